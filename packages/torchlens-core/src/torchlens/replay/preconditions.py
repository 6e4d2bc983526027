"""What a replay must check about the recorded graph itself before and while it re-executes ops.

A capture records two facts a replay of recorded ops cannot reproduce on its own:

- `op.meta["replay_unsupported"]`: the op cannot be re-executed from its recorded arguments
  (`torch.autograd.grad` inside the forward needs the autograd graph of the forward that ran;
  a write through a view of a base whose layout a replayed copy does not keep). Replay and
  validation refuse such an op before anything runs (`refuse_unreplayable`).
- `op.meta["value_reads"]`: `(slot, read)` pairs, each a read of the op's output back into
  Python (`.item()`, `.tolist()`, `int(t)`, `float(t)`, a branch on `bool(t)`). A shape,
  index or branch of the forward may have been computed from what it read (Mask R-CNN's mask
  sizes). Replay reuses every recorded literal, so when an edit changes what such a read
  gives, the ops after it may no longer be the ones the forward would run: the replay
  refuses (`check_value_reads`, called on each recomputed op before anything is written).
  The rerun engine (`model=`, `inputs=`) runs the forward again and is the remedy.

The reads are evaluated with Python's own conversions on the values (framework-neutral).
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Iterable

from torchlens.errors import ReplayPreconditionError, TorchLensError

_READS: dict[str, Callable[[Any], Any]] = {
    "item": lambda v: v.item(),
    "tolist": lambda v: v.tolist(),
    "__int__": int,
    "__index__": operator.index,
    "__float__": float,
    "__bool__": bool,
    "__complex__": complex,
}

_WHY = {
    "autograd_grad": "torch.autograd.grad inside the forward needs the forward's autograd graph, which a replay "
                     "from saved values does not have",
    "view_write_base_layout": "a write through a view of a non-contiguous base is not recomputed from saved values",
}


def refuse_unreplayable(trace: Any, ops: Iterable[Any], *, validating: bool = False) -> None:
    """Raise for the first op among `ops` that the capture marked as not re-executable
    (`replay_op_unsupported`, or `validation_unavailable` when `validating`)."""
    for op in ops:
        meta = getattr(op, "meta", None) or {}
        reason = meta.get("replay_unsupported")
        if not reason:
            continue
        why = _WHY.get(reason, str(reason))
        if validating:
            from torchlens.errors import ValidationError

            raise ValidationError("validation_unavailable", f"{op.label} ({op.func_name}) cannot be replayed: {why}",
                                  remedy="the other ops still hold their captured values; validate a trace of the "
                                         "model without this op, or compare against a second capture",
                                  label=op.label, reason=str(reason))
        raise ReplayPreconditionError("replay_op_unsupported",
                                      f"{op.label} ({op.func_name}) is in the edit's downstream cone and cannot be "
                                      f"re-executed: {why}; nothing was changed",
                                      remedy="use the rerun engine: trace.do(site, edit, model=model, inputs=x)",
                                      label=op.label, reason=str(reason))


def _read(value: Any, name: str) -> tuple[bool, Any]:
    fn = _READS.get(name)
    if fn is None:
        return False, None
    try:
        return True, fn(value)
    except (TypeError, ValueError, RuntimeError, IndexError, OverflowError, TorchLensError):
        return False, None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def check_value_reads(op: Any, new_outs: tuple) -> None:
    """Before a replay keeps `new_outs` as `op`'s value: every read the forward made of the
    op's output must give what it gave at capture, else `replay_value_read_changed`."""
    reads = (getattr(op, "meta", None) or {}).get("value_reads")
    if not reads:
        return
    old = op._outputs if op.saved else None
    for slot, name in reads:
        changed = True
        if old is not None and 0 <= slot < len(old) and 0 <= slot < len(new_outs):
            ok_old, before = _read(old[slot], name)
            ok_new, after = _read(new_outs[slot], name)
            changed = not (ok_old and ok_new and _same(before, after))
            if not ok_old and not ok_new:
                changed = True
        if changed:
            raise ReplayPreconditionError(
                "replay_value_read_changed",
                f"the forward read {op.label}'s value into Python ({name}) and the edit changes it: a shape, index or "
                "branch computed from it at capture may no longer hold, so replaying past it could be wrong; nothing "
                "was changed",
                remedy="use the rerun engine, which runs the forward again: trace.do(site, edit, model=model, inputs=x)",
                label=op.label, read=name, slot=slot)


__all__ = ["refuse_unreplayable", "check_value_reads"]
