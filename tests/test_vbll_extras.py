"""The other VBLL heads (Student-t, heteroscedastic), VBLL-BNN, G-VBLL-MAP and post-hoc fitting,
against numerical integration, Monte Carlo and closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats
from scipy.special import logsumexp
from torch import nn

from gaussify import last_layer, metrics

PARAMS = ["dense", "diagonal", "lowrank", "dense_precision"]
DT = torch.float64
MC = 100_000


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@torch.no_grad()
def _randomize(module: nn.Module, seed: int, scale: float = 0.4) -> nn.Module:
    g = _gen(seed)
    for p in module.parameters():
        p.copy_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


def _mc_se(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.mean(0), x.std(0) / math.sqrt(x.shape[0])


def _inputs(n: int, d: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(n, d, generator=_gen(seed), dtype=DT)


# --------------------------------------------------------------------------------------------
# Student-t regression


def test_student_t_predictive_is_the_marginal_over_the_gamma_posterior() -> None:
    head = _randomize(last_layer.VBLLStudentTRegression(3, 2, 0.1).double(), 1)
    phi = _inputs(4, 3, 2)
    y = torch.randn(4, 2, generator=_gen(3), dtype=DT)
    with torch.no_grad():
        pred = head(phi).predictive
        mean = phi @ head.W_mean.T
        quad = head.W().cov.quad_form(phi)[:, 0]
        a, b = head.noise_gamma.concentration, head.noise_gamma.rate
    assert isinstance(pred, torch.distributions.StudentT)
    for n in range(4):
        for c in range(2):
            # int N(y | mean, (phi^T S phi + 1) / tau) Gamma(tau | a, b) dtau
            v = float(quad[n]) + 1.0
            dens, _ = integrate.quad(
                lambda tau, n=n, c=c, v=v: (
                    stats.norm.pdf(float(y[n, c]), float(mean[n, c]), math.sqrt(v / tau))
                    * stats.gamma.pdf(tau, float(a[c]), scale=1 / float(b[c]))
                ),
                0,
                np.inf,
                epsabs=1e-13,
            )
            assert float(pred.log_prob(y)[n, c]) == pytest.approx(math.log(dens), abs=1e-7)
    log_prob = head(phi).log_prob(y)
    torch.testing.assert_close(log_prob, pred.log_prob(y).sum(-1))
    # the moment-matched Predictive has the Student-t's variance when it exists
    moments = head(phi).to_predictive()
    torch.testing.assert_close(moments.mean, pred.mean)
    ok = torch.isfinite(pred.variance)
    torch.testing.assert_close(moments.var[ok], pred.variance[ok])


@pytest.mark.parametrize("param", PARAMS)
def test_student_t_bound_and_kl_equal_monte_carlo(param: str) -> None:
    d, c, n, s0 = 3, 2, 4, 0.6
    head = _randomize(
        last_layer.VBLLStudentTRegression(d, c, 0.1, param, prior_scale=s0, cov_rank=2).double(),
        4,
    )
    phi, y = _inputs(n, d, 5), torch.randn(n, c, generator=_gen(6), dtype=DT)
    g = _gen(7)
    with torch.no_grad():
        bound = head(phi).elbo_terms(y)["bound"]
        tau = head.noise().sample((MC,))  # (S, C)
        w = head.W().mean + head.W().rsample((MC,), generator=g).sub(
            head.W().mean
        ) / tau.sqrt().unsqueeze(-1)
        f = torch.einsum("scd,nd->snc", w, phi)
        lp = torch.distributions.Normal(f, 1 / tau.sqrt().unsqueeze(1)).log_prob(y).sum(-1)
    est, se = _mc_se(lp)
    assert (bound - est).abs().max() < 4 * se.max()
    # KL of the Normal-Gamma pair: E_tau[KL(N(w, S/tau) || N(0, s0/tau I))] + KL(Gamma || Gamma);
    # the Gaussian KL is linear in tau, so its expectation is its value at E[tau]
    with torch.no_grad():
        a, b = head.noise_gamma.concentration, head.noise_gamma.rate
        e_tau = (a / b)[:, None, None]
        q = torch.distributions.MultivariateNormal(head.W().mean, head.W().covariance / e_tau)
        p = torch.distributions.MultivariateNormal(
            torch.zeros(c, d, dtype=DT), s0 * torch.eye(d, dtype=DT) / e_tau
        )
        prior = torch.distributions.Gamma(torch.tensor(0.5, dtype=DT), torch.tensor(0.5, dtype=DT))
        ref = torch.distributions.kl_divergence(q, p).sum()
        ref = ref + torch.distributions.kl_divergence(head.noise(), prior).sum()
        torch.testing.assert_close(head.kl(), ref)


# --------------------------------------------------------------------------------------------
# heteroscedastic regression


@pytest.mark.parametrize("param", PARAMS)
def test_heteroscedastic_bound_equals_monte_carlo(param: str) -> None:
    d, c, n = 3, 2, 4
    head = last_layer.VBLLHeteroscedasticRegression(d, c, 0.1, param, cov_rank=2).double()
    _randomize(head, 8, 0.3)
    phi, y = _inputs(n, d, 9), torch.randn(n, c, generator=_gen(10), dtype=DT)
    g = _gen(11)
    with torch.no_grad():
        bound = head(phi).elbo_terms(y)["bound"]
        w, m = head.W().rsample((MC,), generator=g), head.M().rsample((MC,), generator=g)
        f = torch.einsum("scd,nd->snc", w, phi)
        log_var = torch.einsum("scd,nd->snc", m, phi)
        lp = torch.distributions.Normal(f, (0.5 * log_var).exp()).log_prob(y).sum(-1)
    est, se = _mc_se(lp)
    assert (bound - est).abs().max() < 4 * se.max()


def test_heteroscedastic_predictive_moments_and_density() -> None:
    head = _randomize(last_layer.VBLLHeteroscedasticRegression(3, 1, 0.1).double(), 12, 0.5)
    phi, y = _inputs(3, 3, 13), torch.randn(3, 1, generator=_gen(14), dtype=DT)
    with torch.no_grad():
        out = head(phi)
        pred = out.predictive
        mean, quad = head.W().output_moments(phi)
        m, v = head.M().output_moments(phi)
        torch.testing.assert_close(pred.mean, mean)
        torch.testing.assert_close(pred.var, quad + torch.exp(m + 0.5 * v))
        log_prob = out.log_prob(y)
    for n in range(3):
        dens, _ = integrate.quad(
            lambda s, n=n: (
                stats.norm.pdf(
                    float(y[n, 0]), float(mean[n, 0]), math.sqrt(float(quad[n, 0]) + math.exp(s))
                )
                * stats.norm.pdf(s, float(m[n, 0]), math.sqrt(float(v[n, 0])))
            ),
            float(m[n, 0]) - 12 * math.sqrt(float(v[n, 0])),
            float(m[n, 0]) + 12 * math.sqrt(float(v[n, 0])),
            epsabs=1e-13,
        )
        assert float(log_prob[n]) == pytest.approx(math.log(dens), abs=1e-6)


# --------------------------------------------------------------------------------------------
# Student-t and heteroscedastic discriminative classification: the moment bound


def _logit_samples(head: nn.Module, phi: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Samples (S, N, K) of the logits from the model itself."""
    n, k = phi.shape[0], head.out_features
    w = head.W().rsample((MC,), generator=g)
    eps = torch.randn(MC, n, k, generator=g, dtype=DT)
    if isinstance(head, last_layer.VBLLStudentTDiscriminative):
        # z_k = w_bar phi + (w - w_bar) phi / sqrt(tau) + eps / sqrt(tau)
        tau = head.noise().sample((MC,)).unsqueeze(1)  # (S, 1, K)
        centred = torch.einsum("skd,nd->snk", w - head.W().mean, phi)
        return phi @ head.W().mean.T + (centred + eps) / tau.sqrt()
    m = head.M().rsample((MC,), generator=g)
    log_var = torch.einsum("skd,nd->snk", m, phi)
    return torch.einsum("skd,nd->snk", w, phi) + (0.5 * log_var).exp() * eps


