"""One-file safetensors export of a Trace (header schema `tl_trace_safetensors_v1`).

`tl.export.safetensors(trace, path)` writes every tensor-valued op payload as a tensor
(`ops/<label>/out/<slot>`, `ops/<label>/grad/<slot>`) and puts, in the safetensors
`__metadata__`, a JSON header with the saved-format version and digest, the capture's
accuracy facts and, for the trace and every op, each field with an exact JSON encoding;
fields without one are listed under `omitted` with their value types.
`tl.io.read_safetensors(path)` reads it back as a read-only `SafetensorsTrace`.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from torchlens.errors import ArtifactError, TorchLensError
from torchlens.io import blobfile
from torchlens.io.codec import backend_codec, codec_named
from torchlens.io.manifest import FORMAT_VERSION, parse_json
from torchlens.io.schema import SCHEMA_DIGEST, SCHEMAS, Encoder, site_key

SCHEMA = "tl_trace_safetensors_v1"
_OPAQUE = ("$unencodable", "$callable", "$payload")
_TENSOR_COLUMNS = ("outputs", "grads")


@dataclass(frozen=True)
class SafetensorsTrace:
    """What `tl.io.read_safetensors` returns; every mapping is read-only."""

    header: Mapping[str, Any]
    trace_fields: Mapping[str, Any]
    op_fields: Mapping[str, Mapping[str, Any]]
    tensors: Mapping[str, Any]
    omitted: Mapping[str, Any]


def _opaque(cell: Any) -> bool:
    if isinstance(cell, dict):
        return any(k in _OPAQUE for k in cell) or any(_opaque(v) for v in cell.values())
    if isinstance(cell, list):
        return any(_opaque(v) for v in cell)
    return False


def write_safetensors(trace: Any, path: Any, overwrite: bool = False) -> Path:
    from torchlens.io.bundle import _as_path

    target = _as_path(path)
    if target.is_symlink():
        raise ArtifactError("save_path_symlink_rejected", f"{target} is a symlink", remedy="write to the real path",
                            path=str(target))
    if os.path.lexists(target) and not overwrite:
        raise ArtifactError("bundle_path_exists", f"{target} already exists", remedy="pass overwrite=True or another path",
                            path=str(target))
    if os.path.lexists(target) and not target.is_file():
        raise ArtifactError("bundle_path_not_artifact", f"{target} is not a file; refusing to replace it",
                            remedy="choose another path", path=str(target))
    codec = backend_codec(trace._backend) if trace._backend is not None else backend_codec(None)
    prov = trace.provenance
    header: dict[str, Any] = {
        "schema": SCHEMA, "format_version": FORMAT_VERSION, "format_digest": SCHEMA_DIGEST, "codec": codec.name,
        "accuracy": {"backend": prov.backend, "backend_version": prov.backend_version,
                     "framework_version": prov.framework_version, "verified": prov.verified,
                     "verification_reason": prov.verification_reason},
        "trace_fields": {}, "op_fields": {}, "tensors": {}, "omitted": {"trace": {}, "ops": {}},
    }
    enc = Encoder(codec)
    trace_values = {"name": ("str", trace.name), "uncalled_modules": ("str_list", trace.uncalled_modules),
                    "annotations": ("value", trace.annotations), "options": ("value", trace.options)}
    for kind, obj in (("provenance", prov), ("cost", trace.cost)):
        for col, ctype in SCHEMAS[kind]:
            trace_values[f"{kind}.{col}"] = (ctype, getattr(obj, col))
    for name, (ctype, value) in trace_values.items():
        cell = enc.cell(ctype, value, f"trace.{name}")
        if _opaque(cell):
            header["omitted"]["trace"][name] = type(value).__name__
        else:
            header["trace_fields"][name] = cell
    entries = []
    for op in trace._ops.values():
        fields: dict[str, Any] = {}
        omitted: dict[str, str] = {}
        for col, ctype in SCHEMAS["ops"]:
            value = getattr(op, "_outputs" if col == "outputs" else col, None)
            if col in _TENSOR_COLUMNS:
                for i, v in enumerate(value or ()):
                    if v is None:
                        continue
                    if codec.can_encode(v):
                        name = f"ops/{op.label}/{'out' if col == 'outputs' else 'grad'}/{i}"
                        p = codec.encode(v)
                        blobfile.check_encoded(p, name)
                        entries.append((name, p))
                        header["tensors"][name] = {"dtype": p.dtype, "shape": list(p.shape), "meta": p.meta}
                    else:
                        omitted[f"{col}[{i}]"] = type(v).__name__
                continue
            if col == "site":
                value = site_key(value)
            cell = enc.cell(ctype, value, f"ops.{op.label}.{col}")
            if _opaque(cell):
                omitted[col] = type(value).__name__
            else:
                fields[col] = cell
        header["op_fields"][op.label] = fields
        if omitted:
            header["omitted"]["ops"][op.label] = omitted
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{secrets.token_hex(6)}"
    try:
        blobfile.write_blob(str(tmp), entries, {SCHEMA: json.dumps(header, separators=(",", ":"), allow_nan=False)})
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ArtifactError("artifact_write_failed", f"could not write {target}: {exc}", remedy="check the directory",
                            path=str(target)) from exc
    return target


def _frozen(x: Any) -> Any:
    if isinstance(x, dict):
        return MappingProxyType({k: _frozen(v) for k, v in x.items()})
    if isinstance(x, list):
        return tuple(_frozen(v) for v in x)
    return x


def _invalid(why: str) -> ArtifactError:
    return ArtifactError("safetensors_export_invalid", why, remedy="pass a file written by tl.export.safetensors")


def read_safetensors(path: Any) -> SafetensorsTrace:
    """Read a file written by `tl.export.safetensors` (tensors decoded by the codec it names)."""
    p = Path(os.fspath(path))
    if p.is_symlink():
        raise ArtifactError("load_path_symlink_rejected", f"{p} is a symlink", remedy="read the real path", path=str(p))
    if not p.is_file():
        raise ArtifactError("artifact_not_found", f"{p} is not a file", remedy="pass the exported .safetensors file",
                            path=str(p))
    try:
        blob = blobfile.read_blob(str(p), p.name, blobfile.fsize(str(p)), None, lazy=False)
    except ArtifactError as exc:
        raise _invalid(f"{p.name}: {exc.message}") from exc
    if SCHEMA not in blob.metadata:
        raise _invalid(f"{p.name} carries no {SCHEMA} header")
    try:
        header = parse_json(blob.metadata[SCHEMA].encode("utf-8"), SCHEMA, "safetensors_export_invalid")
    except UnicodeEncodeError:
        raise _invalid("header is not UTF-8") from None
    keys = {"schema", "format_version", "format_digest", "codec", "accuracy", "trace_fields", "op_fields", "tensors", "omitted"}
    if not isinstance(header, dict) or set(header) != keys or header["schema"] != SCHEMA:
        raise _invalid(f"the header is not a {SCHEMA} header")
    if not isinstance(header["tensors"], dict) or set(header["tensors"]) != {t for t in blob.entries if not t.startswith(blobfile.PAD_PREFIX)}:
        raise _invalid("the header's tensor list disagrees with the file's tensors")
    tensors = {}
    codec = None
    for name, info in header["tensors"].items():
        if not (isinstance(info, dict) and set(info) == {"dtype", "shape", "meta"} and isinstance(info["shape"], list)
                and all(type(d) is int and d >= 0 for d in info["shape"]) and isinstance(info["meta"], dict)
                and all(isinstance(v, str) for v in info["meta"].values()) and isinstance(info["dtype"], str)):
            raise _invalid(f"tensor entry {name!r} is malformed")
        if codec is None:
            codec = codec_named(str(header["codec"]), str(header["accuracy"].get("backend")))
        try:
            payload = blobfile.payload_from_storage(blob, name, info["dtype"], tuple(info["shape"]), info["meta"])
            tensors[name] = codec.decode(payload)
        except TorchLensError as exc:
            raise _invalid(f"tensor {name!r}: {exc}") from exc
    return SafetensorsTrace(header=_frozen(header), trace_fields=_frozen(header["trace_fields"]),
                            op_fields=_frozen(header["op_fields"]), tensors=MappingProxyType(tensors),
                            omitted=_frozen(header["omitted"]))
