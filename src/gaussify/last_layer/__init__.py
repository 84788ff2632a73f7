"""Bayesian last layers: variational Bayesian last layers (VBLL, Harrison et al. 2024).

    import gaussify as gs
    head = gs.last_layer.VBLLDiscriminative(64, 10, regularization_weight=1 / len(train_set))
    out = head(features)            # VBLLOutput
    loss = out.train_loss(y)        # instead of F.cross_entropy(linear(features), y)
    out.predictive.probs            # a gaussify Predictive

Heads (each with every covariance parameterization: "dense", "diagonal", "lowrank",
"dense_precision"): ``VBLLRegression``, ``VBLLDiscriminative``, ``VBLLGenerative`` (the paper's
three), ``VBLLStudentTRegression``, ``VBLLHeteroscedasticRegression``,
``VBLLStudentTDiscriminative``, ``VBLLHeteroscedasticDiscriminative``. The ``vbll`` package's
class names are aliases (``Regression``, ``tRegression``, ``HetRegression``,
``DiscClassification``, ``tDiscClassification``, ``HetClassification``,
``GenClassification``). Variational features: ``VBLLBNN``, ``MeanFieldLinear``,
``to_mean_field``. Post-hoc: ``fit_posthoc``, ``extract_features``, ``GVBLLMAP``.

Exact marginal-likelihood last layer (Watson et al. 2021, the GBLL baseline of the VBLL
paper): ``GBLLRegression`` (``train_loss`` = negative log evidence per example, full batch;
``fit_posterior(features, y)`` then the exact predictive).

Exact last layers with Gaussian likelihood approximations (Bui): ``ExactLastLayer`` (streaming
Kalman updates), baselines ``ADFLastLayer`` and ``SGDLastLayer``, and ``ActiveLearner``.
"""

from gaussify.last_layer import bounds, covariance, parameterization
from gaussify.last_layer.active import ActiveLearner, active_learning
from gaussify.last_layer.adf import ADFLastLayer, SGDLastLayer
from gaussify.last_layer.base import VBLLHead, VBLLOutput
from gaussify.last_layer.bnn import (
    VBLLBNN,
    BNNOutput,
    MeanFieldLinear,
    mean_field_kl,
    mix_predictives,
    to_mean_field,
)
from gaussify.last_layer.covariance import GaussianRows
from gaussify.last_layer.exact import ExactLastLayer
from gaussify.last_layer.gbll import GBLLRegression
from gaussify.last_layer.noise import GammaNoise, NoiseCovariance, inverse_wishart_log_prior
from gaussify.last_layer.parameterization import PARAMETERIZATIONS, make_covariance
from gaussify.last_layer.posthoc import (
    GVBLLMAP,
    class_covariance_map,
    extract_features,
    fit_posthoc,
)
from gaussify.last_layer.vbll_discriminative import (
    VBLLDiscriminative,
    VBLLHeteroscedasticDiscriminative,
    VBLLStudentTDiscriminative,
)
from gaussify.last_layer.vbll_generative import VBLLGenerative
from gaussify.last_layer.vbll_regression import (
    VBLLHeteroscedasticRegression,
    VBLLRegression,
    VBLLStudentTRegression,
)

# the vbll package's names, so that switching is a change of import
Regression = VBLLRegression
tRegression = VBLLStudentTRegression
HetRegression = VBLLHeteroscedasticRegression
DiscClassification = VBLLDiscriminative
tDiscClassification = VBLLStudentTDiscriminative
HetClassification = VBLLHeteroscedasticDiscriminative
GenClassification = VBLLGenerative

__all__ = [
    "GVBLLMAP",
    "PARAMETERIZATIONS",
    "VBLLBNN",
    "ADFLastLayer",
    "ActiveLearner",
    "BNNOutput",
    "DiscClassification",
    "ExactLastLayer",
    "GBLLRegression",
    "GammaNoise",
    "GaussianRows",
    "GenClassification",
    "HetClassification",
    "HetRegression",
    "MeanFieldLinear",
    "NoiseCovariance",
    "Regression",
    "SGDLastLayer",
    "VBLLDiscriminative",
    "VBLLGenerative",
    "VBLLHead",
    "VBLLHeteroscedasticDiscriminative",
    "VBLLHeteroscedasticRegression",
    "VBLLOutput",
    "VBLLRegression",
    "VBLLStudentTDiscriminative",
    "VBLLStudentTRegression",
    "active_learning",
    "bounds",
    "class_covariance_map",
    "covariance",
    "extract_features",
    "fit_posthoc",
    "inverse_wishart_log_prior",
    "make_covariance",
    "mean_field_kl",
    "mix_predictives",
    "parameterization",
    "tDiscClassification",
    "tRegression",
    "to_mean_field",
]
