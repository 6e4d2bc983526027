"""The runnable artifact: `trace.save(path, level="runnable")`, `trace.runnable`, Readiness.

A runnable save writes everything a level "full" save writes, plus two files under
`runnable/`, listed (sha256 and size) by the manifest's `runnable` object:

- `runnable/descriptor.json` (schema `tl.runnable/1`): the sparse taken-path descriptor. `ops`
  is the ordered list of ops the captured forward actually executed, each with its label,
  role (`input`, `buffer`, `constant`, `op`, `output`), callable name (the backend's closed
  callable table), argument templates (`{"$op": [parent, slot]}` for a parent's output slot,
  `{"$state": address}` for a parameter or buffer, `{"$payload": key}` for a saved constant),
  output shapes and dtypes, the alias topology it recorded (`inplace_of`: the parent an in-place
  op wrote into) and its escape records (`reads`: each read of the op's value back into Python
  with what it gave at capture). `inputs` maps input ops to `args[i]` / `kwargs['k']`;
  `state` lists the tensors of `state.safetensors`.
- `runnable/state.safetensors`: parameter values from the capture-time snapshot
  (`CaptureOptions(replayable=True)` takes it as the capture's last step) and buffer values
  from the buffer ops' saved payloads (copies taken during the forward). Never the live
  values read at save time.

No callable is pickled or imported by path: a callable name re-binds on load through the
backend's closed table (`io.rebuild`). Loading checks both files' sizes and digests and the
descriptor against the trace's records before it returns; `trace.runnable.readiness` is then
"ready" or "unavailable" (with `reasons`), decided without executing anything.

`trace.runnable.run(*inputs, **kwargs)` re-executes the taken path on new inputs of the
captured shapes and dtypes with the saved state (no model), and returns a `RunnableResult`
with `outputs`, `path_faithfulness` and `numeric_attestation` (docs/guides/runnable.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

from torchlens.errors import ArtifactError, InvalidArgumentError

SCHEMA = "tl.runnable/1"
DIR = "runnable"
DESCRIPTOR = "runnable/descriptor.json"
STATE = "runnable/state.safetensors"
FILES = (DESCRIPTOR, STATE)
_LEAVES = ("input", "buffer", "output")
_INPUT_PATH = re.compile(r"^(?:args\[(\d+)\]|kwargs\['([A-Za-z_][A-Za-z0-9_]*)'\])$")
_MAX_DESCRIPTOR = 512 * 1024 * 1024


def _refuse(code: str, msg: str, remedy: str, **fields: Any) -> ArtifactError:
    return ArtifactError(code, msg, remedy=remedy, **fields)


# save ---------------------------------------------------------------------------------------
def _read_value(value: Any, name: str) -> tuple[bool, Any]:
    from torchlens.replay.preconditions import _read

    return _read(value, name)


def _plain(v: Any) -> Any:
    """A read's result as JSON (bool, int, finite float, str, nested lists); None when not."""
    if v is None or type(v) in (bool, int, str):
        return v
    if type(v) is float:
        return v if math.isfinite(v) else {"$float": repr(v)}
    if type(v) in (list, tuple):
        items = [_plain(x) for x in v]
        return None if any(x is None and y is not None for x, y in zip(items, v)) else items
    return None


def _unplain(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"$float"}:
        return float(v["$float"])
    if isinstance(v, list):
        return [_unplain(x) for x in v]
    return v


def _role(op: Any) -> str:
    if op.kind in _LEAVES:
        return op.kind
    if op.kind == "constant" and not callable(op.func):
        return "constant"
    return "op"


