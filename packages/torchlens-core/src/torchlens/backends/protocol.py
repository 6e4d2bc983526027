"""The backend contract: BackendProtocol, BackendSpec, capabilities and requirements."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Literal, Mapping, Protocol, runtime_checkable

from torchlens.backends.codes import CAPABILITY_REFUSALS, REFUSAL_CODES, VALIDATION_REASONS
from torchlens.errors import BackendUnsupportedError

Maturity = Literal["preview", "stable"]
Materialization = Literal["eager", "lazy"]


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do. A flag that is False refuses with its code from
    `CAPABILITY_REFUSALS` when the capability is requested."""

    backward_capture: bool = False
    fastlog: bool = False
    interventions: bool = False
    rng_replay: bool = False
    streaming: bool = False
    structure_only_capture: bool = False
    validation_replay: bool = False
    payload_materialization: bool = True
    intermediate_derived_grads: bool = False

    def as_dict(self) -> dict[str, bool]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def refuse_unless(self, flag: str, what: str = "") -> None:
        """Raise the flag's refusal code when the flag is False."""
        if not getattr(self, flag):
            raise BackendUnsupportedError(CAPABILITY_REFUSALS[flag], what or f"this backend does not support {flag}",
                                          remedy="use a backend whose capabilities() declare it", flag=flag)


assert set(CAPABILITY_REFUSALS) == {f.name for f in fields(BackendCapabilities)}


#: distributions -> the installed version found for them (see `installed_version`)
_INSTALLED_VERSIONS: dict[tuple, str] = {}


@dataclass(frozen=True)
class FrameworkRequirement:
    """What a backend needs from its framework: the supported range is [minimum, below)."""

    distributions: tuple[str, ...]
    minimum: str
    below: str | None = None
    tested_through: str | None = None
    pinned: str | None = None
    extra: str = ""

    def installed_version(self) -> str | None:
        """The installed framework version, read from distribution metadata (no import).
        A version found is kept for the process (every `tl.trace` asks; parsing metadata costs
        about a millisecond); an absent framework is looked up again next time."""
        key = tuple(self.distributions)
        found = _INSTALLED_VERSIONS.get(key)
        if found is not None:
            return found
        from importlib import metadata

        for dist in self.distributions:
            try:
                found = metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
            _INSTALLED_VERSIONS[key] = found
            return found
        return None

    def contains(self, version: str) -> bool:
        v = _vtuple(version)
        if v < _vtuple(self.minimum):
            return False
        return self.below is None or v < _vtuple(self.below)

    def range_text(self) -> str:
        return f"[{self.minimum}, {self.below or 'unbounded'})"


