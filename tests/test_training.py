"""MAP training reaches closed-form / scikit-learn optima and is deterministic."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from torch import nn

from gaussify.training import GaussianLogPrior, log_prior, train_map


def _regression(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(60, 3, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.3 * torch.randn(
        60, generator=g, dtype=torch.float64
    )
    return x, y.unsqueeze(-1)


def test_linear_gaussian_map_is_ridge_solution() -> None:
    x, y = _regression()
    delta, sigma = 4.0, 0.5
    model = nn.Linear(3, 1, bias=False).double()
    train_map(
        model,
        (x, y),
        "regression",
        delta,
        epochs=1500,
        lr=0.05,
        sigma_noise=sigma,
        batch_size=60,
        seed=0,
    )
    ridge = torch.linalg.solve(
        x.T @ x / sigma**2 + delta * torch.eye(3, dtype=x.dtype), x.T @ y / sigma**2
    )
    torch.testing.assert_close(model.weight.detach().T, ridge, atol=1e-5, rtol=1e-5)


def test_logistic_map_matches_sklearn() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 4))
    y = (x @ np.array([1.5, -1.0, 0.0, 2.0]) + rng.normal(size=200) > 0).astype(int)
    delta = 2.0
    ref = LogisticRegression(C=1 / delta, fit_intercept=False, tol=1e-10, max_iter=10_000)
    ref.fit(x, y)
    model = nn.Linear(4, 1, bias=False).double()
    xt, yt = torch.from_numpy(x), torch.from_numpy(y).double()
    train_map(model, (xt, yt), "binary", delta, epochs=2000, lr=0.05, batch_size=200, seed=0)
    np.testing.assert_allclose(model.weight.detach().numpy()[0], ref.coef_[0], atol=1e-4)


def test_deterministic_under_seed_and_history() -> None:
    x, y = _regression(1)

    def run() -> tuple[torch.Tensor, list[float]]:
        torch.manual_seed(123)
        model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()
        _, hist = train_map(
            model, (x, y), "regression", 1.0, epochs=20, lr=1e-2, batch_size=16, seed=7
        )
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), hist.loss

    (a, la), (b, lb) = run(), run()
    assert torch.equal(a, b) and la == lb
    assert len(la) == 20 and la[-1] < la[0]


def test_log_prior_granularities() -> None:
    model = nn.Linear(2, 1)
    theta2 = [p.detach().square().sum() for p in model.parameters()]
    per_tensor = torch.tensor([2.0, 3.0])
    expected = -0.5 * (2.0 * theta2[0] + 3.0 * theta2[1])
    torch.testing.assert_close(log_prior(model, per_tensor), expected)
    torch.testing.assert_close(log_prior(model, 2.0), -0.5 * 2.0 * (theta2[0] + theta2[1]))


def test_cached_log_prior_reads_the_live_parameters() -> None:
    # built once per train_map call: must equal -1/2 sum_p delta_p theta_p^2 at the current
    # weights (not those at construction) and give the gradient -delta * theta
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    numels = torch.tensor([q.numel() for q in model.parameters()])
    p = int(numels.sum())
    per_tensor = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    per_param = torch.linspace(0.5, 2.0, p, dtype=torch.float64)
    cases = [
        (2.0, torch.full((p,), 2.0, dtype=torch.float64)),
        (per_tensor, per_tensor.repeat_interleave(numels)),
        (per_param, per_param),
    ]
    for prior, delta in cases:
        term = GaussianLogPrior(model, prior)
        with torch.no_grad():
            for q in model.parameters():
                q.add_(0.1)
        theta = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
        value = term()
        torch.testing.assert_close(value, -0.5 * (delta * theta.square()).sum())
        grads = torch.autograd.grad(value, list(model.parameters()))
        torch.testing.assert_close(torch.cat([g.reshape(-1) for g in grads]), -delta * theta)


def test_bad_arguments() -> None:
    x, y = _regression()
    model = nn.Linear(3, 1).double()
    with pytest.raises(ValueError, match="epochs"):
        train_map(model, (x, y), "regression", epochs=0)
    with pytest.raises(ValueError, match="prior_precision"):
        train_map(model, (x, y), "regression", prior_precision=-1.0)
    with pytest.raises(ValueError, match="optimizer"):
        train_map(model, (x, y), "regression", optimizer="lbfgs")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="data: x has 60 rows but y has 2"):
        train_map(model, (x, y[:2]), "regression")
    with pytest.raises(FloatingPointError, match="loss became"):
        train_map(model, (x * 1e200, y), "regression", epochs=2)
