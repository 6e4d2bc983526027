"""Turn a backend's event stream into a Trace.

Labels, pass grouping, the module tree, module calls, parameter and buffer records and the
graph edges are computed here, once, for every backend.

Labelling rules:
- sources and sinks: `input_N`, `buffer_N`, `output_N` (N counts that kind);
- every other layer: `{type}_{type_num}_{step_num}`, where `type` is the normalised callable
  name, `type_num` counts layers of that type and `step_num` counts all such layers, both
  in order of first execution;
- a layer that ran more than once has pass-qualified op labels `label:1`, `label:2`, ...;
  single-pass layers' ops carry the bare label.

Pass grouping: two op events belong to the same Layer when they share (innermost module
address, call site, callable, kind). Running one place again (a loop, a module called again)
is a new pass; two places with the same weights are two layers.
"""

from __future__ import annotations

from typing import Any, Iterable

from torchlens.build.events import EventLog, ModelInfo, ModuleEnter, ModuleExit, OpEvent
from torchlens.records.module import Buffer, Module, ModuleCall, Param
from torchlens.records.op import Layer, Op
from torchlens.records.ports import port
from torchlens.records.trace import Cost, Provenance, Trace

_SOURCE_KINDS = {"input", "buffer", "output"}


#: Property names whose spelling is their meaning: `x.T` is `T_1_2`, never `t_1_2` (`x.t()`).
_CASED_NAMES = frozenset({"T", "H", "mT", "mH"})


def normalize_type(func_name: str) -> str:
    """`"__add__"` -> `"add"`, `"add_"` -> `"add"`, `"Tensor.view"` -> `"view"`, lowercased;
    a tensor property read keeps its spelling (`"T"`, `"mT"`), so `x.T` and `x.t()` differ."""
    short = func_name.rsplit(".", 1)[-1]
    if short in _CASED_NAMES:
        return short
    name = short.strip("_").lower()
    if name.startswith("r") and func_name.startswith("__r") and func_name.endswith("__"):
        name = name[1:]  # __radd__ -> add
    if name.startswith("i") and func_name.startswith("__i") and func_name.endswith("__") and name[1:] in _INPLACE_DUNDERS:
        name = name[1:]  # __iadd__ -> add
    return name or "op"


_INPLACE_DUNDERS = {"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift", "rshift"}