@pytest.mark.parametrize("param", PARAMS)
@pytest.mark.parametrize(
    "cls", [last_layer.VBLLStudentTDiscriminative, last_layer.VBLLHeteroscedasticDiscriminative]
)
def test_moment_bound_is_below_expected_loglik(cls, param: str) -> None:
    d, k, n = 3, 4, 5
    head = _randomize(cls(d, k, 0.1, param, cov_rank=2).double(), 15, 0.5)
    phi = _inputs(n, d, 16, 1.5)
    y = torch.randint(0, k, (n,), generator=_gen(17))
    with torch.no_grad():
        logits = _logit_samples(head, phi, _gen(18))
        mc = logits.log_softmax(-1).gather(-1, y.expand(MC, n).unsqueeze(-1)).squeeze(-1)
        est, se = _mc_se(mc)
        for gamma in (-0.3, 0.0, 0.1, 0.5, 1.0):
            head.gamma.fill_(gamma)
            bound = head(phi).elbo_terms(y)["bound"]
            assert (bound <= est + 4 * se).all(), (gamma, bound, est)
        # the predictive samples the same model
        head.num_samples = MC
        torch.testing.assert_close(
            head(phi).predictive.probs, logits.softmax(-1).mean(0), atol=0.01, rtol=0
        )


