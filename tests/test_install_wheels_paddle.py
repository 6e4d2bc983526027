"""Issue 20: a fresh venv with only the torchlens-core and torchlens-paddle wheels plus
paddlepaddle (no torch, no jax, no tensorflow) traces, draws, saves, loads and validates a
model; `import torchlens` alone imports no framework.

Modelled on the MLX case in tests/test_install_wheels.py (its `_run` and
`_build_member_wheel` are repeated here, small, rather than imported from another test
module). The third-party wheels are kept in TORCHLENS_WHEEL_CACHE (default
.venv/wheel-cache); skips when the paddle wheels cannot be had (no cache, no index).
Set TORCHLENS_SKIP_INSTALL_TEST=1 to skip (a few minutes on the 2-core machine).
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


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)
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


def _paddle_pin() -> str:
    """The paddle requirement CI tests (requirements-dev.txt)."""
    reqs = (ROOT / "requirements-dev.txt").read_text(encoding="utf-8").splitlines()
    return next(ln.split("#", 1)[0].strip() for ln in reqs if ln.strip().startswith("paddlepaddle"))


def test_paddle_wheels_alone_trace_draw_save_load_validate_without_torch(tmp_path):
    default_cache = ROOT / ".venv" / "wheel-cache" if (ROOT / ".venv").is_dir() else tmp_path / "wheel-cache"
    cache = Path(os.environ.get("TORCHLENS_WHEEL_CACHE", default_cache))
    cache.mkdir(parents=True, exist_ok=True)
    pin = _paddle_pin()
    download = [sys.executable, "-m", "pip", "download", "-q", "-c", str(ROOT / "constraints.txt"), "-d", str(cache)]
    for extra in (["--no-index", "--find-links", str(cache)], []):   # offline first, then the index
        got = subprocess.run([*download, *extra, pin, "numpy", "pluggy", "safetensors", "setuptools"],
                             capture_output=True, text=True, timeout=900)
        if got.returncode == 0:
            break
    else:
        pytest.skip(f"cannot obtain {pin} wheels: {got.stderr.strip()[-300:]}")

    wheelhouse, stage = tmp_path / "wheelhouse", tmp_path / "stage"
    wheelhouse.mkdir()
    stage.mkdir()
    for member in ("packages/torchlens-core", "packages/torchlens-paddle"):
        _build_member_wheel(member, wheelhouse, stage)
    assert sorted(p.name.split("-")[0] for p in wheelhouse.glob("*.whl")) == ["torchlens_core", "torchlens_paddle"]

    venv = tmp_path / "venv-paddle"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-compile",
          "--no-index", "--find-links", str(wheelhouse), "--find-links", str(cache), "torchlens-core",
          "torchlens-paddle"])
    smoke = _run([str(venv / "bin" / "python"), "-c", PADDLE_SMOKE], cwd=tmp_path)
    assert smoke.stdout.startswith("OK ") and str(venv) in smoke.stdout, smoke.stdout  # not the repo's copy
    version = _run([str(venv / "bin" / "torchlens"), "--version"]).stdout.strip()
    assert version == "torchlens-core 0.1.0; plugins: torchlens-paddle 0.1.0", version
