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
