"""`tl.facets.patching`: activation and attribution patching over facets (experimental).

Each helper traces the clean and the corrupted input, then, for every component, reruns
the corrupted input with the clean component's facet slice written into its home op (the
facet-edit scatter-back path, `fork` + `do(..., model=, inputs=)`), and reads the metric.
`metric(trace) -> scalar` receives the patched Trace. Results are NumPy float64 arrays.

Head patching writes the `z` facet's head slice by default: a head's `result`
contribution is linear in its `z` slice, so patching z head h patches exactly that head's
contribution (and `result` itself is a computed, read-only facet).

Attribution patching is the linear approximation
`grad(metric wrt corrupted component) * (clean component - corrupted component)`, summed
over the component's dimensions, read through `facet.grad` on a corrupted trace captured
with gradients.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from torchlens.errors import FacetError


def _scalar(v: Any) -> float:
    if hasattr(v, "detach"):
        v = v.detach()
    return float(v)


def _patch_run(corrupt: Any, model: Any, inputs: Any, spec: Any, value: Any, metric: Callable) -> float:
    """Rerun `inputs` with the region `spec` names replaced by `value`; the metric of it."""
    from torchlens.intervention.edits import Edit, fire, replace_with

    user = replace_with(value)

    def fn(v: Any, ctx: Any) -> Any:
        return spec.scatter_update(v, fire(user, spec.read(v), ctx), ctx.ops)

    fork = corrupt.fork("patched")
    fork.do({spec.home: Edit(f"facet:{user.name}", tuple(user.kwargs), fn, tensors=(value,))}, model=model,
            inputs=inputs)
    return _scalar(metric(fork))


def _writable(spec: Any, what: str) -> Any:
    if not spec.writable:
        raise FacetError("facet_write_refused", f"{what}: a {spec.capability} facet cannot be patched",
                         remedy="patch an op-anchored facet (z, resid_pre, out)", capability=spec.capability)
    return spec


def _traces(model: Any, clean_tokens: Any, corrupted_tokens: Any) -> tuple[Any, Any]:
    from torchlens.capture import trace

    return trace(model, clean_tokens), trace(model, corrupted_tokens)


def activation_patch_attention_heads(model: Any, clean_tokens: Any, corrupted_tokens: Any, metric: Callable, *,
                                     facet: str = "z") -> np.ndarray:
    """[layer, head]: the metric with each attention head's `facet` slice patched from clean."""
    from torchlens.facets.view import FacetView, head_spec

    clean, corrupt = _traces(model, clean_tokens, corrupted_tokens)
    rows = []
    for block in corrupt.attention_blocks():
        view = FacetView(block.calls[0])
        clean_view = clean.modules[block.address].facets
        n_heads = int(view[facet].shape[-2])
        row = []
        for h in range(n_heads):
            spec = _writable(head_spec(view, facet, h), f"head {h} of {facet}")
            clean_head = head_spec(clean_view, facet, h)
            row.append(_patch_run(corrupt, model, corrupted_tokens, spec, clean_head.read(_home(clean, clean_head)),
                                  metric))
        rows.append(row)
    return np.asarray(rows, dtype=np.float64)


def _home(trace: Any, spec: Any) -> Any:
    from torchlens.facets.view import home_value

    return home_value(trace, spec)


def activation_patch_attention_output(model: Any, clean_tokens: Any, corrupted_tokens: Any,
                                      metric: Callable) -> np.ndarray:
    """[layer]: each attention module's output (`out`, or `out0`) patched from clean."""
    clean, corrupt = _traces(model, clean_tokens, corrupted_tokens)
    out = []
    for block in corrupt.attention_blocks():
        name = "out" if "out" in block.facets else "out0"
        spec = _writable(block.facets[name].spec, name)
        out.append(_patch_run(corrupt, model, corrupted_tokens, spec, clean.modules[block.address].facets[name].value,
                              metric))
    return np.asarray(out, dtype=np.float64)


def activation_patch_mlp_output(model: Any, clean_tokens: Any, corrupted_tokens: Any, metric: Callable) -> np.ndarray:
    """[layer]: each MLP's output (the built-in MLP facet family's `out`) patched from clean."""
    clean, corrupt = _traces(model, clean_tokens, corrupted_tokens)
    mlps = corrupt.modules_with_facet("post")
    out = []
    for m in mlps:
        spec = _writable(m.facets["out"].spec, "out")
        out.append(_patch_run(corrupt, model, corrupted_tokens, spec, clean.modules[m.address].facets["out"].value,
                              metric))
    return np.asarray(out, dtype=np.float64)


def activation_patch_residual_stream(model: Any, clean_tokens: Any, corrupted_tokens: Any, metric: Callable, *,
                                     facet: str = "resid_pre", per_position: bool = True) -> np.ndarray:
    """[layer, pos] (or [layer] with per_position=False): the block's residual facet patched
    from clean, one position at a time along axis 1."""
    clean, corrupt = _traces(model, clean_tokens, corrupted_tokens)
    rows = []
    for block in corrupt.modules_with_facet(facet):
        spec = _writable(block.facets[facet].spec, facet)
        clean_value = clean.modules[block.address].facets[facet].value
        if not per_position:
            rows.append(_patch_run(corrupt, model, corrupted_tokens, spec, clean_value, metric))
            continue
        n_pos = int(block.facets[facet].shape[1])
        rows.append([_patch_run(corrupt, model, corrupted_tokens, spec.select(1, p), spec.select(1, p).read(
            _home(clean, spec)), metric) for p in range(n_pos)])
    return np.asarray(rows, dtype=np.float64)


def attribution_patch_attention_heads(model: Any, clean_tokens: Any, corrupted_tokens: Any, metric: Callable, *,
                                      facet: str = "z") -> np.ndarray:
    """[layer, head]: sum over (batch, pos, d_head) of grad(metric wrt the corrupted head
    slice) * (clean slice - corrupted slice), from one corrupted forward/backward."""
    from torchlens.capture import trace
    from torchlens.facets.view import MissingGrad
    from torchlens.options import CaptureOptions

    clean = trace(model, clean_tokens)
    corrupt = trace(model, corrupted_tokens, capture=CaptureOptions(backward_ready=True, save_grads=True))
    corrupt.backward(metric(corrupt))
    rows = []
    for block in corrupt.attention_blocks():
        f = block.facets[facet]
        g = f.grad
        if isinstance(g, MissingGrad):
            raise FacetError("facet_grad_unavailable", f"attribution patching needs {facet}'s gradient in "
                             f"{block.address!r}: {g.reason}", remedy=g.recapture, facet=facet, module=block.address)
        diff = clean.modules[block.address].facets[facet].value - f.value
        prod = g * diff  # [batch, pos, head, d_head]
        per_head = prod.sum(-1).sum(1).sum(0)
        rows.append([_scalar(v) for v in per_head])
    return np.asarray(rows, dtype=np.float64)


__all__ = ["activation_patch_attention_heads", "activation_patch_attention_output", "activation_patch_mlp_output",
           "activation_patch_residual_stream", "attribution_patch_attention_heads"]