def check_saveable(trace: Any) -> None:
    """Every refusal of a runnable save, raised before anything is written."""
    opts = trace.options
    if not getattr(opts, "replayable", False):
        raise _refuse("runnable_capture_not_replayable", "the trace was not captured with replayable=True",
                      "capture with capture=tl.options.CaptureOptions(replayable=True), then save level='runnable'")
    if getattr(opts, "save_mode", "copy") != "copy":
        raise _refuse("runnable_capture_not_replayable", f"save_mode={opts.save_mode!r}: saved buffer values may be "
                      "live objects, not capture-time copies", "capture with save_mode='copy' (the default)")
    if not trace.is_pristine or trace.armed_edits or trace.recipe:
        raise _refuse("runnable_trace_edited", "the trace was intervened on, so it is not the captured forward",
                      "save a fresh capture (or trace.fork() before editing) at level='runnable'")
    if trace._backend is None:
        raise _refuse("runnable_op_unsupported", "the trace has no installed backend to name its callables",
                      "save from a live capture")
    from torchlens.io.codec import backend_codec

    codec = backend_codec(trace._backend)
    from torchlens.backends.protocol import SupportsCallableTable, supports

    resolve = trace._backend.resolve_callable if supports(trace._backend, SupportsCallableTable) else None
    for op in trace._ops.values():
        meta = op.meta or {}
        role = _role(op)
        if role == "input":
            if not _INPUT_PATH.match(op.path or ""):
                raise _refuse("runnable_op_unsupported", f"input {op.label} is at {op.path!r}; a runnable takes "
                              "top-level inputs only (args[i], kwargs['k'])",
                              "capture a model whose forward takes its tensors as top-level arguments", label=op.label)
            continue
        if role == "buffer":
            if not op.saved or not op.outs or not codec.can_encode(op.outs[0]):
                raise _refuse("runnable_payload_missing", f"buffer {op.label} ({op.path}) has no saved value",
                              "capture with save='all' (the default)", label=op.label)
            continue
        if role == "constant":
            if not op.saved:
                raise _refuse("runnable_payload_missing", f"constant {op.label} has no saved value",
                              "capture with save='all' (the default)", label=op.label)
            continue
        if role == "output":
            continue
        if meta.get("replay_unsupported"):
            raise _refuse("runnable_op_unsupported", f"{op.label} ({op.func_name}) cannot be re-executed "
                          f"({meta['replay_unsupported']})", "a runnable needs every op re-executable", label=op.label)
        name = codec.callable_name(op.func) if op.func is not None else None
        if not isinstance(name, str) or resolve is None or resolve(name) is None:
            raise _refuse("runnable_op_unsupported", f"{op.label} ({op.func_name}) has no name in the "
                          f"{trace.provenance.backend} backend's closed callable table",
                          "a runnable re-binds every callable by name; this model's forward calls one outside it",
                          label=op.label)
        if op.args_template is None:
            raise _refuse("runnable_op_unsupported", f"{op.label} recorded no argument template",
                          "capture again with replayable=True", label=op.label)
        from torchlens.replay.engine import _unencodable

        probe = _unencodable_live(op.args_template, codec) or _unencodable_live(op.kwargs_template or {}, codec)
        if probe is not None or _unencodable(op.args_template) is not None:
            raise _refuse("runnable_op_unsupported", f"{op.label}'s argument {probe!r:.60} has no portable encoding",
                          "a runnable saves every argument as data", label=op.label)


def _unencodable_live(template: Any, codec: Any) -> Any:
    """The first leaf of a live template the schema encoder would write as text, or None."""
    from torchlens.build.events import ArgRef
    from torchlens.io.schema import Encoder

    if isinstance(template, ArgRef):
        return None
    if type(template) in (tuple, list):
        for t in template:
            bad = _unencodable_live(t, codec)
            if bad is not None:
                return bad
        return None
    if type(template) is dict:
        return _unencodable_live(tuple(template.values()), codec)
    if codec.can_encode(template):  # a tensor constant: saved as a payload
        return None
    enc = Encoder(codec)
    enc.value(template, "probe", 0)
    return template if enc.unencodable or enc.callables else None


