"""CaptureOptions(replayable=True), Trace.cleanup() and loading traces saved before an option
field existed (issue 17 core gaps; helper A, session 6)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

import torchlens as tl
from torchlens.errors import InvalidArgumentError, PayloadUnavailableError, TorchLensError


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 6)
        self.fc2 = torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _model() -> _MLP:
    torch.manual_seed(0)
    return _MLP().eval()


# replayable -----------------------------------------------------------------------------


def test_replayable_is_a_validated_bool_recorded_in_trace_options():
    assert tl.options.CaptureOptions().replayable is False
    for bad in ("yes", 1, None):
        with pytest.raises(InvalidArgumentError) as exc:
            tl.options.CaptureOptions(replayable=bad)
        assert exc.value.code == "capture_option_invalid" and exc.value.fields["field"] == "replayable"
    with pytest.raises(InvalidArgumentError) as exc:
        tl.options.CaptureOptions(replayable=True, inference_only=True)
    assert exc.value.code == "capture_option_invalid"
    t = tl.trace(_model(), torch.randn(3, 4), capture=tl.options.CaptureOptions(replayable=True))
    assert t.options.replayable is True
    assert t.options.capture_options().replayable is True
    plain = tl.trace(_model(), torch.randn(3, 4))
    assert plain.options.replayable is False


def test_replayable_implies_backward_even_under_no_grad():
    """Glossary: replayable asks for a backward, so an enclosing no_grad does not imply
    inference_only; the independent check is torch autograd on the saved output."""
    model, x = _model(), torch.randn(3, 4)
    with torch.no_grad():
        t = tl.trace(model, x, capture=tl.options.CaptureOptions(replayable=True))
        plain = tl.trace(model, x)
    assert t.options.backward_ready is True and t.options.inference_only is False
    assert plain.options.inference_only is True
    out = t.output  # the live forward return keeps its graph (as with backward_ready=True)
    assert out.grad_fn is not None
    assert plain.output.grad_fn is None  # the default capture under no_grad built no graph
    (g,) = torch.autograd.grad(out.sum(), [model.fc2.weight])
    h = torch.relu(model.fc1(x))
    assert torch.allclose(g, torch.ones(3, 2).T @ h)  # d(sum(h W^T + b))/dW = 1^T h


def test_replayable_survives_save_and_load(tmp_path):
    t = tl.trace(_model(), torch.randn(3, 4), capture=tl.options.CaptureOptions(replayable=True))
    t.save(tmp_path / "r.tl")
    back = tl.load(tmp_path / "r.tl")
    assert back.options.replayable is True and back.options.backward_ready is True


def _drop_option_field(path, name: str, *, add: str | None = None) -> None:
    """Rewrite a saved trace as if it had been written before option field `name` existed
    (or with an unknown field `add`), keeping the manifest's file digests consistent."""
    rec = path / "records" / "trace.json"
    data = json.loads(rec.read_text())
    hits = []

    def walk(o):
        if isinstance(o, dict):
            for tag in ("$trace_options", "$capture_options"):
                if tag in o:
                    hits.append(o[tag])
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(data)
    assert hits, "the saved trace stores its options"
    for body in hits:
        body.pop(name)
        if add is not None:
            body[add] = False
    raw = json.dumps(data).encode()
    rec.write_bytes(raw)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["records/trace.json"] = {"sha256": hashlib.sha256(raw).hexdigest(), "size": len(raw)}
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_trace_saved_before_a_new_option_field_loads_with_its_default(tmp_path):
    x = torch.randn(3, 4)
    t = tl.trace(_model(), x, capture=tl.options.CaptureOptions(replayable=True))
    t.save(tmp_path / "old.tl")
    _drop_option_field(tmp_path / "old.tl", "replayable")
    back = tl.load(tmp_path / "old.tl")
    assert back.options.replayable is False  # the field's default, not the value the live trace had
    assert back.options.backward_ready is True  # the other stored fields are kept
    assert torch.equal(back.output_ops[0].out, t.output_ops[0].out)


def test_unknown_option_field_still_refuses(tmp_path):
    t = tl.trace(_model(), torch.randn(3, 4))
    t.save(tmp_path / "odd.tl")
    _drop_option_field(tmp_path / "odd.tl", "replayable", add="not_an_option")
    with pytest.raises(TorchLensError) as exc:
        tl.load(tmp_path / "odd.tl")
    assert exc.value.code == "record_schema_invalid"


# cleanup --------------------------------------------------------------------------------


def test_cleanup_releases_payloads_and_reads_refuse_typed():
    model, x = _model(), torch.randn(3, 4)
    t = tl.trace(model, x, capture=tl.options.CaptureOptions(backward_ready=True, save_grads=True))
    fork = t.fork()
    out = t.output_ops[0].out
    t.backward(out.sum())
    relu = next(op for op in t.ops if op.func_name == "relu")
    assert relu.has_grad
    expected = torch.relu(model.fc1(x))
    assert torch.equal(relu.out, expected)
    n_ops, labels = len(t.ops), t.labels
    t.cleanup()
    for read in (lambda: relu.out, lambda: relu.grad, lambda: t.output, lambda: t[relu.label].out,
                 lambda: t.modules["fc2"].out):
        with pytest.raises(PayloadUnavailableError) as exc:
            read()
        assert exc.value.code == "trace_cleaned_up"
        assert exc.value.remedy
    assert not relu.has_saved_out and not relu.has_grad
    # the records stay
    assert len(t.ops) == n_ops and t.labels == labels and relu.shape == (3, 6)
    # a fork made before keeps its own references
    assert torch.equal(fork[relu.label].out, expected)
    t.cleanup()  # idempotent
    with pytest.raises(PayloadUnavailableError):
        relu.out


def test_a_cleaned_trace_saves_its_records_without_payloads(tmp_path):
    t = tl.trace(_model(), torch.randn(3, 4))
    labels = t.labels
    t.cleanup()
    back = tl.load(t.save(tmp_path / "c.tl"))
    assert back.labels == labels
    with pytest.raises(PayloadUnavailableError) as exc:
        back.output_ops[0].out
    assert exc.value.code == "activation_not_saved"  # on disk: never saved, nothing was released there


def test_cleanup_drops_the_trace_s_references_to_its_tensors():
    import gc
    import weakref

    t = tl.trace(_model(), torch.randn(3, 4))
    relu = next(op for op in t.ops if op.func_name == "relu")
    ref = weakref.ref(relu.out)
    gc.collect()
    assert ref() is not None
    t.cleanup()
    gc.collect()
    assert ref() is None
