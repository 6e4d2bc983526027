"""Layer labels side by side: ours against PyPI torchlens's, for every model of the torch zoo
(`torchlens_torch.zoo`) and the hand-written and Hugging Face entries of the real-model zoo
(`torchlens_torch.real_zoo`; torchvision/timm entries need `.venv/vision` and are skipped).

PyPI torchlens cannot live in this venv (its import name is ours). Install it in a separate
venv and point `--pypi-torchlens-python` (or TORCHLENS_PYPI_PYTHON) at that venv's python:

    python -m venv /tmp/pypi_tl && /tmp/pypi_tl/bin/pip install -c constraints.txt torchlens transformers
    python benchmarks/labels_pypi.py --pypi-torchlens-python /tmp/pypi_tl/bin/python

The peer process loads the zoo files by path (they import only torch and transformers; the
real zoo's `vision_env` is stubbed out there), builds each model with the same seed and
prints PyPI torchlens's `layer_labels`. For each model the report gives whether the compute
labels (sources `input_*`, `buffer_*`, `output_*` set aside: PyPI torchlens numbers buffer
reads differently) are equal; when not, whether both record the same op types in the same
order (then the labels must be equal) and which types only one side records (an op one side
records and the other does not shifts every later step number). Results go to
`benchmarks/results/labels_pypi.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "labels_pypi.json"
_SRC = Path(__file__).resolve().parents[1] / "packages" / "torchlens-torch" / "src" / "torchlens_torch"
_SOURCES = ("input", "buffer", "output")


def _peer(python: str, names: list[str]) -> dict[str, Any]:
    code = f"""
import importlib.util, json, sys, types, warnings
warnings.simplefilter("ignore")
import torch, torchlens
stub = types.ModuleType("torchlens_torch"); stub.__path__ = []
env = types.ModuleType("torchlens_torch.vision_env")
env.available = lambda: False; env.vision_paths = lambda: []
stub.vision_env = env
sys.modules["torchlens_torch"] = stub; sys.modules["torchlens_torch.vision_env"] = env
def load(name):
    spec = importlib.util.spec_from_file_location("torchlens_torch." + name, {str(_SRC)!r} + "/" + name + ".py")
    mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod; spec.loader.exec_module(mod); return mod
zoo, real = load("zoo"), load("real_zoo")
out = {{}}
for name in {names!r}:
    kind, _, key = name.partition(":")
    try:
        m, a, k = (zoo.ZOO[key] if kind == "zoo" else real.ENTRIES[key]).build(0)
        t = torchlens.trace(m, *a, **k) if not k else torchlens.trace(m, a, input_kwargs=k)
        out[name] = list(t.layer_labels)
    except Exception as exc:
        out[name] = "ERROR " + type(exc).__name__ + ": " + str(exc)[:300]
print(json.dumps(out))
"""
    res = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise SystemExit(f"peer run failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _ours(names: list[str]) -> dict[str, Any]:
    import torchlens as tl
    from torchlens_torch import real_zoo, zoo

    out: dict[str, Any] = {}
    for name in names:
        kind, _, key = name.partition(":")
        try:
            m, a, k = (zoo.ZOO[key] if kind == "zoo" else real_zoo.ENTRIES[key]).build(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = tl.trace(m, *a, input_kwargs=k, save="none")
            out[name] = list(t.layers.labels)
        except Exception as exc:  # reported, not hidden
            out[name] = f"ERROR {type(exc).__name__}: {str(exc)[:300]}"
    return out


def _compute(labels: list[str]) -> list[str]:
    return [lb for lb in labels if lb.rsplit("_", 1)[0] not in _SOURCES]


def compare(ours: Any, theirs: Any) -> dict[str, Any]:
    if isinstance(ours, str) or isinstance(theirs, str):
        return {"equal": False, "ours": ours if isinstance(ours, str) else None,
                "pypi": theirs if isinstance(theirs, str) else None}
    a, b = _compute(ours), _compute(theirs)
    ta, tb = [lb.rsplit("_", 2)[0] for lb in a], [lb.rsplit("_", 2)[0] for lb in b]
    row: dict[str, Any] = {"equal": a == b, "same_ops": ta == tb, "num_ours": len(a), "num_pypi": len(b)}
    if a != b:
        diffs = [(i, x, y) for i, (x, y) in enumerate(zip(a, b)) if x != y]
        row["first_differences"] = diffs[:3]
        # the type tokens one side records and the other does not (why the numbering shifts)
        row["types_only_ours"] = dict((Counter(ta) - Counter(tb)).most_common(8))
        row["types_only_pypi"] = dict((Counter(tb) - Counter(ta)).most_common(8))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pypi-torchlens-python", default=os.environ.get("TORCHLENS_PYPI_PYTHON"))
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("names", nargs="*", help="zoo:NAME or real:NAME (default: every zoo and non-vision real entry)")
    args = ap.parse_args(argv)
    if not args.pypi_torchlens_python:
        raise SystemExit("give --pypi-torchlens-python (a venv with PyPI torchlens; see the module docstring)")
    from torchlens_torch import real_zoo, zoo

    names = args.names or ([f"zoo:{n}" for n, e in zoo.ZOO.items() if e.available()]
                           + [f"real:{n}" for n, e in real_zoo.ENTRIES.items()
                              if not e.big and not set(e.requires) & {"torchvision", "timm"} and e.available()])
    ours, theirs = _ours(names), _peer(args.pypi_torchlens_python, names)
    rows = {n: compare(ours[n], theirs[n]) for n in names}
    equal = [n for n, r in rows.items() if r["equal"]]
    same_ops = [n for n, r in rows.items() if r.get("same_ops")]
    print(f"{len(equal)} of {len(rows)} models: compute-layer labels equal to PyPI torchlens's; "
          f"{len(same_ops)} record the same op types in the same order (labels must be equal there: "
          f"{'yes' if set(same_ops) <= set(equal) else 'NO'})")
    for n, r in rows.items():
        if not r["equal"]:
            print(f"  {n}: {json.dumps({k: v for k, v in r.items() if k != 'equal'})[:400]}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"num_equal": len(equal), "num_same_ops": len(same_ops), "num_models": len(rows),
                               "models": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
