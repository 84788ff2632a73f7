"""Online / continual use of Laplace: incremental fits, a prior mean, output-diagonal and
joint predictives through ``predict`` (issue 10, items 2-3)."""

import math

import pytest
import torch
from torch import nn

import gaussify as gs
from gaussify.weight_space.joint import joint_predictive


def _mlp(c: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, c)).double()


def _data(task: str, n: int = 60) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    if task == "regression":
        return x, torch.randn(n, 2, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (n,), generator=gen)


@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
@pytest.mark.parametrize("task", ["regression", "classification"])
def test_incremental_fit_on_two_halves_equals_one_fit(structure: str, task: str) -> None:
    model = _mlp(2 if task == "regression" else 3)
    x, y = _data(task)
    kw = {"prior_precision": 0.8, "sigma_noise": 0.7 if task == "regression" else 1.0}
    whole = gs.Laplace(model, task, structure, **kw).fit((x, y), batch_size=16)
    parts = gs.Laplace(model, task, structure, **kw).fit((x[:25], y[:25]), batch_size=16)
    parts.fit((x[25:], y[25:]), batch_size=16, reset=False)
    assert parts.num_data == whole.num_data == 60
    torch.testing.assert_close(parts.posterior_precision, whole.posterior_precision)
    torch.testing.assert_close(parts.log_marginal_likelihood(), whole.log_marginal_likelihood())
    # reset=True (the default) replaces: the second half alone
    second = gs.Laplace(model, task, structure, **kw).fit((x[25:], y[25:]), batch_size=16)
    parts.fit((x[25:], y[25:]), batch_size=16)
    torch.testing.assert_close(parts.posterior_precision, second.posterior_precision)


def test_incremental_fit_needs_an_additive_structure_and_the_same_noise() -> None:
    model = _mlp(2)
    x, y = _data("regression")
    la = gs.Laplace(model, "regression", "lowrank", rank=4).fit((x, y))
    with pytest.raises(ValueError, match="reset"):
        la.fit((x, y), reset=False)
    la = gs.Laplace(model, "regression", "full", sigma_noise=0.5).fit((x, y))
    before = la.posterior_precision.clone()
    la.sigma_noise = 0.9
    with pytest.raises(ValueError, match="sigma_noise"):
        la.fit((x, y), reset=False)
    la.sigma_noise = 0.5
    torch.testing.assert_close(la.posterior_precision, before)  # the failed fit changed nothing


def test_prior_mean_gives_the_exact_evidence_of_a_linear_gaussian_model() -> None:
    gen = torch.Generator().manual_seed(2)
    n, d, delta, sigma = 30, 4, 2.0, 0.4
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    y = x @ torch.randn(d, generator=gen, dtype=torch.float64) + sigma * torch.randn(
        n, generator=gen, dtype=torch.float64
    )
    m0 = torch.randn(d, generator=gen, dtype=torch.float64)
    # exact: y ~ N(X m0, sigma^2 I + X X^T / delta); posterior mean A^-1 (X^T y / s^2 + d m0)
    cov_y = sigma**2 * torch.eye(n, dtype=torch.float64) + x @ x.T / delta
    exact = torch.distributions.MultivariateNormal(x @ m0, cov_y).log_prob(y)
    a = x.T @ x / sigma**2 + delta * torch.eye(d, dtype=torch.float64)
    w_map = torch.linalg.solve(a, x.T @ y / sigma**2 + delta * m0)

    model = nn.Linear(d, 1, bias=False).double()
    kw = {"prior_precision": delta, "sigma_noise": sigma, "prior_mean": m0}
    with torch.no_grad():
        model.weight.copy_(w_map[None])
    at_map = gs.Laplace(model, "regression", "full", **kw).fit((x, y[:, None]))
    torch.testing.assert_close(at_map.log_marginal_likelihood(), exact, rtol=1e-10, atol=1e-10)
    # away from the MAP the corrected evidence is still exact, and refine finds the MAP
    with torch.no_grad():
        model.weight.zero_()
    away = gs.Laplace(model, "regression", "full", **kw).fit((x, y[:, None]))
    torch.testing.assert_close(away.log_marginal_likelihood(), exact, rtol=1e-10, atol=1e-10)
    away.refine((x, y[:, None]))
    torch.testing.assert_close(away.mean, w_map, rtol=1e-8, atol=1e-10)
    # the prior mean shifts the evidence exactly as the closed form does
    zero = gs.Laplace(model, "regression", "full", prior_precision=delta, sigma_noise=sigma)
    zero.fit((x, y[:, None]))
    exact0 = torch.distributions.MultivariateNormal(torch.zeros(n).double(), cov_y).log_prob(y)
    shift = away.log_marginal_likelihood() - zero.log_marginal_likelihood()
    torch.testing.assert_close(shift, exact - exact0, rtol=1e-9, atol=1e-9)
    state = away.state_dict()
    fresh = gs.Laplace(model, "regression", "full", prior_precision=delta, sigma_noise=sigma)
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh.prior_mean, m0)
    with pytest.raises(ValueError, match="prior_mean"):
        gs.Laplace(model, "regression", "full", prior_mean=torch.zeros(d + 1))
    assert math.isfinite(float(exact))


@pytest.mark.parametrize(("structure", "subset"), [("kron", "all"), ("diag", "last_layer")])
def test_diagonal_output_and_joint_through_predict(structure: str, subset: str) -> None:
    model = _mlp(3)
    x, y = _data("classification")
    la = gs.Laplace(model, "classification", structure, subset).fit((x, y))
    xt = x[:6]
    full = la.predict(xt)
    diag = la.predict(xt, diagonal_output=True)
    assert full.f_cov is not None and diag.f_cov is not None
    torch.testing.assert_close(diag.f_cov, torch.diag_embed(full.f_cov.diagonal(dim1=1, dim2=2)))
    joint = la.predict(xt, joint=True)
    torch.testing.assert_close(joint.joint_cov, joint_predictive(la, xt).joint_cov)
    torch.testing.assert_close(joint.f_cov, full.f_cov)
    with pytest.raises(ValueError, match="joint"):
        la.predict(xt, method="nn", joint=True)
