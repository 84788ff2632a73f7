"""Jacobian products over batches of vectors, and pathwise (Matheron) posterior samples.

``batched_jvp`` / ``batched_vjp``: J(x) v_s and sum_n J_n^T u_{s,n} for S vectors at once with
``torch.func`` (``vmap`` of forward- / reverse-mode products), never an (N, C, P) Jacobian.

``pathwise_sample``: exact draws of the linearised Laplace posterior
q(theta) = N(theta*, A^-1), A = J^T L L^T J + P0 (L_n L_n^T = Lambda_n), by conditioning a
prior draw on noisy "observations" of the linear model (Matheron's rule; Wilson et al. 2020):

    theta_s = theta* + e_s - P0^-1 J^T L B^-1 (L^T J e_s + xi_s),   B = I + L^T K L,

with e_s ~ N(0, P0^-1), xi_s ~ N(0, I_NC) and K = J P0^-1 J^T the NTK kernel. Its covariance is
P0^-1 - P0^-1 J^T L B^-1 L^T J P0^-1 = A^-1 (Woodbury), so a sample needs the (NC, NC)
Cholesky factor of B that the function-space posterior has anyway, and no P x P matrix.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.func as tfunc
from torch import Tensor, nn
from torch.func import vmap

from gaussify.curvature.generic_jacobian import jacobians
from gaussify.curvature.subset import ParameterSubset
from gaussify.fastpath import forward_ad_unsupported, functional_call, warn_reverse_mode

__all__ = ["batched_jvp", "batched_vjp", "pathwise_sample"]


def _functional(model: nn.Module, subset: ParameterSubset, x: Tensor) -> tuple[Callable, dict]:
    """(params -> f(x) (B, C), current subset parameters), every other parameter frozen."""
    chosen = set(subset.names)
    named = dict(model.named_parameters())
    params = {n: named[n].detach() for n in subset.names}
    frozen = {n: p.detach() for n, p in named.items() if n not in chosen}

    def f(p: dict[str, Tensor]) -> Tensor:
        return functional_call(model, {**frozen, **p}, (x,))

    return f, params


def batched_jvp(model: nn.Module, x: Tensor, subset: ParameterSubset, v: Tensor) -> Tensor:
    """J(x) v_s for a batch of tangents ``v (S, P)``: shape (S, N, C).

    ``vmap`` of forward-mode ``torch.func.jvp`` over the S tangents (the primal pass is shared),
    so no Jacobian is materialised. The model must be in eval mode.
    """
    f, params = _functional(model, subset, x)

    def one(t: Tensor) -> Tensor:
        return tfunc.jvp(f, (params,), (subset.unflatten(t),))[1]

    v = v.to(next(iter(params.values())).dtype)
    try:
        return vmap(one)(v)
    except (NotImplementedError, RuntimeError) as error:
        if not forward_ad_unsupported(error):
            raise
        warn_reverse_mode(model, error)  # J from reverse mode (gaussify.fastpath)
        return torch.einsum("ncp,sp->snc", jacobians(model, x, subset), v)


def batched_vjp(model: nn.Module, x: Tensor, subset: ParameterSubset, u: Tensor) -> Tensor:
    """sum_n J_n^T u_{s,n} for a batch of output-space cotangents ``u (S, N, C)``: shape (S, P).

    One forward pass and a ``vmap`` over the S cotangents of its pullback.
    """
    f, params = _functional(model, subset, x)
    out, pullback = tfunc.vjp(f, params)
    (grads,) = vmap(pullback)(u.to(out.dtype))
    return subset.flatten(grads)


def pathwise_sample(
    model: nn.Module,
    x: Tensor,
    subset: ParameterSubset,
    theta_star: Tensor,
    prior: Tensor,
    lam_sqrt: Tensor,
    chol: Tensor,
    num_samples: int,
    generator: torch.Generator | None,
) -> Tensor:
    """``num_samples`` draws (S, P) of N(theta*, (J^T L L^T J + P0)^-1) by Matheron's rule
    (module docstring) for training inputs ``x``, the diagonal prior ``prior (P,)``,
    ``lam_sqrt (N, C, K)`` and ``chol`` the lower Cholesky factor of B = I + L^T K L
    (NK, NK) in (n, k) order. ``e`` is drawn before ``xi`` from ``generator``."""
    dtype = theta_star.dtype
    n, _, k = lam_sqrt.shape
    device = theta_star.device  # drawn where the generator lives, then moved
    e = torch.randn(num_samples, prior.shape[0], generator=generator, dtype=dtype).to(device)
    e = e / prior.sqrt()
    xi = torch.randn(num_samples, n * k, generator=generator, dtype=dtype).to(device)
    with torch.no_grad():
        je = batched_jvp(model, x, subset, e)  # (S, N, C)
        rhs = torch.einsum("nck,snc->snk", lam_sqrt, je).reshape(num_samples, n * k) + xi
        v = torch.cholesky_solve(rhs.T, chol).T.reshape(num_samples, n, k)
        back = batched_vjp(model, x, subset, torch.einsum("nck,snk->snc", lam_sqrt, v))
    return theta_star + e - back / prior
