"""Typed errors: one registry, a generated reference page that stays current."""

from pathlib import Path

import pytest

import torchlens.backends  # noqa: F401  (registers the refusal codes)
from torchlens import errors

DOC = Path(__file__).resolve().parents[3] / "docs" / "reference" / "error-codes.md"


def test_error_code_page_is_generated_from_the_registry():
    assert DOC.read_text() == errors.render_error_codes_markdown(), (
        "docs/reference/error-codes.md is stale: run "
        "`.venv/bin/python -m torchlens.errors > docs/reference/error-codes.md`")


def test_every_registered_class_exists():
    for code, (cls_name, meaning) in errors.ERROR_CODES.items():
        assert issubclass(getattr(errors, cls_name), errors.TorchLensError), code
        assert meaning


def test_unregistered_code_cannot_be_raised():
    with pytest.raises(RuntimeError):
        errors.InvalidArgumentError("no_such_code_anywhere")


def test_error_carries_code_fields_remedy():
    e = errors.InvalidArgumentError("invalid_argument", "bad x", remedy="pass y", x=1)
    assert (e.code, e.fields, e.remedy) == ("invalid_argument", {"x": 1}, "pass y")
    assert "[invalid_argument]" in str(e) and "remedy: pass y" in str(e)
    assert isinstance(errors.LookupMissError("label_unknown"), KeyError)


def _raise_site_codes():
    """(file, line, code) for every `XxxError("code", ...)` call in the packages' sources,
    found by parsing them (every TorchLensError subclass takes its code first)."""
    import ast

    root = Path(__file__).resolve().parents[3]
    classes = {name for name in dir(errors) if isinstance(getattr(errors, name), type)
               and issubclass(getattr(errors, name), errors.TorchLensError)}
    out = []
    sources = [p for base in ("packages", "conformance") for p in (root / base).rglob("*.py")
               if "/tests/" not in p.as_posix() and "/build/lib" not in p.as_posix()]
    for path in sources:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
            first = node.args[0]
            if name in classes and isinstance(first, ast.Constant) and isinstance(first.value, str):
                out.append((path.relative_to(root).as_posix(), node.lineno, first.value))
    return out


def test_every_raise_site_uses_a_registered_code():
    errors.load_all_codes()
    import torchlens.backends.codes  # noqa: F401

    sites = _raise_site_codes()
    assert len(sites) > 200  # the scan sees the raise sites (guards against a scan that finds nothing)
    unregistered = [f"{f}:{line}: {code}" for f, line, code in sites if code not in errors.ERROR_CODES]
    assert not unregistered, "raise sites with unregistered codes:\n" + "\n".join(unregistered)
