"""The built-in attention recipe: q, k, v, scores, pattern, z and per-head result.

A module is attention when its own code (not a child's) ran exactly one attention core:
one `scaled_dot_product_attention` call, or one 4-d softmax whose input comes from a
`q @ k^T` matmul and whose output feeds a `pattern @ v` matmul (eager attention). From
the core, the recipe walks the captured dataflow back to the projections feeding Q, K and
V (fused `c_attn` Conv1D, separate q/k/v Linear, grouped K/V) and forward to the output
projection. Shapes follow TransformerLens: q/k/v/z `[batch, pos, head, d_head]`,
pattern/scores `[batch, head, q_pos, k_pos]`, result `[batch, pos, head, d_model]`.

Fused SDPA hides scores and pattern: they are computed read-only from the exact tensors
and options the kernel received, and validated by recomputing pattern @ V against the
kernel's captured output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torchlens

from torchlens_torch.recipes.dataflow import (
    IDENTITY,
    MATMULS,
    SCORE_ELEMENTWISE,
    arg_value,
    forward_to_projection,
    own_ops,
    projection_spec,
)

RECIPE_ID = "torchlens_torch.attention"
ATTENTION_FACETS = ("q", "k", "v", "scores", "pattern", "z", "result")


@dataclass(frozen=True)
class Core:
    """The attention core of one call: the op computing it and the Q/K/V tensors it read
    (in `(..., heads, pos, d_head)` layout)."""

    kind: str  # "sdpa" | "eager"
    op: Any  # the SDPA op, or the softmax op
    q: Any
    k: Any
    v: Any
    z: Any  # the op whose output is z in (..., heads, pos, d_head) layout
    scores: Any = None  # eager: the op feeding the softmax


def _first_matmul_back(trace: Any, op: Any, inside: set[str]) -> Any:
    cur = op
    for _ in range(8):
        if cur.func_name in MATMULS:
            return cur
        if cur.func_name not in SCORE_ELEMENTWISE or not cur.parents:
            return None
        nxt = [trace._ops[p] for p in cur.parents if p in inside and trace._ops[p].shape is not None
               and len(trace._ops[p].shape) == len(cur.shape)]
        if not nxt:
            return None
        cur = nxt[0]
    return None


def find_core(trace: Any, call: Any) -> Core | None:
    ops = own_ops(call)
    sdpa = [op for op in ops if op.func_name == "scaled_dot_product_attention"]
    if len(sdpa) == 1:
        op = sdpa[0]
        if len(op.parents) < 3:
            return None
        q, k, v = (trace._ops[p] for p in op.parents[:3])
        return Core("sdpa", op, q, k, v, op)
    if sdpa:
        return None
    soft = [op for op in ops if op.func_name in ("softmax", "_softmax") and op.shape is not None and len(op.shape) == 4]
    if len(soft) != 1:
        return None
    sm = soft[0]
    inside = set(call.op_labels)
    if not sm.parents:
        return None
    scores = trace._ops[sm.parents[0]]
    qk = _first_matmul_back(trace, scores, inside)
    if qk is None or len(qk.parents) < 2:
        return None
    q = trace._ops[qk.parents[0]]
    kt = trace._ops[qk.parents[1]]
    k = trace._ops[kt.parents[0]] if kt.func_name in ("transpose", "permute") and kt.parents else kt
    sources = {sm.label}
    frontier = [sm]
    for _ in range(3):  # dropout / dtype casts between the softmax and pattern @ v
        nxt = [trace._ops[c] for o in frontier for c in o.children if c in inside]
        frontier = [o for o in nxt if o.func_name in IDENTITY]
        sources |= {o.label for o in frontier}
    pv = [trace._ops[c] for s in sources for c in trace._ops[s].children
          if c in inside and trace._ops[c].func_name in MATMULS and trace._ops[c].parents[0] in sources]
    if len(pv) != 1 or len(pv[0].parents) < 2:
        return None
    v = trace._ops[pv[0].parents[1]]
    return Core("eager", sm, q, k, v, pv[0], scores)


def is_attention(module: Any) -> bool:
    return any(find_core(module._trace, call) is not None for call in module.calls)


def _up(t: Any) -> Any:
    """`t` in at least float32 (a half / bfloat16 value is upcast; float64 stays)."""
    import torch

    return t.float() if t is not None and t.dtype in (torch.float16, torch.bfloat16) else t


def _mismatch(got: Any, captured: Any, magnitude: Any) -> float | None:
    """None when `got` (recomputed in at least float32 from the captured inputs) reproduces the
    captured value, else the largest absolute error (inf for a shape change). Within bound means
    |got - captured| <= 1e-5 + 1e-4 |captured| (the float32 bound) or <= 4 eps (magnitude +
    |captured|), eps the captured dtype's machine epsilon and magnitude the sum of the absolute
    terms `got` adds up: the rounding a bfloat16 / float16 kernel is allowed, scaled with the dtype."""
    import torch

    if tuple(got.shape) != tuple(captured.shape):
        return float("inf")
    dt = torch.promote_types(torch.promote_types(got.dtype, captured.dtype), torch.float32)
    got, cap, mag = (t.detach().to(dt) for t in (got, captured, magnitude))
    eps = torch.finfo(captured.dtype).eps if captured.dtype.is_floating_point else 0.0
    err = (got - cap).abs()
    bound = torch.maximum(1e-5 + 1e-4 * cap.abs(), 4 * eps * (mag.abs() + cap.abs()))
    return None if bool((err <= bound).all()) else float(err.max())


def _sdpa_scores(trace: Any, op: Any) -> tuple[Any, Any]:
    """(scores after scale and mask, V with grouped heads expanded) from the SDPA call's own
    inputs and options (PyTorch's enable_gqa repeat-interleave convention), in at least
    float32 (a bfloat16 / float16 kernel accumulates in float32 too)."""
    import torch

    args = op.args_template or ()
    kw = dict(op.kwargs_template or {})
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    given = {names[i]: a for i, a in enumerate(args) if i < len(names)}
    given.update(kw)
    q, k, v = (_up(arg_value(trace, op, given[n])) for n in names[:3])
    mask = _up(arg_value(trace, op, given.get("attn_mask")))
    scale = given.get("scale")
    scale = 1.0 / (q.shape[-1] ** 0.5) if scale is None else scale
    if k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    s = (q @ k.transpose(-2, -1)) * scale
    if given.get("is_causal"):
        L, S = q.shape[-2], k.shape[-2]
        keep = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(diagonal=0)
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return s, v


def _sdpa_checked(trace: Any, op: Any) -> tuple[Any, Any]:
    """(scores, pattern), after checking pattern @ V reproduces the kernel's output; kept per
    trace and op (while its output is the one checked), so scores and pattern cost one pass."""
    import torch

    cache = torchlens.facets.state_for(trace).setdefault("sdpa", {})
    hit = cache.get(op.label)
    if hit is not None and hit[0] is op.outs[0]:
        return hit[1], hit[2]
    s, v = _sdpa_scores(trace, op)
    pattern = torch.softmax(s, dim=-1)
    out = op.outs[0]
    err = _mismatch(pattern @ v, out, pattern @ v.abs())
    if err is not None:
        raise torchlens.errors.FacetError(
            "facet_reconstruction_mismatch", f"reconstructed attention pattern @ V differs from {op.label}'s output "
            f"by {err:.3g} (beyond the rounding {out.dtype} allows)", remedy="recapture with an eager attention "
            "implementation so pattern is a real op", label=op.label)
    s, pattern = s.to(out.dtype), pattern.to(out.dtype)
    cache[op.label] = (out, s, pattern)
    return s, pattern


def _needs(op: Any) -> str | None:
    kw = dict(op.kwargs_template or {})
    p = kw.get("dropout_p", op.args_template[4] if op.args_template and len(op.args_template) > 4 else 0.0)
    if isinstance(p, (int, float)) and p > 0:
        return (f"{op.label} ran with dropout_p={p}: the dropout mask (RNG) is not reconstructed; capture in eval "
                "mode or with dropout off")
    return None


def _sdpa_inputs(op: Any) -> tuple[str, ...]:
    return tuple(op.parents)


def _innermost_call(trace: Any, op: Any) -> Any:
    """The call of the innermost module that ran `op`."""
    module = trace._modules.get(op.module)
    if module is None:
        return None
    return next((c for c in module.calls if op.label in c.op_labels), None)


def _projection_after_output(trace: Any, call: Any, z: Any) -> Any:
    """When z leaves the attention module only reshaped (its first output), the output
    projection is the first parameter op reading that output in the enclosing module's
    call (BERT: `BertAttention` feeds `self`'s output to `output.dense`)."""
    if not call.output_labels:
        return None
    out = trace._ops[call.output_labels[0]]
    inside = set(call.op_labels)
    cur, structural = z, IDENTITY | {"transpose", "reshape", "view", "permute", "flatten"}
    for _ in range(8):  # z reaches the output through structural ops only
        if cur.label == out.label:
            break
        nxt = [trace._ops[c] for c in cur.children if c in inside and trace._ops[c].func_name in structural]
        if not nxt:
            return None
        nxt.sort(key=lambda o: -len([c for c in o.children if c in inside]))
        cur = nxt[0]
    else:
        return None
    parent = trace._modules.get(call.module.parent) if call.module.parent else None
    if parent is None:
        return None
    pcall = next((c for c in parent.calls if out.label in c.op_labels), None)
    if pcall is None:
        return None
    outer = set(pcall.op_labels) - inside
    readers = [trace._ops[c] for c in out.children if c in outer]
    proj = [o for o in readers if o.params or o.module != pcall.address]
    if len(readers) != 1 or len(proj) != 1 or not proj[0].params:
        return None
    return proj[0]


def _result_spec(trace: Any, call: Any, core: Any, z_spec: Any) -> Any:
    """Per-head contributions of the output projection, `[batch, pos, head, d_model]`:
    z's head h times W_O's rows for h; validated so that the heads summed plus the bias
    equal the projection's captured output."""
    proj_first = forward_to_projection(trace, call, core.z)
    if proj_first is None:  # the projection sits outside: BERT's sibling BertSelfOutput.dense
        proj_first = _projection_after_output(trace, call, core.z)
    if proj_first is None:
        return None
    if proj_first.module != call.address:
        pcall = _innermost_call(trace, proj_first)
        if pcall is None:
            return None
        pops = [o for o in pcall.ops if o.params]
        if len(pops) != 1 or not pcall.output_labels:
            return None
        pop, out_label = pops[0], pcall.output_labels[0]
    else:
        if not proj_first.params:
            return None
        pop, out_label = proj_first, proj_first.label
    weight = [a for a in pop.params if a.rsplit(".", 1)[-1] == "weight" or trace._params[a].shape.__len__() == 2]
    bias = [a for a in pop.params if a not in weight]
    if len(weight) != 1:
        return None
    w_addr, b_addr = weight[0], (bias[0] if bias else None)
    func = pop.func_name

    def compute(tr: Any) -> Any:
        import torch

        z = torchlens.facets.value_of(tr, z_spec)
        w = tr._params[w_addr].value
        w_io = w.t() if func == "linear" else w  # linear keeps (out, in); Conv1D/addmm keeps (in, out)
        n_heads, d_head = z.shape[-2], z.shape[-1]
        if w_io.shape[0] != n_heads * d_head:
            raise torchlens.errors.FacetError(
                "facet_reconstruction_mismatch", f"output projection {w_addr} has {w_io.shape[0]} input rows, not "
                f"{n_heads} heads x {d_head}", remedy="this module's output projection is not per-head", weight=w_addr)
        result = torch.einsum("...hd,hdm->...hm", _up(z), _up(w_io.reshape(n_heads, d_head, -1).to(z.dtype)))
        captured = tr._ops[out_label].outs[0]
        total, magnitude = result.sum(-2), result.abs().sum(-2)
        if b_addr is not None:
            bias = _up(tr._params[b_addr].value.to(z.dtype))
            total, magnitude = total + bias, magnitude + bias.abs()
        err = _mismatch(total, captured, magnitude)
        if err is not None:
            raise torchlens.errors.FacetError(
                "facet_reconstruction_mismatch", f"per-head results summed with the bias do not reproduce "
                f"{out_label} (off by {err:.3g}, beyond the rounding {captured.dtype} allows)",
                remedy="the output projection applies more than a linear map to z", label=out_label)
        return result.to(z.dtype)

    inputs = tuple(dict.fromkeys((z_spec.inputs if z_spec.home_kind == "computed" else (z_spec.home,)) + (out_label,)))
    return torchlens.facets.computed_spec(compute, inputs, recipe_id=RECIPE_ID, address=call.address)


@torchlens.facets.recipe(predicate=is_attention, facets=ATTENTION_FACETS, recipe_id=RECIPE_ID, builtin=True)
def attention(module: Any) -> dict[str, Any]:
    trace = module._trace
    call = torchlens.facets.current_call(module)
    core = find_core(trace, call)
    if core is None:
        return {}
    n_heads, d_head = int(core.q.shape[-3]), int(core.q.shape[-1])
    kv_heads = int(core.k.shape[-3])
    out: dict[str, Any] = {
        "q": projection_spec(trace, call, core.q, n_heads, d_head, RECIPE_ID),
        "k": projection_spec(trace, call, core.k, kv_heads, d_head, RECIPE_ID),
        "v": projection_spec(trace, call, core.v, kv_heads, int(core.v.shape[-1]), RECIPE_ID),
    }
    z_spec = torchlens.facets.FacetSpec(home_kind="op", home=core.z.label, recipe_id=RECIPE_ID,
                                        address=call.address).transpose(-3, -2)
    out["z"] = z_spec
    if core.kind == "eager":
        out["pattern"] = torchlens.facets.FacetSpec(home_kind="op", home=core.op.label, recipe_id=RECIPE_ID,
                                                    address=call.address)
        out["scores"] = torchlens.facets.FacetSpec(home_kind="op", home=core.scores.label, recipe_id=RECIPE_ID,
                                                   address=call.address)
    else:
        op, needs = core.op, _needs(core.op)
        out["scores"] = torchlens.facets.computed_spec(lambda tr, op=op: _sdpa_checked(tr, tr._ops[op.label])[0],
                                                       _sdpa_inputs(op) + (op.label,), recipe_id=RECIPE_ID,
                                                       needs=needs, address=call.address)
        out["pattern"] = torchlens.facets.computed_spec(lambda tr, op=op: _sdpa_checked(tr, tr._ops[op.label])[1],
                                                        _sdpa_inputs(op) + (op.label,), recipe_id=RECIPE_ID,
                                                        needs=needs, address=call.address)
    out["result"] = _result_spec(trace, call, core, z_spec)
    return out


__all__ = ["attention", "find_core", "is_attention", "Core", "ATTENTION_FACETS"]


def _mha_ops(trace: Any, call: Any) -> dict[str, Any] | None:
    """The ops of one expanded `nn.MultiheadAttention` call with a packed in-projection:
    the in-projection, the softmax over `(batch * heads, q_pos, k_pos)` scores, the
    pattern @ V product, and the output projection."""
    own = own_ops(call)
    inproj = [o for o in own if any(a.endswith("in_proj_weight") for a in o.params)]
    outproj = [o for o in own if any(a.endswith("out_proj.weight") for a in o.params)]
    soft = [o for o in own if o.func_name in ("softmax", "_softmax") and o.shape is not None and len(o.shape) == 3]
    if len(inproj) != 1 or len(outproj) != 1 or len(soft) != 1:
        return None
    sm = soft[0]
    pv = [trace._ops[c] for c in sm.children if trace._ops[c].func_name in MATMULS]
    if len(pv) != 1 or not sm.parents:
        return None
    return {"in": inproj[0], "softmax": sm, "scores": trace._ops[sm.parents[0]], "pv": pv[0], "out": outproj[0]}


@torchlens.facets.recipe(class_qualname="MultiheadAttention", facets=ATTENTION_FACETS,
                         recipe_id=RECIPE_ID + ".multihead", builtin=True)
def multihead_attention(module: Any) -> dict[str, Any]:
    """`torch.nn.MultiheadAttention` (its composite forward recorded leaf by leaf): q/k/v
    from the packed in-projection `(pos, batch, 3 * d_model)`, the folded
    `(batch * heads, ...)` pattern and z unfolded to the TransformerLens layouts."""
    trace = module._trace
    call = torchlens.facets.current_call(module)
    found = _mha_ops(trace, call)
    if found is None:
        return {}
    rid = RECIPE_ID + ".multihead"
    T, B, E3 = (int(d) for d in found["in"].shape)
    BH, L, S = (int(d) for d in found["softmax"].shape)
    H = BH // B
    E = E3 // 3
    D = E // H
    spec = torchlens.facets.FacetSpec
    proj = spec(home_kind="op", home=found["in"].label, recipe_id=rid, address=call.address)
    out: dict[str, Any] = {name: proj.split(3, dim=-1)[i].heads(H, D).transpose(0, 1)
                           for i, name in enumerate(("q", "k", "v"))}
    out["pattern"] = spec(home_kind="op", home=found["softmax"].label, recipe_id=rid,
                          address=call.address).reshape(B, H, L, S)
    out["scores"] = spec(home_kind="op", home=found["scores"].label, recipe_id=rid,
                         address=call.address).reshape(B, H, L, S)
    z_spec = spec(home_kind="op", home=found["pv"].label, recipe_id=rid, address=call.address).reshape(
        B, H, L, D).transpose(1, 2)
    out["z"] = z_spec
    o = found["out"]
    w_addr = next(a for a in o.params if a.endswith("weight"))
    b_addr = next((a for a in o.params if a.endswith("bias")), None)

    def compute(tr: Any) -> Any:
        import torch

        z = torchlens.facets.value_of(tr, z_spec)  # (B, L, H, D)
        w = tr._params[w_addr].value  # (E_out, E_in): linear keeps (out, in)
        result = torch.einsum("blhd,hdm->blhm", _up(z), _up(w.t().reshape(H, D, -1).to(z.dtype)))
        bias = _up(tr._params[b_addr].value.to(z.dtype)) if b_addr else None
        total = result.sum(-2) + (bias if bias is not None else 0)
        magnitude = result.abs().sum(-2) + (bias.abs() if bias is not None else 0)
        captured = tr._ops[o.label].outs[0].reshape(L, B, -1).transpose(0, 1)  # rows are (pos, batch)
        err = _mismatch(total, captured, magnitude)
        if err is not None:
            raise torchlens.errors.FacetError("facet_reconstruction_mismatch", f"per-head results do not reproduce "
                                              f"{o.label} (off by {err:.3g}, beyond the rounding {captured.dtype} "
                                              "allows)", remedy="the output projection is not per-head", label=o.label)
        return result.to(z.dtype)

    out["result"] = torchlens.facets.computed_spec(compute, (found["pv"].label, o.label), recipe_id=rid,
                                                   address=call.address)
    return out
