"""Arrows point down only: core imports no framework and no backend; inside core each layer
imports only the layers below it (records import no selection, intervention, persistence or
drawing code: they reach those through `torchlens.records.ports`); backends never import
each other; every backend (torch, jax, reference) imports nothing from core but `torchlens`
and `torchlens.backends.sdk`. Checked on the source (every import statement, including ones
inside functions)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = {"torch", "jax", "jaxlib", "tensorflow", "keras", "paddle", "mlx", "tinygrad", "flax", "equinox",
              "transformers"}
CORE_ALLOWED_PACKAGES = {"torchlens_mechinterp"}  # torchlens.mechinterp re-exports the kit by design


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def imported_names(source: str) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def core_violations(src_dir: Path) -> list[str]:
    bad = []
    for path in src_dir.rglob("*.py"):
        for line, name in imported_names(path.read_text()):
            top = name.split(".")[0]
            if top in FRAMEWORKS or (top.startswith("torchlens_") and top not in CORE_ALLOWED_PACKAGES):
                bad.append(f"{_rel(path)}:{line} imports {name}")
    return bad


def backend_violations(pkg_dir: Path, own: str) -> list[str]:
    bad = []
    for path in pkg_dir.rglob("*.py"):
        for line, name in imported_names(path.read_text()):
            top = name.split(".")[0]
            if top.startswith("torchlens_") and top not in (own, "torchlens_conformance"):
                bad.append(f"{_rel(path)}:{line} imports {name}")
    return bad


#: Backends that import core only through `torchlens.backends.sdk` (issue 14): all of them; a new
#: backend starts here.
SDK_ONLY_BACKENDS = ("torchlens_jax", "torchlens_mlx", "torchlens_paddle", "torchlens_reference", "torchlens_tf", "torchlens_tinygrad", "torchlens_torch")
SDK_ALLOWED = {"torchlens", "torchlens.backends.sdk"}


def sdk_violations(pkg_dir: Path) -> list[str]:
    """Imports of core modules other than `torchlens` itself and the SDK (`from torchlens
    import x` is allowed only for `hookimpl`)."""
    bad = []
    for path in pkg_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [(node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [(node.lineno, node.module)]
                if node.module == "torchlens":
                    names += [(node.lineno, f"torchlens.{a.name}") for a in node.names if a.name not in ("hookimpl",)]
            else:
                continue
            for line, name in names:
                if (name == "torchlens" or name.startswith("torchlens.")) and name not in SDK_ALLOWED:
                    bad.append(f"{_rel(path)}:{line} imports {name}")
    return bad


#: Core layers and the other core layers each may import (issue 14 §4). A layer is the first
#: component of a module's path under `torchlens/` (`records/trace.py` -> "records"); layers not
#: listed (the top: capture, check, io, cli, ...) are unconstrained. `backends/sdk.py` is the
#: facade backends import, so it may import any layer.
CORE_LAYER_ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "records": {"errors", "types"},
    "build": {"errors", "types", "records", "select"},
    "viz": {"errors", "types", "records", "build", "options"},
    "intervention": {"errors", "types", "records", "build", "select", "backends", "options", "io", "replay"},
    "replay": {"errors", "types", "records", "build", "backends", "io", "viz", "options"},
    "stats": {"errors", "__version__"},  # the saved state names the writing version
    "dataset_extraction": {"errors", "stats", "capture", "options", "backends", "select"},
    "backends": {"errors", "types", "plugins"},
    # issue 22: tl.record runs each forward through tl.trace's capture path (capture), keeps records (records,
    # build.save), resolves backends (backends) and stop_after= edits (intervention, select)
    "recording": {"errors", "types", "options", "records", "build", "select", "capture", "backends", "intervention"},
    "distributed": {"errors", "io", "backends"},  # issue 24: merge loads traces (io), arm() finds the backend
}
#: (layer, file) pairs whose upward imports are deliberate facades: the backend SDK re-exports
#: what backends need; `tl.stats.aggregate` (the spec's home for it) delegates to the extraction
#: layer lazily, inside the function.
LAYER_EXEMPT = {("backends", "sdk.py"), ("stats", "__init__.py")}


def _core_imports(path: Path) -> list[tuple[int, str]]:
    """(line, layer) of every core module `path` imports (`from torchlens import x` counts x)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [(node.lineno, node.module)]
            if node.module == "torchlens":
                names = [(node.lineno, f"torchlens.{a.name}") for a in node.names]
        else:
            continue
        out += [(line, name.split(".")[1]) for line, name in names if name.startswith("torchlens.")]
    return out


