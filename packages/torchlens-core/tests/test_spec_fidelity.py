"""Spec fidelity (issue 13), on the reference backend: each test checks one statement of
spec/glossary.md or spec/interventions.md against an independent numpy computation or a
reproduced fault. Silent wrong answers first: a saved trace keeps its staged recipe and
reruns it after loading, is_pristine notices direct writes, a fork has no live output,
and a rerun records the rules that fired nowhere."""

import json
import warnings

import numpy as np
import pytest

import torchlens as tl
from torchlens.errors import ArtifactError, InterventionError, PayloadUnavailableError


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


def _zeroed_relu_output(model, x):
    return model[2](np.zeros((3, 8), np.float32))  # independent: the head on a zero-ablated ReLU


# interventions saved with a trace (glossary l. 892-893, 796, 308-311) ------------------------
def test_saved_trace_keeps_its_recipe_and_reruns_it_after_load(mlp, tmp_path):
    model, x = mlp
    fork = tl.trace(model, x).fork()
    fork.do(tl.module("1"), tl.zero_ablate())
    fork.save(tmp_path / "t.tlspec")
    assert (tmp_path / "t.tlspec" / "intervention.json").is_file()
    loaded = tl.load(tmp_path / "t.tlspec")
    assert loaded.recipe.digest == fork.recipe.digest and len(loaded.recipe) == 1
    rerun = loaded.run(model, x)  # legacy rerun entry point: the recorded edit is live
    assert np.array_equal(rerun.output_ops[0].out, _zeroed_relu_output(model, x))
    assert not np.array_equal(rerun.output_ops[0].out, model(x))


def test_loaded_recipe_applies_on_the_rerun_engine_and_with_an_edit_staged_after_loading(mlp, tmp_path):
    model, x = mlp
    fork = tl.trace(model, x).fork().do(tl.module("1"), tl.zero_ablate())
    fork.save(tmp_path / "t.tlspec")
    loaded = tl.load(tmp_path / "t.tlspec")
    loaded.do(tl.module("2"), tl.scale(2.0), model=model, inputs=x)
    assert np.array_equal(loaded.output_ops[0].out, 2.0 * _zeroed_relu_output(model, x))


def test_recipe_tensors_travel_in_a_recipe_blob(mlp, tmp_path):
    model, x = mlp
    v = np.arange(8, dtype=np.float32)
    fork = tl.trace(model, x).fork().do("relu_1_2", tl.steer(v, 0.5))
    fork.save(tmp_path / "t.tlspec")
    manifest = json.loads((tmp_path / "t.tlspec" / "manifest.json").read_text())
    assert "blobs/recipe-0000.safetensors" in manifest["files"]
    loaded = tl.load(tmp_path / "t.tlspec")
    (kw,) = [dict(r.edit.kwargs) for r in loaded.recipe.rules]
    assert np.array_equal(kw["direction"], v)
    expected = model[2](np.maximum(model[0](x), 0) + 0.5 * v)
    assert np.allclose(loaded.run(model, x).output_ops[0].out, expected, atol=1e-6)


def test_a_saved_callable_placeholder_refuses_to_rerun_naming_the_rule(mlp, tmp_path):
    model, x = mlp
    fork = tl.trace(model, x).fork().do("relu_1_2", lambda v, *, ctx: v * 2)
    fork.save(tmp_path / "t.tlspec")
    loaded = tl.load(tmp_path / "t.tlspec")
    assert loaded.recipe.rules[0].edit.portability == "placeholder"
    with pytest.raises(InterventionError) as info:
        loaded.run(model, x)
    assert info.value.code == "run_intervention_spec_not_persisted" and info.value.fields["rule"] == 0
    with pytest.raises(InterventionError) as info:
        loaded.do(tl.module("2"), tl.scale(2.0), model=model, inputs=x)
    assert info.value.code == "run_intervention_spec_not_persisted"
    assert len(loaded.recipe) == 1  # nothing staged by the refused call


