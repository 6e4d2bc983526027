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
#: `__metadata__` key holding the sha256 of the header and the data section (the export has
#: no manifest, so the file carries its own digest; damage refuses on read).
DIGEST_KEY = "tl_content_sha256"
_MAX_DEPTH = 64
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

    from torchlens.io import ownership, publish

    target = _as_path(path)
    if target.is_symlink():
        raise ArtifactError("save_path_symlink_rejected", f"{target} is a symlink", remedy="write to the real path",
                            path=str(target))
    if target.parent.is_dir():
        publish.tidy(target)  # stale `.<name>.tmp-*` files a killed export left
    proof = None
    if os.path.lexists(target):
        if not overwrite:
            raise ArtifactError("bundle_path_exists", f"{target} already exists",
                                remedy="pass overwrite=True or another path", path=str(target))
        proof = ownership.prove_export(target)
    codec = backend_codec(trace._backend) if trace._backend is not None else backend_codec(None)
    prov = trace.provenance
    prov.param_hash_full  # noqa: B018 - computed now while the live values are held, so the export keeps it
    prov.settle_extra()  # extra entries deferred to their first read (torch's grad_fn records)
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
    from torchlens.io.bundle import _begin, write_failed

    st = _begin(target, directory=False)
    try:
        blobfile.write_blob(str(st.path), entries, {SCHEMA: json.dumps(header, separators=(",", ":"), allow_nan=False)},
                            digest_key=DIGEST_KEY)
        publish.fsync_path(st.path)
        with publish.parent_lock(target.parent):
            if proof is None:
                publish.rename_new(st.path, target)
            else:
                ownership.rechecker(target, proof)()
                os.replace(st.path, target)  # one atomic rename replaces a file
            st.published = True
            publish.fsync_path(target.parent, directory=True)
    except FileExistsError as exc:
        st.discard()
        raise ArtifactError("bundle_path_exists", f"{target} appeared while the file was being written",
                            remedy="pass overwrite=True or another path", path=str(target)) from exc
    except BaseException as exc:
        st.discard()
        if isinstance(exc, OSError):
            if st.published:
                raise ArtifactError("artifact_publish_unconfirmed", f"{target} was written, but flushing its directory "
                                    f"failed: {exc}", remedy="check the disk; export again to be sure it is durable",
                                    path=str(target)) from exc
            raise write_failed(target, exc) from exc
        raise
    st.close()
    return target


def _frozen(x: Any) -> Any:
    if isinstance(x, dict):
        return MappingProxyType({k: _frozen(v) for k, v in x.items()})
    if isinstance(x, list):
        return tuple(_frozen(v) for v in x)
    return x


def _invalid(why: str) -> ArtifactError:
    return ArtifactError("safetensors_export_invalid", why, remedy="pass a file written by tl.export.safetensors")


def _depth_ok(x: Any, depth: int = 0) -> bool:
    if depth > _MAX_DEPTH:
        return False
    if isinstance(x, dict):
        return all(_depth_ok(v, depth + 1) for v in x.values())
    if isinstance(x, list):
        return all(_depth_ok(v, depth + 1) for v in x)
    return True


def _str_map(x: Any) -> bool:
    return isinstance(x, dict) and all(type(v) is str for v in x.values())


