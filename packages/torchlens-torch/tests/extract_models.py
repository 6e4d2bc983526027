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
