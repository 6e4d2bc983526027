"""Portable intervention specs: `.tlspec` directories of kind "intervention" or "recipe".

Layout: `manifest.json` (kind, level, versions, sha256 and size of every file),
`intervention.json` (each rule's selector and built-in edit identity as typed JSON; a user
callable is a placeholder, never pickled) and `blobs/recipe-NNNN.safetensors` (the recipe's
tensors, one entry per tensor object). Loading checks every digest before decoding.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchlens.errors import ArtifactError, InterventionError, TorchLensError
from torchlens.io import blobfile
from torchlens.io.codec import NumpyCodec, backend_codec, codec_named

FORMAT, FORMAT_VERSION = "tlspec", 3
SCHEMA = "tl.intervention/1"
LEVELS = ("portable", "audit")
_KEYS = {"format", "format_version", "kind", "level", "torchlens_version", "backend", "files", "rules"}
_MAX_DEPTH = 64
#: The only file names a spec holds (anything else, `/etc/passwd` or `../x` included, refuses).
_FILE_RE = re.compile(r"^(intervention\.json|blobs/recipe-0000\.safetensors)$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_MAX_BODY_BYTES = 256 * 1024 * 1024


# selectors ----------------------------------------------------------------------------------
def _enc_selector(sel: Any) -> Any:
    from torchlens.select import selectors as S

    if isinstance(sel, str):
        return {"label": sel}
    simple = {S.FuncSelector: ("func", "name"), S.ModuleSelector: ("module", "address"),
              S.InModuleSelector: ("in_module", "address"), S.LabelSelector: ("label", "label"),
              S.LabelContainsSelector: ("label_contains", "text"), S.ModelInputSelector: ("model_input", "path"),
              S.ModelOutputSelector: ("model_output", "path")}
    t = type(sel)
    if t in simple:
        kind, attr = simple[t]
        return {kind: getattr(sel, attr)}
    if t is S.AllSitesSelector:
        return {"all_sites": True}
    if t is S.LabelMatchesSelector:
        return {"label_matches": sel.pattern}
    if t in (S._And, S._Or, S._Sub):
        return {{S._And: "and", S._Or: "or", S._Sub: "sub"}[t]: [_enc_selector(sel.a), _enc_selector(sel.b)]}
    if t is S._Not:
        return {"not": _enc_selector(sel.a)}
    grad = getattr(S, "GradSelector", None)
    if grad is not None and t is grad:
        return {"grad": _enc_selector(sel.site)}
    raise InterventionError("intervention_spec_not_portable", f"{sel!r} has no portable form (a predicate runs user code)",
                            remedy="use label, func, module or in_module selectors, or save at level='audit'")


def _dec_selector(obj: Any, where: str, depth: int = 0) -> Any:
    try:
        return _dec_selector_inner(obj, where, depth)
    except TorchLensError:
        raise
    except Exception as exc:  # a selector constructor refusing text from the file: typed, never raw
        raise _malformed(f"{where}: selector does not rebuild ({type(exc).__name__})") from None


def _dec_selector_inner(obj: Any, where: str, depth: int) -> Any:
    import torchlens as tl
    from torchlens.select import selectors as S

    if depth > _MAX_DEPTH:
        raise _malformed(f"{where}: selectors nest deeper than {_MAX_DEPTH} levels")
    if not isinstance(obj, dict) or len(obj) != 1:
        raise _malformed(f"{where}: a selector is a one-key object")
    (kind, body), = obj.items()
    one = {"label": tl.label, "func": tl.func, "module": tl.module, "in_module": tl.in_module,
           "label_contains": tl.label_contains, "label_matches": tl.label_matches}
    if kind in one and isinstance(body, str):
        return body if kind == "label" and where.endswith("target") else one[kind](body)
    if kind in ("model_input", "model_output") and (body is None or isinstance(body, str)):
        return getattr(tl, kind)(body)
    if kind == "all_sites" and body is True:
        return tl.all_sites()
    if kind in ("and", "or", "sub") and isinstance(body, list) and len(body) == 2:
        a, b = (_dec_selector(x, where + "." + kind, depth + 1) for x in body)
        a, b = (S.as_selector(a), S.as_selector(b))
        return {"and": a & b, "or": a | b, "sub": a - b}[kind]
    if kind == "not":
        return ~S.as_selector(_dec_selector(body, where + ".not", depth + 1))
    if kind == "grad":
        if isinstance(body, dict) and set(body) == {"label"} and isinstance(body["label"], str):
            return tl.grad(body["label"])  # tl.grad('relu_1_2') keeps its plain label (and its digest)
        return tl.grad(_dec_selector(body, where + ".grad", depth + 1))
    raise _malformed(f"{where}: unknown selector {kind!r:.80}")


# values ---------------------------------------------------------------------------------------
class _Writer:
    def __init__(self, codec: Any) -> None:
        self.codec = codec
        self.numpy = NumpyCodec()
        self.tensors: dict[int, tuple[str, Any]] = {}
        self.entries: list[tuple[str, Any]] = []
        self.table: dict[str, dict[str, Any]] = {}

    def value(self, v: Any) -> Any:
        if v is None or type(v) in (bool, int, str):
            return v
        if type(v) is float:
            return v if np.isfinite(v) else {"$float": repr(v)}
        if type(v) is tuple:
            return {"$tuple": [self.value(x) for x in v]}
        if type(v) is list:
            return [self.value(x) for x in v]
        for codec in (self.codec, self.numpy):
            if codec.can_encode(v):
                key = self.tensors.get(id(v))
                if key is None:
                    key = (f"t{len(self.tensors):04d}", codec.name)
                    self.tensors[id(v)] = key
                    enc = codec.encode(v)
                    self.entries.append((key[0], enc))
                    self.table[key[0]] = {"codec": codec.name, "dtype": enc.dtype, "shape": list(enc.shape),
                                          "meta": dict(enc.meta)}
                return {"$tensor": key[0]}
        if isinstance(v, np.generic):
            return self.value(v.item())
        raise InterventionError("intervention_spec_not_portable", f"a {type(v).__name__} argument has no portable form",
                                remedy="pass tensors, numbers or strings to built-in helpers")


class _Reader:
    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = tensors

    def value(self, x: Any, where: str, depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise _malformed(f"{where}: a value nests deeper than {_MAX_DEPTH} levels")
        if x is None or type(x) in (bool, int, float, str):
            return x
        if type(x) is list:
            return [self.value(v, where, depth + 1) for v in x]
        if type(x) is dict and set(x) == {"$tuple"} and isinstance(x["$tuple"], list):
            return tuple(self.value(v, where, depth + 1) for v in x["$tuple"])
        if type(x) is dict and set(x) == {"$float"} and x["$float"] in ("inf", "-inf", "nan"):
            return float(x["$float"])
        if type(x) is dict and set(x) == {"$tensor"} and type(x["$tensor"]) is str and x["$tensor"] in self.tensors:
            return self.tensors[x["$tensor"]]
        raise _malformed(f"{where}: unreadable value")


# helpers: edits <-> records --------------------------------------------------------------------
@dataclass(frozen=True)
class HelperRecord:
    """A saved edit's identity: `name`, `kwargs` (pairs) and `portability`."""

    name: str
    kwargs: tuple[tuple[str, Any], ...]
    portability: str
    qualname: str = ""


