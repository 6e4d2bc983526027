"""`tl.validate(..., scope=)` beyond the forward replay: each scope checks a capture against
an independent run of the model (no TorchLens in the oracle arm) and returns a
`ValidationStatus` whose decisions say what was compared.

- `receptive_field`: perturb each floating-point model input in turn and capture again;
  every op whose value changed must be downstream of that input in the captured graph. An
  op that moved with no captured path from the input is a dropped edge
  (`dropped_parent_edge_witness`): interventions upstream of it would not reach it.
- `intervention`: for up to `MAX_SITES` modules (spread over the forward), replaying
  `tl.scale(0.5)` at the module through the recorded graph must equal the model run with a
  forward hook applying the same edit, bit for bit (`replay_mismatch`). A replay the library
  refuses (typed) is recorded as skipped with its code, never guessed.
- `backward`: a traced forward plus `trace.backward` must give the same parameter and input
  gradients, and the same gradients at every module output, as a plain forward and backward
  of the same seeded loss (`replay_mismatch`, bit for bit). A model that carries autograd
  history between calls in a module attribute is refused with `backward_validation_carried_graph`.

Each run starts from the same torch RNG state, and the caller's state is restored after.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from torchlens.backends.sdk import ValidationStatus

from torchlens_torch.values import iter_leaves

#: at most this many module sites are edited by the intervention scope.
MAX_SITES = 8
_EDIT_FACTOR = 0.5  # exact in binary floating point: edit order cannot change a bit


def _leaves(obj: Any) -> list[torch.Tensor]:
    """Tensor leaves of a nested value, in the capture's own order (`values.iter_leaves`)."""
    return [t for _, t in iter_leaves(obj, "")]


def _replace_leaf(obj: Any, target: int, value: torch.Tensor, counter: list[int]) -> Any:
    """`obj` with its `target`-th tensor leaf (in `_leaves` order) replaced by `value`."""
    if isinstance(obj, torch.Tensor):
        counter[0] += 1
        return value if counter[0] - 1 == target else obj
    if type(obj) in (tuple, list):
        return type(obj)(_replace_leaf(o, target, value, counter) for o in obj)
    if type(obj) is dict:
        return {k: _replace_leaf(v, target, value, counter) for k, v in obj.items()}
    return obj


def _same(a: Any, b: Any) -> bool:
    from torchlens_torch.validate_rules import same_bits

    return same_bits(a.detach() if isinstance(a, torch.Tensor) else a, b.detach() if isinstance(b, torch.Tensor) else b)


@contextlib.contextmanager
def _seeded() -> Iterator[Any]:
    """Yields `reset()`, which puts the torch RNG back to the state at entry; the caller's
    state is restored on exit."""
    state = torch.get_rng_state()
    try:
        yield lambda: torch.set_rng_state(state)
    finally:
        torch.set_rng_state(state)


@contextlib.contextmanager
def _plain_mode() -> Iterator[None]:
    """The capture turns the MHA fast path off; so does the oracle arm."""
    mha = torch.backends.mha
    before = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        mha.set_fastpath_enabled(before)


def _status(decisions: list[dict[str, Any]], counts: dict[str, int]) -> ValidationStatus:
    first = next((d for d in decisions if d.get("ok") is False), None)
    if first is None:
        return ValidationStatus(True, decisions=decisions, reason_counts=counts)
    return ValidationStatus(False, first["op"], first["reason"], decisions, counts, first["detail"])


def _fail(decisions: list, counts: dict, op: str, reason: str, detail: str, **extra: Any) -> None:
    decisions.append({"op": op, "ok": False, "reason": reason, "detail": detail, **extra})
    counts[reason] = counts.get(reason, 0) + 1


def _trace(model: Any, args: tuple, kwargs: dict, capture: Any = None) -> Any:
    import warnings

    import torchlens as tl

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tl.trace(model, *args, input_kwargs=kwargs, capture=capture, save="all", backend="torch")


# receptive field ---------------------------------------------------------------------------

def _descendants(trace: Any, label: str) -> set[str]:
    seen, stack = set(), [label]
    while stack:
        for c in trace.ops[stack.pop()].children:
            if c not in seen:
                seen.add(c)
                stack.append(c)
    return seen


def _structure(trace: Any) -> list[tuple]:
    return [(o.label, o.func_name, tuple(o.parents)) for o in trace.ops]


