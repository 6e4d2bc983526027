"""Trace.save and tl.load: the `.tlspec` directory of saved format 3.

Layout::

    <name>.tlspec/
      manifest.json                 what this is; sha256 and size of every file below
      records/<kind>.json           one typed table per record kind (io.schema.SCHEMAS)
      blobs/payloads-<n>.safetensors  payload bytes, written through the backend's codec

Saving writes everything into a locked temporary directory beside the target, fsyncs it, and
publishes it with one atomic rename or, over an old artifact, one atomic exchange
(`io.publish`); `overwrite=True` replaces only a directory `io.ownership` proves is an
intact TorchLens artifact. A save or load first repairs what a killed save left behind. Loading checks
paths, the manifest, every file's size and digest, every record cell and every
cross-reference before it builds the Trace: a refusal is a typed `ArtifactError`, and a
trace is never returned half-loaded.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torchlens.errors import ArtifactError, TorchLensError
from torchlens.io import blobfile, ownership, publish
from torchlens.io.codec import EncodedPayload, backend_codec, codec_named
from torchlens.io.manifest import (FORMAT, FORMAT_VERSION, MANIFEST_NAME, MAX_MANIFEST_BYTES, check_manifest, malformed, parse_json,
                                   read_bounded, render)
from torchlens.io.intervention import RECIPE_BLOB
from torchlens.io.schema import RECORD_KINDS, SCHEMA_DIGEST, SCHEMAS, Decoder, Encoder, check_table, site_key

LEVELS = ("full", "runnable")  # "runnable": io.runnable (a replayable capture only)
SHARD_BYTES = 64 * 1024 * 1024  # small enough that shards hash and write in parallel
_MAX_RECORD_BYTES = 1024 * 1024 * 1024


# save ---------------------------------------------------------------------------------------
def save(trace: Any, path: Any, level: str = "full", overwrite: bool = False) -> Path:
    """Write `trace` as a `.tlspec` directory at `path`; return the path."""
    if level not in LEVELS:
        raise ArtifactError("artifact_save_level_unsupported", f"level={level!r} is not one of {LEVELS}",
                            remedy="save with level='full'", level=repr(level))
    if not isinstance(overwrite, bool):
        raise _arg("overwrite= takes True or False")
    if level == "runnable":
        from torchlens.io import runnable

        runnable.check_saveable(trace)  # its refusals come before anything is written
    target = _as_path(path)
    proof = _check_save_target(target, overwrite)
    codec = backend_codec(trace._backend) if trace._backend is not None else backend_codec(None)
    from torchlens.io.intervention import trace_recipe_body, write_recipe_files

    recipe = trace_recipe_body(trace)  # the staged recipe and touch history (refusals before anything is written)
    enc = Encoder(codec)
    tables = encode_tables(trace, enc)
    shards = _shard(enc.payloads)
    tables["payloads"] = {"schema": "tl.payloads/3", "columns": [c for c, _ in SCHEMAS["payloads"]], "rows": [
        [key, blob, key, p.dtype, list(p.shape), dict(p.meta)] for blob, items in shards.items() for key, p in items]}
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": "trace", "level": level,
        "schema_digest": SCHEMA_DIGEST, "torchlens_version": _torchlens_version(),
        "backend": {"name": trace.provenance.backend, "version": trace.provenance.backend_version,
                    "framework_version": trace.provenance.framework_version},
        "codec": codec.name,
        "counts": {k: len(v["rows"]) for k, v in tables.items()},
        "disclosures": {"unencodable_values": sum(enc.unencodable.values()), "unencodable_types": dict(enc.unencodable),
                        "callable_placeholders": enc.callables, "output_not_stored": True},
        "files": {},
    }
    texts = {kind: json.dumps(tables[kind], separators=(",", ":"), allow_nan=False).encode("ascii") for kind in RECORD_KINDS}
    _refuse_unloadable(texts, manifest, codec, set(enc.payloads))  # save refuses what load would refuse
    st = _begin(target)
    tmp = st.path
    try:
        (tmp / "records").mkdir()
        (tmp / "blobs").mkdir()
        files: dict[str, dict[str, Any]] = {}
        for kind in RECORD_KINDS:
            data = texts[kind]
            name = f"records/{kind}.json"
            publish.write_file(tmp / name, data, sync=False)
            files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        if recipe is not None:
            files.update(write_recipe_files(tmp, *recipe))
        if level == "runnable":  # runnable/descriptor.json + state.safetensors, listed by manifest["runnable"]
            manifest["runnable"] = runnable.write(tmp, trace, enc)

        def write(item: tuple[str, list[tuple[str, EncodedPayload]]]) -> tuple[str, int, str]:
            name, entries = item
            size, digest = blobfile.write_blob(str(tmp / name), entries, {"format": "tlspec-blob", "codec": codec.name})
            return name, size, digest

        workers = max(1, min(len(shards), os.cpu_count() or 1, 8))
        with ThreadPoolExecutor(workers) as pool:
            from torchlens.viz.progress import progress, progress_enabled

            written = pool.map(write, shards.items())
            big = sum(p.array.nbytes for p in enc.payloads.values()) >= 512 * 1024 * 1024  # seconds of writing
            show = big and progress_enabled(None)  # a terminal, not CI, not switched off
            for name, size, digest in progress(written, total=len(shards), desc="save", enabled=show):
                files[name] = {"sha256": digest, "size": size}
        manifest["files"] = dict(sorted(files.items()))
        publish.write_file(tmp / MANIFEST_NAME, render(manifest), sync=False)
        publish.fsync_stage(tmp)
        _finish(st, target, proof)
    except BaseException as exc:
        st.discard()
        if isinstance(exc, OSError):
            raise write_failed(target, exc) from exc
        raise
    return target


def _arg(msg: str) -> Exception:
    from torchlens.errors import InvalidArgumentError

    return InvalidArgumentError("invalid_argument", msg, remedy="overwrite=True or overwrite=False")


def _as_path(path: Any) -> Path:
    try:
        return Path(os.fspath(path))
    except TypeError:
        raise _arg(f"path must be a str or os.PathLike, not {type(path).__name__}") from None


def _torchlens_version() -> str:
    import torchlens

    return getattr(torchlens, "__version__", "0")


def _check_save_target(target: Path, overwrite: bool) -> Any:
    """Refuse a save path before anything is written; return the fingerprint of the artifact
    `overwrite=True` may replace (None for a new path). Stale siblings a killed save of this
    path left are repaired or removed first (`publish.tidy`)."""
    if target.is_symlink():
        raise ArtifactError("save_path_symlink_rejected", f"{target} is a symlink",
                            remedy="save to the real path (a symlinked parent directory is fine)", path=str(target))
    if target.parent.is_dir():
        publish.tidy(target, prove=ownership.prove_artifact)
    if not os.path.lexists(target):
        return None
    if not overwrite:
        raise ArtifactError("bundle_path_exists", f"{target} already exists",
                            remedy="pass overwrite=True to replace it, or choose another path", path=str(target))
    return ownership.prove_artifact(target)


def write_failed(target: Path, exc: OSError) -> ArtifactError:
    """The typed form of a write the file system refused (ENOSPC, EFBIG, EACCES, EROFS, EIO...)."""
    name = errno.errorcode.get(exc.errno or 0, "") if exc.errno else ""
    return ArtifactError("artifact_write_failed", f"could not write {target}: {exc}",
                         remedy="check the directory is writable and has space, then save again",
                         path=str(target), errno=name or None)


def _begin(target: Path, directory: bool = True) -> publish.Stage:
    """Create the locked stage beside `target` (its parent directories too)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return publish.stage(target, directory=directory)
    except OSError as exc:
        raise write_failed(target, exc) from exc


