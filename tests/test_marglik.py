"""Online marginal-likelihood training reaches the exact evidence optimum on a linear model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import optimize
from torch import nn

import gaussify as gs
from gaussify.marglik import marglik_training


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(50, 3, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([0.8, -1.2, 0.3], dtype=torch.float64) + 0.25 * torch.randn(
        50, generator=g, dtype=torch.float64
    )
    return x, y.unsqueeze(-1)


def _exact_log_evidence(x: torch.Tensor, y: torch.Tensor, delta: float, sigma: float) -> float:
    phi = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    k = phi @ phi.T / delta + sigma**2 * torch.eye(len(x), dtype=x.dtype)
    mvn = torch.distributions.MultivariateNormal(torch.zeros(len(x), dtype=x.dtype), k)
    return float(mvn.log_prob(y[:, 0]))


def test_online_marglik_finds_the_evidence_optimum() -> None:
    x, y = _data()
    best = optimize.minimize(
        lambda h: -_exact_log_evidence(x, y, *np.exp(h)),
        np.zeros(2),
        method="Nelder-Mead",
        options={"xatol": 1e-9, "fatol": 1e-12},
    )
    delta_opt, sigma_opt = np.exp(best.x)
    torch.manual_seed(0)
    model = nn.Linear(3, 1).double()
    model, la, hist = marglik_training(
        model,
        (x, y),
        "regression",
        structure="full",
        prior_structure="scalar",
        epochs=60,
        lr=0.05,
        lr_hyp=0.1,
        burnin=0,
        marglik_frequency=20,
        n_hypersteps=300,
        batch_size=50,
        seed=0,
    )
    assert float(la.prior_precision) == pytest.approx(delta_opt, rel=1e-2)
    assert float(la.sigma_noise) == pytest.approx(sigma_opt, rel=1e-2)
    # the returned posterior is the one with the best evidence, and its evidence is exact
    assert float(la.log_marginal_likelihood()) == pytest.approx(max(hist.log_marglik))
    exact = _exact_log_evidence(x, y, float(la.prior_precision), float(la.sigma_noise))
    assert float(la.log_marginal_likelihood()) == pytest.approx(exact, abs=1e-6)


def test_layerwise_priors_on_a_classifier_improve_the_evidence() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 2, generator=g)
    y = (x[:, 0] * x[:, 1] > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 2))
    _, la, hist = marglik_training(
        model,
        (x, y),
        "classification",
        structure="kron",
        epochs=30,
        lr=1e-2,
        burnin=5,
        marglik_frequency=5,
        n_hypersteps=20,
        seed=0,
    )
    assert la.prior_precision.shape == (4,)
    assert len(hist.log_marglik) == 5 and np.all(np.isfinite(hist.log_marglik))
    assert max(hist.log_marglik) > hist.log_marglik[0]


def test_bad_arguments() -> None:
    x, y = _data()
    with pytest.raises(ValueError, match="burnin"):
        marglik_training(nn.Linear(3, 1).double(), (x, y), "regression", epochs=5, burnin=5)
    with pytest.raises(ValueError, match="prior_structure"):
        marglik_training(nn.Linear(3, 1).double(), (x, y), "regression", prior_structure="diag")  # type: ignore[arg-type]
    assert gs.Laplace  # public API stays importable
