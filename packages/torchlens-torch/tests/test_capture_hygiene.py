"""Capture hygiene of the torch backend: threads, process-global state, parameter writes and
the save budget (issue findings 3, 7, 11, 12).

Every test reproduces the finding against an independent computation (a plain forward under
the recorded RNG state, clones taken before the capture, torch's own global hook tables)."""

from __future__ import annotations

import copy
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module

import torchlens as tl
from torchlens.errors import ReentrantTraceError, SaveBudgetExceededError, TraceCaptureError

from torchlens_torch import concurrency


def _global_hook_sizes() -> dict[str, int]:
    return {k: len(v) for k, v in vars(nn_module).items() if k.startswith("_global_") and isinstance(v, dict)}


def _fastpath() -> bool:
    return torch.backends.mha.get_fastpath_enabled()


def _codes(record: list) -> list[str]:
    out = []
    for w in record:
        text = str(w.message)
        if text.startswith("["):
            out.append(text[1:text.index("]")])
    return out


class RandomAttention(nn.Module):
    """MHA plus random draws (dropout, randn_like): every capture draws from the global RNG."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(d, 2, batch_first=True, dropout=0.1)
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        for _ in range(2):
            a, _ = self.mha(x, x, x)
            x = self.drop(self.fc(a)) + 0.1 * torch.randn_like(a)
        return x


# finding 3: two threads tracing at once ------------------------------------------------------

def test_two_threads_ten_captures_each_validate_and_restore_global_state():
    torch.manual_seed(0)
    models = [RandomAttention().train(), RandomAttention().train()]
    x = torch.randn(2, 6, 16)
    plain = [copy.deepcopy(m) for m in models]
    rng_before = torch.get_rng_state()
    fast_before = _fastpath()
    hooks_before = _global_hook_sizes()
    results: dict[int, list] = {0: [], 1: []}
    start = threading.Barrier(2)

    def work(i: int) -> None:
        start.wait()
        for _ in range(10):
            try:
                results[i].append(tl.trace(models[i], x))
            except Exception as exc:  # collected and checked below
                results[i].append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert torch.equal(torch.get_rng_state(), rng_before), "the caller's RNG was not restored"
    assert _fastpath() == fast_before, "the MHA fast path was left changed process-wide"
    assert _global_hook_sizes() == hooks_before, "torch's global hook tables grew"
    for i in (0, 1):
        assert len(results[i]) == 10
        for trace in results[i]:
            if isinstance(trace, ReentrantTraceError):
                assert trace.code == "capture_lock_timeout"
                continue
            assert not isinstance(trace, Exception), trace
            assert trace.provenance.verified, trace.provenance.verification_reason
            status = trace._backend.validate(trace)
            assert status, (status.reason, status.op)
            # independent check: a plain forward from the recorded RNG state reproduces the output
            saved = torch.get_rng_state()
            try:
                torch.set_rng_state(trace.provenance.extra["rng_state"])
                want = plain[i](x)
            finally:
                torch.set_rng_state(saved)
            assert torch.equal(trace.output, want)


def test_a_capture_waiting_too_long_for_another_refuses_typed(monkeypatch):
    entered, release = threading.Event(), threading.Event()

    class Slow(nn.Module):
        def forward(self, x):
            entered.set()
            release.wait(10)
            return x + 1

    m = nn.Linear(2, 2)  # built (random init) before the other capture starts
    w = m.weight.detach().clone()
    box: dict = {}
    holder = threading.Thread(target=lambda: box.setdefault("trace", tl.trace(Slow(), torch.ones(2))))
    holder.start()
    try:
        assert entered.wait(10)
        monkeypatch.setattr(concurrency, "CAPTURE_LOCK_TIMEOUT_S", 0.2)
        rng_before, fast_before = torch.get_rng_state(), _fastpath()
        with pytest.raises(ReentrantTraceError) as info:
            tl.trace(m, torch.ones(2))
        assert info.value.code == "capture_lock_timeout" and info.value.fields["waited_s"] == pytest.approx(0.2)
        assert info.value.remedy
        assert torch.equal(m.weight, w) and torch.equal(torch.get_rng_state(), rng_before)
        assert _fastpath() == fast_before
    finally:
        release.set()
        holder.join()
    assert torch.equal(box["trace"].output, torch.full((2,), 2.0))


def test_random_draws_on_another_thread_during_a_capture_are_flagged():
    go, done = threading.Event(), threading.Event()

    class Handshake(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            y = self.drop(x)
            go.set()
            done.wait(10)  # another thread draws from the global generator meanwhile
            return self.drop(y)

    def other() -> None:
        go.wait(10)
        torch.rand(10)  # a plain, untraced draw
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trace = tl.trace(Handshake().train(), torch.ones(4, 4))
    t.join()
    assert "capture_rng_unaccounted" in _codes(rec)
    assert trace.provenance.verified is False
    assert trace.provenance.verification_reason == "capture_rng_unaccounted"


def test_a_capture_without_foreign_draws_is_not_flagged():
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trace = tl.trace(RandomAttention().train(), torch.randn(2, 3, 16))
    assert not [c for c in _codes(rec) if c.startswith("capture_")]
    assert trace.provenance.verified


def test_the_traced_models_modules_run_on_another_thread_are_flagged():
    go, done = threading.Event(), threading.Event()
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x):
            go.set()
            done.wait(10)
            return self.inner(x)

    def other() -> None:  # a thread that existed before the capture: a plain forward
        go.wait(10)
        with torch.no_grad():
            model(torch.ones(1, 3))
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trace = tl.trace(Outer(), torch.ones(1, 3))
    t.join()
    assert "capture_worker_thread" in _codes(rec)
    assert trace.provenance.verification_reason == "capture_worker_thread"
    assert trace.provenance.extra["thread_activity_detected"] is True
    assert [m for m in trace.modules.labels if m.startswith("inner")]  # our own thread's calls still recorded


# finding 12: worker threads inside the forward; global hook tables --------------------------

class ThreadedForward(nn.Module):
    def __init__(self, pool: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.pool = pool

    def forward(self, x):
        h = self.fc(x)
        if self.pool:
            with ThreadPoolExecutor(1) as ex:
                y = ex.submit(torch.sin, h).result()
        else:
            box = []
            t = threading.Thread(target=lambda: box.append(torch.sin(h)))
            t.start()
            t.join()
            y = box[0]
        return y * 2


@pytest.mark.parametrize("pool", [False, True])
def test_ops_on_a_worker_thread_inside_the_forward_warn(pool):
    x = torch.randn(2, 4)
    m = ThreadedForward(pool)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trace = tl.trace(m, x)
    assert "capture_worker_thread" in _codes(rec)
    assert trace.provenance.verified is False
    assert trace.provenance.verification_reason == "capture_worker_thread"
    assert trace.provenance.extra["thread_activity_detected"] is True
    assert "sin" not in {op.func_name for op in trace.ops}  # what the warning is about
    assert torch.equal(trace.output, m(x))


def test_a_plain_capture_reports_no_thread_activity():
    trace = tl.trace(nn.Linear(2, 2), torch.ones(1, 2))
    assert trace.provenance.extra["thread_activity_detected"] is False
    assert trace.provenance.extra["owner_thread_id"] == threading.get_ident()


def test_global_hook_tables_do_not_grow_across_captures():
    before = _global_hook_sizes()
    m = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    for _ in range(5):
        tl.trace(m, torch.ones(1, 3))

    class Fails(nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    with pytest.raises(TraceCaptureError):
        tl.trace(Fails(), torch.ones(1))
    assert _global_hook_sizes() == before


# finding 11: in-place parameter writes inside the forward -----------------------------------

class WritesParams(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.ones(3))
        self.shift = nn.Parameter(torch.zeros(3))
        self.gain = nn.Parameter(torch.full((3,), 2.0))

    def forward(self, x):
        with torch.no_grad():
            self.fc.weight.add_(1.0)             # direct in-place write
            self.fc.bias[:2].mul_(3.0)           # through a view
            self.scale.data.add_(5.0)            # through .data (own version counter)
            self.shift.data = torch.full((3,), 7.0)  # rebinding .data
            self.gain[0] = -1.0                  # __setitem__
        return self.fc(x) * self.scale + self.shift + self.gain


def test_inplace_parameter_writes_are_undone_and_the_trace_validates():
    torch.manual_seed(0)
    m = WritesParams()
    before = {k: v.detach().clone() for k, v in m.named_parameters()}
    objects = dict(m.named_parameters())
    storages = {k: v.data_ptr() for k, v in m.named_parameters()}
    x = torch.randn(2, 3)
    twin = copy.deepcopy(m)
    want = twin(x)  # an independent forward: what the capture must record
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        trace = tl.trace(m, x)
    assert not [c for c in _codes(rec) if c.startswith("capture_")]
    assert torch.equal(trace.output, want)
    for k, p in m.named_parameters():
        assert p is objects[k] and p.data_ptr() == storages[k]
        assert torch.equal(p, before[k]), f"{k} was left written"
    assert sorted(trace.provenance.extra["params_restored"]) == ["fc.bias", "fc.weight", "gain", "scale", "shift"]
    assert trace._backend.validate(trace)


def test_carry_state_keeps_parameter_writes_like_a_plain_forward():
    torch.manual_seed(0)
    m = WritesParams()
    twin = copy.deepcopy(m)
    x = torch.randn(2, 3)
    twin(x)
    tl.trace(m, x, capture=tl.CaptureOptions(carry_state=True))
    for (k, p), (_, q) in zip(m.named_parameters(), twin.named_parameters()):
        assert torch.equal(p, q), k


def test_a_parameter_capture_without_writes_clones_nothing():
    m = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    trace = tl.trace(m, torch.ones(1, 3))
    assert trace.provenance.extra["params_restored"] == []


def test_a_parameter_write_the_interceptor_cannot_see_is_named_in_a_warning():
    class Hidden(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def forward(self, x):
            with torch.no_grad(), torch._C.DisableTorchFunction():
                self.w.add_(1.0)  # invisible to the mode; its version counter still moves
            return x * 2

    m = Hidden()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        tl.trace(m, torch.ones(2))
    msgs = [str(w.message) for w in rec if "capture_state_restore_incomplete" in str(w.message)]
    assert len(msgs) == 1 and "'w'" in msgs[0]


# finding 7: save_budget enforced while capturing --------------------------------------------

class Counted(nn.Module):
    calls = 0

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        type(self).calls += 1
        return torch.relu(self.fc(x))


def test_save_budget_stops_the_capture_before_the_bytes_are_kept():
    torch.manual_seed(0)
    d, batch, depth = 256, 64, 40
    layer_bytes = batch * d * 4  # 64 KiB per activation
    model = nn.Sequential(nn.BatchNorm1d(d), *[Counted(d) for _ in range(depth)]).train()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x = torch.randn(batch, d)
    budget = 5 * layer_bytes
    rng_before, fast_before, hooks_before = torch.get_rng_state(), _fastpath(), _global_hook_sizes()
    Counted.calls = 0
    with pytest.raises(SaveBudgetExceededError) as info:
        tl.trace(model, x, capture=tl.CaptureOptions(save_budget=budget))
    err = info.value
    assert err.code == "save_budget_exceeded" and err.fields["budget"] == budget
    assert err.fields["kept_bytes"] > budget and err.fields["func_name"]
    assert Counted.calls < 5, f"the forward ran {Counted.calls} of {depth} layers past the budget"
    partial = err.partial_trace
    kept = sum(op.nbytes for op in partial.ops if op.saved and op.kind != "output")
    assert kept <= budget
    for k, v in model.state_dict().items():  # running statistics included
        assert torch.equal(v, state[k]), k
    assert torch.equal(torch.get_rng_state(), rng_before) and _fastpath() == fast_before
    assert _global_hook_sizes() == hooks_before


def test_save_budget_is_charged_per_kept_payload_exactly():
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(3, 4)
    full = tl.trace(m, x)
    kept = sum(op.nbytes for op in full.ops if op.saved and op.kind != "output")
    assert len(tl.trace(m, x, capture=tl.CaptureOptions(save_budget=kept)).ops) == len(full.ops)
    with pytest.raises(SaveBudgetExceededError):
        tl.trace(m, x, capture=tl.CaptureOptions(save_budget=kept - 1))
    assert len(tl.trace(m, x, save="none", capture=tl.CaptureOptions(save_budget=0)).ops) == len(full.ops)


def test_save_budget_error_swallowed_by_the_forward_still_refuses():
    class Swallows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            try:
                x = self.fc(x) * 2
            except MemoryError:
                pass
            return x + 1

    with pytest.raises(SaveBudgetExceededError):
        tl.trace(Swallows(), torch.randn(2, 8), capture=tl.CaptureOptions(save_budget=100))


def test_the_thread_watch_keeps_a_callers_thread_profile_hook():
    calls: list[str] = []

    def user_hook(frame, event, arg):
        calls.append(threading.current_thread().name)

    previous = threading.getprofile()
    threading.setprofile(user_hook)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tl.trace(ThreadedForward(pool=False), torch.randn(1, 4))
        assert threading.getprofile() is user_hook
    finally:
        threading.setprofile(previous)
    assert any(name != threading.current_thread().name for name in calls)  # the worker kept the caller's hook
