"""Repository-wide pytest configuration: docs examples are tests.

Every ```python block in docs/ whose first line is `# docs-test: expected=<literal>` runs as
a test; after it runs, its `RESULT` variable must equal the literal. A block that needs a
framework that is not installed is skipped, not failed.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

_BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
_MARK = re.compile(r"^#\s*docs-test:\s*expected=(.*)$")
_FRAMEWORKS = {"torch", "jax", "jaxlib", "flax", "equinox", "tensorflow", "paddle", "mlx", "tinygrad", "transformers",
               "torchlens_torch", "torchlens_jax", "torchlens_mlx", "torchlens_tf", "torchlens_paddle",
               "torchlens_tinygrad", "torchlens_reference", "graphviz", "pandas"}


def docs_blocks(path: Path) -> list[tuple[int, str, str]]:
    """(line number, expected literal, code) for each docs-test block in a Markdown file."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in _BLOCK.finditer(text):
        code = m.group(1)
        first = code.split("\n", 1)[0].strip()
        mark = _MARK.match(first)
        if mark:
            line = text.count("\n", 0, m.start()) + 2
            out.append((line, mark.group(1).strip(), code))
    return out


class DocsFile(pytest.File):
    def collect(self):
        for line, expected, code in docs_blocks(Path(self.path)):
            yield DocsItem.from_parent(self, name=f"line{line}", expected=expected, code=code, line=line)


class DocsItem(pytest.Item):
    def __init__(self, *, expected: str, code: str, line: int, **kw):
        super().__init__(**kw)
        self.expected = expected
        self.code = code
        self.line = line

    def runtest(self):
        expected = ast.literal_eval(self.expected)
        ns: dict = {"__name__": "__docs_test__"}
        cwd = os.getcwd()
        tmp = self.config._tmp_path_factory.mktemp("docs") if hasattr(self.config, "_tmp_path_factory") else None
        if tmp is not None:
            os.chdir(tmp)
        try:
            exec(compile(self.code, f"{self.path}:{self.line}", "exec"), ns)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] in _FRAMEWORKS:
                pytest.skip(f"needs {exc.name}")
            raise
        finally:
            os.chdir(cwd)
        if "RESULT" not in ns:
            raise AssertionError(f"{self.path}:{self.line}: the block sets no RESULT")
        got = ns["RESULT"]
        if got != expected:
            raise AssertionError(f"{self.path}:{self.line}: RESULT is {got!r}, expected {expected!r}")

    def reportinfo(self):
        return self.path, self.line - 1, f"docs example {self.path.name}:{self.line}"


def pytest_collect_file(parent, file_path: Path):
    if file_path.suffix == ".md" and "docs" in file_path.parts and docs_blocks(file_path):
        return DocsFile.from_parent(parent, path=file_path)
    return None
