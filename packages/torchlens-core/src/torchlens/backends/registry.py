"""Backend lookup and selection over the plugin registry."""

from __future__ import annotations

import importlib
import sys
import threading
from typing import Any

from torchlens.backends.protocol import BackendSpec, check_capability_protocols, missing_members
from torchlens.errors import BackendUnsupportedError, InvalidArgumentError
from torchlens.plugins.manager import get_plugin_manager

#: Backends this project ships, with the pip extra that installs each.
KNOWN_BACKEND_EXTRAS: dict[str, str] = {
    "torch": "torch", "jax": "jax", "mlx": "mlx", "tf": "tf", "paddle": "paddle", "tinygrad": "tinygrad",
}

_protocols: dict[str, Any] = {}


def install_hint(extra: str) -> str:
    """The install line for a pip extra. TorchLens is installed from a wheelhouse built in the
    repository (`scripts/build-wheels.sh`), never from PyPI, where "torchlens" is another project."""
    return f'pip install --no-index --find-links wheelhouse "torchlens[{extra}]" (see docs/install.md)'


_lock = threading.Lock()


def specs() -> dict[str, BackendSpec]:
    """Every registered BackendSpec, by name (loads plugins; imports no framework)."""
    return get_plugin_manager().backends()


def get_spec(name: str) -> BackendSpec:
    found = specs().get(name)
    if found is not None:
        return found
    if name in KNOWN_BACKEND_EXTRAS:
        extra = KNOWN_BACKEND_EXTRAS[name]
        raise BackendUnsupportedError("runtime_missing", f"the {name} backend is not installed",
                                      remedy=install_hint(extra), backend=name, extra=extra)
    raise BackendUnsupportedError("backend_unknown", f"no backend named {name!r} is registered",
                                  remedy="registered backends: " + (", ".join(sorted(specs())) or "none"), backend=name)


def get_protocol(name: str) -> Any:
    """The backend's protocol object (created once; this imports its framework)."""
    with _lock:
        proto = _protocols.get(name)
        if proto is not None:
            return proto
    spec = get_spec(name)
    if spec.protocol is None:
        raise BackendUnsupportedError("backend_protocol_incomplete", f"backend {name!r} registers no protocol factory",
                                      remedy="set BackendSpec.protocol", backend=name)
    refuse_framework(spec)  # read from distribution metadata: the framework is not imported for a refusal
    proto = spec.protocol()
    missing = missing_members(proto)
    if missing:
        raise BackendUnsupportedError("backend_protocol_incomplete", f"backend {name!r} lacks {', '.join(missing)}",
                                      remedy="implement every member of tl.backends.BackendProtocol", backend=name,
                                      missing=missing)
    check_capability_protocols(proto)
    with _lock:
        _protocols[name] = proto
    return proto


def framework_problem(spec: BackendSpec) -> str | None:
    """`runtime_missing` / `runtime_version_unsupported` when the installed framework (read
    from distribution metadata, never imported) is absent or outside the spec's range."""
    fw = spec.framework
    installed = fw.installed_version()
    if installed is None:
        return "runtime_missing"
    return None if fw.contains(installed) else "runtime_version_unsupported"


def refuse_framework(spec: BackendSpec) -> None:
    """Raise the typed refusal of `framework_problem`, before the backend's factory (which
    imports the framework) runs."""
    code = framework_problem(spec)
    if code is None:
        return
    fw = spec.framework
    installed = fw.installed_version()
    what = "is not installed" if installed is None else f"{installed} is outside the supported range {fw.range_text()}"
    raise BackendUnsupportedError(code, f"the {spec.name} backend's framework {'/'.join(fw.distributions)} {what}",
                                  remedy=install_hint(fw.extra or spec.name), backend=spec.name, installed=installed,
                                  supported=fw.range_text())


def reset_protocol_cache() -> None:
    with _lock:
        _protocols.clear()


def select_backend(model: Any, args: tuple, kwargs: dict, backend: str | None = None) -> Any:
    """The protocol object that will capture `model`: the named one, or the first
    candidate (framework already imported) whose `can_handle` says yes."""
    if backend is not None:
        if not isinstance(backend, str):
            raise InvalidArgumentError("invalid_argument", f"backend= takes a backend name, not {type(backend).__name__}",
                                       remedy="for example backend='torch'", backend=repr(backend))
        proto = get_protocol(backend)
        code = proto.runtime_available()
        if code is not None:
            spec = get_spec(backend)
            raise BackendUnsupportedError(code, f"the {backend} backend cannot run here ({code})",
                                          remedy=install_hint(spec.framework.extra or backend), backend=backend)
        if not proto.can_handle(model, args, kwargs):
            tname = f"{type(model).__module__}.{type(model).__qualname__}"
            raise InvalidArgumentError("model_type_unsupported", f"the {backend} backend cannot trace a {tname}",
                                       remedy="pass a model of that backend's framework, or omit backend=", model_type=tname,
                                       backend=backend)
        return proto
    all_specs = specs()
    # a framework outside its range is no candidate (checked once, before its protocol is made)
    candidates = [s for s in all_specs.values() if any(m in sys.modules for m in s.modules)
                  and (s.name in _protocols or framework_problem(s) is None)]
    for spec in candidates:
        proto = get_protocol(spec.name)
        if proto.runtime_available() is None and proto.can_handle(model, args, kwargs):
            return proto
    tname = f"{type(model).__module__}.{type(model).__qualname__}"
    tried = ", ".join(s.name for s in candidates) or "none (no supported framework is imported)"
    raise InvalidArgumentError(
        "model_type_unsupported", f"no registered backend can trace a {tname}",
        remedy=f"pass a model of an installed framework (backends tried: {tried}; registered: {', '.join(sorted(all_specs)) or 'none'})",
        model_type=tname)


def namespace(name: str) -> Any:
    """`tl.backends.<name>`: the installed backend package's public namespace."""
    spec = get_spec(name)
    if spec.namespace is None:
        raise BackendUnsupportedError("backend_unknown", f"backend {name!r} publishes no namespace",
                                      remedy="use tl.trace(..., backend=name)", backend=name)
    return importlib.import_module(spec.namespace)