@dataclass(frozen=True)
class HookSpec:
    site: Any
    helper: HelperRecord


@dataclass(frozen=True)
class InterventionSpec:
    """A loaded intervention spec: `recipe` (apply with `trace.do(spec)`), `hook_specs`."""

    kind: str
    level: str
    recipe: Any
    hook_specs: tuple[HookSpec, ...]


def _rebuild_edit(name: str, kw: dict[str, Any], where: str, depth: int = 0) -> Any:
    import torchlens as tl
    from torchlens.intervention.subspace import subspace_edit_from_rows, units_edit

    simple = {"zero_ablate": tl.zero_ablate, "scale": tl.scale, "add": tl.add, "clamp": tl.clamp, "add_noise": tl.add_noise,
              "mean_ablate": tl.mean_ablate, "replace_with": tl.replace_with, "steer": tl.steer,
              "project_onto": tl.project_onto, "project_out": tl.project_out, "clip_norm": tl.clip_norm,
              "scramble_elements": tl.intervention.scramble_elements,
              "set_affine_coordinates": tl.intervention.set_affine_coordinates}
    try:
        if name in simple:
            return simple[name](**kw)
        if name == "subspace_ablate":
            return tl.intervention.subspace_ablate(_basis_rows(kw["rows"], where), mode=kw.get("mode", "zero"),
                                                   dim=kw.get("dim", -1), mean=kw.get("mean"), seed=kw.get("seed"))
        if name in ("subspace_edit", "units_edit"):
            if depth >= 2 or not isinstance(kw["verb"], str) or not isinstance(kw["verb_kwargs"], tuple):
                raise _malformed(f"{where}: the inner verb is not a built-in helper with its arguments")
            verb_kw = dict(kw["verb_kwargs"])
            verb = _rebuild_edit(kw["verb"], verb_kw, where + ".verb", depth + 1)
            mask = _stored_mask(kw, where)
            if name == "units_edit":
                return units_edit(mask, verb)
            rows = _basis_rows(kw["rows"], where)
            if not np.all(np.isfinite(rows)):
                raise ArtifactError("subspace_spec_invalid", f"{where}: stored basis rows are malformed",
                                    remedy="save the spec again")
            if hashlib.sha256(np.ascontiguousarray(rows).tobytes()).hexdigest() != kw["rows_sha256"]:
                raise ArtifactError("subspace_spec_basis_tampered", f"{where}: the basis rows changed after saving",
                                    remedy="save the spec again from its source")
            if not np.allclose(rows @ rows.T, np.eye(rows.shape[0]), atol=1e-6):
                raise ArtifactError("subspace_spec_basis_not_orthonormal", f"{where}: stored rows are not orthonormal",
                                    remedy="save the spec again from its source")
            if kw.get("axis", -1) != -1:
                raise ArtifactError("subspace_spec_invalid", f"{where}: stored axis {kw.get('axis')!r:.40} is not the "
                                    "last axis (-1), the only axis a subspace edit binds", remedy="save the spec again")
            prov = {k: kw.get(k) for k in ("basis_sha256", "basis_dtype")}
            if not all(v is None or type(v) is str for v in prov.values()):
                raise ArtifactError("subspace_spec_invalid", f"{where}: stored basis provenance is not text",
                                    remedy="save the spec again")
            return subspace_edit_from_rows(rows, verb, mask=mask, origin=kw.get("origin"),
                                           method=kw.get("method"), orthonormalised=bool(kw.get("orthonormalised")), **prov)
    except TorchLensError:
        raise
    except Exception as exc:  # a helper refusing arguments read from the file: typed, cause chained
        raise _malformed(f"{where}: helper {name!r:.80} arguments do not rebuild it ({type(exc).__name__}: "
                         f"{str(exc)[:200]})") from exc
    if name in _RENAMED:  # removed spellings (spec glossary): say so, never guess the new arguments
        raise ArtifactError("intervention_helper_renamed", f"{where}: helper {name!r} was removed; it is now "
                            f"{_RENAMED[name]}", remedy=f"re-create the edit with {_RENAMED[name]} and save the spec "
                            "again", helper=name, replacement=_RENAMED[name], at=where)
    raise ArtifactError("recipe_record_malformed", f"{where}: unknown helper {name!r:.80}", remedy="save the spec again")