HEADS = [
    (last_layer.VBLLStudentTRegression, "regression"),
    (last_layer.VBLLHeteroscedasticRegression, "regression"),
    (last_layer.VBLLStudentTDiscriminative, "classification"),
    (last_layer.VBLLHeteroscedasticDiscriminative, "classification"),
]


@pytest.mark.parametrize("param", PARAMS)
@pytest.mark.parametrize(("cls", "task"), HEADS)
def test_every_head_has_every_parameterization(cls, task: str, param: str) -> None:
    head = cls(4, 3, 0.05, param, cov_rank=2)
    phi = torch.randn(6, 4)
    y = torch.randn(6, 3) if task == "regression" else torch.randint(0, 3, (6,))
    out = head(phi)
    loss = out.train_loss(y)
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in head.parameters() if p.requires_grad]
    assert all(gr is not None and torch.isfinite(gr).all() for gr in grads)
    assert out.log_prob(y).shape == (6,)
    assert out.to_predictive().mean.shape == (6, 3)
    assert out.ood_score().shape == (6,)
    assert head.W().mean.shape == (3, 4)
    assert head.W().covariance.shape == (3, 4, 4)


def test_extra_heads_reject_bad_arguments() -> None:
    for kwargs, name in [
        ({"prior_scale": -1.0}, "prior_scale"),
        ({"parameterization": "lowrank"}, "cov_rank"),
    ]:
        for cls, _ in HEADS:
            with pytest.raises(ValueError, match=name):
                cls(3, 2, 0.1, **kwargs)
    with pytest.raises(ValueError, match="noise_prior_scale"):
        last_layer.VBLLHeteroscedasticRegression(3, 2, 0.1, noise_prior_scale=0.0)
    with pytest.raises(ValueError, match="wishart_scale"):
        last_layer.VBLLStudentTDiscriminative(3, 2, 0.1, wishart_scale=0.0)
    with pytest.raises(ValueError, match="softmax_bound"):
        last_layer.VBLLStudentTDiscriminative(3, 2, 0.1, softmax_bound="jensen")
    with pytest.raises(ValueError, match="phi"):
        last_layer.VBLLStudentTRegression(3, 2, 0.1)(torch.randn(4, 2))
    with pytest.raises(ValueError, match="y: labels"):
        last_layer.VBLLHeteroscedasticDiscriminative(3, 2, 0.1)(torch.randn(2, 3)).train_loss(
            torch.tensor([0, 2])
        )


