"""Tiny models and data shared by the extraction tests and their subprocess scripts."""

from __future__ import annotations

import time

import torch
from torch import nn


class TokenNet(nn.Module):
    """Embedding -> Linear -> ReLU -> Linear over [batch, tokens] ids; `delay` slows each
    forward so a test can kill a run between shards."""

    def __init__(self, vocab: int = 40, width: int = 8, delay: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.fc1 = nn.Linear(width, 12)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(12, 5)
        self.delay = delay

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return self.fc2(self.act(self.fc1(self.emb(ids))))


def token_model(seed: int = 0, delay: float = 0.0) -> TokenNet:
    torch.manual_seed(seed)
    return TokenNet(delay=delay).eval()


def token_data(n: int = 70, t: int = 6, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 40, (n, t), generator=g)


def hooked(model: nn.Module, x: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """Module outputs by forward hooks: the independent oracle."""
    got: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(n).register_forward_hook(lambda m, i, o, n=n: got.__setitem__(n, o.detach().clone()))
               for n in names]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return got


class MaskedTokenNet(TokenNet):
    """TokenNet that takes an attention_mask (zeroes padded embeddings), for ragged='trim'."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        h = self.emb(input_ids) * attention_mask[..., None].to(torch.float32)
        return self.fc2(self.act(self.fc1(h)))


def ragged_data(n: int = 10, t: int = 7, seed: int = 2) -> dict[str, torch.Tensor]:
    """Right-padded token ids with 1..t real tokens per row (pad id 0, mask 0 on padding)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(torch.int64)
    ids = torch.randint(1, 40, (n, t), generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask}


class LoopNet(TokenNet):
    """fc1 runs once per row of the batch (drift: a short batch fires at fewer passes), and not
    at all for a batch of fewer than `skip_below` rows (no fire)."""

    def __init__(self, skip_below: int = 0, per_row: bool = False) -> None:
        super().__init__()
        self.skip_below, self.per_row = skip_below, per_row

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        if ids.shape[0] >= self.skip_below:
            for _ in range(ids.shape[0] if self.per_row else 1):
                h = self.fc1(h)[..., :8]
        return h
