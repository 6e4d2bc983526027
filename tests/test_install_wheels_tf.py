"""Issue 19: a fresh venv with only the torchlens-core and torchlens-tf wheels plus
TensorFlow (tensorflow-cpu, which brings Keras 3; no torch, no jax) traces, draws, saves,
loads and validates a Keras model; `import torchlens` alone imports no framework (checked in
a separate interpreter before tensorflow is imported).

Modelled on the MLX case in tests/test_install_wheels.py; the build, cache, venv and install
steps are tests/_wheel_env.py's `backend_alone_smoke`, shared by every install test. The
third-party wheels are kept between runs in TORCHLENS_WHEEL_CACHE (default
.venv/wheel-cache); the test skips when they cannot be had (no cache, no index), and with
TORCHLENS_SKIP_INSTALL_TEST=1. Slow (a few minutes: tensorflow is a large install).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _wheel_env import backend_alone_smoke  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TORCHLENS_SKIP_INSTALL_TEST") == "1",
                                reason="TORCHLENS_SKIP_INSTALL_TEST=1")

TF_SMOKE = """
import importlib.util, subprocess, sys, tempfile
bare = subprocess.run([sys.executable, "-c", "import sys, torchlens; "
                       "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras', 'torch', 'jax')))"],
                      capture_output=True, text=True, check=True).stdout.strip()
assert bare == "[]", bare
assert importlib.util.find_spec("torch") is None and importlib.util.find_spec("jax") is None
import keras, numpy as np, tensorflow as tf, torchlens as tl
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
x = tf.reshape(tf.linspace(-1.0, 1.0, 12), (3, 4))
trace = tl.trace(model, x)
names = [op.func_name for op in trace.ops if op.kind == "op"]
assert names == ["matmul", "biasadd", "relu", "matmul", "biasadd"], names
dense = model.layers[0]
relu = trace[tl.func("relu")].first()
np.testing.assert_array_equal(np.asarray(relu.out), tf.nn.relu(tf.nn.bias_add(x @ dense.kernel.value, dense.bias.value)).numpy())
np.testing.assert_array_equal(np.asarray(trace.output_ops[0].out), model(x).numpy())
assert tl.validate(model, x) is True
with tempfile.TemporaryDirectory() as d:
    trace.draw(f"{d}/mlp.svg")
    assert open(f"{d}/mlp.svg").read().lstrip().startswith(("<svg", "<?xml")), "draw wrote no svg"
    trace.save(f"{d}/mlp.tlens")
    back = tl.load(f"{d}/mlp.tlens")
    assert list(back.labels) == list(trace.labels)
    np.testing.assert_array_equal(np.asarray(back[relu.label].out), np.asarray(relu.out))
    status = tl.backends.get_protocol("tf").validate(back, None)   # every op replayed on its loaded inputs
    assert status.ok, status
assert "torch" not in sys.modules and "jax" not in sys.modules
print("OK", tl.__file__)
"""


def test_tf_wheels_alone_trace_draw_save_load_validate_without_torch(tmp_path):
    stdout, version, venv = backend_alone_smoke(tmp_path, "tf", "tensorflow", TF_SMOKE, download_timeout=1500, run_timeout=1500)
    assert stdout.startswith("OK ") and str(venv) in stdout, stdout  # the venv's torchlens, not the repo's copy
    assert version == "torchlens-core 0.1.0; plugins: torchlens-tf 0.1.0", version
