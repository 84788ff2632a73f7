"""laplace-torch's ``marglik_training`` (Immer et al. 2021, Alg. 1) with its arguments,
schedule and return value ``(la, model, margliks, losses)``, on gaussify.compat's Laplace.

Per epoch the weights take one pass of ``optimizer_cls`` steps on
``criterion(f, y) + theta^T diag(delta) theta / (2 N c)`` (criterion: mean cross-entropy,
``c = T``; or mean squared error, ``c = T / (2 sigma^2)``). Every ``marglik_frequency``
epochs from ``n_epochs_burnin`` on, a Laplace approximation is fitted and ``n_hypersteps``
Adam steps (``lr_hyp``) on log delta (and log sigma) increase its evidence; the weights with
the best evidence are kept and refitted at the end. ``margliks`` holds the negative log
evidence of every hyperstep, ``losses`` the mean training loss of every epoch. gaussify's
own :func:`gaussify.marglik_training` is the engine's version (best-evidence model selection,
spectral tuning); this one keeps laplace-torch's schedule so migrated numbers match.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from gaussify.compat.laplace.enums import HessianStructure, Likelihood, PriorStructure, option
from gaussify.compat.laplace.parametric import Laplace

__all__ = ["marglik_training"]


def _expand(prior: Tensor, params: list[Tensor]) -> Tensor:
    """A scalar, per-tensor or per-parameter prior as one value per parameter."""
    counts = [p.numel() for p in params]
    if prior.numel() == 1:
        return prior.reshape(1).expand(sum(counts))
    if prior.numel() == len(params):
        return torch.cat([d.expand(c) for d, c in zip(prior, counts, strict=True)])
    return prior


def marglik_training(
    model: nn.Module, train_loader: Any, likelihood: str = "classification",
    hessian_structure: str = "kron", backend: type | None = None,
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.Adam,
    optimizer_kwargs: dict[str, Any] | None = None, scheduler_cls: type | None = None,
    scheduler_kwargs: dict[str, Any] | None = None, n_epochs: int = 300, lr_hyp: float = 1e-1,
    prior_structure: str = "layerwise", n_epochs_burnin: int = 0, n_hypersteps: int = 10,
    marglik_frequency: int = 1, prior_prec_init: float = 1.0, sigma_noise_init: float = 1.0,
    temperature: float = 1.0, fix_sigma_noise: bool = False, progress_bar: bool = False,
    enable_backprop: bool = False, dict_key_x: str = "input_ids", dict_key_y: str = "labels",
) -> tuple[Any, nn.Module, list[float], list[float]]:  # fmt: skip
    """Train ``model`` and its prior precision (and noise) by the Laplace evidence; returns
    the Laplace at the best epoch, the model restored there, the negative log evidences and
    the epoch losses (module docstring)."""
    likelihood = option(likelihood, Likelihood, "likelihood")
    structure = option(hessian_structure, HessianStructure, "hessian_structure")
    prior_kind = option(prior_structure, PriorStructure, "prior_structure")
    if likelihood not in ("classification", "regression"):
        raise ValueError(
            f"likelihood: expected 'classification' or 'regression', got {likelihood!r}"
        )
    if n_epochs < 1 or n_hypersteps < 1 or marglik_frequency < 1:
        raise ValueError("n_epochs, n_hypersteps, marglik_frequency: must be positive integers")
    kwargs = dict(optimizer_kwargs or {})
    if "weight_decay" in kwargs:
        warnings.warn("optimizer_kwargs: weight_decay is the tuned prior, set to 0", stacklevel=2)
        kwargs["weight_decay"] = 0.0
    params = [p for p in model.parameters() if p.requires_grad]
    dtype = params[0].dtype
    n = len(train_loader.dataset)
    size = {"scalar": 1, "layerwise": len(params), "diag": sum(p.numel() for p in params)}
    log_prior = torch.full(
        (size[prior_kind],), math.log(temperature * prior_prec_init), dtype=dtype
    ).requires_grad_()
    regression = likelihood == "regression"
    log_sigma = torch.full((1,), math.log(sigma_noise_init), dtype=dtype).requires_grad_()
    hyper = [log_prior, log_sigma] if regression else [log_prior]
    optimizer = optimizer_cls(model.parameters(), **kwargs)
    scheduler = scheduler_cls(optimizer, **(scheduler_kwargs or {})) if scheduler_cls else None
    hyper_optimizer = torch.optim.Adam(hyper, lr=lr_hyp)
    criterion = nn.MSELoss() if regression else nn.CrossEntropyLoss()

    def sigma_now(detach: bool) -> Any:
        if not regression:
            return 1.0
        if fix_sigma_noise:
            return sigma_noise_init
        return log_sigma.exp().detach() if detach else log_sigma.exp()

    def laplace(sigma: Any, prior: Tensor, backprop: bool = False) -> Any:
        return Laplace(
            model,
            likelihood,
            "all",
            structure,
            sigma_noise=sigma,
            prior_precision=prior,
            temperature=temperature,
            backend=backend,
            enable_backprop=backprop,
        )

    best: tuple[float, dict[str, Tensor], Tensor, Any] | None = None
    losses: list[float] = []
    margliks: list[float] = []
    for epoch in range(1, n_epochs + 1):
        total = 0.0
        for x, y in train_loader:
            optimizer.zero_grad()
            sigma = sigma_now(detach=True)
            factor = temperature / (2 * sigma**2) if regression else temperature
            delta = _expand(log_prior.detach().exp(), params)
            theta = torch.cat([p.reshape(-1) for p in params])
            f = model(x)
            loss = criterion(f, y) + 0.5 * (delta * theta) @ theta / n / factor
            loss.backward()
            optimizer.step()
            total += loss.item() * len(y)
            if scheduler is not None:
                scheduler.step()
        losses.append(total / n)
        if epoch % marglik_frequency != 0 or epoch < n_epochs_burnin:
            continue
        la = laplace(sigma_now(detach=False), log_prior.exp())
        la.fit(train_loader)
        used: tuple[Tensor, Any] = (log_prior.exp(), sigma_now(detach=False))
        for _ in range(n_hypersteps):
            hyper_optimizer.zero_grad()
            sigma = None if not regression or fix_sigma_noise else log_sigma.exp()
            used = (log_prior.exp(), sigma_now(detach=False))
            neg = -la.log_marginal_likelihood(used[0], sigma)
            neg.backward()
            hyper_optimizer.step()
            margliks.append(neg.item())
        if best is None or margliks[-1] < best[0]:
            # the hyperparameters of the last evidence evaluated (before its Adam step)
            prior_used, sigma_used = used
            if isinstance(sigma_used, Tensor):
                sigma_used = sigma_used.detach().clone()
            best = (
                margliks[-1],
                copy.deepcopy(model.state_dict()),
                prior_used.detach().clone(),
                sigma_used,
            )
    if best is None:
        prior, sigma = log_prior.exp().detach(), sigma_now(detach=True)
    else:
        model.load_state_dict(best[1])
        prior, sigma = best[2], best[3]
    la = laplace(sigma, prior, enable_backprop)
    la.fit(train_loader)
    return la, model, margliks, losses
