"""The built-in `language_model_head` recipe (experimental): the facts a logit lens needs.

It matches a module with a conventional unembedding child (`lm_head`, `embed_out` or
`output_projection`, the spec's list) and anchors: `logits` (the head's output op),
`unembed_weight` / `unembed_bias` (the parameters the head op read), and the final norm
feeding the head, found structurally: the module call that outputs the value the head reads
(walking up across position selections such as `hidden[:, slice_indices, :]`, reshapes and
casts) and ran a normalisation (a `layer_norm` op, or an RMS norm's pow/mean/rsqrt chain) and
no projection, never by name. Non-tensor facts (`final_norm_kind`, `final_norm_eps`) are computed facets.
"""

from __future__ import annotations

from typing import Any

import torchlens

RECIPE_ID = "torchlens_torch.language_model_head"
HEAD_CHILDREN = ("lm_head", "embed_out", "output_projection")
HEAD_FACETS = ("logits", "unembed_weight", "unembed_bias", "final_norm_kind", "final_norm_eps", "final_norm_gamma",
               "final_norm_beta", "final_norm_input")


def _child(module: Any, name: str) -> str:
    return name if module.address == "self" else f"{module.address}.{name}"


def head_call(module: Any) -> Any:
    trace = module._trace
    for name in HEAD_CHILDREN:
        child = trace._modules.get(_child(module, name))
        if child is not None and len(child.calls) == 1 and any(o.params for o in child.calls[0].ops):
            return child.calls[0]
    return None


def is_lm_model(module: Any) -> bool:
    return head_call(module) is not None


CLASSIFIER_CHILDREN = ("classifier",)
CLASSIFIER_FACETS = ("logits", "classifier_weight", "classifier_bias", "pooled_position", "tower_address",
                     "final_norm_kind",
                     "final_norm_eps", "final_norm_gamma", "final_norm_beta", "final_norm_input")


def classifier_call(module: Any) -> Any:
    """The call of a linear classifier child that reads ONE token of a normalised sequence."""
    trace = module._trace
    for name in CLASSIFIER_CHILDREN:
        child = trace._modules.get(_child(module, name))
        if child is None or len(child.calls) != 1:
            continue
        call = child.calls[0]
        pops = [o for o in call.ops if o.params]
        if len(pops) == 1 and pops[0].func_name == "linear" and call.input_labels:
            return call
    return None


def _pooled_position(trace: Any, head: Any) -> tuple[int, Any] | None:
    """(token index, the op it was read from) when the classifier reads `x[:, i, :]`."""
    op = trace._ops[head.input_labels[0]]
    key = op.args_template[1] if op.func_name == "__getitem__" and op.args_template and len(op.args_template) > 1 \
        else None
    if not isinstance(key, tuple) or len(key) < 2 or not isinstance(key[1], int) or key[0] != slice(None):
        return None
    return key[1], trace._ops[op.parents[0]]


def is_classifier_model(module: Any) -> bool:
    call = classifier_call(module)
    return call is not None and _pooled_position(module._trace, call) is not None


def _norm_kind(call: Any) -> str | None:
    names = {op.func_name for op in call.ops}
    if "layer_norm" in names:
        return "layer_norm"
    if "rms_norm" in names or {"rsqrt", "mean"} <= names:
        return "rms_norm"
    return None


#: ops a head's input may pass through after the final norm without changing the feature axis: a
#: position selection (`hidden[:, slice_indices, :]`, HF's logits_to_keep), a reshape, a cast or copy
_THROUGH = frozenset({"__getitem__", "getitem", "view", "reshape", "contiguous", "to", "float", "type_as", "clone"})
_PROJECTIONS = frozenset({"linear", "matmul", "addmm", "mm", "bmm", "conv1d", "embedding"})


def _norm_call_of(trace: Any, op: Any) -> tuple[Any, str] | None:
    """(call, kind) of the innermost module call that OUTPUTS `op` and is a normalisation
    (a norm op, no projection or embedding op): a norm module, never a model that contains one."""
    address = op.module
    while address:
        mod = trace._modules.get(address)
        if mod is None:
            return None
        call = next((c for c in mod.calls if op.label in c.op_labels), None)
        if call is None or op.label not in call.output_labels:
            return None
        kind = _norm_kind(call)
        if kind is not None:
            if any(o.func_name in _PROJECTIONS for o in call.ops):
                return None
            return call, kind
        address = mod.parent
    return None


def _source(trace: Any, op: Any) -> str | None:
    """The parent op `op` reads its data from: the one its first argument refers to (an index
    tensor, as in `hidden[:, positions, :]`, is another parent), else its only parent."""
    args = op.args_template or ()
    ref = getattr(args[0], "index", None) if args else None
    if isinstance(ref, int) and 0 <= ref < len(op.parents):
        return op.parents[ref] if op.parents[ref] in trace._ops else None
    parents = [p for p in op.parents if p in trace._ops]
    return parents[0] if len(parents) == 1 else None


