"""Last-layer GLM predictive from features alone (J_n = I_C ⊗ [phi_n, 1]^T, thesis eqs. 2.22
and 3.15): every posterior structure's ``functional_cov_lastlayer`` equals the generic
``functional_cov(jacobians(...))`` path, and ``Laplace`` gives the same fit, refinement and
predictions with the feature path on or off."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import gaussify as gs
from gaussify.curvature.base import LastLayerPrecision
from gaussify.curvature.jacobian import jacobians
from gaussify.curvature.lastlayer import (
    OutputLinear,
    find_output_linear,
    forward_with_features,
    lastlayer_factor_products,
    lastlayer_features,
    lastlayer_index,
    lastlayer_jacobians,
)
from gaussify.curvature.subset import select_parameters

DT = torch.float64
N, D_IN, H = 24, 3, 5

# (structure, options, prior): scalar priors use the eigen / plain paths, per-tensor priors
# the Cholesky path (full) and the bias rank-one correction (kron, joint W + b).
CASES = [
    ("full", {}, "scalar"),
    ("full", {}, "layer"),
    ("diag", {}, "scalar"),
    ("diag", {}, "layer"),
    ("kron", {}, "scalar"),
    ("kron", {}, "layer"),
    ("kron", {"kron_bias": "separate"}, "layer"),
    ("lowrank", {"rank": 3}, "scalar"),
    ("lowrank", {"rank": 3}, "layer"),
]
IDS = [f"{s}-{'-'.join(o) or 'default'}-{p}" for s, o, p in CASES]


def _problem(num_outputs: int, bias: bool, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(D_IN, H), nn.Tanh(), nn.Linear(H, num_outputs, bias=bias)).to(
        DT
    )
    model.eval()
    x = torch.randn(N, D_IN, dtype=DT)
    if num_outputs == 1:
        y = torch.sin(2 * x[:, :1]) + 0.1 * torch.randn(N, 1, dtype=DT)
        return model, x, y, "regression"
    y = torch.randint(0, num_outputs, (N,))
    return model, x, y, "classification"


def _prior(kind: str, bias: bool) -> Tensor | float:
    if kind == "scalar":
        return 0.7
    return torch.tensor([0.5, 3.0] if bias else [0.5], dtype=DT)


def _laplace(structure: str, options: dict, prior: str, num_outputs: int, bias: bool):
    model, x, y, lik = _problem(num_outputs, bias)
    la = gs.Laplace(
        model, lik, structure, subset="last_layer", prior_precision=_prior(prior, bias), **options
    )
    return la.fit((x, y)), model, x, y


@pytest.mark.parametrize("num_outputs", [1, 4])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(("structure", "options", "prior"), CASES, ids=IDS)
def test_feature_path_equals_jacobian_path(
    structure: str, options: dict, prior: str, num_outputs: int, bias: bool
) -> None:
    la, model, _, _ = _laplace(structure, options, prior, num_outputs, bias)
    post = la.posterior
    assert isinstance(post, LastLayerPrecision)
    layer = find_output_linear(model, la.subset)
    assert layer is not None and layer.has_bias == bias
    xt = torch.randn(7, D_IN, dtype=DT)
    _, phi = forward_with_features(model, xt, layer)
    assert phi is not None
    ref = post.functional_cov(jacobians(model, xt, la.subset))
    cov = post.functional_cov_lastlayer(phi, layer)
    assert cov.shape == (7, num_outputs, num_outputs)
    torch.testing.assert_close(cov, ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(
        post.functional_var_lastlayer(phi, layer),
        ref.diagonal(dim1=-2, dim2=-1),
        rtol=0,
        atol=1e-10,
    )


@pytest.mark.parametrize(("structure", "options", "prior"), CASES, ids=IDS)
def test_bias_only_subset(structure: str, options: dict, prior: str) -> None:
    model, x, y, lik = _problem(3, True, seed=1)
    la = gs.Laplace(model, lik, structure, subset=["2.bias"], prior_precision=0.9, **options)
    la.fit((x, y))
    layer = la._output_layer
    assert layer == OutputLinear(
        "2", has_weight=False, has_bias=True, in_features=H, out_features=3
    )
    _, phi = forward_with_features(model, x, layer)
    ref = la.posterior.functional_cov(jacobians(model, x, la.subset))
    torch.testing.assert_close(
        la.posterior.functional_cov_lastlayer(phi, layer), ref, rtol=0, atol=1e-10
    )


@pytest.mark.parametrize("num_outputs", [1, 4])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(("structure", "options", "prior"), CASES, ids=IDS)
def test_laplace_same_with_feature_path_on_or_off(
    structure: str, options: dict, prior: str, num_outputs: int, bias: bool
) -> None:
    model, x, y, lik = _problem(num_outputs, bias, seed=2)
    results = {}
    for on in (True, False):
        la = gs.Laplace(
            model, lik, structure, "last_layer", prior_precision=_prior(prior, bias), **options
        )
        la._feature_path = on
        la.fit((x, y), batch_size=10)
        if structure != "lowrank":  # Newton steps need the full data pass each time
            la.refine((x, y), max_iter=3, batch_size=10)
        pred = la.predict(x[:9], chunk_size=4)
        results[on] = (la._grad, la.mean, la.log_marginal_likelihood(), pred.mean, pred.cov)
    for fast, slow in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(fast, slow, rtol=1e-10, atol=1e-10)


def test_laplace_never_forms_jacobians_on_the_last_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    import gaussify.curvature.base as base_module
    import gaussify.weight_space.laplace_fit as fit_module
    import gaussify.weight_space.laplace_predict as predict_module

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the generic torch.func path was used")

    for module in (fit_module, predict_module):  # the data passes and the predictive routes
        for name in ("jacobians", "vjp", "jvp_with_outputs"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, forbidden)
    monkeypatch.setattr(base_module, "per_sample_vjp", forbidden)
    model, x, y, lik = _problem(4, True, seed=3)
    for structure in ("full", "diag", "kron", "lowrank"):
        la = (
            gs.Laplace(model, lik, structure, "last_layer", rank=2)
            if structure == "lowrank"
            else (gs.Laplace(model, lik, structure, "last_layer"))
        )
        la.fit((x, y))
        if structure != "lowrank":
            la.refine((x, y), max_iter=2)
        pred = la.predict(x)
        assert pred.probs.shape == (N, 4)


def test_many_classes_predictive_is_cheap() -> None:
    """A 300-class head: the kron and diag predictives come from features, and agree with the
    Jacobian path on a few points."""
    torch.manual_seed(4)
    num_classes = 300
    model = nn.Sequential(nn.Linear(D_IN, 16), nn.ReLU(), nn.Linear(16, num_classes)).to(DT)
    model.eval()
    x = torch.randn(64, D_IN, dtype=DT)
    y = torch.randint(0, num_classes, (64,))
    for structure in ("diag", "kron"):
        la = gs.Laplace(model, "classification", structure, "last_layer").fit((x, y))
        fast = la.predict(x[:3])
        la._feature_path = False
        slow = la.predict(x[:3])
        torch.testing.assert_close(fast.cov, slow.cov, rtol=0, atol=1e-10)
        torch.testing.assert_close(fast.probs, slow.probs, rtol=0, atol=1e-10)


@pytest.mark.parametrize(("structure", "options", "prior"), CASES, ids=IDS)
def test_chunked_feature_path(
    structure: str, options: dict, prior: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    la, model, x, _ = _laplace(structure, options, prior, 4, True)
    layer = la._output_layer
    _, phi = forward_with_features(model, x, layer)
    whole = la.posterior.functional_cov_lastlayer(phi, layer)
    import gaussify.curvature.generic_jacobian as jacobian_module

    monkeypatch.setattr(jacobian_module, "DEFAULT_CHUNK_ELEMENTS", 50)  # ~1 sample a chunk
    torch.testing.assert_close(
        la.posterior.functional_cov_lastlayer(phi, layer), whole, rtol=0, atol=1e-14
    )


def test_feature_helpers_match_jacobians() -> None:
    model, x, _, _ = _problem(3, True, seed=5)
    for names in ("last_layer", ["2.weight"], ["2.bias"]):
        subset = select_parameters(model, names)
        layer = find_output_linear(model, subset)
        assert layer is not None
        _, phi = forward_with_features(model, x, layer)
        jac = lastlayer_jacobians(phi, 3, layer)
        feats = lastlayer_features(phi, layer)
        index = lastlayer_index(3, H, layer)
        # J_n[c, index[c, d']] = phi~_{n, d'} and zero elsewhere
        rebuilt = torch.zeros_like(jac)
        for c in range(3):
            rebuilt[:, c, index[c]] = feats
        torch.testing.assert_close(rebuilt, jac, rtol=0, atol=0)
        factor = torch.randn(subset.num_params, 6, dtype=DT)
        torch.testing.assert_close(
            lastlayer_factor_products(phi, factor, 3, layer), jac @ factor, rtol=0, atol=1e-13
        )


def test_mismatched_features_raise() -> None:
    la = _laplace("diag", {}, "scalar", 4, True)[0]
    layer = la._output_layer
    with pytest.raises(ValueError, match="features of dimension"):
        la.posterior.functional_cov_lastlayer(torch.randn(3, H + 2, dtype=DT), layer)
    other = OutputLinear(layer.name, True, True)  # sizes unknown: only P is checked
    with pytest.raises(ValueError, match="features of dimension"):
        la.posterior.functional_cov_lastlayer(torch.randn(3, H + 1, dtype=DT), other)


# ------------------------------------------------------------------ memory-lean paths


class _Rescaled(nn.Module):
    """The same network with its output multiplied by 1: the last layer's output is no longer
    the model output, so KFAC backpropagates the output vectors to it."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x) * 1.0