#: removed helper spellings a saved spec may still name -> the helper that replaced each
_RENAMED = {"mean_fill": "mean_ablate", "resample_ablate": "scramble_elements"}


def _stored_mask(kw: dict[str, Any], where: str) -> Any:
    """A saved element mask, checked against its stored sha256 before it is used: a mask that
    is not a boolean array refuses subspace_spec_invalid, one changed after saving (or saved
    without its digest) subspace_spec_mask_tampered."""
    if "mask" not in kw:
        return None
    from torchlens.intervention.subspace import array_sha256

    mask = kw["mask"]
    try:
        arr = np.asarray(mask if isinstance(mask, np.ndarray) else _host_array(mask))
    except Exception:
        arr = None
    if arr is None or arr.dtype != np.bool_ or arr.ndim == 0:
        raise ArtifactError("subspace_spec_invalid", f"{where}: the stored mask is not a boolean array",
                            remedy="save the spec again")
    digest = kw.get("mask_sha256")
    if type(digest) is not str or array_sha256(arr) != digest:
        raise ArtifactError("subspace_spec_mask_tampered", f"{where}: the stored mask does not match its sha256 "
                            f"({'no digest saved' if type(digest) is not str else 'changed after saving'})",
                            remedy="save the spec again from its source", where=where)
    return mask


def _host_array(v: Any) -> np.ndarray:
    from torchlens.intervention.checks import to_numpy

    return to_numpy(v)


def _basis_rows(value: Any, where: str) -> np.ndarray:
    """Saved basis rows as a float64 [k, d] array with k <= d, checked before any product of
    them is formed: more rows than columns cannot be orthonormal, and `rows @ rows.T` of k
    one-wide rows would allocate k*k floats from a file holding k."""
    if isinstance(value, list):
        if not all(isinstance(r, list) for r in value):
            raise ArtifactError("subspace_spec_invalid", f"{where}: stored basis rows are not a [k, d] matrix",
                                remedy="save the spec again")
        width = len(value[0]) if value else 0
        if len(value) > max(width, 1) or not all(len(r) == width for r in value):
            raise ArtifactError("subspace_spec_basis_not_orthonormal" if all(len(r) == width for r in value)
                                else "subspace_spec_invalid", f"{where}: {len(value)} stored rows of width {width} "
                                "cannot be an orthonormal basis", remedy="save the spec again from its source")
    shape = np.shape(value)
    if len(shape) != 2:
        raise ArtifactError("subspace_spec_invalid", f"{where}: stored basis rows are not a [k, d] matrix",
                            remedy="save the spec again")
    if shape[0] > shape[1]:
        raise ArtifactError("subspace_spec_basis_not_orthonormal",
                            f"{where}: {shape[0]} stored rows of width {shape[1]} cannot be orthonormal",
                            remedy="save the spec again from its source")
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ArtifactError("subspace_spec_invalid", f"{where}: stored basis rows are not numbers",
                            remedy="save the spec again") from None


