"""The same 2-layer MLP in flax.nnx and torch: same module structure, and the op counts
line up. Torch's `linear` is one op; JAX records its parts: one `dot_general` (and one bias
`add`) per torch `linear`; the activation is `max` inside jax.nn.relu's composite."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import jax.numpy as jnp  # noqa: E402

import torchlens as tl  # noqa: E402
from torchlens_jax import zoo as Z  # noqa: E402

#: What the torch backend records for Linear -> relu -> Linear.
STATED_TORCH_COUNTS = {"linear": 2, "relu": 1}
STATED_MODULES = ["self", "fc1", "fc2"]


def _jax_counts():
    t = tl.trace(Z.MLP(4, 8, 2), jnp.ones((3, 4), jnp.float32))
    ops = [o for o in t.ops if o.kind == "op"]
    counts = {
        "dot_general": sum(o.func_name == "dot_general" for o in ops),
        "bias_add": sum(o.func_name == "add" and o.module in ("fc1", "fc2") for o in ops),
        "activation": sum(o.meta.get("composite") == "relu" for o in ops),
    }
    return t, counts


def _torch_counts():
    try:
        import torch
        import torchlens_torch  # noqa: F401
    except ImportError:
        return None, STATED_TORCH_COUNTS

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    t = tl.trace(MLP(), torch.ones(3, 4), backend="torch")
    ops = [o for o in t.ops if o.kind == "op"]
    return t, {"linear": sum(o.func_name == "linear" for o in ops), "relu": sum(o.func_name == "relu" for o in ops)}


def test_flax_mlp_matches_torch_structure_and_counts():
    jt, j = _jax_counts()
    tt, t = _torch_counts()
    assert t == STATED_TORCH_COUNTS
    assert j["dot_general"] == t["linear"] == j["bias_add"]
    assert j["activation"] == t["relu"]
    assert list(jt._modules) == STATED_MODULES
    if tt is not None:
        assert list(tt._modules) == list(jt._modules)
        assert sorted(tt._params) == sorted(p.replace("kernel", "weight") for p in jt._params)
        t_mods = [o.module for o in tt.ops if o.kind == "op"]
        j_mods = [o.module for o in jt.ops if o.kind == "op" and o.func_name in ("dot_general", "max")]
        assert t_mods == j_mods