def _finish(st: publish.Stage, target: Path, proof: Any) -> None:
    """Publish the written stage: a plain rename for a new path, an atomic swap over the
    proven old artifact (re-checked first) for an overwrite."""
    recheck = None if proof is None else ownership.rechecker(target, proof)
    try:
        publish.publish(st, recheck)
    except publish.PublishUnconfirmed as exc:
        raise ArtifactError("artifact_publish_unconfirmed", f"{target} was published, but flushing its directory "
                            f"failed: {exc.os_error}", remedy="check the disk; save again to be sure it is durable",
                            path=str(target)) from exc.os_error
    except FileExistsError as exc:
        raise ArtifactError("bundle_path_exists", f"{target} appeared while the artifact was being written",
                            remedy="pass overwrite=True to replace it, or choose another path", path=str(target)) from exc


def _shard(payloads: dict[str, EncodedPayload]) -> dict[str, list[tuple[str, EncodedPayload]]]:
    shards: dict[str, list[tuple[str, EncodedPayload]]] = {}
    cur: list[tuple[str, EncodedPayload]] = []
    size = 0
    for key, p in payloads.items():
        if cur and size + p.array.nbytes > SHARD_BYTES:
            shards[f"blobs/payloads-{len(shards):04d}.safetensors"] = cur
            cur, size = [], 0
        cur.append((key, p))
        size += p.array.nbytes
    if cur or not shards:
        shards[f"blobs/payloads-{len(shards):04d}.safetensors"] = cur
    return shards


