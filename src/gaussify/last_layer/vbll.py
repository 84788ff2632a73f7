"""Variational Bayesian last layers (Harrison, Willes & Snoek 2024): the three heads of the paper.

* :class:`VBLLRegression` -- ``y = W phi + eps``, ``eps ~ N(0, Sigma)``, q(W) = MN(W_bar, I, S)
  (Sec. 2.1, App. A); objective eq. (12)/(16); predictive eq. (1)/(17),
  ``N(W_bar phi, phi^T S phi I + Sigma)``.
* :class:`VBLLDiscriminative` -- logits ``z = W phi + eps`` with independent rows
  ``w_k ~ N(w_bar_k, S_k)`` and diagonal noise (Sec. 2.2, 3.2); objective eq. (13); predictive
  ``E[softmax(z)]`` by sampling (App. C.6) or a deterministic link approximation.
* :class:`VBLLGenerative` -- Gaussian discriminant analysis on features: class means
  ``mu_k ~ N(mu_bar_k, S_k)``, shared noise Sigma, Dirichlet class probabilities counted from
  labels (Sec. 2.3, 3.3); objective eq. (14); predictive eq. (8); feature density eq. (74).

Every head keeps the noise covariance as a MAP estimate under an inverse-Wishart prior with
``dof`` nu and scale ``M = wishart_scale * I`` (App. C.3, eq. 65), the prior of the last layer
``N(0, prior_scale * I)`` (App. C.5), and the covariance ``parameterization`` of App. D
(``"dense"``, ``"diagonal"``, ``"lowrank"`` with ``cov_rank``, ``"dense_precision"``).
``prior_scale`` is the prior *variance* s of ``S_0 = s I`` as in the paper (the ``vbll``
package divides its ``prior_scale`` by the feature width). :class:`VBLLRegression` defaults to
``s = 1 / in_features``: the prior on the *function* ``w^T phi ~ N(0, ||phi||^2 / D)`` then has
unit variance for features of unit mean square, matching standardised targets whatever the
width -- the prior behind the paper's UCI numbers (its code's ``prior_scale=1`` is ``1 / D``).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor, nn

from gaussify.last_layer.base import (
    VBLLHead,
    check_labels,
    check_positive,
    check_regression_targets,
)
from gaussify.last_layer.bounds import (
    discriminative_bound,
    generative_bound,
    generative_log_joint,
    regression_bound,
)
from gaussify.last_layer.covariance import GaussianRows, StructuredCovariance
from gaussify.last_layer.noise import NoiseCovariance, NoiseStructure
from gaussify.last_layer.parameterization import ParameterizationName, make_covariance
from gaussify.predictive import LINKS, Predictive
from gaussify.validation import check_count

__all__ = [
    "ClassificationHead",
    "VBLLDiscriminative",
    "VBLLGenerative",
    "VBLLRegression",
    "logit_predictive",
]

LinkName = Literal["mc", "probit", "bridge"]


def default_prior_scale(in_features: Any) -> float:
    """The default prior variance of a regression head's weights, ``1 / in_features``: the
    prior function variance ``||phi||^2 / D`` is then the mean square feature (App. C.5's
    ``N(0, I)`` on normalised features, as in the authors' code)."""
    in_features = check_count(in_features, "in_features")
    return 1.0 / in_features


def initial_variance(in_features: int, prior_scale: float) -> float:
    """Initial posterior variance per weight: min(prior variance, 1 / in_features)."""
    # start the posterior tighter than the prior: a variance of 1/D keeps phi^T S phi O(1)
    return min(prior_scale, 1.0 / in_features)


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


class RegressionHead(VBLLHead):
    """Shared target checks of the regression heads."""

    task = "regression"

    def check_targets(self, y: Any, num: int) -> Tensor:
        return check_regression_targets(y, num, self.out_features, self.W_mean)


class ClassificationHead(VBLLHead):
    """Shared label checks and label-based predictive density of the classification heads."""

    task = "classification"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        regularization_weight: float,
        prior_scale: float,
        link: str = "mc",
        num_samples: int = 100,
    ) -> None:
        super().__init__(in_features, out_features, regularization_weight, prior_scale)
        if link not in ("mc", "probit", "bridge"):
            raise ValueError(f"link: expected 'mc', 'probit' or 'bridge', got {link!r}")
        num_samples = check_count(num_samples, "num_samples")
        self.link, self.num_samples = link, num_samples

    def check_targets(self, y: Any, num: int) -> Tensor:
        return check_labels(y, num, self.out_features)

    def log_prob(self, phi: Tensor, y: Tensor) -> Tensor:
        probs = self.predictive(phi).probs
        return probs.clamp_min(1e-12).log().gather(-1, y.unsqueeze(-1)).squeeze(-1)

    def ood_score(self, phi: Tensor) -> Tensor:
        """Negative maximum predictive probability (Hendrycks & Gimpel 2017; App. C.7)."""
        return -self.predictive(phi).probs.amax(-1)