def _placeholder_edit(name: str, qualname: str, rule: int | None = None) -> Any:
    from torchlens.intervention.edits import Edit

    def refuse(v: Any, ctx: Any) -> Any:
        raise not_persisted(rule, qualname or name)

    return Edit(name, (("qualname", qualname),), refuse, portability="placeholder")


def not_persisted(rule: int | None, qualname: str) -> InterventionError:
    """The refusal of a saved rule whose user code (an edit or a predicate) was never saved."""
    return InterventionError("run_intervention_spec_not_persisted", f"saved rule {rule} ({qualname}) is a placeholder "
                             "for user code, which is never saved; it cannot run", remedy="re-create the edit in code, "
                             "clear_edits() the placeholder, and stage the new edit", rule=rule, qualname=qualname)


# save / load -----------------------------------------------------------------------------------
def _rules_of(obj: Any) -> tuple[list[Any], Any]:
    from torchlens.intervention.recipe import Recipe

    if isinstance(obj, Recipe):
        return list(obj.rules), None
    return list(obj.recipe.rules), obj


def encode_rules(rules: list[Any], backend: Any, *, level: str) -> tuple[list[dict[str, Any]], "_Writer"]:
    """The rules as typed JSON records (and their tensors, collected in the returned writer).
    A built-in edit keeps its helper name and arguments; user code (a hook, a `tl.where`
    predicate) is a placeholder holding its position and qualified name, allowed only at
    `level="audit"`: below it, `OpaqueCallableError` (`intervention_spec_not_portable`)."""
    from torchlens.errors import OpaqueCallableError
    from torchlens.intervention.edits import check_tensors_unchanged
    from torchlens.intervention.subspace import lower

    w = _Writer(backend_codec(backend))
    out_rules = []
    for i, rule in enumerate(rules):
        check_tensors_unchanged(rule.edit)
        site, edit, _ = lower(rule.target, rule.edit)
        try:
            target = _enc_selector(site)
        except InterventionError:
            if level != "audit":
                raise OpaqueCallableError(
                    "intervention_spec_not_portable", f"rule {i} targets {site!r}, a predicate that runs user code",
                    remedy="select with label, func, module or in_module selectors, or save at level='audit'",
                    rule=i) from None
            target = {"placeholder": repr(site)[:400]}
        if edit.portability != "builtin":
            if level != "audit":
                raise OpaqueCallableError(
                    "intervention_spec_not_portable",
                    f"rule {i} ({edit.name}) runs user or session code, which a portable spec cannot hold",
                    remedy="use built-in helpers (zero_ablate, steer, replace_with, ...) or save at level='audit'", rule=i)
            qual = dict(edit.kwargs).get("fn", dict(edit.kwargs).get("qualname", edit.name))
            out_rules.append({"target": target, "edit": {"name": edit.name, "portability": "placeholder",
                                                         "qualname": _qualname(qual)}})
            continue
        try:
            kwargs = [[k, w.value(v)] for k, v in edit.kwargs]
        except InterventionError as exc:  # an argument with no portable form (a trace, a module)
            if level != "audit":
                raise OpaqueCallableError("intervention_spec_not_portable", f"rule {i} ({edit.name}): {exc.message}",
                                          remedy=exc.remedy or "save at level='audit'", rule=i) from None
            out_rules.append({"target": target, "edit": {"name": edit.name, "portability": "placeholder",
                                                         "qualname": edit.identity()[:400]}})
            continue
        out_rules.append({"target": target, "edit": {"name": edit.name, "portability": "builtin", "kwargs": kwargs}})
    return out_rules, w


def _qualname(obj: Any) -> str:
    """A callable's `module.qualname` (text only; never used to look anything up)."""
    if isinstance(obj, str):
        return obj[:400]
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__qualname__
    mod = getattr(obj, "__module__", None)
    return (f"{mod}.{name}" if mod else str(name))[:400]


