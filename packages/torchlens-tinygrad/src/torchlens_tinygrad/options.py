"""`tl.backends.tinygrad.GradOptions`: the SDK's one `GradOptions` dataclass under this backend's name
(imports no framework; see `torchlens.backends.sdk_grads` and docs/backends/tinygrad.md)."""

from __future__ import annotations

from torchlens.backends.sdk import GradOptions

__all__ = ["GradOptions"]
