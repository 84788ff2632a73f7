"""laplace-torch's curvature backend names, kept so that ``backend=...`` arguments and their
imports keep working. gaussify computes every curvature itself (exact GGN, KFAC or diagonal
from per-sample Jacobians, :mod:`gaussify.curvature`), so a backend only selects the kind of
curvature: an empirical-Fisher backend (``*EF``) gives ``ef=True``; the GGN and Hessian
backends give the GGN (for the networks laplace-torch supports the Hessian backends are used
with, the GGN is its usual positive semi-definite replacement)."""

from __future__ import annotations

__all__ = [
    "AsdlEF",
    "AsdlGGN",
    "AsdlHessian",
    "AsdlInterface",
    "BackPackEF",
    "BackPackGGN",
    "BackPackInterface",
    "CurvatureInterface",
    "CurvlinopsEF",
    "CurvlinopsGGN",
    "CurvlinopsHessian",
    "CurvlinopsInterface",
    "EFInterface",
    "GGNInterface",
]


class CurvatureInterface:
    """Marker base of the backend names (never instantiated by gaussify.compat)."""


class GGNInterface(CurvatureInterface):
    """Generalised Gauss-Newton backends."""


class EFInterface(CurvatureInterface):
    """Empirical-Fisher backends (select ``ef=True``)."""


class BackPackInterface(CurvatureInterface):
    pass


class AsdlInterface(CurvatureInterface):
    pass


class CurvlinopsInterface(CurvatureInterface):
    pass


class BackPackGGN(BackPackInterface, GGNInterface):
    pass


class BackPackEF(BackPackInterface, EFInterface):
    pass


class AsdlGGN(AsdlInterface, GGNInterface):
    pass


class AsdlEF(AsdlInterface, EFInterface):
    pass


class AsdlHessian(AsdlInterface):
    pass


class CurvlinopsGGN(CurvlinopsInterface, GGNInterface):
    pass


class CurvlinopsEF(CurvlinopsInterface, EFInterface):
    pass


class CurvlinopsHessian(CurvlinopsInterface):
    pass
