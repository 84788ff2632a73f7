"""Laplace log marginal likelihood in weight space, with the non-MAP correction.

With prior N(0, P0^-1), posterior precision A = G / T + P0 (G the GGN or EF, T the temperature),
log-likelihood L(theta*) at the expansion point and its gradient g = sum_n J_n^T r_n, the
Laplace-GGN evidence of the linearised model (Immer thesis Thm 3.3, eq. 3.17-3.18) is

    log Z = L(theta*) - 1/2 theta*^T P0 theta* + 1/2 (log det P0 - log det A) + 1/2 b^T A^-1 b,

where b = g - P0 theta* is the gradient of the log joint at theta*. The last term is the
correction for an expansion point that is not the MAP: eq. 3.18 evaluates the Bayesian linear
regression evidence at its posterior mean mu = theta* + A^-1 b, and substituting mu gives
exactly 1/2 b^T A^-1 b; it vanishes at a stationary point (b = 0). For a model linear in its
parameters with a Gaussian likelihood, log Z is then the exact evidence at any theta*.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["gaussian_log_likelihood", "laplace_log_evidence", "optimize_hyperparameters"]


def gaussian_log_likelihood(
    sse: Tensor, num_data: int, sigma_noise: Tensor, temperature: float = 1.0
) -> Tensor:
    """sum_n log N(y_n | f_n, sigma^2) from the per-output sum of squared errors ``sse (C,)``;
    differentiable in ``sigma_noise`` (scalar or (C,)), so the noise can be tuned post hoc."""
    sigma = sigma_noise.expand_as(sse)
    per_output = -0.5 * sse / sigma.square() - num_data * (
        sigma.log() + 0.5 * math.log(2 * math.pi)
    )
    return per_output.sum() / temperature


def laplace_log_evidence(
    log_lik: Tensor,
    theta: Tensor,
    prior_vec: Tensor,
    logdet_posterior: Tensor,
    solve: object,
    grad_log_lik: Tensor | None = None,
) -> Tensor:
    """The Laplace log evidence above.

    ``log_lik`` scalar L(theta*) (already divided by T); ``theta (P,)`` the expansion point;
    ``prior_vec (P,)`` the diagonal of P0; ``logdet_posterior`` log det A; ``solve`` a callable
    v -> A^-1 v; ``grad_log_lik (P,)`` g / T, or None to drop the non-MAP correction (what
    laplace-torch computes).
    """
    value = (
        log_lik
        - 0.5 * (prior_vec * theta.square()).sum()
        + 0.5 * (prior_vec.log().sum() - logdet_posterior)
    )
    if grad_log_lik is None:
        return value
    b = grad_log_lik - prior_vec * theta
    return value + 0.5 * (b * solve(b)).sum()  # type: ignore[operator]


def optimize_hyperparameters(
    log_marglik: Callable[[Tensor, Tensor], Tensor],
    prior_init: Tensor,
    sigma_init: Tensor,
    *,
    tune_noise: bool,
    n_steps: int,
    lr: float,
) -> tuple[Tensor, Tensor]:
    """Maximise ``log_marglik(prior, sigma)`` over the log prior precision (any shape) and log
    noise by the shared routine :func:`gaussify.tuning.tune_hyperparameters` (at most
    ``n_steps`` iterations; ``lr`` is Adam's step there); returns (prior, sigma), detached."""
    from gaussify.tuning import tune_hyperparameters

    result = tune_hyperparameters(
        log_marglik, prior_init, sigma_init, tune_noise=tune_noise, n_steps=n_steps, lr=lr
    )
    sigma = sigma_init.detach() if result.sigma_noise is None else result.sigma_noise
    return result.prior_precision, torch.as_tensor(sigma).reshape(sigma_init.shape)
