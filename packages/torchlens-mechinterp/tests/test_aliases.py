"""resolve_alias / alias_report: resolved values against forward hooks on the HF modules."""

from __future__ import annotations

import pytest
import torch
from mi_models import gpt2, llama, neox

import torchlens as tl
import torchlens_mechinterp as mi
from torchlens.errors import MechInterpError

IDS = torch.tensor([[3, 14, 15, 9, 26]])
ABSENT_ON_GPT2 = {"hook_rot_q", "hook_rot_k", "hook_pre_linear"}
RECONSTRUCTED_ON_GPT2 = {"hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input", "ln1.hook_scale",
                         "ln1.hook_normalized", "ln2.hook_scale", "ln2.hook_normalized", "hook_result",
                         "ln_final.hook_scale", "ln_final.hook_normalized"}


def _hooked(model, ids):
    """Every module's input and output on one plain forward (hooks on the HF modules)."""
    seen = {}
    handles = []
    for name, mod in model.named_modules():
        def pre(m, args, kwargs, name=name):
            x = args[0] if args else kwargs.get("hidden_states")
            seen[name + ":in"] = x

        def post(m, args, out, name=name):
            seen[name + ":out"] = out[0] if isinstance(out, tuple) else out

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post))
    try:
        with torch.no_grad():
            res = model(ids, output_attentions=True)
    finally:
        for h in handles:
            h.remove()
    return seen, res


def test_gpt2_report_resolves_every_tl4_name_with_a_native_coordinate():
    model = gpt2(layers=2)
    trace = tl.trace(model, IDS)
    report = mi.alias_report(trace, generation="tl4")
    assert len(report) > 80 and report.counts["needs_capture"] == 0 and report.counts["ambiguous"] == 0
    for row in report:
        suffix = row.alias.split(".", 2)[-1] if row.alias.startswith("blocks.") else row.alias
        tail = row.alias.split(".")[-1]
        if tail in ABSENT_ON_GPT2:
            assert row.status == "structurally_absent" and row.remedy, row
        elif any(suffix.endswith(r) for r in RECONSTRUCTED_ON_GPT2):
            assert row.status == "reconstructed_read_only" and row.reconstruction and row.remedy, row
        else:
            assert row.status == "real", row
        if row.status != "structurally_absent":
            assert row.value is not None
    assert "reconstructed_read_only" in str(report)


def test_resolved_values_equal_forward_hooks_on_the_hf_modules():
    model = gpt2(layers=2)
    trace = tl.trace(model, IDS)
    seen, res = _hooked(model, IDS)
    h = "transformer.h"

    def val(name, generation=None):
        return mi.resolve_alias(trace, name, generation).value

    checks = {
        "hook_embed": seen["transformer.wte:out"],
        "hook_pos_embed": seen["transformer.wpe:out"],
        "blocks.1.hook_resid_pre": seen[f"{h}.1:in"],
        "blocks.1.hook_in": seen[f"{h}.1:in"],
        "blocks.0.hook_resid_mid": seen[f"{h}.0.ln_2:in"],
        "blocks.0.hook_resid_post": seen[f"{h}.0:out"],
        "blocks.0.hook_attn_out": seen[f"{h}.0.attn:out"],
        "blocks.1.hook_mlp_out": seen[f"{h}.1.mlp:out"],
        "blocks.1.attn.hook_z": seen[f"{h}.1.attn.c_proj:in"].reshape(1, 5, 4, 8),
        "blocks.0.attn.hook_q": seen[f"{h}.0.attn.c_attn:out"][..., :32].reshape(1, 5, 4, 8),
        "blocks.0.attn.hook_pattern": res.attentions[0],
        "blocks.1.mlp.hook_post": seen[f"{h}.1.mlp.act:out"],
        "ln_final.hook_in": seen["transformer.ln_f:in"],
        "unembed.hook_in": seen["transformer.ln_f:out"],
        "hook_unembed": res.logits,
        "blocks.0.ln2.hook_out": seen[f"{h}.0.ln_2:out"],
        ("layers_output[1]", "nnterp"): seen[f"{h}.1:out"],
        ("attentions_output[0]", "nnterp"): seen[f"{h}.0.attn:out"],
        ("mlps_input[0]", "nnterp"): seen[f"{h}.0.mlp:in"],
        ("logits", "nnterp"): res.logits,
        ("resid_post.1", "interp-engine"): seen[f"{h}.1:out"],
        ("attn_out.0", "interp-engine"): seen[f"{h}.0.attn:out"],
        ("mlp_act.0", "interp-engine"): seen[f"{h}.0.mlp.act:out"],
        ("embeddings", "interp-engine"): seen["transformer.wte:out"],
    }
    for name, expected in checks.items():
        got = val(*name) if isinstance(name, tuple) else val(name)
        assert torch.allclose(torch.as_tensor(got), expected, atol=1e-5), name
    # reconstructed: TransformerLens's LayerNorm scale / normalized, checked through the norm's own affine map
    ln_f = model.transformer.ln_f
    normalized = val("ln_final.hook_normalized")
    assert torch.allclose(normalized * ln_f.weight + ln_f.bias, seen["transformer.ln_f:out"], atol=1e-5)
    x = seen["transformer.ln_f:in"]
    assert torch.allclose(normalized * val("ln_final.hook_scale"), x - x.mean(-1, keepdim=True), atol=1e-5)
    ln1 = model.transformer.h[1].ln_1
    assert torch.allclose(val("blocks.1.ln1.hook_normalized") * ln1.weight + ln1.bias, seen[f"{h}.1.ln_1:out"],
                          atol=1e-5)
    per_head = val("blocks.0.hook_attn_in")
    assert per_head.shape == (1, 5, 4, 32) and torch.equal(per_head[:, :, 2], seen[f"{h}.0:in"])