def final_norm(trace: Any, head: Any, op: Any = None) -> tuple[Any, str] | None:
    """(norm module call, kind) of the norm module whose output the head reads (or `op`, the
    value the head's input was read from), walking up across position selections, reshapes and
    casts that keep the feature axis (`_THROUGH`); None when the head does not read a norm."""
    if op is None and not head.input_labels:
        return None
    op = op if op is not None else trace._ops[head.input_labels[0]]
    seen = 0
    while op is not None and seen < 64:
        found = _norm_call_of(trace, op)
        if found is not None:
            return found
        source = _source(trace, op) if op.func_name in _THROUGH else None
        if source is None:
            return None
        parent = trace._ops[source]
        if not op.shape or not parent.shape or tuple(op.shape)[-1] != tuple(parent.shape)[-1]:
            return None
        op, seen = parent, seen + 1
    return None


def _eps(call: Any, kind: str) -> float | None:
    for op in call.ops:
        if kind == "layer_norm" and op.func_name == "layer_norm":
            kw = dict(op.kwargs_template or {})
            if "eps" in kw:
                return float(kw["eps"])
            floats = [a for a in (op.args_template or ())[2:] if isinstance(a, float)]
            return floats[-1] if floats else 1e-5
        if kind == "rms_norm":
            if op.func_name == "rms_norm":
                kw = dict(op.kwargs_template or {})
                return kw.get("eps")
            if op.func_name in ("add", "__add__") and op.parents and call._trace._ops[op.parents[0]].func_name == "mean":
                floats = [a for a in (op.args_template or ()) if isinstance(a, float)]
                if floats:
                    return floats[0]
    return None


def _norm_facets(trace: Any, found: Any, rid: str) -> dict[str, Any]:
    spec = torchlens.facets.FacetSpec
    call, kind = found
    eps = _eps(call, kind)
    params = [a for o in call.ops for a in o.params]
    gamma = next((a for a in params if len(trace._params[a].shape) == 1 and a.rsplit(".", 1)[-1] == "weight"),
                 params[0] if params else None)
    beta = next((a for a in params if a != gamma and len(trace._params[a].shape) == 1), None)
    out = {"final_norm_kind": torchlens.facets.computed_spec(lambda tr, k=kind: k, (), recipe_id=rid),
           "final_norm_eps": torchlens.facets.computed_spec(lambda tr, e=eps: e, (), recipe_id=rid)
           if eps is not None else None,
           "final_norm_gamma": spec(home_kind="parameter", home=gamma, recipe_id=rid, grad_capable=False)
           if gamma else None,
           "final_norm_beta": spec(home_kind="parameter", home=beta, recipe_id=rid, grad_capable=False)
           if beta and kind == "layer_norm" else None}
    if call.input_labels:
        out["final_norm_input"] = spec(home_kind="op", home=call.input_labels[0], recipe_id=rid, address=call.address)
    return out


CLASSIFIER_ID = "torchlens_torch.classification_head"


@torchlens.facets.recipe(predicate=is_classifier_model, facets=CLASSIFIER_FACETS, recipe_id=CLASSIFIER_ID,
                         builtin=True)
def classification_head(module: Any) -> dict[str, Any]:
    """A linear classifier reading one token of the final norm's output (ViT's [CLS])."""
    trace = module._trace
    head = classifier_call(module)
    pos, source = _pooled_position(trace, head)
    pop = [o for o in head.ops if o.params][0]
    weight = [a for a in pop.params if len(trace._params[a].shape) == 2]
    bias = [a for a in pop.params if len(trace._params[a].shape) == 1]
    spec = torchlens.facets.FacetSpec
    out: dict[str, Any] = {
        "logits": torchlens.facets.call_output_spec(head, CLASSIFIER_ID),
        "classifier_weight": spec(home_kind="parameter", home=weight[0], recipe_id=CLASSIFIER_ID, grad_capable=False),
        "classifier_bias": spec(home_kind="parameter", home=bias[0], recipe_id=CLASSIFIER_ID, grad_capable=False)
        if bias else None,
        "pooled_position": torchlens.facets.computed_spec(lambda tr, p=pos: p, (), recipe_id=CLASSIFIER_ID),
    }
    found = final_norm(trace, head, source)
    tower = trace._modules[found[0].address].parent if found is not None else None  # the module around the norm
    out["tower_address"] = torchlens.facets.computed_spec(lambda tr, a=tower or "self": a, (), recipe_id=CLASSIFIER_ID)
    if found is not None:
        out.update(_norm_facets(trace, found, CLASSIFIER_ID))
    return out


CONTRASTIVE_ID = "torchlens_torch.contrastive_image_head"
CONTRASTIVE_CHILDREN = ("visual_projection",)
CONTRASTIVE_FACETS = ("logits_per_image", "image_projection_weight", "text_features", "logit_scale", "pooled_position",
                      "tower_address", "image_features", "final_norm_kind", "final_norm_eps", "final_norm_gamma",
                      "final_norm_beta", "final_norm_input")


