"""`resolve_alias` / `alias_report`: other tools' names for a model's internals, resolved to
native coordinates of a trace with an honest status.

Generations (spellings):
- "tl2": TransformerLens HookedTransformer hook names (`hook_embed`, `blocks.3.hook_resid_pre`,
  `blocks.3.attn.hook_z`, `blocks.3.ln1.hook_scale`, `ln_final.hook_normalized`, ...).
- "tl3": the TransformerBridge canonical names (`embed.hook_out`, `blocks.3.hook_in`,
  `blocks.3.attn.hook_out`, `blocks.3.attn.q.hook_out`, `unembed.hook_out`, ...).
- "tl4": both of the above (the bridge generation keeps the legacy names as aliases of its
  canonical ones), plus `hook_unembed`.
- "nnterp": StandardizedTransformer accessors (`layers_input[3]`, `layers_output[3]`,
  `attentions_output[3]`, `mlps_input[3]`, `attention_probabilities[3]`, `logits`, ...).
- "interp-engine": point addresses (`resid_pre.3`, `resid_post.3`, `attn_out.3`,
  `mlp_act.3`, `embeddings`, `logits`, ...).

Status: "real" (a captured tensor read through a writable view), "reconstructed_read_only"
(computed from captured tensors: a fused kernel's pattern, per-head results, a LayerNorm's
scale or normalized value that the model never materialises), "needs_capture" (the payload
was not kept), "structurally_absent" (this architecture has no such value: resid_mid on a
parallel block, positional embeddings on a rotary model) or "ambiguous" (several native
values fit the name). Every non-real status carries a remedy. Coordinates come from the
captured graph and the facet recipes, never from module names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from torchlens.errors import MechInterpError
from torchlens_mechinterp import _sites

GENERATIONS = ("tl2", "tl3", "tl4", "nnterp", "interp-engine")
STATUSES = ("real", "reconstructed_read_only", "needs_capture", "structurally_absent", "ambiguous")

# name pattern -> target; "{L}" is the layer index
_TL_LEGACY = {
    "hook_embed": "embed", "hook_pos_embed": "pos_embed", "hook_tokens": "tokens",
    "blocks.{L}.hook_resid_pre": "resid_pre", "blocks.{L}.hook_resid_mid": "resid_mid",
    "blocks.{L}.hook_resid_post": "resid_post", "blocks.{L}.hook_attn_out": "attn_out",
    "blocks.{L}.hook_mlp_out": "mlp_out", "blocks.{L}.hook_mlp_in": "resid_mid_mlp_in",
    "blocks.{L}.hook_attn_in": "attn_in_per_head", "blocks.{L}.hook_q_input": "attn_in_per_head",
    "blocks.{L}.hook_k_input": "attn_in_per_head", "blocks.{L}.hook_v_input": "attn_in_per_head",
    "blocks.{L}.ln1.hook_scale": "ln1_scale", "blocks.{L}.ln1.hook_normalized": "ln1_normalized",
    "blocks.{L}.ln2.hook_scale": "ln2_scale", "blocks.{L}.ln2.hook_normalized": "ln2_normalized",
    "blocks.{L}.attn.hook_q": "q", "blocks.{L}.attn.hook_k": "k", "blocks.{L}.attn.hook_v": "v",
    "blocks.{L}.attn.hook_z": "z", "blocks.{L}.attn.hook_attn_scores": "scores",
    "blocks.{L}.attn.hook_pattern": "pattern", "blocks.{L}.attn.hook_result": "result",
    "blocks.{L}.attn.hook_rot_q": "rot_q", "blocks.{L}.attn.hook_rot_k": "rot_k",
    "blocks.{L}.mlp.hook_pre": "mlp_pre", "blocks.{L}.mlp.hook_pre_linear": "mlp_pre_linear",
    "blocks.{L}.mlp.hook_post": "mlp_post",
    "ln_final.hook_scale": "final_scale", "ln_final.hook_normalized": "final_normalized",
}
_TL_BRIDGE = {
    "embed.hook_out": "embed", "pos_embed.hook_out": "pos_embed", "unembed.hook_out": "logits",
    "unembed.hook_in": "final_out", "ln_final.hook_in": "final_in", "ln_final.hook_out": "final_out",
    "blocks.{L}.hook_in": "resid_pre", "blocks.{L}.hook_out": "resid_post",
    "blocks.{L}.ln1.hook_in": "resid_pre", "blocks.{L}.ln1.hook_out": "ln1_out",
    "blocks.{L}.ln2.hook_in": "resid_mid", "blocks.{L}.ln2.hook_out": "ln2_out",
    "blocks.{L}.attn.hook_in": "ln1_out", "blocks.{L}.attn.hook_out": "attn_out",
    "blocks.{L}.attn.q.hook_out": "q", "blocks.{L}.attn.k.hook_out": "k", "blocks.{L}.attn.v.hook_out": "v",
    "blocks.{L}.attn.o.hook_in": "z", "blocks.{L}.attn.hook_pattern": "pattern",
    "blocks.{L}.attn.hook_attn_scores": "scores",
    "blocks.{L}.mlp.hook_in": "ln2_out", "blocks.{L}.mlp.hook_out": "mlp_out",
    "blocks.{L}.mlp.in.hook_out": "mlp_pre", "blocks.{L}.mlp.out.hook_in": "mlp_post",
}
_NNTERP = {
    "token_embeddings": "embed", "logits": "logits", "embed_tokens": "embed",
    "layers_input[{L}]": "resid_pre", "layers_output[{L}]": "resid_post",
    "attentions_input[{L}]": "ln1_out", "attentions_output[{L}]": "attn_out",
    "mlps_input[{L}]": "ln2_out", "mlps_output[{L}]": "mlp_out",
    "attention_probabilities[{L}]": "pattern",
}
_INTERP_ENGINE = {
    "embeddings": "embed", "pos_embeddings": "pos_embed", "logits": "logits", "final_norm": "final_out",
    "resid_pre.{L}": "resid_pre", "resid_mid.{L}": "resid_mid", "resid_post.{L}": "resid_post",
    "attn_in.{L}": "ln1_out", "attn_out.{L}": "attn_out", "attn_pattern.{L}": "pattern",
    "attn_z.{L}": "z", "mlp_in.{L}": "ln2_out", "mlp_pre.{L}": "mlp_pre", "mlp_act.{L}": "mlp_post",
    "mlp_out.{L}": "mlp_out",
}
TABLES: dict[str, dict[str, str]] = {
    "tl2": _TL_LEGACY,
    "tl3": _TL_BRIDGE,
    "tl4": {**_TL_LEGACY, **_TL_BRIDGE, "hook_unembed": "logits"},
    "nnterp": _NNTERP,
    "interp-engine": _INTERP_ENGINE,
}


def _compile(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(re.escape("{L}"), r"(\d+)") + "$")


_COMPILED = {g: [(_compile(p), p, t) for p, t in table.items()] for g, table in TABLES.items()}


@dataclass(frozen=True)
class AliasResolution:
    """One alias resolved on one trace: the native coordinate (module address, facet or op
    label), its status and, when not real, a remedy. `.value` reads it (or refuses)."""

    alias: str
    generation: str
    target: str
    layer: int | None
    status: str
    module: str | None = None
    facet: str | None = None
    label: str | None = None
    reconstruction: str | None = None
    remedy: str = ""
    _reader: Any = field(default=None, repr=False, compare=False)

    @property
    def native(self) -> str:
        if self.facet is not None:
            return f"trace.modules[{self.module!r}].facets[{self.facet!r}]"
        if self.label is not None:
            return f"trace.ops[{self.label!r}]"
        return "-"

    @property
    def value(self) -> Any:
        if self.status not in ("real", "reconstructed_read_only") or self._reader is None:
            raise MechInterpError("mi_alias_unresolved", f"{self.alias!r} ({self.generation}) is {self.status} on "
                                  "this trace: no value to read", remedy=self.remedy or "see alias_report(trace)",
                                  alias=self.alias, status=self.status)
        return self._reader()


@dataclass(frozen=True)
class AliasReport:
    """Every alias of one generation for this trace's layers, each with its resolution."""

    generation: str
    rows: tuple[AliasResolution, ...]

    @property
    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.rows) for s in STATUSES}

    def by_status(self, status: str) -> list[AliasResolution]:
        return [r for r in self.rows if r.status == status]

    def __getitem__(self, alias: str) -> AliasResolution:
        for r in self.rows:
            if r.alias == alias:
                return r
        raise KeyError(alias)

    def __iter__(self) -> Any:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        lines = [f"alias report ({self.generation}): " + ", ".join(f"{k} {v}" for k, v in self.counts.items() if v)]
        for r in self.rows:
            extra = f"  [{r.remedy}]" if r.status not in ("real",) and r.remedy else ""
            lines.append(f"  {r.alias:<36} {r.status:<24} {r.native}{extra}")
        return "\n".join(lines)


