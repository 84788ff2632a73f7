"""The loaded data set: train/val/test tensors plus what a user needs to interpret them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["Dataset", "Part", "loaders"]

Part = Literal["train", "val", "test"]
_PARTS = ("train", "val", "test")


@dataclass(frozen=True, eq=False, repr=False)
class Dataset:
    """One split of one data set, as returned by :func:`gaussify.data.load`.

    Shapes: tabular ``x_*`` are (N, d); images are (N, 1, 28, 28) in [0, 1] (or (N, 784) with
    ``flatten=True``) and are never standardised per feature. Classification ``y_*`` are
    int64 (N,) labels in 0..C-1 (names in ``label_names``); regression ``y_*`` are (N, 1),
    matching a network output f (N, 1), and standardised with the training mean ``y_mean``
    and standard deviation ``y_std`` when ``standardized`` (``unstandardize_y`` undoes it:
    a predictive mean maps by ``y_mean + y_std * mu``, a standard deviation by ``y_std * s``).
    ``x_mean`` and ``x_std`` (float64, (d,)) are the training statistics used for the
    features (None for images or ``standardize=False``). ``idx_*`` hold the row numbers
    (into the data set as stored) of each part, in the order of the tensors. ``n`` and ``d``
    describe the whole data set, before any split.
    """

    name: str
    task: Literal["regression", "classification"]
    num_classes: int | None
    n: int
    d: int
    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor
    x_test: Tensor
    y_test: Tensor
    idx_train: Tensor
    idx_val: Tensor
    idx_test: Tensor
    source: str
    licence: str
    split: str
    description: str
    seed: int
    synthetic: bool = False
    standardized: bool = False
    x_mean: Tensor | None = None
    x_std: Tensor | None = None
    y_mean: float | None = None
    y_std: float | None = None
    label_names: tuple[str, ...] | None = None
    input_shape: tuple[int, ...] = ()

    def tensors(self, part: Part = "train") -> tuple[Tensor, Tensor]:
        """``(x, y)`` of ``part`` ("train", "val" or "test")."""
        _check_part(part)
        return getattr(self, f"x_{part}"), getattr(self, f"y_{part}")

    def loader(
        self,
        part: Part = "train",
        batch_size: int = 128,
        shuffle: bool | None = None,
        seed: int = 0,
        drop_last: bool = False,
    ) -> DataLoader:
        """A ``DataLoader`` over ``part``; shuffled (reproducibly, from ``seed``) by default
        for "train" only."""
        x, y = self.tensors(part)
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
            raise ValueError(f"batch_size: must be a positive integer, got {batch_size!r}")
        shuffle = part == "train" if shuffle is None else shuffle
        generator = torch.Generator().manual_seed(seed) if shuffle else None
        return DataLoader(
            TensorDataset(x, y),
            batch_size=batch_size,
            shuffle=shuffle,
            generator=generator,
            drop_last=drop_last,
        )

    def unstandardize_y(self, y: Tensor) -> Tensor:
        """Map standardised regression targets or predictive means back to original units."""
        if self.task != "regression":
            raise ValueError(f"unstandardize_y: {self.name} is a classification data set")
        return y * self.y_std + self.y_mean  # type: ignore[operator]

    @property
    def sizes(self) -> tuple[int, int, int]:
        """Number of rows in (train, val, test)."""
        return len(self.y_train), len(self.y_val), len(self.y_test)

    def __repr__(self) -> str:
        kind = self.task if self.num_classes is None else f"{self.num_classes}-class"
        return (
            f"Dataset({self.name!r}, {kind}, n={self.n}, d={self.d}, "
            f"train/val/test={'/'.join(map(str, self.sizes))}, seed={self.seed})"
        )


def _check_part(part: str) -> None:
    if part not in _PARTS:
        raise ValueError(f"part: expected one of {_PARTS}, got {part!r}")


def loaders(
    dataset: Dataset, batch_size: int = 128, seed: int = 0
) -> tuple[DataLoader, DataLoader, DataLoader]:
    """Train (shuffled from ``seed``), validation and test ``DataLoader``s of ``dataset``."""
    return tuple(dataset.loader(p, batch_size=batch_size, seed=seed) for p in _PARTS)  # type: ignore[return-value]
