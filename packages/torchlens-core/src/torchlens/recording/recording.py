"""`Recording`: a sparse, multi-pass record of selected sites (glossary: Recording).

A recording holds one pass per forward the recorder ran. A full pass keeps the capture's
records (the event metadata `tl.trace`'s builder made from the backend's event stream:
labels, pass grouping, module calls, parameters) with only the payloads `save=` selected;
`to_trace()` hands back that graph as a Trace. A lean pass (the generation recorder's decode
steps) keeps only its site records and refuses `to_trace()` with `recording_lean_omitted`.

No public constructor: `tl.record` and `tl.recording.Recorder` build one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from torchlens.errors import PayloadUnavailableError, RecordingError

_TOKEN = object()


@dataclass(frozen=True)
class SiteRecord:
    """One kept payload: the pass it belongs to, the site's label (an op label, or a module
    address on a lean pass), its module, the value and its held bytes. `meta` holds extras
    (a reducer's name and the shape it reduced from, a spill file)."""

    pass_number: int
    label: str
    module: str | None
    value: Any
    shape: tuple | None
    dtype: str | None
    nbytes: int
    meta: dict = field(default_factory=dict)


def payload_nbytes(value: Any) -> int:
    """Bytes a payload holds (a framework tensor's or numpy array's `nbytes`; 0 for None)."""
    if value is None:
        return 0
    nb = getattr(value, "nbytes", None)
    if isinstance(nb, int):
        return nb
    if isinstance(value, (tuple, list)):
        return sum(payload_nbytes(v) for v in value)
    return 0


class RecordingPass:
    """One forward of a recording. `trace` is the sparse Trace of a full pass (None on a lean
    pass); `records` the kept site payloads; `output` the forward's return value."""

    __slots__ = ("number", "trace", "records", "output", "output_state", "n_ops", "lean", "aliases")

    def __init__(self, number: int, *, trace: Any = None, records: list[SiteRecord] | None = None, output: Any = None,
                 output_state: str | None = None, n_ops: int | None = None, lean: bool = False) -> None:
        self.number = number
        self.trace = trace
        self.records = records if records is not None else []
        self.output = output
        self.output_state = output_state
        self.n_ops = n_ops
        self.lean = lean
        self.aliases: dict[str, frozenset] = {}  # a lean pass: save= item name -> the op labels it selected

    def __repr__(self) -> str:
        return f"RecordingPass({self.number}, records={len(self.records)}, lean={self.lean})"


def records_from_trace(number: int, trace: Any) -> list[SiteRecord]:
    """The kept payloads of a sparse Trace, as site records (output leaves excluded: the
    model's return value is `Recording.output`)."""
    out = []
    for op in trace._ops.values():
        if not op.saved or op.kind == "output":
            continue
        outs = op._outputs
        value = outs[0] if len(outs) == 1 else tuple(outs)
        if value is None:
            continue
        out.append(SiteRecord(number, op.label, op.module, value, op.shape, op.dtype, payload_nbytes(value)))
    return out


class Recording:
    """A sparse event record of one or more forwards (no public constructor).

    - `records`: every kept payload as a `SiteRecord`, pass by pass.
    - `passes`: the `RecordingPass` of each forward; `num_passes`.
    - `output`: the last pass's return value, exactly as the model returned it.
    - `options`: the `RecordingSettings` it was made with; `outcome`: its `CaptureOutcome`.
    - `status`: "complete", "stopped" or "partial_error"; `is_failed`.
    - `to_trace(pass_number=None)`: the full Trace of a pass (the last by default).
    - `save(path)`, `fork()`, `do(site, edit, ...)`: convert through `to_trace()` and delegate.
    - `backward(loss)`: only for a recording made with gradient hooks.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not args or args[0] is not _TOKEN:
            raise TypeError("Recording has no public constructor: use tl.record(model, x, save=...) or "
                            "tl.recording.Recorder")
        self._passes: list[RecordingPass] = kwargs.get("passes", [])
        self._settings = kwargs.get("settings")
        self._backend_name: str = kwargs.get("backend", "?")
        self._gradients: bool = bool(kwargs.get("gradients", False))
        self._inference_only: bool | None = kwargs.get("inference_only")
        self.status: str = kwargs.get("status", "complete")
        self.error_type: str | None = kwargs.get("error_type")
        self.error_message: str | None = kwargs.get("error_message")
        self.num_committed_ops: int | None = kwargs.get("num_committed_ops")
        self.last_event_label: str | None = kwargs.get("last_event_label")
        self.last_event_module: str | None = kwargs.get("last_event_module")
        self.stopped_at: str | None = kwargs.get("stopped_at")
        self.error_code: str | None = kwargs.get("error_code")

    # identity ----------------------------------------------------------------------------
    @property
    def is_failed(self) -> bool:
        return self.status == "partial_error"

    @property
    def options(self) -> Any:
        """The `RecordingSettings` this recording was made with."""
        return self._settings

    @property
    def outcome(self) -> Any:
        """The frozen `CaptureOutcome`: COMPLETE, STOPPED or FAILED (phase "forward")."""
        from torchlens.records.outcome import CaptureOutcome

        if self.status == "partial_error":
            return CaptureOutcome("ABORTED_NONFINITE" if self.error_code == "nonfinite_value" else "FAILED", phase="forward", inference_only=self._inference_only,
                                  error_type=self.error_type, error_message=self.error_message)
        if self.status == "stopped":
            return CaptureOutcome("STOPPED", inference_only=self._inference_only, stopped_at=self.stopped_at)
        return CaptureOutcome("COMPLETE", inference_only=self._inference_only)

    @property
    def backend(self) -> str:
        return self._backend_name

    # contents ----------------------------------------------------------------------------
    @property
    def passes(self) -> tuple[RecordingPass, ...]:
        return tuple(self._passes)

    @property
    def num_passes(self) -> int:
        return len(self._passes)

    @property
    def records(self) -> tuple[SiteRecord, ...]:
        return tuple(r for p in self._passes for r in p.records)

    def __iter__(self) -> Iterator[SiteRecord]:
        return iter(self.records)

    def __len__(self) -> int:
        return sum(len(p.records) for p in self._passes)

    @property
    def lean_omissions(self) -> tuple[str, ...]:
        """What lean passes did not keep (() when every pass kept its full records):
        the shell records of unkept ops, the module boundary events of unkept modules, the
        event indexes of unkept events and the op counts."""
        if not any(p.lean for p in self._passes):
            return ()
        return ("shell_records_of_unkept_ops", "module_boundary_events_of_unkept_modules",
                "event_indexes_of_unkept_events", "op_counts")

    @property
    def saved_bytes(self) -> int:
        """Bytes of every kept payload (what `save=` selected), summed over passes."""
        return sum(r.nbytes for p in self._passes for r in p.records)

    def _pass(self, pass_number: int | None) -> RecordingPass:
        if not self._passes:
            raise PayloadUnavailableError("activation_not_saved", "this recording holds no pass",
                                          remedy="run the recorder on an input first")
        if pass_number is None:
            return self._passes[-1]
        for p in self._passes:
            if p.number == pass_number:
                return p
        raise RecordingError("recording_pass_missing", f"this recording has no pass {pass_number}",
                             remedy=f"passes: {[p.number for p in self._passes]}", pass_number=pass_number)

    def value(self, site: str, pass_number: int | None = None) -> Any:
        """The kept payload of `site` (an op label, or a module address whose output was
        kept) at a pass (the last by default). A site `save=` did not select raises
        `activation_not_saved`; a name the pass never ran raises `recording_site_missing`."""
        p = self._pass(pass_number)
        for r in p.records:
            if r.label == site or (r.meta.get("stop_site") and r.module == site):
                return r.value
        if p.trace is None and site in p.aliases:
            kept = [r for r in p.records if r.label in p.aliases[site]]
            if len(kept) == 1:
                return kept[0].value
        if p.trace is not None:
            from torchlens.build.save import resolve_save, save_plan

            try:
                labels = resolve_save(p.trace, save_plan([site]))
            except Exception:
                labels = set()
            kept = [r for r in p.records if r.label in labels]
            if len(kept) == 1:
                return kept[0].value
            if labels:
                raise PayloadUnavailableError(
                    "activation_not_saved", f"{site!r} was not selected by this recording's save=",
                    remedy=f"record again with save= naming it (save={self._settings.keep_op!r} here)", site=site)
        raise RecordingError("recording_site_missing", f"pass {p.number} of this recording has no site {site!r}",
                             remedy="read recording.records for the kept sites", site=site, pass_number=p.number)

    def __getitem__(self, site: str) -> Any:
        return self.value(site)

    @property
    def output(self) -> Any:
        """The model's return value exactly as returned (the last pass's)."""
        if not self._passes:
            raise PayloadUnavailableError("output_forward_failed", "this recording ran no forward",
                                          remedy="run the recorder first")
        p = self._passes[-1]
        if p.output_state is not None:
            why = {"output_forward_failed": "the forward failed before returning (a failed partial recording)",
                   "output_capture_stopped": "stop_after= ended the capture before the model returned",
                   "output_not_stored": "a loaded or unpickled recording holds no live model output"}[p.output_state]
            raise PayloadUnavailableError(p.output_state, why, remedy="record again without stop_after= / fix the "
                                          "forward", status=self.status)
        return p.output

    # conversion --------------------------------------------------------------------------
    def to_trace(self, pass_number: int | None = None) -> Any:
        """The full Trace of one pass (the last by default): the graph the capture's builder
        made from the event stream (labels, passes, modules as `tl.trace` gives them), with the
        payloads this recording kept. A converted trace has no live forward return."""
        self._refuse_failed("to_trace")
        p = self._pass(pass_number)
        if p.trace is None:
            raise RecordingError("recording_lean_omitted", f"pass {p.number} kept only its site records (a lean pass), "
                                 "not the event metadata a Trace is built from",
                                 remedy="record with tl.record(model, x, save=...) (not lean) to convert; read "
                                        "recording.records for the kept values", pass_number=p.number)
        trace = p.trace.copy(name=f"recording-pass-{p.number}")
        trace.drop_output("recording")
        return trace

    def _journal(self, what: str) -> list[RecordingPass]:
        lean = [p.number for p in self._passes if p.trace is None]
        if lean:
            raise RecordingError("recording_lean_omitted", f"{what} needs the full event journal; pass(es) {lean} are lean",
                                 remedy="record without lean=True (module-site generation passes are always lean); "
                                        "read recording.records instead", passes=lean)
        return list(self._passes)

    @property
    def op_events(self) -> tuple[dict, ...]:
        """One metadata row per recorded op of every pass, in execution order: pass_number,
        label, func_name, kind, module, shape, dtype, saved."""
        rows = []
        for p in self._journal("op_events"):
            for op in p.trace._ops.values():
                rows.append({"pass_number": p.number, "label": op.label, "func_name": op.func_name, "kind": op.kind,
                             "module": op.module, "shape": op.shape, "dtype": op.dtype, "saved": bool(op.saved)})
        return tuple(rows)

    @property
    def event_stream(self) -> tuple[dict, ...]:
        """The op rows (`op_events`) and module calls of every pass, as ("op" | "module_call") rows."""
        rows = []
        for p in self._journal("event_stream"):
            for op in p.trace._ops.values():
                rows.append({"event": "op", "pass_number": p.number, "label": op.label, "module": op.module})
            for call in p.trace._module_calls.values():
                rows.append({"event": "module_call", "pass_number": p.number, "label": call.label})
        return tuple(rows)

    @property
    def lazy_trace(self) -> Any:
        """The last pass's Trace (`to_trace()`)."""
        self._journal("lazy_trace")
        return self.to_trace()

    def raw_metadata(self) -> dict:
        """Plain facts about the recording: backend, status, passes with their op counts."""
        self._journal("raw_metadata()")
        return {"backend": self._backend_name, "status": self.status, "num_passes": self.num_passes,
                "passes": [{"pass_number": p.number, "num_ops": len(p.trace._ops), "num_records": len(p.records)}
                           for p in self._passes]}

    def _refuse_failed(self, verb: str) -> None:
        if self.is_failed:
            raise RecordingError("recording_failed_partial", f"{verb} on a failed partial recording "
                                 f"({self.error_type}: {self.error_message})",
                                 remedy="fix the forward and record again; read recording.records for what was kept",
                                 status=self.status, verb=verb)

    def save(self, path: Any, **kwargs: Any) -> Any:
        """`self.to_trace().save(path, ...)`."""
        return self.to_trace().save(path, **kwargs)

    def fork(self, name: str | None = None) -> Any:
        """`self.to_trace().fork(name)`: an editable Trace."""
        return self.to_trace().fork(name)

    def do(self, site: Any, edit: Any = None, /, **kwargs: Any) -> Any:
        """`self.to_trace().fork().do(site, edit, ...)`: the edit lands on a fork of the
        converted trace (the recording is never edited); returns that Trace."""
        return self.to_trace().fork().do(site, edit, **kwargs)

    def backward(self, loss: Any, **kwargs: Any) -> Any:
        """Run backward from `loss` through the last pass (a recording made with gradient
        hooks: `CaptureOptions(backward_ready=True)`, `save_grads=` or `default_grad=True`)."""
        self._refuse_failed("backward")
        if not self._gradients:
            raise RecordingError("recording_backward_not_requested", "this recording installed no gradient hooks",
                                 remedy="record with capture=CaptureOptions(backward_ready=True) (or save_grads=True, "
                                        "or recording=RecordingOptions(default_grad=True))")
        if self._inference_only:
            raise RecordingError("recording_backward_inference_only", "this recording's forward ran without grad",
                                 remedy="record outside torch.no_grad(), or with CaptureOptions(inference_only=False)")
        p = self._pass(None)
        if p.trace is None:
            raise RecordingError("recording_lean_omitted", "the last pass is lean and holds no graph",
                                 remedy="record without lean=")
        return p.trace.backward(loss, **kwargs)

    def summary(self) -> str:
        lines = [f"Recording ({self._backend_name}): {self.num_passes} pass(es), {len(self)} record(s), "
                 f"{self.saved_bytes} bytes, status {self.status}"]
        for r in self.records[:50]:
            lines.append(f"  pass {r.pass_number}  {r.label}  {r.shape}  {r.dtype}  {r.nbytes} B")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"<Recording {self.status}: {self.num_passes} pass(es), {len(self)} record(s), "
                f"{self.saved_bytes} bytes>")

    def __getstate__(self) -> dict:
        """Pickling keeps the records and the passes' graphs, never the live model output
        (an unpickled recording's `output` raises `output_not_stored`), and of the settings
        only the plain values (bools, numbers, strings; callables and objects read None)."""
        state = dict(self.__dict__)
        passes = []
        for p in self._passes:
            q = RecordingPass(p.number, trace=p.trace.copy(name=p.trace.name) if p.trace is not None else None,
                              records=list(p.records), output=None, n_ops=p.n_ops, lean=p.lean,
                              output_state=p.output_state or "output_not_stored")
            if p.output_state is None:
                q.output_state = "output_not_stored"
            q.aliases = dict(p.aliases)
            passes.append(q)
        state["_passes"] = passes
        if self._settings is not None:
            from torchlens.recording.settings import plain_settings

            state["_settings"] = plain_settings(self._settings)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


def make_recording(**kwargs: Any) -> Recording:
    """Build a Recording (the recorder's private constructor)."""
    return Recording(_TOKEN, **kwargs)


__all__ = ["Recording", "RecordingPass", "SiteRecord", "make_recording", "records_from_trace", "payload_nbytes"]