def _check_header(header: Any) -> None:
    """The header's schema, strictly: every key, every type (a typed refusal otherwise)."""
    keys = {"schema", "format_version", "format_digest", "codec", "accuracy", "trace_fields", "op_fields", "tensors",
            "omitted"}
    if not isinstance(header, dict) or set(header) != keys or header["schema"] != SCHEMA:
        raise _invalid(f"the header is not a {SCHEMA} header")
    if type(header["format_version"]) is not int or header["format_version"] != FORMAT_VERSION:
        raise _invalid(f"the header names format version {header['format_version']!r:.40}, not {FORMAT_VERSION}")
    if header["format_digest"] != SCHEMA_DIGEST:
        raise _invalid("the header's record schema digest is not saved format 3's")
    acc = header["accuracy"]
    acc_keys = {"backend", "backend_version", "framework_version", "verified", "verification_reason"}
    if not (isinstance(acc, dict) and set(acc) == acc_keys and type(acc["backend"]) is str
            and type(acc["verified"]) is bool
            and all(acc[k] is None or type(acc[k]) is str for k in acc_keys - {"backend", "verified"})):
        raise _invalid("the header's accuracy facts are malformed")
    om = header["omitted"]
    if not (type(header["codec"]) is str and isinstance(header["trace_fields"], dict)
            and isinstance(header["op_fields"], dict) and all(isinstance(v, dict) for v in header["op_fields"].values())
            and isinstance(header["tensors"], dict) and isinstance(om, dict) and set(om) == {"trace", "ops"}
            and _str_map(om["trace"]) and isinstance(om["ops"], dict) and all(_str_map(v) for v in om["ops"].values())):
        raise _invalid("the header's field tables are malformed")
    if not _depth_ok(header):
        raise _invalid(f"the header nests deeper than {_MAX_DEPTH} levels")


def read_safetensors(path: Any) -> SafetensorsTrace:
    """Read a file written by `tl.export.safetensors` (tensors decoded by the codec it names).

    The file's content digest is checked before anything in it is decoded; memory used is
    the file size plus the decoded header."""
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
    except OSError as exc:
        raise ArtifactError("artifact_read_failed", f"could not read {p}: {exc}", remedy="check permissions",
                            path=str(p)) from None
    if set(blob.metadata) != {SCHEMA, DIGEST_KEY, "align"}:
        raise _invalid(f"{p.name} carries no {SCHEMA} header and content digest (or carries other metadata)")
    start = 8 + int.from_bytes(bytes(blob.buffer[:8]), "little")
    if blobfile.content_digest(blob, DIGEST_KEY, start) != blob.metadata[DIGEST_KEY]:
        raise ArtifactError("artifact_digest_mismatch", f"{p.name}: content sha256 differs from the one it carries",
                            remedy="the file was modified or damaged; export the trace again", file=p.name)
    try:
        header = parse_json(blob.metadata[SCHEMA].encode("utf-8"), SCHEMA, "safetensors_export_invalid")
    except UnicodeEncodeError:
        raise _invalid("header is not UTF-8") from None
    _check_header(header)
    if set(header["tensors"]) != {t for t in blob.entries if not t.startswith(blobfile.PAD_PREFIX)}:
        raise _invalid("the header's tensor list disagrees with the file's tensors")
    tensors = {}
    codec = None
    for name, info in header["tensors"].items():
        if not (isinstance(info, dict) and set(info) == {"dtype", "shape", "meta"} and isinstance(info["shape"], list)
                and all(type(d) is int and d >= 0 for d in info["shape"]) and _str_map(info["meta"])
                and isinstance(info["dtype"], str)):
            raise _invalid(f"tensor entry {name!r:.80} is malformed")
        if codec is None:
            codec = codec_named(header["codec"], header["accuracy"]["backend"])
        try:
            payload = blobfile.payload_from_storage(blob, name, info["dtype"], tuple(info["shape"]), info["meta"])
            tensors[name] = codec.decode(payload)
        except TorchLensError as exc:
            raise _invalid(f"tensor {name!r:.80}: {exc}") from exc
        except Exception as exc:  # a codec's own failure on bytes it was handed: a damaged file, typed
            raise _invalid(f"tensor {name!r:.80}: the {header['codec']} codec could not decode it "
                           f"({type(exc).__name__}: {exc})") from exc
    return SafetensorsTrace(header=_frozen(header), trace_fields=_frozen(header["trace_fields"]),
                            op_fields=_frozen(header["op_fields"]), tensors=MappingProxyType(tensors),
                            omitted=_frozen(header["omitted"]))
