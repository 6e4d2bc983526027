"""Spec fidelity (issue 13 leftovers, session 4): provenance identity and run fields
(glossary l. 15-16), the cost fields of l. 20, and Module.num_params on a tied alias owner,
each checked against an independent computation (hand formulas, torch autograd, torch's
own parameter counts) and after save/load."""

from __future__ import annotations

import hashlib
import time
import warnings

import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.options import CaptureOptions


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _mlp(seed=0, act=nn.ReLU):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), act(), nn.Linear(8, 2))


class Renamed(nn.Module):
    """The same architecture as `_mlp()` under other attribute names."""

    def __init__(self):
        super().__init__()
        self.first, self.act, self.second = nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)

    def forward(self, x):
        return self.second(self.act(self.first(x)))


# --- provenance identity ---------------------------------------------------------------

def test_fingerprint_is_structural_and_address_free():
    x = torch.randn(3, 4)
    base = tl.trace(_mlp(0), x).provenance.fingerprint
    assert isinstance(base, str) and len(base) == 64
    assert tl.trace(_mlp(1), torch.randn(3, 4)).provenance.fingerprint == base  # other weights and values
    other = tl.trace(Renamed(), x).provenance.fingerprint
    # Renamed's ops run in a different module class (Renamed, not Sequential) only at the root,
    # and the root owns no op: same ops, same parents, same owning classes -> same hash
    assert other == base
    assert tl.trace(_mlp(0), torch.randn(5, 4)).provenance.fingerprint != base  # input shape
    assert tl.trace(_mlp(0, nn.GELU), x).provenance.fingerprint != base  # another op
    assert tl.trace(_mlp(0), x.double().float().half().float()).provenance.fingerprint == base


def test_input_signature_structure_and_object_id():
    m = _mlp()
    x = torch.randn(3, 4)
    t = tl.trace(m, x)
    p = t.provenance
    assert p.input_structure == "args[0]: Tensor[3, 4] float32"
    assert p.input_signature_hash == hashlib.sha256(p.input_structure.encode()).hexdigest()
    assert p.input_object_id == id(x)
    assert tl.trace(m, torch.randn(3, 4)).provenance.input_signature_hash == p.input_signature_hash  # contents
    assert tl.trace(m, torch.randn(2, 4)).provenance.input_signature_hash != p.input_signature_hash  # shape
    assert tl.trace(m.double(), x.double()).provenance.input_signature_hash != p.input_signature_hash  # dtype

    class Two(nn.Module):
        def forward(self, a, scale=1.0, mask=None):
            return a * scale if mask is None else a * mask

    a = torch.ones(2)
    t2 = tl.trace(Two(), a, input_kwargs={"scale": 3, "mask": torch.ones(2, dtype=torch.bool)})
    assert t2.provenance.input_structure.splitlines() == [
        "args[0]: Tensor[2] float32", "kwargs['scale']: int 3", "kwargs['mask']: Tensor[2] bool"]


def test_param_hashes_quick_and_full():
    m = _mlp()
    x = torch.randn(3, 4)
    t = tl.trace(m, x)
    p = t.provenance
    twin = _mlp(5)
    twin.load_state_dict(m.state_dict())
    t_twin = tl.trace(twin, x)
    assert p.param_hash_quick == t_twin.provenance.param_hash_quick
    assert p.param_hash_full == t_twin.provenance.param_hash_full and len(p.param_hash_full) == 64

    # one element off the sampled positions: the full hash sees it, the quick one by design not
    nudged = _mlp(5)
    nudged.load_state_dict(m.state_dict())
    with torch.no_grad():
        nudged[0].weight[1, 1] += 1.0  # flat index 5; the 16 samples of 32 elements are 0,2,4,6,8,10,...
    t_n = tl.trace(nudged, x)
    assert t_n.provenance.param_hash_full != p.param_hash_full
    assert t_n.provenance.param_hash_quick == p.param_hash_quick
    # an update of every element (an optimizer step) changes the quick hash too
    with torch.no_grad():
        for q in nudged.parameters():
            q.mul_(0.5)
    assert tl.trace(nudged, x).provenance.param_hash_quick != p.param_hash_quick


def test_quick_hash_sample_positions_stay_in_range_for_huge_parameters():
    from torchlens_torch.backend import sample_positions

    n = 50257 * 768  # GPT-2's wte: float32 cannot represent n - 1 exactly
    pos = sample_positions(n, 16)
    assert pos[0] == 0 and pos[-1] == n - 1 and len(set(pos)) == 16 and pos == sorted(pos)
    assert sample_positions(5, 16) == [0, 1, 2, 3, 4]


