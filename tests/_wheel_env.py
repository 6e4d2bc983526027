"""The steps the install-wheel tests share (tests/test_install_wheels*.py): build a member's
wheel as scripts/build-wheels.sh does, read the framework pin CI tests, fill the third-party
wheel cache, and install core plus one backend wheel into a fresh virtual environment that
runs a smoke script.

Not a test module (the leading underscore keeps pytest from collecting it); the test files
import it after putting this folder on `sys.path` (the suite runs with
`--import-mode=importlib`, which does not). The third-party wheels are kept between runs in
TORCHLENS_WHEEL_CACHE (default .venv/wheel-cache).
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


def run(cmd: list[str], timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    """Run `cmd`; a non-zero exit fails the test with the tail of its output."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert done.returncode == 0, f"{shlex.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def build_member_wheel(member: str, out: Path, stage: Path, timeout: float = 900) -> None:
    """One member's wheel, built as scripts/build-wheels.sh builds each (from a copy of its
    sources, without build isolation)."""
    src, dst = ROOT / member, stage / member.replace("/", "_")
    top = {"build", "dist", "tests", "benchmarks"}               # excluded at the member's top level only

    def ignore(folder: str, names: list[str]) -> set[str]:
        skip = {n for n in names if n.endswith(".egg-info") or n in ("__pycache__", ".pytest_cache")}
        return skip | (top & set(names) if Path(folder) == src else set())

    shutil.copytree(src, dst, ignore=ignore)
    run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; b.build_wheel(sys.argv[1])",
         str(out)], timeout=timeout, cwd=dst)


def requirement_pin(prefix: str) -> str:
    """The requirement CI tests for a framework (the first line of requirements-dev.txt that
    starts with `prefix`, without its comment)."""
    reqs = (ROOT / "requirements-dev.txt").read_text(encoding="utf-8").splitlines()
    return next(ln.split("#", 1)[0].strip() for ln in reqs if ln.strip().startswith(prefix))


def wheel_cache(tmp_path: Path) -> Path:
    """The third-party wheel cache folder (created): TORCHLENS_WHEEL_CACHE, else .venv/wheel-cache
    when the repository has a .venv, else one under `tmp_path`."""
    default_cache = ROOT / ".venv" / "wheel-cache" if (ROOT / ".venv").is_dir() else tmp_path / "wheel-cache"
    cache = Path(os.environ.get("TORCHLENS_WHEEL_CACHE", default_cache))
    cache.mkdir(parents=True, exist_ok=True)
    return cache


def fill_cache(cache: Path, requirements: list[str], timeout: float) -> None:
    """Download `requirements` (under constraints.txt) into `cache`: offline from the cache
    first, then from the index; the test skips when neither has them."""
    download = [sys.executable, "-m", "pip", "download", "-q", "-c", str(ROOT / "constraints.txt"), "-d", str(cache)]
    for extra in (["--no-index", "--find-links", str(cache)], []):   # offline first, then the index
        got = subprocess.run([*download, *extra, *requirements], capture_output=True, text=True, timeout=timeout)
        if got.returncode == 0:
            return
    pytest.skip(f"cannot obtain {requirements[0]} wheels: {got.stderr.strip()[-300:]}")


def backend_alone_smoke(tmp_path: Path, backend: str, pin_prefix: str, smoke: str, *,
                        deps: tuple[str, ...] = ("numpy", "pluggy", "safetensors"),
                        download_timeout: float = 600, run_timeout: float = 900) -> tuple[str, str, Path]:
    """The single-backend install case: a fresh venv with only the torchlens-core and
    torchlens-`backend` wheels (built here) plus the framework pinned by `pin_prefix` runs
    `smoke`. Returns (smoke's stdout, `torchlens --version`, the venv) for the test to check:
    `OK <path of the venv's torchlens>`, and a version line naming core and that one plugin.
    Skips when the framework's wheels cannot be had."""
    cache = wheel_cache(tmp_path)
    fill_cache(cache, [requirement_pin(pin_prefix), *deps], download_timeout)

    wheelhouse, stage = tmp_path / "wheelhouse", tmp_path / "stage"
    wheelhouse.mkdir()
    stage.mkdir()
    for member in ("packages/torchlens-core", f"packages/torchlens-{backend}"):
        build_member_wheel(member, wheelhouse, stage, timeout=run_timeout)
    assert sorted(p.name.split("-")[0] for p in wheelhouse.glob("*.whl")) == ["torchlens_core", f"torchlens_{backend}"]

    venv = tmp_path / f"venv-{backend}"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=run_timeout)
    run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-compile",
         "--no-index", "--find-links", str(wheelhouse), "--find-links", str(cache), "torchlens-core",
         f"torchlens-{backend}"], timeout=run_timeout)
    out = run([str(venv / "bin" / "python"), "-c", smoke], timeout=run_timeout, cwd=tmp_path)
    version = run([str(venv / "bin" / "torchlens"), "--version"], timeout=run_timeout).stdout.strip()
    return out.stdout, version, venv
