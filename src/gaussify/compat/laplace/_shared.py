"""What the two laplace-torch front classes (:class:`~.parametric.ParametricLaplace` and
:class:`~.functional.FunctionalLaplace`) share: the likelihood argument, the noise
hyperparameter, the arguments of ``log_marginal_likelihood`` that become the current
hyperparameters, and the class check of a saved state."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["CompatHyperparameters", "check_likelihood"]


def check_likelihood(likelihood: Any) -> str:
    """The likelihood name of a string or of laplace-torch's ``Likelihood`` enum:
    "classification" or "regression", else ``ValueError`` naming the argument."""
    name = getattr(likelihood, "value", likelihood)
    if name not in ("classification", "regression"):
        raise ValueError(f"likelihood: expected 'classification' or 'regression', got {name!r}")
    return str(name)


class CompatHyperparameters:
    """``prior_precision`` and ``sigma_noise`` (checked and shaped by the class's
    :meth:`_checked_prior` / :meth:`_checked_sigma`), the update of the hyperparameters
    passed to ``log_marginal_likelihood`` and the saved-class check."""

    likelihood: str
    _dtype: torch.dtype
    _prior: Tensor
    _sigma: Tensor

    @property
    def prior_precision(self) -> Tensor:
        """The prior precision as laplace-torch stores it: (1,) or, where the class allows,
        (n_layers,) or (n_params,)."""
        return self._prior

    @prior_precision.setter
    def prior_precision(self, value: float | Tensor) -> None:
        self._prior = self._checked_prior(value)

    def _checked_prior(self, value: float | Tensor) -> Tensor:
        raise NotImplementedError

    @property
    def sigma_noise(self) -> Tensor:
        return self._sigma

    @sigma_noise.setter
    def sigma_noise(self, value: float | Tensor) -> None:
        self._sigma = self._checked_sigma(torch.as_tensor(value, dtype=self._dtype)).reshape(())

    def _checked_sigma(self, sigma: Tensor) -> Tensor:
        raise NotImplementedError

    def _set_hyperparameters(self, prior_precision: Any, sigma_noise: Any) -> None:
        """Store the given (not None) arguments of ``log_marginal_likelihood`` as the current
        hyperparameters, as laplace-torch does; the noise only for regression."""
        if prior_precision is not None:
            self.prior_precision = prior_precision
        if sigma_noise is not None:
            if self.likelihood != "regression":
                raise ValueError("sigma_noise: can only be changed for regression")
            self.sigma_noise = sigma_noise

    def _check_saved_class(self, state_dict: dict[str, Any], hint: str = "") -> None:
        """``ValueError`` unless ``state_dict`` was saved from this class (``hint``: appended)."""
        if state_dict.get("cls_name") != type(self).__name__:
            raise ValueError(
                f"state_dict: saved from {state_dict.get('cls_name')!r}, this is "
                f"{type(self).__name__!r}{hint}"
            )