def _refuse_unloadable(texts: dict[str, bytes], manifest: dict[str, Any], codec: Any, keys: set[str]) -> None:
    """Read the encoded records back as `load` reads them (JSON, typed cells, every
    cross-reference, the rebuild) before anything is written; a refusal load would make is
    raised now as `save_records_invalid`, naming load's code, and nothing is written."""
    from torchlens.io.rebuild import rebuild_trace

    def payload(key: str, where: str) -> Any:
        if key not in keys:
            raise ArtifactError("record_reference_invalid", f"{where} names payload {key!r}, which no payload record holds",
                                remedy="the records are damaged; save the trace again", at=where)
        return _CHECKED

    try:
        dec = Decoder(payload, getattr(codec, "decode_literal", None))
        rows = {kind: [{col: dec.cell(ctype, cell, f"{kind}[{i}].{col}") for (col, ctype), cell in zip(SCHEMAS[kind], row)}
                       for i, row in enumerate(check_table(kind, json.loads(texts[kind]), f"records/{kind}.json"))]
                for kind in RECORD_KINDS if kind != "payloads"}
        rebuild_trace(rows, manifest, attach_backend=False)
    except ArtifactError as exc:
        raise ArtifactError("save_records_invalid", f"the trace's records would not load ({exc.code}): {exc.message}",
                            remedy="the backend recorded an inconsistent trace (report it); nothing was written",
                            load_code=exc.code, **{k: v for k, v in exc.fields.items() if k != "load_code"}) from exc


def _table(kind: str, rows: list[list[Any]]) -> dict[str, Any]:
    return {"schema": f"tl.{kind}/3", "columns": [c for c, _ in SCHEMAS[kind]], "rows": rows}


def _row(enc: Encoder, kind: str, values: dict[str, Any], index: int) -> list[Any]:
    return [enc.cell(ctype, values[col], f"{kind}[{index}].{col}") for col, ctype in SCHEMAS[kind]]


def _slot(obj: Any, name: str) -> Any:
    return getattr(obj, name, None)


