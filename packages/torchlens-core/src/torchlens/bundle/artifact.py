"""Bundle.save / Bundle.load: the bundle artifact, a directory of member traces.

Layout::

    <name>/
      manifest.json        kind "bundle": member names and folders, the baseline, and the
                           sha256 and size of relations.json and of every member's manifest
      relations.json       the relation rows (schema tl.bundle_relations/1)
      members/0000/ ...    each member, a trace `.tlspec` written by Trace.save
      snapshots/0000.safetensors   the member's capture-time parameter snapshot, when it has one

A member entry's "binding" is its attached token-stream binding (a token_boundary_v1 mapping,
or null); on load it is checked against the loaded member's own ids before any relation row
is re-checked, so a verified fed_by row stays verified only while its evidence holds.

The bundle manifest pins each member's own manifest by digest, and a member's manifest pins
every file of the member, so one chain of digests covers the whole directory. Loading reads
nothing it has not bounded and checked (strict JSON, no duplicate keys, exact key sets,
no unlisted entries, no symlinks), loads each member with the trace loader's full checks,
and re-checks every relation row against the loaded members: a tampered relations.json is
refused even when its digest was recomputed. Nothing is unpickled or imported. Writing
goes through the same locked stage and atomic publish as Trace.save.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path
from typing import Any

from torchlens.bundle import binding as _binding
from torchlens.bundle.guard import attach_snapshot, snapshot_of
from torchlens.errors import ArtifactError, TorchLensError
from torchlens.io import publish
from torchlens.io.manifest import FORMAT, FORMAT_VERSION, MAX_MANIFEST_BYTES, read_bounded, render, strict_json

KIND = "bundle"
RELATIONS = "relations.json"
RELATIONS_SCHEMA = "tl.bundle_relations/1"
_KEYS = {"format", "format_version", "kind", "torchlens_version", "members", "baseline", "files"}
_DIR_RE = re.compile(r"^members/[0-9]{4}$")
SNAPSHOT_KIND = "param_snapshot"
MAX_SNAPSHOT_PARAMS = 1_000_000
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_RELATIONS_BYTES = 64 * 1024 * 1024
MAX_MEMBERS = 100_000


def _bad(target: Path, why: str) -> ArtifactError:
    return ArtifactError("bundle_artifact_malformed", f"bundle {target}: {why}",
                         remedy="the bundle artifact is damaged or was edited; save the bundle again", why=why)


def _entry(data: bytes) -> dict[str, Any]:
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


# save ------------------------------------------------------------------------------------------
def save_bundle(bundle: Any, path: Any, overwrite: bool = False) -> Path:
    """Write `bundle` as a bundle artifact at `path`; return the path."""
    import json

    from torchlens import __version__
    from torchlens.io.bundle import _as_path, _begin, save, write_failed

    if not isinstance(overwrite, bool):
        from torchlens.io.bundle import _arg

        raise _arg("overwrite= takes True or False")
    target = _as_path(path)
    if target.is_symlink():
        raise ArtifactError("save_path_symlink_rejected", f"{target} is a symlink",
                            remedy="save to the real path (a symlinked parent directory is fine)", path=str(target))
    if target.parent.is_dir():
        publish.tidy(target, prove=_prove)
    proof = None
    if os.path.lexists(target):
        if not overwrite:
            raise ArtifactError("bundle_path_exists", f"{target} already exists",
                                remedy="pass overwrite=True to replace it, or choose another path", path=str(target))
        proof = _prove(target)
    relations = {"schema": RELATIONS_SCHEMA, "rows": [r.to_json() for r in bundle.relations]}
    rel_bytes = (json.dumps(relations, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")
    st = _begin(target)
    try:
        files = {RELATIONS: _entry(rel_bytes)}
        publish.write_file(st.path / RELATIONS, rel_bytes, sync=False)
        (st.path / "members").mkdir()
        members = []
        for i, (name, trace) in enumerate(bundle.members.items()):
            folder = f"members/{i:04d}"
            save(trace, st.path / folder)
            data = (st.path / folder / "manifest.json").read_bytes()
            files[f"{folder}/manifest.json"] = _entry(data)
            snap_name = _write_snapshot(st.path, i, snapshot_of(trace), files)
            held = _binding.attached(trace)
            members.append({"name": name, "dir": folder, "snapshot": snap_name,
                            "binding": None if held is None else held.to_json()})
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "kind": KIND, "torchlens_version": __version__,
                    "members": members, "baseline": bundle._baseline, "files": files}
        publish.write_file(st.path / "manifest.json", render(manifest), sync=False)
        publish.fsync_stage(st.path)
        _finish_bundle(st, target, proof)
    except BaseException as exc:
        st.discard()
        if isinstance(exc, OSError):
            raise write_failed(target, exc) from exc
        raise
    return target


def _write_snapshot(root: Path, index: int, snap: dict[str, Any] | None, files: dict[str, Any]) -> str | None:
    """Write one member's parameter snapshot as a safetensors blob; return its name (or None)."""
    import json

    from torchlens.io.blobfile import write_blob
    from torchlens.io.codec import NumpyCodec

    if snap is None:
        return None
    codec = NumpyCodec()
    entries, listing = [], []
    for k, (address, arr) in enumerate(snap.items()):
        payload = codec.encode(arr)
        entries.append((f"p{k}", payload))
        listing.append([address, payload.dtype, list(payload.shape)])
    (root / "snapshots").mkdir(exist_ok=True)
    name = f"snapshots/{index:04d}.safetensors"
    meta = {"format": "tlspec-blob", "codec": codec.name, "kind": SNAPSHOT_KIND,
            "params": json.dumps(listing, separators=(",", ":"))}
    size, digest = write_blob(str(root / name), entries, meta)
    files[name] = {"sha256": digest, "size": size}
    return name


