"""Option dataclasses (frozen). Every capture setting rides one of these or an entry-point
keyword; values outside their vocabulary raise typed errors at construction."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from torchlens.errors import InterventionError, InvalidArgumentError

_SAVE_MODES = ("copy", "reference", "view")
_ON_NONFINITE = ("ignore", "track", "warn", "raise")


@dataclass(frozen=True)
class CaptureOptions:
    """Capture mechanics. Payload selection is `save=` on `tl.trace`, not a field here.

    - `save_mode`: `"copy"` isolates each saved value (default), `"reference"` keeps the
      live object, `"view"` leaves aliasing visible.
    - `output_device`: `"same"` or a device string saved payloads are moved to.
    - `detach_saved_activations`: detach saved payloads from the autograd graph.
    - `inference_only`: run the forward without building a graph (`None`: implied from
      the caller's grad mode).
    - `backward_ready` / `save_grads`: keep the graph so `trace.backward(loss)` can fill
      `op.grad`.
    - `carry_state`: let buffers, modes and attributes advance as a plain forward would
      (default False: pure observer).
    - `seed`: seed the capture's own random streams.
    - `on_nonfinite`: `"ignore"`, `"track"`, `"warn"` or `"raise"`.
    - `save_budget`: the most bytes of payloads a capture may keep (`"auto"` or None: no
      limit); a capture over it raises `SaveBudgetExceededError` (`save_budget_exceeded`).
      The torch backend charges each payload before keeping it and stops the forward at the
      first one over the budget (with a `save=` selector, every payload held until the
      selection is resolved counts); other backends are checked after the capture.
    - `snapshot_params` (experimental): right after the capture, keep a read-only host copy
      of every parameter value the trace recorded (`torchlens.bundle.snapshot_params`), the
      capture-time evidence a Bundle's cross-member parameter reads need (else they refuse
      with `checkpoint_series_live_params`). Costs one copy of the model's parameters.
    - `replayable`: record what a runnable save and the edge-patching verbs need (what a
      default capture does not promise to keep). It asks for a backward: True implies
      `backward_ready=True` (the effective value `trace.options` reports), so an enclosing
      `torch.no_grad()` does not make the capture inference-only; `inference_only=True`
      with it refuses `capture_option_invalid`. `torchlens.mechinterp.patch_edges` refuses a
      trace captured without it (`mi_edge_patch_not_replayable`). It also implies
      `snapshot_params=True`: the capture-time parameter values a `level="runnable"` save
      writes (`torchlens.io.runnable`); buffers come from the buffer ops' saved copies.
    """

    save_mode: str = "copy"
    output_device: str = "same"
    detach_saved_activations: bool = False
    inference_only: bool | None = None
    backward_ready: bool = False
    save_grads: bool = False
    carry_state: bool = False
    seed: int | None = None
    on_nonfinite: str = "ignore"
    save_budget: Any = "auto"
    snapshot_params: bool = False
    replayable: bool = False

    def __post_init__(self) -> None:
        if not (self.save_budget in ("auto", None) or (isinstance(self.save_budget, int) and not isinstance(self.save_budget, bool)
                                                     and self.save_budget >= 0)):
            raise InvalidArgumentError("capture_option_invalid", f"save_budget={self.save_budget!r} is not 'auto', None or bytes",
                                       remedy="save_budget=2**30 (bytes), 'auto' or None", field="save_budget")
        if self.save_mode not in _SAVE_MODES:
            raise InvalidArgumentError("capture_option_invalid", f"save_mode={self.save_mode!r} is not one of {_SAVE_MODES}",
                                       remedy="use 'copy', 'reference' or 'view'", field="save_mode")
        if self.on_nonfinite not in _ON_NONFINITE:
            raise InvalidArgumentError("on_nonfinite_invalid", f"on_nonfinite={self.on_nonfinite!r} is not one of {_ON_NONFINITE}",
                                       remedy="use 'ignore', 'track', 'warn' or 'raise'", field="on_nonfinite")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidArgumentError("capture_option_invalid", "seed must be an int or None", remedy="seed=0",
                                       field="seed")
        if self.inference_only and (self.backward_ready or self.save_grads):
            raise InvalidArgumentError("capture_option_invalid", "inference_only=True conflicts with backward_ready/save_grads",
                                       remedy="drop inference_only or the gradient options", field="inference_only")
        for name in ("detach_saved_activations", "backward_ready", "save_grads", "carry_state", "snapshot_params",
                     "replayable"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError("capture_option_invalid", f"{name} must be a bool", remedy=f"{name}=True or False",
                                           field=name)
        if self.replayable:
            if self.inference_only:
                raise InvalidArgumentError("capture_option_invalid", "inference_only=True conflicts with replayable=True "
                                           "(a replayable capture keeps its backward graph)",
                                           remedy="drop inference_only or replayable", field="replayable")
            object.__setattr__(self, "backward_ready", True)  # replayable asks for a backward (glossary)
            # the capture-time parameter snapshot a runnable save writes (runnable/state.safetensors),
            # taken by the existing snapshot path as the capture's last step (bundle.guard)
            object.__setattr__(self, "snapshot_params", True)

    def as_dict(self) -> dict[str, Any]:
        """Every field by name (what `dataclasses.asdict` gives: the values are immutable
        scalars, so no deep copy is made; this runs once per capture)."""
        names = _FIELD_NAMES.get(type(self))
        if names is None:
            names = _FIELD_NAMES[type(self)] = tuple(f.name for f in fields(self))
        return {n: getattr(self, n) for n in names}


#: dataclass field names per options class (read by `as_dict`)
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


@dataclass(frozen=True)
class TraceOptions(CaptureOptions):
    """`trace.options`: the stored snapshot of how a capture ran: every `CaptureOptions`
    field with its effective value (an implied `inference_only` filled in), plus the payload
    selection (`save`, `structure_only`)."""

    save: str = "all"
    structure_only: bool = False

    @classmethod
    def from_capture(cls, opts: CaptureOptions, *, save: str, structure_only: bool, **effective: Any) -> "TraceOptions":
        values = {**CaptureOptions.as_dict(opts), **effective}
        values.pop("save", None)
        values.pop("structure_only", None)
        return cls(save=save, structure_only=structure_only, **values)

    def capture_options(self) -> CaptureOptions:
        """The `CaptureOptions` part, to capture again the same way."""
        return CaptureOptions(**{f.name: getattr(self, f.name) for f in fields(CaptureOptions)})


_ENGINES = ("replay", "rerun", "set_only")
_ZERO_FIRE = ("warn", "error", "disclose")


@dataclass(frozen=True)
class InterventionOptions:
    """How `Trace.do` applies an edit.

    - `engine`: `None` picks from the arguments (replay without model/inputs, rerun with
      both); `"replay"` pushes the edit through the recorded graph; `"rerun"` re-executes
      the model with the edit live; `"set_only"` stages the edit without propagating.
    - `on_zero_fire`: `"warn"`, `"error"` or `"disclose"` for an edit that fires nowhere.
    - `differentiable`: replay onto a new fork whose recomputed values keep their autograd
      graph (back to the parameters and the edited values) and return that fork.
    - `allow_changed_params`: let the replay engine run with parameters that changed since
      capture (default False: `replay_param_changed_since_capture`); the names land in
      `trace.last_run["replayed_with_changed_params"]`. Rerun and set-only ignore it.
    """

    engine: str | None = None
    on_zero_fire: str = "warn"
    differentiable: bool = False
    allow_changed_params: bool = False

    def __post_init__(self) -> None:
        if self.engine is not None and self.engine not in _ENGINES:
            raise InterventionError("engine_invalid", f"engine={self.engine!r} is not one of {_ENGINES}",
                                       remedy="engine='replay', 'rerun' or 'set_only'", engine=self.engine)
        if self.on_zero_fire not in _ZERO_FIRE:
            raise InterventionError("zero_fire_policy_invalid", f"on_zero_fire={self.on_zero_fire!r} is not one of {_ZERO_FIRE}",
                                       remedy="'warn', 'error' or 'disclose'")
        _check_flags(self, ("differentiable", "allow_changed_params"))


@dataclass(frozen=True)
class ReplayOptions:
    """How the replay engine pushes an edit through the recorded graph
    (`trace.do(site, edit, intervention=ReplayOptions(...))`, always the replay engine).

    - `on_zero_fire`: `"warn"`, `"error"` or `"disclose"` for an edit that fires nowhere.
    - `allow_changed_params`: as on `InterventionOptions`. There is no `differentiable`
      field: use `InterventionOptions(differentiable=True)`.
    """

    on_zero_fire: str = "warn"
    allow_changed_params: bool = False

    def __post_init__(self) -> None:
        if self.on_zero_fire not in _ZERO_FIRE:
            raise InterventionError("zero_fire_policy_invalid", f"on_zero_fire={self.on_zero_fire!r} is not one of {_ZERO_FIRE}",
                                    remedy="'warn', 'error' or 'disclose'")
        _check_flags(self, ("allow_changed_params",))

    def as_intervention_options(self) -> InterventionOptions:
        """The same request spelled as `InterventionOptions(engine="replay", ...)`."""
        return InterventionOptions(engine="replay", on_zero_fire=self.on_zero_fire,
                                   allow_changed_params=self.allow_changed_params)


def _check_flags(opts: Any, names: tuple[str, ...]) -> None:
    for name in names:
        if not isinstance(getattr(opts, name), bool):
            raise InterventionError("intervention_option_invalid", f"{type(opts).__name__}.{name} must be a bool, "
                                    f"not {type(getattr(opts, name)).__name__}", remedy=f"{name}=True or False", field=name)


def as_intervention_options(value: Any) -> InterventionOptions:
    """`do(..., intervention=...)`'s argument as InterventionOptions (None: the defaults)."""
    if value is None:
        return InterventionOptions()
    if isinstance(value, InterventionOptions):
        return value
    if isinstance(value, ReplayOptions):
        return value.as_intervention_options()
    raise InterventionError("intervention_option_invalid", f"intervention= takes InterventionOptions or ReplayOptions, "
                            f"not {type(value).__name__}", remedy="intervention=tl.options.InterventionOptions(engine='replay')",
                            given=type(value).__name__)


