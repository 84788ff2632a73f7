"""Discriminative VBLL classifiers (Harrison, Willes & Snoek 2024, Sec. 2.2, 3.2): softmax of
logits ``z = W phi + eps`` with independent rows ``w_k ~ N(w_bar_k, S_k)``.

* :class:`VBLLDiscriminative` -- D-VBLL: diagonal logit noise ``sigma_k^2``, a MAP estimate
  under the inverse-Wishart prior; objective eq. (13); predictive ``E[softmax(z)]`` by sampling
  (App. C.6) or a deterministic link approximation.
* :class:`VBLLStudentTDiscriminative` / :class:`VBLLHeteroscedasticDiscriminative` -- the
  ``vbll`` package's ``tDiscClassification`` and ``HetClassification``: a random variance
  ``V_k`` on the logits, Student-t (a Gamma posterior over the noise precision, the conjugate
  Normal-Gamma form) or input-dependent ``exp(m_k^T phi)`` from a second VBLL. Jensen's step
  of eq. (13) then diverges (``E[exp(V / 2)]`` is infinite for these V), so they are trained on
  the deterministic bound of :func:`~gaussify.last_layer.bounds.softmax_moment_bound` with a
  learnable ``gamma`` (the package's ``kn_alpha``). The predictive samples the model.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from gaussify.last_layer.base import (
    ClassificationHead,
    LogNoiseLayer,
    NormalGammaNoise,
    WishartNoise,
    check_positive,
)
from gaussify.last_layer.bounds import discriminative_bound, softmax_moment_bound
from gaussify.last_layer.noise import GammaNoise, NoiseCovariance
from gaussify.last_layer.parameterization import ParameterizationName
from gaussify.predictive import LINKS, Predictive

__all__ = [
    "VBLLDiscriminative",
    "VBLLHeteroscedasticDiscriminative",
    "VBLLStudentTDiscriminative",
    "logit_predictive",
]

LinkName = Literal["mc", "probit", "bridge"]


def logit_predictive(
    mean: Tensor,
    var: Tensor,
    link: str,
    num_samples: int,
    samples: Tensor | None = None,
) -> Predictive:
    """Classification predictive from independent logits with ``mean, var (N, K)``.

    ``link="mc"`` averages the softmax over ``samples (S, N, K)`` (drawn from N(mean, var)
    when not given; App. C.6); ``"probit"`` / ``"bridge"`` use the library's deterministic
    link approximations on the diagonal Gaussian.
    """
    f_cov = torch.diag_embed(var)
    if link == "mc":
        if samples is None:
            eps = torch.randn((num_samples, *mean.shape), dtype=mean.dtype, device=mean.device)
            samples = mean + var.sqrt() * eps
        probs = torch.softmax(samples, dim=-1).mean(0)
    else:
        probs = LINKS[link](mean, f_cov, "classification", num_samples, None)
    return Predictive("classification", mean, f_cov=f_cov, probs=probs)


def _require_bound(softmax_bound: str, expected: str, says: str) -> None:
    """Refuse a ``softmax_bound`` other than the one the head is trained on."""
    if softmax_bound != expected:
        raise ValueError(f"softmax_bound: {says} {softmax_bound!r}")


class _RowsClassifier(ClassificationHead):
    """A classifier with independent rows ``w_k ~ N(w_bar_k, S_k)`` (one covariance per
    class)."""

    def _add_rows(self, parameterization: str, cov_rank: int | None) -> None:
        self.add_gaussian_rows(
            "W", self.random_rows(), self.out_features, parameterization, self.prior_scale, cov_rank
        )


class VBLLDiscriminative(WishartNoise, _RowsClassifier):
    """Discriminative VBLL classifier (D-VBLL, Sec. 3.2): softmax of ``W phi + eps`` with
    independent rows ``w_k ~ N(w_bar_k, S_k)`` and diagonal logit noise ``sigma_k^2``.

    ``train_loss(y)`` is eq. (13) plus the KL and the inverse-Wishart (inverse-Gamma per class)
    prior on sigma^2. ``predictive`` averages the softmax over ``num_samples`` logit samples
    (``link="mc"``, App. C.6) or applies ``"probit"`` / ``"bridge"`` deterministically.
    """

    def __init__(
        self, in_features: int, out_features: int, regularization_weight: float,
        parameterization: ParameterizationName = "dense", prior_scale: float = 1.0,
        wishart_scale: float = 1.0, dof: float = 1.0, cov_rank: int | None = None,
        softmax_bound: Literal["jensen"] = "jensen", link: LinkName = "mc",
        num_samples: int = 100, init_noise_var: float = 0.1,
    ) -> None:  # fmt: skip
        super().__init__(in_features, out_features, regularization_weight, prior_scale, link,
                         num_samples)  # fmt: skip
        _require_bound(softmax_bound, "jensen", "D-VBLL uses eq. (13), 'jensen'; got")
        self.set_wishart_prior(wishart_scale, dof)
        init_noise_var = check_positive(init_noise_var, "init_noise_var")
        self._add_rows(parameterization, cov_rank)
        self.noise_cov = NoiseCovariance(out_features, "diagonal", init_noise_var)

    def logit_moments(self, phi: Tensor) -> tuple[Tensor, Tensor]:
        """Mean ``W_bar phi`` and variance ``phi^T S_k phi + sigma_k^2`` of the logits, (N, K)."""
        mean, quad = self.W().output_moments(phi)
        return mean, quad + self.noise_cov.variance

    def log_likelihood_bound(self, phi: Tensor, y: Tensor) -> Tensor:
        return discriminative_bound(y, *self.logit_moments(phi))

    def predictive(self, phi: Tensor) -> Predictive:
        mean, var = self.logit_moments(phi)
        return logit_predictive(mean, var, self.link, self.num_samples)


class _MomentBoundHead(_RowsClassifier):
    """D-VBLL with random logit variance, trained on ``softmax_moment_bound`` with a learnable
    ``gamma`` (the ``vbll`` package's ``kn_alpha``)."""

    def __init__(
        self, in_features: int, out_features: int, regularization_weight: float,
        parameterization: str, prior_scale: float, cov_rank: int | None, softmax_bound: str,
        kn_alpha: float, link: str, num_samples: int,
    ) -> None:  # fmt: skip
        super().__init__(in_features, out_features, regularization_weight, prior_scale, link,
                         num_samples)  # fmt: skip
        _require_bound(
            softmax_bound, "reduced_kn", "this head uses the deterministic 'reduced_kn' bound, got"
        )
        if link == "bridge":
            raise ValueError("link: use 'mc' or 'probit' for heads with random logit noise")
        self._add_rows(parameterization, cov_rank)
        self.gamma = nn.Parameter(torch.tensor(float(kn_alpha)))


class VBLLStudentTDiscriminative(NormalGammaNoise, _MomentBoundHead):
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
        self, in_features: int, out_features: int, regularization_weight: float,
        parameterization: ParameterizationName = "dense", prior_scale: float = 1.0,
        wishart_scale: float = 1.0, dof: float = 2.0, cov_rank: int | None = None,
        softmax_bound: Literal["reduced_kn"] = "reduced_kn", kn_alpha: float = 0.1,
        link: Literal["mc", "probit"] = "mc", num_samples: int = 100,
    ) -> None:  # fmt: skip
        super().__init__(in_features, out_features, regularization_weight, parameterization,
            prior_scale, cov_rank, softmax_bound, kn_alpha, link, num_samples)  # fmt: skip
        self.wishart_scale = check_positive(wishart_scale, "wishart_scale")
        self.dof = check_positive(dof, "dof")
        self.noise_gamma = GammaNoise(out_features, self.dof, self.wishart_scale, 1.0)

    def _moments(self, phi: Tensor) -> tuple[Tensor, Tensor]:
        mean, quad = self.W().output_moments(phi)
        return mean, quad + 1.0

    def log_likelihood_bound(self, phi: Tensor, y: Tensor) -> Tensor:
        mean, c = self._moments(phi)
        a, b = self.noise_gamma.concentration, self.noise_gamma.rate
        expected_var = c * b / (a - 1)
        return softmax_moment_bound(y, mean, expected_var, expected_var, a / (b * c), self.gamma)

    def predictive(self, phi: Tensor) -> Predictive:
        mean, c = self._moments(phi)
        a, b = self.noise_gamma.concentration, self.noise_gamma.rate
        samples = None
        if self.link == "mc":
            tau = self.noise().rsample((self.num_samples, mean.shape[0]))  # (S, N, K)
            samples = mean + (c / tau).sqrt() * torch.randn_like(tau)
        return logit_predictive(mean, c * b / (a - 1), self.link, self.num_samples, samples)


