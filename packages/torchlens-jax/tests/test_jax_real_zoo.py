"""Issue 28 acceptance: a real-model JAX zoo. For every configuration: each recorded op's
value equals an independent evaluation (JAX's own `make_jaxpr` of the model called
directly, walked by a plain evaluator written here that steps into calls, scans, loops and
branches; it shares no code with torchlens_jax), module paths follow the module tree,
save -> load -> validate is True and `tl.module(...)` selects each called submodule.
Models are tiny; the whole file runs in well under a minute on one CPU core."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
eqx = pytest.importorskip("equinox")

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.extend.core import Literal  # noqa: E402

import torchlens as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jax_test_models import EqxAttentionBlock, seq_input  # noqa: E402
from torchlens_jax import zoo as Z  # noqa: E402

_SYNTHETIC = {"scan_slice", "scan_stack"}
_CALLS = {"jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call", "checkpoint", "remat", "remat2"}


# the independent evaluator ------------------------------------------------------------------

def _sub(eqn):
    for k in ("call_jaxpr", "jaxpr", "fun_jaxpr"):
        j = eqn.params.get(k)
        if j is not None:
            return (j.jaxpr, j.consts) if hasattr(j, "consts") else (j, [])
    return None


def _closed(j):
    return (j.jaxpr, list(j.consts)) if hasattr(j, "consts") else (j, [])


def _run(jaxpr, consts, args, trail):
    env = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        sub = _sub(eqn) if name in _CALLS else None
        if sub is not None:
            outs = _run(sub[0], list(sub[1]), ins, trail)
        elif name == "cond":  # the branch the index picks, stepped into
            idx = int(np.clip(int(ins[0]), 0, len(eqn.params["branches"]) - 1))
            j, c = _closed(eqn.params["branches"][idx])
            outs = _run(j, c, ins[1:], trail)
        elif name == "while":
            p = eqn.params
            cj, cc = _closed(p["cond_jaxpr"])
            bj, bc = _closed(p["body_jaxpr"])
            nc, nb = p["cond_nconsts"], p["body_nconsts"]
            cconst, bconst, carry = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
            while bool(_run(cj, cc, [*cconst, *carry], trail)[0]):
                carry = _run(bj, bc, [*bconst, *carry], trail)
            outs = carry
        elif name == "scan":
            p = eqn.params
            bj, bc = _closed(p["jaxpr"])
            nc, ncarry, n = p["num_consts"], p["num_carry"], p["length"]
            consts_, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
            ys = []
            for s in (range(n - 1, -1, -1) if p["reverse"] else range(n)):
                res = _run(bj, bc, [*consts_, *carry, *[x[s] for x in xs]], trail)
                carry, y = res[:ncarry], res[ncarry:]
                ys.append(y)
            if p["reverse"]:
                ys.reverse()
            stacked = [jnp.stack([y[i] for y in ys]) for i in range(len(bj.outvars) - ncarry)]
            outs = [*carry, *stacked]
        else:
            out = eqn.primitive.bind(*ins, **eqn.params)
            outs = list(out) if eqn.primitive.multiple_results else [out]
            trail.append((name, outs))
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _trail(fn, args):
    closed = jax.make_jaxpr(fn)(*args)
    trail = []
    out = _run(closed.jaxpr, list(closed.consts), list(jax.tree_util.tree_leaves(args)), trail)
    return trail, out


# the configurations -------------------------------------------------------------------------

X = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)


class NnxCNN(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.conv(x))
        h = nnx.avg_pool(h, (2, 2), strides=(2, 2))
        return self.head(h.mean(axis=(1, 2)))


class NnxStateNet(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(self.bn(self.fc(x))))


class EqxVmapped(eqx.Module):
    lin: eqx.nn.Linear

    def __init__(self, key):
        self.lin = eqx.nn.Linear(4, 3, key=key)

    def __call__(self, x):
        return jnp.tanh(jax.vmap(self.lin)(x))


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.gelu(nn.Dense(6)(x)))


def _lstm_params(h=4, d=3):
    k = jax.random.split(jax.random.PRNGKey(3), 2)
    return {"wx": jax.random.normal(k[0], (d, 4 * h)) * 0.3, "wh": jax.random.normal(k[1], (h, 4 * h)) * 0.3,
            "b": jnp.zeros((4 * h,))}


def lstm_scan(params, xs):
    h0 = jnp.zeros((params["wh"].shape[0],))

    def cell(carry, x):
        h, c = carry
        i, f, g, o = jnp.split(x @ params["wx"] + h @ params["wh"] + params["b"], 4)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    (_, _), hs = jax.lax.scan(cell, (h0, h0), xs)
    return hs


def gru_scan(params, xs):
    """A GRU written as a step function over `lax.scan` (the form papers' code often takes)."""
    def cell(h, x):
        r, z = jnp.split(jax.nn.sigmoid(x @ params["wx"][:, :8] + h @ params["wh"][:, :8]), 2)
        n = jnp.tanh(x @ params["wx"][:, 8:] + r * (h @ params["wh"][:, 8:]))
        h = (1 - z) * n + z * h
        return h, h

    return jax.lax.scan(cell, jnp.zeros((4,)), xs)[1]


def _gru_params():
    k = jax.random.split(jax.random.PRNGKey(5), 2)
    return {"wx": jax.random.normal(k[0], (3, 12)) * 0.4, "wh": jax.random.normal(k[1], (4, 12)) * 0.4}


class GPTBlock(nnx.Module):
    def __init__(self, d, heads, rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class TinyGPT(nnx.Module):
    """A decoder-only GPT: token + position embeddings, causal attention blocks in an
    `nnx.List`, a final LayerNorm and an untied head."""

    def __init__(self, vocab=11, d=8, heads=2, n_layers=2, ctx=6, *, rngs):
        self.tok = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Embed(ctx, d, rngs=rngs)
        self.blocks = nnx.List([GPTBlock(d, heads, rngs) for _ in range(n_layers)])
        self.ln_f = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        x = self.tok(ids) + self.pos(jnp.arange(ids.shape[-1]))
        mask = nnx.make_causal_mask(ids)
        for b in self.blocks:
            x = b(x, mask)
        return self.head(self.ln_f(x))


@functools.partial(jax.jit, static_argnums=1)
def jit_static(x, n):
    for _ in range(n):
        x = jnp.sin(x) * 1.5
    return x


@jax.checkpoint
def remat_block(x):
    return jnp.tanh(x @ x.T).sum(axis=0)


def control(x):
    y = jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] * 1.1 + 0.1, c[1] + 1), (x, 0))[0]
    y = jax.lax.cond(y.sum() > 0, lambda a: a * 2.0, lambda a: a - 1.0, y)
    return jax.lax.switch(jnp.int32(y.mean() > 0) + 1, [jnp.sin, jnp.cos, jnp.tanh], y)


