"""The one per-op replay engine: re-execute a recorded op on values filled into its argument
template, for validation, interventions and every other verb that re-runs recorded ops.

An op records its callable (`op.func`) and an argument template (`op.args_template`,
`op.kwargs_template`) in which `ArgRef`s stand for its parents (by parent index) and for the
parameters and buffers it read (by address). `Replayer.run` fills the template (parents from
edited values, an override, or the saved payloads; parameters and buffers from the trace),
lets the backend protect what the call may write into (`replay_args`), restores the op's
recorded RNG state (`rng_state`) and calls it (`call`). Nothing in this module imports a
framework: the backend supplies those steps and its comparison rule through a `ReplayOps`
object (`ReplayOpsBase` holds the defaults).

- Validation (`validate`): every op re-executed from its parents' saved payloads and
  compared with its own saved payload (`ReplayOps.compare`), each failure named with a reason
  from `tl.backends.VALIDATION_REASONS`; a backend adds its own per-op checks (torch's
  perturbation rules) through `extra_check`.
- Interventions (`torchlens.intervention.replay`): the downstream cone of an edit re-executed
  on the edited values (`changed=`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable

import numpy as np

from torchlens.build.events import ArgRef, fill_template


class ReplayFailure(Exception):
    """An op cannot be re-executed: `kind` is "payload_missing" (a parent's saved value, named
    by `label`), "param_missing" (a parameter or buffer the trace does not hold, `address`) or
    "template_missing" (no recorded callable and arguments). Callers turn it into their own
    typed error (a validation reason, an intervention code)."""

    def __init__(self, kind: str, op: Any, detail: str, *, label: str | None = None, address: str | None = None) -> None:
        super().__init__(detail)
        self.kind = kind
        self.op = op
        self.detail = detail
        self.label = label
        self.address = address


class ReplayOpsBase:
    """Defaults for the backend's side of the replay engine (`tl.backends.ReplayOps`): a
    backend subclasses it and overrides what its framework needs. Every member has a default;
    an `EditOps` that does not subclass it is read through `replay_ops_from` (its
    `replay_args` and `rng_state`)."""

    def replay_args(self, op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Arguments the call may run on without writing into saved payloads or parameters."""
        return args, kwargs

    def rng_state(self, state: Any) -> Any:
        """A context manager that runs the call under the op's recorded RNG state."""
        return contextlib.nullcontext()

    def parent_value(self, op: Any, ref: ArgRef, value: Any) -> Any:
        """The value handed to the call for parent `ref` (a saved or edited payload)."""
        return value

    def call(self, op: Any, args: tuple, kwargs: dict) -> Any:
        """Call the recorded callable (the raw return value; `outputs` splits it)."""
        return op.func(*args, **kwargs)

    def outputs(self, op: Any, out: Any, args: tuple) -> tuple:
        """The call's output slots: an in-place op that returns None (and `__setitem__`)
        produced its receiver; a multi-output op's return value is its slots."""
        if op.func_name == "__setitem__" or (op.is_inplace and out is None):
            return (args[0],)
        if op.multi_output:
            return tuple(out)
        return (out,)

    def equal(self, a: Any, b: Any) -> bool:
        """Bit-for-bit equality of two values (shape, dtype and every element; NaN equals NaN)."""
        if a is None or b is None:
            return a is b
        ha, hb = np.asarray(a), np.asarray(b)
        if ha.shape != hb.shape or ha.dtype != hb.dtype:
            return False
        return bool(np.array_equal(ha, hb, equal_nan=ha.dtype.kind in "fc"))

    def compare(self, trace: Any, op: Any, got: tuple, want: tuple) -> tuple[str | None, str, dict[str, Any]]:
        """(failure reason or None, detail, fields for the op's decision): the replayed slots
        against the saved ones. The default is bit-for-bit equality of every slot."""
        if len(got) != len(want):
            return "capture_inconsistent", f"replaying {op.label} produced {len(got)} outputs, the capture {len(want)}", {}
        if not all(self.equal(g, w) for g, w in zip(got, want) if g is not None or w is not None):
            return "replay_mismatch", f"re-executing {op.func_name} did not reproduce {op.label}", {}
        return None, "", {}

    def preflight(self, trace: Any) -> None:
        """Backend refusals raised before validation runs any op (nothing by default)."""
        return None


