"""The predictive routes of a fitted :class:`~gaussify.weight_space.laplace.Laplace`.

GLM predictive (thesis eq. 3.15-3.16): the network linearised at theta*,
f_lin(x) = f(x; theta*) + J(x) (mu - theta*), pushes q(theta) = N(mu, A^-1) forward to the
output-space Gaussian N(f_lin(x), J A^-1 J^T). Three routes give the same moments:

* the last-layer feature path (the subset is the final ``nn.Linear``): J_n = I_C ⊗ [phi_n, 1]^T,
  so mean and covariance come from the features phi alone (:mod:`gaussify.curvature.lastlayer`);
* the traced KFAC route (structure kron over plain ``nn.Linear`` layers): a layer's Jacobian
  rows are rank one, so no (N, C, P) Jacobian is formed
  (:func:`gaussify.curvature.kron.traced_predictive`);
* otherwise per-sample Jacobians (N, C, P) in chunks and the structure's ``functional_cov``.

NN predictive (eq. 3.14): networks with weights drawn from q(theta), :func:`nn_samples`.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.func import vmap

from gaussify.curvature.base import LastLayerPrecision
from gaussify.curvature.jacobian import jacobians
from gaussify.curvature.kron import KronPosteriorPrecision, traced_predictive
from gaussify.curvature.lastlayer import lastlayer_jvp
from gaussify.deferred_checks import deferred_checks
from gaussify.fastpath import functional_call
from gaussify.weight_space.laplace_fields import LaplaceFields
from gaussify.weight_space.laplace_fit import features

__all__ = ["glm_moments", "nn_samples"]


def _f_star(la: LaplaceFields, x: Tensor) -> Tensor:
    with torch.set_grad_enabled(x.requires_grad):
        return la.model(x)


def glm_moments(
    la: LaplaceFields, x: Tensor, chunk_size: int, diagonal_output: bool
) -> tuple[Tensor, Tensor]:
    """Mean (N, C) and covariance (N, C, C) of the GLM predictive's latent f at ``x``, in
    chunks of ``chunk_size`` inputs (``diagonal_output``: only the C variances, on the
    diagonal of each (C, C) block)."""
    # the per-chunk finiteness checks (Jacobians, traced gradients) recorded and tested once
    # at the end, not read per chunk (no host sync inside the loop on a GPU)
    with deferred_checks():
        return _glm_chunks(la, x, chunk_size, diagonal_output)


def _glm_chunks(
    la: LaplaceFields, x: Tensor, chunk_size: int, diagonal_output: bool
) -> tuple[Tensor, Tensor]:
    """:func:`glm_moments` chunk by chunk, by the first route that applies (module
    docstring)."""
    means, covs = [], []
    shift = la.mean - la.theta_star
    post = la.posterior
    layer = la._output_layer
    on_features = isinstance(post, LastLayerPrecision) and layer is not None
    traced = isinstance(post, KronPosteriorPrecision) and not on_features
    for xs in x.split(chunk_size):
        if traced and not xs.requires_grad:
            # KFAC over nn.Linear layers: rank-one Jacobian rows, no (N, C, P) Jacobian
            fast = traced_predictive(post, la.model, xs, la.subset, shift, diagonal_output)
            if fast is not None:
                means.append(fast[0])
                covs.append(fast[1])
                continue
        f, phi = features(la, xs) if on_features else (_f_star(la, xs), None)
        if phi is not None and layer is not None:
            # J_n = I_C ⊗ [phi_n, 1]^T: mean and covariance from the features alone.
            means.append(f + lastlayer_jvp(phi, shift.to(phi.dtype), f.shape[1], layer))
            if diagonal_output:
                covs.append(torch.diag_embed(post.functional_var_lastlayer(phi, layer)))
            else:
                covs.append(post.functional_cov_lastlayer(phi, layer))
            continue
        jac = jacobians(la.model, xs, la.subset)
        means.append(f + jac @ shift)
        if diagonal_output:
            covs.append(torch.diag_embed(post.functional_var(jac)))
        else:
            covs.append(post.functional_cov(jac))
    return torch.cat(means), torch.cat(covs)


def nn_samples(
    la: LaplaceFields, x: Tensor, num_samples: int, generator: torch.Generator | None
) -> Tensor:
    """Network outputs f(x; theta_s) under weights theta_s ~ q(theta), (S, N, C)."""
    thetas = la.subset.unflatten(la.sample(num_samples, generator), base=la.subset.params(la.model))

    def run(theta: dict[str, Tensor]) -> Tensor:
        return functional_call(la.model, theta, (x,), strict=False)

    with torch.no_grad():
        return vmap(run)(thetas)
