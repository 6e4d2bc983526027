"""Generation recording on torch (issue 22 parts 3-4): tl.record(..., generate_kwargs=) over GPT-2 and
LLaMA (random init), compared with generate() alone and with forward hooks during a hooked generate();
streaming options (reducers, kv_sites, keep_last, spill, budget) and every generation refusal."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import torchlens as tl
from torchlens.errors import RecordingError
from torchlens.options import CaptureOptions, RecordingOptions

transformers = pytest.importorskip("transformers")
GenerationOptions = tl.recording.GenerationOptions
reducers = tl.recording.reducers


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=256, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval(), "transformer.h.1"


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(cfg).eval(), "model.layers.1"


GK = {"max_new_tokens": 20, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}


def _hooked(model, site, fn):
    got = []
    mod = dict(model.named_modules())[site]
    h = mod.register_forward_hook(lambda m, a, o: got.append((o[0] if isinstance(o, tuple) else o).detach().clone()))
    try:
        out = fn()
    finally:
        h.remove()
    return got, out


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_generation_matches_generate_and_hooks(make):
    model, site = make()
    x = torch.randint(1, 100, (1, 6))
    g = tl.record(model, x, save=tl.module(site), generate_kwargs=GK)
    alone = model.generate(x, **GK)
    assert torch.equal(g.sequences, alone) and g.sequences.shape[1] == 6 + 20
    hooked, out = _hooked(model, site, lambda: model.generate(x, **GK))
    assert torch.equal(out, alone)
    assert g.n_steps == len(hooked) == 20 and g.prompt_length == 6
    assert g.steps[0].positions == range(0, 6) and g.steps[0].kind == "prefill"
    for k in range(1, 20):
        assert g.steps[k].positions == range(6 + k - 1, 6 + k) and g.steps[k].kind == "decode"
    for k, want in enumerate(hooked):
        (r,) = g.records_at(k)
        assert r.label == site and torch.equal(r.value, want)
        assert r.value.shape[1] == len(g.steps[k].positions)  # a decode step holds only its new position
    assert g.step_of_position(0) == 0 and g.step_of_position(6 + 4) == 5
    with pytest.raises(RecordingError) as exc:
        g.step_of_position(6 + 19)  # the last token's own position never runs a forward
    assert exc.value.code == "record_generation_step_missing"
    with pytest.raises(RecordingError) as exc:
        g.records_at(20)
    assert exc.value.code == "record_generation_step_missing"
    assert g.recording.num_passes == 20 and [s.pass_number for s in g.steps] == list(range(1, 21))
    assert torch.equal(g.output, alone) and g.recording.output is g.output
    assert g.recording.outcome.inference_only is True and g.recording.lean_omissions
    series = g.series(site)
    assert series.positions == range(0, 25) and len(series) == 25
    assert torch.equal(series.values, torch.cat([h[0] for h in hooked]))
    assert g.settings["max_new_tokens"] == 20 and "rng_state_digest" in g.settings
    assert len(g.not_recorded) == 3
    with pytest.raises(RecordingError) as exc:
        g.recording.to_trace()
    assert exc.value.code == "recording_lean_omitted"


def test_op_level_save_captures_every_forward():
    """An op selector runs each forward generate() makes through tl.trace's capture: the steps carry
    op counts and full traces, and the kept op values equal the modules' outputs during a hooked generate."""
    model, site = _gpt2()
    x = torch.randint(1, 100, (1, 5))
    gk = {**GK, "max_new_tokens": 4}
    g = tl.record(model, x, save=tl.func("layer_norm"), generate_kwargs=gk)
    assert torch.equal(g.sequences, model.generate(x, **gk))
    got = []
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    hs = [m.register_forward_hook(lambda mod, a, o: got.append(o.detach().clone())) for m in norms]
    try:
        model.generate(x, **gk)
    finally:
        for h in hs:
            h.remove()
    per_forward = len(norms)  # ln_1, ln_2 per block and ln_f, each once per forward
    assert len(got) == per_forward * g.n_steps
    for k in range(g.n_steps):
        recs = g.records_at(k)
        assert len(recs) == per_forward and all(r.label.startswith("layernorm") for r in recs)
        for r, want in zip(recs, got[k * per_forward:(k + 1) * per_forward]):
            assert torch.equal(r.value, want) and r.value.shape[1] == len(g.steps[k].positions)
        assert g.steps[k].n_ops == len(g.recording.to_trace(k + 1).ops) > per_forward
    conv = g.recording.to_trace(2)
    assert [o.label for o in conv.ops if o.saved and o.kind != "output"] == [r.label for r in g.records_at(1)]
    assert not g.recording.lean_omissions
    assert "forward" not in model.__dict__  # the driver put the model back