def _refuse(code: str, opts: Any, name: str, why: str, remedy: str) -> None:
    raise InvalidArgumentError(code, f"{type(opts).__name__}.{name}={getattr(opts, name)!r:.80} {why}", remedy=remedy,
                               field=name, options=type(opts).__name__)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_DIRECTIONS = ("TB", "BT", "LR", "RL")
_LAYOUTS = ("auto", "dot", "rank")
_FORMATS = ("pdf", "svg", "png", "dot", "gv")


@dataclass(frozen=True)
class VisualizationOptions:
    """Drawing settings (`Trace.draw`'s keywords as one frozen object; `as_kwargs()` passes
    them to `trace.draw(**opts.as_kwargs())`). Values outside a field's vocabulary raise
    `InvalidArgumentError` (`draw_option_invalid`) at construction.

    - `depth`: fold modules deeper than this (None: no folding).
    - `rolled`: draw one node per layer instead of one per pass.
    - `direction`: "TB", "BT", "LR" or "RL".
    - `theme`: a theme name.
    - `show_legend`: None (automatic), True or False.
    - `layout`: "auto", "dot" or "rank".
    - `file_format`: None or "pdf", "svg", "png", "dot", "gv" (for a path with no extension).
    - `open_viewer`: open the drawing in a viewer after writing it.
    """

    depth: int | None = None
    rolled: bool = False
    direction: str = "TB"
    theme: str = "light"
    show_legend: bool | None = None
    layout: str = "auto"
    file_format: str | None = None
    open_viewer: bool = False

    def __post_init__(self) -> None:
        code = "draw_option_invalid"
        if self.depth is not None and not (_is_int(self.depth) and self.depth >= 0):
            _refuse(code, self, "depth", "is not None or an int >= 0", "depth=2 (or None: no folding)")
        for name in ("rolled", "open_viewer"):
            if not isinstance(getattr(self, name), bool):
                _refuse(code, self, name, "is not a bool", f"{name}=True or False")
        if self.show_legend is not None and not isinstance(self.show_legend, bool):
            _refuse(code, self, "show_legend", "is not None or a bool", "show_legend=None, True or False")
        if self.direction not in _DIRECTIONS:
            _refuse(code, self, "direction", f"is not one of {_DIRECTIONS}", "direction='TB'")
        from torchlens.viz.themes import THEMES

        if not isinstance(self.theme, str) or self.theme not in THEMES:
            _refuse(code, self, "theme", f"is not one of {tuple(THEMES)}", "theme='light'")
        if self.layout not in _LAYOUTS:
            _refuse(code, self, "layout", f"is not one of {_LAYOUTS}", "layout='auto'")
        if self.file_format is not None and self.file_format not in _FORMATS:
            _refuse(code, self, "file_format", f"is not None or one of {_FORMATS}", "file_format='svg'")

    def as_kwargs(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StorageOptions:
    """Streaming-storage settings (`storage=tl.to_disk(...)`: payloads written while the
    capture runs; experimental, names may change). Values outside a field's vocabulary raise
    `InvalidArgumentError` (`storage_option_invalid`) at construction.

    - `path`: the bundle directory to write (a str or path-like; None: not chosen yet).
    - `async_writes`: write payloads on one background writer with a bounded queue.
    - `max_pending_bytes`: queued bytes that block the capture when the disk falls behind
      (default 256 MiB).
    - `overwrite`: replace an existing bundle at `path`.
    """

    path: Any = None
    async_writes: bool = True
    max_pending_bytes: int = 256 * 2**20
    overwrite: bool = False

    def __post_init__(self) -> None:
        import os

        code = "storage_option_invalid"
        if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
            _refuse(code, self, "path", "is not a path", "path='run.tlspec'")
        for name in ("async_writes", "overwrite"):
            if not isinstance(getattr(self, name), bool):
                _refuse(code, self, name, "is not a bool", f"{name}=True or False")
        if not (_is_int(self.max_pending_bytes) and self.max_pending_bytes > 0):
            _refuse(code, self, "max_pending_bytes", "is not an int > 0", "max_pending_bytes=256 * 2**20")


_ON_PREDICATE_ERROR = ("raise", "warn", "skip")
_ON_FORWARD_ERROR = ("raise", "attach_partial", "return_partial")


@dataclass(frozen=True)
class RecordingOptions:
    """Recorder settings of `tl.record` (`recording=RecordingOptions(...)`, matching
    `tl.trace`'s `capture=`). Values outside a field's vocabulary raise
    `InvalidArgumentError` (`recording_option_invalid`) at construction.

    - `default_op` / `default_module` / `default_grad`: what the recorder keeps for an op,
      a module boundary or a gradient no selector names (a bool, or None: the recorder's
      default).
    - `history_size`: recordings kept in the recorder's history (an int >= 0).
    - `include_source_events`: journal source-code events too.
    - `max_predicate_failures`: failures of a save predicate tolerated before the recording
      stops (an int >= 0, or None: no limit).
    - `on_predicate_error`: "raise", "warn" or "skip".
    - `on_forward_error`: "raise", "attach_partial" (the failed partial recording rides on the
      raised error as `exc.partial_recording`) or "return_partial" (it is returned).
    - `postprocess`: None or a callable applied to the finished recording.
    - `lean`: journal only the events the selection keeps (PROVISIONAL SPELLING).
    """

    default_op: bool | None = None
    default_module: bool | None = None
    history_size: int = 1
    include_source_events: bool = False
    max_predicate_failures: int | None = None
    on_predicate_error: str = "raise"
    on_forward_error: str = "raise"
    default_grad: bool | None = None
    postprocess: Any = None
    lean: bool = False

    def __post_init__(self) -> None:
        code = "recording_option_invalid"
        for name in ("default_op", "default_module", "default_grad"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                _refuse(code, self, name, "is not None or a bool", f"{name}=True, False or None")
        for name in ("include_source_events", "lean"):
            if not isinstance(getattr(self, name), bool):
                _refuse(code, self, name, "is not a bool", f"{name}=True or False")
        if not (_is_int(self.history_size) and self.history_size >= 0):
            _refuse(code, self, "history_size", "is not an int >= 0", "history_size=1")
        if self.max_predicate_failures is not None and not (_is_int(self.max_predicate_failures)
                                                            and self.max_predicate_failures >= 0):
            _refuse(code, self, "max_predicate_failures", "is not None or an int >= 0", "max_predicate_failures=10")
        if self.on_predicate_error not in _ON_PREDICATE_ERROR:
            _refuse(code, self, "on_predicate_error", f"is not one of {_ON_PREDICATE_ERROR}", "on_predicate_error='raise'")
        if self.on_forward_error not in _ON_FORWARD_ERROR:
            _refuse(code, self, "on_forward_error", f"is not one of {_ON_FORWARD_ERROR}", "on_forward_error='raise'")
        if self.postprocess is not None and not callable(self.postprocess):
            _refuse(code, self, "postprocess", "is not None or a callable", "postprocess=lambda recording: recording")


__all__ = ["CaptureOptions", "InterventionOptions", "RecordingOptions", "ReplayOptions", "StorageOptions", "TraceOptions",
           "VisualizationOptions"]
