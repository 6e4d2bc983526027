"""Reading an extraction back: `ExtractionReader` over its shards (on disk or in memory),
`LoadedExtraction` (what `tl.load(path)` returns for an extraction directory) and
`TokenRows`, the one-row-per-token view of token-axis keys.

Values come back as NumPy host arrays. A disk shard is checked (file digest from the
manifest, format, run, batch index, keys, dtypes, row count) every time it is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from torchlens.dataset_extraction import shards as S
from torchlens.errors import ArtifactError, InvalidArgumentError


@dataclass(frozen=True)
class TokenRows:
    """Stored keys one row per token: `values[key]` is [num_tokens, ...]; `stimulus_row` and
    `position` say where each row came from; `num_tokens` is the row count."""

    values: dict[str, np.ndarray]
    stimulus_row: np.ndarray
    position: np.ndarray
    num_tokens: int


class ExtractionReader:
    """Shards of one extraction, read lazily and checked on every read."""

    def __init__(self, manifest: dict[str, Any], root: Path | None = None,
                 memory: list[dict[str, np.ndarray]] | None = None) -> None:
        self.manifest = manifest
        self.root = root
        self._memory = memory
        self._sites = {s["key"]: s for s in manifest["sites"]}
        self._shards = sorted(manifest["shards"], key=lambda e: e["index"])
        if [e["index"] for e in self._shards] != list(range(len(self._shards))):
            raise ArtifactError("extraction_manifest_invalid", "shard indices are not 0..n-1 exactly once",
                                remedy="re-run the extraction; resume=True keeps the shards that check out")

    @property
    def keys(self) -> list[str]:
        return list(self._sites)

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    @property
    def num_rows(self) -> int:
        return sum(e["rows"][1] - e["rows"][0] for e in self._shards)

    @property
    def stimulus_ids(self) -> list | None:
        return self.manifest.get("stimulus_ids")

    def _keys(self, keys: Sequence[str] | None) -> list[str]:
        if keys is None:
            return self.keys
        unknown = [k for k in keys if k not in self._sites]
        if unknown:
            raise InvalidArgumentError("extraction_layers_invalid", f"keys {unknown} are not stored (stored: {self.keys})",
                                       remedy="pick keys from reader.keys")
        return list(keys)

    def shard(self, index: int, keys: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """The stored values of batch `index`, {key: [rows, ...]}."""
        keys = self._keys(keys)
        if not isinstance(index, int) or not 0 <= index < len(self._shards):
            raise InvalidArgumentError("invalid_argument", f"shard {index!r} is outside 0..{len(self._shards) - 1}",
                                       remedy="index a shard by its batch number")
        entry = self._shards[index]
        if self._memory is not None:
            arrays = self._memory[index]
        else:
            path = self.root / entry["file"]
            meta, arrays = S.decode_shard(path, run=self.manifest["run"], index=index, sha256=entry["sha256"])
            rows = entry["rows"][1] - entry["rows"][0]
            if set(arrays) != set(self._sites):
                raise ArtifactError("extraction_shard_invalid", f"{path}: keys {sorted(arrays)} differ from the manifest's",
                                    remedy="re-run the extraction", path=str(path))
            for k, a in arrays.items():
                site = self._sites[k]
                if str(a.dtype) != site["stored_dtype"] or (a.ndim and a.shape[0] != rows) \
                        or (list(a.shape[1:]) != list(site["row_shape"]) and not site.get("varying_shape", False)):
                    raise ArtifactError("extraction_shard_invalid",
                                        f"{path}: {k!r} is {a.dtype}{list(a.shape)}, the manifest says "
                                        f"{site['stored_dtype']}[{rows}, {site['row_shape']}]",
                                        remedy="re-run the extraction", path=str(path))
        return {k: arrays[k] for k in keys}

    def batches(self, keys: Sequence[str] | None = None) -> Iterator[dict[str, np.ndarray]]:
        for i in range(self.num_shards):
            yield self.shard(i, keys)

    def __getitem__(self, key: str) -> np.ndarray:
        """All rows of one key, concatenated in stimulus order."""
        self._keys([key])
        if self._sites[key].get("varying_shape", False):
            raise InvalidArgumentError("invalid_argument", f"{key!r} has a different row shape in different shards "
                                       "(ragged='trim' or ready batches of different widths)",
                                       remedy="read it per shard with shard(i) / batches(), or as token rows with "
                                              "token_rows() / token_batch(i)")
        return np.concatenate([self.shard(i, [key])[key] for i in range(self.num_shards)], axis=0)

    def _token_keys(self, keys: Sequence[str] | None) -> list[str]:
        keys = self._keys(keys)
        flat = [k for k in keys if list(self._sites[k]["axes"][:2]) != ["stimulus", "position"]]
        if flat:
            raise InvalidArgumentError("invalid_argument", f"keys {flat} have no token (position) axis",
                                       remedy="read them with shard()/batches(); token rows need [stimulus, position, ...]")
        return keys

    def _tokens_of(self, index: int, keys: list[str]) -> TokenRows:
        masked = "token_mask" in self._sites  # ragged="trim": padding is never a token row
        arrays = self.shard(index, sorted(set(keys) | {"token_mask"}) if masked else keys)
        entry = self._shards[index]
        first = arrays[keys[0]]
        b, t = first.shape[:2]
        stim = np.repeat(np.arange(entry["rows"][0], entry["rows"][0] + b), t)
        pos = np.tile(np.arange(t), b)
        values = {k: arrays[k].reshape(b * t, *arrays[k].shape[2:]) for k in keys}
        if masked:
            keep = arrays["token_mask"].reshape(b * t) == 1
            values, stim, pos = {k: v[keep] for k, v in values.items()}, stim[keep], pos[keep]
        return TokenRows(values, stim, pos, len(stim))

    def token_batch(self, shard_index: int, keys: Sequence[str] | None = None) -> TokenRows:
        """One shard's token-axis keys, one row per token."""
        return self._tokens_of(shard_index, self._token_keys(keys))

    def token_rows(self, keys: Sequence[str] | None = None, *, max_bytes: int | None = None) -> TokenRows:
        """Every shard's token rows at once; refuses up front when that exceeds `max_bytes`."""
        keys = self._token_keys(keys)
        if max_bytes is not None:
            need = 0
            for k in keys:
                site = self._sites[k]
                need += self.num_rows * int(np.prod(site["row_shape"], dtype=np.int64)) * np.dtype(site["stored_dtype"]).itemsize
            if need > max_bytes:
                raise InvalidArgumentError("invalid_argument", f"token rows need {need} bytes, max_bytes={max_bytes}",
                                           remedy="iterate token_batch(i) or shuffled_batches(..., tokens=True)")
        parts = [self._tokens_of(i, keys) for i in range(self.num_shards)]
        return TokenRows({k: np.concatenate([p.values[k] for p in parts]) for k in keys},
                         np.concatenate([p.stimulus_row for p in parts]), np.concatenate([p.position for p in parts]),
                         sum(p.num_tokens for p in parts))

    def shuffled_batches(self, batch_size: int, *, seed: int = 0, keys: Sequence[str] | None = None,
                         buffer_shards: int = 1, tokens: bool = False) -> Iterator[Any]:
        """Rows (or token rows) in a seeded shuffle that mixes `buffer_shards` shards at a time;
        yields {key: [batch_size, ...]} dicts (TokenRows with tokens=True); the last may be short."""
        if not isinstance(batch_size, int) or batch_size < 1 or not isinstance(buffer_shards, int) or buffer_shards < 1:
            raise InvalidArgumentError("invalid_argument", "batch_size and buffer_shards take positive ints",
                                       remedy="shuffled_batches(256, buffer_shards=4)")
        keys = self._token_keys(keys) if tokens else self._keys(keys)
        rng = np.random.default_rng(seed)
        order = rng.permutation(self.num_shards)
        for g in range(0, len(order), buffer_shards):
            group = [int(i) for i in order[g:g + buffer_shards]]
            if tokens:
                parts = [self._tokens_of(i, keys) for i in group]
                vals = {k: np.concatenate([p.values[k] for p in parts]) for k in keys}
                stim = np.concatenate([p.stimulus_row for p in parts])
                pos = np.concatenate([p.position for p in parts])
            else:
                parts = [self.shard(i, keys) for i in group]
                vals = {k: np.concatenate([p[k] for p in parts]) for k in keys}
                stim = np.concatenate([np.arange(*self._shards[i]["rows"]) for i in group])
            perm = rng.permutation(len(stim))
            for s in range(0, len(perm), batch_size):
                sel = perm[s:s + batch_size]
                if tokens:
                    yield TokenRows({k: v[sel] for k, v in vals.items()}, stim[sel], pos[sel], len(sel))
                else:
                    yield {**{k: v[sel] for k, v in vals.items()}, "stimulus_row": stim[sel]}

    def __repr__(self) -> str:
        where = str(self.root) if self.root is not None else "memory"
        return f"{type(self).__name__}({where}: {self.num_shards} shards, {self.num_rows} rows, keys={self.keys})"