class VBLLRegression(RegressionHead):
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
        self,
        in_features: int,
        out_features: int,
        regularization_weight: float,
        parameterization: ParameterizationName = "dense",
        prior_scale: float | None = None,
        wishart_scale: float = 1.0,
        dof: float = 1.0,
        cov_rank: int | None = None,
        noise_parameterization: NoiseStructure = "dense",
        init_noise_var: float = 1.0,
    ) -> None:
        if prior_scale is None:
            prior_scale = default_prior_scale(in_features)
        super().__init__(in_features, out_features, regularization_weight, prior_scale)
        self.wishart_scale = check_positive(wishart_scale, "wishart_scale")
        self.dof = check_positive(dof, "dof")
        init_noise_var = check_positive(init_noise_var, "init_noise_var")
        self.parameterization = parameterization
        self.W_mean = nn.Parameter(torch.randn(out_features, in_features) / math.sqrt(in_features))
        self.W_cov = make_covariance(
            parameterization,
            1,
            in_features,
            initial_variance(in_features, self.prior_scale),
            cov_rank,
        )
        self.noise_cov = NoiseCovariance(out_features, noise_parameterization, init_noise_var)

    def W(self) -> GaussianRows:
        """q(W) = MN(W_bar, I, S): rows of ``W (out_features, in_features)``."""
        return GaussianRows(self.W_mean, self.W_cov())

    def noise(self) -> StructuredCovariance:
        """The noise covariance Sigma (one block, ``out_features`` square)."""
        return self.noise_cov.structured()

    def _moments(self, phi: Tensor) -> tuple[Tensor, Tensor]:
        return phi @ self.W_mean.mT, self.W_cov().quad_form(phi)[..., 0]

    def log_likelihood_bound(self, phi: Tensor, y: Tensor) -> Tensor:
        mean, quad = self._moments(phi)
        return regression_bound(
            self.noise_cov.log_prob(y - mean), quad, self.noise_cov.trace_precision
        )

    def kl(self) -> Tensor:
        return self.W().kl(self.prior_scale)

    def log_prior(self) -> Tensor:
        return self.noise_cov.log_prior(self.dof, self.wishart_scale)

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

    def ood_score(self, phi: Tensor) -> Tensor:
        """Epistemic variance ``phi^T S phi``."""
        return self._moments(phi)[1]