def _parse(name: str, generation: str | None) -> tuple[str, str, int | None]:
    if generation is not None and generation not in GENERATIONS:
        raise MechInterpError("mi_alias_generation_unknown", f"generation={generation!r}",
                              remedy=f"use one of {', '.join(GENERATIONS)} (or None to detect)", generation=generation)
    if not isinstance(name, str):
        raise MechInterpError("mi_alias_unknown", f"an alias is a string, not {type(name).__name__}",
                              remedy="resolve_alias(trace, 'blocks.0.hook_resid_pre')", alias=repr(name))
    for gen in ([generation] if generation else ["tl4", "tl2", "tl3", "nnterp", "interp-engine"]):
        for rx, _pattern, target in _COMPILED[gen]:
            m = rx.match(name)
            if m:
                return gen, target, int(m.group(1)) if m.groups() else None
    raise MechInterpError("mi_alias_unknown", f"{name!r} is no {generation or 'known'} spelling",
                          remedy="alias_report(trace, generation=...) lists every spelling", alias=name,
                          generation=generation)


# ------------------------------------------------------------------------------ native lookup
class _Model:
    """The trace's structure found once: blocks, attention calls, MLP calls, norms, embeddings."""

    def __init__(self, trace: Any) -> None:
        from torchlens.facets.view import call_entries

        self.trace = trace
        order = {label: i for i, label in enumerate(trace._ops)}

        def first(c: Any) -> int:
            return min((order.get(lb, 0) for lb in c.op_labels), default=0)

        def having(name: str) -> list[Any]:
            out = []
            for module in trace._modules.values():
                for call in module.calls:
                    e = call_entries(call).get(name)
                    if e is not None and (e.spec is not None or e.status == "structurally_absent"):
                        out.append(call)
            return sorted(out, key=first)

        self.blocks = having("resid_post")
        self.attn = _sites.attention_calls(trace)
        self.mlps = having("post")
        head = [c for c in having("logits")]
        self.head = head[0] if len(head) == 1 else None
        self.embeddings = [o for o in trace._ops.values() if o.func_name == "embedding"]

    def entry(self, call: Any, name: str) -> Any:
        from torchlens.facets.view import call_entries

        return call_entries(call).get(name)


