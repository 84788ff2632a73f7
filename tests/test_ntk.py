"""The kernel J S0 J^T (thesis eq. 3.4): against Jacobians from ``curvature.jacobians`` for every
prior granularity, the per-layer MLP route (VaLLA App. E.3) against the Jacobian route, blocking,
and bad inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gaussify.curvature.jacobian import jacobians
from gaussify.curvature.subset import expand_prior, select_parameters
from gaussify.function_space.ntk import ntk, ntk_components, ntk_diag, per_layer_modules

DT = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny tensors: thread start-up costs more than it saves (much more on a loaded machine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _mlp(c: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, c))


class _Mixed(nn.Module):
    """A LayerNorm between linear layers: Jacobian route for its parameters, per-layer route
    for the linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def _reference(model: nn.Module, x1, x2, prior, subset="all") -> torch.Tensor:
    sub = select_parameters(model, subset)
    s0 = 1.0 / expand_prior(prior, sub).to(DT)
    return torch.einsum("acp,p,bdp->acbd", jacobians(model, x1, sub), s0, jacobians(model, x2, sub))


def _priors(model: nn.Module, subset="all") -> list:
    sub = select_parameters(model, subset)
    g = torch.Generator().manual_seed(1)
    return [
        0.7,
        torch.linspace(0.5, 3.0, len(sub.names), dtype=DT),
        0.5 + torch.rand(sub.num_params, generator=g, dtype=DT),
    ]


@pytest.mark.parametrize("make", [_mlp, _Mixed])
@pytest.mark.parametrize("granularity", [0, 1, 2])
def test_ntk_equals_jacobian_kernel(make, granularity: int) -> None:
    model = make().double().eval()
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(7, 4, generator=g, dtype=DT)
    x2 = torch.randn(5, 4, generator=g, dtype=DT)
    prior = _priors(model)[granularity]
    ref = _reference(model, x1, x2, prior)
    for route in ("auto", "jacobian"):
        for chunk in (None, 2):
            k = ntk(model, x1, x2, prior_precision=prior, chunk_size=chunk, route=route)
            assert k.shape == (7, 3, 5, 3)
            torch.testing.assert_close(k, ref, atol=1e-12, rtol=1e-10)
    sym = _reference(model, x1, x1, prior)
    torch.testing.assert_close(ntk(model, x1, prior_precision=prior, chunk_size=3), sym)
    diag = torch.stack([sym[i, :, i, :] for i in range(7)])
    torch.testing.assert_close(ntk_diag(model, x1, prior_precision=prior, chunk_size=3), diag)


def test_per_layer_route_is_used_and_matches_on_subsets() -> None:
    model = _mlp().double().eval()
    assert per_layer_modules(model) == ["0", "2", "4"]
    assert per_layer_modules(model, "all", _priors(model)[2]) == []  # per-parameter prior
    assert per_layer_modules(_Mixed()) == ["fc1", "fc2"]
    x = torch.randn(6, 4, dtype=DT)
    for subset in ("last_layer", ["2.weight", "4"]):
        ref = _reference(model, x, x, 2.0, subset)
        torch.testing.assert_close(ntk(model, x, subset=subset, prior_precision=2.0), ref)


def test_components_sum_to_the_kernel() -> None:
    model = _mlp().double().eval()
    x = torch.randn(5, 4, dtype=DT)
    names = select_parameters(model).names
    groups = [list(names[:2]), list(names[2:])]
    comps = ntk_components(model, x, groups=groups)
    assert comps.shape == (2, 5, 3, 5, 3)
    prior = torch.tensor([2.0, 2.0, 0.5, 0.5, 0.5, 0.5], dtype=DT)
    torch.testing.assert_close(
        comps[0] / 2.0 + comps[1] / 0.5, ntk(model, x, prior_precision=prior)
    )


def test_float32_model_gives_float32_kernel() -> None:
    model = _mlp().eval()
    k = ntk(model, torch.randn(3, 4), prior_precision=2.0)
    assert k.dtype == torch.float32


def test_kernel_is_differentiable_in_the_prior() -> None:
    model = _mlp().double().eval()
    x = torch.randn(4, 4, dtype=DT)
    prior = torch.tensor(2.0, dtype=DT, requires_grad=True)
    k = ntk(model, x, prior_precision=prior)
    (grad,) = torch.autograd.grad(k.sum(), prior)
    torch.testing.assert_close(grad, -k.sum().detach() / 2.0)


def test_bad_inputs_name_the_argument() -> None:
    model = _mlp().double().eval()
    x = torch.randn(4, 4, dtype=DT)
    with pytest.raises(ValueError, match="x2"):
        ntk(model, x, torch.randn(3, 5, dtype=DT))
    with pytest.raises(ValueError, match="x1"):
        ntk(model, x[:0])
    with pytest.raises(ValueError, match="prior_precision"):
        ntk(model, x, prior_precision=torch.ones(4, dtype=DT))
    with pytest.raises(ValueError, match="prior_precision"):
        ntk(model, x, prior_precision=-1.0)
    with pytest.raises(ValueError, match="route"):
        ntk(model, x, route="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="groups"):
        ntk_components(model, x, groups=[["0.weight"]])
