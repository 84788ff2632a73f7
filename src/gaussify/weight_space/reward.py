"""Bayesian reward models from preference pairs (Bradley–Terry) through the Laplace protocol.

A reward network ``r(x)`` (scalar output) is trained from pairs ``(a, b)`` with labels
``y = 1`` when ``a`` is preferred. The Bradley–Terry likelihood is a Bernoulli on the reward
difference,

    p(y = 1 | a, b, theta) = sigmoid(r(a; theta) - r(b; theta)),

so a Laplace posterior over theta is an ordinary binary-classification Laplace on the pair model
:class:`BradleyTerry` (``gs.Laplace(BradleyTerry(net), "binary", ...)``). The reward at a new
input is then the linearised push-forward of that posterior through ``r`` alone,

    r(x) ~ N(r(x; theta*) + J_r(x) (mu - theta*), J_r(x) Sigma J_r(x)^T),

which :func:`predict_reward` returns as a regression-type :class:`~gaussify.Predictive`
(``f_mean``, ``f_cov``; no observation noise). A constant added to ``r`` cancels in every
difference, so the reward is identified only up to a shift: give the reward network no free
output bias (or read credible intervals of *differences* of rewards).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor, nn

from gaussify.curvature.jacobian import jacobians
from gaussify.curvature.subset import select_parameters
from gaussify.model_checks import in_eval_mode
from gaussify.predictive import Predictive, predictive_from_gaussian
from gaussify.validation import check_count, check_inputs
from gaussify.weight_space.laplace import Laplace

__all__ = ["BradleyTerry", "predict_reward", "preference_pairs"]

PREFIX = "reward."


class BradleyTerry(nn.Module):
    """Pair model over a scalar reward network: ``forward(pairs)`` maps pairs ``(N, 2, ...)``
    to the logits ``r(a) - r(b)`` of shape ``(N, 1)``.

    Both members of every pair go through ``reward`` in one batched call. ``reward`` must map
    ``(B, ...)`` to ``(B, 1)`` or ``(B,)``.
    """

    def __init__(self, reward: nn.Module) -> None:
        super().__init__()
        self.reward = reward

    def forward(self, pairs: Tensor) -> Tensor:
        if pairs.dim() < 2 or pairs.shape[1] != 2:
            raise ValueError(
                f"pairs: expected shape (N, 2, ...) with the preferred-or-not pair on dim 1, "
                f"got {tuple(pairs.shape)}"
            )
        n = pairs.shape[0]
        flat = pairs.reshape(2 * n, *pairs.shape[2:])  # rows: a_1, b_1, a_2, b_2, ...
        r = self.reward(flat).reshape(n, 2, -1)
        if r.shape[-1] != 1:
            raise ValueError(f"reward: expected a scalar reward per input, got {r.shape[-1]}")
        return r[:, 0] - r[:, 1]


def preference_pairs(first: Tensor, second: Tensor) -> Tensor:
    """Stack two aligned input batches ``(N, ...)`` into the pairs ``(N, 2, ...)`` that
    :class:`BradleyTerry` takes."""
    if first.shape != second.shape:
        raise ValueError(
            f"second: expected the shape of first {tuple(first.shape)}, got {tuple(second.shape)}"
        )
    return torch.stack([first, second], dim=1)


@in_eval_mode
def predict_reward(laplace: Laplace, x: Tensor, chunk_size: int = 256) -> Predictive:
    """The Gaussian reward ``N(E[r(x)], Cov[r(x)])`` at inputs ``x (N, ...)`` under a Laplace
    posterior fitted on a :class:`BradleyTerry` pair model.

    Returns a regression-type :class:`~gaussify.Predictive` with ``f_mean (N, 1)`` and
    ``f_cov (N, 1, 1)`` (the epistemic reward uncertainty; there is no observation noise).
    """
    model = laplace.model
    if not isinstance(model, BradleyTerry):
        raise ValueError(
            f"laplace: expected a Laplace fitted on a BradleyTerry pair model, got a model of "
            f"type {type(model).__name__}"
        )
    check_inputs(x, model.reward)
    chunk_size = check_count(chunk_size, "chunk_size")
    names = [n.removeprefix(PREFIX) for n in laplace.subset.names]
    # the same tensors without the pair wrapper's prefix (and the same subnetwork, if any)
    subset = replace(select_parameters(model.reward, names), indices=laplace.subset.indices)
    post = laplace.posterior
    shift = laplace.mean - laplace.theta_star
    means, covs = [], []
    for xs in x.split(chunk_size):
        with torch.no_grad():
            f = model.reward(xs).reshape(len(xs), 1)
        jac = jacobians(model.reward, xs, subset)
        means.append(f + jac @ shift)
        covs.append(post.functional_cov(jac))
    return predictive_from_gaussian(torch.cat(means), torch.cat(covs), "regression")
