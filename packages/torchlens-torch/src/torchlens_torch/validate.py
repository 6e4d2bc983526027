"""Replay validation of a torch trace.

For each recorded op: (a) call its recorded callable on its saved parent values, parameters
and literals (its argument template) under its recorded RNG state, and compare bit for bit
with the saved output; (b) perturb each floating-point tensor parent in turn and check the
output changes. Parents the output cannot depend on by rule are exempt (shape-only
constructors such as `zeros_like`, the shape argument of `view_as`/`expand_as`/`type_as`,
integer and boolean parents such as indices and masks, receivers that an op overwrites
whole); the exemptions are listed in the decisions, never a blanket skip.
"""

from __future__ import annotations

from typing import Any

import torch

from torchlens.backends.protocol import ValidationStatus
from torchlens.build.events import ArgRef, fill_template

#: callables whose output does not depend on the values of the listed argument positions
#: ("all": of any tensor argument).
_VALUE_INSENSITIVE: dict[str, Any] = {
    "zeros_like": "all", "ones_like": "all", "empty_like": "all", "full_like": "all", "rand_like": "all",
    "randn_like": "all", "randint_like": "all", "new_zeros": "all", "new_ones": "all", "new_empty": "all",
    "new_full": "all", "new_tensor": "all", "isfinite": "all", "isnan": "all", "isinf": "all", "isposinf": "all",
    "isneginf": "all", "size": "all", "zero_": "all", "fill_": (0,), "copy_": (0,), "detach_": (),
    "view_as": (1,), "expand_as": (1,), "reshape_as": (1,), "type_as": (1,), "to": (1,), "new": "all",
}

_PERTURB_TRIES = 3


class ThreadPin:
    """`num_threads=`: pin torch's intra-op threads for a validation run, then restore."""

    def __init__(self, num_threads: int | None) -> None:
        self.n = num_threads
        self.saved: int | None = None

    def __enter__(self) -> "ThreadPin":
        if self.n is not None:
            self.saved = torch.get_num_threads()
            torch.set_num_threads(self.n)
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self.saved is not None:
            torch.set_num_threads(self.saved)
        return False


