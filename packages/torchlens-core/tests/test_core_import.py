"""`import torchlens` imports no ML framework, and works where none is installed."""

import json
import subprocess
import sys

FRAMEWORKS = ("torch", "jax", "jaxlib", "tensorflow", "keras", "paddle", "mlx", "tinygrad", "flax", "equinox")


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_import_and_plugin_loading_import_no_framework():
    code = (
        "import sys, json, torchlens as tl\n"
        "tl.report.doctor()\n"  # loads every plugin and reads every scorecard
        "tl.backends.specs()\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r})))"
    )
    assert json.loads(_run(code)) == []


def test_import_works_with_every_framework_blocked():
    blocker = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        f"        if name.split('.')[0] in {FRAMEWORKS!r}: raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    code = blocker + (
        "import torchlens as tl\n"
        "rows = tl.report.doctor().keys()\n"
        "print('ok' if 'torchlens' in rows else 'missing')"
    )
    assert _run(code) == "ok"