def layer_violations(src_dir: Path) -> list[str]:
    bad = []
    for path in src_dir.rglob("*.py"):
        parts = path.relative_to(src_dir).parts
        layer = parts[0].removesuffix(".py")
        if layer not in CORE_LAYER_ALLOWED or (layer, parts[-1]) in LAYER_EXEMPT:
            continue
        for line, target in _core_imports(path):
            if target != layer and target not in CORE_LAYER_ALLOWED[layer]:
                bad.append(f"{_rel(path)}:{line} ({layer}) imports torchlens.{target}")
    return bad


def test_core_layers_import_only_layers_below():
    assert layer_violations(ROOT / "packages" / "torchlens-core" / "src" / "torchlens") == []


def test_layer_checker_catches_upward_imports(tmp_path):
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "trace.py").write_text(
        "from torchlens.errors import X\nfrom torchlens.records.op import Op\n"
        "def f():\n    from torchlens.intervention.verbs import do\n    from torchlens import io\n")
    (tmp_path / "backends").mkdir()
    (tmp_path / "backends" / "sdk.py").write_text("from torchlens.build import build_trace\n")
    (tmp_path / "capture.py").write_text("from torchlens.viz import draw\n")
    assert sorted(v.split(" imports ")[1] for v in layer_violations(tmp_path)) == ["torchlens.intervention", "torchlens.io"]


def test_every_records_port_is_bound():
    """Each `port("name")` a record or the builder calls is bound by `torchlens._wiring`."""
    import torchlens  # noqa: F401  (runs the wiring)
    from torchlens.records.ports import bound, port

    core = ROOT / "packages" / "torchlens-core" / "src" / "torchlens"
    called = set()
    for path in [*(core / "records").glob("*.py"), *(core / "build").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "port"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                called.add(node.args[0].value)
    assert called and called <= bound(), sorted(called - bound())
    for name in called:
        assert callable(port(name)), name


def backend_packages() -> list[tuple[Path, str]]:
    out = []
    for src in sorted((ROOT / "packages").glob("torchlens-*/src/torchlens_*")):
        if src.name != "torchlens_mechinterp":
            out.append((src, src.name))
    return out


def test_core_imports_no_framework_and_no_backend():
    assert core_violations(ROOT / "packages" / "torchlens-core" / "src") == []


def test_backends_never_import_each_other():
    pkgs = backend_packages()
    assert any(name == "torchlens_reference" for _, name in pkgs)
    for src, name in pkgs:
        assert backend_violations(src, name) == [], name


def test_sdk_backends_import_core_only_through_the_sdk():
    pkgs = dict((name, src) for src, name in backend_packages())
    for name in SDK_ONLY_BACKENDS:
        assert name in pkgs, name
        assert sdk_violations(pkgs[name]) == [], name


def test_sdk_checker_catches_internal_imports(tmp_path):
    (tmp_path / "a.py").write_text("import torchlens\nfrom torchlens import hookimpl\nfrom torchlens.backends.sdk import OpEvent\n"
                                   "def f():\n    from torchlens.build import EventLog\n    import torchlens.records.trace\n"
                                   "    from torchlens import errors\n")
    assert sorted(v.split(" imports ")[1] for v in sdk_violations(tmp_path)) == [
        "torchlens.build", "torchlens.errors", "torchlens.records.trace"]


def test_checkers_catch_violations(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    import torch.nn as nn\n    from torchlens_jax import x\n")
    (tmp_path / "b.py").write_text("import torchlens_torch\nimport torchlens_conformance\nimport numpy\n")
    assert sorted(v.split(" imports ")[1] for v in core_violations(tmp_path)) == [
        "torch.nn", "torchlens_conformance", "torchlens_jax", "torchlens_torch"]
    assert [v.split(" imports ")[1] for v in backend_violations(tmp_path, "torchlens_torch")] == ["torchlens_jax"]
