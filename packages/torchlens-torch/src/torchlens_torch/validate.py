"""Replay validation of a torch trace.

For each recorded op: (a) call its recorded callable on its saved parent values, parameters
and literals (its argument template) under its recorded RNG state, and compare with the
saved output (bit for bit, unless a rule of `validate_rules.comparison` says otherwise:
uninitialised memory by shape and dtype, a compiled region within a dtype tolerance);
(b) perturb each floating-point tensor parent in turn and check the output changes.
Parents the output cannot depend on by rule are exempt (shape-only constructors such as
`zeros_like`, the shape argument of `view_as`/`expand_as`/`type_as`, integer and boolean
parents such as indices and masks, receivers that an op overwrites whole, constant
parents, which are skipped while the op's other parents are still perturbed); a parent
that does not move the output is excused only by a rule the values prove (another operand
pins it: `zero_factor`, `constant_mask`, `saturating_operand`; a discrete output:
`discrete_output`). Every exemption is in the op's decision with its rule and why, never a
blanket skip. Every op is checked: the status names the first failure and counts them all.
"""

from __future__ import annotations

from typing import Any

import torch

from torchlens.backends.sdk import ValidationStatus, ArgRef, fill_template
from torchlens_torch import validate_rules as R

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

    def run(self, op: Any, override: dict[Any, Any] | None = None) -> tuple:
        """Re-execute `op` on its saved values; `override` replaces parents (by parent
        index) or parameters and buffers (by address)."""
        def fill(ref: ArgRef) -> Any:
            if override is not None:
                key = ref.index if ref.address is None else ref.address
                if key in override:
                    return override[key]
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


def _tensor_refs(template: Any) -> list[ArgRef]:
    """Every ArgRef of a template, in order (parents and parameter/buffer addresses)."""
    if isinstance(template, ArgRef):
        return [template]
    if type(template) in (tuple, list):
        return [r for t in template for r in _tensor_refs(t)]
    if type(template) is dict:
        return [r for t in template.values() for r in _tensor_refs(t)]
    return []


def _unencodable(template: Any) -> Any:
    """The first `tl.types.UnencodableValue` stand-in in a loaded argument template, or None."""
    from torchlens.backends.sdk import UnencodableValue

    if isinstance(template, UnencodableValue):
        return template
    items = template.values() if type(template) is dict else template if type(template) in (tuple, list) else ()
    for t in items:
        found = _unencodable(t)
        if found is not None:
            return found
    return None