def encode_tables(trace: Any, enc: Encoder) -> dict[str, dict[str, Any]]:
    """Every record of `trace` as typed tables (payloads collected in `enc`)."""
    prov, cost = trace.provenance, trace.cost
    prov.param_hash_full  # noqa: B018 - computed now while the live values are held, so the file keeps it
    prov.settle_extra()  # extra entries deferred to their first read (torch's grad_fn records)
    annotations = dict(trace.annotations)
    armed = len(trace.armed_edits) if trace._intervention is not None else 0
    if armed:  # the saved trace keeps its armed gradient rules (intervention.json) and says how many
        annotations["armed_gradient_edits"] = armed
    tables = {
        "trace": _table("trace", [_row(enc, "trace", {"name": trace.name, "uncalled_modules": trace.uncalled_modules,
                                                       "options": trace.options, "annotations": annotations,
                                                       "backward_passes": int(trace.__dict__.get("_backward_passes", 0))},
                                      0)]),
        "provenance": _table("provenance", [_row(enc, "provenance", {c: getattr(prov, c) for c, _ in SCHEMAS["provenance"]}, 0)]),
        "cost": _table("cost", [_row(enc, "cost", {c: getattr(cost, c) for c, _ in SCHEMAS["cost"]}, 0)]),
    }
    rows = []
    for i, op in enumerate(trace._ops.values()):
        vals = {c: _slot(op, c) for c, _ in SCHEMAS["ops"]}
        vals["outputs"] = _slot(op, "_outputs") or ()
        vals["site"] = site_key(vals["site"])
        rows.append(_row(enc, "ops", vals, i))
    tables["ops"] = _table("ops", rows)
    tables["layers"] = _table("layers", [
        _row(enc, "layers", {**{c: _slot(layer, c) for c, _ in SCHEMAS["layers"]}, "ops": [o.label for o in layer.ops]}, i)
        for i, layer in enumerate(trace._layers.values())])
    tables["modules"] = _table("modules", [
        _row(enc, "modules", {**{c: _slot(m, c) for c, _ in SCHEMAS["modules"]}, "calls": [c.label for c in m.calls]}, i)
        for i, m in enumerate(trace._modules.values())])
    for kind, records in (("module_calls", trace._module_calls), ("params", trace._params), ("buffers", trace._buffers)):
        tables[kind] = _table(kind, [_row(enc, kind, {c: _slot(r, c) for c, _ in SCHEMAS[kind]}, i)
                                     for i, r in enumerate(records.values())])
    return tables


# load ---------------------------------------------------------------------------------------
def load(path: Any, lazy: bool = False) -> Any:
    """Load a `.tlspec` directory written by `Trace.save`, checking all of it first.

    Every payload byte the trace holds was read into memory once and verified against the
    manifest's sha256 before `load` returns, so changing, truncating or deleting the files
    afterwards cannot reach the trace. Files are never memory-mapped: a mapping of a file
    another process truncates kills the reader with SIGBUS, and mapped pages read after the
    check would be unverified. `lazy=True` is accepted for compatibility and loads the same
    way (see docs/guides/saving.md, "Lazy loading").
    """
    if not isinstance(lazy, bool):
        raise _arg("lazy= takes True or False")
    return _open(_as_path(path), lazy, decode=True)


def validate(path: Any) -> dict[str, Any]:
    """Every check `load` makes, without decoding payloads or building the trace."""
    bundle = _as_path(path)
    _open(bundle, True, decode=False)
    return read_manifest(bundle)


def repair(path: Any) -> None:
    """Before reading `path`: restore the artifact a save killed mid-publish left only as a
    `.old-*` copy, and remove stale temporary siblings (`publish.tidy`)."""
    bundle = _as_path(path)
    if bundle.parent.is_dir() and not bundle.is_symlink():
        publish.tidy(bundle, prove=ownership.prove_artifact)


def _open(bundle: Path, lazy: bool, decode: bool) -> Any:
    repair(bundle)
    manifest = read_manifest(bundle)
    files = manifest["files"]
    _check_layout(bundle, files, manifest.get("runnable"))
    tables = {}
    for kind in RECORD_KINDS:
        name = f"records/{kind}.json"
        data = _read_checked(bundle, name, files[name])
        tables[kind] = check_table(kind, parse_json(data, name, "record_file_malformed"), name)
    payload_rows = _payload_rows(tables["payloads"], files)
    # validate resolves the codec and decodes (then drops) each payload too: it refuses what load refuses
    codec = codec_named(manifest["codec"], manifest["backend"]["name"]) if payload_rows else None
    encoded = _read_payloads(bundle, files, payload_rows, keep=decode, codec=codec, codec_name=manifest["codec"])
    decoded: dict[str, Any] = {}
    referenced: set[str] = set()

    def payload(key: str, where: str) -> Any:
        if key not in encoded:
            raise ArtifactError("record_reference_invalid", f"{where} names payload {key!r}, which no payload record holds",
                                remedy="the records are damaged; save the trace again", at=where)
        referenced.add(key)
        if not decode:
            return _CHECKED  # decoded and dropped while reading; not None, so record checks match load's
        if key not in decoded:
            decoded[key] = _decode(codec, encoded[key], key)
        return decoded[key]

    literal_codec = codec
    if literal_codec is None:
        try:
            literal_codec = codec_named(manifest["codec"], manifest["backend"]["name"])
        except TorchLensError:
            literal_codec = None
    dec = Decoder(payload, getattr(literal_codec, "decode_literal", None))
    rows = {kind: [{col: dec.cell(ctype, cell, f"{kind}[{i}].{col}") for (col, ctype), cell in zip(SCHEMAS[kind], row)}
                   for i, row in enumerate(tables[kind])] for kind in RECORD_KINDS if kind != "payloads"}
    if set(encoded) - referenced:
        raise ArtifactError("record_reference_invalid", "payload records exist that no record references",
                            remedy="the records are damaged; save the trace again")
    _check_disclosures(manifest, tables, dec)
    from torchlens.intervention.verbs import restore_state
    from torchlens.io.intervention import read_trace_recipe
    from torchlens.io.rebuild import rebuild_trace

    state = read_trace_recipe(bundle, files, manifest["backend"]["name"])
    trace = rebuild_trace(rows, manifest, attach_backend=decode)
    if state is not None:
        restore_state(trace, state)
    if "runnable" in manifest:  # digests, the descriptor against the records; then trace.runnable
        from torchlens.io import runnable

        rn = runnable.read(bundle, manifest, trace if decode else None)
        if rn is not None:
            trace.__dict__["_runnable"] = rn
    return trace


