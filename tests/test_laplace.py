"""Laplace-GGN oracles: exact Bayesian linear regression (thesis Thm 3.1), the non-MAP
correction (Thm 3.3), quadrature of a 2-parameter logistic evidence, prior tuning."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from scipy import integrate, optimize, special
from torch import nn

import gaussify as gs

D = 3


def _data(n: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    w = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    y = x @ w + 0.7 + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    return x, y.unsqueeze(-1)


def _design(x: torch.Tensor) -> torch.Tensor:
    # nn.Linear flattens as [weight (1, D), bias (1,)]
    return torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)


def _blr(x: torch.Tensor, y: torch.Tensor, delta: float, sigma: float):
    phi = _design(x)
    prec = phi.T @ phi / sigma**2 + delta * torch.eye(D + 1, dtype=x.dtype)
    cov = torch.linalg.inv(prec)
    mean = cov @ phi.T @ y[:, 0] / sigma**2
    k = phi @ phi.T / delta + sigma**2 * torch.eye(len(y), dtype=x.dtype)
    evidence = torch.distributions.MultivariateNormal(torch.zeros(len(y), dtype=x.dtype), k)
    return mean, cov, evidence.log_prob(y[:, 0])


def _linear_at(theta: torch.Tensor) -> nn.Linear:
    model = nn.Linear(D, 1).double()
    with torch.no_grad():
        model.weight.copy_(theta[:D].reshape(1, D))
        model.bias.copy_(theta[D:])
    return model


@pytest.mark.parametrize("structure", ["full", "kron", "diag", "lowrank"])
def test_linear_gaussian_equals_bayesian_linear_regression(structure: str) -> None:
    x, y = _data()
    delta, sigma = 2.0, 0.4
    mean, cov, log_evidence = _blr(x, y, delta, sigma)
    model = _linear_at(mean)
    options = {"rank": D + 1} if structure == "lowrank" else {}
    la = gs.Laplace(
        model, "regression", structure, prior_precision=delta, sigma_noise=sigma, **options
    )
    la.fit((x, y))
    if structure == "diag":
        # diag keeps only the diagonal of the exact precision
        exact_prec = torch.linalg.inv(cov)
        torch.testing.assert_close(la.posterior_precision, torch.diag(exact_prec.diagonal()))
        return
    torch.testing.assert_close(la.mean, mean, atol=1e-10, rtol=0)
    torch.testing.assert_close(la.posterior_covariance, cov, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(la.log_marginal_likelihood(), log_evidence, atol=1e-6, rtol=0)
    xt, _ = _data(5, seed=1)
    pred = la.predict(xt)
    phi = _design(xt)
    torch.testing.assert_close(pred.mean[:, 0], phi @ mean)
    torch.testing.assert_close(pred.var[:, 0], (phi @ cov * phi).sum(-1) + sigma**2)


def test_non_map_correction_recovers_exact_evidence() -> None:
    x, y = _data()
    delta, sigma = 2.0, 0.4
    mean, _, log_evidence = _blr(x, y, delta, sigma)
    away = mean + torch.tensor([0.3, -0.2, 0.5, 0.1], dtype=torch.float64)
    la = gs.Laplace(
        _linear_at(away), "regression", "full", prior_precision=delta, sigma_noise=sigma
    ).fit((x, y))
    torch.testing.assert_close(la.log_marginal_likelihood(), log_evidence, atol=1e-6, rtol=0)
    plain = gs.Laplace(
        _linear_at(away),
        "regression",
        "full",
        prior_precision=delta,
        sigma_noise=sigma,
        correction=False,
    ).fit((x, y))
    assert plain.log_marginal_likelihood() < log_evidence - 1.0
    # at the MAP the correction vanishes
    at_map = gs.Laplace(
        _linear_at(mean),
        "regression",
        "full",
        prior_precision=delta,
        sigma_noise=sigma,
        correction=False,
    ).fit((x, y))
    torch.testing.assert_close(at_map.log_marginal_likelihood(), log_evidence, atol=1e-6, rtol=0)


def test_optimize_prior_and_noise_match_exact_evidence_optimum() -> None:
    x, y = _data(seed=3)

    def neg_evidence(log_hyper: np.ndarray) -> float:
        delta, sigma = np.exp(log_hyper)
        _, _, lml = _blr(x, y, float(delta), float(sigma))
        return -float(lml)

    best = optimize.minimize(
        neg_evidence, np.zeros(2), method="Nelder-Mead", options={"xatol": 1e-8, "fatol": 1e-10}
    )
    delta_opt, sigma_opt = np.exp(best.x)
    # Laplace of a linear-Gaussian model is exact at any expansion point (with the correction),
    # so tuning from a fixed fit reaches the exact optimum.
    mean, _, _ = _blr(x, y, 1.0, 1.0)
    la = gs.Laplace(
        _linear_at(mean), "regression", "full", prior_precision=1.0, sigma_noise=1.0
    ).fit((x, y))
    la.optimize_prior(n_steps=600, lr=0.05)
    assert float(la.prior_precision) == pytest.approx(delta_opt, rel=1e-3)
    assert float(la.sigma_noise) == pytest.approx(sigma_opt, rel=1e-3)


def test_logistic_evidence_against_quadrature() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 2, generator=g, dtype=torch.float64)
    y = (
        x @ torch.tensor([1.5, -1.0], dtype=torch.float64)
        + 0.5 * torch.randn(30, generator=g, dtype=torch.float64)
        > 0
    ).double()
    delta = 1.0
    model = nn.Linear(2, 1, bias=False).double()
    gs.train_map(model, (x, y), "binary", delta, epochs=1500, lr=0.05, batch_size=30, seed=0)
    la = gs.Laplace(model, "binary", "full", prior_precision=delta).fit((x, y))
    xn, yn = x.numpy(), y.numpy()

    def joint(w1: float, w2: float) -> float:
        f = xn @ np.array([w1, w2])
        ll = np.sum(yn * special.log_expit(f) + (1 - yn) * special.log_expit(-f))
        return math.exp(ll - 0.5 * delta * (w1**2 + w2**2) - math.log(2 * math.pi / delta))

    w = model.weight.detach().numpy()[0]
    z, _ = integrate.dblquad(
        lambda b, a: joint(a, b), w[0] - 6, w[0] + 6, w[1] - 6, w[1] + 6, epsabs=1e-14
    )
    gap = float(la.log_marginal_likelihood()) - math.log(z)
    print(f"Laplace evidence - quadrature evidence = {gap:.4f} nats")
    assert abs(gap) < 0.1


def test_state_dict_round_trip_weights_only() -> None:
    x, y = _data()
    model = _linear_at(_blr(x, y, 1.0, 1.0)[0])
    la = gs.Laplace(model, "regression", "kron", prior_precision=3.0).fit((x, y))
    buffer = io.BytesIO()
    torch.save(la.state_dict(), buffer)
    buffer.seek(0)
    other = gs.Laplace(model, "regression", "kron")
    other.load_state_dict(torch.load(buffer, weights_only=True))
    torch.testing.assert_close(other.log_marginal_likelihood(), la.log_marginal_likelihood())
    torch.testing.assert_close(other.predict(x[:4]).var, la.predict(x[:4]).var)


def test_nn_sampling_equals_glm_for_a_linear_model() -> None:
    x, y = _data()
    model = _linear_at(_blr(x, y, 1.0, 0.5)[0])
    la = gs.Laplace(model, "regression", "full", sigma_noise=0.5).fit((x, y))
    glm = la.predict(x[:5])
    nn_pred = la.predict(
        x[:5], method="nn", num_samples=20000, generator=torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(nn_pred.f_var, glm.f_var, rtol=0.05, atol=0)
    torch.testing.assert_close(nn_pred.mean, glm.mean, atol=0.01, rtol=0)


def test_classification_predictive_and_grid_tuning() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(80, 2, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 1).long()
    model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 3))
    gs.train_map(model, (x, y), "classification", 1.0, epochs=200, lr=1e-2, seed=0)
    la = gs.Laplace(model, "classification", "full").fit((x, y))
    before = float(la.log_marginal_likelihood())
    la.optimize_prior(method="grid")
    assert float(la.log_marginal_likelihood()) >= before
    pred = la.predict(x[:10])
    torch.testing.assert_close(pred.probs.sum(-1), torch.ones(10))
    with torch.no_grad():
        map_probs = torch.softmax(model(x[:10]), -1)
    # the GLM predictive is less confident than the MAP at its most confident class
    assert (pred.probs.max(-1).values <= map_probs.max(-1).values + 1e-6).all()


def test_bad_input() -> None:
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="structure"):
        gs.Laplace(model, "regression", "dense")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prior_precision"):
        gs.Laplace(model, "regression", "full", prior_precision=-1.0)
    with pytest.raises(ValueError, match="prior_precision: expected a scalar, 2 values"):
        gs.Laplace(model, "regression", "full", prior_precision=torch.ones(5))
    with pytest.raises(ValueError, match="subset"):
        gs.Laplace(model, "regression", "full", subset=["nope"])
    with pytest.raises(RuntimeError, match="fit"):
        gs.Laplace(model, "regression", "full").predict(torch.zeros(1, 2))
    la = gs.Laplace(model, "regression", "full").fit((torch.randn(5, 2), torch.randn(5, 1)))
    with pytest.raises(ValueError, match="method"):
        la.predict(torch.zeros(1, 2), method="bnn")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="granularity"):
        la.optimize_prior(granularity="block")  # type: ignore[arg-type]
