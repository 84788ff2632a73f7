"""laplace-torch's ``FunctionalLaplace`` / ``FunctionalLLLaplace`` (``hessian_structure="gp"``)
on :class:`gaussify.FunctionalLaplace`.

Kept from laplace-torch: the arguments, the subset of data (``n_subset`` points drawn with
``numpy.random.default_rng(seed).choice(N, n_subset, replace=False)``, the same points as its
sampler) and its prior convention for it (the kernel's prior variance is
``(n_subset / N) / prior_precision``), return shapes and links.

Exact where laplace-torch is not (docs/migrating.md lists the measured differences):

* the likelihood Hessian keeps its full C x C blocks (laplace-torch keeps only their diagonal,
  which overstates the multi-class predictive variance), so the predictive equals the
  weight-space full-GGN GLM predictive on the same points;
* the evidence is the GP-regression evidence of the linearised model (gaussify's
  ``FunctionalLaplace.log_marginal_likelihood``, equal to the full-GGN weight-space evidence
  with the non-MAP correction), where laplace-torch adds the MAP log-likelihood to a GP
  evidence that already contains the data fit.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from gaussify.compat.laplace._shared import CompatHyperparameters, check_likelihood
from gaussify.compat.laplace.enums import LinkApprox, PredType, option
from gaussify.compat.laplace.links import apply_link, normal_draws
from gaussify.compat.laplace.tuning import optimize_prior_precision as _optimize
from gaussify.function_space.gp import FunctionalLaplace as _Engine

__all__ = ["FunctionalLLLaplace", "FunctionalLaplace"]


class FunctionalLaplace(CompatHyperparameters):
    """Function-space (GP) Laplace over all weights on a subset of ``n_subset`` data points."""

    _key = ("all", "gp")

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        n_subset: int,
        sigma_noise: float | Tensor = 1.0,
        prior_precision: float | Tensor = 1.0,
        prior_mean: float | Tensor = 0.0,
        temperature: float = 1.0,
        enable_backprop: bool = False,
        *,
        independent_outputs: bool = False,
        seed: int = 0,
        last_layer_name: str | None = None,
        backend: type | None = None,
        backend_kwargs: dict[str, Any] | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        feature_reduction: str | None = None,
    ) -> None:
        likelihood = check_likelihood(likelihood)
        if isinstance(n_subset, bool) or not isinstance(n_subset, int) or n_subset < 1:
            raise ValueError(f"n_subset: expected a positive integer, got {n_subset!r}")
        if float(torch.as_tensor(temperature)) != 1.0:
            raise ValueError("temperature: FunctionalLaplace supports only temperature=1")
        if bool((torch.as_tensor(prior_mean) != 0).any()):
            raise ValueError("prior_mean: FunctionalLaplace supports only a zero prior mean")
        if independent_outputs:
            warnings.warn(
                "independent_outputs: ignored, gaussify keeps the exact C x C kernel blocks",
                stacklevel=2,
            )
        self.likelihood = likelihood
        self.model = model
        self.n_subset, self.seed = n_subset, seed
        self.enable_backprop = bool(enable_backprop)
        self.backend = backend  # accepted; gaussify computes the kernel
        self.temperature = 1.0
        subset: Any = "all"
        if self._key[0] == "last_layer":
            subset = [last_layer_name] if last_layer_name else "last_layer"
        self._dtype = next(model.parameters()).dtype
        self._engine = _Engine(model, likelihood, 1.0, float(torch.as_tensor(sigma_noise)), subset)
        self.n_params = self._engine.subset.num_params
        self.n_layers = len(self._engine.subset.names)
        self.n_outputs, self.n_data = 0, 0
        self._fitted = False
        self.prior_precision = prior_precision
        self.sigma_noise = sigma_noise

    # ------------------------------------------------------------------ hyperparameters
    def _checked_prior(self, value: float | Tensor) -> Tensor:
        prior = torch.as_tensor(value, dtype=self._dtype)
        if prior.numel() != 1 or prior.ndim > 1:
            raise ValueError(
                "prior_precision: FunctionalLaplace supports only an isotropic (scalar) prior, "
                f"got shape {tuple(prior.shape)}"
            )
        return prior.reshape(1)

    def _checked_sigma(self, sigma: Tensor) -> Tensor:
        if sigma.numel() != 1:
            raise ValueError(f"sigma_noise: expected a scalar, got shape {tuple(sigma.shape)}")
        if self.likelihood != "regression" and float(sigma) != 1.0:
            raise ValueError("sigma_noise: must be 1 for classification")
        return sigma

    @property
    def _sod_factor(self) -> float:
        """N / n_subset: laplace-torch's subset-of-data prior rescaling."""
        return self.n_data / self.n_subset

    def _push(self) -> _Engine:
        """The engine at the current (detached) hyperparameters."""
        if not self._fitted:
            raise RuntimeError("Call fit before making functional Laplace predictions.")
        engine = self._engine
        prior = self._prior.detach().reshape(()) * self._sod_factor
        sigma = self._sigma.detach()
        if not (
            torch.equal(engine.prior_precision, prior) and torch.equal(engine.sigma_noise, sigma)
        ):
            engine.prior_precision, engine.sigma_noise = prior, sigma
            engine._chol = None  # the cached posterior factor belongs to the old values
        return engine

    # ------------------------------------------------------------------ fit / evidence
    def fit(self, train_loader: DataLoader, progress_bar: bool = False) -> None:
        """Condition the GP on laplace-torch's subset of ``n_subset`` training points."""
        dataset = train_loader.dataset
        n = len(dataset)  # type: ignore[arg-type]
        if self.n_subset > n:
            raise ValueError(f"n_subset: {self.n_subset} exceeds the {n} training points")
        chosen = np.random.default_rng(self.seed).choice(list(range(n)), self.n_subset, False)
        loader = DataLoader(
            dataset, batch_size=train_loader.batch_size or 1, sampler=chosen.tolist()
        )
        xs, ys = zip(*loader, strict=True)
        self.n_data = n
        self._engine.fit((torch.cat(xs), torch.cat(ys)))
        with torch.no_grad():
            self.n_outputs = int(self.model(xs[0][:1]).shape[-1])
        self._fitted = True

    @property
    def mean(self) -> Tensor:
        return self._push().theta_star

    def log_marginal_likelihood(
        self, prior_precision: Tensor | None = None, sigma_noise: Tensor | None = None
    ) -> Tensor:
        """The exact GP evidence of the linearised model on the subset (module docstring);
        differentiable in both arguments, which become the current hyperparameters."""
        self._set_hyperparameters(prior_precision, sigma_noise)
        engine = self._push()
        prior = self._prior.reshape(()) * self._sod_factor
        sigma = self._sigma if self.likelihood == "regression" else None
        return engine.log_marginal_likelihood(prior, sigma)

    # ------------------------------------------------------------------ predictive
    def _moments(self, x: Tensor, diagonal: bool) -> tuple[Tensor, Tensor]:
        engine = self._push()
        with torch.set_grad_enabled(self.enable_backprop):
            mean = self.model(x)
        cov = engine.functional_covariance(x)
        if not self.enable_backprop:
            mean = mean.detach()
        return mean, cov.diagonal(dim1=-2, dim2=-1) if diagonal else cov

    def __call__(
        self, x: Tensor, pred_type: str = "gp", joint: bool = False, link_approx: str = "probit",
        n_samples: int = 100, diagonal_output: bool = False,
        generator: torch.Generator | None = None, fitting: bool = False, **model_kwargs: Any,
    ) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
        """Classification: probabilities (N, C); regression: latent mean (N, C) and
        covariance (N, C, C) (variances with ``diagonal_output``), noise not added."""
        if option(pred_type, PredType, "pred_type") == "nn":
            raise ValueError("pred_type: FunctionalLaplace predicts with 'gp' (or 'glm')")
        link = option(link_approx, LinkApprox, "link_approx")
        if joint:
            raise ValueError("joint: not supported by gaussify.compat's FunctionalLaplace")
        if self.likelihood == "regression":
            return self._moments(x, diagonal_output)
        mean, cov = self._moments(x, link == "probit" or (link == "mc" and diagonal_output))
        return apply_link(mean, cov, link, n_samples, generator)

    def functional_samples(
        self, x: Tensor, pred_type: str = "glm", n_samples: int = 100,
        diagonal_output: bool = False, generator: torch.Generator | None = None,
    ) -> Tensor:  # fmt: skip
        mean, cov = self._moments(x, diagonal_output)
        return normal_draws(mean, cov, n_samples, generator)

    def predictive_samples(
        self, x: Tensor, pred_type: str = "glm", n_samples: int = 100,
        diagonal_output: bool = False, generator: torch.Generator | None = None,
    ) -> Tensor:  # fmt: skip
        fs = self.functional_samples(x, pred_type, n_samples, diagonal_output, generator)
        return fs if self.likelihood == "regression" else torch.softmax(fs, dim=-1)

    # ------------------------------------------------------------------ tuning
    def optimize_prior_precision(
        self, pred_type: str = "gp", method: str = "marglik", *args: Any, **kwargs: Any
    ) -> None:
        """laplace-torch's tuning (scalar prior only); see :mod:`.laplace_tuning`."""
        if str(getattr(kwargs.get("prior_structure", "scalar"), "value", "scalar")) != "scalar":
            raise ValueError("prior_structure: FunctionalLaplace supports only 'scalar'")
        _optimize(self, pred_type, method, *args, **kwargs)

    def _require_fit(self) -> None:
        self._push()

    def _tune_marglik(self, granularity: str, n_steps: int, lr: float) -> None:
        engine = self._push()
        engine.optimize_prior(
            method="gradient",
            granularity="scalar",
            tune_noise=False,
            n_steps=n_steps,
            lr=lr,
            fixed_steps=True,  # laplace-torch's n_steps of Adam, not run to convergence
        )
        self.prior_precision = engine.prior_precision.detach() / self._sod_factor

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "cls_name": type(self).__name__,
            "likelihood": self.likelihood,
            "n_data": self.n_data,
            "n_outputs": self.n_outputs,
            "n_subset": self.n_subset,
            "prior_precision": self._prior.detach(),
            "sigma_noise": self._sigma.detach(),
            "engine": self._push().state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_saved_class(state_dict)
        if state_dict["likelihood"] != self.likelihood:
            raise ValueError("state_dict: saved for a different likelihood")
        self._engine.load_state_dict(state_dict["engine"])
        self.n_data, self.n_outputs = int(state_dict["n_data"]), int(state_dict["n_outputs"])
        self.n_subset = int(state_dict["n_subset"])
        self.prior_precision = state_dict["prior_precision"]
        self.sigma_noise = state_dict["sigma_noise"]
        self._fitted = True


class FunctionalLLLaplace(FunctionalLaplace):
    """Function-space Laplace over the last layer's weights."""

    _key = ("last_layer", "gp")
