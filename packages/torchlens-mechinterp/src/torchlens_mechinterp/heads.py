"""Attention heads: weight views and per-head contributions.

`head_weight_views(trace, attention)` reads W_Q / W_K / W_V / W_O as per-head views
``[H, d_model, d_head]`` / ``[H, d_head, d_model]``. Orientation comes from the projection
module's CLASS (``Conv1D`` stores ``[in, out]``, ``Linear`` ``[out, in]``), the q/k/v slices of a
fused projection from the captured graph (the attention recipe's split of the projection's
output), the head counts from the recipe's head split (grouped-query attention: fewer K/V
heads). When the projection's input and output payloads were saved, the views are checked
against them (``receipt["verified"]``).

`attention_head_contributions(trace, attention)` returns a ComponentStack with one row per
QUERY head (the validated ``result`` facet: head h's ``z @ W_O[h]``) plus an ``output_bias``
constant row when the projection has a bias, proven by the identity
``sum(heads) + bias == the captured projection output`` within a per-element budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torchlens.errors import FacetError, MechInterpError

from torchlens_mechinterp._common import LINEAR_FUNCS, attention_addresses, dtype_eps, entries, spec_labels
from torchlens_mechinterp.stack import ComponentStack, StackRow

ORIENTATION = {"Conv1D": "in_out", "Linear": "out_in", "NonDynamicallyQuantizableLinear": "out_in"}
#: ULP headroom of the per-element budgets (weight-view verification, head-row identity)
VIEW_HEADROOM = 4.0
RESULT_HEADROOM = 4.0


@dataclass
class HeadWeightViews:
    """Per-head weight views of one attention module (float tensors, views of the parameters).

    W_Q ``[n_heads, d_model, d_head]``, W_K / W_V ``[n_kv_heads, d_model, d_head]``, W_O
    ``[n_heads, d_head, d_model]``; b_* the matching bias slices (None without a bias).
    `kv_head_of(h)` is the K/V head that serves query head h."""

    attention: str
    W_Q: Any
    W_K: Any
    W_V: Any
    W_O: Any
    b_Q: Any = None
    b_K: Any = None
    b_V: Any = None
    b_O: Any = None
    n_heads: int = 0
    n_kv_heads: int = 0
    d_head: int = 0
    d_model: int = 0
    receipt: dict[str, Any] = field(default_factory=dict)

    def kv_head_of(self, h: int) -> int:
        return h // (self.n_heads // self.n_kv_heads)

    @property
    def grouped(self) -> bool:
        return self.n_kv_heads != self.n_heads


def _require_attention(trace: Any, attention: Any, function: str) -> str:
    address = getattr(attention, "address", attention)
    if not isinstance(address, str) or address not in attention_addresses(trace):
        raise MechInterpError("mi_not_attention", f"{function}: {address!r} is not an attention block of this trace",
                              remedy=f"pass one of: {', '.join(sorted(attention_addresses(trace))) or '(none)'}",
                              function=function, attention=str(address))
    mod = trace._modules[address]
    if len(mod.calls) != 1:
        raise MechInterpError("mi_not_attention", f"{function}: {address!r} ran {len(mod.calls)} times; the kit "
                              "reads single-call attention blocks", remedy="trace one forward pass",
                              function=function, attention=address)
    return address


def _param_op(trace: Any, module: str, function: str, attention: str) -> tuple[Any, str, str | None, str]:
    """(op, weight address, bias address, orientation) of the one parametrised op of `module`."""
    mod = trace._modules.get(module)

    def refuse(why: str) -> MechInterpError:
        return MechInterpError("mi_head_weights_unresolved", f"{function}: {why}", remedy="use a model whose "
                               "projections are nn.Linear or transformers' Conv1D", function=function,
                               attention=attention, module=module)

    if mod is None or len(mod.calls) != 1:
        raise refuse(f"projection module {module!r} is not a single-call module")
    orient = ORIENTATION.get(mod.class_name)
    if orient is None:
        raise refuse(f"projection module {module!r} has class {mod.class_name!r}, whose weight layout is unknown")
    pops = [o for o in mod.calls[0].ops if o.params]
    if len(pops) != 1:
        raise refuse(f"projection module {module!r} runs {len(pops)} parametrised ops, not one")
    op = pops[0]
    w = [a for a in op.params if len(trace._params[a].shape) == 2]
    b = [a for a in op.params if len(trace._params[a].shape) == 1]
    if len(w) != 1:
        raise refuse(f"projection op {op.label!r} reads {len(w)} matrices, not one")
    return op, w[0], (b[0] if b else None), orient


def _in_out(trace: Any, weight: str, orient: str) -> Any:
    w = trace._params[weight].value
    return w if orient == "in_out" else w.t()


def _qkv_view(trace: Any, address: str, name: str, function: str) -> dict[str, Any]:
    """The per-head columns of q / k / v in their projection's weight: the attention recipe's
    primitive chain (heads, split, transpose, ...) applied to the projection output's COLUMN
    INDICES, so a fused (GPT-2 c_attn), per-head interleaved (GPT-NeoX) or separate (LLaMA)
    layout is read from the captured graph, never assumed."""
    import torch

    spec = entries(trace, address)[name].spec
    home = trace._ops[spec.home] if spec.home_kind in ("module_output", "op") else None
    heads = next((p for p in spec.chain if type(p).__name__ == "Heads"), None)

    def refuse(why: str) -> MechInterpError:
        return MechInterpError("mi_head_weights_unresolved", f"{function}: the {name} facet of {address!r} {why} "
                               f"({spec.describe()})", remedy="use a model whose q/k/v are projection outputs",
                               function=function, attention=address)

    if home is None or heads is None:
        raise refuse("is not a projection output split into heads")
    op, weight, bias, orient = _param_op(trace, home.module, function, address)
    W = _in_out(trace, weight, orient)  # [d_model, out]
    b = trace._params[bias].value if bias else None
    shape = tuple(home.shape)
    if not shape or shape[-1] != W.shape[1]:
        raise refuse(f"reads {home.label!r} of shape {shape}, not the projection's {W.shape[1]} outputs")
    idx = torch.arange(W.shape[1]).expand(shape)
    for p in spec.chain:
        idx = p.apply(idx)
    n = heads.n_heads
    cols = idx.reshape(-1, idx.shape[-2], idx.shape[-1])
    if idx.shape[-2] != n or not bool((cols == cols[:1]).all()):
        raise refuse("does not select the same projection columns at every position")
    cols = cols[0]  # [n_heads, d_head] column indices
    d = int(cols.shape[-1])
    Wh = W[:, cols].permute(1, 0, 2)  # [n, d_model, d]
    bh = b[cols] if b is not None else None
    flat = cols.reshape(-1)
    contiguous = bool((flat == torch.arange(int(flat[0]), int(flat[0]) + flat.numel())).all())
    return {"W": Wh, "b": bh, "n": n, "d": d, "weight": weight, "bias": bias, "orientation": orient,
            "module": home.module, "class": trace._modules[home.module].class_name, "op": op.label,
            "slice": (int(flat.min()), int(flat.max()) + 1) if contiguous else "interleaved", "evidence": spec.describe()}


def _o_projection(trace: Any, address: str, function: str) -> tuple[Any, str, str | None, str, str]:
    """The attention's output projection: the last parametrised op of the attention call that
    is downstream of z's home, and its module."""
    zspec = entries(trace, address)["z"].spec
    zhome = zspec.home
    call = trace._modules[address].calls[0]
    cands = [o for o in call.ops if o.params and o.func_name in LINEAR_FUNCS and o.index > trace._ops[zhome].index]
    if not cands:
        raise MechInterpError("mi_head_weights_unresolved", f"{function}: no output projection after z in "
                              f"{address!r}", remedy="use a model whose attention ends in a projection",
                              function=function, attention=address)
    op = cands[-1]
    pop, weight, bias, orient = _param_op(trace, op.module, function, address)
    return pop, weight, bias, orient, op.module


