"""Numerical robustness of the weight-space Laplace and its dense / low-rank curvatures.

Oracles: a freshly constructed Laplace with the new hyperparameters (setting one after ``fit``
must give the same posterior); the float64 model for float32 log-determinants; closed-form
log det of an eigendecomposition; the float64 logistic MAP for float32 refinement; the
curvature of the good batches alone after a failing batch; torch.autograd for the fused
log-likelihood / gradient pass, and counted forward passes for its cost.
"""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import gaussify as gs
from gaussify.curvature import make_curvature
from gaussify.curvature.full import CholeskyPrecision, EigenPrecision

DT = torch.float64


def _classification(n: int = 60, seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=DT)
    y = (x[:, 0] + x[:, 1] ** 2 > 0.5).long() + (x[:, 2] > 1).long()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT).eval()
    return model, x, y


def _regression(n: int = 50, seed: int = 1) -> tuple[nn.Module, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g, dtype=DT)
    y = torch.sin(x[:, :1]) + 0.1 * torch.randn(n, 1, generator=g, dtype=DT)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 1)).to(DT).eval()
    return model, x, y


# --------------------------------------------------------------------------- 1. stale posterior


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
def test_setting_prior_precision_after_fit_equals_a_fresh_posterior(structure: str) -> None:
    model, x, y = _classification()
    la = gs.Laplace(model, "classification", structure, prior_precision=1.0).fit((x, y))
    la.predict(x[:4])  # builds and caches the posterior at prior 1
    la.prior_precision = 7.0
    fresh = gs.Laplace(model, "classification", structure, prior_precision=7.0).fit((x, y))
    torch.testing.assert_close(la.posterior_precision, fresh.posterior_precision)
    torch.testing.assert_close(la.predict(x[:4]).probs, fresh.predict(x[:4]).probs)
    torch.testing.assert_close(la.log_marginal_likelihood(), fresh.log_marginal_likelihood())


def test_setting_sigma_noise_and_temperature_after_fit_equals_a_fresh_posterior() -> None:
    model, x, y = _regression()
    la = gs.Laplace(model, "regression", "full", prior_precision=2.0, sigma_noise=1.0)
    la.fit((x, y)).predict(x[:3])
    la.sigma_noise = 0.3
    la.temperature = 0.5
    fresh = gs.Laplace(
        model, "regression", "full", prior_precision=2.0, sigma_noise=0.3, temperature=0.5
    ).fit((x, y))
    for a, b in [(la.predict(x[:3]), fresh.predict(x[:3]))]:
        torch.testing.assert_close(a.mean, b.mean)
        torch.testing.assert_close(a.var, b.var)
    torch.testing.assert_close(la.log_marginal_likelihood(), fresh.log_marginal_likelihood())
    # a refit uses the new noise: the curvature is built with the likelihood's sigma
    la.fit((x, y))
    torch.testing.assert_close(la.posterior_precision, fresh.posterior_precision)
    torch.testing.assert_close(la.log_marginal_likelihood(), fresh.log_marginal_likelihood())


def test_hyperparameter_setters_validate() -> None:
    model, x, y = _classification()
    la = gs.Laplace(model, "classification", "diag").fit((x, y))
    with pytest.raises(ValueError, match="prior_precision: must be finite and > 0"):
        la.prior_precision = -1.0
    with pytest.raises(ValueError, match="prior_precision: expected a scalar"):
        la.prior_precision = torch.ones(5, dtype=DT)
    with pytest.raises(ValueError, match="temperature: must be a finite number > 0"):
        la.temperature = 0.0
    with pytest.raises(ValueError, match="sigma_noise: must be finite and > 0"):
        la.sigma_noise = float("nan")
    assert float(la.prior_precision) == 1.0 and la.temperature == 1.0


# --------------------------------------------------------------------------- 2. float32 logdet


