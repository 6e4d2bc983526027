"""Acceptance over every zoo model: module outputs, model output, completeness against an
independent TorchFunctionMode counter, labels, and parent/child agreement."""

from __future__ import annotations

import re
from collections import Counter

import torch

import torchlens as tl
from torchlens_torch.testing import count_torch_calls, hooked_module_outputs, tensor_leaves

_SOURCE_LABEL = re.compile(r"^(input|buffer|output)_\d+$")
_OP_LABEL = re.compile(r"^[a-z0-9_]+?_\d+_\d+(:\d+)?$")


def _trace(model, args, kwargs, **kw):
    torch.manual_seed(0)
    return tl.trace(model, *args, input_kwargs=kwargs, **kw)


def _call_values(call) -> list[torch.Tensor]:
    values = []
    for op in call.output_ops:
        values.extend(t for t in (op.outs if op.multi_output else (op.out,)) if isinstance(t, torch.Tensor))
    return values


def test_module_outputs_match_independent_hooks(zoo_case):
    model, args, kwargs = zoo_case
    trace = _trace(model, args, kwargs)
    seen = hooked_module_outputs(model, args, kwargs)
    checked = 0
    for address, calls in seen.items():
        module = trace.modules[address]
        assert module.num_calls == len(calls), address
        for call, expected in zip(module.calls, calls):
            got = _call_values(call)
            for leaf in expected:
                assert any(g.shape == leaf.shape and g.dtype == leaf.dtype and torch.equal(g, leaf) for g in got), (
                    f"{call.label}: an output the hook saw is missing from the trace")
                checked += 1
    assert checked > 0


def test_trace_output_equals_model_output(zoo_case):
    model, args, kwargs = zoo_case
    trace = _trace(model, args, kwargs)
    torch.manual_seed(0)
    ref = model(*args, **kwargs)
    assert type(trace.output) is type(ref)
    got, want = tensor_leaves(trace.output), tensor_leaves(ref)
    assert len(got) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the output ops hold the same values
    outs = [o.out for o in trace.output_ops]
    assert len(outs) == len(want) and all(torch.equal(a, b) for a, b in zip(outs, want))


def test_every_tensor_producing_call_is_recorded(zoo_case):
    model, args, kwargs = zoo_case
    trace = _trace(model, args, kwargs)
    expected = Counter(count_torch_calls(model, args, kwargs))
    got: Counter = Counter()
    composites = set()
    for op in trace.ops:
        if op.kind != "op":
            continue
        comp = op.meta.get("composite")
        if comp is None:
            got[op.func_name] += 1
        elif comp not in composites:  # an expanded composite is one call to an outside observer
            composites.add(comp)
            got[comp.rpartition("#")[0]] += 1
    assert got == expected


def test_labels_follow_the_spec(zoo_case):
    model, args, kwargs = zoo_case
    trace = _trace(model, args, kwargs, save="none")
    for op in trace.ops:
        if op.kind in ("input", "buffer", "output"):
            assert _SOURCE_LABEL.match(op.label), op.label
        else:
            assert _OP_LABEL.match(op.label), op.label
            assert (op.num_passes == 1) == (":" not in op.label)
    assert len(set(trace.labels)) == len(trace.labels)


def test_parents_and_children_agree(zoo_case):
    model, args, kwargs = zoo_case
    trace = _trace(model, args, kwargs, save="none")
    ops = trace.ops
    for op in ops:
        for p in op.parents:
            assert op.label in ops[p].children, (p, op.label)
        for c in op.children:
            assert op.label in ops[c].parents, (op.label, c)
        if op.kind in ("input", "buffer", "constant"):
            assert not op.parents
    assert len(trace.input_ops) >= 1 and len(trace.output_ops) >= 1