class VBLLHeteroscedasticDiscriminative(LogNoiseLayer, _MomentBoundHead):
    """D-VBLL with input-dependent logit noise (the ``vbll`` package's ``HetClassification``).

    Logits ``z_k = w_k^T phi + eps_k``, ``eps_k ~ N(0, exp(m_k^T phi))``, independent ``q(W)``
    and ``q(M)`` (one covariance per class each). Given the log noise ``s``, ``V_k = phi^T S_k
    phi + e^{s_k}`` with ``s_k ~ N(m_k, v_k)``; the bound uses the reference ``E[V_k] = phi^T
    S_k phi + exp(m_k + v_k / 2)`` and ``E[1 / V_k] <= min(1 / (phi^T S_k phi), exp(-m_k + v_k
    / 2))``.
    """

    def __init__(
        self, in_features: int, out_features: int, regularization_weight: float,
        parameterization: ParameterizationName = "dense", prior_scale: float = 1.0,
        noise_prior_scale: float = 0.01, cov_rank: int | None = None,
        softmax_bound: Literal["reduced_kn"] = "reduced_kn", kn_alpha: float = 0.1,
        link: Literal["mc", "probit"] = "mc", num_samples: int = 100,
    ) -> None:  # fmt: skip
        super().__init__(in_features, out_features, regularization_weight, parameterization,
            prior_scale, cov_rank, softmax_bound, kn_alpha, link, num_samples)  # fmt: skip
        self.noise_prior_scale = check_positive(noise_prior_scale, "noise_prior_scale")
        zeros = torch.zeros(out_features, in_features)
        self.add_gaussian_rows(
            "M", zeros, out_features, parameterization, self.noise_prior_scale, cov_rank
        )

    def log_likelihood_bound(self, phi: Tensor, y: Tensor) -> Tensor:
        mean, quad, m, v = self._moments(phi)
        expected_var = quad + torch.exp(m + 0.5 * v)
        expected_inv_var = torch.minimum(quad.reciprocal(), torch.exp(-m + 0.5 * v))
        return softmax_moment_bound(
            y, mean, expected_var, expected_var, expected_inv_var, self.gamma
        )

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
