"""Issue 28 zoo: `jax.jit` with shardings (pjit) over two host CPU devices, and a
`shard_map` with a collective. Runs `jax_two_devices.py` in a fresh process (the device
count is fixed when jax is first imported). Every op's value equals JAX's own jaxpr
evaluated equation by equation; the trace validates live and after save -> load (a loaded
op that read sharded inputs places them on a mesh of the recorded axes before it binds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")

SCRIPT = Path(__file__).resolve().parent / "jax_two_devices.py"


@pytest.fixture(scope="module")
def found():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pjit_on_two_devices_equals_an_independent_evaluation(found):
    assert found["devices"] == 2
    assert found["names"] == found["independent_names"] == ["dot_general", "max", "sharding_constraint", "dot_general", "tanh"]
    assert found["values_equal"] and found["output_equal"]
    assert found["sharded_ops"] == 5  # every op read an array sharded over both devices


def test_pjit_on_two_devices_validates_live_and_after_load(found):
    assert found["live_valid"]
    assert found["loaded_valid"]
    assert found["loaded_rebound"] == ["ShardedPrimitiveCall", "ShardingPassThrough"]


def test_shard_map_with_a_collective_on_two_devices_is_one_op_valid_live_refused_after_load(found):
    assert found["shard_map_names"] == ["shard_map", "add"]
    assert found["shard_map_output_equal"] and found["shard_map_live_valid"]
    # its body is code (a jaxpr): a loaded trace refuses it typed rather than run saved code
    assert found["shard_map_loaded"] == "opaque_op_not_replayable"
