"""One way to iterate ``(x, y)`` batches, whatever the user passes.

Every ``fit`` in the library accepts a ``torch.utils.data.DataLoader`` (any iterable of
``(x, y)`` pairs, or of dict batches as Hugging Face collators make them), or a tuple
``(x, y)`` of tensors, which is split into batches here.

A dict batch ``{"input_ids": x, "labels": y, ...}`` is read with the keys
:data:`INPUT_KEY` / :data:`LABEL_KEY`; wrap the loader in :class:`DictBatches` to choose other
keys. The model is then called on ``batch[input_key]`` (one tensor); a model taking several
named inputs is wrapped so that they arrive stacked in one tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeAlias

import torch
import torch.distributed
from torch import Tensor
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    SequentialSampler,
    TensorDataset,
    default_collate,
)

__all__ = ["INPUT_KEY", "LABEL_KEY", "Batches", "DictBatches", "as_batches", "num_examples"]

INPUT_KEY = "input_ids"
LABEL_KEY = "labels"

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
    if isinstance(data, DictBatches):
        return data
    if _tensor_loader(data):
        return _TensorLoaderBatches(data)  # type: ignore[arg-type]
    return DictBatches(data)


def num_examples(data: Batches) -> int:
    """Number of examples in ``data`` (one pass over it when the size is not known)."""
    if isinstance(data, tuple):
        return int(data[0].shape[0])
    dataset = getattr(data, "dataset", None)
    if dataset is not None and hasattr(dataset, "__len__"):
        return len(dataset)
    return sum(int(x.shape[0]) for x, _ in as_batches(data))


class DictBatches:
    """Iterate ``(x, y)`` pairs over a loader of ``(x, y)`` pairs or of dict batches, taking
    ``x = batch[input_key]`` and ``y = batch[label_key]`` from a dict (other keys are ignored).
    """

    def __init__(
        self, loader: Iterable[Any], input_key: str = INPUT_KEY, label_key: str = LABEL_KEY
    ) -> None:
        self.loader, self.input_key, self.label_key = loader, input_key, label_key
        self.dataset = getattr(loader, "dataset", None)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for batch in self.loader:
            if isinstance(batch, dict):
                missing = [k for k in (self.input_key, self.label_key) if k not in batch]
                if missing:
                    raise KeyError(
                        f"data: a dict batch lacks {missing}; it has {sorted(batch)}. Pass "
                        "DictBatches(loader, input_key=..., label_key=...) to name the keys"
                    )
                x, y = batch[self.input_key], batch[self.label_key]
            else:
                try:
                    x, y = batch
                except (TypeError, ValueError):
                    raise TypeError(
                        "data: expected batches of (x, y) or dicts with input and label keys, "
                        f"got {type(batch).__name__}"
                    ) from None
            _check_pair(x, y)
            yield x, y


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


def _tensor_loader(data: object) -> bool:
    """Whether ``data`` is a plain single-process ``DataLoader`` over a ``TensorDataset`` of
    (x, y) with torch's default collation, no pinned memory and no process group: its
    batches are then x[indices], y[indices] for the index lists of its batch sampler
    (:class:`_TensorLoaderBatches`)."""
    if type(data) is not DataLoader:
        return False
    loader: DataLoader[Any] = data  # type: ignore[assignment]
    dataset = loader.dataset
    return (
        type(dataset) is TensorDataset
        and len(dataset.tensors) == 2
        and loader.num_workers == 0
        and loader.batch_sampler is not None  # batch_size=None: items, not batches
        and loader.collate_fn is default_collate
        and not loader.pin_memory
        and not (torch.distributed.is_available() and torch.distributed.is_initialized())
    )


class _TensorLoaderBatches(DictBatches):
    """The batches of a plain ``DataLoader`` over a ``TensorDataset`` (:func:`_tensor_loader`)
    without its per-sample path: the loader fetches each row as a tuple of 0-or-more-dim
    tensors (two indexing operations per row) and stacks them per batch; here each batch
    is one indexing of each tensor by the batch sampler's indices (one slice for a
    sequential sampler). The same values, dtypes and shapes, in fresh contiguous tensors as
    the loader's, and the same random numbers drawn: the loader's iterator draws its base
    seed from ``loader.generator`` (the global stream when None) once per pass, after
    starting the sampler, and so does this."""

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        loader: DataLoader[Any] = self.loader  # type: ignore[assignment]
        x, y = loader.dataset.tensors  # type: ignore[attr-defined]
        sampler = loader.batch_sampler
        assert sampler is not None
        indices = iter(sampler)
        # the loader iterator's base seed (its worker seeds): one draw per pass, not read
        torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
        sequential = type(sampler) is BatchSampler and type(sampler.sampler) is SequentialSampler
        if sequential:
            n, size = len(sampler.sampler), sampler.batch_size
            stop = n - n % size if sampler.drop_last else n
            for start in range(0, stop, size):
                rows = slice(start, min(start + size, n))
                yield _fresh(x[rows]), _fresh(y[rows])
            return
        for batch in indices:
            idx = torch.as_tensor(batch, dtype=torch.long, device=x.device)
            yield x[idx], y[idx if y.device == x.device else idx.to(y.device)]


def _fresh(t: Tensor) -> Tensor:
    """A contiguous copy of ``t`` (as the loader's ``torch.stack`` makes)."""
    return t.clone(memory_format=torch.contiguous_format)