def build_trace(
    model_info: ModelInfo,
    events: EventLog | Iterable[Any],
    *,
    output: Any = None,
    output_state: str | None = None,
    provenance: Provenance,
    options: Any = None,
    backend: Any = None,
    cost: Cost | None = None,
) -> Trace:
    """Build a `Trace` from a model description and the raw events of one capture."""
    evs = events.events if isinstance(events, EventLog) else list(events)
    trace = Trace()
    trace.provenance = provenance
    trace.options = options
    trace._backend = backend
    trace._output = output
    trace._output_state = output_state

    _build_modules(trace, model_info)

    # pass 1: layers and provisional ids -------------------------------------------------
    layer_of_key: dict[Any, Layer] = {}
    type_counts: dict[str, int] = {}
    kind_counts: dict[str, int] = {}
    step = 0
    op_of_event: dict[int, Op] = {}
    ordered_ops: list[Op] = []
    open_calls: list[ModuleCall] = []
    mod_calls = trace._module_calls

    for ev in evs:
        if isinstance(ev, OpEvent):
            op = Op()
            op.event_id = ev.id
            op.kind = ev.kind
            op.func_name = ev.func_name
            op.parent_slots = ev.parents
            op.shapes = ev.shapes
            op.dtypes = ev.dtypes
            op.multi_output = ev.multi_output
            op.path = ev.path
            op._outputs = ev.outputs
            op.saved = ev.saved
            op.meta = ev.meta
            op.func = ev.func
            op.args_template = ev.args_template
            op.kwargs_template = ev.kwargs_template
            op.is_inplace = ev.is_inplace
            op.params = ev.params
            op.site = ev.site
            op._trace = trace
            op.module_calls = tuple(f"{a}:{c}" for a, c in ev.module_stack)
            op.modules = tuple(a for a, _ in ev.module_stack)
            op.module = op.modules[-1] if op.modules else None

            if ev.kind in _SOURCE_KINDS:
                n = kind_counts.get(ev.kind, 0) + 1
                kind_counts[ev.kind] = n
                layer = Layer(f"{ev.kind}_{n}", ev.kind, ev.kind, op.module, op.modules)
                layer.type_num, layer.step_num = n, 0
                layer._trace = trace
                trace._layers[layer.label] = layer
            else:
                key = (op.module, ev.site, ev.func_name, ev.kind) if ev.site is not None else ("#", ev.id)
                layer = layer_of_key.get(key)
                if layer is None:
                    t = normalize_type(ev.func_name) if ev.kind != "constant" else "constant"
                    tn = type_counts.get(t, 0) + 1
                    type_counts[t] = tn
                    step += 1
                    layer = Layer(f"{t}_{tn}_{step}", ev.func_name, ev.kind, op.module, op.modules)
                    layer.type_num, layer.step_num = tn, step
                    layer._trace = trace
                    layer_of_key[key] = layer
                    trace._layers[layer.label] = layer
            layer.ops.append(op)
            op.layer_label = layer.label
            op.pass_number = len(layer.ops)
            op.type_num, op.step_num = layer.type_num, layer.step_num
            op_of_event[ev.id] = op
            ordered_ops.append(op)
        elif isinstance(ev, ModuleEnter):
            call = ModuleCall(ev.address, ev.call)
            call._trace = trace
            call.input_labels = ev.input_ids  # resolved below
            mod = trace._modules.get(ev.address)
            if mod is None:  # a module the description missed: record it rather than drop it
                mod = Module(ev.address, "?", "?", _parent_address(ev.address), (ev.address,), False)
                mod._trace = trace
                trace._modules[ev.address] = mod
            mod.calls.append(call)
            mod_calls[call.label] = call
            open_calls.append(call)
        elif isinstance(ev, ModuleExit):
            call = mod_calls.get(f"{ev.address}:{ev.call}")
            if call is not None:
                call.output_labels = ev.output_ids  # resolved below

    # pass 2: final labels ----------------------------------------------------------------
    for op in ordered_ops:
        layer = trace._layers[op.layer_label]
        op.num_passes = len(layer.ops)
        op.label = op.layer_label if op.num_passes == 1 else f"{op.layer_label}:{op.pass_number}"
    for i, op in enumerate(ordered_ops):
        op.index = i
        trace._ops[op.label] = op

    # edges ---------------------------------------------------------------------------
    for op in ordered_ops:
        parents = []
        for pid, _slot in op.parent_slots:
            p = op_of_event.get(pid)
            if p is None:
                continue
            parents.append(p.label)
            if not p.children or p.children[-1] != op.label:
                if op.label not in p.children:
                    p.children.append(op.label)
        op.parents = tuple(dict.fromkeys(parents))

    # module calls: ops, inputs, outputs ----------------------------------------------------
    for op in ordered_ops:
        for cl in op.module_calls:
            call = mod_calls.get(cl)
            if call is not None:
                call.op_labels.append(op.label)
    output_slots: dict[str, list[list]] = {}
    for call in mod_calls.values():
        ids = call.output_labels
        call.input_labels = _resolve_ids(call.input_labels, op_of_event)
        call.output_labels = _resolve_ids(ids, op_of_event)
        slots = _output_slots(ids, op_of_event)
        if slots is not None:
            output_slots[call.label] = slots
    if output_slots:  # saved with the trace: a loaded trace's calls return the same slots
        trace.annotations["module_output_slots"] = output_slots

    # params and buffers ---------------------------------------------------------------------
    for op in ordered_ops:
        for addr in op.params:
            p = trace._params.get(addr)
            if p is not None:
                p.consumer_labels.append(op.label)
        if op.kind == "buffer" and op.path in trace._buffers:
            trace._buffers[op.path].op_labels.append(op.label)
        for addr in op.meta.get("buffer_write", ()) if op.meta else ():  # every recorded write is a version
            if addr in trace._buffers and op.label not in trace._buffers[addr].op_labels:
                trace._buffers[addr].op_labels.append(op.label)

    drop_uncalled_modules(trace)
    trace.cost = cost or _cost(trace)
    stamp_params = port("stamp_params")

    stamp_params(trace)  # replay refuses parameters changed after this point
    return trace


