"""The `torchlens` console script: `torchlens doctor`, `torchlens demo`, `torchlens scorecard`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def version_line() -> str:
    """`torchlens --version`: core's version and every installed plugin distribution, read from
    package metadata (imports no plugin and no framework)."""
    from importlib import metadata

    import torchlens

    try:
        core = f"torchlens-core {metadata.version('torchlens-core')}"
    except metadata.PackageNotFoundError:  # running from a source tree that was never installed
        core = f"torchlens-core {torchlens.__version__} (not installed)"
    plugins = set()
    for ep in metadata.entry_points(group="torchlens"):
        dist = getattr(ep, "dist", None)
        plugins.add(f"{dist.metadata['Name']} {dist.version}" if dist is not None else ep.value)
    return core + ("; plugins: " + ", ".join(sorted(plugins)) if plugins else "; no plugins installed")


class _VersionAction(argparse.Action):
    """Like argparse's "version" action, but computed only when asked and never re-wrapped."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


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
        print(f"no backend is installed: {registry.install_hint('torch')}", file=sys.stderr)
        return 2
    problem = backend_problem(name)
    if problem is not None:
        print(f"torchlens demo: {problem}", file=sys.stderr)
        return 2
    spec = specs[name]
    zoo = load_zoo(spec)
    key = args.model or ("demo" if "demo" in zoo else next(iter(zoo), None))
    if key is None or key not in zoo:
        print(f"torchlens demo: backend {name} ships no model {key!r}; choose from {', '.join(zoo) or 'none'}",
              file=sys.stderr)
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


def _backend_arg(rest: list[str]) -> str | None:
    """The value of `--backend NAME` / `--backend=NAME` among forwarded arguments."""
    for i, arg in enumerate(rest):
        if arg == "--backend" and i + 1 < len(rest):
            return rest[i + 1]
        if arg.startswith("--backend="):
            return arg.split("=", 1)[1]
    return None


def backend_problem(name: str | None) -> str | None:
    """One line when `name` is not an installed backend (listing the installed ones), else None."""
    if name is None:
        return None
    from torchlens.backends import registry

    installed = sorted(registry.specs())
    if name in installed:
        return None
    listed = ", ".join(installed) or "none"
    if name in registry.KNOWN_BACKEND_EXTRAS:
        return f"the {name} backend is not installed; installed backends: {listed}"
    return f"no backend named {name!r}; installed backends: {listed}"


def _scorecard(args: argparse.Namespace, rest: list[str]) -> int:
    """With no mode (or `--summary`): cell outcomes and capability coverage of each backend
    (or the named one) from its shipped record, read by core. Otherwise forwarded to
    `python -m torchlens_conformance.scorecard` (core never imports the suite)."""
    import importlib.util
    import subprocess

    name = _backend_arg(rest)
    problem = backend_problem(name)
    if problem is not None:
        print(f"torchlens scorecard: {problem}", file=sys.stderr)
        return 2
    modes = {"--write", "--check", "--graduation", "-h", "--help"}
    if not modes & set(rest):
        return _scorecard_summary(name)
    if importlib.util.find_spec("torchlens_conformance") is None:
        from torchlens.backends.registry import install_hint

        print(f"the conformance suite is not installed: {install_hint('conformance')}", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, "-m", "torchlens_conformance.scorecard", *rest])


def _scorecard_summary(name: str | None) -> int:
    """Print each backend's cell outcomes and capability coverage from its shipped record."""
    from torchlens.backends import registry
    from torchlens.report.scorecard import read_scorecard, summary_lines

    specs = registry.specs()
    status = 0
    for backend in [name] if name else sorted(specs):
        record = read_scorecard(specs[backend])
        if record is None:
            print(f"{backend}: no shipped scorecard (python -m torchlens_conformance.scorecard --backend {backend} --write)")
            status = 1
            continue
        print("\n".join(summary_lines(record)))
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchlens", description="TorchLens command line")
    parser.add_argument("--version", action=_VersionAction,
                        help="print the installed torchlens distributions and exit")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("doctor", help="list plugins, backends and their scorecards")
    demo = sub.add_parser("demo", help="trace a small built-in model and draw it",
                          description="Trace a model from a backend's zoo (no downloads), print its summary, "
                                      "draw it and print the doctor table.")
    demo.add_argument("--backend", default=None,
                      help="backend whose zoo to use (default: torch if installed, else reference)")
    demo.add_argument("--model", default=None,
                      help="zoo model name (default: 'demo' if the backend has one, else its first model)")
    demo.add_argument("--out", default="torchlens_demo.svg",
                      help="picture to write (default torchlens_demo.svg; DOT text in a .gv file when "
                           "graphviz cannot render)")
    sub.add_parser("scorecard", help="show backends' cell outcomes and capability coverage; with --write/--check/"
                                     "--graduation, run torchlens_conformance", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.cmd == "doctor":
        return _doctor(args)
    if args.cmd == "demo":
        return _demo(args)
    return _scorecard(args, rest)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
