"""`tl.trace`: pick a backend, guard against reentrancy, capture."""

from __future__ import annotations

import threading
from typing import Any

from torchlens.errors import InvalidArgumentError, ReentrantTraceError
from torchlens.options import CaptureOptions

_state = threading.local()


def trace(model: Any, *args: Any, save: Any = "all", capture: CaptureOptions | None = None,
          backend: str | None = None, input_kwargs: dict[str, Any] | None = None, **trace_options: Any) -> Any:
    """Record every operation `model(*args, **input_kwargs)` executes and return a `Trace`.

    `save` chooses payloads: `"all"` (default), `"none"` (structure only), a selector, or a
    list of labels / module addresses. `capture` carries `CaptureOptions`. `backend` names a
    backend; by default the first registered backend whose framework is already imported
    and that says it can handle `model` is used.
    """
    import gc

    # The cyclic collector is paused for the whole call (capture, build, stamps): a capture
    # allocates many small objects and the collector would otherwise walk them repeatedly.
    # Reference counting still frees everything acyclic; a caller's disabled collector stays off.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _trace(model, args, save, capture, backend, input_kwargs, trace_options)
    finally:
        if was_enabled:
            gc.enable()


def _trace(model: Any, args: tuple, save: Any, capture: CaptureOptions | None, backend: str | None,
           input_kwargs: dict[str, Any] | None, trace_options: dict[str, Any]) -> Any:
    from torchlens.backends.registry import select_backend

    _refuse_class(model)
    removed = sorted(k for k in ("keep_op", "keep_module") if k in trace_options)
    if removed:
        raise TypeError(f"trace() got an unexpected keyword argument {removed[0]!r}: it was removed; "
                        "choose payloads with save= (a selector, a list of labels or module addresses)")
    if capture is not None and not isinstance(capture, CaptureOptions):
        raise InvalidArgumentError("invalid_argument", f"capture= takes a CaptureOptions, not {type(capture).__name__}",
                                   remedy="capture=tl.options.CaptureOptions(...)")
    if input_kwargs is not None and not isinstance(input_kwargs, dict):
        raise InvalidArgumentError("invalid_argument", "input_kwargs= takes a dict", remedy="input_kwargs={'mask': m}")
    if getattr(_state, "active", False):
        raise ReentrantTraceError("reentrant_trace", "tl.trace was called while another capture is running in this thread",
                                  remedy="finish the outer capture first; trace the inner model separately")
    kwargs = dict(input_kwargs or {})
    proto = select_backend(model, args, kwargs, backend)
    reduce_to_stats = isinstance(save, str) and save == "stats"  # issue 23 reduce and discard (stats/reduce.py)
    fold_offer = None
    if reduce_to_stats:
        from torchlens.backends.sdk_stats import StatsFoldOffer

        save = "all"
        fold_offer = StatsFoldOffer()  # a backend that takes it folds each op's out during the forward
    intervene = trace_options.pop("intervene", None)
    on_zero_fire = trace_options.pop("on_zero_fire", "warn")
    facets = trace_options.pop("facets", None)  # recipes only this trace sees (issue 15); the backend never sees it
    if facets is not None and not isinstance(facets, (list, tuple)):
        from torchlens.errors import FacetError

        raise FacetError("facet_registration_invalid", f"facets= takes a list of recipes, not {type(facets).__name__}",
                         remedy="facets=[my_recipe]")
    if facets:
        from torchlens.facets.registry import snapshot

        snapshot(facets)  # a bad recipe refuses before the model runs
    check_requested_capabilities(proto, capture, {**trace_options, **({"intervene": intervene} if intervene is not None else {})},
                                 live_interventions=True, model=model)
    _state.active = True
    try:
        if intervene is not None:
            from torchlens.build.save import save_plan
            from torchlens.intervention.live import live_capture
            from torchlens.intervention.recipe import Recipe
            from torchlens.options import InterventionOptions

            InterventionOptions(on_zero_fire=on_zero_fire)
            save_plan(save)
            if not isinstance(intervene, Recipe):
                raise InvalidArgumentError("invalid_argument", f"intervene= takes a tl.Recipe, not {type(intervene).__name__}",
                                           remedy="intervene=tl.when(site, tl.zero_ablate())")
            result = live_capture(proto, model, args, kwargs, intervene, save=save, capture=capture or CaptureOptions(),
                                  on_zero_fire=on_zero_fire, trace_options=trace_options)
        elif fold_offer is not None:
            with fold_offer:
                result = proto.capture(model, args, kwargs, save=save, capture=capture or CaptureOptions(), **trace_options)
        else:
            result = proto.capture(model, args, kwargs, save=save, capture=capture or CaptureOptions(), **trace_options)
    finally:
        _state.active = False
    from torchlens.build.save import check_saved_matches

    check_saved_matches(result, save, proto.name)
    check_save_budget(result, capture)
    if reduce_to_stats:
        from torchlens.stats.reduce import reduce_trace

        reduce_trace(result, fold_offer)
    _stamp_identity(result, proto, args, kwargs)
    from torchlens.facets.registry import stamp  # the trace's immutable facet-registry snapshot (loads no recipe)

    stamp(result, facets)
    if capture is not None and getattr(capture, "snapshot_params", False):
        from torchlens.bundle.guard import take_capture_snapshot  # the parameters this forward read, for Bundle checks

        take_capture_snapshot(result, capture)
    return result