def write_recipe_files(tmp: Path, body: dict[str, Any], w: "_Writer") -> dict[str, dict[str, Any]]:
    """Write `intervention.json` (and `blobs/recipe-0000.safetensors` when the rules hold
    tensors) into the stage `tmp`; return their manifest entries."""
    from torchlens.io import publish

    files: dict[str, dict[str, Any]] = {}
    data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    publish.write_file(tmp / "intervention.json", data, sync=False)
    files["intervention.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    if w.entries:
        name = RECIPE_BLOB
        size, digest = blobfile.write_blob(str(tmp / name), w.entries, {"format": "tlspec-blob", "codec": "mixed"})
        files[name] = {"sha256": digest, "size": size}
    return files


RECIPE_BLOB = "blobs/recipe-0000.safetensors"


def save_intervention(obj: Any, path: Any, *, level: str = "portable", overwrite: bool = False, kind: str | None = None) -> Path:
    """Write a trace's staged recipe (kind "intervention") or a Recipe (kind "recipe")."""
    from torchlens.io import publish
    from torchlens.io.bundle import _as_path, _begin, _check_save_target, _finish, _torchlens_version, write_failed

    if level not in LEVELS:
        raise ArtifactError("artifact_save_level_unsupported", f"level={level!r} is not one of {LEVELS}",
                            remedy="level='portable' or level='audit'", level=repr(level))
    rules, trace = _rules_of(obj)
    kind = kind or ("recipe" if trace is None else "intervention")
    backend = trace._backend if trace is not None else None
    out_rules, w = encode_rules(rules, backend, level=level)
    target = _as_path(path)
    proof = _check_save_target(target, overwrite)
    st = _begin(target)
    tmp = st.path
    try:
        (tmp / "blobs").mkdir()
        files = write_recipe_files(tmp, {"schema": SCHEMA, "rules": out_rules, "tensors": w.table}, w)
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "kind": kind, "level": level,
                    "torchlens_version": _torchlens_version(),
                    "backend": None if backend is None else backend.name, "rules": len(out_rules), "files": files}
        publish.write_file(tmp / "manifest.json", json.dumps(manifest, indent=1).encode(), sync=False)
        publish.fsync_stage(tmp)
        _finish(st, target, proof)
    except BaseException as exc:
        st.discard()
        if isinstance(exc, OSError):
            raise write_failed(target, exc) from exc
        raise
    return target


def _bad_manifest(why: str) -> ArtifactError:
    return ArtifactError("manifest_malformed", f"manifest.json {why}", remedy="the spec's manifest is damaged; save it again",
                         why=why)


def read_intervention_manifest(bundle: Path) -> dict[str, Any]:
    """The checked manifest of a spec directory: read with a size bound, parsed strictly (no
    duplicate keys, bounded nesting), every key and type checked, and every listed file name
    confined to the spec layout (`intervention.json`, `blobs/recipe-0000.safetensors`)."""
    from torchlens.io.manifest import MAX_MANIFEST_BYTES, parse_json, read_bounded

    if bundle.is_symlink():
        raise ArtifactError("load_path_symlink_rejected", f"{bundle} is a symlink", remedy="load the real path", path=str(bundle))
    if not bundle.is_dir():
        raise ArtifactError("artifact_not_found", f"{bundle} is not a directory", remedy="pass a saved spec directory",
                            path=str(bundle))
    mpath = bundle / "manifest.json"
    if mpath.is_symlink():
        raise ArtifactError("load_path_symlink_rejected", f"{mpath} is a symlink", remedy="artifacts hold no symlinks",
                            path=str(mpath))
    if not mpath.is_file():
        raise ArtifactError("manifest_missing", f"{bundle} has no manifest.json", remedy="pass a saved spec directory")
    try:
        data = read_bounded(mpath, MAX_MANIFEST_BYTES)
    except OSError as exc:
        raise ArtifactError("artifact_read_failed", f"could not read {mpath}: {exc}", remedy="check permissions") from None
    if data is None:
        raise _bad_manifest("is larger than any manifest torchlens writes")
    m = parse_json(data, "manifest.json", "manifest_malformed")
    if not isinstance(m, dict) or set(m) != _KEYS or m.get("format") != FORMAT or m.get("kind") not in ("intervention", "recipe"):
        raise _bad_manifest("is not an intervention or recipe manifest")
    if type(m["format_version"]) is not int or m["format_version"] != FORMAT_VERSION:
        raise ArtifactError("manifest_version_unsupported", f"format version {m['format_version']!r:.40}",
                            remedy="load it with the torchlens version that wrote it", found=repr(m["format_version"])[:40])
    if m["level"] not in LEVELS:
        raise ArtifactError("artifact_save_level_unsupported", f"level {m['level']!r:.40} is not a spec level",
                            remedy=f"specs are saved at {LEVELS}", level=repr(m["level"])[:40])
    if type(m["torchlens_version"]) is not str or not (m["backend"] is None or type(m["backend"]) is str):
        raise _bad_manifest("torchlens_version or backend is not a string")
    if type(m["rules"]) is not int or m["rules"] < 0:
        raise _bad_manifest("rules is not a count")
    files = m["files"]
    if not isinstance(files, dict) or "intervention.json" not in files:
        raise _bad_manifest("lists no intervention.json")
    for name, entry in files.items():
        if not _FILE_RE.match(name):
            raise _bad_manifest(f"lists a file outside the spec layout: {name[:80]!r}")
        if not (isinstance(entry, dict) and set(entry) == {"sha256", "size"} and type(entry["sha256"]) is str
                and _SHA_RE.match(entry["sha256"]) and type(entry["size"]) is int and entry["size"] >= 0):
            raise _bad_manifest(f"entry for {name} is malformed")
    return m


