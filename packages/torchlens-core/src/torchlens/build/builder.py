"""Turn a backend's event stream into a Trace.

Labels, pass grouping, the module tree, module calls, parameter and buffer records and the
graph edges are computed here, once, for every backend.

Labelling rules:
- sources and sinks: `input_N`, `buffer_N`, `output_N` (N counts that kind);
- every other layer: `{type}_{type_num}_{step_num}`, where `type` is the callable's name
  lower-cased with underscores removed (`batchnorm`, `conv2d`, PyPI torchlens's token; see
  `normalize_type`), `type_num` counts layers of that type and `step_num` counts all such
  layers, both in order of first execution;
- a layer that ran more than once has pass-qualified op labels `label:1`, `label:2`, ...;
  single-pass layers' ops carry the bare label.

Pass grouping: two op events belong to the same Layer when they share (innermost module
address, call site, callable, kind). Running one place again (a loop, a module called again)
is a new pass; two places with the same weights are two layers.
"""

from __future__ import annotations

import gc
from typing import Any, Iterable

from torchlens.build.events import EventLog, ModelInfo, ModuleEnter, ModuleExit, OpEvent
from torchlens.records.module import Buffer, Module, ModuleCall, Param
from torchlens.records.op import Layer, Op, itemsize, numel
from torchlens.records.ports import port
from torchlens.records.trace import Cost, Provenance, Trace

_SOURCE_KINDS = {"input", "buffer", "output"}


