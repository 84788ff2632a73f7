"""laplace-torch's link approximations of E[softmax(f)], f ~ N(mu, Sigma) per input.

Written from the formulas (Daxberger et al. 2021; Hobbhahn et al. 2022), kept separate from
:mod:`gaussify.predictive` because the numbers must follow laplace-torch exactly:

* probit: ``softmax(mu_k / sqrt(1 + pi/8 Sigma_kk))`` (no re-normalisation beyond softmax);
* Laplace bridge: first the zero-sum projection of the Gaussian (softmax is invariant to a
  shift along 1): ``mu <- mu - Sigma 1 (1^T mu) / (1^T Sigma 1)``,
  ``Sigma <- Sigma - Sigma 1 1^T Sigma / (1^T Sigma 1)``; then the Dirichlet parameters
  ``alpha_k = (1 - 2/K + exp(mu_k) sum_j exp(-mu_j) / K^2) / Sigma_kk`` and the Dirichlet mean
  ``alpha / sum alpha`` (NaN -> 1, as laplace-torch). ``bridge_norm`` first rescales by
  ``s = mean_k Sigma_kk / sqrt(K / 2)``: ``mu / sqrt(s)``, ``Sigma_kk / s``;
* mc: the average softmax of ``n_samples`` draws of f.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gaussify.predictive import gaussian_samples

__all__ = ["apply_link", "normal_draws"]


def normal_draws(
    mean: Tensor, var: Tensor, n_samples: int, generator: torch.Generator | None = None
) -> Tensor:
    """(S, N, C) draws of N(mean (N, C), var): ``var`` either (N, C) variances or (N, C, C)."""
    if var.shape == mean.shape:
        eps = torch.randn(
            (n_samples, *mean.shape), generator=generator, dtype=mean.dtype, device=mean.device
        )
        return mean + var.clamp_min(0).sqrt() * eps
    return gaussian_samples(mean, var, n_samples, generator)


def _bridge(mu: Tensor, cov: Tensor, normalise: bool) -> Tensor:
    row = cov.sum(-1)  # Sigma 1, (N, K)
    total = row.sum(-1, keepdim=True)  # 1^T Sigma 1, (N, 1)
    mu = mu - row * mu.sum(-1, keepdim=True) / total
    cov = cov - row.unsqueeze(-1) * row.unsqueeze(-2) / total.unsqueeze(-1)
    k = mu.shape[-1]
    var = cov.diagonal(dim1=-2, dim2=-1)
    if normalise:
        s = var.mean(-1, keepdim=True) / math.sqrt(k / 2)
        mu = mu / s.sqrt()
        var = var / s
    alpha = (1 - 2 / k + mu.exp() * (-mu).exp().sum(-1, keepdim=True) / k**2) / var
    return torch.nan_to_num(alpha / alpha.sum(-1, keepdim=True), nan=1.0)


def apply_link(
    mu: Tensor,
    var: Tensor,
    link: str,
    n_samples: int = 100,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Class probabilities (N, K) from the latent Gaussian ``N(mu (N, K), var)``; ``var`` is the
    (N, K, K) covariance or, for "probit" and "mc", possibly the (N, K) variances."""
    if link == "probit":
        diag = var if var.shape == mu.shape else var.diagonal(dim1=-2, dim2=-1)
        return torch.softmax(mu / torch.sqrt(1.0 + math.pi / 8 * diag), dim=-1)
    if link == "mc":
        return torch.softmax(normal_draws(mu, var, n_samples, generator), dim=-1).mean(0)
    if link in ("bridge", "bridge_norm"):
        if var.shape == mu.shape:
            raise ValueError("link_approx: 'bridge' needs the full output covariance")
        return _bridge(mu, var, link == "bridge_norm")
    raise ValueError(
        f"link_approx: expected one of ['mc', 'probit', 'bridge', 'bridge_norm'], got {link!r}"
    )
