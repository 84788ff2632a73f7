"""Joint predictives and weight-shared function samples of a fitted :class:`Laplace`.

Per-point predictives treat test points separately. Bayesian optimisation, active learning and
smooth sample paths need the *joint* distribution of the linearised network over a set of
inputs: with the stacked Jacobian J (N C x P) of all test points,

    f(X) ~ N(f(X; theta*) + J (mu - theta*), J Sigma J^T),

whose (N C x N C) covariance comes from the posterior's own structured algebra (one
``functional_cov`` call over all stacked rows; no P x P matrix for diag / kron / low-rank).
Function samples draw weights once, theta_s ~ q(theta), and push every input through the same
draw -- the GLM sample f(x; theta*) + J(x) (theta_s - theta*) or the network f(x; theta_s) --
so a sample is one smooth function, not independent noise per input.

The functions take any fitted weight-space posterior that satisfies :class:`LinearisedPosterior`
(``Laplace`` does); this module imports nothing from the families above it, so
``laplace.py`` -> ``joint.py`` is a one-way arrow.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn
from torch.func import vmap

from gaussify.curvature.jacobian import jacobians
from gaussify.curvature.subset import ParameterSubset
from gaussify.fastpath import functional_call
from gaussify.memory_guard import check_allocation
from gaussify.predictive import LinkName, Predictive, predictive_from_gaussian

__all__ = ["LinearisedPosterior", "function_samples", "joint_predictive"]

SampleMethod = Literal["glm", "nn"]


class LinearisedPosterior(Protocol):
    """What the joint predictive needs of a fitted weight-space Gaussian q(theta) = N(mu, Sigma)
    over the ``subset`` of ``model``'s weights, linearised at theta*."""

    @property
    def model(self) -> nn.Module: ...

    @property
    def task(self) -> str: ...

    @property
    def subset(self) -> ParameterSubset: ...

    @property
    def mean(self) -> Tensor:
        """mu, (P,)."""
        ...

    @property
    def theta_star(self) -> Tensor:
        """The linearisation point theta*, (P,)."""
        ...

    @property
    def posterior(self) -> Any:
        """The posterior precision A; ``functional_cov(jac)`` gives J Sigma J^T."""
        ...

    @property
    def sigma_noise(self) -> Tensor: ...

    def _require_fit(self) -> None: ...

    def sample(self, num_samples: int = ..., generator: torch.Generator | None = ...) -> Tensor:
        """(S, P) draws from q(theta)."""
        ...


def _noise_var(la: LinearisedPosterior) -> Tensor | None:
    return la.sigma_noise.square().reshape(-1) if la.task == "regression" else None


def joint_predictive(
    la: LinearisedPosterior,
    x: Tensor,
    *,
    link: LinkName = "probit",
    num_samples: int = 100,
    generator: torch.Generator | None = None,
) -> Predictive:
    """The GLM predictive at ``x (N, ...)`` with the joint latent covariance ``joint_cov``
    (N C, N C) across points and outputs; ``f_cov`` (its diagonal blocks), ``probs`` and the
    regression noise are as in :meth:`Laplace.predict`. Cost: one Jacobian of all N points
    and an (N C)^2 output, so meant for N C up to a few thousand."""
    la._require_fit()
    with torch.set_grad_enabled(x.requires_grad):
        f = la.model(x)
    rows, p = f.numel(), la.subset.num_params
    check_allocation(
        rows * rows + rows * p,
        f.dtype,
        f"joint=True: the (N C)^2 joint covariance and the (N C, P) Jacobian (N C = {rows:,}, "
        f"P = {p:,})",
        "joint=False (per-point covariances), diagonal_output=True, function_samples(), or a "
        "subset of the inputs",
        device=f.device,
    )
    jac = jacobians(la.model, x, la.subset)
    n, c, p = jac.shape
    mean = f + jac @ (la.mean - la.theta_star)
    joint = la.posterior.functional_cov(jac.reshape(1, n * c, p))[0]
    blocks = joint.reshape(n, c, n, c).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    pred = predictive_from_gaussian(
        mean,
        blocks,
        la.task,
        link=link,
        noise_var=_noise_var(la),
        num_samples=num_samples,
        generator=generator,
    )
    return dataclasses.replace(pred, joint_cov=joint)


def function_samples(
    la: LinearisedPosterior,
    x: Tensor,
    num_samples: int = 100,
    *,
    method: SampleMethod = "glm",
    generator: torch.Generator | None = None,
    chunk_size: int = 256,
) -> Tensor:
    """Latent function samples ``(S, N, C)`` at ``x``, every input evaluated under the same
    S weight draws theta_s ~ q(theta): ``method="glm"`` gives the linearised network
    f(x; theta*) + J(x)(theta_s - theta*) (exactly Gaussian with the joint covariance of
    :func:`joint_predictive`), ``"nn"`` the network itself at theta_s."""
    la._require_fit()
    if num_samples < 1:
        raise ValueError(f"num_samples: must be >= 1, got {num_samples}")
    if method not in ("glm", "nn"):
        raise ValueError(f"method: expected 'glm' or 'nn', got {method!r}")
    weights = la.sample(num_samples, generator)  # (S, P), shared by every input
    if method == "nn":
        thetas = la.subset.unflatten(weights, base=la.subset.params(la.model))

        def run(theta: dict[str, Tensor]) -> Tensor:
            return functional_call(la.model, theta, (x,), strict=False)

        with torch.no_grad():
            return vmap(run)(thetas)
    deltas = weights - la.theta_star
    out = []
    for xs in x.split(chunk_size):
        with torch.no_grad():
            f = la.model(xs)
        jac = jacobians(la.model, xs, la.subset)  # (n, C, P)
        out.append(f + torch.einsum("ncp,sp->snc", jac, deltas))
    return torch.cat(out, dim=1)
