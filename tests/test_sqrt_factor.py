"""The structured square root of Lambda (diag(s) - q s^T) on the batched backward route:
equal to the likelihoods' dense ``hessian_sqrt`` and its products in float64, and the
diagonal GGN / KFAC factors it gives equal to the dense vectors' route and a brute-force
Jacobian GGN, within the memory rule."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

import gaussify.curvature.base as cbase
import gaussify.curvature.kron as ckron
from gaussify.curvature import make_curvature
from gaussify.curvature.batched_backward import backward_peak, chain_forward, module_chain
from gaussify.curvature.sqrt_factor import SqrtFactor, sqrt_factor
from gaussify.likelihoods import (
    Bernoulli,
    Categorical,
    Gaussian,
    HeteroscedasticGaussian,
)

alloc_peak = runpy.run_path(
    str(Path(__file__).resolve().parents[1] / "benchmarks" / "curvature_fits.py")
)["alloc_peak"]

LIKELIHOODS = [
    Categorical(),
    Gaussian(torch.tensor([0.5, 2.0, 1.0, 0.7, 1.3], dtype=torch.float64)),
    Bernoulli(),
    HeteroscedasticGaussian(),
]


def outputs(c: int = 5, n: int = 6) -> torch.Tensor:
    return torch.randn(n, c, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


@pytest.mark.parametrize("lik", LIKELIHOODS[1:], ids=lambda x: type(x).__name__)
def test_diagonal_factor_is_the_likelihoods_hessian_sqrt(lik: object) -> None:
    """For a diagonal Lambda, dense() is (hessian_sqrt(f))^T, the output vectors
    u_k = L[:, k], in float64; a group of columns / rows is the same columns / rows of L."""
    c = 6 if isinstance(lik, HeteroscedasticGaussian) else 5
    f = outputs(c)
    fac = sqrt_factor(lik, f)
    assert isinstance(fac, SqrtFactor)
    dense = lik.hessian_sqrt(f).transpose(1, 2)  # type: ignore[attr-defined]
    torch.testing.assert_close(fac.dense(), dense, rtol=0, atol=1e-15)
    torch.testing.assert_close(fac.columns(1, 4).dense(), dense[:, 1:4], rtol=0, atol=1e-15)
    torch.testing.assert_close(fac.rows(slice(2, 5)).dense(), dense[2:5], rtol=0, atol=1e-15)


@pytest.mark.parametrize("c", [2, 3, 10])
def test_softmax_factor_has_c_minus_1_vectors_whose_gram_is_lambda(c: int) -> None:
    """Categorical: C - 1 vectors with sum_k u_k u_k^T = diag(p) - p p^T in float64, also for
    extreme probabilities (the last class near 1 or near 0, outputs spread over +-30)."""
    f = outputs(c, n=8)
    f[0, -1] = 30.0  # p_C ~ 1
    f[1, -1] = -30.0  # p_C ~ 0
    f[2] = torch.linspace(-30, 30, c, dtype=torch.float64)
    fac = sqrt_factor(Categorical(), f)
    assert isinstance(fac, SqrtFactor)
    assert fac.shape == (8, c - 1, c)
    dense = fac.dense()
    torch.testing.assert_close(dense.mT @ dense, Categorical().hessian(f), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("lik", LIKELIHOODS, ids=lambda x: type(x).__name__)
@pytest.mark.parametrize(("lo", "hi"), [(0, None), (0, 2), (2, 5), (4, 5)])
def test_products_equal_the_dense_vectors(lik: object, lo: int, hi: int | None) -> None:
    """For a group of vectors [lo, hi): u^T W = s_k (W_k - q^T W) equals the dense
    (B, K, C) @ (C, d) product, and the squared sums over the group equal sum_k u_k^2."""
    c = 6 if isinstance(lik, HeteroscedasticGaussian) else 5
    f = outputs(c)
    fac = sqrt_factor(lik, f)
    assert fac is not None
    group = fac if hi is None else fac.columns(lo, hi)
    dense = group.dense()
    assert group.shape == dense.shape
    w = torch.randn(c, 7, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    torch.testing.assert_close(group.through_linear(w), dense @ w, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(group.squared_sums(), (dense * dense).sum(1), rtol=1e-12, atol=0)


def test_no_factor_for_other_likelihoods_and_checks_run() -> None:
    """A subclass (which may override hessian_sqrt) or a user's own likelihood gets None; the
    likelihood's own checks of f run (non-finite outputs raise as hessian_sqrt does)."""

    class Tempered(Categorical):
        pass

    f = outputs()
    assert sqrt_factor(Tempered(), f) is None
    assert sqrt_factor(object(), f) is None
    bad = f.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="f: network outputs contain NaN or inf"):
        sqrt_factor(Categorical(), bad)


def wide_mlp(c: int) -> nn.Sequential:
    """3-4-6-C: C larger than the hidden widths (the structured factor's regime)."""
    torch.manual_seed(0)
    return (
        nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, c))
        .double()
        .eval()
    )