def test_trace_save_intervention_writes_an_intervention_artifact(mlp, tmp_path):
    model, x = mlp
    fork = tl.trace(model, x).fork().do(tl.module("1"), tl.zero_ablate())
    out = fork.save_intervention(tmp_path / "s.tlspec")
    assert json.loads((out / "manifest.json").read_text())["kind"] == "intervention"
    spec = tl.load(tmp_path / "s.tlspec")
    assert isinstance(spec, tl.io.InterventionSpec) and spec.recipe.digest == fork.recipe.digest


def test_a_damaged_trace_recipe_is_refused_typed(mlp, tmp_path):
    import hashlib

    model, x = mlp
    fork = tl.trace(model, x).fork().do(tl.module("1"), tl.zero_ablate())
    fork.save(tmp_path / "t.tlspec")
    path = tmp_path / "t.tlspec" / "intervention.json"
    doc = json.loads(path.read_text())
    doc["rules"][0]["edit"] = {"name": "os.system", "portability": "builtin", "kwargs": [["command", "true"]]}
    body = json.dumps(doc).encode()
    path.write_bytes(body)
    m = json.loads((tmp_path / "t.tlspec" / "manifest.json").read_text())
    m["files"]["intervention.json"] = {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}
    from torchlens.io.manifest import render

    (tmp_path / "t.tlspec" / "manifest.json").write_bytes(render(m))
    with pytest.raises(ArtifactError) as info:
        tl.load(tmp_path / "t.tlspec")
    assert info.value.code == "recipe_record_malformed"
    with pytest.raises(ArtifactError) as info2:
        tl.validation.validate_tlspec(tmp_path / "t.tlspec")
    assert info2.value.code == "recipe_record_malformed"


# is_pristine (l. 579-582) ------------------------------------------------------------------
def test_a_direct_write_makes_the_trace_non_pristine_and_survives_save(mlp, tmp_path):
    model, x = mlp
    t = tl.trace(model, x)
    assert t.is_pristine is True
    t["relu_1_2"].out = np.zeros((3, 8), np.float32)
    assert t.is_pristine is False
    t.save(tmp_path / "t.tlspec")
    assert tl.load(tmp_path / "t.tlspec").is_pristine is False
    assert t.fork().is_pristine is False


def test_pristine_reading_survives_save_after_clear_edits(mlp, tmp_path):
    model, x = mlp
    t = tl.trace(model, x).fork().do(tl.module("1"), tl.zero_ablate()).clear_edits()
    t.save(tmp_path / "a.tlspec")
    assert tl.load(tmp_path / "a.tlspec").is_pristine is False
    clean = tl.trace(model, x)
    clean.save(tmp_path / "b.tlspec")
    assert tl.load(tmp_path / "b.tlspec").is_pristine is True
    assert not (tmp_path / "b.tlspec" / "intervention.json").exists()


# forked traces have no live output (l. 53) -------------------------------------------------
def test_a_fork_has_no_live_output(mlp):
    model, x = mlp
    t = tl.trace(model, x)
    assert np.array_equal(t.output, model(x))
    fork = t.fork().do(tl.module("1"), tl.zero_ablate())
    with pytest.raises(PayloadUnavailableError) as info:
        fork.output
    assert info.value.code == "output_not_stored" and info.value.fields["reason"] == "fork"
    assert np.array_equal(t.output, model(x))


# rerun reporting (l. 287-288, 814-819) -----------------------------------------------------
def test_a_rerun_records_the_rules_that_fired_nowhere(mlp):
    model, x = mlp
    t = tl.trace(model, x).fork()
    t.do(tl.func("relu"), tl.zero_ablate(), intervention=tl.InterventionOptions(engine="set_only"))
    t.do(tl.func("sigmoid"), tl.zero_ablate(), intervention=tl.InterventionOptions(engine="set_only",
                                                                                   on_zero_fire="disclose"))
    out = t.run(model, x, on_zero_fire="disclose")
    assert out.last_run["hooks_unfired"] == ["tl.func('sigmoid')"]
    assert out.last_run["hooks_fired"] == 1


