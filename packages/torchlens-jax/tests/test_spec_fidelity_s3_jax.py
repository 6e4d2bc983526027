"""Helper S3: the JAX capture's setup/cleanup durations (provenance, glossary l. 16)."""

from __future__ import annotations

import time

import pytest

jnp = pytest.importorskip("jax.numpy")

import torchlens as tl  # noqa: E402


def test_setup_forward_and_cleanup_durations_add_up_to_the_capture_call():
    def model(x):
        return jnp.tanh(x @ x.T).sum(axis=0)

    x = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
    t0 = time.perf_counter()
    t = tl.trace(model, x, backend="jax")
    outer = time.perf_counter() - t0
    p = t.provenance
    assert p.setup_duration is not None and p.cleanup_duration is not None
    assert "setup_duration" not in p.unavailable and "cleanup_duration" not in p.unavailable
    assert p.setup_duration > 0 and p.cleanup_duration > 0
    inside = float(p.setup_duration) + float(t.cost.forward_duration) + float(p.cleanup_duration)
    assert inside <= outer  # the three phases lie inside the tl.trace call, without overlap
    assert "phases: setup_duration" in p.summary()