def normalize_type(func_name: str) -> str:
    """The type token of an op's label: the callable's short name lower-cased with every
    underscore removed, the token PyPI torchlens uses, so labels read as its users know them:
    `"batch_norm"` -> `"batchnorm"`, `"scaled_dot_product_attention"` ->
    `"scaleddotproductattention"`, `"__add__"` and `"add_"` -> `"add"`, `"__iadd__"` ->
    `"iadd"`, `"__rsub__"` -> `"rsub"`, `"Tensor.view"` -> `"view"`, a property read `"T"` ->
    `"t"`. Lookups also accept the underscored spelling (`trace.ops["batch_norm_1_5"]`, see
    `torchlens.records.collections.label_alias`)."""
    return func_name.rsplit(".", 1)[-1].lower().replace("_", "") or "op"


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
    """Build a `Trace` from a model description and the raw events of one capture.

    One pass over the events groups ops into layers and counts passes; a walk over the ops
    gives the final labels, and one more (a parent always precedes its children) the edges,
    module-call membership, parameter consumers and cost totals together. Per-event work is kept to attribute copies and dict lookups: this runs after
    every forward and is part of the capture's cost. Python's cyclic collector is paused
    while the records are made (a few small objects per op would trigger full collections);
    it is set back as it was when the build returns or raises."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        return _build(model_info, events, output, output_state, provenance, options, backend, cost)
    finally:
        if paused:
            gc.enable()


def _build(model_info: ModelInfo, events: EventLog | Iterable[Any], output: Any, output_state: str | None,
           provenance: Provenance, options: Any, backend: Any, cost: Cost | None) -> Trace:
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
    type_of: dict[str, str] = {}  # func_name -> type token
    stacks: dict[int, tuple] = {}  # id(module_stack) -> (module_calls, modules, module)
    step = 0
    op_of_event: dict[int, Op] = {}
    ordered_ops: list[Op] = []
    mod_calls = trace._module_calls
    layers = trace._layers
    modules = trace._modules
    append_op = ordered_ops.append
    call_of: dict[tuple, ModuleCall] = {}  # (address, call number) -> its ModuleCall
    _OpEvent, _ModuleEnter, _ModuleExit = OpEvent, ModuleEnter, ModuleExit

    for ev in evs:
        cls = type(ev)
        if cls is _OpEvent or (cls is not _ModuleEnter and cls is not _ModuleExit and isinstance(ev, OpEvent)):
            op = Op()
            op.event_id = eid = ev.id
            op.kind = kind = ev.kind
            op.func_name = func_name = ev.func_name
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
            op.site = site = ev.site
            op._trace = trace
            ms = ev.module_stack
            cached = stacks.get(id(ms)) if type(ms) is tuple else None
            if cached is None:
                cached = (tuple(f"{a}:{c}" for a, c in ms), tuple(a for a, _ in ms))
                cached = cached + (cached[1][-1] if cached[1] else None,)
                if type(ms) is tuple:
                    stacks[id(ms)] = cached  # the events hold the tuple: its id is stable here
            op.module_calls, op.modules, op.module = cached
            module = cached[2]

            if kind in _SOURCE_KINDS:
                n = kind_counts.get(kind, 0) + 1
                kind_counts[kind] = n
                layer = Layer(f"{kind}_{n}", kind, kind, module, cached[1])
                layer.type_num, layer.step_num = n, 0
                layer._trace = trace
                layers[layer.label] = layer
            else:
                key = (module, site, func_name, kind) if site is not None else ("#", eid)
                layer = layer_of_key.get(key)
                if layer is None:
                    if kind == "constant":
                        t = "constant"
                    else:
                        t = type_of.get(func_name)
                        if t is None:
                            t = type_of[func_name] = normalize_type(func_name)
                    tn = type_counts.get(t, 0) + 1
                    type_counts[t] = tn
                    step += 1
                    layer = Layer(f"{t}_{tn}_{step}", func_name, kind, module, cached[1])
                    layer.type_num, layer.step_num = tn, step
                    layer._trace = trace
                    layer_of_key[key] = layer
                    layers[layer.label] = layer
            lops = layer._ops
            lops.append(op)
            op.layer_label = layer.label
            op.pass_number = len(lops)
            op.type_num, op.step_num = layer.type_num, layer.step_num
            op_of_event[eid] = op
            append_op(op)
        elif cls is _ModuleEnter or (cls is not _ModuleExit and isinstance(ev, ModuleEnter)):
            call = ModuleCall(ev.address, ev.call)
            call._trace = trace
            call.input_labels = ev.input_ids  # resolved below
            mod = modules.get(ev.address)
            if mod is None:  # a module the description missed: record it rather than drop it
                mod = Module(ev.address, "?", "?", _parent_address(ev.address), (ev.address,), False)
                mod._trace = trace
                modules[ev.address] = mod
            mod.calls.append(call)
            mod_calls[call.label] = call
            call_of[(ev.address, ev.call)] = call  # (the exit finds it without formatting its label)
        elif isinstance(ev, ModuleExit):
            call = call_of.get((ev.address, ev.call))
            if call is not None:
                call.output_labels = ev.output_ids  # resolved below

    # pass 2: final labels ----------------------------------------------------------------
    ops_by_label = trace._ops
    for i, op in enumerate(ordered_ops):
        lops = layers[op.layer_label]._ops
        n = len(lops)
        op.num_passes = n
        op.label = label = op.layer_label if n == 1 else f"{op.layer_label}:{op.pass_number}"
        op.index = i
        ops_by_label[label] = op

    # edges, module calls, params and buffers, cost totals ----------------------------------
    params = trace._params
    buffers = trace._buffers
    calls_cache: dict[int, list] = {}  # id(op.module_calls) -> the ModuleCall records
    total_flops = total_macs = activation = 0
    num_flops = 0
    macs_by_kind: dict[str, int] = {}
    nbytes_of: dict[tuple, int] = {}  # (shape, dtype) -> bytes
    for op in ordered_ops:
        label = op.label
        slots = op.parent_slots
        if slots:
            parents = []
            for pid, _slot in slots:
                p = op_of_event.get(pid)
                if p is None:
                    continue
                parents.append(p.label)
                ch = p.children
                if not ch or ch[-1] != label:
                    if label not in ch:
                        ch.append(label)
            op.parents = tuple(dict.fromkeys(parents)) if len(parents) > 1 else tuple(parents)
        else:
            op.parents = ()
        mcs = op.module_calls
        if mcs:
            calls = calls_cache.get(id(mcs))
            if calls is None:
                calls = calls_cache[id(mcs)] = [c for c in (mod_calls.get(cl) for cl in mcs) if c is not None]
            for call in calls:
                call.op_labels.append(label)
        for addr in op.params:
            p = params.get(addr)
            if p is not None:
                p.consumer_labels.append(label)
        kind = op.kind
        if kind == "buffer" and op.path in buffers:
            buffers[op.path].op_labels.append(label)
        meta = op.meta
        if meta:
            for addr in meta.get("buffer_write", ()):  # every recorded write is a version
                if addr in buffers and label not in buffers[addr].op_labels:
                    buffers[addr].op_labels.append(label)
            f = meta.get("flops")
            if f is not None:
                total_flops += f
                num_flops += 1
            m = meta.get("macs")
            if m is not None:
                total_macs += m
                k = type_of.get(op.func_name)
                if k is None:
                    k = type_of[op.func_name] = normalize_type(op.func_name)
                macs_by_kind[k] = macs_by_kind.get(k, 0) + m
        if kind != "output":
            nb = meta.get("nbytes") if meta else None
            if nb is None:
                shapes, dtypes = op.shapes, op.dtypes
                if len(shapes) == 1 and len(dtypes) == 1 and type(shapes[0]) is tuple:  # Op.nbytes, common case
                    key = (shapes[0], dtypes[0])
                    nb = nbytes_of.get(key)
                    if nb is None:
                        nb = nbytes_of[key] = numel(shapes[0]) * itemsize(dtypes[0])
                else:
                    nb = op.nbytes
            activation += nb
    output_slots: dict[str, list[list]] = {}
    for call in mod_calls.values():
        ids = call.output_labels
        call.input_labels = _resolve_ids(call.input_labels, op_of_event)
        # `_resolve_ids` and `_output_slots` in one walk (one returned tensor is the common case)
        labels: list[str] = []
        multi = False
        for pid, _slot in ids or ():
            op = op_of_event.get(pid)
            if op is not None:
                if op.multi_output:
                    multi = True
                if op.label not in labels:
                    labels.append(op.label)
        call.output_labels = labels
        if multi:
            output_slots[call.label] = _output_slots(ids, op_of_event)
    if output_slots:  # saved with the trace: a loaded trace's calls return the same slots
        trace.annotations["module_output_slots"] = output_slots

    drop_uncalled_modules(trace)
    if cost is None:
        cost = Cost()
        if num_flops:
            cost.total_flops += total_flops
            cost.num_ops_with_flops += num_flops
        if macs_by_kind:
            cost.total_macs += total_macs
            cost.macs_by_kind = macs_by_kind
        cost.total_activation_memory += activation
        param_bytes = 0
        for p in params.values():  # `Param.nbytes`, with one computation per (shape, dtype)
            key = (p.shape, p.dtype)
            nb = nbytes_of.get(key) if type(p.shape) is tuple else None
            if nb is None:
                nb = p.nbytes
                if type(p.shape) is tuple:
                    nbytes_of[key] = nb
            param_bytes += nb
        cost.total_param_memory = param_bytes
    trace.cost = cost
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
    if not gone:
        return  # every module ran (the common case)
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