def _check_spec_layout(bundle: Path, files: dict[str, Any]) -> None:
    """Exactly the listed files, each a regular file of its listed size (lstat, no reads)."""
    allowed_dirs = {"blobs"}
    for entry in os.scandir(bundle):
        if entry.name == "manifest.json" or entry.name in files:
            continue
        if entry.name in allowed_dirs and entry.is_dir(follow_symlinks=False):
            for sub in os.scandir(entry.path):
                if f"{entry.name}/{sub.name}" not in files:
                    code = "load_path_symlink_rejected" if sub.is_symlink() else "artifact_file_unlisted"
                    raise ArtifactError(code, f"{entry.name}/{sub.name} is not listed in the manifest",
                                        remedy="artifacts hold only the files their manifest lists")
            continue
        code = "load_path_symlink_rejected" if entry.is_symlink() else "artifact_file_unlisted"
        raise ArtifactError(code, f"{entry.name} is not listed in the manifest",
                            remedy="artifacts hold only the files their manifest lists")
    for name, entry in files.items():
        p = bundle / name
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            raise ArtifactError("artifact_file_missing", f"{name} is missing", remedy="save the spec again", file=name) from None
        except OSError as exc:
            raise ArtifactError("artifact_read_failed", f"could not stat {name}: {exc}", remedy="check permissions") from None
        if stat.S_ISLNK(st.st_mode) or (bundle / "blobs").is_symlink():
            raise ArtifactError("load_path_symlink_rejected", f"{name} is a symlink", remedy="artifacts hold no symlinks")
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactError("artifact_file_missing", f"{name} is not a regular file", remedy="save the spec again",
                                file=name)
        if st.st_size != entry["size"]:
            raise ArtifactError("artifact_size_mismatch", f"{name} is {st.st_size} bytes, the manifest says {entry['size']}",
                                remedy="the file was truncated or modified; save the spec again", file=name)


def _read_body(bundle: Path, entry: dict[str, Any]) -> Any:
    from torchlens.io.manifest import parse_json

    if entry["size"] > _MAX_BODY_BYTES:
        raise _bad_manifest("gives intervention.json an implausible size")
    try:
        with open(bundle / "intervention.json", "rb") as f:
            body = f.read(entry["size"] + 1)
    except OSError as exc:
        raise ArtifactError("artifact_read_failed", f"could not read intervention.json: {exc}", remedy="check permissions") from None
    if len(body) != entry["size"] or hashlib.sha256(body).hexdigest() != entry["sha256"]:
        raise ArtifactError("artifact_digest_mismatch", "intervention.json differs from the manifest",
                            remedy="the spec was modified; save it again", file="intervention.json")
    return parse_json(body, "intervention.json", "recipe_record_malformed")


def load_tensors(bundle: Path, files: dict[str, Any], backend_name: str, table: dict[str, Any]) -> dict[str, Any]:
    """The recipe's tensors from `blobs/recipe-0000.safetensors`, checked against the tensor
    table (names, dtypes, shapes against byte spans) and the manifest's size and sha256."""
    blob_name = RECIPE_BLOB
    if not table:
        if blob_name in files:
            raise ArtifactError("artifact_file_unlisted", f"{blob_name} is listed but the spec holds no tensors",
                                remedy="save the spec again", file=blob_name)
        return {}
    if blob_name not in files:
        raise ArtifactError("artifact_file_missing", f"{blob_name} is not listed", remedy="save the spec again")
    for tname, info in table.items():
        if not (isinstance(info, dict) and set(info) == {"codec", "dtype", "shape", "meta"} and type(info["codec"]) is str
                and type(info["dtype"]) is str and isinstance(info["shape"], list)
                and all(type(d) is int and d >= 0 for d in info["shape"]) and isinstance(info["meta"], dict)
                and all(type(v) is str for v in info["meta"].values())):
            raise ArtifactError("recipe_record_malformed", f"tensor table entry {tname[:80]!r} is malformed",
                                remedy="save the spec again")
    b = files[blob_name]
    try:
        blob = blobfile.read_blob(str(bundle / blob_name), blob_name, b["size"], b["sha256"], False)
    except OSError as exc:
        raise ArtifactError("artifact_read_failed", f"could not read {blob_name}: {exc}", remedy="check permissions") from None
    if blob.metadata.get("format") != "tlspec-blob" or blob.metadata.get("codec") != "mixed":
        raise ArtifactError("blob_malformed", f"{blob_name} is not a spec blob", remedy="save the spec again", blob=blob_name)
    if {t for t in blob.entries if not t.startswith(blobfile.PAD_PREFIX)} != set(table):
        raise ArtifactError("record_reference_invalid", "the blob's tensors differ from the tensor table",
                            remedy="save the spec again")
    tensors: dict[str, Any] = {}
    for tname, info in table.items():
        payload = blobfile.payload_from_storage(blob, tname, info["dtype"], tuple(info["shape"]), info["meta"])
        codec = codec_named(info["codec"], backend_name)
        try:
            tensors[tname] = codec.decode(payload)
        except TorchLensError:
            raise
        except Exception as exc:  # the codec's own failure on bytes from the file: typed, cause chained
            raise ArtifactError("blob_malformed", f"the {info['codec'][:40]} codec could not decode tensor {tname[:80]} "
                                f"({type(exc).__name__}: {str(exc)[:200]})", remedy="save the spec again",
                                blob=blob_name) from exc
    return tensors


