"""VBLL regression heads (Harrison, Willes & Snoek 2024, Sec. 3.1, App. A, and the ``vbll``
package's other regression heads, derived from the paper's lemmas).

* :class:`VBLLRegression` -- ``y = W phi + eps``, ``eps ~ N(0, Sigma)``, q(W) = MN(W_bar, I, S);
  objective eq. (12)/(16); predictive eq. (1)/(17), ``N(W_bar phi, phi^T S phi I + Sigma)``;
  Sigma a MAP estimate under the inverse-Wishart prior (App. C.3).
* :class:`VBLLStudentTRegression` -- the noise precision is inferred, not point-estimated:
  ``tau_c ~ Gamma(a_c, b_c)`` with the conjugate Normal-Gamma posterior ``w_c | tau_c ~
  N(w_bar_c, S / tau_c)``; the predictive is a Student-t.
* :class:`VBLLHeteroscedasticRegression` -- a second VBLL ``M`` for the log noise variance,
  ``sigma_c^2(x) = exp(m_c^T phi)``.

``prior_scale`` is the prior *variance* s of ``S_0 = s I`` as in the paper (the ``vbll``
package divides its ``prior_scale`` by the feature width). :class:`VBLLRegression` defaults to
``s = 1 / in_features``: the prior on the *function* ``w^T phi ~ N(0, ||phi||^2 / D)`` then has
unit variance for features of unit mean square, matching standardised targets whatever the
width -- the prior behind the paper's UCI numbers (its code's ``prior_scale=1`` is ``1 / D``).
The noise precisions of the Student-t head have the prior ``Gamma(dof / 2, wishart_scale /
2)`` -- the one-dimensional inverse-Wishart ``W^-1(dof, wishart_scale)`` of App. C.3 on each
variance, so the arguments mean what they mean for the Gaussian heads.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.distributions import StudentT

from gaussify.last_layer.base import (
    LogNoiseLayer,
    NormalGammaNoise,
    RegressionHead,
    WishartNoise,
    check_positive,
)
from gaussify.last_layer.bounds import (
    heteroscedastic_expected_loglik,
    regression_bound,
    student_t_expected_loglik,
)
from gaussify.last_layer.noise import GammaNoise, NoiseCovariance, NoiseStructure
from gaussify.last_layer.parameterization import ParameterizationName
from gaussify.predictive import Predictive
from gaussify.validation import check_count

__all__ = [
    "VBLLHeteroscedasticRegression",
    "VBLLRegression",
    "VBLLStudentTRegression",
    "default_prior_scale",
]


def default_prior_scale(in_features: Any) -> float:
    """The default prior variance of a regression head's weights, ``1 / in_features``: the
    prior function variance ``||phi||^2 / D`` is then the mean square feature (App. C.5's
    ``N(0, I)`` on normalised features, as in the authors' code)."""
    in_features = check_count(in_features, "in_features")
    return 1.0 / in_features


class _SharedRowsRegression(RegressionHead):
    """A regression head whose rows share one covariance: q(W) = MN(W_bar, I, S)."""

    def _moments(self, phi: Tensor) -> tuple[Tensor, Tensor]:
        """``W_bar phi`` (N, C) and ``phi^T S phi`` (N,)."""
        return phi @ self.W_mean.mT, self.W_cov().quad_form(phi)[..., 0]

    def ood_score(self, phi: Tensor) -> Tensor:
        """Epistemic variance ``phi^T S phi``."""
        return self._moments(phi)[1]


class VBLLRegression(WishartNoise, _SharedRowsRegression):
    """Variational Bayesian last layer for (multivariate) regression (Sec. 3.1, App. A).

    ``forward(phi (N, in_features))`` returns a :class:`~gaussify.last_layer.VBLLOutput` whose
    ``predictive`` is a regression :class:`~gaussify.Predictive` (eq. 17, with the full noise
    covariance in ``noise_cov``) and whose ``train_loss(y)`` is the negative regularised ELBO
    of eq. (16) per example. ``W()`` is q(W) (one covariance S shared by the output rows),
    ``noise()`` the MAP noise covariance Sigma (``noise_parameterization`` ``"dense"`` --
    correlated outputs -- or ``"diagonal"``).

    ``prior_scale`` (the variance s of ``p(W) = MN(0, I, s I)``) defaults to ``1 /
    in_features``, so that the prior function variance ``s ||phi||^2`` is O(1) for standardised
    targets at any width. With joint (MAP) feature learning the prior is the only regulariser
    of the output layer: a weaker one (``s = 1`` at ``D = 50`` is 50 times weaker) lets the
    features fit the training targets further, and the MAP noise Sigma -- which tracks the
    training residuals plus ``phi^T S phi`` (eq. 12) -- then under-estimates the test error.
    """

    def __init__(
        self, in_features: int, out_features: int, regularization_weight: float,
        parameterization: ParameterizationName = "dense", prior_scale: float | None = None,
        wishart_scale: float = 1.0, dof: float = 1.0, cov_rank: int | None = None,
        noise_parameterization: NoiseStructure = "dense", init_noise_var: float = 1.0,
    ) -> None:  # fmt: skip
        if prior_scale is None:
            prior_scale = default_prior_scale(in_features)
        super().__init__(in_features, out_features, regularization_weight, prior_scale)
        self.set_wishart_prior(wishart_scale, dof)
        init_noise_var = check_positive(init_noise_var, "init_noise_var")
        self.add_gaussian_rows(
            "W", self.random_rows(), 1, parameterization, self.prior_scale, cov_rank
        )
        self.noise_cov = NoiseCovariance(out_features, noise_parameterization, init_noise_var)

    def log_likelihood_bound(self, phi: Tensor, y: Tensor) -> Tensor:
        mean, quad = self._moments(phi)
        return regression_bound(
            self.noise_cov.log_prob(y - mean), quad, self.noise_cov.trace_precision
        )

    def predictive(self, phi: Tensor) -> Predictive:
        """Eq. (17): ``N(W_bar phi, phi^T S phi I + Sigma)``."""
        mean, quad = self._moments(phi)
        eye = torch.eye(self.out_features, dtype=mean.dtype, device=mean.device)
        sigma = self.noise_cov.covariance
        return Predictive(
            "regression",
            mean,
            f_cov=quad[:, None, None] * eye,
            noise_var=sigma.diagonal(),
            noise_cov=sigma,
        )

    def log_prob(self, phi: Tensor, y: Tensor) -> Tensor:
        return self.predictive(phi).log_prob(y)


class VBLLStudentTRegression(NormalGammaNoise, _SharedRowsRegression):
    """VBLL regression with the noise precision inferred (the ``vbll`` package's ``tRegression``).

    Model: ``y_c = w_c^T phi + eps_c``, ``eps_c ~ N(0, 1 / tau_c)``; prior ``tau_c ~ Gamma(dof/2,
    wishart_scale/2)``, ``w_c | tau_c ~ N(0, prior_scale / tau_c I)``; posterior
    ``q(tau_c) = Gamma(a_c, b_c)``, ``q(w_c | tau_c) = N(w_bar_c, S / tau_c)`` with S shared.
    The bound is the exact expected log-likelihood
    (:func:`~gaussify.last_layer.bounds.student_t_expected_loglik`), and the predictive is the
    exact marginal over tau: ``StudentT(df = 2 a_c, loc = w_bar_c phi, scale^2 = (phi^T S phi + 1)
    b_c / a_c)`` (a ``torch.distributions.StudentT`` with batch shape (N, C));
    ``to_predictive()`` moment-matches it (finite variance needs ``a_c > 1``). ``W()`` is
    q(W | tau = 1): given tau_c the covariance of row c is ``S / tau_c``.
    """

    def __init__(
        self, in_features: int, out_features: int, regularization_weight: float,
        parameterization: ParameterizationName = "dense", prior_scale: float = 1.0,
        wishart_scale: float = 1.0, dof: float = 1.0, cov_rank: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(in_features, out_features, regularization_weight, prior_scale)
        self.wishart_scale = check_positive(wishart_scale, "wishart_scale")
        self.dof = check_positive(dof, "dof")
        self.add_gaussian_rows(
            "W", self.random_rows(), 1, parameterization, self.prior_scale, cov_rank
        )
        self.noise_gamma = GammaNoise(out_features, self.dof, self.wishart_scale)

    def log_likelihood_bound(self, phi: Tensor, y: Tensor) -> Tensor:
        mean, quad = self._moments(phi)
        return student_t_expected_loglik(
            y, mean, quad, self.noise_gamma.concentration, self.noise_gamma.rate
        )

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


# Gauss-Hermite nodes for integrals over the Gaussian log noise variance
_GH_NODES, _GH_WEIGHTS = np.polynomial.hermite.hermgauss(48)


class VBLLHeteroscedasticRegression(LogNoiseLayer, RegressionHead):
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
        self, in_features: int, out_features: int, regularization_weight: float,
        parameterization: ParameterizationName = "dense", prior_scale: float = 1.0,
        noise_prior_scale: float = 0.01, cov_rank: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__(in_features, out_features, regularization_weight, prior_scale)
        self.noise_prior_scale = check_positive(noise_prior_scale, "noise_prior_scale")
        self.add_gaussian_rows(
            "W", self.random_rows(), 1, parameterization, self.prior_scale, cov_rank
        )
        zeros = torch.zeros(out_features, in_features)
        self.add_gaussian_rows("M", zeros, 1, parameterization, self.noise_prior_scale, cov_rank)

    def log_likelihood_bound(self, phi: Tensor, y: Tensor) -> Tensor:
        return heteroscedastic_expected_loglik(y, *self._moments(phi))

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