def _same(a: Any, b: Any) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(a, b) or ((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return bool(torch.equal(a, b))


def _template_indices(template: Any) -> set[int]:
    if isinstance(template, ArgRef):
        return {template.index} if template.address is None else set()
    if type(template) in (tuple, list):
        return set().union(*(_template_indices(t) for t in template)) if template else set()
    if type(template) is dict:
        return set().union(*(_template_indices(t) for t in template.values())) if template else set()
    return set()


def _outs(op: Any, out: Any, args: tuple) -> tuple:
    if op.func_name == "__setitem__":
        return (args[0],)
    if op.multi_output:
        return tuple(out)
    return (out,)


class _Replayer:
    def __init__(self, trace: Any) -> None:
        self.trace = trace
        self.ev2op = {o.event_id: o for o in trace._ops.values()}
        # replay in the capture's grad mode: some kernels (LSTM) take other paths without grad
        self.grad = not bool(getattr(trace.options, "inference_only", False))

    def parent_value(self, op: Any, ref: ArgRef) -> Any:
        if ref.address is not None:
            rec = self.trace._params.get(ref.address) or self.trace._buffers.get(ref.address)
            return None if rec is None else rec.value
        eid, slot = op.parent_slots[ref.index]
        parent = self.ev2op[eid]
        if not parent.saved:
            return None
        v = parent.outs[slot]
        if self.grad and isinstance(v, torch.Tensor) and not v.requires_grad and v.is_floating_point():
            rg = parent.meta.get("requires_grad")
            if rg is not None and slot < len(rg) and rg[slot]:
                v = v.detach().requires_grad_(True)  # a loaded payload lost its graph: kernels pick paths by it
        return v

    def run(self, op: Any, override: dict[int, Any] | None = None) -> tuple:
        def fill(ref: ArgRef) -> Any:
            if override is not None and ref.address is None and ref.index in override:
                return override[ref.index]
            v = self.parent_value(op, ref)
            return v

        args, kwargs = safe_replay_args(op, fill_template(op.args_template, fill), fill_template(op.kwargs_template or {}, fill))
        state = op.meta.get("rng_state")
        saved_state = torch.get_rng_state()
        try:
            if state is not None:
                torch.set_rng_state(state)
            with torch.set_grad_enabled(self.grad):
                out = op.func(*args, **kwargs)
        finally:
            torch.set_rng_state(saved_state)
        return _outs(op, out, args)


#: ops that write into arguments other than the receiver: positions to clone before replay.
_WRITES_ARGS = {"batch_norm": (1, 2), "instance_norm": (1, 2)}


def safe_replay_args(op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Arguments a replay may run on without writing into saved payloads or parameters."""
    args = tuple(args)
    if op.is_inplace and args and isinstance(args[0], torch.Tensor):
        args = (args[0].clone(),) + args[1:]
    for pos in _WRITES_ARGS.get(op.func_name, ()):
        if pos < len(args) and isinstance(args[pos], torch.Tensor):
            args = args[:pos] + (args[pos].clone(),) + args[pos + 1:]
    for k in ("running_mean", "running_var", "out"):
        if isinstance(kwargs.get(k), torch.Tensor):
            kwargs = {**kwargs, k: kwargs[k].clone()}
    return args, kwargs


def _training_flag(op: Any) -> bool:
    t = op.args_template
    if len(t) > 5 and isinstance(t[5], bool):
        return t[5]
    return bool((op.kwargs_template or {}).get("training", False))


def _exempt_positions(op: Any) -> Any:
    rule = _VALUE_INSENSITIVE.get(op.func_name)
    if rule == "all":
        return "all"
    exempt: set[int] = set()
    if rule:
        for pos in rule:
            if pos < len(op.args_template) and isinstance(op.args_template[pos], ArgRef):
                if op.args_template[pos].address is None:
                    exempt.add(op.args_template[pos].index)
    if op.func_name in _WRITES_ARGS and _training_flag(op):
        for pos in _WRITES_ARGS[op.func_name]:  # train mode normalises with batch statistics
            ref = op.args_template[pos] if pos < len(op.args_template) else None
            if isinstance(ref, ArgRef) and ref.address is None:
                exempt.add(ref.index)
    if op.func_name == "__setitem__" or (op.is_inplace and op.func_name in ("copy_", "fill_", "zero_")):
        first = op.args_template[0] if op.args_template else None
        if isinstance(first, ArgRef) and first.address is None:
            exempt.add(first.index)  # the receiver may be overwritten whole
    return exempt


def _perturbed(v: torch.Tensor, k: int) -> torch.Tensor:
    g = torch.Generator(device=v.device).manual_seed(1234 + k)
    scale = float(v.detach().abs().max()) + 1.0 if v.numel() else 1.0
    return (v.detach() + torch.randn(v.shape, generator=g, dtype=v.dtype, device=v.device) * scale).to(v.dtype)


def validate_trace(trace: Any, **_: Any) -> ValidationStatus:
    from torchlens.intervention.params import changed_params, param_addresses
    from torchlens.io.opaque import refuse_opaque

    refuse_opaque(trace, trace._ops.values())  # an op loaded as opaque refuses before any op runs
    rp = _Replayer(trace)
    decisions: list[dict[str, Any]] = []
    counts: dict[str, int] = {}

    def fail(op: Any, reason: str, detail: str) -> ValidationStatus:
        decisions.append({"op": op.label, "ok": False, "reason": reason, "detail": detail})
        counts[reason] = counts.get(reason, 0) + 1
        return ValidationStatus(False, op.label, reason, decisions, counts, detail)

    from torchlens.viz.progress import progress

    for op in progress(trace._ops.values(), total=len(trace._ops), desc="validate"):
        if op.kind == "output":
            parent = rp.ev2op.get(op.parent_slots[0][0]) if op.parent_slots else None
            if parent is None:
                return fail(op, "capture_inconsistent", "an output op has no producer")
            if op.saved and parent.saved and not _same(op.out, parent.outs[op.parent_slots[0][1]]):
                return fail(op, "replay_mismatch", f"{op.label} differs from its producer {parent.label}")
            continue
        if op.kind in ("input", "buffer", "constant"):
            decisions.append({"op": op.label, "ok": True, "reason": "constant_producer_leaf" if op.kind == "constant" else None})
            continue
        if op.func is None or op.args_template is None or not callable(op.func):
            return fail(op, "no_replayable_function", f"{op.label} has no recorded callable and arguments")
        used = _template_indices(op.args_template) | _template_indices(op.kwargs_template or {})
        if used != set(range(len(op.parent_slots))):
            return fail(op, "arg_logging_mismatch",
                        f"{op.label}'s argument template reads parents {sorted(used)}, the graph records {len(op.parent_slots)}")
        if not op.saved:
            return fail(op, "parent_payload_missing", f"{op.label}'s own output was not saved")
        for eid, _slot in op.parent_slots:
            p = rp.ev2op.get(eid)
            if p is None or not p.saved:
                return fail(op, "parent_payload_missing", f"the saved value of a parent of {op.label} is missing")
        moved = changed_params(trace, [a for a in param_addresses(op) if a in trace._params])
        if moved:  # the cause, not a bare replay_mismatch: the weights changed after capture
            status = fail(op, "replay_param_changed_since_capture",
                          f"{op.label} reads parameter {moved[0]!r}, which changed since capture (optimizer step, "
                          "load_state_dict or an in-place write); capture again to validate the current weights")
            decisions[-1]["param"] = moved[0]
            return status
        try:
            got = rp.run(op)
        except Exception as exc:  # the recorded call does not re-execute
            return fail(op, "replay_execution_exception", f"{type(exc).__name__}: {exc}")
        want = op.outs
        if len(got) != len(want) or not all(_same(g, w) for g, w in zip(got, want) if w is not None or g is not None):
            return fail(op, "replay_mismatch", f"re-executing {op.func_name} did not reproduce {op.label}")
        exempt = _exempt_positions(op)
        perturbed_ok = []
        if exempt != "all":
            for idx, (eid, slot) in enumerate(op.parent_slots):
                if idx in exempt:
                    continue
                parent = rp.ev2op[eid]
                v = parent.outs[slot]
                if not isinstance(v, torch.Tensor) or not (v.is_floating_point() or v.is_complex()) or v.numel() == 0:
                    continue  # integer / boolean parents (indices, masks) are exempt by rule
                if all(o is None or (isinstance(o, torch.Tensor) and o.numel() == 0) for o in want):
                    continue
                moved = False
                for k in range(_PERTURB_TRIES):
                    try:
                        alt = rp.run(op, {idx: _perturbed(v, k)})
                    except Exception:
                        moved = True  # a perturbed value the op rejects still shows a dependence
                        break
                    if not all(_same(a, w) for a, w in zip(alt, want)):
                        moved = True
                        break
                if not moved:
                    if parent.kind == "constant":
                        counts["constant_parent_payload"] = counts.get("constant_parent_payload", 0) + 1
                        continue
                    return fail(op, "perturbation_insensitive",
                                f"perturbing parent {parent.label} did not change {op.label}")
                perturbed_ok.append(parent.label)
        decisions.append({"op": op.label, "ok": True, "reason": None, "perturbed": perturbed_ok,
                          "exempt": "all" if exempt == "all" else sorted(exempt)})
    return ValidationStatus(True, decisions=decisions, reason_counts=counts)
