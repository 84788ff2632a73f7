"""laplace-torch's subnetwork masks: ``Mask(model, ...).select(train_loader)`` returns the
sorted indices (into the vector of all trainable weights in ``named_parameters()`` order) that
``Laplace(..., subset_of_weights="subnetwork", subnetwork_indices=...)`` takes. Each is a thin
front for a selector of :mod:`gaussify.weight_space.subnetwork`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gaussify.curvature.subset import select_parameters
from gaussify.weight_space import subnetwork

__all__ = [
    "LargestMagnitudeSubnetMask",
    "LargestVarianceDiagLaplaceSubnetMask",
    "LastLayerSubnetMask",
    "ModuleNameSubnetMask",
    "ParamNameSubnetMask",
    "RandomSubnetMask",
    "ScoreBasedSubnetMask",
    "SubnetMask",
]


class SubnetMask:
    """A selection of individual weights, made once by :meth:`select`."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._n_params = subnetwork.num_weights(model)
        self._indices: Tensor | None = None

    @property
    def parameter_vector(self) -> Tensor:
        everything = select_parameters(self.model, "all")
        return everything.flatten(everything.params(self.model)).detach()

    @property
    def indices(self) -> Tensor:
        if self._indices is None:
            raise AttributeError("indices: no subnetwork selected yet; call select() first")
        return self._indices

    @property
    def n_params_subnet(self) -> int:
        return len(self.indices)

    def select(self, train_loader: Any = None) -> Tensor:
        """The sorted indices of the selected weights (a LongTensor)."""
        if self._indices is not None:
            raise ValueError("select: the subnetwork was already selected")
        self._indices = self._choose(train_loader).long()
        return self._indices

    def _choose(self, train_loader: Any) -> Tensor:
        raise NotImplementedError


class ScoreBasedSubnetMask(SubnetMask):
    """The ``n_params_subnet`` weights with the largest scores."""

    def __init__(self, model: nn.Module, n_params_subnet: int) -> None:
        super().__init__(model)
        if n_params_subnet is None or not 1 <= n_params_subnet <= self._n_params:
            raise ValueError(
                f"n_params_subnet: expected an integer in [1, {self._n_params}] (the trainable "
                f"weights), got {n_params_subnet!r}"
            )
        self._n_subnet = int(n_params_subnet)

    def compute_param_scores(self, train_loader: Any) -> Tensor:
        raise NotImplementedError

    def _choose(self, train_loader: Any) -> Tensor:
        return subnetwork.largest(self.compute_param_scores(train_loader), self._n_subnet)


class RandomSubnetMask(ScoreBasedSubnetMask):
    """Weights chosen uniformly at random (scores ``torch.rand``, as laplace-torch draws them)."""

    def compute_param_scores(self, train_loader: Any) -> Tensor:
        return torch.rand_like(self.parameter_vector)


class LargestMagnitudeSubnetMask(ScoreBasedSubnetMask):
    """The weights of largest magnitude |theta_i|."""

    def compute_param_scores(self, train_loader: Any) -> Tensor:
        return self.parameter_vector.abs()


class LargestVarianceDiagLaplaceSubnetMask(ScoreBasedSubnetMask):
    """The weights of largest marginal variance under ``diag_laplace_model`` (a compat
    ``DiagLaplace``), fitted on ``train_loader``."""

    def __init__(self, model: nn.Module, n_params_subnet: int, diag_laplace_model: Any) -> None:
        super().__init__(model, n_params_subnet)
        self.diag_laplace_model = diag_laplace_model

    def compute_param_scores(self, train_loader: Any) -> Tensor:
        if train_loader is None:
            raise ValueError("train_loader: needed to fit the diagonal Laplace")
        self.diag_laplace_model.fit(train_loader)
        return self.diag_laplace_model.posterior_variance


class ParamNameSubnetMask(SubnetMask):
    """Every weight of the named parameters (``model.named_parameters()`` names)."""

    def __init__(self, model: nn.Module, parameter_names: list[str]) -> None:
        super().__init__(model)
        known = {name for name, _ in model.named_parameters()}
        missing = [name for name in parameter_names if name not in known]
        if not parameter_names or missing:
            raise ValueError(
                f"parameter_names: expected names of model parameters, missing {missing}"
            )
        self._names = list(parameter_names)

    def _choose(self, train_loader: Any) -> Tensor:
        return subnetwork.by_name(self.model, self._names)


class ModuleNameSubnetMask(SubnetMask):
    """Every weight of the named leaf modules (``model.named_modules()`` names)."""

    def __init__(self, model: nn.Module, module_names: list[str]) -> None:
        super().__init__(model)
        self._names = list(module_names)

    def _choose(self, train_loader: Any) -> Tensor:
        modules = dict(self.model.named_modules())
        missing = [name for name in self._names if name not in modules]
        if not self._names or missing:
            raise ValueError(f"module_names: expected names of model modules, missing {missing}")
        return subnetwork.by_name(self.model, self._names)


class LastLayerSubnetMask(ModuleNameSubnetMask):
    """Every weight of the output layer (``last_layer_name``, found automatically if None)."""

    def __init__(self, model: nn.Module, last_layer_name: str | None = None) -> None:
        super().__init__(model, [] if last_layer_name is None else [last_layer_name])

    def _choose(self, train_loader: Any) -> Tensor:
        if self._names:
            return super()._choose(train_loader)
        names = list(select_parameters(self.model, "last_layer").names)
        return subnetwork.by_name(self.model, names)
