"""laplace-torch's ``laplace.curvature.curvlinops`` names (see :mod:`..curvature`)."""

from gaussify.compat.laplace.curvature import (
    CurvlinopsEF,
    CurvlinopsGGN,
    CurvlinopsHessian,
    CurvlinopsInterface,
)

__all__ = ["CurvlinopsEF", "CurvlinopsGGN", "CurvlinopsHessian", "CurvlinopsInterface"]
