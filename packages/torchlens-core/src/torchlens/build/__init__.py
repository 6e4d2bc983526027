"""Events -> records: the one place labels, passes and the module tree are computed."""

from torchlens.build.builder import build_trace, normalize_type
from torchlens.build.events import (
    ArgRef,
    BufferInfo,
    EventLog,
    ModelInfo,
    ModuleEnter,
    ModuleExit,
    ModuleInfo,
    OpEvent,
    ParamInfo,
    fill_template,
)

__all__ = ["build_trace", "normalize_type", "ArgRef", "BufferInfo", "EventLog", "ModelInfo", "ModuleEnter",
           "ModuleExit", "ModuleInfo", "OpEvent", "ParamInfo", "fill_template"]
