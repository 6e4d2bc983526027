"""Replay validation of a torch trace, on core's one per-op replay engine (`replay_validate`:
the walk over the ops, the argument filling, the preflight refusals and the typed failures).
This module supplies the torch side: `TorchReplayOps` (grad mode, RNG state, argument
protection, comparison rules) and `_Perturbation` (the per-op perturbation check).

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

import contextlib
from typing import Any

import torch

from torchlens.backends.sdk import ArgRef, ReplayOpsBase, ValidationStatus, replay_validate
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


class TorchReplayOps(ReplayOpsBase):
    """The torch side of core's replay engine for validation: replay in the capture's grad
    mode, under the op's recorded CPU RNG state, on arguments it may write into, and compare
    bit for bit unless a rule of `validate_rules.comparison` says otherwise."""

    def __init__(self, trace: Any) -> None:
        # replay in the capture's grad mode: some kernels (LSTM) take other paths without grad
        self.grad = not bool(getattr(trace.options, "inference_only", False))
        self.ev2op = {o.event_id: o for o in trace._ops.values()}

    def parent_value(self, op: Any, ref: ArgRef, v: Any) -> Any:
        if self.grad and isinstance(v, torch.Tensor) and not v.requires_grad and v.is_floating_point():
            eid, slot = op.parent_slots[ref.index]
            rg = self.ev2op[eid].meta.get("requires_grad")
            if rg is not None and slot < len(rg) and rg[slot]:
                v = v.detach().requires_grad_(True)  # a loaded payload lost its graph: kernels pick paths by it
        return v

    def replay_args(self, op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return safe_replay_args(op, args, kwargs)

    @contextlib.contextmanager
    def rng_state(self, state: Any) -> Any:
        saved_state = torch.get_rng_state()
        try:
            if state is not None:
                torch.set_rng_state(state)
            yield
        finally:
            torch.set_rng_state(saved_state)

    def call(self, op: Any, args: tuple, kwargs: dict) -> Any:
        with torch.set_grad_enabled(self.grad):
            return op.func(*args, **kwargs)

    def outputs(self, op: Any, out: Any, args: tuple) -> tuple:
        if op.func_name == "__setitem__":
            return (args[0],)
        if op.multi_output:
            return tuple(out)
        return (out,)

    def equal(self, a: Any, b: Any) -> bool:
        return R.same_bits(a, b)

    def compare(self, trace: Any, op: Any, got: tuple, want: tuple) -> tuple[str | None, str, dict[str, Any]]:
        mode, compare, record = R.comparison(trace, op)
        if len(got) != len(want) or not all(compare(g, w) for g, w in zip(got, want) if w is not None or g is not None):
            if mode == "tolerance" and len(got) == len(want) and all(R.same_meta(g, w) for g, w in zip(got, want)):
                return "dtype_tolerance_exceeded", (f"re-executing {op.func_name} eagerly differs from {op.label} by more "
                                                    f"than {R.COMPILED_ULPS} epsilons"), {"compared": mode, **record}
            return "replay_mismatch", f"re-executing {op.func_name} did not reproduce {op.label}", {}
        fields: dict[str, Any] = {}
        if mode != "bits":
            fields.update(compared=mode, **record)
            if mode == "tolerance":
                fields["bit_exact"] = all(R.same_bits(g, w) for g, w in zip(got, want))
        return None, "", fields


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


class _Perturbation:
    """Torch's per-op check after a replay matched (core's `replay_validate` runs the rest):
    perturb each floating-point parent and check the output moves, or name the rule that
    excuses it. Re-executions go through the engine (`v.engine.run`)."""

    def __init__(self) -> None:
        self.v: Any = None

    def __call__(self, v: Any, op: Any, got: tuple, decision: dict[str, Any]) -> tuple[str, str, dict] | None:
        self.v = v
        rp = v.engine
        want = op.outs
        exempt = _exempt_positions(op)
        if exempt == "all" or decision.get("compared") == "shape_dtype":
            decision.update(perturbed=[], exempt="all")
            return None
        perturbed, constants, exemptions = [], [], []
        for idx, (eid, slot) in enumerate(op.parent_slots):
            if idx in exempt:
                continue
            parent = rp.ev2op[eid]
            if parent.kind == "constant":  # skipped; the op's other parents are still perturbed
                constants.append(parent.label)
                v.count("constant_parent_payload")
                continue
            val = parent.outs[slot]
            if not isinstance(val, torch.Tensor) or not (val.is_floating_point() or val.is_complex()) or val.numel() == 0:
                continue  # integer / boolean parents (indices, masks) are exempt by rule
            if all(o is None or (isinstance(o, torch.Tensor) and o.numel() == 0) for o in want):
                continue
            if self.moves(op, {idx: None}, got, val, idx):
                perturbed.append(parent.label)
                continue
            excuse = self.excuse(op, idx, parent, val, got)
            if excuse is None:
                return ("perturbation_insensitive", f"perturbing parent {parent.label} did not change "
                        f"{op.label}, and no other operand explains it", {})
            exemptions.append(excuse)
        decision.update(perturbed=perturbed, exempt=sorted(exempt))
        if constants:
            decision["constant_parent_payload"] = constants
        if exemptions:
            decision["exemptions"] = exemptions
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
                alt = self.v.engine.run(op, override)
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
        rp = self.v.engine
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
            w = rp.param(op, ref.address) if ref.address is not None else self._parent_out(op, ref.index)
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
                v = self.v.engine.param(op, r.address) if r.address is not None else self._parent_out(op, r.index)
                if r.address is None and r.index == idx and pos < 0:
                    pos = i
            shapes.append(tuple(v.shape) if isinstance(v, torch.Tensor) else None)
        return pos, shapes

    def _parent_out(self, op: Any, index: int) -> Any:
        eid, slot = op.parent_slots[index]
        return self.v.engine.ev2op[eid].outs[slot]

    def _parent_label(self, op: Any, index: int) -> str:
        return self.v.engine.ev2op[op.parent_slots[index][0]].label


def validate_trace(trace: Any, **_: Any) -> ValidationStatus:
    """Check every op of `trace` through core's replay engine (see the module docstring);
    refuses opaque ops first."""
    return replay_validate(trace, TorchReplayOps(trace), extra_check=_Perturbation())