class _OtherCategorical(gs.likelihoods.Categorical):
    """Not the built-in type: its summed Hessian takes the generic chunked route."""


@pytest.mark.parametrize("kind", ["categorical", "other", "gaussian", "bernoulli"])
@pytest.mark.parametrize("flavour", [{}, {"ef": True}, {"mc_samples": 2}], ids=["ggn", "ef", "mc"])
def test_kron_output_layer_needs_no_backward(kind: str, flavour: dict) -> None:
    from gaussify.curvature.kron import KronGGN

    torch.manual_seed(6)
    net = nn.Sequential(nn.Linear(D_IN, H), nn.Tanh(), nn.Linear(H, 4)).to(DT).eval()
    x = torch.randn(N, D_IN, dtype=DT)
    lik = {
        "categorical": gs.likelihoods.Categorical(),
        "other": _OtherCategorical(),
        "gaussian": gs.likelihoods.Gaussian(0.5),
        "bernoulli": gs.likelihoods.Bernoulli(),
    }[kind]
    if kind in ("categorical", "other"):
        y = torch.randint(0, 4, (N,))
    elif kind == "gaussian":
        y = torch.randn(N, 4, dtype=DT)
    else:
        y = torch.randint(0, 2, (N, 4)).to(DT)
    wrapped = _Rescaled(net).eval()
    for subset in (["2"], ["0", "2"]):
        direct = KronGGN(net, lik, subset, generator=torch.Generator().manual_seed(0), **flavour)
        direct.update(net, x, y)
        names = [f"net.{s}" for s in subset]
        backprop = KronGGN(
            wrapped, lik, names, generator=torch.Generator().manual_seed(0), **flavour
        )
        backprop.update(wrapped, x, y)
        for (a1, b1, m1), (a2, b2, m2) in zip(
            direct.kron_factors().values(), backprop.kron_factors().values(), strict=True
        ):
            torch.testing.assert_close(a1, a2, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(b1, b2, rtol=1e-10, atol=1e-12)
            assert m1 == m2


def test_summed_hessian_matches_sum_of_hessians() -> None:
    from gaussify.curvature.base import summed_hessian

    f = torch.randn(37, 5, dtype=DT)
    for lik in (
        gs.likelihoods.Categorical(),
        _OtherCategorical(),
        gs.likelihoods.Gaussian(torch.tensor([0.5, 1, 2, 3, 4], dtype=DT)),
        gs.likelihoods.Bernoulli(),
    ):
        expected = lik.hessian(f).sum(0)
        torch.testing.assert_close(summed_hessian(lik, f), expected, rtol=1e-12, atol=1e-12)
        out = torch.eye(5, dtype=DT)
        assert summed_hessian(lik, f, out=out) is out
        torch.testing.assert_close(out, expected + torch.eye(5, dtype=DT), rtol=1e-12, atol=1e-12)


def test_lastlayer_diag_and_vjp_accumulate_in_place() -> None:
    from gaussify.curvature.lastlayer import lastlayer_diag, lastlayer_vjp

    model, x, _, _ = _problem(3, True, seed=7)
    layer = find_output_linear(model, select_parameters(model, "last_layer"))
    _, phi = forward_with_features(model, x, layer)
    phi = phi.detach()
    jac = lastlayer_jacobians(phi, 3, layer)
    middle = torch.rand(N, 3, dtype=DT)
    u = torch.randn(N, 3, dtype=DT)
    start = torch.randn(jac.shape[-1], dtype=DT)
    out = start.clone()
    assert lastlayer_diag(phi, middle, layer, out=out) is out
    torch.testing.assert_close(out, start + torch.einsum("ncp,nc->p", jac.square(), middle))
    out = start.clone()
    assert lastlayer_vjp(phi, u, layer, out=out) is out
    torch.testing.assert_close(out, start + torch.einsum("ncp,nc->p", jac, u))
    with pytest.raises(ValueError, match="out"):
        lastlayer_vjp(phi, u, layer, out=torch.zeros(3, dtype=DT))


@pytest.mark.parametrize("budget", [None, 1, 200, 10**9])
def test_squared_vjp_sum_chunked_by_budget(budget: int | None) -> None:
    from gaussify.curvature.jacobian import squared_vjp_sum

    model, x, _, _ = _problem(4, True, seed=8)
    cot = torch.randn(N, 3, 4, dtype=DT)
    jac = jacobians(model, x, "all")
    expected = torch.einsum("ncp,nkc->nkp", jac, cot).square().sum((0, 1))
    calls = []

    def cotangents(f: Tensor) -> Tensor:
        calls.append(f.shape[0])
        return cot

    got, f = squared_vjp_sum(model, x, "all", cotangents, budget=budget)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(f, model(x).detach())
    assert calls == [N]  # the cotangents are evaluated once, on all outputs
    start = torch.ones_like(expected)
    out = start.clone()
    assert squared_vjp_sum(model, x, "all", cotangents, budget=budget, out=out)[0] is out
    torch.testing.assert_close(out, start + expected, rtol=1e-10, atol=1e-12)


def test_graph_uses_count_each_parameter_use() -> None:
    from gaussify.curvature.layer_traces import _graph_uses

    lin = nn.Linear(3, 3).to(DT)
    x = torch.randn(4, 3, dtype=DT)
    once = _graph_uses(lin(x))
    assert once[id(lin.weight)] == 1 and once[id(lin.bias)] == 1
    twice = _graph_uses(lin(x) + x @ lin.weight.T)
    assert twice[id(lin.weight)] == 2 and twice[id(lin.bias)] == 1
    with torch.no_grad():
        assert _graph_uses(lin(x)) == {}
