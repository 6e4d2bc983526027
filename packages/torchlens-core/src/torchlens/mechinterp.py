"""`tl.mechinterp`: re-exports `torchlens_mechinterp` when it is installed."""

from __future__ import annotations

from typing import Any

from torchlens.errors import BackendUnsupportedError


def __getattr__(name: str) -> Any:
    try:
        import torchlens_mechinterp  # type: ignore[import-not-found]
    except ImportError:
        from torchlens.backends.registry import install_hint

        raise BackendUnsupportedError("runtime_missing", "the mechinterp kit is not installed",
                                      remedy=install_hint("mechinterp"), extra="mechinterp") from None
    return getattr(torchlens_mechinterp, name)