# --------------------------------------------------------------------------------------------
# VBLL-BNN: collapsed VI with mean-field features (Sec. 3.4, App. C.2)


def test_mean_field_linear_kl_and_sampling() -> None:
    layer = last_layer.MeanFieldLinear(3, 2, prior_std=0.7).double()
    _randomize(layer, 20)
    ref = sum(
        torch.distributions.kl_divergence(
            torch.distributions.Normal(mean, nn.functional.softplus(rho)),
            torch.distributions.Normal(0.0, 0.7),
        ).sum()
        for mean, rho in [(layer.weight_mean, layer.weight_rho), (layer.bias_mean, layer.bias_rho)]
    )
    torch.testing.assert_close(layer.kl(), ref)
    torch.testing.assert_close(last_layer.mean_field_kl(nn.Sequential(layer, nn.ReLU())), ref)
    x = torch.randn(5, 3, dtype=DT)
    assert not torch.allclose(layer(x), layer(x))  # a fresh weight sample per forward
    layer.sample = False
    torch.testing.assert_close(layer(x), x @ layer.weight_mean.T + layer.bias_mean)
    # conversion keeps the function at the means
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    mf = last_layer.to_mean_field(net, prior_std=1.0)
    for m in mf.modules():
        if isinstance(m, last_layer.MeanFieldLinear):
            m.sample = False
    torch.testing.assert_close(mf(x), net(x))
    assert isinstance(net[0], nn.Linear)  # the original is untouched
    with pytest.raises(ValueError, match="MeanFieldLinear"):
        last_layer.mean_field_kl(net)


def test_vbll_bnn_mixture_predictive_and_objective() -> None:
    torch.manual_seed(0)
    features = last_layer.to_mean_field(nn.Sequential(nn.Linear(1, 8), nn.Tanh()), init_std=0.1)
    head = last_layer.VBLLRegression(8, 1, 0.01)
    model = last_layer.VBLLBNN(features.double(), head.double(), feature_kl_weight=0.01)
    x = torch.linspace(-2, 2, 7, dtype=DT).unsqueeze(-1)
    y = torch.sin(x)
    out = model(x, num_samples=5)
    # exact mixture density (eq. 70)
    comps = torch.stack([o.predictive.log_prob(y) for o in out.outputs])
    torch.testing.assert_close(out.log_prob(y), torch.logsumexp(comps, 0) - math.log(5))
    # moment-matched mixture: exact mean and variance
    means = torch.stack([o.predictive.mean for o in out.outputs])
    vars_ = torch.stack([o.predictive.var for o in out.outputs])
    pred = out.predictive
    torch.testing.assert_close(pred.mean, means.mean(0))
    torch.testing.assert_close(pred.var, vars_.mean(0) + means.var(0, unbiased=False))
    # eq. (64): head losses averaged over samples plus the weighted feature KL
    loss = out.train_loss(y)
    ref = torch.stack([o.train_loss(y) for o in out.outputs]).mean()
    torch.testing.assert_close(loss, ref + 0.01 * last_layer.mean_field_kl(features))
    # it trains
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for _ in range(150):
        opt.zero_grad()
        loss = model(x, num_samples=2).train_loss(y)
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
    assert loss.item() < first


def test_vbll_bnn_generative_ood_score_averages_densities() -> None:
    torch.manual_seed(1)
    features = last_layer.to_mean_field(nn.Sequential(nn.Linear(2, 3)), init_std=0.2).double()
    head = last_layer.VBLLGenerative(3, 2, 0.1).double()
    model = last_layer.VBLLBNN(features, head, 0.1)
    x = torch.randn(4, 2, dtype=DT)
    out = model(x, num_samples=3)
    dens = torch.stack([head.feature_log_density(o.features) for o in out.outputs])
    torch.testing.assert_close(out.ood_score(), -(torch.logsumexp(dens, 0) - math.log(3)))
    probs = torch.stack([o.predictive.probs for o in out.outputs]).mean(0)
    torch.testing.assert_close(out.predictive.probs, probs)  # eq. (71)