def _relu(model, x):
    return np.maximum(model[0](x), 0)


def test_a_selective_save_reruns_on_the_guarded_fast_engine(mlp):
    model, x = mlp
    t = tl.trace(model, x, save=tl.module("1"))
    x2 = x[::-1].copy()
    out = t.run(model, x2)
    assert out.last_run["engine"] == "guarded_fast" and out.last_run["fast_refused"] is None
    assert np.array_equal(out["relu_1_2"].out, _relu(model, x2))
    assert np.array_equal(out.output, model(x2))
    assert np.array_equal(t["relu_1_2"].out, _relu(model, x))  # the source trace is untouched


def test_the_fast_engine_refreshes_saved_inputs_and_outputs(mlp):
    model, x = mlp
    t = tl.trace(model, x, save=tl.model_input() | tl.module("1") | tl.model_output())
    x2 = x * 2
    out = t.run(model, x2)
    assert out.last_run["engine"] == "guarded_fast"
    assert np.array_equal(out.input_ops[0].out, x2) and np.array_equal(out.output_ops[0].out, model(x2))
    assert np.array_equal(out["relu_1_2"].out, _relu(model, x2))


def test_the_fast_engine_applies_a_steered_module_edit(mlp):
    model, x = mlp
    t = tl.trace(model, x, save=tl.module("1"), intervene=tl.when(tl.module("1"), tl.scale(3.0)))
    out = t.run(model, x)
    assert out.last_run["engine"] == "guarded_fast" and out.last_run["hooks_unfired"] == []
    assert np.array_equal(out["relu_1_2"].out, 3.0 * _relu(model, x))
    assert np.array_equal(out.output, model[2](3.0 * _relu(model, x)))
    assert out.is_pristine is False


@pytest.mark.parametrize("stage, make", [
    ("run_capability_unavailable:fast_rerun_graph_unsteered",
     lambda t: t.do(tl.module("1"), tl.scale(3.0), intervention=tl.InterventionOptions(engine="set_only"))),
    ("run_capability_unavailable:fast_rerun_target_unsupported",
     lambda t: t.do(tl.func("relu"), tl.scale(3.0), intervention=tl.InterventionOptions(engine="set_only"))),
])
def test_a_refused_fast_rerun_falls_back_and_says_why(mlp, stage, make):
    model, x = mlp
    t = make(tl.trace(model, x, save=tl.module("1")).fork())
    out = t.run(model, x)
    assert (out.last_run["engine"], out.last_run["fast_refused"]) == ("rerun", stage)
    assert np.array_equal(out["relu_1_2"].out, 3.0 * _relu(model, x))


def test_a_full_save_with_nothing_staged_keeps_the_capture_rerun(mlp):
    model, x = mlp
    out = tl.trace(model, x).run(model, x)
    assert (out.last_run["engine"], out.last_run["fast_refused"]) == ("rerun", None)


def test_a_changed_input_shape_falls_back_to_the_capture_engine(mlp):
    model, x = mlp
    t = tl.trace(model, x, save=tl.module("1"))
    x2 = np.ones((5, 4), np.float32)
    out = t.run(model, x2)
    assert out.last_run["fast_refused"] == "rerun_graph_diverged:fast_live_input_signature"
    assert np.array_equal(out["relu_1_2"].out, _relu(model, x2))


# verbs (l. 783-784, 801-803) ----------------------------------------------------------------
def test_a_forward_state_edit_on_a_gradient_site_refuses_at_attach_time(mlp):
    model, x = mlp
    t = tl.trace(model, x).fork()
    for edit in (tl.mean_ablate(dim=0), tl.patch_from(tl.trace(model, x))):
        with pytest.raises(InterventionError) as info:
            tl.when(tl.grad("relu_1_2"), edit)
        assert info.value.code == "edit_signal_mismatch"
        with pytest.raises(InterventionError) as info:
            t.do(tl.grad("relu_1_2"), edit, intervention=tl.InterventionOptions(engine="set_only"))
        assert info.value.code == "edit_signal_mismatch"
    assert len(t.recipe) == 0 and t.is_pristine
    tl.when(tl.grad("relu_1_2"), tl.scale(0.5))  # neutral edits stay accepted


