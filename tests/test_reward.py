"""Bradley–Terry reward models through the Laplace protocol (issue 10, item 4)."""

import math

import pytest
import torch
from torch import nn

import gaussify as gs
from gaussify.weight_space.reward import BradleyTerry, predict_reward, preference_pairs

D = 3


def _data(n: int, w: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randn(n, D, generator=gen, dtype=torch.float64)
    b = torch.randn(n, D, generator=gen, dtype=torch.float64)
    p = torch.sigmoid((a - b) @ w)
    y = torch.bernoulli(p, generator=gen)
    return preference_pairs(a, b), y[:, None]


def _map(pairs: torch.Tensor, y: torch.Tensor, delta: float) -> torch.Tensor:
    """Logistic-regression MAP on the differences by Newton's method (the oracle)."""
    z = pairs[:, 0] - pairs[:, 1]
    w = torch.zeros(D, dtype=torch.float64)
    for _ in range(30):
        p = torch.sigmoid(z @ w)
        grad = z.T @ (p - y[:, 0]) + delta * w
        hess = z.T @ (z * (p * (1 - p))[:, None]) + delta * torch.eye(D, dtype=torch.float64)
        w = w - torch.linalg.solve(hess, grad)
    return w


def _fitted(pairs: torch.Tensor, y: torch.Tensor, delta: float) -> gs.Laplace:
    net = nn.Linear(D, 1, bias=False).double()
    with torch.no_grad():
        net.weight.copy_(_map(pairs, y, delta)[None])
    la = gs.Laplace(BradleyTerry(net), "binary", "full", prior_precision=delta)
    return la.fit((pairs, y))


def test_pair_laplace_equals_logistic_laplace_on_differences() -> None:
    gen = torch.Generator().manual_seed(0)
    pairs, y = _data(200, torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64), gen)
    la = _fitted(pairs, y, 1.0)
    z = pairs[:, 0] - pairs[:, 1]
    w = la.mean
    p = torch.sigmoid(z @ w)
    precision = z.T @ (z * (p * (1 - p))[:, None]) + torch.eye(D, dtype=torch.float64)
    torch.testing.assert_close(la.posterior_precision, precision, rtol=1e-10, atol=1e-10)
    # the reward at x is linear in w: mean x.w, variance x Sigma x^T
    x = torch.randn(7, D, generator=gen, dtype=torch.float64)
    pred = predict_reward(la, x)
    cov = torch.linalg.inv(precision)
    torch.testing.assert_close(pred.f_mean[:, 0], x @ w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(pred.f_cov[:, 0, 0], ((x @ cov) * x).sum(-1), rtol=1e-10, atol=0)


def test_credible_intervals_cover_the_true_reward_at_the_nominal_rate() -> None:
    # w ~ N(0, 1/delta I) is the prior, so an exact posterior's 90% intervals cover the truth
    # with probability 0.9 exactly; the Laplace posterior should be close at N = 300.
    gen = torch.Generator().manual_seed(1)
    delta, reps, z90 = 0.5, 150, 1.6448536269514722
    x = torch.randn(4, D, generator=gen, dtype=torch.float64)
    hits, err = [], []
    for _ in range(reps):
        w = torch.randn(D, generator=gen, dtype=torch.float64) / math.sqrt(delta)
        pairs, y = _data(300, w, gen)
        la = _fitted(pairs, y, delta)
        pred = predict_reward(la, x)
        sd = pred.f_cov[:, 0, 0].sqrt()
        hits.append(((pred.f_mean[:, 0] - x @ w).abs() <= z90 * sd).double())
        err.append(((la.mean - w) / la.posterior_variance.sqrt()).abs().max())
    coverage = torch.cat(hits).mean().item()
    mc_error = math.sqrt(0.9 * 0.1 / (reps * 4))
    assert abs(coverage - 0.9) < 4 * mc_error + 0.01, coverage
    # the posterior mean recovers the true weights within a few posterior standard deviations
    assert torch.stack(err).median() < 2.0


def test_bad_input_names_the_argument() -> None:
    net = nn.Linear(D, 1, bias=False)
    with pytest.raises(ValueError, match="pairs"):
        BradleyTerry(net)(torch.randn(5, 3, D))
    with pytest.raises(ValueError, match="second"):
        preference_pairs(torch.randn(5, D), torch.randn(4, D))
    la = gs.Laplace(nn.Linear(D, 1), "binary", "full")
    with pytest.raises(ValueError, match="BradleyTerry"):
        predict_reward(la, torch.randn(2, D))
    with pytest.raises(ValueError, match="scalar reward"):
        BradleyTerry(nn.Linear(D, 2))(torch.randn(5, 2, D))