class LoadedExtraction(ExtractionReader):
    """An extraction directory read back with its metadata (`manifest`, `signature`, `sites`)."""

    @property
    def signature(self) -> dict[str, Any]:
        return dict(self.manifest["signature"])

    @property
    def sites(self) -> list[dict[str, Any]]:
        return [dict(s) for s in self.manifest["sites"]]


def load_extraction(path: Any) -> LoadedExtraction:
    """Read an extraction directory's manifest; shards are checked as they are read
    (`verify()` reads them all now)."""
    root = Path(path)
    manifest = S.read_manifest(root)
    if manifest["status"] != "complete":
        raise ArtifactError("extraction_manifest_invalid", f"{root}: the run did not complete (status "
                            f"{manifest['status']!r})", remedy="finish it: extract_dataset(..., path=..., resume=True)",
                            path=str(root))
    for s in manifest["sites"]:
        if not (isinstance(s, dict) and isinstance(s.get("key"), str) and isinstance(s.get("stored_dtype"), str)
                and isinstance(s.get("row_shape"), list) and isinstance(s.get("axes"), list)):
            raise ArtifactError("extraction_manifest_invalid", f"{root}: a site entry is malformed",
                                remedy="re-run the extraction", path=str(root))
        try:
            np.dtype(s["stored_dtype"])
        except TypeError:
            raise ArtifactError("extraction_manifest_invalid", f"{root}: dtype {s['stored_dtype']!r} is unknown",
                                remedy="re-run the extraction", path=str(root)) from None
    return LoadedExtraction(manifest, root=root)
