"""Numerical variational matching (Bui, Sec. 3.3 and App. A.2).

For ``omega ~ Beta(alpha, beta)`` and ``psi = logit(omega)`` the variational objective

    F(mu, sigma) = KL(N(mu, sigma^2) || p_psi)
                 = c - log sigma + beta mu + (alpha + beta) E_q[log(1 + exp(-psi))]

has no closed-form minimiser. It is jointly convex in ``(mu, sigma)`` (``p_psi`` is
log-concave), so :func:`beta_variational` minimises it by Newton's method with a backtracking
line search, taking every expectation by a quadrature that is accurate for any ``sigma``:

* ``sigma < 1``: trapezoid rule over ``z = (psi - mu) / sigma`` against the normal density;
* ``sigma >= 1``: the logistic pieces are written as expectations over a standard logistic
  variable ``L`` (``sigmoid(psi) = P(L < psi)``, ``softplus(x) = E[relu(x + L)]``), so the rule
  runs over ``L`` against its density, where the normal factors are smooth.

Both rules converge geometrically (the integrands are analytic in a strip), so 201 and 401
nodes give errors far below 1e-12. The minimiser is differentiable in ``(alpha, beta)``: one
final Newton step taken with gradients on equals the implicit-function derivative.

:func:`variational_reparam` is the generic route the paper names (reparameterisation
gradients, Rezende et al. 2014; Kingma & Welling 2014) for any log density.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["beta_kl", "beta_variational", "logistic_normal_expectations", "variational_reparam"]

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _grid(low: float, high: float, num: int, like: Tensor) -> tuple[Tensor, float]:
    return torch.linspace(low, high, num, dtype=like.dtype, device=like.device), (high - low) / (
        num - 1
    )


def _float(x: Tensor | float) -> Tensor:
    x = torch.as_tensor(x)
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


def _normal_pdf(x: Tensor) -> Tensor:
    # Clamped so far tails give ~1e-305 rather than subnormals, which are slow on CPUs.
    return torch.exp(-0.5 * (x * x).clamp_max(1400.0) - _LOG_SQRT_2PI)


def logistic_normal_expectations(mu: Tensor, sigma: Tensor) -> tuple[Tensor, ...]:
    """For ``psi ~ N(mu, sigma^2)`` and ``z = (psi - mu)/sigma`` return
    ``(E[sigmoid(psi)], E[s'(psi)], E[z s'(psi)], E[z^2 s'(psi)], E[softplus(-psi)])`` with
    ``s' = sigmoid (1 - sigmoid)``; elementwise over broadcast ``mu``, ``sigma``."""
    mu, sigma = torch.broadcast_tensors(mu, sigma)
    m, s = mu.unsqueeze(-1), sigma.unsqueeze(-1)
    # sigma < 1: the normal is the narrow factor; integrate over z.
    z, hz = _grid(-10.0, 10.0, 201, mu)
    w = hz * _normal_pdf(z)
    psi = m + s * z
    sig = torch.sigmoid(psi)
    dsig = sig * torch.sigmoid(-psi)
    small = (
        (w * sig).sum(-1),
        (w * dsig).sum(-1),
        (w * z * dsig).sum(-1),
        (w * z * z * dsig).sum(-1),
        (w * torch.nn.functional.softplus(-psi)).sum(-1),
    )
    # sigma >= 1: the logistic density is the narrow factor; integrate over L = t.
    t, ht = _grid(-40.0, 40.0, 401, mu)
    u = ht * torch.sigmoid(t) * torch.sigmoid(-t)
    x = (t - m) / s
    dens = _normal_pdf(x) / s
    cdf = torch.special.ndtr(x.clamp(-37.0, 37.0))
    large = (
        (u * (1.0 - cdf)).sum(-1),  # P(L < psi)
        (u * dens).sum(-1),
        (u * x * dens).sum(-1),
        (u * x * x * dens).sum(-1),
        (u * sigma.unsqueeze(-1) * (x * cdf + _normal_pdf(x))).sum(-1),  # E_L[E relu(L - psi)]
    )
    use_small = sigma < 1.0
    return tuple(torch.where(use_small, a, b) for a, b in zip(small, large, strict=True))


def beta_kl(mean: Tensor, var: Tensor, alpha: Tensor, beta: Tensor) -> Tensor:
    """``KL(N(mean, var) || p_psi)`` for ``psi = logit(omega)``, ``omega ~ Beta(alpha, beta)``
    (App. A.2, with the constant ``log B(alpha, beta) - (1 + log 2 pi)/2`` included)."""
    sigma = var.sqrt()
    *_, softplus_neg = logistic_normal_expectations(mean, sigma)
    log_b = torch.lgamma(alpha) + torch.lgamma(beta) - torch.lgamma(alpha + beta)
    return (
        -torch.log(sigma)
        - 0.5 * (1.0 + math.log(2 * math.pi))
        + beta * mean
        + (alpha + beta) * softplus_neg
        + log_b
    )


def _objective(mu: Tensor, sigma: Tensor, alpha: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
    """F (up to a constant), its gradient and Hessian in ``(mu, sigma)``."""
    e1, e2, e3, e4, softplus_neg = logistic_normal_expectations(mu, sigma)
    n = alpha + beta
    value = -torch.log(sigma) + beta * mu + n * softplus_neg
    g_mu = n * e1 - alpha
    g_sigma = -1.0 / sigma + n * sigma * e2  # Stein: E[z sigmoid(psi)] = sigma E[s'(psi)]
    return value, g_mu, g_sigma, n * e2, n * e3, 1.0 / sigma**2 + n * e4


def _newton_direction(g1: Tensor, g2: Tensor, h11: Tensor, h12: Tensor, h22: Tensor) -> tuple:
    det = h11 * h22 - h12 * h12
    return -(h22 * g1 - h12 * g2) / det, -(h11 * g2 - h12 * g1) / det


def beta_variational(
    alpha: Tensor, beta: Tensor, *, max_iter: int = 100, tol: float = 1e-16
) -> tuple[Tensor, Tensor]:
    """Variational matching in the logit basis (Sec. 3.3 / App. A.2): the Gaussian
    ``N(mean, var)`` minimising ``KL(q || p_psi)`` for ``psi = logit(omega)``,
    ``omega ~ Beta(alpha, beta)``; elementwise over broadcast tensors, differentiable.

    Stationarity reads ``E_q[sigmoid(psi)] = alpha/(alpha + beta)`` and
    ``1/var = (alpha + beta) E_q[sigmoid'(psi)]``. Starts from Laplace matching and stops when
    the squared Newton decrement is below ``tol`` (warns if some entry stays above 1e-8, the
    round-off floor for extreme parameters being ~1e-17).
    """
    alpha, beta = torch.broadcast_tensors(_float(alpha), _float(beta))
    with torch.no_grad():
        a, b = alpha.detach(), beta.detach()
        mu = torch.log(a / b)
        sigma = torch.sqrt((a + b) / (a * b))
        decrement = torch.full_like(a, math.inf)
        for _ in range(max_iter):
            value, g1, g2, h11, h12, h22 = _objective(mu, sigma, a, b)
            d1, d2 = _newton_direction(g1, g2, h11, h12, h22)
            slope = g1 * d1 + g2 * d2  # = -(Newton decrement)^2 <= 0 (H is positive definite)
            decrement = -slope
            active = decrement >= tol
            if not bool(active.any()):
                break
            # Backtracking (Armijo, with a round-off allowance so that converged entries keep
            # the full Newton step); entries already accepted keep their step.
            t = torch.ones_like(a)
            accepted = ~active
            for _ in range(40):
                cand_sigma = sigma + t * d2
                cand_value = _objective(mu + t * d1, cand_sigma.clamp_min(1e-300), a, b)[0]
                ok = (cand_sigma > 0) & (
                    cand_value <= value + 1e-4 * t * slope + 1e-13 * (1 + value.abs())
                )
                accepted = accepted | ok
                if bool(accepted.all()):
                    break
                t = torch.where(accepted, t, 0.5 * t)
            t = torch.where(active, t, torch.zeros_like(t))
            mu, sigma = mu + t * d1, sigma + t * d2
        if bool((decrement > 1e-8).any()):
            warnings.warn(
                f"beta_variational: Newton did not converge in {max_iter} iterations "
                f"(max squared decrement {float(decrement.max()):.2e})",
                stacklevel=2,
            )
    # One more full Newton step, with gradients on: it polishes the last digits and its
    # derivative at the optimum is the implicit-function one, -H^-1 dg/d(alpha, beta).
    _, g1, g2, h11, h12, h22 = _objective(mu, sigma, alpha, beta)
    d1, d2 = _newton_direction(g1, g2, h11, h12, h22)
    return mu + d1, (sigma + d2) ** 2


def variational_reparam(
    log_density: Callable[[Tensor], Tensor],
    mean: Tensor,
    var: Tensor,
    *,
    num_samples: int = 2000,
    max_iter: int = 200,
) -> tuple[Tensor, Tensor]:
    """Variational matching for any (unnormalised) ``log_density`` of ``psi`` by the
    reparameterisation trick (the route Sec. 3.3 names): minimise
    ``-log sigma - mean_s log p(mu + sigma z_s)`` over ``(mu, log sigma)`` with L-BFGS.

    ``log_density`` maps a tensor of ``psi`` values shaped ``(S, *mean.shape)`` to log
    densities of the same shape; ``mean``/``var`` are the starting point (e.g. Laplace
    matching), elementwise independent problems. The base samples are the ``num_samples``
    normal quantiles (stratified), so the objective is deterministic and its optimum is
    reproducible; the Monte Carlo error shrinks like ``1/num_samples``.
    """
    mean = torch.as_tensor(mean)
    probs = (torch.arange(num_samples, dtype=mean.dtype, device=mean.device) + 0.5) / num_samples
    z = torch.special.ndtri(probs).reshape(-1, *([1] * mean.ndim))
    mu = mean.detach().clone().requires_grad_(True)
    log_sigma = (0.5 * torch.as_tensor(var).to(mean).log()).detach().clone().requires_grad_(True)
    opt = torch.optim.LBFGS(
        [mu, log_sigma], max_iter=max_iter, tolerance_grad=1e-12, line_search_fn="strong_wolfe"
    )

    def closure() -> Tensor:
        opt.zero_grad()
        loss = (-log_sigma - log_density(mu + log_sigma.exp() * z).mean(0)).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return mu.detach(), (2 * log_sigma).exp().detach()
