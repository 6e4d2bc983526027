"""tl.record / tl.recording.Recorder on torch models (issue 22 parts 1-2): sparse payloads, to_trace
parity with tl.trace, settings, outcomes, failure modes, stop_after=, Trace-parity verbs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.errors import PayloadUnavailableError, RecordingError, TraceCaptureError
from torchlens.options import CaptureOptions, RecordingOptions

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


class Loop(nn.Module):
    """A reused layer: one Layer with three passes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for _ in range(3):
            x = torch.relu(self.fc(x))
        return self.head(x)


class Boom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        y = torch.relu(self.a(x))
        if True:
            raise ValueError("boom")
        return self.b(y)


def _hook_value(module, fn):
    got = []
    h = module.register_forward_hook(lambda m, a, o: got.append(o[0] if isinstance(o, tuple) else o))
    try:
        fn()
    finally:
        h.remove()
    return got


def test_record_module_keeps_only_that_modules_payload_gpt2(gpt2):
    x = torch.randint(0, 100, (1, 7))
    rec = tl.record(gpt2, x, save=tl.module("transformer.h.3"))
    with torch.no_grad():
        want = _hook_value(gpt2.transformer.h[3], lambda: gpt2(x))[0]
    assert len(rec.records) == 1
    (r,) = rec.records
    assert torch.equal(r.value, want)
    assert rec.saved_bytes == want.numel() * want.element_size() == r.nbytes
    assert torch.equal(rec["transformer.h.3"], want)
    full = tl.trace(gpt2, x)
    conv = rec.to_trace()
    assert conv.labels == full.labels
    assert [o.pass_number for o in conv.ops] == [o.pass_number for o in full.ops]
    assert [l.num_passes for l in conv.layers] == [l.num_passes for l in full.layers]
    for op in conv.ops:
        if op.saved and op.kind != "output":
            assert torch.equal(op.out, full[op.label].out)
    assert [o.label for o in conv.ops if o.saved and o.kind != "output"] == [r.label]
    assert rec.lean_omissions == ()
    lean = tl.record(gpt2, x, save=tl.module("transformer.h.3"), recording=RecordingOptions(lean=True))
    assert torch.equal(lean["transformer.h.3"], want) and lean.options.lean is True and lean.lean_omissions
    for read in (lean.to_trace, lambda: lean.op_events, lambda: lean.event_stream, lambda: lean.lazy_trace,
                 lean.raw_metadata):
        with pytest.raises(RecordingError) as exc:
            read()
        assert exc.value.code == "recording_lean_omitted"
    assert [e["label"] for e in rec.op_events] == list(full.labels)
    assert rec.raw_metadata()["passes"][0]["num_ops"] == len(full.ops)
    assert torch.equal(rec.output.logits, gpt2(x).logits)
    with pytest.raises(PayloadUnavailableError) as exc:
        conv.output  # a converted trace has no live forward return
    assert exc.value.code == "output_not_stored"


def test_reading_an_unselected_site_fails_explicitly(gpt2):
    x = torch.randint(0, 100, (1, 5))
    rec = tl.record(gpt2, x, save=tl.module("transformer.h.1"))
    with pytest.raises(PayloadUnavailableError) as exc:
        rec.value("transformer.h.0")
    assert exc.value.code == "activation_not_saved"
    with pytest.raises(RecordingError) as exc:
        rec.value("no.such.module")
    assert exc.value.code == "recording_site_missing"


def test_recorder_runs_several_forwards_with_tl_trace_pass_grouping():
    torch.manual_seed(1)
    m = Loop()
    xs = [torch.randn(2, 4), torch.randn(2, 4)]
    recorder = tl.recording.Recorder(m, save=tl.module("fc"))
    outs = [recorder(x) for x in xs]
    rec = recorder.recording
    assert rec.num_passes == 2
    assert torch.equal(rec.output, outs[-1]) and torch.equal(outs[0], m(xs[0]))
    for n, x in enumerate(xs, start=1):
        full = tl.trace(m, x)
        conv = rec.to_trace(n)
        assert conv.labels == full.labels
        assert [l.num_passes for l in conv.layers] == [l.num_passes for l in full.layers]
        kept = [r for r in rec.records if r.pass_number == n]
        hooked = _hook_value(m.fc, lambda: m(x))
        assert len(kept) == 3 and all(torch.equal(r.value, h) for r, h in zip(kept, hooked))
    with pytest.raises(RecordingError) as exc:
        rec.to_trace(3)
    assert exc.value.code == "recording_pass_missing"


def test_recording_options_are_the_live_settings():
    m = Loop()
    sel = tl.module("fc")
    post_seen = []

    def post(recording):
        post_seen.append(recording)

    rec = tl.record(m, torch.randn(1, 4), save=sel, recording=RecordingOptions(postprocess=post))
    s = rec.options
    assert s.keep_op is sel and s.detach_saved_activations is True and s.postprocess is post
    assert post_seen and post_seen[0].num_passes == 1
    with pytest.raises(AttributeError):
        s.keep_op = None
    with pytest.raises(TypeError):
        type(s)()
    with pytest.raises(TypeError):
        type(rec)()
    assert all(not r.value.requires_grad for r in rec.records)  # detached by default


