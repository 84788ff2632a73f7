"""laplace-torch's ``optimize_prior_precision`` on gaussify's engine.

* ``method="marglik"``: the prior is reset to ``init_prior_prec`` (expanded to
  ``prior_structure`` when it is a single number), then ``n_steps`` of Adam (``lr``) on its log
  maximise the evidence. gaussify runs the same Adam update, in closed form from the
  curvature's eigenvalues where the structure allows it (:mod:`gaussify.spectral`).
* ``method="gridsearch"``: ``grid_size`` values ``base^linspace(min, max)``; each is scored on
  ``val_loader`` with ``loss`` and the first minimiser is kept. The default losses are
  laplace-torch's running metrics -- the mean NLL of the predicted probabilities
  (classification) or the per-output MSE of the predictive mean summed over outputs
  (regression) -- and, as in laplace-torch, a running metric is not reset between grid values,
  so the score of the k-th value is the metric over the validation passes of values 1..k
  (kept so that a migrated script selects the same prior; see docs/migrating.md).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gaussify.compat.laplace.enums import PredType, PriorStructure, TuningMethod, option

__all__ = ["RunningMSE", "RunningNLL", "optimize_prior_precision"]


class RunningNLL:
    """Running mean of ``-log p[y]`` over every ``update`` since construction."""

    def __init__(self) -> None:
        self.total, self.count = 0.0, 0

    def update(self, probs: Tensor, targets: Tensor) -> None:
        probs = probs.reshape(-1, probs.shape[-1])
        targets = targets.reshape(-1).long()
        self.total += float(-probs.log().gather(1, targets[:, None]).sum())
        self.count += targets.numel()

    def compute(self) -> float:
        return self.total / self.count


class RunningMSE:
    """Running per-output mean squared error, summed over outputs, over every ``update``."""

    def __init__(self) -> None:
        self.sse: Tensor | None = None
        self.count = 0

    def update(self, mean: Tensor, targets: Tensor) -> None:
        sq = (mean - targets.reshape(mean.shape)).square().sum(0)
        self.sse = sq if self.sse is None else self.sse + sq
        self.count += mean.shape[0]

    def compute(self) -> float:
        assert self.sse is not None
        return float((self.sse / self.count).sum())


def _validate(la: Any, val_loader: Any, loss: Any, **predict: Any) -> float:
    """Score of the current prior on ``val_loader``: a running metric (``update`` /
    ``compute``) fed online, or an offline callable on the concatenated predictions."""
    online = hasattr(loss, "update") and hasattr(loss, "compute")
    means, variances, targets = [], [], []
    for x, y in val_loader:
        out = la(x, **predict)
        if online:
            if isinstance(out, tuple):
                try:
                    loss.update(*out, y)
                except TypeError:  # a metric of (prediction, target) only
                    loss.update(out[0], y)
            else:
                loss.update(out, y)
            continue
        means.append(out[0] if isinstance(out, tuple) else out)
        if isinstance(out, tuple):
            variances.append(out[1])
        targets.append(y)
    if online:
        value = loss.compute()
        return float(value.sum()) if isinstance(value, Tensor) else float(value)
    if variances:
        return float(loss(torch.cat(means), torch.cat(variances), torch.cat(targets)))
    return float(loss(torch.cat(means), torch.cat(targets)))


def optimize_prior_precision(
    self: Any,
    pred_type: str = "glm",
    method: str = "marglik",
    n_steps: int = 100,
    lr: float = 1e-1,
    init_prior_prec: float | Tensor = 1.0,
    prior_structure: str = "scalar",
    val_loader: Any = None,
    loss: Any = None,
    log_prior_prec_min: float = -4,
    log_prior_prec_max: float = 4,
    grid_size: int = 100,
    link_approx: str = "probit",
    n_samples: int = 100,
    verbose: bool = False,
    progress_bar: bool = False,
    log_prior_prec_base: float = 10.0,
) -> None:
    """Tune the prior precision (laplace-torch's arguments and meaning; module docstring)."""
    pred_type = option(pred_type, PredType, "pred_type")
    method = option(method, TuningMethod, "method")
    structure = option(prior_structure, PriorStructure, "prior_structure")
    self._require_fit()
    if method == "marglik":
        if val_loader is not None:
            warnings.warn(
                "val_loader: ignored by method='marglik' (did you mean 'gridsearch'?)",
                stacklevel=2,
            )
        init = torch.as_tensor(init_prior_prec, dtype=self._dtype).reshape(-1)
        if len(init) == 1 and structure != "scalar":
            size = self.n_layers if structure == "layerwise" else self.n_params
            init = init.expand(size).clone()
        self.prior_precision = init  # validates the length (kron: scalar or per layer)
        granularity = {1: "scalar", self.n_layers: "layer", self.n_params: "diag"}[len(init)]
        self._tune_marglik(granularity, n_steps, lr)
    else:
        if val_loader is None:
            raise ValueError("val_loader: method='gridsearch' needs a validation DataLoader")
        grid = torch.logspace(
            log_prior_prec_min, log_prior_prec_max, grid_size, base=log_prior_prec_base
        )
        if loss is None:
            loss = RunningMSE() if self.likelihood == "regression" else RunningNLL()
        scores = []
        for value in grid:
            self.prior_precision = value
            try:
                score = _validate(
                    self,
                    val_loader,
                    loss,
                    pred_type=pred_type,
                    link_approx=link_approx,
                    n_samples=n_samples,
                )
            except (torch.linalg.LinAlgError, FloatingPointError):
                score = float("inf")
            scores.append(score)
        self.prior_precision = grid[int(np.argmin(scores))]
    if verbose:
        print(f"Optimized prior precision is {self.prior_precision}.")
