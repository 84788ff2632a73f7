"""VaLLA: the decoupled sparse GP with the linearised network's kernel. Oracles: with Z = X
its optimum is the exact LLA posterior and its ELBO the exact log evidence of the linearised
GP; its KL is the KL of the induced weight-space Gaussians; its mean is the network output."""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch
from torch import nn
from torch.distributions import MultivariateNormal, kl_divergence

import gaussify as gs
from gaussify.curvature.jacobian import jacobians
from gaussify.function_space.valla import VaLLA, gaussian_expected_log_lik, whitened_kl

DTYPE = torch.float64
PRIOR, SIGMA = 1.0, 0.3


def _map_problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A small regression MLP at a stationary point of its log joint (L-BFGS, float64), so
    that theta* is the mode of the linearised model and the LLA mean is f(x; theta*)."""
    torch.manual_seed(0)
    n = 16
    x = torch.linspace(-2, 2, n, dtype=DTYPE).unsqueeze(-1)
    y = torch.sin(2 * x) + 0.1 * torch.randn(n, 1, dtype=DTYPE)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1)).to(DTYPE)
    params = list(model.parameters())
    opt = torch.optim.LBFGS(
        params,
        max_iter=1000,
        tolerance_grad=1e-12,
        tolerance_change=0,
        history_size=50,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        theta = torch.cat([p.reshape(-1) for p in params])
        loss = ((model(x) - y) ** 2).sum() / (2 * SIGMA**2) + 0.5 * PRIOR * theta.square().sum()
        loss.backward()
        return loss

    for _ in range(2):
        opt.step(closure)
    return model.eval(), x, y


@pytest.fixture(scope="module")
def problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    return _map_problem()


def _exact_evidence(model, x, y) -> torch.Tensor:
    """log N(y | f* - J theta*, J P0^-1 J^T + sigma^2 I): the linearised GP's evidence."""
    jac = jacobians(model, x).reshape(x.shape[0], -1)
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    with torch.no_grad():
        mean = model(x)[:, 0] - jac @ theta
    cov = jac @ jac.T / PRIOR + SIGMA**2 * torch.eye(x.shape[0], dtype=DTYPE)
    return MultivariateNormal(mean, cov).log_prob(y[:, 0])


def _valla(model, z, **kw) -> VaLLA:
    kw.setdefault("alpha", 0.0)
    kw.setdefault("learn_prior", False)
    kw.setdefault("mean_kl", True)  # the weight-space KL: the ELBO bounds the LLA evidence
    return VaLLA(
        model,
        "regression",
        num_inducing=None,
        prior_precision=PRIOR,
        sigma_noise=SIGMA,
        inducing_points=z,
        **kw,
    )


XT = torch.linspace(-3, 3, 7, dtype=DTYPE).unsqueeze(-1)


