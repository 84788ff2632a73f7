"""Discriminative VBLL classifiers with random logit noise, the ``vbll`` package's
``tDiscClassification`` and ``HetClassification``, with every covariance parameterization.

Both keep D-VBLL's independent rows ``w_k ~ q`` and add a random variance ``V_k`` to the
logits: Student-t logits (a Gamma posterior over the noise precision, the conjugate
Normal-Gamma form) or input-dependent noise ``exp(m_k^T phi)`` from a second VBLL. Jensen's
step of eq. (13) then diverges (``E[exp(V / 2)]`` is infinite for these V), so they are
trained on the deterministic bound of :func:`~gaussify.last_layer.bounds.softmax_moment_bound`
with a learnable ``gamma`` (the package's ``kn_alpha``). The predictive samples the model.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn
from torch.distributions import Gamma

from gaussify.last_layer.base import check_positive
from gaussify.last_layer.bounds import softmax_moment_bound
from gaussify.last_layer.covariance import GaussianRows
from gaussify.last_layer.noise import GammaNoise
from gaussify.last_layer.parameterization import ParameterizationName, make_covariance
from gaussify.last_layer.vbll import ClassificationHead, initial_variance, logit_predictive
from gaussify.predictive import Predictive

__all__ = ["VBLLHeteroscedasticDiscriminative", "VBLLStudentTDiscriminative"]


class _MomentBoundHead(ClassificationHead):
    """D-VBLL with random logit variance, trained on ``softmax_moment_bound`` with a learnable
    ``gamma`` (the ``vbll`` package's ``kn_alpha``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        regularization_weight: float,
        parameterization: str,
        prior_scale: float,
        cov_rank: int | None,
        softmax_bound: str,
        kn_alpha: float,
        link: str,
        num_samples: int,
    ) -> None:
        super().__init__(
            in_features, out_features, regularization_weight, prior_scale, link, num_samples
        )
        if softmax_bound != "reduced_kn":
            raise ValueError(
                f"softmax_bound: this head uses the deterministic 'reduced_kn' bound, "
                f"got {softmax_bound!r}"
            )
        if link == "bridge":
            raise ValueError("link: use 'mc' or 'probit' for heads with random logit noise")
        self.parameterization = parameterization
        self.W_mean = nn.Parameter(torch.randn(out_features, in_features) / math.sqrt(in_features))
        self.W_cov = make_covariance(
            parameterization,
            out_features,
            in_features,
            initial_variance(in_features, self.prior_scale),
            cov_rank,
        )
        self.gamma = nn.Parameter(torch.tensor(float(kn_alpha)))

    def W(self) -> GaussianRows:
        return GaussianRows(self.W_mean, self.W_cov())


