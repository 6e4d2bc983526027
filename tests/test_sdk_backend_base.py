"""`tl.backends.sdk.BackendBase` / `RecorderBase` (the shared half of the mlx, tf, paddle and
tinygrad backends), checked on numpy values against hand-built expectations. The four backends'
package tests and scorecards check them end to end."""

from __future__ import annotations

import numpy as np
import pytest

import torchlens as tl
from torchlens.backends.protocol import check_capability_protocols
from torchlens.backends.sdk import (ArgRef, BackendBase, BackendCapabilities, EventLog, ModelInfo, RecorderBase,
                                    SupportsBackward, SupportsInterventions, SupportsPersistence, refusal_codes_for,
                                    supports)


class _Rec(RecorderBase):
    def is_leaf(self, value):
        return isinstance(value, np.ndarray)

    def dtype_of(self, value):
        return str(value.dtype)


class _Backend(BackendBase):
    name, framework, package = "toy", None, "toy_backend"
    CAPABILITIES = BackendCapabilities(interventions=True)
    own_refusals = frozenset({"foreign_tensor_input"})
    module_types = (dict,)
    replay_rng_note = "toy draws replay"

    def is_tensor(self, value):
        return isinstance(value, np.ndarray)


def test_declarations_come_from_the_class_attributes():
    b = _Backend()
    assert b.capabilities() == BackendCapabilities(interventions=True)
    assert b.refusal_codes() == refusal_codes_for(b, {"foreign_tensor_input"})
    assert "foreign_tensor_input" in b.refusal_codes() and "interventions_unsupported" not in b.refusal_codes()
    assert b.trace_options() == frozenset({"save", "capture", "replay_rng"})
    assert b.can_handle({}, (), {}) is True                          # a module type, whatever the inputs
    assert b.can_handle(len, ([np.zeros(1)],), {}) is True
    assert b.can_handle(len, (1,), {"k": "x"}) is False


def test_members_of_undeclared_capabilities_are_withdrawn():
    class Plain(BackendBase):                                       # declares nothing, names no codec
        name, framework, package = "plain", None, "plain_backend"

        def is_tensor(self, value):
            return isinstance(value, np.ndarray)

    class Own(Plain):                                               # its own backward stays (and is refused)
        def backward(self, trace, loss=None):
            return None

    plain = Plain()
    assert Plain.backward is None and Plain.edit_ops is None and Plain.attach_module_edits is None
    assert Plain.payload_codec is None and callable(Plain.validate)
    check_capability_protocols(plain)                               # registration accepts it
    assert not any(supports(plain, p) for p in (SupportsBackward, SupportsInterventions, SupportsPersistence))
    with pytest.raises(tl.errors.BackendUnsupportedError) as err:
        check_capability_protocols(Own())
    assert err.value.code == "backend_capability_undeclared"
    full = _Backend()                                               # interventions declared: lent
    assert callable(type(full).edit_ops) and type(full).backward is None and type(full).payload_codec is None


def test_open_capture_refuses_before_anything_runs():
    b = _Backend()
    with pytest.raises(tl.errors.InvalidArgumentError) as err:
        b.open_capture(None, {}, "yes", "all")
    assert err.value.code == "invalid_argument" and "toy draws replay" in str(err.value)
    with pytest.raises(tl.errors.TorchLensError):
        b.open_capture(None, {}, True, 3.5)                        # save= is checked too
    assert b.open_capture(None, {}, True, "none").kind == "none"
    with pytest.raises(tl.errors.ReentrantTraceError):
        b.refuse_reentrant(object())
    b.refuse_reentrant(None)


def test_input_leaves_and_module_descriptions():
    b = _Backend()
    x, y, z = np.zeros(1), np.ones(2), np.full(3, 2.0)
    assert [(p, v is w) for (p, v), w in zip(b.input_leaves((x, [y, 1]), {"k": {"m": z}}), (x, y, z))] == [
        ("args[0]", True), ("args[1][0]", True), ("kwargs['k']['m']", True)]

    class M:
        training = True

    info = ModelInfo("M")
    b.describe_modules(info, [("self", M()), ("blocks.0", M()), ("blocks.0.fc", object())])
    assert [(m.address, m.parent, m.training) for m in info.modules] == [
        ("self", None, True), ("blocks.0", "self", True), ("blocks.0.fc", "blocks.0", False)]


def test_recorder_templates_sources_scopes_and_outputs():
    log = EventLog()
    model = object()
    rec = _Rec(log, [("self", model)])
    w, x = np.eye(2), np.ones((1, 2))
    rec.param_addr[id(w)] = "w"
    src = rec.source("input", x, "args[0]")
    rec.enter(model, (x,), {})
    c = np.zeros(2)
    parents, params, args_t, kwargs_t = rec.arguments((x, [w, 3]), {"bias": c})
    # x by its producer, w by address, the unseen c as a constant recorded inside the module
    assert args_t == (ArgRef(index=0), [ArgRef(address="w"), 3]) and kwargs_t == {"bias": ArgRef(index=1)}
    assert params == ["w"] and parents[0] == src
    const = log.events[-1]
    assert const.kind == "constant" and const.outputs[0] is c and const.module_stack == (("self", 1),)
    rec.exit(x)
    rec.record_outputs([("output", x), ("output[1]", w)])
    outs = [e for e in log.events if getattr(e, "kind", None) == "output"]
    assert [e.parents for e in outs][0] == (src,)
    assert outs[1].parents[0] != src and log.events[-2].kind == "constant"    # a parameter returned as is


def test_split_outputs_and_apply_edits():
    rec = _Rec(EventLog(), [])
    a, b = np.zeros(1), np.ones(1)
    assert rec.split_outputs(a) == ((a,), False)
    assert rec.split_outputs([a, b]) == ((a, b), True)
    assert rec.split_outputs((a, 1)) is None and rec.split_outputs(()) is None

    class Plan:
        def __contains__(self, i):
            return i == 7

        def apply(self, i, outs):
            self.seen = i
            return [o + 1 for o in outs]

    rec.edit_plan = Plan()
    assert rec.apply_edits(6, (a,), a, False) == ((a,), a)
    outs, out = rec.apply_edits(7, (a, b), [a, b], True)
    assert isinstance(out, list) and [o.tolist() for o in outs] == [[1.0], [2.0]] and out[0] is outs[0]
    outs, out = rec.apply_edits(7, (a,), a, False, inplace=True)   # an in-place op keeps its receiver
    assert outs == (a,) and out is a and rec.edit_plan.seen == 7
