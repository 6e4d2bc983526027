"""`trace.using("mechinterp")`: the kit's functions bound to one trace.

`trace.using("mechinterp").residual_decomposition()` returns exactly what
`torchlens.mechinterp.residual_decomposition(trace)` returns: every kit function whose first
parameter is the trace is served with the trace filled in.
"""

from __future__ import annotations

from typing import Any


class MechInterpAppliance:
    __slots__ = ("trace",)

    def __init__(self, trace: Any) -> None:
        self.trace = trace

    def __getattr__(self, name: str) -> Any:
        import functools

        import torchlens_mechinterp as kit

        if name.startswith("_") or name not in kit.TRACE_FUNCTIONS:
            raise AttributeError(f"the mechinterp appliance has no trace function {name!r}; "
                                 f"trace functions: {', '.join(sorted(kit.TRACE_FUNCTIONS))}")
        return functools.partial(getattr(kit, name), self.trace)

    def __dir__(self) -> list[str]:
        import torchlens_mechinterp as kit

        return sorted(kit.TRACE_FUNCTIONS)

    def __repr__(self) -> str:
        return f"<mechinterp appliance bound to {self.trace!r}>"


def bind(trace: Any) -> MechInterpAppliance:
    return MechInterpAppliance(trace)
