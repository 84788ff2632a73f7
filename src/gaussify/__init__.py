"""gaussify: Gaussian approximate inference for deep learning.

The public API is re-exported here; nothing else lives in this module.
"""

from gaussify import approx_likelihoods, data, evidence, last_layer, likelihoods, metrics
from gaussify.likelihoods import Bernoulli, Categorical, Gaussian, get_likelihood
from gaussify.marglik import marglik_training
from gaussify.predictive import Predictive
from gaussify.training import train_map
from gaussify.weight_space import Laplace

__all__ = [
    "Bernoulli",
    "Categorical",
    "Gaussian",
    "Laplace",
    "Predictive",
    "approx_likelihoods",
    "data",
    "evidence",
    "get_likelihood",
    "last_layer",
    "likelihoods",
    "marglik_training",
    "metrics",
    "train_map",
]
__version__ = "0.1.0"