def receptive_field(model: Any, args: tuple, kwargs: dict, capture: Any = None) -> tuple[ValidationStatus, Any]:
    decisions: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    with _seeded() as reset:
        reset()
        base = _trace(model, args, kwargs, capture)
        inputs = [o for o in base.ops if o.kind == "input"]
        leaves = _leaves((args, kwargs))
        for i, leaf in enumerate(leaves):
            if not (leaf.is_floating_point() or leaf.is_complex()) or leaf.numel() == 0:
                continue
            g = torch.Generator(device=leaf.device).manual_seed(99 + i)
            scale = float(leaf.detach().abs().max()) * 1e-2 + 1e-3
            moved = (leaf.detach() + torch.randn(leaf.shape, generator=g, dtype=leaf.dtype, device=leaf.device) * scale)
            new_args, new_kwargs = _replace_leaf((args, kwargs), i, moved.requires_grad_(leaf.requires_grad), [0])
            reset()
            alt = _trace(model, new_args, new_kwargs, capture)
            if _structure(alt) != _structure(base):
                decisions.append({"op": f"<input leaf {i}>", "ok": True, "reason": None, "skipped": "graph_diverged",
                                  "why": "the perturbed input took another path through the model (data-dependent "
                                         "control flow); its ops cannot be paired"})
                continue
            sources = [o.label for o in inputs if o.saved and not _same(alt.ops[o.label].out, o.out)]
            reach = set(sources).union(*(_descendants(base, s) for s in sources)) if sources else set()
            changed = [o.label for o in base.ops if o.saved and o.kind != "input" and alt.ops[o.label].saved
                       and not all(_same(a, b) for a, b in zip(alt.ops[o.label].outs, o.outs))]
            dropped = [c for c in changed if c not in reach]
            for c in dropped:
                _fail(decisions, counts, c, "dropped_parent_edge_witness",
                      f"{c} changed when input leaf {i} ({', '.join(sources) or 'no input op'}) was perturbed, but the "
                      "captured graph has no path from it to that op: a dependence the capture did not record",
                      input=sources)
            decisions.append({"op": f"<input leaf {i}>", "ok": True, "reason": None, "inputs": sources,
                              "changed": len(changed), "downstream": len(reach)})
    return _status(decisions, counts), base


# intervention ----------------------------------------------------------------------------------

def _sites(trace: Any) -> list[tuple[str, str]]:
    """(module address, first output op label) of modules whose every call returns one
    floating-point tensor, spread evenly over the forward, at most MAX_SITES."""
    order = {o.label: i for i, o in enumerate(trace.ops)}
    found = []
    for m in trace.modules:
        if m.address == "self" or not m.calls:
            continue
        outs = [c.output_ops for c in m.calls]
        if all(len(o) == 1 and o[0].saved and isinstance(o[0].out, torch.Tensor) and o[0].out.is_floating_point()
               for o in outs):
            found.append((order.get(outs[0][0].label, 0), m.address, outs[0][0].label))
    found.sort()
    if len(found) > MAX_SITES:
        step = len(found) / MAX_SITES
        found = [found[int(k * step)] for k in range(MAX_SITES)]
    return [(a, label) for _, a, label in found]


def intervention(model: Any, args: tuple, kwargs: dict, capture: Any = None) -> tuple[ValidationStatus, Any]:
    import warnings

    import torchlens as tl
    from torchlens.backends.sdk import TorchLensError

    decisions: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    with _seeded() as reset:
        reset()
        base = _trace(model, args, kwargs, capture)
        for address, label in _sites(base):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    fork = base.fork().do(tl.module(address), tl.scale(_EDIT_FACTOR))
                got = [o.out for o in fork.output_ops]
            except TorchLensError as exc:
                decisions.append({"op": label, "ok": True, "reason": None, "site": address, "skipped": exc.code,
                                  "why": f"replay refused: {exc}"[:300]})
                continue
            handle = model.get_submodule(address).register_forward_hook(
                lambda m, i, o: o * _EDIT_FACTOR if isinstance(o, torch.Tensor) else o)
            try:
                reset()
                with _plain_mode(), torch.no_grad():
                    want = _leaves(model(*args, **kwargs))
            finally:
                handle.remove()
            bad = [k for k, (a, b) in enumerate(zip(got, want)) if not _same(a, b)]
            if len(got) != len(want) or bad:
                _fail(decisions, counts, label, "replay_mismatch",
                      f"replaying tl.scale({_EDIT_FACTOR}) at module {address!r} through the recorded graph differs "
                      f"from the model run with a forward hook applying it (output {bad[0] if bad else 'count'})",
                      site=address)
                continue
            decisions.append({"op": label, "ok": True, "reason": None, "site": address, "edit": f"scale({_EDIT_FACTOR})",
                              "outputs_compared": len(want)})
    return _status(decisions, counts), base


# backward ---------------------------------------------------------------------------------------

def _carried(model: Any) -> list[str]:
    """Module attributes (`addr.name`) holding a tensor with autograd history."""
    found = []
    for addr, m in model.named_modules() if isinstance(model, nn.Module) else ():
        for name, v in vars(m).items():
            for t in _leaves(v):
                if t.grad_fn is not None:
                    found.append(f"{addr or 'self'}.{name}")
                    break
    return found


def _backward(model: Any, loss: torch.Tensor, run: Any) -> Any:
    from torchlens.backends.sdk import ValidationError

    try:
        return run()
    except RuntimeError as exc:
        text = str(exc)
        if "second time" in text or "already been freed" in text:
            attrs = _carried(model)
            if attrs:
                raise ValidationError(
                    "backward_validation_carried_graph",
                    f"the backward went through a graph an earlier backward freed, and module attributes "
                    f"{attrs} hold tensors with autograd history carried from call to call",
                    remedy="detach what the module keeps between calls (e.g. self.cache = h.detach()), or reset it "
                           "before validating", attributes=attrs) from exc
        raise


