"""A data-parallel group on `torch.distributed` for `tl.extract_dataset` and `tl.stats.aggregate`.

`TorchDistributedGroup` gives core what it asks of a group (rank, world size, an all-gather
of bytes, a barrier) on the default process group; bytes travel as uint8 tensors (gloo on
CPU, NCCL on the current CUDA device), never pickled. Importing this module registers a
provider, so once `torch.distributed.init_process_group()` has run, `distributed=None`
(the default) shards the work by rank with no further argument.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import torchlens as tl


class TorchDistributedGroup:
    """The default (or a given) `torch.distributed` process group as a data-parallel group."""

    def __init__(self, group: Any = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialised; call torch.distributed.init_process_group() first")
        self._group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        backend = dist.get_backend(group)
        self._device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        n = torch.tensor([len(data)], dtype=torch.int64, device=self._device)
        sizes = [torch.zeros_like(n) for _ in range(self.world_size)]
        dist.all_gather(sizes, n, group=self._group)
        longest = max(int(s.item()) for s in sizes)
        buf = torch.zeros(max(longest, 1), dtype=torch.uint8, device=self._device)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self._device)
        out = [torch.empty_like(buf) for _ in range(self.world_size)]
        dist.all_gather(out, buf, group=self._group)
        return [bytes(o[: int(s.item())].cpu().numpy().tobytes()) for o, s in zip(out, sizes)]

    def barrier(self) -> None:
        dist.barrier(group=self._group)

    def __repr__(self) -> str:
        return f"TorchDistributedGroup(rank={self.rank}, world_size={self.world_size})"


def default_group() -> TorchDistributedGroup | None:
    """The initialised default group, or None (the provider core asks)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchDistributedGroup()
    return None


tl.dataset_extraction.register_group_provider(default_group)