def test_optimum_with_all_training_points_is_exact_lla(problem) -> None:
    model, x, y = problem
    exact = gs.Laplace(model, "regression", "full", prior_precision=PRIOR, sigma_noise=SIGMA)
    exact_pred = exact.fit((x, y)).predict(XT)
    evidence = _exact_evidence(model, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # K_XX may need jitter (M C close to P)
        post = _valla(model, x.clone()).fit((x, y), method="closed_form")
        pred = post.predict(XT)
        objective = post.objective((x, y))
    # the mean is the network output, bit for bit
    with torch.no_grad():
        assert torch.equal(pred.f_mean, model(XT))
    torch.testing.assert_close(pred.f_var, exact_pred.f_var, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(pred.var, exact_pred.var, rtol=1e-6, atol=1e-9)
    # the ELBO touches the exact evidence at the optimum (theta* is the linearised mode)
    assert abs(float(objective - evidence)) < 1e-5
    # ... and stochastic optimisation of the same objective gets there too: natural-gradient
    # steps on q(u), full batch and minibatches of 4 (N / B = 4)
    for kw, tol in ((dict(epochs=30, batch_size=16), 1e-3), (dict(epochs=30, batch_size=8), 2e-2)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sgd = _valla(model, x.clone(), ng_lr=0.5, **kw).fit((x, y))
            sgd_pred, sgd_objective = sgd.predict(XT), sgd.objective((x, y))
        rel = ((sgd_pred.f_var - exact_pred.f_var) / exact_pred.f_var).abs().max()
        assert rel < tol, (kw, rel)
        assert -tol / 10 < float(sgd_objective - evidence) <= 1e-8
    # Adam on the Cholesky factor (the paper's optimiser) improves on the prior q(u) = p(u)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adam = _valla(model, x.clone(), optimizer="adam", lr=0.05, epochs=20, batch_size=16)
        start = adam.initialize((x, y)).objective((x, y))
        adam.fit((x, y))
        assert start < adam.objective((x, y)) <= evidence


def test_objective_is_a_lower_bound(problem) -> None:
    model, x, y = problem
    evidence = _exact_evidence(model, x, y)
    gen = torch.Generator().manual_seed(0)
    for z in (x.clone(), x[::3].clone()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            post = _valla(model, z).fit((x, y), method="closed_form")
            best = post.objective((x, y))
            assert float(best) <= float(evidence) + 1e-8
            for _ in range(3):  # any other q(u) is worse
                with torch.no_grad():
                    post.chol_raw.add_(0.1 * torch.randn(post.chol_raw.shape, generator=gen))
                assert float(post.objective((x, y))) < float(best)


def test_kl_equals_torch_distributions(problem) -> None:
    model, x, y = problem
    post = _valla(model, x[::4].clone())
    post.initialize((x, y))
    with torch.no_grad():
        post.chol_raw.copy_(0.3 * torch.randn(post.chol_raw.shape, dtype=DTYPE))
    s_u, k_zz = post.inducing_covariance, post.kernel_zz
    m = s_u.shape[0]
    zero = torch.zeros(m, dtype=DTYPE)
    expected_cov = kl_divergence(MultivariateNormal(zero, s_u), MultivariateNormal(zero, k_zz))
    torch.testing.assert_close(whitened_kl(post.chol_v), expected_cov, rtol=1e-8, atol=1e-8)
    # the full KL is the KL of the induced weight-space Gaussians N(theta*, Sigma_theta)
    jz = jacobians(model, post.inducing_points.detach()).reshape(m, -1)
    p = jz.shape[1]
    k_inv = torch.linalg.inv(k_zz)
    prior_cov = torch.eye(p, dtype=DTYPE) / PRIOR
    sigma_theta = prior_cov - prior_cov @ jz.T @ k_inv @ (k_zz - s_u) @ k_inv @ jz @ prior_cov
    sigma_theta = 0.5 * (sigma_theta + sigma_theta.T)
    expected = kl_divergence(
        MultivariateNormal(post.theta_star, sigma_theta),
        MultivariateNormal(torch.zeros(p, dtype=DTYPE), prior_cov),
    )
    torch.testing.assert_close(post.kl(), expected, rtol=1e-6, atol=1e-6)
    # pathwise weight samples have that covariance (through the linearisation)
    thetas = post.sample(4000, generator=torch.Generator().manual_seed(1))
    jt = jacobians(model, XT).reshape(XT.shape[0], -1)
    sample_var = ((thetas - post.theta_star) @ jt.T).square().mean(0)
    exact_var = post.predict(XT).f_var[:, 0]
    assert ((sample_var - exact_var).abs() <= 5 * math.sqrt(2 / 4000) * exact_var).all()


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_gaussian_expectation_closed_form(alpha: float) -> None:
    gen = torch.Generator().manual_seed(0)
    mean = torch.randn(3, 2, generator=gen, dtype=DTYPE)
    root = torch.randn(3, 2, 2, generator=gen, dtype=DTYPE)
    cov = root @ root.mT + 0.1 * torch.eye(2, dtype=DTYPE)
    y = torch.randn(3, 2, generator=gen, dtype=DTYPE)
    noise = torch.tensor([0.5, 1.5], dtype=DTYPE)
    value = gaussian_expected_log_lik(y, mean, cov, noise, alpha)
    f = MultivariateNormal(mean, cov).sample((400_000,))
    logp = (-0.5 * ((y - f).square() / noise + noise.log() + math.log(2 * math.pi))).sum(-1)
    if alpha == 0:
        mc = logp.mean(0)
    else:
        mc = (torch.logsumexp(alpha * logp, 0) - math.log(f.shape[0])) / alpha
    torch.testing.assert_close(value, mc, rtol=0, atol=2e-2)


def test_learning_prior_inducing_and_early_stopping(problem) -> None:
    model, x, y = problem
    torch.manual_seed(3)
    xv = torch.rand(8, 1, dtype=DTYPE) * 4 - 2
    # shifted validation targets: the wide prior q(u) scores best on them, so every step
    # (which shrinks the predictive variance) worsens the validation NLL
    yv = torch.sin(2 * xv) + 3.0
    common = dict(prior_precision=PRIOR, sigma_noise=SIGMA, num_inducing=4, batch_size=8)
    post = VaLLA(model, "regression", learn_inducing=True, learn_noise=True, epochs=20, **common)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        post.fit((x, y), (xv, yv), patience=2)
    assert post.prior_precision != PRIOR and post.sigma_noise != SIGMA  # Sec. 3.3: learned
    scores = post.history["val_nll"]
    assert len(scores) == 3 and scores[0] < scores[1] < scores[2]  # stopped after patience
    assert len(post.history["objective"]) == 3 * 2  # evaluated once per epoch (2 steps)
    torch.testing.assert_close(torch.tensor(post.validation_nll((xv, yv))), torch.tensor(scores[0]))
    # without early stopping the same run goes on, and the inducing inputs leave K-means
    full = VaLLA(model, "regression", learn_inducing=True, epochs=3, **common).fit((x, y))
    kmeans = VaLLA(model, "regression", **common).initialize((x, y)).inducing_points
    assert len(full.history["objective"]) == 6
    assert not torch.equal(full.inducing_points.detach(), kmeans)
    with torch.no_grad():
        assert torch.equal(full.predict(XT).f_mean, model(XT))


def test_classification_and_routes() -> None:
    torch.manual_seed(1)
    x = torch.randn(24, 2, dtype=DTYPE)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 0] > 1).long()
    model = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 3)).to(DTYPE).eval()
    prior = torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=DTYPE)  # per parameter tensor
    kw = dict(num_inducing=5, prior_precision=prior, epochs=3, batch_size=8)
    jac = VaLLA(model, "classification", **kw).fit((x, y), init="closed_form")
    ntk = VaLLA(model, "classification", kernel="ntk", **kw).fit((x, y), init="closed_form")
    a, b = jac.predict(x[:4]), ntk.predict(x[:4])
    torch.testing.assert_close(a.f_cov, b.f_cov)
    with torch.no_grad():
        assert torch.equal(a.f_mean, model(x[:4]))
    torch.testing.assert_close(a.probs.sum(-1), torch.ones(4, dtype=DTYPE))
    mc = VaLLA(model, "classification", alpha=0.0, **kw).fit((x, y))
    assert mc.expectation == "mc" and math.isfinite(float(mc.objective((x, y))))
    buf = io.BytesIO()
    torch.save(jac.state_dict(), buf)
    buf.seek(0)
    other = VaLLA(model, "classification", **kw)
    other.load_state_dict(torch.load(buf, weights_only=True))
    torch.testing.assert_close(other.predict(x[:4]).f_cov, a.f_cov)


