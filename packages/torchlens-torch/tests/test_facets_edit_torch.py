"""Facet edits (tl.facet / tl.head as do sites): the scatter-back edit equals the same edit
done with a plain forward hook on the home module, and every fail-closed case refuses with
its code before anything is staged (spec/facets.md "Intervention", issue 15 §5)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import torchlens as tl
from torchlens.select.facet import lower_facet

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers next to this file
from facet_models import gpt2 as _gpt2, ids as _ids, llama as _llama  # noqa: E402


def _do_facet(trace, selector, edit, model, ids):
    """Stage a facet edit through do() on the rerun engine (lowered against its structure-only capture)."""
    return trace.do(selector, edit, model=model, inputs=ids)


def _logits(trace):
    return trace.output_ops[0].out


def _hooked_logits(model, module, cols, ids):
    def hook(m, args, out):
        out = out.clone()
        out[..., cols] = 0
        return out

    h = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        h.remove()


def test_gpt2_head_q_zero_ablation_equals_a_forward_hook():
    model, ids = _gpt2("eager"), _ids()
    log = tl.trace(model, ids)
    edited = _do_facet(log.fork("ablated"), tl.head(3, "q").in_module("transformer.h.0.attn"), tl.zero_ablate(),
                       model, ids)
    want = _hooked_logits(model, model.transformer.h[0].attn.c_attn, slice(24, 32), ids)  # q third, head 3
    assert torch.equal(_logits(edited), want)
    assert not torch.equal(_logits(edited), _logits(log))  # the edit changed something


def test_llama_head_q_zero_ablation_equals_a_forward_hook():
    model, ids = _llama("eager"), _ids()
    log = tl.trace(model, ids)
    edited = _do_facet(log.fork("ablated"), tl.facet("q").head(3).in_module("model.layers.1.self_attn"),
                       tl.zero_ablate(), model, ids)
    want = _hooked_logits(model, model.model.layers[1].self_attn.q_proj, slice(24, 32), ids)
    assert torch.equal(_logits(edited), want)
    assert not torch.equal(_logits(edited), _logits(log))


def test_non_overlapping_same_home_writes_compose():
    """GPT-2 c_attn holds q, k and v: q head 0 and k head 1 compose on the one home op."""
    model, ids = _gpt2("eager"), _ids()
    log = tl.trace(model, ids)
    fork = log.fork("two")
    site = "transformer.h.0.attn"
    lowered = (lower_facet(fork, tl.head(0, "q").in_module(site), tl.zero_ablate())
               + lower_facet(fork, tl.head(1, "k").in_module(site), tl.zero_ablate()))
    assert len(lowered) == 2 and len({label for label, _, _ in lowered}) == 1  # one home: c_attn's output
    plan = {}
    for label, e, _ in lowered:  # the two writes on the one home, applied in attach order
        prev = plan.get(label)
        plan[label] = e if prev is None else _chain(prev, e)
    fork.do(plan, model=model, inputs=ids)
    cols = torch.zeros(96, dtype=torch.bool)
    cols[0:8] = True  # q head 0
    cols[32 + 8:32 + 16] = True  # k head 1
    want = _hooked_logits(model, model.transformer.h[0].attn.c_attn, cols, ids)
    assert torch.equal(_logits(fork), want)


def _chain(a, b):
    from torchlens.intervention.edits import Edit

    return Edit("chain", (("a", a.identity()), ("b", b.identity())), lambda v, ctx: b(a(v, ctx), ctx))


def test_overlapping_same_home_writes_refuse_before_staging():
    model, ids = _gpt2("eager"), _ids()
    log = tl.trace(model, ids)
    fork = log.fork("overlap")
    site = "transformer.h.0.attn"
    lower_facet(fork, tl.head(2, "q").in_module(site), tl.zero_ablate())
    before = dict(fork.__dict__["_facet_writes"])
    with pytest.raises(tl.errors.FacetError) as exc:
        lower_facet(fork, tl.facet("q").in_module(site), tl.scale(2.0))  # all of q covers head 2
    assert exc.value.code == "facet_write_overlap"
    assert fork.__dict__["_facet_writes"].keys() == before.keys()
    assert fork.is_pristine


@pytest.mark.parametrize("case, code", [
    (lambda: tl.head(9, "q").in_module("transformer.h.0.attn"), "facet_index_out_of_range"),
    (lambda: tl.head(0, "q").in_module("transformer.h.0.mlp"), "facet_not_attention"),
    (lambda: tl.facet("nonexistent").in_module("transformer.h.0.attn"), "facet_unknown"),
    (lambda: tl.facet("result").in_module("transformer.h.0.attn"), "facet_write_refused"),
])
def test_bad_facet_edits_refuse_with_their_code(case, code):
    model, ids = _gpt2("sdpa"), _ids()
    log = tl.trace(model, ids)
    fork = log.fork("bad")
    with pytest.raises(tl.errors.TorchLensError) as exc:
        lower_facet(fork, case(), tl.zero_ablate())
    assert exc.value.code == code
    assert not fork._facet_writes and fork.is_pristine


def test_computed_sdpa_pattern_and_gqa_alias_heads_are_read_only():
    model, ids = _llama("sdpa"), _ids()
    log = tl.trace(model, ids)
    fork = log.fork("ro")
    site = "model.layers.0.self_attn"
    for sel in (tl.facet("pattern").in_module(site), tl.head(3, "k").in_module(site)):
        with pytest.raises(tl.errors.FacetError) as exc:
            lower_facet(fork, sel, tl.zero_ablate())
        assert exc.value.code == "facet_write_refused"
    f = log.modules[site].facets
    assert f.head(3).k.capability == "aliasing_selection"
    assert torch.equal(f.head(3).k.value, f["k"].value[:, :, 1])  # query head 3 reads K/V head 3 // 2


def test_facet_selector_never_resolves_to_whole_ops():
    model, ids = _gpt2("eager"), _ids()
    log = tl.trace(model, ids)
    with pytest.raises(tl.errors.SelectorCompositionError) as exc:
        log[tl.head(3)]
    assert exc.value.code == "facet_selector_unsupported"
    with pytest.raises(tl.errors.SelectorCompositionError) as exc:
        tl.head(1).in_module("a").in_module("b")
    assert exc.value.code == "selector_module_facet_scope_conflict"


def test_unscoped_head_warns_its_fanout():
    model, ids = _gpt2("eager"), _ids()
    log = tl.trace(model, ids)
    with pytest.warns(tl.errors.FacetWarning) as rec:
        lowered = lower_facet(log.fork("f"), tl.head(1), tl.zero_ablate())
    assert rec[0].message.code == "facet_selector_fanout" and rec[0].message.fields["site_count"] == 6
    assert len(lowered) == 2  # q, k and v of each layer share that layer's c_attn home


def test_scatter_back_keeps_dtype_shape_and_memory_format():
    from torchlens.facets.spec import FacetSpec

    from torchlens_torch.edit_ops import TorchEditOps

    home = torch.randn(2, 6, 4, 4).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    spec = FacetSpec(home_kind="op", home="h").split(3, dim=1)[1].select(1, 0)
    edited = spec.scatter_update(home, torch.zeros(2, 4, 4, dtype=torch.bfloat16), TorchEditOps())
    want = home.clone()
    want[:, 2] = 0
    assert torch.equal(edited, want) and edited.dtype == torch.bfloat16 and edited.shape == home.shape
    assert edited.is_contiguous(memory_format=torch.channels_last)
    assert not torch.equal(home, want)  # the home tensor itself was not written


def test_module_and_head_compose_to_a_scoped_facet_selector():
    a = tl.module("transformer.h.0.attn") & tl.head(3, "q")
    b = tl.head(3, "q") & tl.module("transformer.h.0.attn")
    assert a == b == tl.head(3, "q").in_module("transformer.h.0.attn")
    with pytest.raises(tl.errors.SelectorCompositionError) as exc:
        tl.module("transformer.h.1.attn") & tl.head(3).in_module("transformer.h.0.attn")
    assert exc.value.code == "selector_module_facet_scope_conflict"
    with pytest.raises(tl.errors.SelectorCompositionError) as exc:
        tl.func("relu") & tl.head(3)
    assert exc.value.code == "facet_selector_unsupported"


def test_head_edit_through_do_on_the_replay_engine_and_clear_edits_drops_its_write_mask():
    model, ids = _gpt2("eager"), _ids()
    log = tl.trace(model, ids)
    site = "transformer.h.0.attn"
    fork = log.fork("replayed").do(tl.head(3, "q").in_module(site), tl.zero_ablate())  # no model: replay
    want = _hooked_logits(model, model.transformer.h[0].attn.c_attn, slice(24, 32), ids)
    assert torch.allclose(_logits(fork), want, atol=1e-6) and not torch.allclose(_logits(log), want, atol=1e-6)
    other = log.fork("staged").do(tl.head(2, "q").in_module(site), tl.zero_ablate(),
                                  intervention=tl.InterventionOptions(engine="set_only"))
    with pytest.raises(tl.errors.FacetError) as exc:  # all of q overlaps the staged head 2
        other.do(tl.facet("q").in_module(site), tl.scale(2.0), intervention=tl.InterventionOptions(engine="set_only"))
    assert exc.value.code == "facet_write_overlap"
    other.clear_edits()
    assert not other._facet_writes
    other.do(tl.facet("q").in_module(site), tl.scale(2.0), intervention=tl.InterventionOptions(engine="set_only"))


def _hooked_many(model, zeroed: dict, ids):
    """Logits with forward hooks zeroing `cols` of each module's output ({module: cols})."""
    def hook(m, args, out):
        out = out.clone()
        out[..., zeroed[m]] = 0
        return out

    handles = [m.register_forward_hook(hook) for m in zeroed]
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        for h in handles:
            h.remove()


