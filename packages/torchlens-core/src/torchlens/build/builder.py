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

Cost (issue 26: this runs after every forward and is part of the capture's time): records are
made without their constructors (every slot set directly); strings and tuples that repeat from
capture to capture (module-stack fields, labels, byte counts) come from small value-keyed
caches; and a capture whose events equal an earlier capture's wherever the linking reads them
(`_event_sigs`) takes that capture's links from a `_Plan` instead of computing them again.
Every path makes the same records: `tests/test_build_cost.py` compares them.
"""

from __future__ import annotations

import gc
from typing import Any, Iterable

from torchlens.build.events import EventLog, ModelInfo, ModuleEnter, ModuleExit, OpEvent
from torchlens.records.collections import OwnedRecords
from torchlens.records.module import Buffer, Module, ModuleCall, Param
from torchlens.records.op import Layer, Op
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

    One pass over the events groups ops into layers and counts passes; a walk over the ops in
    execution order gives the final labels, the edges, module-call membership, parameter
    consumers and buffer versions, and a last one the cost totals. A capture whose events
    repeat an earlier capture's takes the links from that capture's plan (module docstring).
    Per-event work is kept to attribute copies and dict lookups: this runs after every
    forward and is part of the capture's cost. Python's cyclic collector is paused
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


#: (module stack) -> (its call labels, its addresses, its innermost address): plain strings, the
#: same for every capture of a model (module stacks repeat from capture to capture); emptied
#: when it grows past `_STACKS_MAX` entries
_STACK_INFO: dict[tuple, tuple] = {}
_STACKS_MAX = 1 << 14
#: (output shapes, output dtype names) -> bytes (`Op.nbytes` without a recorded "nbytes");
#: emptied past `_STACKS_MAX` entries
_NBYTES: dict[tuple, int] = {}
#: module address -> its parent's address (`_parent_address`), cached the same way
_PARENT_OF: dict[str, str | None] = {}
#: (type token, type number, step number) -> layer label, and (address, call number) -> call
#: label, cached the same way (labels repeat from capture to capture)
_LABELS: dict[tuple, str] = {}
#: func_name -> `normalize_type(func_name)`, cached the same way
_TYPE_OF: dict[str, str] = {}

_new = object.__new__
_new_list = list.__new__


def _stack_info(ms: Any) -> tuple:
    """`(module_calls, modules, module)` of an op's module stack (see `_STACK_INFO`)."""
    try:
        got = _STACK_INFO.get(ms) if type(ms) is tuple else None
    except TypeError:  # a tuple holding something unhashable: not cached
        return _stack_fields(ms)
    if got is None:
        got = _stack_fields(ms)
        if type(ms) is tuple:
            if len(_STACK_INFO) >= _STACKS_MAX:
                _STACK_INFO.clear()
            _STACK_INFO[ms] = got
    return got


def _stack_fields(ms: Any) -> tuple:
    addrs = tuple([a for a, _ in ms])
    return tuple([f"{a}:{c}" for a, c in ms]), addrs, addrs[-1] if addrs else None


def _build(model_info: ModelInfo, events: EventLog | Iterable[Any], output: Any, output_state: str | None,
           provenance: Provenance, options: Any, backend: Any, cost: Cost | None) -> Trace:
    # Records are made here without their constructors (`object.__new__` and every slot the
    # constructor sets, set directly: a call per record is a measurable part of the build);
    # `tests/test_build_cost.py` checks they read as constructor-made ones.
    evs = events.events if isinstance(events, EventLog) else list(events)
    trace = Trace(provenance)
    trace.options = options
    trace._backend = backend
    trace._output = output
    trace._output_state = output_state

    param_bytes = _build_modules(trace, model_info)
    # A capture whose events match an earlier capture's, field for field where the links
    # read them (`_event_sigs`), over the same module, parameter and buffer addresses, gets
    # the links that capture computed (`_Plan`): labels, passes, edges, call members. The
    # first capture of a structure keeps its signatures only; the second, when equal, makes
    # the plan; the later ones use it.
    sigs = _event_sigs(evs)
    keys = (tuple(trace._modules), tuple(trace._params), tuple(trace._buffers))
    pkey = (len(evs), len(keys[0]), len(keys[1]), len(keys[2]))
    plan = _PLANS.get(pkey) if sigs is not None else None
    if plan is not None and plan.keys == keys and plan.sigs == sigs:
        if plan.ops is not None:
            ordered_ops = _link_planned(trace, evs, plan)
        else:
            ordered_ops, calls = _link(trace, evs)
            _remember_plan(pkey, keys, sigs, trace, ordered_ops, calls)
    else:
        ordered_ops, _ = _link(trace, evs)
        if sigs is not None:
            _remember_sigs(pkey, keys, sigs)

    drop_uncalled_modules(trace)
    if cost is None:
        cost = _cost_totals(ordered_ops)
        cost.total_param_memory = param_bytes
    trace.cost = cost
    stamp_params = port("stamp_params")

    stamp_params(trace)  # replay refuses parameters changed after this point
    return trace


def _link(trace: Trace, evs: list) -> tuple[list[Op], list[ModuleCall]]:
    """The Op, Layer and ModuleCall records of the events, linked: labels, passes, edges,
    call members, parameter consumers and buffer versions. Returns the ops in execution
    order and the calls in the order they started."""
    # pass 1: layers and provisional ids -------------------------------------------------
    layer_of_key: dict[Any, Layer] = {}
    type_counts: dict[str, int] = {}
    kind_counts: dict[str, int] = {}
    type_of = _TYPE_OF  # func_name -> type token
    if len(type_of) >= _STACKS_MAX:
        type_of.clear()
    stacks: dict[int, tuple] = {}  # id(module_stack) -> _stack_info(module_stack)
    step = 0
    op_of_event: dict[int, Op] = {}
    ordered_ops: list[Op] = []
    op_lops: list[list] = []  # per op, its layer's op list (its length at the end: the layer's passes)
    mod_calls = trace._module_calls
    layers = trace._layers
    modules = trace._modules
    append_op = ordered_ops.append
    append_lops = op_lops.append
    call_of: dict[tuple, ModuleCall] = {}  # (address, call number) -> its ModuleCall
    started: list[ModuleCall] = []  # every call, in the order they started
    _OpEvent, _ModuleEnter, _ModuleExit = OpEvent, ModuleEnter, ModuleExit
    _Op, _Layer, _ModuleCall, _Owned = Op, Layer, ModuleCall, OwnedRecords
    source_kinds = _SOURCE_KINDS
    index = 0
    labels_of = _LABELS
    if len(labels_of) >= _STACKS_MAX:
        labels_of.clear()

    for ev in evs:
        cls = type(ev)
        if cls is _OpEvent or (cls is not _ModuleEnter and cls is not _ModuleExit and isinstance(ev, OpEvent)):
            op = _new(_Op)
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
            op.children = []
            op.grads = None
            op._trace = trace
            op.index = index
            index += 1
            op.label = None  # set below (read early only by a child recorded before its parent)
            ms = ev.module_stack
            cached = stacks.get(id(ms)) if type(ms) is tuple else None
            if cached is None:
                cached = _stack_info(ms)
                if type(ms) is tuple:
                    stacks[id(ms)] = cached  # the events hold the tuple: its id is stable here
            op.module_calls, op.modules, op.module = cached
            module = cached[2]

            if kind in source_kinds:
                n = kind_counts.get(kind, 0) + 1
                kind_counts[kind] = n
                layer = _new(_Layer)
                layer.label = label = f"{kind}_{n}"
                layer.func_name = layer.kind = kind
                layer.type_num = n
                layer.step_num = 0
                new_layer = True
            else:
                key = (module, site, func_name, kind) if site is not None else ("#", eid)
                layer = layer_of_key.get(key)
                new_layer = layer is None
                if new_layer:
                    if kind == "constant":
                        t = "constant"
                    else:
                        t = type_of.get(func_name)
                        if t is None:
                            t = type_of[func_name] = normalize_type(func_name)
                    tn = type_counts.get(t, 0) + 1
                    type_counts[t] = tn
                    step += 1
                    layer = layer_of_key[key] = _new(_Layer)
                    lkey = (t, tn, step)
                    label = labels_of.get(lkey)
                    if label is None:
                        label = labels_of[lkey] = f"{t}_{tn}_{step}"
                    layer.label = label
                    layer.func_name = func_name
                    layer.kind = kind
                    layer.type_num = tn
                    layer.step_num = step
            if new_layer:
                layer.module = module
                layer.modules = cached[1]
                layer._ops = lops = _new_list(_Owned)
                lops._owner = layer
                layer._trace = trace
                layers[label] = layer
                lops.append(op)
                op.pass_number = 1
            else:
                label = layer.label
                lops = layer._ops
                lops.append(op)
                op.pass_number = len(lops)
            op.layer_label = label
            op.type_num = layer.type_num
            op.step_num = layer.step_num
            op_of_event[eid] = op
            append_op(op)
            append_lops(lops)
        elif cls is _ModuleEnter or (cls is not _ModuleExit and isinstance(ev, ModuleEnter)):
            address, number = ev.address, ev.call
            call = _new(_ModuleCall)
            call.address = address
            call.call = number
            ckey = (address, number)
            label = labels_of.get(ckey)
            if label is None:
                label = labels_of[ckey] = f"{address}:{number}"
            call.label = label
            call.op_labels = []
            call.input_labels = ev.input_ids  # resolved below
            call.output_labels = []
            call._trace = trace
            mod = modules.get(address)
            if mod is None:  # a module the description missed: record it rather than drop it
                mod = Module(address, "?", "?", _parent_address(address), (address,), False)
                mod._trace = trace
                modules[address] = mod
            mod._calls.append(call)
            mod_calls[label] = call
            started.append(call)
            call_of[ckey] = call  # (the exit finds it without formatting its label)
        elif isinstance(ev, ModuleExit):
            call = call_of.get((ev.address, ev.call))
            if call is not None:
                call.output_labels = ev.output_ids  # resolved below

    # final labels, edges, module calls, params and buffers, cost totals -----------------------
    # (one walk in execution order: a parent's final label is set before its children read it)
    ops_by_label = trace._ops
    params = trace._params
    buffers = trace._buffers
    calls_cache: dict[int, list] = {}  # id(op.module_calls) -> the ModuleCall records
    for op, lops in zip(ordered_ops, op_lops):
        n = len(lops)
        op.num_passes = n
        op.label = label = op.layer_label if n == 1 else f"{op.layer_label}:{op.pass_number}"
        ops_by_label[label] = op
        slots = op.parent_slots
        if slots:
            if len(slots) == 1:
                p = op_of_event.get(slots[0][0])
                if p is None:
                    op.parents = ()
                else:
                    op.parents = (p.label or _final_label(p, layers),)
                    ch = p.children
                    if not ch or ch[-1] != label:
                        if label not in ch:
                            ch.append(label)
            else:
                parents = []
                for pid, _slot in slots:
                    p = op_of_event.get(pid)
                    if p is None:
                        continue
                    parents.append(p.label or _final_label(p, layers))
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
                calls = calls_cache[id(mcs)] = []
                for cl in mcs:
                    c = mod_calls.get(cl)
                    if c is not None:
                        calls.append(c.op_labels)
            for call_ops in calls:
                call_ops.append(label)
        for addr in op.params:
            p = params.get(addr)
            if p is not None:
                p.consumer_labels.append(label)
        if op.kind == "buffer" and op.path in buffers:
            buffers[op.path].op_labels.append(label)
        meta = op.meta
        if meta:
            for addr in meta.get("buffer_write", ()):  # every recorded write is a version
                if addr in buffers and label not in buffers[addr].op_labels:
                    buffers[addr].op_labels.append(label)
    output_slots: dict[str, list[list]] = {}
    for call in mod_calls.values():
        # `_resolve_ids` and `_output_slots` in one walk (one returned tensor is the common case)
        ids = call.input_labels
        labels: list[str] = []
        for pid, _slot in ids or ():
            op = op_of_event.get(pid)
            if op is not None and op.label not in labels:
                labels.append(op.label)
        call.input_labels = labels
        ids = call.output_labels
        labels = []
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
    return ordered_ops, started


#: (events, modules, params, buffers counts) -> the `_Plan` of the last capture with those
#: counts: at most `_PLANS_MAX` plans over at most `_PLAN_EVENTS_MAX` events (the oldest go first)
_PLANS: dict[tuple, "_Plan"] = {}
_PLANS_MAX = 16
_PLAN_EVENTS_MAX = 1 << 18


def _event_sigs(evs: list) -> list | None:
    """Per event, every field `_link` reads from it to link the records (not the payloads,
    shapes or metadata it copies or totals): equal signatures and equal record addresses give
    equal links. None when an event is not exactly one of the three event classes."""
    sigs: list[tuple] = []
    append = sigs.append
    _OpEvent, _ModuleEnter, _ModuleExit = OpEvent, ModuleEnter, ModuleExit
    for ev in evs:
        cls = type(ev)
        if cls is _OpEvent:
            meta = ev.meta
            append((ev.id, ev.kind, ev.func_name, ev.site, ev.module_stack, ev.parents, ev.params, ev.path,
                    ev.multi_output, meta.get("buffer_write", ()) if meta else ()))
        elif cls is _ModuleEnter:
            append((cls, ev.address, ev.call, ev.input_ids))
        elif cls is _ModuleExit:
            append((cls, ev.address, ev.call, ev.output_ids))
        else:
            return None
    return sigs


class _Plan:
    """What `_link` computed for one capture's events, as plain immutable values (no record,
    payload or model object): `_link_planned` makes the same records from it for a capture
    whose `_event_sigs` and record addresses are equal."""

    __slots__ = ("keys", "sigs", "ops", "layers", "calls", "consumers", "versions", "output_slots")


def _frozen(value: Any) -> tuple:
    """(is a list, the items as a tuple): a call's label list, or the raw ids a call whose
    label a later call reused keeps."""
    return (type(value) is list, tuple(value) if type(value) is list else value)


def _keep(pkey: tuple, plan: _Plan) -> None:
    """Publish `plan` (complete: never changed afterwards), evicting the oldest plans first."""
    _PLANS.pop(pkey, None)
    if len(plan.sigs) > _PLAN_EVENTS_MAX:
        return
    while _PLANS and (len(_PLANS) >= _PLANS_MAX
                      or sum(len(p.sigs) for p in list(_PLANS.values())) + len(plan.sigs) > _PLAN_EVENTS_MAX):
        try:
            _PLANS.pop(next(iter(_PLANS)), None)
        except (StopIteration, RuntimeError):  # another thread changed the table: retry on its state
            continue
    _PLANS[pkey] = plan


def _remember_sigs(pkey: tuple, keys: tuple, sigs: list) -> None:
    """Keep a capture's signatures (a `_Plan` without links) for the next capture to compare with."""
    plan = _Plan()
    plan.keys, plan.sigs, plan.ops = keys, sigs, None
    _keep(pkey, plan)


def _remember_plan(pkey: tuple, keys: tuple, sigs: list, trace: Trace, ordered_ops: list[Op],
                   calls: list[ModuleCall]) -> None:
    """Keep the links `_link` made for events whose signatures an earlier capture's equalled."""
    try:
        hash(tuple(sigs))  # plain immutable values only (a list in an event could change later)
    except TypeError:
        _PLANS.pop(pkey, None)
        return
    plan = _Plan()
    plan.keys, plan.sigs = keys, sigs
    plan.ops = [(op.label, op.layer_label, op.index, op.pass_number, op.num_passes, op.type_num, op.step_num,
                 op.parents, op.module_calls, op.modules, op.module, tuple(op.children)) for op in ordered_ops]
    plan.layers = [(lay.label, lay.func_name, lay.kind, lay.module, lay.modules, lay.type_num, lay.step_num,
                    tuple([op.index for op in lay._ops])) for lay in trace._layers.values()]
    plan.calls = [(c.address, c.call, c.label, tuple(c.op_labels), _frozen(c.input_labels), _frozen(c.output_labels))
                  for c in calls]
    plan.consumers = tuple((a, tuple(p.consumer_labels)) for a, p in trace._params.items() if p.consumer_labels)
    plan.versions = tuple((a, tuple(b.op_labels)) for a, b in trace._buffers.items() if b.op_labels)
    slots = trace.annotations.get("module_output_slots")
    plan.output_slots = None if slots is None else tuple(
        (k, None if v is None else tuple(tuple(pair) for pair in v)) for k, v in slots.items())
    _keep(pkey, plan)


def _link_planned(trace: Trace, evs: list, plan: _Plan) -> list[Op]:
    """`_link`'s records for events whose signatures equal `plan.sigs` (see `_Plan`)."""
    ordered_ops: list[Op] = []
    append_op = ordered_ops.append
    ops_by_label = trace._ops
    mod_calls = trace._module_calls
    modules = trace._modules
    plan_ops = iter(plan.ops)
    plan_calls = iter(plan.calls)
    _OpEvent, _ModuleEnter = OpEvent, ModuleEnter
    _Op, _Layer, _ModuleCall, _Owned = Op, Layer, ModuleCall, OwnedRecords
    for ev in evs:
        cls = type(ev)
        if cls is _OpEvent:
            op = _new(_Op)
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
            (label, op.layer_label, op.index, op.pass_number, op.num_passes, op.type_num, op.step_num,
             op.parents, op.module_calls, op.modules, op.module, children) = next(plan_ops)
            op.label = label
            op.children = list(children) if children else []
            op.grads = None
            op._trace = trace
            ops_by_label[label] = op
            append_op(op)
        elif cls is _ModuleEnter:
            address, number, label, op_labels, (in_list, in_labels), (out_list, out_labels) = next(plan_calls)
            call = _new(_ModuleCall)
            call.address = address
            call.call = number
            call.label = label
            call.op_labels = list(op_labels)
            call.input_labels = list(in_labels) if in_list else in_labels
            call.output_labels = list(out_labels) if out_list else out_labels
            call._trace = trace
            mod = modules.get(address)
            if mod is None:  # a module the description missed (as `_link` records it)
                mod = Module(address, "?", "?", _parent_address(address), (address,), False)
                mod._trace = trace
                modules[address] = mod
            mod._calls.append(call)
            mod_calls[label] = call
    layers = trace._layers
    for label, func_name, kind, module, mods, type_num, step_num, indices in plan.layers:
        layer = _new(_Layer)
        layer.label = label
        layer.func_name = func_name
        layer.kind = kind
        layer.module = module
        layer.modules = mods
        layer.type_num = type_num
        layer.step_num = step_num
        layer._ops = lops = _new_list(_Owned)
        lops._owner = layer
        lops.extend([ordered_ops[i] for i in indices])
        layer._trace = trace
        layers[label] = layer
    params = trace._params
    for address, labels in plan.consumers:
        params[address].consumer_labels = list(labels)
    buffers = trace._buffers
    for address, labels in plan.versions:
        buffers[address].op_labels = list(labels)
    if plan.output_slots is not None:
        trace.annotations["module_output_slots"] = {
            k: None if v is None else [list(pair) for pair in v] for k, v in plan.output_slots}
    return ordered_ops


def _cost_totals(ordered_ops: list[Op]) -> Cost:
    """A Cost with the totals the ops' metadata gives (flops, macs, activation bytes)."""
    total_flops = total_macs = activation = 0
    num_flops = 0
    macs_by_kind: dict[str, int] = {}
    nbytes_of = _NBYTES
    if len(nbytes_of) >= _STACKS_MAX:
        nbytes_of.clear()
    type_of = _TYPE_OF
    for op in ordered_ops:
        meta = op.meta
        if meta:
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
        if op.kind != "output":
            nb = meta.get("nbytes") if meta else None
            if nb is None:  # `Op.nbytes`, one computation per (shapes, dtypes)
                key = (op.shapes, op.dtypes)
                try:
                    nb = nbytes_of.get(key)
                except TypeError:  # an unhashable shape
                    nb = op.nbytes
                else:
                    if nb is None:
                        nb = nbytes_of[key] = op.nbytes
            activation += nb
    cost = Cost()
    if num_flops:
        cost.total_flops += total_flops
        cost.num_ops_with_flops += num_flops
    if macs_by_kind:
        cost.total_macs += total_macs
        cost.macs_by_kind = macs_by_kind
    cost.total_activation_memory += activation
    return cost


def _final_label(op: Op, layers: dict[str, Layer]) -> str:
    """An op's final label before the walk reaches it (its child came first in the log)."""
    n = len(layers[op.layer_label]._ops)
    op.label = label = op.layer_label if n == 1 else f"{op.layer_label}:{op.pass_number}"
    return label


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
        if not gone.isdisjoint(m.children):
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


def _parent_address(address: str) -> str | None:
    if address == "self":
        return None
    return address.rpartition(".")[0] or "self"


def _build_modules(trace: Trace, info: ModelInfo) -> int:
    """The Module, Param and Buffer records of `info` on `trace` (fresh records, made as their
    constructors make them); returns the parameters' bytes (`Cost.total_param_memory`)."""
    modules = trace._modules
    _Module, _Owned = Module, OwnedRecords
    parent_of = _PARENT_OF
    if len(parent_of) >= _STACKS_MAX:
        parent_of.clear()
    in_order = True  # every parent made before its children: children lists filled as we go
    made = 0
    for mi in info.modules:
        made += 1
        address = mi.address
        parent = mi.parent
        if parent is None:
            parent = parent_of.get(address, False)
            if parent is False:
                parent = parent_of[address] = _parent_address(address)
        mod = _new(_Module)
        mod.address = address
        mod.class_name = mi.class_name
        mod.class_qualname = mi.class_qualname
        mod.parent = parent
        mod.children = []
        mod._calls = calls = _new_list(_Owned)
        calls._owner = mod
        mod.param_addresses = []
        mod.buffer_addresses = []
        mod.all_addresses = tuple(mi.all_addresses) or (address,)
        mod.training = mi.training
        mod._attribute_writes = None
        mod._trace = trace
        if parent is not None and in_order:
            up = modules.get(parent)
            if up is not None:
                up.children.append(address)
            else:
                in_order = False
        modules[address] = mod
    if made != len(modules):  # an address described twice: its last record stands
        in_order = False
    if "self" not in modules:
        mod = Module("self", info.root_class, info.root_class, None, ("self",), False)
        mod._trace = trace
        trace._modules = modules = {"self": mod, **modules}
        in_order = False
    if not in_order:  # children in the records' order, whatever the description's order
        for mod in modules.values():
            mod.children = []
        for addr, mod in modules.items():
            if mod.parent is not None and mod.parent in modules:
                modules[mod.parent].children.append(addr)
    params = trace._params
    _Param = Param
    nbytes_of = _NBYTES
    param_bytes = 0
    for pi in info.params:
        address, owner, shape, dtype = pi.address, pi.module, tuple(pi.shape), pi.dtype
        p = _new(_Param)
        p.address = address
        p.module = owner
        p.name = pi.name
        p.shape = shape
        p.dtype = dtype
        p.trainable = pi.trainable
        p.value = pi.value
        p.device = pi.device
        p.consumer_labels = []
        p.aliases = tuple(pi.aliases)
        p._trace = trace
        params[address] = p
        mod = modules.get(owner)
        if mod is not None:
            mod.param_addresses.append(address)
        key = ((shape,), (dtype,))  # (`Param.nbytes` is `Op.nbytes` of one such output)
        try:
            nb = nbytes_of.get(key)
        except TypeError:  # an unhashable shape
            nb = p.nbytes
        else:
            if nb is None:
                nb = nbytes_of[key] = p.nbytes
        param_bytes += nb
    if len(params) != len(info.params):  # an address described twice: count each record once
        param_bytes = sum(p.nbytes for p in params.values())
    buffers = trace._buffers
    _Buffer = Buffer
    for bi in info.buffers:
        address, owner = bi.address, bi.module
        b = _new(_Buffer)
        b.address = address
        b.module = owner
        b.name = bi.name
        b.shape = tuple(bi.shape)
        b.dtype = bi.dtype
        b.value = bi.value
        b.persistent = bi.persistent
        b.device = bi.device
        b.op_labels = []
        b._trace = trace
        buffers[address] = b
        mod = modules.get(owner)
        if mod is not None:
            mod.buffer_addresses.append(address)
    return param_bytes