def _facet(m: _Model, alias: str, gen: str, target: str, layer: int | None, calls: list[Any], name: str,
           *, reconstructed: str | None = None) -> AliasResolution:
    if layer is None or layer >= len(calls):
        return AliasResolution(alias, gen, target, layer, "structurally_absent",
                               remedy=f"this model has {len(calls)} such layers")
    call = calls[layer]
    e = m.entry(call, name)
    if e is None or e.spec is None:
        return AliasResolution(alias, gen, target, layer, "structurally_absent", module=call.address,
                               remedy=(e.reason if e is not None else f"{call.address} declares no {name!r}") or
                               "this architecture has no such value")
    if e.status == "needs_capture":
        return AliasResolution(alias, gen, target, layer, "needs_capture", call.address, name,
                               remedy=e.reason or "capture again with save='all'")
    computed = e.spec.capability == "computed" or e.spec.home_kind == "computed"
    status = "reconstructed_read_only" if computed or reconstructed else "real"
    trace = m.trace
    return AliasResolution(alias, gen, target, layer, status, call.address, name,
                           reconstruction=reconstructed or ("recomputed from the tensors the kernel received"
                                                            if computed else None),
                           remedy="read-only: edit the real site it is computed from" if status != "real" else "",
                           _reader=lambda: _sites.value(trace, e.spec))


def _op(m: _Model, alias: str, gen: str, target: str, layer: int | None, label: str | None, module: str | None,
        absent: str) -> AliasResolution:
    if label is None:
        return AliasResolution(alias, gen, target, layer, "structurally_absent", module=module, remedy=absent)
    op = m.trace._ops[label]
    if not op.saved:
        return AliasResolution(alias, gen, target, layer, "needs_capture", op.module, label=label,
                               remedy=f"capture again with save='all' or save=[{label!r}]")
    return AliasResolution(alias, gen, target, layer, "real", op.module, label=label, _reader=lambda: op.out)