def _read_snapshot(target: Path, name: str, entry: dict[str, Any], trace: Any) -> dict[str, Any]:
    """A member's snapshot, checked: the blob's digest, its listing (strict JSON naming exactly
    the trace's parameters with their shapes) and each tensor's header before any byte is used."""
    import numpy as np

    from torchlens.io.blobfile import payload_from_storage, read_blob
    from torchlens.io.codec import NumpyCodec

    p = target / name
    if p.is_symlink() or not p.is_file():
        raise _bad(target, f"{name} is missing, a symlink or not a regular file")
    blob = read_blob(str(p), name, entry["size"], entry["sha256"])
    if blob.metadata.get("kind") != SNAPSHOT_KIND or blob.metadata.get("codec") != "numpy":
        raise _bad(target, f"{name} is not a parameter snapshot blob")
    try:
        listing = strict_json(blob.metadata.get("params", ""))
    except (ValueError, RecursionError):
        raise _bad(target, f"{name}: its parameter listing is not strict JSON") from None
    if not (isinstance(listing, list) and len(listing) <= MAX_SNAPSHOT_PARAMS and all(
            isinstance(r, list) and len(r) == 3 and type(r[0]) is str and type(r[1]) is str and isinstance(r[2], list)
            and all(type(d) is int and d >= 0 for d in r[2]) for r in listing)):
        raise _bad(target, f"{name}: its parameter listing is malformed")
    if [r[0] for r in listing] != list(trace._params):
        raise _bad(target, f"{name}: the snapshot does not list exactly the member's parameters")
    codec = NumpyCodec()
    snap = {}
    for k, (address, tag, shape) in enumerate(listing):
        want = list(trace._params[address].shape)
        if shape != want:
            raise _bad(target, f"{name}: {address} has shape {shape}, the member's parameter {want}")
        snap[address] = np.array(codec.decode(payload_from_storage(blob, f"p{k}", tag, tuple(shape), {})), copy=True)
    return snap


def _finish_bundle(st: Any, target: Path, proof: Any) -> None:
    from torchlens.io.bundle import _finish

    if proof is None:
        _finish(st, target, None)
        return
    recheck_stamp = proof

    def recheck() -> None:
        if _stamp(target) != recheck_stamp:
            raise ArtifactError("bundle_path_not_artifact", f"{target} changed while the new bundle was being written",
                                remedy="save again", path=str(target))

    try:
        publish.publish(st, recheck)
    except publish.PublishUnconfirmed as exc:
        raise ArtifactError("artifact_publish_unconfirmed", f"{target} was published, but flushing its directory "
                            f"failed: {exc.os_error}", remedy="check the disk; save again to be sure it is durable",
                            path=str(target)) from exc.os_error