def _stamp_identity(result: Any, proto: Any, args: tuple, kwargs: dict) -> None:
    """Provenance identity facts (fingerprint, input signature, lazy full parameter hash)."""
    from torchlens.replay.params import changed_params
    from torchlens.records.identity import stamp_identity
    from torchlens.records.trace import Trace

    if isinstance(result, Trace):
        stamp_identity(result, proto, args, kwargs, changed_params)


def _refuse_class(model: Any) -> None:
    """`tl.trace(SomeModel, x)` with the class, not an instance: say "instantiate it"."""
    if isinstance(model, type):
        name = f"{model.__module__}.{model.__qualname__}"
        raise InvalidArgumentError(
            "model_type_unsupported", f"tl.trace got the class {name}, not a model: instantiate it first",
            remedy=f"model = {model.__qualname__}(...); tl.trace(model, x)", model_type=name, is_class=True)


def forward_keywords(model: Any) -> tuple[str, ...]:
    """The named parameters of the model's forward (`forward` for a module, else `__call__`,
    else the callable itself), read with `inspect` (runs no model code); () if unknown."""
    import inspect

    candidates = [getattr(model, "forward", None)]
    if not inspect.isroutine(model):
        candidates.append(getattr(model, "__call__", None))
    candidates.append(model)
    for fn in candidates:
        if fn is None or not callable(fn):
            continue
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            continue
        named = tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        if named:
            return named
    return ()


def _forward_name(model: Any) -> str:
    import inspect

    if inspect.isroutine(model):
        return f"{getattr(model, '__qualname__', getattr(model, '__name__', 'the model'))}()"
    owner = type(model).__qualname__
    return f"{owner}.forward()" if callable(getattr(model, "forward", None)) else f"{owner}.__call__()"


def check_save_budget(result: Any, capture: CaptureOptions | None) -> None:
    """Refuse a capture whose kept payloads exceed `CaptureOptions.save_budget`."""
    budget = None if capture is None else capture.save_budget
    if budget in ("auto", None):
        return
    kept = sum(op.nbytes for op in result._ops.values() if op.saved and op.kind != "output")
    if kept > budget:
        from torchlens.errors import SaveBudgetExceededError

        raise SaveBudgetExceededError("save_budget_exceeded", f"the capture kept {kept} payload bytes; the budget is {budget}",
                                      remedy="raise save_budget=, or keep less with save= (a selector or 'none')",
                                      kept_bytes=kept, budget=budget)


