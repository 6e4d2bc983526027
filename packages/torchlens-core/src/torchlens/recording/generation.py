"""Generation recording (glossary: Generation recording, Streaming generation recording).

`tl.record(model, input_ids, save=..., generate_kwargs={...})` runs the model's own
`generate()` once, with its KV cache, through the backend's generation driver
(`SupportsGenerationRecording.record_generation`, torch: `torchlens_torch.generation`). The
driver observes every forward `generate()` runs and hands core one `ForwardData` per forward:
the forward's absolute positions and each selected site's value (for a decode step, only the
new position: the cache holds the rest). Core applies the reducers, keeps or evicts payloads
(`keep_last=`, `spill=`), checks the byte budget after the first decode step, and builds the
`GenerationRecording`. This module imports no framework: values are touched only through the
reducer callables and the driver's spill functions.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from torchlens.errors import RecordingError
from torchlens.recording.recording import Recording, RecordingPass, SiteRecord, make_recording, payload_nbytes

#: What a generation recording never holds (GenerationRecording.not_recorded).
NOT_RECORDED: tuple[str, ...] = (
    "cache tensors (past keys and values; kv_sites= keeps each forward's new slices)",
    "the sampling between forwards (logits processors, the token choice)",
    "the last token's own position (generate() returns it without running a forward on it)",
)

#: generate() settings that decide the tokens (GenerationRecording.settings reads them).
TOKEN_SETTINGS: tuple[str, ...] = ("max_new_tokens", "max_length", "min_new_tokens", "do_sample", "temperature", "top_k",
                                   "top_p", "typical_p", "repetition_penalty", "no_repeat_ngram_size", "num_beams",
                                   "num_return_sequences", "eos_token_id", "pad_token_id", "use_cache")

DEFAULT_MAX_SAVED_BYTES = 512 * 1024 * 1024


# options ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GenerationOptions:
    """Streaming options of a generation recording (the names may change).

    - `reducers`: site address -> callable applied to the site's payload after every forward;
      its result (first axis: the forward's positions) replaces the payload.
    - `kv_sites`: decoder layer indexes (or True: all) whose new KV-cache slices are kept per
      token as series `kv.<layer>.key` / `kv.<layer>.value`.
    - `keep_last`: keep the payloads of the newest N forwards; older ones are written to
      `spill` (a directory, one file per step) or dropped.
    - `max_saved_bytes`: the retained-bytes budget (512 MiB by default, None: off), projected
      for the whole generation right after the first decode step.
    """

    reducers: Any = None
    kv_sites: Any = None
    keep_last: int | None = None
    spill: Any = None
    max_saved_bytes: int | None = DEFAULT_MAX_SAVED_BYTES

    def __post_init__(self) -> None:
        code = "record_generation_options_invalid"
        if self.reducers is not None:
            if not isinstance(self.reducers, dict):
                raise RecordingError(code, f"reducers= takes a dict site -> callable, not {type(self.reducers).__name__}",
                                     remedy="reducers={'transformer.h.1': tl.recording.reducers.norm()}", field="reducers")
            for site, fn in self.reducers.items():
                if not isinstance(site, str) or not callable(fn):
                    raise RecordingError(code, f"reducers= entry {site!r}: {fn!r} is not a site address -> callable",
                                         remedy="reducers={'transformer.h.1': tl.recording.reducers.norm()}",
                                         field="reducers")
        kv = self.kv_sites
        if kv is not None and kv is not True:
            if isinstance(kv, bool) or not isinstance(kv, (list, tuple, set, frozenset)) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in kv):
                raise RecordingError(code, f"kv_sites={kv!r} is not True or a list of layer indexes",
                                     remedy="kv_sites=[0, 3] or kv_sites=True", field="kv_sites")
        if self.keep_last is not None and (isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int)
                                           or self.keep_last < 1):
            raise RecordingError(code, f"keep_last={self.keep_last!r} is not None or an int >= 1", remedy="keep_last=8",
                                 field="keep_last")
        if self.spill is not None:
            if not isinstance(self.spill, (str, os.PathLike)):
                raise RecordingError(code, "spill= takes a directory path", remedy="spill='/tmp/run1'", field="spill")
            if self.keep_last is None:
                raise RecordingError(code, "spill= without keep_last=: nothing would be evicted", remedy="keep_last=8",
                                     field="spill")
        if self.max_saved_bytes is not None and (isinstance(self.max_saved_bytes, bool) or
                                                 not isinstance(self.max_saved_bytes, int) or self.max_saved_bytes < 0):
            raise RecordingError(code, f"max_saved_bytes={self.max_saved_bytes!r} is not None or an int >= 0",
                                 remedy="max_saved_bytes=2**30", field="max_saved_bytes")


# the driver contract -------------------------------------------------------------------------------
@dataclass
class ForwardData:
    """What the driver reports after one forward: `positions` (the absolute positions it
    computed, a range), `values` (site address -> payload, in the order the sites ran; a site
    seen twice in one forward is listed in `duplicates`), `kv` ("kv.<layer>.key" -> the new
    slice, [positions, kv_heads, head_dim]) and `n_ops` (None when not counted)."""

    positions: range
    values: dict[str, Any] = field(default_factory=dict)
    kv: dict[str, Any] = field(default_factory=dict)
    n_ops: int | None = None
    duplicates: tuple[str, ...] = ()
    trace: Any = None  # the forward's sparse Trace when the request asked for full captures


@dataclass(frozen=True)
class GenerationRequest:
    """What core asks the driver for: the sites to observe (module addresses), the KV layers
    (None, True or indexes), the generate() call, the seed, whether payloads are detached,
    and `on_forward`, called with a `ForwardData` after every forward (an error it raises
    must end generate() and propagate, with the driver's hooks removed). With an op-level
    `save=`, `capture_forward(fn, args, kwargs) -> Trace` is set: the driver runs each forward
    through it (`tl.trace`'s capture, the trace's output is the forward's return) and reports
    the trace in `ForwardData.trace`."""

    sites: tuple[str, ...]
    kv_layers: Any
    generate_kwargs: dict
    seed: int | None
    detach: bool
    on_forward: Callable[[ForwardData], None]
    capture_forward: Callable[..., Any] | None = None


@dataclass
class GenerationRun:
    """What the driver returns: `output` (what generate() returned), `sequences`,
    `prompt_length`, `settings` (token settings, seed, rng digest)."""

    output: Any
    sequences: Any
    prompt_length: int
    settings: dict


# results ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GenerationStep:
    """One forward of a generation: `step` (0: the prefill), `pass_number` (the recording pass
    holding its records), `kind` ("prefill" or "decode"), `positions` (absolute positions it
    computed), `n_ops` (None: not counted by a hook-level driver), `n_records`, `saved_bytes`."""

    step: int
    pass_number: int
    kind: str
    positions: range
    n_ops: int | None
    n_records: int
    saved_bytes: int


@dataclass(frozen=True)
class TokenSeries:
    """One site's per-token stream: `name`, `positions` (a range of absolute positions) and
    `values` (one row per position). `len(series)` is the number of positions."""

    name: str
    positions: range
    values: Any

    def __len__(self) -> int:
        return len(self.positions)


class GenerationRecording:
    """The result of a generation recording (no public constructor). See the module docstring."""

    def __init__(self, token: Any, **kw: Any) -> None:
        if token is not _TOKEN:
            raise TypeError("GenerationRecording has no public constructor: use tl.record(..., generate_kwargs={...})")
        self.recording: Recording = kw["recording"]
        self.steps: tuple[GenerationStep, ...] = kw["steps"]
        self.sequences: Any = kw["sequences"]
        self.prompt_length: int = kw["prompt_length"]
        self.settings: dict = kw["settings"]
        self.not_recorded: tuple[str, ...] = NOT_RECORDED
        self.options: GenerationOptions = kw["options"]
        self.peak_saved_bytes: int = kw["peak_saved_bytes"]
        self.evicted_steps: dict[int, str] = kw["evicted_steps"]
        self._output = kw["output"]
        self._series_rows: dict[str, list[tuple[int, range]]] = kw["series_rows"]  # name -> (step, positions)
        self._spill_load: Callable[[str], Any] | None = kw.get("spill_load")
        self._concat: Callable[[list], Any] | None = kw.get("concat")

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    @property
    def output(self) -> Any:
        """What generate() returned."""
        return self._output

    def _step(self, step: int) -> GenerationStep:
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < len(self.steps):
            raise RecordingError("record_generation_step_missing", f"this generation has no step {step!r}",
                                 remedy=f"steps run from 0 (the prefill) to {len(self.steps) - 1}", step=repr(step))
        return self.steps[step]

    def records_at(self, step: int) -> tuple[SiteRecord, ...]:
        """The records of one step (its pass of `.recording`); payloads of an evicted step are
        metadata stubs (`meta["payload"]` is "spilled" or "dropped")."""
        s = self._step(step)
        return tuple(r for p in self.recording.passes if p.number == s.pass_number for r in p.records)

    def value(self, site: str, step: int) -> Any:
        """The kept payload of `site` at `step` (read back from the spill when evicted)."""
        for r in self.records_at(step):
            if r.label == site:
                return self._payload(r, step)
        raise RecordingError("record_generation_step_missing", f"step {step} recorded no site {site!r}",
                             remedy=f"sites at that step: {[r.label for r in self.records_at(step)]}", site=site,
                             step=step)

    def _payload(self, r: SiteRecord, step: int) -> Any:
        state = r.meta.get("payload")
        if state == "dropped":
            raise RecordingError("record_generation_step_missing", f"step {step}'s payload of {r.label!r} was dropped "
                                 "(keep_last= without spill=)", remedy="record with spill= to keep evicted steps",
                                 site=r.label, step=step)
        if state == "spilled":
            return self._spill_load(r.meta["spill_file"])[r.label]
        return r.value

    def step_of_position(self, position: int) -> int:
        """The step whose forward computed absolute `position`."""
        for s in self.steps:
            if position in s.positions:
                return s.step
        raise RecordingError("record_generation_step_missing", f"no forward computed position {position!r}",
                             remedy=f"positions 0..{self.steps[-1].positions.stop - 1} were computed; the last token's "
                                    "own position never is" if self.steps else "the generation ran no forward",
                             position=repr(position))

    @property
    def series_names(self) -> tuple[str, ...]:
        return tuple(self._series_rows)

    def series(self, name: str) -> TokenSeries:
        """The per-token stream of a site (or `kv.<layer>.key|value`), evicted rows read back
        from the spill. An unknown or fully dropped series raises `record_generation_step_missing`."""
        rows = self._series_rows.get(name)
        if rows is None:
            raise RecordingError("record_generation_step_missing", f"no series {name!r}",
                                 remedy=f"series: {list(self._series_rows)}", series=name)
        parts, positions = [], []
        for step, pos in rows:
            if self.evicted_steps.get(step) == "dropped":
                continue
            value = self.value(name, step)
            rec = next(r for r in self.records_at(step) if r.label == name)
            if "reducer" not in rec.meta and not rec.meta.get("kv"):
                value = value[0]  # a module output [batch=1, positions, ...] -> [positions, ...]
            parts.append(value)
            positions.append(pos)
        if not parts:
            raise RecordingError("record_generation_step_missing", f"every step of series {name!r} was dropped",
                                 remedy="record with spill= or a larger keep_last=", series=name)
        contiguous = all(a.stop == b.start for a, b in zip(positions, positions[1:]))
        if not contiguous:
            raise RecordingError("record_generation_step_missing", f"series {name!r} has dropped steps inside it",
                                 remedy="read the kept steps with value(name, step)", series=name)
        return TokenSeries(name, range(positions[0].start, positions[-1].stop), self._concat(parts))

    def __repr__(self) -> str:
        return (f"<GenerationRecording: {self.n_steps} steps, prompt {self.prompt_length} tokens, "
                f"{self.recording.saved_bytes} bytes kept>")


_TOKEN = object()


# the recorder -------------------------------------------------------------------------------------
def _unsupported(reason: str, message: str, remedy: str) -> RecordingError:
    return RecordingError("record_generation_unsupported", message, remedy=remedy, reason=reason)


def _sites_of(save: Any) -> tuple[tuple[str, ...], bool]:
    """(module addresses `save=` names, whether it needs a full capture per forward). A save=
    of module addresses only is observed with module hooks (cheap); a selector naming ops
    (tl.func, tl.label, ...) runs every forward through tl.trace's capture instead."""
    from torchlens.build.save import save_plan
    from torchlens.select.selectors import ModuleSelector

    plan = save_plan(save)
    if plan.kind == "none":
        return (), False
    if plan.kind == "all":
        raise _unsupported("save_all", "save='all' over a generation would keep every op of every forward",
                           "name the sites to keep: save=tl.module('transformer.h.3') or save=tl.func('softmax')")
    items = plan.spec if isinstance(plan.spec, list) else [plan.spec]
    out: list[str] = []
    for item in items:
        if isinstance(item, ModuleSelector) and ":" not in item.address:
            out.append(item.address)
        elif isinstance(item, str) and ":" not in item and "_" not in item.rsplit(".", 1)[-1]:
            out.append(item)
        else:
            return (), True
    return tuple(dict.fromkeys(out)), False


def _check_generate_kwargs(gk: dict) -> None:
    if (gk.get("num_beams") or 1) > 1:
        raise _unsupported("beam_search", "beam search (num_beams > 1)", "use greedy or sampling decoding")
    if (gk.get("num_return_sequences") or 1) > 1:
        raise _unsupported("num_return_sequences", "more than one return sequence", "num_return_sequences=1")
    if gk.get("assistant_model") is not None or gk.get("prompt_lookup_num_tokens") is not None:
        raise _unsupported("assisted_decoding", "assisted decoding", "drop assistant_model= / prompt_lookup_num_tokens=")
    if gk.get("use_cache") is False:
        raise _unsupported("use_cache_false", "use_cache=False (each decode step would rerun the whole prefix)",
                           "drop use_cache=False")


def record_generation(model: Any, args: tuple, *, save: Any, capture: Any, recording: Any, backend: str | None,
                      input_kwargs: dict | None, stop_after: Any, intervene: Any, generate_kwargs: dict | None,
                      generation: Any, storage: Any, narrate: Any, episode: Any) -> Any:
    """`tl.record(..., generate_kwargs=...)`: see the module docstring. Every refusal is
    raised before generate() runs, except the budget check (after the first decode step)
    and invalid reducer results (at the forward that produced them)."""
    from torchlens.options import CaptureOptions, RecordingOptions

    if generate_kwargs is None:
        raise RecordingError("record_generation_options_invalid", "generation= without generate_kwargs=",
                             remedy="tl.record(model, ids, generate_kwargs={'max_new_tokens': 20}, generation=...)")
    if not isinstance(generate_kwargs, dict):
        raise RecordingError("record_generation_options_invalid", "generate_kwargs= takes a dict",
                             remedy="generate_kwargs={'max_new_tokens': 20}")
    options = generation if generation is not None else GenerationOptions()
    if not isinstance(options, GenerationOptions):
        raise RecordingError("record_generation_options_invalid", f"generation= takes a GenerationOptions, not "
                             f"{type(options).__name__}", remedy="generation=tl.recording.GenerationOptions(...)")
    recording = recording if recording is not None else RecordingOptions()
    if intervene is not None:
        raise _unsupported("intervene", "intervene= during a generation recording", "record, then intervene with tl.trace")
    if stop_after is not None:
        raise _unsupported("stop_after", "stop_after= during a generation recording", "limit max_new_tokens= instead")
    mode = recording.on_forward_error
    if mode != "raise":
        raise _unsupported("on_forward_error", f"on_forward_error={mode!r} (partial forward-error modes)",
                           "keep on_forward_error='raise'")
    if episode is not None:
        raise RecordingError("record_episode_unsupported", "tl.record does not capture episodes",
                             remedy="capture episodes with tl.trace(model, x, episode=...)")
    for name, value in (("storage", storage), ("narrate", narrate)):
        if value is not None:
            raise RecordingError("record_option_unsupported", f"tl.record({name}=...) is not supported yet",
                                 remedy=f"drop {name}=", option=name)
    if capture is None:
        capture = CaptureOptions(detach_saved_activations=True)
    if capture.backward_ready or capture.save_grads or recording.default_grad:
        raise _unsupported("gradients", "gradient hooks during a generation recording", "drop backward_ready/save_grads")
    _check_generate_kwargs(generate_kwargs)
    sites, full = _sites_of(save)
    reducers = dict(options.reducers or {})
    sites = tuple(dict.fromkeys(sites + tuple(reducers)))
    if not sites and not full and options.kv_sites is None:
        raise RecordingError("record_generation_options_invalid", "nothing to record: no save=, reducers= or kv_sites=",
                             remedy="save=tl.module('transformer.h.3')")
    from torchlens.backends.registry import select_backend

    kwargs = dict(input_kwargs or {})
    proto = select_backend(model, args, kwargs, backend)
    driver = generation_driver(proto)
    if driver is None:
        raise _unsupported("backend", f"the {proto.name} backend has no generation driver",
                           "record generation with the torch backend")
    stream = _Stream(options, reducers, driver)
    from torchlens.recording.settings import RecordingSettings

    settings = RecordingSettings._make(capture, recording, keep_op=save, intervene=None, stop_after=None)
    capture_forward = None
    if full:
        from torchlens.capture import trace as _trace

        def capture_forward(fn: Any, f_args: tuple, f_kwargs: dict) -> Any:
            return _trace(fn, *f_args, save=save, capture=capture, backend=proto.name, input_kwargs=f_kwargs)

    request = GenerationRequest(sites=sites, kv_layers=options.kv_sites, generate_kwargs=dict(generate_kwargs),
                                seed=capture.seed, detach=capture.detach_saved_activations, on_forward=stream.on_forward,
                                capture_forward=capture_forward)
    stream.max_new = _max_new_tokens(generate_kwargs)
    run = driver.record_generation(model, args, kwargs, request)
    inference_only = True  # generate() runs its forwards under torch.no_grad()
    if stream.passes:  # the recording's output is what generate() returned (glossary: Recording.output)
        stream.passes[-1].output, stream.passes[-1].output_state = run.output, None
    rec = make_recording(passes=stream.passes, settings=settings, backend=proto.name, gradients=False,
                         inference_only=inference_only)
    return GenerationRecording(
        _TOKEN, recording=rec, steps=tuple(stream.steps), sequences=run.sequences, prompt_length=run.prompt_length,
        settings=run.settings, options=options, peak_saved_bytes=stream.peak, evicted_steps=dict(stream.evicted),
        output=run.output, series_rows=stream.series_rows, spill_load=driver.spill_load, concat=driver.concat)


def generation_driver(proto: Any) -> Any:
    """The backend's generation driver (`SupportsGenerationRecording.generation_driver()`),
    or None for a backend that does not offer the capability."""
    from torchlens.backends.protocol import SupportsGenerationRecording, supports

    return proto.generation_driver() if supports(proto, SupportsGenerationRecording) else None


def _max_new_tokens(gk: dict) -> int | None:
    n = gk.get("max_new_tokens")
    return n if isinstance(n, int) and not isinstance(n, bool) else None


class _Stream:
    """Per-forward bookkeeping: reducers, records, eviction, the byte budget."""

    def __init__(self, options: GenerationOptions, reducers: dict, driver: Any) -> None:
        self.options = options
        self.reducers = reducers
        self.driver = driver
        self.passes: list[RecordingPass] = []
        self.steps: list[GenerationStep] = []
        self.evicted: dict[int, str] = {}
        self.series_rows: dict[str, list[tuple[int, range]]] = {}
        self.retained = 0
        self.peak = 0
        self.max_new: int | None = None
        self.prompt_bytes = 0

    def on_forward(self, data: ForwardData) -> None:
        step = len(self.steps)
        number = step + 1
        n = len(data.positions)
        if data.duplicates:
            raise RecordingError("record_generation_reducer_invalid", f"step {step}: site(s) {list(data.duplicates)} "
                                 "ran twice in one forward", remedy="record a module that runs once per forward",
                                 sites=list(data.duplicates), step=step)
        missing = [s for s in self.reducers if s not in data.values]
        if missing:
            raise RecordingError("record_generation_reducer_invalid", f"step {step}: reducer site(s) {missing} did not "
                                 "run in this forward", remedy="name a module the forward calls", sites=missing, step=step)
        records: list[SiteRecord] = []
        for site, value in data.values.items():
            meta: dict = {}
            fn = self.reducers.get(site)
            if fn is not None:
                value, meta = self._reduce(site, fn, value, n, step)
            records.append(SiteRecord(number, site, site, value, _shape(value), _dtype(value), payload_nbytes(value), meta))
            self.series_rows.setdefault(site, []).append((step, data.positions))
        if data.trace is not None:
            from torchlens.recording.recording import records_from_trace

            data.trace.drop_output("recording")  # releases the pass's logits and fed-back cache (generate holds its own)
            for r in records_from_trace(number, data.trace):
                records.append(r)
                self.series_rows.setdefault(r.label, []).append((step, data.positions))
        for name, value in data.kv.items():
            records.append(SiteRecord(number, name, None, value, _shape(value), _dtype(value), payload_nbytes(value),
                                      {"kv": True}))
            self.series_rows.setdefault(name, []).append((step, data.positions))
        nbytes = sum(r.nbytes for r in records)
        self.passes.append(RecordingPass(number, trace=data.trace, records=records, n_ops=data.n_ops,
                                         lean=data.trace is None, output_state="output_not_stored"))
        self.steps.append(GenerationStep(step, number, "prefill" if step == 0 else "decode", data.positions, data.n_ops,
                                         len(records), nbytes))
        self.retained += nbytes
        if step == 0:
            self.prompt_bytes = nbytes
        self._evict(step)
        self.peak = max(self.peak, self.retained)
        if step >= 1:
            self._check_budget(nbytes if step == 1 else None)

    def _reduce(self, site: str, fn: Any, value: Any, n: int, step: int) -> tuple[Any, dict]:
        try:
            out = fn(value)
        except Exception as exc:
            raise RecordingError("record_generation_reducer_invalid", f"step {step}: the reducer of {site!r} raised "
                                 f"{type(exc).__name__}: {exc}", remedy="fix the reducer", site=site, step=step) from exc
        shape = _shape(out)
        if shape is None or not self.driver.is_tensor(out):
            raise RecordingError("record_generation_reducer_invalid", f"step {step}: the reducer of {site!r} returned "
                                 f"{type(out).__name__}, not a tensor", remedy="return a tensor whose first axis is the "
                                 "forward's positions", site=site, step=step)
        if len(shape) == 0 or shape[0] != n:
            raise RecordingError("record_generation_reducer_invalid", f"step {step}: the reducer of {site!r} returned "
                                 f"shape {tuple(shape)}; its first axis must be the forward's {n} position(s)",
                                 remedy="reduce to [positions, ...] (reducers.norm() for one value per position)",
                                 site=site, step=step, shape=list(shape), positions=n)
        name = getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__
        return out, {"reducer": name, "reduced_from_shape": _shape(value)}

    def _evict(self, step: int) -> None:
        keep = self.options.keep_last
        if keep is None:
            return
        old = step - keep
        if old < 0:
            return
        p = self.passes[old]
        if self.options.spill is not None:
            os.makedirs(self.options.spill, exist_ok=True)
            path = os.path.join(os.fspath(self.options.spill), f"step_{old:06d}.pt")
            self.driver.spill_save({r.label: r.value for r in p.records}, path)
            state, extra = "spilled", {"spill_file": path}
        else:
            state, extra = "dropped", {}
        freed = 0
        new = []
        for r in p.records:
            freed += r.nbytes
            new.append(SiteRecord(r.pass_number, r.label, r.module, None, r.shape, r.dtype, 0,
                                  {**r.meta, "payload": state, **extra}))
        p.records = new
        if p.trace is not None:  # the pass's trace held the same payloads: release them there too
            for op in p.trace._ops.values():
                if op.saved and op.kind != "output":
                    op.saved = False
                    op._outputs = tuple(None for _ in op._outputs)
        self.retained -= freed
        self.evicted[old] = state

    def _check_budget(self, decode_bytes: int | None) -> None:
        """After the first decode step (`decode_bytes` given): refuse when the retained bytes
        projected for the whole generation exceed the budget. At every later step: refuse when
        the retained bytes themselves exceed it (a generation whose length is unknown)."""
        budget = self.options.max_saved_bytes
        if budget is None:
            return
        projected = self.retained
        if decode_bytes is not None and self.max_new is not None:
            decodes = max(self.max_new - 1, 0)  # the last token runs no forward
            keep = self.options.keep_last
            if keep is None:
                projected = self.prompt_bytes + decode_bytes * decodes
            else:  # the ring buffer's fullest moment, with or without the prefill still in it
                projected = max(self.prompt_bytes + decode_bytes * min(keep - 1, decodes),
                                decode_bytes * min(keep, decodes))
        if projected > budget:
            raise RecordingError("record_generation_budget_exceeded",
                                 f"the recording would retain about {projected} bytes"
                                 + (f" over {self.max_new} new tokens" if self.max_new else "")
                                 + f"; max_saved_bytes is {budget}",
                                 remedy="reduce the sites (reducers=), keep fewer steps (keep_last=, spill=), or raise "
                                        "max_saved_bytes=", projected_bytes=projected, budget=budget)


def _shape(value: Any) -> tuple | None:
    shape = getattr(value, "shape", None)
    if shape is None:
        return None
    try:
        return tuple(int(d) for d in shape)
    except Exception:
        return None


def _dtype(value: Any) -> str | None:
    d = getattr(value, "dtype", None)
    return None if d is None else str(d)


__all__ = ["GenerationOptions", "GenerationRecording", "GenerationStep", "TokenSeries", "ForwardData",
           "GenerationRequest", "GenerationRun", "NOT_RECORDED", "record_generation", "generation_driver"]
