"""Patch grids against brute-force forward-hook loops on the HF modules (and a wrapped
`repeat_kv` for query-head grids); refusals raise before anything runs."""

from __future__ import annotations

import pytest
import torch
from mi_models import gpt2, llama

import torchlens_mechinterp as mi
from torchlens.errors import MechInterpError

CLEAN = torch.tensor([[3, 14, 15, 9, 26]])
CORRUPT = torch.tensor([[5, 35, 8, 9, 7]])


def metric(trace):
    logits = trace.output_ops[0].out
    return logits[0, -1, 3] - logits[0, -1, 4]


def _hf_metric(model, ids):
    with torch.no_grad():
        logits = model(ids).logits
    return float(logits[0, -1, 3] - logits[0, -1, 4])


def _with_hook(model, module, hook, ids, pre=False):
    handle = (module.register_forward_pre_hook(hook, with_kwargs=True) if pre else module.register_forward_hook(hook))
    try:
        return _hf_metric(model, ids)
    finally:
        handle.remove()


def _capture(model, module, ids, pre=False):
    box = {}

    def grab_pre(mod, args, kwargs):
        box["v"] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

    def grab(mod, args, out):
        box["v"] = (out[0] if isinstance(out, tuple) else out).detach().clone()

    _with_hook(model, module, grab_pre if pre else grab, ids, pre=pre)
    return box["v"]


def test_head_grid_equals_a_forward_hook_loop_on_c_proj():
    model = gpt2(layers=2, heads=2, d_model=16)
    grid = mi.patch_grid(model, CLEAN, CORRUPT, metric, preset="heads")
    assert grid.axes == ("layer", "head") and grid.shape == (2, 2)
    assert grid.receipts["clean_metric"] == pytest.approx(_hf_metric(model, CLEAN), abs=1e-5)
    assert grid.receipts["corrupted_metric"] == pytest.approx(_hf_metric(model, CORRUPT), abs=1e-5)
    for layer in range(2):
        proj = model.transformer.h[layer].attn.c_proj
        clean_z = _capture(model, proj, CLEAN, pre=True)  # [b, pos, heads * d_head], heads merged
        for head in range(2):
            cols = slice(head * 8, (head + 1) * 8)

            def hook(mod, args, kwargs, cols=cols, clean_z=clean_z):
                x = args[0].clone()
                x[..., cols] = clean_z[..., cols]
                return (x,) + tuple(args[1:]), kwargs

            oracle = _with_hook(model, proj, hook, CORRUPT, pre=True)
            assert grid[layer, head] == pytest.approx(oracle, abs=1e-5), (layer, head)
            assert grid.cells[(layer, head)]["fired"] == 1


def test_resid_pre_grid_equals_a_block_pre_hook_loop():
    model = gpt2(layers=2, heads=2, d_model=16)
    grid = mi.patch_grid(model, CLEAN, CORRUPT, metric, preset="resid_pre", positions=[1, 4])
    assert grid.shape == (2, 5)
    assert torch.isnan(torch.as_tensor(grid[0, 0]))  # not selected: no number
    for layer in range(2):
        block = model.transformer.h[layer]
        clean_x = _capture(model, block, CLEAN, pre=True)
        for pos in (1, 4):
            def hook(mod, args, kwargs, pos=pos, clean_x=clean_x):
                if args:
                    x = args[0].clone()
                    x[:, pos] = clean_x[:, pos]
                    return (x,) + tuple(args[1:]), kwargs
                x = kwargs["hidden_states"].clone()
                x[:, pos] = clean_x[:, pos]
                return args, {**kwargs, "hidden_states": x}

            assert grid[layer, pos] == pytest.approx(_with_hook(model, block, hook, CORRUPT, pre=True), abs=1e-5)


@pytest.mark.parametrize("preset, attr", [("mlp_out", "mlp"), ("attn_out", "attn")])
def test_output_grids_equal_a_module_output_hook_loop(preset, attr):
    model = gpt2(layers=2, heads=2, d_model=16)
    grid = mi.patch_grid(model, CLEAN, CORRUPT, metric, preset=preset)
    assert grid.axes == ("layer",)
    for layer in range(2):
        mod = getattr(model.transformer.h[layer], attr)
        clean_out = _capture(model, mod, CLEAN)

        def hook(m, args, out, clean_out=clean_out):
            return (clean_out,) + tuple(out[1:]) if isinstance(out, tuple) else clean_out

        assert grid[layer] == pytest.approx(_with_hook(model, mod, hook, CORRUPT), abs=1e-5)


