"""VBLL heads (Harrison, Willes & Snoek 2024) against closed forms, Monte Carlo and torch.

The oracles: the regression ELBO is tight at the exact Bayesian linear regression posterior
(Theorem 1, App. A); the classification bounds (eq. 13, 14) lie below the exact expected
log-likelihood; the KL terms and covariance parameterizations agree with dense torch
references; the generative predictive is Bayes' rule with the class-conditional Gaussians.
"""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

from gaussify import last_layer
from gaussify.last_layer import covariance as cv
from gaussify.last_layer import parameterization as pz
from gaussify.last_layer.noise import inverse_wishart_log_prior

PARAMS = ["dense", "diagonal", "lowrank", "dense_precision"]
DT = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # the tensors here are tiny: thread start-up costs more than it saves (and a loaded CI
    # machine makes it much worse); restored afterwards
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@torch.no_grad()
def _randomize(module: nn.Module, seed: int, scale: float = 0.4) -> nn.Module:
    """Random values for every parameter: a generic, non-trivial variational posterior."""
    g = _gen(seed)
    for p in module.parameters():
        p.copy_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


def _covariance(param: str, blocks: int, dim: int, seed: int) -> cv.StructuredCovariance:
    mod = pz.make_covariance(param, blocks, dim, init_var=0.5, rank=2).double()
    return _randomize(mod, seed)()


