"""gaussify: Gaussian approximate inference for deep learning.

The public API is re-exported here; nothing else lives in this module.
"""

from gaussify import (
    approx_likelihoods,
    data,
    evidence,
    experiments,
    function_space,
    last_layer,
    likelihoods,
    metrics,
    state,
)
from gaussify.function_space import ELLA, FunctionalLaplace, SampledLLA, VaLLA
from gaussify.likelihoods import Bernoulli, Categorical, Gaussian, get_likelihood
from gaussify.marglik import marglik_training
from gaussify.predictive import Predictive
from gaussify.training import train_map
from gaussify.weight_space import GLMVI, LGVA, OGGN, VOGGN, Laplace, subnetwork

__all__ = [
    "ELLA",
    "GLMVI",
    "LGVA",
    "OGGN",
    "VOGGN",
    "Bernoulli",
    "Categorical",
    "FunctionalLaplace",
    "Gaussian",
    "Laplace",
    "Predictive",
    "SampledLLA",
    "VaLLA",
    "approx_likelihoods",
    "data",
    "evidence",
    "experiments",
    "function_space",
    "get_likelihood",
    "last_layer",
    "likelihoods",
    "marglik_training",
    "metrics",
    "state",
    "subnetwork",
    "train_map",
]
__version__ = "0.1.0"
