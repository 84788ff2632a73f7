"""Point-estimated noise covariance of a VBLL head and its inverse-Wishart prior.

The noise covariance Sigma is a MAP estimate (Harrison et al. 2024, App. C.1/C.3). Following
the paper's "mixed" parameterization (App. D) the module stores the Cholesky factor of the
*precision*, ``Sigma^-1 = L L^T`` with ``L = tril(L_d, -1) + diag(exp(m))`` (eq. 78), so the
Gaussian log density needs ``||L^T e||^2`` (eq. 79) and ``tr(Sigma^-1) = ||L||_F^2`` (eq. 80)
-- no inverse, no solve. ``structure="diagonal"`` keeps ``L`` diagonal (the assumption of
Sec. 3.2 for classification and of App. D.2 for generative classification).

:class:`GammaNoise` is the alternative of the ``vbll`` package's Student-t heads: a Gamma
*variational posterior* over noise precisions instead of a point estimate.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn
from torch.distributions import Gamma, kl_divergence

from gaussify.last_layer.covariance import DensePrecision, Diagonal, StructuredCovariance

__all__ = ["GammaNoise", "NoiseCovariance", "NoiseStructure", "inverse_wishart_log_prior"]

NoiseStructure = Literal["dense", "diagonal"]


def inverse_wishart_log_prior(
    logdet_precision: Tensor, trace_precision: Tensor, dim: int, dof: float, scale: float
) -> Tensor:
    """log W^-1(Sigma | nu, M = m I) up to its constant (App. C.3, eq. 65):

    ``(nu + N + 1) / 2 logdet Sigma^-1 - m / 2 tr(Sigma^-1)``.

    On diagonal matrices this is a product of inverse-Gamma densities with shape
    ``(nu + N - 1) / 2`` and scale ``m / 2`` (the paper's diagonal alternative).
    """
    return 0.5 * (dof + dim + 1.0) * logdet_precision - 0.5 * scale * trace_precision


class NoiseCovariance(nn.Module):
    """Sigma (dim x dim) through the Cholesky factor of its precision (App. D, eq. 78).

    Initialised at ``init_var * I``. ``structured()`` gives Sigma as a
    :class:`~gaussify.last_layer.covariance.StructuredCovariance` (``DensePrecision`` or
    ``Diagonal``) for the generative head's ``Sigma + S_k``.
    """

    def __init__(self, dim: int, structure: NoiseStructure = "dense", init_var: float = 1.0):
        super().__init__()
        if structure not in ("dense", "diagonal"):
            raise ValueError(
                f"noise_parameterization: expected 'dense' or 'diagonal', got {structure!r}"
            )
        self.dim, self.structure = dim, structure
        self.logdiag = nn.Parameter(torch.full((dim,), -0.5 * math.log(init_var)))
        if structure == "dense":
            self.offdiag = nn.Parameter(torch.zeros(dim, dim))

    @property
    def precision_tril(self) -> Tensor:
        """L with Sigma^-1 = L L^T, (dim, dim)."""
        diag = torch.diag_embed(self.logdiag.exp())
        if self.structure == "diagonal":
            return diag
        return torch.tril(self.offdiag, diagonal=-1) + diag

    @property
    def precision(self) -> Tensor:
        tril = self.precision_tril
        return tril @ tril.mT

    @property
    def covariance(self) -> Tensor:
        """Sigma, (dim, dim)."""
        if self.structure == "diagonal":
            return torch.diag_embed(self.variance)
        return torch.cholesky_inverse(self.precision_tril)

    @property
    def variance(self) -> Tensor:
        """diag(Sigma), (dim,)."""
        if self.structure == "diagonal":
            return torch.exp(-2.0 * self.logdiag)
        return self.covariance.diagonal()

    @property
    def logdet_precision(self) -> Tensor:
        return 2.0 * self.logdiag.sum()

    @property
    def trace_precision(self) -> Tensor:
        """tr(Sigma^-1) = ||L||_F^2 (eq. 80)."""
        if self.structure == "diagonal":
            return torch.exp(2.0 * self.logdiag).sum()
        return self.precision_tril.square().sum()

    def mahalanobis(self, e: Tensor) -> Tensor:
        """e^T Sigma^-1 e = ||L^T e||^2 for ``e (..., dim)`` (eq. 79): (...,)."""
        if self.structure == "diagonal":
            return (e * self.logdiag.exp()).square().sum(-1)
        return (e @ self.precision_tril).square().sum(-1)

    def log_prob(self, e: Tensor) -> Tensor:
        """log N(e | 0, Sigma) for residuals ``e (..., dim)``: (...,)."""
        return -0.5 * (
            self.dim * math.log(2 * math.pi) - self.logdet_precision + self.mahalanobis(e)
        )

    def trace_product(self, cov: StructuredCovariance) -> Tensor:
        """tr(Sigma^-1 S_k) for each block of ``cov``: (K,). O(K D) for diagonal noise."""
        if self.structure == "diagonal":
            return cov.diagonal @ torch.exp(2.0 * self.logdiag)
        return (cov.covariance * self.precision).sum((-2, -1))

    def structured(self) -> StructuredCovariance:
        """Sigma as a one-block structured covariance."""
        if self.structure == "diagonal":
            return Diagonal(self.variance.unsqueeze(0))
        return DensePrecision(self.precision_tril.unsqueeze(0))

    def log_prior(self, dof: float, scale: float) -> Tensor:
        """The inverse-Wishart log prior of Sigma (eq. 65)."""
        return inverse_wishart_log_prior(
            self.logdet_precision, self.trace_precision, self.dim, dof, scale
        )

    @torch.no_grad()
    def set_covariance(self, cov: Tensor) -> None:
        """Set Sigma from a dense ``(dim, dim)`` matrix (its diagonal for ``"diagonal"``)."""
        cov = cov.to(self.logdiag)
        if self.structure == "diagonal":
            self.logdiag.copy_(-0.5 * cov.diagonal().log())
            return
        tril = torch.linalg.cholesky(torch.linalg.inv(cov))
        self.logdiag.copy_(tril.diagonal().log())
        self.offdiag.copy_(torch.tril(tril, diagonal=-1))


class GammaNoise(nn.Module):
    """q(tau) = prod_c Gamma(a_c, b_c) over noise precisions with a Gamma(dof/2, scale/2) prior.

    ``min_concentration`` keeps ``a > min_concentration`` (``a > 1`` makes E[1/tau] finite).
    Initialised at the prior's mean precision with ``a = max(prior a, 1 + min)``.
    """

    def __init__(self, dim: int, dof: float, wishart_scale: float, min_concentration: float = 0.0):
        super().__init__()
        self.prior_concentration, self.prior_rate = 0.5 * dof, 0.5 * wishart_scale
        self.min_concentration = min_concentration
        a0 = max(self.prior_concentration, 1.0 + min_concentration)
        b0 = a0 * self.prior_rate / self.prior_concentration
        self.log_concentration = nn.Parameter(torch.full((dim,), math.log(a0 - min_concentration)))
        self.log_rate = nn.Parameter(torch.full((dim,), math.log(b0)))

    @property
    def concentration(self) -> Tensor:
        return self.min_concentration + self.log_concentration.exp()

    @property
    def rate(self) -> Tensor:
        return self.log_rate.exp()

    def distribution(self) -> Gamma:
        return Gamma(self.concentration, self.rate)

    def kl(self) -> Tensor:
        a = self.concentration
        prior = Gamma(
            torch.full_like(a, self.prior_concentration), torch.full_like(a, self.prior_rate)
        )
        return kl_divergence(self.distribution(), prior).sum()
