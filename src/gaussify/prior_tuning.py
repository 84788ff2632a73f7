"""Type-II maximum likelihood of a fitted posterior's hyperparameters: the plumbing of
``optimize_prior`` that Laplace, FunctionalLaplace and ELLA share.

Each family maximises its own log evidence log p(D | P0, sigma) over the prior precision P0
(and, for a scalar-noise regression likelihood, sigma) with the one optimiser of
:func:`gaussify.tuning.tune_hyperparameters`. What is the same everywhere lives here: the
argument checks done before anything is touched (:func:`tuning_options`), which noise is
tunable (:func:`noise_to_tune`), the hyperparameters an evidence is evaluated at
(:func:`hyperparameters_or_current`) and the optimiser call (:func:`maximise_evidence`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gaussify.tuning import (
    AutogradEvidence,
    ClosedFormEvidence,
    Optimizer,
    TuningResult,
    check_tuning_arguments,
    tune_hyperparameters,
)

__all__ = [
    "TuningOptions",
    "hyperparameters_or_current",
    "maximise_evidence",
    "noise_to_tune",
    "tuning_options",
]


@dataclass(frozen=True)
class TuningOptions:
    """The checked options of an ``optimize_prior`` call: ``method`` "gradient" or "grid",
    at most ``n_steps`` iterations of ``optimizer`` (Adam step ``lr``), the ``grid`` of the
    grid search (None: the default), ``fixed_steps`` (exactly ``n_steps`` Adam steps)."""

    method: str
    n_steps: int
    lr: float
    grid: Tensor | None
    optimizer: Optimizer
    fixed_steps: bool


def tuning_options(
    method: str,
    n_steps: int,
    lr: float,
    grid: Tensor | Sequence[float] | None,
    optimizer: Optimizer,
    fixed_steps: bool,
) -> TuningOptions:
    """Check the options (:func:`gaussify.tuning.check_tuning_arguments`) before anything
    is fitted or changed."""
    n_steps, lr, grid_t = check_tuning_arguments(method, n_steps, lr, grid, optimizer)
    return TuningOptions(method, n_steps, lr, grid_t, optimizer, bool(fixed_steps))


def noise_to_tune(tune_noise: bool | None, task: str, sigma_noise: Tensor) -> bool:
    """Whether to tune the noise: by default exactly for a regression likelihood with one
    (scalar) noise; asking for it with another likelihood raises ``ValueError``."""
    if tune_noise is None:
        return task == "regression" and sigma_noise.ndim == 0
    if tune_noise and task != "regression":
        raise ValueError("tune_noise: only a regression likelihood has noise to tune")
    return bool(tune_noise)


def hyperparameters_or_current(
    owner: Any,
    prior_precision: Tensor | float | None,
    sigma_noise: Tensor | float | None,
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> tuple[Tensor, Tensor]:
    """(P0, sigma) at which to evaluate ``owner``'s evidence: the given values as ``dtype``
    tensors on ``device`` (default: the current prior's), keeping their graph so that the
    evidence is differentiable in them; else ``owner.prior_precision`` / ``owner.sigma_noise``."""
    prior, sigma = owner.prior_precision, owner.sigma_noise
    where = {"dtype": dtype, "device": prior.device if device is None else device}
    if prior_precision is not None:
        prior = torch.as_tensor(prior_precision, **where)
    if sigma_noise is not None:
        sigma = torch.as_tensor(sigma_noise, **where)
    return prior, sigma


def maximise_evidence(
    evidence: ClosedFormEvidence | AutogradEvidence,
    start: Tensor,
    sigma_noise: Tensor,
    options: TuningOptions,
    *,
    tune_noise: bool,
    prior_centre: float | None,
    noise_start: float | None,
    caller: str,
    progress: bool = False,
) -> TuningResult:
    """Maximise ``evidence`` over log P0 (from ``start``; the granularity is its shape) and,
    with ``tune_noise``, log sigma, by :func:`gaussify.tuning.tune_hyperparameters` with
    ``options``; ``prior_centre`` / ``noise_start`` are the data-scale starts; ``progress``
    counts the evidence evaluations on a ``tqdm`` bar."""
    return tune_hyperparameters(
        evidence,
        start,
        sigma_noise,
        tune_noise=tune_noise,
        n_steps=options.n_steps,
        lr=options.lr,
        optimizer=options.optimizer,
        prior_centre=prior_centre,
        fixed_steps=options.fixed_steps,
        noise_start=noise_start,
        caller=caller,
        progress=progress,
    )