def _norm_input(m: _Model, call: Any) -> Any:
    """The op label of the normalised residual `call` (attention or MLP) reads: its one
    floating input of the residual's shape ([batch, pos, d_model])."""
    outs = [m.trace._ops[lb] for lb in call.output_labels if lb in m.trace._ops]
    width = outs[0].shape if outs and outs[0].shape is not None else None
    labels = []
    for lb in call.input_labels:
        op = m.trace._ops.get(lb)
        if op is None or op.shape is None or width is None:
            continue
        if tuple(op.shape) == tuple(width) and "float" in str(op.dtype):
            labels.append(lb)
    return labels[0] if len(labels) == 1 else None


def _layer_norm_parts(m: _Model, alias: str, gen: str, target: str, layer: int | None, norm_out: str | None,
                      part: str) -> AliasResolution:
    """TransformerLens's LayerNorm hook_scale / hook_normalized, reconstructed from the norm's
    captured input (the model computes them inside one layer_norm kernel)."""
    if norm_out is None:
        return AliasResolution(alias, gen, target, layer, "structurally_absent", remedy="no norm found here")
    op = m.trace._ops[norm_out]
    if op.func_name not in ("layer_norm", "rms_norm") and not op.parents:
        return AliasResolution(alias, gen, target, layer, "ambiguous", op.module, label=norm_out,
                               remedy="the norm is not one layer_norm op: read its input and output instead")
    if op.func_name not in ("layer_norm",):
        return AliasResolution(alias, gen, target, layer, "ambiguous", op.module, label=norm_out,
                               remedy=f"the norm is {op.func_name!r}, not a LayerNorm op; TransformerLens's "
                               f"{part} is defined for its own LayerNorm / RMSNorm: read the norm's input and output")
    parent = m.trace._ops[op.parents[0]]
    if not parent.saved:
        return AliasResolution(alias, gen, target, layer, "needs_capture", op.module, label=parent.label,
                               remedy=f"capture again with save=[{parent.label!r}]")
    eps = _layer_norm_eps(op)

    def read() -> Any:
        import torch

        x = parent.out
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        scale = torch.sqrt(var + eps)
        return scale if part == "scale" else (x - mean) / scale

    return AliasResolution(alias, gen, target, layer, "reconstructed_read_only", op.module, label=norm_out,
                           reconstruction=f"{part} of LayerNorm from {parent.label} (eps={eps})",
                           remedy="read-only: TransformerLens materialises it; this model computes it inside "
                           f"{op.label}", _reader=read)


def _layer_norm_eps(op: Any) -> float:
    kwargs = getattr(op, "kwargs_template", None) or {}
    if isinstance(kwargs.get("eps"), (int, float)):
        return float(kwargs["eps"])
    args = getattr(op, "args_template", None) or ()
    if len(args) >= 5 and isinstance(args[4], (int, float)):
        return float(args[4])
    return 1e-5


def _resolve(m: _Model, alias: str, gen: str, target: str, layer: int | None) -> AliasResolution:
    if target in ("resid_pre", "resid_mid", "resid_post"):
        return _facet(m, alias, gen, target, layer, m.blocks, target)
    if target == "resid_mid_mlp_in":
        r = _facet(m, alias, gen, target, layer, m.blocks, "resid_mid")
        return r
    if target in ("q", "k", "v", "z", "scores", "pattern", "result"):
        r = _facet(m, alias, gen, target, layer, m.attn, target)
        return r
    if target in ("rot_q", "rot_k"):
        site = _rotary_site(m, layer, target[-1])
        if site is None:
            return AliasResolution(alias, gen, target, layer, "structurally_absent",
                                   remedy="this attention applies no rotary embedding")
        r = _op(m, alias, gen, target, layer, site, m.attn[layer].address, "")
        if r.status != "real":
            return r
        op = m.trace._ops[site]
        return AliasResolution(alias, gen, target, layer, "real", r.module, label=site,
                               reconstruction=f"{site}.transpose(1, 2) ([batch, pos, head, d_head])",
                               _reader=lambda: op.out.transpose(1, 2))
    if target == "attn_out":
        if layer is None or layer >= len(m.attn):
            return AliasResolution(alias, gen, target, layer, "structurally_absent", remedy="no such layer")
        e = m.entry(m.attn[layer], "out")
        return _facet(m, alias, gen, target, layer, m.attn, "out" if e is not None else "out0")
    if target in ("mlp_out", "mlp_pre", "mlp_post", "mlp_pre_linear"):
        return _facet(m, alias, gen, target, layer, m.mlps, {"mlp_out": "out", "mlp_pre": "pre", "mlp_post": "post",
                                                                "mlp_pre_linear": "pre_linear"}[target])
    if target in ("ln1_out", "ln2_out", "ln1_scale", "ln1_normalized", "ln2_scale", "ln2_normalized",
                  "attn_in_per_head"):
        calls = m.attn if target.startswith(("ln1", "attn_in")) else m.mlps
        if layer is None or layer >= len(calls):
            return AliasResolution(alias, gen, target, layer, "structurally_absent", remedy="no such layer")
        norm_out = _norm_input(m, calls[layer])
        if target in ("ln1_out", "ln2_out"):
            return _op(m, alias, gen, target, layer, norm_out, calls[layer].address, "the module reads several inputs")
        if target == "attn_in_per_head":
            return _attn_in(m, alias, gen, target, layer)
        return _layer_norm_parts(m, alias, gen, target, layer, norm_out, target.split("_", 1)[1])
    if target in ("embed", "pos_embed", "tokens"):
        return _embedding(m, alias, gen, target)
    if target in ("logits", "final_in", "final_out", "final_scale", "final_normalized"):
        return _head(m, alias, gen, target)
    raise AssertionError(target)  # every table target is handled above