def _wrap_repeat_kv(monkeypatch, on_call):
    import transformers.models.llama.modeling_llama as ml

    original = ml.repeat_kv
    count = {"n": 0}

    def wrapped(hidden, n_rep):
        out = original(hidden, n_rep)
        i = count["n"]
        count["n"] += 1
        return on_call(i, out)

    monkeypatch.setattr(ml, "repeat_kv", wrapped)
    return count


@pytest.mark.parametrize("site", ["v", "k"])
def test_query_head_grid_equals_a_wrapped_repeat_kv_loop(monkeypatch, site):
    model = llama(layers=2)
    grid = mi.patch_query_heads_grid(model, CLEAN, CORRUPT, metric, site=site, heads=[(0, 1), (1, 2)])
    assert grid.receipts["num_q_heads"] == 4 and grid.receipts["n_kv_heads"] == 2
    assert len(grid.receipts["expansion_ops"]) == 2 and grid.receipts["site"] == site
    side = 1 if site == "v" else 0  # eager attention expands the keys first, then the values
    saved = {}
    _wrap_repeat_kv(monkeypatch, lambda i, out: saved.setdefault(i, out.detach().clone()) is None or out)
    with torch.no_grad():
        model(CLEAN)
    for layer, head in [(0, 1), (1, 2)]:
        def patch(i, out, layer=layer, head=head):
            if i == 2 * layer + side:
                out = out.clone()
                out[:, head] = saved[i][:, head]
            return out

        counter = _wrap_repeat_kv(monkeypatch, patch)
        oracle = _hf_metric(model, CORRUPT)
        assert counter["n"] == 4
        assert grid[layer, head] == pytest.approx(oracle, abs=1e-5), (layer, head)
    assert torch.isnan(torch.as_tensor(grid[0, 0]))


_FORWARDS = []  # outside the model: a capture restores the model's own attributes


class _Flaky(torch.nn.Module):
    """Calls `mid` on every forward except the fourth: the rerun's edited capture skips it."""

    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.out = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x):
        _FORWARDS.append(1)
        h = self.inp(x)
        if len(_FORWARDS) != 4:
            h = self.mid(h)
        return self.out(torch.relu(h))


def test_a_cell_whose_hook_cannot_fire_raises_instead_of_a_number(monkeypatch):
    import torchlens_mechinterp.patching as patching

    _FORWARDS.clear()
    model = _Flaky()
    # one custom layer preset: the `out` of module `mid`
    monkeypatch.setitem(patching.PRESETS, "mid_out", ("out", ("layer",)))
    monkeypatch.setattr(patching, "_sites_for", lambda trace, preset: [(trace.modules["mid"].calls[0], "out")])
    with pytest.raises(MechInterpError) as exc:
        mi.patch_grid(model, torch.randn(1, 4), torch.randn(1, 4), lambda t: t.output_ops[0].out[0, 0],
                      preset="mid_out")
    assert exc.value.code == "mi_patch_hook_not_fired" and exc.value.remedy


def test_patch_head_on_fused_sdpa_lowers_to_the_projection_add():
    model = gpt2(layers=2, heads=2, d_model=16, attn="sdpa")
    patched = mi.patch_head(model, CORRUPT, module="transformer.h.0.attn", head=1, source=CLEAN)
    r = patched.receipt
    assert r["formula_version"].startswith("mi_head_delta_v1") and r["fired"] == 1
    assert set(r["invalidated_facets"]) == {"z", "result"}
    assert "c_proj" in str(r["weight"]) and r["real_site"] != r["virtual_site"]
    proj = model.transformer.h[0].attn.c_proj
    clean_z = _capture(model, proj, CLEAN, pre=True)

    def hook(mod, args, kwargs):
        x = args[0].clone()
        x[..., 8:16] = clean_z[..., 8:16]
        return (x,) + tuple(args[1:]), kwargs

    oracle = _with_hook(model, proj, hook, CORRUPT, pre=True)
    assert float(metric(patched.trace).detach()) == pytest.approx(oracle, abs=1e-5)
    with pytest.raises(MechInterpError) as exc:
        patched.facets("transformer.h.0.attn")["z"]
    assert exc.value.code == "mi_facet_invalidated"
    assert patched.facets("transformer.h.0.attn")["q"].shape == (1, 5, 2, 8)
    assert "z" in patched.facets("transformer.h.1.attn").keys()


