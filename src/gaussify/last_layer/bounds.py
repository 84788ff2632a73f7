"""The per-example terms of the VBLL objectives as pure functions over tensors.

Harrison, Willes & Snoek (2024), "Variational Bayesian Last Layers" (ICLR):

* :func:`regression_bound` -- Theorem 1 / Corollary 8, eq. (12) and (16): the exact
  expectation of the Gaussian log-likelihood under the matrix normal posterior.
* :func:`discriminative_bound` -- Theorem 2, eq. (13): Jensen's bound on the softmax.
* :func:`generative_log_joint` / :func:`generative_bound` -- eq. (8)-(9) with Lemma 7, and
  Theorem 3, eq. (14).
* :func:`student_t_expected_loglik`, :func:`heteroscedastic_expected_loglik` and
  :func:`softmax_moment_bound` -- the Student-t and heteroscedastic heads of the ``vbll``
  package, derived here from the same Lemma 4 / Corollary 6 computations (see the docstrings).

Each returns one value per example, ``(N,)``; the heads average them and add the
regularisation terms (eq. 11, 61).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gaussify.last_layer.covariance import StructuredCovariance

__all__ = [
    "discriminative_bound",
    "gaussian_log_prob",
    "generative_bound",
    "generative_log_joint",
    "heteroscedastic_expected_loglik",
    "regression_bound",
    "softmax_moment_bound",
    "student_t_expected_loglik",
]

_LOG_2PI = math.log(2 * math.pi)


def regression_bound(noise_log_prob: Tensor, quad: Tensor, trace_precision: Tensor) -> Tensor:
    """E_{W ~ MN(W_bar, I, S)}[log N(y | W phi, Sigma)], eq. (12) / (16):

    ``log N(y | W_bar phi, Sigma) - 1/2 phi^T S phi tr(Sigma^-1)``,

    from ``noise_log_prob = log N(y - W_bar phi | 0, Sigma) (N,)``, ``quad = phi^T S phi (N,)``
    and ``trace_precision = tr(Sigma^-1)``. Exact (Corollary 6), so the ELBO is tight at the
    exact posterior when Sigma = sigma^2 I.
    """
    return noise_log_prob - 0.5 * quad * trace_precision


def discriminative_bound(y: Tensor, logit_mean: Tensor, logit_var: Tensor) -> Tensor:
    """Eq. (13): ``w_bar[y]^T phi - LSE_k[w_bar[k]^T phi + 1/2 (phi^T S_k phi + sigma_k^2)]``.

    ``y (N,)`` integer labels, ``logit_mean (N, K)``, ``logit_var = phi^T S_k phi + sigma_k^2
    (N, K)``. A lower bound on E_q[log softmax_y(W phi + eps)] (Jensen, eq. 50-51).
    """
    linear = logit_mean.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return linear - torch.logsumexp(logit_mean + 0.5 * logit_var, dim=-1)


def gaussian_log_prob(residual: Tensor, cov: StructuredCovariance) -> Tensor:
    """log N(x_k | mu_k, S_k) from ``residual = x - mu (..., K, D)``: (..., K)."""
    dim = residual.shape[-1]
    return -0.5 * (dim * _LOG_2PI + cov.logdet + cov.inv_quad(residual))


def generative_log_joint(
    phi: Tensor, means: Tensor, marginal: StructuredCovariance, log_class_prior: Tensor
) -> Tensor:
    """``log N(phi | mu_k, Sigma + S_k) + log p(y = k)``, (N, K): the class logits of eq. (8)-(9),
    with the class means marginalised by Lemma 7.

    ``phi (N, D)``, ``means (K, D)``, ``marginal`` the K covariances ``Sigma + S_k``,
    ``log_class_prior (K,)`` the log Dirichlet predictive ``log alpha_k - log sum alpha``.
    """
    residual = phi.unsqueeze(-2) - means
    return gaussian_log_prob(residual, marginal) + log_class_prior


def generative_bound(
    y: Tensor,
    noise_log_prob: Tensor,
    trace_noise_precision_cov: Tensor,
    log_joint: Tensor,
    log_class_prior: Tensor,
) -> Tensor:
    """Eq. (14): ``log N(phi | mu_y, Sigma) - 1/2 tr(Sigma^-1 S_y) + log alpha_y
    - LSE_k[log N(phi | mu_k, Sigma + S_k) + log alpha_k]``.

    ``noise_log_prob (N,) = log N(phi - mu_y | 0, Sigma)``; ``trace_noise_precision_cov (K,) =
    tr(Sigma^-1 S_k)``; ``log_joint (N, K)`` from :func:`generative_log_joint`. The Dirichlet
    enters through its predictive ``log alpha_k - log sum alpha`` in both places; the
    normaliser cancels (Sec. 3.3). A lower bound on E_{mu ~ q}[log p(y | phi, mu)] with the
    class probabilities at their Dirichlet predictive (eq. 55).
    """
    linear = noise_log_prob - 0.5 * trace_noise_precision_cov[y] + log_class_prior[y]
    return linear - torch.logsumexp(log_joint, dim=-1)


def student_t_expected_loglik(
    y: Tensor, mean: Tensor, quad: Tensor, concentration: Tensor, rate: Tensor
) -> Tensor:
    """E_q[log N(y | W phi, diag(1 / tau))] for the Normal-Gamma posterior
    ``tau_c ~ Gamma(a_c, b_c)``, ``w_c | tau_c ~ N(w_bar_c, S / tau_c)``, summed over outputs:

    ``sum_c 1/2 (psi(a_c) - log b_c - log 2 pi)
    - 1/2 (a_c / b_c (y_c - w_bar_c phi)^2 + phi^T S phi)``.

    The weight covariance scales with the noise (the conjugate form), so ``E[tau (w phi - w_bar
    phi)^2] = phi^T S phi`` exactly. ``y, mean (N, C)``, ``quad (N,)``, ``a, b (C,)``. (N,)
    """
    expected_log_tau = torch.digamma(concentration) - rate.log()
    sq = (y - mean).square() * (concentration / rate)
    per_output = 0.5 * (expected_log_tau - _LOG_2PI) - 0.5 * (sq + quad.unsqueeze(-1))
    return per_output.sum(-1)


def heteroscedastic_expected_loglik(
    y: Tensor, mean: Tensor, quad: Tensor, log_noise_mean: Tensor, log_noise_var: Tensor
) -> Tensor:
    """E_q[log N(y | W phi, diag(exp(M phi)))] with independent Gaussian q(W), q(M), summed over
    outputs (exact: ``E[exp(-s)] = exp(-m + v / 2)`` for ``s ~ N(m, v)``):

    ``-1/2 sum_c [log 2 pi + m_c + ((y_c - w_bar_c phi)^2 + phi^T S phi) exp(-m_c + v_c / 2)]``.

    ``y, mean (N, C)``, ``quad (N, C)`` (``phi^T S_W phi``), ``log_noise_mean / var (N, C)``
    (``M_bar phi`` and ``phi^T S_M phi``). (N,)
    """
    inv_noise = torch.exp(-log_noise_mean + 0.5 * log_noise_var)
    sq = (y - mean).square() + quad
    return -0.5 * (_LOG_2PI + log_noise_mean + sq * inv_noise).sum(-1)


def softmax_moment_bound(
    y: Tensor,
    logit_mean: Tensor,
    reference_var: Tensor,
    expected_var: Tensor,
    expected_inv_var: Tensor,
    gamma: Tensor | float,
) -> Tensor:
    """A lower bound on E[log softmax_y(z)] for ``z_k | V ~ N(mu_k, V_k)`` independent across
    k, with a random variance V (Student-t or heteroscedastic logits), in the spirit of
    Knowles & Minka (2011) -- the ``vbll`` package's ``reduced_kn`` bound, derived here:

    For any ``alpha_k`` that may depend on V, writing ``LSE(z) = t + log sum_k exp(z_k - t)``
    with ``t = sum_j alpha_j z_j`` and applying Jensen to the log,
    ``E[LSE(z) | V] <= LSE_k(mu_k + (1/2 - alpha_k) V_k) + 1/2 sum_k alpha_k^2 V_k``.
    Choosing ``alpha_k = 1/2 - gamma c_k / V_k`` for deterministic ``c_k`` (``reference_var``)
    makes the log-sum-exp deterministic, and averaging over V gives

    ``E[LSE(z)] <= LSE_k(mu_k + gamma c_k) + 1/2 sum_k (E[V_k] / 4 - gamma c_k
    + gamma^2 c_k^2 E[1 / V_k])``.

    Any upper bound may stand in for ``E[1 / V_k]`` (``expected_inv_var``). ``gamma`` is a free
    (learnable) scalar. All tensors (N, K); returns ``mu_y - bound`` (N,).
    """
    lse = torch.logsumexp(logit_mean + gamma * reference_var, dim=-1)
    penalty = (
        0.25 * expected_var
        - gamma * reference_var
        + gamma**2 * reference_var.square() * expected_inv_var
    )
    linear = logit_mean.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return linear - lse - 0.5 * penalty.sum(-1)