def _snapshot_state(trace: Any, codec: Any) -> dict[str, Any]:
    """address -> EncodedPayload: parameters from the capture-time snapshot, buffers from the
    buffer ops' saved payloads."""
    from torchlens.bundle.guard import snapshot_of

    loaded = trace.__dict__.get("_runnable")
    if loaded is not None:  # re-saving a loaded runnable: its checked capture-time state
        return dict(loaded._state)
    snap = snapshot_of(trace)
    used = {ref for op in trace._ops.values() for ref in _addresses(op.args_template) | _addresses(op.kwargs_template)}
    if snap is None and (used & set(trace._params)):
        raise _refuse("runnable_state_missing", "the trace carries no capture-time parameter snapshot",
                      "capture with CaptureOptions(replayable=True) (it takes the snapshot), then save")
    state: dict[str, Any] = {}
    for address in sorted(used):
        if address in trace._params:
            p = trace._params[address]
            arr = (snap or {}).get(address)
            if arr is None:
                raise _refuse("runnable_state_missing", f"the snapshot lacks parameter {address!r}",
                              "capture again with replayable=True", address=address)
            value = trace._backend.from_host(arr.copy(), like=p.value)  # a writable copy of the snapshot
            ep = codec.encode(value)
            if ep.dtype != p.dtype or list(ep.shape) != list(p.shape):
                raise _refuse("runnable_state_missing", f"parameter {address!r} is {ep.dtype}{list(ep.shape)} now, "
                              f"{p.dtype}{list(p.shape)} at capture", "save before changing the model's dtypes",
                              address=address)
            ep.meta.pop("parameter", None)
            ep.meta.pop("requires_grad", None)
            state[address] = ep
        elif address in trace._buffers:
            ops = [o for o in trace._ops.values() if o.kind == "buffer" and o.path == address and o.saved]
            if not ops:
                raise _refuse("runnable_payload_missing", f"buffer {address!r} has no saved value",
                              "capture with save='all'", address=address)
            state[address] = codec.encode(ops[0].outs[0])
        else:
            raise _refuse("runnable_state_missing", f"an op reads {address!r}, which no parameter or buffer record holds",
                          "capture again", address=address)
    for op in trace._ops.values():
        if op.kind == "buffer":
            state.setdefault(op.path, codec.encode(op.outs[0]))
    return state


def _addresses(template: Any) -> set[str]:
    from torchlens.build.events import ArgRef

    if isinstance(template, ArgRef):
        return {template.address} if template.address is not None else set()
    if type(template) in (tuple, list):
        return set().union(*(_addresses(t) for t in template)) if template else set()
    if type(template) is dict:
        return _addresses(tuple(template.values()))
    return set()


def _render_template(template: Any, op: Any, ev2op: dict, enc: Any, where: str) -> Any:
    from torchlens.build.events import ArgRef

    if isinstance(template, ArgRef):
        if template.address is not None:
            return {"$state": template.address}
        eid, slot = op.parent_slots[template.index]
        return {"$op": [ev2op[eid].label, slot]}
    if type(template) is tuple:
        return {"$tuple": [_render_template(t, op, ev2op, enc, where) for t in template]}
    if type(template) is list:
        return [_render_template(t, op, ev2op, enc, where) for t in template]
    if type(template) is dict:
        return {"$dict": [[k, _render_template(v, op, ev2op, enc, where)] for k, v in template.items()]}
    return enc.value(template, where, 1)


