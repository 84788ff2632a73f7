"""Gaussian likelihood approximations (Bui, Sec. 3, App. A-B) against numerical references.

Every closed form (and the numerical Beta variational solver) is compared with an oracle that
does not use it: moments by adaptive quadrature of the transformed density, KL minimisation by
Nelder-Mead on a quadrature KL, Laplace by Newton with autograd on a ``torch.distributions``
log density, log-normal moment matching by quadrature in both bases, plus 10^6 Monte Carlo
samples for the moments of the log basis.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import integrate, optimize, special, stats

import gaussify.approx_likelihoods as al
from gaussify.approx_likelihoods import (
    APPROXIMATIONS,
    BetaGaussian,
    DirichletGaussian,
    GaussianApproxLoss,
    gaussian_approx,
)

TOL = 1e-4

# (distribution, parameters) cases; the Inverse-Gamma needs alpha > 2 for 'moment-ori'.
CASES: list[tuple[str, dict[str, float]]] = [
    ("gamma", {"alpha": 0.1, "beta": 1.0}),
    ("gamma", {"alpha": 1.1, "beta": 1.0}),
    ("gamma", {"alpha": 3.0, "beta": 2.5}),
    ("gamma", {"alpha": 20.0, "beta": 0.5}),
    ("exponential", {"rate": 0.5}),
    ("exponential", {"rate": 3.0}),
    ("inverse_gamma", {"alpha": 2.5, "beta": 1.0}),
    ("inverse_gamma", {"alpha": 6.0, "beta": 0.3}),
    ("chi2", {"df": 0.5}),
    ("chi2", {"df": 3.0}),
    ("chi2", {"df": 12.0}),
    ("beta", {"alpha": 1.1, "beta": 0.1}),
    ("beta", {"alpha": 0.1, "beta": 1.1}),
    ("beta", {"alpha": 2.0, "beta": 1.0}),
    ("beta", {"alpha": 5.0, "beta": 3.0}),
    ("beta", {"alpha": 1.01, "beta": 0.01}),
    ("beta", {"alpha": 0.5, "beta": 0.5}),
]


def _scipy_log_density(dist: str, p: dict[str, float]):
    """log p_psi(psi) for psi = g(omega): scipy's log pdf of omega plus the log-Jacobian."""
    if dist == "beta":
        # log Beta(sigmoid(psi)) + log sigmoid(psi) + log sigmoid(-psi), written stably.
        a, b = p["alpha"], p["beta"]
        return lambda s: -a * np.logaddexp(0, -s) - b * np.logaddexp(0, s) - special.betaln(a, b)
    frozen = {
        "gamma": lambda: stats.gamma(p.get("alpha", 0), scale=1 / p.get("beta", 1)),
        "exponential": lambda: stats.expon(scale=1 / p.get("rate", 1)),
        "inverse_gamma": lambda: stats.invgamma(p.get("alpha", 0), scale=p.get("beta", 1)),
        "chi2": lambda: stats.chi2(p.get("df", 1)),
    }[dist]()
    return lambda s: frozen.logpdf(np.exp(s)) + s


def _support(log_p) -> tuple[float, float, float]:
    """Mode and an interval outside which the (unimodal) density is below e^-60 of its peak."""
    mode = optimize.minimize_scalar(lambda s: -log_p(s), bounds=(-700, 700), method="bounded")
    mode = optimize.minimize(lambda s: -log_p(s[0]), [mode.x], method="Nelder-Mead").x[0]
    peak = log_p(mode)
    ends = []
    for direction in (-1.0, 1.0):
        step = 1.0
        while log_p(mode + direction * step) > peak - 60 and step < 1e4:
            step *= 1.5
        ends.append(mode + direction * step)
    return mode, ends[0], ends[1]


def _integrate(fn, lo: float, hi: float, pieces: int = 60) -> float:
    edges = np.linspace(lo, hi, pieces + 1)
    return sum(
        integrate.quad(fn, a, b, limit=200, epsabs=1e-14, epsrel=1e-12)[0]
        for a, b in itertools.pairwise(edges)
    )


