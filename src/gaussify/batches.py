"""One way to iterate ``(x, y)`` batches, whatever the user passes.

Every ``fit`` in the library accepts a ``torch.utils.data.DataLoader`` (any iterable of
``(x, y)`` pairs), or a tuple ``(x, y)`` of tensors, which is split into batches here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeAlias

import torch
from torch import Tensor

__all__ = ["Batches", "as_batches", "num_examples"]

Batches: TypeAlias = "Iterable[tuple[Tensor, Tensor]] | tuple[Tensor, Tensor]"


def _check_pair(x: Any, y: Any) -> None:
    if not isinstance(x, Tensor) or not isinstance(y, Tensor):
        raise TypeError("data: expected (x, y) tensors or a DataLoader yielding (x, y) batches")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"data: x has {x.shape[0]} rows but y has {y.shape[0]}")


def as_batches(
    data: Batches,
    batch_size: int = 256,
    shuffle: bool = False,
    generator: torch.Generator | None = None,
) -> Iterable[tuple[Tensor, Tensor]]:
    """Return an iterable of ``(x, y)`` batches over ``data`` (re-iterable, one pass per call)."""
    if isinstance(data, tuple):
        if len(data) != 2:
            raise ValueError(f"data: expected a pair (x, y), got a tuple of length {len(data)}")
        x, y = data
        _check_pair(x, y)
        if batch_size <= 0:
            raise ValueError(f"batch_size: must be a positive integer, got {batch_size}")
        return _TensorBatches(x, y, batch_size, shuffle, generator)
    if not isinstance(data, Iterable):
        raise TypeError(
            f"data: expected a DataLoader or an (x, y) tuple, got {type(data).__name__}"
        )
    return data


def num_examples(data: Batches) -> int:
    """Number of examples in ``data`` (one pass over it when the size is not known)."""
    if isinstance(data, tuple):
        return int(data[0].shape[0])
    dataset = getattr(data, "dataset", None)
    if dataset is not None and hasattr(dataset, "__len__"):
        return len(dataset)
    return sum(int(x.shape[0]) for x, _ in as_batches(data))


class _TensorBatches:
    def __init__(
        self,
        x: Tensor,
        y: Tensor,
        batch_size: int,
        shuffle: bool,
        generator: torch.Generator | None,
    ) -> None:
        self.x, self.y = x, y
        self.batch_size, self.shuffle, self.generator = batch_size, shuffle, generator

    def __len__(self) -> int:
        return -(-self.x.shape[0] // self.batch_size)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        n = self.x.shape[0]
        order = torch.randperm(n, generator=self.generator) if self.shuffle else torch.arange(n)
        for start in range(0, n, self.batch_size):
            idx = order[start : start + self.batch_size]
            yield self.x[idx], self.y[idx]
