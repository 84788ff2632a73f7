"""Predictive link approximations and decompositions against closed forms and quadrature."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate, special, stats

from gaussify.predictive import (
    gaussian_samples,
    laplace_bridge,
    predictive_from_gaussian,
    predictive_from_samples,
    probit,
)


def _cov(n: int, c: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(n, c, generator=g, dtype=torch.float64)
    a = 0.5 * torch.randn(n, c, c, generator=g, dtype=torch.float64)
    return mean, a @ a.mT + 0.1 * torch.eye(c, dtype=torch.float64)


def test_binary_probit_is_close_to_quadrature() -> None:
    for mu, var in [(0.0, 1.0), (1.5, 0.3), (-2.0, 4.0), (3.0, 10.0)]:
        exact, _ = integrate.quad(
            lambda f, mu=mu, var=var: special.expit(f) * stats.norm.pdf(f, mu, math.sqrt(var)),
            -60,
            60,
        )
        approx = probit(torch.tensor([[mu]]), torch.tensor([[var]]), task="binary").item()
        # MacKay's probit approximation is accurate to ~0.02 over this range.
        assert abs(approx - exact) < 0.02
    # with zero variance it is the plug-in
    m = torch.tensor([[0.3, -1.0]])
    torch.testing.assert_close(probit(m, torch.zeros_like(m)), torch.softmax(m, -1))


def test_laplace_bridge_formula_and_limits() -> None:
    mean, cov = _cov(5, 4)
    var = cov.diagonal(dim1=-2, dim2=-1)
    k = 4
    alpha = (1 - 2 / k + mean.exp() / k**2 * (-mean).exp().sum(-1, keepdim=True)) / var
    torch.testing.assert_close(laplace_bridge(mean, var), alpha / alpha.sum(-1, keepdim=True))
    # huge logits stay finite
    big = torch.tensor([[900.0, -900.0, 0.0]], dtype=torch.float64)
    out = laplace_bridge(big, torch.ones_like(big))
    assert torch.isfinite(out).all() and out.sum().item() == pytest.approx(1.0)


def test_gaussian_samples_have_the_requested_moments() -> None:
    mean, cov = _cov(3, 3)
    s = gaussian_samples(mean, cov, 100_000, torch.Generator().manual_seed(0))
    torch.testing.assert_close(s.mean(0), mean, atol=0.02, rtol=0)
    emp = torch.einsum("sni,snj->nij", s - mean, s - mean) / s.shape[0]
    torch.testing.assert_close(emp, cov, atol=0.03, rtol=0)


def test_mc_link_agrees_with_its_definition_and_probit_is_close() -> None:
    mean, cov = _cov(6, 3, seed=1)
    g = torch.Generator().manual_seed(0)
    pred = predictive_from_gaussian(
        mean, cov, "classification", link="mc", num_samples=200_000, generator=g
    )
    ref = torch.softmax(gaussian_samples(mean, cov, 200_000, torch.Generator().manual_seed(0)), -1)
    torch.testing.assert_close(pred.probs, ref.mean(0))
    pr = predictive_from_gaussian(mean, cov, "classification", link="probit")
    assert (pr.probs - pred.probs).abs().max() < 0.06


def test_regression_closed_form_and_log_prob() -> None:
    mean, cov = _cov(4, 2)
    noise = torch.tensor([0.3, 0.7], dtype=torch.float64) ** 2
    pred = predictive_from_gaussian(mean, cov, "regression", noise_var=noise)
    torch.testing.assert_close(pred.var, cov.diagonal(dim1=-2, dim2=-1) + noise)
    torch.testing.assert_close(pred.cov, cov + torch.diag(noise))
    y = torch.randn(4, 2, dtype=torch.float64)
    ref = stats.norm.logpdf(y.numpy(), mean.numpy(), pred.var.sqrt().numpy()).sum(-1)
    np.testing.assert_allclose(pred.log_prob(y).numpy(), ref, rtol=1e-10)
    d = pred.decompose()
    torch.testing.assert_close(d["aleatoric"] + d["epistemic"], pred.var)


def test_decomposition_sums_to_bernoulli_variance() -> None:
    mean, cov = _cov(5, 3, seed=2)
    pred = predictive_from_gaussian(mean, cov, "classification", link="mc", num_samples=10)
    d = pred.decompose(num_samples=5000, generator=torch.Generator().manual_seed(0))
    # total = E p(1-p) + Var p = pbar (1 - pbar), an identity for the sampled p
    s = gaussian_samples(mean, cov, 5000, torch.Generator().manual_seed(0))
    pbar = torch.softmax(s, -1).mean(0)
    torch.testing.assert_close(d["total"], pbar * (1 - pbar))
    assert (d["mutual_information"] >= -1e-12).all()
    torch.testing.assert_close(d["entropy"] - d["expected_entropy"], d["mutual_information"])


def test_sample_predictive() -> None:
    g = torch.Generator().manual_seed(0)
    f = torch.randn(50, 4, 3, generator=g, dtype=torch.float64)
    pred = predictive_from_samples(f, "classification")
    torch.testing.assert_close(pred.probs, torch.softmax(f, -1).mean(0))
    torch.testing.assert_close(pred.var, f.var(0, unbiased=False))
    assert pred.sample(10).shape == (10, 4, 3)
    with pytest.raises(ValueError, match="num_samples"):
        pred.sample(51)


def test_bad_input() -> None:
    mean, cov = _cov(2, 2)
    with pytest.raises(ValueError, match="link"):
        predictive_from_gaussian(mean, cov, "classification", link="logit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="link: 'bridge'"):
        predictive_from_gaussian(mean, cov, "binary", link="bridge")
    with pytest.raises(ValueError, match="f_cov: expected shape"):
        predictive_from_gaussian(mean, cov[:, 0], "classification")
    with pytest.raises(ValueError, match="f_cov: contains NaN"):
        predictive_from_gaussian(mean, cov * float("nan"), "classification")
    bad = -torch.eye(2, dtype=torch.float64).expand(2, 2, 2)
    with pytest.raises(ValueError, match="f_cov: not positive semi-definite"):
        gaussian_samples(mean, bad, 3)
