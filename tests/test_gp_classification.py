"""GP classification as heteroscedastic GP regression (Bui, Sec. 4.2).

Oracles: the log marginal likelihood against ``torch.distributions.MultivariateNormal`` with
an independently built kernel and mean; the analytic gradient against autograd through
``torch.linalg.cholesky``; the fitted hyperparameters against central finite differences; the
latent predictive against dense solves; ``moment-ori`` against gpytorch's exact GP with
``DirichletClassificationLikelihood``; the Monte Carlo predictive against Gauss-Hermite
quadrature.
"""

from __future__ import annotations

import math
import runpy
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import gaussify as gs
from gaussify.approx_likelihoods import DirichletGaussian, GPClassifier
from gaussify.approx_likelihoods.gp_classification import (
    heteroscedastic_cholesky,
    heteroscedastic_lml,
    rbf_kernel,
)

DT = torch.float64
BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "gp_classification.py"
METHODS = ("moment-ori", "moment", "laplace", "variational", "gauss")


def _toy(n: int = 45, classes: int = 3, dim: int = 2, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    centres = torch.randn(classes, dim, generator=g, dtype=DT) * 1.5
    x = centres[y] + torch.randn(n, dim, generator=g, dtype=DT)
    return x, y


def _reference_kernel(x1: torch.Tensor, x2: torch.Tensor, ls: torch.Tensor, var: float):
    """k(x, x') = var exp(-0.5 ||(x - x') / ls||^2) by pairwise differences (no expansion)."""
    diff = (x1[:, None, :] - x2[None, :, :]) / ls
    return var * torch.exp(-0.5 * diff.square().sum(-1))


def _reference_lml(gp: GPClassifier, x: torch.Tensor, y: torch.Tensor, classes: int):
    """Sum over classes of MultivariateNormal(m_c 1, K_c + diag(v_c)).log_prob(targets_c)
    with m_c the GLS estimate by dense solves (or 0), targets from DirichletGaussian."""
    mean, var = gp.likelihood.pseudo_targets(y, classes, dtype=DT)
    total = torch.zeros((), dtype=DT)
    for c in range(mean.shape[1]):
        h = c if gp.lengthscale.shape[0] > 1 else 0
        k = _reference_kernel(x, x, gp.lengthscale[h], float(gp.variance[h]))
        a = k + torch.diag(var[:, c])
        if gp.mean_mode == "constant":
            ones = torch.ones(len(y), dtype=DT)
            m = ones @ torch.linalg.solve(a, mean[:, c]) / (ones @ torch.linalg.solve(a, ones))
        else:
            m = torch.zeros((), dtype=DT)
        dist = torch.distributions.MultivariateNormal(m * torch.ones(len(y), dtype=DT), a)
        total = total + dist.log_prob(mean[:, c])
    return total


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "options",
    [
        {"hyperparameters": "per_class"},
        {"hyperparameters": "shared", "ard": True},
        {"hyperparameters": "per_class", "mean": "zero", "ard": True},
    ],
)
def test_lml_equals_multivariate_normal(method: str, options: dict) -> None:
    x, y = _toy()
    gp = GPClassifier(method, 0.05, **options).set_data(x, y, 3)
    g = torch.Generator().manual_seed(1)
    gp.log_lengthscale = gp.log_lengthscale + 0.3 * torch.randn(
        gp.log_lengthscale.shape, generator=g, dtype=DT
    )
    gp.log_variance = gp.log_variance + 0.3 * torch.randn(
        gp.log_variance.shape, generator=g, dtype=DT
    )
    ours = gp.log_marginal_likelihood()
    ref = _reference_lml(gp, x, y, 3)
    assert torch.allclose(ours, ref, rtol=1e-10, atol=1e-9)
    per_class = gp.log_marginal_likelihood(per_class=True)
    assert per_class.shape == (3,) and torch.allclose(per_class.sum(), ours)


