"""laplace-torch's ``laplace.curvature.asdl`` names (see :mod:`..curvature`)."""

from gaussify.compat.laplace.curvature import AsdlEF, AsdlGGN, AsdlHessian, AsdlInterface

__all__ = ["AsdlEF", "AsdlGGN", "AsdlHessian", "AsdlInterface"]