def test_do_on_layer_and_op_is_trace_do(mlp):
    model, x = mlp
    t = tl.trace(model, x).fork()
    assert t.layers["relu_1_2"].do("relu_1_2", tl.zero_ablate()) is t
    assert np.array_equal(t.output_ops[0].out, _zeroed_relu_output(model, x))
    t2 = tl.trace(model, x).fork()
    t2.ops["linear_1_1"].do(tl.module("1"), tl.zero_ablate())
    assert np.array_equal(t2.output_ops[0].out, _zeroed_relu_output(model, x))


def test_a_scoped_fork_detaches_its_edits_on_exit(mlp):
    model, x = mlp
    t = tl.trace(model, x)
    with t.fork() as scoped:
        scoped.do(tl.module("1"), tl.zero_ablate(), intervention=tl.InterventionOptions(engine="set_only"))
        assert len(scoped.recipe) == 1
        assert np.array_equal(scoped.run(model, x).output_ops[0].out, _zeroed_relu_output(model, x))
    assert len(scoped.recipe) == 0 and len(t.recipe) == 0
    assert np.array_equal(scoped.run(model, x).output_ops[0].out, model(x))


def test_hostile_trace_recipes_end_typed(mlp, tmp_path):
    """Byte flips, truncation and JSON edits of a saved trace's intervention.json, with the
    manifest digest recomputed: every load ends loaded or in a typed TorchLensError."""
    import hashlib
    import random
    import shutil

    from torchlens.errors import ERROR_CODES, TorchLensError
    from torchlens.io.manifest import render

    model, x = mlp
    src = tmp_path / "src.tlspec"
    tl.trace(model, x).fork().do("relu_1_2", tl.steer(np.ones(8, np.float32), 0.5)).save(src)
    body = (src / "intervention.json").read_bytes()
    rng = random.Random(13)
    edits = [b'{"schema":1}', b"[]", body[: len(body) // 2], body.replace(b'"steer"', b'"exec"'),
             body.replace(b'"label"', b'"placeholder"'), body.replace(b'"audit":[', b'"audit":[1,')]
    for _ in range(30):
        b = bytearray(body)
        b[rng.randrange(len(b))] = rng.randrange(256)
        edits.append(bytes(b))
    outcomes: list[str] = []
    for i, data in enumerate(edits):
        case = tmp_path / f"c{i}.tlspec"
        shutil.copytree(src, case)
        (case / "intervention.json").write_bytes(data)
        m = json.loads((case / "manifest.json").read_text())
        m["files"]["intervention.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        (case / "manifest.json").write_bytes(render(m))
        try:
            tl.load(case)
            outcomes.append("loaded")
        except TorchLensError as exc:
            assert exc.code in ERROR_CODES and exc.remedy, (i, exc)
            outcomes.append(exc.code)
    # the first four hand-made edits are malformed records (a wrong schema, a list, a truncation,
    # a helper name outside the built-in set): each refuses with the recipe code, none loads
    assert outcomes[:4] == ["recipe_record_malformed"] * 4, outcomes[:4]
    assert outcomes.count("loaded") < len(outcomes)


def test_a_trace_with_a_recipe_can_be_overwritten_and_validated(mlp, tmp_path):
    model, x = mlp
    fork = tl.trace(model, x).fork().do("relu_1_2", tl.steer(np.ones(8, np.float32), 0.5))
    fork.save(tmp_path / "t.tlspec")
    assert tl.validation.validate_tlspec(tmp_path / "t.tlspec")["kind"] == "trace"
    tl.trace(model, x).save(tmp_path / "t.tlspec", overwrite=True)
    assert tl.load(tmp_path / "t.tlspec").is_pristine is True
    assert not (tmp_path / "t.tlspec" / "intervention.json").exists()
