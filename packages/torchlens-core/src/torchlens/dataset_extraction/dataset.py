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

`ragged="trim"` drops, per batch, the token columns that are padding in every row (by the
batch's `attention_mask`) and stores the trimmed mask as `token_mask`; the token readers skip
masked positions. `intervene=tl.when(...)` captures every batch with the spec armed: batch zero
freezes the sites it fired at, later batches must fire at exactly those (site freeze), and the
manifest's `tl_counterfactual_harvest_v1` block and each shard's fire receipt record it.
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


def model_identity(probe: Any) -> dict[str, Any]:
    """The measured identity record `torchlens.lens.model_identity(probe)` gives (the record a
    user lens compares against; written out here because this layer does not import the lens;
    test_extract_dataset checks the two agree)."""
    p = probe.provenance
    return {"kind": "measured", "model_class": p.model_class, "backend": p.backend, "param_hash_full": p.param_hash_full}


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


#: helpers whose edit of one row reads only that row (glossary: Intervened extraction); others must
#: declare `is_batch_independent = True` on the Edit
_ROW_LOCAL_HELPERS = frozenset({"zero_ablate", "scale", "add", "clamp", "replace_with", "steer", "project_onto",
                                "project_out"})


def _harvest_spec(intervene: Any) -> dict[str, Any]:
    """Check an intervene= spec before anything runs: a tl.when(...) recipe of forward rules
    addressed by module (tl.module, tl.in_module) or op type (tl.func), every helper batch
    independent. Returns the run's intervention identity."""
    from torchlens.select.selectors import FuncSelector, InModuleSelector, ModuleSelector

    rules = getattr(intervene, "rules", None)
    if not isinstance(rules, tuple) or not rules or not isinstance(getattr(intervene, "digest", None), str):
        raise InvalidArgumentError("invalid_argument", f"intervene= takes a tl.when(selector, helper) spec, not "
                                   f"{type(intervene).__name__}", remedy="intervene=tl.when(tl.module('fc1'), tl.zero_ablate())")
    classes = set()
    for rule in rules:
        target = rule.target
        if isinstance(target, (ModuleSelector, InModuleSelector)):
            classes.add("module")
        elif isinstance(target, FuncSelector):
            classes.add("op_type")
        else:
            raise InvalidArgumentError("harvest_address_class_ungated",
                                       f"intervened extraction runs module- and op-type-addressed specs; {rule!r} is "
                                       f"addressed by {type(target).__name__}",
                                       remedy="address the edit with tl.module, tl.in_module or tl.func", rule=rule.identity())
        if getattr(rule, "signal", "forward") != "forward":
            raise InvalidArgumentError("harvest_address_class_ungated", f"{rule!r} edits a gradient; intervened "
                                       "extraction runs forward edits only", remedy="drop the gradient rule",
                                       rule=rule.identity())
        edit = rule.edit
        if getattr(edit, "is_batch_independent", None) is not True and getattr(edit, "name", None) not in _ROW_LOCAL_HELPERS:
            raise InvalidArgumentError("extraction_intervention_batch_coupled",
                                       f"helper {getattr(edit, 'name', type(edit).__name__)!r} does not declare "
                                       "is_batch_independent=True: its edit of a row may read other rows, so the stored "
                                       "rows would depend on how the dataset is batched",
                                       remedy="use a row-local helper (tl.zero_ablate, tl.scale, tl.add, tl.clamp, "
                                              "tl.replace_with, tl.steer, tl.project_onto/out) or one that declares it",
                                       rule=rule.identity())
    return {"policy": "intervene", "engine": "live_hook", "address_class": sorted(classes),
            "recipe_digest": intervene.digest, "rules": [r.identity() for r in rules]}


def _fired(t: Any) -> dict[str, int]:
    """{op label: times fired} of a live intervened capture."""
    plan = t._edit_plan
    return {plan.labels[e]: int(n) for e, n in sorted(plan.fired.items())}


def _check_fired(fired: dict[str, int], frozen: list[str] | None, index: int) -> None:
    if not fired:
        raise InvalidArgumentError("extraction_intervention_no_fire", f"the intervene= spec fired nowhere in batch {index}",
                                   remedy="check the spec's sites exist for every batch (batch zero froze "
                                          f"{frozen})", batch=index, frozen_sites=frozen)
    if frozen is not None and sorted(fired) != frozen:
        raise InvalidArgumentError("extraction_intervention_site_drift",
                                   f"batch {index} fired at {sorted(fired)}; batch zero froze {frozen}",
                                   remedy="make every batch run the same structure (equal batch shapes, no "
                                          "data-dependent control flow at the edited sites)",
                                   batch=index, fired_sites=sorted(fired), frozen_sites=frozen)


#: the key ragged="trim" stores each batch's trimmed 0/1 attention mask under
TOKEN_MASK = "token_mask"


def _batch_mask(b: batching.Batch, proto: Any) -> np.ndarray:
    """The batch's [rows, tokens] 0/1 attention_mask (keyword input), as int64."""
    v = b.kwargs.get("attention_mask")
    if v is None or not (proto.is_tensor(v) or isinstance(v, np.ndarray)):
        raise InvalidArgumentError("extraction_dataset_invalid", f"ragged='trim' but batch {b.index} has no "
                                   "attention_mask keyword input", remedy="pass batches as {'input_ids': ids, "
                                   "'attention_mask': mask} (a dict dataset or dict batches)")
    m = _host(proto, v)
    if m.ndim != 2 or m.shape[0] != b.stop - b.start or not np.isin(m, (0, 1)).all():
        raise InvalidArgumentError("extraction_dataset_invalid", f"batch {b.index}'s attention_mask is not a "
                                   f"[{b.stop - b.start}, tokens] array of 0 and 1", remedy="pass a 0/1 mask per row")
    return m.astype(np.int64)


def _trim(values: dict[str, np.ndarray], mask: np.ndarray) -> dict[str, np.ndarray]:
    """ragged='trim': drop the token columns that are padding in every row of the batch from
    every token-axis value ([rows, tokens, ...] with the mask's shape), and store the trimmed
    mask, so token rows never include padding."""
    cols = np.flatnonzero(mask.any(axis=0))
    out = {n: (np.ascontiguousarray(a[:, cols]) if a.ndim >= 2 and a.shape[:2] == mask.shape else a)
           for n, a in values.items()}
    out[TOKEN_MASK] = np.ascontiguousarray(mask[:, cols])
    return out


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
    harvest = _harvest_spec(intervene) if intervene is not None else None
    if ragged is not None and ragged != "trim":
        raise InvalidArgumentError("extraction_option_unsupported", f"extract_dataset(ragged={ragged!r}) is not built; "
                                   "ragged='trim' is", remedy="ragged='trim' (with an attention_mask input) or ragged=None")
    if "input_ids" in names and store_input_ids:
        raise InvalidArgumentError("extraction_layers_invalid", "a layer is named 'input_ids', the token store's key",
                                   remedy="store_input_ids=False, or name the layer by its label")
    if TOKEN_MASK in names and ragged is not None:
        raise InvalidArgumentError("extraction_layers_invalid", f"a layer is named {TOKEN_MASK!r}, ragged='trim''s mask key",
                                   remedy="name the layer by its label")
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
    armed = {} if harvest is None else {"intervene": intervene, "on_zero_fire": "disclose"}
    # the first batch's own capture gives the signature, and its values are reused below
    probe = trace(model, *probe_batch.args, save=names, capture=capture, input_kwargs=probe_batch.kwargs or None,
                  backend=backend, **armed)
    first_values = {n: _host(proto, probe.ops[n].out) for n in names} if first is not None else None
    first_fired = _fired(probe) if harvest is not None else None
    fingerprint = probe.provenance.fingerprint  # of batch 0 on every rank: it depends on input shapes
    frozen = sorted(first_fired) if first_fired is not None and probe_batch.index == 0 else None
    if probe_batch.index != 0:
        b0 = next(batching.iter_batches(dataset, batch_size, collate))
        t0 = trace(model, *b0.args, save="none", input_kwargs=b0.kwargs or None, backend=backend, **armed)
        fingerprint = t0.provenance.fingerprint
        if harvest is not None:
            frozen = sorted(_fired(t0))
        del t0
    if harvest is not None:  # site freeze: batch zero's fired sites
        _check_fired({k: 1 for k in frozen}, None, 0)
        harvest["site_keys"] = frozen
    signature = {
        "model_class": type(model).__module__ + "." + type(model).__qualname__,
        "structural_fingerprint": fingerprint,
        "param_digest": param_digest(proto, probe),
        "layers": names, "batch_size": batch_size, "num_rows": total,
        "collate": None if collate is None else getattr(collate, "__qualname__", type(collate).__name__),
        "store_input_ids": bool(store_input_ids), "ragged": ragged, "stimulus_ids_digest": None if stimulus_ids is None else
        hashlib.sha256(json.dumps(stimulus_ids).encode()).hexdigest(),
        "intervention": {"policy": "none"} if harvest is None else
        {k: harvest[k] for k in ("policy", "engine", "address_class", "recipe_digest", "rules", "site_keys")},
        "backend": probe.provenance.backend,
        "model_identity": model_identity(probe),  # the lens-compatible identity record (torchlens.lens)
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
            receipt = None
            if b.index in done:
                values = done[b.index]["arrays"]
                sha = done[b.index]["sha256"]
                if harvest is not None:
                    receipt = json.loads(done[b.index]["meta"].get("fire_receipt", "null"))
            else:
                if first_values is not None and b.index == first.index:
                    values, first_values = first_values, None
                    fired = first_fired
                else:
                    t = trace(model, *b.args, save=names, capture=capture, input_kwargs=b.kwargs or None, backend=backend,
                              **armed)
                    values = {n: _host(proto, t.ops[n].out) for n in names}
                    fired = _fired(t) if harvest is not None else None
                    del t
                    collect()  # free the batch's Trace now (see _memory.py)
                if harvest is not None:
                    _check_fired(fired, harvest["site_keys"], b.index)
                    receipt = {"index": b.index, "fired": fired}
                if store_input_ids:
                    ids = _token_ids(b, proto)
                    if ids is None:
                        raise InvalidArgumentError("extraction_dataset_invalid", "store_input_ids=True but the batch has no "
                                                   "[batch, tokens] integer input_ids", remedy="pass token ids as the first input")
                    values["input_ids"] = ids
                if ragged == "trim":
                    values = _trim(values, _batch_mask(b, proto))
                bad = [n for n, a in values.items() if a.ndim == 0 or a.shape[0] != b.stop - b.start]
                if bad:
                    raise InvalidArgumentError("extraction_layers_invalid", f"layers {bad} have no batch axis matching "
                                               f"the batch's {b.stop - b.start} rows", remedy="extract per-row layers only")
                if root is not None:
                    meta = {"run": run, "index": str(b.index), "rows": f"{b.start}:{b.stop}",
                            "input_digest": digest_in, "rank": str(group.rank)}
                    if receipt is not None:
                        meta["fire_receipt"] = json.dumps(receipt, sort_keys=True)
                    data = S.encode_shard(values, meta)
                    S.atomic_write(root / S.shard_name(b.index), data)
                    sha = S.digest(data)
                else:
                    sha = ""
            if not sites:
                ids = values[TOKEN_MASK] if ragged == "trim" else _token_ids(b, proto)
                sites = {n: {"key": n, "stored_dtype": str(a.dtype), "row_shape": list(a.shape[1:]), "axes": _axes(a, ids),
                             "varying_shape": False} for n, a in values.items()}
            for n, a in values.items():  # batches of different lengths (ready batches): say so, do not guess
                if list(a.shape[1:]) != sites[n]["row_shape"]:
                    sites[n]["varying_shape"] = True
            entries.append({"file": S.shard_name(b.index), "index": b.index, "rows": [b.start, b.stop], "rank": group.rank,
                            "sha256": sha, "input_digest": digest_in, **({"fire_receipt": receipt} if harvest else {})})
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
                "tl_counterfactual_harvest_v1": {"policy": "none"} if harvest is None else {
                    **{k: harvest[k] for k in ("policy", "engine", "address_class", "site_keys", "recipe_digest")},
                    "fire_receipt_digest": hashlib.sha256(json.dumps([e["fire_receipt"] for e in all_entries],
                                                                     sort_keys=True).encode()).hexdigest()}}
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