def read_manifest(bundle: Path) -> dict[str, Any]:
    """The checked manifest of a `.tlspec` directory (path rules first)."""
    if bundle.is_symlink():
        raise ArtifactError("load_path_symlink_rejected", f"{bundle} is a symlink",
                            remedy="load the real path (a symlinked parent directory is fine)", path=str(bundle))
    if not bundle.is_dir():
        raise ArtifactError("artifact_not_found", f"{bundle} is not a directory",
                            remedy="pass the .tlspec directory Trace.save wrote", path=str(bundle))
    mpath = bundle / MANIFEST_NAME
    if mpath.is_symlink():
        raise ArtifactError("load_path_symlink_rejected", f"{mpath} is a symlink", remedy="artifacts hold no symlinks",
                            path=str(mpath))
    if not mpath.is_file():
        from torchlens.io.detect import detect_tlspec_format

        if os.path.lexists(mpath) is False and detect_tlspec_format(bundle) == "pre_3":
            raise ArtifactError("manifest_version_unsupported", "this artifact was saved by torchlens 2.37 or earlier",
                                remedy="load it with the torchlens version that wrote it", path=str(bundle))
        raise ArtifactError("manifest_missing", f"{bundle} has no manifest.json",
                            remedy="pass the .tlspec directory Trace.save wrote", path=str(bundle))
    try:
        data = read_bounded(mpath, MAX_MANIFEST_BYTES)  # allocates what the file holds, not the bound
    except OSError as exc:
        raise ArtifactError("artifact_read_failed", f"could not read {mpath}: {exc}", remedy="check permissions") from exc
    if data is None:
        raise malformed("is larger than any manifest torchlens writes")
    obj = parse_json(data, MANIFEST_NAME, "manifest_malformed")
    extra = obj.pop("runnable", None) if isinstance(obj, dict) and obj.get("level") == "runnable" else None
    manifest = check_manifest(obj)
    if manifest["level"] == "runnable":
        from torchlens.io.runnable import check_manifest_object

        manifest["runnable"] = check_manifest_object(extra)
    if manifest["kind"] != "trace":
        raise ArtifactError("artifact_kind_unsupported", f"the artifact is a {manifest['kind'][:40]!r}, not a trace",
                            remedy="tl.load reads traces", kind=manifest["kind"][:40])
    if manifest["level"] not in LEVELS:
        raise ArtifactError("artifact_save_level_unsupported", f"level {manifest['level'][:40]!r} is not readable here",
                            remedy="save with level='full'", level=manifest["level"][:40])
    if manifest["schema_digest"] != SCHEMA_DIGEST:
        raise ArtifactError("manifest_version_unsupported", "the record schemas differ from saved format 3's",
                            remedy="load it with the torchlens version that wrote it")
    if set(manifest["counts"]) != set(RECORD_KINDS):
        raise malformed("counts does not name every record kind")
    for kind in RECORD_KINDS:
        if f"records/{kind}.json" not in manifest["files"]:
            raise malformed(f"does not list records/{kind}.json")
    return manifest