# --------------------------------------------------------------------------------------------
# post-hoc: G-VBLL-MAP (App. C.7) and heads on frozen features


def test_class_covariance_map_is_eq_77() -> None:
    g = _gen(30)
    phi = torch.randn(50, 3, generator=g, dtype=DT)
    y = torch.randint(0, 3, (50,), generator=g)
    nu, m = 2.0, 0.5
    means, covs, counts = last_layer.class_covariance_map(phi, y, 3, nu, m)
    for k in range(3):
        f = phi[y == k].numpy()
        mu = f.mean(0)
        ref = (m * np.eye(3) + (f - mu).T @ (f - mu)) / (len(f) + nu + 3 + 1)
        np.testing.assert_allclose(means[k].numpy(), mu, atol=1e-12)
        np.testing.assert_allclose(covs[k].numpy(), ref, atol=1e-12)
        assert counts[k] == len(f)


def test_gvbll_map_density_and_ood_score() -> None:
    g = _gen(31)
    centres = torch.tensor([[3.0, 0.0], [-3.0, 0.0]], dtype=DT)
    y = torch.randint(0, 2, (300,), generator=g)
    phi = centres[y] + 0.5 * torch.randn(300, 2, generator=g, dtype=DT)
    head = last_layer.VBLLGenerative(2, 2, 1 / 300, prior_scale=10.0).double()
    model = last_layer.GVBLLMAP.from_head(head, phi, y)
    x = torch.randn(5, 2, generator=g, dtype=DT)
    means, covs, counts = last_layer.class_covariance_map(phi, y, 2, head.dof, head.wishart_scale)
    alpha = (counts + 1.0).numpy()
    log_joint = np.stack(
        [
            stats.multivariate_normal(means[k].numpy(), covs[k].numpy()).logpdf(x.numpy())
            + np.log(alpha[k] / alpha.sum())
            for k in range(2)
        ],
        -1,
    )
    torch.testing.assert_close(model.log_density(x), torch.tensor(logsumexp(log_joint, -1)))
    prior_cov = 10.0 * np.eye(2) + head.noise_cov.covariance.detach().numpy()
    prior = stats.multivariate_normal(np.zeros(2), prior_cov).logpdf(x.numpy())
    torch.testing.assert_close(
        model.ood_score(x), torch.tensor(-(logsumexp(log_joint, -1) - prior))
    )
    far = 8.0 * torch.randn(300, 2, generator=g, dtype=DT) + torch.tensor([0.0, 12.0], dtype=DT)
    scores = torch.cat([model.ood_score(phi), model.ood_score(far)])
    labels = torch.cat([torch.zeros(300), torch.ones(300)]).long()
    assert metrics.auroc(scores, labels) > 0.95
    state = model.state_dict()
    other = last_layer.GVBLLMAP(2, 2)
    other.load_state_dict(state)
    torch.testing.assert_close(other.ood_score(x.float()), model.ood_score(x).float())