def test_unpickled_recording_keeps_records_not_the_live_output():
    import pickle

    torch.manual_seed(4)
    m = Loop()
    x = torch.randn(2, 4)

    def post(recording):
        return None

    rec = tl.record(m, x, save=tl.module("fc"), recording=RecordingOptions(postprocess=post))
    back = pickle.loads(pickle.dumps(rec))
    assert [r.label for r in back.records] == [r.label for r in rec.records]
    assert all(torch.equal(a.value, b.value) for a, b in zip(back.records, rec.records))
    assert back.to_trace().labels == rec.to_trace().labels
    with pytest.raises(PayloadUnavailableError) as exc:
        back.output
    assert exc.value.code == "output_not_stored"
    assert back.options.postprocess is None and back.options.history_size == 1 and back.options.keep_op is None
    assert rec.options.postprocess is post and torch.equal(rec.output, m(x))  # the original is untouched


def test_backward_needs_gradient_hooks():
    m = Loop()
    x = torch.randn(2, 4)
    rec = tl.record(m, x, save=tl.module("fc"))
    with pytest.raises(RecordingError) as exc:
        rec.backward(rec.output.sum())
    assert exc.value.code == "recording_backward_not_requested"
    rec = tl.record(m, x, save=tl.module("fc"), capture=CaptureOptions(backward_ready=True))
    rec.backward(rec.output.sum())  # runs with hooks requested
    with pytest.raises(RecordingError) as exc:
        tl.record(m, x, capture=CaptureOptions(backward_ready=True, detach_saved_activations=True))
    assert exc.value.code == "backward_ready_conflict"


def test_forward_error_modes():
    m = Boom()
    x = torch.randn(2, 4)
    with pytest.raises(TraceCaptureError):
        tl.record(m, x, save="all")
    rec = tl.record(m, x, save=tl.module("a"), recording=RecordingOptions(on_forward_error="return_partial"))
    assert rec.status == "partial_error" and rec.is_failed
    assert rec.error_type == "ValueError" and "boom" in rec.error_message
    assert rec.num_committed_ops >= 2 and rec.last_event_label is not None
    assert rec.outcome.status == "FAILED" and rec.outcome.phase == "forward"
    assert torch.equal(rec["a"], m.a(x))  # the prefix kept its selected payload
    for call, code in ((rec.to_trace, "recording_failed_partial"), (rec.fork, "recording_failed_partial"),
                       (lambda: rec.backward(None), "recording_failed_partial")):
        with pytest.raises(RecordingError) as exc:
            call()
        assert exc.value.code == code
    with pytest.raises(PayloadUnavailableError) as exc:
        rec.output
    assert exc.value.code == "output_forward_failed"
    with pytest.raises(RecordingError) as exc:
        tl.record(m, x, save=tl.module("a"), recording=RecordingOptions(on_forward_error="attach_partial"))
    assert exc.value.code == "recording_forward_failed"
    assert exc.value.partial_recording.is_failed and exc.value.partial_recording.num_passes == 1


def test_stop_after_ends_the_forward_after_the_site():
    torch.manual_seed(2)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(2, 4)
    rec = tl.record(m, x, save=tl.module("1"), stop_after=tl.module("1"))
    assert rec.outcome.status == "STOPPED" and rec.status == "stopped"
    assert rec.outcome.stopped_at == rec.stopped_at == "relu_1_2"
    assert torch.equal(rec["1"], torch.relu(m[0](x)))  # the stop site's own value is kept
    conv = rec.to_trace()
    assert [o.label for o in conv.ops] == ["input_1", "linear_1_1"]  # nothing after the stop site was recorded
    with pytest.raises(PayloadUnavailableError) as exc:
        rec.output
    assert exc.value.code == "output_capture_stopped"
    assert rec.to_trace().outcome.status == "STOPPED"


def test_nonfinite_abort_outcome():
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.full((1, 4), float("nan"))
    rec = tl.record(m, x, save=tl.module("0"), capture=CaptureOptions(on_nonfinite="raise", detach_saved_activations=True),
                    recording=RecordingOptions(on_forward_error="return_partial"))
    assert rec.outcome.status == "ABORTED_NONFINITE" and rec.error_code == "nonfinite_value" and rec.is_failed
    assert not rec.outcome.ok


def test_trace_outcome():
    m = Loop()
    assert tl.trace(m, torch.randn(1, 4)).outcome.status == "COMPLETE"
    with pytest.raises(TraceCaptureError) as exc:
        tl.trace(Boom(), torch.randn(1, 4))
    out = exc.value.partial_trace.outcome
    assert out.status == "FAILED" and out.phase == "forward"


def test_parity_verbs_delegate_through_to_trace(tmp_path):
    torch.manual_seed(3)
    m = Loop()
    x = torch.randn(2, 4)
    rec = tl.record(m, x, save=tl.module("head"))
    forked = rec.fork()
    assert isinstance(forked, tl.Trace) and forked.labels == tl.trace(m, x).labels
    rec.save(tmp_path / "r.tlspec")
    loaded = tl.load(tmp_path / "r.tlspec")
    assert loaded.labels == forked.labels
    head = [o for o in loaded.ops if o.saved and o.kind != "output"]
    assert len(head) == 1 and torch.equal(head[0].out, m(x))
    edited = rec.do(tl.module("head"), tl.zero_ablate())
    assert isinstance(edited, tl.Trace)


def test_record_refusals_before_running():
    m = Loop()
    for kwargs, code in (({"episode": object()}, "record_episode_unsupported"),
                         ({"save": 3.5}, "save_spec_invalid"),
                         ({"recording": "lean"}, "recording_option_invalid")):
        with pytest.raises(Exception) as exc:
            tl.record(m, torch.randn(1, 4), **kwargs)
        assert exc.value.code == code