def dropout(x, key):
    keep = jax.random.bernoulli(key, 0.7, x.shape)
    return jnp.where(keep, x / 0.7, 0.0)


@jax.custom_vjp
def clip_grad(x):
    return jnp.sin(x) * 2.0


clip_grad.defvjp(lambda x: (clip_grad(x), x), lambda x, g: (jnp.clip(g, -1, 1) * jnp.cos(x),))


def bf16(x, w):
    return jax.nn.relu(x.astype(jnp.bfloat16) @ w).astype(jnp.float32)


def pytree_in(inputs):
    a, (b, c) = inputs["a"], inputs["bc"]
    return {"sum": a + b * c, "prod": (a * c).sum()}


def _nnx_oracle(model):
    gd, st = nnx.split(model)
    leaves, tdef = jax.tree_util.tree_flatten(st)

    def fn(state_leaves, *a):  # the state as jaxpr inputs; merged inside, so its writes stay there
        return nnx.merge(gd, jax.tree_util.tree_unflatten(tdef, state_leaves))(*a)

    fn.lead = (leaves,)
    return fn


def _configs():
    mlp = Z.MLP()
    cnn = NnxCNN(nnx.Rngs(0))
    att = Z.AttentionBlock()
    state = NnxStateNet(nnx.Rngs(1))
    state.train()
    eqx_mlp = eqx.nn.MLP(4, 2, 6, 2, key=jax.random.PRNGKey(0))
    eqx_att = EqxAttentionBlock(key=jax.random.PRNGKey(0))
    vm = EqxVmapped(jax.random.PRNGKey(2))
    lin = LinenNet()
    lin_v = lin.init(jax.random.PRNGKey(0), X)
    img = jnp.sin(jnp.arange(2 * 6 * 6, dtype=jnp.float32)).reshape(2, 6, 6, 1)
    xs = jnp.cos(jnp.arange(5 * 3, dtype=jnp.float32)).reshape(5, 3)
    wbf = (jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 10).astype(jnp.bfloat16)
    tree = {"a": X, "bc": (X * 2, X - 1)}
    rnn = nnx.RNN(nnx.GRUCell(3, 4, rngs=nnx.Rngs(3)))
    gpt = TinyGPT(rngs=nnx.Rngs(4))
    ids = jax.random.randint(jax.random.PRNGKey(1), (1, 6), 0, 11)
    gpt_mods = {"tok", "pos", "ln_f", "head"} | {f"blocks.{i}{s}" for i in range(2)
                                                  for s in ("", ".ln1", ".attn", ".attn.query", ".ln2", ".up", ".down")}
    # name: (traced model, args, oracle fn, expected module addresses (called), input kwargs)
    return {
        "nnx_mlp": (mlp, (X,), _nnx_oracle(mlp), {"fc1", "fc2"}),
        "nnx_cnn": (cnn, (img,), _nnx_oracle(cnn), {"conv", "head"}),
        "nnx_transformer": (att, (seq_input(),), _nnx_oracle(att), {"ln1", "attn", "attn.query", "ln2", "up", "down"}),
        "nnx_batchnorm_dropout_train": (state, (X,), _nnx_oracle(state), {"fc", "bn", "drop", "out"}),
        "lstm_lax_scan": (lstm_scan, (_lstm_params(), xs), lstm_scan, set()),
        "gru_lax_scan": (gru_scan, (_gru_params(), xs), gru_scan, set()),
        "nnx_rnn_gru": (rnn, (xs[None],), _nnx_oracle(rnn), {"cell"}),
        "nnx_gpt": (gpt, (ids,), _nnx_oracle(gpt), gpt_mods),
        "eqx_mlp": (eqx_mlp, (X[0],), eqx_mlp, {"layers.0", "layers.1", "layers.2"}),
        "eqx_transformer": (eqx_att, (seq_input(None),), eqx_att, {"ln1", "attn", "up", "down"}),
        "eqx_vmap": (vm, (X,), vm, {"lin"}),
        "jit_static_args": (functools.partial(jit_static, n=2), (X,), functools.partial(jit_static, n=2), set()),
        "checkpoint_remat": (remat_block, (X,), remat_block, set()),
        "while_cond_switch": (control, (X,), control, set()),
        "dropout_with_key": (dropout, (X, jax.random.PRNGKey(7)), dropout, set()),
        "custom_vjp": (clip_grad, (X,), clip_grad, set()),
        "bf16": (bf16, (X, wbf), bf16, set()),
        "pytree_inputs": (pytree_in, (tree,), pytree_in, set()),
        "linen_apply": (lin.apply, (lin_v, X), lin.apply, {"Dense_0", "Dense_1"}),
    }


