"""The `torchlens` console script: `torchlens doctor`, `torchlens demo`, `torchlens scorecard`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _doctor(args: argparse.Namespace) -> int:
    from torchlens.report import doctor

    print(doctor().table())
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Trace a small built-in model (no downloads), print its summary, draw it, run the doctor."""
    import torchlens as tl
    from torchlens.backends import registry
    from torchlens.backends.zoo import load_zoo

    specs = registry.specs()
    name = args.backend or ("torch" if "torch" in specs else "reference" if "reference" in specs else None)
    if name is None:
        print("no backend is installed: pip install 'torchlens[torch]'", file=sys.stderr)
        return 2
    spec = specs[name]
    zoo = load_zoo(spec)
    key = args.model or ("demo" if "demo" in zoo else next(iter(zoo), None))
    if key is None or key not in zoo:
        print(f"backend {name} ships no model {key!r}; choose from {', '.join(zoo)}", file=sys.stderr)
        return 2
    entry = zoo[key]
    if entry.reseed is not None:
        entry.reseed()
    trace = tl.trace(entry.model, *entry.args, input_kwargs=entry.kwargs, backend=name)
    print(f"== {trace!r}")
    print(trace.summary())
    out = Path(args.out)
    try:
        drawing = trace.draw(out)
        print(f"\n== graph written to {drawing.path}")
    except tl.errors.TorchLensError as exc:
        dot = out.with_suffix(".gv")
        trace.draw(dot)
        print(f"\n== could not render a picture ({exc.code}); DOT source written to {dot}")
    print("\n== doctor")
    print(tl.report.doctor().table())
    return 0


def _scorecard(args: argparse.Namespace, rest: list[str]) -> int:
    """Forwarded to `python -m torchlens_conformance.scorecard` (core never imports the suite)."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("torchlens_conformance") is None:
        print("the conformance suite is not installed: pip install torchlens-conformance", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, "-m", "torchlens_conformance.scorecard", *rest])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchlens", description="TorchLens command line")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("doctor", help="list plugins, backends and their scorecards")
    demo = sub.add_parser("demo", help="trace a small built-in model and draw it")
    demo.add_argument("--backend", default=None)
    demo.add_argument("--model", default=None)
    demo.add_argument("--out", default="torchlens_demo.svg")
    sub.add_parser("scorecard", help="compute or check a backend scorecard (torchlens_conformance)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.cmd == "doctor":
        return _doctor(args)
    if args.cmd == "demo":
        return _demo(args)
    return _scorecard(args, rest)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
