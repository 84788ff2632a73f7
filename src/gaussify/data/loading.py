"""``load(name, seed)``: bundled data set -> seeded split -> standardised tensors.

Nothing is downloaded: rows come from files inside the package, from generators, or (for
``fashion_mnist_full``) from files an installed Debian package put on disk.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gaussify.data import raw as raw_files
from gaussify.data.dataset import Dataset
from gaussify.data.raw import CorruptDataError, RawData, read_npz
from gaussify.data.registry import REGISTRY, DatasetSpec, Task
from gaussify.data.splits import (
    check_fractions,
    ordered_split,
    split_pool,
    standardization_stats,
    subsample,
)

__all__ = ["info", "is_available", "list_datasets", "load"]

Parts = tuple[np.ndarray, np.ndarray, np.ndarray]
_TASKS = ("regression", "classification")


def list_datasets(task: Task | None = None, available_only: bool = False) -> list[str]:
    """Sorted names of the bundled data sets, optionally only those of one ``task``
    ("regression" or "classification") and only those loadable on this machine
    (``fashion_mnist_full`` needs a Debian package; every other one is always available)."""
    if task is not None and task not in _TASKS:
        raise ValueError(f"task: expected one of {_TASKS} or None, got {task!r}")
    names = sorted(REGISTRY)
    return [
        name
        for name in names
        if (task is None or REGISTRY[name].task == task)
        and (not available_only or is_available(name))
    ]


def info(name: str) -> DatasetSpec:
    """The registry entry of ``name`` (shape, task, split protocol, source, licence) without
    reading any data. Raises ``ValueError`` naming every available data set if unknown."""
    if not isinstance(name, str) or name not in REGISTRY:
        raise ValueError(
            f"name: unknown data set {name!r}; available: {', '.join(sorted(REGISTRY))}"
        )
    return REGISTRY[name]


def is_available(name: str) -> bool:
    """True if ``name`` can be loaded here (all but ``fashion_mnist_full`` always can)."""
    spec = info(name)
    return spec.installed is None or spec.installed()


def load(
    name: str,
    seed: int = 0,
    *,
    split: Sequence[float] | None = None,
    standardize: bool = True,
    max_train: int | None = None,
    flatten: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Dataset:
    """Load data set ``name`` split by ``seed`` into train/val/test tensors.

    The default split is the protocol of the paper that uses the data set (see
    ``info(name).protocol`` and ``Dataset.split``): UCI regression 0.72/0.18/0.10 at random
    (VBLL App. F), the Immer et al. (2021) Table 1 classification sets 70/15/15 stratified
    (App. B.3), banana 5/5/90 stratified (App. B.2), Fashion-MNIST with its original test set,
    the VaLLA toy with its fixed in-between gap, airline in time order (first 0.75 train, next
    0.125 validation, last 0.125 test: VaLLA Sec. 5.2); otherwise 70/15/15 stratified
    (classification) or 0.72/0.18/0.10 (regression). ``split=(train, val, test)`` overrides
    it with a random split of all rows (stratified for classification), also for data sets
    that have an original test set or fixed parts.

    ``standardize`` maps tabular features, and regression targets, to zero mean and unit
    variance with training-set statistics (constant features become 0); images are only
    scaled to [0, 1]. ``max_train`` keeps at most that many training rows (class-
    proportionally for classification), drawn from ``seed``, before the statistics are
    computed. ``flatten`` turns images (N, 1, 28, 28) into (N, 784). ``dtype`` is the float
    type of x (and of regression y): torch.float32 or torch.float64.
    Same arguments, same tensors; a different ``seed`` gives a different split.
    """
    spec = info(name)
    seed = _check_seed(seed)
    fractions = None if split is None else check_fractions(split, "split")
    _check_flag(standardize, "standardize")
    _check_flag(flatten, "flatten")
    max_train = _check_max_train(max_train)
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype: expected torch.float32 or torch.float64, got {dtype!r}")

    raw = _read(spec, seed)
    labels = raw.y.astype(np.int64) if spec.task == "classification" else None
    rng = np.random.default_rng(seed)
    (train, val, test), description = _choose_parts(spec, raw, labels, fractions, seed, rng)
    if max_train is not None and max_train < len(train):
        train = subsample(train, max_train, labels, rng)
        description += f"; train subsampled to {max_train} rows"

    x = _features(spec, raw, (train, val, test), standardize, flatten, dtype)
    y = _targets(spec, raw, (train, val, test), standardize, dtype)
    return Dataset(
        name=spec.name,
        task=spec.task,
        num_classes=spec.num_classes,
        n=spec.n,
        d=spec.d,
        x_train=x["parts"][0],
        x_val=x["parts"][1],
        x_test=x["parts"][2],
        y_train=y["parts"][0],
        y_val=y["parts"][1],
        y_test=y["parts"][2],
        idx_train=torch.from_numpy(np.asarray(train, dtype=np.int64)),
        idx_val=torch.from_numpy(np.asarray(val, dtype=np.int64)),
        idx_test=torch.from_numpy(np.asarray(test, dtype=np.int64)),
        source=spec.source,
        licence=spec.licence,
        split=description,
        description=spec.description,
        seed=seed,
        synthetic=spec.synthetic,
        standardized=standardize,
        x_mean=x["mean"],
        x_std=x["std"],
        y_mean=y["mean"],
        y_std=y["std"],
        label_names=raw.label_names,
        input_shape=tuple(x["parts"][0].shape[1:]),
    )


# ----------------------------------------------------------------------------- helpers


def _check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed: expected a non-negative integer, got {seed!r}")
    return int(seed)


def _check_flag(value: object, name: str) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}: expected True or False, got {value!r}")


def _check_max_train(max_train: object) -> int | None:
    if max_train is None:
        return None
    if isinstance(max_train, bool) or not isinstance(max_train, (int, np.integer)):
        raise ValueError(f"max_train: expected a positive integer or None, got {max_train!r}")
    if max_train <= 0:
        raise ValueError(f"max_train: expected a positive integer or None, got {max_train!r}")
    return int(max_train)


def _read(spec: DatasetSpec, seed: int) -> RawData:
    """The raw arrays of ``spec``, checked: the file's SHA-256 (in :func:`read_npz`), then
    the shapes against the registry, finite features and targets, and integer labels in
    ``0..num_classes-1``. Anything else raises :class:`CorruptDataError` naming the data set
    and where its rows came from."""
    if spec.file is not None:
        raw = read_npz(spec.file, spec.name)
        where = f"file {raw_files.FILES_DIR / spec.file}"
    elif spec.reader is not None:
        raw = spec.reader(seed if spec.data_seed is None else spec.data_seed)
        where = f"reader {getattr(spec.reader, '__qualname__', spec.reader)!s}"
    else:  # pragma: no cover - guarded by the registry tests
        raise RuntimeError(f"{spec.name}: registry entry has neither a file nor a reader")
    rows = raw.x.shape[0]
    features = int(np.prod(raw.x.shape[1:]))
    if rows != spec.n or features != spec.d or raw.y.shape != (rows,):
        raise CorruptDataError(
            f"{spec.name}: data have x {raw.x.shape}, y {raw.y.shape}; the registry says "
            f"n={spec.n}, d={spec.d} ({where})"
        )
    _check_values(spec, raw, where)
    return raw


def _first_row(bad: np.ndarray) -> int:
    """Index of the first row of ``bad`` (N, ...) with any True entry."""
    return int(np.flatnonzero(bad.reshape(bad.shape[0], -1).any(axis=1))[0])


def _check_values(spec: DatasetSpec, raw: RawData, where: str) -> None:
    """Raise :class:`CorruptDataError` at the first non-finite feature or target, or label
    that is not an integer in ``0..num_classes-1``."""

    def fail(what: str) -> None:
        raise CorruptDataError(f"{spec.name}: {what} ({where}); {raw_files.REBUILD_HINT}")

    for label, a in (("x", raw.x), ("y", raw.y)):
        if np.issubdtype(a.dtype, np.inexact) and not np.isfinite(a).all():
            row = _first_row(~np.isfinite(a))
            kind = "NaN" if np.isnan(a[row]).any() else "Inf"
            fail(f"{label}: row {row} contains {kind}")
        elif not np.issubdtype(a.dtype, np.number) and not np.issubdtype(a.dtype, np.bool_):
            fail(f"{label}: expected numbers, got dtype {a.dtype}")
    if spec.task != "classification" or len(raw.y) == 0:
        return
    classes = int(spec.num_classes or 0)
    y = raw.y
    bad = (y != np.round(y)) | (y < 0) | (y >= classes)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        fail(
            f"y: row {row} has label {y[row].item()!r}, expected an integer in "
            f"0..{classes - 1} (num_classes={classes})"
        )


def _choose_parts(
    spec: DatasetSpec,
    raw: RawData,
    labels: np.ndarray | None,
    fractions: tuple[float, float, float] | None,
    seed: int,
    rng: np.random.Generator,
) -> tuple[Parts, str]:
    protocol = spec.protocol
    every_row = np.arange(spec.n)
    if fractions is not None:
        how = "stratified" if labels is not None else "random"
        text = f"{how} {_fmt(fractions)} of all {spec.n} rows (seed {seed}; split= given)"
        return split_pool(every_row, labels, fractions, rng), text
    ref = f"; {protocol.reference}" if protocol.reference else ""
    if protocol.kind == "random":
        strat = labels if protocol.stratify else None
        how = "stratified" if strat is not None else "random"
        text = f"{how} {_fmt(protocol.fractions)} of all {spec.n} rows (seed {seed}{ref})"
        return split_pool(every_row, strat, protocol.fractions, rng), text
    if protocol.kind == "original_test":
        assert raw.is_test is not None, f"{spec.name}: original_test needs is_test"
        pool = np.flatnonzero(~raw.is_test)
        test = np.flatnonzero(raw.is_test)
        strat = labels if protocol.stratify else None
        train, val, _ = split_pool(pool, strat, protocol.fractions, rng)
        text = (
            f"original test set ({len(test)} rows); the {len(pool)} training rows split "
            f"{protocol.fractions[0]:.4g}/{protocol.fractions[1]:.4g} train/val "
            f"{'stratified ' if strat is not None else ''}(seed {seed}{ref})"
        )
        return (train, val, test), text
    if protocol.kind == "ordered":
        parts = ordered_split(spec.n, protocol.fractions)
        sizes = "/".join(str(len(p)) for p in parts)
        text = (
            f"in row (time) order: the first {_fmt(protocol.fractions)} of all {spec.n} rows "
            f"train/val/test ({sizes} rows; seed {seed} does not move it{ref})"
        )
        return parts, text
    assert raw.fixed_parts is not None, f"{spec.name}: fixed split needs fixed_parts"
    return raw.fixed_parts, f"fixed parts (seed {seed} only draws the data{ref})"


def _fmt(fractions: tuple[float, float, float]) -> str:
    return "/".join(f"{f:.4g}" for f in fractions)


def _features(
    spec: DatasetSpec,
    raw: RawData,
    parts: Parts,
    standardize: bool,
    flatten: bool,
    dtype: torch.dtype,
) -> dict:
    if spec.image_shape is not None:
        shape = (-1, spec.d) if flatten else (-1, *spec.image_shape)
        scaled = [
            torch.from_numpy(raw.x[idx]).to(dtype).div_(255.0).reshape(shape) for idx in parts
        ]
        return {"parts": scaled, "mean": None, "std": None}
    xs = [np.asarray(raw.x[idx], dtype=np.float64) for idx in parts]
    mean = std = None
    if standardize:
        mean, std = standardization_stats(xs[0])
        xs = [(x - mean) / std for x in xs]
        mean, std = torch.from_numpy(mean), torch.from_numpy(std)  # float64, for exactness
    return {"parts": [torch.from_numpy(x).to(dtype) for x in xs], "mean": mean, "std": std}


def _targets(
    spec: DatasetSpec, raw: RawData, parts: Parts, standardize: bool, dtype: torch.dtype
) -> dict:
    if spec.task == "classification":
        ys = [torch.from_numpy(raw.y[idx].astype(np.int64)) for idx in parts]
        return {"parts": ys, "mean": None, "std": None}
    ys = [np.asarray(raw.y[idx], dtype=np.float64) for idx in parts]
    mean, std = 0.0, 1.0
    if standardize:
        mean, std = float(ys[0].mean()), float(ys[0].std()) or 1.0
        ys = [(y - mean) / std for y in ys]
    return {
        "parts": [torch.from_numpy(y).to(dtype).reshape(-1, 1) for y in ys],
        "mean": mean,
        "std": std,
    }