def test_float32_full_logdet_matches_the_float64_model() -> None:
    # The GGN's eigenvalues spread over ~15 decades (58 of 760 below 1e-4): float32 eigh
    # resolves the small ones only to ~eps * lambda_max, which moved log det A by 0.65 nat
    # at prior 1e-4 (0.05 at 1e-3). Decomposing in float64 leaves only the error of storing
    # G in float32 (oracle: float64 eigenvalues of that same float32 G), and stays close to
    # the float64 model's value.
    d = gs.data.load("digits", seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 10), nn.Tanh(), nn.Linear(10, 10)).eval()
    x, y = d.x_train, d.y_train
    model64 = copy.deepcopy(model).double()
    curv32 = make_curvature("full", model, "classification")
    curv32.update(model, x, y)
    curv64 = make_curvature("full", model64, "classification")
    curv64.update(model64, x.double(), y)
    evals, evecs = curv32.eigendecomposition()
    assert evals.dtype == torch.float64 and evecs.dtype == torch.float32
    stored = torch.linalg.eigvalsh(curv32.ggn.double()).clamp_min(0)
    for prior, bound in [(1e-4, 0.15), (1e-3, 0.015), (1e-2, 2e-3), (1.0, 1e-3)]:
        post = curv32.posterior(prior)
        assert isinstance(post, EigenPrecision)
        logdet = post.logdet()
        assert logdet.dtype == torch.float32
        same_g = float((stored + prior).log().sum())
        assert abs(float(logdet) - same_g) < 2e-3 * max(1.0, abs(same_g) / 100)
        exact = float(curv64.posterior(prior).logdet())
        assert abs(float(logdet) - exact) < bound, (prior, float(logdet) - exact)
        v = torch.randn(3, curv32.num_params)
        assert post.solve(v).dtype == torch.float32
        assert post.covariance_diag().dtype == torch.float32
    # per-parameter priors take the Cholesky route: factorised in float64 too (a float32
    # Cholesky was off by 0.20 nat at 1e-4 and 0.014 at 1e-3)
    p = curv32.num_params
    # The float64 factorisation leaves only the error of storing G in float32, as on the
    # eigen route; its oracle is the float64 log det of that float32 G, without the eigen
    # route's clamp of round-off eigenvalues (-eps * lambda_max) to zero.
    unclamped = torch.linalg.eigvalsh(curv32.ggn.double())
    for prior, bound in [(1e-4, 0.15), (1e-3, 0.015), (1.0, 1e-3)]:
        chol = curv32.posterior(torch.full((p,), prior))
        assert isinstance(chol, CholeskyPrecision)
        assert chol.logdet().dtype == torch.float32 and chol.cholesky.dtype == torch.float32
        same_g = float((unclamped + prior).log().sum())
        assert abs(float(chol.logdet()) - same_g) < 2e-3 * max(1.0, abs(same_g) / 100)
        exact = float(curv64.posterior(prior).logdet())
        assert abs(float(chol.logdet()) - exact) < bound, (prior, float(chol.logdet()) - exact)


def test_failed_eigendecomposition_falls_back_to_cholesky(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x, y = _classification()
    curv = make_curvature("full", model, "classification", eig_cache=True)
    curv.update(model, x, y)
    curv.posterior(0.5)  # caches the eigendecomposition
    curv.update(model, x[:1], y[:1])
    curv.update(model, x[:1] * 0, y[:1])  # the cached decomposition is dropped by an update
    expected = make_curvature("full", model, "classification")
    for xs, ys in [(x, y), (x[:1], y[:1]), (x[:1] * 0, y[:1])]:
        expected.update(model, xs, ys)
    reference = expected.posterior(torch.full((curv.num_params,), 0.5, dtype=DT)).logdet()

    def fail(*args: object, **kwargs: object) -> None:
        raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "eigh", fail)
    with pytest.warns(RuntimeWarning, match="eigendecomposition failed"):
        post = curv.posterior(0.5)
    assert isinstance(post, CholeskyPrecision)
    torch.testing.assert_close(post.logdet(), reference)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the failure is remembered until the next update
        assert isinstance(curv.posterior(2.0), CholeskyPrecision)


