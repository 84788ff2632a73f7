"""Float64 brute-force oracles shared by the model-zoo tests (transformer, ResNet, Conv1d,
weight tying): the network as a function of the flat vector of its unique parameters
(``model.parameters()`` order, a tied tensor once), its per-sample Jacobian by
``torch.func.jacrev`` with every fused kernel off, the GGN, the Laplace log evidence without
the non-MAP correction and the GLM predictive covariance. Written independently of gaussify's
Jacobian code; :func:`assert_laplace_matches` is the one comparison with ``gaussify.Laplace``."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev
from torch.nn.attention import SDPBackend, sdpa_kernel


@contextmanager
def plain_kernels() -> Iterator[None]:
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


def flat_params(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def jacobian(model: nn.Module, x: Tensor) -> Tensor:
    """J (N, C, P): d f(x_n) / d theta over the unique parameters; a tied tensor's column
    holds the sum of the contributions of all its uses."""
    named = list(model.named_parameters())  # unique tensors, first name of each
    shapes = [p.shape for _, p in named]
    counts = [p.numel() for _, p in named]

    def f(theta: Tensor) -> Tensor:
        parts = torch.split(theta, counts)
        params = {n: t.view(s) for (n, _), t, s in zip(named, parts, shapes, strict=True)}
        return functional_call(model, params, (x,))

    with plain_kernels():
        return jacrev(f)(flat_params(model))


def softmax_hessian(f: Tensor) -> Tensor:
    p = f.softmax(-1)
    return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)


def ggn(model: nn.Module, x: Tensor) -> Tensor:
    """G = sum_n J_n^T Lambda_n J_n for the categorical likelihood."""
    with torch.no_grad(), plain_kernels():
        f = model(x)
    jac = jacobian(model, x)
    return torch.einsum("nci,ncd,ndj->ij", jac, softmax_hessian(f), jac)


def log_evidence(model: nn.Module, x: Tensor, y: Tensor, delta: float, diag: bool = False) -> float:
    """log p(y | theta*) - delta/2 ||theta*||^2 + 1/2 (P log delta - log det(G + delta I))
    (no non-MAP correction); ``diag``: G replaced by its diagonal."""
    with torch.no_grad(), plain_kernels():
        f = model(x)
    log_lik = f.log_softmax(-1).gather(1, y[:, None]).sum()
    theta = flat_params(model)
    g = ggn(model, x)
    p = theta.numel()
    if diag:
        logdet = (g.diagonal() + delta).log().sum()
    else:
        logdet = torch.linalg.slogdet(g + delta * torch.eye(p, dtype=g.dtype))[1]
    value = log_lik - 0.5 * delta * theta.square().sum() + 0.5 * (p * math.log(delta) - logdet)
    return float(value)


def glm_cov(
    model: nn.Module, x_train: Tensor, x: Tensor, delta: float, diag: bool = False
) -> Tensor:
    """J_* (G + delta I)^{-1} J_*^T, (N, C, C)."""
    g = ggn(model, x_train)
    if diag:
        g = torch.diag(g.diagonal())
    a = g + delta * torch.eye(g.shape[0], dtype=g.dtype)
    jac = jacobian(model, x)
    return torch.einsum("nci,ij,ndj->ncd", jac, torch.linalg.inv(a), jac)


def assert_laplace_matches(
    model: nn.Module, x: Tensor, y: Tensor, xt: Tensor, structure: str, delta: float
) -> Any:
    """Fit ``gaussify.Laplace(correction=False)`` (lowrank at full rank P) and assert that its
    log evidence and GLM predictive covariance at ``xt`` equal the brute force; returns the
    prediction at ``xt``."""
    import gaussify as gs  # the oracles above do not use gaussify

    p = sum(q.numel() for q in model.parameters())
    kw = {"rank": p} if structure == "lowrank" else {}
    la = gs.Laplace(
        model, "classification", structure=structure, prior_precision=delta, correction=False, **kw
    ).fit((x, y))
    diag = structure == "diag"
    assert float(la.log_marginal_likelihood()) == pytest.approx(
        log_evidence(model, x, y, delta, diag=diag), rel=1e-10, abs=1e-9
    )
    pred = la.predict(xt)
    torch.testing.assert_close(
        pred.f_cov, glm_cov(model, x, xt, delta, diag=diag), atol=1e-10, rtol=1e-8
    )
    return pred