def test_patch_head_by_pattern_equals_pattern_times_v_through_the_projection():
    model = gpt2(layers=1, heads=2, d_model=16, attn="sdpa")
    uniform = torch.tril(torch.ones(5, 5))
    uniform = (uniform / uniform.sum(-1, keepdim=True))[None]
    patched = mi.patch_head(model, CORRUPT, module="transformer.h.0.attn", head=0, pattern=uniform)
    assert "pattern" in patched.receipt["invalidated_facets"]
    attn = model.transformer.h[0].attn
    qkv = _capture(model, attn.c_attn, CORRUPT)
    v0 = qkv[..., 32:40]  # value columns of head 0
    z0 = uniform @ v0

    def hook(mod, args, kwargs):
        x = args[0].clone()
        x[..., 0:8] = z0
        return (x,) + tuple(args[1:]), kwargs

    assert float(metric(patched.trace).detach()) == pytest.approx(_with_hook(model, attn.c_proj, hook, CORRUPT, pre=True),
                                                         abs=1e-5)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("call, code", [
    (lambda m: mi.patch_grid(m, CLEAN, CORRUPT, metric, preset="nope"), "mi_patch_preset_unknown"),
    (lambda m: mi.patch_grid(m, CLEAN, CORRUPT, metric, engine="replay"), "mi_patch_engine_reserved"),
    (lambda m: mi.patch_grid(m, CLEAN, CORRUPT, metric, budget=0), "mi_patch_setting_invalid"),
    (lambda m: mi.patch_grid(m, CLEAN, CORRUPT, 3), "mi_patch_setting_invalid"),
    (lambda m: mi.patch_grid(m, CLEAN, CORRUPT, metric, budget=1), "mi_patch_budget_exceeded"),
    (lambda m: mi.patch_grid(m, CLEAN, CORRUPT, metric, heads=[(0, 9)]), "mi_patch_setting_invalid"),
    (lambda m: mi.patch_grid(m, CLEAN, CORRUPT[:, :4], metric), "mi_patch_inputs_mismatched"),
    (lambda m: mi.patch_grid(m, CLEAN, CORRUPT, lambda t: t.output_ops[0].out[0, -1], heads=[(0, 0)]),
     "mi_patch_metric_invalid"),
    (lambda m: mi.patch_query_heads_grid(m, CLEAN, CORRUPT, metric), "mi_kv_heads_not_grouped"),
    (lambda m: mi.patch_query_heads_grid(m, CLEAN, CORRUPT, metric, site="q"), "mi_patch_setting_invalid"),
    (lambda m: mi.patch_head(m, CORRUPT, module="transformer.h.0.attn", head=0), "mi_patch_setting_invalid"),
    (lambda m: mi.patch_head(m, CORRUPT, module="transformer.h.0.attn", head=7, source=CLEAN),
     "mi_patch_setting_invalid"),
    (lambda m: mi.patch_head(m, CORRUPT, module="transformer.h.0", head=0, source=CLEAN), "mi_no_attention"),
])
def test_gpt2_refusals_run_no_cell_and_leave_the_model_unchanged(call, code):
    model = gpt2(layers=1, heads=2, d_model=16)
    before = _state(model)
    with pytest.raises(MechInterpError) as exc:
        call(model)
    assert exc.value.code == code and exc.value.remedy
    assert _same(before, _state(model))
    assert not model.transformer.h[0].attn.c_proj._forward_pre_hooks