def test_fit_posthoc_on_frozen_features_gives_the_blr_posterior() -> None:
    torch.manual_seed(2)
    g = _gen(32)
    backbone = nn.Sequential(nn.Linear(2, 4), nn.Tanh()).double()
    x = torch.randn(30, 2, generator=g, dtype=DT)
    y = torch.randn(30, 1, generator=g, dtype=DT)
    backbone.train()
    phi, yy = last_layer.extract_features(backbone, (x, y), batch_size=7)
    assert backbone.training and phi.shape == (30, 4) and not phi.requires_grad
    torch.testing.assert_close(yy, y)
    sig2, s0 = 0.4, 2.0
    head = last_layer.VBLLRegression(4, 1, 1 / 30, prior_scale=s0).double()
    head.noise_cov.set_covariance(torch.tensor([[sig2]], dtype=DT))
    head.noise_cov.requires_grad_(False)
    history = last_layer.fit_posthoc(head, phi, y, max_iter=1000)
    assert history[-1] < history[0]
    precision = torch.eye(4, dtype=DT) / s0 + phi.T @ phi / sig2
    s_post = torch.linalg.inv(precision)
    torch.testing.assert_close(head.W().covariance[0], s_post, atol=1e-4, rtol=0)
    torch.testing.assert_close(head.W().mean, (s_post @ phi.T @ y / sig2).T, atol=1e-4, rtol=0)
    # a generative head gets its class counts; Adam runs minibatches
    labels = (phi[:, 0] > 0).long()
    gen = last_layer.VBLLGenerative(4, 2, 1 / 30).double()
    hist = last_layer.fit_posthoc(
        gen, phi, labels, optimizer="adam", max_iter=30, batch_size=8, seed=0
    )
    assert len(hist) == 30 and hist[-1] < hist[0]
    torch.testing.assert_close(gen.class_counts, torch.bincount(labels, minlength=2).to(DT))
    with pytest.raises(ValueError, match="optimizer"):
        last_layer.fit_posthoc(gen, phi, labels, optimizer="sgd")


def test_heads_share_one_gaussian_layer_plumbing() -> None:
    """Every head builds its Gaussian layers with ``VBLLHead.add_gaussian_rows``: the mean is
    drawn first (``randn(out, in) / sqrt(in)``, G-VBLL's class means included), then
    the covariance at ``min(prior_scale, 1 / in)``; a user's head gets ``W()``, the KL against
    ``N(0, prior_scale I)`` and the inverse-Wishart noise prior from the shared pieces."""
    from gaussify.last_layer.base import RegressionHead, WishartNoise
    from gaussify.last_layer.noise import NoiseCovariance

    d, k = 5, 3
    for cls in (
        last_layer.VBLLRegression,
        last_layer.VBLLStudentTRegression,
        last_layer.VBLLHeteroscedasticRegression,
        last_layer.VBLLDiscriminative,
        last_layer.VBLLStudentTDiscriminative,
        last_layer.VBLLHeteroscedasticDiscriminative,
        last_layer.VBLLGenerative,
    ):
        torch.manual_seed(3)
        head = cls(d, k, 0.1)
        torch.manual_seed(3)
        first = torch.randn(k, d)
        mean = head.mu_mean if cls is last_layer.VBLLGenerative else head.W_mean
        expected = first / math.sqrt(d)
        assert torch.equal(mean.detach(), expected), cls.__name__

    class MyHead(WishartNoise, RegressionHead):
        def __init__(self) -> None:
            super().__init__(d, k, 0.5, prior_scale=2.0)
            self.set_wishart_prior(3.0, 4.0)
            self.add_gaussian_rows("W", torch.zeros(k, d), 1, "diagonal", 2.0, None)
            self.noise_cov = NoiseCovariance(k, "diagonal", 1.0)

        def log_likelihood_bound(self, phi: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.zeros(phi.shape[0])

        def predictive(self, phi: torch.Tensor) -> None:
            return None

        def log_prob(self, phi: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.zeros(phi.shape[0])

        def ood_score(self, phi: torch.Tensor) -> torch.Tensor:
            return torch.zeros(phi.shape[0])

    head = MyHead()
    s0 = min(2.0, 1.0 / d)  # the initial variance; q = N(0, s0 I) for each of the k rows
    kl = 0.5 * k * d * (s0 / 2.0 - 1.0 - math.log(s0 / 2.0))
    assert float(head.kl().detach()) == pytest.approx(kl, rel=1e-5)
    assert torch.equal(head.W().mean, head.W_mean)
    assert head.parameterization == "diagonal" and (head.wishart_scale, head.dof) == (3.0, 4.0)
    assert torch.equal(head.log_prior(), head.noise_cov.log_prior(4.0, 3.0))
    with pytest.raises(ValueError, match="dof: must be > 0"):
        head.set_wishart_prior(1.0, -1.0)
