"""`tl.sweep`: one intervened capture per swept replacement value."""

from __future__ import annotations

from typing import Any, Callable, Iterable


def sweep(model: Any, inputs: Any, site: Any, values: Iterable[Any], *, edit: Callable[[Any], Any] | None = None,
          save: Any = "all", loss: Callable[[Any], Any] | None = None, **trace_kwargs: Any) -> list[Any]:
    """Capture `model(inputs)` once per value, with `site` set to that value.

    `edit` turns a value into an edit (default `tl.replace_with`, so a scalar fills the
    site); `loss=` (a callable of each returned trace) runs its backward in the same call:
    `t.backward(loss(t))`, so it returns what the backend's backward takes (a loss tensor on
    torch; on JAX, whose arrays carry no graph, a function of the model output:
    `loss=lambda t: lambda out: out.sum()`). `loss=` needs a gradient site (`tl.grad(...)`);
    on a forward site it raises `do_loss_without_gradient_site` before any capture, as
    `Trace.do(..., loss=)` does. Returns the traces in the order of `values`.
    """
    import torchlens as tl
    from torchlens.errors import InterventionError

    if loss is not None and not callable(loss):  # refused before the first capture runs
        raise InterventionError("do_loss_not_callable", "loss= takes a callable of the returned trace",
                                remedy="loss=lambda t: t.output.sum()")
    if loss is not None:  # glossary: loss= on a plan with no gradient site refuses, before any capture
        from torchlens.intervention.verbs import _is_grad

        if not _is_grad(site):
            raise InterventionError("do_loss_without_gradient_site",
                                    f"loss= was given but the swept site {site!r:.80} is not a gradient site",
                                    remedy="sweep tl.grad(site) to edit what flows back, or drop loss= and call "
                                    "t.backward(...) on each returned trace")
    make = edit or tl.replace_with
    args = tuple(inputs) if isinstance(inputs, tuple) else (inputs,)
    out = []
    for v in values:
        t = tl.trace(model, *args, save=save, intervene=tl.when(site, make(v)), **trace_kwargs)
        if loss is not None:
            t.backward(loss(t))
        out.append(t)
    return out
