"""`tl.record` and `tl.recording.Recorder`: sparse recording over one or several forwards.

Each forward runs through `tl.trace`'s own capture path (backend selection, capability
checks, the backend's event stream, core's builder, `save=` enforcement), so a recording's
passes are grouped and labelled exactly as `tl.trace` groups them; the recorder keeps the
records and only the payloads `save=` selected. `stop_after=` ends a forward right after a
site (outcome STOPPED); `on_forward_error=` keeps a failed forward's prefix as a failed
partial recording. `generate_kwargs=` hands the whole `generate()` to the backend's
generation driver (`torchlens.recording.generation`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torchlens.errors import InvalidArgumentError, RecordingError, TorchLensError
from torchlens.options import CaptureOptions, RecordingOptions
from torchlens.recording.recording import Recording, RecordingPass, make_recording, records_from_trace
from torchlens.recording.settings import RecordingSettings

class _StopCapture(Exception):
    """Raised inside the forward by the `stop_after=` edit (never escapes the recorder)."""

    def __init__(self, label: str | None, value: Any) -> None:
        super().__init__(label)
        self.label = label
        self.value = value


class Recorder:
    """One recorder, several forwards: `rec = Recorder(model, save=...)`, then `rec(x)` per
    forward (returns the model's output), then `rec.recording`.

    Keywords are `tl.record`'s: `save=` (a selector, labels or module addresses; default: none,
    or everything with `RecordingOptions(default_op=True)`), `capture=CaptureOptions(...)`
    (detached payloads by default), `recording=RecordingOptions(...)`, `backend=`,
    `stop_after=` (a site or selector), `intervene=` (a `tl.Recipe`).
    """

    def __init__(self, model: Any, *, save: Any = None, capture: CaptureOptions | None = None,
                 recording: RecordingOptions | None = None, backend: str | None = None, stop_after: Any = None,
                 intervene: Any = None, storage: Any = None, narrate: Any = None, episode: Any = None) -> None:
        if episode is not None:
            raise RecordingError("record_episode_unsupported", "tl.record does not capture episodes",
                                 remedy="capture episodes with tl.trace(model, x, episode=...)")
        for name, value in (("storage", storage), ("narrate", narrate)):
            if value is not None:
                raise RecordingError("record_option_unsupported", f"tl.record({name}=...) is not supported yet",
                                     remedy=f"drop {name}=", option=name)
        if recording is None:
            recording = RecordingOptions()
        if not isinstance(recording, RecordingOptions):
            raise InvalidArgumentError("recording_option_invalid", f"recording= takes a RecordingOptions, not "
                                       f"{type(recording).__name__}", remedy="recording=tl.options.RecordingOptions(...)")
        if capture is not None and not isinstance(capture, CaptureOptions):
            raise InvalidArgumentError("invalid_argument", f"capture= takes a CaptureOptions, not {type(capture).__name__}",
                                       remedy="capture=tl.options.CaptureOptions(...)")
        forward_error = recording.on_forward_error  # "raise", "attach_partial" or "return_partial" (checked there)
        if capture is None:
            capture = CaptureOptions(detach_saved_activations=True)  # a recording's payloads are detached by default
        elif capture.detach_saved_activations and capture.backward_ready:
            raise RecordingError("backward_ready_conflict", "detach_saved_activations=True with backward_ready=True: "
                                 "detached payloads cannot carry a backward",
                                 remedy="drop one of them (detach_saved_activations=False keeps payloads attached)")
        if recording.default_grad and not (capture.backward_ready or capture.save_grads):
            capture = dataclasses.replace(capture, backward_ready=True, detach_saved_activations=False)
        if save is None:
            save = "all" if recording.default_op else "none"
        from torchlens.build.save import save_plan

        save_plan(save)  # a malformed save= refuses before anything runs
        if intervene is not None:
            from torchlens.intervention.recipe import Recipe

            if not isinstance(intervene, Recipe):
                raise InvalidArgumentError("invalid_argument", f"intervene= takes a tl.Recipe, not {type(intervene).__name__}",
                                           remedy="intervene=tl.when(site, tl.zero_ablate())")
            if stop_after is not None:
                raise RecordingError("record_option_unsupported", "stop_after= together with intervene= is not "
                                     "supported yet", remedy="record in two calls", option="stop_after+intervene")
        if stop_after is not None:
            _stop_selector(stop_after)  # checked before anything runs
        self._model = model
        self._save = save
        self._capture = capture
        self._options = recording
        self._backend = backend
        self._stop_after = stop_after
        self._intervene = intervene
        self._on_forward_error = forward_error
        self._gradients = bool(capture.backward_ready or capture.save_grads or recording.default_grad)
        self._passes: list[RecordingPass] = []
        self._backend_name = "?"
        self._inference_only: bool | None = None
        self._status = "complete"
        self._failure: dict[str, Any] = {}
        self._settings = RecordingSettings._make(capture, recording, keep_op=save, intervene=intervene,
                                                 stop_after=stop_after, storage=storage, narrate=narrate)

    @property
    def settings(self) -> RecordingSettings:
        return self._settings

    def __call__(self, *args: Any, input_kwargs: dict[str, Any] | None = None) -> Any:
        """Run one recorded forward of the model on `args` (and `input_kwargs`) and return
        its output (None when `stop_after=` stopped it). A failed forward raises (or, with
        `on_forward_error="return_partial"`, ends the recording and returns None)."""
        if self._status != "complete":
            raise RecordingError("recording_failed_partial" if self._status == "partial_error" else
                                 "record_option_unsupported",
                                 f"this recorder's recording is {self._status}; it takes no further forward",
                                 remedy="start a new Recorder", option="forward_after_end")
        from torchlens.capture import trace

        number = len(self._passes) + 1
        recipe = self._recipe()
        try:
            result = trace(self._model, *args, save=self._save, capture=self._capture, backend=self._backend,
                           input_kwargs=input_kwargs, **({"intervene": recipe} if recipe is not None else {}))
        except TorchLensError as exc:
            partial = getattr(exc, "partial_trace", None)
            stop = _stop_cause(exc)
            if stop is not None and partial is not None:
                self._stopped(number, partial, stop)
                return None
            if partial is None:
                raise
            return self._failed(number, partial, exc)
        self._backend_name = result.provenance.backend
        self._inference_only = getattr(result.options, "inference_only", None)
        lean = self._options.lean
        rp = RecordingPass(number, trace=None if lean else result, records=records_from_trace(number, result),
                           output=result._output, n_ops=len(result._ops), lean=lean)
        if lean:
            rp.aliases = _save_aliases(self._save, result)
        self._passes.append(rp)
        return result._output

    # stop_after ---------------------------------------------------------------------------
    def _recipe(self) -> Any:
        if self._stop_after is None:
            return self._intervene
        from torchlens.intervention import when

        def stop(value: Any, ctx: Any = None) -> Any:
            label = getattr(ctx, "label", None) or getattr(ctx, "site", None)
            raise _StopCapture(label if isinstance(label, str) else None, value)

        return when(_stop_selector(self._stop_after), stop)

    def _stopped(self, number: int, partial: Any, stop: _StopCapture) -> None:
        from torchlens.build.save import apply_save, save_plan

        apply_save(partial, save_plan(self._save))
        label = stop.label or repr(self._stop_after)
        partial.annotations["stopped_at"] = label
        partial.annotations.pop("partial", None)
        records = records_from_trace(number, partial)
        from torchlens.recording.recording import SiteRecord, payload_nbytes

        address = getattr(_stop_selector(self._stop_after), "address", None)
        if _selected_at_stop(self._save, label, address):
            value = stop.value
            records.append(SiteRecord(number, label, address, value, tuple(getattr(value, "shape", ()) or ()),
                                      str(getattr(value, "dtype", "")) or None, payload_nbytes(value), {"stop_site": True}))
        self._backend_name = partial.provenance.backend
        self._inference_only = getattr(partial.options, "inference_only", None)
        self._passes.append(RecordingPass(number, trace=None if self._options.lean else partial, records=records,
                                          output_state="output_capture_stopped", n_ops=len(partial._ops),
                                          lean=self._options.lean))
        self._status = "stopped"
        self._failure = {"stopped_at": label}

    # forward errors -----------------------------------------------------------------------
    def _failed(self, number: int, partial: Any, exc: TorchLensError) -> Any:
        mode = self._on_forward_error
        if mode == "raise":
            raise exc
        from torchlens.build.save import apply_save, save_plan

        try:
            apply_save(partial, save_plan(self._save))
        except TorchLensError:
            pass  # a selector that names what the forward never reached keeps the prefix as it is
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        ops = list(partial._ops.values())
        last = next((o for o in reversed(ops) if o.kind != "output"), None)
        self._backend_name = partial.provenance.backend
        self._passes.append(RecordingPass(number, trace=partial, records=records_from_trace(number, partial),
                                          output_state="output_forward_failed", n_ops=len(ops)))
        self._status = "partial_error"
        if exc.code == "nonfinite_value":  # on_nonfinite="raise" aborted the forward
            partial.annotations["outcome_status"] = "ABORTED_NONFINITE"
        self._failure = {"error_type": type(cause).__name__, "error_message": str(cause), "error_code": exc.code,
                         "num_committed_ops": sum(1 for o in ops if o.kind not in ("input", "output")),
                         "last_event_label": last.label if last is not None else None,
                         "last_event_module": last.module if last is not None else None}
        if mode == "return_partial":
            return None
        raise RecordingError("recording_forward_failed", f"the recorded forward raised {type(cause).__name__}: {cause}",
                             remedy="fix the forward; exc.partial_recording holds what was recorded before it",
                             partial_recording=self.recording, error_type=type(cause).__name__) from exc

    # result -------------------------------------------------------------------------------
    @property
    def recording(self) -> Recording:
        """The Recording of every forward run so far."""
        rec = make_recording(passes=list(self._passes), settings=self._settings, backend=self._backend_name,
                             gradients=self._gradients, inference_only=self._inference_only, status=self._status,
                             **self._failure)
        post = self._options.postprocess
        if post is not None and self._status == "complete":
            out = post(rec)
            if isinstance(out, Recording):
                rec = out
        return rec


def _save_aliases(save: Any, trace: Any) -> dict:
    """For a lean pass: each name in `save=` (a label, module address or `tl.module` address)
    -> the op labels it selected, so the kept values stay readable by that name."""
    from torchlens.build.save import resolve_save, save_plan
    from torchlens.select.selectors import ModuleSelector

    plan = save_plan(save)
    if plan.kind != "select":
        return {}
    items = plan.spec if isinstance(plan.spec, list) else [plan.spec]
    out = {}
    for item in items:
        name = item.address if isinstance(item, ModuleSelector) else item if isinstance(item, str) else None
        if name is not None:
            out[name] = frozenset(resolve_save(trace, save_plan([item])))
    return out


def _stop_selector(stop_after: Any) -> Any:
    from torchlens.errors import InvalidArgumentError as _IAE
    from torchlens.select.selectors import LabelSelector, ModuleSelector, Selector

    if isinstance(stop_after, Selector):
        return stop_after
    if isinstance(stop_after, str):  # an op label ("relu_1_2", "linear_1_1:2") or a module address ("fc", "h.1")
        import re

        return LabelSelector(stop_after) if re.fullmatch(r"[a-z0-9]+_\d+_\d+(:\d+)?", stop_after) else ModuleSelector(stop_after)
    raise _IAE("invalid_argument", f"stop_after= takes a site (a label, module address or selector), not "
               f"{type(stop_after).__name__}", remedy="stop_after=tl.module('layer.1') or stop_after='relu_1_2'")


def _stop_cause(exc: BaseException) -> _StopCapture | None:
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 8:
        if isinstance(e, _StopCapture):
            return e
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def _selected_at_stop(save: Any, label: str, address: str | None) -> bool:
    """Whether the stop site's value is one `save=` selects. The site's op is not in the
    partial trace (the forward stopped while it was recorded), so this compares names: the
    op label, or the module address of a `tl.module` stop site."""
    from torchlens.build.save import save_plan
    from torchlens.select.selectors import ModuleSelector

    plan = save_plan(save)
    if plan.kind == "all":
        return True
    if plan.kind == "none":
        return False
    items = plan.spec if isinstance(plan.spec, list) else [plan.spec]
    for item in items:
        if isinstance(item, str) and item in (label, address):
            return True
        if isinstance(item, ModuleSelector) and address is not None and item.address == address:
            return True
    return False


def record(model: Any, *args: Any, save: Any = None, capture: CaptureOptions | None = None,
           recording: RecordingOptions | None = None, backend: str | None = None,
           input_kwargs: dict[str, Any] | None = None, stop_after: Any = None, intervene: Any = None,
           generate_kwargs: dict[str, Any] | None = None, generation: Any = None, storage: Any = None,
           narrate: Any = None, episode: Any = None) -> Any:
    """Record `model(*args, **input_kwargs)` sparsely and return a `Recording` (one pass).

    `save=` selects the sites whose payloads are kept (nothing else is); `to_trace()` gives the
    full graph. With `generate_kwargs=`, runs the model's own `generate()` once and returns a
    `GenerationRecording` (see `torchlens.recording.generation`)."""
    if generate_kwargs is not None or generation is not None:
        from torchlens.recording.generation import record_generation

        return record_generation(model, args, save=save, capture=capture, recording=recording, backend=backend,
                                 input_kwargs=input_kwargs, stop_after=stop_after, intervene=intervene,
                                 generate_kwargs=generate_kwargs, generation=generation, storage=storage,
                                 narrate=narrate, episode=episode)
    rec = Recorder(model, save=save, capture=capture, recording=recording, backend=backend, stop_after=stop_after,
                   intervene=intervene, storage=storage, narrate=narrate, episode=episode)
    rec(*args, input_kwargs=input_kwargs)
    return rec.recording


__all__ = ["Recorder", "record"]
