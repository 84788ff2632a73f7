"""Subnetwork selection for subnetwork inference (Daxberger et al. 2021).

Subnetwork inference keeps a full-covariance Laplace posterior over a small set S of the
weights and a point mass at the MAP for every other weight: q(theta) = N(theta_S; theta*_S,
A_S^-1) x delta(theta_rest - theta*_rest), with A_S = G_SS / T + P0_S the S x S block of the
GGN posterior precision. Its predictive is the GLM predictive with
the Jacobian columns of S only, J_S Sigma_S J_S^T. Which weights to keep is the question
answered here; every selector returns the sorted indices (a ``LongTensor``) of the chosen
weights in the vector of all trainable parameters flattened in ``named_parameters()`` order,
which ``gs.Laplace(model, ..., subset=indices)`` takes directly (laplace-torch's
``subnetwork_indices``):

* :func:`largest_variance` -- the paper's rule: the n weights with the largest marginal
  variance, here under a diagonal Laplace over all weights (keeping the subnetwork closest in
  Wasserstein-2 distance to the full posterior, when that is approximated as diagonal;
  laplace-torch's ``LargestVarianceDiagLaplaceSubnetMask``);
* :func:`largest_magnitude` -- the n weights of largest |theta*| (``LargestMagnitudeSubnetMask``);
* :func:`random` -- n weights uniformly without replacement (``RandomSubnetMask``);
* :func:`by_name` -- every weight of the named parameters or modules
  (``ModuleNameSubnetMask`` / ``ParamNameSubnetMask``), e.g. to combine with the above;
* :func:`largest` -- the n largest entries of any score vector (P_all,).

Ties are broken towards the lower index (a stable sort), so selections are reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gaussify.batches import Batches
from gaussify.curvature.subset import select_parameters
from gaussify.likelihoods import Likelihood
from gaussify.weight_space.laplace import Laplace

__all__ = ["by_name", "largest", "largest_magnitude", "largest_variance", "num_weights", "random"]


def num_weights(model: nn.Module) -> int:
    """P_all: the number of trainable weights, the length of the vector indices refer to."""
    return select_parameters(model, "all").num_params


def _check_n(n: int, total: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n: expected an integer number of weights, got {type(n).__name__}")
    if not 1 <= n <= total:
        raise ValueError(f"n: expected 1 <= n <= {total} (the trainable weights), got {n}")
    return n


def largest(scores: Tensor, n: int) -> Tensor:
    """Sorted indices of the ``n`` largest entries of ``scores`` (P_all,) (ties: lower index
    first)."""
    if not isinstance(scores, Tensor) or scores.ndim != 1:
        shape = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
        raise ValueError(f"scores: expected a 1-D tensor, got {shape}")
    if not torch.isfinite(scores).all():
        raise ValueError("scores: contains NaN or inf")
    _check_n(n, scores.numel())
    order = torch.sort(scores.detach(), descending=True, stable=True).indices
    return order[:n].sort().values.cpu()


def largest_magnitude(model: nn.Module, n: int) -> Tensor:
    """The ``n`` weights of largest absolute value |theta*_i| (the current weights)."""
    everything = select_parameters(model, "all")
    return largest(everything.flatten(everything.params(model)).abs(), n)


def largest_variance(
    model: nn.Module,
    likelihood: str | Likelihood,
    data: Batches,
    n: int,
    *,
    prior_precision: float | Tensor = 1.0,
    sigma_noise: float | Tensor = 1.0,
    batch_size: int = 256,
    **curvature_options: Any,
) -> Tensor:
    """The ``n`` weights with the largest marginal variance 1 / (diag(G)_i + P0_i) under a
    diagonal Laplace-GGN over all weights fitted on ``data`` (Daxberger et al. 2021).

    ``prior_precision`` and ``sigma_noise`` are those of that diagonal Laplace (the paper uses
    the same prior as the subnetwork posterior); ``curvature_options`` (e.g. ``mc_samples``
    for many classes) go to its diagonal GGN.
    """
    _check_n(n, num_weights(model))
    diag = Laplace(
        model,
        likelihood,
        "diag",
        "all",
        prior_precision=prior_precision,
        sigma_noise=sigma_noise,
        **curvature_options,
    )
    diag.fit(data, batch_size=batch_size)
    return largest(diag.posterior_variance, n)


def random(model: nn.Module, n: int, generator: torch.Generator | None = None) -> Tensor:
    """``n`` weights drawn uniformly without replacement (seeded by ``generator``)."""
    total = num_weights(model)
    _check_n(n, total)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator, got {type(generator).__name__}")
    return torch.randperm(total, generator=generator)[:n].sort().values


def by_name(model: nn.Module, names: Sequence[str]) -> Tensor:
    """Every weight of the named parameters or modules (as ``subset=[names]`` selects them),
    as indices, e.g. to take the union with another selection:
    ``torch.cat([a, b]).unique()``."""
    if isinstance(names, str):
        names = [names]
    everything = select_parameters(model, "all")
    chosen = set(select_parameters(model, list(names)).names)
    starts = torch.tensor([0, *everything.numels]).cumsum(0)
    parts = [
        torch.arange(int(starts[i]), int(starts[i + 1]))
        for i, name in enumerate(everything.names)
        if name in chosen
    ]
    return torch.cat(parts)