def test_param_hash_full_refuses_after_the_parameters_changed():
    m = _mlp()
    t = tl.trace(m, torch.randn(3, 4))
    with torch.no_grad():
        m[0].weight.add_(1.0)  # before the hash was ever read
    assert t.provenance.param_hash_full is None
    assert "changed since the capture" in t.provenance.unavailable["param_hash_full"]


def test_param_hash_full_is_saved_and_survives_load(tmp_path):
    m = _mlp()
    t = tl.trace(m, torch.randn(3, 4))
    t.save(tmp_path / "t.tl")  # computed by the save, before it was read
    with torch.no_grad():
        m[0].weight.add_(1.0)
    loaded = tl.load(tmp_path / "t.tl")
    twin = _mlp(3)
    twin.load_state_dict(_mlp().state_dict())
    assert loaded.provenance.param_hash_full == tl.trace(twin, torch.randn(3, 4)).provenance.param_hash_full
    for name in ("fingerprint", "input_structure", "input_signature_hash", "param_hash_quick", "setup_duration",
                 "cleanup_duration"):
        assert getattr(loaded.provenance, name) == getattr(t.provenance, name), name


def test_setup_and_cleanup_durations_measure_their_phases(monkeypatch):
    import torchlens_torch.backend as backend

    real_describe, real_build = backend.describe_model, backend.build_trace

    def slow_describe(root):
        time.sleep(0.15)
        return real_describe(root)

    def slow_build(*a, **k):
        time.sleep(0.15)
        return real_build(*a, **k)

    x = torch.randn(3, 4)
    monkeypatch.setattr(backend, "describe_model", slow_describe)
    p = tl.trace(_mlp(), x).provenance
    assert p.setup_duration >= 0.15 and p.cleanup_duration < 0.15
    monkeypatch.setattr(backend, "describe_model", real_describe)
    monkeypatch.setattr(backend, "build_trace", slow_build)
    started = time.perf_counter()
    t = tl.trace(_mlp(), x)
    wall = time.perf_counter() - started
    p = t.provenance
    assert p.cleanup_duration >= 0.15 and p.setup_duration < 0.15
    assert p.setup_duration + t.cost.forward_duration + p.cleanup_duration <= wall


def test_pickle_keeps_what_was_computed_and_says_why_otherwise():
    import pickle

    t = tl.trace(_mlp(), torch.randn(3, 4))
    early = pickle.loads(pickle.dumps(t))  # before the full hash was read: the copy cannot vouch for it
    assert early.provenance.param_hash_full is None and "param_hash_full" in early.provenance.unavailable
    full = t.provenance.param_hash_full
    late = pickle.loads(pickle.dumps(t))
    assert late.provenance.param_hash_full == full
    assert late.cost.forward_peak_memory == t.cost.forward_peak_memory == 192


def test_provenance_summary_carries_the_identity_block():
    t = tl.trace(_mlp(), torch.randn(3, 4))
    p = t.provenance
    text = p.summary()
    assert f"fingerprint {p.fingerprint[:16]}" in text and f"param_hash_quick {p.param_hash_quick[:16]}" in text
    assert "inputs: args[0]: Tensor[3, 4] float32" in text and "setup_duration" in text and "verified" in text


@pytest.mark.parametrize("scope", ["forward", "saved"])
def test_validation_trace_observer_reads_the_fingerprint(scope):
    """glossary l. 865: trace_observer reads trace.provenance.fingerprint of the validation trace."""
    m, x = _mlp(), torch.randn(3, 4)
    seen = []
    assert tl.validate(m, x, scope=scope, trace_observer=lambda t: seen.append(t.provenance.fingerprint))
    assert seen == [tl.trace(m, x).provenance.fingerprint] and seen[0] is not None


# --- cost ------------------------------------------------------------------------------

def test_forward_peak_memory_is_the_liveness_peak():
    # x (3x4) -> linear (3x8) -> relu (3x8) -> linear (3x2), float32, one consumer each:
    # x 48 | +a 96 = 144, x freed | +b 96 = 192, a freed | +c 24 = 120  -> peak 192
    t = tl.trace(_mlp(), torch.randn(3, 4))
    assert t.cost.forward_peak_memory == 192
    assert t.cost.forward_peak_memory <= t.cost.total_activation_memory == 48 + 96 + 96 + 24

    class Fan(nn.Module):  # x is read by both branches: it stays alive until the second one
        def forward(self, x):
            a = x.exp()      # 64 B
            b = x * 2        # 64 B
            return a + b     # 64 B

    # x 64 | +a 128 | +b 192, x freed 128 | +sum 192, a and b freed  -> peak 192
    t2 = tl.trace(Fan(), torch.randn(4, 4))
    assert t2.cost.forward_peak_memory == 192
    assert str(t2.cost.forward_peak_memory).endswith("B")


