"""Records -> Trace for a loaded artifact, after checking every cross-reference.

The saved records are the builder's output, so a loaded trace is rebuilt from them directly
(not by replaying events): labels, passes, edges and module calls are exactly the saved ones.
"""

from __future__ import annotations

from typing import Any

from torchlens.build.builder import drop_uncalled_modules
from torchlens.errors import ArtifactError, TorchLensError
from torchlens.records.module import Buffer, Module, ModuleCall, Param
from torchlens.records.op import Layer, Op
from torchlens.records.trace import Cost, Provenance, Trace
from torchlens.types import Duration


def _ref(where: str, what: str) -> ArtifactError:
    return ArtifactError("record_reference_invalid", f"{where} names {what!r}, which is not in the artifact",
                         remedy="the records are damaged; save the trace again", at=where)


def _unique(rows: list[dict[str, Any]], key: str, kind: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for i, r in enumerate(rows):
        if r[key] in out:
            raise ArtifactError("record_reference_invalid", f"{kind}[{i}]: duplicate {key} {r[key]!r}",
                                remedy="the records are damaged; save the trace again", at=f"{kind}[{i}].{key}")
        out[r[key]] = r
    return out


def _one(rows: dict[str, list], kind: str) -> dict[str, Any]:
    if len(rows[kind]) != 1:
        raise ArtifactError("record_schema_invalid", f"the {kind} table has {len(rows[kind])} rows, not 1",
                            remedy="the records are damaged; save the trace again", at=kind)
    return rows[kind][0]


def rebuild_trace(rows: dict[str, list[dict[str, Any]]], manifest: dict[str, Any], attach_backend: bool = True) -> Trace:
    """A Trace whose records are exactly `rows` (decoded cells), checked for coherence."""
    ops = _unique(rows["ops"], "label", "ops")
    layers = _unique(rows["layers"], "label", "layers")
    modules = _unique(rows["modules"], "address", "modules")
    calls = _unique(rows["module_calls"], "label", "module_calls")
    params = _unique(rows["params"], "address", "params")
    buffers = _unique(rows["buffers"], "address", "buffers")
    t_row, p_row, c_row = _one(rows, "trace"), _one(rows, "provenance"), _one(rows, "cost")

    def check(labels: Any, pool: dict, where: str) -> None:
        for label in labels:
            if label not in pool:
                raise _ref(where, label)

    for i, r in enumerate(rows["ops"]):
        w = f"ops[{i}]"
        if r["index"] != i:
            raise ArtifactError("record_reference_invalid", f"{w}.index is {r['index']}, not its row {i}",
                                remedy="the records are damaged; save the trace again", at=f"{w}.index")
        check(r["parents"], ops, f"{w}.parents")
        check(r["children"], ops, f"{w}.children")
        check([r["layer_label"]], layers, f"{w}.layer_label")
        check(r["modules"], modules, f"{w}.modules")
        check(r["module_calls"], calls, f"{w}.module_calls")
        check(r["params"], params, f"{w}.params")
        if r["module"] is not None:
            check([r["module"]], modules, f"{w}.module")
        if not r["saved"] and any(v is not None for v in r["outputs"]):
            raise ArtifactError("record_schema_invalid", f"{w} is not saved but carries payloads",
                                remedy="the records are damaged; save the trace again", at=f"{w}.outputs")
    claimed: set[str] = set()
    for i, r in enumerate(rows["layers"]):
        check(r["ops"], ops, f"layers[{i}].ops")
        for label in r["ops"]:
            if label in claimed or ops[label]["layer_label"] != r["label"]:
                raise _ref(f"layers[{i}].ops", label)
            claimed.add(label)
    for i, r in enumerate(rows["modules"]):
        w = f"modules[{i}]"
        check(r["children"], modules, f"{w}.children")
        check(r["calls"], calls, f"{w}.calls")
        check(r["param_addresses"], params, f"{w}.param_addresses")
        check(r["buffer_addresses"], buffers, f"{w}.buffer_addresses")
        if r["parent"] is not None and r["parent"] not in t_row["uncalled_modules"]:  # e.g. a ModuleList's items
            check([r["parent"]], modules, f"{w}.parent")
        for c in r["calls"]:
            if calls[c]["address"] != r["address"]:
                raise _ref(f"{w}.calls", c)
    for i, r in enumerate(rows["module_calls"]):
        w = f"module_calls[{i}]"
        check([r["address"]], modules, f"{w}.address")
        for col in ("op_labels", "input_labels", "output_labels"):
            check(r[col], ops, f"{w}.{col}")
    for kind, col, pool in (("params", "consumer_labels", ops), ("buffers", "op_labels", ops)):
        for i, r in enumerate(rows[kind]):
            check(r[col], pool, f"{kind}[{i}].{col}")
    paths = set(params)  # a tied parameter's aliases are paths no other record (or alias) holds
    for i, r in enumerate(rows["params"]):
        for a in r["aliases"]:
            if a in paths:
                raise ArtifactError("record_reference_invalid", f"params[{i}].aliases repeats the address {a!r}",
                                    remedy="the records are damaged; save the trace again", at=f"params[{i}].aliases")
            paths.add(a)
    _check_uncalled(t_row["uncalled_modules"], modules)
    backend = manifest["backend"]
    if (backend["name"], backend["version"], backend["framework_version"]) != (
            p_row["backend"], p_row["backend_version"], p_row["framework_version"]):
        raise ArtifactError("manifest_disclosure_mismatch", "the manifest's backend disagrees with the provenance record",
                            remedy="the artifact was modified; save the trace again")

    trace = Trace()
    trace.name = t_row["name"]
    trace.uncalled_modules = t_row["uncalled_modules"]
    trace.options = t_row["options"]
    trace.annotations = t_row["annotations"]
    if t_row["backward_passes"] < 0:
        raise ArtifactError("record_schema_invalid", "trace.backward_passes is negative",
                            remedy="the records are damaged; save the trace again", at="trace.backward_passes")
    trace._backward_passes = t_row["backward_passes"]  # trace.autograd.backward_passes
    trace.provenance = Provenance(**p_row)
    durations = c_row["backward_durations"]
    if not isinstance(durations, (list, tuple)) or not all(
            isinstance(d, (int, float)) and not isinstance(d, bool) and d >= 0 for d in durations):
        raise ArtifactError("record_schema_invalid", "cost.backward_durations is not a list of non-negative seconds",
                            remedy="the records are damaged; save the trace again", at="cost.backward_durations")
    c_row["backward_durations"] = tuple(Duration(d) for d in durations)
    trace.cost = Cost(**c_row)
    trace._output = None
    trace._output_state = "output_not_stored"
    for label, r in ops.items():
        op = Op()
        for col, value in r.items():
            if col == "outputs":
                op._outputs = value
            else:
                setattr(op, col, value)
        op._trace = trace
        trace._ops[label] = op
    for label, r in layers.items():
        layer = Layer(label, r["func_name"], r["kind"], r["module"], r["modules"])
        layer.type_num, layer.step_num = r["type_num"], r["step_num"]
        layer.ops = [trace._ops[o] for o in r["ops"]]
        layer._trace = trace
        trace._layers[label] = layer
    for label, r in calls.items():
        call = ModuleCall(r["address"], r["call"])
        if call.label != label:
            raise _ref(f"module_calls[{label}]", label)
        call.op_labels, call.input_labels, call.output_labels = r["op_labels"], r["input_labels"], r["output_labels"]
        call._trace = trace
        trace._module_calls[label] = call
    for address, r in modules.items():
        mod = Module(address, r["class_name"], r["class_qualname"], r["parent"], r["all_addresses"], r["training"])
        mod.all_addresses = r["all_addresses"]
        mod.children = r["children"]
        mod.calls = [trace._module_calls[c] for c in r["calls"]]
        mod.param_addresses, mod.buffer_addresses = r["param_addresses"], r["buffer_addresses"]
        mod._trace = trace
        trace._modules[address] = mod
    trace.__dict__["_params_from_artifact"] = True  # Param.value_basis: values read from the file, not live
    for address, r in params.items():
        p = Param(address, r["module"], r["name"], r["shape"], r["dtype"], r["trainable"], r["value"], r["device"],
                  r["aliases"])
        p.consumer_labels = r["consumer_labels"]
        p._trace = trace
        trace._params[address] = p
    for address, r in buffers.items():
        b = Buffer(address, r["module"], r["name"], r["shape"], r["dtype"], r["value"], r["persistent"], r["device"])
        b.op_labels = r["op_labels"]
        b._trace = trace
        trace._buffers[address] = b
    drop_uncalled_modules(trace)  # a file from before the rule may hold call-less records: the rule holds on load
    trace._backend = _backend_or_none(trace.provenance.backend) if attach_backend else None
    _rebind_callables(trace)
    return trace


def _check_uncalled(uncalled: Any, modules: dict) -> None:
    """Uncalled addresses are distinct, and a module record listed as uncalled has no call
    (a record with calls cannot be uncalled)."""
    if len(set(uncalled)) != len(uncalled):
        raise ArtifactError("record_reference_invalid", "trace.uncalled_modules repeats an address",
                            remedy="the records are damaged; save the trace again", at="trace[0].uncalled_modules")
    for a in uncalled:
        if a in modules and modules[a]["calls"]:
            raise ArtifactError("record_reference_invalid", f"trace.uncalled_modules lists {a!r}, a module with calls",
                                remedy="the records are damaged; save the trace again",
                                at="trace[0].uncalled_modules", address=a)


def _rebind_callables(trace: Trace) -> None:
    """Turn saved callable names back into the backend's callables, through its closed table
    only: `rebind_op(op)` (`SupportsOpRebinding`: rebuilds an op from its own records, e.g. a
    JAX primitive from the primitive table) or `resolve_callable(name)`
    (`SupportsCallableTable`: a name in the backend's callable table).
    Nothing here imports a module or looks a dotted path up. An op whose name neither
    resolves keeps its `CallablePlaceholder` and is opaque: every replay verb refuses it with
    `opaque_op_not_replayable` before running anything (`io/opaque.py`). Placeholders in other
    cells (argument templates, meta, options, parameter values) are never re-bound."""
    from torchlens.backends.protocol import SupportsCallableTable, SupportsOpRebinding, supports
    from torchlens.types import CallablePlaceholder

    backend = trace._backend
    resolve = backend.resolve_callable if supports(backend, SupportsCallableTable) else None
    rebind_op = backend.rebind_op if supports(backend, SupportsOpRebinding) else None  # per-op: from its own records
    if resolve is None and rebind_op is None:
        return
    cache: dict[str, Any] = {}
    for op in trace._ops.values():
        f = op.func
        if not isinstance(f, CallablePlaceholder):
            continue
        new = rebind_op(op) if rebind_op is not None else None
        if new is None and resolve is not None:
            if f.qualname not in cache:
                cache[f.qualname] = resolve(f.qualname)
            new = cache[f.qualname]
        if new is not None and callable(new) and not isinstance(new, CallablePlaceholder):
            op.func = new


def _backend_or_none(name: str) -> Any:
    """The installed backend's protocol object (for verbs that run code), or None."""
    try:
        from torchlens.backends.registry import get_protocol

        return get_protocol(name)
    except TorchLensError:
        return None
