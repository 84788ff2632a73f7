"""laplace-torch's public API on gaussify's engine: replace ``laplace`` by
``gaussify.compat.laplace`` in the imports (``from gaussify.compat.laplace import Laplace``,
``gaussify.compat.laplace.curvature``, ``gaussify.compat.laplace.utils``) and keep the script.

Modules: :mod:`.parametric` (the weight-space classes and the ``Laplace`` factory),
:mod:`.functional` (``hessian_structure="gp"``), :mod:`.links` (its link formulas),
:mod:`.tuning` (``optimize_prior_precision``), :mod:`.marglik` (``marglik_training``),
:mod:`.enums`, :mod:`.curvature` (backend names, replaced by gaussify's engine),
:mod:`.utils` (subnetwork masks, metrics). docs/migrating.md lists what is equal, faster and
exact where laplace-torch is not.
"""

from gaussify.compat.laplace.enums import (
    FunctionalApproximation,
    HessianStructure,
    Likelihood,
    LinkApprox,
    PredType,
    PriorStructure,
    SubsetOfWeights,
    TuningMethod,
)
from gaussify.compat.laplace.functional import FunctionalLaplace, FunctionalLLLaplace
from gaussify.compat.laplace.marglik import marglik_training
from gaussify.compat.laplace.parametric import (
    DiagLaplace,
    DiagLLLaplace,
    DiagSubnetLaplace,
    FullLaplace,
    FullLLLaplace,
    FullSubnetLaplace,
    KronLaplace,
    KronLLLaplace,
    Laplace,
    LowRankLaplace,
    ParametricLaplace,
)

# laplace-torch's base-class names (for isinstance checks in user code)
BaseLaplace = ParametricLaplace
LLLaplace = ParametricLaplace
SubnetLaplace = ParametricLaplace

__all__ = [
    "BaseLaplace",
    "DiagLLLaplace",
    "DiagLaplace",
    "DiagSubnetLaplace",
    "FullLLLaplace",
    "FullLaplace",
    "FullSubnetLaplace",
    "FunctionalApproximation",
    "FunctionalLLLaplace",
    "FunctionalLaplace",
    "HessianStructure",
    "KronLLLaplace",
    "KronLaplace",
    "LLLaplace",
    "Laplace",
    "Likelihood",
    "LinkApprox",
    "LowRankLaplace",
    "ParametricLaplace",
    "PredType",
    "PriorStructure",
    "SubnetLaplace",
    "SubsetOfWeights",
    "TuningMethod",
    "marglik_training",
]