def _rotary_site(m: _Model, layer: int | None, side: str) -> str | None:
    """The op holding the rotated q (or k) of attention `layer`, or None when no rotary
    embedding is applied: a `mul` of the projection's heads by a factor independent of them
    (cos / sin), whose sum with its rotated-half partner (or the concatenation with the
    unrotated part) is what the attention core reads."""
    if layer is None or layer >= len(m.attn):
        return None
    call = m.attn[layer]
    e = m.entry(call, side)
    if e is None or e.spec is None or e.spec.home_kind == "computed" or e.spec.home not in m.trace._ops:
        return None
    inside = set(call.op_labels)
    from torchlens_mechinterp.patching import _descendants

    down = _descendants(m.trace, m.trace._ops[e.spec.home], inside)
    order = {lb: i for i, lb in enumerate(m.trace._ops)}
    for lb in sorted(down, key=order.get):
        op = m.trace._ops[lb]
        if op.func_name != "mul" or len(op.parents) != 2:
            continue
        independent = [p for p in op.parents if p not in down and p != e.spec.home]
        if len(independent) != 1:
            continue
        after = sorted(_descendants(m.trace, op, inside), key=order.get)
        for cand in after:
            c = m.trace._ops[cand]
            if c.func_name in ("add", "cat") and c.shape is not None and len(c.shape) == 4:
                q_shape = _sites.value(m.trace, e.spec).shape  # [b, pos, H, d]
                if tuple(c.shape) == (q_shape[0], q_shape[2], q_shape[1], q_shape[3]):
                    return cand
        return None
    return None


def _attn_in(m: _Model, alias: str, gen: str, target: str, layer: int) -> AliasResolution:
    r = _facet(m, alias, gen, target, layer, m.blocks, "resid_pre")
    if r.status != "real":
        return r
    n_heads = m.entry(m.attn[layer], "q")
    heads = int(_sites.value(m.trace, n_heads.spec).shape[-2]) if n_heads is not None and n_heads.spec else 1
    reader = r._reader
    return AliasResolution(alias, gen, target, layer, "reconstructed_read_only", r.module, "resid_pre",
                           reconstruction=f"resid_pre repeated over {heads} heads ([batch, pos, head, d_model])",
                           remedy="read-only: edit resid_pre", _reader=lambda: reader().unsqueeze(-2).expand(
                               *reader().shape[:-1], heads, reader().shape[-1]))


def _embedding(m: _Model, alias: str, gen: str, target: str) -> AliasResolution:
    trace = m.trace
    if target == "tokens":
        op = next((o for o in trace.input_ops if o.saved), None)
        if op is None:
            return AliasResolution(alias, gen, target, None, "needs_capture", remedy="capture with save='all'")
        return AliasResolution(alias, gen, target, None, "real", label=op.label, _reader=lambda: op.out)
    token, positional = [], []
    inputs = {o.label for o in trace.input_ops}
    for op in m.embeddings:
        chain, seen = list(op.parents), 0
        reaches_input = False
        while chain and seen < 4:
            p = chain.pop()
            seen += 1
            if p in inputs:
                reaches_input = True
                break
            chain.extend(trace._ops[p].parents if p in trace._ops else ())
        (token if reaches_input else positional).append(op)
    found = token if target == "embed" else positional
    if not found:
        return AliasResolution(alias, gen, target, None, "structurally_absent",
                               remedy="no learned positional embedding (rotary or none)" if target == "pos_embed"
                               else "no token embedding op found")
    if len(found) > 1:
        return AliasResolution(alias, gen, target, None, "ambiguous", remedy="several embedding ops: "
                               + ", ".join(o.label for o in found))
    return _op(m, alias, gen, target, None, found[0].label, found[0].module, "")


