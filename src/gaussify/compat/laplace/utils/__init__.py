"""laplace-torch's ``laplace.utils`` names that user code imports: the enums, the subnetwork
masks (:mod:`.subnetmask`, on :mod:`gaussify.weight_space.subnetwork`) and the running NLL
metric of its grid search."""

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
from gaussify.compat.laplace.tuning import RunningNLL as RunningNLLMetric
from gaussify.compat.laplace.utils.subnetmask import (
    LargestMagnitudeSubnetMask,
    LargestVarianceDiagLaplaceSubnetMask,
    LastLayerSubnetMask,
    ModuleNameSubnetMask,
    ParamNameSubnetMask,
    RandomSubnetMask,
    ScoreBasedSubnetMask,
    SubnetMask,
)

__all__ = [
    "FunctionalApproximation",
    "HessianStructure",
    "LargestMagnitudeSubnetMask",
    "LargestVarianceDiagLaplaceSubnetMask",
    "LastLayerSubnetMask",
    "Likelihood",
    "LinkApprox",
    "ModuleNameSubnetMask",
    "ParamNameSubnetMask",
    "PredType",
    "PriorStructure",
    "RandomSubnetMask",
    "RunningNLLMetric",
    "ScoreBasedSubnetMask",
    "SubnetMask",
    "SubsetOfWeights",
    "TuningMethod",
]
