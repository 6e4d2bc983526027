"""The builder's cheap paths read exactly like its plain one (issue 26: build cost).

`torchlens.build.builder` makes records without calling their constructors and, for a capture
whose events match an earlier capture's (`_event_sigs`), copies that capture's links from a
`_Plan` instead of computing them. Each test compares against an independent reading: records
made by the constructors, or a build with every builder cache emptied (the plain path, which
`packages/torchlens-core/tests/test_records.py` checks against hand-computed labels and edges).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from torchlens.build import builder as B
from torchlens.build.events import BufferInfo, ModelInfo, ModuleEnter, ModuleExit, ModuleInfo, OpEvent, ParamInfo
from torchlens.records.collections import OwnedRecords
from torchlens.records.module import Buffer, Module, ModuleCall, Param
from torchlens.records.op import Layer, Op
from torchlens.records.trace import Provenance


def _events() -> tuple[ModelInfo, list]:
    """A small model's description and events, covering every link the builder makes: a cell
    run twice (multi-pass layers, a module called twice), a parameter, a buffer source and a
    buffer write, a two-output op one slot of which a module returns (`module_output_slots`),
    a module the description missed, one it described but never called, a constant, and an
    op whose parent event comes later in the log."""
    info = ModelInfo("Net", [ModuleInfo("self", "Net"), ModuleInfo("cell", "Cell", "m.Cell"),
                             ModuleInfo("cell.lin", "Linear"), ModuleInfo("unused", "ReLU")],
                     [ParamInfo("cell.lin.weight", "cell.lin", "weight", (4, 4), "float32", True, np.ones((4, 4)))],
                     [BufferInfo("cell.count", "cell", "count", (1,), "int64", np.zeros(1))])
    evs: list = [ModuleEnter("self", 1), OpEvent(0, "input", "input", shapes=((1, 4),), dtypes=("float32",), path="x")]
    h, nid = 0, 1
    for n in (1, 2):
        stack = (("self", 1), ("cell", n))
        evs.append(ModuleEnter("cell", n, ((h, 0),)))
        evs.append(OpEvent(nid, "buffer", "buffer", shapes=((1,),), dtypes=("int64",), module_stack=stack,
                           path="cell.count"))
        evs.append(ModuleEnter("cell.lin", n, ((h, 0),)))
        evs.append(OpEvent(nid + 1, "op", "linear", ((h, 0),), shapes=((1, 4),), dtypes=("float32",),
                           module_stack=stack + (("cell.lin", n),), site=("lin", 7), params=("cell.lin.weight",),
                           meta={"macs": 16, "flops": 36}))
        evs.append(ModuleExit("cell.lin", n, ((nid + 1, 0),)))
        evs.append(OpEvent(nid + 2, "op", "add_", ((nid, 0), (nid + 1, 0)), shapes=((1, 4),), dtypes=("float32",),
                           module_stack=stack, site=("add", 9), is_inplace=True,
                           meta={"buffer_write": ("cell.count",), "nbytes": 12}))
        evs.append(OpEvent(nid + 3, "op", "topk", ((nid + 2, 0),), shapes=((1, 2), (1, 2)),
                           dtypes=("float32", "int64"), module_stack=stack, site=("topk", 11), multi_output=True))
        evs.append(ModuleExit("cell", n, ((nid + 3, 1),)))
        h, nid = nid + 3, nid + 4
    evs.append(ModuleEnter("extra", 1, ((h, 0),)))  # not in the description
    evs.append(OpEvent(nid + 3, "op", "neg", ((nid, 0),), shapes=((1, 2),), dtypes=("float32",),
                       module_stack=(("self", 1), ("extra", 1)), site=("neg", 4)))
    evs.append(OpEvent(nid + 1, "op", "mul", ((h, 0), (nid, 0)), shapes=((1, 2),), dtypes=("float32",),
                       module_stack=(("self", 1), ("extra", 1)), site=("mul", 3)))
    evs.append(OpEvent(nid, "constant", "tensor", shapes=((1, 2),), dtypes=("float32",),
                       module_stack=(("self", 1), ("extra", 1)), site=("const", 2)))  # the parent above, logged late
    evs.append(OpEvent(nid + 4, "op", "sub", ((h, 0), (nid + 5, 0)), shapes=((1, 2),), dtypes=("float32",),
                       module_stack=(("self", 1), ("extra", 1)), site=("sub", 5)))
    evs.append(OpEvent(nid + 5, "constant", "tensor", shapes=((1, 2),), dtypes=("float32",),
                       module_stack=(("self", 1), ("extra", 1)), site=("const", 6)))  # logged after its child
    evs.append(ModuleExit("extra", 1, ((nid + 1, 0),)))
    evs.append(OpEvent(nid + 2, "output", "output", ((nid + 1, 0),), shapes=(None,), dtypes=("float32",),
                       path="output", saved=False))
    evs.append(ModuleExit("self", 1, ((nid + 1, 0),)))
    return info, evs


def _build(info: ModelInfo, evs: list):
    return B.build_trace(info, list(evs), provenance=Provenance("numpy", model_class="Net"))


def _clear_caches() -> None:
    for cache in (B._PLANS, B._STACK_INFO, B._NBYTES, B._PARENT_OF, B._LABELS, B._TYPE_OF):
        cache.clear()


def _value(v):
    if isinstance(v, (Op, Layer, Module, ModuleCall, Param, Buffer)):
        return (type(v).__name__, getattr(v, "label", None))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, [_value(x) for x in v])
    if isinstance(v, dict):
        return ("dict", [(k, _value(x)) for k, x in v.items()])
    if isinstance(v, np.ndarray):
        return ("array", id(v))
    return v


def _dump(trace) -> dict:
    """Every slot of every record (records by label), in dict order, plus totals."""
    out = {}
    for name in ("_ops", "_layers", "_modules", "_module_calls", "_params", "_buffers"):
        rows = []
        for key, rec in getattr(trace, name).items():
            assert rec._trace is trace
            rows.append((key, type(rec).__name__, {s: _value(getattr(rec, s)) for s in type(rec).__slots__
                                                   if s != "_trace"}))
        out[name] = rows
    cost = trace.cost
    out["cost"] = {k: _value(getattr(cost, k)) for k in ("total_flops", "total_macs", "macs_by_kind",
                                                          "total_activation_memory", "total_param_memory",
                                                          "num_ops_with_flops")}
    out["annotations"] = _value(dict(trace.annotations))
    out["uncalled"] = list(trace.uncalled_modules)
    return out


@pytest.fixture
def links(monkeypatch):
    """Which link path each build took: "plain" (`_link`) or "planned" (`_link_planned`)."""
    seen: list[str] = []
    plain, planned = B._link, B._link_planned
    monkeypatch.setattr(B, "_link", lambda *a: (seen.append("plain"), plain(*a))[1])
    monkeypatch.setattr(B, "_link_planned", lambda *a: (seen.append("planned"), planned(*a))[1])
    _clear_caches()
    yield seen
    _clear_caches()


def test_records_read_as_constructor_made(links):
    info, evs = _events()
    t = _build(info, evs)
    made = {Op: None, Layer: Layer("l", "f", "op", None, ()), Module: Module("m", "M", "M", "self", ("m",), False),
            ModuleCall: ModuleCall("m", 1), Param: Param("p", "m", "p", (1,), "float32", True, None, "cpu"),
            Buffer: Buffer("b", "m", "b", (1,), "int64", None, True, "cpu")}
    for coll in (t._ops, t._layers, t._modules, t._module_calls, t._params, t._buffers):
        for rec in coll.values():
            assert all(hasattr(rec, s) for s in type(rec).__slots__), (rec, [s for s in type(rec).__slots__
                                                                          if not hasattr(rec, s)])
            ref = made[type(rec)]
            if ref is not None:  # the containers a constructor makes, of the same types
                for s in type(rec).__slots__:
                    if hasattr(ref, s) and type(getattr(ref, s)) in (list, tuple, dict, OwnedRecords):
                        assert type(getattr(rec, s)) is type(getattr(ref, s)), (rec, s)
    for layer in t._layers.values():
        assert type(layer.ops) is OwnedRecords and layer.ops._owner is layer
        assert layer.ops[layer.ops[0].label] is layer.ops[0]  # the keyed read goes through its owner
    for mod in t._modules.values():
        assert type(mod.calls) is OwnedRecords and mod.calls._owner is mod
    op = next(iter(t._ops.values()))
    assert op.children is not t._ops[op.children[0]].children and op.grads is None


def test_expected_links(links):
    """A few links of the fixture read by hand, so the comparisons below compare something."""
    info, evs = _events()
    t = _build(info, evs)
    assert list(t._ops) == ["input_1", "buffer_1", "linear_1_1:1", "add_1_2:1", "topk_1_3:1", "buffer_2",
                            "linear_1_1:2", "add_1_2:2", "topk_1_3:2", "neg_1_4", "mul_1_5", "constant_1_6",
                            "sub_1_7", "constant_2_8", "output_1"]
    assert [o.index for o in t._ops.values()] == list(range(15))
    assert [o.pass_number for o in t._layers["add_1_2"].ops] == [1, 2]
    assert t._ops["mul_1_5"].parents == ("topk_1_3:2", "constant_1_6")
    assert t._ops["neg_1_4"].parents == ("constant_1_6",)
    assert t._ops["constant_1_6"].children == ["neg_1_4", "mul_1_5"]
    assert t._ops["sub_1_7"].parents == ("topk_1_3:2", "constant_2_8")
    assert t._module_calls["cell:2"].op_labels == ["buffer_2", "linear_1_1:2", "add_1_2:2", "topk_1_3:2"]
    assert t.annotations["module_output_slots"]["cell:1"] == [["topk_1_3:1", 1]]
    assert t._params["cell.lin.weight"].consumer_labels == ["linear_1_1:1", "linear_1_1:2"]
    assert t._buffers["cell.count"].op_labels == ["buffer_1", "add_1_2:1", "buffer_2", "add_1_2:2"]
    assert t._modules["extra"].class_name == "?" and t.uncalled_modules == ["unused"]
    assert t._modules["self"].children == ["cell"] and t._modules["cell"].children == ["cell.lin"]
    assert t.cost.total_macs == 32 and t.cost.total_param_memory == 64
    assert links == ["plain"]


def test_planned_build_equals_plain_build(links):
    info, evs = _events()
    first = _dump(_build(info, evs))
    assert links == ["plain"] and all(p.ops is None for p in B._PLANS.values())  # signatures only
    second = _dump(_build(info, evs))
    assert links == ["plain", "plain"] and all(p.ops is not None for p in B._PLANS.values())  # the plan made
    t3 = _build(info, evs)
    assert links == ["plain", "plain", "planned"]
    assert _dump(t3) == second == first
    t4 = _build(info, evs)  # fresh mutable records each time
    assert t4._ops["input_1"].children is not t3._ops["input_1"].children
    assert t4._module_calls["cell:1"].op_labels is not t3._module_calls["cell:1"].op_labels
    assert t4._layers["linear_1_1"].ops is not t3._layers["linear_1_1"].ops
    assert t4.annotations["module_output_slots"]["cell:1"] is not t3.annotations["module_output_slots"]["cell:1"]


def _perturbed() -> list:
    """(name, events) variants of the fixture, each different in one field the links read."""
    info, evs = _events()
    out = []

    def swap(i, **kw):
        e = list(evs)
        e[i] = dataclasses.replace(e[i], **kw)
        out.append((f"{type(evs[i]).__name__}[{i}] {sorted(kw)}", e))

    ops = [i for i, e in enumerate(evs) if type(e) is OpEvent and e.kind == "op"]
    lin, add, topk = ops[0], ops[1], ops[2]
    swap(lin, site=("lin", 8))
    swap(lin, func_name="matmul")
    swap(lin, kind="constant")
    swap(lin, module_stack=(("self", 1), ("cell", 1)))
    swap(lin, params=())
    swap(add, parents=((1, 0),))
    swap(add, parents=((2, 0), (1, 0)))
    swap(add, meta={"buffer_write": ()})
    swap(topk, multi_output=False)
    swap(1, path="y")
    buf = next(i for i, e in enumerate(evs) if type(e) is OpEvent and e.kind == "buffer")
    swap(buf, path="cell.other")
    enters = [i for i, e in enumerate(evs) if type(e) is ModuleEnter]
    swap(enters[1], call=3)
    swap(enters[1], input_ids=())
    exits = [i for i, e in enumerate(evs) if type(e) is ModuleExit]
    swap(exits[1], output_ids=((4, 0),))
    e = list(evs)
    e[ops[3]] = dataclasses.replace(evs[ops[3]], id=50)  # ids shifted: the parents read another op
    out.append(("OpEvent id", e))
    return out


@pytest.mark.parametrize("case", range(len(_perturbed())))
def test_changed_events_are_linked_afresh(links, case):
    info, evs = _events()
    _build(info, evs)
    _build(info, evs)  # the plan of the fixture exists now
    name, changed = _perturbed()[case]
    got = _dump(_build(info, changed))
    assert links[-1] == "plain", name
    _clear_caches()
    assert got == _dump(_build(info, changed)), name


def test_changed_description_is_linked_afresh(links):
    info, evs = _events()
    _build(info, evs)
    _build(info, evs)
    other = dataclasses.replace(info, params=[dataclasses.replace(info.params[0], address="cell.lin.w2")])
    got = _dump(_build(other, evs))
    assert links[-1] == "plain"
    assert got["_params"][0][2]["consumer_labels"] == ("list", [])  # no op read `cell.lin.w2`
    _clear_caches()
    assert got == _dump(_build(other, evs))


def test_unhashable_events_make_no_plan(links):
    info, evs = _events()
    evs = [dataclasses.replace(e, module_stack=list(e.module_stack)) if type(e) is OpEvent else e for e in evs]
    first = _dump(_build(info, evs))
    for _ in range(2):
        assert _dump(_build(info, evs)) == first
    assert links == ["plain"] * 3 and all(p.ops is None for p in B._PLANS.values())


def test_plan_table_is_bounded(links, monkeypatch):
    info, evs = _events()
    monkeypatch.setattr(B, "_PLANS_MAX", 2)
    for cut in (0, 1, 2):  # three structures (the log cut short after its last events)
        _build(info, evs[:len(evs) - cut])
    assert len(B._PLANS) == 2 and {k[0] for k in B._PLANS} == {len(evs) - 1, len(evs) - 2}
    monkeypatch.setattr(B, "_PLAN_EVENTS_MAX", len(evs) - 1)
    _build(info, evs)  # more events than the table may hold: not kept, the others stay
    assert {k[0] for k in B._PLANS} == {len(evs) - 1, len(evs) - 2}
    _build(info, evs[:-3])  # room for it only when both older plans go (events over the bound)
    assert {k[0] for k in B._PLANS} == {len(evs) - 3}