def drop_uncalled_modules(trace: Trace) -> None:
    """An uncalled module has no Module record (spec glossary, "Module filters"): record the
    addresses of the modules without a call in `trace.uncalled_modules`, drop their records
    and their entries in their parents' `children`. Their parameters and buffers stay (a
    called module's `all_param_addresses` counts them, as torch's `parameters()` does).
    The root `self` keeps its record: it is the trace's module tree."""
    uncalled = [a for a, m in trace._modules.items() if not m.calls and a != "self"]
    trace.uncalled_modules = list(dict.fromkeys([*trace.uncalled_modules, *uncalled]))
    gone = set(trace.uncalled_modules)
    for a in gone:
        trace._modules.pop(a, None)
    for m in trace._modules.values():
        if any(c in gone for c in m.children):
            m.children = [c for c in m.children if c not in gone]


def _output_slots(ids: Any, op_of_event: dict[int, Op]) -> list[list] | None:
    """`[[op label, slot], ...]` for a module call's returned tensors, in return order, when
    the labels alone would say more or less than the call returned: a multi-output op of
    which only some slots were returned (a router's `topk(...)[1]`), or one op returned in
    several slots (both outputs of `torch.max`). None when each label is one whole output."""
    pairs = []
    for pid, slot in ids or ():
        op = op_of_event.get(pid)
        if op is not None:
            pairs.append([op.label, slot])
    if not any(op_of_event[pid].multi_output for pid, _ in ids or () if pid in op_of_event):
        return None
    return pairs


def _resolve_ids(ids: Any, op_of_event: dict[int, Op]) -> list[str]:
    out: list[str] = []
    for pid, _slot in ids or ():
        op = op_of_event.get(pid)
        if op is not None and op.label not in out:
            out.append(op.label)
    return out


def _parent_address(address: str) -> str | None:
    if address == "self":
        return None
    return address.rpartition(".")[0] or "self"


def _build_modules(trace: Trace, info: ModelInfo) -> None:
    for mi in info.modules:
        parent = mi.parent if mi.parent is not None else _parent_address(mi.address)
        mod = Module(mi.address, mi.class_name, mi.class_qualname, parent, tuple(mi.all_addresses), mi.training)
        mod._trace = trace
        trace._modules[mi.address] = mod
    if "self" not in trace._modules:
        mod = Module("self", info.root_class, info.root_class, None, ("self",), False)
        mod._trace = trace
        trace._modules = {"self": mod, **trace._modules}
    for addr, mod in trace._modules.items():
        if mod.parent is not None and mod.parent in trace._modules:
            trace._modules[mod.parent].children.append(addr)
    for pi in info.params:
        p = Param(pi.address, pi.module, pi.name, pi.shape, pi.dtype, pi.trainable, pi.value, pi.device,
                  pi.aliases)
        p._trace = trace
        trace._params[pi.address] = p
        if pi.module in trace._modules:
            trace._modules[pi.module].param_addresses.append(pi.address)
    for bi in info.buffers:
        b = Buffer(bi.address, bi.module, bi.name, bi.shape, bi.dtype, bi.value, bi.persistent, bi.device)
        b._trace = trace
        trace._buffers[bi.address] = b
        if bi.module in trace._modules:
            trace._modules[bi.module].buffer_addresses.append(bi.address)


def _cost(trace: Trace) -> Cost:
    c = Cost()
    for op in trace._ops.values():
        f = op.meta.get("flops")
        if f is not None:
            c.total_flops += f
            c.num_ops_with_flops += 1
        m = op.meta.get("macs")
        if m is not None:
            c.total_macs += m
            k = normalize_type(op.func_name)
            c.macs_by_kind[k] = c.macs_by_kind.get(k, 0) + m
        if op.kind not in ("output",):
            c.total_activation_memory += op.nbytes
    c.total_param_memory = sum(p.nbytes for p in trace._params.values())
    return c
