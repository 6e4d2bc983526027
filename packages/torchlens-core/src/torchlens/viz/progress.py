"""Progress bars for long loops: shown only on an interactive terminal, never in a
non-interactive run, and switchable off.

`progress(iterable, total=..., desc=...)` returns the iterable itself unless a bar is due:
`enabled=None` (auto) means "stderr is a TTY, the loop is long enough, tqdm is installed
and neither TORCHLENS_PROGRESS=0 nor CI is set"; True/False force it (True still needs
tqdm). `set_progress(False)` turns bars off for the process.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Iterable

#: Loops shorter than this never get a bar in auto mode.
MIN_TOTAL = 2000

_override: bool | None = None


def set_progress(enabled: bool | None) -> None:
    """Force progress bars on (True), off (False), or back to auto (None)."""
    global _override
    _override = enabled


def progress_enabled(total: int | None = None, enabled: bool | None = None) -> bool:
    """Whether a loop of `total` items would show a bar now."""
    if enabled is None:
        enabled = _override
    if enabled is False:
        return False
    if enabled is None:
        env = os.environ.get("TORCHLENS_PROGRESS", "").strip().lower()
        if env in ("0", "false", "off", "no"):
            return False
        if env not in ("1", "true", "on", "yes"):
            if os.environ.get("CI") or not _interactive():
                return False
            if total is not None and total < MIN_TOTAL:
                return False
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


def _interactive() -> bool:
    stream = sys.stderr
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError):
        return False


def progress(iterable: Iterable[Any], *, total: int | None = None, desc: str = "",
             enabled: bool | None = None) -> Iterable[Any]:
    """Wrap `iterable` in a tqdm bar when one is due, else return it unchanged."""
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    if not progress_enabled(total, enabled):
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True)


def bound(enabled: bool | None):
    """A `progress` with `enabled` fixed, to hand to code that takes a progress callable."""
    def _p(iterable: Iterable[Any], *, total: int | None = None, desc: str = "") -> Iterable[Any]:
        return progress(iterable, total=total, desc=desc, enabled=enabled)

    return _p