def load_intervention_spec(path: Any) -> InterventionSpec:
    """Load a saved intervention or recipe spec. The manifest is checked strictly, every file
    is checked against it (size before anything is read, sha256 before anything is decoded),
    and every refusal is a typed `ArtifactError`. Memory stays proportional to the files."""
    from torchlens.io.bundle import _as_path

    bundle = _as_path(path)
    m = read_intervention_manifest(bundle)
    files = m["files"]
    _check_spec_layout(bundle, files)
    doc = _read_body(bundle, files["intervention.json"])
    if not (isinstance(doc, dict) and set(doc) == {"schema", "rules", "tensors"} and doc["schema"] == SCHEMA
            and isinstance(doc["rules"], list) and isinstance(doc["tensors"], dict)):
        raise ArtifactError("recipe_record_malformed", "intervention.json does not hold a rule list and tensor table",
                            remedy="save the spec again")
    if len(doc["rules"]) != m["rules"]:
        raise ArtifactError("manifest_disclosure_mismatch", f"the manifest counts {m['rules']} rules, the spec holds "
                            f"{len(doc['rules'])}", remedy="the spec was modified; save it again")
    reader = _Reader(load_tensors(bundle, files, m["backend"] or "", doc["tensors"]))
    allow = m["kind"] == "intervention" and m["level"] == "audit"
    recipe, hooks = decode_rules(doc["rules"], reader, allow_placeholders=allow)
    return InterventionSpec(m["kind"], m["level"], recipe, hooks)


def decode_rules(doc_rules: list[Any], reader: "_Reader", *, allow_placeholders: bool) -> tuple[Any, tuple[HookSpec, ...]]:
    """Rebuild rules from their records: selectors from the closed selector vocabulary, edits
    from the fixed set of built-in helpers; a placeholder (user code) loads only where
    `allow_placeholders` (else `recipe_audit_only`) and refuses to run
    (`run_intervention_spec_not_persisted`). Nothing in the file is imported or called."""
    from torchlens.intervention.recipe import Recipe, Rule
    from torchlens.select.selectors import PlaceholderSelector

    rules, hooks = [], []
    for i, r in enumerate(doc_rules):
        where = f"rules[{i}]"
        if not isinstance(r, dict) or set(r) != {"target", "edit"} or not isinstance(r["edit"], dict):
            raise ArtifactError("recipe_record_malformed", f"{where} is malformed", remedy="save the spec again")
        t = r["target"]
        placeholder_site = isinstance(t, dict) and set(t) == {"placeholder"}
        if placeholder_site:
            if type(t["placeholder"]) is not str or len(t["placeholder"]) > 400:
                raise ArtifactError("recipe_record_malformed", f"{where}.target is malformed", remedy="save the spec again")
            site = PlaceholderSelector(t["placeholder"], i)
        else:
            site = _dec_selector(t, where + ".target")
        e = r["edit"]
        if e.get("portability") == "placeholder" or placeholder_site:
            if not allow_placeholders:
                raise ArtifactError("recipe_audit_only", f"{where} holds a callable placeholder; only an audit-level "
                                    "intervention spec may", remedy="re-create the edit in code", rule=i)
        if e.get("portability") == "placeholder":
            if not (set(e) == {"name", "portability", "qualname"} and type(e["name"]) is str
                    and type(e["qualname"]) is str and len(e["qualname"]) <= 400 and len(e["name"]) <= 400):
                raise ArtifactError("recipe_record_malformed", f"{where}.edit is malformed", remedy="save the spec again")
            edit = _placeholder_edit(e["name"], e["qualname"], i)
            helper = HelperRecord(edit.name, (), "placeholder", e["qualname"])
        else:
            if not (set(e) == {"name", "portability", "kwargs"} and e["portability"] == "builtin"
                    and type(e["name"]) is str and isinstance(e["kwargs"], list)):
                raise ArtifactError("recipe_record_malformed", f"{where}.edit is malformed", remedy="save the spec again")
            kw = {}
            for pair in e["kwargs"]:
                if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is str and pair[0] not in kw):
                    raise ArtifactError("recipe_record_malformed", f"{where}.edit.kwargs is malformed", remedy="save the spec again")
                kw[pair[0]] = reader.value(pair[1], where)
            edit = _rebuild_edit(e["name"], kw, where)
            helper = HelperRecord(edit.name, edit.kwargs, "builtin")
        rules.append(Rule(site, edit))
        hooks.append(HookSpec(site, helper))
    return Recipe(tuple(rules)), tuple(hooks)


