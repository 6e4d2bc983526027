"""Issue 21: a fresh virtual environment with only the torchlens-core and torchlens-tinygrad
wheels plus tinygrad (no torch, no jax) traces, draws, saves, loads and validates a model;
`import torchlens` alone imports no framework (checked in a separate interpreter).

Modelled on the MLX case in tests/test_install_wheels.py (the shared steps are
tests/_wheel_env.py's `backend_alone_smoke`). The tinygrad wheel is kept in the same cache
folder (TORCHLENS_WHEEL_CACHE, default .venv/wheel-cache). Set TORCHLENS_SKIP_INSTALL_TEST=1 to skip (about a minute here).
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

#: the fresh tinygrad environment: import torchlens alone imports no framework, then a trace
#: checked against tinygrad's own forward, drawn, saved, loaded and validated after load.
TINYGRAD_SMOKE = """
import importlib.util, os, shutil, subprocess, sys, tempfile
bare = subprocess.run([sys.executable, "-c", "import sys, torchlens; "
                       "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tinygrad', 'torch', 'jax', 'mlx')))"],
                      capture_output=True, text=True, check=True).stdout.strip()
assert bare == "[]", bare
assert importlib.util.find_spec("torch") is None and importlib.util.find_spec("jax") is None
if shutil.which("clang") is None:
    os.environ["DEV"] = "PYTHON"     # no compiler: tinygrad's pure-Python device
import numpy as np, torchlens as tl
from tinygrad import Tensor, nn


class MLP:
    def __init__(self):
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def __call__(self, x):
        return self.l2(self.l1(x).relu())


Tensor.manual_seed(0)
model = MLP()
x = Tensor(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))
trace = tl.trace(model, x)            # tinygrad is the only framework imported: its backend is chosen
names = [op.func_name for op in trace.ops if op.kind == "op"]
assert names == ["transpose", "linear", "relu", "transpose", "linear"], names
assert [m.address for m in trace.modules] == ["self", "l1", "l2"]
relu = trace[tl.func("relu")].first()
w1, b1 = model.l1.weight.numpy(), model.l1.bias.numpy()
np.testing.assert_allclose(relu.out.numpy(), np.maximum(x.numpy() @ w1.T + b1, 0), rtol=1e-5, atol=1e-6)
np.testing.assert_allclose(trace.output_ops[0].out.numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
assert tl.validate(model, x) is True
with tempfile.TemporaryDirectory() as d:
    trace.draw(f"{d}/mlp.svg")
    assert open(f"{d}/mlp.svg").read().lstrip().startswith(("<svg", "<?xml")), "draw wrote no svg"
    trace.save(f"{d}/mlp.tlens")
    back = tl.load(f"{d}/mlp.tlens")
    assert list(back.labels) == list(trace.labels)
    np.testing.assert_array_equal(back[relu.label].out.numpy(), relu.out.numpy())
    status = tl.backends.get_protocol("tinygrad").validate(back, None)   # every op replayed on its loaded inputs
    assert status.ok, status
assert "torch" not in sys.modules and "jax" not in sys.modules
print("OK", tl.__file__)
"""


def test_tinygrad_wheels_alone_trace_draw_save_load_validate_without_torch(tmp_path):
    stdout, version, venv = backend_alone_smoke(tmp_path, "tinygrad", "tinygrad", TINYGRAD_SMOKE, download_timeout=600, run_timeout=900)
    assert stdout.startswith("OK ") and str(venv) in stdout, stdout  # the venv's torchlens, not the repo's copy
    assert version == "torchlens-core 0.1.0; plugins: torchlens-tinygrad 0.1.0", version
