"""Laplace log marginal likelihood in weight space, with the non-MAP correction.

With prior N(m0, P0^-1), posterior precision A = s G + P0 (G the GGN or EF, s = 1 / T times
the noise ratio), log-likelihood L(theta*) at the expansion point and its gradient
g = sum_n J_n^T r_n (both tempered), and theta = theta* - m0, the Laplace-GGN evidence of the
linearised model (Immer thesis Thm 3.3, eq. 3.17-3.18) is

    log Z = L(theta*) - 1/2 theta^T P0 theta + 1/2 (log det P0 - log det A) + 1/2 b^T A^-1 b,

where b = g - P0 theta is the gradient of the log joint at theta*. The last term is the
correction for an expansion point that is not the MAP: the linearised model's log-likelihood
is the quadratic q(phi) = L + g^T (phi - theta) - 1/2 s (phi - theta)^T G (phi - theta), and
1/2 b^T A^-1 b is the gain of the Newton step z = A^-1 b to the mode mu = theta + z of
q(phi) - 1/2 phi^T P0 phi. It vanishes at a stationary point (b = 0); for a model linear in
its parameters with a Gaussian likelihood and the exact GGN, log Z is the exact evidence at
any theta*.

**The rule that keeps the correction possible.** The quadratic q is a model of the
log-likelihood, so it cannot be trusted where it exceeds the largest value the likelihood can
take, L_sup (0 for class labels, Categorical or Bernoulli, also with soft labels; for a
Gaussian likelihood with noise sigma, -N sum_c (log sigma_c + 1/2 log 2 pi) / T, the value at
zero residual). Far from a MAP (e.g. a classifier whose logits were scaled up) the Newton gain
can claim q(mu) > L_sup, and log Z then comes out positive for discrete labels and grows
without bound as the prior precision shrinks. Hence: **where q(mu) = L + g^T z - 1/2 s z^T G z
exceeds L_sup, the correction is dropped** and log Z is the standard Laplace evidence at
theta* (the first three terms above, <= L_sup for any prior), and the caller warns with
:class:`gaussify.warnings.EvidenceWarning`. For discrete labels the result is then always
<= 0: without the correction each term is <= 0; with it, log Z = q(mu) - 1/2 mu^T P0 mu +
1/2 log det(P0 A^-1) <= q(mu) <= 0. The exact full-GGN Gaussian case never triggers the rule
(q is then the exact log-likelihood of the linear model, <= L_sup). A likelihood without a
known supremum (user likelihoods, heteroscedastic noise) keeps the correction unchecked.

**Precision.** Everything is evaluated in float64 whatever the model dtype: the small
quantities (log-likelihood, gradient, theta, prior, eigenvalues, projections, log det A and
solves with A factorised in float64) are cast, never the model. The correction and the prior
term cancel to relative round-off times P0 theta^T theta (1e15 at a prior of 1e12), so where
the curvature has an eigenbasis V (G = V diag(lambda) V^T with the prior constant on each
eigenvector, :func:`eigenbasis_log_evidence`) the two are merged per direction without any
cancellation, with e_j = s lambda_j, d_j = e_j + delta_j, h_j = s u_j (u = V^T g / s, the
untempered projection) and w = V^T theta:

    -1/2 delta_j w_j^2 + 1/2 (h_j - delta_j w_j)^2 / d_j
        = (1/2 h_j^2 - delta_j (h_j w_j + 1/2 e_j w_j^2)) / d_j,

and 1/2 (log det P0 - log det A) = -1/2 sum_j log1p(e_j / delta_j).
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from gaussify.likelihoods import Bernoulli, Categorical, Gaussian
from gaussify.warnings import EvidenceWarning

__all__ = [
    "EvidenceValue",
    "apply_rule",
    "eigenbasis_log_evidence",
    "feature_log_evidence",
    "finite_evidence",
    "gaussian_log_likelihood",
    "laplace_log_evidence",
    "log_likelihood_supremum",
    "optimize_hyperparameters",
    "rule_fires",
    "warn_dropped_correction",
]

WIDE = torch.float64


class EvidenceValue(NamedTuple):
    """A log evidence (float64 scalar tensor, differentiable in the hyperparameters) and
    whether the non-MAP correction was dropped by the rule of the module docstring, with the
    Newton model's log-likelihood q(mu) and the supremum it exceeded (nan when not dropped)."""

    value: Tensor
    dropped: bool = False
    newton_log_lik: float = math.nan
    supremum: float = math.nan


