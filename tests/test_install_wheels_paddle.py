"""Issue 20: a fresh venv with only the torchlens-core and torchlens-paddle wheels plus
paddlepaddle (no torch, no jax, no tensorflow) traces, draws, saves, loads and validates a
model; `import torchlens` alone imports no framework.

Modelled on the MLX case in tests/test_install_wheels.py; the build, cache, venv and install
steps are tests/_wheel_env.py's `backend_alone_smoke`, shared by every install test. The
third-party wheels are kept in TORCHLENS_WHEEL_CACHE (default .venv/wheel-cache); skips when
the paddle wheels cannot be had (no cache, no index). Set TORCHLENS_SKIP_INSTALL_TEST=1 to
skip (a few minutes on the 2-core machine).
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

#: the fresh paddle environment: import torchlens alone imports no framework (checked in a
#: separate interpreter, before paddle is imported), then a trace checked against paddle's
#: own forward (layer by layer with paddle.nn.functional), drawn, saved, loaded and
#: validated after load; torch, jax and tensorflow are absent.
PADDLE_SMOKE = """
import importlib.util, subprocess, sys, tempfile
bare = subprocess.run([sys.executable, "-c", "import sys, torchlens, torchlens_paddle; "
                       "print(sorted(m for m in sys.modules if m.split('.')[0] in ('paddle', 'torch', 'jax', 'tensorflow')))"],
                      capture_output=True, text=True, check=True).stdout.strip()
assert bare == "[]", bare
for name in ("torch", "jax", "tensorflow"):
    assert importlib.util.find_spec(name) is None, name
import numpy as np, paddle, torchlens as tl
import paddle.nn.functional as F
paddle.seed(0)
model = paddle.nn.Sequential(paddle.nn.Linear(4, 8), paddle.nn.ReLU(), paddle.nn.Linear(8, 2))
x = paddle.to_tensor(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))
trace = tl.trace(model, x)                     # paddle is the only framework imported: chosen by itself
names = [op.func_name for op in trace.ops if op.kind == "op"]
assert names == ["linear", "relu", "linear"], names
relu = trace[tl.func("relu")].first()
np.testing.assert_array_equal(relu.out.numpy(), F.relu(F.linear(x, model[0].weight, model[0].bias)).numpy())
np.testing.assert_array_equal(trace.output_ops[0].out.numpy(), model(x).numpy())
assert tl.validate(model, x) is True
with tempfile.TemporaryDirectory() as d:
    trace.draw(f"{d}/mlp.svg")
    assert open(f"{d}/mlp.svg").read().lstrip().startswith(("<svg", "<?xml")), "draw wrote no svg"
    trace.save(f"{d}/mlp.tlens")
    back = tl.load(f"{d}/mlp.tlens")
    assert list(back.labels) == list(trace.labels)
    np.testing.assert_array_equal(back[relu.label].out.numpy(), relu.out.numpy())
    status = tl.backends.get_protocol("paddle").validate(back, None)   # every op replayed on its loaded inputs
    assert status.ok, status
assert "torch" not in sys.modules and "jax" not in sys.modules and "tensorflow" not in sys.modules
print("OK", tl.__file__)
"""


def test_paddle_wheels_alone_trace_draw_save_load_validate_without_torch(tmp_path):
    stdout, version, venv = backend_alone_smoke(tmp_path, "paddle", "paddlepaddle", PADDLE_SMOKE,
                                                deps=("numpy", "pluggy", "safetensors", "setuptools"), download_timeout=900,
                                                run_timeout=900)
    assert stdout.startswith("OK ") and str(venv) in stdout, stdout  # the venv's torchlens, not the repo's copy
    assert version == "torchlens-core 0.1.0; plugins: torchlens-paddle 0.1.0", version
