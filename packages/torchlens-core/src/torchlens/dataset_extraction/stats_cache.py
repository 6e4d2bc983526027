"""`tl.stats.aggregate(..., cache=True, cache_dir=...)` (experimental): key the run by value and
restore the folded states on a rerun instead of running the loop.

The key is sha256 over: the model (class, source of its class, structural fingerprint and a
digest of every parameter value, both from a structure-only capture of batch 0), every
batch's input values (names, dtypes, shapes, bytes), each metric's canonical key, kind,
configuration and starting state (`tl_stats_state_v1` bytes), each encoder and `loss_fn`
(module, qualified name, bytecode, constants and primitive defaults/closure values), the
backend and framework versions, TorchLens and NumPy versions. What it cannot key by value
raises `stats_aggregate_cache_unkeyable` before anything runs: a one-shot iterator (keying
reads every batch first), a batch value that is not an array, tensor or primitive, a
callable holding non-primitive state (a bound method, a module, a closure over a tensor), or
a multi-process group.

An entry is one file `<key>.tlagg`: a magic tag, an HMAC-SHA256 and a body of
`tl_stats_state_v1` states (no pickle). The HMAC secret is per user and lives outside every
cache directory ($XDG_STATE_HOME/torchlens/stats_cache_secret, default
~/.local/state/torchlens), so a copied-in entry is not trusted: an entry whose tag or HMAC
does not check is a miss and is rewritten. Writes are atomic (temporary file + rename).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import sys
import types
from pathlib import Path
from typing import Any, Callable

import numpy as np

from torchlens.errors import InvalidArgumentError

MAGIC = b"TLAGG001"
FORMAT = "tl_stats_aggregate_cache_v1"
_PRIMITIVE = (type(None), bool, int, float, str, bytes)


def _unkeyable(why: str, **fields: Any) -> InvalidArgumentError:
    return InvalidArgumentError("stats_aggregate_cache_unkeyable", f"aggregate(cache=True) cannot key this run: {why}",
                                remedy="drop cache= (or make the part named here plain data: a re-iterable loader "
                                       "of tensors, module-level functions)", **fields)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "torchlens" / "stats"


def _secret() -> bytes:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    path = Path(base) / "torchlens" / "stats_cache_secret"
    try:
        data = path.read_bytes()
        if len(data) == 32:
            return data
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    data = secrets.token_bytes(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path.read_bytes()


def _code_digest(code: types.CodeType, h: Any) -> None:
    h.update(code.co_code)
    h.update(code.co_name.encode())
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _code_digest(c, h)
        else:
            h.update(repr(c).encode())
    h.update(repr(code.co_names).encode())


def callable_key(fn: Any, what: str) -> str | None:
    """A value key of a plain function (None for None); anything else is unkeyable."""
    if fn is None:
        return None
    if not isinstance(fn, types.FunctionType):
        raise _unkeyable(f"{what} is a {type(fn).__name__}, not a plain function", part=what)
    h = hashlib.sha256(f"{fn.__module__}.{fn.__qualname__}".encode())
    _code_digest(fn.__code__, h)
    state = list(fn.__defaults__ or ()) + list((fn.__kwdefaults__ or {}).values())
    state += [c.cell_contents for c in (fn.__closure__ or ())]
    for v in state:
        if not isinstance(v, _PRIMITIVE):
            raise _unkeyable(f"{what} holds a {type(v).__name__} (a default or closure value)", part=what)
        h.update(repr(v).encode())
    return h.hexdigest()


def _class_source(model: Any) -> str:
    import inspect

    h = hashlib.sha256()
    for cls in type(model).__mro__:
        if cls.__module__ in ("builtins",) or cls.__module__.startswith(("torch.", "jax", "flax", "mlx", "keras")):
            continue
        try:
            h.update(inspect.getsource(cls).encode())
        except (OSError, TypeError):
            h.update(f"{cls.__module__}.{cls.__qualname__}".encode())
    return h.hexdigest()


def _state_digest(acc: Any) -> str:
    """sha256 of an accumulator's configuration and arrays (not of its safetensors bytes, whose
    header order varies from run to run)."""
    h = hashlib.sha256(json.dumps(acc.config(), sort_keys=True, default=repr).encode())
    for name, a in sorted(acc.state_dict().items()):
        a = np.ascontiguousarray(a)
        h.update(f"|{name}|{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _batch_digest(proto: Any, b: Any) -> str:
    h = hashlib.sha256()
    for name, v in [(str(i), a) for i, a in enumerate(b.args)] + sorted(b.kwargs.items()):
        h.update(name.encode() + b"\0")
        if proto.is_tensor(v) or isinstance(v, np.ndarray):
            a = np.ascontiguousarray(np.asarray(proto.host_copy(v)))
            h.update(f"{a.dtype}{a.shape}".encode())
            h.update(a.tobytes())
        elif isinstance(v, _PRIMITIVE):
            h.update(repr(v).encode())
        else:
            raise _unkeyable(f"batch {b.index} input {name!r} is a {type(v).__name__}, not an array or primitive",
                             part="batch", batch=b.index)
    return h.hexdigest()


def cache_key(model: Any, dataloader: Any, metrics: dict, loss_fn: Callable | None, backend: str | None,
              canonical: Callable[[Any], str]) -> str:
    """The run's value key; raises `stats_aggregate_cache_unkeyable` for what it cannot key."""
    import torchlens
    from torchlens.capture import trace
    from torchlens.dataset_extraction import batching
    from torchlens.dataset_extraction.dataset import param_digest
    if iter(dataloader) is dataloader:
        raise _unkeyable("the dataloader is a one-shot iterator (keying reads every batch before the loop)",
                         part="dataloader")
    metric_keys = []
    for key, acc in metrics.items():
        metric_keys.append({"key": canonical(key), "kind": type(acc).__name__,
                            "state": _state_digest(acc),
                            "encoder": callable_key(getattr(acc, "encoder", None), f"metrics[{canonical(key)!r}].encoder")})
    loss_key = callable_key(loss_fn, "loss_fn")
    batches = []
    probe = proto = None
    for b in batching.iter_batches(dataloader, None, None):
        if probe is None:
            probe = trace(model, *b.args, save="none", input_kwargs=b.kwargs or None, backend=backend)
            proto = probe._backend
        batches.append(_batch_digest(proto, b))
    if probe is None:
        return hashlib.sha256(json.dumps({"empty": True, "metrics": metric_keys}).encode()).hexdigest()
    p = probe.provenance
    record = {
        "format": FORMAT,
        "model": {"class": f"{type(model).__module__}.{type(model).__qualname__}", "source": _class_source(model),
                  "fingerprint": p.fingerprint, "param_digest": param_digest(proto, probe)},
        "batches": batches, "metrics": metric_keys, "loss_fn": loss_key,
        "versions": {"torchlens": torchlens.__version__, "numpy": np.__version__, "backend": p.backend,
                     "backend_version": p.backend_version, "framework_version": p.framework_version,
                     "python": sys.version.split()[0]},
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _entry(cache_dir: Any, key: str) -> Path:
    return Path(default_cache_dir() if cache_dir is None else cache_dir) / f"{key}.tlagg"


def load_entry(cache_dir: Any, key: str, metrics: dict, canonical: Callable[[Any], str]) -> dict | None:
    """{metric key: folded accumulator} from a checked entry, or None (a miss)."""
    from torchlens.dataset_extraction.aggregate import _unpack
    from torchlens.errors import TorchLensError
    from torchlens.stats.state import loads_state

    path = _entry(cache_dir, key)
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    if data[:8] != MAGIC or len(data) < 40:
        return None
    body = data[40:]
    if not hmac.compare_digest(data[8:40], hmac.new(_secret(), body, hashlib.sha256).digest()):
        return None
    try:
        parts = _unpack(body)
        header = json.loads(parts[0])
        if header.get("format") != FORMAT or header.get("key") != key \
                or header.get("metrics") != [canonical(k) for k in metrics] or len(parts) != len(metrics) + 1:
            return None
        return {k: loads_state(blob, encoder=getattr(acc, "encoder", None), where=str(path))
                for (k, acc), blob in zip(metrics.items(), parts[1:])}
    except (TorchLensError, ValueError, UnicodeDecodeError):
        return None


def save_entry(cache_dir: Any, key: str, results: dict, canonical: Callable[[Any], str]) -> Path:
    from torchlens.dataset_extraction.aggregate import _pack
    from torchlens.stats.state import dumps_state

    path = _entry(cache_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = json.dumps({"format": FORMAT, "key": key, "metrics": [canonical(k) for k in results]}).encode()
    body = _pack([header] + [dumps_state(acc) for acc in results.values()])
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + hmac.new(_secret(), body, hashlib.sha256).digest() + body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