def _close(value: torch.Tensor, ref: float, tol: float = TOL) -> None:
    value = float(value)
    assert abs(value - ref) <= tol * max(1.0, abs(ref)), (value, ref)


def _approx(dist: str, method: str, p: dict[str, float]):
    params = {k: torch.tensor(v, dtype=torch.float64) for k, v in p.items()}
    return gaussian_approx(dist, method, **params)


def _methods(dist: str) -> list[str]:
    return sorted(m for d, m in APPROXIMATIONS if d == dist)


# --- every (distribution, method) against a numerical oracle ------------------------------


@pytest.mark.parametrize(("dist", "params"), CASES)
def test_moment_matching_equals_quadrature(dist, params):
    log_p = _scipy_log_density(dist, params)
    _, lo, hi = _support(log_p)
    mass = _integrate(lambda s: np.exp(log_p(s)), lo, hi)
    assert abs(mass - 1) < 1e-8  # the oracle's density is normalised
    mean = _integrate(lambda s: s * np.exp(log_p(s)), lo, hi)
    var = _integrate(lambda s: (s - mean) ** 2 * np.exp(log_p(s)), lo, hi)
    m, v = _approx(dist, "moment", params)
    _close(m, mean)
    _close(v, var)


@pytest.mark.parametrize("alpha", [0.3, 1.1, 4.0])
def test_moment_matching_equals_monte_carlo(alpha):
    """10^6 samples of log(omega), omega ~ Gamma(alpha): within 5 standard errors."""
    psi = torch.from_numpy(np.log(np.random.default_rng(0).gamma(alpha, size=10**6)))
    m, v = gaussian_approx("gamma", "moment", alpha=torch.tensor(alpha, dtype=torch.float64))
    n = psi.numel()
    assert abs(float(psi.mean() - m)) < 5 * math.sqrt(float(v) / n)
    fourth = float(((psi - psi.mean()) ** 4).mean())
    assert abs(float(psi.var() - v)) < 5 * math.sqrt((fourth - float(v) ** 2) / n)


@pytest.mark.parametrize(("dist", "params"), CASES)
def test_variational_matching_equals_kl_minimisation(dist, params):
    log_p = _scipy_log_density(dist, params)

    z = np.linspace(-12, 12, 4801)
    weights = np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi) * (z[1] - z[0])

    def kl(theta: np.ndarray) -> float:  # KL(N(mu, s^2) || p), trapezoid rule over z
        mu, log_s = theta
        cross = float(np.sum(weights * log_p(mu + math.exp(log_s) * z)))
        return -log_s - 0.5 * math.log(2 * math.pi * math.e) - cross

    mode, _, _ = _support(log_p)
    start = [mode, 0.0]
    res = optimize.minimize(
        kl, start, method="Nelder-Mead", options={"xatol": 1e-11, "fatol": 1e-15, "maxiter": 8000}
    )
    res = optimize.minimize(
        kl, res.x, method="Nelder-Mead", options={"xatol": 1e-11, "fatol": 1e-15, "maxiter": 8000}
    )
    m, v = _approx(dist, "variational", params)
    _close(m, res.x[0])
    _close(v, math.exp(2 * res.x[1]))
    # ... and the closed form is at least as good as the optimiser's point
    assert kl(np.array([float(m), 0.5 * math.log(float(v))])) <= res.fun + 1e-9


def _torch_log_density(dist: str, p: dict[str, float]):
    d = torch.distributions
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in p.items()}
    if dist == "beta":
        base = d.Beta(t["alpha"], t["beta"])
        return lambda s: (
            base.log_prob(torch.sigmoid(s))
            + torch.nn.functional.logsigmoid(s)
            + torch.nn.functional.logsigmoid(-s)
        )
    base = {
        "gamma": lambda: d.Gamma(t.get("alpha"), t.get("beta")),
        "exponential": lambda: d.Exponential(t.get("rate")),
        "inverse_gamma": lambda: d.InverseGamma(t.get("alpha"), t.get("beta")),
        "chi2": lambda: d.Chi2(t.get("df")),
    }[dist]()
    return lambda s: base.log_prob(s.exp()) + s


