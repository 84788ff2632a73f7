"""gaussify: Gaussian approximate inference for deep learning.

The public API is re-exported here; nothing else lives in this module.
"""

from gaussify import data, likelihoods, metrics
from gaussify.likelihoods import Bernoulli, Categorical, Gaussian, get_likelihood
from gaussify.predictive import Predictive
from gaussify.training import train_map

__all__ = [
    "Bernoulli",
    "Categorical",
    "Gaussian",
    "Predictive",
    "data",
    "get_likelihood",
    "likelihoods",
    "metrics",
    "train_map",
]
__version__ = "0.1.0"
