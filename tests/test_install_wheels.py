"""The install lines of docs/install.md, executed: build the wheelhouse with
scripts/build-wheels.sh, install core+torch and core+jax into two fresh virtual
environments with the documented `pip install --no-index --find-links wheelhouse ...` lines,
and trace a tiny model in each.

Why: `pip install "torchlens[torch]"` against PyPI installs an unrelated project of the same
name; the documented route must keep working from a clean environment, installing only the
chosen extras. The third-party wheels (torch, jax, ...) are kept between runs in a cache
folder (TORCHLENS_WHEEL_CACHE, default .venv/wheel-cache), so a second run downloads
nothing; installs skip byte-compilation and run in parallel to stay within CI's budget.
Set TORCHLENS_SKIP_INSTALL_TEST=1 to skip (about 1-3 minutes on the 2-core machine).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _wheel_env import ROOT, backend_alone_smoke, run as _run, wheel_cache  # noqa: E402
INSTALL_DOC = ROOT / "docs" / "install.md"

pytestmark = pytest.mark.skipif(os.environ.get("TORCHLENS_SKIP_INSTALL_TEST") == "1",
                                reason="TORCHLENS_SKIP_INSTALL_TEST=1")

#: what each fresh environment runs after the install: a tiny trace checked against the
#: framework's own forward, and proof that only the chosen backend came with it.
SMOKE = {
    "torch": """
import importlib.util, torch, torchlens as tl
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
x = torch.randn(3, 4)
trace = tl.trace(model, x)
assert list(trace.labels) == ['input_1', 'linear_1_1', 'relu_1_2', 'linear_2_3', 'output_1'], trace.labels
assert torch.equal(trace["relu_1_2"].out, torch.relu(model[0](x)))
assert importlib.util.find_spec("torchlens_jax") is None and importlib.util.find_spec("jax") is None
print("OK", tl.__file__)
""",
    "jax": """
import importlib.util, jax.numpy as jnp, numpy as np, torchlens as tl
def f(x, w):
    return jnp.tanh(x @ w)
x, w = jnp.ones((2, 3)), jnp.full((3, 4), 0.5)
trace = tl.trace(f, x, w)
assert [op.func_name for op in trace.ops if op.kind == "op"] == ["dot_general", "tanh"], trace.labels
np.testing.assert_allclose(np.asarray(trace[tl.func("tanh")].first().out), np.asarray(f(x, w)))
assert importlib.util.find_spec("torchlens_torch") is None and importlib.util.find_spec("torch") is None
print("OK", tl.__file__)
""",
}


def _doc_commands() -> tuple[str, dict[str, str]]:
    """The build line and the core+torch / core+jax install lines, as docs/install.md writes them."""
    text = INSTALL_DOC.read_text(encoding="utf-8")
    lines = [ln.split("#", 1)[0].strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for ln in block.splitlines()]
    build = next(ln for ln in lines if ln.startswith("bash scripts/build-wheels.sh"))
    installs = {}
    for extra in SMOKE:
        installs[extra] = next(ln for ln in lines if ln.startswith("pip install") and ln.endswith(f'"torchlens[{extra}]"'))
    return build, installs


def test_documented_install_lines_work_in_fresh_venvs(tmp_path):
    build, installs = _doc_commands()
    # The documented lines take TorchLens from the wheelhouse only (PyPI's "torchlens" is another project).
    for line in installs.values():
        assert "--no-index" in line.split() and "--find-links wheelhouse" in line

    wheelhouse = tmp_path / "wheelhouse"
    cache = wheel_cache(tmp_path)
    build_args = shlex.split(build)[2:]                       # after "bash scripts/build-wheels.sh"
    build_args[build_args.index("wheelhouse")] = str(wheelhouse)
    env = {**os.environ, "PYTHON": sys.executable}
    _run(["bash", str(ROOT / "scripts" / "build-wheels.sh"), *build_args, "--deps-dir", str(cache)], env=env)
    built = sorted(p.name.split("-")[0] for p in wheelhouse.glob("*.whl"))
    assert built == ["torchlens", "torchlens_conformance", "torchlens_core", "torchlens_jax", "torchlens_mechinterp",
                     "torchlens_mlx", "torchlens_paddle", "torchlens_reference", "torchlens_tf", "torchlens_tinygrad",
                     "torchlens_torch"]

    # Every module of every member's source tree is in its wheel (nothing filtered out by the build).
    for member, wheel_name in [("packages/torchlens-core", "torchlens_core"), ("packages/torchlens-torch", "torchlens_torch"),
                               ("packages/torchlens-jax", "torchlens_jax"), ("conformance", "torchlens_conformance")]:
        src = ROOT / member / "src"
        want = {p.relative_to(src).as_posix() for p in src.rglob("*.py")}
        with zipfile.ZipFile(next(wheelhouse.glob(f"{wheel_name}-*.whl"))) as z:
            assert want - set(z.namelist()) == set(), member

    # One fresh venv per documented line (no pip inside: the test's pip installs into it).
    jobs = {}
    for extra, line in installs.items():
        venv = tmp_path / f"venv-{extra}"
        _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
        args = shlex.split(line)[2:]                          # after "pip install"
        args = [str(wheelhouse) if a == "wheelhouse" else a for a in args]
        cmd = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
               "--no-compile", "--find-links", str(cache), *args]
        jobs[extra] = (venv, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for extra, (venv, proc) in jobs.items():
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"installing {installs[extra]!r} failed:\n{out[-4000:]}"

    for extra, (venv, _) in jobs.items():
        py = venv / "bin" / "python"
        smoke = _run([str(py), "-c", SMOKE[extra]], cwd=tmp_path)
        assert smoke.stdout.startswith("OK ") and str(venv) in smoke.stdout, smoke.stdout  # not the repo's copy
        version = _run([str(venv / "bin" / "torchlens"), "--version"]).stdout.strip()
        assert version == f"torchlens-core 0.1.0; plugins: torchlens-{extra} 0.1.0", version


#: the fresh MLX environment: import torchlens alone imports no framework (checked in a
#: separate interpreter, before mlx is imported), then a trace checked against MLX's own
#: forward, drawn, saved, loaded and validated after load; torch and jax are absent.
MLX_SMOKE = """
import importlib.util, subprocess, sys, tempfile
bare = subprocess.run([sys.executable, "-c", "import sys, torchlens; "
                       "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'torch', 'jax')))"],
                      capture_output=True, text=True, check=True).stdout.strip()