def build(trace: Any, enc: Any) -> tuple[bytes, list[tuple[str, Any]]]:
    """(descriptor.json bytes, state entries) for a trace `check_saveable` accepted. `enc` is
    the save's record encoder, so a constant in a template names the payload the records hold."""
    codec = enc.codec
    state = _snapshot_state(trace, codec)
    ev2op = {o.event_id: o for o in trace._ops.values()}
    ops, inputs = [], []
    for op in trace._ops.values():
        role = _role(op)
        entry: dict[str, Any] = {"label": op.label, "role": role, "shapes": [list(s) if s is not None else None
                                                                           for s in (op.shapes or ())],
                                 "dtypes": list(op.dtypes or ()),
                                 "parents": [[ev2op[e].label, s] for e, s in op.parent_slots]}
        if role == "input":
            m = _INPUT_PATH.match(op.path)
            inputs.append({"label": op.label, "position": int(m.group(1)) if m.group(1) is not None else None,
                           "keyword": m.group(2)})
        elif role == "buffer":
            entry["state"] = op.path
        elif role == "op":
            entry["callable"] = codec.callable_name(op.func)
            entry["args"] = _render_template(op.args_template, op, ev2op, enc, f"runnable.{op.label}.args")
            entry["kwargs"] = _render_template(op.kwargs_template or {}, op, ev2op, enc, f"runnable.{op.label}.kwargs")
            entry["multi_output"] = bool(op.multi_output)
            if op.is_inplace and op.parent_slots:
                entry["inplace_of"] = ev2op[op.parent_slots[0][0]].label
        reads = (op.meta or {}).get("value_reads")
        if reads:
            rec = []
            for slot, name in reads:
                got: Any = None
                ok = False
                if op.saved and op._outputs is not None and 0 <= slot < len(op._outputs):
                    ok, val = _read_value(op._outputs[slot], name)
                    got = _plain(val) if ok else None
                    ok = ok and (got is not None or val is None)
                rec.append({"slot": int(slot), "read": str(name), "checkable": bool(ok), "value": got if ok else None})
            entry["reads"] = rec
        ops.append(entry)
    keys = {}
    for i, address in enumerate(sorted(state)):
        keys[address] = f"s{i:06d}"
    doc = {
        "schema": SCHEMA, "backend": trace.provenance.backend,
        "inputs": sorted(inputs, key=lambda d: (d["position"] is None, d["position"] or 0, d["keyword"] or "")),
        "outputs": [o.label for o in trace._ops.values() if o.kind == "output"],
        "state": [{"address": a, "tensor": keys[a], "dtype": p.dtype, "shape": list(p.shape), "meta": dict(p.meta),
                   "kind": "param" if a in trace._params else "buffer"} for a, p in sorted(state.items())],
        "escapes": [e["label"] for e in ops if e.get("reads")],
        "ops": ops,
    }
    data = json.dumps(doc, separators=(",", ":"), allow_nan=False, sort_keys=False).encode("utf-8")
    return data, [(keys[a], p) for a, p in sorted(state.items())]


def write(tmp: Path, trace: Any, enc: Any) -> dict[str, Any]:
    """Write runnable/ into the save's stage `tmp`; return the manifest's `runnable` object."""
    from torchlens.io import blobfile, publish

    data, entries = build(trace, enc)
    (tmp / DIR).mkdir()
    publish.write_file(tmp / DESCRIPTOR, data, sync=False)
    size, digest = blobfile.write_blob(str(tmp / STATE), entries, {"format": "tlspec-runnable-state",
                                                                     "codec": enc.codec.name})
    return {"schema": SCHEMA, "files": {DESCRIPTOR: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)},
                                        STATE: {"sha256": digest, "size": size}}}


# load ---------------------------------------------------------------------------------------
def _bad(why: str) -> ArtifactError:
    return ArtifactError("runnable_descriptor_invalid", f"runnable artifact: {why}",
                         remedy="the artifact was modified or damaged; save the trace again", why=why[:200])


_SHA = re.compile(r"^[0-9a-f]{64}$")


def check_manifest_object(obj: Any) -> dict[str, Any]:
    """The manifest's `runnable` object, checked (schema, exactly the two files, sha256/size)."""
    if not (isinstance(obj, dict) and set(obj) == {"schema", "files"} and obj["schema"] == SCHEMA
            and isinstance(obj["files"], dict) and set(obj["files"]) == set(FILES)):
        raise _bad("the manifest's runnable object is malformed")
    for name, e in obj["files"].items():
        if not (isinstance(e, dict) and set(e) == {"sha256", "size"} and type(e["sha256"]) is str
                and _SHA.match(e["sha256"]) and type(e["size"]) is int and e["size"] >= 0):
            raise _bad(f"the manifest entry for {name} is malformed")
    return obj