def head_weight_views(trace: Any, attention: Any) -> HeadWeightViews:
    """Per-head W_Q / W_K / W_V / W_O views of `attention` (a module address or record)."""
    import torch

    function = "head_weight_views"
    address = _require_attention(trace, attention, function)
    q, k, v = (_qkv_view(trace, address, n, function) for n in ("q", "k", "v"))
    oop, oweight, obias, oorient, omodule = _o_projection(trace, address, function)
    WO_full = _in_out(trace, oweight, oorient)  # [n_heads * d_head, d_model]
    n, d = q["n"], q["d"]
    if WO_full.shape[0] != n * d or k["n"] != v["n"] or n % k["n"]:
        raise MechInterpError("mi_head_weights_unresolved", f"{function}: head counts do not fit ({n} query heads "
                              f"of {d}, {k['n']} key / {v['n']} value heads, W_O rows {WO_full.shape[0]})",
                              remedy="report the model", function=function, attention=address)
    W_O = WO_full.reshape(n, d, WO_full.shape[1])
    fused = q["weight"] == k["weight"] == v["weight"]
    receipt: dict[str, Any] = {
        "orientation": {"q": q["orientation"], "k": k["orientation"], "v": v["orientation"], "o": oorient},
        "module_class": {"q": q["class"], "k": k["class"], "v": v["class"], "o": trace._modules[omodule].class_name},
        "parameters": {"q": q["weight"], "k": k["weight"], "v": v["weight"], "o": oweight},
        "fused_qkv": fused, "slices": {"q": q["slice"], "k": k["slice"], "v": v["slice"]},
        "evidence": {"q": q["evidence"], "k": k["evidence"], "v": v["evidence"]},
        "shared_storage": q["weight"] if fused else None,
        "verified": {}, "verified_skipped": [],
    }
    # payload verification of each projection (when its input and output were saved); a fused
    # q/k/v projection (GPT-2's c_attn) is one op and one weight: checked once, its verdict shared
    checked: dict[tuple, bool] = {}
    for name, view in (("q", q), ("k", k), ("v", v)):
        op = trace._ops[view["op"]]
        src = trace._ops[op.parents[0]] if op.parents else None
        if src is None or not (op.saved and src.saved):
            receipt["verified_skipped"].append(name)
            continue
        key = (view["op"], view["weight"], view["orientation"], view["bias"])
        if key in checked:
            receipt["verified"][name] = checked[key]
            continue
        W = _in_out(trace, view["weight"], view["orientation"])
        b = trace._params[view["bias"]].value if view["bias"] else None
        x = src.out.reshape(-1, W.shape[0]).double()
        hand = x @ W.double() + (b.double() if b is not None else 0)
        got = op.out.reshape(-1, W.shape[1]).double()
        budget = VIEW_HEADROOM * dtype_eps(op.out) * (1 + math.log2(W.shape[0] + 2)) * (
            x.abs() @ W.double().abs() + (b.double().abs() if b is not None else 0) + got.abs())
        ok = bool(torch.all((hand - got).abs() <= budget))
        receipt["verified"][name] = checked[key] = ok
        if not ok:
            raise MechInterpError("mi_head_weights_unresolved", f"{function}: the {name} weight view does not "
                                  f"reproduce the captured projection {op.label!r}", remedy="report the model",
                                  function=function, attention=address)
    # the output projection: its captured input (z merged over heads) through W_O (+ b_O) is its output
    src = trace._ops[oop.parents[0]] if oop.parents else None
    if src is not None and oop.saved and src.saved:
        b = trace._params[obias].value.double() if obias else 0
        x = src.out.reshape(-1, WO_full.shape[0]).double()
        got = oop.out.reshape(-1, WO_full.shape[1]).double()
        budget = VIEW_HEADROOM * dtype_eps(oop.out) * (1 + math.log2(WO_full.shape[0] + 2)) * (
            x.abs() @ WO_full.double().abs() + (b.abs() if obias else 0) + got.abs())
        ok = bool(torch.all((x @ WO_full.double() + b - got).abs() <= budget))
        receipt["verified"]["o"] = ok
        if not ok:
            raise MechInterpError("mi_head_weights_unresolved", f"{function}: the W_O view does not reproduce the "
                                  f"captured projection {oop.label!r}", remedy="report the model", function=function,
                                  attention=address)
    else:
        receipt["verified_skipped"].append("o")
    return HeadWeightViews(address, q["W"], k["W"], v["W"], W_O, q["b"], k["b"], v["b"],
                           trace._params[obias].value if obias else None, n, k["n"], d, q["W"].shape[1], receipt)


