"""laplace-torch's option enums (``laplace.utils.enums``), under the same names and values.

Each is a ``str`` enum, so a member compares equal to its string (``PredType.GLM == "glm"``)
and either spelling can be passed to :mod:`gaussify.compat.laplace`.
"""

from __future__ import annotations

from enum import Enum

__all__ = [
    "FunctionalApproximation",
    "HessianStructure",
    "Likelihood",
    "LinkApprox",
    "PredType",
    "PriorStructure",
    "SubsetOfWeights",
    "TuningMethod",
    "option",
]


class SubsetOfWeights(str, Enum):
    """Which weights get a posterior: every trainable one, the output layer, or a subnetwork."""

    ALL = "all"
    LAST_LAYER = "last_layer"
    SUBNETWORK = "subnetwork"


class HessianStructure(str, Enum):
    """Structure of the curvature; "gp" is function-space (a GP with the NTK as kernel)."""

    FULL = "full"
    KRON = "kron"
    DIAG = "diag"
    LOWRANK = "lowrank"
    GP = "gp"


class FunctionalApproximation(str, Enum):
    """How ``hessian_structure="gp"`` approximates the GP (only subset-of-data here)."""

    SOD = "sod"
    NYSTROM = "nystrom"
    VARIATIONAL = "variational"


class Likelihood(str, Enum):
    """Gaussian regression (MSE) or softmax classification (cross-entropy)."""

    REGRESSION = "regression"
    CLASSIFICATION = "classification"
    REWARD_MODELING = "reward_modeling"


class PredType(str, Enum):
    """Predictive: linearised network ("glm"), sampled networks ("nn") or the GP ("gp")."""

    GLM = "glm"
    NN = "nn"
    GP = "gp"


class LinkApprox(str, Enum):
    """Approximation of E[softmax(f)] under a Gaussian f."""

    MC = "mc"
    PROBIT = "probit"
    BRIDGE = "bridge"
    BRIDGE_NORM = "bridge_norm"


class TuningMethod(str, Enum):
    """Prior-precision tuning: evidence maximisation or a validation grid search."""

    MARGLIK = "marglik"
    GRIDSEARCH = "gridsearch"


class PriorStructure(str, Enum):
    """Granularity of a tuned prior precision."""

    SCALAR = "scalar"
    DIAG = "diag"
    LAYERWISE = "layerwise"


def option(value: object, allowed: type[Enum], name: str) -> str:
    """``value`` (a string or a member of ``allowed``) as its string; a ValueError naming the
    argument ``name`` and the allowed values otherwise."""
    raw = value.value if isinstance(value, Enum) else value
    choices = [m.value for m in allowed]  # type: ignore[attr-defined]
    if raw not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
    return str(raw)
