"""Online marginal-likelihood training: learn weights and hyperparameters together.

Immer et al. (2021, "Scalable marginal likelihood estimation for model selection in deep
learning", Alg. 1): gradient steps on the weights under the current prior precision delta (and
noise sigma for regression) alternate, every ``marglik_frequency`` epochs after a burn-in, with
at most ``n_hypersteps`` iterations of the shared tuning routine (:mod:`gaussify.tuning`) on log
delta (and log sigma) that maximise the Laplace-GGN log
evidence of the current network (evidence.py, thesis eq. 3.18). The network with the best
evidence is kept, which makes the evidence a model-selection criterion computed from training
data alone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from gaussify.batches import Batches, as_batches, num_examples
from gaussify.curvature.subset import select_parameters
from gaussify.likelihoods import Likelihood, get_likelihood
from gaussify.training import GaussianLogPrior
from gaussify.tuning import (
    OPTIMIZERS,
    Optimizer,
    check_choice,
    check_positive,
)
from gaussify.validation import (
    check_count,
    check_data,
)
from gaussify.weight_space.laplace import Laplace, Structure

__all__ = ["MarglikHistory", "marglik_training"]


@dataclass
class MarglikHistory:
    """Per-epoch negative log joint per datum (``loss``) and, at each hyperparameter update,
    the epoch, log evidence, prior precision and noise."""

    loss: list[float] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    log_marglik: list[float] = field(default_factory=list)
    prior_precision: list[Tensor] = field(default_factory=list)
    sigma_noise: list[float] = field(default_factory=list)


def marglik_training(
    model: nn.Module,
    data: Batches,
    likelihood: str | Likelihood = "classification",
    *,
    structure: Structure = "kron",
    subset: str | list[str] = "all",
    prior_structure: Literal["scalar", "layer"] = "layer",
    prior_precision: float = 1.0,
    sigma_noise: float = 1.0,
    epochs: int = 100,
    lr: float = 1e-3,
    lr_hyp: float = 0.1,
    burnin: int = 10,
    marglik_frequency: int = 5,
    n_hypersteps: int = 50,
    hyper_optimizer: Optimizer = "lbfgs",
    batch_size: int = 128,
    seed: int | None = None,
    progress: bool = False,
    **laplace_options: Any,
) -> tuple[nn.Module, Laplace, MarglikHistory]:
    """Train ``model`` and its prior precision (and regression noise) by the Laplace evidence.

    Every ``marglik_frequency`` epochs after ``burnin`` the hyperparameters are tuned on the
    current network by :meth:`Laplace.optimize_prior` (the shared routine of
    :mod:`gaussify.tuning`: at most ``n_hypersteps`` iterations of ``hyper_optimizer``,
    "lbfgs" or "adam" with step ``lr_hyp``, until converged; a
    :class:`gaussify.warnings.ConvergenceWarning` when a phase ends unconverged).

    Returns the model restored to the epoch with the best log evidence, the Laplace posterior
    fitted there with the learned hyperparameters, and the history.
    """
    epochs = check_count(epochs, "epochs")
    marglik_frequency = check_count(marglik_frequency, "marglik_frequency")
    n_hypersteps = check_count(n_hypersteps, "n_hypersteps")
    batch_size = check_count(batch_size, "batch_size")
    check_positive(lr_hyp, "lr_hyp")
    check_choice(hyper_optimizer, "hyper_optimizer", OPTIMIZERS)
    if burnin < 0 or burnin >= epochs:
        raise ValueError(f"burnin: must be in [0, epochs), got {burnin}")
    if prior_structure not in ("scalar", "layer"):
        raise ValueError(f"prior_structure: expected 'scalar' or 'layer', got {prior_structure!r}")
    lik = get_likelihood(likelihood, sigma_noise=sigma_noise)
    regression = lik.task == "regression"
    generator = None
    if seed is not None:
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed)
    data = check_data(data, model=model, task=lik.task, owner="marglik_training", multi_pass=True)
    batches = as_batches(data, batch_size=batch_size, shuffle=True, generator=generator)
    fit_batches = as_batches(data, batch_size=max(batch_size, 256))
    n_data = num_examples(batches)
    dd = {"dtype": next(model.parameters()).dtype, "device": next(model.parameters()).device}
    all_names = select_parameters(model, "all").names
    # the posterior's per-tensor priors are those of its subset's tensors
    in_subset = [all_names.index(n) for n in select_parameters(model, subset).names]
    n_prior = 1 if prior_structure == "scalar" else len(all_names)
    log_delta = torch.full((n_prior,), float(prior_precision), **dd).log()
    log_sigma = torch.tensor(float(sigma_noise), **dd).log()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    history = MarglikHistory()
    best: tuple[float, dict[str, Tensor], Laplace] | None = None
    epoch_iter: Any = range(1, epochs + 1)
    if progress:
        from tqdm.auto import tqdm

        epoch_iter = tqdm(epoch_iter, desc="marglik training", unit="epoch")
    for epoch in epoch_iter:
        model.train()
        # the weight steps see delta as a constant: build the prior term once per epoch
        prior_term = GaussianLogPrior(model, _prior(log_delta, prior_structure).detach())
        delta_subset = _prior(log_delta, prior_structure, in_subset).detach()
        sigma = log_sigma.detach().exp()
        batch_lik = get_likelihood("regression", sigma_noise=sigma) if regression else lik
        total: Tensor | float = 0.0  # summed on the model's device: one host read per epoch
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            nll = -batch_lik.log_prob(model(x), y).mean()
            loss = nll - prior_term() / n_data
            if not torch.isfinite(loss):
                raise FloatingPointError(f"marglik_training: loss became {loss.item()}")
            loss.backward()
            opt.step()
            total = total + loss.detach().double() * x.shape[0]
        history.loss.append(float(total) / n_data)
        if epoch <= burnin or epoch % marglik_frequency != 0:
            continue
        model.eval()
        la = Laplace(
            model,
            batch_lik,
            structure,
            subset,
            prior_precision=delta_subset,
            sigma_noise=sigma,
            **laplace_options,
        ).fit(fit_batches)
        # the evidence steps: the shared tuning routine (scale-aware start, at most
        # n_hypersteps iterations, convergence test and ConvergenceWarning)
        la.optimize_prior(
            granularity=prior_structure,
            tune_noise=regression,
            n_steps=n_hypersteps,
            lr=lr_hyp,
            optimizer=hyper_optimizer,
        )
        with torch.no_grad():
            tuned = la.prior_precision.reshape(-1).log()
            if prior_structure == "scalar":
                log_delta = tuned.reshape(1).clone()
            else:
                log_delta = log_delta.clone()
                log_delta[in_subset] = tuned
            log_sigma = la.sigma_noise.detach().log().clone()
            value = float(la.log_marginal_likelihood())
        history.epochs.append(epoch)
        history.log_marglik.append(value)
        history.prior_precision.append(log_delta.detach().exp().clone())
        history.sigma_noise.append(float(log_sigma.detach().exp()))
        if best is None or value > best[0]:
            best = (value, copy.deepcopy(model.state_dict()), la)
    if best is None:
        raise ValueError("epochs: no hyperparameter update happened; lower burnin or frequency")
    model.load_state_dict(best[1])
    model.eval()
    return model, best[2], history


def _prior(log_delta: Tensor, prior_structure: str, index: list[int] | None = None) -> Tensor:
    """The prior precision as ``Laplace`` takes it: a scalar, or one value per parameter tensor
    (those at ``index`` when the posterior covers a subset)."""
    delta = log_delta.exp()
    if prior_structure == "scalar":
        return delta.squeeze(0)
    return delta if index is None else delta[index]