assert bare == "[]", bare
assert importlib.util.find_spec("torch") is None and importlib.util.find_spec("jax") is None
import mlx.core as mx, mlx.nn as nn, numpy as np, torchlens as tl
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
mx.eval(model.parameters())
x = mx.linspace(-1, 1, 12).reshape(3, 4)
trace = tl.trace(model, x)
names = [op.func_name for op in trace.ops if op.kind == "op"]
assert names == ["transpose", "addmm", "maximum", "transpose", "addmm"], names
relu = trace[tl.func("maximum")].first()
np.testing.assert_array_equal(np.asarray(relu.out), np.asarray(mx.maximum(model.layers[0](x), 0)))
np.testing.assert_array_equal(np.asarray(trace.output_ops[0].out), np.asarray(model(x)))
assert tl.validate(model, x) is True
with tempfile.TemporaryDirectory() as d:
    trace.draw(f"{d}/mlp.svg")
    assert open(f"{d}/mlp.svg").read().lstrip().startswith(("<svg", "<?xml")), "draw wrote no svg"
    trace.save(f"{d}/mlp.tlens")
    back = tl.load(f"{d}/mlp.tlens")
    assert list(back.labels) == list(trace.labels)
    np.testing.assert_array_equal(np.asarray(back[relu.label].out), np.asarray(relu.out))
    status = tl.backends.get_protocol("mlx").validate(back, None)   # every op replayed on its loaded inputs
    assert status.ok, status
assert "torch" not in sys.modules and "jax" not in sys.modules
print("OK", tl.__file__)
"""


def test_mlx_wheels_alone_trace_draw_save_load_validate_without_torch(tmp_path):
    """Issue 18: a fresh venv with only the torchlens-core and torchlens-mlx wheels plus MLX
    (no torch, no jax) traces, draws, saves, loads and validates; `import torchlens` alone
    imports no framework. Skips when the MLX wheels cannot be had (no cache, no index)."""
    stdout, version, venv = backend_alone_smoke(tmp_path, "mlx", "mlx", MLX_SMOKE, download_timeout=600, run_timeout=900)
    assert stdout.startswith("OK ") and str(venv) in stdout, stdout  # the venv's torchlens, not the repo's copy
    assert version == "torchlens-core 0.1.0; plugins: torchlens-mlx 0.1.0", version
