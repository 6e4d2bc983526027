"""`tl.stats`: streaming statistics over datasets (constant memory except exact Quantile).

Accumulators fold batches in float64 and merge exactly (`merge(other)`), so a dataset split
over batches, processes or a save/load boundary gives the same statistic; see
docs/guides/datasets.md. Core imports NumPy only; tensors arrive as host copies.
"""

from __future__ import annotations

from typing import Any

from torchlens.stats._base import KINDS, StreamingStat
from torchlens.stats.decomp import CKA, PCA
from torchlens.stats.distances import cosine_distance, relative_l1, relative_l2
from torchlens.stats.moments import RUNNING_SLOTS, Covariance, CrossCovariance, Mean, Norm, RunningStats
from torchlens.stats.order import Histogram, Quantile, TopK, TopKResult, UnitTopK
from torchlens.stats.state import load_fitted, save_fitted


def site_stats(trace: Any) -> Any:
    """{op label: RunningStats} of a `tl.trace(model, x, save="stats")` capture; see
    `torchlens.stats.reduce`."""
    from torchlens.stats.reduce import site_stats as _site_stats

    return _site_stats(trace)


def aggregate(model: Any, dataloader: Any, metrics: Any, loss_fn: Any = None, **kwargs: Any) -> Any:
    """Stream `dataloader` through `model` and fold each metric's site into its accumulator;
    see `torchlens.dataset_extraction.aggregate`."""
    from torchlens.dataset_extraction.aggregate import aggregate as _aggregate

    return _aggregate(model, dataloader, metrics, loss_fn=loss_fn, **kwargs)


__all__ = ["StreamingStat", "Mean", "Norm", "Covariance", "CrossCovariance", "Quantile", "TopK", "UnitTopK", "TopKResult",
           "PCA", "CKA", "Histogram", "RunningStats", "RUNNING_SLOTS", "save_fitted", "load_fitted", "aggregate", "site_stats",
           "cosine_distance", "relative_l1", "relative_l2", "KINDS"]