def _vtuple(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if digits == "":
            break
        out.append(int(digits))
        if not part.isdigit():
            break
    return tuple(out)


@runtime_checkable
class BackendProtocol(Protocol):
    """The one interface every backend implements to produce traces."""

    name: str
    maturity: Maturity
    framework: FrameworkRequirement
    materialization: Materialization

    def capabilities(self) -> BackendCapabilities: ...
    def runtime_available(self) -> str | None: ...
    def can_handle(self, model: Any, args: tuple, kwargs: dict) -> bool: ...
    def capture(self, model: Any, args: tuple, kwargs: dict, **trace_options: Any) -> Any: ...
    def reference_output(self, model: Any, args: tuple, kwargs: dict) -> Any: ...
    def validate(self, trace: Any, ground_truth: Any = None) -> Any: ...
    def is_tensor(self, value: Any) -> bool: ...
    def host_copy(self, value: Any) -> Any: ...
    def realize_once(self, values: Any) -> Any: ...
    def trace_options(self) -> frozenset[str]: ...
    def refusal_codes(self) -> frozenset[str]: ...


PROTOCOL_MEMBERS: tuple[str, ...] = (
    "name", "maturity", "framework", "materialization", "capabilities", "runtime_available",
    "can_handle", "capture", "reference_output", "validate", "is_tensor", "host_copy",
    "realize_once", "trace_options", "refusal_codes",
)


def missing_members(obj: Any) -> list[str]:
    """Names of `BackendProtocol` members `obj` lacks."""
    return [m for m in PROTOCOL_MEMBERS if not hasattr(obj, m)]


@dataclass(frozen=True)
class BackendSpec:
    """A backend's registration: what the doctor and `tl.trace` need without importing
    its framework. `protocol` is a lazy factory that imports the framework on call.

    - `modules`: top-level framework module names; the backend is a candidate for
      automatic selection only if one of them is already in `sys.modules`.
    - `zoo`: optional lazy factory returning the backend's conformance models.
    - `namespace`: optional dotted module path served as `tl.backends.<name>`.
    """

    name: str
    maturity: Maturity
    framework: FrameworkRequirement
    protocol: Callable[[], Any] | None = None
    modules: tuple[str, ...] = ()
    zoo: Callable[[], Any] | None = None
    namespace: str | None = None
    description: str = ""
    package: str = ""


@dataclass
class ValidationStatus:
    """The outcome of a backend's validate: `ok`, the first failing op and its reason."""

    ok: bool
    first_failure: str | None = None
    reason: str | None = None
    decisions: list[dict[str, Any]] = field(default_factory=list)
    reason_counts: Mapping[str, int] = field(default_factory=dict)
    detail: str = ""

    def __post_init__(self) -> None:
        if self.reason is not None and self.reason not in VALIDATION_REASONS:
            raise ValueError(f"validation reason {self.reason!r} is not in VALIDATION_REASONS")

    def __bool__(self) -> bool:
        return self.ok

    @property
    def state(self) -> str:
        """"passed" or "failed" (the spec's `validation_replay_status.state`)."""
        return "passed" if self.ok else "failed"

    @property
    def num_failed_ops(self) -> int:
        """How many ops have a failed decision (the first is `first_failure`); at least 1
        on a failed status whose backend stops at its first failure."""
        n = sum(1 for d in self.decisions if d.get("ok") is False)
        return n if self.ok or n else 1


# capability protocols ---------------------------------------------------------------------------
#
# What a backend offers beyond `BackendProtocol` is typed: one runtime-checkable protocol per
# capability, bound to the `BackendCapabilities` flag that declares it (or, for a flagless
# extension, declared by implementing it). `check_capability_protocols` runs when the
# protocol object is registered (`tl.backends.get_protocol`): a declared capability whose
# members are missing, or members of a capability the backend does not declare, are refused
# there, typed, so core reads a capability from `capabilities()` / `supports(...)` and never
# probes for an optional member.


@runtime_checkable
class SupportsInterventions(Protocol):
    """`interventions=True`: the math edits run with, and module-output edits for the bound
    and rerun engines."""

    def edit_ops(self) -> Any: ...
    def attach_module_edits(self, model: Any, rules: list, ops: Any, fired: dict) -> Any: ...


@runtime_checkable
class SupportsBackward(Protocol):
    """`backward_capture=True`: `trace.backward(loss)` fills `op.grads` of a trace captured
    with `CaptureOptions(backward_ready=True, save_grads=True)`."""

    def backward(self, trace: Any, loss: Any, **kwargs: Any) -> Any: ...


@runtime_checkable
class SupportsValidation(Protocol):
    """`validation_replay=True`: `validate` replays the ops (on a backend that declares it
    False, the required `validate` refuses with `validation_replay_unsupported`)."""

    def validate(self, trace: Any, ground_truth: Any = None) -> Any: ...


@runtime_checkable
class SupportsValidationSession(Protocol):
    """Optional, needs `validation_replay=True`: a context manager `tl.validate` runs inside
    (for example pinning the framework's intra-op threads)."""

    def validation_session(self, num_threads: int | None = None) -> Any: ...


@runtime_checkable
class SupportsValidationScopes(Protocol):
    """Optional, needs `validation_replay=True`: `tl.validate(scope=...)` for the scopes past
    "forward" and "saved" ("receptive_field", "intervention", "backward"). Returns
    (ValidationStatus, the validation trace or None)."""

    def validate_scope(self, scope: str, model: Any, args: tuple, kwargs: dict, capture: Any = None) -> Any: ...


@runtime_checkable
class EditOps(Protocol):
    """What `edit_ops()` of a backend declaring `interventions=True` returns: the math edits
    and replay run with, on the backend's own values (`tl.backends.sdk.NumpyEditOps` is the
    numpy implementation). Checked at registration."""

    def zeros_like(self, x: Any) -> Any: ...
    def clone(self, x: Any) -> Any: ...
    def clip(self, x: Any, lo: Any, hi: Any) -> Any: ...
    def mean(self, x: Any, dim: Any, keepdim: bool) -> Any: ...
    def norm(self, x: Any, dim: Any, keepdim: bool, p: float = 2.0) -> Any: ...
    def randn_like(self, x: Any, seed: int) -> Any: ...
    def permute_flat(self, x: Any, seed: int) -> Any: ...
    def moveaxis(self, x: Any, src: int, dst: int) -> Any: ...
    def where(self, mask: Any, a: Any, b: Any) -> Any: ...
    def asarray(self, v: Any, like: Any) -> Any: ...
    def param_stamp(self, p: Any) -> Any: ...
    def replay_args(self, op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]: ...
    def rng_state(self, state: Any) -> Any: ...


EDIT_OPS_MEMBERS: tuple[str, ...] = ("zeros_like", "clone", "clip", "mean", "norm", "randn_like", "permute_flat",
                                     "moveaxis", "where", "asarray", "param_stamp", "replay_args", "rng_state")


@runtime_checkable
class ReplayOps(Protocol):
    """The backend's side of core's one per-op replay engine (`torchlens.replay.engine`):
    what validation and interventions need to re-execute a recorded op and judge the result.
    `tl.backends.sdk.ReplayOpsBase` holds a default for every member (plain call, no RNG,
    numpy bit-for-bit comparison); an `EditOps` lacking the others is adapted with those
    defaults (`tl.backends.sdk.replay_ops_from`)."""

    def replay_args(self, op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]: ...
    def rng_state(self, state: Any) -> Any: ...
    def parent_value(self, op: Any, ref: Any, value: Any) -> Any: ...
    def call(self, op: Any, args: tuple, kwargs: dict) -> Any: ...
    def outputs(self, op: Any, out: Any, args: tuple) -> tuple: ...
    def equal(self, a: Any, b: Any) -> bool: ...
    def compare(self, trace: Any, op: Any, got: tuple, want: tuple) -> tuple[str | None, str, dict[str, Any]]: ...
    def preflight(self, trace: Any) -> None: ...


REPLAY_OPS_MEMBERS: tuple[str, ...] = ("replay_args", "rng_state", "parent_value", "call", "outputs", "equal", "compare",
                                       "preflight")


@runtime_checkable
class DifferentiableEditOps(EditOps, Protocol):
    """The edit ops of a backend declaring both `interventions` and `backward_capture`:
    `grad_enabled()` is the context differentiable replay runs in."""

    def grad_enabled(self) -> Any: ...


@runtime_checkable
class SupportsPersistence(Protocol):
    """Optional: the codec that turns this backend's payloads into bytes and back
    (`torchlens.io.codec.PayloadCodec`). Without it, payloads must be numpy arrays and core's
    `NumpyCodec` is used."""

    def payload_codec(self) -> Any: ...


@runtime_checkable
class SupportsHostValues(Protocol):
    """Optional: a framework value holding `values` (numpy), shaped and typed like `like`."""

    def from_host(self, values: Any, like: Any = None) -> Any: ...


@runtime_checkable
class SupportsCallableTable(Protocol):
    """Optional: a saved callable name back to a callable, through the backend's closed table
    only (None when the name is not in it; the op then stays opaque)."""

    def resolve_callable(self, qualname: str) -> Any: ...


@runtime_checkable
class SupportsOpRebinding(Protocol):
    """Optional: a loaded op's callable rebuilt from its own records (for example a JAX
    primitive and its parameters), or None."""

    def rebind_op(self, op: Any) -> Any: ...


@dataclass(frozen=True)
class CapabilityProtocol:
    """One capability protocol: its members, the flag that declares it (None: declared by
    implementing it) and a flag it needs (`requires`)."""

    protocol: type
    members: tuple[str, ...]
    flag: str | None = None
    requires: str | None = None


@runtime_checkable
class SupportsGenerationRecording(Protocol):
    """Optional (issue 22): `generation_driver()` returns the object `tl.record(...,
    generate_kwargs=...)` runs generate() through. That object has
    `record_generation(model, args, kwargs, request: GenerationRequest) -> GenerationRun`
    (call `request.on_forward(ForwardData(...))` after every forward), `is_tensor(value)`,
    `concat(parts)` (rows along the first axis), `spill_save(obj, path)` and `spill_load(path)`.
    Core reads it from the backend's type (`torchlens.recording.generation.generation_driver`)."""

    def generation_driver(self) -> Any: ...


CAPABILITY_PROTOCOLS: tuple[CapabilityProtocol, ...] = (
    CapabilityProtocol(SupportsInterventions, ("edit_ops", "attach_module_edits"), flag="interventions"),
    CapabilityProtocol(SupportsBackward, ("backward",), flag="backward_capture"),
    CapabilityProtocol(SupportsValidation, ("validate",), flag="validation_replay"),
    CapabilityProtocol(SupportsValidationSession, ("validation_session",), requires="validation_replay"),
    CapabilityProtocol(SupportsValidationScopes, ("validate_scope",), requires="validation_replay"),
    CapabilityProtocol(SupportsPersistence, ("payload_codec",)),
    CapabilityProtocol(SupportsHostValues, ("from_host",)),
    CapabilityProtocol(SupportsCallableTable, ("resolve_callable",)),
    CapabilityProtocol(SupportsOpRebinding, ("rebind_op",)),
    CapabilityProtocol(SupportsGenerationRecording, ("generation_driver",)),
)


def _has(obj: Any, member: str) -> bool:
    """`member` is a callable the object's class defines (instance attributes do not count:
    a capability is a property of the backend's type)."""
    return callable(inspect.getattr_static(type(obj), member, None))


def supports(proto: Any, protocol: type) -> bool:
    """True when `proto` (a registered backend) offers `protocol`. For a flag-bound protocol
    this reads the declared flag; registration guaranteed the members match it."""
    if proto is None:
        return False
    for cp in CAPABILITY_PROTOCOLS:
        if cp.protocol is protocol:
            if cp.flag is not None:
                return proto.capabilities().as_dict()[cp.flag]
            return all(_has(proto, m) for m in cp.members)
    raise TypeError(f"{protocol!r} is not a capability protocol")


def check_capability_protocols(proto: Any) -> None:
    """Refuse, typed, a backend whose members disagree with its declared capabilities, or
    whose `refusal_codes()` contradict them."""
    caps = proto.capabilities()
    name = proto.name  # a required member, checked before this runs
    flags = caps.as_dict()
    for cp in CAPABILITY_PROTOCOLS:
        present = [m for m in cp.members if _has(proto, m)]
        missing = [m for m in cp.members if m not in present]
        declared = True if cp.flag is None else flags[cp.flag]
        if cp.flag is None and not present:
            continue  # an optional extension the backend does not offer
        if declared and missing:
            raise BackendUnsupportedError(
                "backend_capability_members_missing",
                f"backend {name!r} declares {cp.flag or cp.protocol.__name__} but lacks {', '.join(missing)}",
                remedy=f"implement every member of tl.backends.{cp.protocol.__name__}, or declare the capability False",
                backend=name, protocol=cp.protocol.__name__, missing=missing)
        base = set(PROTOCOL_MEMBERS)
        extra = [m for m in present if m not in base]
        if not declared and extra:
            raise BackendUnsupportedError(
                "backend_capability_undeclared",
                f"backend {name!r} implements {', '.join(extra)} ({cp.protocol.__name__}) but declares {cp.flag}=False",
                remedy=f"declare {cp.flag}=True in capabilities(), or remove the members", backend=name,
                protocol=cp.protocol.__name__, members=extra)
        if cp.requires is not None and not flags[cp.requires]:
            raise BackendUnsupportedError(
                "backend_capability_undeclared",
                f"backend {name!r} implements {cp.protocol.__name__} but declares {cp.requires}=False",
                remedy=f"declare {cp.requires}=True, or remove {', '.join(present)}", backend=name,
                protocol=cp.protocol.__name__, members=present)
    if flags["interventions"]:
        _check_edit_ops(proto, name, differentiable=flags["backward_capture"])
    declared_codes = set(proto.refusal_codes())
    for flag, value in caps.as_dict().items():
        code = CAPABILITY_REFUSALS[flag]
        if value == (code in declared_codes):
            raise BackendUnsupportedError(
                "backend_refusal_codes_inconsistent",
                f"backend {name!r} declares {flag}={value} but its refusal_codes() "
                f"{'lists' if value else 'omits'} {code!r}",
                remedy="derive refusal_codes() with tl.backends.sdk.refusal_codes_for(self)", backend=name, flag=flag)


def _check_edit_ops(proto: Any, name: str, differentiable: bool) -> None:
    """The object `edit_ops()` returns has every `EditOps` member (and `grad_enabled` when
    the backend also declares `backward_capture`)."""
    ops = proto.edit_ops()
    wanted = EDIT_OPS_MEMBERS + (("grad_enabled",) if differentiable else ())
    missing = [m for m in wanted if not _has(ops, m)]
    if missing:
        raise BackendUnsupportedError(
            "backend_capability_members_missing",
            f"backend {name!r}: edit_ops() returns {type(ops).__name__}, which lacks {', '.join(missing)}",
            remedy="return an object implementing tl.backends." + ("DifferentiableEditOps" if differentiable else "EditOps")
                   + " (subclass tl.backends.sdk.NumpyEditOps for numpy values)",
            backend=name, protocol="DifferentiableEditOps" if differentiable else "EditOps", missing=missing)


def edit_ops_of(proto: Any, what: str = "") -> Any:
    """The backend's `EditOps`, or the typed `interventions_unsupported` refusal."""
    if proto is None:
        raise BackendUnsupportedError("backend_unknown", f"{what or 'this trace'} has no backend to run edits with",
                 remedy="capture the trace again with an installed backend")
    proto.capabilities().refuse_unless("interventions", what or f"the {proto.name} backend does not support interventions")
    return proto.edit_ops()


#: Refusal codes every backend may raise whatever it declares.
BASE_REFUSALS: frozenset[str] = frozenset({"trace_option_unsupported", "runtime_missing", "runtime_version_unsupported"})


def refusal_codes_for(proto: Any, extra: Any = ()) -> frozenset[str]:
    """A backend's `refusal_codes()`, derived in core: the code of every capability flag it
    declares False, `BASE_REFUSALS`, `explicit_seed_unsupported` for a preview backend, plus
    `extra` (its own codes from `REFUSAL_CODES`, such as `foreign_tensor_input`)."""
    caps = proto.capabilities()
    extra = frozenset(extra)
    unknown = extra - REFUSAL_CODES
    if unknown:
        raise ValueError(f"refusal codes outside tl.backends.REFUSAL_CODES: {sorted(unknown)}")
    supported = {CAPABILITY_REFUSALS[f] for f, v in caps.as_dict().items() if v}
    if extra & supported:
        raise ValueError(f"refusal codes of declared capabilities: {sorted(extra & supported)}")
    off = {CAPABILITY_REFUSALS[f] for f, v in caps.as_dict().items() if not v}
    seed = {"explicit_seed_unsupported"} if proto.maturity == "preview" else set()
    return frozenset(off | BASE_REFUSALS | seed | extra)


__all__ = ["BackendCapabilities", "FrameworkRequirement", "BackendProtocol", "BackendSpec", "ValidationStatus",
           "PROTOCOL_MEMBERS", "REFUSAL_CODES", "VALIDATION_REASONS", "missing_members", "CapabilityProtocol",
           "CAPABILITY_PROTOCOLS", "SupportsInterventions", "SupportsBackward", "SupportsValidation",
           "SupportsValidationSession", "SupportsPersistence", "SupportsHostValues", "SupportsCallableTable",
           "SupportsOpRebinding", "SupportsValidationScopes", "EditOps", "DifferentiableEditOps", "EDIT_OPS_MEMBERS",
           "ReplayOps", "REPLAY_OPS_MEMBERS",
           "edit_ops_of", "supports", "check_capability_protocols", "refusal_codes_for", "BASE_REFUSALS"]
