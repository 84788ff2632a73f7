"""The regression head's default prior (issue 19): variance ``1 / in_features``, the prior
behind the paper's UCI numbers, checked against closed forms and the ``vbll`` package's
objective at its own defaults (float64, same parameters)."""

from __future__ import annotations

import math

import pytest
import torch

from gaussify import last_layer

DT = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _regression_elbo_oracle(
    phi: torch.Tensor,
    y: torch.Tensor,
    w_mean: torch.Tensor,
    s_cov: torch.Tensor,
    sigma2: torch.Tensor,
    prior_var: float,
    reg: float,
    dof: float,
    wishart_scale: float,
) -> torch.Tensor:
    """Negative eq. (61) / T for one output, written out term by term in float64:
    ``-(mean_t[log N(y_t | w^T phi_t, s2) - phi_t^T S phi_t / (2 s2)]
        + reg ((dof + 2) / 2 log(1 / s2) - m / (2 s2) - KL(N(w, S) || N(0, s0 I))))``."""
    d = phi.shape[-1]
    resid = y[:, 0] - phi @ w_mean[0]
    loglik = -0.5 * (math.log(2 * math.pi) + torch.log(sigma2) + resid.square() / sigma2)
    trace = 0.5 * torch.einsum("nd,de,ne->n", phi, s_cov, phi) / sigma2
    log_prior = 0.5 * (dof + 2.0) * torch.log(1.0 / sigma2) - 0.5 * wishart_scale / sigma2
    kl = 0.5 * (
        torch.trace(s_cov) / prior_var
        + w_mean.square().sum() / prior_var
        - d
        + d * math.log(prior_var)
        - torch.logdet(s_cov)
    )
    return -((loglik - trace).mean() + reg * (log_prior - kl))


def test_default_prior_variance_is_inverse_width() -> None:
    from gaussify.last_layer.vbll_regression import default_prior_scale

    for d in (1, 7, 50):
        head = last_layer.VBLLRegression(d, 2, 0.1)
        assert head.prior_scale == pytest.approx(1.0 / d)
        assert default_prior_scale(d) == pytest.approx(1.0 / d)
        # the posterior starts at the prior: S = I / D
        torch.testing.assert_close(
            head.W_cov().covariance, torch.eye(d).unsqueeze(0) / d, rtol=1e-6, atol=1e-7
        )
    # an explicit prior variance is kept as given (the meaning of the argument is unchanged)
    assert last_layer.VBLLRegression(50, 1, 0.1, prior_scale=1.0).prior_scale == 1.0
    assert last_layer.VBLLRegression(50, 1, 0.1, prior_scale=0.3).prior_scale == 0.3
    with pytest.raises(ValueError, match="prior_scale"):
        last_layer.VBLLRegression(5, 1, 0.1, prior_scale=0.0)


def test_default_prior_function_variance_is_mean_square_feature() -> None:
    # prior on w^T phi at the default: N(0, ||phi||^2 / D), whatever the width
    for d in (4, 64):
        head = last_layer.VBLLRegression(d, 1, 0.1).double()
        phi = torch.full((3, d), 2.0, dtype=DT)
        prior_fvar = head.prior_scale * phi.square().sum(-1)
        torch.testing.assert_close(prior_fvar, torch.full((3,), 4.0, dtype=DT))


@pytest.mark.parametrize("dof, wishart_scale", [(1.0, 1.0), (3.0, 0.1)])
def test_default_train_loss_equals_float64_oracle(dof: float, wishart_scale: float) -> None:
    g = torch.Generator().manual_seed(3)
    d, n, reg = 6, 11, 1.0 / 11
    head = last_layer.VBLLRegression(d, 1, reg, dof=dof, wishart_scale=wishart_scale).double()
    with torch.no_grad():
        head.W_mean.copy_(torch.randn(1, d, generator=g, dtype=DT))
        head.W_cov.logdiag.copy_(0.3 * torch.randn(1, d, generator=g, dtype=DT))
        head.W_cov.offdiag.copy_(0.2 * torch.randn(1, d, d, generator=g, dtype=DT))
        head.noise_cov.logdiag.fill_(0.4)
    phi = torch.randn(n, d, generator=g, dtype=DT)
    y = torch.randn(n, 1, generator=g, dtype=DT)
    s_cov = head.W().covariance[0]
    sigma2 = head.noise_cov.variance[0]
    ref = _regression_elbo_oracle(
        phi,
        y,
        head.W_mean.detach(),
        s_cov.detach(),
        sigma2.detach(),
        1.0 / d,
        reg,
        dof,
        wishart_scale,
    )
    torch.testing.assert_close(head(phi).train_loss(y).detach(), ref)


def test_default_objective_equals_the_vbll_package_at_its_defaults() -> None:
    """At the same parameters, gaussify's default head and ``vbll.Regression`` at its default
    ``prior_scale`` optimise the same objective (the package's KL omits ``-D/2``): the two
    libraries' default priors agree (before issue 19 ours was 50 times weaker at D = 50)."""
    vbll = pytest.importorskip("vbll")
    torch.manual_seed(0)
    d, n = 50, 40
    reg = 1.0 / n
    ref = vbll.Regression(d, 1, reg, wishart_scale=1.0).double()
    ours = last_layer.VBLLRegression(d, 1, reg, wishart_scale=1.0).double()
    with torch.no_grad():
        ours.W_mean.copy_(ref.W_mean)
        ours.W_cov.logdiag.copy_(ref.W_logdiag)
        ours.W_cov.offdiag.copy_(ref.W_offdiag)
        ours.noise_cov.logdiag.copy_(-ref.noise_logdiag)
    phi = torch.randn(n, d, dtype=DT)
    y = torch.randn(n, 1, dtype=DT)
    torch.testing.assert_close(
        ours(phi).train_loss(y), ref(phi).train_loss_fn(y) - reg * d / 2, rtol=1e-10, atol=1e-10
    )


