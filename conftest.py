"""Repository-wide pytest configuration: docs examples are tests.

Every ```python block in README.md and docs/ runs as a test, each in a fresh namespace and a
fresh temporary working directory. A block whose first line is `# docs-test: expected=<literal>`
must also leave a `RESULT` variable equal to the literal; any other block must simply run
without raising. A block that needs a framework (or a backend package) that is not installed
is skipped, not failed.
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


def _load_paddle_before_tensorflow() -> None:
    """paddlepaddle 3.3's native core crashes the process (SIGSEGV) when it is loaded after
    tensorflow 2.21's; loaded first, both work. The suite imports both in one process, so
    when both are installed paddle is loaded here, before any test can load tensorflow.
    (The paddle backend refuses typed, `runtime_conflict`, instead of crashing a user's
    process; see docs/backends/paddle.md.)"""
    import importlib.util

    if importlib.util.find_spec("paddle") and importlib.util.find_spec("tensorflow"):
        import sys

        if "tensorflow" not in sys.modules:
            import warnings

            with warnings.catch_warnings():  # paddle's "No ccache found" notice at import
                warnings.filterwarnings("ignore", message=".*ccache.*")
                import paddle  # noqa: F401


_load_paddle_before_tensorflow()


#: TorchLens refusal codes that mean "the backend this block needs is not installed here".
_MISSING_BACKEND_CODES = {"runtime_missing"}


def docs_blocks(path: Path) -> list[tuple[int, str | None, str]]:
    """(line number, expected literal or None, code) for each ```python block in a Markdown
    file; the literal is None for a block without a `# docs-test: expected=` first line."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in _BLOCK.finditer(text):
        code = m.group(1)
        first = code.split("\n", 1)[0].strip()
        mark = _MARK.match(first)
        line = text.count("\n", 0, m.start()) + 2
        out.append((line, mark.group(1).strip() if mark else None, code))
    return out


class DocsFile(pytest.File):
    def collect(self):
        for line, expected, code in docs_blocks(Path(self.path)):
            yield DocsItem.from_parent(self, name=f"line{line}", expected=expected, code=code, line=line)


class DocsItem(pytest.Item):
    def __init__(self, *, expected: str | None, code: str, line: int, **kw):
        super().__init__(**kw)
        self.expected = expected
        self.code = code
        self.line = line

    def runtest(self):
        expected = None if self.expected is None else ast.literal_eval(self.expected)
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
        except Exception as exc:
            if getattr(exc, "code", None) in _MISSING_BACKEND_CODES:
                pytest.skip(f"needs a backend that is not installed here: {exc}")
            raise
        finally:
            os.chdir(cwd)
        if self.expected is None:
            return  # an unmarked block only has to run
        if "RESULT" not in ns:
            raise AssertionError(f"{self.path}:{self.line}: the block sets no RESULT")
        got = ns["RESULT"]
        if got != expected:
            raise AssertionError(f"{self.path}:{self.line}: RESULT is {got!r}, expected {expected!r}")

    def reportinfo(self):
        return self.path, self.line - 1, f"docs example {self.path.name}:{self.line}"


def _is_docs_page(parent, file_path: Path) -> bool:
    """A Markdown page under docs/, or the repository's README.md."""
    if file_path.suffix != ".md":
        return False
    if file_path.name == "README.md" and file_path.parent == Path(parent.config.rootpath):
        return True
    return "docs" in file_path.parts


def pytest_collect_file(parent, file_path: Path):
    if _is_docs_page(parent, file_path) and docs_blocks(file_path):
        return DocsFile.from_parent(parent, path=file_path)
    return None
