"""laplace-torch's public API on gaussify's engine: change ``from laplace import Laplace`` to
``from gaussify.compat.laplace import Laplace`` and keep the rest of the script.

Every class here is a thin adapter over :class:`gaussify.Laplace` (one object, ``_engine``),
built with laplace-torch's conventions so that its numbers do not move:

* evidence without the non-MAP correction (``correction=False``):
  ``log p(D | theta*) - 1/2 [log det P - log det P0 + (theta* - m0)^T P0 (theta* - m0)]``
  with ``P = G / (sigma^2 T) + P0``, and for regression the tempered log-likelihood
  ``-SSE / (2 sigma^2 T) - N C log(sigma sqrt(2 pi))`` (the normaliser is not tempered);
* Kronecker factors with weight and bias as separate blocks (``kron_bias="separate"``);
* hyperparameters in its shapes: the prior precision is a (1,), (n_layers,) or (n_params,)
  tensor (n_layers = parameter tensors), ``sigma_noise`` a 0-d tensor; passing them to
  :meth:`ParametricLaplace.log_marginal_likelihood` sets them, keeping their autograd graph
  (its README tunes both with Adam through that call);
* its predictive return values, link formulas (:mod:`.laplace_links`), prior-tuning and
  grid-search criteria (:mod:`.laplace_tuning`).

``backend``, ``backend_kwargs`` and ``asdl_fisher_kwargs`` are accepted and replaced by
gaussify's engine (its curvature is the exact GGN or KFAC whatever laplace-torch backend is
named, see :mod:`gaussify.compat.laplace.curvature`); an empirical-Fisher backend (a class
whose name contains "EF") selects ``ef=True``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from gaussify.compat.laplace._shared import CompatHyperparameters, check_likelihood
from gaussify.compat.laplace.enums import (
    FunctionalApproximation,
    HessianStructure,
    LinkApprox,
    PredType,
    SubsetOfWeights,
    option,
)
from gaussify.compat.laplace.links import apply_link, normal_draws
from gaussify.compat.laplace.tuning import optimize_prior_precision
from gaussify.validation import check_data
from gaussify.weight_space.laplace import Laplace as _Engine

__all__ = [
    "DiagLLLaplace",
    "DiagLaplace",
    "DiagSubnetLaplace",
    "FullLLLaplace",
    "FullLaplace",
    "FullSubnetLaplace",
    "KronLLLaplace",
    "KronLaplace",
    "Laplace",
    "LowRankLaplace",
    "ParametricLaplace",
]


class _KronPrecision:
    """The Kronecker posterior precision (laplace-torch's ``KronDecomposed`` role): a dense
    view on demand, its log-determinant and diagonal."""

    def __init__(self, posterior: Any) -> None:
        self._posterior = posterior

    def to_matrix(self) -> Tensor:
        return self._posterior.precision_dense()

    def logdet(self) -> Tensor:
        return self._posterior.logdet()

    def diag(self) -> Tensor:
        return self._posterior.precision_dense().diagonal()


class ParametricLaplace(CompatHyperparameters):
    """Base of the weight-space classes; a subclass only names its ``_key``
    (subset_of_weights, hessian_structure). See the module docstring for the conventions."""

    _key: tuple[str, str] = ("all", "full")

    def __init__(
        self,
        model: nn.Module,
        likelihood: str,
        sigma_noise: float | Tensor = 1.0,
        prior_precision: float | Tensor = 1.0,
        prior_mean: float | Tensor = 0.0,
        temperature: float = 1.0,
        enable_backprop: bool = False,
        *,
        subnetwork_indices: Tensor | None = None,
        last_layer_name: str | None = None,
        damping: bool = False,
        backend: type | None = None,
        backend_kwargs: dict[str, Any] | None = None,
        asdl_fisher_kwargs: dict[str, Any] | None = None,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        feature_reduction: str | None = None,
        rank: int | None = None,
    ) -> None:
        likelihood = check_likelihood(likelihood)
        if damping:
            raise ValueError("damping: Kronecker damping is not supported; pass damping=False")
        self.likelihood = str(likelihood)
        if likelihood != "regression" and not _is_one(sigma_noise):
            raise ValueError(
                "sigma_noise: must be 1 for classification (only regression has noise)"
            )
        subset_kind, structure = self._key
        subset: Any = "all"
        if subset_kind == "last_layer":
            subset = [last_layer_name] if last_layer_name is not None else "last_layer"
        elif subset_kind == "subnetwork":
            if subnetwork_indices is None:
                raise ValueError("subnetwork_indices: required for subnetwork Laplace")
            subset = torch.as_tensor(subnetwork_indices).reshape(-1).long()
        options: dict[str, Any] = {}
        if structure == "kron":
            options["kron_bias"] = "separate"
        if structure == "lowrank" and rank is not None:
            options["rank"] = rank
        if backend is not None and "EF" in getattr(backend, "__name__", ""):
            options["ef"] = True
        self.model = model
        self.enable_backprop = bool(enable_backprop)
        self.dict_key_x, self.dict_key_y = dict_key_x, dict_key_y
        self.backend = backend  # accepted; gaussify's engine computes the curvature
        self._engine = _Engine(
            model,
            self.likelihood,
            structure,
            subset,
            prior_precision=1.0,
            sigma_noise=1.0,
            correction=False,
            **options,
        )
        self.n_params: int = self._engine.subset.num_params
        self.n_layers: int = len(self._engine.subset.names)
        self.n_outputs: int = 0
        self._dtype = next(model.parameters()).dtype
        self._fitted = False
        self._pushed: tuple[Any, ...] | None = None
        self.prior_precision = prior_precision
        self.sigma_noise = sigma_noise
        self.temperature = temperature
        self.prior_mean = prior_mean

    # ------------------------------------------------------------------ hyperparameters
    def _checked_prior(self, value: float | Tensor) -> Tensor:
        """(1,), (n_layers,) or (n_params,) tensor, as laplace-torch stores it."""
        if isinstance(value, str | bool) or value is None:
            raise ValueError(
                f"prior_precision: expected a number or a tensor, got {type(value).__name__}"
            )
        prior = torch.as_tensor(value, dtype=self._dtype)
        if prior.ndim > 1:
            raise ValueError(
                f"prior_precision: expected at most 1 dimension, got shape {tuple(prior.shape)}"
            )
        prior = prior.reshape(-1).to(self._dtype)
        allowed = [1, self.n_layers, self.n_params]
        if self._key[1] == "kron":
            allowed = [1, self.n_layers]
        if len(prior) not in allowed:
            raise ValueError(
                f"prior_precision: expected length in {sorted(set(allowed))} (scalar, per layer"
                f"{'' if self._key[1] == 'kron' else ' or per parameter'}), got {len(prior)}"
            )
        return prior

    @property
    def prior_precision_diag(self) -> Tensor:
        """The prior precision expanded to one value per parameter (n_params,)."""
        prior = self._prior
        if len(prior) == 1:
            return prior.expand(self.n_params)
        if len(prior) == self.n_params:
            return prior
        counts = torch.tensor(list(self._engine.subset.counts))
        return prior.repeat_interleave(counts)

    def _checked_sigma(self, sigma: Tensor) -> Tensor:
        if sigma.ndim > 1 or sigma.numel() != 1:
            raise ValueError(
                "sigma_noise: only a homoscedastic (scalar) noise is supported, got shape "
                f"{tuple(sigma.shape)}"
            )
        return sigma

    @property
    def prior_mean(self) -> Tensor:
        return self._engine.prior_mean

    @prior_mean.setter
    def prior_mean(self, value: float | Tensor) -> None:
        value = torch.as_tensor(value, dtype=self._dtype)
        self._engine.prior_mean = value.reshape(()) if value.numel() == 1 else value

    @property
    def temperature(self) -> float:
        return self._temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        self._engine.temperature = value  # validates
        self._temperature = float(value)

    @property
    def _H_factor(self) -> Tensor:
        """1 / (sigma^2 T): the factor of the fitted curvature in the posterior precision."""
        return 1 / self._sigma.square() / self.temperature

    def _gs_prior(self, prior: Tensor) -> Tensor:
        return prior.reshape(()) if prior.numel() == 1 else prior

    def _push(self) -> _Engine:
        """The engine with the current hyperparameters (detached), for everything that is not
        the evidence: predictive, samples, posterior views."""
        self._require_fit()
        key = (self._prior, self._sigma)
        if self._pushed is None or any(a is not b for a, b in zip(key, self._pushed, strict=True)):
            self._engine.prior_precision = self._gs_prior(self._prior.detach())
            if self.likelihood == "regression":
                self._engine.sigma_noise = self._sigma.detach()
            self._pushed = key
        return self._engine

    def _require_fit(self) -> None:
        if not self._fitted:
            raise AttributeError("Laplace not fitted. Run fit() first.")

    # ------------------------------------------------------------------ fit
    def fit(self, train_loader: Any, override: bool = True, progress_bar: bool = False) -> None:
        """Curvature, log-likelihood and MAP at the model's current weights over
        ``train_loader`` (``override=False`` adds to the previous fit)."""
        if not override and self._key[0] == "last_layer":
            raise ValueError("override: last-layer Laplace does not support override=False")
        # the loader is read twice (the fit, then one batch for n_outputs): no generators
        train_loader = check_data(
            train_loader, model=self.model, owner=f"{type(self).__name__}.fit", multi_pass=True
        )
        self._pushed = None
        self._engine.sigma_noise = self._sigma.detach()
        self._engine.fit(train_loader, reset=override, progress=progress_bar)
        x = next(iter(train_loader))[0]
        with torch.no_grad():
            self.n_outputs = int(self.model(x[:1]).shape[-1])
        self._fitted = True

    @property
    def mean(self) -> Tensor:
        """MAP of the Laplace weights (n_params,); for a subnetwork, of all the weights."""
        if self._key[0] == "subnetwork":
            return _all_params(self.model)
        return self._engine.mean

    @property
    def n_data(self) -> int:
        return int(self._engine.num_data) if self._fitted else 0

    # ------------------------------------------------------------------ evidence
    def log_marginal_likelihood(
        self, prior_precision: Tensor | None = None, sigma_noise: Tensor | None = None
    ) -> Tensor:
        """Laplace evidence (module docstring); differentiable in both arguments, which are
        stored as the current hyperparameters (as laplace-torch does)."""
        self._set_hyperparameters(prior_precision, sigma_noise)
        self._require_fit()
        regression = self.likelihood == "regression"
        value = self._engine.log_marginal_likelihood(
            self._gs_prior(self._prior), self._sigma if regression else None
        )
        if regression and self.temperature != 1.0:
            normaliser = self._sigma.log() + 0.5 * math.log(2 * math.pi)
            count = self.n_data * self.n_outputs
            value = value + count * normaliser * (1 / self.temperature - 1)
        return value

    @property
    def log_det_posterior_precision(self) -> Tensor:
        return self._push().posterior.logdet()

    @property
    def log_det_prior_precision(self) -> Tensor:
        return self.prior_precision_diag.log().sum()

    @property
    def log_det_ratio(self) -> Tensor:
        return self.log_det_posterior_precision - self.log_det_prior_precision

    @property
    def scatter(self) -> Tensor:
        """(theta* - m0)^T P0 (theta* - m0)."""
        delta = self._engine.mean - self.prior_mean
        return (delta * self.prior_precision_diag) @ delta

    @property
    def log_likelihood(self) -> Tensor:
        """The (tempered) training log-likelihood at the MAP."""
        return self.log_marginal_likelihood() + 0.5 * (self.log_det_ratio + self.scatter)

    @property
    def loss(self) -> Tensor:
        """The summed training loss at the MAP: cross-entropy, or half the sum of squared
        errors for regression (laplace-torch's ``loss``)."""
        with torch.no_grad():
            log_lik = self.log_likelihood
            if self.likelihood != "regression":
                return -log_lik * self.temperature
            sigma = self._sigma.detach()
            count = self.n_data * self.n_outputs
            normaliser = count * (sigma.log() + 0.5 * math.log(2 * math.pi))
            return -(log_lik + normaliser) * sigma.square() * self.temperature

    def square_norm(self, value: Tensor) -> Tensor:
        delta = value - self._engine.mean
        post = self._push().posterior
        if self._key[1] == "diag":
            return (delta.square() / post.covariance_diag()).sum()
        if hasattr(post, "matvec"):
            return delta @ post.matvec(delta)
        return delta @ post.precision_dense() @ delta

    def log_prob(self, value: Tensor, normalized: bool = True) -> Tensor:
        """log N(value; mean, P^-1) (or only its quadratic term when not ``normalized``)."""
        if not normalized:
            return -self.square_norm(value) / 2
        const = -self.n_params / 2 * math.log(2 * math.pi) + self.log_det_posterior_precision / 2
        return const - self.square_norm(value) / 2

    # ------------------------------------------------------------------ posterior views
    @property
    def posterior_precision(self) -> Any:
        """Full: (P, P); diag: the (P,) diagonal; kron: a structured view (``to_matrix()``)."""
        post = self._push().posterior
        if self._key[1] == "diag":
            return 1 / post.covariance_diag()
        if self._key[1] == "kron":
            return _KronPrecision(post)
        return post.precision_dense()

    @property
    def posterior_covariance(self) -> Tensor:
        return self._push().posterior_covariance

    @property
    def posterior_variance(self) -> Tensor:
        return self._push().posterior_variance

    @property
    def posterior_scale(self) -> Tensor:
        """Full: the lower Cholesky factor of the covariance; diag: the (P,) standard deviations."""
        if self._key[1] == "diag":
            return self.posterior_variance.sqrt()
        return torch.linalg.cholesky(self.posterior_covariance)

    @property
    def H(self) -> Tensor:
        """The fitted curvature at sigma = 1, T = 1: (P, P), or (P,) for the diagonal."""
        prior = self.prior_precision_diag.detach()
        if self._key[1] == "diag":
            return (1 / self._push().posterior.covariance_diag() - prior) / self._H_factor.detach()
        prec = self._push().posterior.precision_dense()
        return (prec - torch.diag(prior)) / self._H_factor.detach()

    def functional_variance(self, Js: Tensor) -> Tensor:
        """J P^-1 J^T per input: (N, C, C) from Jacobians (N, C, P)."""
        return self._push().posterior.functional_cov(Js)

    def functional_covariance(self, Js: Tensor) -> Tensor:
        """(N C, N C) covariance across inputs and outputs from Jacobians (N, C, P)."""
        n, c, p = Js.shape
        return self._push().posterior.functional_cov(Js.reshape(1, n * c, p))[0]

    def sample(self, n_samples: int = 100, generator: torch.Generator | None = None) -> Tensor:
        """Weight draws from the posterior (S, n_params); a subnetwork returns all weights."""
        full = self._key[0] == "subnetwork"
        return self._push().sample(n_samples, generator, full=full)

    # ------------------------------------------------------------------ predictive
    def _glm(self, x: Tensor, joint: bool, diagonal: bool) -> tuple[Tensor, Tensor]:
        engine = self._push()
        if joint:
            pred = engine.predict(x, "glm", joint=True)
            mean, var = pred.f_mean.reshape(-1), pred.joint_cov
        else:
            pred = engine.predict(x, "glm", diagonal_output=diagonal)
            mean, var = pred.f_mean, pred.f_cov
            if diagonal:
                var = var.diagonal(dim1=-2, dim2=-1)
        assert var is not None
        if not self.enable_backprop:
            mean, var = mean.detach(), var.detach()
        return mean, var

    def _nn_functions(self, x: Tensor, n_samples: int, generator: Any) -> Tensor:
        pred = self._push().predict(x, "nn", num_samples=n_samples, generator=generator)
        assert pred.f_samples is not None
        return pred.f_samples

    def __call__(
        self, x: Tensor, pred_type: str = "glm", joint: bool = False, link_approx: str = "probit",
        n_samples: int = 100, diagonal_output: bool = False,
        generator: torch.Generator | None = None, fitting: bool = False, **model_kwargs: Any,
    ) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
        """Classification: class probabilities (N, C). Regression: the latent mean (N, C) and
        covariance (N, C, C) (variances (N, C) with ``diagonal_output``; with ``joint`` the
        flattened mean (N C,) and covariance (N C, N C)); the observation noise is not added."""
        pred_type = option(pred_type, PredType, "pred_type")
        link = option(link_approx, LinkApprox, "link_approx")
        if pred_type == "gp":
            raise ValueError("pred_type: 'gp' is for FunctionalLaplace; use 'glm' or 'nn'")
        if pred_type == "nn" and link != "mc":
            raise ValueError("link_approx: only 'mc' is supported for pred_type='nn'")
        regression = self.likelihood == "regression"
        if pred_type == "glm":
            if regression:
                return self._glm(x, joint, diagonal_output and not joint)
            diagonal = link == "probit" or (link == "mc" and diagonal_output)
            mean, var = self._glm(x, False, diagonal)
            return apply_link(mean, var, link, n_samples, generator)
        fs = self._nn_functions(x, n_samples, generator)
        if regression:
            return fs.mean(0), fs.var(0)
        return torch.softmax(fs, dim=-1).mean(0)

    def predictive(
        self, x: Tensor, pred_type: str, link_approx: str, n_samples: int
    ) -> Tensor | tuple[Tensor, Tensor]:
        return self(x, pred_type=pred_type, link_approx=link_approx, n_samples=n_samples)

    def functional_samples(
        self, x: Tensor, pred_type: str = "glm", n_samples: int = 100,
        diagonal_output: bool = False, generator: torch.Generator | None = None,
    ) -> Tensor:  # fmt: skip
        """Latent function draws (S, N, C)."""
        if option(pred_type, PredType, "pred_type") == "glm":
            mean, var = self._glm(x, False, diagonal_output)
            return normal_draws(mean, var, n_samples, generator)
        return self._nn_functions(x, n_samples, generator)

    def predictive_samples(
        self, x: Tensor, pred_type: str = "glm", n_samples: int = 100,
        diagonal_output: bool = False, generator: torch.Generator | None = None,
    ) -> Tensor:  # fmt: skip
        """Predictive draws (S, N, C): softmax of the function draws for classification."""
        fs = self.functional_samples(x, pred_type, n_samples, diagonal_output, generator)
        return fs if self.likelihood == "regression" else torch.softmax(fs, dim=-1)

    optimize_prior_precision = optimize_prior_precision

    def _tune_marglik(self, granularity: str, n_steps: int, lr: float) -> None:
        """Adam on the log prior from the current value (gaussify's engine, closed form in
        the curvature's eigenbasis where the structure allows it)."""
        engine = self._push()
        engine.optimize_prior(
            method="gradient",
            granularity=granularity,
            tune_noise=False,
            n_steps=n_steps,
            lr=lr,
            fixed_steps=True,  # laplace-torch's n_steps of Adam, not run to convergence
        )
        self.prior_precision = engine.prior_precision.detach().reshape(-1).clone()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        self._require_fit()
        return {
            "cls_name": type(self).__name__,
            "likelihood": self.likelihood,
            "n_outputs": self.n_outputs,
            "prior_precision": self._prior.detach(),
            "sigma_noise": self._sigma.detach(),
            "temperature": self.temperature,
            "enable_backprop": self.enable_backprop,
            "engine": self._push().state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_saved_class(
            state_dict, "; make sure subset_of_weights and hessian_structure match"
        )
        if len(state_dict["engine"]["mean"]) != self.n_params:
            raise ValueError(
                f"state_dict: saved for {len(state_dict['engine']['mean'])} parameters, this "
                f"Laplace has {self.n_params}; use the same subset_of_weights and requires_grad"
            )
        if state_dict["likelihood"] != self.likelihood:
            raise ValueError(
                f"state_dict: likelihood {state_dict['likelihood']!r} differs from "
                f"{self.likelihood!r}"
            )
        if float(state_dict["temperature"]) != self.temperature:
            warnings.warn("state_dict: a different temperature was saved", stacklevel=2)
        self._engine.load_state_dict(state_dict["engine"])
        self.n_outputs = int(state_dict["n_outputs"])
        self.prior_precision = state_dict["prior_precision"]
        self.sigma_noise = state_dict["sigma_noise"]
        self.temperature = state_dict["temperature"]
        self._fitted, self._pushed = True, None


def _is_one(value: float | Tensor) -> bool:
    return bool((torch.as_tensor(value) == 1).all())


def _all_params(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


# One class per (subset_of_weights, hessian_structure): only the key differs.
class FullLaplace(ParametricLaplace):
    _key = ("all", "full")


class KronLaplace(ParametricLaplace):
    _key = ("all", "kron")


class DiagLaplace(ParametricLaplace):
    _key = ("all", "diag")


class LowRankLaplace(ParametricLaplace):
    _key = ("all", "lowrank")


class FullLLLaplace(ParametricLaplace):
    _key = ("last_layer", "full")


class KronLLLaplace(ParametricLaplace):
    _key = ("last_layer", "kron")


class DiagLLLaplace(ParametricLaplace):
    _key = ("last_layer", "diag")


class _SubnetLaplace(ParametricLaplace):
    """Subnetwork Laplace: ``subnetwork_indices`` (third argument, as in laplace-torch) index
    the vector of all trainable parameters."""

    def __init__(
        self, model: nn.Module, likelihood: str, subnetwork_indices: Tensor, *args: Any, **kw: Any
    ) -> None:
        super().__init__(model, likelihood, *args, subnetwork_indices=subnetwork_indices, **kw)


class FullSubnetLaplace(_SubnetLaplace):
    _key = ("subnetwork", "full")


class DiagSubnetLaplace(_SubnetLaplace):
    _key = ("subnetwork", "diag")


_CLASSES: dict[tuple[str, str], type[ParametricLaplace]] = {
    c._key: c
    for c in (
        FullLaplace,
        KronLaplace,
        DiagLaplace,
        LowRankLaplace,
        FullLLLaplace,
        KronLLLaplace,
        DiagLLLaplace,
        FullSubnetLaplace,
        DiagSubnetLaplace,
    )
}


def Laplace(
    model: nn.Module,
    likelihood: str,
    subset_of_weights: str = "last_layer",
    hessian_structure: str = "kron",
    *args: Any,
    functional_approximation: str = "sod",
    **kwargs: Any,
) -> Any:
    """The Laplace class for (``subset_of_weights``, ``hessian_structure``), as laplace-torch's
    factory: "all" / "last_layer" / "subnetwork" x "full" / "kron" / "diag" / "lowrank", and "gp"
    (function space, :mod:`gaussify.compat.laplace.functional`)."""
    subset = option(subset_of_weights, SubsetOfWeights, "subset_of_weights")
    structure = option(hessian_structure, HessianStructure, "hessian_structure")
    approx = option(functional_approximation, FunctionalApproximation, "functional_approximation")
    if subset == "subnetwork" and structure not in ("full", "diag"):
        raise ValueError(
            f"hessian_structure: subnetwork Laplace needs 'full' or 'diag', got {structure!r}"
        )
    if structure == "gp":
        if approx != "sod" or subset == "subnetwork":
            raise ValueError(
                "functional_approximation: gaussify.compat supports 'sod' (subset of data) "
                "with subset_of_weights 'all' or 'last_layer'; for Nystrom or variational "
                "function-space Laplace use gaussify.ELLA or gaussify.VaLLA"
            )
        from gaussify.compat.laplace.functional import FunctionalLaplace, FunctionalLLLaplace

        cls = FunctionalLaplace if subset == "all" else FunctionalLLLaplace
        return cls(model, likelihood, *args, **kwargs)
    if approx != "sod":
        raise ValueError("functional_approximation: needs hessian_structure='gp'")
    key = (subset, structure)
    if key not in _CLASSES:
        raise ValueError(
            f"hessian_structure: {structure!r} is not available with subset_of_weights "
            f"{subset!r}; available: {sorted(_CLASSES)}"
        )
    return _CLASSES[key](model, likelihood, *args, **kwargs)
