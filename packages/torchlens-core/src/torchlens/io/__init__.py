"""Persistence: `.tlspec` save/load, payload codecs, format detection, safetensors export.

`trace.save(path)` writes a `.tlspec` directory (saved format 3); `tl.load(path)` reads it
back after checking all of it. Payloads travel through the backend's `PayloadCodec`
(`backend.payload_codec()`, core's `NumpyCodec` otherwise); nothing is ever pickled.
"""

from __future__ import annotations

from torchlens.io.bundle import load, save
from torchlens.io.codec import DTYPE_ITEMSIZE, EncodedPayload, NumpyCodec, PayloadCodec, backend_codec
from torchlens.io.compare import trace_differences
from torchlens.io.detect import detect_tlspec_format
from torchlens.io.intervention import InterventionSpec, load_intervention_spec, save_intervention
from torchlens.io.manifest import FORMAT_VERSION
from torchlens.io.trace_safetensors import SafetensorsTrace, read_safetensors, write_safetensors

__all__ = ["save", "load", "detect_tlspec_format", "read_safetensors", "write_safetensors", "SafetensorsTrace",
           "PayloadCodec", "EncodedPayload", "NumpyCodec", "DTYPE_ITEMSIZE", "backend_codec", "trace_differences",
           "FORMAT_VERSION", "save_intervention", "load_intervention_spec", "InterventionSpec"]


def __getattr__(name: str):
    # `tl.io.attach_sidecar` (spec name) lives with the bundle's token-stream bindings; imported
    # lazily because the bundle layer sits above io.
    if name == "attach_sidecar":
        from torchlens.bundle.binding import attach_sidecar

        return attach_sidecar
    raise AttributeError(f"module 'torchlens.io' has no attribute {name!r}")
