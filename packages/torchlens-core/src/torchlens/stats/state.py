"""Saving and loading an accumulator's whole state (`tl_stats_state_v1`).

One safetensors file: the state's named float64/int64 arrays, and in its string metadata the
format tag, the accumulator kind and its JSON configuration. Loading builds only kinds from
`tl.stats`'s closed table and checks every array's name, dtype and shape before the state is
used; nothing is unpickled and nothing in the file runs. A reload keeps folding as if never
interrupted (the float64 arrays round-trip bit for bit). An `encoder=` callable is not stored;
pass it again to `load_fitted`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from torchlens.errors import ArtifactError, InvalidArgumentError
from torchlens.stats._base import KINDS, Accumulator

FORMAT = "tl_stats_state_v1"
_DTYPES = (np.dtype(np.float64), np.dtype(np.int64))


def dumps_state(stat: Accumulator) -> bytes:
    """`stat`'s whole state as `tl_stats_state_v1` bytes (what `save_fitted` writes, and what
    data-parallel runs exchange between ranks)."""
    from safetensors.numpy import save

    from torchlens import __version__

    if not isinstance(stat, Accumulator) or KINDS.get(type(stat).__name__) is not type(stat):
        raise InvalidArgumentError("invalid_argument", f"expected a tl.stats accumulator, not {type(stat).__name__}",
                                   remedy="pass tl.stats.Mean(), tl.stats.PCA(), ...")
    arrays = {k: np.ascontiguousarray(v) for k, v in stat.state_dict().items()}
    meta = {"format": FORMAT, "kind": type(stat).__name__, "config": json.dumps(stat.config(), sort_keys=True),
            "torchlens_version": __version__}
    return save(arrays, metadata=meta)


def save_fitted(stat: Accumulator, path: str | os.PathLike) -> Path:
    """Write `stat`'s state to `path` (a `.safetensors` file), atomically; returns the path."""
    data = dumps_state(stat)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _refuse(code: str, why: str, where: str) -> ArtifactError:
    return ArtifactError(code, f"{where}: {why}", path=where,
                         remedy="load a file written by tl.stats.save_fitted (tl_stats_state_v1); re-fit otherwise")


def read_safetensors(data: bytes, where: str, code: str) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """Metadata and arrays of safetensors bytes; every parser refusal becomes `code`. The
    header length is checked against the data before anything is sized from it."""
    from safetensors.numpy import load

    if len(data) < 8:
        raise _refuse(code, "shorter than a safetensors header", where)
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise _refuse(code, f"header length {n} exceeds the data ({len(data)} bytes)", where)
    try:
        header = json.loads(data[8:8 + n])
        meta = header.get("__metadata__") or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise ValueError("metadata is not a string map")
        arrays = load(data)
    except Exception as e:  # the safetensors parser's own refusals (bad header, truncated data)
        raise _refuse(code, f"not a readable safetensors file ({type(e).__name__}: {e})", where) from None
    return meta, arrays


def loads_state(data: bytes, *, encoder: Callable[[Any], Any] | None = None, where: str = "<bytes>") -> Accumulator:
    """Rebuild an accumulator from `dumps_state` bytes, checking everything first."""
    meta, arrays = read_safetensors(data, where, "stats_state_invalid")
    if meta.get("format") != FORMAT:
        raise _refuse("stats_state_foreign", f"format tag {meta.get('format')!r} is not {FORMAT!r}", where)
    cls = KINDS.get(meta.get("kind", ""))
    if cls is None:
        raise _refuse("stats_state_foreign", f"kind {meta.get('kind')!r} is not a tl.stats accumulator", where)
    unknown = sorted(set(arrays) - set(cls._ARRAYS))
    if unknown:
        raise _refuse("stats_state_invalid", f"arrays {unknown} are not part of a {cls.__name__} state", where)
    for n, a in arrays.items():
        if a.dtype not in _DTYPES:
            raise _refuse("stats_state_invalid", f"array {n!r} has dtype {a.dtype}, not float64/int64", where)
    try:
        config = json.loads(meta.get("config", ""))
        if not isinstance(config, dict):
            raise ValueError("config is not an object")
        stat = cls.from_config(config)
    except (ValueError, TypeError, KeyError, InvalidArgumentError) as e:
        raise _refuse("stats_state_invalid", f"configuration does not build a {cls.__name__}: {e}", where) from None
    if hasattr(stat, "encoder"):
        stat.encoder = encoder
    elif encoder is not None:
        raise InvalidArgumentError("invalid_argument", f"{cls.__name__} takes no encoder", remedy="drop encoder=")
    try:
        stat._load_state(arrays)
    except ArtifactError as e:
        raise _refuse("stats_state_invalid", e.message, where) from None
    return stat


def load_fitted(path: str | os.PathLike, *, encoder: Callable[[Any], Any] | None = None) -> Accumulator:
    """Read an accumulator written by `save_fitted`; `encoder=` re-attaches a callable."""
    path = Path(path)
    if not path.is_file():
        raise _refuse("stats_state_invalid", "no such file", str(path))
    return loads_state(path.read_bytes(), encoder=encoder, where=str(path))
