"""The Kronecker-factored Laplace evidence for regression and its (prior, noise) optimum.

Oracle: for one ``nn.Linear`` with one output, KFAC is exactly the GGN, and a linear-Gaussian
model's Laplace evidence is the exact Bayesian linear-regression evidence
log N(y | 0, sigma^2 I + Phi Phi^T / delta), Phi = [x, 1]. The kron evidence and its tuned
(prior, noise) must equal the full-structure ones to 1e-8 (float64).

Bug this guards (issue 7): tuning prior and noise with the KFAC evidence of a multi-layer MLP
ran both off to ~1e-7. Cause: the non-MAP correction 1/2 b^T A^-1 b of thesis Thm 3.3 (exact
with the full GGN) was also applied with A = KFAC; it then exceeds the largest gain the
linearised model can have (1/2 ||r||^2 / sigma^2 + 1/2 delta ||theta*||^2) and grows without
bound as delta, sigma -> 0. The correction is now on by default only for the exact full GGN.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import gaussify as gs

DT = torch.float64


def _linear_data(n: int = 40, d: int = 3) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(n, d, dtype=DT)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=DT) + 0.3 * torch.randn(n, 1, dtype=DT)
    model = nn.Linear(d, 1).double()  # random weights: not the MAP
    return model, x, y


def _exact_evidence(x: torch.Tensor, y: torch.Tensor, delta: float, sigma: float) -> float:
    phi = torch.cat([x, torch.ones(len(x), 1, dtype=DT)], 1)
    cov = sigma**2 * torch.eye(len(x), dtype=DT) + phi @ phi.T / delta
    dist = torch.distributions.MultivariateNormal(torch.zeros(len(x), dtype=DT), cov)
    return float(dist.log_prob(y[:, 0]))


@pytest.mark.parametrize("delta, sigma", [(0.1, 0.3), (1.0, 0.7), (10.0, 2.0), (1e-4, 0.05)])
def test_one_layer_kron_evidence_equals_full_and_exact(delta: float, sigma: float) -> None:
    model, x, y = _linear_data()
    exact = _exact_evidence(x, y, delta, sigma)
    for structure in ("full", "kron"):
        # off the MAP the correction is needed for the exact value; KFAC is exact here
        la = gs.Laplace(model, "regression", structure, sigma_noise=0.7, correction=True)
        value = float(la.fit((x, y)).log_marginal_likelihood(delta, sigma))
        assert math.isclose(value, exact, rel_tol=1e-8), (structure, value, exact)


def test_one_layer_kron_optimum_equals_full_optimum() -> None:
    model, x, y = _linear_data()
    opt = {}
    for structure in ("full", "kron"):
        la = gs.Laplace(model, "regression", structure, sigma_noise=0.7, correction=True)
        la.fit((x, y)).optimize_prior(tune_noise=True, n_steps=400, lr=0.05)
        opt[structure] = (float(la.prior_precision), float(la.sigma_noise))
    (d_full, s_full), (d_kron, s_kron) = opt["full"], opt["kron"]
    assert math.isclose(d_kron, d_full, rel_tol=1e-8) and math.isclose(s_kron, s_full, rel_tol=1e-8)
    # and it is the optimum of the exact evidence: a stationary point in log(delta), log(sigma)
    log_h = torch.tensor([math.log(d_full), math.log(s_full)], requires_grad=True)
    phi = torch.cat([x, torch.ones(len(x), 1, dtype=DT)], 1)
    cov = log_h[1].exp().square() * torch.eye(len(x), dtype=DT) + phi @ phi.T / log_h[0].exp()
    value = torch.distributions.MultivariateNormal(torch.zeros(len(x), dtype=DT), cov)
    (grad,) = torch.autograd.grad(value.log_prob(y[:, 0]), log_h)
    assert grad.abs().max() < 1e-4  # vs O(N) = 40 away from the optimum
    assert 0.2 < s_full < 0.4  # the data's noise is 0.3


def test_one_layer_at_the_map_default_kron_equals_full() -> None:
    """At the MAP the correction vanishes, so the defaults (kron without it, full with it) give
    the same evidence: the exact one."""
    model, x, y = _linear_data()
    delta, sigma = 2.0, 0.5
    phi = torch.cat([x, torch.ones(len(x), 1, dtype=DT)], 1)
    w = torch.linalg.solve(phi.T @ phi + delta * sigma**2 * torch.eye(4, dtype=DT), phi.T @ y)
    with torch.no_grad():
        model.weight.copy_(w[:3].T)
        model.bias.copy_(w[3])
    exact = _exact_evidence(x, y, delta, sigma)
    for structure in ("full", "kron"):
        la = gs.Laplace(model, "regression", structure, sigma_noise=sigma, prior_precision=delta)
        assert la.correction == (structure == "full")
        value = float(la.fit((x, y)).log_marginal_likelihood())
        assert math.isclose(value, exact, rel_tol=1e-8), (structure, value, exact)


def _trained_mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor, float]:
    torch.manual_seed(1)
    x = torch.linspace(-2, 2, 80, dtype=DT)[:, None]
    y = torch.sin(2 * x) + 0.2 * torch.randn_like(x)
    model = nn.Sequential(
        nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    ).double()
    gs.train_map(model, (x, y), "regression", epochs=150, lr=1e-2, batch_size=80, seed=0)
    with torch.no_grad():
        rmse = float((model(x) - y).square().mean().sqrt())
    return model, x, y, rmse


def test_multilayer_kron_regression_no_longer_collapses() -> None:
    model, x, y, rmse = _trained_mlp()
    # the cause: with A = KFAC the correction exceeds the largest possible gain of the
    # linearised model, 1/2 ||r||^2 / sigma^2 + 1/2 delta ||theta*||^2 (the full GGN's is below)
    delta, sigma = 1e-4, 0.5 * rmse
    sse = float((model(x).detach() - y).square().sum())
    theta_sq = float(sum(p.detach().square().sum() for p in model.parameters()))
    bound = 0.5 * sse / sigma**2 + 0.5 * delta * theta_sq
    gain = {}
    for structure in ("full", "kron"):
        on = gs.Laplace(model, "regression", structure, sigma_noise=rmse, correction=True)
        off = gs.Laplace(model, "regression", structure, sigma_noise=rmse, correction=False)
        on.fit((x, y))
        off.fit((x, y))
        gain[structure] = float(
            on.log_marginal_likelihood(delta, sigma) - off.log_marginal_likelihood(delta, sigma)
        )
        # the Newton model's log-likelihood L + gain vs its supremum (zero residual)
        spec = on.spectrum("scalar", tune_noise=True)
        assert spec is not None
        dropped = spec.correction_dropped(np.log([delta]), math.log(sigma))
        assert dropped is (structure == "kron")  # the full GGN's gain stays below the bound
    assert 0 <= gain["full"] <= bound
    # with A = KFAC the correction (> 2 x the bound: the collapse) is dropped by the rule
    # of gaussify.evidence: its Newton model exceeds the largest Gaussian log-likelihood
    assert gain["kron"] == 0.0
    # so tuning with the correction on for kron no longer runs off (it ran to sigma < 0.1 rmse)
    old = gs.Laplace(model, "regression", "kron", sigma_noise=rmse, correction=True).fit((x, y))
    old.optimize_prior(tune_noise=True)
    assert 0.5 * rmse < float(old.sigma_noise) < 2 * rmse
    la = gs.Laplace(model, "regression", "kron", sigma_noise=rmse).fit((x, y))
    la.optimize_prior(tune_noise=True)
    assert 0.5 * rmse < float(la.sigma_noise) < 2 * rmse
    assert 1e-3 < float(la.prior_precision) < 1e3
    assert old.correction and not la.correction
