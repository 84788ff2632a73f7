"""laplace-torch's ``laplace.curvature.backpack`` names (see :mod:`..curvature`)."""

from gaussify.compat.laplace.curvature import BackPackEF, BackPackGGN, BackPackInterface

__all__ = ["BackPackEF", "BackPackGGN", "BackPackInterface"]
