"""GGN / EF curvature structures and posterior precisions against dense autograd references.

Oracles: sum_n J_n^T Lambda_n J_n from torch.autograd Jacobians and ``likelihood.hessian``
(thesis eq. 2.24); the exact NLL Hessian for models linear in their parameters (where the GGN is
exact); per-sample autograd gradients for the empirical Fisher; torch.linalg for every
posterior quantity (float64, ~1e-10).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import Tensor, nn

from gaussify.curvature import (
    Curvature,
    PosteriorPrecision,
    available_structures,
    get_curvature_class,
    make_curvature,
    register_curvature,
)
from gaussify.curvature import jacobian as jacobian_module
from gaussify.curvature.base import cholesky_psd
from gaussify.curvature.diag import DiagGGN
from gaussify.curvature.full import CholeskyPrecision, EigenPrecision, FullGGN
from gaussify.curvature.lowrank import LowRankGGN
from gaussify.curvature.subset import select_parameters
from gaussify.likelihoods import Bernoulli, Categorical, Gaussian, Likelihood

DT = torch.float64
N, D, H, C = 12, 3, 4, 3


class SkipNet(nn.Module):
    def __init__(self, out: int = C) -> None:
        super().__init__()
        self.inp = nn.Linear(D, H)
        self.norm = nn.LayerNorm(H)
        self.mid = nn.Linear(H, H)
        self.head = nn.Linear(H, out)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(self.norm(h + torch.tanh(self.mid(h))))


def _likelihood(kind: str) -> Likelihood:
    if kind == "gaussian":
        return Gaussian(torch.tensor([0.5, 1.3, 2.0], dtype=DT))
    return Categorical() if kind == "categorical" else Bernoulli()


def _data(kind: str, seed: int = 0, n: int = N) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(seed)
    model = SkipNet().to(DT).eval()
    x = torch.randn(n, D, dtype=DT)
    if kind == "gaussian":
        y = torch.randn(n, C, dtype=DT)
    elif kind == "categorical":
        y = torch.randint(0, C, (n,))
    else:
        y = torch.randint(0, 2, (n, C)).to(DT)
    return model, x, y


def autograd_jacobians(model: nn.Module, x: Tensor, names: tuple[str, ...]) -> Tensor:
    named = dict(model.named_parameters())
    params = [named[n] for n in names]
    out = model(x)
    rows = []
    for i in range(out.shape[0]):
        per_output = []
        for c in range(out.shape[1]):
            grads = torch.autograd.grad(out[i, c], params, retain_graph=True)
            per_output.append(torch.cat([g.reshape(-1) for g in grads]))
        rows.append(torch.stack(per_output))
    return torch.stack(rows).detach()


def reference_ggn(model: nn.Module, x: Tensor, lik: Likelihood, subset: object) -> Tensor:
    names = select_parameters(model, subset).names
    jac = autograd_jacobians(model, x, names)
    lam = lik.hessian(model(x).detach())
    return torch.einsum("nap,nab,nbq->pq", jac, lam, jac)


def reference_ef(model: nn.Module, x: Tensor, y: Tensor, lik: Likelihood, subset: object) -> Tensor:
    """sum_n g_n g_n^T with g_n = d log p(y_n | f(x_n)) / d theta by autograd, one sample at a
    time."""
    names = select_parameters(model, subset).names
    named = dict(model.named_parameters())
    grads = []
    for i in range(x.shape[0]):
        logp = lik.log_prob(model(x[i : i + 1]), y[i : i + 1]).sum()
        g = torch.autograd.grad(logp, [named[n] for n in names])
        grads.append(torch.cat([t.reshape(-1) for t in g]))
    gs = torch.stack(grads)
    return gs.T @ gs


def _fit(structure: str, model: nn.Module, x: Tensor, y: Tensor, lik: Likelihood, **kw: object):
    curv = make_curvature(structure, model, lik, **kw)  # type: ignore[arg-type]
    half = x.shape[0] // 2
    curv.update(model, x[:half], y[:half])
    curv.update(model, x[half:], y[half:])
    return curv


KINDS = ["gaussian", "categorical", "bernoulli"]
SUBSETS = ["all", "last_layer", ["inp", "head.bias"]]


# ------------------------------------------------------------------------------ GGN values


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("subset", SUBSETS, ids=["all", "last", "named"])
def test_full_ggn_equals_autograd_reference(kind: str, subset: object) -> None:
    model, x, y = _data(kind)
    lik = _likelihood(kind)
    ref = reference_ggn(model, x, lik, subset)
    curv = _fit("full", model, x, y, lik, subset=subset, chunk_size=5)
    assert isinstance(curv, Curvature) and curv.num_data == N
    torch.testing.assert_close(curv.ggn, ref, rtol=1e-10, atol=1e-12)
    diag = _fit("diag", model, x, y, lik, subset=subset, chunk_size=4)
    torch.testing.assert_close(diag.ggn_diag, ref.diagonal(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["gaussian", "categorical"])
def test_ggn_of_linear_model_is_exact_nll_hessian(kind: str) -> None:
    """For f linear in theta the network Hessian term of eq. 2.24 vanishes: GGN = Hessian."""
    torch.manual_seed(1)
    model = nn.Linear(D, C).to(DT).eval()
    lik = _likelihood(kind)
    _, x, y = _data(kind, seed=1)
    subset = select_parameters(model, "all")
    theta = subset.flatten(subset.params(model))

    def nll(flat: Tensor) -> Tensor:
        params = subset.unflatten(flat)
        f = torch.func.functional_call(model, params, (x,))
        return -lik.log_prob(f, y).sum()

    hess = torch.autograd.functional.hessian(nll, theta)
    for identity in (True, False):
        curv = make_curvature("full", model, lik, last_layer_identity=identity)
        curv.update(model, x, y)
        torch.testing.assert_close(curv.ggn, hess, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("structure", ["full", "diag", "lowrank"])
def test_last_layer_identity_equals_generic_path(
    kind: str, structure: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, x, y = _data(kind, seed=2)
    lik = _likelihood(kind)
    opts = {"rank": 2} if structure == "lowrank" else {}
    generic = _fit(
        structure, model, x, y, lik, subset="last_layer", last_layer_identity=False, **opts
    )
    generic_prec = generic.posterior(0.7).precision_dense()

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the generic torch.func path was used")

    import gaussify.curvature.base as base_module
    import gaussify.curvature.lowrank as lowrank_module

    monkeypatch.setattr(base_module, "per_sample_vjp", forbidden)
    monkeypatch.setattr(lowrank_module, "jvp_with_outputs", forbidden)
    monkeypatch.setattr(lowrank_module, "vjp", forbidden)
    fast = _fit(structure, model, x, y, lik, subset="last_layer", **opts)
    torch.testing.assert_close(
        fast.posterior(0.7).precision_dense(), generic_prec, rtol=1e-9, atol=1e-11
    )


def test_last_layer_diag_with_many_classes_needs_no_jacobians(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    num_classes = 2000
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, num_classes)).to(DT).eval()
    x = torch.randn(64, D, dtype=DT)
    y = torch.randint(0, num_classes, (64,))
    import gaussify.curvature.base as base_module

    monkeypatch.setattr(base_module, "per_sample_vjp", None)  # must not be reached
    curv = make_curvature("diag", model, "classification", "last_layer")
    curv.update(model, x, y)
    phi = torch.tanh(model[0](x)).detach()
    lam = torch.softmax(model(x), -1).detach()
    lam = lam - lam.square()
    expected_w = torch.einsum("nc,nd->cd", lam, phi.square()).reshape(-1)
    torch.testing.assert_close(curv.ggn_diag[: num_classes * 8], expected_w)
    torch.testing.assert_close(curv.ggn_diag[num_classes * 8 :], lam.sum(0))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_empirical_fisher_equals_per_sample_gradients(kind: str, subset: str) -> None:
    model, x, y = _data(kind, seed=3)
    lik = _likelihood(kind)
    ref = reference_ef(model, x, y, lik, subset)
    full = _fit("full", model, x, y, lik, subset=subset, ef=True)
    torch.testing.assert_close(full.ggn, ref, rtol=1e-10, atol=1e-12)
    diag = _fit("diag", model, x, y, lik, subset=subset, ef=True)
    torch.testing.assert_close(diag.ggn_diag, ref.diagonal(), rtol=1e-10, atol=1e-12)
    low = _fit("lowrank", model, x, y, lik, subset=subset, ef=True, rank=3)
    evals, _ = low.eigendecomposition()
    torch.testing.assert_close(evals, torch.linalg.eigvalsh(ref).flip(0)[:3], rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("kind", ["categorical", "gaussian"])
def test_mc_diag_converges_to_exact(kind: str) -> None:
    model, x, y = _data(kind, seed=4)
    lik = _likelihood(kind)
    exact = _fit("diag", model, x, y, lik).ggn_diag
    errors = {}
    for samples in (8, 4096):
        gen = torch.Generator().manual_seed(0)
        mc = _fit("diag", model, x, y, lik, mc_samples=samples, generator=gen).ggn_diag
        errors[samples] = float((mc - exact).abs().max() / exact.max())
    assert errors[4096] < 0.03, errors
    assert errors[4096] < errors[8] / 4, errors
    # the same generator seed gives the same estimate; the Monte Carlo full GGN agrees with diag
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    d1 = _fit("diag", model, x, y, lik, mc_samples=3, generator=g1).ggn_diag
    full = _fit("full", model, x, y, lik, mc_samples=3, generator=g2).ggn
    torch.testing.assert_close(d1, full.diagonal(), rtol=1e-10, atol=1e-12)


def test_mc_lowrank_uses_the_same_samples_as_its_diagonal() -> None:
    model, x, y = _data("categorical", seed=5)
    lik = _likelihood("categorical")
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    full = _fit("full", model, x, y, lik, mc_samples=2, generator=g1)
    low = _fit("lowrank", model, x, y, lik, mc_samples=2, generator=g2, rank=100)
    torch.testing.assert_close(
        low.posterior(1.0).precision_dense(), full.posterior(1.0).precision_dense()
    )


# ------------------------------------------------------------------------------ low rank


@pytest.mark.parametrize("kind", KINDS)
def test_lowrank_top_eigenvalues_match_eigvalsh(kind: str) -> None:
    model, x, y = _data(kind, seed=6)
    lik = _likelihood(kind)
    ref = reference_ggn(model, x, lik, "all")
    k = 5
    low = _fit("lowrank", model, x, y, lik, rank=k, chunk_size=5)
    evals, evecs = low.eigendecomposition()
    ref_vals = torch.linalg.eigvalsh(ref)
    torch.testing.assert_close(evals, ref_vals.flip(0)[:k], rtol=1e-9, atol=1e-10)
    # eigenvectors up to sign: G u = s u
    torch.testing.assert_close(ref @ evecs, evecs * evals, rtol=1e-8, atol=1e-9)
    # the diagonal remainder keeps the exact diagonal of G
    post = low.posterior(0.3)
    torch.testing.assert_close(
        post.precision_dense().diagonal(), ref.diagonal() + 0.3, rtol=1e-10, atol=1e-10
    )
    assert torch.linalg.matrix_rank(post.precision_dense() - torch.diag(post.diag)) == k


def test_lowrank_full_rank_equals_full() -> None:
    model, x, y = _data("categorical", seed=7)
    lik = _likelihood("categorical")
    full = _fit("full", model, x, y, lik)
    p = full.num_params
    low = _fit("lowrank", model, x, y, lik, rank=p)
    for prior in (0.5, torch.rand(p, dtype=DT) + 0.1):
        a, b = full.posterior(prior, 2.0), low.posterior(prior, 2.0)
        torch.testing.assert_close(b.logdet(), a.logdet(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(
            b.covariance_dense(), a.covariance_dense(), rtol=1e-8, atol=1e-10
        )


# ------------------------------------------------------------------------------ posteriors


def _posteriors(prior: object, scale: float = 1.7) -> dict[str, PosteriorPrecision]:
    """The four posterior-precision implementations on one small problem."""
    model, x, y = _data("categorical", seed=8, n=6)
    lik = _likelihood("categorical")
    full = _fit("full", model, x, y, lik)
    return {
        "eigen": _eig(full).posterior(prior, scale),
        "cholesky": FullGGN.posterior(_no_eig(full), prior, scale),
        "diag": _fit("diag", model, x, y, lik).posterior(prior, scale),
        "lowrank": _fit("lowrank", model, x, y, lik, rank=4).posterior(prior, scale),
    }


def _no_eig(curv: FullGGN) -> FullGGN:
    curv.eig_cache = False
    return curv


def _eig(curv: FullGGN) -> FullGGN:
    curv.eig_cache = True
    return curv


PRIORS = {
    "scalar": 0.8,
    "per_tensor": torch.tensor([0.5, 1.0, 2.0, 0.3, 1.5, 0.9, 1.1, 0.7], dtype=DT),
    "per_parameter": None,
}


def _prior(name: str, num_params: int) -> object:
    if name == "per_parameter":
        return torch.linspace(0.2, 3.0, num_params, dtype=DT)
    return PRIORS[name]


@pytest.mark.parametrize("prior_name", list(PRIORS))
def test_posterior_precision_against_dense_linear_algebra(prior_name: str) -> None:
    model, _, _ = _data("categorical", seed=8, n=6)
    p = sum(q.numel() for q in model.parameters())
    posts = _posteriors(_prior(prior_name, p))
    assert isinstance(posts["eigen"], EigenPrecision) == (prior_name == "scalar")
    assert isinstance(posts["cholesky"], CholeskyPrecision)
    g = torch.Generator().manual_seed(0)
    jac = torch.randn(5, C, p, generator=g, dtype=DT)
    v = torch.randn(2, 3, p, generator=g, dtype=DT)
    for name, post in posts.items():
        assert isinstance(post, PosteriorPrecision), name
        assert post.num_params == p
        prec = post.precision_dense()
        torch.testing.assert_close(prec, prec.T, rtol=0, atol=1e-12)
        cov = torch.linalg.inv(prec)
        torch.testing.assert_close(post.logdet(), torch.logdet(prec), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(post.covariance_dense(), cov, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(post.covariance_diag(), cov.diagonal(), rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(
            post.solve(v), torch.linalg.solve(prec, v.reshape(-1, p).T).T.reshape(2, 3, p)
        )
        fcov = jac @ cov @ jac.transpose(1, 2)
        torch.testing.assert_close(post.functional_cov(jac), fcov, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(
            post.functional_var(jac), fcov.diagonal(dim1=1, dim2=2), rtol=1e-9, atol=1e-11
        )
    # all full-matrix views agree with each other
    torch.testing.assert_close(
        posts["eigen"].precision_dense(), posts["cholesky"].precision_dense()
    )
    torch.testing.assert_close(
        posts["eigen"].logdet(), posts["cholesky"].logdet(), rtol=1e-11, atol=1e-11
    )


_SAMPLING_POSTERIORS = _posteriors(0.8)


@pytest.mark.parametrize("name", ["eigen", "cholesky", "diag", "lowrank"])
def test_posterior_samples_have_the_covariance(name: str) -> None:
    post = _SAMPLING_POSTERIORS[name]
    n = 20000
    samples = post.sample(n, generator=torch.Generator().manual_seed(1))
    assert samples.shape == (n, post.num_params) and samples.dtype == DT
    cov = post.covariance_dense()
    emp = samples.T @ samples / n
    # standard error of a sample second moment of a zero-mean Gaussian
    se = ((cov.diagonal()[:, None] * cov.diagonal()[None, :] + cov.square()) / n).sqrt()
    assert ((emp - cov).abs() < 5 * se + 1e-12).all(), float(((emp - cov).abs() / se).max())
    again = post.sample(n, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(again, samples, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["eigen", "cholesky", "diag", "lowrank"])
@pytest.mark.parametrize("prior_name", ["scalar", "per_tensor"])
def test_logdet_gradients_match_finite_differences(name: str, prior_name: str) -> None:
    model, x, y = _data("categorical", seed=9, n=6)
    lik = _likelihood("categorical")
    p = sum(q.numel() for q in model.parameters())
    base_prior = torch.as_tensor(_prior(prior_name, p), dtype=DT)
    structure = {"eigen": "full", "cholesky": "full"}.get(name, name)
    opts = {"rank": 4} if name == "lowrank" else {"eig_cache": False} if name == "cholesky" else {}
    curv = _fit(structure, model, x, y, lik, **opts)

    def objective(log_prior: Tensor, log_scale: Tensor) -> Tensor:
        return curv.posterior(log_prior.exp(), log_scale.exp()).logdet()

    log_prior = base_prior.log().clone().requires_grad_(True)
    log_scale = torch.tensor(0.3, dtype=DT, requires_grad=True)
    grad_prior, grad_scale = torch.autograd.grad(
        objective(log_prior, log_scale), [log_prior, log_scale]
    )
    h = 1e-6
    with torch.no_grad():
        fd_prior = torch.zeros_like(log_prior)
        for i in range(log_prior.numel()):
            e = torch.zeros_like(log_prior).reshape(-1)
            e[i] = h
            e = e.reshape(log_prior.shape)
            fd_prior.reshape(-1)[i] = (
                objective(log_prior + e, log_scale) - objective(log_prior - e, log_scale)
            ) / (2 * h)
        fd_scale = (objective(log_prior, log_scale + h) - objective(log_prior, log_scale - h)) / (
            2 * h
        )
    torch.testing.assert_close(grad_prior, fd_prior, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_scale, fd_scale, rtol=1e-6, atol=1e-7)


def test_eig_cached_logdet_equals_cholesky_and_is_cached() -> None:
    model, x, y = _data("bernoulli", seed=10)
    curv = _eig(_fit("full", model, x, y, _likelihood("bernoulli")))
    p = curv.num_params
    for prior, scale in [(0.1, 1.0), (3.0, 0.25), (1e-3, 10.0)]:
        eig = curv.posterior(prior, scale)
        chol = curv.posterior(torch.full((p,), prior, dtype=DT), scale)
        assert isinstance(eig, EigenPrecision) and isinstance(chol, CholeskyPrecision)
        torch.testing.assert_close(eig.logdet(), chol.logdet(), rtol=1e-11, atol=1e-10)
    cached = curv.eigendecomposition()
    assert curv.eigendecomposition() is cached
    curv.update(model, x[:2], y[:2])
    assert curv.eigendecomposition() is not cached


def test_eig_cache_auto_uses_cholesky_once_then_the_eigendecomposition() -> None:
    # default eig_cache=None: a one-off scalar-prior posterior is a Cholesky factorisation;
    # the second since the last update (repeated evaluations) computes and caches eigh
    model, x, y = _data("bernoulli", seed=10)
    curv = _fit("full", model, x, y, _likelihood("bernoulli"))
    assert curv.eig_cache is None
    first, second = curv.posterior(0.5), curv.posterior(0.7)
    assert isinstance(first, CholeskyPrecision) and isinstance(second, EigenPrecision)
    torch.testing.assert_close(curv.posterior(0.5).logdet(), first.logdet(), rtol=1e-11, atol=1e-10)
    curv.update(model, x[:2], y[:2])
    assert isinstance(curv.posterior(0.5), CholeskyPrecision)
    curv.eigendecomposition()  # cached by someone else (e.g. tuning with the correction)
    assert isinstance(curv.posterior(0.5), EigenPrecision)


@pytest.mark.parametrize("structure", ["full", "diag", "lowrank"])
def test_state_dict_round_trip(structure: str, tmp_path: object) -> None:
    model, x, y = _data("gaussian", seed=11)
    lik = _likelihood("gaussian")
    opts = {"rank": 3} if structure == "lowrank" else {}
    curv = _fit(structure, model, x, y, lik, **opts)
    path = f"{tmp_path}/curv.pt"
    torch.save(curv.state_dict(), path)
    fresh = make_curvature(structure, model, lik, **opts)
    fresh.load_state_dict(torch.load(path, weights_only=True))
    assert fresh.num_data == N
    a, b = curv.posterior(0.5, 2.0), fresh.posterior(0.5, 2.0)
    torch.testing.assert_close(a.precision_dense(), b.precision_dense(), rtol=0, atol=0)
    bad = dict(curv.state_dict())
    key = next(k for k in bad if k != "num_data")
    bad[key] = bad[key][..., :-1]
    with pytest.raises(ValueError, match=r"invalid state: '\w+': expected shape"):
        fresh.load_state_dict(bad)


def test_float32_model_gives_float32_curvature() -> None:
    torch.manual_seed(0)
    model = SkipNet().eval()
    x, y = torch.randn(N, D), torch.randint(0, C, (N,))
    for structure in ("full", "diag", "lowrank"):
        opts = {"rank": 2} if structure == "lowrank" else {}
        curv = make_curvature(structure, model, "classification", **opts)
        curv.update(model, x, y)
        post = curv.posterior(1.0)
        assert post.precision_dense().dtype == torch.float32
        assert post.sample(2).dtype == torch.float32


def test_registry_lists_structures_and_loads_classes() -> None:
    assert {"full", "diag", "lowrank", "kron"} <= set(available_structures())
    assert get_curvature_class("full") is FullGGN
    assert get_curvature_class("diag") is DiagGGN
    assert get_curvature_class("lowrank") is LowRankGGN
    register_curvature("test-missing", "gaussify.curvature.does_not_exist")
    with pytest.raises(ValueError, match="'test-missing' is registered but its module"):
        get_curvature_class("test-missing")
    register_curvature("test-diag-alias", DiagGGN)
    model, _, _ = _data("gaussian")
    assert isinstance(make_curvature("test-diag-alias", model, "regression"), DiagGGN)


# ------------------------------------------------------------------------------ errors


def test_errors_name_the_argument() -> None:
    model, x, y = _data("categorical")
    with pytest.raises(ValueError, match=r"structure: unknown curvature structure 'dense'"):
        make_curvature("dense", model, "classification")
    with pytest.raises(ValueError, match="subset"):
        make_curvature("full", nn.Sequential(nn.Tanh()), "classification")
    with pytest.raises(ValueError, match="subset"):
        make_curvature("diag", model, "classification", ["nope"])
    with pytest.raises(ValueError, match="mc_samples"):
        make_curvature("diag", model, "classification", ef=True, mc_samples=3)
    with pytest.raises(ValueError, match="rank"):
        make_curvature("lowrank", model, "classification", rank=0)
    with pytest.raises(ValueError, match="likelihood"):
        make_curvature("full", model, "poisson")
    curv = _fit("full", model, x, y, Categorical())
    with pytest.raises(ValueError, match="prior_precision"):
        curv.posterior(-1.0)
    with pytest.raises(ValueError, match="prior_precision"):
        curv.posterior(torch.ones(5, dtype=DT))
    with pytest.raises(ValueError, match="scale"):
        curv.posterior(1.0, 0.0)
    with pytest.raises(ValueError, match="y: batch size"):
        curv.update(model, x, y[:-1])
    bn = nn.Sequential(nn.Linear(D, C), nn.BatchNorm1d(C)).to(DT).train()
    with pytest.raises(ValueError, match=r"'1' \(BatchNorm1d\) is in training mode"):
        make_curvature("diag", bn, "classification").update(bn, x, y)


def test_nan_jacobian_is_reported_during_update() -> None:
    class Sqrt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.zeros(C, dtype=DT))

        def forward(self, h: Tensor) -> Tensor:
            return h + h * self.gain.square().sqrt()

    model = nn.Sequential(nn.Linear(D, C), Sqrt()).to(DT).eval()
    x, y = torch.randn(N, D, dtype=DT), torch.randint(0, C, (N,))
    for structure in ("full", "diag"):
        curv = make_curvature(structure, model, "classification")
        with pytest.raises(ValueError, match=r"NaN Jacobian in parameter '1.gain'"):
            curv.update(model, x, y)


def test_non_positive_definite_precision_raises() -> None:
    """A corrupted (indefinite) curvature loaded from disk cannot silently give a posterior."""
    model, x, y = _data("gaussian", seed=12)
    lik = _likelihood("gaussian")
    curv = _fit("full", model, x, y, lik)
    state = curv.state_dict()
    p = curv.num_params
    u = torch.randn(p, dtype=DT)
    state["ggn"] = state["ggn"] - 1e3 * torch.outer(u, u)
    curv.load_state_dict(state)
    with pytest.raises(ValueError, match="posterior precision is not positive definite"):
        curv.posterior(1.0).logdet()
    with pytest.raises(ValueError, match="posterior precision is not positive definite"):
        curv.posterior(torch.ones(p, dtype=DT)).logdet()
    diag = _fit("diag", model, x, y, lik)
    diag.load_state_dict({"ggn_diag": -torch.ones(p, dtype=DT), "num_data": torch.tensor(N)})
    with pytest.raises(ValueError, match="posterior precision is not positive definite"):
        diag.posterior(1.0)


def test_cholesky_jitter_warns_once_with_its_size() -> None:
    v = torch.tensor([1.0, 2.0, 3.0], dtype=DT)
    singular = torch.outer(v, v)  # PSD, rank one: plain Cholesky fails
    with pytest.warns(RuntimeWarning, match=r"added jitter [0-9.e-]+"):
        factor = cholesky_psd(singular)
    torch.testing.assert_close(factor @ factor.T, singular, rtol=0, atol=1e-8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cholesky_psd(singular + torch.eye(3, dtype=DT))
    with pytest.raises(ValueError, match="not positive definite"):
        cholesky_psd(-singular)


def test_lowrank_refuses_changed_parameters_and_loaded_updates() -> None:
    model, x, y = _data("categorical", seed=13)
    low = make_curvature("lowrank", model, "classification", rank=2)
    low.update(model, x, y)
    with torch.no_grad():
        model.head.bias.add_(1.0)
    with pytest.raises(ValueError, match="parameters changed"):
        low.posterior(1.0)
    model2, _, _ = _data("categorical", seed=13)
    low2 = make_curvature("lowrank", model2, "classification", rank=2)
    low2.update(model2, x, y)
    fresh = make_curvature("lowrank", model2, "classification", rank=2)
    fresh.load_state_dict(low2.state_dict())
    with pytest.raises(ValueError, match="loaded from a state_dict"):
        fresh.update(model2, x, y)


def test_chunk_size_does_not_change_results() -> None:
    model, x, y = _data("categorical", seed=14)
    lik = _likelihood("categorical")
    a = _fit("full", model, x, y, lik, chunk_size=1).ggn
    b = _fit("full", model, x, y, lik).ggn
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    assert math.isfinite(float(a.sum()))
    assert jacobian_module.DEFAULT_CHUNK_ELEMENTS > 0