def test_non_finite_ggn_raises_before_decomposing() -> None:
    model, x, y = _classification()
    curv = make_curvature("full", model, "classification")
    curv.update(model, x, y)
    state = curv.state_dict()
    state["ggn"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="'ggn': contains NaN or inf"):
        curv.load_state_dict(state)  # a saved NaN GGN is refused at load (gaussify.state)
    curv.ggn = state["ggn"]  # one that arises otherwise is caught before decomposing
    with pytest.raises(ValueError, match="GGN contains NaN or inf"):
        curv.posterior(1.0)


# --------------------------------------------------------------------------- 3. round-off


def _orthogonal(p: int, dtype: torch.dtype) -> Tensor:
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(p, p, generator=g, dtype=DT))
    return q.to(dtype)


def test_eigen_precision_clamps_round_off_negative_eigenvalues() -> None:
    p = 50
    vecs = _orthogonal(p, torch.float32)
    evals = torch.linspace(0, 1e3, p, dtype=torch.float32)
    # float32 round-off of a PSD G: -P eps lambda_max = -5.96e-3 is the bound
    evals[:3] = torch.tensor([-1e-3, -3e-3, 0.0])
    prior = torch.tensor(1e-4, dtype=torch.float32)
    post = EigenPrecision(vecs, evals, prior, torch.tensor(1.0, dtype=torch.float32))
    exact = (evals.double().clamp_min(0) + 1e-4).log().sum()
    torch.testing.assert_close(post.logdet().double(), exact, rtol=1e-6, atol=0)
    assert torch.isfinite(post.covariance_diag()).all()


@pytest.mark.parametrize("prior", [1e-4, 10.0])
def test_eigen_precision_raises_on_truly_negative_eigenvalues(prior: float) -> None:
    p = 50
    vecs = _orthogonal(p, torch.float32)
    evals = torch.linspace(0, 1e3, p, dtype=torch.float32)
    evals[0] = -1.0  # far below -P eps lambda_max: G is not PSD (a corrupted state)
    with pytest.raises(ValueError, match="posterior precision is not positive definite"):
        EigenPrecision(vecs, evals, torch.tensor(prior, dtype=torch.float32), torch.tensor(1.0))


# --------------------------------------------------------------------------- 4. refine


def _logistic(dtype: torch.dtype, n: int = 2000) -> tuple[Tensor, Tensor]:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 3))
    y = (x @ np.array([1.0, -2.0, 0.5]) + rng.normal(size=n) > 0).astype(float)
    return torch.from_numpy(x).to(dtype), torch.from_numpy(y).to(dtype)


def _refined(dtype: torch.dtype) -> tuple[gs.Laplace, int]:
    x, y = _logistic(dtype)
    model = nn.Linear(3, 1, bias=False).to(dtype)
    with torch.no_grad():
        model.weight.fill_(0.1)
    la = gs.Laplace(model, "binary", "full", prior_precision=2.0).fit((x, y))
    passes = []
    accumulate = la._accumulate

    def counted(*args: object, **kwargs: object) -> None:
        passes.append(1)
        accumulate(*args, **kwargs)  # type: ignore[arg-type]

    la._accumulate = counted  # type: ignore[method-assign]
    la.refine((x, y))
    return la, len(passes)


def test_float32_refine_stops_early_at_the_float64_map() -> None:
    la64, passes64 = _refined(DT)
    la32, passes32 = _refined(torch.float32)
    # Newton converges quadratically: a handful of GGN passes, not max_iter = 50
    assert passes32 <= 10 and passes64 <= 10, (passes32, passes64)
    torch.testing.assert_close(la32.mean.double(), la64.mean, rtol=2e-6, atol=1e-6)
    # the float64 mode is stationary to round-off
    b = la64._grad - 2.0 * la64.mean
    assert float(b.abs().max()) < 1e-9


def test_refine_validates_its_arguments() -> None:
    x, y = _logistic(DT, n=20)
    la = gs.Laplace(nn.Linear(3, 1, bias=False).double(), "binary", "full").fit((x, y))
    with pytest.raises(ValueError, match="tol: expected a finite number >= 0"):
        la.refine((x, y), tol=-1.0)
    with pytest.raises(ValueError, match="max_iter: expected an integer >= 0"):
        la.refine((x, y), max_iter=-2)


