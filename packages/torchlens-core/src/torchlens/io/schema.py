"""The typed record schemas of saved format 3 and the cell codec.

Every record kind is a table: a fixed list of (column, type) pairs and rows of cells.
Column types are a small closed vocabulary (strings, ints, floats, bools, shapes, label
lists, ...). Free-form fields (op meta, argument templates, annotations) use the `value`
type: tagged JSON for None/bool/int/float/str/list/tuple/dict and a few known objects; a
payload the codec can encode becomes a `{"$payload": key}` reference into the blobs; any
other object is written as text and loads as `tl.types.UnencodableValue`. A callable is
written as its name only (`{"$callable": name}`, the backend's table name when it has one)
and always loads as a `tl.types.CallablePlaceholder`; only the backend's closed callable
table turns an op's name back into code (see `io/rebuild.py`, `io/opaque.py`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import fields as dc_fields
from typing import Any, Callable

import numpy as np

from torchlens.build.events import ArgRef
from torchlens.errors import ArtifactError
from torchlens.io.codec import EncodedPayload, PayloadCodec
from torchlens.types import CallablePlaceholder, Quantity, UnencodableValue

SCHEMAS: dict[str, list[tuple[str, str]]] = {
    "trace": [("name", "str"), ("uncalled_modules", "str_list"), ("options", "value"), ("annotations", "value"),
              ("backward_passes", "int")],
    "provenance": [
        ("backend", "str"), ("backend_version", "str?"), ("framework_version", "str?"), ("kind", "str"),
        ("model_class", "str"), ("start_time", "float"), ("end_time", "float"), ("duration", "float"),
        ("root_entry_point", "str"), ("verified", "bool"), ("verification_reason", "str?"), ("extra", "value")],
    "cost": [
        ("total_flops", "int"), ("total_macs", "int"), ("macs_by_kind", "value"), ("forward_duration", "float"),
        ("total_activation_memory", "int"), ("total_param_memory", "int"), ("num_ops_with_flops", "int"),
        ("backward_durations", "value")],
    "ops": [
        ("label", "str"), ("layer_label", "str"), ("func_name", "str"), ("kind", "str"), ("index", "int"),
        ("pass_number", "int"), ("num_passes", "int"), ("parents", "str_tuple"), ("parent_slots", "slots"),
        ("children", "str_list"), ("module", "str?"), ("modules", "str_tuple"), ("module_calls", "str_tuple"),
        ("params", "str_tuple"), ("shapes", "shapes"), ("dtypes", "dtypes"), ("multi_output", "bool"),
        ("path", "str?"), ("saved", "bool"), ("outputs", "values"), ("grads", "values?"), ("meta", "value"),
        ("func", "callable"), ("args_template", "value"), ("kwargs_template", "value"), ("is_inplace", "bool"),
        ("event_id", "int"), ("type_num", "int"), ("step_num", "int"), ("site", "str?")],
    "layers": [
        ("label", "str"), ("func_name", "str"), ("kind", "str"), ("module", "str?"), ("modules", "str_tuple"),
        ("ops", "str_list"), ("type_num", "int"), ("step_num", "int")],
    "modules": [
        ("address", "str"), ("class_name", "str"), ("class_qualname", "str"), ("parent", "str?"),
        ("children", "str_list"), ("calls", "str_list"), ("param_addresses", "str_list"),
        ("buffer_addresses", "str_list"), ("all_addresses", "str_tuple"), ("training", "bool")],
    "module_calls": [
        ("label", "str"), ("address", "str"), ("call", "int"), ("op_labels", "str_list"), ("input_labels", "str_list"),
        ("output_labels", "str_list")],
    "params": [
        ("address", "str"), ("module", "str"), ("name", "str"), ("shape", "shape"), ("dtype", "str"),
        ("trainable", "bool"), ("value", "value"), ("device", "str"), ("consumer_labels", "str_list"),
        ("aliases", "str_tuple")],
    "buffers": [
        ("address", "str"), ("module", "str"), ("name", "str"), ("shape", "shape"), ("dtype", "str"), ("value", "value"),
        ("persistent", "bool"), ("device", "str"), ("op_labels", "str_list")],
    "payloads": [
        ("key", "str"), ("blob", "str"), ("tensor", "str"), ("dtype", "str"), ("shape", "shape"), ("meta", "str_map")],
}
RECORD_KINDS: tuple[str, ...] = tuple(SCHEMAS)
#: Digest of the schemas: two artifacts with the same digest share every column and type.
SCHEMA_DIGEST = hashlib.sha256(json.dumps(SCHEMAS, sort_keys=True).encode()).hexdigest()
MAX_DEPTH = 64
#: numpy scalar dtype names a `$np` cell may name (the encoder writes only these kinds);
#: np.dtype parses much more (records, sub-arrays), so the name is checked before numpy sees it.
_NP_SCALARS = frozenset(np.dtype(t).name for t in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64",
    "longdouble"))
_MARKERS = {"$tuple", "$dict", "$float", "$argref", "$payload", "$np", "$slice", "$ellipsis", "$complex", "$bytes",
            "$capture_options", "$trace_options", "$unencodable", "$callable", "$literal"}


def _invalid(where: str, why: str) -> ArtifactError:
    return ArtifactError("record_schema_invalid", f"{where}: {why}", remedy="the records are damaged; save the trace again",
                         at=where)


class Encoder:
    """Writes cells. Collects payloads (deduplicated by identity, so aliasing survives) and
    counts the values written as text."""

    def __init__(self, codec: PayloadCodec) -> None:
        self.codec = codec
        self.payloads: dict[str, EncodedPayload] = {}
        self._key_of: dict[int, str] = {}
        self._alive: list[Any] = []
        self.unencodable: dict[str, int] = {}
        self.callables = 0

    # typed columns -----------------------------------------------------------------------
    def cell(self, ctype: str, value: Any, where: str) -> Any:
        if ctype == "value":
            return self.value(value, where, 0)
        if ctype == "values":
            return [self.value(v, f"{where}[{i}]", 1) for i, v in enumerate(_seq(value, where))]
        if ctype == "values?":
            return None if value is None else self.cell("values", value, where)
        if ctype == "callable":
            if value is None:
                return None
            self.callables += 1
            return {"$callable": self.callable_name(value)}
        try:
            return _typed_out(ctype, value)
        except (TypeError, ValueError):
            raise ArtifactError("record_field_unencodable", f"{where}: {type(value).__name__} value does not fit column type {ctype}",
                                remedy="the backend must fill this field with its declared type", at=where) from None

    # free-form values --------------------------------------------------------------------
    def value(self, v: Any, where: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            return self._unencodable(v)
        if v is None or isinstance(v, (bool, str)) and type(v) in (bool, str):
            return v
        t = type(v)
        if isinstance(v, Quantity):  # a tl.types quantity (Bytes, Duration, ...) saves as its plain number
            v = int(v) if isinstance(v, int) else float(v)
            t = type(v)
        if t is int:
            return v
        if t is float:
            return v if math.isfinite(v) else {"$float": repr(v)}
        if isinstance(v, UnencodableValue):  # re-saving a loaded trace keeps the stand-in as it was
            self.unencodable[v.type_name] = self.unencodable.get(v.type_name, 0) + 1
            return {"$unencodable": [v.type_name, v.repr_text]}
        if isinstance(v, CallablePlaceholder):
            self.callables += 1
            return {"$callable": v.qualname}
        if self.codec.can_encode(v):
            return {"$payload": self._payload(v, where)}
        if t is list:
            return [self.value(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
        if t is tuple:
            return {"$tuple": [self.value(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]}
        if t is dict:
            return {"$dict": [[self.value(k, where, depth + 1), self.value(x, f"{where}[{k!r}]", depth + 1)] for k, x in v.items()]}
        if t is ArgRef:
            return {"$argref": [v.index, v.address]}
        if isinstance(v, np.generic) and v.dtype.kind in "biuf":
            return {"$np": [v.dtype.name, self.value(v.item(), where, depth + 1)]}
        if t is slice:
            return {"$slice": [self.value(x, where, depth + 1) for x in (v.start, v.stop, v.step)]}
        if v is Ellipsis:
            return {"$ellipsis": True}
        if t is complex:
            return {"$complex": [self.value(v.real, where, depth + 1), self.value(v.imag, where, depth + 1)]}
        if t is bytes:
            return {"$bytes": v.hex()}
        from torchlens.options import CaptureOptions, TraceOptions

        if t is CaptureOptions or t is TraceOptions:
            tag = "$capture_options" if t is CaptureOptions else "$trace_options"
            return {tag: {f.name: self.value(getattr(v, f.name), where, depth + 1) for f in dc_fields(v)}}
        lit = getattr(self.codec, "encode_literal", None)
        if lit is not None:
            found = lit(v)  # a framework literal (a dtype, a shape type): (kind, plain value)
            if found is not None:
                return {"$literal": [found[0], self.value(found[1], where, depth + 1)]}
        if callable(v) and hasattr(v, "__qualname__"):
            self.callables += 1
            return {"$callable": self.callable_name(v)}
        return self._unencodable(v)

    def callable_name(self, fn: Any) -> str:
        """The name a callable is saved under. A backend whose codec names callables
        (`codec.callable_name(fn)`) gives the name its closed callable table resolves on load;
        any other callable is written as `module.qualname` and loads as an opaque placeholder.
        Only the name is written, never code."""
        if isinstance(fn, CallablePlaceholder):
            return fn.qualname
        namer = getattr(self.codec, "callable_name", None)
        name = namer(fn) if namer is not None else None
        return name if isinstance(name, str) else CallablePlaceholder.describe(fn)

    def _unencodable(self, v: Any) -> Any:
        type_name, text = UnencodableValue.describe(v)
        self.unencodable[type_name] = self.unencodable.get(type_name, 0) + 1
        return {"$unencodable": [type_name, text]}

    def _payload(self, v: Any, where: str) -> str:
        key = self._key_of.get(id(v))
        if key is None:
            from torchlens.io.blobfile import check_encoded

            try:
                enc = self.codec.encode(v)
            except Exception as exc:
                raise ArtifactError("record_field_unencodable", f"{where}: the {self.codec.name} codec could not encode "
                                    f"{type(v).__name__} ({type(exc).__name__}: {exc})",
                                    remedy="fix the backend's payload codec", at=where) from exc
            check_encoded(enc, where)
            key = f"p{len(self.payloads)}"
            self.payloads[key] = enc
            self._key_of[id(v)] = key
            self._alive.append(v)
        return key


def _seq(value: Any, where: str) -> tuple:
    if not isinstance(value, (tuple, list)):
        raise ArtifactError("record_field_unencodable", f"{where}: expected a sequence, got {type(value).__name__}",
                            remedy="the backend must fill this field with its declared type", at=where)
    return tuple(value)


def _int(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError
    return int(x)


def _opt(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda x: None if x is None else fn(x)


def _str(x: Any) -> str:
    if not isinstance(x, str):
        raise TypeError
    return str(x)


def _typed_out(ctype: str, v: Any) -> Any:
    if ctype == "str":
        return _str(v)
    if ctype == "str?":
        return _opt(_str)(v)
    if ctype == "int":
        return _int(v)
    if ctype == "int?":
        return _opt(_int)(v)
    if ctype == "float":
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
            raise TypeError
        f = float(v)
        return f if math.isfinite(f) else {"$float": repr(f)}
    if ctype == "bool":
        if not isinstance(v, (bool, np.bool_)):
            raise TypeError
        return bool(v)
    if ctype in ("str_list", "str_tuple"):
        if not isinstance(v, (list, tuple)):
            raise TypeError
        return [_str(x) for x in v]
    if ctype == "shape":
        if not isinstance(v, (list, tuple)):
            raise TypeError
        return [_int(d) for d in v]
    if ctype == "shapes":
        return [None if s is None else _typed_out("shape", s) for s in _seqt(v)]
    if ctype == "dtypes":
        return [None if d is None else _str(d) for d in _seqt(v)]
    if ctype == "slots":
        return [[_int(a), _int(b)] for a, b in _seqt(v)]
    if ctype == "str_map":
        if not isinstance(v, dict):
            raise TypeError
        return {_str(k): _str(x) for k, x in v.items()}
    raise ValueError(ctype)


def _seqt(v: Any) -> Any:
    if not isinstance(v, (list, tuple)):
        raise TypeError
    return v


def site_key(site: Any) -> str | None:
    """The text a call-site key is saved as (sites group passes at build time only; the
    loaded trace keeps this text so a re-save writes the same key)."""
    if site is None or isinstance(site, str):
        return site
    return hashlib.sha256(_site_text(site).encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _site_text(site: Any) -> str:
    if isinstance(site, tuple):
        return "(" + ",".join(_site_text(s) for s in site) + ")"
    code = getattr(site, "co_qualname", None) or getattr(site, "co_name", None)
    if code is not None and hasattr(site, "co_filename"):
        return f"{site.co_filename}:{site.co_firstlineno}:{code}"
    return repr(site)


# load side --------------------------------------------------------------------------------
class Decoder:
    """Reads cells of one table, checking each against its column type. `payload(key)`
    returns the decoded payload (shared for a shared key)."""

    def __init__(self, payload: Callable[[str, str], Any], literal: Callable[[str, Any], Any] | None = None) -> None:
        self.payload = payload
        self.literal = literal
        self.unencodable: dict[str, int] = {}
        self.callables = 0

    def cell(self, ctype: str, x: Any, where: str) -> Any:
        if ctype == "value":
            return self.value(x, where, 0)
        if ctype == "values":
            if not isinstance(x, list):
                raise _invalid(where, "expected a list of values")
            return tuple(self.value(v, f"{where}[{i}]", 1) for i, v in enumerate(x))
        if ctype == "values?":
            return None if x is None else self.cell("values", x, where)
        if ctype == "callable":
            if x is None:
                return None
            if not (isinstance(x, dict) and set(x) == {"$callable"} and isinstance(x["$callable"], str)):
                raise _invalid(where, "expected null or a callable placeholder")
            self.callables += 1
            return CallablePlaceholder(x["$callable"], where)
        return _typed_in(ctype, x, where)

    def value(self, x: Any, where: str, depth: int) -> Any:
        if depth > MAX_DEPTH + 2:
            raise _invalid(where, "nested too deeply")
        t = type(x)
        if x is None or t in (bool, int, str):
            return x
        if t is float:
            return x
        if t is list:
            return [self.value(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(x)]
        if t is not dict or len(x) != 1:
            raise _invalid(where, f"unexpected {t.__name__} cell")
        (tag, body), = x.items()
        if tag not in _MARKERS:
            raise _invalid(where, f"unknown tag {tag!r}")
        try:
            return self._tagged(tag, body, where, depth)
        except ArtifactError:
            raise
        except (TypeError, ValueError, KeyError, OverflowError):
            raise _invalid(where, f"malformed {tag} cell") from None

    def _tagged(self, tag: str, body: Any, where: str, depth: int) -> Any:
        sub = lambda v, w=where: self.value(v, w, depth + 1)  # noqa: E731
        if tag == "$tuple":
            _need(isinstance(body, list))
            return tuple(sub(v, f"{where}[{i}]") for i, v in enumerate(body))
        if tag == "$dict":
            _need(isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body))
            out = {}
            for k, v in body:
                key = sub(k)
                hash(key)
                _need(key not in out)
                out[key] = sub(v, f"{where}[{key!r}]")
            return out
        if tag == "$float":
            _need(body in ("nan", "inf", "-inf"))
            return float(body)
        if tag == "$argref":
            _need(isinstance(body, list) and len(body) == 2 and type(body[0]) is int
                  and (body[1] is None or isinstance(body[1], str)))
            return ArgRef(index=body[0], address=body[1])
        if tag == "$payload":
            _need(isinstance(body, str))
            return self.payload(body, where)
        if tag == "$np":
            _need(isinstance(body, list) and len(body) == 2 and body[0] in _NP_SCALARS)
            dt = np.dtype(body[0])
            val = sub(body[1])
            _need(dt.kind in "biuf" and type(val) in ({"b": bool}.get(dt.kind, int), float) and
                  (dt.kind == "f") == (type(val) is float))
            return dt.type(val)
        if tag == "$slice":
            _need(isinstance(body, list) and len(body) == 3)
            return slice(*(sub(v) for v in body))
        if tag == "$ellipsis":
            _need(body is True)
            return Ellipsis
        if tag == "$complex":
            _need(isinstance(body, list) and len(body) == 2)
            re, im = sub(body[0]), sub(body[1])
            _need(type(re) is float and type(im) is float)
            return complex(re, im)
        if tag == "$bytes":
            _need(isinstance(body, str))
            return bytes.fromhex(body)
        if tag in ("$capture_options", "$trace_options"):
            from torchlens.options import CaptureOptions, TraceOptions

            cls = CaptureOptions if tag == "$capture_options" else TraceOptions
            names = [f.name for f in dc_fields(cls)]
            # every stored field must be known; a field added after the artifact was written is
            # absent from it and takes its default (all option fields have one)
            _need(isinstance(body, dict) and set(body) <= set(names))
            try:
                return cls(**{k: sub(v) for k, v in body.items()})
            except ArtifactError:
                raise
            except Exception:
                raise ValueError("invalid CaptureOptions") from None
        if tag == "$literal":
            _need(isinstance(body, list) and len(body) == 2 and isinstance(body[0], str))
            plain = sub(body[1])
            if self.literal is None:
                return UnencodableValue(body[0], repr(plain), where)
            try:
                value = self.literal(body[0], plain)
            except ArtifactError:
                raise
            except Exception as exc:  # the backend's literal parser on text from the file: typed, never raw
                raise _invalid(where, f"{body[0][:40]!r} literal does not rebuild ({type(exc).__name__})") from None
            _need(value is not None)
            return value
        if tag == "$unencodable":
            _need(isinstance(body, list) and len(body) == 2 and all(isinstance(s, str) for s in body))
            self.unencodable[body[0]] = self.unencodable.get(body[0], 0) + 1
            return UnencodableValue(body[0], body[1], where)
        if tag == "$callable":
            _need(isinstance(body, str))
            self.callables += 1
            return CallablePlaceholder(body, where)
        raise ValueError(tag)  # pragma: no cover


def _need(ok: bool) -> None:
    if not ok:
        raise ValueError("cell shape")


def _typed_in(ctype: str, x: Any, where: str) -> Any:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise _invalid(where, f"expected {what}, got {type(x).__name__}")

    def is_int(v: Any) -> bool:
        return type(v) is int

    def is_str(v: Any) -> bool:
        return type(v) is str

    if ctype == "str":
        need(is_str(x), "a string")
        return x
    if ctype == "str?":
        need(x is None or is_str(x), "a string or null")
        return x
    if ctype == "int":
        need(is_int(x), "an int")
        return x
    if ctype == "int?":
        need(x is None or is_int(x), "an int or null")
        return x
    if ctype == "float":
        if isinstance(x, dict):
            need(set(x) == {"$float"} and x["$float"] in ("nan", "inf", "-inf"), "a float")
            return float(x["$float"])
        need(type(x) is float, "a float")
        return x
    if ctype == "bool":
        need(type(x) is bool, "a bool")
        return x
    if ctype in ("str_list", "str_tuple"):
        need(isinstance(x, list) and all(is_str(s) for s in x), "a list of strings")
        return list(x) if ctype == "str_list" else tuple(x)
    if ctype == "shape":
        need(isinstance(x, list) and all(is_int(d) and d >= 0 for d in x), "a shape")
        return tuple(x)
    if ctype == "shapes":
        need(isinstance(x, list) and all(s is None or (isinstance(s, list) and all(is_int(d) and d >= 0 for d in s))
                                         for s in x), "a list of shapes")
        return tuple(None if s is None else tuple(s) for s in x)
    if ctype == "dtypes":
        need(isinstance(x, list) and all(d is None or is_str(d) for d in x), "a list of dtype names")
        return tuple(x)
    if ctype == "slots":
        need(isinstance(x, list) and all(isinstance(p, list) and len(p) == 2 and all(is_int(i) for i in p) for p in x),
             "a list of (id, slot) pairs")
        return tuple((a, b) for a, b in x)
    if ctype == "str_map":
        need(isinstance(x, dict) and all(is_str(v) for v in x.values()), "a map of strings")
        return dict(x)
    raise _invalid(where, f"unknown column type {ctype}")  # pragma: no cover


def check_table(kind: str, obj: Any, name: str) -> list[list[Any]]:
    """The rows of a records file, after checking it is a table of `kind`'s schema."""
    cols = [c for c, _ in SCHEMAS[kind]]
    if not (isinstance(obj, dict) and set(obj) == {"schema", "columns", "rows"}):
        raise ArtifactError("record_file_malformed", f"{name} is not a records table",
                            remedy="the records are damaged; save the trace again", file=name)
    if obj["schema"] != f"tl.{kind}/3" or obj["columns"] != cols:
        raise ArtifactError("record_schema_invalid", f"{name}: schema or columns differ from saved format 3's {kind} table",
                            remedy="the records are damaged or from another format", file=name)
    rows = obj["rows"]
    if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) == len(cols) for r in rows):
        raise ArtifactError("record_schema_invalid", f"{name}: a row does not have {len(cols)} cells",
                            remedy="the records are damaged; save the trace again", file=name)
    return rows
