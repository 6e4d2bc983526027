"""`mlp_neuron_contributions(trace, mlp, neurons=None)`: an MLP's output as one row per hidden
neuron, ``hidden[..., n] * W_out[n]``, read from the output projection's CAPTURED input, plus a
bias constant row; the identity ``sum(rows) + bias == the captured output`` is checked on every
call against a per-element budget. ``neurons=`` keeps those neurons and folds the others into
one exact ``other_neurons`` row (their hidden values through W_out in one product)."""

from __future__ import annotations

import math
from typing import Any

from torchlens.errors import MechInterpError

from torchlens_mechinterp._common import (LINEAR_FUNCS, VALUE_PRESERVING, attention_addresses, dtype_eps,
                                          mlp_addresses)
from torchlens_mechinterp.stack import ComponentStack, StackRow

FUNCTION = "mlp_neuron_contributions"
#: ULP headroom of the identity budget
HEADROOM = 4.0


def _projection(trace: Any, mlp: Any) -> tuple[str, Any, Any, str | None, str, str]:
    """(address, output op, projection op, bias, weight, orientation) of the MLP's output projection."""
    from torchlens_mechinterp.heads import _param_op

    address = getattr(mlp, "address", mlp)
    mod = trace._modules.get(address) if isinstance(address, str) else None
    if mod is None or len(mod.calls) != 1 or not mod.calls[0].output_labels or address in attention_addresses(trace):
        raise MechInterpError("mi_not_mlp", f"{FUNCTION}: {address!r} is not a single-call MLP module of this trace",
                              remedy=f"pass an MLP address: {', '.join(sorted(mlp_addresses(trace))) or '(none)'}",
                              function=FUNCTION, mlp=str(address))
    ops = trace._ops
    out = ops[mod.calls[0].output_labels[0]]
    cur = out
    while not cur.params and cur.func_name in VALUE_PRESERVING and len(cur.parents) == 1:
        cur = ops[cur.parents[0]]
    if not cur.params or cur.func_name not in LINEAR_FUNCS or len(cur.parents) != 1 or cur.module is None \
            or not cur.module.startswith(address + ".") and cur.module != address:
        raise MechInterpError("mi_not_mlp", f"{FUNCTION}: the output of {address!r} does not come from one "
                              "linear / Conv1D projection", remedy=f"pass an MLP address: "
                              f"{', '.join(sorted(mlp_addresses(trace))) or '(none)'}", function=FUNCTION,
                              mlp=address)
    op, weight, bias, orient = _param_op(trace, cur.module, FUNCTION, address)
    return address, out, op, bias, weight, orient


def neuron_sites(trace: Any, mlp: Any) -> list[str]:
    _, out, op, *_ = _projection(trace, mlp)
    return list(dict.fromkeys([op.parents[0], out.label]))


def mlp_neuron_contributions(trace: Any, mlp: Any, neurons: Any = None) -> ComponentStack:
    """One row per hidden neuron (``neuron[n]``, float64 ``[*out_shape]``) plus the output
    projection's bias (``output_bias``, a verified constant)."""
    import torch

    from torchlens_mechinterp.heads import _in_out
    from torchlens_mechinterp.retention import require_payloads

    address, out, op, bias, weight, orient = _projection(trace, mlp)
    W = _in_out(trace, weight, orient).detach().double()  # [N, E]
    N = W.shape[0]
    if neurons is not None:
        sel = [neurons] if isinstance(neurons, int) else list(neurons)
        if any(isinstance(n, bool) or not isinstance(n, int) or not -N <= n < N for n in sel) \
                or len({n % N for n in sel}) != len(sel):
            raise MechInterpError("mi_neuron_index_invalid", f"neurons={neurons!r} for a hidden width of {N}",
                                  remedy=f"distinct ints in 0..{N - 1}", function=FUNCTION, width=N)
        sel = [n % N for n in sel]
    else:
        sel = list(range(N))
    require_payloads(trace, neuron_sites(trace, address), function=FUNCTION)
    hidden = trace._ops[op.parents[0]].out.detach()
    target = out.out.detach()
    h = hidden.double().reshape(-1, N)
    shape = tuple(target.shape)
    rows: list[StackRow] = []
    for n in sel:
        rows.append(StackRow(name=f"neuron[{n}]", kind="writer", value=(h[:, n:n + 1] * W[n]).reshape(shape),
                             label=op.parents[0], module=address, component="neuron"))
    other = [n for n in range(N) if n not in set(sel)]
    if other:
        idx = torch.tensor(other)
        rows.append(StackRow(name="other_neurons", kind="writer", value=(h[:, idx] @ W[idx]).reshape(shape),
                             label=op.parents[0], module=address, component="neuron"))
    b = trace._params[bias].value.detach().double() if bias else None
    if b is not None:
        rows.append(StackRow(name="output_bias", kind="constant", value=b, label=None, module=address,
                             component="output_bias"))
    total = sum(r.value for r in rows if r.kind == "writer")
    if b is not None:
        total = total + b
    basis = (h.abs() @ W.abs()).reshape(shape) + (b.abs() if b is not None else 0) + target.double().abs()
    budget = HEADROOM * dtype_eps(target, hidden) * (1 + math.log2(len(rows) + 2)) * (1 + math.log2(N + 2)) * basis
    err = (total - target.double()).abs()
    frac = float((err / budget.clamp_min(torch.finfo(torch.float64).tiny)).max())
    if not frac <= 1.0:
        raise MechInterpError("mi_neuron_identity_failed", f"{FUNCTION}: the neuron rows of {address!r} plus the bias "
                              f"miss the captured output {out.label!r} (max budget fraction {frac:.3g})",
                              remedy="report the model", function=FUNCTION, mlp=address, max_budget_fraction=frac)
    grade = "closed_constant" if b is not None else "complete"
    return ComponentStack(rows=rows, grade=grade, target_label=out.label,
                          receipt={"max_budget_fraction": frac, "width": N, "selected": len(sel),
                                   "projection": op.label, "hidden": op.parents[0], "weight": weight,
                                   "orientation": orient, "budget_model": "per_element_abs_basis"})


__all__ = ["mlp_neuron_contributions", "neuron_sites"]