def test_sampling_with_seed_matches_generate_alone():
    model, site = _gpt2()
    x = torch.randint(1, 100, (1, 4))
    gk = {"max_new_tokens": 8, "do_sample": True, "top_k": 10, "pad_token_id": 0, "eos_token_id": None}
    g = tl.record(model, x, save=tl.module(site), generate_kwargs=gk, capture=CaptureOptions(seed=7))
    torch.manual_seed(7)
    assert torch.equal(g.sequences, model.generate(x, **gk))
    assert g.settings["seed"] == 7


def test_reducers_replace_payloads():
    model, site = _gpt2()
    x = torch.randint(1, 100, (1, 5))
    gk = {**GK, "max_new_tokens": 5}
    probe_layer = nn.Linear(32, 3)
    opts = GenerationOptions(reducers={site: reducers.norm(), "transformer.h.0": reducers.probe(probe_layer)})
    g = tl.record(model, x, generate_kwargs=gk, generation=opts)
    hooked, _ = _hooked(model, site, lambda: model.generate(x, **gk))
    hooked0, _ = _hooked(model, "transformer.h.0", lambda: model.generate(x, **gk))
    for k in range(g.n_steps):
        recs = {r.label: r for r in g.records_at(k)}
        assert torch.allclose(recs[site].value, hooked[k][0].norm(dim=-1))
        assert recs[site].meta["reduced_from_shape"] == tuple(hooked[k].shape)
        assert recs[site].meta["reducer"].startswith("norm")
        with torch.no_grad():
            assert torch.allclose(recs["transformer.h.0"].value, probe_layer(hooked0[k][0]), atol=1e-6)
    assert g.series(site).values.shape == (5 + 4,)


def test_top_k_and_sklearn_probe():
    model, site = _gpt2()
    x = torch.randint(1, 100, (1, 5))
    gk = {**GK, "max_new_tokens": 3}
    g = tl.record(model, x, generate_kwargs=gk, generation=GenerationOptions(reducers={site: reducers.top_k(4, dim=-1, position_dim=1)}))
    hooked, _ = _hooked(model, site, lambda: model.generate(x, **gk))
    for k in range(g.n_steps):
        assert torch.equal(g.records_at(k)[0].value, hooked[k].topk(4, dim=-1).indices.movedim(1, 0))
    feats = torch.cat([h[0] for h in hooked]).numpy()

    class FittedLinear:  # the scikit-learn linear estimator surface: coef_ [1, d] and intercept_ [1] (binary)
        coef_ = np.random.default_rng(0).normal(size=(1, 32))
        intercept_ = np.array([0.25])

    g = tl.record(model, x, generate_kwargs=gk, generation=GenerationOptions(reducers={site: reducers.probe(FittedLinear())}))
    got = torch.cat([g.records_at(k)[0].value for k in range(g.n_steps)]).numpy()
    assert got.shape == (5 + 2,)
    assert abs(got - (feats @ FittedLinear.coef_[0] + 0.25)).max() < 1e-4
    w, b = torch.randn(2, 32), torch.randn(2)
    g = tl.record(model, x, generate_kwargs=gk, generation=GenerationOptions(reducers={site: reducers.probe((w, b))}))
    assert torch.allclose(g.series(site).values, torch.from_numpy(feats) @ w.T + b, atol=1e-5)


def test_reducer_wrong_first_axis_refuses():
    model, site = _gpt2()
    x = torch.randint(1, 100, (1, 5))
    bad = GenerationOptions(reducers={site: lambda v: v.sum()})
    with pytest.raises(RecordingError) as exc:
        tl.record(model, x, generate_kwargs=GK, generation=bad)
    assert exc.value.code == "record_generation_reducer_invalid"
    for fn in (lambda v: [1, 2], lambda v: 1 / 0):
        with pytest.raises(RecordingError) as exc:
            tl.record(model, x, generate_kwargs=GK, generation=GenerationOptions(reducers={site: fn}))
        assert exc.value.code == "record_generation_reducer_invalid"
    with pytest.raises(RecordingError) as exc:
        tl.record(model, x, generate_kwargs=GK, generation=GenerationOptions(kv_sites=[7]))
    assert exc.value.code == "record_generation_reducer_invalid"
    assert not model._forward_hooks and not model._forward_pre_hooks  # the driver removed its hooks


