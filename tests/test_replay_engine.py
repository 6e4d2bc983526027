"""Replay once (issue 14 §2): validation on every backend and interventions re-execute recorded
ops through core's one per-op engine (`torchlens.replay.engine`), and no per-backend replay
loop is left.

The counts are checked against the trace itself (how many recorded ops there are to replay,
how many the intervention re-executed), the replayed values against hand-computed ones."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import torchlens as tl
from torchlens.replay import engine as E

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def calls(monkeypatch):
    """Every op the engine re-executes, by label (the engine's one call site, patched)."""
    seen: list[str] = []
    real = E.call_op

    def counting(ops, op, args, kwargs):
        seen.append(op.label)
        return real(ops, op, args, kwargs)

    monkeypatch.setattr(E, "call_op", counting)
    return seen


def _replayable(trace):
    return [o.label for o in trace.ops if o.kind == "op"]


# the reference backend --------------------------------------------------------------------------


def _reference_model():
    from torchlens_reference import nn, ops

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3, seed=1)

        def forward(self, x):
            return ops.relu(self.fc(x))

    return Net(), np.linspace(-1.0, 1.0, 8, dtype=np.float32).reshape(2, 4)


def test_reference_validate_runs_every_op_through_the_engine(calls):
    model, x = _reference_model()
    t = tl.trace(model, x)
    status = t._backend.validate(t)
    assert status.ok
    assert calls == _replayable(t) and calls  # each recorded op exactly once, in order


def test_reference_validate_names_a_corrupted_op_and_checks_the_rest(calls):
    model, x = _reference_model()
    t = tl.trace(model, x)
    relu = next(o for o in t.ops if o.func_name == "relu")
    relu.outs[0][...] = relu.outs[0] + 1.0  # the saved payload no longer equals relu(saved parent)
    status = t._backend.validate(t)
    assert not status.ok and status.first_failure == relu.label and status.reason == "replay_mismatch"
    assert calls == _replayable(t)  # the walk went on past the failure
    assert status.num_failed_ops == 2  # relu itself and the output op that differs from it now


def test_reference_intervention_replays_the_cone_through_the_engine(calls):
    model, x = _reference_model()
    t = tl.trace(model, x)
    linear = next(o for o in t.ops if o.func_name == "linear")
    f = t.fork()
    f.do(tl.label(linear.label), tl.scale(0.5))
    downstream = f.last_run["reexecuted"]
    assert calls == downstream and downstream  # the engine ran exactly the re-executed cone
    w, b = model.fc.weight.value, model.fc.bias.value
    want = np.maximum(0.5 * (x @ w.T + b), 0)
    np.testing.assert_allclose(np.asarray(f.output_ops[0].out), want, rtol=1e-6, atol=1e-6)


# torch --------------------------------------------------------------------------------------------


def test_torch_validate_and_fork_do_go_through_the_engine(calls):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    x = torch.randn(2, 4)
    t = tl.trace(model, x)
    assert t._backend.validate(t).ok
    replayable = [o.label for o in t.ops if o.kind == "op"]
    # every op replayed once as captured, plus the perturbation re-runs of each op with a float parent
    assert set(calls) == set(replayable) and len(calls) > len(replayable)
    calls.clear()
    f = t.fork()
    f.do(tl.module("1"), tl.scale(0.5))
    assert calls == f.last_run["reexecuted"] and calls
    with torch.no_grad():
        want = model[2](0.5 * torch.tanh(model[0](x)))
    torch.testing.assert_close(f.output_ops[0].out, want, rtol=0, atol=1e-6)


def test_torch_edit_ops_reach_the_engine_through_their_replay_args(monkeypatch, calls):
    """An EditOps that is no ReplayOpsBase is read through its own replay_args / rng_state."""
    torch = pytest.importorskip("torch")
    from torchlens_torch.edit_ops import TorchEditOps

    seen = []
    real = TorchEditOps.replay_args

    def spy(self, op, args, kwargs):
        seen.append(op.label)
        return real(self, op, args, kwargs)

    monkeypatch.setattr(TorchEditOps, "replay_args", spy)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    t = tl.trace(model, torch.randn(2, 4))
    f = t.fork()
    f.do(tl.module("0"), tl.scale(2.0))
    assert seen == calls == f.last_run["reexecuted"]


# jax ----------------------------------------------------------------------------------------------


def test_jax_validate_runs_every_op_through_the_engine(calls):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    def f(x):
        return jnp.tanh(x * 2.0) + jnp.sum(x, axis=1, keepdims=True)

    x = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
    t = tl.trace(f, x)
    status = t._backend.validate(t, f(x))
    assert status.ok
    assert calls == [o.label for o in t.ops if o.kind == "op" and o.func is not None] and calls