def finite_evidence(value: Tensor) -> Tensor:
    """``value`` (a log evidence), or ``FloatingPointError`` where it is not finite: the
    hyperparameters it was evaluated at are out of the numerically usable range."""
    if not torch.isfinite(value):
        raise FloatingPointError(
            f"log marginal likelihood is {value.item()}: check prior_precision/sigma_noise"
        )
    return value


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


def log_likelihood_supremum(
    likelihood: Any,
    num_data: int,
    num_outputs: int,
    sigma_noise: Tensor | None = None,
    temperature: float = 1.0,
) -> Tensor | None:
    """L_sup = sup_f sum_n log p(y_n | f_n) / T as a float64 scalar (differentiable in
    ``sigma_noise``): 0 for Categorical and Bernoulli (a probability of discrete labels, or
    the negative cross-entropy of soft labels, is <= 0), -N sum_c (log sigma_c + 1/2 log 2 pi)
    / T for a Gaussian (``sigma_noise`` scalar or (C,)); None when unknown."""
    if isinstance(likelihood, (Categorical, Bernoulli)):
        return torch.zeros((), dtype=WIDE)
    if isinstance(likelihood, Gaussian):
        sigma = torch.as_tensor(likelihood.sigma_noise if sigma_noise is None else sigma_noise).to(
            WIDE
        )
        per_output = sigma.log() + 0.5 * math.log(2 * math.pi)
        return -num_data * per_output.expand(num_outputs).sum() / temperature
    return None


def rule_fires(log_lik: float, gain: float, supremum: float | None) -> bool:
    """Whether q(mu) = ``log_lik`` + ``gain`` exceeds ``supremum`` beyond round-off (relative
    1e-9 of the magnitudes involved): the correction's Newton model is then impossible."""
    if supremum is None:
        return False
    tol = 1e-9 * (abs(log_lik) + abs(gain) + abs(supremum) + 1.0)
    return log_lik + gain > supremum + tol


def apply_rule(
    log_lik: Tensor,
    gain: Tensor,
    supremum: Tensor | None,
    base: Tensor,
    corrected: Callable[[], Tensor],
) -> EvidenceValue:
    """``corrected()`` unless q(mu) = ``log_lik`` + ``gain`` exceeds ``supremum`` (then
    ``base``, the evidence without the correction, flagged as dropped)."""
    lik, value = float(log_lik.detach()), float(gain.detach())
    sup = None if supremum is None else float(supremum.detach())
    if sup is not None and rule_fires(lik, value, sup):
        return EvidenceValue(base, True, lik + value, sup)
    return EvidenceValue(corrected())


def _wide(t: Tensor | float) -> Tensor:
    return torch.as_tensor(t).to(WIDE)


def laplace_log_evidence(
    log_lik: Tensor,
    theta: Tensor,
    prior_vec: Tensor,
    logdet_posterior: Tensor,
    solve: Callable[[Tensor], Tensor],
    grad_log_lik: Tensor | None = None,
    *,
    supremum: Tensor | None = None,
) -> EvidenceValue:
    """The Laplace log evidence of the module docstring, in float64, for any structure.

    ``log_lik`` scalar L(theta*) (already divided by T); ``theta (P,)`` theta* - m0;
    ``prior_vec (P,)`` the diagonal of P0; ``logdet_posterior`` log det A (best computed in
    float64); ``solve`` a callable v -> A^-1 v (given and expected to return float64 where the
    structure can); ``grad_log_lik (P,)`` g (tempered), or None to drop the non-MAP
    correction (what laplace-torch computes); ``supremum`` L_sup for the rule (None: none).
    """
    lik = _wide(log_lik)
    th = _wide(theta)
    prior = _wide(prior_vec)
    base = (
        lik
        - 0.5 * (prior * th.square()).sum()
        + 0.5 * (prior.log().sum() - _wide(logdet_posterior))
    )
    if grad_log_lik is None:
        return EvidenceValue(base)
    g = _wide(grad_log_lik)
    b = g - prior * th
    z = _wide(solve(b))
    bz = (b * z).sum()
    # q(mu) - L = g^T z - 1/2 s z^T G z, with s z^T G z = z^T A z - z^T P0 z = b^T z - z^T P0 z
    gain = (g * z).sum() - 0.5 * (bz - (prior * z.square()).sum())
    return apply_rule(lik, gain, supremum, base, lambda: base + 0.5 * bz)


