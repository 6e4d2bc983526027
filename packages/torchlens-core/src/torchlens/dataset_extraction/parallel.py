"""Data-parallel groups: how extraction and aggregation learn their rank, world size and how
to exchange bytes, without core importing a framework.

A group is any object with `rank`, `world_size`, `all_gather_bytes(data) -> list[bytes]` (one
entry per rank, in rank order) and `barrier()`. `torchlens_torch.distributed_data.TorchDistributedGroup`
is one on `torch.distributed` (gloo or NCCL); the torch plugin registers a lazy provider when
it loads (it imports `torchlens_torch.distributed_data` only once `torch.distributed` is in
use), so `distributed=None` picks the initialised default group up on its own. Work is split by batch index
(`batch % world_size == rank`), so every row is handled exactly once.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

from torchlens.errors import InvalidArgumentError


@runtime_checkable
class DataParallelGroup(Protocol):
    rank: int
    world_size: int

    def all_gather_bytes(self, data: bytes) -> list[bytes]: ...
    def barrier(self) -> None: ...


class LocalGroup:
    """The one-process group: rank 0 of 1."""

    rank = 0
    world_size = 1

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        return [data]

    def barrier(self) -> None:
        return None


#: callables returning an initialised group, or None when theirs is not initialised
_PROVIDERS: list[Callable[[], Any]] = []


def register_group_provider(provider: Callable[[], Any]) -> None:
    """Let `distributed=None/True` find a framework's initialised process group."""
    if provider not in _PROVIDERS:
        _PROVIDERS.append(provider)


def _provided() -> Any:
    from torchlens.backends.registry import specs

    specs()  # loads the plugins once: a backend's plugin registers its framework's provider when it loads
    for provider in _PROVIDERS:
        group = provider()
        if group is not None:
            return group
    return None


def resolve_group(distributed: Any) -> Any:
    """The group a run uses: `None` an initialised provider's group, else one process;
    `True` an initialised group or `distributed_unavailable`; `False` one process; a group object itself."""
    if distributed is None:
        return _provided() or LocalGroup()
    if distributed is False:
        return LocalGroup()
    if distributed is True:
        group = _provided()
        if group is None:
            raise InvalidArgumentError("distributed_unavailable", "distributed=True but no data-parallel group is initialised",
                                       remedy="launch with torchrun and call torch.distributed.init_process_group() "
                                              "before the run (the framework's backend plugin finds the group)")
        return group
    if isinstance(distributed, DataParallelGroup) and isinstance(distributed.rank, int) \
            and isinstance(distributed.world_size, int) and 0 <= distributed.rank < distributed.world_size:
        return distributed
    raise InvalidArgumentError("distributed_group_invalid", f"distributed={distributed!r} is not a data-parallel group",
                               remedy="distributed=None (auto), True, False, or a group with rank, world_size, "
                                      "all_gather_bytes and barrier")
