"""Seeds trained together: ``S`` independent AdamW runs of one architecture as one vectorised
model (``torch.func.vmap`` over stacked parameters), exactly equal to ``S`` separate runs --
each with its own data, initialisation, batch order, per-seed gradient clipping, validation
curve and early stopping -- at a fraction of the Python overhead. Used by
:mod:`gaussify.experiments.vbll_uci` (tests check it against the plain loop)."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, stack_module_state, vmap

__all__ = ["StackedRun", "select_epoch", "train_stacked"]


class _Objective(nn.Module):
    """Wraps a model so that ``functional_call`` can evaluate its training loss."""

    def __init__(self, model: nn.Module, loss: Callable[[nn.Module, Tensor, Tensor], Tensor]):
        super().__init__()
        self.model = model
        self._loss = loss

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return self._loss(self.model, x, y)


@dataclass
class StackedRun:
    """Result of :func:`train_stacked` for ``S`` models.

    ``states[s]``: the state dict of model ``s`` (at its ``snapshot`` epoch if one was asked
    for, else at the end). ``val_epochs``: the epochs at which validation was computed;
    ``val_curves (S, len(val_epochs))``: validation NLL (NaN after a model stopped);
    ``stopped (S,)``: the epoch at which each model's early stopping ended (its last
    evaluation). ``epochs_run``: epochs actually trained.
    """

    states: list[dict[str, Tensor]]
    val_epochs: list[int] = field(default_factory=list)
    val_curves: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    stopped: list[int] = field(default_factory=list)
    epochs_run: int = 0
    seconds: float = 0.0


def select_epoch(val_epochs: Sequence[int], curve: np.ndarray) -> int:
    """The number of epochs chosen by the validation curve: the epoch of the lowest validation
    NLL (the first on ties; NaN entries -- after early stopping -- are ignored)."""
    curve = np.asarray(curve, dtype=np.float64)
    masked = np.where(np.isfinite(curve), curve, np.inf)
    return int(val_epochs[int(np.argmin(masked))])


def _per_model_clip(grads: list[Tensor], max_norm: float) -> None:
    """``clip_grad_norm_`` separately for every model of a stack (dim 0 indexes models)."""
    num = grads[0].shape[0]
    sq = torch.zeros(num, dtype=grads[0].dtype)
    for g in grads:
        sq += g.reshape(num, -1).square().sum(1)
    # torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6), clamped to 1
    coef = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.reshape(num, *([1] * (g.dim() - 1))))


def train_stacked(
    models: Sequence[nn.Module],
    x: Tensor,
    y: Tensor,
    *,
    epochs: int,
    batch_size: int,
    seeds: Sequence[int],
    lr: float = 1e-3,
    weight_decay: float = 1e-2,
    max_grad_norm: float | None = 1.0,
    loss: Callable[[nn.Module, Tensor, Tensor], Tensor],
    validation: tuple[Tensor, Tensor] | None = None,
    val_nll: Callable[[nn.Module, Tensor, Tensor], float],
    eval_every: int = 10,
    patience: int | None = None,
    snapshots: Sequence[int] | None = None,
    progress: Any = None,
) -> StackedRun:
    """Train ``S = len(models)`` models of one architecture, each on its own data, as ``S``
    independent AdamW runs vectorised with ``torch.func.vmap``.

    ``x (S, N, ...)``, ``y (S, N, 1)``: model ``s`` trains on ``x[s], y[s]``, in batches of
    ``batch_size`` from ``torch.randperm(N, generator=Generator().manual_seed(seeds[s]))`` per
    epoch (the last batch may be smaller). AdamW is elementwise, so stacking is exact; the
    gradient norm is clipped per model. ``validation = (x_val (S, M, ...), y_val (S, M, 1))``:
    every ``eval_every`` epochs ``val_nll(model_s, x_val[s], y_val[s])`` is recorded; with
    ``patience`` a model stops being evaluated after that many evaluations without
    improvement, and training ends when every model stopped (a model's selection then equals
    that of a run of its own). ``snapshots[s]``: keep model ``s``'s state at that epoch.
    """
    num = len(models)
    if not (x.shape[0] == y.shape[0] == len(seeds) == num):
        raise ValueError(
            f"x, y, seeds: need one entry per model ({num}), got {x.shape[0]}, {y.shape[0]}, "
            f"{len(seeds)}"
        )
    if snapshots is not None and len(snapshots) != num:
        raise ValueError(f"snapshots: need one epoch per model ({num}), got {len(snapshots)}")
    start = time.perf_counter()
    objectives = [_Objective(m, loss) for m in models]
    params, buffers = stack_module_state(objectives)
    # frozen parameters (``requires_grad=False``, e.g. a fixed noise mean) stay frozen, as in
    # a plain loop: no gradient, no AdamW step (weight decay included), not in the clip norm
    trainable = {k for k, v in objectives[0].named_parameters() if v.requires_grad}
    params = {k: v.detach().clone().requires_grad_(k in trainable) for k, v in params.items()}
    template = objectives[0]

    def one(p: dict[str, Tensor], b: dict[str, Tensor], xb: Tensor, yb: Tensor) -> Tensor:
        return functional_call(template, (p, b), (xb, yb))

    batched = vmap(one, in_dims=(0, 0, 0, 0))
    learned = [v for k, v in params.items() if k in trainable]
    opt = torch.optim.AdamW(learned, lr=lr, weight_decay=weight_decay)
    gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
    rows = torch.arange(num).unsqueeze(1)
    n = x.shape[1]
    scratch = copy.deepcopy(models[0])
    states: list[dict[str, Tensor] | None] = [None] * num
    val_epochs: list[int] = []
    curves: list[list[float]] = [[] for _ in range(num)]
    best = [math.inf] * num
    since = [0] * num
    active = [True] * num
    stopped = [epochs] * num
    epoch = 0

    def model_state(s: int) -> dict[str, Tensor]:
        state = {k[len("model.") :]: v[s].detach().clone() for k, v in params.items()}
        state.update({k[len("model.") :]: v[s].clone() for k, v in buffers.items()})
        return state

    for epoch in range(1, epochs + 1):
        perms = torch.stack([torch.randperm(n, generator=g) for g in gens])
        for lo in range(0, n, batch_size):
            idx = perms[:, lo : lo + batch_size]
            opt.zero_grad(set_to_none=True)
            losses = batched(params, buffers, x[rows, idx], y[rows, idx])
            losses.sum().backward()
            if max_grad_norm is not None:
                grads = [p.grad for p in learned if p.grad is not None]
                _per_model_clip(grads, max_norm=max_grad_norm)
            opt.step()
        if not torch.isfinite(losses.detach()).all():
            bad = [int(seeds[s]) for s in torch.nonzero(~torch.isfinite(losses)).flatten()]
            raise FloatingPointError(f"train_stacked: loss not finite for seeds {bad}")
        if snapshots is not None:
            for s in range(num):
                if snapshots[s] == epoch:
                    states[s] = model_state(s)
        if progress is not None:
            progress.update()
        if validation is not None and epoch % eval_every == 0:
            val_epochs.append(epoch)
            for s in range(num):
                if not active[s]:
                    curves[s].append(math.nan)
                    continue
                scratch.load_state_dict(model_state(s))
                scratch.eval()
                value = val_nll(scratch, validation[0][s], validation[1][s])
                curves[s].append(value)
                if value < best[s]:
                    best[s], since[s] = value, 0
                else:
                    since[s] += 1
                if patience is not None and since[s] >= patience:
                    active[s], stopped[s] = False, epoch
            if not any(active):
                break
        if snapshots is not None and all(st is not None for st in states):
            break
    final = [st if st is not None else model_state(s) for s, st in enumerate(states)]
    return StackedRun(
        states=final,
        val_epochs=val_epochs,
        val_curves=np.asarray(curves, dtype=np.float64).reshape(num, len(val_epochs)),
        stopped=stopped if validation is not None else [],
        epochs_run=epoch,
        seconds=time.perf_counter() - start,
    )