@pytest.mark.parametrize(("dist", "params"), CASES)
def test_laplace_matching_equals_autograd_newton(dist, params):
    log_p = _torch_log_density(dist, params)
    psi = torch.tensor(0.0, dtype=torch.float64)
    for _ in range(200):
        psi = psi.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(log_p(psi), psi, create_graph=True)
        (hess,) = torch.autograd.grad(grad, psi)
        step = (-grad / hess).detach().clamp(-1.0, 1.0)
        psi = psi.detach() + step
        if abs(float(step)) < 1e-12:
            break
    psi = psi.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(log_p(psi), psi, create_graph=True)
    (hess,) = torch.autograd.grad(grad, psi)
    m, v = _approx(dist, "laplace", params)
    _close(m, float(psi.detach()))
    _close(v, float(-1 / hess))


@pytest.mark.parametrize(("dist", "params"), [c for c in CASES if c[0] != "beta"])
def test_moment_ori_matches_original_basis_moments(dist, params):
    """The log-normal N(m, v) in the log basis has the first two moments of omega."""
    log_p = _scipy_log_density(dist, params)
    _, lo, hi = _support(log_p)
    m, v = (float(t) for t in _approx(dist, "moment-ori", params))
    for k in (1, 2):
        target = _integrate(lambda s, k=k: np.exp(k * s + log_p(s)), lo, hi)
        got = integrate.quad(
            lambda z, k=k: (
                math.exp(k * (m + math.sqrt(v) * z) - 0.5 * z * z) / math.sqrt(2 * math.pi)
            ),
            -14,
            14,
            limit=400,
            epsabs=0,
            epsrel=1e-13,
        )[0]
        assert abs(got - target) <= TOL * abs(target), (k, got, target)


def test_every_pair_is_tested():
    """The oracle tests above (moment, variational, laplace on every case; moment-ori on every
    log-basis case) cover exactly the registered (distribution, method) pairs."""
    tested = {d for d, _ in CASES}
    assert tested == set(al.BASES)
    oracles = {(d, m) for d in tested for m in ("laplace", "variational", "moment")}
    oracles |= {(d, "moment-ori") for d in tested if al.BASES[d] == "log"}
    assert oracles == set(APPROXIMATIONS)
    assert _methods("beta") == ["laplace", "moment", "variational"]  # no moment-ori for Beta


def test_beta_variational_extremes_and_kl():
    """Newton converges for very small/large pseudo-counts, and its KL is a minimum."""
    a = torch.tensor([1.001, 1e-3, 1000.0, 2.0], dtype=torch.float64)
    b = torch.tensor([1e-3, 1.001, 1e-3, 1000.0], dtype=torch.float64)
    mean, var = al.beta_variational(a, b)
    assert torch.isfinite(mean).all() and (var > 0).all()
    assert torch.allclose(mean[0], -mean[1]) and torch.allclose(var[0], var[1])
    e1 = torch.sigmoid(mean + var.sqrt() * torch.randn(200000, 4, dtype=torch.float64)).mean(0)
    assert torch.allclose(e1, a / (a + b), atol=5e-3)  # stationarity E_q[sigmoid] = a/(a+b)
    kl0 = al.beta_kl(mean, var, a, b)
    for dm, dv in [(1e-3, 0.0), (-1e-3, 0.0), (0.0, 1e-3), (0.0, -1e-3)]:
        assert (al.beta_kl(mean + dm * var.sqrt(), var * (1 + dv), a, b) >= kl0 - 1e-12).all()