def head_contribution_sites(trace: Any, attention: Any) -> list[str]:
    address = _require_attention(trace, attention, "attention_head_contributions")
    e = entries(trace, address)
    oop = _o_projection(trace, address, "attention_head_contributions")[0]
    return list(dict.fromkeys(list(spec_labels(e["result"].spec)) + list(spec_labels(e["z"].spec))
                              + [oop.label, _writer_label(trace, oop)]))


def _writer_label(trace: Any, oop: Any) -> str:
    """The o-projection's output as its module returns it (across shape-only ops)."""
    mod = trace._modules[oop.module]
    return mod.calls[0].output_labels[0]


def head_rows(trace: Any, address: str, function: str, *, views: HeadWeightViews | None = None
              ) -> tuple[list[StackRow], str, dict[str, Any]]:
    """(per-head rows + output_bias row when present, the writer label, receipt), verified."""
    import torch

    from torchlens_mechinterp.retention import require_payloads

    views = views or head_weight_views(trace, address)
    require_payloads(trace, head_contribution_sites(trace, address), function=function)
    oop = _o_projection(trace, address, function)[0]
    writer = _writer_label(trace, oop)
    for name in ("result", "z"):  # a facet can need a capture option as well as payloads
        e = entries(trace, address).get(name)
        if e is None or e.status != "available_now":
            raise MechInterpError("mi_payloads_missing", f"{function}: the {name} facet of {address!r} is not "
                                  f"readable: {e.reason if e is not None else 'not declared'}",
                                  remedy=(e.reason if e is not None and e.reason else "capture with save='all'"),
                                  function=function, missing=[], facet=name, attention=address)
    f = trace._modules[address].calls[0].facets
    try:
        result = f["result"].value  # [B, P, H, d_model]; the facet validates its own reconstruction
    except FacetError as exc:
        raise MechInterpError("mi_head_result_unverified", f"{function}: the result facet of {address!r} refused: "
                              f"{exc.message}", remedy="use grain='layer' (the literal writers)", function=function,
                              attention=address, facet_code=exc.code) from exc
    z = f["z"].value  # [B, P, H, d_head]
    W_O = views.W_O.double()
    target = trace._ops[writer].out
    heads_sum = result.double().sum(-2)
    b = views.b_O.double() if views.b_O is not None else None
    total = heads_sum + (b if b is not None else 0)
    basis = torch.einsum("bphd,hde->bpe", z.double().abs(), W_O.abs()) + (b.abs() if b is not None else 0) \
        + target.double().abs().reshape(total.shape)
    depth = (1 + math.log2(views.n_heads + 2)) * (1 + math.log2(views.d_head + 2))
    budget = RESULT_HEADROOM * dtype_eps(target, result) * depth \
        * basis
    err = (total - target.double().reshape(total.shape)).abs()
    frac = float((err / budget.clamp_min(1e-300)).max().detach())
    if frac > 1:
        raise MechInterpError("mi_head_result_unverified", f"{function}: the {views.n_heads} head rows of "
                              f"{address!r} plus the output bias miss the projection output {writer!r} "
                              f"(max budget fraction {frac:.3g})", remedy="report the model", function=function,
                              attention=address, max_budget_fraction=frac)
    rows = [StackRow(name=f"{address}.h{h}", kind="writer", value=result[..., h, :], label=None,
                     module=address, component="head") for h in range(views.n_heads)]
    if views.b_O is not None:
        rows.append(StackRow(name=f"{address}.output_bias", kind="constant", value=views.b_O,
                             label=None, module=address, component="output_bias"))
    return rows, writer, {"max_budget_fraction": frac, "n_heads": views.n_heads, "target": writer,
                          "output_bias_proven": views.b_O is not None}


def attention_head_contributions(trace: Any, attention: Any) -> ComponentStack:
    """One row per query head (`result[..., h, :]`) plus a proven `output_bias` constant row."""
    address = _require_attention(trace, attention, "attention_head_contributions")
    rows, writer, receipt = head_rows(trace, address, "attention_head_contributions")
    grade = "closed_constant" if any(r.kind == "constant" for r in rows) else "complete"
    receipt["budget_model"] = "per_element_abs_basis"
    return ComponentStack(rows=rows, grade=grade, target_label=writer, receipt=receipt)


__all__ = ["head_weight_views", "HeadWeightViews", "attention_head_contributions", "head_contribution_sites",
           "head_rows"]