def read(bundle: Path, manifest: dict[str, Any], trace: Any) -> "Runnable | None":
    """Check runnable/ (sizes, digests, the descriptor against `trace`'s records) and return
    the `Runnable` (None when `trace` is None: `validate` checks only)."""
    from torchlens.io import blobfile
    from torchlens.io.bundle import _read_checked
    from torchlens.io.manifest import parse_json

    files = manifest["runnable"]["files"]
    e = files[DESCRIPTOR]
    if e["size"] > _MAX_DESCRIPTOR:
        raise _bad("the descriptor's declared size is implausible")
    data = _read_checked(bundle, DESCRIPTOR, e)  # size and sha256 against the manifest, as every record file
    doc = parse_json(data, DESCRIPTOR, "runnable_descriptor_invalid")
    s = files[STATE]
    blob = blobfile.read_blob(str(bundle / STATE), STATE, s["size"], s["sha256"], False)
    if blob.metadata.get("format") != "tlspec-runnable-state" or blob.metadata.get("codec") != manifest["codec"]:
        raise _bad("state.safetensors names another format or codec")
    _check_doc(doc, manifest)
    state = {}
    for row in doc["state"]:
        state[row["address"]] = blobfile.payload_from_storage(blob, row["tensor"], row["dtype"], tuple(row["shape"]),
                                                              row["meta"])
    if {t for t in blob.entries if not t.startswith(blobfile.PAD_PREFIX)} != {r["tensor"] for r in doc["state"]}:
        raise _bad("state.safetensors holds tensors the descriptor does not list")
    if trace is None:
        return None
    _check_against(doc, trace)
    return Runnable(trace, doc, state)


def _check_doc(doc: Any, manifest: dict[str, Any]) -> None:
    keys = {"schema", "backend", "inputs", "outputs", "state", "escapes", "ops"}
    if not (isinstance(doc, dict) and set(doc) == keys and doc["schema"] == SCHEMA):
        raise _bad("descriptor.json does not have the tl.runnable/1 keys")
    if doc["backend"] != manifest["backend"]["name"]:
        raise _bad("descriptor.json names another backend than the manifest")
    if not (isinstance(doc["ops"], list) and all(isinstance(o, dict) and type(o.get("label")) is str
                                                 and o.get("role") in ("input", "buffer", "constant", "op", "output")
                                                 for o in doc["ops"])):
        raise _bad("descriptor ops are malformed")
    if not (isinstance(doc["state"], list) and all(
            isinstance(r, dict) and set(r) == {"address", "tensor", "dtype", "shape", "meta", "kind"}
            and type(r["address"]) is str and type(r["tensor"]) is str and type(r["dtype"]) is str
            and isinstance(r["shape"], list) and all(type(d) is int and d >= 0 for d in r["shape"])
            and isinstance(r["meta"], dict) and all(type(v) is str for v in r["meta"].values())
            and r["kind"] in ("param", "buffer") for r in doc["state"])):
        raise _bad("descriptor state rows are malformed")
    if len({r["address"] for r in doc["state"]}) != len(doc["state"]):
        raise _bad("descriptor state repeats an address")
    if not (isinstance(doc["inputs"], list) and all(
            isinstance(i, dict) and set(i) == {"label", "position", "keyword"}
            and (type(i["position"]) is int) != (type(i["keyword"]) is str) for i in doc["inputs"])):
        raise _bad("descriptor inputs are malformed")