def brute_ggn(model: nn.Module, x: torch.Tensor, lik: object) -> torch.Tensor:
    """sum_n J_n^T Lambda_n J_n from per-sample float64 Jacobians."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def f(p: dict, xn: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (xn.unsqueeze(0),)).squeeze(0)

    jac = vmap(jacrev(f), in_dims=(None, 0))(params, x)
    j = torch.cat([jac[k].flatten(2) for k in params], dim=2)
    with torch.no_grad():
        lam = lik.hessian(model(x))  # type: ignore[attr-defined]
    return torch.einsum("ncp,ncd,ndq->pq", j, lam, j)


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_structured_diagonal_equals_brute_force_and_dense_route(
    task: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The diagonal GGN of a chain ending with a linear layer goes through the structured
    factor (its product with the final weight is called) and equals the float64 brute-force
    GGN's diagonal and the dense vectors' route (the factor switched off), also with an
    offset and in chunks of 3 samples."""
    c = 9
    model = wide_mlp(c)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, c, (7,), generator=gen) if task == "classification" else model(x)
    offset = 0.3 * torch.randn(7, c, generator=gen, dtype=torch.float64)
    calls = []
    through = SqrtFactor.through_linear
    monkeypatch.setattr(
        SqrtFactor, "through_linear", lambda self, w: calls.append(1) or through(self, w)
    )
    lik = Categorical() if task == "classification" else Gaussian(1.0)
    for chunk in (None, 3):
        curv = make_curvature("diag", model, task, chunk_size=chunk)
        curv.update(model, x, y)
        assert calls
        expected = brute_ggn(model, x, lik).diagonal()
        torch.testing.assert_close(curv.ggn_diag, expected, rtol=1e-10, atol=1e-13)
        shifted = make_curvature("diag", model, task, chunk_size=chunk)
        shifted.update(model, x, y, offset=offset)
        with monkeypatch.context() as m:
            m.setattr(cbase, "sqrt_factor", lambda lik, f: None)
            dense = make_curvature("diag", model, task, chunk_size=chunk)
            dense.update(model, x, y, offset=offset)
        torch.testing.assert_close(shifted.ggn_diag, dense.ggn_diag, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_structured_kron_factors_equal_dense_route(
    approx: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KFAC's output-gradient factors B of the inner layers from the structured factor equal
    the dense vectors' route in float64 (the factor switched off), and a one-sample fit's
    block of the first layer (bias folded) equals that sample's exact GGN block."""
    c = 9
    model = wide_mlp(c)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 3, generator=gen, dtype=torch.float64), torch.randint(0, c, (6,))
    curv = make_curvature("kron", model, "classification", kfac_approx=approx)
    curv.update(model, x, y)
    with monkeypatch.context() as m:
        m.setattr(ckron, "sqrt_factor", lambda lik, f: None)
        dense = make_curvature("kron", model, "classification", kfac_approx=approx)
        dense.update(model, x, y)
    for key in curv._b:
        torch.testing.assert_close(curv._b[key], dense._b[key], rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(curv._a[key], dense._a[key], rtol=1e-12, atol=1e-15)
    one = make_curvature("kron", model, "classification", kfac_approx=approx)
    one.update(model, x[:1], y[:1])
    a, b, m1 = next(iter(one.kron_factors().values()))
    ggn = brute_ggn(model, x[:1], Categorical())
    w = model[0].weight.numel() + model[0].bias.numel()
    # parameters (W, b) ordered as W (4, 3) then b (4,): the block's [W b] interleaving
    order = torch.cat(
        [torch.arange(12).view(4, 3), torch.arange(12, 16).view(4, 1)], dim=1
    ).flatten()
    block = ggn[:w, :w][order][:, order]
    torch.testing.assert_close(torch.kron(b.to(a.dtype), a) / m1, block, rtol=1e-10, atol=1e-13)


def test_structured_peak_is_smaller_and_fit_within_the_rule() -> None:
    """With C = 100 vectors entering a 50-wide final layer, the structured factor's
    per-sample peak (no K-fold input of the final product) is below the dense vectors' one
    (another module's then), and the diagonal and KFAC fits of the benchmark's MLP
    (64-100-100-100, batch 32) keep the memory rule: peak <= 2 (training step + storage)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 100)
    ).eval()
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 100, (32,), generator=gen)
    narrow = nn.Sequential(nn.Linear(64, 50), nn.ReLU(), nn.Linear(50, 100)).eval()
    run = chain_forward(module_chain(narrow), x)
    per = {0, 2}
    # dense: the final layer's K-fold gradient and squares (2 K C) and its sums (C + 50);
    # structured: the first layer's K (50 + 64) bound the peak
    assert backward_peak(run, 100, per) == 100 * 2 * 100 + 150
    assert backward_peak(run, 100, per, structured=True) == 100 * (50 + 64)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        model.zero_grad(set_to_none=True)

    _, train = alloc_peak(step)
    for structure, opts in (("diag", {}), ("kron", {"kron_bias": "separate"})):

        def fit(structure: str = structure, opts: dict = opts):  # type: ignore[no-untyped-def]
            curv = make_curvature(structure, model, "classification", **opts)
            curv.update(model, x, y)
            return curv

        fit()
        curv, peak = alloc_peak(fit)
        storage = sum(t.numel() * t.element_size() for t in curv.state_dict().values())
        assert peak <= 2 * (train + storage), (structure, peak, train, storage)
