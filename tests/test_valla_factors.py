"""VaLLA's cached inducing factors ("ntk" route, fixed Z). Oracles in float64: the cached
unit-prior components equal the NTK of full torch.func Jacobians at the kept rows (pairs and
all outputs, scalar and per-tensor priors, a parameter outside any linear layer); a step with
the cache gives the objective and gradients of the uncached route and forms no factors at Z."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gaussify.curvature.subset import select_parameters
from gaussify.function_space.valla import VaLLA
from gaussify.function_space.valla_factors import InducingFactors

DTYPE = torch.float64
C = 3


class _Scaled(nn.Module):
    """Elementwise learned scale: a parameter outside any nn.Linear (Jacobian fallback)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _problem(scaled: bool = False) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(40, 4, dtype=DTYPE)
    y = torch.randint(0, C, (40,))
    mid: list[nn.Module] = [_Scaled(8)] if scaled else []
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), *mid, nn.Linear(8, C))
    return model.to(DTYPE).eval(), x, y


def _jacobians(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-tensor Jacobians name -> (N, C, numel) by torch.func (independent of gaussify)."""
    params = dict(model.named_parameters())

    def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(model, p, (x,))

    jac = torch.func.jacrev(f)(params)
    return {n: j.reshape(x.shape[0], C, -1) for n, j in jac.items()}


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("design", ["pairs", "all"])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_cached_components_are_the_ntk_at_the_kept_rows(scaled, design, per_tensor):
    model, x, _ = _problem(scaled)
    subset = select_parameters(model, "all")
    z, xb = x[:5], x[10:17]
    rows = None if design == "all" else torch.arange(5) * C + torch.tensor([2, 0, 1, 1, 0])
    groups = [[n] for n in subset.names] if per_tensor else [list(subset.names)]
    fac = InducingFactors(model, subset, z, rows, groups, chunk_size=2)  # several blocks
    cross, diag = fac.batch(xb)
    gram = fac.gram()
    jz, jx = _jacobians(model, z), _jacobians(model, xb)
    keep = torch.arange(5 * C) if rows is None else rows
    for g, names in enumerate(groups):
        az = torch.cat([jz[n] for n in names], -1).reshape(5 * C, -1)[keep]  # (D, P_g)
        ax = torch.cat([jx[n] for n in names], -1)  # (B, C, P_g)
        want_cross = torch.einsum("kp,bcp->kbc", az, ax)
        assert torch.allclose(cross[g], want_cross, atol=1e-10, rtol=0)
        assert torch.allclose(diag[g], torch.einsum("bcp,bdp->bcd", ax, ax), atol=1e-10, rtol=0)
        assert torch.allclose(gram[g], az @ az.T, atol=1e-10, rtol=0)
    assert float(cross.abs().max()) > 1e-2  # not trivially zero
    assert not cross.requires_grad and not gram.requires_grad


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("design", ["label", "all"])
@pytest.mark.parametrize("prior", [0.7, "per_tensor"])
def test_cached_step_matches_the_uncached_route(design, prior, subset):
    """Objective and its gradients (log prior, L_v) with the cache equal those of the
    uncached "ntk" route (kernels re-formed from the network every step) to 1e-10."""
    model, x, y = _problem(scaled=True)
    n_tensors = len(select_parameters(model, subset).names)
    p0 = torch.linspace(0.5, 2.0, n_tensors, dtype=DTYPE) if prior == "per_tensor" else prior
    post = VaLLA(
        model, "classification", None, p0, subset=subset, inducing_points=x[:6],
        inducing_classes=design, kernel="ntk", learn_prior=True,
    ).initialize((x, y))  # fmt: skip
    with torch.no_grad():  # a non-trivial q(u)
        post.chol_raw.copy_(0.1 * torch.randn(post.chol_raw.shape, dtype=DTYPE).tril())

    def value_and_grads() -> tuple[torch.Tensor, ...]:
        post.log_prior.grad, post.chol_raw.grad = None, None
        obj = post.batch_objective(x[20:28], y[20:28])
        obj.backward()
        return obj.detach(), post.log_prior.grad.clone(), post.chol_raw.grad.clone()

    assert post._z_factors is not None
    cached = value_and_grads()
    post._z_factors = None  # the uncached route: ntk(Z, x) and ntk_diag(x) every call
    uncached = value_and_grads()
    for a, b in zip(cached, uncached, strict=True):
        assert torch.allclose(a, b, atol=1e-10, rtol=1e-10)
    assert float(cached[1].abs().max()) > 1e-6  # the prior does receive a gradient


def test_a_step_forms_no_factors_at_the_inducing_inputs():
    model, x, y = _problem()
    post = VaLLA(model, "classification", None, inducing_points=x[:6], kernel="ntk")
    post.initialize((x, y))
    plan = post._z_factors.plan
    seen: list[int] = []
    original = plan.factors

    def spy(inputs: torch.Tensor):
        seen.append(inputs.shape[0])
        return original(inputs)

    plan.factors = spy  # type: ignore[method-assign]
    post.step(x[20:28], y[20:28])
    post.predict(x[30:33])
    assert seen == [8, 3]  # one pass over the minibatch (K_Zx and k_xx), one over the test