CONFIGS = _configs()


_SLOW = {"nnx_transformer", "eqx_transformer", "nnx_gpt"}  # the largest op counts: `-m "not slow"` leaves them out


@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.slow) if n in _SLOW else n for n in sorted(CONFIGS)])
def case(request):
    model, args, oracle, mods = CONFIGS[request.param]
    return request.param, model, args, oracle, mods, tl.trace(model, *args, backend="jax")


def _host(v):
    if jax.dtypes.issubdtype(getattr(v, "dtype", np.float32), jax.dtypes.prng_key):
        v = jax.random.key_data(v)
    return np.asarray(v)


def test_every_op_equals_an_independent_evaluation(case):
    name, model, args, oracle, _, t = case
    trail, out = _trail(oracle, (*getattr(oracle, "lead", ()), *args))
    ops = [o for o in t.ops if o.kind == "op" and o.func_name not in _SYNTHETIC]
    assert [o.func_name for o in ops] == [p for p, _ in trail], name
    for op, (_, outs) in zip(ops, trail):
        assert len(op.outs) == len(outs), op.label
        for got, want in zip(op.outs, outs):
            g, w = _host(got), _host(want)
            assert g.shape == w.shape and g.dtype == w.dtype, f"{name}: {op.label}"
            assert np.array_equal(g, w, equal_nan=True), f"{name}: {op.label} differs from the independent evaluation"
    got_out = [np.asarray(o.out) for o in t.output_ops]
    assert len(got_out) == len(out)
    for g, w in zip(got_out, out):
        np.testing.assert_array_equal(g, np.asarray(w))


def test_module_paths_follow_the_module_tree_and_select(case):
    name, model, args, oracle, mods, t = case
    for op in t.ops:
        if op.kind in ("input", "output"):
            continue
        assert op.modules[0] == "self", op.label
        for parent, child in zip(op.modules, op.modules[1:]):
            # the nearest called ancestor: uncalled containers (eqx.nn.MLP's `layers`) sit between
            up = t._modules[child].parent
            while up != parent and up in t.uncalled_modules:
                up = up.rpartition(".")[0] or "self"
            assert up == parent, f"{name}: {op.label} path {op.modules}"
    assert mods <= set(t._modules), name
    for address in mods:
        sites = t.find_sites(tl.module(address)).labels
        assert sites, f"{name}: tl.module({address!r}) selects nothing"
        assert all(address in t[label].modules or t[label].module == address for label in sites), name


def test_save_load_validate(case, tmp_path):
    name, model, args, oracle, mods, t = case
    assert t.validate_forward_pass(), name
    t.save(tmp_path / f"{name}.tlspec")
    loaded = tl.load(tmp_path / f"{name}.tlspec")
    assert loaded.validate_forward_pass(), name
    assert list(loaded._modules) == list(t._modules)
    for address in mods:
        assert loaded.find_sites(tl.module(address)).labels == t.find_sites(tl.module(address)).labels
