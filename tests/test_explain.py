"""GP-view explanations (thesis Sec. 5.3, eq. 5.2): the dual-coefficient reconstruction
sum_n k(x*, x_n) r_n equals the GP posterior-mean shift f(x*) - m(x*) = J(x*) theta* at a
stationary point of the MAP objective (the prediction itself for a linear model), and differs
from it by exactly -J(x*) S0 b elsewhere."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gaussify as gs
from gaussify.curvature.jacobian import jacobians, vjp
from gaussify.curvature.subset import expand_prior, select_parameters
from gaussify.function_space.explain import dual_coefficients, explain, kernel_similarity
from gaussify.training import log_prior

DT = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny tensors: thread start-up costs more than it saves (much more on a loaded machine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _classification(n: int = 40) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 2, generator=g, dtype=DT)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return x, y, torch.randn(5, 2, generator=g, dtype=DT)


def test_linear_gaussian_prediction_is_the_dual_sum() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(25, 3, generator=g, dtype=DT)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=DT) + 0.3
    y = y + 0.2 * torch.randn(25, 1, generator=g, dtype=DT)
    delta, sigma = 2.0, 0.4
    phi = torch.cat([x, torch.ones(25, 1, dtype=DT)], 1)  # nn.Linear order: weight, bias
    theta = torch.linalg.solve(phi.T @ phi / sigma**2 + delta * torch.eye(4, dtype=DT), phi.T @ y)
    theta = theta / sigma**2
    model = nn.Linear(3, 1).double()
    with torch.no_grad():
        model.weight.copy_(theta[:3].T)
        model.bias.copy_(theta[3])
    xt = torch.randn(4, 3, generator=g, dtype=DT)
    ex = explain(model, xt, x, y, "regression", delta, sigma_noise=sigma)
    torch.testing.assert_close(ex.alpha, (y - model(x).detach()) / sigma**2)
    torch.testing.assert_close(ex.prior_mean, torch.zeros(4, 1, dtype=DT), atol=1e-12, rtol=0)
    torch.testing.assert_close(ex.reconstruction, model(xt).detach(), atol=1e-10, rtol=0)


def test_mlp_at_the_map_and_away_from_it() -> None:
    x, y, xt = _classification()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 3)).double().eval()
    sub = select_parameters(model)
    prior = torch.tensor([0.5, 1.0, 2.0, 0.3], dtype=DT)  # per-tensor
    lik = gs.Categorical()

    def exact_gap() -> torch.Tensor:
        # away from a stationary point: f - m - K alpha = -J(x*) S0 b, b = J^T r - P0 theta*
        theta = sub.flatten(sub.params(model))
        p0 = expand_prior(prior, sub)
        b = vjp(model, x, sub, lik.residual(model(x).detach(), y)) - p0 * theta
        return -jacobians(model, xt) @ (b / p0)

    ex = explain(model, xt, x, y, "classification", prior)
    assert float(ex.gap.abs().max()) > 0.1  # the initialisation is not a MAP
    torch.testing.assert_close(ex.gap, exact_gap(), atol=1e-10, rtol=0)
    opt = torch.optim.LBFGS(
        model.parameters(),
        max_iter=500,
        tolerance_grad=1e-11,
        tolerance_change=1e-15,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = -lik.log_prob(model(x), y).sum() - log_prior(model, prior)
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    ex = explain(model, xt, x, y, "classification", prior, top_k=3)
    grad = max(float(p.grad.abs().max()) for p in model.parameters())
    assert grad < 1e-7
    # at the MAP: the GP posterior-mean shift f(x*) - m(x*) is the dual sum (eq. 5.2)
    torch.testing.assert_close(ex.reconstruction, ex.f - ex.prior_mean, atol=1e-5, rtol=0)
    assert float(ex.reconstruction.abs().max()) > 0.5
    torch.testing.assert_close(ex.alpha, dual_coefficients(model, x, y))
    # top-k indices are those of the extreme contributions, per class
    assert ex.supporting.shape == ex.opposing.shape == (5, 3, 3)
    best = ex.contributions.gather(-1, ex.supporting[..., :1])[..., 0]
    worst = ex.contributions.gather(-1, ex.opposing[..., :1])[..., 0]
    torch.testing.assert_close(best, ex.contributions.max(-1).values)
    torch.testing.assert_close(worst, ex.contributions.min(-1).values)
    torch.testing.assert_close(ex.contrast(0, 2), ex.contributions[:, 0] - ex.contributions[:, 2])


def test_similarity_is_a_cosine() -> None:
    x, _, _ = _classification(12)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 3)).double().eval()
    sim = kernel_similarity(model, x[:4], x)
    assert sim.shape == (4, 12)
    assert bool((sim.abs() <= 1 + 1e-12).all())
    torch.testing.assert_close(sim[:, :4].diagonal(), torch.ones(4, dtype=DT))


def test_bad_inputs_name_the_argument() -> None:
    x, y, xt = _classification(10)
    model = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)).double().eval()
    with pytest.raises(ValueError, match="top_k"):
        explain(model, xt, x, y, top_k=0)
    with pytest.raises(ValueError, match="x_star"):
        explain(model, torch.randn(2, 3, dtype=DT), x, y)
    with pytest.raises(ValueError, match="train_y"):
        explain(model, xt, x, y[:5])
    with pytest.raises(ValueError, match="kernel"):
        kernel_similarity(model, xt, x, kernel=torch.zeros(5, 3, 4, 3, dtype=DT))