class VBLLDiscriminative(ClassificationHead):
    """Discriminative VBLL classifier (D-VBLL, Sec. 3.2): softmax of ``W phi + eps`` with
    independent rows ``w_k ~ N(w_bar_k, S_k)`` and diagonal logit noise ``sigma_k^2``.

    ``train_loss(y)`` is eq. (13) plus the KL and the inverse-Wishart (inverse-Gamma per class)
    prior on sigma^2. ``predictive`` averages the softmax over ``num_samples`` logit samples
    (``link="mc"``, App. C.6) or applies ``"probit"`` / ``"bridge"`` deterministically.
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
        softmax_bound: Literal["jensen"] = "jensen",
        link: LinkName = "mc",
        num_samples: int = 100,
        init_noise_var: float = 0.1,
    ) -> None:
        super().__init__(
            in_features, out_features, regularization_weight, prior_scale, link, num_samples
        )
        if softmax_bound != "jensen":
            raise ValueError(
                f"softmax_bound: D-VBLL uses eq. (13), 'jensen'; got {softmax_bound!r}"
            )
        self.wishart_scale = check_positive(wishart_scale, "wishart_scale")
        self.dof = check_positive(dof, "dof")
        init_noise_var = check_positive(init_noise_var, "init_noise_var")
        self.parameterization = parameterization
        self.W_mean = nn.Parameter(torch.randn(out_features, in_features) / math.sqrt(in_features))
        self.W_cov = make_covariance(
            parameterization,
            out_features,
            in_features,
            initial_variance(in_features, self.prior_scale),
            cov_rank,
        )
        self.noise_cov = NoiseCovariance(out_features, "diagonal", init_noise_var)

    def W(self) -> GaussianRows:
        """q(W): independent rows, one covariance S_k per class."""
        return GaussianRows(self.W_mean, self.W_cov())

    def noise(self) -> StructuredCovariance:
        """Diagonal logit noise covariance diag(sigma_k^2)."""
        return self.noise_cov.structured()

    def logit_moments(self, phi: Tensor) -> tuple[Tensor, Tensor]:
        """Mean ``W_bar phi`` and variance ``phi^T S_k phi + sigma_k^2`` of the logits, (N, K)."""
        mean, quad = self.W().output_moments(phi)
        return mean, quad + self.noise_cov.variance

    def log_likelihood_bound(self, phi: Tensor, y: Tensor) -> Tensor:
        return discriminative_bound(y, *self.logit_moments(phi))

    def kl(self) -> Tensor:
        return self.W().kl(self.prior_scale)

    def log_prior(self) -> Tensor:
        return self.noise_cov.log_prior(self.dof, self.wishart_scale)

    def predictive(self, phi: Tensor) -> Predictive:
        mean, var = self.logit_moments(phi)
        return logit_predictive(mean, var, self.link, self.num_samples)


class VBLLGenerative(ClassificationHead):
    """Generative VBLL classifier (G-VBLL, Sec. 3.3): ``phi | y ~ N(mu_y, Sigma)``,
    ``mu_k ~ N(mu_bar_k, S_k)``, ``y ~ Cat(rho)``, ``rho ~ Dir(alpha)``.

    The Dirichlet posterior is exact: ``alpha = dirichlet_prior + class counts``, set once from
    the training labels with :meth:`set_class_counts` (uniform until then). ``train_loss(y)`` is
    eq. (14) plus the KL and the inverse-Wishart prior on Sigma; ``predictive`` is eq. (8),
    exact given q; :meth:`feature_log_density` is eq. (74), whose negative is ``ood_score``.
    The paper restricts S_k and Sigma to diagonals for O(D) cost (App. D.2); other
    parameterizations work and cost one O(K D^3) factorisation of ``Sigma + S_k`` per call
    (O(K D r^2) for ``"lowrank"`` with diagonal noise).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        regularization_weight: float,
        parameterization: ParameterizationName = "diagonal",
        prior_scale: float = 1.0,
        wishart_scale: float = 1.0,
        dof: float = 1.0,
        cov_rank: int | None = None,
        noise_parameterization: NoiseStructure = "diagonal",
        dirichlet_prior: float = 1.0,
        init_noise_var: float = 1.0,
    ) -> None:
        super().__init__(in_features, out_features, regularization_weight, prior_scale)
        self.wishart_scale = check_positive(wishart_scale, "wishart_scale")
        self.dof = check_positive(dof, "dof")
        self.dirichlet_prior = check_positive(dirichlet_prior, "dirichlet_prior")
        init_noise_var = check_positive(init_noise_var, "init_noise_var")
        self.parameterization = parameterization
        self.mu_mean = nn.Parameter(torch.randn(out_features, in_features))
        self.mu_cov = make_covariance(
            parameterization,
            out_features,
            in_features,
            initial_variance(in_features, self.prior_scale),
            cov_rank,
        )
        self.noise_cov = NoiseCovariance(in_features, noise_parameterization, init_noise_var)
        self.register_buffer("class_counts", torch.zeros(out_features))

    # ---- Dirichlet class counts -----------------------------------------------------------

    @torch.no_grad()
    def set_class_counts(self, y: Tensor) -> None:
        """Set the Dirichlet posterior counts from all training labels ``y (N,)``."""
        y = check_labels(y, y.shape[0] if isinstance(y, Tensor) else -1, self.out_features)
        self.class_counts.copy_(torch.bincount(y, minlength=self.out_features))

    @torch.no_grad()
    def update_class_counts(self, y: Tensor) -> None:
        """Add the labels of one batch to the counts (one pass over the data)."""
        y = check_labels(y, y.shape[0] if isinstance(y, Tensor) else -1, self.out_features)
        self.class_counts.add_(torch.bincount(y, minlength=self.out_features))

    def log_class_prior(self) -> Tensor:
        """Dirichlet predictive ``log alpha_k - log sum alpha`` (eq. 7, 55), (K,)."""
        alpha = self.class_counts + self.dirichlet_prior
        return alpha.log() - alpha.sum().log()

    # ---- posterior access -----------------------------------------------------------------

    def mu(self) -> GaussianRows:
        """q(mu): class embedding means, one covariance S_k per class."""
        return GaussianRows(self.mu_mean, self.mu_cov())

    def W(self) -> GaussianRows:
        """Same as :meth:`mu`: the last-layer parameters of G-VBLL are the class means."""
        return self.mu()

    def noise(self) -> StructuredCovariance:
        """The shared feature noise covariance Sigma (``in_features`` square)."""
        return self.noise_cov.structured()

    # ---- objective and prediction ---------------------------------------------------------

    def log_joint(self, phi: Tensor) -> Tensor:
        """``log N(phi | mu_bar_k, Sigma + S_k) + log p(y = k)``, (N, K) (eq. 8-9, Lemma 7)."""
        marginal = self.mu_cov().add(self.noise())
        return generative_log_joint(phi, self.mu_mean, marginal, self.log_class_prior())

    def log_likelihood_bound(self, phi: Tensor, y: Tensor) -> Tensor:
        cov = self.mu_cov()
        marginal = cov.add(self.noise())
        log_prior = self.log_class_prior()
        log_joint = generative_log_joint(phi, self.mu_mean, marginal, log_prior)
        return generative_bound(
            y,
            self.noise_cov.log_prob(phi - self.mu_mean[y]),
            self.noise_cov.trace_product(cov),
            log_joint,
            log_prior,
        )

    def kl(self) -> Tensor:
        return self.mu().kl(self.prior_scale)

    def log_prior(self) -> Tensor:
        return self.noise_cov.log_prior(self.dof, self.wishart_scale)

    def predictive(self, phi: Tensor) -> Predictive:
        """Eq. (8): ``softmax_k(log N(phi | mu_bar_k, Sigma + S_k) + log p(y = k))``; the
        logits are stored as a single deterministic sample (no latent uncertainty left)."""
        logits = self.log_joint(phi)
        return Predictive(
            "classification", logits, f_samples=logits.unsqueeze(0), probs=logits.softmax(-1)
        )

    def log_prob(self, phi: Tensor, y: Tensor) -> Tensor:
        return self.log_joint(phi).log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)

    def feature_log_density(self, phi: Tensor) -> Tensor:
        """``log p(phi) = LSE_k[log N(phi | mu_bar_k, Sigma + S_k) + log p(y = k)]`` (eq. 74)."""
        return torch.logsumexp(self.log_joint(phi), dim=-1)

    def ood_score(self, phi: Tensor) -> Tensor:
        """Negative feature log density (App. C.7)."""
        return -self.feature_log_density(phi)