def _check_layout(bundle: Path, files: dict[str, Any], runnable: dict[str, Any] | None = None) -> None:
    if runnable is not None:  # runnable/ holds exactly the files the manifest's runnable object lists
        files = {**files, **runnable["files"]}
    for sub in ("records", "blobs") + (("runnable",) if runnable is not None else ()):
        d = bundle / sub
        if d.is_symlink():
            raise ArtifactError("load_path_symlink_rejected", f"{d} is a symlink", remedy="artifacts hold no symlinks",
                                path=str(d))
        if not d.is_dir():
            raise ArtifactError("artifact_file_missing", f"{bundle} has no {sub}/ directory",
                                remedy="the artifact is incomplete; save the trace again", file=sub)
    for name, entry in files.items():
        p = bundle / name
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            raise ArtifactError("artifact_file_missing", f"{name} is missing", remedy="the artifact is incomplete; save it again",
                                file=name) from None
        except OSError as exc:
            raise ArtifactError("artifact_read_failed", f"could not stat {name}: {exc}", remedy="check permissions") from exc
        if stat.S_ISLNK(st.st_mode):
            raise ArtifactError("load_path_symlink_rejected", f"{name} is a symlink", remedy="artifacts hold no symlinks",
                                path=str(p))
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactError("artifact_file_missing", f"{name} is not a regular file",
                                remedy="the artifact is damaged; save it again", file=name)
        if st.st_size != entry["size"]:
            raise ArtifactError("artifact_size_mismatch", f"{name} is {st.st_size} bytes, the manifest says {entry['size']}",
                                remedy="the file was truncated or modified; save the trace again", file=name)
    for entry in os.scandir(bundle):
        rel = entry.name
        if rel == "intervention.json" and rel in files:
            continue
        dirs = ("records", "blobs") + (("runnable",) if runnable is not None else ())
        if rel == MANIFEST_NAME or (rel in dirs and entry.is_dir(follow_symlinks=False)):
            if rel in dirs:
                for sub in os.scandir(entry.path):
                    name = f"{rel}/{sub.name}"
                    if name not in files:
                        code = "load_path_symlink_rejected" if sub.is_symlink() else "artifact_file_unlisted"
                        raise ArtifactError(code, f"{name} is not listed in the manifest",
                                            remedy="artifacts hold only the files their manifest lists", file=name)
            continue
        code = "load_path_symlink_rejected" if entry.is_symlink() else "artifact_file_unlisted"
        raise ArtifactError(code, f"{rel} is not part of the artifact layout",
                            remedy="artifacts hold only the files their manifest lists", file=rel)


def _read_checked(bundle: Path, name: str, entry: dict[str, Any]) -> bytes:
    import hashlib

    if entry["size"] > _MAX_RECORD_BYTES:
        raise malformed(f"gives {name} an implausible size")
    try:
        with open(bundle / name, "rb") as f:
            data = f.read(entry["size"] + 1)
    except OSError as exc:
        raise ArtifactError("artifact_read_failed", f"could not read {name}: {exc}", remedy="check permissions") from exc
    if len(data) != entry["size"]:
        raise ArtifactError("artifact_size_mismatch", f"{name} changed size while being read",
                            remedy="do not modify an artifact while loading it", file=name)
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ArtifactError("artifact_digest_mismatch", f"{name}: sha256 differs from the manifest",
                            remedy="the file was modified or damaged; save the trace again", file=name)
    return data