def test_variational_reparam_agrees_with_newton_and_closed_form():
    a = torch.tensor([1.1, 5.0], dtype=torch.float64)
    b = torch.tensor([0.1, 3.0], dtype=torch.float64)

    def log_beta(s):
        return a * torch.nn.functional.logsigmoid(s) + b * torch.nn.functional.logsigmoid(-s)

    m0, v0 = gaussian_approx("beta", "laplace", alpha=a, beta=b)
    mean, var = al.variational_reparam(log_beta, m0, v0, num_samples=4000)
    ref_mean, ref_var = al.beta_variational(a, b)
    assert torch.allclose(mean, ref_mean, rtol=2e-3) and torch.allclose(var, ref_var, rtol=5e-3)

    alpha = torch.tensor([2.0, 5.0], dtype=torch.float64)
    mean, var = al.variational_reparam(
        lambda s: alpha * s - s.exp(),
        torch.zeros(2, dtype=torch.float64),
        torch.ones(2, dtype=torch.float64),
    )
    ref_mean, ref_var = gaussian_approx("gamma", "variational", alpha=alpha)
    assert torch.allclose(mean, ref_mean, atol=5e-3) and torch.allclose(var, ref_var, rtol=5e-3)


# --- pseudo-targets -----------------------------------------------------------------------

METHODS = ["laplace", "variational", "moment", "moment-ori", "gauss"]
LOGIT_METHODS = ["laplace", "variational", "moment", "gauss"]


