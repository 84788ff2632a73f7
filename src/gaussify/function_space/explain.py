"""Explaining predictions by training points, through the GP view (Immer thesis Sec. 5.3).

The linearised network is a GP with kernel k(x, x') = J(x) S0 J(x')^T and prior mean
m(x) = f(x; theta*) - J(x) theta* (thesis eq. 3.3-3.4 with a zero-mean prior). At a stationary
point of the MAP objective, sum_n J_n^T r_n = P0 theta* (r_n = d log p(y_n | f) / d f at
f(x_n; theta*), the residuals), so theta* = S0 sum_n J_n^T r_n and

    f(x*; theta*) - m(x*) = J(x*) theta* = sum_n k(x*, x_n) alpha_n,   alpha_n = r_n   (eq. 5.2)

exactly: the network's prediction, relative to the linearised prior mean, is a sum over
training points of a kernel similarity k(x*, x_n) (C x C) times a dual coefficient (the
residual). This is also the posterior-mean shift of the GP at the MAP (eq. 3.13's mean
f(x*; theta*) minus the prior mean). For a model linear in its parameters (f = J theta, e.g.
one ``nn.Linear``) m = 0 and the prediction itself is sum_n k(x*, x_n) alpha_n. Away from
a stationary point f - m - K alpha = -J(x*) S0 b with b = sum_n J_n^T r_n -
P0 theta*; :attr:`Explanation.gap` reports how far the decomposition is from the prediction.

The contribution of training point n to output c at x* is sum_c' k(x*, x_n)[c, c'] alpha_n[c']:
positive contributions *support* class c, negative ones *oppose* it; contrasting two classes
(``contributions[:, a] - contributions[:, b]``) answers "which training points make this a
4 rather than a 9".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gaussify.curvature.jacobian import SubsetLike, jvp, model_outputs, resolve_subset
from gaussify.function_space.ntk import Route, ntk, ntk_diag
from gaussify.likelihoods import Likelihood, get_likelihood
from gaussify.model_checks import in_eval_mode
from gaussify.validation import check_count, check_inputs, check_targets, output_width

__all__ = ["Explanation", "dual_coefficients", "explain", "kernel_similarity"]


@dataclass
class Explanation:
    """Training-point explanation of the predictions at S test inputs (N training points,
    C outputs).

    ``alpha (N, C)``: dual coefficients (residuals at theta*). ``kernel (S, C, N, C)``:
    k(x*_s, x_n). ``contributions (S, C, N)``: sum_c' k(x*_s, x_n)[c, c'] alpha_n[c'].
    ``similarity (S, N)``: tr k(x*, x_n) / sqrt(tr k(x*, x*) tr k(x_n, x_n)), a cosine
    similarity of the kernel in [-1, 1]. ``f (S, C)``: network outputs; ``prior_mean (S, C)``:
    m(x*) = f(x*) - J(x*) theta*. ``supporting`` / ``opposing (S, C, k)``: indices of the
    training points with the largest positive / negative contributions per output.
    """

    alpha: Tensor
    kernel: Tensor
    contributions: Tensor
    similarity: Tensor
    f: Tensor
    prior_mean: Tensor
    supporting: Tensor
    opposing: Tensor

    @property
    def reconstruction(self) -> Tensor:
        """sum_n k(x*, x_n) alpha_n, (S, C): equals f - prior_mean at a stationary point."""
        return self.contributions.sum(-1)

    @property
    def gap(self) -> Tensor:
        """f - prior_mean - reconstruction, (S, C): zero at the MAP, -J(x*) S0 b otherwise."""
        return self.f - self.prior_mean - self.reconstruction

    def contrast(self, a: int, b: int) -> Tensor:
        """Contributions to f_a - f_b (S, N): positive entries push towards class a."""
        return self.contributions[:, a] - self.contributions[:, b]

    def top(self, scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """(largest, smallest) ``k`` indices of ``scores (..., N)`` along the last axis."""
        k = min(k, scores.shape[-1])
        return scores.topk(k, dim=-1).indices, (-scores).topk(k, dim=-1).indices


def dual_coefficients(
    model: nn.Module, x: Tensor, y: Tensor, likelihood: str | Likelihood = "classification"
) -> Tensor:
    """alpha_n = r(y_n, f(x_n; theta*)) = d log p(y_n | f) / d f, (N, C) (thesis Sec. 5.3)."""
    lik = get_likelihood(likelihood)
    return lik.residual(model_outputs(model, x), y)


def kernel_similarity(
    model: nn.Module,
    x_star: Tensor,
    train_x: Tensor,
    subset: SubsetLike = "all",
    prior_precision: float | Tensor = 1.0,
    *,
    kernel: Tensor | None = None,
    route: Route = "auto",
) -> Tensor:
    """Cosine similarity of the NTK between test and training inputs, (S, N):
    tr k(x*, x_n) / sqrt(tr k(x*, x*) tr k(x_n, x_n)). ``kernel (S, C, N, C)`` may be given
    to avoid recomputing it."""
    if kernel is None:
        kernel = ntk(model, x_star, train_x, subset, prior_precision, route=route)
    if (
        kernel.ndim != 4
        or kernel.shape[0] != x_star.shape[0]
        or kernel.shape[2] != train_x.shape[0]
    ):
        raise ValueError(
            f"kernel: expected shape (S, C, N, C) = ({x_star.shape[0]}, C, {train_x.shape[0]}, C), "
            f"got {tuple(kernel.shape)}"
        )
    cross = kernel.diagonal(dim1=1, dim2=3).sum(-1)
    d_star = ntk_diag(model, x_star, subset, prior_precision, route=route).diagonal(
        dim1=-2, dim2=-1
    )
    d_train = ntk_diag(model, train_x, subset, prior_precision, route=route).diagonal(
        dim1=-2, dim2=-1
    )
    norm = (d_star.sum(-1)[:, None] * d_train.sum(-1)[None, :]).clamp_min(1e-300).sqrt()
    return cross / norm


@in_eval_mode
def explain(
    model: nn.Module,
    x_star: Tensor,
    train_x: Tensor,
    train_y: Tensor,
    likelihood: str | Likelihood = "classification",
    prior_precision: float | Tensor = 1.0,
    top_k: int = 5,
    *,
    subset: SubsetLike = "all",
    sigma_noise: float | Tensor = 1.0,
    chunk_size: int | None = None,
    route: Route = "auto",
) -> Explanation:
    """Explain the predictions of ``model`` at ``x_star (S, ...)`` by its training data
    (thesis Sec. 5.3, eq. 5.2): dual coefficients alpha (residuals at the current weights),
    the kernel k(x*, x_n) with prior precision ``prior_precision`` (the one the network was
    trained with, so the decomposition is exact at its MAP), per-training-point contributions
    to every output, kernel similarities, and the ``top_k`` supporting and opposing training
    points per output. ``train_x``/``train_y`` should be the training set the MAP was fitted
    on (the identity needs all of it)."""
    top_k = check_count(top_k, "top_k")
    lik = get_likelihood(likelihood, sigma_noise=sigma_noise)
    check_inputs(x_star, model, "x_star")
    check_inputs(train_x, model, "train_x")
    check_targets(train_y, lik.task, output_width(model), "train_y")
    if train_x.shape[0] != train_y.shape[0]:
        raise ValueError(f"train_y: has {train_y.shape[0]} rows but train_x has {train_x.shape[0]}")
    if x_star.shape[1:] != train_x.shape[1:]:
        raise ValueError(
            f"x_star: per-sample shape {tuple(x_star.shape[1:])} does not match train_x's "
            f"{tuple(train_x.shape[1:])}"
        )
    model.eval()
    sub = resolve_subset(model, subset)
    alpha = dual_coefficients(model, train_x, train_y, lik)
    with torch.no_grad():
        kernel = ntk(model, x_star, train_x, sub, prior_precision, chunk_size, route=route)
    contributions = torch.einsum("scnd,nd->scn", kernel, alpha.to(kernel.dtype))
    similarity = kernel_similarity(
        model, x_star, train_x, sub, prior_precision, kernel=kernel, route=route
    )
    f = model_outputs(model, x_star)
    theta = sub.flatten(sub.params(model))
    prior_mean = f - jvp(model, x_star, sub, theta)
    k = min(top_k, train_x.shape[0])
    supporting = contributions.topk(k, dim=-1).indices
    opposing = (-contributions).topk(k, dim=-1).indices
    return Explanation(
        alpha=alpha,
        kernel=kernel,
        contributions=contributions,
        similarity=similarity,
        f=f,
        prior_mean=prior_mean,
        supporting=supporting,
        opposing=opposing,
    )