def eigenbasis_log_evidence(
    log_lik: Tensor,
    eigenvalues: Tensor,
    scale: Tensor,
    delta: Tensor,
    prior_vec: Tensor,
    theta: Tensor,
    projections: list[Tensor],
    *,
    supremum: Tensor | None = None,
) -> EvidenceValue:
    """The Laplace log evidence where the prior is constant on each eigenvector of G
    (module docstring, merged per direction), in float64, differentiable in ``scale``,
    ``delta`` and ``log_lik`` (and ``supremum``).

    ``eigenvalues (P,)`` lambda of the untempered G; ``scale`` s; ``delta (P,)`` the prior of
    each eigenvector; ``prior_vec (P,)`` and ``theta (P,)`` in parameter space (the prior
    term without the correction); ``projections`` empty (no correction) or [V^T g, V^T theta]
    with g the untempered gradient (tempered: s V^T g).
    """
    s = _wide(scale)
    lam = _wide(eigenvalues)
    dl = _wide(delta)
    e = s * lam
    d = e + dl
    lik = _wide(log_lik)
    logdet_term = -0.5 * torch.log1p(e / dl).sum()
    base = lik - 0.5 * (_wide(prior_vec) * _wide(theta).square()).sum() + logdet_term
    if not projections:
        return EvidenceValue(base)
    h = s * _wide(projections[0])
    w = _wide(projections[1])
    z = (h - dl * w) / d
    gain = (h * z - 0.5 * e * z.square()).sum()

    def corrected() -> Tensor:
        merged = ((0.5 * h.square() - dl * (h * w + 0.5 * e * w.square())) / d).sum()
        return lik + merged + logdet_term

    return apply_rule(lik, gain, supremum, base, corrected)


def feature_log_evidence(
    log_lik: Tensor,
    const: Tensor,
    precision: Tensor,
    rhs: Tensor,
    *,
    supremum: Tensor | None = None,
    prior_quad: Tensor | None = None,
) -> EvidenceValue:
    """The same evidence for a linearised model written in R unit-prior features,
    f = f* + m + Phi^T w with w ~ N(0, I_R) (ELLA's Nystrom GLM): with ``const`` = L + r^T m
    - 1/2 m^T Lambda m (the Newton model at w = 0), ``precision`` A = I + Phi Lambda Phi^T
    (R, R) and ``rhs`` s = Phi (r - Lambda m) (R,),

        log Z = const + 1/2 s^T A^-1 s - 1/2 log det A,

    in float64, with the rule: the Newton model's log-likelihood at the mode w = A^-1 s is
    const + w^T s - 1/2 w^T (A - I) w; where it exceeds ``supremum`` the value is
    L - 1/2 ``prior_quad`` - 1/2 log det A (no correction; ``prior_quad`` = theta*^T P0
    theta*)."""
    lik, const_w = _wide(log_lik), _wide(const)
    a, s = _wide(precision), _wide(rhs)
    chol = torch.linalg.cholesky(0.5 * (a + a.T))
    z = torch.linalg.solve_triangular(chol, s.reshape(-1, 1), upper=False)
    half_logdet = chol.diagonal().log().sum()
    value = const_w + 0.5 * z.square().sum() - half_logdet
    if supremum is None or prior_quad is None:
        return EvidenceValue(value)
    w = torch.cholesky_solve(s.reshape(-1, 1), chol).reshape(-1)
    eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    gain = const_w - lik + (w * s).sum() - 0.5 * (w * ((a - eye) @ w)).sum()
    base = lik - 0.5 * _wide(prior_quad) - half_logdet
    return apply_rule(lik, gain, supremum, base, lambda: value)


_WARNED: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def warn_dropped_correction(result: EvidenceValue, owner: Any, fit_state: object) -> None:
    """Warn (:class:`~gaussify.warnings.EvidenceWarning`) that ``result`` dropped the
    correction; once per ``owner`` (a posterior) and ``fit_state`` (an object that a new fit
    replaces, e.g. its curvature), so that prior tuning does not warn at every step and a new
    fit warns again."""
    if _WARNED.get(owner) == id(fit_state):
        return
    _WARNED[owner] = id(fit_state)
    warnings.warn(
        "log evidence: the non-MAP correction was dropped because its Newton model of the "
        f"log-likelihood reaches {result.newton_log_lik:.6g}, above the likelihood's supremum "
        f"{result.supremum:.6g} (impossible); the expansion point is far from a mode, so the "
        "evidence is the standard Laplace evidence at theta* there. Train to the MAP (or "
        "refine()) to use the correction, or pass correction=False to silence this",
        EvidenceWarning,
        stacklevel=3,
    )


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