def _payload_rows(rows: list[list[Any]], files: dict[str, Any]) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    dec = Decoder(lambda k, w: None)
    for i, row in enumerate(rows):
        key, blob, tensor, dtype, shape, meta = (dec.cell(ct, cell, f"payloads[{i}].{c}")
                                                 for (c, ct), cell in zip(SCHEMAS["payloads"], row))
        if key in out:
            raise ArtifactError("record_schema_invalid", f"payloads[{i}]: duplicate key {key!r}",
                                remedy="the records are damaged; save the trace again", at=f"payloads[{i}].key")
        if blob not in files or not blob.startswith("blobs/") or blob == RECIPE_BLOB:
            raise ArtifactError("record_reference_invalid", f"payloads[{i}] names blob {blob!r}, which the manifest does not list",
                                remedy="the records are damaged; save the trace again", at=f"payloads[{i}].blob")
        if dtype not in blobfile.STORAGE:
            raise ArtifactError("record_schema_invalid", f"payloads[{i}]: unknown dtype tag {dtype!r}",
                                remedy="the records are damaged; save the trace again", at=f"payloads[{i}].dtype")
        out[key] = (blob, tensor, dtype, shape, meta)
    return out


_CHECKED = object()  # what validate's decoder gets for a payload it checked and dropped


def _decode(codec: Any, p: EncodedPayload, key: str) -> Any:
    """Decode one payload; a codec's own failure on the file's bytes is a typed refusal."""
    try:
        return codec.decode(p)
    except TorchLensError:
        raise
    except Exception as exc:
        raise ArtifactError("blob_malformed", f"the {codec.name} codec could not decode payload {key} "
                            f"({type(exc).__name__}: {str(exc)[:200]})", remedy="the artifact is damaged; save it again",
                            payload=key) from exc


def _read_payloads(bundle: Path, files: dict[str, Any], rows: dict[str, tuple], keep: bool, codec: Any = None,
                   codec_name: str = "") -> dict[str, Any]:
    """Read and verify every blob, check it against its payload records, and return the
    payloads (`keep=False`, for validate: each blob is dropped once checked, so memory stays
    at a few shards whatever the artifact's size)."""
    by_blob: dict[str, list[str]] = {}
    for key, row in rows.items():
        by_blob.setdefault(row[0], []).append(key)
    names = [n for n in files if n.startswith("blobs/") and n != RECIPE_BLOB]  # the recipe's blob: io.intervention

    def read(name: str) -> dict[str, Any]:
        try:
            blob = blobfile.read_blob(str(bundle / name), name, files[name]["size"], files[name]["sha256"], False)
        except OSError as exc:
            raise ArtifactError("artifact_read_failed", f"could not read {name}: {exc}", remedy="check permissions") from exc
        if blob.metadata.get("format") != "tlspec-blob" or blob.metadata.get("codec") != codec_name:
            raise ArtifactError("blob_malformed", f"{name} names codec {blob.metadata.get('codec')!r:.40}, the manifest "
                                f"{codec_name[:40]!r}", remedy="the artifact was modified; save the trace again", blob=name)
        out: dict[str, Any] = {}
        for key in by_blob.get(name, ()):
            _, tensor, dtype, shape, meta = rows[key]
            payload = blobfile.payload_from_storage(blob, tensor, dtype, shape, meta)
            if not keep:
                _decode(codec, payload, key)  # validate: the codec's refusals, nothing kept
            out[key] = payload if keep else None
        used = {rows[k][1] for k in by_blob.get(name, ())}
        if any(t not in used for t in blob.entries if not t.startswith(blobfile.PAD_PREFIX)):
            raise ArtifactError("blob_malformed", f"{name} holds tensors no payload record names",
                                remedy="the artifact was modified; save the trace again", blob=name)
        return out

    encoded: dict[str, Any] = {}
    if len(names) <= 1:
        for n in names:
            encoded.update(read(n))
        return encoded
    with ThreadPoolExecutor(max(1, min(len(names), os.cpu_count() or 1, 8))) as pool:
        for part in pool.map(read, names):
            encoded.update(part)
    return encoded


def _check_disclosures(manifest: dict[str, Any], tables: dict[str, list], dec: Decoder) -> None:
    d = manifest["disclosures"]
    counts = {k: len(v) for k, v in tables.items()}
    if (manifest["counts"] != counts or d["unencodable_values"] != sum(dec.unencodable.values())
            or d["unencodable_types"] != dec.unencodable or d["callable_placeholders"] != dec.callables
            or d["output_not_stored"] is not True):
        raise ArtifactError("manifest_disclosure_mismatch", "the manifest's counts or disclosures disagree with the records",
                            remedy="the artifact was modified; save the trace again")
