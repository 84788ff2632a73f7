"""Posteriors over the network weights: Laplace-GGN and natural-gradient VI with the GGN."""

from gaussify.weight_space import subnetwork
from gaussify.weight_space.glm_vi import GLMVI
from gaussify.weight_space.laplace import Laplace
from gaussify.weight_space.ngvi import LGVA, OGGN, VOGGN, NaturalGradientVI
from gaussify.weight_space.reward import BradleyTerry, predict_reward, preference_pairs

__all__ = [
    "GLMVI",
    "LGVA",
    "OGGN",
    "VOGGN",
    "BradleyTerry",
    "Laplace",
    "NaturalGradientVI",
    "predict_reward",
    "preference_pairs",
    "subnetwork",
]