def contrastive_parts(module: Any) -> tuple[Any, Any, int, Any] | None:
    """(projection call, norm call found by final_norm, pooled token index, pooling op) of a
    CLIP-style image tower: a linear projection child reading a normalised ONE token of the
    tower's last hidden state (`post_layernorm(h[:, 0, :])`)."""
    trace = module._trace
    for name in CONTRASTIVE_CHILDREN:
        child = trace._modules.get(_child(module, name))
        if child is None or len(child.calls) != 1:
            continue
        call = child.calls[0]
        pops = [o for o in call.ops if o.params]
        if len(pops) != 1 or pops[0].func_name != "linear" or not call.input_labels:
            continue
        found = final_norm(trace, call)
        if found is None or not found[0].input_labels:
            continue
        pooled = _pooled_position(trace, found[0])  # the norm reads x[:, i, :]
        if pooled is None:
            continue
        return call, found, pooled[0], trace._ops[found[0].input_labels[0]]
    return None


def is_contrastive_model(module: Any) -> bool:
    return contrastive_parts(module) is not None


@torchlens.facets.recipe(predicate=is_contrastive_model, facets=CONTRASTIVE_FACETS, recipe_id=CONTRASTIVE_ID,
                         builtin=True)
def contrastive_image_head(module: Any) -> dict[str, Any]:
    """CLIP's contrastive image head: `logits_per_image` (the model's output), the image
    projection's weight, `text_features` (the text projection's output), `logit_scale`, the
    pooled token and the image tower's final norm; `tower_address` is the image tower (the
    lens projects only its blocks); `image_features` is the image projection's output before
    the contrastive normalisation (Hugging Face's `get_image_features`)."""
    trace = module._trace
    call, found, pos, pool = contrastive_parts(module)
    pop = [o for o in call.ops if o.params][0]
    weight = [a for a in pop.params if len(trace._params[a].shape) == 2]
    spec = torchlens.facets.FacetSpec
    scale = _child(module, "logit_scale")
    text = trace._modules.get(_child(module, "text_projection"))
    own = torchlens.facets.current_call(module)
    named = {n: (label, slot) for n, label, slot, _ in torchlens.facets.view.structural_rows(own)}
    lpi = named.get("logits_per_image")
    out: dict[str, Any] = {
        "logits_per_image": spec(home_kind="module_output", home=lpi[0], slot=lpi[1], recipe_id=CONTRASTIVE_ID,
                                 address=module.address, call=own.call) if lpi is not None else None,
        "image_features": torchlens.facets.call_output_spec(call, CONTRASTIVE_ID),
        "image_projection_weight": spec(home_kind="parameter", home=weight[0], recipe_id=CONTRASTIVE_ID,
                                        grad_capable=False) if weight else None,
        "text_features": torchlens.facets.call_output_spec(text.calls[0], CONTRASTIVE_ID)
        if text is not None and len(text.calls) == 1 else None,
        "pooled_position": torchlens.facets.computed_spec(lambda tr, p=pos: p, (), recipe_id=CONTRASTIVE_ID),
        "tower_address": torchlens.facets.computed_spec(lambda tr, a=pool.module: a, (), recipe_id=CONTRASTIVE_ID),
        "logit_scale": spec(home_kind="parameter", home=scale, recipe_id=CONTRASTIVE_ID, grad_capable=False)
        if scale in trace._params else None,
    }
    out.update(_norm_facets(trace, found, CONTRASTIVE_ID))
    return out


@torchlens.facets.recipe(predicate=is_lm_model, facets=HEAD_FACETS, recipe_id=RECIPE_ID, builtin=True)
def language_model_head(module: Any) -> dict[str, Any]:
    trace = module._trace
    head = head_call(module)
    pop = [o for o in head.ops if o.params][0]
    weight = [a for a in pop.params if len(trace._params[a].shape) == 2]
    bias = [a for a in pop.params if len(trace._params[a].shape) == 1]
    spec = torchlens.facets.FacetSpec
    out: dict[str, Any] = {
        "logits": torchlens.facets.call_output_spec(head, RECIPE_ID),
        "unembed_weight": spec(home_kind="parameter", home=weight[0], recipe_id=RECIPE_ID, grad_capable=False)
        if weight else None,
        "unembed_bias": spec(home_kind="parameter", home=bias[0], recipe_id=RECIPE_ID, grad_capable=False)
        if bias else None,
    }
    found = final_norm(trace, head)
    if found is not None:
        out.update(_norm_facets(trace, found, RECIPE_ID))
    return out


__all__ = ["language_model_head", "classification_head", "contrastive_image_head", "is_contrastive_model", "is_lm_model",
           "is_classifier_model", "final_norm",
           "HEAD_FACETS", "CLASSIFIER_FACETS"]