_DEFAULT = ReplayOpsBase()


class _FromEditOps(ReplayOpsBase):
    """The `ReplayOps` of a backend's `EditOps` that is not a `ReplayOpsBase`: its
    `replay_args` and `rng_state` (members of `tl.backends.EditOps`, checked at registration)
    and the defaults for the rest."""

    def __init__(self, edit_ops: Any) -> None:
        self.edit_ops = edit_ops

    def replay_args(self, op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self.edit_ops.replay_args(op, args, kwargs)

    def rng_state(self, state: Any) -> Any:
        return self.edit_ops.rng_state(state)


def replay_ops_from(ops: Any) -> ReplayOpsBase:
    """The `ReplayOps` for `ops`: itself when it is a `ReplayOpsBase` (a backend overrides the
    members it needs by subclassing it), the defaults for None, else `ops` read as an
    `EditOps` (its `replay_args` and `rng_state`, the defaults for the rest)."""
    if ops is None:
        return _DEFAULT
    if isinstance(ops, ReplayOpsBase):
        return ops
    return _FromEditOps(ops)


def call_op(ops: ReplayOpsBase, op: Any, args: tuple, kwargs: dict) -> tuple:
    """The one place a recorded op is re-executed: under its recorded RNG state, through the
    backend's `call`, split into output slots."""
    with ops.rng_state(op.meta.get("rng_state")):
        out = ops.call(op, args, kwargs)
    return ops.outputs(op, out, args)


class Replayer:
    """Re-executes ops of one trace (see the module docstring)."""

    def __init__(self, trace: Any, ops: Any = None) -> None:
        self.trace = trace
        self.ops = replay_ops_from(ops)
        self.ev2op = {o.event_id: o for o in trace._ops.values()}

    def saved(self, op: Any) -> tuple:
        """`op`'s saved output slots, or `ReplayFailure("payload_missing")`."""
        if not op.saved:
            raise ReplayFailure("payload_missing", op, f"replay needs the saved value of {op.label}", label=op.label)
        return op.outs

    def param(self, op: Any, address: str) -> Any:
        rec = self.trace._params.get(address) or self.trace._buffers.get(address)
        if rec is None or rec.value is None:
            raise ReplayFailure("param_missing", op, f"{op.label} reads {address}, which the trace does not hold",
                                address=address)
        return rec.value

    def value(self, op: Any, ref: ArgRef, changed: dict[str, tuple] | None = None) -> Any:
        """The value `ref` of `op`'s template stands for: a parameter or buffer, or the parent's
        output slot (edited, in `changed` by label, else saved)."""
        if ref.address is not None:
            return self.param(op, ref.address)
        eid, slot = op.parent_slots[ref.index]
        parent = self.ev2op[eid]
        outs = changed.get(parent.label) if changed else None
        if outs is None:
            outs = self.saved(parent)
        return self.ops.parent_value(op, ref, outs[slot])

    def run(self, op: Any, override: dict[Any, Any] | None = None, changed: dict[str, tuple] | None = None,
            protect: bool = True) -> tuple:
        """Re-execute `op`; returns its output slots. `override` replaces parents (by parent
        index) or parameters and buffers (by address); `changed` holds edited parent outputs
        (by label). `protect=False` skips the backend's `replay_args` (the copies that keep a
        call from writing into saved payloads or parameters): for a caller whose values are
        all its own, where an in-place write must land as it did in the forward (a runnable
        artifact's run). Raises `ReplayFailure` for a missing piece; the call's own exception
        propagates unchanged."""
        if op.func is None or op.args_template is None:
            raise ReplayFailure("template_missing", op, f"{op.label} ({op.func_name}) has no recorded callable and arguments")

        def fill(ref: ArgRef) -> Any:
            if override:
                key = ref.index if ref.address is None else ref.address
                if key in override:
                    return override[key]
            return self.value(op, ref, changed)

        args = fill_template(op.args_template, fill)
        kwargs = fill_template(op.kwargs_template or {}, fill)
        if protect:
            args, kwargs = self.ops.replay_args(op, tuple(args), dict(kwargs))
        return call_op(self.ops, op, tuple(args), dict(kwargs))


# validation --------------------------------------------------------------------------------


def _template_indices(template: Any) -> set[int]:
    if isinstance(template, ArgRef):
        return {template.index} if template.address is None else set()
    if type(template) in (tuple, list):
        return set().union(*(_template_indices(t) for t in template)) if template else set()
    if type(template) is dict:
        return set().union(*(_template_indices(t) for t in template.values())) if template else set()
    return set()


def _unencodable(template: Any) -> Any:
    """The first `tl.types.UnencodableValue` stand-in in a loaded argument template, or None."""
    from torchlens.types import UnencodableValue

    if isinstance(template, UnencodableValue):
        return template
    items = template.values() if type(template) is dict else template if type(template) in (tuple, list) else ()
    for t in items:
        found = _unencodable(t)
        if found is not None:
            return found
    return None


class Validation:
    """One validation run: the replayer, a decision per op and reason counts. Every op is
    checked; the status names the first failure and counts them all."""

    def __init__(self, trace: Any, ops: Any) -> None:
        self.trace = trace
        self.engine = Replayer(trace, ops)
        self.decisions: list[dict[str, Any]] = []
        self.counts: dict[str, int] = {}
        self.first: dict[str, Any] | None = None

    def count(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1

    def fail(self, op: Any, reason: str, detail: str, **extra: Any) -> None:
        d = {"op": op.label, "ok": False, "reason": reason, "detail": detail, **extra}
        self.decisions.append(d)
        self.count(reason)
        if self.first is None:
            self.first = d

    def status(self) -> Any:
        from torchlens.backends.protocol import ValidationStatus

        if self.first is None:
            return ValidationStatus(True, decisions=self.decisions, reason_counts=self.counts)
        f = self.first
        return ValidationStatus(False, f["op"], f["reason"], self.decisions, self.counts, f["detail"])

    def check(self, op: Any, extra_check: Callable[..., Any] | None = None) -> None:
        """Check one op; appends its decision."""
        ev2op, ops = self.engine.ev2op, self.engine.ops
        if op.kind == "output":
            parent = ev2op.get(op.parent_slots[0][0]) if op.parent_slots else None
            if parent is None:
                return self.fail(op, "capture_inconsistent", "an output op has no producer")
            if op.saved and parent.saved and not ops.equal(op.out, parent.outs[op.parent_slots[0][1]]):
                return self.fail(op, "replay_mismatch", f"{op.label} differs from its producer {parent.label}")
            self.decisions.append({"op": op.label, "ok": True, "reason": None})
            return None
        if op.kind in ("input", "buffer") or (op.kind == "constant" and not callable(op.func)):
            if op.kind == "constant":  # read from its saved payload: counted as exempted
                self.count("constant_producer_leaf")
            self.decisions.append({"op": op.label, "ok": True,
                                   "reason": "constant_producer_leaf" if op.kind == "constant" else None})
            return None
        if op.func is None or op.args_template is None or not callable(op.func):
            return self.fail(op, "no_replayable_function", f"{op.label} has no recorded callable and arguments")
        used = _template_indices(op.args_template) | _template_indices(op.kwargs_template or {})
        if used != set(range(len(op.parent_slots))):
            return self.fail(op, "arg_logging_mismatch", f"{op.label}'s argument template reads parents "
                                                         f"{sorted(used)}, the graph records {len(op.parent_slots)}")
        if not op.saved:
            return self.fail(op, "parent_payload_missing", f"{op.label}'s own output was not saved")
        lost = _unencodable(op.args_template) or _unencodable(op.kwargs_template or {})
        if lost is not None:  # a loaded argument that had no encoding: the call cannot be rebuilt
            return self.fail(op, "missing_saved_args", f"{op.label}'s argument {lost.at} ({lost.type_name}) was "
                             "saved as text (it has no portable encoding), so the call cannot be replayed")
        for eid, _slot in op.parent_slots:
            p = ev2op.get(eid)
            if p is None or not p.saved:
                return self.fail(op, "parent_payload_missing", f"the saved value of a parent of {op.label} is missing")
        from torchlens.replay.params import changed_params, param_addresses

        addresses = param_addresses(op)
        for a in addresses:
            rec = self.trace._params.get(a) or self.trace._buffers.get(a)
            if rec is None or rec.value is None:
                return self.fail(op, "parent_payload_missing", f"{op.label} reads {a}, which has no saved value")
        moved = changed_params(self.trace, [a for a in addresses if a in self.trace._params])
        if moved:  # the cause, not a bare replay_mismatch: the weights changed after capture
            return self.fail(op, "replay_param_changed_since_capture",
                             f"{op.label} reads parameter {moved[0]!r}, which changed since capture (optimizer "
                             "step, load_state_dict or an in-place write); capture again to validate the current "
                             "weights", param=moved[0])
        try:
            got = self.engine.run(op)
        except Exception as exc:  # the recorded call does not re-execute
            return self.fail(op, "replay_execution_exception", f"{type(exc).__name__}: {exc}")
        reason, detail, record = ops.compare(self.trace, op, got, op.outs)
        if reason is not None:
            return self.fail(op, reason, detail, **record)
        decision: dict[str, Any] = {"op": op.label, "ok": True, "reason": None, **record}
        if extra_check is not None:
            failed = extra_check(self, op, got, decision)
            if failed is not None:
                reason, detail, extra = failed
                return self.fail(op, reason, detail, **extra)
        self.decisions.append(decision)
        return None


def validate(trace: Any, ops: Any = None, *, extra_check: Callable[..., Any] | None = None,
             ground_truth: Iterable[Any] | None = None) -> Any:
    """Replay every op of `trace` from its parents' saved payloads and compare with its own
    (module docstring); returns a `ValidationStatus`. Opaque ops (`opaque_op_not_replayable`),
    ops the capture marked as not re-executable (`validation_unavailable`) and the backend's
    `preflight` refuse before any op runs. `extra_check(validation, op, got, decision)`
    returns None or (reason, detail, extra fields) for a replayed op that matched;
    `ground_truth` (the model's own output leaves) is compared with the output ops."""
    from torchlens.replay.preconditions import refuse_unreplayable
    from torchlens.io.opaque import refuse_opaque
    from torchlens.viz.progress import progress

    all_ops = list(trace._ops.values())
    refuse_opaque(trace, all_ops)  # an op loaded as opaque refuses before any op runs
    refuse_unreplayable(trace, all_ops, validating=True)  # e.g. torch.autograd.grad in the forward
    v = Validation(trace, ops)
    v.engine.ops.preflight(trace)
    for op in progress(all_ops, total=len(all_ops), desc="validate"):
        v.check(op, extra_check)
    if ground_truth is not None:
        truth = list(ground_truth)
        outs = [o for o in all_ops if o.kind == "output"]
        if len(truth) != len(outs):
            v.fail(outs[0] if outs else all_ops[0], "capture_inconsistent",
                   f"the ground truth has {len(truth)} outputs, the trace {len(outs)}")
        else:
            for t, op in zip(truth, outs):
                if op.saved and not v.engine.ops.equal(t, op.outs[0]):
                    v.fail(op, "replay_mismatch", f"{op.label} differs from the model's own output")
    return v.status()


__all__ = ["ReplayFailure", "ReplayOpsBase", "Replayer", "Validation", "call_op", "replay_ops_from", "validate"]
