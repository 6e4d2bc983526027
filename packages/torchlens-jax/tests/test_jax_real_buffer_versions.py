"""Issue 28 item 7: state a forward writes is recorded as buffer versions. flax.linen's
`apply(..., mutable=["batch_stats"])` returns updated collections: the op computing each
new value is a version of its buffer (`Buffer.versions`), equal to what linen itself
returns. nnx BatchNorm's running statistics in train mode likewise."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import torchlens as tl  # noqa: E402

X = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)


class LinenBN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.BatchNorm(use_running_average=not train)(nn.Dense(4)(x))
        return nn.Dense(2)(nn.relu(x))


def test_linen_mutable_batch_stats_are_buffer_versions_with_linens_values(tmp_path):
    m = LinenBN()
    v = m.init(jax.random.PRNGKey(0), X)
    t = tl.trace(m.apply, v, X, input_kwargs={"mutable": ["batch_stats"]}, backend="jax")
    _, updated = m.apply(v, X, mutable=["batch_stats"])  # linen's own new statistics
    for name in ("mean", "var"):
        buf = t.buffers[f"BatchNorm_0.{name}"]
        assert len(buf.versions) == 2, name  # the value read, then the value written
        np.testing.assert_array_equal(np.asarray(buf.versions[0].out), np.asarray(v["batch_stats"]["BatchNorm_0"][name]))
        written = buf.versions[-1]
        assert written.kind == "op" and written.meta["buffer_write"] == (f"BatchNorm_0.{name}",)
        np.testing.assert_array_equal(np.asarray(written.out), np.asarray(updated["batch_stats"]["BatchNorm_0"][name]))
    t.save(tmp_path / "bn.tlspec")
    loaded = tl.load(tmp_path / "bn.tlspec")
    labels = [o.label for o in t.buffers["BatchNorm_0.mean"].versions]
    assert [o.label for o in loaded.buffers["BatchNorm_0.mean"].versions] == labels
    assert loaded.validate_forward_pass()


def test_linen_eval_mode_without_mutable_has_one_version_per_buffer():
    m = LinenBN()
    v = m.init(jax.random.PRNGKey(0), X)
    t = tl.trace(m.apply, v, X, input_kwargs={"train": False}, backend="jax")
    assert all(len(b.versions) == 1 and b.versions[0].kind == "buffer" for b in t.buffers)


def test_nnx_batchnorm_running_stats_in_train_mode_are_buffer_versions():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(4, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.fc(x))

    m = Net(nnx.Rngs(0))
    m.train()
    t = tl.trace(m, X, backend="jax")
    m(X)  # nnx updates the running statistics in place: the values the trace recorded as written
    for name in ("mean", "var"):
        buf = t.buffers[f"bn.{name}"]
        assert buf.versions[-1].meta["buffer_write"] == (f"bn.{name}",)
        np.testing.assert_array_equal(np.asarray(buf.versions[-1].out), np.asarray(getattr(m.bn, name)[...]))