#: Keywords core itself handles for every backend (intervene= needs the interventions capability).
CORE_TRACE_OPTIONS: tuple[str, ...] = ("intervene", "on_zero_fire", "facets")

#: Entry-point keywords of tl.trace a backend declares in trace_options() or refuses.
#: (`facets=` is not one: core handles it for every backend, see `trace`.)
PUBLIC_TRACE_OPTIONS: tuple[str, ...] = (
    "stop_after", "storage", "narrate", "episode", "chunk_paths", "input_shape",
    "structure_only", "fastlog", "grad_options", "replay_rng", "materialize_payloads",
)

#: trace option -> the capability flag it requests (refused with that flag's code when False).
OPTION_CAPABILITY: dict[str, str] = {
    "intervene": "interventions",
    "storage": "streaming",
    "structure_only": "structure_only_capture",
    "fastlog": "fastlog",
    "grad_options": "intermediate_derived_grads",
    "replay_rng": "rng_replay",
    "materialize_payloads": "payload_materialization",
}


def check_requested_capabilities(proto: Any, capture: CaptureOptions | None, options: dict[str, Any],
                                 live_interventions: bool = False, model: Any = None) -> None:
    """Refuse, before any framework call, what the backend declares it cannot do. With
    `model`, an unknown option that names an input of the model's forward says to pass it
    in `input_kwargs=`."""
    from torchlens.backends.codes import CAPABILITY_REFUSALS
    from torchlens.errors import BackendUnsupportedError

    caps = proto.capabilities()
    if capture is not None and capture.seed is not None and proto.maturity == "preview":
        raise BackendUnsupportedError("explicit_seed_unsupported", f"seed= on the preview {proto.name} backend",
                                      remedy="seed the framework's own random streams (or pass explicit keys) yourself",
                                      backend=proto.name)
    if capture is not None and (capture.backward_ready or capture.save_grads) and not caps.backward_capture:
        raise BackendUnsupportedError(CAPABILITY_REFUSALS["backward_capture"],
                                      f"the {proto.name} backend cannot capture gradients",
                                      remedy="drop backward_ready/save_grads or use the torch backend", backend=proto.name)
    declared = set(proto.trace_options())
    for name in options:
        flag = OPTION_CAPABILITY.get(name)
        if flag is not None and not getattr(caps, flag):
            raise BackendUnsupportedError(CAPABILITY_REFUSALS[flag], f"the {proto.name} backend declares {flag}=False ({name}=)",
                                          remedy=f"drop {name}= for this backend", backend=proto.name, option=name)
        if name == "intervene" and live_interventions:
            continue  # core applies recipes through the backend's _edit_plan option
        if name not in declared:
            options_text = ", ".join(sorted(declared | {"save", "capture"}))
            named_options = set(PUBLIC_TRACE_OPTIONS) | set(CORE_TRACE_OPTIONS)
            inputs = {k for k in options if k not in declared and k not in named_options}
            if model is not None and name in inputs and name in forward_keywords(model):
                given = ", ".join(f"{k!r}: ..." for k in sorted(inputs & set(forward_keywords(model))))
                raise BackendUnsupportedError(
                    "trace_option_unsupported",
                    f"{name!r} is an input of {_forward_name(model)}, not a trace option of the {proto.name} backend",
                    remedy=f"pass the model's keyword inputs in input_kwargs=: tl.trace(model, input_kwargs={{{given}}}) "
                           f"(trace options: {options_text})",
                    backend=proto.name, option=name, model_input=True)
            raise BackendUnsupportedError("trace_option_unsupported", f"the {proto.name} backend has no trace option {name!r}",
                                          remedy=f"its options: {options_text}",
                                          backend=proto.name, option=name)


def capture_active() -> bool:
    """True while a `tl.trace` capture runs in this thread."""
    return bool(getattr(_state, "active", False))