def test_jax_fork_do_replays_the_cone_through_the_engine(calls):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    if not tl.backends.get_protocol("jax").capabilities().interventions:
        pytest.skip("the jax backend does not declare interventions")

    def f(x):
        return jnp.tanh(x * 2.0) + 1.0

    x = jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3)
    t = tl.trace(f, x)
    mul = next(o for o in t.ops if o.func_name == "mul")
    g = t.fork()
    g.do(tl.label(mul.label), tl.scale(0.5))
    assert calls == g.last_run["reexecuted"] and calls
    np.testing.assert_allclose(np.asarray(g.output_ops[0].out), np.tanh(np.asarray(x)) + 1.0, rtol=1e-6, atol=1e-6)


def test_jax_ground_truth_that_differs_is_named():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    def f(x):
        return jnp.tanh(x)

    x = jnp.ones((2, 3), jnp.float32)
    t = tl.trace(f, x)
    status = t._backend.validate(t, f(x) + 1.0)
    assert not status.ok and status.reason == "replay_mismatch"
    assert status.first_failure == t.output_ops[0].label


# the engine's defaults ----------------------------------------------------------------------------


def test_default_replay_ops_equal_is_bitwise_with_nan_equal():
    ops = E.ReplayOpsBase()
    a = np.array([1.0, np.nan], np.float32)
    assert ops.equal(a, a.copy())
    assert not ops.equal(a, a.astype(np.float64))  # dtype matters
    assert not ops.equal(a, np.array([1.0 + 1e-7, np.nan], np.float32))
    assert not ops.equal(a, None) and ops.equal(None, None)


def test_replay_ops_base_implements_the_declared_protocol():
    from torchlens.backends.protocol import REPLAY_OPS_MEMBERS, ReplayOps

    base = E.ReplayOpsBase()
    assert isinstance(base, ReplayOps)
    assert all(callable(getattr(E.ReplayOpsBase, m)) for m in REPLAY_OPS_MEMBERS)
    assert {m for m in vars(E.ReplayOpsBase) if not m.startswith("_")} == set(REPLAY_OPS_MEMBERS)


# no second replay loop ----------------------------------------------------------------------------

#: Where a recorded op's callable may be called: the engine's default `ReplayOpsBase.call` and
#: the backends' own `call` overrides. Listed exception: JAX's gradient evaluator (`grads.py`)
#: re-evaluates the whole recorded graph as one traced function for `jax.vjp` (not yet on the
#: engine; see /work/notes/s4/R.md).
ALLOWED_FUNC_CALLS: set[str] = set()  # jax grads.py re-executes through core's Replayer too (issue 14 §2)


def _sources():
    dirs = [ROOT / "packages" / p / "src" for p in ("torchlens-core", "torchlens-torch", "torchlens-jax",
                                                     "torchlens-reference")]
    return [p for d in dirs for p in d.rglob("*.py")]


def _func_calls(path: Path) -> list[tuple[int, str | None]]:
    """(line, enclosing function) of every `<x>.func(...)` call and `fill_template(...)` call."""
    tree = ast.parse(path.read_text())
    out = []

    def visit(node, fn):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if isinstance(child, ast.Call):
                f = child.func
                if isinstance(f, ast.Attribute) and f.attr == "func":
                    out.append((child.lineno, "func", name))
                if (isinstance(f, ast.Name) and f.id == "fill_template") or (
                        isinstance(f, ast.Attribute) and f.attr == "fill_template"):
                    out.append((child.lineno, "fill_template", name))
            visit(child, name)

    visit(tree, None)
    return out


def test_no_per_backend_replay_loop_remains():
    bad = []
    for path in _sources():
        rel = str(path.relative_to(ROOT))
        for line, what, fn in _func_calls(path):
            if what == "func" and (fn == "call" or rel in ALLOWED_FUNC_CALLS):
                continue
            if what == "fill_template" and (rel == "packages/torchlens-core/src/torchlens/replay/engine.py"
                                            or fn == "fill_template"):  # the engine; the helper's own recursion
                continue
            bad.append(f"{rel}:{line} {what}() in {fn}")
    assert bad == [], bad


def test_the_loop_scanner_finds_a_replay_loop(tmp_path):
    p = tmp_path / "v.py"
    p.write_text("def validate(t):\n    for op in t.ops:\n        args = fill_template(op.args_template, f)\n"
                 "        op.func(*args)\n\nclass R:\n    def call(self, op, a, k):\n        return op.func(*a)\n")
    assert [(w, fn) for _, w, fn in _func_calls(p)] == [("fill_template", "validate"), ("func", "validate"),
                                                         ("func", "call")]
