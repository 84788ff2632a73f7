"""The generative VBLL classifier (G-VBLL; Harrison, Willes & Snoek 2024, Sec. 2.3, 3.3):
Gaussian discriminant analysis on features. Class means ``mu_k ~ N(mu_bar_k, S_k)``, shared
noise Sigma (a MAP estimate under the inverse-Wishart prior, App. C.3), Dirichlet class
probabilities counted from labels; objective eq. (14); predictive eq. (8); feature density
eq. (74). ``noise()`` is the shared feature noise covariance Sigma (``in_features`` square).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gaussify.last_layer.base import ClassificationHead, WishartNoise, check_labels, check_positive
from gaussify.last_layer.bounds import generative_bound, generative_log_joint
from gaussify.last_layer.covariance import GaussianRows
from gaussify.last_layer.noise import NoiseCovariance, NoiseStructure
from gaussify.last_layer.parameterization import ParameterizationName
from gaussify.predictive import Predictive

__all__ = ["VBLLGenerative"]


class VBLLGenerative(WishartNoise, ClassificationHead):
    """Generative VBLL classifier (G-VBLL, Sec. 3.3): ``phi | y ~ N(mu_y, Sigma)``,
    ``mu_k ~ N(mu_bar_k, S_k)``, ``y ~ Cat(rho)``, ``rho ~ Dir(alpha)``.

    The Dirichlet posterior is exact: ``alpha = dirichlet_prior + class counts``, set once from
    the training labels with :meth:`set_class_counts` (uniform until then). ``train_loss(y)`` is
    eq. (14) plus the KL and the inverse-Wishart prior on Sigma; ``predictive`` is eq. (8),
    exact given q; :meth:`feature_log_density` is eq. (74), whose negative is ``ood_score``.
    The paper restricts S_k and Sigma to diagonals for O(D) cost (App. D.2); other
    parameterizations work and cost one O(K D^3) factorisation of ``Sigma + S_k`` per call
    (O(K D r^2) for ``"lowrank"`` with diagonal noise).

    Initialisation: class means ``randn(K, D) / sqrt(D)`` (norm about 1 whatever the width, as
    the rows of the other heads), ``S_k = min(prior_scale, 1 / D) I``, ``Sigma =
    init_noise_var I``. The mean's scale matters: with unit-variance means (norm sqrt(D)) the
    class means sit far from O(1) features, barely move in a short run, and the logits
    ``-1/2 ||phi - mu_k||^2_{(Sigma + S_k)^-1}`` then differ by O(sqrt(D)) -- an overconfident
    classifier (docs/vbll.md, "G-VBLL calibration").
    """

    def __init__(
        self, in_features: int, out_features: int, regularization_weight: float,
        parameterization: ParameterizationName = "diagonal", prior_scale: float = 1.0,
        wishart_scale: float = 1.0, dof: float = 1.0, cov_rank: int | None = None,
        noise_parameterization: NoiseStructure = "diagonal", dirichlet_prior: float = 1.0,
        init_noise_var: float = 1.0,
    ) -> None:  # fmt: skip
        super().__init__(in_features, out_features, regularization_weight, prior_scale)
        self.set_wishart_prior(wishart_scale, dof)
        self.dirichlet_prior = check_positive(dirichlet_prior, "dirichlet_prior")
        init_noise_var = check_positive(init_noise_var, "init_noise_var")
        # class means at the scale of the other heads' rows, ||mu_k|| ~ 1 for any width: a
        # unit-variance draw puts them sqrt(D) away from O(1) features (issue 19)
        self.add_gaussian_rows(
            "mu", self.random_rows(), out_features, parameterization, self.prior_scale, cov_rank
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
