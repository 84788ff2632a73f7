"""Choosing the pseudo-count ``alpha_eps`` (Bui, Sec. 4 and App. B).

* :func:`select_alpha_eps`: fit once per value on a grid and keep the one whose predictions
  give the highest training log-likelihood under the *exact* (categorical) likelihood, as
  Milios et al. (2018) suggest and the paper does (Sec. 4, App. C.1.1).
* :func:`tune_alpha_eps`: App. B's variational route (the shared optimiser of
  :mod:`gaussify.tuning`). The exact posterior of the model with
  the Gaussian pseudo-likelihood is used as a variational posterior for the *exact* model, and
  ``alpha_eps`` is the only variational parameter: maximise
  ``L(alpha_eps) = -KL[q || p] + sum_n E_q[log p(y_n | f_n)]``. The model supplies the bound
  (e.g. :meth:`gaussify.last_layer.exact.ExactLastLayer.elbo`); :func:`expected_log_likelihood`
  is its data term by reparameterised Monte Carlo with fixed base samples.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from gaussify import metrics
from gaussify.tuning import (
    OPTIMIZERS,
    Optimizer,
    check_choice,
    check_count,
    check_positive,
    maximize,
)
from gaussify.warnings import ConvergenceWarning

__all__ = [
    "DEFAULT_GRID",
    "AlphaSelection",
    "expected_log_likelihood",
    "select_alpha_eps",
    "tune_alpha_eps",
]

DEFAULT_GRID: tuple[float, ...] = (0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0)


@dataclass
class AlphaSelection:
    """Result of a selection: the chosen ``alpha_eps`` and its score (mean training
    log-likelihood for the grid, the bound for the variational route), with the trace
    ``scores`` (grid value -> score, or step -> bound)."""

    alpha_eps: float
    score: float
    scores: dict[float, float] = field(default_factory=dict)


def _as_probs(probs: Tensor) -> Tensor:
    if probs.ndim == 1:
        probs = probs.unsqueeze(-1)
    if probs.shape[-1] == 1:  # binary: probability of the positive class
        probs = torch.cat([1 - probs, probs], dim=-1)
    return probs


def select_alpha_eps(
    fit_predict: Callable[[float], Tensor],
    y: Tensor,
    grid: Sequence[float] = DEFAULT_GRID,
) -> AlphaSelection:
    """Pick ``alpha_eps`` from ``grid`` by the training log-likelihood (Sec. 4).

    ``fit_predict(alpha_eps)`` fits the model with that pseudo-count and returns its predicted
    class probabilities on the training inputs, ``(N, C)`` (or ``(N,)``/``(N, 1)`` positive-class
    probabilities for binary tasks); ``y (N,)`` are the training labels.
    """
    if len(grid) == 0:
        raise ValueError("grid: needs at least one alpha_eps value")
    scores: dict[float, float] = {}
    for value in grid:
        if not value > 0:
            raise ValueError(f"grid: alpha_eps values must be positive, got {value}")
        with torch.no_grad():
            probs = _as_probs(fit_predict(float(value)))
        scores[float(value)] = -metrics.nll(probs.clamp_min(1e-12), y)
    best = max(scores, key=lambda a: scores[a])
    return AlphaSelection(best, scores[best], scores)


def expected_log_likelihood(
    f_mean: Tensor, f_var: Tensor, y: Tensor, task: str, base_samples: Tensor
) -> Tensor:
    """``sum_n E[log p(y_n | f_n)]`` for independent ``f_nk ~ N(f_mean, f_var)`` (N, C) by the
    reparameterisation ``f = f_mean + sqrt(f_var) eps`` with ``base_samples`` eps (S, N, C);
    ``task`` is ``"classification"`` (softmax, integer ``y (N,)``) or ``"binary"`` (sigmoid of
    the single output, ``y`` in {0, 1}). Differentiable in ``f_mean`` and ``f_var``."""
    f = f_mean + f_var.clamp_min(0).sqrt() * base_samples
    if task == "classification":
        log_p = torch.log_softmax(f, dim=-1).gather(
            -1, y.long().reshape(1, -1, 1).expand(f.shape[0], -1, 1)
        )
    elif task == "binary":
        sign = 2.0 * y.reshape(1, -1, 1).to(f) - 1.0
        log_p = torch.nn.functional.logsigmoid(sign * f)
    else:
        raise ValueError(f"task: expected 'classification' or 'binary', got {task!r}")
    return log_p.sum((-1, -2)).mean(0)


def tune_alpha_eps(
    elbo: Callable[[Tensor], Tensor],
    init: float = 0.1,
    *,
    steps: int = 100,
    lr: float = 0.05,
    bounds: tuple[float, float] = (1e-4, 10.0),
    optimizer: Optimizer = "lbfgs",
) -> AlphaSelection:
    """Maximise ``elbo(alpha_eps)`` (App. B) over ``log alpha_eps`` with the shared optimiser
    of :mod:`gaussify.tuning` (L-BFGS, or Adam with step ``lr``; at most ``steps`` iterations,
    the same convergence test, a :class:`gaussify.warnings.ConvergenceWarning` when it stops
    unconverged).

    ``elbo`` takes a 0-dim tensor ``alpha_eps`` (requiring grad) and returns the scalar bound,
    differentiable in it. ``alpha_eps`` is clamped to ``bounds``. Returns the optimum, its
    bound and the trace (evaluation index -> bound).
    """
    init = check_positive(init, "init")
    steps = check_count(steps, "steps")
    lr = check_positive(lr, "lr")
    low, high = (math.log(check_positive(b, "bounds")) for b in bounds)
    if not low < high:
        raise ValueError(f"bounds: expected (low, high) with low < high, got {bounds!r}")
    check_choice(optimizer, "optimizer", OPTIMIZERS)
    trace: dict[float, float] = {}

    def objective(x: np.ndarray) -> tuple[float, np.ndarray]:
        log_alpha = torch.tensor(float(x[0]), dtype=torch.float64, requires_grad=True)
        alpha = log_alpha.clamp(low, high).exp()
        value = elbo(alpha)
        if not torch.isfinite(value):
            raise ValueError(f"elbo: not finite at alpha_eps={float(alpha.detach()):.3g}")
        (grad,) = torch.autograd.grad(value, log_alpha)
        trace[float(len(trace))] = float(value.detach())
        return float(value.detach()), np.array([float(grad)])

    x0 = np.array([min(max(math.log(init), low), high)])
    opt = maximize(
        objective,
        x0,
        [(low - 1.0, high + 1.0)],
        max_steps=steps,
        optimizer=optimizer,
        lr=lr,
    )
    if not opt.converged and "bound" not in opt.message:
        warnings.warn(
            f"tune_alpha_eps: did not converge after {opt.steps} {optimizer} steps "
            f"(|d elbo / d log alpha_eps| = {float(np.abs(opt.grad).max()):.3g}; {opt.message})",
            ConvergenceWarning,
            stacklevel=2,
        )
    alpha = math.exp(min(max(float(opt.x[0]), low), high))
    return AlphaSelection(alpha, opt.value, trace)
