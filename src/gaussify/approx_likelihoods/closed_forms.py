"""Gaussian approximations of transformed exponential-family densities (Bui, Sec. 3, App. A).

Every function maps the parameters of a base density ``p_omega`` to ``(mean, var)`` of a
Gaussian ``q(psi) = N(mean, var)`` over the transformed variable ``psi = g(omega)``:
``g = log`` for the Gamma, Exponential, Inverse-Gamma and Chi-squared densities and
``g = logit`` for the Beta density. The methods are

* ``laplace``: mode and negative inverse Hessian of ``log p_psi`` (Hobbhahn & Hennig 2022);
* ``variational``: ``argmin_q KL(q || p_psi)`` (closed form in the log basis; numerical in the
  logit basis, :func:`gaussify.approx_likelihoods.numerical.beta_variational`);
* ``moment``: mean and variance of ``psi`` (``argmin_q KL(p_psi || q)``);
* ``moment-ori``: the log-normal moment-matched in the *original* basis (Milios et al. 2018),
  written as the Gaussian of its logarithm; defined in the log basis only.

All functions are pure, elementwise over broadcastable tensors and differentiable in their
parameters. :data:`APPROXIMATIONS` is the registry ``(distribution, method) -> function``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from gaussify.approx_likelihoods.numerical import beta_variational

__all__ = [
    "APPROXIMATIONS",
    "BASES",
    "PARAMETERS",
    "beta_laplace",
    "beta_moment",
    "beta_variational",
    "chi2_laplace",
    "chi2_moment",
    "chi2_moment_ori",
    "chi2_variational",
    "dirichlet_logit_prior",
    "exponential_laplace",
    "exponential_moment",
    "exponential_moment_ori",
    "exponential_variational",
    "gamma_laplace",
    "gamma_moment",
    "gamma_moment_ori",
    "gamma_variational",
    "gaussian_approx",
    "inverse_gamma_laplace",
    "inverse_gamma_moment",
    "inverse_gamma_moment_ori",
    "inverse_gamma_variational",
]

Pair = tuple[Tensor, Tensor]
EULER_GAMMA = 0.5772156649015329


def _trigamma(x: Tensor) -> Tensor:
    return torch.special.polygamma(1, x)


# --- Gamma(alpha, beta) (rate beta), log basis: Sec. 3.2, App. A.1 -------------------------


def gamma_laplace(alpha: Tensor, beta: Tensor | float = 1.0) -> Pair:
    """Laplace matching, App. A.1: ``N(log(alpha/beta), 1/alpha)``."""
    return torch.log(alpha / beta), 1.0 / alpha


def gamma_variational(alpha: Tensor, beta: Tensor | float = 1.0) -> Pair:
    """Variational matching, Sec. 3.2 / App. A.1: the stationary point of
    ``F = -0.5 log s2 - alpha mu + beta exp(mu + s2/2)`` is
    ``N(log(alpha/beta) - 1/(2 alpha), 1/alpha)``."""
    var = 1.0 / alpha
    return torch.log(alpha / beta) - 0.5 * var, var


def gamma_moment(alpha: Tensor, beta: Tensor | float = 1.0) -> Pair:
    """Moment matching, App. A.1: ``E[log w] = digamma(alpha) - log beta``,
    ``Var[log w] = trigamma(alpha)``."""
    return torch.special.digamma(alpha) - torch.log(torch.as_tensor(beta).to(alpha)), _trigamma(
        alpha
    )


def gamma_moment_ori(alpha: Tensor, beta: Tensor | float = 1.0) -> Pair:
    """Log-normal moment matching in the original basis (Milios et al. 2018; Sec. 3.2):
    ``s2 = log(1 + 1/alpha)``, ``mean = log(alpha/beta) - s2/2``.

    The paper writes ``s2 = log(1 + beta/alpha)``, which equals this only for ``beta = 1`` (the
    case it uses); matching ``E[w] = alpha/beta`` and ``Var[w] = alpha/beta^2`` gives
    ``exp(s2) - 1 = Var/E^2 = 1/alpha`` for every rate ``beta``.
    """
    var = torch.log1p(1.0 / alpha)
    return torch.log(alpha / beta) - 0.5 * var, var


# --- Exponential(rate), log basis: App. A.3 ------------------------------------------------


def exponential_laplace(rate: Tensor) -> Pair:
    """Laplace matching, App. A.3: ``N(-log rate, 1)``."""
    return -torch.log(rate), torch.ones_like(rate)


def exponential_variational(rate: Tensor) -> Pair:
    """Variational matching, App. A.3: ``N(-log rate - 1/2, 1)``."""
    return -torch.log(rate) - 0.5, torch.ones_like(rate)


def exponential_moment(rate: Tensor) -> Pair:
    """Moment matching, App. A.3: ``N(-log rate - euler_gamma, pi^2/6)``."""
    return -torch.log(rate) - EULER_GAMMA, torch.full_like(rate, math.pi**2 / 6)


def exponential_moment_ori(rate: Tensor) -> Pair:
    """Log-normal moment matching in the original basis (an extension; the Exponential is
    Gamma(1, rate)): ``s2 = log 2``, ``mean = -log rate - s2/2``."""
    var = torch.full_like(rate, math.log(2.0))
    return -torch.log(rate) - 0.5 * var, var


# --- InverseGamma(alpha, beta) (scale beta), log basis: App. A.4 ---------------------------


def inverse_gamma_laplace(alpha: Tensor, beta: Tensor) -> Pair:
    """Laplace matching, App. A.4: ``N(log(beta/alpha), 1/alpha)``."""
    return torch.log(beta / alpha), 1.0 / alpha


def inverse_gamma_variational(alpha: Tensor, beta: Tensor) -> Pair:
    """Variational matching, App. A.4: ``N(log(beta/alpha) + 1/(2 alpha), 1/alpha)``."""
    var = 1.0 / alpha
    return torch.log(beta / alpha) + 0.5 * var, var


def inverse_gamma_moment(alpha: Tensor, beta: Tensor) -> Pair:
    """Moment matching, App. A.4: ``N(log beta - digamma(alpha), trigamma(alpha))``."""
    return torch.log(beta) - torch.special.digamma(alpha), _trigamma(alpha)


def inverse_gamma_moment_ori(alpha: Tensor, beta: Tensor) -> Pair:
    """Log-normal moment matching in the original basis (an extension, needs ``alpha > 2`` for a
    finite variance): ``Var/E^2 = 1/(alpha - 2)``, so ``s2 = log((alpha - 1)/(alpha - 2))`` and
    ``mean = log(beta/(alpha - 1)) - s2/2``."""
    if bool((alpha <= 2).any()):
        raise ValueError("alpha: 'moment-ori' for the Inverse-Gamma needs alpha > 2")
    var = torch.log((alpha - 1.0) / (alpha - 2.0))
    return torch.log(beta / (alpha - 1.0)) - 0.5 * var, var


# --- Chi-squared(df), log basis: App. A.5 --------------------------------------------------


def chi2_laplace(df: Tensor) -> Pair:
    """Laplace matching, App. A.5: ``N(log k, 2/k)``."""
    return torch.log(df), 2.0 / df


def chi2_variational(df: Tensor) -> Pair:
    """Variational matching, App. A.5: ``N(log k - 1/k, 2/k)``."""
    return torch.log(df) - 1.0 / df, 2.0 / df


def chi2_moment(df: Tensor) -> Pair:
    """Moment matching, App. A.5: ``N(digamma(k/2) + log 2, trigamma(k/2))``."""
    return torch.special.digamma(0.5 * df) + math.log(2.0), _trigamma(0.5 * df)


def chi2_moment_ori(df: Tensor) -> Pair:
    """Log-normal moment matching in the original basis (an extension): ``Var/E^2 = 2/k``, so
    ``s2 = log(1 + 2/k)``, ``mean = log k - s2/2``."""
    var = torch.log1p(2.0 / df)
    return torch.log(df) - 0.5 * var, var


# --- Beta(alpha, beta), logit basis: Sec. 3.3, App. A.2 ------------------------------------


def beta_laplace(alpha: Tensor, beta: Tensor) -> Pair:
    """Laplace matching, Sec. 3.3: ``N(log(alpha/beta), (alpha + beta)/(alpha beta))``."""
    return torch.log(alpha / beta), (alpha + beta) / (alpha * beta)


def beta_moment(alpha: Tensor, beta: Tensor) -> Pair:
    """Moment matching, Sec. 3.3 / App. A.2:
    ``N(digamma(alpha) - digamma(beta), trigamma(alpha) + trigamma(beta))``."""
    mean = torch.special.digamma(alpha) - torch.special.digamma(beta)
    return mean, _trigamma(alpha) + _trigamma(beta)


APPROXIMATIONS: dict[tuple[str, str], Callable[..., Pair]] = {
    ("gamma", "laplace"): gamma_laplace,
    ("gamma", "variational"): gamma_variational,
    ("gamma", "moment"): gamma_moment,
    ("gamma", "moment-ori"): gamma_moment_ori,
    ("exponential", "laplace"): exponential_laplace,
    ("exponential", "variational"): exponential_variational,
    ("exponential", "moment"): exponential_moment,
    ("exponential", "moment-ori"): exponential_moment_ori,
    ("inverse_gamma", "laplace"): inverse_gamma_laplace,
    ("inverse_gamma", "variational"): inverse_gamma_variational,
    ("inverse_gamma", "moment"): inverse_gamma_moment,
    ("inverse_gamma", "moment-ori"): inverse_gamma_moment_ori,
    ("chi2", "laplace"): chi2_laplace,
    ("chi2", "variational"): chi2_variational,
    ("chi2", "moment"): chi2_moment,
    ("chi2", "moment-ori"): chi2_moment_ori,
    ("beta", "laplace"): beta_laplace,
    ("beta", "variational"): beta_variational,
    ("beta", "moment"): beta_moment,
}
"""``(distribution, method) -> f(**params) -> (mean, var)``; a new pair is one entry."""

BASES: dict[str, str] = {
    "gamma": "log",
    "exponential": "log",
    "inverse_gamma": "log",
    "chi2": "log",
    "beta": "logit",
}
"""The transformed basis each base distribution is approximated in."""

PARAMETERS: dict[str, tuple[str, ...]] = {
    "gamma": ("alpha", "beta"),
    "exponential": ("rate",),
    "inverse_gamma": ("alpha", "beta"),
    "chi2": ("df",),
    "beta": ("alpha", "beta"),
}
"""Parameter names of each base distribution (all must be positive)."""


def gaussian_approx(distribution: str, method: str, **params: Tensor | float) -> Pair:
    """Gaussian ``(mean, var)`` approximating ``p_psi`` for ``distribution`` in its basis
    (:data:`BASES`) by ``method``, e.g. ``gaussian_approx("gamma", "moment", alpha=a)``.

    Parameters are broadcast tensors or floats (floats become tensors of the default dtype);
    Gamma's rate ``beta`` defaults to 1. Raises ``ValueError`` naming the argument for an
    unknown distribution or method, a method the distribution does not support, a missing or
    unexpected parameter, or a non-positive parameter.
    """
    if distribution not in BASES:
        raise ValueError(f"distribution: expected one of {sorted(BASES)}, got {distribution!r}")
    supported = sorted(m for d, m in APPROXIMATIONS if d == distribution)
    if method not in supported:
        raise ValueError(
            f"method: {distribution!r} (basis {BASES[distribution]!r}) supports {supported}, "
            f"got {method!r}"
        )
    names = PARAMETERS[distribution]
    if distribution == "gamma":
        params.setdefault("beta", 1.0)
    unknown = sorted(set(params) - set(names))
    missing = [n for n in names if n not in params]
    if unknown or missing:
        raise ValueError(
            f"params: {distribution!r} takes {list(names)}; missing {missing}, unexpected {unknown}"
        )
    tensors: dict[str, Tensor] = {}
    for name in names:
        value = torch.as_tensor(params[name])
        if not value.is_floating_point():
            value = value.to(torch.get_default_dtype())
        if bool((value <= 0).any()) or not bool(torch.isfinite(value).all()):
            raise ValueError(f"{name}: must be positive and finite, got {params[name]}")
        tensors[name] = value
    return APPROXIMATIONS[(distribution, method)](**tensors)


def dirichlet_logit_prior(
    concentration: float = 1.0, method: str = "moment"
) -> tuple[float, float]:
    """The Gaussian on each logit that a symmetric ``Dir(concentration)`` prior on the class
    probabilities implies in the log basis (Sec. 2.2 / 3.2): ``pi = softmax(psi)`` with
    ``psi_k = log w_k``, ``w_k ~ Gamma(concentration, 1)`` i.i.d., so each logit ``psi_k`` is
    a log-Gamma variable and ``method`` (``"moment"`` by default) maps it to ``N(mean, var)``
    with :func:`gaussian_approx`. ``Dir(1)`` (uniform on the simplex) with ``moment`` gives
    ``N(-euler_gamma, pi^2/6)``: mean ``digamma(1)``, variance ``trigamma(1)``.

    The mean is common to all ``K`` logits, so it leaves ``softmax(psi)`` unchanged; the
    variance is the prior logit scale. Returns floats ``(mean, var)``; raises ``ValueError``
    naming ``concentration`` unless it is positive and finite, or ``method`` if unknown.
    """
    if isinstance(concentration, bool) or not isinstance(concentration, int | float):
        raise TypeError(f"concentration: expected a positive float, got {concentration!r}")
    if not (math.isfinite(concentration) and concentration > 0):
        raise ValueError(f"concentration: must be positive and finite, got {concentration}")
    alpha = torch.tensor(float(concentration), dtype=torch.float64)
    mean, var = gaussian_approx("gamma", method, alpha=alpha)
    return float(mean), float(var)
