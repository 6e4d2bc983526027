"""The backend contract: BackendProtocol, BackendSpec, capabilities and requirements."""

from __future__ import annotations

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
        """The installed framework version, read from distribution metadata (no import)."""
        from importlib import metadata

        for dist in self.distributions:
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
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


__all__ = ["BackendCapabilities", "FrameworkRequirement", "BackendProtocol", "BackendSpec", "ValidationStatus",
           "PROTOCOL_MEMBERS", "REFUSAL_CODES", "VALIDATION_REASONS", "missing_members"]
