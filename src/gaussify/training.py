"""MAP training with the likelihood and a Gaussian prior expressed as a prior precision.

The objective is the negative log joint per data point (Immer thesis eq. 2.9),

    L(theta) = -(1/N) sum_n log p(y_n | f(x_n; theta)) + delta / (2N) ||theta||^2,

so ``prior_precision`` (delta) is the same number a Laplace posterior uses as its prior
afterwards; plain weight decay ``wd`` in ``torch.optim.SGD`` corresponds to ``delta = wd * N``
for a likelihood summed over the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from gaussify.batches import Batches, num_examples
from gaussify.curvature.subset import check_prior, expand_prior, select_parameters
from gaussify.likelihoods import Likelihood, get_likelihood
from gaussify.model_checks import warn_if_squashed_output
from gaussify.validation import check_count, validated_batches

__all__ = ["GaussianLogPrior", "TrainHistory", "log_prior", "train_map"]


@dataclass
class TrainHistory:
    """Per-epoch training curves: ``loss`` is the negative log joint per data point and
    ``nll`` the negative log-likelihood per data point."""

    loss: list[float] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)


def log_prior(model: nn.Module, prior_precision: float | Tensor) -> Tensor:
    """log N(theta | 0, diag(delta)^-1) up to its constant: -0.5 sum_p delta_p theta_p^2.

    ``prior_precision`` is a scalar, one value per parameter tensor, or one per parameter.
    (Resolves the parameters and expands the prior on every call; loops use
    :class:`GaussianLogPrior`, which does that once.)
    """
    return GaussianLogPrior(model, prior_precision)()


class GaussianLogPrior:
    """-0.5 sum_p delta_p theta_p^2 over the trainable parameters of ``model``, with the
    parameter list and the prior expanded to per-tensor shapes once, so that a training step
    pays only the sum of squares (the parameters are read live at every call)."""

    def __init__(self, model: nn.Module, prior_precision: float | Tensor) -> None:
        subset = select_parameters(model, "all")
        named = dict(model.named_parameters())
        self.params = [named[n] for n in subset.names]
        dtype = self.params[0].dtype
        prior = check_prior(prior_precision)
        self.scalar: Tensor | None = None
        self.deltas: list[Tensor] = []
        if prior.numel() == 1:
            self.scalar = prior.reshape(()).to(dtype)
        else:
            delta = expand_prior(prior, subset).to(dtype)
            chunks = torch.split(delta, list(subset.numels))
            self.deltas = [c.view(s) for c, s in zip(chunks, subset.shapes, strict=True)]

    def __call__(self) -> Tensor:
        if self.scalar is not None:
            total = torch.stack([p.square().sum() for p in self.params]).sum()
            return -0.5 * self.scalar * total
        pairs = zip(self.deltas, self.params, strict=True)
        return -0.5 * torch.stack([(d * p.square()).sum() for d, p in pairs]).sum()


def train_map(
    model: nn.Module,
    data: Batches,
    likelihood: str | Likelihood = "classification",
    prior_precision: float | Tensor = 1.0,
    epochs: int = 100,
    lr: float = 1e-3,
    *,
    sigma_noise: float = 1.0,
    optimizer: Literal["adam", "sgd"] = "adam",
    scheduler: Literal["cosine", "none"] = "cosine",
    batch_size: int = 128,
    seed: int | None = None,
    progress: bool = False,
) -> tuple[nn.Module, TrainHistory]:
    """Train ``model`` in place to the MAP of likelihood + Gaussian prior; return it and history.

    ``data`` is a DataLoader of ``(x, y)`` or an ``(x, y)`` tuple (shuffled batches of
    ``batch_size`` drawn with a generator seeded by ``seed``). Deterministic given ``seed``.
    Raises ``FloatingPointError`` when the loss becomes NaN or infinite.
    """
    epochs = check_count(epochs, "epochs")
    batch_size = check_count(batch_size, "batch_size")
    if lr <= 0:
        raise ValueError(f"lr: must be > 0, got {lr}")
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer: expected 'adam' or 'sgd', got {optimizer!r}")
    if scheduler not in ("cosine", "none"):
        raise ValueError(f"scheduler: expected 'cosine' or 'none', got {scheduler!r}")
    prior_term = GaussianLogPrior(model, prior_precision)  # built once, not every step
    lik = get_likelihood(likelihood, sigma_noise=sigma_noise)
    warn_if_squashed_output(model, lik.task)
    generator = None
    if seed is not None:
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed)
    batches = validated_batches(
        data,
        batch_size,
        shuffle=True,
        generator=generator,
        model=model,
        task=lik.task,
        owner="train_map",
        multi_pass=True,
    )
    n_data = num_examples(batches)
    params = [p for p in model.parameters() if p.requires_grad]
    opt: torch.optim.Optimizer = (
        torch.optim.Adam(params, lr=lr)
        if optimizer == "adam"
        else torch.optim.SGD(params, lr=lr, momentum=0.9)
    )
    sched = (
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
        if scheduler == "cosine"
        else None
    )
    history = TrainHistory()
    epoch_iter = range(epochs)
    if progress:
        from tqdm.auto import tqdm

        epoch_iter = tqdm(epoch_iter, desc="MAP training", unit="epoch")
    model.train()
    for epoch in epoch_iter:
        # summed on the model's device: one host read per epoch, not one per step
        total_nll: Tensor | float = 0.0
        seen = 0
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            nll = -lik.log_prob(model(x), y).sum()
            loss = nll / x.shape[0] - prior_term() / n_data
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"train_map: loss became {loss.item()} at epoch {epoch}; "
                    "lower lr or check the data for extreme values"
                )
            loss.backward()
            opt.step()
            total_nll = total_nll + nll.detach().double()
            seen += x.shape[0]
        if sched is not None:
            sched.step()
        with torch.no_grad():
            mean_nll = float(total_nll) / seen
            history.nll.append(mean_nll)
            history.loss.append(mean_nll - prior_term().item() / n_data)
        if progress and hasattr(epoch_iter, "set_postfix"):
            epoch_iter.set_postfix(loss=f"{history.loss[-1]:.4f}")
    model.eval()
    if not math.isfinite(history.loss[-1]):
        raise FloatingPointError("train_map: final loss is not finite")
    return model, history