def test_gqa_refusals(monkeypatch):
    sdpa = llama(layers=1, attn="sdpa")
    with pytest.raises(MechInterpError) as exc:
        mi.patch_query_heads_grid(sdpa, CLEAN, CORRUPT, metric)
    assert exc.value.code == "mi_kv_expansion_unavailable" and "eager" in exc.value.remedy
    eager = llama(layers=1)
    with pytest.raises(MechInterpError) as exc:
        mi.patch_grid(eager, CLEAN, CORRUPT, metric, preset="heads_v")
    assert exc.value.code == "mi_patch_site_unwritable" and "patch_query_heads_grid" in exc.value.remedy
    import transformers.models.llama.modeling_llama as ml

    original = ml.repeat_kv

    def twice(hidden, n_rep):  # a second expansion of the same tensor: which copy to patch is ambiguous
        first = original(hidden, n_rep)
        return original(hidden, n_rep) + 0 * first

    monkeypatch.setattr(ml, "repeat_kv", twice)
    before = _state(eager)
    with pytest.raises(MechInterpError) as exc:
        mi.patch_query_heads_grid(eager, CLEAN, CORRUPT, metric)
    assert exc.value.code == "mi_kv_expansion_ambiguous"
    assert _same(before, _state(eager))


def test_patch_head_on_gqa_sdpa_equals_an_o_proj_pre_hook():
    model = llama(layers=1, attn="sdpa")
    patched = mi.patch_head(model, CORRUPT, module="model.layers.0.self_attn", head=3, source=CLEAN)
    assert patched.receipt["weight"].endswith("o_proj.weight")
    proj = model.model.layers[0].self_attn.o_proj
    clean_z = _capture(model, proj, CLEAN, pre=True)

    def hook(mod, args, kwargs):
        x = args[0].clone()
        x[..., 24:32] = clean_z[..., 24:32]
        return (x,) + tuple(args[1:]), kwargs

    assert float(metric(patched.trace).detach()) == pytest.approx(_with_hook(model, proj, hook, CORRUPT, pre=True), abs=1e-5)


def test_a_grid_on_a_partial_capture_refuses_with_every_missing_payload():
    model = gpt2(layers=2, heads=2, d_model=16)
    with pytest.raises(MechInterpError) as exc:
        mi.patch_grid(model, CLEAN, CORRUPT, metric, trace_kwargs={"save": ["transformer.h.0.ln_1"]})
    assert exc.value.code == "mi_payloads_missing"
    import torchlens as tl

    full = tl.trace(model, CORRUPT)
    homes = {b.facets["z"].spec.home for b in full.attention_blocks()}
    assert homes <= set(exc.value.fields["missing"]) and len(homes) == 2


def test_patch_head_refuses_a_projection_weight_that_does_not_reproduce_the_result_facet(monkeypatch):
    import torchlens_mechinterp.patching as patching

    real = patching._projection
    monkeypatch.setattr(patching, "_projection", lambda trace, label: (real(trace, label)[0] * 2, "wrong"))
    model = gpt2(layers=1, heads=2, d_model=16, attn="sdpa")
    before = _state(model)
    with pytest.raises(MechInterpError) as exc:
        mi.patch_head(model, CORRUPT, module="transformer.h.0.attn", head=0, source=CLEAN)
    assert exc.value.code == "mi_patch_head_unsupported" and exc.value.remedy
    assert _same(before, _state(model))


def test_llama_head_grid_equals_an_o_proj_pre_hook_loop():
    model = llama(layers=2)
    grid = mi.patch_grid(model, CLEAN, CORRUPT, metric, preset="heads", heads=[(0, 1), (1, 3)])
    assert grid.shape == (2, 4) and len(grid.cells) == 2
    for layer, head in [(0, 1), (1, 3)]:
        proj = model.model.layers[layer].self_attn.o_proj
        clean_z = _capture(model, proj, CLEAN, pre=True)
        cols = slice(head * 8, (head + 1) * 8)

        def hook(mod, args, kwargs, cols=cols, clean_z=clean_z):
            x = args[0].clone()
            x[..., cols] = clean_z[..., cols]
            return (x,) + tuple(args[1:]), kwargs

        assert grid[layer, head] == pytest.approx(_with_hook(model, proj, hook, CORRUPT, pre=True), abs=1e-5)