# --------------------------------------------------------------------------- 5. failed updates


class RootNet(nn.Module):
    """f = W2 sqrt|W1 x| + b2: finite everywhere, but the Jacobian in W1 is NaN at x = 0
    (0 * inf), so one sample can make a batch fail after the others succeeded."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4, bias=False)
        self.out = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.inp(x).abs().sqrt())


def _snapshot(curv: object) -> dict[str, object]:
    state: dict[str, object] = {"num_data": curv.num_data}  # type: ignore[attr-defined]
    for key in ("ggn", "ggn_diag"):
        if hasattr(curv, key):
            state[key] = getattr(curv, key).clone()
    if hasattr(curv, "_batches"):
        state["batches"] = len(curv._batches)  # type: ignore[attr-defined]
    return state


@pytest.mark.parametrize("structure", ["full", "diag", "lowrank"])
@pytest.mark.parametrize("bad", ["nan_input", "nan_jacobian"])
def test_a_failing_batch_leaves_the_curvature_unchanged(structure: str, bad: str) -> None:
    torch.manual_seed(0)
    model = RootNet().double().eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, generator=g, dtype=DT) + 0.1
    y = torch.randint(0, 2, (8,), generator=g)
    # chunk_size=2: the bad sample is in the last chunk, after three good ones were summed
    options = {"rank": 3} if structure == "lowrank" else {}
    curv = make_curvature(structure, model, "classification", chunk_size=2, **options)
    curv.update(model, x, y)
    before = _snapshot(curv)
    x_bad = x.clone()
    x_bad[-1] = float("nan") if bad == "nan_input" else 0.0
    with pytest.raises(ValueError, match=r"NaN|infinite"):
        curv.update(model, x_bad, y)
    after = _snapshot(curv)
    assert after.keys() == before.keys()
    for key, value in before.items():
        if isinstance(value, Tensor):
            torch.testing.assert_close(after[key], value, rtol=0, atol=0)
        else:
            assert after[key] == value, key
    reference = make_curvature(structure, model, "classification", **options)
    reference.update(model, x, y)
    torch.testing.assert_close(
        curv.posterior(1.0).precision_dense(), reference.posterior(1.0).precision_dense()
    )


@pytest.mark.parametrize("structure", ["full", "kron", "diag", "lowrank"])
def test_a_failing_refit_leaves_the_laplace_unchanged(structure: str) -> None:
    model, x, y = _classification()
    options = {"rank": 4} if structure == "lowrank" else {}
    la = gs.Laplace(model, "classification", structure, **options).fit((x, y))
    precision, evidence = la.posterior_precision.clone(), la.log_marginal_likelihood()
    with torch.no_grad():
        model[0].bias.add_(0.5)  # a different expansion point that the failed fit must not keep
    x_bad = x.clone()
    x_bad[5] = float("nan")
    with pytest.raises(ValueError, match=r"NaN|infinite"):
        la.fit((x_bad, y))
    torch.testing.assert_close(la.posterior_precision, precision, rtol=0, atol=0)
    torch.testing.assert_close(la.log_marginal_likelihood(), evidence, rtol=0, atol=0)
    assert la.num_data == len(x)
    with torch.no_grad():
        model[0].bias.sub_(0.5)
    original = la.subset.flatten(la.subset.params(model))
    torch.testing.assert_close(la.mean, original, rtol=0, atol=0)
    torch.testing.assert_close(la.theta_star, original, rtol=0, atol=0)


# --------------------------------------------------------------------------- 7. fused passes


class Counter:
    def __init__(self, module: nn.Module) -> None:
        self.calls = 0
        module.register_forward_pre_hook(self._hook)

    def _hook(self, *_: object) -> None:
        self.calls += 1


@pytest.mark.parametrize(
    ("structure", "subset"),
    [
        ("kron", "all"),
        ("diag", "all"),
        ("full", "all"),
        ("diag", "last_layer"),
        ("full", "last_layer"),
        ("kron", "last_layer"),
    ],
)
def test_fit_adds_at_most_one_forward_pass_and_matches_autograd(
    structure: str, subset: str
) -> None:
    model, x, y = _classification()
    counter = Counter(model)
    curv = make_curvature(structure, model, "classification", subset)
    curv.update(model, x, y)
    own = counter.calls
    counter.calls = 0
    la = gs.Laplace(model, "classification", structure, subset, prior_precision=1.0)
    la.fit((x, y), batch_size=len(x))
    extra = counter.calls - own
    # generic path: one forward (with its backward) for log p(y | f) and J^T r; last-layer
    # path: none, every structure keeps its outputs and features (full, diag, kron); the
    # diagonal and KFAC of a chain: none either, J^T r is one more vector of their own
    # backward passes
    expected = 1 if subset == "all" and structure == "full" else 0
    assert extra == expected, (extra, own)
    # oracle: autograd on the summed log-likelihood
    names = la.subset.names
    params = [dict(model.named_parameters())[n] for n in names]
    log_lik = torch.distributions.Categorical(logits=model(x)).log_prob(y).sum()
    grads = torch.autograd.grad(log_lik, params)
    torch.testing.assert_close(la._log_lik, log_lik.detach())
    torch.testing.assert_close(la._grad, torch.cat([gr.reshape(-1) for gr in grads]))
    assert math.isfinite(float(la.log_marginal_likelihood()))


# --------------------------------------------------------------------------- 8. memory


def test_last_layer_diag_batch_that_overflows_leaves_the_curvature_unchanged() -> None:
    """The last-layer diagonal is added in place only when rows * max|diag M| * max phi^2
    cannot overflow; features of 1e20 in float32 (phi^2 = inf) take the checked temporary
    instead, raise, and leave the sum of the good batches untouched, which equals a
    curvature of those batches summed in two other batches (Gaussian likelihood: diag M = 1,
    so the GGN diagonal is [sum_n phi_n^2, N] per output)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).eval()  # float32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, generator=g)
    y = torch.randn(16, 2, generator=g)
    curv = make_curvature("diag", model, "regression", "last_layer", chunk_size=4)
    curv.update(model, x, y)
    before = curv.ggn_diag.clone()
    with pytest.raises(ValueError, match="NaN or infinite"):
        curv.update(model, 1e20 * x, y)
    torch.testing.assert_close(curv.ggn_diag, before, rtol=0, atol=0)
    assert curv.num_data == 16
    with torch.no_grad():
        phi = model[0](x)
    closed = torch.cat([phi.square().sum(0).repeat(2), torch.full((2,), 16.0)])
    torch.testing.assert_close(before, closed, rtol=1e-6, atol=0)
    reference = make_curvature("diag", model, "regression", "last_layer", chunk_size=4)
    reference.update(model, x[:8], y[:8])
    reference.update(model, x[8:], y[8:])
    torch.testing.assert_close(reference.ggn_diag, before, rtol=1e-6, atol=0)


def test_scalar_prior_mean_is_one_number_and_round_trips() -> None:
    """A scalar prior mean is a broadcast view of one number (no P-sized vector), it enters
    the evidence as m0 * 1, and a saved state restores it (weights_only) as one number."""
    import io

    model, x, y = _classification()
    la = gs.Laplace(model, "classification", "diag", prior_mean=0.3)
    p = la.subset.num_params
    assert la.prior_mean.shape == (p,)
    assert la.prior_mean.untyped_storage().nbytes() == la.prior_mean.element_size()
    torch.testing.assert_close(la.mean, la.subset.flatten(la.subset.params(model)))
    la.fit((x, y))
    dense = gs.Laplace(model, "classification", "diag", prior_mean=torch.full((p,), 0.3, dtype=DT))
    dense.fit((x, y))
    torch.testing.assert_close(la.log_marginal_likelihood(), dense.log_marginal_likelihood())
    buffer = io.BytesIO()
    torch.save(la.state_dict(), buffer)
    buffer.seek(0)
    restored = gs.Laplace(model, "classification", "diag")
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.prior_mean.untyped_storage().nbytes() == la.prior_mean.element_size()
    torch.testing.assert_close(restored.prior_mean, dense.prior_mean)
