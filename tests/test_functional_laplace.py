"""Functional Laplace (thesis Thm 3.2, eq. 3.13, 3.17-3.19) against the weight-space full
Laplace GLM (the DESIGN.md oracle): predictive mean and covariance, and the log marginal
likelihood, for Gaussian, 3-class softmax and Bernoulli likelihoods, at the MAP and away
from it, for every prior granularity."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import gaussify as gs
from gaussify.curvature.jacobian import jvp
from gaussify.curvature.subset import select_parameters
from gaussify.function_space.gp import (
    FunctionalLaplace,
    gp_cholesky,
    gp_log_evidence,
    gp_log_evidence_pseudo_targets,
    gp_predictive_cov,
)
from gaussify.function_space.ntk import ntk, ntk_diag
from gaussify.training import log_prior

DT = torch.float64
N = 30
CASES = {"regression": 1, "classification": 3, "binary": 1}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny tensors: thread start-up costs more than it saves (much more on a loaded machine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _problem(task: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    c = CASES[task]
    model = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, c)).double().eval()
    x = torch.randn(N, 2, generator=g, dtype=DT)
    if task == "regression":
        y = torch.sin(2 * x[:, :1]) + 0.3 * torch.randn(N, 1, generator=g, dtype=DT)
    elif task == "classification":
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    else:
        y = (x[:, :1] * x[:, 1:] > 0).to(DT)
    return model, x, y


def _train_map(model: nn.Module, x, y, task: str, delta: float, sigma: float) -> None:
    lik = gs.get_likelihood(task, sigma_noise=sigma if task == "regression" else 1.0)
    opt = torch.optim.LBFGS(
        model.parameters(), max_iter=300, tolerance_grad=1e-10, line_search_fn="strong_wolfe"
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = -lik.log_prob(model(x), y).sum() - log_prior(model, delta)
        loss.backward()
        return loss

    opt.step(closure)


def _compare(model, x, y, task, prior, sigma, xt) -> tuple[float, float, float]:
    sigma = sigma if task == "regression" else 1.0  # only regression has observation noise
    la = gs.Laplace(model, task, "full", prior_precision=prior, sigma_noise=sigma).fit((x, y))
    fl = FunctionalLaplace(model, task, prior_precision=prior, sigma_noise=sigma).fit((x, y))
    p_w, p_f = la.predict(xt), fl.predict(xt)
    torch.testing.assert_close(p_f.f_mean, p_w.f_mean, atol=1e-10, rtol=0)
    torch.testing.assert_close(p_f.f_cov, p_w.f_cov, atol=1e-6, rtol=0)
    lml_w, lml_f = la.log_marginal_likelihood(), fl.log_marginal_likelihood()
    torch.testing.assert_close(lml_f, lml_w, atol=1e-6, rtol=0)
    if p_w.probs is not None:
        torch.testing.assert_close(p_f.probs, p_w.probs, atol=1e-6, rtol=0)
    return (
        float((p_f.f_cov - p_w.f_cov).abs().max()),
        float((lml_f - lml_w).abs()),
        float(lml_w),
    )


@pytest.mark.parametrize("task", list(CASES))
def test_equals_weight_space_full_laplace_at_map_and_away(task: str) -> None:
    model, x, y = _problem(task)
    xt = torch.randn(6, 2, generator=torch.Generator().manual_seed(5), dtype=DT)
    sub = select_parameters(model)
    priors = [0.7, torch.linspace(0.5, 2.0, len(sub.names), dtype=DT)]
    # away from the MAP (random initialisation): eq. 3.19 with the Thm 3.3 correction terms
    # still equals eq. 3.18 with the non-MAP correction
    for prior in priors:
        _compare(model, x, y, task, prior, 0.5, xt)
    _train_map(model, x, y, task, 0.7, 0.5)
    _compare(model, x, y, task, 0.7, 0.5, xt)
    # a per-parameter prior (generic kernel route) and changed hyperparameters after fit
    per_param = 0.5 + torch.rand(sub.num_params, generator=torch.Generator().manual_seed(2))
    _compare(model, x, y, task, per_param.to(DT), 0.5, xt)
    sigma = 0.5 if task == "regression" else 1.0  # only regression has observation noise
    la = gs.Laplace(model, task, "full", prior_precision=0.7, sigma_noise=sigma).fit((x, y))
    fl = FunctionalLaplace(model, task, prior_precision=0.7, sigma_noise=sigma).fit((x, y))
    for prior, sigma in [(2.5, 0.5), (priors[1], 0.8)]:
        torch.testing.assert_close(
            fl.log_marginal_likelihood(prior, sigma),
            la.log_marginal_likelihood(prior, sigma),
            atol=1e-6,
            rtol=0,
        )


def test_softmax_needs_the_full_hessian_blocks() -> None:
    """The independent-outputs shortcut (diagonal Lambda blocks, laplace-torch's functional
    Laplace) is visibly off on a 3-class problem, so the oracle above cannot pass with it."""
    model, x, y = _problem("classification")
    fl = FunctionalLaplace(model, "classification", prior_precision=0.7).fit((x, y))
    kernel = fl.train_kernel()
    lik = gs.Categorical()
    f = model(x).detach()
    exact = gp_log_evidence(
        lik.log_prob(f, y).sum(), lik.residual(f, y), lik.hessian_sqrt(f), fl._m, kernel
    )
    diag_sqrt = torch.diag_embed(lik.hessian_diag(f).sqrt())
    shortcut = gp_log_evidence(
        lik.log_prob(f, y).sum(), lik.residual(f, y), diag_sqrt, fl._m, kernel
    )
    torch.testing.assert_close(exact, fl.log_marginal_likelihood())
    assert abs(float(shortcut - exact)) > 0.1
    xt = torch.randn(20, 2, generator=torch.Generator().manual_seed(3), dtype=DT)
    k_test, k_cross = (
        ntk_diag(model, xt, prior_precision=0.7),
        ntk(model, xt, x, prior_precision=0.7),
    )
    var = gp_predictive_cov(k_test, k_cross, diag_sqrt, gp_cholesky(kernel, diag_sqrt))
    rel = (var.diagonal(dim1=-2, dim2=-1) / fl.predict(xt).f_var - 1).abs()
    assert float(rel.median()) > 0.2


@pytest.mark.parametrize("task", ["regression", "binary"])
def test_literal_pseudo_target_form_for_invertible_lambda(task: str) -> None:
    model, x, y = _problem(task)
    sigma = 0.5 if task == "regression" else 1.0  # only regression has observation noise
    fl = FunctionalLaplace(model, task, prior_precision=0.7, sigma_noise=sigma).fit((x, y))
    lik = gs.get_likelihood(task, sigma_noise=sigma)
    f = model(x).detach()
    kernel = fl.train_kernel()
    m = -jvp(model, x, "all", select_parameters(model).flatten(dict(model.named_parameters())))
    literal = gp_log_evidence_pseudo_targets(
        lik.log_prob(f, y).sum(), lik.residual(f, y), lik.hessian(f), m.detach(), kernel
    )
    torch.testing.assert_close(literal, fl.log_marginal_likelihood(), atol=1e-8, rtol=0)
    if task == "regression":
        # eq. 3.19 directly: y ~ N(prior mean of the linearised network, K + sigma^2 I)
        cov = kernel.reshape(N, N) + 0.25 * torch.eye(N, dtype=DT)
        gp = torch.distributions.MultivariateNormal((f + m.detach())[:, 0], cov)
        torch.testing.assert_close(gp.log_prob(y[:, 0]), literal, atol=1e-8, rtol=0)


def test_optimize_prior_matches_weight_space() -> None:
    model, x, y = _problem("classification")
    _train_map(model, x, y, "classification", 1.0, 1.0)
    la = gs.Laplace(model, "classification", "full", prior_precision=1.0).fit((x, y))
    fl = FunctionalLaplace(model, "classification", prior_precision=1.0).fit((x, y))
    la.optimize_prior(n_steps=60)
    fl.optimize_prior(n_steps=60)
    torch.testing.assert_close(fl.prior_precision, la.prior_precision, atol=1e-6, rtol=1e-6)
    before = float(fl.log_marginal_likelihood())
    fl.optimize_prior(granularity="layer", n_steps=30)
    assert fl.prior_precision.shape == (4,)
    assert float(fl.log_marginal_likelihood()) >= before - 1e-9
    grid = FunctionalLaplace(model, "classification").fit((x, y))
    grid.optimize_prior(method="grid", grid=torch.logspace(-2, 2, 9, dtype=DT))
    assert grid.prior_precision.ndim == 0


def test_regression_noise_tuning_matches_weight_space() -> None:
    model, x, y = _problem("regression")
    la = gs.Laplace(model, "regression", "full", prior_precision=1.0, sigma_noise=1.0)
    fl = FunctionalLaplace(model, "regression", prior_precision=1.0, sigma_noise=1.0)
    la.fit((x, y)).optimize_prior(n_steps=40)
    fl.fit((x, y)).optimize_prior(n_steps=40)
    torch.testing.assert_close(fl.sigma_noise, la.sigma_noise, atol=1e-6, rtol=1e-6)
    xt = x[:4]
    torch.testing.assert_close(fl.predict(xt).var, la.predict(xt).var, atol=1e-6, rtol=0)


def test_data_subset_state_dict_and_links() -> None:
    model, x, y = _problem("classification")
    fl = FunctionalLaplace(
        model, "classification", num_data_subset=12, generator=torch.Generator().manual_seed(0)
    ).fit((x, y))
    assert fl.num_data == 12
    idx = torch.randperm(N, generator=torch.Generator().manual_seed(0))[:12].sort().values
    ref = FunctionalLaplace(model, "classification").fit((x[idx], y[idx]))
    torch.testing.assert_close(fl.log_marginal_likelihood(), ref.log_marginal_likelihood())
    buf = io.BytesIO()
    torch.save(fl.state_dict(), buf)
    buf.seek(0)
    other = FunctionalLaplace(model, "classification")
    other.load_state_dict(torch.load(buf, weights_only=True))
    xt = x[:5]
    torch.testing.assert_close(other.predict(xt).f_cov, fl.predict(xt).f_cov)
    for link in ("probit", "bridge", "mc"):
        probs = fl.predict(xt, link=link).probs
        torch.testing.assert_close(probs.sum(-1), torch.ones(5, dtype=DT))
    cov = fl.functional_covariance(xt)
    torch.testing.assert_close(cov, cov.transpose(-1, -2))
    assert bool((torch.linalg.eigvalsh(cov) > -1e-12).all())


def test_kernel_used_is_the_ntk() -> None:
    model, x, y = _problem("binary")
    fl = FunctionalLaplace(model, "binary", prior_precision=3.0).fit((x, y))
    torch.testing.assert_close(fl.train_kernel(), ntk(model, x, prior_precision=3.0))


def test_bad_inputs_name_the_argument() -> None:
    model, x, y = _problem("classification")
    with pytest.raises(ValueError, match="num_data_subset"):
        FunctionalLaplace(model, "classification", num_data_subset=0)
    with pytest.raises(ValueError, match="prior_precision"):
        FunctionalLaplace(model, "classification", prior_precision=torch.ones(3, dtype=DT))
    with pytest.raises(ValueError, match="num_data_subset"):
        FunctionalLaplace(model, "classification", max_kernel_size=50).fit((x, y))
    fl = FunctionalLaplace(model, "classification")
    with pytest.raises(RuntimeError, match="fit"):
        fl.predict(x)
    fl.fit((x, y))
    with pytest.raises(ValueError, match="method"):
        fl.predict(x, method="nn")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="link"):
        fl.predict(x, link="logit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="granularity"):
        fl.optimize_prior(granularity="diag")  # type: ignore[arg-type]


def test_evidence_refuses_where_float64_round_off_exceeds_a_nat() -> None:
    """A tiny prior precision and noise make K / sigma^2 of order 1 / eps: the evidence there
    is round-off (it varied by hundreds of nats with the BLAS thread count) and must refuse,
    naming the cause, while a well-conditioned point nearby stays a plain number."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50, 2, generator=g, dtype=torch.float64)
    y = 1e-3 * (torch.sin(x[:, :1]) + 0.1 * torch.randn(50, 1, generator=g, dtype=torch.float64))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(2, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)
    ).double()
    gs.train_map(model, (x, y), "regression", prior_precision=1.0, epochs=50, lr=2e-2, seed=0)
    la = gs.FunctionalLaplace(model, "regression").fit((x, y))
    rms = float((y - model(x)).detach().square().mean().sqrt())
    with pytest.raises(FloatingPointError, match="ill-conditioned for float64"):
        la.log_marginal_likelihood(torch.tensor(1e-7, dtype=torch.float64), rms)
    value = la.log_marginal_likelihood(torch.tensor(1.0, dtype=torch.float64), rms)
    assert torch.isfinite(value)