def _malformed(why: str) -> ArtifactError:
    return ArtifactError("recipe_record_malformed", why, remedy="save the spec again")


# the recipe saved with a trace -------------------------------------------------------------------
TRACE_SCHEMA = "tl.trace-intervention/1"
_HISTORY_KEYS = {"audit", "direct_writes", "steered"}
_MAX_HISTORY = 100_000


def trace_recipe_body(trace: Any) -> tuple[dict[str, Any], "_Writer"] | None:
    """What `Trace.save` writes as `intervention.json`: the staged recipe (user code as
    placeholders, so nothing is dropped) and the touch history `is_pristine` reads (the
    intervention audit and the ops written directly). None for a trace nothing touched."""
    st = trace._intervention  # the typed InterventionState, or None
    if st is None or not st.touched:
        return None
    out_rules, w = encode_rules(list(st.recipe.rules), trace._backend, level="audit")
    from torchlens.intervention.verbs import steered_digest

    history = {"audit": _plain(st.audit, "audit"), "direct_writes": list(st.direct_writes),
               "steered": steered_digest(trace) == st.recipe.digest}  # the saved values reflect the recipe
    return {"schema": TRACE_SCHEMA, "rules": out_rules, "tensors": w.table, "history": history}, w


def _plain(value: Any, where: str, depth: int = 0) -> Any:
    """A JSON-plain copy of an audit row (numbers, text, lists, maps with text keys)."""
    if depth > 8:
        raise ArtifactError("recipe_record_malformed", f"{where} nests too deep", remedy="save the trace again")
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        return value if np.isfinite(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v, where, depth + 1) for v in value]
    if isinstance(value, dict) and all(type(k) is str for k in value):
        return {k: _plain(v, where, depth + 1) for k, v in value.items()}
    return repr(value)[:400]


def read_trace_recipe(bundle: Path, files: dict[str, Any], backend_name: str) -> dict[str, Any] | None:
    """The intervention state a saved trace carries (recipe, audit, direct writes), read with
    the spec loader's rules: size and sha256 first, strict JSON, the closed helper and selector
    vocabularies, placeholders that refuse to run. None when the artifact has no recipe."""
    if "intervention.json" not in files:
        if RECIPE_BLOB in files:
            raise ArtifactError("artifact_file_unlisted", f"{RECIPE_BLOB} is listed without intervention.json",
                                remedy="save the trace again", file=RECIPE_BLOB)
        return None
    doc = _read_body(bundle, files["intervention.json"])
    if not (isinstance(doc, dict) and set(doc) == {"schema", "rules", "tensors", "history"} and doc["schema"] == TRACE_SCHEMA
            and isinstance(doc["rules"], list) and isinstance(doc["tensors"], dict) and isinstance(doc["history"], dict)
            and set(doc["history"]) == _HISTORY_KEYS):
        raise _malformed("intervention.json does not hold a trace's rule list, tensor table and history")
    h = doc["history"]
    if not (isinstance(h["audit"], list) and len(h["audit"]) <= _MAX_HISTORY
            and all(isinstance(r, dict) and all(type(k) is str for k in r) for r in h["audit"])
            and isinstance(h["direct_writes"], list) and len(h["direct_writes"]) <= _MAX_HISTORY
            and all(type(x) is str for x in h["direct_writes"]) and type(h["steered"]) is bool):
        raise _malformed("intervention.json's history is malformed")
    reader = _Reader(load_tensors(bundle, files, backend_name, doc["tensors"]))
    recipe, _ = decode_rules(doc["rules"], reader, allow_placeholders=True)
    return {"recipe": recipe, "audit": [dict(r) for r in h["audit"]], "direct_writes": list(h["direct_writes"]),
            "steered": h["steered"]}