def test_a_union_of_head_selectors_on_one_home_equals_a_forward_hook_doing_both():
    """GPT-2: q head 1 | v head 2 both live in c_attn's output: one do() writes both slices."""
    model, ids = _gpt2("eager"), _ids()
    log = tl.trace(model, ids)
    site = "transformer.h.0.attn"
    both = tl.head(1, "q") | tl.head(2, "v")
    assert repr(both) == "(tl.head(1, 'q') | tl.head(2, 'v'))"
    edited = _do_facet(log.fork("union"), both.in_module(site), tl.zero_ablate(), model, ids)
    cols = torch.zeros(96, dtype=torch.bool)
    cols[8:16] = True  # q head 1
    cols[64 + 16:64 + 24] = True  # v head 2
    want = _hooked_many(model, {model.transformer.h[0].attn.c_attn: cols}, ids)
    assert torch.equal(_logits(edited), want)
    only_q = _do_facet(log.fork("q"), tl.head(1, "q").in_module(site), tl.zero_ablate(), model, ids)
    assert not torch.equal(_logits(only_q), want)  # the v write counted
    replayed = log.fork("replayed").do((tl.module(site) & tl.head(1, "q")) | tl.head(2, "v").in_module(site),
                                       tl.zero_ablate())  # no model: the replay engine
    assert torch.allclose(_logits(replayed), want, atol=1e-6)


