"""Training with Gaussian likelihood approximations (Bui, eq. 3).

``GaussianApproxLoss`` replaces ``nn.CrossEntropyLoss`` (log basis) or
``nn.BCEWithLogitsLoss`` (logit basis): the per-example loss is
``-sum_k log N(f_k; m_k(y), v_k(y))``, a weighted least-squares loss on the logits with the
pseudo-targets of :mod:`gaussify.approx_likelihoods.pseudo_targets`. Predictions go through
the basis' inverse transform of the predicted logits (softmax or sigmoid, Sec. 3.2-3.3).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from gaussify.approx_likelihoods.pseudo_targets import (
    Basis,
    BetaGaussian,
    DirichletGaussian,
    Method,
    Scalar,
    pseudo_likelihood,
)

__all__ = ["GaussianApproxLoss", "gaussian_pseudo_nll"]

Reduction = Literal["mean", "sum", "none"]


def gaussian_pseudo_nll(f: Tensor, mean: Tensor, var: Tensor) -> Tensor:
    """``-sum_k log N(f_k; mean_k, var_k)`` per example, ``(N, C) -> (N,)`` (eq. 3)."""
    return 0.5 * ((f - mean).square() / var + torch.log(2 * math.pi * var)).sum(-1)


class GaussianApproxLoss(nn.Module):
    """Drop-in replacement for cross-entropy by the Gaussian likelihood approximation of eq. (3).

    ``method``: ``laplace`` | ``variational`` | ``moment`` | ``moment-ori`` | ``gauss``;
    ``basis``: ``"log"`` (softmax, logits ``f (N, C)``, integer labels ``y (N,)``) or ``"logit"``
    (sigmoid, one logit ``f (N,)`` or ``(N, 1)``, labels in {0, 1}); ``alpha_eps`` (and
    ``beta_eps`` in the logit basis) the pseudo-counts; ``noise`` the variance of ``gauss``.
    ``reduction``: ``"mean"`` over examples (summed over classes, as cross-entropy sums the
    one-hot terms), ``"sum"`` or ``"none"`` (per example, (N,)).
    """

    def __init__(
        self, method: Method = "moment", basis: Basis = "log", alpha_eps: Scalar = 0.1, *,
        beta_eps: Scalar | None = None, noise: float = 0.1, reduction: Reduction = "mean",
    ) -> None:  # fmt: skip
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction: expected 'mean', 'sum' or 'none', got {reduction!r}")
        self.pseudo_likelihood: DirichletGaussian | BetaGaussian = pseudo_likelihood(
            method, basis, alpha_eps, beta_eps=beta_eps, noise=noise
        )
        self.reduction = reduction

    @property
    def basis(self) -> str:
        return self.pseudo_likelihood.basis

    def _logits(self, f: Tensor) -> Tensor:
        if not isinstance(f, Tensor) or not f.is_floating_point():
            raise TypeError("f: expected a floating-point tensor of logits")
        if self.basis == "logit":
            if f.ndim == 1:
                f = f.unsqueeze(-1)
            if f.ndim != 2 or f.shape[-1] != 1:
                raise ValueError(f"f: logit basis expects (N,) or (N, 1), got {tuple(f.shape)}")
        elif f.ndim != 2 or f.shape[-1] < 2:
            raise ValueError(f"f: log basis expects (N, C >= 2), got {tuple(f.shape)}")
        return f

    def pseudo_targets(
        self, y: Tensor, num_classes: int, dtype: torch.dtype | None = None
    ) -> tuple[Tensor, Tensor]:
        """The Gaussian pseudo-targets ``(mean, var)`` of the labels (see the pseudo-likelihood)."""
        return self.pseudo_likelihood.pseudo_targets(y, num_classes, dtype=dtype)

    def forward(self, f: Tensor, y: Tensor) -> Tensor:
        """Negative approximate log-likelihood of labels ``y`` under logits ``f`` (eq. 3)."""
        f = self._logits(f)
        num_classes = 2 if self.basis == "logit" else f.shape[-1]
        if y.shape[0] != f.shape[0]:
            raise ValueError(f"y: expected {f.shape[0]} labels, got shape {tuple(y.shape)}")
        mean, var = self.pseudo_likelihood.pseudo_targets(y, num_classes, dtype=f.dtype)
        per_example = gaussian_pseudo_nll(f, mean.reshape(f.shape), var.reshape(f.shape))
        if self.reduction == "mean":
            return per_example.mean()
        if self.reduction == "sum":
            return per_example.sum()
        return per_example

    @torch.no_grad()
    def predict(self, f: Tensor) -> Tensor:
        """Class probabilities ``(N, C)`` from logits: softmax (log basis) or
        ``[1 - sigmoid(f), sigmoid(f)]`` (logit basis), ready for :mod:`gaussify.metrics`."""
        f = self._logits(f)
        if self.basis == "logit":
            p = torch.sigmoid(f)
            return torch.cat([1 - p, p], dim=-1)
        return torch.softmax(f, dim=-1)