def test_kv_sites_keep_last_and_spill(tmp_path):
    model, site = _gpt2()
    x = torch.randint(1, 100, (1, 5))
    gk = {**GK, "max_new_tokens": 10}
    full = tl.record(model, x, save=tl.module(site), generate_kwargs=gk, generation=GenerationOptions(kv_sites=True))
    out = model.generate(x, **gk, return_dict_in_generate=True)
    cache = out.past_key_values
    for layer in range(2):
        keys = full.series(f"kv.{layer}.key")
        assert keys.positions == range(0, 14)
        want = cache.layers[layer].keys[0].permute(1, 0, 2)
        assert torch.allclose(keys.values, want[:14])
    spilled = tl.record(model, x, save=tl.module(site), generate_kwargs=gk,
                        generation=GenerationOptions(kv_sites=[0], keep_last=3, spill=tmp_path))
    assert spilled.evicted_steps == {k: "spilled" for k in range(7)}
    assert len(list(tmp_path.iterdir())) == 7
    assert torch.equal(spilled.series(site).values, full.series(site).values)
    assert torch.equal(spilled.series("kv.0.value").values, full.series("kv.0.value").values)
    assert spilled.records_at(0)[0].meta["payload"] == "spilled" and spilled.records_at(0)[0].value is None
    assert spilled.peak_saved_bytes < full.peak_saved_bytes
    dropped = tl.record(model, x, save=tl.module(site), generate_kwargs=gk, generation=GenerationOptions(keep_last=2))
    assert set(dropped.evicted_steps.values()) == {"dropped"}
    assert torch.equal(dropped.value(site, 9), full.value(site, 9))
    tail = dropped.series(site)  # the kept steps 8 and 9
    assert tail.positions == range(12, 14) and torch.equal(tail.values, full.series(site).values[12:])
    with pytest.raises(RecordingError) as exc:
        dropped.value(site, 0)
    assert exc.value.code == "record_generation_step_missing"
    with pytest.raises(RecordingError) as exc:
        dropped.series("no.such.site")
    assert exc.value.code == "record_generation_step_missing"


def test_budget_refuses_after_the_first_decode_step():
    model, site = _gpt2()
    x = torch.randint(1, 100, (1, 5))
    forwards = []
    h = model.register_forward_pre_hook(lambda m, a: forwards.append(1))
    try:
        with pytest.raises(RecordingError) as exc:
            tl.record(model, x, save=tl.module(site), generate_kwargs={**GK, "max_new_tokens": 200},
                      generation=GenerationOptions(max_saved_bytes=5 * 32 * 4 + 50 * 32 * 4))
    finally:
        h.remove()
    assert exc.value.code == "record_generation_budget_exceeded"
    assert len(forwards) == 2  # the prefill and one decode step, then the projection refused
    assert exc.value.fields["projected_bytes"] == 5 * 32 * 4 + 199 * 32 * 4
    g = tl.record(model, x, save=tl.module(site), generate_kwargs={**GK, "max_new_tokens": 200},
                  generation=GenerationOptions(max_saved_bytes=5 * 32 * 4 + 50 * 32 * 4, keep_last=8))
    assert g.n_steps == 200 and g.peak_saved_bytes <= 5 * 32 * 4 + 7 * 32 * 4


@pytest.mark.parametrize("kwargs,reason", [
    ({"generate_kwargs": {**GK, "num_beams": 2}}, "beam_search"),
    ({"generate_kwargs": {**GK, "num_return_sequences": 2, "do_sample": True}}, "num_return_sequences"),
    ({"generate_kwargs": {**GK, "use_cache": False}}, "use_cache_false"),
    ({"generate_kwargs": {**GK, "assistant_model": object()}}, "assisted_decoding"),
    ({"generate_kwargs": GK, "intervene": tl.when(tl.module("transformer.h.0"), tl.zero_ablate())}, "intervene"),
    ({"generate_kwargs": GK, "stop_after": tl.module("transformer.h.0")}, "stop_after"),
    ({"generate_kwargs": GK, "recording": RecordingOptions(on_forward_error="return_partial")}, "on_forward_error"),
    ({"generate_kwargs": GK, "save": "all"}, "save_all"),
])
def test_generation_refusals(kwargs, reason):
    model, site = _gpt2()
    x = torch.randint(1, 100, (1, 5))
    kwargs.setdefault("save", tl.module(site))
    with pytest.raises(RecordingError) as exc:
        tl.record(model, x, **kwargs)
    assert exc.value.code == "record_generation_unsupported" and exc.value.fields["reason"] == reason


def test_generation_refusals_from_the_model():
    model, site = _gpt2()
    with pytest.raises(RecordingError) as exc:
        tl.record(model, torch.randint(1, 100, (2, 5)), save=tl.module(site), generate_kwargs=GK)
    assert exc.value.fields["reason"] == "batched_prompts"
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2,
                                             decoder_start_token_id=0)).eval()
    with pytest.raises(RecordingError) as exc:
        tl.record(t5, torch.randint(1, 50, (1, 4)), save=tl.module("encoder"), generate_kwargs=GK)
    assert exc.value.fields["reason"] == "encoder_decoder"
    with pytest.raises(RecordingError) as exc:
        tl.record(nn.Linear(2, 2), torch.randn(1, 2), save=tl.module("self"), generate_kwargs=GK)
    assert exc.value.fields["reason"] == "no_generate"


def test_generation_options_invalid():
    model, site = _gpt2()
    x = torch.randint(1, 100, (1, 5))
    with pytest.raises(RecordingError) as exc:
        tl.record(model, x, save=tl.module(site), generation=GenerationOptions())
    assert exc.value.code == "record_generation_options_invalid"
    with pytest.raises(RecordingError) as exc:
        tl.record(model, x, save=tl.module(site), generate_kwargs=GK, generation={"keep_last": 2})
    assert exc.value.code == "record_generation_options_invalid"