class VBLLStudentTDiscriminative(_MomentBoundHead):
    """D-VBLL with Student-t logits (the ``vbll`` package's ``tDiscClassification``).

    Logits ``z_k = w_k^T phi + eps_k``, ``eps_k ~ N(0, 1 / tau_k)``, posterior ``q(tau_k) =
    Gamma(a_k, b_k)`` with ``a_k > 1`` and ``q(w_k | tau_k) = N(w_bar_k, S_k / tau_k)``, so
    ``z_k | tau_k ~ N(w_bar_k phi, V_k)``, ``V_k = c_k / tau_k``, ``c_k = phi^T S_k phi + 1``.
    The bound uses the reference ``E[V_k] = c_k b_k / (a_k - 1)`` and ``E[1 / V_k] = a_k /
    (b_k c_k)`` (with ``gamma = 1/2`` and a deterministic V it is eq. 13); the KL is that of
    the Normal-Gamma pair. ``predictive`` samples tau and the logits (``link="mc"``) or applies the
    probit link to the moment-matched logits.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        regularization_weight: float,
        parameterization: ParameterizationName = "dense",
        prior_scale: float = 1.0,
        wishart_scale: float = 1.0,
        dof: float = 2.0,
        cov_rank: int | None = None,
        softmax_bound: Literal["reduced_kn"] = "reduced_kn",
        kn_alpha: float = 0.1,
        link: Literal["mc", "probit"] = "mc",
        num_samples: int = 100,
    ) -> None:
        super().__init__(
            in_features,
            out_features,
            regularization_weight,
            parameterization,
            prior_scale,
            cov_rank,
            softmax_bound,
            kn_alpha,
            link,
            num_samples,
        )
        self.wishart_scale = check_positive(wishart_scale, "wishart_scale")
        self.dof = check_positive(dof, "dof")
        self.noise_gamma = GammaNoise(out_features, self.dof, self.wishart_scale, 1.0)

    def noise(self) -> Gamma:
        """q(tau): Gamma posterior over the logit noise precisions, batch (K,)."""
        return self.noise_gamma.distribution()

    def _moments(self, phi: Tensor) -> tuple[Tensor, Tensor]:
        mean, quad = self.W().output_moments(phi)
        return mean, quad + 1.0

    def log_likelihood_bound(self, phi: Tensor, y: Tensor) -> Tensor:
        mean, c = self._moments(phi)
        a, b = self.noise_gamma.concentration, self.noise_gamma.rate
        expected_var = c * b / (a - 1)
        return softmax_moment_bound(y, mean, expected_var, expected_var, a / (b * c), self.gamma)

    def kl(self) -> Tensor:
        a, b = self.noise_gamma.concentration, self.noise_gamma.rate
        return self.W().kl(self.prior_scale, mean_weight=a / b) + self.noise_gamma.kl()

    def predictive(self, phi: Tensor) -> Predictive:
        mean, c = self._moments(phi)
        a, b = self.noise_gamma.concentration, self.noise_gamma.rate
        samples = None
        if self.link == "mc":
            tau = self.noise().rsample((self.num_samples, mean.shape[0]))  # (S, N, K)
            samples = mean + (c / tau).sqrt() * torch.randn_like(tau)
        return logit_predictive(mean, c * b / (a - 1), self.link, self.num_samples, samples)


class VBLLHeteroscedasticDiscriminative(_MomentBoundHead):
    """D-VBLL with input-dependent logit noise (the ``vbll`` package's ``HetClassification``).

    Logits ``z_k = w_k^T phi + eps_k``, ``eps_k ~ N(0, exp(m_k^T phi))``, independent ``q(W)``
    and ``q(M)`` (one covariance per class each). Given the log noise ``s``, ``V_k = phi^T S_k
    phi + e^{s_k}`` with ``s_k ~ N(m_k, v_k)``; the bound uses the reference ``E[V_k] = phi^T
    S_k phi + exp(m_k + v_k / 2)`` and ``E[1 / V_k] <= min(1 / (phi^T S_k phi), exp(-m_k + v_k
    / 2))``.
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
        softmax_bound: Literal["reduced_kn"] = "reduced_kn",
        kn_alpha: float = 0.1,
        link: Literal["mc", "probit"] = "mc",
        num_samples: int = 100,
    ) -> None:
        super().__init__(
            in_features,
            out_features,
            regularization_weight,
            parameterization,
            prior_scale,
            cov_rank,
            softmax_bound,
            kn_alpha,
            link,
            num_samples,
        )
        self.noise_prior_scale = check_positive(noise_prior_scale, "noise_prior_scale")
        self.M_mean = nn.Parameter(torch.full((out_features, in_features), 0.0))
        self.M_cov = make_covariance(
            parameterization,
            out_features,
            in_features,
            initial_variance(in_features, self.noise_prior_scale),
            cov_rank,
        )

    def M(self) -> GaussianRows:
        """q(M): the log-noise-variance layer, one row per class."""
        return GaussianRows(self.M_mean, self.M_cov())

    def _moments(self, phi: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        mean, quad = self.W().output_moments(phi)
        m, v = self.M().output_moments(phi)
        return mean, quad, m, v

    def log_likelihood_bound(self, phi: Tensor, y: Tensor) -> Tensor:
        mean, quad, m, v = self._moments(phi)
        expected_var = quad + torch.exp(m + 0.5 * v)
        expected_inv_var = torch.minimum(quad.reciprocal(), torch.exp(-m + 0.5 * v))
        return softmax_moment_bound(
            y, mean, expected_var, expected_var, expected_inv_var, self.gamma
        )

    def kl(self) -> Tensor:
        return self.W().kl(self.prior_scale) + self.M().kl(self.noise_prior_scale)

    def predictive(self, phi: Tensor) -> Predictive:
        mean, quad, m, v = self._moments(phi)
        samples = None
        if self.link == "mc":
            eps = torch.randn(
                (2, self.num_samples, *mean.shape), dtype=mean.dtype, device=mean.device
            )
            var = quad + torch.exp(m + v.sqrt() * eps[0])
            samples = mean + var.sqrt() * eps[1]
        return logit_predictive(
            mean, quad + torch.exp(m + 0.5 * v), self.link, self.num_samples, samples
        )
