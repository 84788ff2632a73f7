"""Sampled linearised Laplace (sample-then-optimise): every sample is the exact minimiser of
its randomised objective, and the samples' covariance is the exact LLA covariance."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

import gaussify as gs
from gaussify.curvature.jacobian import jacobians
from gaussify.curvature.subset import expand_prior
from gaussify.function_space.sampled_lla import SampledLLA, batched_jvp, batched_vjp

DTYPE = torch.float64


def _regression(n: int = 24) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.linspace(-2, 2, n, dtype=DTYPE).unsqueeze(-1)
    y = torch.sin(2 * x) + 0.1 * torch.randn(n, 1, dtype=DTYPE)
    model = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)).to(DTYPE)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(200):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return model.eval(), x, y


def _classification(n: int = 30) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(n, 2, dtype=DTYPE)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 0] > 1).long()
    model = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 3)).to(DTYPE)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(150):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.eval(), x, y


def _analytic_minimisers(post: SampledLLA, model, x, likelihood, seed, batch_size):
    """Redraw the documented randomisation and minimise each objective by least squares on
    the stacked system [L^T J; P0^1/2] d = [z; P0^1/2 d0] (independent of the library)."""
    subset = post.subset
    prior = expand_prior(post.prior_precision, subset).to(DTYPE)
    gen = torch.Generator().manual_seed(seed)
    s, p = post.num_samples, subset.num_params
    d0 = torch.randn(s, p, generator=gen, dtype=DTYPE) / prior.sqrt()
    rows, targets = [], []
    for start in range(0, x.shape[0], batch_size):
        xb = x[start : start + batch_size]
        with torch.no_grad():
            factor = likelihood.hessian_sqrt(model(xb))
        z = torch.randn(s, xb.shape[0], factor.shape[-1], generator=gen, dtype=DTYPE)
        rows.append(torch.einsum("nck,ncp->nkp", factor, jacobians(model, xb)).reshape(-1, p))
        targets.append(z.reshape(s, -1))
    design = torch.cat([*rows, torch.diag(prior.sqrt())])
    rhs = torch.cat([*targets, prior.sqrt() * d0], dim=1)  # (S, NC + P)
    return torch.linalg.lstsq(design, rhs.T).solution.T


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_solve_equals_analytic_minimiser_per_sample(task: str) -> None:
    if task == "regression":
        model, x, y = _regression()
        lik, prior = gs.Gaussian(0.3), 2.0
    else:
        model, x, y = _classification()
        lik = gs.Categorical()  # Lambda singular: the factor form must stay exact
        prior = torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=DTYPE)  # per parameter tensor
    post = SampledLLA(model, lik, prior, num_samples=16, solver="solve", batch_size=7, seed=3)
    post.fit((x, y))
    expected = _analytic_minimisers(post, model, x, lik, seed=3, batch_size=7)
    torch.testing.assert_close(post.samples, expected, rtol=0, atol=1e-8)
    # and conjugate gradients (matrix-free, vectorised over samples) reach the same minimiser
    cg = SampledLLA(model, lik, prior, num_samples=16, solver="cg", batch_size=7, seed=3)
    cg.fit((x, y))
    torch.testing.assert_close(cg.samples, expected, rtol=0, atol=1e-8)


def _assert_cov_within_mc_error(sample_cov, exact_cov, num_samples):
    """Each entry of a sample covariance (known mean) has variance
    (S_ii S_jj + S_ij^2) / S; allow 5 standard deviations."""
    diag = exact_cov.diagonal(dim1=-2, dim2=-1)
    sd = torch.sqrt((diag.unsqueeze(-1) * diag.unsqueeze(-2) + exact_cov.square()) / num_samples)
    assert ((sample_cov - exact_cov).abs() <= 5 * sd).all(), (sample_cov - exact_cov) / sd


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_sample_covariance_converges_to_exact_lla(task: str) -> None:
    if task == "regression":
        model, x, y = _regression()
        lik, prior, xt = "regression", 1.5, torch.linspace(-3, 3, 5, dtype=DTYPE)[:, None]
    else:
        model, x, y = _classification()
        lik, prior, xt = "classification", 1.0, torch.randn(4, 2, dtype=DTYPE)
    s = 3000
    sigma = 0.3 if task == "regression" else 1.0  # only regression has observation noise
    exact = gs.Laplace(model, lik, "full", prior_precision=prior, sigma_noise=sigma).fit((x, y))
    exact_pred = exact.predict(xt)
    post = SampledLLA(model, lik, prior, sigma, num_samples=s, solver="solve", seed=0).fit((x, y))
    pred = post.predict(xt, link="probit")
    torch.testing.assert_close(pred.f_mean, exact_pred.f_mean)  # f(x; theta*)
    _assert_cov_within_mc_error(pred.f_cov, exact_pred.f_cov, s)
    # the sample-based predictive (the default) carries the same samples
    mc = post.predict(xt)
    assert mc.f_samples is not None and mc.f_samples.shape == (s, *exact_pred.f_mean.shape)
    if task == "regression":
        torch.testing.assert_close(mc.var, mc.f_var + 0.09)
    else:
        torch.testing.assert_close(mc.probs.sum(-1), torch.ones(4, dtype=DTYPE))


def test_sgd_converges_to_the_exact_minimisers() -> None:
    model, x, y = _regression()
    solve = SampledLLA(model, "regression", 1.0, 0.3, num_samples=64, solver="solve", seed=5)
    solve.fit((x, y))
    # full batch: heavy-ball with the step size and momentum of the estimated condition number
    full = SampledLLA(model, "regression", 1.0, 0.3, num_samples=64, epochs=300, seed=5)
    full.fit((x, y))
    err = (full.samples - solve.samples).norm(dim=1) / solve.samples.norm(dim=1)
    assert err.max() < 1e-2, err.max()
    gap = full.objective((x, y)) - solve.objective((x, y))  # 1/2 (d - d*)^T A (d - d*) >= 0
    assert (gap > -1e-8).all() and (gap < 1e-3).all()
    # minibatches (the same randomisation: z is drawn on the unshuffled batches) on a
    # well-conditioned problem
    kw = dict(num_samples=64, batch_size=8, seed=5)
    solve = SampledLLA(model, "regression", 10.0, 1.0, solver="solve", **kw).fit((x, y))
    mini = SampledLLA(model, "regression", 10.0, 1.0, epochs=150, **kw).fit((x, y))
    err = (mini.samples - solve.samples).norm(dim=1) / solve.samples.norm(dim=1)
    assert err.mean() < 2e-2, err.mean()
    assert mini.momentum_used <= 0.9


def test_batched_products_equal_jacobian_products() -> None:
    model, x, _ = _classification(9)
    post = SampledLLA(model, "classification", num_samples=2)
    jac = jacobians(model, x)
    v = torch.randn(5, post.subset.num_params, dtype=DTYPE)
    u = torch.randn(5, 9, 3, dtype=DTYPE)
    torch.testing.assert_close(
        batched_jvp(model, x, post.subset, v), torch.einsum("ncp,sp->snc", jac, v)
    )
    torch.testing.assert_close(
        batched_vjp(model, x, post.subset, u), torch.einsum("ncp,snc->sp", jac, u)
    )


def test_jvp_route_equals_jacobian_route() -> None:
    model, x, y = _regression()
    kw = dict(num_samples=8, epochs=5, batch_size=8, seed=2)
    a = SampledLLA(model, "regression", route="jacobian", **kw).fit((x, y))
    b = SampledLLA(model, "regression", route="jvp", **kw).fit((x, y))
    torch.testing.assert_close(a.samples, b.samples)


def test_state_dict_round_trip_and_sample() -> None:
    model, x, y = _regression()
    post = SampledLLA(model, "regression", 1.0, 0.3, num_samples=8, solver="solve").fit((x, y))
    buf = io.BytesIO()
    torch.save(post.state_dict(), buf)
    buf.seek(0)
    other = SampledLLA(model, "regression", 1.0, 0.3, num_samples=1)
    other.load_state_dict(torch.load(buf, weights_only=True))
    xt = torch.linspace(-1, 1, 3, dtype=DTYPE)[:, None]
    torch.testing.assert_close(other.predict(xt).f_samples, post.predict(xt).f_samples)
    assert other.sample(3).shape == (3, post.subset.num_params)
    torch.testing.assert_close(other.sample(2) - other.theta_star, post.samples[:2])
    with pytest.raises(ValueError, match="num_samples"):
        other.sample(9)


def test_bad_input() -> None:
    model, x, _y = _regression()
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="num_samples"):
            SampledLLA(model, "regression", num_samples=bad)
    with pytest.raises(ValueError, match="solver"):
        SampledLLA(model, "regression", solver="newton")
    with pytest.raises(ValueError, match="lr"):
        SampledLLA(model, "regression", optimizer="adam")
    with pytest.raises(ValueError, match="likelihood"):
        SampledLLA(nn.Linear(1, 2).to(DTYPE), "heteroscedastic")
    with pytest.raises(RuntimeError, match="fit"):
        SampledLLA(model, "regression").predict(x)
    assert math.isfinite(float(SampledLLA(model, "regression", num_samples=1).prior_precision))
