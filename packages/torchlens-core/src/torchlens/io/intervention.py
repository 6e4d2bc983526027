"""Portable intervention specs: `.tlspec` directories of kind "intervention" or "recipe".

Layout: `manifest.json` (kind, level, versions, sha256 and size of every file),
`intervention.json` (each rule's selector and built-in edit identity as typed JSON; a user
callable is a placeholder, never pickled) and `blobs/recipe-NNNN.safetensors` (the recipe's
tensors, one entry per tensor object). Loading checks every digest before decoding.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchlens.errors import ArtifactError, InterventionError
from torchlens.io import blobfile
from torchlens.io.codec import NumpyCodec, backend_codec, codec_named

FORMAT, FORMAT_VERSION = "tlspec", 3
SCHEMA = "tl.intervention/1"
LEVELS = ("portable", "audit")
_KEYS = {"format", "format_version", "kind", "level", "torchlens_version", "backend", "files", "rules"}


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


def _dec_selector(obj: Any, where: str) -> Any:
    import torchlens as tl
    from torchlens.select import selectors as S

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
        a, b = (_dec_selector(x, where + "." + kind) for x in body)
        a, b = (S.as_selector(a), S.as_selector(b))
        return {"and": a & b, "or": a | b, "sub": a - b}[kind]
    if kind == "not":
        return ~S.as_selector(_dec_selector(body, where + ".not"))
    if kind == "grad":
        return tl.grad(_dec_selector(body, where + ".grad"))
    raise _malformed(f"{where}: unknown selector {kind!r}")


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

    def value(self, x: Any, where: str) -> Any:
        if x is None or type(x) in (bool, int, float, str):
            return x
        if type(x) is list:
            return [self.value(v, where) for v in x]
        if type(x) is dict and set(x) == {"$tuple"} and isinstance(x["$tuple"], list):
            return tuple(self.value(v, where) for v in x["$tuple"])
        if type(x) is dict and set(x) == {"$float"} and x["$float"] in ("inf", "-inf", "nan"):
            return float(x["$float"])
        if type(x) is dict and set(x) == {"$tensor"} and x["$tensor"] in self.tensors:
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


def _rebuild_edit(name: str, kw: dict[str, Any], where: str) -> Any:
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
            return tl.intervention.subspace_ablate(np.asarray(kw["rows"], dtype=np.float64))
        if name in ("subspace_edit", "units_edit"):
            verb = _rebuild_edit(kw["verb"], dict(kw["verb_kwargs"]), where + ".verb")
            if name == "units_edit":
                return units_edit(kw["mask"], verb)
            rows = np.asarray(kw["rows"], dtype=np.float64)
            if rows.ndim != 2 or not np.all(np.isfinite(rows)):
                raise ArtifactError("subspace_spec_invalid", f"{where}: stored basis rows are malformed",
                                    remedy="save the spec again")
            if hashlib.sha256(np.ascontiguousarray(rows).tobytes()).hexdigest() != kw["rows_sha256"]:
                raise ArtifactError("subspace_spec_basis_tampered", f"{where}: the basis rows changed after saving",
                                    remedy="save the spec again from its source")
            if not np.allclose(rows @ rows.T, np.eye(rows.shape[0]), atol=1e-6):
                raise ArtifactError("subspace_spec_basis_not_orthonormal", f"{where}: stored rows are not orthonormal",
                                    remedy="save the spec again from its source")
            return subspace_edit_from_rows(rows, verb, mask=kw.get("mask"), origin=kw.get("origin"),
                                               method=kw.get("method"), orthonormalised=bool(kw.get("orthonormalised")))
    except ArtifactError:
        raise
    except (TypeError, KeyError, ValueError) as exc:
        raise _malformed(f"{where}: helper {name!r} arguments do not rebuild it ({exc})") from exc
    raise ArtifactError("recipe_record_malformed", f"{where}: unknown helper {name!r}", remedy="save the spec again")


def _placeholder_edit(name: str, qualname: str) -> Any:
    from torchlens.intervention.edits import Edit

    def refuse(v: Any, ctx: Any) -> Any:
        raise InterventionError("run_intervention_spec_not_persisted", f"the saved rule's edit {qualname or name} is a "
                                "placeholder (user code is never saved)", remedy="re-create the edit in code and stage it")

    return Edit(name, (("qualname", qualname),), refuse, portability="placeholder")


# save / load -----------------------------------------------------------------------------------
def _rules_of(obj: Any) -> tuple[list[Any], Any]:
    from torchlens.intervention.recipe import Recipe

    if isinstance(obj, Recipe):
        return list(obj.rules), None
    return list(obj.recipe.rules), obj


def save_intervention(obj: Any, path: Any, *, level: str = "portable", overwrite: bool = False, kind: str | None = None) -> Path:
    """Write a trace's staged recipe (kind "intervention") or a Recipe (kind "recipe")."""
    from torchlens.intervention.subspace import lower
    from torchlens.io.bundle import _as_path, _check_save_target, _publish, _torchlens_version

    if level not in LEVELS:
        raise ArtifactError("artifact_save_level_unsupported", f"level={level!r} is not one of {LEVELS}",
                            remedy="level='portable' or level='audit'", level=repr(level))
    rules, trace = _rules_of(obj)
    kind = kind or ("recipe" if trace is None else "intervention")
    backend = trace._backend if trace is not None else None
    w = _Writer(backend_codec(backend))
    out_rules = []
    for i, rule in enumerate(rules):
        from torchlens.intervention.edits import check_tensors_unchanged

        check_tensors_unchanged(rule.edit)
        site, edit, _ = lower(rule.target, rule.edit)
        if edit.portability != "builtin":
            if level == "portable":
                raise InterventionError("intervention_spec_not_portable",
                                        f"rule {i} ({edit.name}) runs user or session code, which a portable spec cannot hold",
                                        remedy="use built-in helpers (zero_ablate, steer, replace_with, ...) or save at level='audit'")
            qual = dict(edit.kwargs).get("fn", edit.name)
            out_rules.append({"target": _enc_selector(site), "edit": {"name": edit.name, "portability": "placeholder",
                                                                      "qualname": str(qual)}})
            continue
        kwargs = [[k, w.value(v)] for k, v in edit.kwargs]
        out_rules.append({"target": _enc_selector(site), "edit": {"name": edit.name, "portability": "builtin",
                                                                  "kwargs": kwargs}})
    target = _as_path(path)
    _check_save_target(target, overwrite)
    tmp = target.parent / f".{target.name}.tmp-{secrets.token_hex(6)}"
    try:
        (tmp / "blobs").mkdir(parents=True)
        files: dict[str, dict[str, Any]] = {}
        body = json.dumps({"schema": SCHEMA, "rules": out_rules, "tensors": w.table}, separators=(",", ":"),
                          allow_nan=False).encode()
        (tmp / "intervention.json").write_bytes(body)
        files["intervention.json"] = {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}
        if w.entries:
            name = "blobs/recipe-0000.safetensors"
            size, digest = blobfile.write_blob(str(tmp / name), w.entries, {"format": "tlspec-blob", "codec": "mixed"})
            files[name] = {"sha256": digest, "size": size}
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "kind": kind, "level": level,
                    "torchlens_version": _torchlens_version(),
                    "backend": None if backend is None else backend.name, "rules": len(out_rules), "files": files}
        (tmp / "manifest.json").write_bytes(json.dumps(manifest, indent=1).encode())
        _publish(tmp, target, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def read_intervention_manifest(bundle: Path) -> dict[str, Any]:
    if bundle.is_symlink():
        raise ArtifactError("load_path_symlink_rejected", f"{bundle} is a symlink", remedy="load the real path", path=str(bundle))
    mpath = bundle / "manifest.json"
    if not mpath.is_file() or mpath.is_symlink():
        raise ArtifactError("manifest_missing", f"{bundle} has no manifest.json", remedy="pass a saved spec directory")
    try:
        m = json.loads(mpath.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ArtifactError("manifest_malformed", f"manifest.json is not JSON ({exc})", remedy="save the spec again") from None
    if not isinstance(m, dict) or set(m) != _KEYS or m.get("format") != FORMAT or m.get("kind") not in ("intervention", "recipe"):
        raise ArtifactError("manifest_malformed", "manifest.json is not an intervention or recipe manifest",
                            remedy="save the spec again")
    if m["format_version"] != FORMAT_VERSION:
        raise ArtifactError("manifest_version_unsupported", f"format version {m['format_version']!r}", remedy="save it again")
    return m


def load_intervention_spec(path: Any) -> InterventionSpec:
    """Load a saved intervention or recipe spec after checking every file's digest."""
    from torchlens.intervention.recipe import Recipe, Rule
    from torchlens.io.bundle import _as_path

    bundle = _as_path(path)
    m = read_intervention_manifest(bundle)
    files = m["files"]
    if not isinstance(files, dict) or "intervention.json" not in files:
        raise ArtifactError("manifest_malformed", "the manifest lists no intervention.json", remedy="save the spec again")
    present = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file() or p.is_symlink()}
    extra = present - set(files) - {"manifest.json"}
    if extra:
        raise ArtifactError("artifact_file_unlisted", f"{sorted(extra)[0]} is not listed in the manifest",
                            remedy="artifacts hold only the files their manifest lists")
    for name, entry in files.items():
        p = bundle / name
        if p.is_symlink():
            raise ArtifactError("load_path_symlink_rejected", f"{name} is a symlink", remedy="artifacts hold no symlinks")
        if not p.is_file():
            raise ArtifactError("artifact_file_missing", f"{name} is missing", remedy="save the spec again", file=name)
    body = (bundle / "intervention.json").read_bytes()
    entry = files["intervention.json"]
    if len(body) != entry.get("size") or hashlib.sha256(body).hexdigest() != entry.get("sha256"):
        raise ArtifactError("artifact_digest_mismatch", "intervention.json differs from the manifest",
                            remedy="the spec was modified; save it again", file="intervention.json")
    try:
        doc = json.loads(body)
    except ValueError:
        raise ArtifactError("recipe_record_malformed", "intervention.json is not JSON", remedy="save the spec again") from None
    if not (isinstance(doc, dict) and set(doc) == {"schema", "rules", "tensors"} and doc["schema"] == SCHEMA
            and isinstance(doc["rules"], list) and isinstance(doc["tensors"], dict)):
        raise ArtifactError("recipe_record_malformed", "intervention.json does not hold a rule list and tensor table",
                            remedy="save the spec again")
    tensors: dict[str, Any] = {}
    blob_name = "blobs/recipe-0000.safetensors"
    if doc["tensors"]:
        if blob_name not in files:
            raise ArtifactError("artifact_file_missing", f"{blob_name} is not listed", remedy="save the spec again")
        b = files[blob_name]
        blob = blobfile.read_blob(str(bundle / blob_name), blob_name, b["size"], b["sha256"], False)
        if {t for t in blob.entries if not t.startswith(blobfile.PAD_PREFIX)} != set(doc["tensors"]):
            raise ArtifactError("record_reference_invalid", "the blob's tensors differ from the tensor table",
                                remedy="save the spec again")
        for tname, info in doc["tensors"].items():
            if not (isinstance(info, dict) and set(info) == {"codec", "dtype", "shape", "meta"}
                    and isinstance(info["shape"], list) and all(type(d) is int and d >= 0 for d in info["shape"])):
                raise ArtifactError("recipe_record_malformed", f"tensor table entry {tname} is malformed",
                                    remedy="save the spec again")
            payload = blobfile.payload_from_storage(blob, tname, info["dtype"], tuple(info["shape"]), info["meta"])
            tensors[tname] = codec_named(info["codec"], m["backend"] or "").decode(payload)
    reader = _Reader(tensors)
    rules, hooks = [], []
    for i, r in enumerate(doc["rules"]):
        where = f"rules[{i}]"
        if not isinstance(r, dict) or set(r) != {"target", "edit"} or not isinstance(r["edit"], dict):
            raise ArtifactError("recipe_record_malformed", f"{where} is malformed", remedy="save the spec again")
        site = _dec_selector(r["target"], where + ".target")
        e = r["edit"]
        if e.get("portability") == "placeholder":
            if m["kind"] == "recipe":
                raise ArtifactError("recipe_audit_only", f"{where} holds a callable placeholder; this recipe is audit-only",
                                    remedy="re-create the edit in code")
            edit = _placeholder_edit(str(e.get("name")), str(e.get("qualname", "")))
            helper = HelperRecord(edit.name, (), "placeholder", str(e.get("qualname", "")))
        else:
            if not (isinstance(e.get("name"), str) and isinstance(e.get("kwargs"), list)):
                raise ArtifactError("recipe_record_malformed", f"{where}.edit is malformed", remedy="save the spec again")
            kw = {}
            for pair in e["kwargs"]:
                if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
                    raise ArtifactError("recipe_record_malformed", f"{where}.edit.kwargs is malformed", remedy="save the spec again")
                kw[pair[0]] = reader.value(pair[1], where)
            edit = _rebuild_edit(e["name"], kw, where)
            helper = HelperRecord(edit.name, edit.kwargs, "builtin")
        rules.append(Rule(site, edit))
        hooks.append(HookSpec(site, helper))
    return InterventionSpec(m["kind"], m["level"], Recipe(tuple(rules)), tuple(hooks))


def _malformed(why: str) -> ArtifactError:
    return ArtifactError("recipe_record_malformed", why, remedy="save the spec again")