def test_bad_input(problem) -> None:
    model, x, y = problem
    with pytest.raises(ValueError, match="num_inducing"):
        VaLLA(model, "regression", num_inducing=x.shape[0] + 1).fit((x, y))
    with pytest.raises(ValueError, match="num_inducing"):
        VaLLA(model, "regression", num_inducing=0)
    with pytest.raises(ValueError, match="val_data"):
        VaLLA(model, "regression", num_inducing=4).fit((x, y), patience=5)
    with pytest.raises(ValueError, match="alpha"):
        VaLLA(model, "regression", num_inducing=4, alpha=2.0)
    with pytest.raises(ValueError, match="expectation"):
        VaLLA(model, "regression", num_inducing=4, expectation="probit")
    with pytest.raises(ValueError, match="learn_inducing"):
        VaLLA(model, "regression", num_inducing=4, kernel="ntk", learn_inducing=True)
    with pytest.raises(RuntimeError, match="fit"):
        VaLLA(model, "regression", num_inducing=4).predict(x)


def test_hyperparameters_take_steps_of_hyper_lr(problem) -> None:
    """Adam's first step moves each coordinate by its step size (the bias-corrected m / sqrt(v)
    is the gradient's sign): log prior and log noise by ``hyper_lr``, Z by ``lr``."""
    model, x, y = problem
    post = VaLLA(
        model, "regression", num_inducing=4, prior_precision=PRIOR, sigma_noise=SIGMA,
        learn_inducing=True, learn_noise=True, lr=1e-3, hyper_lr=0.25, schedule="constant",
    )  # fmt: skip
    post.initialize((x, y))
    with torch.no_grad():  # away from q(u) = p(u), where Sigma(x, x) does not depend on Z
        post.chol_raw.copy_(0.3 * torch.randn(post.chol_raw.shape, dtype=DTYPE).tril())
    z0 = post.inducing_points.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        post.step(x, y)
    moved = (post.prior_precision.log() - math.log(PRIOR)).abs()
    torch.testing.assert_close(moved, torch.tensor(0.25, dtype=DTYPE), rtol=1e-4, atol=0)
    moved = (post.sigma_noise.log() - math.log(SIGMA)).abs()
    torch.testing.assert_close(moved, torch.tensor(0.25, dtype=DTYPE), rtol=1e-4, atol=0)
    dz = (post.inducing_points.detach() - z0).abs()  # Adam's eps shortens tiny gradients' steps
    assert float(dz.max()) == pytest.approx(1e-3, rel=1e-4) and bool((dz <= 1e-3 + 1e-12).all())
    with pytest.raises(ValueError, match="hyper_lr: must be > 0"):
        VaLLA(model, "regression", num_inducing=4, hyper_lr=0.0)