@pytest.mark.parametrize("method", METHODS)
def test_dirichlet_targets_are_the_gamma_approximation(method):
    y = torch.tensor([[0, 2, 1], [3, 3, 0]])  # any batch shape
    mean, var = DirichletGaussian(method, alpha_eps=0.05).pseudo_targets(y, 4, torch.float64)
    assert mean.shape == var.shape == (2, 3, 4)
    alpha = 0.05 + torch.nn.functional.one_hot(y, 4).double()
    if method == "gauss":
        ref_mean, ref_var = alpha - 0.05, torch.full_like(alpha, 0.1)
    else:
        ref_mean, ref_var = gaussian_approx("gamma", method, alpha=alpha)
    torch.testing.assert_close(mean, ref_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var, ref_var, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method", LOGIT_METHODS)
def test_beta_targets_are_the_beta_approximation(method):
    y = torch.tensor([0, 1, 1, 0])
    mean, var = BetaGaussian(method, alpha_eps=0.2, beta_eps=0.05).pseudo_targets(
        y, dtype=torch.float64
    )
    assert mean.shape == var.shape == (4, 1)
    a, b = 0.2 + y.double(), 0.05 + 1 - y.double()
    if method == "gauss":
        # -1/+1 targets: the least-squares boundary is f = 0, where sigmoid(f) = 1/2
        ref_mean, ref_var = 2 * y.double() - 1, torch.full((4,), 0.1, dtype=torch.float64)
    else:
        ref_mean, ref_var = gaussian_approx("beta", method, alpha=a, beta=b)
    torch.testing.assert_close(mean.squeeze(-1), ref_mean, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(var.squeeze(-1), ref_var, rtol=1e-10, atol=1e-10)


def test_moment_ori_is_milios_dirichlet_construction():
    """Milios et al. (2018): alpha = alpha_eps + onehot, s2 = log(1/alpha + 1),
    y~ = log(alpha) - s2/2 (hard-coded numbers for alpha_eps = 0.01)."""
    y = torch.tensor([1, 0])
    mean, var = DirichletGaussian("moment-ori", alpha_eps=0.01).pseudo_targets(y, 3, torch.float64)
    on_var, off_var = math.log(1 / 1.01 + 1), math.log(1 / 0.01 + 1)
    on_mean, off_mean = math.log(1.01) - on_var / 2, math.log(0.01) - off_var / 2
    assert off_var == pytest.approx(4.61512051684126, abs=1e-12)
    f64 = torch.float64
    expected_mean = torch.tensor(
        [[off_mean, on_mean, off_mean], [on_mean, off_mean, off_mean]], dtype=f64
    )
    expected_var = torch.tensor([[off_var, on_var, off_var], [on_var, off_var, off_var]], dtype=f64)
    torch.testing.assert_close(mean, expected_mean, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(var, expected_var, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("alpha_eps", [0.01, 0.1])
def test_moment_ori_equals_gpytorch_dirichlet_likelihood(alpha_eps):
    gpytorch = pytest.importorskip("gpytorch")
    y = torch.tensor([0, 2, 1, 1, 3, 0])
    lik = gpytorch.likelihoods.DirichletClassificationLikelihood(
        y, alpha_epsilon=alpha_eps, dtype=torch.float64
    )
    mean, var = DirichletGaussian("moment-ori", alpha_eps=alpha_eps).pseudo_targets(
        y, 4, torch.float64
    )
    torch.testing.assert_close(mean, lik.transformed_targets.T)  # gpytorch stores (C, N)
    torch.testing.assert_close(var, lik.noise.T)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("alpha_eps", [1e-3, 0.1, 1.0, 10.0])
def test_log_basis_targets_recover_the_label(method, alpha_eps):
    y = torch.tensor([0, 3, 2, 1, 4])
    mean, _ = DirichletGaussian(method, alpha_eps=alpha_eps).pseudo_targets(y, 5)
    probs = torch.softmax(mean, dim=-1)
    assert torch.equal(probs.argmax(-1), y)
    on = probs.gather(1, y[:, None])
    assert (probs < on).sum() == 5 * 4  # every other class strictly below the label


@pytest.mark.parametrize("method", LOGIT_METHODS)
def test_logit_basis_targets_recover_the_label(method):
    y = torch.tensor([0, 1, 1, 0])
    mean, _ = BetaGaussian(method).pseudo_targets(y)
    assert torch.equal((torch.sigmoid(mean.squeeze(-1)) > 0.5).long(), y)


@pytest.mark.parametrize("method", ["laplace", "variational", "moment", "moment-ori"])
def test_targets_are_differentiable_in_alpha_eps(method):
    y = torch.tensor([0, 1, 2, 1])

    def dirichlet(a):
        m, v = DirichletGaussian(method, alpha_eps=a).pseudo_targets(y, 3)
        return m, v

    a = torch.tensor([0.2, 0.05, 0.5], dtype=torch.float64, requires_grad=True)  # per class
    assert torch.autograd.gradcheck(dirichlet, (a,))
    if method != "moment-ori":

        def beta(a):
            return BetaGaussian(method, alpha_eps=a[0], beta_eps=a[1]).pseudo_targets(y.clamp(0, 1))

        ab = torch.tensor([0.3, 0.1], dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(beta, (ab,), atol=1e-5)


def test_dirichlet_logit_prior_is_the_moment_map_of_a_symmetric_dirichlet():
    """A symmetric Dir(a) on the class probabilities is softmax(psi) with psi_k = log w_k,
    w_k ~ Gamma(a, 1) (Sec. 2.2); its logit Gaussian is that log-Gamma's mean and variance
    (float64 quadrature of p(psi) = exp(a psi - e^psi) / Gamma(a)); Dir(1) gives
    N(-euler_gamma, pi^2/6), the streaming experiment's prior logit variance."""
    from gaussify.approx_likelihoods.closed_forms import dirichlet_logit_prior

    mean, var = dirichlet_logit_prior()
    assert mean == pytest.approx(-np.euler_gamma, abs=1e-12)
    assert var == pytest.approx(math.pi**2 / 6, abs=1e-8)

    def moment(k: int, a: float) -> float:
        def integrand(psi: float) -> float:
            return psi**k * math.exp(a * psi - math.exp(psi) - special.gammaln(a))

        return integrate.quad(integrand, -60, 10, limit=200)[0]

    for a in (0.5, 1.0, 3.0):
        m1, m2 = moment(1, a), moment(2, a)
        got = dirichlet_logit_prior(a)
        assert got[0] == pytest.approx(m1, abs=1e-8)
        assert got[1] == pytest.approx(m2 - m1 * m1, abs=1e-7)
    # the other maps of Sec. 3.2 on the same log-Gamma: variational N(log a - 1/(2a), 1/a)
    assert dirichlet_logit_prior(2.0, "variational") == pytest.approx((math.log(2) - 0.25, 0.5))
    with pytest.raises(ValueError, match=r"concentration: must be positive and finite, got 0\.0"):
        dirichlet_logit_prior(0.0)
    with pytest.raises(ValueError, match="concentration"):
        dirichlet_logit_prior(float("inf"))
    with pytest.raises(TypeError, match="concentration"):
        dirichlet_logit_prior(True)
    with pytest.raises(ValueError, match="method"):
        dirichlet_logit_prior(1.0, "ep")


def test_bad_inputs_raise_naming_the_argument():
    with pytest.raises(ValueError, match="alpha_eps"):
        DirichletGaussian("moment", alpha_eps=0.0)
    with pytest.raises(ValueError, match="alpha_eps"):
        DirichletGaussian("moment", alpha_eps=-1.0)
    with pytest.raises(ValueError, match="alpha_eps"):
        BetaGaussian("moment", alpha_eps=torch.tensor([0.1, -0.2]))
    with pytest.raises(ValueError, match="beta_eps"):
        BetaGaussian("moment", beta_eps=0.0)
    with pytest.raises(ValueError, match="alpha_eps"):
        GaussianApproxLoss("variational", alpha_eps=float("nan"))
    with pytest.raises(ValueError, match="basis"):
        BetaGaussian("moment-ori")
    with pytest.raises(ValueError, match="basis"):
        GaussianApproxLoss("moment-ori", basis="logit")
    with pytest.raises(ValueError, match="basis"):
        DirichletGaussian("moment", basis="logit")
    with pytest.raises(ValueError, match="basis"):
        GaussianApproxLoss("moment", basis="probit")
    with pytest.raises(ValueError, match="method"):
        DirichletGaussian("exact")
    with pytest.raises(ValueError, match="method"):
        gaussian_approx("beta", "moment-ori", alpha=1.0, beta=1.0)
    with pytest.raises(ValueError, match="distribution"):
        gaussian_approx("poisson", "moment", rate=1.0)
    with pytest.raises(ValueError, match="rate"):
        gaussian_approx("exponential", "moment", rate=0.0)
    with pytest.raises(ValueError, match="params"):
        gaussian_approx("beta", "moment", alpha=1.0)
    with pytest.raises(ValueError, match="alpha"):
        gaussian_approx("inverse_gamma", "moment-ori", alpha=1.5, beta=1.0)
    dirichlet = DirichletGaussian("moment")
    with pytest.raises(ValueError, match=r"y: labels must be in \[0, 3\)"):
        dirichlet.pseudo_targets(torch.tensor([0, 3]), 3)
    with pytest.raises(ValueError, match="y"):
        dirichlet.pseudo_targets(torch.tensor([-1, 0]), 3)
    with pytest.raises(TypeError, match="y"):
        dirichlet.pseudo_targets(torch.tensor([0.0, 1.0]), 3)
    with pytest.raises(ValueError, match="num_classes"):
        dirichlet.pseudo_targets(torch.tensor([0]), 1)
    with pytest.raises(ValueError, match="y"):
        BetaGaussian("moment").pseudo_targets(torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="num_classes"):
        BetaGaussian("moment").pseudo_targets(torch.tensor([0, 1]), 3)
    # ... and through the training loss
    with pytest.raises(ValueError, match=r"y: labels must be in \[0, 4\)"):
        GaussianApproxLoss("moment")(torch.randn(3, 4), torch.tensor([0, 4, 1]))
    with pytest.raises(ValueError, match=r"y: labels must be in \[0, 2\)"):
        GaussianApproxLoss("moment", basis="logit")(torch.randn(3, 1), torch.tensor([0, 2, 1]))


# --- the training loss (eq. 3) ---------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_loss_gradient_is_the_gaussian_nll_gradient(method):
    torch.manual_seed(0)
    f = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 1, 3, 2, 2, 0])
    loss_fn = GaussianApproxLoss(method, alpha_eps=0.07)
    mean, var = loss_fn.pseudo_targets(y, 4, torch.float64)
    loss = loss_fn(f, y)
    ref = torch.nn.functional.gaussian_nll_loss(f, mean, var, full=True, reduction="sum") / 6
    (grad,) = torch.autograd.grad(loss, f)
    (ref_grad,) = torch.autograd.grad(ref, f)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)
    torch.testing.assert_close(grad, (f - mean).detach() / var / 6)
    assert loss_fn.predict(f).sum(-1).allclose(torch.ones(6, dtype=torch.float64))


@pytest.mark.parametrize("method", LOGIT_METHODS)
def test_logit_loss_gradient_and_prediction(method):
    f = torch.linspace(-2, 2, 5, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 0, 1, 1, 1])
    loss_fn = GaussianApproxLoss(method, basis="logit", alpha_eps=0.1, reduction="sum")
    mean, var = loss_fn.pseudo_targets(y, 2, torch.float64)
    (grad,) = torch.autograd.grad(loss_fn(f, y), f)
    torch.testing.assert_close(grad, ((f - mean.squeeze(-1)) / var.squeeze(-1)).detach())
    probs = loss_fn.predict(f)
    torch.testing.assert_close(probs[:, 1], torch.sigmoid(f.detach()))
    assert loss_fn(f[:, None], y).shape == ()
    assert GaussianApproxLoss(method, basis="logit", reduction="none")(f, y).shape == (5,)


def test_loss_trains_a_classifier_like_cross_entropy():
    import gaussify as gs

    ds = gs.data.load("digits", seed=0)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 10)
    loss_fn = GaussianApproxLoss("variational", alpha_eps=0.1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(50):
        opt.zero_grad()
        loss_fn(model(ds.x_train), ds.y_train).backward()
        opt.step()
    with torch.no_grad():
        probs = loss_fn.predict(model(ds.x_test))
    assert gs.metrics.accuracy(probs, ds.y_test) > 0.9


# --- choosing alpha_eps ------------------------------------------------------------------


def test_grid_selection_picks_the_best_training_likelihood():
    y = torch.tensor([0, 1, 1, 0])

    def fit_predict(alpha):  # a fake model whose confidence peaks at alpha = 0.1
        p = 0.9 - abs(math.log(alpha / 0.1)) / 20
        return torch.where(y.bool(), p, 1 - p).double()

    result = al.select_alpha_eps(fit_predict, y, grid=(0.01, 0.1, 1.0))
    assert result.alpha_eps == 0.1
    assert result.score == max(result.scores.values())
    with pytest.raises(ValueError, match="grid"):
        al.select_alpha_eps(fit_predict, y, grid=(0.1, -1.0))


def test_variational_tuning_maximises_the_bound():
    result = al.tune_alpha_eps(
        lambda a: -((a.log() - math.log(0.3)) ** 2), init=0.05, steps=300, lr=0.05
    )
    assert result.alpha_eps == pytest.approx(0.3, rel=1e-2)


def test_expected_log_likelihood_matches_quadrature():
    """Binary: E[log sigmoid(f)] for f ~ N(1, 2) by 10^6 reparameterised samples."""
    eps = torch.randn(10**6, 1, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    value = al.expected_log_likelihood(
        torch.ones(1, 1, dtype=torch.float64),
        torch.full((1, 1), 2.0, dtype=torch.float64),
        torch.tensor([1]),
        "binary",
        eps,
    )
    ref = integrate.quad(
        lambda z: -np.logaddexp(0, -(1 + math.sqrt(2) * z)) * stats.norm.pdf(z), -12, 12
    )[0]
    assert float(value) == pytest.approx(ref, abs=3e-3)


def test_binary_gauss_loss_classifies_a_separable_problem() -> None:
    # label regression on one logit read through sigmoid: its optimum must put the decision
    # boundary where the classes separate (0/1 targets would shift it to f = 1/2)
    torch.manual_seed(0)
    x = torch.randn(400, 2, dtype=torch.float64)
    y = (x[:, 0] > 0.3).long()
    mean, _ = BetaGaussian("gauss").pseudo_targets(y, dtype=torch.float64)
    feats = torch.cat([x, torch.ones(400, 1, dtype=torch.float64)], 1)
    w = torch.linalg.lstsq(feats, mean).solution
    acc = ((torch.sigmoid(feats @ w)[:, 0] > 0.5).long() == y).double().mean()
    assert acc > 0.95
