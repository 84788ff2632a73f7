"""GBLLRegression (Watson et al. 2021's exact marginal-likelihood Bayesian last layer) against
float64 oracles: the N-dimensional Gaussian evidence, the closed-form Bayesian linear
regression posterior and its kernel (GP) form, finite differences of the evidence in the
hyperparameters, and the growth of the predictive variance away from the data."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.distributions import MultivariateNormal

from gaussify import last_layer
from gaussify.experiments._gap_toy import gap_toy
from gaussify.last_layer import GBLLRegression
from gaussify.last_layer.gbll import gbll_evidence

F64 = torch.float64


def _problem(n: int = 40, d: int = 5, c: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    phi = torch.randn(n, d, generator=gen, dtype=F64)
    y = torch.randn(n, c, generator=gen, dtype=F64)
    return phi, y


def _head(d: int, c: int, alpha: float, noise) -> GBLLRegression:
    head = GBLLRegression(d, c).double()
    return head.set_hyperparameters(prior_precision=alpha, noise_var=torch.tensor(noise, dtype=F64))


def test_log_marginal_likelihood_is_the_gaussian_density() -> None:
    phi, y = _problem()
    alpha, noise = 0.7, [0.3, 1.9]
    head = _head(5, 2, alpha, noise)
    oracle = 0.0
    for c in range(2):
        cov = phi @ phi.T / alpha + noise[c] * torch.eye(40, dtype=F64)
        oracle += float(MultivariateNormal(torch.zeros(40, dtype=F64), cov).log_prob(y[:, c]))
    assert float(head.log_marginal_likelihood(phi, y).detach()) == pytest.approx(oracle, abs=1e-10)
    # train_loss is its negative per example, also through the forward's output object
    assert float(head(phi).train_loss(y).detach()) == pytest.approx(-oracle / 40, abs=1e-12)
    # more features than examples (A is D x D, the N x N covariance is never formed)
    phi_w, y_w = _problem(n=6, d=9, c=1, seed=1)
    cov = phi_w @ phi_w.T / 2.0 + 0.5 * torch.eye(6, dtype=F64)
    want = float(MultivariateNormal(torch.zeros(6, dtype=F64), cov).log_prob(y_w[:, 0]))
    head_w = _head(9, 1, 2.0, [0.5])
    got = float(head_w.log_marginal_likelihood(phi_w, y_w).detach())
    assert got == pytest.approx(want, abs=1e-10)


def test_predictive_is_the_closed_form_posterior() -> None:
    phi, y = _problem()
    alpha, noise = 1.3, [0.4, 2.2]
    head = _head(5, 2, alpha, noise).fit_posterior(phi, y)
    x_star = torch.randn(7, 5, dtype=F64, generator=torch.Generator().manual_seed(3))
    pred = head(x_star).predictive
    for c in range(2):
        # weight space: Sigma = (alpha I + Phi^T Phi / s2)^-1, m = Sigma Phi^T y / s2
        cov_w = torch.linalg.inv(alpha * torch.eye(5, dtype=F64) + phi.T @ phi / noise[c])
        m = cov_w @ phi.T @ y[:, c] / noise[c]
        torch.testing.assert_close(pred.mean[:, c], x_star @ m, atol=1e-10, rtol=0)
        var = ((x_star @ cov_w) * x_star).sum(-1) + noise[c]
        torch.testing.assert_close(pred.var[:, c], var, atol=1e-10, rtol=0)
        # function space (the GP with kernel phi phi'^T / alpha)
        k_nn = phi @ phi.T / alpha + noise[c] * torch.eye(40, dtype=F64)
        k_sn = x_star @ phi.T / alpha
        mean_gp = k_sn @ torch.linalg.solve(k_nn, y[:, c])
        explained = (k_sn * torch.linalg.solve(k_nn, k_sn.T).T).sum(-1)
        var_gp = (x_star * x_star).sum(-1) / alpha - explained
        torch.testing.assert_close(pred.mean[:, c], mean_gp, atol=1e-10, rtol=0)
        torch.testing.assert_close(pred.var[:, c], var_gp + noise[c], atol=1e-10, rtol=0)
        torch.testing.assert_close(head.W().mean[c], m, atol=1e-10, rtol=0)
        torch.testing.assert_close(head.W().covariance[c], cov_w, atol=1e-10, rtol=0)
    # log_prob / val_loss: the Gaussian predictive density
    y_star = torch.randn(7, 2, dtype=F64)
    logp = torch.distributions.Normal(pred.mean, pred.var.sqrt()).log_prob(y_star).sum(-1)
    torch.testing.assert_close(head(x_star).log_prob(y_star), logp, atol=1e-10, rtol=0)


def test_posterior_in_batches_and_prior_before_data() -> None:
    phi, y = _problem()
    head = _head(5, 2, 0.9, [0.5, 0.5])
    x_star = phi[:4] + 0.1
    # before any data: the prior predictive N(0, phi^T phi / alpha + s2), with a warning
    with pytest.warns(UserWarning, match=r"conditions on no data.*call fit_posterior"):
        prior = head(x_star).predictive
    torch.testing.assert_close(prior.mean, torch.zeros(4, 2, dtype=F64))
    want = (x_star.square().sum(-1) / 0.9 + 0.5).unsqueeze(-1).expand(4, 2)
    torch.testing.assert_close(prior.var, want, atol=1e-12, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # conditioned on data: no warning
        one = head.fit_posterior(phi, y)(x_star).predictive
    other = _head(5, 2, 0.9, [0.5, 0.5])
    for part in range(4):
        other.update_posterior(phi[10 * part : 10 * part + 10], y[10 * part : 10 * part + 10])
    batched = other(x_star).predictive
    torch.testing.assert_close(batched.mean, one.mean, atol=1e-12, rtol=0)
    torch.testing.assert_close(batched.var, one.var, atol=1e-12, rtol=0)
    assert int(other.num_data) == 40
    # fit_posterior replaces earlier data; the state round-trips the posterior
    fresh = GBLLRegression(5, 2).double()
    fresh.load_state_dict(other.state_dict())
    torch.testing.assert_close(fresh(x_star).predictive.var, one.var, atol=1e-12, rtol=0)
    other.fit_posterior(phi, y)
    torch.testing.assert_close(other(x_star).predictive.var, one.var, atol=1e-12, rtol=0)


def test_evidence_gradient_in_hyperparameters_matches_finite_differences() -> None:
    phi, y = _problem(n=25, d=4, c=1)

    def ev(alpha: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
        return gbll_evidence(phi, y, alpha, s2.reshape(1)).log_evidence.sum()

    alpha = torch.tensor(0.8, dtype=F64, requires_grad=True)
    s2 = torch.tensor(0.6, dtype=F64, requires_grad=True)
    g_alpha, g_s2 = torch.autograd.grad(ev(alpha, s2), (alpha, s2))
    h = 1e-6
    with torch.no_grad():
        fd_alpha = (ev(alpha + h, s2) - ev(alpha - h, s2)) / (2 * h)
        fd_s2 = (ev(alpha, s2 + h) - ev(alpha, s2 - h)) / (2 * h)
    assert float(g_alpha) == pytest.approx(float(fd_alpha), rel=1e-6)
    assert float(g_s2) == pytest.approx(float(fd_s2), rel=1e-6)
    assert abs(float(g_alpha)) > 1e-3 and abs(float(g_s2)) > 1e-3  # not a trivial zero
    # the head's learned log-parameters get the chain rule: d/dlog(alpha) = alpha d/dalpha
    head = _head(4, 1, 0.8, [0.6])
    (-head.train_loss(phi, y) * 25).backward()
    assert float(head.log_prior_precision.grad) == pytest.approx(0.8 * float(g_alpha), rel=1e-8)
    # noise_cov stores log(sigma^-1): d/dlogdiag = -2 s2 d/ds2
    assert float(head.noise_cov.logdiag.grad[0]) == pytest.approx(-2 * 0.6 * float(g_s2), rel=1e-8)
    # and the features: autograd against finite differences
    phi_req = phi.clone().requires_grad_(True)
    one = torch.tensor(0.8, dtype=F64)
    two = torch.tensor([0.6], dtype=F64)
    assert torch.autograd.gradcheck(
        lambda p: gbll_evidence(p, y, one, two).log_evidence, (phi_req,), eps=1e-6, atol=1e-6
    )


def _rbf(x: torch.Tensor) -> torch.Tensor:
    """Fixed RBF features on a grid of centres over [-4, 4] (lengthscale 0.5), (N, 33)."""
    centres = torch.linspace(-4.0, 4.0, 33, dtype=F64)
    return torch.exp(-0.5 * ((x - centres) / 0.5).square())


def test_predictive_variance_grows_away_from_the_data() -> None:
    toy = gap_toy(seed=0, n_train=80)  # inputs on [-2, -0.5] U [0.5, 2], noise variance 0.09
    phi, y = _rbf(toy.x_train), toy.y_train
    head = GBLLRegression(33, 1).double()
    opt = torch.optim.Adam(head.parameters(), lr=5e-2)
    for _ in range(200):  # type-II maximum likelihood, full batch
        opt.zero_grad()
        head(phi).train_loss(y).backward()
        opt.step()
    assert 0.04 < head.noise_var.item() < 0.2  # learned from the data (started at 1)
    with torch.no_grad():
        head.fit_posterior(phi, y)
        grid = torch.tensor([[-3.5], [-2.0], [0.0], [2.0], [3.5]], dtype=F64)
        epistemic = head(_rbf(grid)).ood_score()
        at_data = head(phi).ood_score()
        total = head(_rbf(grid)).predictive.var[:, 0]
    # the gap centre and outside the data range are more uncertain than any training input
    assert float(epistemic[2]) > 2 * float(at_data.max())
    assert float(epistemic[0]) > 2 * float(at_data.max())
    assert float(epistemic[4]) > 2 * float(at_data.max())
    assert float(total[2]) > float(total[1]) and float(total[2]) > float(total[3])


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match=r"prior_precision: must be > 0, got 0.0"):
        GBLLRegression(3, 1, prior_precision=0.0)
    with pytest.raises(ValueError, match=r"prior_precision: must be > 0, got nan"):
        GBLLRegression(3, 1, prior_precision=math.nan)
    with pytest.raises(ValueError, match=r"init_noise_var: must be > 0, got -1.0"):
        GBLLRegression(3, 1, init_noise_var=-1.0)
    with pytest.raises(ValueError, match=r"in_features"):
        GBLLRegression(0, 1)
    head = GBLLRegression(3, 2).double()
    with pytest.raises(ValueError, match=r"noise_var: must be finite and > 0, got \[-1.0, -1.0\]"):
        head.set_hyperparameters(noise_var=-1.0)
    with pytest.raises(ValueError, match=r"prior_precision: must be > 0, got -2"):
        head.set_hyperparameters(prior_precision=-2)
    phi, y = torch.randn(5, 3, dtype=F64), torch.randn(5, 2, dtype=F64)
    with pytest.raises(ValueError, match=r"phi: expected features of shape \(N, 3\)"):
        head(torch.randn(5, 4, dtype=F64))
    with pytest.raises(ValueError, match=r"y: expected shape \(5, 2\)"):
        head(phi).train_loss(torch.randn(5, 1, dtype=F64))
    bad = phi.clone()
    bad[2, 1] = math.nan
    with pytest.raises(ValueError, match=r"phi: row 2 contains NaN"):
        head.fit_posterior(bad, y)
    y_bad = y.clone()
    y_bad[4, 0] = math.inf
    with pytest.raises(ValueError, match=r"y: row 4 contains inf"):
        head(phi).train_loss(y_bad)
    with pytest.raises(ValueError, match=r"phi: contains no examples"):
        head(phi[:0]).train_loss(y[:0])
    with pytest.raises(TypeError, match=r"y: expected a torch.Tensor"):
        head.fit_posterior(phi, [1.0] * 5)
    # hyperparameters that became non-finite during training are named
    with torch.no_grad():
        head.log_prior_precision.fill_(math.inf)
    with pytest.raises(ValueError, match=r"prior_precision: must be finite and > 0, got inf"):
        head(phi).train_loss(y)
    with pytest.raises(NotImplementedError, match="log_likelihood_bound: not supported"):
        head.log_likelihood_bound(phi, y)


def test_non_positive_definite_precision_is_detected() -> None:
    head = GBLLRegression(3, 1).double()
    state = head.state_dict()
    state["gram"] = -10.0 * torch.eye(3, dtype=F64)  # a corrupted statistic: A = I - 10 I
    head.load_state_dict(state)
    with pytest.raises(ValueError, match=r"A = alpha I \+ Phi\^T Phi / sigma\^2: not positive"):
        head(torch.randn(2, 3, dtype=F64)).predictive  # noqa: B018
    # float32 round-off: rank-one features far larger than the noise and a tiny prior
    head32 = GBLLRegression(4, 1, prior_precision=1e-8).set_hyperparameters(noise_var=1e-6)
    v = torch.tensor([1.0, 2.0, -3.0, 0.5])
    phi = 1e4 * torch.arange(1.0, 21.0).unsqueeze(-1) * v
    with pytest.raises(ValueError, match=r"not positive definite for output 0 in torch.float32"):
        head32.log_marginal_likelihood(phi, torch.randn(20, 1))


def test_exported_where_the_vbll_heads_are() -> None:
    assert last_layer.GBLLRegression is GBLLRegression
    assert "GBLLRegression" in last_layer.__all__
