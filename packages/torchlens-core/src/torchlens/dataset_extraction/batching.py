"""Cutting a dataset into batches without a framework: slices of an array-like (a tensor or
NumPy array), of a tuple of them (positional inputs) or a dict of them (keyword inputs);
`collate=` over a sequence of examples; or, with `batch_size=None`, an iterable whose items
already are batches. Every batch knows its global index and row range."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from torchlens.errors import InvalidArgumentError


@dataclass
class Batch:
    index: int
    start: int
    stop: int
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


def _bad(why: str) -> InvalidArgumentError:
    return InvalidArgumentError("extraction_dataset_invalid", why,
                                remedy="pass an array/tensor (or a tuple/dict of them) with batch_size=, a sequence of "
                                       "examples with collate=, or an iterable of ready batches with batch_size=None")


def _split(item: Any) -> tuple[tuple, dict]:
    if isinstance(item, (tuple, list)):  # a DataLoader collates a tuple sample into a list
        return tuple(item), {}
    if isinstance(item, dict):
        return (), dict(item)
    return (item,), {}


def _len(v: Any) -> int:
    try:
        return len(v)
    except TypeError:
        raise _bad(f"a batch input of type {type(v).__name__} has no length (rows)") from None


def _rows(args: tuple, kwargs: dict) -> int:
    first = args[0] if args else next(iter(kwargs.values()), None)
    if first is None:
        raise _bad("a batch has no inputs")
    return _len(first)


def _array_like(v: Any) -> bool:
    return hasattr(v, "shape") and hasattr(v, "__getitem__") and len(getattr(v, "shape", ())) >= 1


def num_rows(dataset: Any, batch_size: int | None, collate: Any) -> int | None:
    """Rows in the dataset when that is known without iterating it."""
    if batch_size is None:
        return None
    if collate is not None:
        return _len(dataset)
    if isinstance(dataset, dict):
        return _len(next(iter(dataset.values())))
    if isinstance(dataset, tuple):
        return _len(dataset[0])
    return _len(dataset)


def check(dataset: Any, batch_size: int | None, collate: Callable | None) -> None:
    """Refuse an unusable dataset/batch_size pair before anything runs."""
    if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1):
        raise _bad(f"batch_size={batch_size!r} is not a positive int")
    if collate is not None and not callable(collate):
        raise _bad("collate= is not callable")
    if batch_size is None:
        try:
            iter(dataset)
        except TypeError:
            raise _bad(f"a {type(dataset).__name__} is not iterable") from None
        return
    if collate is not None:
        _len(dataset)
        return
    parts = list(dataset.values()) if isinstance(dataset, dict) else list(dataset) if isinstance(dataset, tuple) else [dataset]
    if not parts or not all(_array_like(p) for p in parts):
        raise _bad(f"a {type(dataset).__name__} cannot be sliced into batches")
    if len({_len(p) for p in parts}) != 1:
        raise _bad("the dataset's inputs have different row counts")


def iter_batches(dataset: Any, batch_size: int | None, collate: Callable | None = None) -> Iterator[Batch]:
    if batch_size is None:
        start = 0
        for i, item in enumerate(dataset):
            args, kwargs = _split(item)
            n = _rows(args, kwargs)
            yield Batch(i, start, start + n, args, kwargs)
            start += n
        return
    n = num_rows(dataset, batch_size, collate)
    for i, s in enumerate(range(0, n, batch_size)):
        e = min(s + batch_size, n)
        if collate is not None:
            args, kwargs = _split(collate([dataset[j] for j in range(s, e)]))
        elif isinstance(dataset, dict):
            args, kwargs = (), {k: v[s:e] for k, v in dataset.items()}
        elif isinstance(dataset, tuple):
            args, kwargs = tuple(v[s:e] for v in dataset), {}
        else:
            args, kwargs = (dataset[s:e],), {}
        yield Batch(i, s, e, args, kwargs)
