"""The terms of VaLLA's objective (Ortega, Santana & Hernández-Lobato 2024, eq. 20-21).

    L_alpha = (N / |B|) sum_{n in B} (1/alpha) log E_q[p(y_n | f_n)^alpha] - KL(q(u) || p(u)),

with q(u) = N(0, S_u) on the M C inducing outputs, S_u = L_K S_v L_K^T whitened by
L_K = chol(K_ZZ). The data term is in closed form for a Gaussian likelihood (any alpha), the
probit approximation for softmax / sigmoid at alpha = 1, or Monte Carlo; the KL is the
whitened Gaussian KL, independent of K_ZZ. Pure functions of tensors (no network).
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from gaussify import draws
from gaussify.likelihoods import Likelihood
from gaussify.predictive import probit

__all__ = [
    "decoupled_kl",
    "gaussian_expected_log_lik",
    "mc_expected_log_lik",
    "probit_log_lik",
    "whitened_kl",
]


def whitened_kl(chol_v: Tensor) -> Tensor:
    """KL(N(0, S_u) || N(0, K_ZZ)) for S_u = L_K S_v L_K^T, S_v = L_v L_v^T:
    1/2 [tr S_v - D - log det S_v], independent of K_ZZ. ``chol_v (D, D)`` lower triangular."""
    diag = chol_v.diagonal()
    return 0.5 * (chol_v.square().sum() - chol_v.shape[0] - 2 * diag.abs().log().sum())


def decoupled_kl(chol_v: Tensor, theta_star: Tensor, prior: Tensor) -> Tensor:
    """KL(q(theta) || p(theta)) of VaLLA's weight-space Gaussian N(theta*, Sigma_theta) to the
    prior N(0, P0^-1): the covariance part plus the anchored mean's 1/2 theta*^T P0 theta*
    (VaLLA eq. 15 with the mean basis reproducing f(x; theta*)). ``prior (P,)``."""
    return whitened_kl(chol_v) + 0.5 * (prior * theta_star.square()).sum()


def gaussian_expected_log_lik(
    y: Tensor, mean: Tensor, cov: Tensor, noise_var: Tensor, alpha: float
) -> Tensor:
    """(1/alpha) log E_{f ~ N(mean, cov)} [N(y | f, D)^alpha] per sample, (B,), D = diag(noise).

    Closed form: N(y | f, D)^alpha = (2 pi)^{C (1 - alpha) / 2} |D|^{(1 - alpha) / 2}
    alpha^{-C/2} N(y | f, D / alpha), so the expectation is that constant times
    N(y | mean, D / alpha + cov). ``alpha = 0`` is the limit E[log N(y | f, D)] =
    log N(y | mean, D) - 1/2 tr(D^-1 cov). Shapes: y, mean (B, C), cov (B, C, C), noise (C,).
    """
    c = mean.shape[-1]
    log_2pi = math.log(2 * math.pi)
    resid = y - mean
    if alpha == 0:
        return -0.5 * (resid.square() / noise_var + noise_var.log() + log_2pi).sum(-1) - 0.5 * (
            cov.diagonal(dim1=-2, dim2=-1) / noise_var
        ).sum(-1)
    total = cov + torch.diag_embed(noise_var / alpha).expand_as(cov)
    chol = torch.linalg.cholesky(total)
    sol = torch.cholesky_solve(resid.unsqueeze(-1), chol).squeeze(-1)
    log_n = -0.5 * (
        (resid * sol).sum(-1) + 2 * chol.diagonal(dim1=-2, dim2=-1).log().sum(-1) + c * log_2pi
    )
    const = 0.5 * (1 - alpha) * (c * log_2pi + noise_var.log().sum()) - 0.5 * c * math.log(alpha)
    return (const + log_n) / alpha


def mc_expected_log_lik(
    likelihood: Likelihood,
    y: Tensor,
    mean: Tensor,
    cov: Tensor,
    alpha: float,
    num_samples: int,
    generator: torch.Generator | None,
) -> Tensor:
    """Reparameterised Monte Carlo estimate of (1/alpha) log E[p(y|f)^alpha] (alpha = 0:
    E[log p(y|f)]), (B,)."""
    chol, info = torch.linalg.cholesky_ex(cov)
    if bool(info.any()):
        eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)
        jitter = 1e-8 * float(cov.diagonal(dim1=-2, dim2=-1).mean().detach())
        warnings.warn(
            f"Sigma(x, x): not positive definite; added jitter {jitter:.1e} to sample from it",
            stacklevel=3,
        )
        chol = torch.linalg.cholesky(cov + jitter * eye)
    eps = draws.normal(
        (num_samples, *mean.shape), dtype=mean.dtype, device=mean.device, generator=generator
    )
    f = mean + torch.einsum("bij,sbj->sbi", chol, eps)
    logp = torch.stack([likelihood.log_prob(fs, y) for fs in f])  # (S, B)
    if alpha == 0:
        return logp.mean(0)
    return (torch.logsumexp(alpha * logp, dim=0) - math.log(num_samples)) / alpha


def probit_log_lik(task: str, y: Tensor, mean: Tensor, cov: Tensor) -> Tensor:
    """log E[p(y|f)] with the probit approximation of softmax / sigmoid (VaLLA Sec. 3.3 uses
    this approximation of Daxberger et al. 2021b), (B,)."""
    probs = probit(mean, cov.diagonal(dim1=-2, dim2=-1), task)
    if task == "classification":
        return probs.clamp_min(1e-300).log().gather(-1, y.long().reshape(-1, 1)).squeeze(-1)
    y = y.reshape(probs.shape).to(probs)
    return (y * probs.clamp_min(1e-300).log() + (1 - y) * (1 - probs).clamp_min(1e-300).log()).sum(
        -1
    )
