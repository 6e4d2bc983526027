"""Spec fidelity (issue 13, trace fact groups and options; glossary l. 13-20, 899): the
`source`, `health`, `graph` and `autograd` groups hold facts computed from the records
(checked against the model and an independent walk of the ops) and survive save/load; the
option dataclasses are frozen with the spec's fields and refuse bad values typed."""

import dataclasses
import warnings

import numpy as np
import pytest

import torchlens as tl
from torchlens.errors import InvalidArgumentError


@pytest.fixture
def mlp():
    from torchlens_reference import nn

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    return model, x


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_fact_groups_hold_computed_facts(mlp):
    model, x = mlp
    t = tl.trace(model, x)
    assert t.source.class_name == type(model).__name__ and t.source.class_qualname == type(model).__qualname__
    assert t.source.class_file is None and "class_file" in t.source.unavailable  # not recorded: None with the reason
    edges = {(p, o.label) for o in t.ops for p in o.parents}  # independent walk of the parent links
    assert set(t.graph.edges) == edges and len(t.graph.edges) == len(edges)
    assert t.graph.is_recurrent is False and t.graph.orphans == () and t.graph.tied_param_groups == ()
    assert t.graph.is_dynamic is None and "is_dynamic" in t.graph.unavailable
    assert t.autograd.backward_passes == 0 and t.autograd.has_grads is False and t.autograd.has_backward_pass is False
    assert t.health.verified is True and t.health.num_nonfinite_ops == 0
    assert t.health.completeness_verified is None and "completeness_verified" in t.health.unavailable
    for group in (t.source, t.health, t.graph, t.autograd):
        with pytest.raises(dataclasses.FrozenInstanceError):
            group.unavailable = {}


def test_fact_groups_survive_save_and_load(mlp, tmp_path):
    model, x = mlp
    t = tl.trace(model, x)
    t.save(tmp_path / "t.tlspec")
    loaded = tl.load(tmp_path / "t.tlspec")
    for name in ("source", "health", "graph", "autograd"):
        assert getattr(loaded, name) == getattr(t, name), name


def test_options_dataclasses_exist_frozen_with_typed_refusals():
    for name in ("CaptureOptions", "VisualizationOptions", "ReplayOptions", "InterventionOptions", "StorageOptions",
                 "RecordingOptions"):
        cls = getattr(tl.options, name)
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cls(), dataclasses.fields(cls)[0].name, None)
    rec = {f.name for f in dataclasses.fields(tl.options.RecordingOptions)}
    assert rec == {"default_op", "default_module", "history_size", "include_source_events", "max_predicate_failures",
                   "on_predicate_error", "on_forward_error", "default_grad", "postprocess", "lean"}
    assert "differentiable" not in {f.name for f in dataclasses.fields(tl.options.ReplayOptions)}
    bad = [
        (lambda: tl.options.VisualizationOptions(direction="up"), "draw_option_invalid"),
        (lambda: tl.options.VisualizationOptions(depth=-1), "draw_option_invalid"),
        (lambda: tl.options.VisualizationOptions(theme="neon"), "draw_option_invalid"),
        (lambda: tl.options.StorageOptions(max_pending_bytes=0), "storage_option_invalid"),
        (lambda: tl.options.StorageOptions(path=3), "storage_option_invalid"),
        (lambda: tl.options.RecordingOptions(on_forward_error="ignore"), "recording_option_invalid"),
        (lambda: tl.options.RecordingOptions(history_size=True), "recording_option_invalid"),
        (lambda: tl.options.RecordingOptions(postprocess="f"), "recording_option_invalid"),
        (lambda: tl.options.RecordingOptions(lean=1), "recording_option_invalid"),
    ]
    for make, code in bad:
        with pytest.raises(InvalidArgumentError) as ei:
            make()
        assert ei.value.code == code and ei.value.remedy and ei.value.fields["field"]
    assert tl.options.VisualizationOptions(depth=2, direction="LR").as_kwargs()["direction"] == "LR"
