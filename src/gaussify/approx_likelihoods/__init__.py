"""Gaussian likelihood approximations (Bui, "Likelihood approximations via Gaussian
approximate inference", Sec. 3 and App. A-B).

* :mod:`~gaussify.approx_likelihoods.closed_forms`: the pure functions
  ``(distribution, method) -> (mean, var)`` for Gamma / Exponential / Inverse-Gamma /
  Chi-squared (log basis) and Beta (logit basis), registry :data:`APPROXIMATIONS`;
* :mod:`~gaussify.approx_likelihoods.numerical`: variational matching for the Beta by Newton
  on exact quadratures, and a generic reparameterisation-gradient route;
* :mod:`~gaussify.approx_likelihoods.pseudo_targets`: labels -> Gaussian pseudo-targets
  (:class:`DirichletGaussian` for softmax, :class:`BetaGaussian` for sigmoid);
* :mod:`~gaussify.approx_likelihoods.loss`: :class:`GaussianApproxLoss` (eq. 3);
* :mod:`~gaussify.approx_likelihoods.tuning`: ``alpha_eps`` by training likelihood on a grid
  or by the variational bound of App. B.
"""

from gaussify.approx_likelihoods.closed_forms import (
    APPROXIMATIONS,
    BASES,
    PARAMETERS,
    gaussian_approx,
)
from gaussify.approx_likelihoods.gp_classification import GPClassifier
from gaussify.approx_likelihoods.loss import GaussianApproxLoss, gaussian_pseudo_nll
from gaussify.approx_likelihoods.numerical import (
    beta_kl,
    beta_variational,
    variational_reparam,
)
from gaussify.approx_likelihoods.pseudo_targets import (
    METHODS,
    SUPPORTED_BASES,
    BetaGaussian,
    DirichletGaussian,
    check_labels,
    pseudo_likelihood,
)
from gaussify.approx_likelihoods.tuning import (
    DEFAULT_GRID,
    AlphaSelection,
    expected_log_likelihood,
    select_alpha_eps,
    tune_alpha_eps,
)

__all__ = [
    "APPROXIMATIONS",
    "BASES",
    "DEFAULT_GRID",
    "METHODS",
    "PARAMETERS",
    "SUPPORTED_BASES",
    "AlphaSelection",
    "BetaGaussian",
    "DirichletGaussian",
    "GPClassifier",
    "GaussianApproxLoss",
    "beta_kl",
    "beta_variational",
    "check_labels",
    "expected_log_likelihood",
    "gaussian_approx",
    "gaussian_pseudo_nll",
    "pseudo_likelihood",
    "select_alpha_eps",
    "tune_alpha_eps",
    "variational_reparam",
]