def _stamp(target: Path) -> tuple:
    st = os.lstat(target)
    m = os.lstat(target / "manifest.json")
    return (st.st_ino, st.st_mtime_ns, m.st_ino, m.st_mtime_ns, m.st_size)


def _prove(target: Path) -> tuple:
    """The stamp of the intact bundle artifact at `target` (its manifest and digests checked),
    or `bundle_path_not_artifact`: overwrite=True replaces only a proven bundle."""
    try:
        _read_checked_layout(target)
        return _stamp(target)
    except (TorchLensError, OSError) as exc:
        raise ArtifactError("bundle_path_not_artifact", f"{target} is not an intact bundle artifact ({exc})",
                            remedy="choose another path; overwrite=True replaces only a TorchLens bundle",
                            path=str(target)) from None


# load ------------------------------------------------------------------------------------------
def _read_file(target: Path, name: str, entry: dict[str, Any], limit: int) -> bytes:
    p = target / name
    if p.is_symlink() or not p.is_file():
        raise _bad(target, f"{name} is missing, a symlink or not a regular file")
    data = read_bounded(p, min(limit, entry["size"]))
    if data is None or len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise _bad(target, f"{name} does not match the size and sha256 its manifest records")
    return data


def _read_checked_layout(target: Path) -> tuple[dict[str, Any], list[Any]]:
    """The checked manifest and relation rows (JSON) of the bundle at `target`."""
    if target.is_symlink():
        raise ArtifactError("load_path_symlink_rejected", f"{target} is a symlink",
                            remedy="load the real path (a symlinked parent directory is fine)", path=str(target))
    if not target.is_dir():
        raise ArtifactError("artifact_not_found", f"{target} is not a directory", remedy="pass a saved bundle's path",
                            path=str(target))
    mpath = target / "manifest.json"
    if mpath.is_symlink() or not mpath.is_file():
        raise _bad(target, "manifest.json is missing, a symlink or not a regular file")
    data = read_bounded(mpath, MAX_MANIFEST_BYTES)
    if data is None:
        raise _bad(target, "manifest.json is too large")
    try:
        m = strict_json(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise _bad(target, "manifest.json is not strict JSON") from None
    if not isinstance(m, dict) or set(m) != _KEYS:
        raise _bad(target, "manifest.json does not have the bundle manifest's keys")
    if m["format"] != FORMAT or m["kind"] != KIND or type(m["format_version"]) is not int:
        raise _bad(target, "manifest.json does not name a tlspec bundle")
    if m["format_version"] != FORMAT_VERSION:
        raise ArtifactError("manifest_version_unsupported", f"saved format {m['format_version']} is not {FORMAT_VERSION}",
                            remedy="load it with the torchlens version that wrote it", found=m["format_version"])
    if type(m["torchlens_version"]) is not str:
        raise _bad(target, "torchlens_version is not a string")
    members, files = m["members"], m["files"]
    if not isinstance(members, list) or len(members) > MAX_MEMBERS:
        raise _bad(target, "members is not a list of bounded length")
    names, dirs = [], []
    snaps = []
    for i, e in enumerate(members):
        if not (isinstance(e, dict) and set(e) - {"binding"} == {"name", "dir", "snapshot"} and type(e["name"]) is str
                and (e.get("binding") is None or isinstance(e["binding"], dict))
                and 0 < len(e["name"]) <= 256 and e["dir"] == f"members/{i:04d}" and _DIR_RE.match(e["dir"])
                and e["snapshot"] in (None, f"snapshots/{i:04d}.safetensors")):
            raise _bad(target, f"members[{i}] is malformed")
        names.append(e["name"])
        dirs.append(e["dir"])
        if e["snapshot"] is not None:
            snaps.append(e["snapshot"])
    if len(set(names)) != len(names):
        raise _bad(target, "two members share a name")
    if not (m["baseline"] is None or (type(m["baseline"]) is str and m["baseline"] in names)):
        raise _bad(target, "baseline is not a member name")
    want = {RELATIONS} | {f"{d}/manifest.json" for d in dirs} | set(snaps)
    if not isinstance(files, dict) or set(files) != want:
        raise _bad(target, "files does not list exactly relations.json, every member's manifest and snapshot")
    for name, entry in files.items():
        if not (isinstance(entry, dict) and set(entry) == {"sha256", "size"} and type(entry["sha256"]) is str
                and _SHA_RE.match(entry["sha256"]) and type(entry["size"]) is int and entry["size"] >= 0):
            raise _bad(target, f"the files entry for {name} is malformed")
    unlisted = sorted({e.name for e in os.scandir(target)} - {"manifest.json", RELATIONS, "members"}
                      - ({"snapshots"} if snaps else set()))
    if unlisted:
        raise _bad(target, f"holds entries its manifest does not list: {unlisted[:5]}")
    mdir = target / "members"
    if mdir.is_symlink() or (dirs and not mdir.is_dir()):
        raise _bad(target, "members/ is missing or a symlink")
    if mdir.is_dir():
        held = {f"members/{e.name}" for e in os.scandir(mdir)}
        if held != set(dirs):
            raise _bad(target, "members/ does not hold exactly the member folders the manifest lists")
    sdir = target / "snapshots"
    if snaps:
        if sdir.is_symlink() or not sdir.is_dir() or {f"snapshots/{e.name}" for e in os.scandir(sdir)} != set(snaps):
            raise _bad(target, "snapshots/ does not hold exactly the snapshot files the manifest lists")
    for d in dirs:
        st = os.lstat(target / d)
        if not stat.S_ISDIR(st.st_mode):
            raise _bad(target, f"{d} is not a directory")
    rel = _read_file(target, RELATIONS, files[RELATIONS], MAX_RELATIONS_BYTES)
    try:
        body = strict_json(rel.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise _bad(target, "relations.json is not strict JSON") from None
    if not (isinstance(body, dict) and set(body) == {"schema", "rows"} and body["schema"] == RELATIONS_SCHEMA
            and isinstance(body["rows"], list)):
        raise _bad(target, f"relations.json is not a {RELATIONS_SCHEMA} table")
    for d in dirs:
        _read_file(target, f"{d}/manifest.json", files[f"{d}/manifest.json"], MAX_MANIFEST_BYTES)
    return m, body["rows"]


def load_bundle(path: Any, lazy: bool = False) -> Any:
    """Load a bundle artifact, checking all of it (every member with the trace loader's checks,
    every relation row re-checked against the loaded members) before it returns."""
    from torchlens.bundle.core import Bundle
    from torchlens.io.bundle import _arg, _as_path, load

    if not isinstance(lazy, bool):
        raise _arg("lazy= takes True or False")
    target = _as_path(path)
    if target.parent.is_dir() and not target.is_symlink():
        publish.tidy(target, prove=_prove)
    manifest, rows = _read_checked_layout(target)
    members, snapshots = {}, {}
    for e in manifest["members"]:
        member_dir = target / e["dir"]
        members[e["name"]] = load(member_dir, lazy=lazy)
        data = read_bounded(member_dir / "manifest.json", MAX_MANIFEST_BYTES)
        if data is None or _entry(data) != manifest["files"][f"{e['dir']}/manifest.json"]:
            raise _bad(target, f"{e['dir']}/manifest.json changed while the bundle was loading")
        if e["snapshot"] is not None:
            snapshots[e["name"]] = _read_snapshot(target, e["snapshot"], manifest["files"][e["snapshot"]],
                                                  members[e["name"]])
    bundle = Bundle(members, baseline=manifest["baseline"])
    for i, e in enumerate(manifest["members"]):
        if e.get("binding") is not None:
            try:
                _binding.restore(members[e["name"]], e["binding"])
            except TorchLensError as exc:
                raise _bad(target, f"members[{i}].binding: {exc.message}") from None
    bundle._append_rows(rows, opaque_ok=True)  # every row re-checked; unknown namespaced kinds stay opaque
    for name, snap in snapshots.items():
        attach_snapshot(members[name], snap)
    return bundle


def is_bundle_artifact(path: Any) -> bool:
    """Whether `path` holds a manifest that names kind "bundle" (for tl.load's dispatch)."""
    from torchlens.io.artifact import artifact_kind

    return artifact_kind(path) == KIND


__all__ = ["save_bundle", "load_bundle", "is_bundle_artifact"]
