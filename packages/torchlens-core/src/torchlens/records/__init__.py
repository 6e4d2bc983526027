"""Graph records: Trace, Op, Layer, Module, ModuleCall, Param, Buffer and their accessors."""

from torchlens.records.module import Buffer, Module, ModuleCall, Param
from torchlens.records.op import Layer, Op
from torchlens.records.trace import Cost, Provenance, Trace

__all__ = ["Trace", "Op", "Layer", "Module", "ModuleCall", "Param", "Buffer", "Provenance", "Cost"]