def test_grad_memory_fields_against_autograd(tmp_path):
    m = _mlp()
    x = torch.randn(3, 4)
    t = tl.trace(m, x, capture=CaptureOptions(backward_ready=True, save_grads=True))
    # every op output on the autograd path gets a gradient of its own size: 96 + 96 + 24
    assert t.cost.total_grad_memory == 216
    assert t.cost.saved_grad_memory == 0 and t.cost.backward_durations == ()
    t.backward(t.output.sum())
    grads = [g for op in t.ops for g in (op.grads or ()) if g is not None]
    assert grads and t.cost.saved_grad_memory == sum(g.numel() * g.element_size() for g in grads)
    assert len(t.cost.backward_durations) == 1 and t.cost.backward_durations[0] > 0
    t.save(tmp_path / "g.tl")
    loaded = tl.load(tmp_path / "g.tl")
    assert loaded.cost.saved_grad_memory == t.cost.saved_grad_memory
    assert loaded.cost.total_grad_memory == 216 and loaded.cost.forward_peak_memory == t.cost.forward_peak_memory
    assert loaded.cost.backward_durations == t.cost.backward_durations
    with torch.no_grad():
        assert tl.trace(m, x).cost.total_grad_memory == 0  # inference-only: no gradient to compute


def test_a_copy_keeps_its_own_backward_durations():
    t = tl.trace(_mlp(), torch.randn(3, 4), capture=CaptureOptions(backward_ready=True))
    copy = t.copy()
    copy.backward(t.output.sum())  # a copy holds no live output of its own
    assert len(copy.cost.backward_durations) == 1 and t.cost.backward_durations == ()


def test_func_calls_and_overhead_durations():
    class Sleepy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            time.sleep(0.1)  # Python time between recorded calls: overhead, not a call
            return y.relu()

    t = tl.trace(Sleepy(), torch.randn(2, 4))
    c = t.cost
    ops_time = sum(op.duration for op in t.ops if op.duration is not None)
    assert c.func_calls_duration == pytest.approx(ops_time)
    assert c.func_calls_duration < 0.1 <= c.overhead_duration
    assert c.overhead_duration == pytest.approx(c.forward_duration - c.func_calls_duration)


# --- Module.num_params on a tied alias owner ------------------------------------------------

class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(10, 4)
        self.blk = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        return self.head(self.blk(self.wte(ids)))


def test_num_params_counts_like_torch_on_an_alias_owner():
    m = Tied()
    t = tl.trace(m, torch.tensor([[1, 2, 3]]))
    for addr in ("wte", "blk", "head", "self"):
        mod = m if addr == "self" else getattr(m, addr)
        rec = t.modules[addr]
        assert rec.num_params == sum(p.numel() for p in mod.parameters(recurse=False)), addr
        assert rec.num_params_total == sum(p.numel() for p in mod.parameters()), addr
        assert rec.all_param_addresses == [
            n if addr == "self" else f"{addr}.{n}" for n, _ in mod.named_parameters()], addr
    head_params = t.modules["head"].params
    assert len(head_params) == 1 and head_params[0] is t.params["wte.weight"]


def test_num_params_counts_like_torch_on_gpt2_lm_head():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    t = tl.trace(model, torch.randint(0, 50, (1, 5)))
    assert t.modules["lm_head"].num_params == model.lm_head.weight.numel() == 50 * 16
    assert t.modules["lm_head"].num_params_total == sum(p.numel() for p in model.lm_head.parameters())
    assert t.modules["self"].num_params_total == sum(p.numel() for p in model.parameters())


# --- tl.fingerprint (glossary l. 922) --------------------------------------------------------

def test_fingerprint_assert_unchanged_passes_on_the_same_architecture_and_fails_typed_on_a_change():
    import torchlens.fingerprint as fingerprint  # tl.fingerprint once the lazy export is wired
    from torchlens.errors import FingerprintMismatchError, InvalidArgumentError

    x = torch.randn(3, 4)
    pinned = tl.trace(_mlp(), x).provenance.fingerprint
    assert fingerprint.of(tl.trace(_mlp(), x)) == pinned == fingerprint.of(_mlp(), x)
    assert fingerprint.assert_unchanged(_mlp(9), pinned, torch.randn(3, 4)) == pinned  # retrained weights: same
    assert fingerprint.assert_unchanged(Renamed(), tl.trace(_mlp(), x), x) == pinned  # a Trace pins too
    with pytest.raises(FingerprintMismatchError) as info:
        fingerprint.assert_unchanged(_mlp(0, nn.GELU), pinned, x)
    assert info.value.code == "fingerprint_changed" and isinstance(info.value, AssertionError)
    assert info.value.fields["expected"] == pinned and info.value.fields["actual"] != pinned
    with pytest.raises(InvalidArgumentError):
        fingerprint.assert_unchanged(_mlp(), "not-a-hash", x)