class _Checker:
    """Checks one trace op by op, collecting a decision per op (every op is checked)."""

    def __init__(self, trace: Any) -> None:
        self.trace = trace
        self.rp = _Replayer(trace)
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

    def status(self) -> ValidationStatus:
        if self.first is None:
            return ValidationStatus(True, decisions=self.decisions, reason_counts=self.counts)
        f = self.first
        return ValidationStatus(False, f["op"], f["reason"], self.decisions, self.counts, f["detail"])

    # one op ------------------------------------------------------------------------------
    def check(self, op: Any) -> None:
        rp, trace = self.rp, self.trace
        if op.kind == "output":
            parent = rp.ev2op.get(op.parent_slots[0][0]) if op.parent_slots else None
            if parent is None:
                return self.fail(op, "capture_inconsistent", "an output op has no producer")
            if op.saved and parent.saved and not R.same_bits(op.out, parent.outs[op.parent_slots[0][1]]):
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
            p = rp.ev2op.get(eid)
            if p is None or not p.saved:
                return self.fail(op, "parent_payload_missing", f"the saved value of a parent of {op.label} is missing")
        from torchlens.backends.sdk import changed_params, param_addresses

        moved = changed_params(trace, [a for a in param_addresses(op) if a in trace._params])
        if moved:  # the cause, not a bare replay_mismatch: the weights changed after capture
            return self.fail(op, "replay_param_changed_since_capture",
                             f"{op.label} reads parameter {moved[0]!r}, which changed since capture (optimizer "
                             "step, load_state_dict or an in-place write); capture again to validate the current "
                             "weights", param=moved[0])
        try:
            got = rp.run(op)
        except Exception as exc:  # the recorded call does not re-execute
            return self.fail(op, "replay_execution_exception", f"{type(exc).__name__}: {exc}")
        want = op.outs
        mode, compare, record = R.comparison(trace, op)
        if len(got) != len(want) or not all(compare(g, w) for g, w in zip(got, want) if w is not None or g is not None):
            if mode == "tolerance" and len(got) == len(want) and all(R.same_meta(g, w) for g, w in zip(got, want)):
                return self.fail(op, "dtype_tolerance_exceeded", f"re-executing {op.func_name} eagerly differs from "
                                 f"{op.label} by more than {R.COMPILED_ULPS} epsilons", compared=mode, **record)
            return self.fail(op, "replay_mismatch", f"re-executing {op.func_name} did not reproduce {op.label}")
        decision: dict[str, Any] = {"op": op.label, "ok": True, "reason": None}
        if mode != "bits":
            decision.update(compared=mode, **record)
            if mode == "tolerance":
                decision["bit_exact"] = all(R.same_bits(g, w) for g, w in zip(got, want))
        exempt = _exempt_positions(op)
        if exempt == "all" or mode == "shape_dtype":
            decision.update(perturbed=[], exempt="all")
            self.decisions.append(decision)
            return None
        perturbed, constants, exemptions = [], [], []
        for idx, (eid, slot) in enumerate(op.parent_slots):
            if idx in exempt:
                continue
            parent = rp.ev2op[eid]
            if parent.kind == "constant":  # skipped; the op's other parents are still perturbed
                constants.append(parent.label)
                self.count("constant_parent_payload")
                continue
            v = parent.outs[slot]
            if not isinstance(v, torch.Tensor) or not (v.is_floating_point() or v.is_complex()) or v.numel() == 0:
                continue  # integer / boolean parents (indices, masks) are exempt by rule
            if all(o is None or (isinstance(o, torch.Tensor) and o.numel() == 0) for o in want):
                continue
            if self.moves(op, {idx: None}, got, v, idx):
                perturbed.append(parent.label)
                continue
            excuse = self.excuse(op, idx, parent, v, got)
            if excuse is None:
                return self.fail(op, "perturbation_insensitive", f"perturbing parent {parent.label} did not change "
                                 f"{op.label}, and no other operand explains it")
            exemptions.append(excuse)
        decision.update(perturbed=perturbed, exempt=sorted(exempt))
        if constants:
            decision["constant_parent_payload"] = constants
        if exemptions:
            decision["exemptions"] = exemptions
        self.decisions.append(decision)
        return None

    # perturbation --------------------------------------------------------------------------
    def moves(self, op: Any, base: dict[Any, Any], ref: tuple, v: torch.Tensor, idx: int,
              values: list[torch.Tensor] | None = None) -> bool:
        """Does replacing parent `idx` (by perturbations of `v`, or `values`) change the
        output, all else as in `base` (whose `None` entry is the parent being moved)?"""
        tries = values if values is not None else [_perturbed(v, k) for k in range(_PERTURB_TRIES)]
        for alt_value in tries:
            override = {k: val for k, val in base.items() if val is not None}
            override[idx] = alt_value
            try:
                alt = self.rp.run(op, override)
            except Exception:
                return True  # a perturbed value the op rejects still shows a dependence
            if len(alt) != len(ref) or not all(R.same_bits(a, r) for a, r in zip(alt, ref)):
                return True
        return False

    def excuse(self, op: Any, idx: int, parent: Any, v: torch.Tensor, got: tuple) -> dict[str, Any] | None:
        """The rule under which parent `idx` legitimately does not move `op`, or None."""
        if R.is_discrete(got):
            moved_by = next((name for name, p in R.probes(v) if self.moves(op, {}, got, v, idx, [p])), None)
            return {"parent": parent.label, "rule": "discrete_output",
                    "why": f"{op.label}'s output is {got[0].dtype if isinstance(got[0], torch.Tensor) else 'discrete'}:"
                           f" a step function of {parent.label} need not move under a perturbation"
                           + (f" (probing {parent.label} with {moved_by} does move it)" if moved_by else
                              " (no probe moved it either)"),
                    "probe_moved": moved_by}
        saturated = R.saturation_probe(op, v, got)
        if saturated is not None and self.moves(op, {}, got, v, idx, [saturated[0]]):
            return {"parent": parent.label, "rule": "saturated_bound",
                    "why": f"{saturated[1]} ({op.label}); fed a value inside the bounds it does move"}
        rp = self.rp
        structural = R.structural_rule(op, *self._positions(op, idx))
        if structural is not None:
            return {"parent": parent.label, "rule": structural[0], "why": f"{structural[1]} ({op.label})"}
        refs = _tensor_refs(op.args_template) + _tensor_refs(op.kwargs_template or {})
        seen: set[Any] = set()
        for ref in refs:
            key = ref.index if ref.address is None else ref.address
            if key == idx or key in seen:
                continue
            seen.add(key)
            w = rp.parent_value(op, ref) if ref.address is not None else self._parent_out(op, ref.index)
            if not isinstance(w, torch.Tensor) or w.numel() == 0:
                continue
            for k in range(2):
                w2 = R.moved_operand(w, k)
                if w2 is None:
                    break
                try:
                    base = rp.run(op, {key: w2})
                except Exception:
                    continue
                if self.moves(op, {key: w2}, base, v, idx):
                    rule, frag = R.operand_rule(w)
                    name = ref.address if ref.address is not None else self._parent_label(op, ref.index)
                    return {"parent": parent.label, "rule": rule, "operand": name,
                            "why": f"operand {name} {frag}, so {parent.label} cannot move {op.label}; with {name} "
                                   f"moved, perturbing {parent.label} does change it"}
        return None

    def _positions(self, op: Any, idx: int) -> tuple[int, list[tuple[int, ...] | None]]:
        """(the positional argument parent `idx` fills, or -1; each positional argument's shape)."""
        pos, shapes = -1, []
        for i, r in enumerate(op.args_template):
            v = None
            if isinstance(r, ArgRef):
                v = self.rp.parent_value(op, r) if r.address is not None else self._parent_out(op, r.index)
                if r.address is None and r.index == idx and pos < 0:
                    pos = i
            shapes.append(tuple(v.shape) if isinstance(v, torch.Tensor) else None)
        return pos, shapes

    def _parent_out(self, op: Any, index: int) -> Any:
        eid, slot = op.parent_slots[index]
        return self.rp.ev2op[eid].outs[slot]

    def _parent_label(self, op: Any, index: int) -> str:
        return self.rp.ev2op[op.parent_slots[index][0]].label


def validate_trace(trace: Any, **_: Any) -> ValidationStatus:
    """Check every op of `trace` (see the module docstring); refuses opaque ops first."""
    from torchlens.backends.sdk import refuse_opaque, progress

    refuse_opaque(trace, trace._ops.values())  # an op loaded as opaque refuses before any op runs
    from torchlens.backends.sdk import refuse_unreplayable

    refuse_unreplayable(trace, trace._ops.values(), validating=True)  # e.g. torch.autograd.grad in the forward
    checker = _Checker(trace)
    for op in progress(trace._ops.values(), total=len(trace._ops), desc="validate"):
        checker.check(op)
    return checker.status()
