"""`tl.export`: static export helpers (experimental)."""

from __future__ import annotations

from typing import Any


def safetensors(trace: Any, path: Any, overwrite: bool = False) -> Any:
    """Write `trace` as one pickle-free `.safetensors` file (header schema
    `tl_trace_safetensors_v1`); read it back with `tl.io.read_safetensors(path)`."""
    from torchlens.io.trace_safetensors import write_safetensors

    return write_safetensors(trace, path, overwrite=overwrite)


__all__ = ["safetensors"]