def test_logit_basis_lml_equals_multivariate_normal() -> None:
    x, y = _toy(classes=2)
    gp = GPClassifier("variational", 0.1, basis="logit").set_data(x, y)
    assert gp.num_outputs == 1
    assert torch.allclose(gp.log_marginal_likelihood(), _reference_lml(gp, x, y, 2), rtol=1e-10)


def test_profiled_mean_is_the_maximiser() -> None:
    x, y = _toy()
    gp = GPClassifier("moment-ori", 0.01).set_data(x, y, 3)
    targets, noise = gp.pseudo_targets(y, 3)
    kernel = gp.train_kernel().expand(3, -1, -1)
    mean = gp.mean.clone().requires_grad_(True)
    a = kernel + torch.diag_embed(noise)
    lp = torch.distributions.MultivariateNormal(mean[:, None].expand(3, len(y)), a).log_prob(
        targets
    )
    (grad,) = torch.autograd.grad(lp.sum(), mean)
    assert grad.abs().max() < 1e-9
    lml_fixed, *_ = heteroscedastic_lml(kernel, noise, targets, gp.mean + 0.1)
    assert (lml_fixed < gp.log_marginal_likelihood(per_class=True)).all()


@pytest.mark.parametrize("profile", [True, False])
def test_analytic_gradient_equals_autograd_through_cholesky(profile: bool) -> None:
    g = torch.Generator().manual_seed(0)
    c, n = 3, 30
    b = torch.randn(c, n, n, generator=g, dtype=DT)
    kernel = (b @ b.mT / n).requires_grad_(True)
    noise = (torch.rand(c, n, generator=g, dtype=DT) + 0.1).requires_grad_(True)
    targets = torch.randn(c, n, generator=g, dtype=DT).requires_grad_(True)
    mean = None if profile else torch.tensor([0.3, -1.0, 2.0], dtype=DT)
    lml, *_ = heteroscedastic_lml(kernel, noise, targets, mean)
    ours = torch.autograd.grad(
        lml @ torch.tensor([1.0, 2.0, -0.5], dtype=DT), [kernel, noise, targets]
    )

    def plain(k: torch.Tensor, v: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a = k + torch.diag_embed(v)
        chol = torch.linalg.cholesky(a)
        ones = torch.ones_like(t)[..., None]
        if mean is None:
            m = (ones.mT @ torch.cholesky_solve(t[..., None], chol)).squeeze() / (
                ones.mT @ torch.cholesky_solve(ones, chol)
            ).squeeze()
        else:
            m = mean
        r = t - m[:, None]
        quad = (r[..., None].mT @ torch.cholesky_solve(r[..., None], chol)).squeeze()
        logdet = 2 * chol.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        return -0.5 * (quad + logdet + n * math.log(2 * math.pi))

    ref_val = plain(kernel, noise, targets)
    assert torch.allclose(lml, ref_val, rtol=1e-12)
    ref = torch.autograd.grad(
        ref_val @ torch.tensor([1.0, 2.0, -0.5], dtype=DT), [kernel, noise, targets]
    )
    sym = 0.5 * (ref[0] + ref[0].mT)  # only the symmetric part of dL/dK is defined
    assert torch.allclose(ours[0], sym, atol=1e-10)
    assert torch.allclose(ours[1], ref[1], atol=1e-10)
    assert torch.allclose(ours[2], ref[2], atol=1e-10)


@pytest.mark.parametrize("hyper", ["per_class", "shared"])
def test_fitted_hyperparameters_are_a_stationary_point(hyper: str) -> None:
    x, y = _toy(n=60)
    gp = GPClassifier("variational", 0.1, hyperparameters=hyper, ard=hyper == "shared")
    result = gp.fit(x, y, 3, tolerance_grad=1e-7)
    assert result.converged and result.lml >= -result.trace[0] * x.shape[0] * 3
    params = torch.cat([gp.log_lengthscale.flatten(), gp.log_variance])
    num_ls = gp.log_lengthscale.numel()

    def lml(p: torch.Tensor) -> float:
        ls = p[:num_ls].reshape(gp.log_lengthscale.shape)
        with torch.no_grad():
            return float(gp.log_marginal_likelihood(ls, p[num_ls:]))

    h = 1e-5
    best = lml(params)
    scale = abs(best)
    for i in range(params.numel()):
        step = torch.zeros_like(params)
        step[i] = h
        fd = (lml(params + step) - lml(params - step)) / (2 * h)
        assert abs(fd) < 1e-5 * scale, (i, fd)
        for s in (1e-2, -1e-2):  # a local maximum, not only a stationary point
            step[i] = s
            assert lml(params + step) <= best + 1e-9 * scale


def test_latent_predictive_equals_dense_solves() -> None:
    x, y = _toy()
    x_test = torch.randn(7, 2, generator=torch.Generator().manual_seed(5), dtype=DT)
    gp = GPClassifier("moment", 0.1, ard=True)
    gp.fit(x, y, 3, max_iter=5)
    mu, var = gp.predict_latent(x_test, chunk_size=3)
    targets, noise = gp.pseudo_targets(y, 3)
    for c in range(3):
        k = _reference_kernel(x, x, gp.lengthscale[c], float(gp.variance[c]))
        ks = _reference_kernel(x, x_test, gp.lengthscale[c], float(gp.variance[c]))
        a = k + torch.diag(noise[c])
        mean = gp.mean[c]
        ref_mu = mean + ks.T @ torch.linalg.solve(a, targets[c] - mean)
        ref_var = gp.variance[c] - (ks * torch.linalg.solve(a, ks)).sum(0)
        assert torch.allclose(mu[:, c], ref_mu, atol=1e-10)
        assert torch.allclose(var[:, c], ref_var, atol=1e-10)


def test_moment_ori_equals_gpytorch_dirichlet_classification() -> None:
    gpytorch = pytest.importorskip("gpytorch")
    ds = gs.data.load("iris", seed=0, dtype=DT)
    alpha = 0.01
    gp = GPClassifier("moment-ori", alpha)
    gp.fit(ds.x_train, ds.y_train, 3)
    # the benchmark's gpytorch model (benchmarks/gp_classification.py) is the reference
    gpytorch_dirichlet_gp = runpy.run_path(str(BENCHMARK))["gpytorch_dirichlet_gp"]
    model, likelihood = gpytorch_dirichlet_gp(gpytorch, ds.x_train, ds.y_train, gp)
    assert torch.allclose(likelihood.transformed_targets, gp._targets, atol=1e-12)
    assert torch.allclose(likelihood.noise, gp._noise, atol=1e-12)
    model.train()
    likelihood.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    with gpytorch.settings.max_cholesky_size(10**6):
        theirs = mll(model(ds.x_train), likelihood.transformed_targets) * ds.x_train.shape[0]
    ours = gp.log_marginal_likelihood(per_class=True)
    assert torch.allclose(ours, theirs.detach(), rtol=1e-5, atol=1e-5)
    model.eval()
    likelihood.eval()
    with torch.no_grad(), gpytorch.settings.max_cholesky_size(10**6):
        post = model(ds.x_test)
    mu, var = gp.predict_latent(ds.x_test)
    assert torch.allclose(mu, post.mean.T, atol=1e-5)
    assert torch.allclose(var, post.variance.T, atol=1e-5)


@pytest.mark.parametrize("basis", ["log", "logit"])
@pytest.mark.parametrize("link", ["mc", "probit", "bridge", "mean"])
def test_predictive_probabilities_sum_to_one(basis: str, link: str) -> None:
    classes = 3 if basis == "log" else 2
    x, y = _toy(classes=classes)
    gp = GPClassifier("variational", 0.1, basis=basis)
    gp.fit(x, y, classes, max_iter=10)
    x_test = torch.randn(11, 2, generator=torch.Generator().manual_seed(3), dtype=DT) * 3
    if link == "bridge" and basis == "logit":
        with pytest.raises(ValueError, match="link"):
            gp.predict(x_test, link=link)
        return
    pred = gp.predict(
        x_test, link=link, num_samples=300, generator=torch.Generator().manual_seed(0)
    )
    assert pred.probs.shape == (11, classes)
    assert torch.allclose(pred.probs.sum(-1), torch.ones(11, dtype=DT), atol=1e-12)
    assert (pred.probs >= 0).all()
    mu, var = gp.predict_latent(x_test)
    assert torch.equal(pred.f_mean, mu) and torch.equal(pred.f_var, var)
    if link == "mean":
        expected = torch.softmax(mu, -1) if basis == "log" else torch.sigmoid(mu)
        assert torch.allclose(pred.probs[:, -1], expected[:, -1])


def test_mc_predictive_matches_quadrature_and_is_seeded() -> None:
    x, y = _toy(classes=2)
    gp = GPClassifier("moment", 0.1, basis="logit")
    gp.fit(x, y, max_iter=10)
    x_test = torch.randn(5, 2, generator=torch.Generator().manual_seed(3), dtype=DT) * 2
    mu, var = gp.predict_latent(x_test)
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)
    f = mu + var.sqrt() * torch.as_tensor(nodes, dtype=DT)  # (5, 80)
    exact = (torch.sigmoid(f) * torch.as_tensor(weights, dtype=DT)).sum(-1) / math.sqrt(2 * math.pi)
    probs = gp.predict_proba(x_test, num_samples=40_000, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(probs[:, 1], exact, atol=5e-3)
    again = gp.predict_proba(x_test, num_samples=40_000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(probs, again)


def test_rbf_kernel_matches_pairwise_differences() -> None:
    x1 = torch.randn(6, 3, dtype=DT)
    x2 = torch.randn(4, 3, dtype=DT)
    ls = torch.tensor([[0.5, 1.0, 2.0], [1.5, 1.5, 1.5]], dtype=DT)
    var = torch.tensor([2.0, 0.3], dtype=DT)
    k = rbf_kernel(x1, x2, ls, var)
    for h in range(2):
        assert torch.allclose(k[h], _reference_kernel(x1, x2, ls[h], float(var[h])), atol=1e-14)


def test_cholesky_jitter_is_reported_and_impossible_cases_raise() -> None:
    kernel = torch.ones(1, 50, 50, dtype=DT) * 1e8  # rank one: needs more than the noise
    noise = torch.full((1, 50), 1e-12, dtype=DT)
    with pytest.warns(RuntimeWarning, match="jitter"):
        chol = heteroscedastic_cholesky(kernel, noise)
    assert torch.isfinite(chol).all()
    bad = -torch.eye(4, dtype=DT)[None]
    with pytest.raises(ValueError, match="not positive definite"):
        heteroscedastic_cholesky(bad, torch.full((1, 4), 1e-3, dtype=DT))


def test_pseudo_targets_are_the_dirichlet_gaussian_ones() -> None:
    x, y = _toy()
    gp = GPClassifier("laplace", 0.2).set_data(x, y, 3)
    mean, var = DirichletGaussian("laplace", alpha_eps=0.2).pseudo_targets(y, 3, dtype=DT)
    assert torch.equal(gp._targets, mean.T) and torch.equal(gp._noise, var.T)


def test_bad_input_errors() -> None:
    x, y = _toy()
    with pytest.raises(ValueError, match="method"):
        GPClassifier("probit")
    for alpha in (0.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="alpha_eps: must be positive"):
            GPClassifier("moment", alpha)
    with pytest.raises(ValueError, match="beta_eps"):
        GPClassifier("moment", 0.1, basis="logit", beta_eps=0.0)
    with pytest.raises(ValueError, match="basis: method 'moment-ori' supports"):
        GPClassifier("moment-ori", basis="logit")
    with pytest.raises(ValueError, match=r"y: labels must be in \[0, 2\)"):
        GPClassifier("moment", 0.1, basis="logit").fit(x, y)  # labels 0, 1, 2
    with pytest.raises(ValueError, match="hyperparameters"):
        GPClassifier(hyperparameters="tied")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mean"):
        GPClassifier(mean="linear")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lengthscale"):
        GPClassifier(lengthscale=-1.0)
    with pytest.raises(ValueError, match="dtype"):
        GPClassifier(dtype=torch.int64)
    gp = GPClassifier()
    with pytest.raises(RuntimeError, match="fit"):
        gp.predict(x)
    with pytest.raises(TypeError, match="x"):
        gp.fit(x.long(), y)
    with pytest.raises(ValueError, match="x"):
        gp.fit(x[:, 0], y)
    with pytest.raises(TypeError, match="y"):
        gp.fit(x, y.double())
    with pytest.raises(ValueError, match="y"):
        gp.fit(x, y[:-1])
    with pytest.raises(ValueError, match="y: labels"):
        gp.fit(x, y, num_classes=2)
    with pytest.raises(ValueError, match="num_classes"):
        gp.fit(x, y, num_classes=1)
    with pytest.raises(ValueError, match="max_iter"):
        gp.fit(x, y, 3, max_iter=0)
    gp.fit(x, y, 3, max_iter=2)
    with pytest.raises(ValueError, match="x: expected 2 features"):
        gp.predict(torch.randn(3, 5, dtype=DT))
    with pytest.raises(ValueError, match="link"):
        gp.predict(x, link="sigmoid")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_samples"):
        gp.predict(x, num_samples=0)
    with pytest.raises(ValueError, match="NaN"):
        gp.predict(torch.full((2, 2), float("nan"), dtype=DT))


# ------------------------------------------------- flat (collapsed) fits, issue 19


def _overlapping(n: int = 60, seed: int = 0) -> tuple:
    """Two Gaussian classes in 2-D whose means are 2 apart along the first axis."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    x = torch.randn(n, 2, generator=g, dtype=DT)
    x[:, 0] += 2.0 * y - 1.0
    return x, y


@pytest.mark.parametrize("alpha", [0.01, 0.05, 0.2, 1.0])
def test_moment_pseudo_targets_put_off_class_deviations_inside_the_noise(alpha: float) -> None:
    """Closed form behind flat ``moment`` fits: with Gamma(alpha) and Gamma(alpha + 1) in the
    log basis, ``mean_on - mean_off = digamma(alpha + 1) - digamma(alpha) = 1 / alpha`` and
    ``var_off = trigamma(alpha) = 1 / alpha^2 + trigamma(alpha + 1)``, so an off-class target is
    within one noise standard deviation of the on-class value: (1/alpha)^2 < var_off."""
    lik = DirichletGaussian("moment", alpha_eps=alpha)
    mean, var = lik.pseudo_targets(torch.tensor([0]), 2, dtype=DT)
    on_m, off_m, on_v, off_v = (
        float(mean[0, 0]),
        float(mean[0, 1]),
        float(var[0, 0]),
        float(var[0, 1]),
    )
    assert on_m - off_m == pytest.approx(1.0 / alpha, rel=1e-12)
    assert off_v == pytest.approx(1.0 / alpha**2 + on_v, rel=1e-9)  # polygamma round-off
    assert off_m == pytest.approx(
        float(torch.special.digamma(torch.tensor(alpha, dtype=DT))), rel=1e-12
    )
    assert on_v == pytest.approx(
        float(torch.special.polygamma(1, torch.tensor(alpha + 1, dtype=DT))), rel=1e-12
    )
    assert (on_m - off_m) ** 2 < off_v


def test_flat_fit_is_detected_warned_and_is_the_evidence_maximum() -> None:
    """``moment`` at alpha_eps = 0.05 on overlapping classes: L-BFGS drives the signal variance
    to ~0 (the fit is flagged in ``result.flat`` with a CollapsedSignalWarning naming the
    method and alpha_eps), the latent mean is the profiled constant at every test point, and
    no point of a (log lengthscale, log variance) grid has a higher evidence, so the constant is
    the maximum and not a stuck optimiser. ``moment-ori`` and ``moment`` at 0.5 are not flat."""
    x, y = _overlapping()
    gp = GPClassifier("moment", 0.05)
    with pytest.warns(gs.warnings.CollapsedSignalWarning, match=r"'moment' at alpha_eps=0.05"):
        result = gp.fit(x, y, 2)
    assert result.flat == [0, 1] == gp.flat_functions()
    assert bool((gp.variance < 1e-6 * gp._targets.var(-1)).all())
    mu, _ = gp.predict_latent(x[:10] + 0.3)
    assert torch.allclose(mu, gp.mean.expand(10, 2), atol=1e-6)
    best = gp.log_marginal_likelihood()
    with torch.no_grad():
        for log_ls in (-1.0, 0.0, 1.0, 2.0):
            for log_var in (-4.0, -1.0, 1.0, 3.0, 5.0):
                value = gp.log_marginal_likelihood(
                    torch.full((2, 1), log_ls, dtype=DT), torch.full((2,), log_var, dtype=DT)
                )
                assert float(value) < float(best)
    for method, alpha in (("moment-ori", 0.05), ("moment", 0.5), ("variational", 0.05)):
        other = GPClassifier(method, alpha)
        with warnings.catch_warnings():
            warnings.simplefilter("error", gs.warnings.CollapsedSignalWarning)
            assert other.fit(x, y, 2).flat == []


@pytest.mark.slow  # 250 Adam steps of two gpytorch models (~5 s alone, more when shared)
def test_gpytorch_training_finds_no_better_evidence_than_ours() -> None:
    """External reference: gpytorch's exact GP (fixed-noise Gaussian likelihood on the same
    pseudo-targets, batch of one GP per class, constant mean, scaled RBF) trained by Adam from
    a non-flat start (outputscale 10) ends at an evidence no higher than our L-BFGS fit, both
    for the flat ``moment`` fit (alpha_eps = 0.05: the constant is the maximum) and for
    ``moment-ori`` (which gpytorch's DirichletClassificationLikelihood implements), where it
    comes within 1 nat of ours."""
    gpytorch = pytest.importorskip("gpytorch")
    x, y = _overlapping()
    for method in ("moment", "moment-ori"):
        gp = GPClassifier(method, 0.05)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", gs.warnings.CollapsedSignalWarning)
            gp.fit(x, y, 2)
        targets, noise = gp._targets, gp._noise
        likelihood = gpytorch.likelihoods.FixedNoiseGaussianLikelihood(
            noise=noise, learn_additional_noise=False
        ).to(DT)
        batch = torch.Size((2,))

        class Model(gpytorch.models.ExactGP):
            def __init__(self, targets, likelihood, batch) -> None:
                super().__init__(x, targets, likelihood)
                self.mean_module = gpytorch.means.ConstantMean(batch_shape=batch)
                self.covar_module = gpytorch.kernels.ScaleKernel(
                    gpytorch.kernels.RBFKernel(batch_shape=batch), batch_shape=batch
                )

            def forward(self, inputs):
                return gpytorch.distributions.MultivariateNormal(
                    self.mean_module(inputs), self.covar_module(inputs)
                )

        model = Model(targets, likelihood, batch).to(DT)
        model.mean_module.constant.data = targets.mean(-1)
        model.covar_module.outputscale = torch.full((2,), 10.0, dtype=DT)
        model.train()
        likelihood.train()
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        with gpytorch.settings.max_cholesky_size(10**6):
            for _ in range(250):
                opt.zero_grad()
                loss = -mll(model(x), targets).sum()
                loss.backward()
                opt.step()
            with torch.no_grad():
                theirs = float(mll(model(x), targets).sum()) * x.shape[0]
        ours = float(gp.log_marginal_likelihood())
        assert theirs <= ours + 1e-6
        if method == "moment-ori":
            assert theirs > ours - 1.0
