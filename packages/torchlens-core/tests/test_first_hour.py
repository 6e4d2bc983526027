"""Issue 27 ("a researcher's first hour"), core side: errors that say what to do, and the CLI.

Runs on the reference (numpy) backend, so no ML framework is imported.
"""

from __future__ import annotations

import re
import warnings
from importlib import metadata

import numpy as np
import pytest

import torchlens as tl
from torchlens import cli
from torchlens_reference import nn


class Scaled(nn.Module):
    """forward(x, scale=...) plus a child module the forward never calls."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4, seed=3)
        self.act = nn.Tanh()
        self.unused = nn.Linear(4, 4, seed=4)

    def forward(self, x, scale=1.0):
        return self.act(self.fc(x)) * scale


X = np.ones((2, 4), dtype=np.float32)


# --- tl.trace keyword that is really a model input --------------------------------------------------------------
def test_unknown_trace_keyword_naming_a_forward_input_suggests_input_kwargs():
    with pytest.raises(tl.errors.BackendUnsupportedError) as info:
        tl.trace(Scaled(), X, scale=2.0)
    err = info.value
    assert err.code == "trace_option_unsupported"
    assert err.fields["option"] == "scale" and err.fields["model_input"] is True
    assert "input_kwargs={'scale': ...}" in err.remedy and "Scaled.forward()" in err.message
    # The remedy works: the same input through input_kwargs= traces, and scales the output.
    out = tl.trace(Scaled(), X, input_kwargs={"scale": 2.0}).output
    np.testing.assert_allclose(out, 2.0 * tl.trace(Scaled(), X).output)


def test_unknown_trace_keyword_that_is_no_input_keeps_the_options_remedy():
    with pytest.raises(tl.errors.BackendUnsupportedError) as info:
        tl.trace(Scaled(), X, sclae=2.0)
    assert info.value.code == "trace_option_unsupported"
    assert "model_input" not in info.value.fields and "input_kwargs" not in info.value.remedy
    assert "capture" in info.value.remedy and "save" in info.value.remedy


# --- a class instead of an instance -----------------------------------------------------------------------------
def test_tracing_a_class_says_instantiate_it():
    with pytest.raises(tl.errors.InvalidArgumentError) as info:
        tl.trace(Scaled, X)
    err = info.value
    assert err.code == "model_type_unsupported" and err.fields["is_class"] is True
    assert "instantiate it" in err.message and err.remedy.startswith("model = Scaled(")


# --- a selector that matches nothing ----------------------------------------------------------------------------
def _zero_fire_message(selector) -> str:
    trace = tl.trace(Scaled(), X).fork()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace.do(selector, tl.zero_ablate())
    messages = [str(w.message) for w in caught if "trace_zero_fire" in str(w.message)]
    assert len(messages) == 1, [str(w.message) for w in caught]
    return messages[0]


def test_misspelt_func_selector_suggests_the_nearest_function_names():
    msg = _zero_fire_message(tl.func("tanhh"))
    assert "nearest function names: tanh" in msg


def test_module_that_never_ran_says_so():
    trace = tl.trace(Scaled(), X)
    assert "unused" in trace.modules.uncalled  # an uncalled module has no record (spec glossary)
    with pytest.raises(tl.errors.LookupMissError, match="exists but was never called"):
        trace.modules["unused"]
    msg = _zero_fire_message(tl.module("unused"))
    assert "module 'unused' exists but was never called" in msg


def test_zero_fire_error_policy_carries_the_hint():
    trace = tl.trace(Scaled(), X).fork()
    with pytest.raises(tl.errors.InterventionError) as info:
        trace.do(tl.in_module("unused") | tl.func("lineer"), tl.zero_ablate(),
                 intervention=tl.options.InterventionOptions(on_zero_fire="error"))
    assert info.value.code == "trace_zero_fire"
    hints = info.value.fields["hints"][0]
    assert "never called" in hints and "nearest function names: linear" in hints


def test_composition_whose_parts_match_says_so():
    msg = _zero_fire_message(tl.func("tanh") & tl.in_module("fc"))
    assert "each part of" in msg and "no site matches both" in msg


# --- CLI ------------------------------------------------------------------------------------------------------
def test_scorecard_with_an_unknown_backend_prints_one_line_listing_installed_backends(capsys):
    assert cli.main(["scorecard", "--backend", "nope"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err and captured.out == ""
    installed = sorted(tl.backends.specs())
    assert lines[0] == f"torchlens scorecard: no backend named 'nope'; installed backends: {', '.join(installed)}"


def test_version_lists_core_and_every_plugin_distribution(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    line = capsys.readouterr().out.strip()
    plugins = sorted({f"{ep.dist.metadata['Name']} {ep.dist.version}" for ep in metadata.entry_points(group="torchlens")})
    assert line == f"torchlens-core {metadata.version('torchlens-core')}; plugins: {', '.join(plugins)}"
    assert re.match(r"torchlens-core \d+\.\d+", line)


def test_demo_with_an_unknown_backend_or_model_prints_one_line(capsys):
    assert cli.main(["demo", "--backend", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"torchlens demo: no backend named 'nope'; installed backends: {', '.join(sorted(tl.backends.specs()))}"]
    assert cli.main(["demo", "--backend", "reference", "--model", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["torchlens demo: backend reference ships no model 'nope'; choose from mlp, loop, constant, random"]


# --- quickstart: trace["label"] is a Layer ---------------------------------------------------------------------
def test_single_pass_layer_passes_op_reads_through_and_multi_pass_refuses():
    trace = tl.trace(nn.LoopNet(width=4, steps=3), X)
    single, op = trace["linear_1_1"], trace.ops["linear_1_1"]
    assert type(single).__name__ == "Layer" and type(op).__name__ == "Op"
    assert (single.flops, single.macs, single.duration, single.saved, single.nbytes) == (
        op.flops, op.macs, op.duration, op.saved, op.nbytes)
    assert single.meta is op.meta
    looped = trace["linear_2_2"]
    assert looped.num_passes == 3
    for attr in ("flops", "duration", "meta"):
        with pytest.raises(tl.errors.AmbiguousOpLookupError) as info:
            getattr(looped, attr)
        assert info.value.code == "layer_pass_ambiguous"


# --- notebook views: recursive params, module output, value stats ------------------------------------------------
def test_module_card_and_summary_count_parameters_recursively():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 8, seed=1), nn.ReLU(), nn.Linear(8, 4, seed=2))

        def forward(self, x):
            return self.block(x)

    model = Outer()
    trace = tl.trace(model, X)
    block = trace.modules["block"]
    want = sum(p.value.size for _, p in model.block.named_parameters())   # 4*8+8 + 8*4+4
    assert (block.num_params, block.num_params_total) == (0, want) and want == 76
    card = block._repr_html_()
    assert f"{want} in 4 tensors (0 its own)" in card
    assert "output" in card and trace.modules["block"].output_ops[0].label in card
    row = next(line for line in trace.summary(by="module").splitlines() if line.startswith("block "))
    assert f" {want} " in row


def test_value_preview_reports_std_norm_and_nan_inf_flags():
    from torchlens.viz.tables import value_preview

    values = np.array([3.0, 4.0, np.nan, np.inf, -np.inf], dtype=np.float32)
    text = value_preview(None, values)
    finite = np.array([3.0, 4.0])
    assert f"std {finite.std():.4g}" in text and "norm 5" in text and "mean 3.5" in text
    assert "NaN x1" in text and "Inf x2" in text
    assert "NaN" not in value_preview(None, np.ones(3, dtype=np.float32))


def test_trace_html_lists_every_op_of_a_mid_sized_trace():
    trace = tl.trace(nn.LoopNet(width=4, steps=30), X)
    assert trace.num_ops > 20
    html = trace._repr_html_()
    assert all(op.label in html for op in trace) and "more ops" not in html
