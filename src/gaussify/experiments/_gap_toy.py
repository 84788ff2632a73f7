"""The 1-D regression toy with a gap of Immer's thesis Ch. 5, as far as the thesis states it.

The thesis (Sec. 5, 5.1) uses "Snelson" with an artificial gap in the inputs: N = 150 training
points, a test set of 1000 further input-output pairs, observations "generated with a noise
variance of 0.09". Snelson's data are not bundled (and have 200 points, so the thesis's 1150
were generated), so this toy keeps what the thesis states and takes the function of the
bundled ``valla_toy``: y = sin(4x) + eps, eps ~ N(0, 0.09);

* training: 150 inputs uniform on [-2, -0.5] U [0.5, 2] (the gap is (-0.5, 0.5));
* test: 1000 inputs uniform on [-2, 2] (the whole range, the gap included: the thesis's test
  pairs come from the problem, the gap is only removed from the training data);
* gap: 200 inputs uniform on (-0.5, 0.5), reported on their own.

All draws come from ``numpy.random.default_rng(seed)``; float64 tensors, targets (N, 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["GAP", "NOISE_VARIANCE", "RANGE", "GapToy", "gap_toy", "truth"]

#: the thesis's generating noise variance (Sec. 5.1: "a similar noise variance of 0.09")
NOISE_VARIANCE = 0.09
#: input range of the data and the gap removed from the training inputs
RANGE = (-2.0, 2.0)
GAP = (-0.5, 0.5)


def truth(x: Tensor) -> Tensor:
    """The noise-free function sin(4x) (the bundled ``valla_toy``'s)."""
    return torch.sin(4.0 * x)


@dataclass(frozen=True)
class GapToy:
    """Training, gap and test draws (``x_val``/``y_val`` hold the gap set)."""

    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor
    x_test: Tensor
    y_test: Tensor
    seed: int


def gap_toy(seed: int = 0, n_train: int = 150, n_test: int = 1000, n_gap: int = 200) -> GapToy:
    """The toy (module docstring) drawn with ``seed``."""
    if min(n_train, n_test, n_gap) < 1:
        raise ValueError(f"n_train, n_test, n_gap: must be >= 1, got {n_train}, {n_test}, {n_gap}")
    rng = np.random.default_rng(seed)
    lo, hi = RANGE
    g0, g1 = GAP
    # training inputs: uniform on the two sides, proportionally to their lengths
    u = rng.uniform(0.0, (g0 - lo) + (hi - g1), size=n_train)
    x_train = np.where(u < g0 - lo, lo + u, g1 + u - (g0 - lo))
    x_test = rng.uniform(lo, hi, size=n_test)
    x_gap = rng.uniform(g0, g1, size=n_gap)
    sd = NOISE_VARIANCE**0.5

    def pair(x: np.ndarray) -> tuple[Tensor, Tensor]:
        xt = torch.as_tensor(np.sort(x), dtype=torch.float64).unsqueeze(-1)
        noise = torch.as_tensor(rng.standard_normal(len(x)), dtype=torch.float64)
        return xt, truth(xt) + sd * noise.unsqueeze(-1)

    (xtr, ytr), (xte, yte), (xg, yg) = pair(x_train), pair(x_test), pair(x_gap)
    return GapToy(xtr, ytr, xg, yg, xte, yte, seed)
