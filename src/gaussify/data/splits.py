"""Seeded train/validation/test splits, subsampling and standardisation (pure numpy).

Sizes are exact and reproducible: a part of fraction ``f`` of ``n`` rows gets ``round(f n)``
rows (train takes what is left), and a stratified split apportions each part across the
classes by the largest-remainder method, so every class's share of every part is within one
row of proportional. The same seed always gives the same rows; different seeds give
different rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "apportion",
    "check_fractions",
    "ordered_split",
    "random_split",
    "split_pool",
    "standardization_stats",
    "stratified_split",
    "subsample",
]

Parts = tuple[np.ndarray, np.ndarray, np.ndarray]


def check_fractions(split: object, name: str = "split") -> tuple[float, float, float]:
    """Validate ``split`` = (train, val, test) fractions: three finite numbers, train > 0,
    val and test >= 0, summing to 1 (to 1e-6). Raises ``ValueError`` naming ``name``."""
    if isinstance(split, (str, bytes)) or not isinstance(split, Sequence) or len(split) != 3:
        raise ValueError(f"{name}: expected three fractions (train, val, test), got {split!r}")
    try:
        fracs = tuple(float(f) for f in split)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: fractions must be numbers, got {split!r}") from None
    if not all(math.isfinite(f) for f in fracs):
        raise ValueError(f"{name}: fractions must be finite, got {split!r}")
    train, val, test = fracs
    if train <= 0 or val < 0 or test < 0:
        raise ValueError(f"{name}: need train > 0 and val, test >= 0, got {split!r}")
    if abs(train + val + test - 1.0) > 1e-6:
        raise ValueError(f"{name}: fractions must sum to 1, got {split!r} (sum {sum(fracs):g})")
    return fracs  # type: ignore[return-value]


def apportion(weights: np.ndarray, total: int, cap: np.ndarray | None = None) -> np.ndarray:
    """Split ``total`` items across groups proportionally to ``weights`` (largest remainder,
    ties to the lower index), giving no group more than its ``cap`` (default: its weight)."""
    weights = np.asarray(weights, dtype=np.int64)
    cap = weights if cap is None else np.asarray(cap, dtype=np.int64)
    if not 0 <= total <= cap.sum():
        raise ValueError(f"cannot take {total} items from groups of sizes {cap.tolist()}")
    quotas = weights * (total / max(int(weights.sum()), 1))
    alloc = np.minimum(np.floor(quotas).astype(np.int64), cap)
    while alloc.sum() < total:
        remainders = np.where(alloc < cap, quotas - alloc, -np.inf)
        alloc[int(np.argmax(remainders))] += 1
    return alloc


def _sizes(n: int, fractions: tuple[float, float, float]) -> tuple[int, int, int]:
    n_val = round(fractions[1] * n)
    n_test = round(fractions[2] * n)
    return n - n_val - n_test, n_val, n_test


def random_split(n: int, fractions: tuple[float, float, float], rng: np.random.Generator) -> Parts:
    """Random (train, val, test) row indices of ``range(n)``, each part in random order."""
    _, n_val, n_test = _sizes(n, fractions)
    perm = rng.permutation(n)
    return perm[n_test + n_val :], perm[n_test : n_test + n_val], perm[:n_test]


def ordered_split(n: int, fractions: tuple[float, float, float]) -> Parts:
    """(train, val, test) row indices of ``range(n)`` as contiguous blocks in row order: train
    the first rows, val the next, test the last (sizes as :func:`random_split`'s)."""
    n_train, n_val, _ = _sizes(n, fractions)
    rows = np.arange(n)
    return rows[:n_train], rows[n_train : n_train + n_val], rows[n_train + n_val :]


def stratified_split(
    labels: np.ndarray, fractions: tuple[float, float, float], rng: np.random.Generator
) -> Parts:
    """Like :func:`random_split`, with every class split in the same proportions.

    The val and test sizes are those of the unstratified split; each is apportioned across
    classes by :func:`apportion`, and train takes the rest of every class.
    """
    labels = np.asarray(labels)
    classes, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    _, n_val, n_test = _sizes(len(labels), fractions)
    test_c = apportion(counts, n_test)
    val_c = apportion(counts, n_val, cap=counts - test_c)
    parts: list[list[np.ndarray]] = [[], [], []]
    for c in range(len(classes)):
        members = rng.permutation(np.flatnonzero(inverse == c))
        parts[2].append(members[: test_c[c]])
        parts[1].append(members[test_c[c] : test_c[c] + val_c[c]])
        parts[0].append(members[test_c[c] + val_c[c] :])
    train, val, test = (rng.permutation(np.concatenate(p)) for p in parts)
    return train, val, test


def split_pool(
    pool: np.ndarray,
    labels: np.ndarray | None,
    fractions: tuple[float, float, float],
    rng: np.random.Generator,
) -> Parts:
    """Split the rows ``pool`` (indices into the data set), stratified when ``labels`` (one
    per row of the whole data set) is given; returns indices into the data set."""
    if labels is None:
        parts = random_split(len(pool), fractions, rng)
    else:
        parts = stratified_split(labels[pool], fractions, rng)
    return pool[parts[0]], pool[parts[1]], pool[parts[2]]


def subsample(
    idx: np.ndarray, size: int, labels: np.ndarray | None, rng: np.random.Generator
) -> np.ndarray:
    """Keep ``size`` of the rows ``idx`` at random (class-proportionally when ``labels``, one
    per row of the whole data set, is given); all of them if ``size >= len(idx)``."""
    if size >= len(idx):
        return idx
    if labels is None:
        return idx[rng.permutation(len(idx))[:size]]
    sub = labels[idx]
    classes, inverse, counts = np.unique(sub, return_inverse=True, return_counts=True)
    take = apportion(counts, size)
    kept = [rng.permutation(np.flatnonzero(inverse == c))[: take[c]] for c in range(len(classes))]
    return idx[rng.permutation(np.concatenate(kept))]


def standardization_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-column mean and standard deviation (ddof 0, float64) of ``x`` (N, d); a column
    that is constant gets std 1, so standardising maps it to 0 instead of NaN."""
    x = np.asarray(x, dtype=np.float64)
    mean = x.mean(axis=0)
    std = x.std(axis=0)
    std[std == 0] = 1.0
    return mean, std
