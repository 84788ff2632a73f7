"""Posteriors over the network weights: Laplace-GGN (and, later, natural-gradient VI)."""

from gaussify.weight_space.laplace import Laplace

__all__ = ["Laplace"]
