"""Heteroscedastic Gaussian likelihood and its Laplace posterior."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import gaussify as gs
from gaussify.likelihoods import HeteroscedasticGaussian

C = 2


def _fy(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(6, 2 * C, generator=g, dtype=torch.float64)
    y = torch.randn(6, C, generator=g, dtype=torch.float64)
    return f, y


def _autograd(lik: HeteroscedasticGaussian, f: torch.Tensor, y: torch.Tensor):
    grads, hessians = [], []
    for n in range(f.shape[0]):

        def logp(fn: torch.Tensor, n: int = n) -> torch.Tensor:
            return lik.log_prob(fn, y[n : n + 1]).sum()

        fn = f[n : n + 1]
        grads.append(torch.autograd.functional.jacobian(logp, fn)[0])
        hessians.append(torch.autograd.functional.hessian(logp, fn)[0, :, 0, :])
    return torch.stack(grads), torch.stack(hessians)


def test_residual_equals_autograd_and_hessian_is_the_fisher() -> None:
    lik = HeteroscedasticGaussian()
    f, y = _fy()
    grad, _ = _autograd(lik, f, y)
    torch.testing.assert_close(lik.residual(f, y), grad, atol=1e-10, rtol=1e-10)
    # -d2 log p is polynomial of degree two in (y - mu): averaging it over y = mu +- sigma
    # gives its expectation under p(y | f) exactly, which is the Fisher information.
    mean, sigma = f[:, :C], torch.exp(0.5 * f[:, C:])
    _, h_plus = _autograd(lik, f, mean + sigma)
    _, h_minus = _autograd(lik, f, mean - sigma)
    torch.testing.assert_close(lik.hessian(f), -(h_plus + h_minus) / 2, atol=1e-10, rtol=1e-10)
    root = lik.hessian_sqrt(f)
    torch.testing.assert_close(root @ root.mT, lik.hessian(f))
    ref = torch.distributions.Normal(mean, sigma).log_prob(y).sum(-1)
    torch.testing.assert_close(lik.log_prob(f, y), ref)


def test_bad_input() -> None:
    lik = HeteroscedasticGaussian()
    with pytest.raises(ValueError, match="even number of columns"):
        lik.log_prob(torch.zeros(3, 3), torch.zeros(3, 1))
    with pytest.raises(ValueError, match="y: regression targets must have shape"):
        lik.log_prob(torch.zeros(3, 4), torch.zeros(3, 3))


class _TwoHeads(nn.Module):
    def __init__(self, log_var: float) -> None:
        super().__init__()
        self.mean = nn.Linear(3, 1)
        self.log_var = nn.Linear(3, 1)
        with torch.no_grad():
            self.log_var.weight.zero_()
            self.log_var.bias.fill_(log_var)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.mean(x), self.log_var(x)], dim=-1)


def test_constant_noise_head_reduces_to_homoscedastic_laplace() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, generator=g, dtype=torch.float64)
    y = x.sum(-1, keepdim=True) + 0.4 * torch.randn(40, 1, generator=g, dtype=torch.float64)
    sigma = 0.4
    model = _TwoHeads(math.log(sigma**2)).double()
    het = gs.Laplace(model, "heteroscedastic", "full", subset=["mean"], prior_precision=2.0)
    het.fit((x, y))
    hom = gs.Laplace(model.mean, "regression", "full", prior_precision=2.0, sigma_noise=sigma)
    hom.fit((x, y))
    torch.testing.assert_close(het.posterior_covariance, hom.posterior_covariance)
    torch.testing.assert_close(het.log_marginal_likelihood(), hom.log_marginal_likelihood())
    p_het, p_hom = het.predict(x[:5]), hom.predict(x[:5])
    torch.testing.assert_close(p_het.mean, p_hom.mean)
    torch.testing.assert_close(p_het.var, p_hom.var)
    torch.testing.assert_close(p_het.log_prob(y[:5]), p_hom.log_prob(y[:5]))
    d = p_het.decompose()
    torch.testing.assert_close(d["aleatoric"], torch.full((5, 1), sigma**2, dtype=x.dtype))


def test_full_network_posterior_predicts_expected_noise() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(60, 3, generator=g, dtype=torch.float64)
    y = x[:, :1] + (0.1 + x[:, 1:2].abs()) * torch.randn(60, 1, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    gs.train_map(model, (x, y), "heteroscedastic", 1.0, epochs=100, lr=1e-2, seed=0)
    la = gs.Laplace(model, "heteroscedastic", "kron").fit((x, y))
    pred = la.predict(x[:7])
    f = pred.f_mean
    noise = torch.exp(f[:, 1:] + 0.5 * pred.f_var[:, 1:])
    torch.testing.assert_close(pred.var, pred.f_var[:, :1] + noise)
    mc = la.predict(
        x[:7], method="nn", num_samples=4000, generator=torch.Generator().manual_seed(0)
    )
    assert mc.mean.shape == (7, 1) and torch.isfinite(mc.var).all()