def test_structural_statuses_on_rotary_parallel_and_fused_models():
    neo = tl.trace(neox(layers=1), IDS)
    assert mi.resolve_alias(neo, "blocks.0.hook_resid_mid").status == "structurally_absent"
    assert mi.resolve_alias(neo, "hook_pos_embed").status == "structurally_absent"
    lm = llama(layers=1)
    lt = tl.trace(lm, IDS)
    rot = mi.resolve_alias(lt, "blocks.0.attn.hook_rot_q")
    assert rot.status == "real" and rot.value.shape == (1, 5, 4, 8)
    q = mi.resolve_alias(lt, "blocks.0.attn.hook_q").value
    assert not torch.allclose(rot.value[:, 1:], q[:, 1:])  # rotary moved every position but the first
    assert torch.allclose(rot.value[:, 0], q[:, 0], atol=1e-6)  # position 0: cos = 1, sin = 0
    sdpa = tl.trace(gpt2(layers=1, attn="sdpa"), IDS)
    assert mi.resolve_alias(sdpa, "blocks.0.attn.hook_pattern").status == "reconstructed_read_only"


def test_needs_capture_names_the_missing_payload():
    model = gpt2(layers=1)
    trace = tl.trace(model, IDS, save=["transformer.h.0.ln_1"])
    r = mi.resolve_alias(trace, "blocks.0.attn.hook_z")
    assert r.status == "needs_capture" and "save" in r.remedy
    with pytest.raises(MechInterpError) as exc:
        _ = r.value
    assert exc.value.code == "mi_alias_unresolved"


def _digest(trace):
    return [(o.label, o.saved) for o in trace._ops.values()]


@pytest.mark.parametrize("call, code", [
    (lambda t: mi.resolve_alias(t, "blocks.0.hook_nonsense"), "mi_alias_unknown"),
    (lambda t: mi.resolve_alias(t, 3), "mi_alias_unknown"),
    (lambda t: mi.resolve_alias(t, "layers_output[0]", generation="tl2"), "mi_alias_unknown"),
    (lambda t: mi.resolve_alias(t, "blocks.0.hook_resid_pre", generation="tl9"), "mi_alias_generation_unknown"),
    (lambda t: mi.alias_report(t, generation="nnsight"), "mi_alias_generation_unknown"),
    (lambda t: mi.resolve_alias(t, "blocks.0.attn.hook_rot_q").value, "mi_alias_unresolved"),
    (lambda t: mi.resolve_alias(t, "blocks.7.hook_resid_pre").value, "mi_alias_unresolved"),
])
def test_alias_refusals_leave_the_trace_unchanged(call, code):
    trace = tl.trace(gpt2(layers=1), IDS)
    before = _digest(trace)
    with pytest.raises(MechInterpError) as exc:
        call(trace)
    assert exc.value.code == code and exc.value.remedy
    assert _digest(trace) == before


def test_the_appliance_serves_the_alias_functions():
    trace = tl.trace(gpt2(layers=1), IDS)
    bound = trace.using("mechinterp")
    assert torch.equal(bound.resolve_alias("blocks.0.hook_resid_post").value,
                       mi.resolve_alias(trace, "resid_post.0", "interp-engine").value)
    assert bound.alias_report("nnterp").counts == mi.alias_report(trace, "nnterp").counts