def _mc_se(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Monte Carlo mean and its standard error over dim 0."""
    return x.mean(0), x.std(0) / math.sqrt(x.shape[0])


# --------------------------------------------------------------------------------------------
# covariance parameterizations (App. D)


@pytest.mark.parametrize("param", PARAMS)
def test_structured_covariance_matches_dense_reference(param: str) -> None:
    k, d = 3, 5
    cov = _covariance(param, k, d, seed=1)
    dense = cov.covariance
    assert dense.shape == (k, d, d)
    torch.testing.assert_close(dense, dense.mT)
    assert (torch.linalg.eigvalsh(dense) > 0).all()
    g = _gen(2)
    phi = torch.randn(4, 6, d, generator=g, dtype=DT)
    x = torch.randn(4, k, d, generator=g, dtype=DT)
    torch.testing.assert_close(
        cov.quad_form(phi), torch.einsum("abi,kij,abj->abk", phi, dense, phi)
    )
    ref_inv = torch.einsum("aki,aki->ak", x, torch.linalg.solve(dense, x.unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(cov.inv_quad(x), ref_inv)
    torch.testing.assert_close(cov.logdet, torch.logdet(dense))
    torch.testing.assert_close(cov.trace, dense.diagonal(dim1=-2, dim2=-1).sum(-1))
    torch.testing.assert_close(cov.diagonal, dense.diagonal(dim1=-2, dim2=-1))
    torch.testing.assert_close(cov.scale_tril @ cov.scale_tril.mT, dense)
    # structured sums with one shared noise block, as in Sigma + S_k (G-VBLL)
    for noise in (
        cv.Diagonal(torch.rand(1, d, generator=g, dtype=DT) + 0.1),
        _covariance("dense_precision", 1, d, 3),
    ):
        total = cov.add(noise)
        torch.testing.assert_close(total.covariance, dense + noise.covariance)
        torch.testing.assert_close(total.logdet, torch.logdet(dense + noise.covariance))
    # reparameterised samples have covariance S
    s = cov.rsample((100_000,), generator=_gen(4))
    emp = torch.einsum("ski,skj->kij", s, s) / s.shape[0]
    torch.testing.assert_close(emp, dense, atol=0.05 * dense.abs().max().item(), rtol=0)


@pytest.mark.parametrize("param", PARAMS)
def test_set_covariance_round_trips_where_representable(param: str) -> None:
    d = 4
    mod = pz.make_covariance(param, 2, d, init_var=1.0, rank=2).double()
    g = _gen(5)
    u = torch.randn(2, d, 2, generator=g, dtype=DT)
    target = u @ u.mT + 0.3 * torch.eye(d, dtype=DT)  # low rank plus isotropic: all can hold it
    if param == "diagonal":
        target = torch.diag_embed(target.diagonal(dim1=-2, dim2=-1))
    mod.set_covariance(target)
    torch.testing.assert_close(mod().covariance, target)


def test_dense_quad_form_is_quadratic_not_cubic() -> None:
    # phi^T S phi = ||L^T phi||^2 needs no factorisation (App. D.1): no linalg call at all
    cov = _covariance("dense", 2, 6, 0)
    phi = torch.randn(3, 6, dtype=DT)
    with torch.autograd.profiler.profile() as prof:
        cov.quad_form(phi)
        cov.trace  # noqa: B018
        cov.logdet  # noqa: B018
    names = {e.name for e in prof.function_events}
    assert not any("linalg" in n or "cholesky" in n or "triangular" in n for n in names), names


@pytest.mark.parametrize("param", PARAMS)
@pytest.mark.parametrize("shared", [True, False])
def test_gaussian_kl_equals_torch_kl_divergence(param: str, shared: bool) -> None:
    rows, d, s0 = 3, 4, 0.7
    cov = _covariance(param, 1 if shared else rows, d, seed=6)
    mean = torch.randn(rows, d, generator=_gen(7), dtype=DT)
    q = torch.distributions.MultivariateNormal(
        mean, covariance_matrix=cov.covariance.expand(rows, d, d)
    )
    p = torch.distributions.MultivariateNormal(
        torch.zeros(rows, d, dtype=DT), s0 * torch.eye(d, dtype=DT)
    )
    ref = torch.distributions.kl_divergence(q, p).sum()
    torch.testing.assert_close(cv.gaussian_kl(mean, cov, s0), ref)
    torch.testing.assert_close(cv.GaussianRows(mean, cov).kl(s0), ref)
    # Normal-Gamma form: covariances S / tau against s0 / tau, KL linear in tau
    tau = torch.rand(rows, generator=_gen(8), dtype=DT) + 0.5
    qt = torch.distributions.MultivariateNormal(
        mean, covariance_matrix=cov.covariance.expand(rows, d, d) / tau[:, None, None]
    )
    pt = torch.distributions.MultivariateNormal(
        torch.zeros(rows, d, dtype=DT), s0 * torch.eye(d, dtype=DT) / tau[:, None, None]
    )
    ref_t = torch.distributions.kl_divergence(qt, pt).sum()
    torch.testing.assert_close(cv.gaussian_kl(mean, cov, s0, mean_weight=tau), ref_t)


@pytest.mark.parametrize("param", PARAMS)
def test_head_kl_terms_equal_torch(param: str) -> None:
    d, s0 = 4, 0.5
    heads = [
        last_layer.VBLLRegression(d, 2, 0.1, param, prior_scale=s0, cov_rank=2),
        last_layer.VBLLDiscriminative(d, 3, 0.1, param, prior_scale=s0, cov_rank=2),
        last_layer.VBLLGenerative(d, 3, 0.1, param, prior_scale=s0, cov_rank=2),
    ]
    for i, head in enumerate(heads):
        _randomize(head.double(), seed=10 + i)
        w = head.W()
        q = torch.distributions.MultivariateNormal(w.mean, covariance_matrix=w.covariance)
        p = torch.distributions.MultivariateNormal(
            torch.zeros_like(w.mean), s0 * torch.eye(d, dtype=DT)
        )
        torch.testing.assert_close(head.kl(), torch.distributions.kl_divergence(q, p).sum())


def test_inverse_wishart_prior_matches_scipy_up_to_a_constant() -> None:
    c, nu, m = 3, 5.0, 0.7
    noise = last_layer.NoiseCovariance(c, "dense").double()
    values = []
    for seed in (0, 1):
        a = torch.randn(c, c, generator=_gen(seed), dtype=DT)
        sigma = a @ a.T + 0.5 * torch.eye(c, dtype=DT)
        noise.set_covariance(sigma)
        torch.testing.assert_close(noise.covariance, sigma)
        ours = noise.log_prior(nu, m).item()
        ref = stats.invwishart(df=nu, scale=m * np.eye(c)).logpdf(sigma.numpy())
        values.append(ours - ref)
    assert values[0] == pytest.approx(values[1], abs=1e-9)
    # the diagonal form is the same density on diagonal matrices
    lp = inverse_wishart_log_prior(torch.tensor(2.0), torch.tensor(3.0), 2, 1.0, 1.0)
    assert lp.item() == pytest.approx(0.5 * 4.0 * 2.0 - 0.5 * 3.0)


# --------------------------------------------------------------------------------------------
# regression: the Bayesian linear regression oracle (Theorem 1, App. A)


def _blr_problem(t: int = 20, d: int = 4, c: int = 2, sig2: float = 0.5, s0: float = 0.7):
    g = _gen(11)
    phi = torch.randn(t, d, generator=g, dtype=DT)
    y = phi @ torch.randn(d, c, generator=g, dtype=DT) + 0.5 * torch.randn(
        t, c, generator=g, dtype=DT
    )
    precision = torch.eye(d, dtype=DT) / s0 + phi.T @ phi / sig2
    s_post = torch.linalg.inv(precision)
    w_post = (s_post @ phi.T @ y / sig2).T
    marginal = sig2 * torch.eye(t, dtype=DT) + s0 * phi @ phi.T
    log_evidence = sum(
        stats.multivariate_normal(np.zeros(t), marginal.numpy()).logpdf(y[:, i].numpy())
        for i in range(c)
    )
    return phi, y, sig2, s0, w_post, s_post, precision, float(log_evidence)


def _regression_head(param: str, d: int, c: int, t: int, sig2: float, s0: float):
    head = last_layer.VBLLRegression(d, c, 1.0 / t, param, prior_scale=s0, cov_rank=d).double()
    head.noise_cov.set_covariance(sig2 * torch.eye(c, dtype=DT))
    head.noise_cov.requires_grad_(False)  # fixed noise
    return head


def _elbo(head: last_layer.VBLLRegression, phi: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    terms = head(phi).elbo_terms(y)
    return terms["bound"].sum() - terms["kl"]


def _optimize(head: nn.Module, phi: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Full-batch L-BFGS on the training loss to convergence (float64)."""
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.LBFGS(
        params,
        max_iter=1000,
        tolerance_grad=1e-11,
        tolerance_change=0.0,
        history_size=20,
        line_search_fn="strong_wolfe",
    )
    history: list[float] = []

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = head(phi).train_loss(y)
        loss.backward()
        history.append(loss.item())
        return loss

    opt.step(closure)
    return history


def _kl_to_posterior(head, w_post, s_post) -> float:
    w = head.W()
    q = torch.distributions.MultivariateNormal(w.mean, covariance_matrix=w.covariance)
    p = torch.distributions.MultivariateNormal(
        w_post, covariance_matrix=s_post.expand_as(w.covariance)
    )
    return torch.distributions.kl_divergence(q, p).sum().item()


@pytest.mark.parametrize("param", PARAMS)
def test_regression_elbo_is_log_evidence_minus_kl_gap(param: str) -> None:
    phi, y, sig2, s0, w_post, s_post, _, log_z = _blr_problem()
    t, d = phi.shape
    head = _randomize(_regression_head(param, d, y.shape[1], t, sig2, s0), seed=12)
    with torch.no_grad():
        head.noise_cov.set_covariance(sig2 * torch.eye(y.shape[1], dtype=DT))
        elbo = _elbo(head, phi, y).item()
    assert elbo == pytest.approx(log_z - _kl_to_posterior(head, w_post, s_post), abs=1e-8)
    # the training loss is the negative ELBO per example plus the (fixed) noise prior term
    loss = head(phi).train_loss(y).item()
    assert loss == pytest.approx(-(elbo + head.log_prior().item()) / t, abs=1e-10)
    # regularization_weight scales the KL and noise-prior terms (tempering, Table 6)
    terms = head(phi).elbo_terms(y)
    for weight in (0.0, 0.1 / t, 10.0 / t):
        head.regularization_weight = weight
        reg = terms["log_prior"] - terms["kl"]
        expected = -(terms["bound"].mean() + weight * reg).item()
        assert head(phi).train_loss(y).item() == pytest.approx(expected, abs=1e-10)


@pytest.mark.parametrize(("param", "c"), [("dense", 2), ("dense_precision", 1), ("lowrank", 2)])
def test_regression_optimum_is_the_exact_blr_posterior(param: str, c: int) -> None:
    phi, y, sig2, s0, w_post, s_post, _, log_z = _blr_problem(c=c)
    t, d = phi.shape
    torch.manual_seed(0)
    head = _regression_head(param, d, c, t, sig2, s0)
    history = _optimize(head, phi, y)
    assert history[-1] <= history[0]
    w = head.W()
    torch.testing.assert_close(w.mean, w_post, atol=1e-4, rtol=0)
    torch.testing.assert_close(w.covariance[0], s_post, atol=1e-4, rtol=0)
    with torch.no_grad():
        assert _elbo(head, phi, y).item() == pytest.approx(log_z, abs=1e-7)  # KL gap closed
    assert _kl_to_posterior(head, w_post, s_post) < 1e-7


def test_regression_diagonal_optimum_is_the_mean_field_solution() -> None:
    # for a Gaussian posterior, the best diagonal Gaussian has the exact mean and precision
    # equal to the diagonal of the posterior precision
    phi, y, sig2, s0, w_post, _, precision, _ = _blr_problem(c=1)
    t, d = phi.shape
    head = _regression_head("diagonal", d, 1, t, sig2, s0)
    _optimize(head, phi, y)
    torch.testing.assert_close(head.W().mean, w_post, atol=1e-4, rtol=0)
    torch.testing.assert_close(
        head.W().cov.diagonal[0], 1 / precision.diagonal(), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("param", PARAMS)
def test_multivariate_regression_bound_equals_monte_carlo(param: str) -> None:
    # eq. (16) is exact (Corollary 6), with a full noise covariance
    d, c, n = 3, 2, 4
    head = _randomize(last_layer.VBLLRegression(d, c, 0.1, param, cov_rank=2).double(), 13)
    g = _gen(14)
    phi = torch.randn(n, d, generator=g, dtype=DT)
    y = torch.randn(n, c, generator=g, dtype=DT)
    bound = head(phi).elbo_terms(y)["bound"]
    w = head.W().rsample((100_000,), generator=g)  # (S, C, D)
    mean = torch.einsum("scd,nd->snc", w, phi)
    sigma = head.noise_cov.covariance.detach()
    mc = torch.distributions.MultivariateNormal(mean, covariance_matrix=sigma).log_prob(y)
    est, se = _mc_se(mc.detach())
    assert (bound.detach() - est).abs().max() < 4 * se.max() + 1e-6


def test_regression_predictive_is_eq_17() -> None:
    d, c = 3, 2
    head = _randomize(last_layer.VBLLRegression(d, c, 0.1).double(), 15)
    phi = torch.randn(5, d, generator=_gen(16), dtype=DT)
    y = torch.randn(5, c, generator=_gen(17), dtype=DT)
    out = head(phi)
    pred = out.predictive
    s = head.W().cov.covariance[0]
    quad = torch.einsum("ni,ij,nj->n", phi, s, phi)
    sigma = head.noise_cov.covariance
    cov = quad[:, None, None] * torch.eye(c, dtype=DT) + sigma
    torch.testing.assert_close(pred.mean, phi @ head.W_mean.T)
    torch.testing.assert_close(pred.cov, cov)
    torch.testing.assert_close(pred.var, cov.diagonal(dim1=-2, dim2=-1))
    ref = [
        stats.multivariate_normal(pred.mean[i].detach().numpy(), cov[i].detach().numpy()).logpdf(
            y[i].numpy()
        )
        for i in range(5)
    ]
    torch.testing.assert_close(out.log_prob(y).detach(), torch.tensor(ref, dtype=DT))
    assert out.val_loss(y).item() == pytest.approx(-np.mean(ref))


# --------------------------------------------------------------------------------------------
# classification bounds (Theorems 2 and 3) against Monte Carlo


@pytest.mark.parametrize("param", PARAMS)
def test_discriminative_bound_is_below_expected_loglik(param: str) -> None:
    d, k, n = 3, 4, 6
    head = _randomize(last_layer.VBLLDiscriminative(d, k, 0.1, param, cov_rank=2).double(), 20, 0.6)
    g = _gen(21)
    phi = 1.5 * torch.randn(n, d, generator=g, dtype=DT)
    y = torch.randint(0, k, (n,), generator=g)
    bound = head(phi).elbo_terms(y)["bound"].detach()
    with torch.no_grad():
        w = head.W().rsample((100_000,), generator=g)  # (S, K, D)
        eps = head.noise_cov.variance.sqrt() * torch.randn(100_000, n, k, generator=g, dtype=DT)
        logits = torch.einsum("skd,nd->snk", w, phi) + eps
        mc = logits.log_softmax(-1).gather(-1, y.expand(100_000, n).unsqueeze(-1)).squeeze(-1)
    est, se = _mc_se(mc)
    assert (bound <= est + 4 * se).all(), (bound, est)
    assert (est - bound).max() > 1e-3  # the bound is not tight (Sec. 3.2)


@pytest.mark.parametrize("param", PARAMS)
@pytest.mark.parametrize("noise", ["diagonal", "dense"])
def test_generative_bound_is_below_expected_loglik(param: str, noise: str) -> None:
    # the class probabilities enter through their Dirichlet predictive (eq. 55); the class
    # means are sampled from q
    d, k, n = 3, 3, 6
    head = last_layer.VBLLGenerative(d, k, 0.1, param, cov_rank=2, noise_parameterization=noise)
    _randomize(head.double(), 22, 0.5)
    g = _gen(23)
    y = torch.randint(0, k, (n,), generator=g)
    head.set_class_counts(torch.tensor([0, 0, 1, 2, 2, 2, 2]))
    phi = head.mu_mean.detach()[y] + torch.randn(n, d, generator=g, dtype=DT)
    bound = head(phi).elbo_terms(y)["bound"].detach()
    with torch.no_grad():
        mu = head.mu().rsample((100_000,), generator=g)  # (S, K, D)
        sigma = head.noise_cov.covariance
        log_lik = torch.distributions.MultivariateNormal(
            mu.unsqueeze(1), covariance_matrix=sigma
        ).log_prob(phi.unsqueeze(1))
        joint = log_lik + head.log_class_prior()
        mc = joint.log_softmax(-1).gather(-1, y.expand(100_000, n).unsqueeze(-1)).squeeze(-1)
    est, se = _mc_se(mc)
    assert (bound <= est + 4 * se).all(), (bound, est)


@pytest.mark.parametrize("param", PARAMS)
def test_generative_predictive_is_bayes_rule(param: str) -> None:
    d, k = 3, 3
    head = _randomize(
        last_layer.VBLLGenerative(
            d, k, 0.1, param, cov_rank=2, noise_parameterization="dense"
        ).double(),
        24,
    )
    y_train = torch.tensor([0, 1, 1, 2, 2, 2, 2])
    head.set_class_counts(y_train)
    torch.testing.assert_close(head.class_counts, torch.tensor([1.0, 2.0, 4.0], dtype=DT))
    phi = torch.randn(5, d, generator=_gen(25), dtype=DT)
    with torch.no_grad():
        pred = head(phi).predictive
        mu, s, sigma = head.mu_mean, head.mu().covariance, head.noise_cov.covariance
        alpha = np.array([2.0, 3.0, 5.0])
        log_joint = np.stack(
            [
                stats.multivariate_normal(mu[j].numpy(), (s[j] + sigma).numpy()).logpdf(phi.numpy())
                + np.log(alpha[j] / alpha.sum())
                for j in range(k)
            ],
            axis=-1,
        )
    ref = np.exp(log_joint - log_joint.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    torch.testing.assert_close(pred.probs, torch.tensor(ref, dtype=DT))
    from scipy.special import logsumexp

    torch.testing.assert_close(
        head.feature_log_density(phi).detach(), torch.tensor(logsumexp(log_joint, -1), dtype=DT)
    )


def test_discriminative_predictive_is_the_expected_softmax() -> None:
    head = _randomize(last_layer.VBLLDiscriminative(4, 3, 0.1, num_samples=50_000).double(), 26)
    phi = torch.randn(6, 4, generator=_gen(27), dtype=DT)
    torch.manual_seed(0)
    with torch.no_grad():
        mc = head(phi).predictive.probs
        # reference: sample the weights and the noise themselves
        g = _gen(28)
        w = head.W().rsample((50_000,), generator=g)
        eps = head.noise_cov.variance.sqrt() * torch.randn(50_000, 6, 3, generator=g, dtype=DT)
        ref = (torch.einsum("skd,nd->snk", w, phi) + eps).softmax(-1).mean(0)
        head.link = "probit"
        probit = head(phi).predictive.probs
    torch.testing.assert_close(mc, ref, atol=0.01, rtol=0)
    torch.testing.assert_close(mc.sum(-1), torch.ones(6, dtype=DT))
    # MacKay's probit is an approximation, a few hundredths off
    torch.testing.assert_close(probit, ref, atol=0.06, rtol=0)


# --------------------------------------------------------------------------------------------
# usage: the two-line swap, dtype, serialisation


def test_two_line_swap_trains_a_classifier() -> None:
    torch.manual_seed(0)
    g = _gen(30)
    x = torch.randn(200, 2, generator=g)
    y = (x[:, 0] * x[:, 1] > 0).long()  # XOR: needs the hidden layer
    model = nn.Sequential(
        nn.Linear(2, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        last_layer.VBLLDiscriminative(32, 2, 1.0 / len(x)),  # was: nn.Linear(32, 2)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(200):
        opt.zero_grad()
        loss = model(x).train_loss(y)  # was: F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    probs = model(x).predictive.probs
    assert (probs.argmax(-1) == y).float().mean() > 0.9


@pytest.mark.parametrize(
    "make",
    [
        lambda: last_layer.VBLLRegression(3, 2, 0.1, "lowrank", cov_rank=2),
        lambda: last_layer.VBLLDiscriminative(3, 4, 0.1, "dense_precision"),
        lambda: last_layer.VBLLGenerative(3, 4, 0.1, "dense"),
    ],
)
def test_state_dict_round_trip_and_float64(make) -> None:
    head = _randomize(make().double(), 31)
    if isinstance(head, last_layer.VBLLGenerative):
        head.set_class_counts(torch.tensor([0, 1, 1, 3]))
    buf = io.BytesIO()
    torch.save(head.state_dict(), buf)
    buf.seek(0)
    other = make().double()
    other.load_state_dict(torch.load(buf, weights_only=True))
    phi = torch.randn(5, 3, dtype=DT)
    a, b = head(phi).to_predictive(), other(phi).to_predictive()
    assert a.f_mean.dtype == DT
    torch.testing.assert_close(a.f_mean, b.f_mean)
    if isinstance(head, last_layer.VBLLGenerative):  # deterministic probabilities
        torch.testing.assert_close(a.probs, b.probs)
        torch.testing.assert_close(other.class_counts, head.class_counts)


# --------------------------------------------------------------------------------------------
# bad input


def test_bad_input_gives_clear_errors() -> None:
    reg = last_layer.VBLLRegression(3, 2, 0.1)
    disc = last_layer.VBLLDiscriminative(3, 4, 0.1)
    gen = last_layer.VBLLGenerative(3, 4, 0.1)
    with pytest.raises(ValueError, match=r"phi: expected features of shape \(N, 3\)"):
        reg(torch.randn(5, 4))
    with pytest.raises(ValueError, match="phi"):
        disc(torch.randn(3))
    for kwargs, name in [
        ({"prior_scale": 0.0}, "prior_scale"),
        ({"wishart_scale": -1.0}, "wishart_scale"),
        ({"dof": 0}, "dof"),
        ({"regularization_weight": -0.1}, "regularization_weight"),
        ({"parameterization": "full"}, "parameterization"),
        ({"parameterization": "lowrank"}, "cov_rank"),
        ({"parameterization": "lowrank", "cov_rank": 7}, "cov_rank"),
        ({"in_features": 0}, "in_features"),
    ]:
        args = {"in_features": 3, "out_features": 2, "regularization_weight": 0.1, **kwargs}
        for cls in (
            last_layer.VBLLRegression,
            last_layer.VBLLDiscriminative,
            last_layer.VBLLGenerative,
        ):
            with pytest.raises(ValueError, match=name):
                cls(**args)
    phi = torch.randn(5, 3)
    with pytest.raises(ValueError, match=r"y: labels must be in \[0, 4\), got range \[0, 4\]"):
        disc(phi).train_loss(torch.tensor([0, 1, 2, 3, 4]))
    with pytest.raises(ValueError, match=r"y: labels must be in \[0, 4\)"):
        gen(phi).train_loss(torch.tensor([0, 1, 2, 3, -1]))
    with pytest.raises(ValueError, match="y: expected integer class labels"):
        disc(phi).train_loss(torch.zeros(5))
    with pytest.raises(ValueError, match=r"y: expected shape \(5,\)"):
        disc(phi).train_loss(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"y: expected shape \(5, 2\)"):
        reg(phi).train_loss(torch.zeros(5, 3))
    with pytest.raises(ValueError, match="link"):
        last_layer.VBLLDiscriminative(3, 4, 0.1, link="logit")
    with pytest.raises(ValueError, match="noise_parameterization"):
        last_layer.VBLLRegression(3, 2, 0.1, noise_parameterization="full")


def test_vbll_package_names_are_aliases() -> None:
    assert last_layer.Regression is last_layer.VBLLRegression
    assert last_layer.GenClassification is last_layer.VBLLGenerative
    assert last_layer.tRegression is last_layer.VBLLStudentTRegression
    out = last_layer.DiscClassification(3, 2, 0.1)(torch.randn(4, 3))
    assert out.train_loss_fn(torch.tensor([0, 1, 1, 0])).ndim == 0


@pytest.mark.parametrize("param", PARAMS)
def test_classification_bounds_are_exact_without_posterior_uncertainty(param: str) -> None:
    # with S_k -> 0 (and no logit noise) Jensen's steps are equalities: the bounds are not slack
    d, k, n = 3, 4, 5
    g = _gen(40)
    phi = torch.randn(n, d, generator=g, dtype=DT)
    y = torch.randint(0, k, (n,), generator=g)
    tiny = 1e-12 * torch.eye(d, dtype=DT).expand(k, d, d)
    disc = _randomize(last_layer.VBLLDiscriminative(d, k, 0.1, param, cov_rank=2).double(), 41)
    disc.W_cov.set_covariance(tiny)
    disc.noise_cov.set_covariance(1e-12 * torch.eye(k, dtype=DT))
    exact = (phi @ disc.W_mean.T).log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(disc(phi).elbo_terms(y)["bound"], exact, atol=1e-8, rtol=0)
    gen = _randomize(last_layer.VBLLGenerative(d, k, 0.1, param, cov_rank=2).double(), 42)
    gen.mu_cov.set_covariance(tiny)
    torch.testing.assert_close(
        gen(phi).elbo_terms(y)["bound"], gen(phi).log_prob(y), atol=1e-8, rtol=0
    )
