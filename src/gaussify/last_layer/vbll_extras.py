"""The other heads of the ``vbll`` package, derived from the paper's lemmas, every one with every
covariance parameterization (the package supports them unevenly).

* :class:`VBLLStudentTRegression` -- the noise precision is inferred, not point-estimated:
  ``tau_c ~ Gamma(a_c, b_c)`` with the conjugate Normal-Gamma posterior ``w_c | tau_c ~
  N(w_bar_c, S / tau_c)``; the predictive is a Student-t.
* :class:`VBLLHeteroscedasticRegression` -- a second VBLL ``M`` for the log noise variance,
  ``sigma_c^2(x) = exp(m_c^T phi)``.
* :class:`VBLLStudentTDiscriminative` / :class:`VBLLHeteroscedasticDiscriminative` -- D-VBLL
  with Gamma-distributed (Student-t logits) or input-dependent logit noise, trained on the
  deterministic bound of :func:`~gaussify.last_layer.bounds.softmax_moment_bound` (in
  :mod:`gaussify.last_layer.vbll_extras_discriminative`).

Priors: the weights ``N(0, prior_scale I)`` (scaled by 1/tau in the Normal-Gamma heads), the
log-noise layer ``N(0, noise_prior_scale I)``, the noise precisions ``Gamma(dof / 2,
wishart_scale / 2)`` -- the one-dimensional inverse-Wishart ``W^-1(dof, wishart_scale)`` of
App. C.3 on each variance, so the arguments mean what they mean for the Gaussian heads.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributions import Gamma, StudentT

from gaussify.last_layer.base import check_positive
from gaussify.last_layer.bounds import heteroscedastic_expected_loglik, student_t_expected_loglik
from gaussify.last_layer.covariance import GaussianRows
from gaussify.last_layer.noise import GammaNoise
from gaussify.last_layer.parameterization import ParameterizationName, make_covariance
from gaussify.last_layer.vbll import RegressionHead, initial_variance

# the discriminative extras live in their own module; re-exported here
from gaussify.last_layer.vbll_extras_discriminative import (
    VBLLHeteroscedasticDiscriminative,
    VBLLStudentTDiscriminative,
)
from gaussify.predictive import Predictive

__all__ = [
    "VBLLHeteroscedasticDiscriminative",
    "VBLLHeteroscedasticRegression",
    "VBLLStudentTDiscriminative",
    "VBLLStudentTRegression",
]


class VBLLStudentTRegression(RegressionHead):
    """VBLL regression with the noise precision inferred (the ``vbll`` package's ``tRegression``).

    Model: ``y_c = w_c^T phi + eps_c``, ``eps_c ~ N(0, 1 / tau_c)``; prior ``tau_c ~ Gamma(dof/2,
    wishart_scale/2)``, ``w_c | tau_c ~ N(0, prior_scale / tau_c I)``; posterior
    ``q(tau_c) = Gamma(a_c, b_c)``, ``q(w_c | tau_c) = N(w_bar_c, S / tau_c)`` with S shared.
    The bound is the exact expected log-likelihood
    (:func:`~gaussify.last_layer.bounds.student_t_expected_loglik`), and the predictive is the
    exact marginal over tau: ``StudentT(df = 2 a_c, loc = w_bar_c phi, scale^2 = (phi^T S phi + 1)
    b_c / a_c)`` (a ``torch.distributions.StudentT`` with batch shape (N, C));
    ``to_predictive()`` moment-matches it (finite variance needs ``a_c > 1``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        regularization_weight: float,
        parameterization: ParameterizationName = "dense",
        prior_scale: float = 1.0,
        wishart_scale: float = 1.0,
        dof: float = 1.0,
        cov_rank: int | None = None,
    ) -> None:
        super().__init__(in_features, out_features, regularization_weight, prior_scale)
        self.wishart_scale = check_positive(wishart_scale, "wishart_scale")
        self.dof = check_positive(dof, "dof")
        self.parameterization = parameterization
        self.W_mean = nn.Parameter(torch.randn(out_features, in_features) / math.sqrt(in_features))
        self.W_cov = make_covariance(
            parameterization,
            1,
            in_features,
            initial_variance(in_features, self.prior_scale),
            cov_rank,
        )
        self.noise_gamma = GammaNoise(out_features, self.dof, self.wishart_scale)

    def W(self) -> GaussianRows:
        """q(W | tau = 1): rows ``N(w_bar_c, S)``; given tau_c the covariance is ``S / tau_c``."""
        return GaussianRows(self.W_mean, self.W_cov())

    def noise(self) -> Gamma:
        """q(tau): Gamma posterior over the noise precisions, batch (C,)."""
        return self.noise_gamma.distribution()

    def _moments(self, phi: Tensor) -> tuple[Tensor, Tensor]:
        return phi @ self.W_mean.mT, self.W_cov().quad_form(phi)[..., 0]

    def log_likelihood_bound(self, phi: Tensor, y: Tensor) -> Tensor:
        mean, quad = self._moments(phi)
        return student_t_expected_loglik(
            y, mean, quad, self.noise_gamma.concentration, self.noise_gamma.rate
        )

    def kl(self) -> Tensor:
        a, b = self.noise_gamma.concentration, self.noise_gamma.rate
        return self.W().kl(self.prior_scale, mean_weight=a / b) + self.noise_gamma.kl()

    def predictive(self, phi: Tensor) -> StudentT:
        mean, quad = self._moments(phi)
        a, b = self.noise_gamma.concentration, self.noise_gamma.rate
        scale = ((quad.unsqueeze(-1) + 1.0) * b / a).sqrt()
        return StudentT(2.0 * a.expand_as(mean), mean, scale)

    def to_predictive(self, phi: Tensor) -> Predictive:
        """Moment-matched Gaussian: latent variance ``phi^T S phi b / (a - 1)``, noise
        variance ``b / (a - 1)`` (infinite when ``a <= 1``)."""
        mean, quad = self._moments(phi)
        a, b = self.noise_gamma.concentration, self.noise_gamma.rate
        noise_var = torch.where(a > 1, b / (a - 1), torch.full_like(a, math.inf))
        return Predictive(
            "regression",
            mean,
            f_cov=torch.diag_embed(quad.unsqueeze(-1) * noise_var),
            noise_var=noise_var,
        )

    def log_prob(self, phi: Tensor, y: Tensor) -> Tensor:
        return self.predictive(phi).log_prob(y).sum(-1)

    def ood_score(self, phi: Tensor) -> Tensor:
        """``phi^T S phi`` (the epistemic part of the scale)."""
        return self._moments(phi)[1]


# Gauss-Hermite nodes for integrals over the Gaussian log noise variance
_GH_NODES, _GH_WEIGHTS = np.polynomial.hermite.hermgauss(48)


class VBLLHeteroscedasticRegression(RegressionHead):
    """VBLL regression with input-dependent noise (the ``vbll`` package's ``HetRegression``).

    ``y_c = w_c^T phi + eps_c``, ``eps_c ~ N(0, exp(m_c^T phi))``, independent posteriors
    ``q(W) = MN(W_bar, I, S_W)`` and ``q(M) = MN(M_bar, I, S_M)`` against ``N(0, prior_scale
    I)`` and ``N(0, noise_prior_scale I)``. The bound is the exact expected log-likelihood
    (:func:`~gaussify.last_layer.bounds.heteroscedastic_expected_loglik`). The predictive is a
    :class:`~gaussify.Predictive` with ``task="heteroscedastic"`` (latent mean and log variance
    with their variances; its ``var`` is the exact predictive variance ``phi^T S_W phi +
    exp(m + v/2)``); ``log_prob`` integrates the log variance by 48-node Gauss-Hermite
    quadrature. ``M()`` is q(M).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        regularization_weight: float,
        parameterization: ParameterizationName = "dense",
        prior_scale: float = 1.0,
        noise_prior_scale: float = 0.01,
        cov_rank: int | None = None,
    ) -> None:
        super().__init__(in_features, out_features, regularization_weight, prior_scale)
        self.noise_prior_scale = check_positive(noise_prior_scale, "noise_prior_scale")
        self.parameterization = parameterization
        self.W_mean = nn.Parameter(torch.randn(out_features, in_features) / math.sqrt(in_features))
        self.W_cov = make_covariance(
            parameterization,
            1,
            in_features,
            initial_variance(in_features, self.prior_scale),
            cov_rank,
        )
        self.M_mean = nn.Parameter(torch.zeros(out_features, in_features))
        self.M_cov = make_covariance(
            parameterization,
            1,
            in_features,
            initial_variance(in_features, self.noise_prior_scale),
            cov_rank,
        )

    def W(self) -> GaussianRows:
        return GaussianRows(self.W_mean, self.W_cov())

    def M(self) -> GaussianRows:
        """q(M): the log-noise-variance layer."""
        return GaussianRows(self.M_mean, self.M_cov())

    def _moments(self, phi: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        mean, quad = self.W().output_moments(phi)
        log_noise_mean, log_noise_var = self.M().output_moments(phi)
        return mean, quad, log_noise_mean, log_noise_var

    def log_likelihood_bound(self, phi: Tensor, y: Tensor) -> Tensor:
        return heteroscedastic_expected_loglik(y, *self._moments(phi))

    def kl(self) -> Tensor:
        return self.W().kl(self.prior_scale) + self.M().kl(self.noise_prior_scale)

    def predictive(self, phi: Tensor) -> Predictive:
        mean, quad, m, v = self._moments(phi)
        return Predictive(
            "heteroscedastic",
            torch.cat([mean, m], dim=-1),
            f_cov=torch.diag_embed(torch.cat([quad, v], dim=-1)),
        )

    def log_prob(self, phi: Tensor, y: Tensor) -> Tensor:
        """``log int N(y | w_bar phi, phi^T S_W phi + e^s) N(s | m, v) ds`` per output, summed
        (outputs are independent given phi), by Gauss-Hermite quadrature."""
        mean, quad, m, v = self._moments(phi)
        nodes = torch.as_tensor(_GH_NODES, dtype=mean.dtype, device=mean.device)
        log_w = torch.as_tensor(np.log(_GH_WEIGHTS), dtype=mean.dtype, device=mean.device)
        s = m.unsqueeze(-1) + (2.0 * v).sqrt().unsqueeze(-1) * nodes  # (N, C, Q)
        var = quad.unsqueeze(-1) + s.exp()
        logpdf = -0.5 * (
            math.log(2 * math.pi) + var.log() + (y - mean).unsqueeze(-1).square() / var
        )
        return (torch.logsumexp(logpdf + log_w, dim=-1) - 0.5 * math.log(math.pi)).sum(-1)

    def ood_score(self, phi: Tensor) -> Tensor:
        """Epistemic variance ``phi^T S_W phi``."""
        return self._moments(phi)[1][..., 0]
