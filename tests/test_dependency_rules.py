"""Arrows point down only: core imports no framework and no backend; backends never import
each other; the backends written on the SDK import nothing from core but `torchlens` and
`torchlens.backends.sdk`. Checked on the source (every import statement, including ones
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


#: Backends that import core only through `torchlens.backends.sdk` (issue 14). Torch joins when
#: the next round moves it; a new backend starts here.
SDK_ONLY_BACKENDS = ("torchlens_jax", "torchlens_reference")
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