def _check_against(doc: dict[str, Any], trace: Any) -> None:
    """The descriptor names exactly the trace's ops, in order, with the records' roles,
    parents and saved callable names; every state address is a parameter or buffer record."""
    ops = list(trace._ops.values())
    if [o["label"] for o in doc["ops"]] != [o.label for o in ops]:
        raise _bad("descriptor ops do not list the trace's ops in execution order")
    ev2op = {o.event_id: o for o in ops}
    for entry, op in zip(doc["ops"], ops):
        if entry["role"] != _role_loaded(op):
            raise _bad(f"{op.label}: role {entry['role']!r} differs from the records")
        if entry.get("parents") != [[ev2op[e].label, s] for e, s in op.parent_slots]:
            raise _bad(f"{op.label}: parents differ from the records")
        if entry["role"] == "op":
            from torchlens.types import CallablePlaceholder

            name = op.func.qualname if isinstance(op.func, CallablePlaceholder) else _bound_name(trace, op.func)
            if entry.get("callable") != name:
                raise _bad(f"{op.label}: callable {str(entry.get('callable'))[:60]!r} differs from the records")
        for r in entry.get("reads", ()):
            if not (isinstance(r, dict) and set(r) == {"slot", "read", "checkable", "value"}
                    and type(r["slot"]) is int and type(r["read"]) is str and type(r["checkable"]) is bool):
                raise _bad(f"{op.label}: escape record malformed")
        if entry["role"] == "buffer" and entry.get("state") not in {r["address"] for r in doc["state"]}:
            raise _bad(f"{op.label}: buffer state missing")
    for r in doc["state"]:
        if r["address"] not in trace._params and r["address"] not in trace._buffers:
            raise _bad(f"state address {r['address'][:80]!r} is no parameter or buffer of the trace")
    labels = {o.label for o in ops if o.kind == "input"}
    if {i["label"] for i in doc["inputs"]} != labels:
        raise _bad("descriptor inputs differ from the trace's input ops")
    if doc["escapes"] != [e["label"] for e in doc["ops"] if e.get("reads")]:
        raise _bad("descriptor escapes differ from its escape records")
    if doc["outputs"] != [o.label for o in ops if o.kind == "output"]:
        raise _bad("descriptor outputs differ from the trace's output ops")


def _role_loaded(op: Any) -> str:
    from torchlens.types import CallablePlaceholder

    if op.kind in _LEAVES:
        return op.kind
    if op.kind == "constant" and (op.func is None or (not callable(op.func) and not isinstance(op.func, CallablePlaceholder))):
        return "constant"
    return "op"


def _bound_name(trace: Any, fn: Any) -> Any:
    from torchlens.io.codec import backend_codec

    if trace._backend is None:
        return None
    return backend_codec(trace._backend).callable_name(fn)


# run ----------------------------------------------------------------------------------------
class RunnableResult:
    """What `Runnable.run` returns.

    - `outputs`: the output values in the trace's output-op order (a tuple; `output` is the
      single one). None when the path diverged.
    - `path_faithfulness`: "verified" (no escape on the path, or every recorded Python read of
      a value gave what it gave at capture), "diverged" (some read differs: the model would
      have taken another path; the run stopped at `diverged_at`), or "unverifiable" (the path
      has escapes whose capture-time reads were not recorded; not a pass).
    - `numeric_attestation`: "attested" (run on the captured inputs and every saved
      activation is byte-equal), "numeric_attestation_failed" (some differ: `mismatches`),
      "not_applicable" (other inputs), "not_present" (no activations were saved).
      Attestation never upgrades path faithfulness.
    """

    def __init__(self, outputs: Any, path_faithfulness: str, numeric_attestation: str, *, diverged_at: Any = None,
                 unverified: tuple = (), mismatches: tuple = (), checked: int = 0) -> None:
        self.outputs = outputs
        self.path_faithfulness = path_faithfulness
        self.numeric_attestation = numeric_attestation
        self.diverged_at = diverged_at
        self.unverified = tuple(unverified)
        self.mismatches = tuple(mismatches)
        self.attested_ops = checked

    @property
    def output(self) -> Any:
        if self.outputs is None or len(self.outputs) != 1:
            raise InvalidArgumentError("invalid_argument", "the result has no single output",
                                       remedy="read result.outputs")
        return self.outputs[0]

    def __repr__(self) -> str:
        n = None if self.outputs is None else len(self.outputs)
        return (f"RunnableResult(outputs={n}, path_faithfulness={self.path_faithfulness!r}, "
                f"numeric_attestation={self.numeric_attestation!r})")