@pytest.mark.slow
def test_default_prior_limits_the_noise_collapse_on_an_overfit_set() -> None:
    """Issue 19's regime: 300 rows of wine_red, 2 x 50 leaky-ReLU features trained jointly
    for 150 epochs. With the default prior the learned noise stays nearer the test error and
    the test NLL is far lower than with the former default (prior variance 1 per weight)."""
    import gaussify as gs
    from gaussify.experiments.vbll_uci import make_body

    ds = gs.data.load("wine_red", seed=0)
    x, y = ds.x_train[:300], ds.y_train[:300]
    result = {}
    for name, kwargs in (("default", {}), ("prior1", {"prior_scale": 1.0})):
        torch.manual_seed(0)
        body = make_body(x.shape[1], 50)
        head = last_layer.VBLLRegression(50, 1, 1.0 / len(x), **kwargs)
        opt = torch.optim.AdamW([*body.parameters(), *head.parameters()], lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        for _ in range(150):
            for idx in torch.randperm(len(x), generator=gen).split(32):
                opt.zero_grad()
                head(body(x[idx])).train_loss(y[idx]).backward()
                opt.step()
        with torch.no_grad():
            nll = float(head(body(ds.x_test)).val_loss(ds.y_test))
        result[name] = (nll, float(head.noise_cov.variance.detach().squeeze()))
    assert result["default"][0] < result["prior1"][0] - 0.5
    assert result["default"][1] > 1.3 * result["prior1"][1]


def _random_state(head: last_layer.VBLLRegression, g: torch.Generator) -> None:
    d = head.in_features
    with torch.no_grad():
        head.W_mean.copy_(torch.randn(1, d, generator=g, dtype=DT))
        head.W_cov.logdiag.copy_(0.3 * torch.randn(1, d, generator=g, dtype=DT) - 1.0)
        head.W_cov.offdiag.copy_(0.2 * torch.randn(1, d, d, generator=g, dtype=DT))
        head.noise_cov.logdiag.fill_(0.7)


def test_predictive_equals_closed_form_eq17() -> None:
    """Eq. (17) in float64: ``N(w^T phi, phi^T S phi + sigma^2)`` -- mean, variance, the
    validation loss (negative mean log density) written out."""
    g = torch.Generator().manual_seed(5)
    d, n = 7, 9
    head = last_layer.VBLLRegression(d, 1, 0.1).double()
    _random_state(head, g)
    phi = torch.randn(n, d, generator=g, dtype=DT)
    y = torch.randn(n, 1, generator=g, dtype=DT)
    w, s_cov = head.W_mean.detach()[0], head.W().covariance.detach()[0]
    sigma2 = math.exp(-1.4)
    mean = phi @ w
    var = torch.einsum("nd,de,ne->n", phi, s_cov, phi) + sigma2
    out = head(phi)
    torch.testing.assert_close(out.predictive.mean[:, 0].detach(), mean)
    torch.testing.assert_close(out.predictive.var[:, 0].detach(), var)
    nll = 0.5 * (math.log(2 * math.pi) + var.log() + (y[:, 0] - mean).square() / var).mean()
    torch.testing.assert_close(out.val_loss(y).detach(), nll)


def test_predictive_and_gradients_equal_the_vbll_package() -> None:
    """Same parameters (float64): the package's predictive (mean, variance, validation loss)
    equals ours, and so do the gradients of the training loss with respect to every head
    parameter and the features -- the two heads take the same optimiser steps."""
    vbll = pytest.importorskip("vbll")
    g = torch.Generator().manual_seed(8)
    d, n = 6, 13
    reg = 1.0 / n
    ours = last_layer.VBLLRegression(d, 1, reg).double()
    ref = vbll.Regression(d, 1, reg, wishart_scale=1.0).double()
    _random_state(ours, g)
    with torch.no_grad():
        ref.W_mean.copy_(ours.W_mean)
        ref.W_logdiag.copy_(ours.W_cov.logdiag)
        ref.W_offdiag.copy_(ours.W_cov.offdiag)
        ref.noise_logdiag.copy_(-ours.noise_cov.logdiag)
    phi = torch.randn(n, d, generator=g, dtype=DT)
    y = torch.randn(n, 1, generator=g, dtype=DT)
    out, out_ref = ours(phi), ref(phi)
    torch.testing.assert_close(out.predictive.mean, out_ref.predictive.mean)
    torch.testing.assert_close(out.predictive.var, out_ref.predictive.variance)
    torch.testing.assert_close(out.val_loss(y), out_ref.val_loss_fn(y))
    phi_a = phi.clone().requires_grad_(True)
    phi_b = phi.clone().requires_grad_(True)
    params = [ours.W_mean, ours.W_cov.logdiag, ours.W_cov.offdiag, ours.noise_cov.logdiag]
    params_ref = [ref.W_mean, ref.W_logdiag, ref.W_offdiag, ref.noise_logdiag]
    grads = torch.autograd.grad(ours(phi_a).train_loss(y), [*params, phi_a])
    grads_ref = torch.autograd.grad(ref(phi_b).train_loss_fn(y), [*params_ref, phi_b])
    signs = (1.0, 1.0, 1.0, -1.0, 1.0)  # our noise parameter is -log sigma
    for a, b, sign in zip(grads, grads_ref, signs, strict=True):
        if a.dim() == 3:  # only the strict lower triangle is used
            a, b = torch.tril(a, -1), torch.tril(b, -1)
        torch.testing.assert_close(a, sign * b, rtol=1e-10, atol=1e-12)
