"""Issue 19: a fresh venv with only the torchlens-core and torchlens-tf wheels plus
TensorFlow (tensorflow-cpu, which brings Keras 3; no torch, no jax) traces, draws, saves,
loads and validates a Keras model; `import torchlens` alone imports no framework (checked in
a separate interpreter before tensorflow is imported).

Modelled on the MLX case in tests/test_install_wheels.py (its helpers `_run` and
`_build_member_wheel` are repeated here, not imported: importing that module would collect its
tests twice). The third-party wheels are kept between runs in TORCHLENS_WHEEL_CACHE (default
.venv/wheel-cache); the test skips when they cannot be had (no cache, no index), and with
TORCHLENS_SKIP_INSTALL_TEST=1. Slow (a few minutes: tensorflow is a large install).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

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


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, **kw)
    assert done.returncode == 0, f"{shlex.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _build_member_wheel(member: str, out: Path, stage: Path) -> None:
    """One member's wheel, built as scripts/build-wheels.sh builds each (from a copy of its
    sources, without build isolation)."""
    src, dst = ROOT / member, stage / member.replace("/", "_")
    top = {"build", "dist", "tests", "benchmarks"}               # excluded at the member's top level only

    def ignore(folder: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n.endswith(".egg-info") or n in ("__pycache__", ".pytest_cache")}
        return skip | (top & set(names) if Path(folder) == src else set())

    shutil.copytree(src, dst, ignore=ignore)
    _run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; b.build_wheel(sys.argv[1])",
          str(out)], cwd=dst)


def _tf_pin() -> str:
    """The TensorFlow requirement CI tests (requirements-dev.txt)."""
    reqs = (ROOT / "requirements-dev.txt").read_text(encoding="utf-8").splitlines()
    return next(ln.split("#", 1)[0].strip() for ln in reqs if ln.strip().startswith("tensorflow"))


def test_tf_wheels_alone_trace_draw_save_load_validate_without_torch(tmp_path):
    default_cache = ROOT / ".venv" / "wheel-cache" if (ROOT / ".venv").is_dir() else tmp_path / "wheel-cache"
    cache = Path(os.environ.get("TORCHLENS_WHEEL_CACHE", default_cache))
    cache.mkdir(parents=True, exist_ok=True)
    pin = _tf_pin()
    download = [sys.executable, "-m", "pip", "download", "-q", "-c", str(ROOT / "constraints.txt"), "-d", str(cache)]
    for extra in (["--no-index", "--find-links", str(cache)], []):   # offline first, then the index
        got = subprocess.run([*download, *extra, pin, "numpy", "pluggy", "safetensors"],
                             capture_output=True, text=True, timeout=1500)
        if got.returncode == 0:
            break
    else:
        pytest.skip(f"cannot obtain {pin} wheels: {got.stderr.strip()[-300:]}")

    wheelhouse, stage = tmp_path / "wheelhouse", tmp_path / "stage"
    wheelhouse.mkdir()
    stage.mkdir()
    for member in ("packages/torchlens-core", "packages/torchlens-tf"):
        _build_member_wheel(member, wheelhouse, stage)
    assert sorted(p.name.split("-")[0] for p in wheelhouse.glob("*.whl")) == ["torchlens_core", "torchlens_tf"]

    venv = tmp_path / "venv-tf"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-compile",
          "--no-index", "--find-links", str(wheelhouse), "--find-links", str(cache), "torchlens-core", "torchlens-tf"])
    smoke = _run([str(venv / "bin" / "python"), "-c", TF_SMOKE], cwd=tmp_path)
    assert smoke.stdout.startswith("OK ") and str(venv) in smoke.stdout, smoke.stdout  # not the repo's copy
    version = _run([str(venv / "bin" / "torchlens"), "--version"]).stdout.strip()
    assert version == "torchlens-core 0.1.0; plugins: torchlens-tf 0.1.0", version