def test_a_union_of_facets_on_separate_homes_equals_a_forward_hook_doing_both():
    """LLaMA: all of q | all of k (q_proj and k_proj outputs), and head unions over them."""
    model, ids = _llama("eager"), _ids()
    log = tl.trace(model, ids)
    at = model.model.layers[1].self_attn
    site = "model.layers.1.self_attn"
    edited = _do_facet(log.fork("qk"), (tl.facet("q") | tl.facet("k")).in_module(site), tl.zero_ablate(), model, ids)
    want = _hooked_many(model, {at.q_proj: slice(None), at.k_proj: slice(None)}, ids)
    assert torch.equal(_logits(edited), want)
    heads = (tl.facet("q") | tl.facet("v")).head(1).in_module(site)  # .head distributes over the members
    assert heads == (tl.head(1, "q") | tl.head(1, "v")).in_module(site)
    with pytest.raises(tl.errors.FacetError) as exc:  # v head 1 of a GQA model aliases a shared K/V head
        _do_facet(log.fork("alias"), heads, tl.zero_ablate(), model, ids)
    assert exc.value.code == "facet_write_refused"
    twice = tl.head(2, "q").in_module(site) | tl.head(2, "q").in_module(site)  # one slice named twice: written once
    edited = _do_facet(log.fork("twice"), twice, tl.zero_ablate(), model, ids)
    assert torch.equal(_logits(edited), _hooked_many(model, {at.q_proj: slice(16, 24)}, ids))


def test_facet_unions_refuse_plain_selectors_overlaps_and_op_resolution():
    model, ids = _gpt2("eager"), _ids()
    log = tl.trace(model, ids)
    site = "transformer.h.0.attn"
    for make in (lambda: tl.facet("q") | tl.module(site), lambda: tl.module(site) | tl.facet("q"),
                 lambda: tl.func("relu") | (tl.facet("q") | tl.facet("k"))):
        with pytest.raises(tl.errors.SelectorCompositionError) as exc:
            make()
        assert exc.value.code == "facet_selector_unsupported"
    with pytest.raises(tl.errors.SelectorCompositionError) as exc:
        log[tl.facet("q") | tl.facet("k")]
    assert exc.value.code == "facet_selector_unsupported"
    fork = log.fork("overlap")
    with pytest.raises(tl.errors.FacetError) as exc:  # all of q covers q head 1: refused before staging
        fork.do((tl.facet("q") | tl.head(1, "q")).in_module(site), tl.zero_ablate(), model=model, inputs=ids)
    assert exc.value.code == "facet_write_overlap"
    assert fork.is_pristine and not fork._facet_writes
    with pytest.warns(tl.errors.FacetWarning) as rec:  # unscoped members fan out over both layers
        lower_facet(log.fork("fan"), tl.head(1, "q") | tl.head(2, "k").in_module(site), tl.zero_ablate())
    assert rec[0].message.fields["site_count"] == 2