def test_default_kl_is_the_papers_kl_of_q_u(problem) -> None:
    """eq. (20) as in the paper: KL(q(u) || p(u)) only; ``mean_kl=True`` adds the anchored
    mean's 1/2 theta*^T P0 theta* (constant in q(u), it pulls a learned prior down)."""
    model, x, y = problem
    kw = dict(num_inducing=4, prior_precision=2.5, sigma_noise=SIGMA)
    paper = VaLLA(model, "regression", **kw).initialize((x, y))
    full = VaLLA(model, "regression", mean_kl=True, **kw).initialize((x, y))
    with torch.no_grad():
        paper.chol_raw.copy_(0.3 * torch.randn(paper.chol_raw.shape, dtype=DTYPE))
        full.chol_raw.copy_(paper.chol_raw)
    zero = torch.zeros(paper.kernel_zz.shape[0], dtype=DTYPE)
    expected = kl_divergence(
        MultivariateNormal(zero, paper.inducing_covariance),
        MultivariateNormal(zero, paper.kernel_zz),
    )
    torch.testing.assert_close(paper.kl(), expected, rtol=1e-8, atol=1e-8)
    mean_term = 0.5 * 2.5 * paper.theta_star.square().sum()
    torch.testing.assert_close(full.kl() - paper.kl(), mean_term, rtol=1e-10, atol=1e-10)
    b_paper, b_full = paper.batch_objective(x, y), full.batch_objective(x, y)
    torch.testing.assert_close(b_paper - b_full, mean_term, rtol=1e-10, atol=1e-10)
    with pytest.raises(TypeError, match="mean_kl: expected True or False"):
        VaLLA(model, "regression", num_inducing=4, mean_kl=1)
