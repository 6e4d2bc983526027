"""`tl.extract_dataset`: the saved outs of chosen layers over a whole dataset, in batches.

Memory mode returns an `ExtractionReader` over host arrays. Disk mode (`path=`) writes one
`batch_XXXXX.safetensors` shard per batch (atomically) and a `manifest.json` holding the run
signature (model class and structural fingerprint, a digest of the parameter values, layers,
batch size, row count, options), per-site identity, axis semantics, dtypes, stimulus ids and
versions. `resume=True` checks the signature and every finished shard (its run, index and the
digest of the inputs it was made from) before it writes anything, then computes only what is
missing. With a data-parallel group (`distributed=`, see `parallel.py`) rank r handles the
batches with `index % world_size == r`, writes its own shards, and rank 0 writes the manifest
listing all of them.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from torchlens.dataset_extraction import batching
from torchlens.dataset_extraction import shards as S
from torchlens.dataset_extraction._memory import per_batch_collection
from torchlens.dataset_extraction.helpers import layer_names
from torchlens.dataset_extraction.parallel import resolve_group
from torchlens.dataset_extraction.reader import ExtractionReader, load_extraction
from torchlens.errors import ArtifactError, InvalidArgumentError


def _host(proto: Any, v: Any) -> np.ndarray:
    return np.asarray(proto.host_copy(v))


def input_digest(proto: Any, b: batching.Batch) -> str:
    """sha256 over a batch's inputs (names, dtypes, shapes, bytes of host copies)."""
    h = hashlib.sha256()
    for name, v in [(str(i), a) for i, a in enumerate(b.args)] + sorted(b.kwargs.items()):
        h.update(name.encode() + b"\0")
        if proto.is_tensor(v) or isinstance(v, np.ndarray):
            a = np.ascontiguousarray(_host(proto, v))
            h.update(f"{a.dtype}{a.shape}".encode())
            h.update(a.tobytes())
        else:
            h.update(repr(v).encode())
    return h.hexdigest()


def param_digest(proto: Any, trace: Any) -> str:
    h = hashlib.sha256()
    for p in sorted(trace.params, key=lambda p: p.address):
        a = np.ascontiguousarray(_host(proto, p.value))
        h.update(f"{p.address}|{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _progress(total: int | None, enabled: bool | None, rank: int) -> Any:
    if enabled is False or rank != 0 or (enabled is None and not sys.stderr.isatty()):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="rows", desc="extract_dataset", dynamic_ncols=True)


def _axes(out: np.ndarray, token_ids: np.ndarray | None) -> list[str]:
    if token_ids is not None and out.ndim >= 2 and out.shape[:2] == token_ids.shape:
        return ["stimulus", "position"] + [f"dim{i}" for i in range(2, out.ndim)]
    return ["stimulus"] + [f"dim{i}" for i in range(1, out.ndim)]


def _token_ids(b: batching.Batch, proto: Any) -> np.ndarray | None:
    v = b.kwargs.get("input_ids", b.args[0] if b.args else None)
    if v is None or not (proto.is_tensor(v) or isinstance(v, np.ndarray)):
        return None
    a = _host(proto, v)
    return a if a.ndim == 2 and np.issubdtype(a.dtype, np.integer) else None


