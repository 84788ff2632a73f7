"""The fields of a fitted :class:`~gaussify.weight_space.laplace.Laplace` that its helper
modules read and write.

:mod:`~gaussify.weight_space.laplace_fit` (the data passes and the GLM refinement),
:mod:`~gaussify.weight_space.laplace_predict` (the predictive routes),
:mod:`~gaussify.weight_space.laplace_evidence` (the log evidence) and
:mod:`~gaussify.weight_space.laplace_state` (``state_dict`` / ``load_state_dict``) take the
posterior as a :class:`LaplaceFields`, so they import nothing from ``laplace.py`` and the
arrows between the modules of :mod:`gaussify.weight_space` point one way (the
``acyclic_siblings`` contract of ``pyproject.toml``).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from torch import Tensor, nn

from gaussify.curvature.subset import ParameterSubset
from gaussify.likelihoods import Likelihood

__all__ = ["Granularity", "LaplaceFields"]

#: one prior precision for all weights, one per parameter tensor, or one per weight
Granularity = Literal["scalar", "layer", "diag"]


class LaplaceFields(Protocol):
    """A Laplace-GGN posterior N(mean, A^-1), A = scale * G + diag(P0), over the ``subset`` of
    ``model``'s weights, fitted on ``num_data`` points at theta* = ``theta_star``."""

    model: nn.Module
    likelihood: Likelihood
    task: str
    structure: str
    subset: ParameterSubset
    curvature_options: dict[str, Any]
    correction: bool
    generator: Any
    _output_layer: Any
    _feature_path: bool
    _spectral_tuning: bool
    num_data: int
    mean: Tensor
    theta_star: Tensor
    prior_precision: Tensor
    prior_mean: Tensor
    sigma_noise: Tensor
    temperature: float
    _dtype: Any
    _device: Any
    _curvature: Any
    _posterior: Any
    _sigma_fit: Tensor
    _log_lik: Tensor
    _grad: Tensor
    _sse: Tensor | None

    def _scale(self, sigma_noise: Tensor) -> Tensor:
        """Multiplier of the fitted G at noise ``sigma_noise``."""
        ...

    def _prior_groups(self, granularity: Granularity) -> Tensor:
        """Prior group of each weight at ``granularity``."""
        ...

    @property
    def posterior(self) -> Any:
        """The posterior precision A at the current hyperparameters (cached)."""
        ...

    def sample(self, num_samples: int = 100, generator: Any = None) -> Tensor:
        """Weight samples (S, P) from q(theta)."""
        ...

    def _accumulate(self, batches: Any, shift: Tensor | None, progress: bool = False) -> None:
        """One pass over the data (the fit's sums)."""
        ...

    def posterior_at(self, prior_precision: Tensor, sigma_noise: Tensor) -> Any:
        """The posterior precision A at these hyperparameters."""
        ...