def _bytes_equal(a: Any, b: Any) -> bool:
    import numpy as np

    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    x, y = np.ascontiguousarray(a.array), np.ascontiguousarray(b.array)
    return x.nbytes == y.nbytes and bool(np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8)))


class Runnable:
    """`trace.runnable` of a loaded runnable artifact (module docstring)."""

    def __init__(self, trace: Any, doc: dict[str, Any], state: dict[str, Any]) -> None:
        self._trace = trace
        self.descriptor = doc
        self._state = state
        self.reasons: tuple[str, ...] = tuple(self._reasons())
        self.readiness = "ready" if not self.reasons else "unavailable"

    def _reasons(self) -> list[str]:
        from torchlens.types import CallablePlaceholder

        out = []
        trace = self._trace
        if trace._backend is None:
            out.append(f"backend {self.descriptor['backend']!r} is not installed")
            return out
        try:
            from torchlens.io.codec import backend_codec

            backend_codec(trace._backend)
        except Exception as exc:  # noqa: BLE001 - readiness reports, never raises
            out.append(f"the backend's payload codec is unavailable ({exc})")
        for entry, op in zip(self.descriptor["ops"], trace._ops.values()):
            if entry["role"] == "op" and (op.func is None or isinstance(op.func, CallablePlaceholder) or not callable(op.func)):
                out.append(f"{op.label}: callable {entry.get('callable')!r} does not re-bind through the backend's table")
        return out

    def _archived(self) -> bool:
        """Whether the artifact holds any saved activation (an op's or an output's payload)."""
        return any(op.saved and op.outs is not None for op in self._trace._ops.values() if op.kind not in ("input", "buffer"))

    @property
    def escapes(self) -> tuple[str, ...]:
        return tuple(self.descriptor["escapes"])

    def __repr__(self) -> str:
        return f"Runnable(readiness={self.readiness!r}, ops={len(self.descriptor['ops'])}, escapes={len(self.escapes)})"

    def _bind_inputs(self, codec: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        specs = self.descriptor["inputs"]
        npos = sum(1 for s in specs if s["position"] is not None)
        kws = {s["keyword"] for s in specs if s["keyword"] is not None}
        if len(args) != npos or set(kwargs) != kws:
            raise InvalidArgumentError("runnable_input_mismatch", f"the capture took {npos} positional inputs and "
                                       f"keywords {sorted(kws)}; got {len(args)} and {sorted(kwargs)}",
                                       remedy="pass inputs shaped like the captured ones")
        ops = {o.label: o for o in self._trace._ops.values()}
        bound = {}
        for s in specs:
            v = args[s["position"]] if s["position"] is not None else kwargs[s["keyword"]]
            op = ops[s["label"]]
            if not codec.can_encode(v):
                raise InvalidArgumentError("runnable_input_mismatch", f"input {op.path} is a {type(v).__name__}, "
                                           "not a value the backend holds", remedy="pass a tensor", input=op.path)
            ep = codec.encode(v)
            want_shape, want_dtype = list(op.shapes[0]), op.dtypes[0]
            if list(ep.shape) != want_shape or ep.dtype != want_dtype:
                raise InvalidArgumentError("runnable_input_mismatch", f"input {op.path} is {ep.dtype}{list(ep.shape)}, "
                                           f"the capture's {want_dtype}{want_shape}",
                                           remedy="a runnable replays the captured path: pass inputs of the same "
                                                  "shapes and dtypes", input=op.path)
            device = ep.meta.get("device", "cpu")
            if not device.startswith("cpu"):  # loaded state decodes to host memory: the run is on the CPU
                raise InvalidArgumentError("runnable_input_mismatch", f"input {op.path} is on {device}; a loaded "
                                           "runnable runs on the CPU, where its saved state is",
                                           remedy="pass the inputs on the CPU (e.g. x.cpu())", input=op.path)
            bound[op.label] = (v, ep)
        return bound

    def run(self, *args: Any, **kwargs: Any) -> RunnableResult:
        """Re-execute the taken path on `args`/`kwargs` (the captured inputs' shapes and
        dtypes) with the saved capture-time state; see `RunnableResult`."""
        if self.readiness != "ready":
            raise InvalidArgumentError("runnable_unavailable", f"the runnable is unavailable: {'; '.join(self.reasons)}",
                                       remedy="install the backend (and the version) that saved it",
                                       reasons=list(self.reasons))
        from torchlens.io.codec import backend_codec
        from torchlens.replay.engine import Replayer

        trace = self._trace
        codec = backend_codec(trace._backend)
        bound = self._bind_inputs(codec, args, kwargs)
        captured = all(op.saved and op.outs and _bytes_equal(ep, codec.encode(op.outs[0]))
                       for op in trace._ops.values() if op.kind == "input" for _, ep in [bound[op.label]])
        state = {a: codec.decode(p) for a, p in self._state.items()}  # fresh values: in-place writes stay in this run
        from torchlens.backends.protocol import SupportsInterventions, supports

        edit_ops = trace._backend.edit_ops() if supports(trace._backend, SupportsInterventions) else None
        replayer = Replayer(trace, edit_ops)
        ev2op = replayer.ev2op
        values: dict[str, tuple] = {}
        unverified, mismatches = [], []
        checked = 0
        for entry, op in zip(self.descriptor["ops"], trace._ops.values()):
            role = entry["role"]
            if role == "input":
                outs: tuple = (bound[op.label][0],)
            elif role == "buffer":
                outs = (state[entry["state"]],)
            elif role == "constant":
                outs = tuple(codec.decode(codec.encode(v)) for v in op.outs)
            elif role == "output":
                eid, slot = op.parent_slots[0]
                outs = (values[ev2op[eid].label][slot],)
            else:  # through the one replay engine: parents from this run, parameters and buffers from the state
                missing = [a for a in op.params if a not in state]
                if missing:
                    raise _refuse("runnable_descriptor_invalid", f"{op.label} reads {missing[0]!r}, which the state "
                                  "does not hold", remedy="save the trace again at level='runnable'", label=op.label)
                outs = replayer.run(op, override=state, changed=values, protect=False)
            values[op.label] = outs
            for r in entry.get("reads", ()):
                if not r["checkable"]:
                    unverified.append(op.label)
                    continue
                from torchlens.replay.preconditions import _same

                ok, got = _read_value(outs[r["slot"]], r["read"]) if r["slot"] < len(outs) else (False, None)
                want = _unplain(r["value"])
                if not ok or not _same(_unplain(_plain(got)), want):
                    attest = "not_present" if not self._archived() else "not_applicable" if not captured else \
                        "numeric_attestation_failed"
                    return RunnableResult(None, "diverged", attest,
                                          diverged_at={"op": op.label, "read": r["read"], "slot": r["slot"],
                                                       "captured": want, "now": got})
            if captured and role in ("op", "output") and op.saved and op.outs is not None:
                for i, (g, w) in enumerate(zip(outs, op.outs)):
                    if w is None or not codec.can_encode(w):
                        continue
                    checked += 1
                    if g is None or not codec.can_encode(g) or not _bytes_equal(codec.encode(g), codec.encode(w)):
                        mismatches.append(f"{op.label}[{i}]")
        outputs = tuple(values[o.label][0] for o in trace._ops.values() if o.kind == "output")
        faith = "unverifiable" if unverified else "verified"
        if not self._archived():
            attest = "not_present"
        elif not captured:
            attest = "not_applicable"
        elif checked == 0:
            attest = "not_present"
        else:
            attest = "numeric_attestation_failed" if mismatches else "attested"
        return RunnableResult(outputs, faith, attest, unverified=tuple(dict.fromkeys(unverified)),
                              mismatches=tuple(mismatches), checked=checked)


def runnable_of(trace: Any) -> "Runnable | None":
    return trace.__dict__.get("_runnable")


__all__ = ["Runnable", "RunnableResult", "SCHEMA", "check_saveable", "write", "read", "check_manifest_object"]