def extract_dataset(model: Any, dataset: Any, layers: Any, *, batch_size: int | None = None, path: Any = None,
                    resume: bool = False, stimulus_ids: Sequence[Any] | None = None, collate: Callable | None = None,
                    store_input_ids: bool = False, ragged: str | None = None, intervene: Any = None,
                    distributed: Any = None, progress: bool | None = None, backend: str | None = None) -> ExtractionReader:
    """Extract `layers`' outs for every row of `dataset`; see the module docstring."""
    from torchlens.backends.registry import select_backend
    from torchlens.capture import trace
    from torchlens.options import CaptureOptions

    names = layer_names(layers)
    if intervene is not None or ragged is not None:
        raise InvalidArgumentError("extraction_option_unsupported",
                                   f"extract_dataset({'intervene=' if intervene is not None else 'ragged='}...) is not built yet",
                                   remedy="extract without it (issue 23 lists intervened extraction and ragged='trim' as open)")
    if "input_ids" in names and store_input_ids:
        raise InvalidArgumentError("extraction_layers_invalid", "a layer is named 'input_ids', the token store's key",
                                   remedy="store_input_ids=False, or name the layer by its label")
    batching.check(dataset, batch_size, collate)
    if resume and path is None:
        raise InvalidArgumentError("invalid_argument", "resume=True needs path=", remedy="pass the run's directory")
    total = batching.num_rows(dataset, batch_size, collate)
    if stimulus_ids is not None:
        stimulus_ids = [s if isinstance(s, (int, str)) else str(s) for s in stimulus_ids]
        if total is not None and len(stimulus_ids) != total:
            raise InvalidArgumentError("extraction_dataset_invalid", f"{len(stimulus_ids)} stimulus_ids for {total} rows",
                                       remedy="one id per row")
    group = resolve_group(distributed)
    root = Path(path) if path is not None else None
    if root is not None and not resume and root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise InvalidArgumentError("extraction_path_exists", f"{root} exists and is not an empty directory",
                                   remedy="pass a new path, or resume=True to continue the run stored there", path=str(root))
    if iter(dataset) is dataset:  # the signature probe and a resume check read the first batches again
        raise InvalidArgumentError("extraction_dataset_invalid", "extract_dataset needs a dataset it can read twice "
                                   "(a one-shot iterator was given)", remedy="pass a list, an array, a tensor or a DataLoader")

    def mine() -> Any:
        return (b for b in batching.iter_batches(dataset, batch_size, collate) if b.index % group.world_size == group.rank)

    first = next(mine(), None)
    if first is None and group.world_size == 1:
        raise InvalidArgumentError("extraction_dataset_invalid", "the dataset has no rows", remedy="pass at least one row")
    probe_batch = first if first is not None else next(batching.iter_batches(dataset, batch_size, collate))
    proto = select_backend(model, probe_batch.args, probe_batch.kwargs, backend)
    capture = CaptureOptions(detach_saved_activations=True)
    # the first batch's own capture gives the signature, and its values are reused below
    probe = trace(model, *probe_batch.args, save=names, capture=capture, input_kwargs=probe_batch.kwargs or None,
                  backend=backend)
    first_values = {n: _host(proto, probe.ops[n].out) for n in names} if first is not None else None
    fingerprint = probe.provenance.fingerprint  # of batch 0 on every rank: it depends on input shapes
    if probe_batch.index != 0:
        b0 = next(batching.iter_batches(dataset, batch_size, collate))
        fingerprint = trace(model, *b0.args, save="none", input_kwargs=b0.kwargs or None,
                            backend=backend).provenance.fingerprint
    signature = {
        "model_class": type(model).__module__ + "." + type(model).__qualname__,
        "structural_fingerprint": fingerprint,
        "param_digest": param_digest(proto, probe),
        "layers": names, "batch_size": batch_size, "num_rows": total,
        "collate": None if collate is None else getattr(collate, "__qualname__", type(collate).__name__),
        "store_input_ids": bool(store_input_ids), "stimulus_ids_digest": None if stimulus_ids is None else
        hashlib.sha256(json.dumps(stimulus_ids).encode()).hexdigest(), "intervention": {"policy": "none"},
        "backend": probe.provenance.backend,
    }
    del probe
    run = hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()
    runs = {r.decode() for r in group.all_gather_bytes(run.encode())}
    if len(runs) != 1:
        raise InvalidArgumentError("distributed_group_invalid", "ranks disagree on the run signature (model weights, "
                                   "dataset or options differ between processes)", remedy="give every rank the same model and data")

    done: dict[int, dict[str, Any]] = {}
    if root is not None:
        manifest_there = (root / S.MANIFEST).is_file()
        if resume and manifest_there:
            old = S.read_manifest(root)
            if old["run"] != run:
                diff = sorted(k for k in set(signature) | set(old["signature"]) if signature.get(k) != old["signature"].get(k))
                raise ArtifactError("extraction_resume_signature_mismatch",
                                    f"{root} holds a run whose signature differs in {diff}",
                                    remedy="resume with the same model, dataset, layers and options, or start a new path",
                                    path=str(root), differs=diff)
            for b in mine():  # check every finished shard before writing anything
                f = root / S.shard_name(b.index)
                if not f.is_file():
                    continue
                meta, arrays = S.decode_shard(f, run=run, index=b.index)
                if meta.get("input_digest") != input_digest(proto, b) or meta.get("rows") != f"{b.start}:{b.stop}":
                    raise ArtifactError("extraction_resume_signature_mismatch",
                                        f"{f}: the dataset rows of batch {b.index} changed since it was written",
                                        remedy="resume with the same dataset, or start a new path", path=str(f),
                                        differs=["dataset"])
                done[b.index] = {"meta": meta, "sha256": S.digest(f.read_bytes()), "arrays": arrays}
        group.barrier()
        if group.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            for tmp in root.glob(".batch_*.tmp"):
                tmp.unlink()
            if not manifest_there:
                S.write_manifest(root, {"format": S.FORMAT, "status": "running", "run": run, "signature": signature,
                                        "sites": [], "shards": []})
        group.barrier()

    entries: list[dict[str, Any]] = []
    memory: dict[int, dict[str, np.ndarray]] = {}
    sites: dict[str, dict[str, Any]] = {}
    bar = _progress(total, progress, group.rank)
    started = time.perf_counter()
    with per_batch_collection() as collect:
        for b in mine():
            digest_in = input_digest(proto, b)
            if b.index in done:
                values = done[b.index]["arrays"]
                sha = done[b.index]["sha256"]
            else:
                if first_values is not None and b.index == first.index:
                    values, first_values = first_values, None
                else:
                    t = trace(model, *b.args, save=names, capture=capture, input_kwargs=b.kwargs or None, backend=backend)
                    values = {n: _host(proto, t.ops[n].out) for n in names}
                    del t
                    collect()  # free the batch's Trace now (see _memory.py)
                if store_input_ids:
                    ids = _token_ids(b, proto)
                    if ids is None:
                        raise InvalidArgumentError("extraction_dataset_invalid", "store_input_ids=True but the batch has no "
                                                   "[batch, tokens] integer input_ids", remedy="pass token ids as the first input")
                    values["input_ids"] = ids
                bad = [n for n, a in values.items() if a.ndim == 0 or a.shape[0] != b.stop - b.start]
                if bad:
                    raise InvalidArgumentError("extraction_layers_invalid", f"layers {bad} have no batch axis matching "
                                               f"the batch's {b.stop - b.start} rows", remedy="extract per-row layers only")
                if root is not None:
                    data = S.encode_shard(values, {"run": run, "index": str(b.index), "rows": f"{b.start}:{b.stop}",
                                                   "input_digest": digest_in, "rank": str(group.rank)})
                    S.atomic_write(root / S.shard_name(b.index), data)
                    sha = S.digest(data)
                else:
                    sha = ""
            if not sites:
                ids = _token_ids(b, proto)
                sites = {n: {"key": n, "stored_dtype": str(a.dtype), "row_shape": list(a.shape[1:]), "axes": _axes(a, ids),
                             "varying_shape": False} for n, a in values.items()}
            for n, a in values.items():  # batches of different lengths (ready batches): say so, do not guess
                if list(a.shape[1:]) != sites[n]["row_shape"]:
                    sites[n]["varying_shape"] = True
            entries.append({"file": S.shard_name(b.index), "index": b.index, "rows": [b.start, b.stop], "rank": group.rank,
                            "sha256": sha, "input_digest": digest_in})
            if root is None:
                memory[b.index] = values
            if bar is not None:
                bar.update(b.stop - b.start)
                bar.set_postfix(rows_per_s=f"{bar.n / max(time.perf_counter() - started, 1e-9):.0f}")
    if bar is not None:
        bar.close()

    gathered = group.all_gather_bytes(json.dumps({"entries": entries, "sites": sites}).encode())
    parts = [json.loads(g) for g in gathered]
    all_entries = sorted((e for p in parts for e in p["entries"]), key=lambda e: e["index"])
    sites = next((p["sites"] for p in parts if p["sites"]), sites)
    for p in parts:  # a site varies when any rank saw it vary or ranks saw different row shapes
        for n, site in p["sites"].items():
            if site["varying_shape"] or site["row_shape"] != sites[n]["row_shape"]:
                sites[n]["varying_shape"] = True
    import torchlens

    manifest = {"format": S.FORMAT, "status": "complete", "run": run, "signature": signature,
                "sites": [sites[n] for n in sites], "shards": all_entries, "num_rows": sum(e["rows"][1] - e["rows"][0] for e in all_entries),
                "batch_size": batch_size, "stimulus_ids": stimulus_ids, "world_size": group.world_size,
                "torchlens_version": torchlens.__version__, "backend": signature["backend"],
                "tl_counterfactual_harvest_v1": {"policy": "none"}}
    if root is not None:
        group.barrier()
        if group.rank == 0:
            S.write_manifest(root, manifest)
        group.barrier()
        return load_extraction(root)
    if group.world_size > 1:  # every rank gets every batch, exchanged as safetensors bytes
        blobs = group.all_gather_bytes(json.dumps(sorted(memory)).encode())
        from torchlens.stats.state import read_safetensors

        payload = b"".join(len(d).to_bytes(8, "little") + d for d in
                           (S.encode_shard(memory[i], {"index": str(i)}) for i in sorted(memory)))
        for r, blob in enumerate(group.all_gather_bytes(payload)):
            indices, off = json.loads(blobs[r]), 0
            for i in indices:
                n = int.from_bytes(blob[off:off + 8], "little")
                _, arrays = read_safetensors(blob[off + 8:off + 8 + n], f"rank {r}", "extraction_shard_invalid")
                memory[i] = arrays
                off += 8 + n
    return ExtractionReader(manifest, memory=[memory[i] for i in sorted(memory)])