def _head(m: _Model, alias: str, gen: str, target: str) -> AliasResolution:
    if m.head is None:
        return AliasResolution(alias, gen, target, None, "structurally_absent",
                               remedy="no language-model head recipe matched (or several)")
    if target == "logits":
        return _facet(m, alias, gen, target, 0, [m.head], "logits")
    if target == "final_in":
        out = _final_norm_output(m)
        parent = _norm_module_input(m, out)
        return _op(m, alias, gen, target, None, parent, None, "the final norm reads no single residual input")
    norm_out = _final_norm_output(m)
    if target == "final_out":
        return _op(m, alias, gen, target, None, norm_out, None, "the final norm is not one norm op")
    return _layer_norm_parts(m, alias, gen, target, None, norm_out, target.split("_", 1)[1])


def _norm_module_input(m: _Model, norm_out: str | None) -> str | None:
    """The residual a norm reads: the layer_norm op's input, or the input of the module call
    whose output `norm_out` is (an RMSNorm written as several ops)."""
    if norm_out is None:
        return None
    op = m.trace._ops[norm_out]
    if op.func_name == "layer_norm":
        return op.parents[0]
    for module in m.trace._modules.values():
        for call in module.calls:
            if norm_out in call.output_labels:
                ins = [lb for lb in call.input_labels if lb in m.trace._ops and "float" in str(m.trace._ops[lb].dtype)]
                if len(ins) == 1:
                    return ins[0]
    return None


_PASS = ("__getitem__", "view", "reshape", "contiguous", "to", "clone", "dropout")


def _final_norm_output(m: _Model) -> str | None:
    """The op the unembedding reads, walked back from the logits through value-preserving
    ops (a last-position slice, a view): the final norm's output."""
    e = m.entry(m.head, "logits")
    if e is None or e.spec is None or e.spec.home not in m.trace._ops:
        return None
    op = m.trace._ops[e.spec.home]
    for _ in range(8):
        if op.func_name in ("output",) or op.kind == "output" or op.func_name in _PASS or op.func_name in (
                "linear", "matmul", "addmm"):
            floating = [m.trace._ops[p] for p in op.parents if p in m.trace._ops and "float" in str(
                m.trace._ops[p].dtype) and not m.trace._ops[p].is_source]
            if len(floating) != 1:
                return None
            op = floating[0]
            if op.func_name in ("layer_norm", "rms_norm") or (op.module and op.func_name not in _PASS
                                                               and op.func_name not in ("linear",)):
                return op.label
            continue
        return op.label
    return None


# ------------------------------------------------------------------------------------- public
def resolve_alias(trace: Any, name: str, generation: str | None = None) -> AliasResolution:
    """Resolve one alias (spelling detected when `generation` is None) on `trace`."""
    gen, target, layer = _parse(name, generation)
    return _resolve(_Model(trace), name, gen, target, layer)


def alias_report(trace: Any, generation: str = "tl4") -> AliasReport:
    """Every spelling of `generation` for this trace's layers, each resolved with its status."""
    if generation not in GENERATIONS:
        raise MechInterpError("mi_alias_generation_unknown", f"generation={generation!r}",
                              remedy=f"use one of {', '.join(GENERATIONS)}", generation=generation)
    m = _Model(trace)
    n_layers = max(len(m.blocks), len(m.attn), len(m.mlps))
    rows = []
    for pattern, target in TABLES[generation].items():
        names = [pattern.replace("{L}", str(i)) for i in range(n_layers)] if "{L}" in pattern else [pattern]
        for name in names:
            layer = int(re.search(r"(\d+)", name).group(1)) if "{L}" in pattern else None
            rows.append(_resolve(m, name, generation, target, layer))
    return AliasReport(generation, tuple(rows))


__all__ = ["resolve_alias", "alias_report", "AliasResolution", "AliasReport", "GENERATIONS", "STATUSES", "TABLES"]
