"""vbll's ``vbll.layers`` names (the layer classes)."""

from gaussify.compat.vbll.layers.classification import (
    DiscClassification,
    GenClassification,
    HetClassification,
    tDiscClassification,
)
from gaussify.compat.vbll.layers.regression import (
    HetRegression,
    Regression,
    VBLLReturn,
    tRegression,
)

__all__ = [
    "DiscClassification",
    "GenClassification",
    "HetClassification",
    "HetRegression",
    "Regression",
    "VBLLReturn",
    "tDiscClassification",
    "tRegression",
]