def _loss(outs: list[torch.Tensor]) -> torch.Tensor:
    """A seeded random projection of every differentiable output (independent of the RNG)."""
    total = None
    for k, o in enumerate(outs):
        if not (o.is_floating_point() or o.is_complex()) or not o.requires_grad:
            continue
        g = torch.Generator(device=o.device).manual_seed(7 + k)
        r = torch.randn(o.shape, generator=g, dtype=o.real.dtype if o.is_complex() else o.dtype, device=o.device)
        term = ((o.real if o.is_complex() else o) * r).sum()
        total = term if total is None else total + term
    return total


def backward(model: Any, args: tuple, kwargs: dict, capture: Any = None) -> tuple[ValidationStatus, Any]:
    import torchlens as tl

    decisions: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad] if isinstance(model, nn.Module) else []
    saved_grads = [p.grad for _, p in params]

    def fresh() -> tuple[tuple, dict, list[torch.Tensor]]:
        leaves = _leaves((args, kwargs))
        new = (args, kwargs)
        grads_of = []
        for i, leaf in enumerate(leaves):
            if leaf.is_floating_point() or leaf.is_complex():
                c = leaf.detach().clone().requires_grad_(True)
                new = _replace_leaf(new, i, c, [0])
                grads_of.append(c)
        return new[0], new[1], grads_of

    with _seeded() as reset:
        try:
            # the oracle: a plain forward and backward, module outputs' grads kept by hooks
            kept: dict[str, list[torch.Tensor]] = {}

            def keep(addr: str) -> Any:
                def hook(m: Any, i: Any, o: Any) -> None:
                    if isinstance(o, torch.Tensor) and o.requires_grad:
                        o.retain_grad()
                        kept.setdefault(addr, []).append(o)
                return hook

            handles = [m.register_forward_hook(keep(a)) for a, m in model.named_modules() if a] \
                if isinstance(model, nn.Module) else []
            p_args, p_kwargs, p_inputs = fresh()
            for _, p in params:
                p.grad = None
            try:
                reset()
                with _plain_mode(), torch.enable_grad():
                    loss = _loss(_leaves(model(*p_args, **p_kwargs)))
            finally:
                for h in handles:
                    h.remove()
            if loss is None:
                decisions.append({"op": "<trace>", "ok": True, "reason": None, "skipped": "no differentiable output"})
                return _status(decisions, counts), None
            _backward(model, loss, loss.backward)
            want_params = {n: p.grad for n, p in params}
            want_inputs = [t.grad for t in p_inputs]
            # the traced arm
            t_args, t_kwargs, t_inputs = fresh()
            for _, p in params:
                p.grad = None
            reset()
            trace = _trace(model, t_args, t_kwargs, tl.options.CaptureOptions(backward_ready=True, save_grads=True))
            t_loss = _loss(_leaves(trace.output))
            _backward(model, t_loss, lambda: trace.backward(t_loss))
            for n, p in params:
                if not _same(p.grad, want_params[n]):
                    _fail(decisions, counts, "<trace>", "replay_mismatch",
                          f"the gradient of parameter {n!r} from trace.backward differs from a plain backward", param=n)
            for k, (a, b) in enumerate(zip(t_inputs, want_inputs)):
                if not _same(a.grad, b):
                    _fail(decisions, counts, "<trace>", "replay_mismatch",
                          f"the gradient of input leaf {k} from trace.backward differs from a plain backward", input=k)
            compared = _module_grads(trace, kept, decisions, counts)
            decisions.append({"op": "<trace>", "ok": True, "reason": None, "params_compared": len(params),
                              "inputs_compared": len(t_inputs), "module_outputs_compared": compared})
            return _status(decisions, counts), trace
        finally:
            for (_, p), g in zip(params, saved_grads):
                p.grad = g


def _module_grads(trace: Any, kept: dict[str, list[torch.Tensor]], decisions: list, counts: dict) -> int:
    """Compare each hooked module output's gradient with the trace's grad of that call's
    output op (calls with one tensor output whose grad both sides hold)."""
    compared = 0
    for addr, outs in kept.items():
        if addr not in trace.modules:
            continue
        calls = trace.modules[addr].calls
        for call, o in zip(calls, outs):
            ops = call.output_ops
            if len(ops) != 1 or o.grad is None or ops[0].grads is None or ops[0].grads[0] is None:
                continue
            if not _same(ops[0].grads[0], o.grad):
                _fail(decisions, counts, ops[0].label, "replay_mismatch",
                      f"the gradient at {ops[0].label} (output of module call {call.label}) differs from the gradient "
                      "a plain backward gives that module's output", module=addr)
            compared += 1
    return compared


SCOPES = {"receptive_field": receptive_field, "intervention": intervention, "backward": backward}


def run_scope(scope: str, model: Any, args: tuple, kwargs: dict, capture: Any = None) -> tuple[ValidationStatus, Any]:
    """Run the named scope; returns (status, the validation trace or None)."""
    return SCOPES[scope](model, args, kwargs, capture)
