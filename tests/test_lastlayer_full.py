"""Last-layer full GGN from features: sum_n M_n ⊗ phi~_n phi~_n^T equals J^T M J.

Oracle: the same FullGGN accumulated from per-sample torch.func Jacobian products
(``last_layer_identity=False``) and a dense sum of ``torch.autograd.functional.jacobian``
products, in float64 to 1e-10, for softmax / Gaussian / Bernoulli likelihoods, the exact GGN,
Monte Carlo and empirical Fisher, weight and/or bias subsets and several chunks per batch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gaussify as gs
from gaussify.curvature import make_curvature
from gaussify.curvature.lastlayer import find_output_linear, lastlayer_full_ggn
from gaussify.likelihoods import get_likelihood

DT = torch.float64


def _setup(task: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    outputs = {"classification": 4, "regression": 3, "binary": 1}[task]
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, outputs)).double().eval()
    x = torch.randn(23, 3, dtype=DT)
    if task == "classification":
        y = torch.randint(0, outputs, (23,))
    elif task == "binary":
        y = torch.randint(0, 2, (23, 1)).to(DT)
    else:
        y = torch.randn(23, outputs, dtype=DT)
    return model, x, y


def _ggn(model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: str, subset, **opts):
    curv = make_curvature("full", model, task, subset, **opts)
    curv.update(model, x, y)
    return curv


SUBSETS = {
    "last_layer": "last_layer",
    "weight_only": ["2.weight"],
    "bias_only": ["2.bias"],
}


@pytest.mark.parametrize("task", ["classification", "regression", "binary"])
@pytest.mark.parametrize("subset", list(SUBSETS))
@pytest.mark.parametrize("flavour", ["exact", "mc", "ef"])
def test_feature_full_ggn_equals_jacobian_full_ggn(task: str, subset: str, flavour: str) -> None:
    model, x, y = _setup(task)
    sub = SUBSETS[subset]
    options: dict = {"ef": flavour == "ef", "mc_samples": 3 if flavour == "mc" else 0}
    ggns = []
    for features, identity in [(True, True), (False, True), (False, False)]:
        gen = torch.Generator().manual_seed(5) if flavour == "mc" else None
        curv = _ggn(
            model,
            x,
            y,
            task,
            sub,
            kron_features=features,
            last_layer_identity=identity,
            generator=gen,
            chunk_size=7 if features else None,  # several chunks on the feature path
            **options,
        )
        assert (curv._layer is not None) == identity
        ggns.append(curv.ggn)
    torch.testing.assert_close(ggns[0], ggns[1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ggns[0], ggns[2], rtol=1e-10, atol=1e-10)


def test_feature_full_ggn_equals_autograd_jacobian_sum() -> None:
    model, x, y = _setup("classification")
    curv = _ggn(model, x, y, "classification", "last_layer")
    layer = find_output_linear(model, curv.subset)
    assert layer is not None and curv.kron_features
    lik = get_likelihood("classification")
    w, b = model[2].weight, model[2].bias

    def out(wv: torch.Tensor, bv: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(model[1](model[0](x)), wv, bv)

    jw, jb = torch.autograd.functional.jacobian(out, (w.detach(), b.detach()))
    jac = torch.cat([jw.reshape(23, 4, -1), jb.reshape(23, 4, -1)], dim=-1)  # (N, C, P)
    with torch.no_grad():
        lam = lik.hessian(model(x))
    dense = torch.einsum("nap,nab,nbq->pq", jac, lam, jac)
    torch.testing.assert_close(curv.ggn, dense, rtol=1e-10, atol=1e-10)


def test_feature_path_is_transactional() -> None:
    model, x, y = _setup("classification")
    curv = _ggn(model, x, y, "classification", "last_layer", chunk_size=5)
    before = curv.ggn.clone()
    bad = x.clone()
    bad[17, 0] = float("nan")
    with pytest.raises(ValueError, match="unchanged"):
        curv.update(model, bad, y)
    assert torch.equal(curv.ggn, before) and curv.num_data == 23


def test_feature_path_adds_chunks_in_place_when_no_entry_can_overflow(monkeypatch) -> None:
    """Several chunks per batch with finite, bounded terms go straight into G: no (P, P)
    temporary is made (``zeros_like`` is forbidden) and G equals the one-chunk sum."""
    model, x, y = _setup("classification")
    reference = _ggn(model, x, y, "classification", "last_layer")
    import gaussify.curvature.full as full_module

    def forbidden(*args, **kwargs):
        raise AssertionError("a (P, P) temporary was allocated")

    curv = make_curvature("full", model, "classification", "last_layer", chunk_size=5)
    monkeypatch.setattr(full_module.torch, "zeros_like", forbidden)
    curv.update(model, x, y)
    monkeypatch.undo()
    torch.testing.assert_close(curv.ggn, reference.ggn, rtol=1e-12, atol=1e-12)


def test_feature_path_batch_that_overflows_leaves_g_unchanged() -> None:
    """float64 features of 1e160 (phi^2 = inf; G is accumulated in float64, also for a
    float32 model) cannot be bounded: the chunks go into a checked temporary, the batch
    raises and G keeps the earlier batch's sum, which equals the closed form for a Gaussian
    likelihood (M_n = I: G = I_C ⊗ sum_n phi~_n phi~_n^T)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).eval().double()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, generator=g, dtype=torch.float64)
    y = torch.randn(16, 2, generator=g, dtype=torch.float64)
    curv = make_curvature("full", model, "regression", "last_layer", chunk_size=4)
    curv.update(model, x, y)
    before = curv.ggn.clone()
    with pytest.raises(ValueError, match="unchanged"):
        curv.update(model, 1e160 * x, y)
    torch.testing.assert_close(curv.ggn, before, rtol=0, atol=0)
    assert curv.num_data == 16
    with torch.no_grad():
        phi = torch.cat([model[0](x), torch.ones(16, 1, dtype=torch.float64)], dim=1)
    gram = phi.T @ phi  # (D + 1)^2 in [w, b] order per output
    closed = torch.zeros_like(before)
    d = 4
    for c in range(2):
        w = slice(c * d, (c + 1) * d)
        b = 2 * d + c
        closed[w, w] = gram[:d, :d]
        closed[w, b] = gram[:d, d]
        closed[b, w] = gram[d, :d]
        closed[b, b] = gram[d, d]
    torch.testing.assert_close(before, closed, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("subset", list(SUBSETS))
def test_class_blocks_give_the_same_ggn(subset: str) -> None:
    # blocks of g classes per matmul (bounded temporaries) sum to the same G
    model, x, y = _setup("classification")
    curv = _ggn(model, x, y, "classification", SUBSETS[subset])
    layer = find_output_linear(model, curv.subset)
    assert layer is not None
    phi = model[1](model[0](x))
    lam = get_likelihood("classification").hessian(model(x)).detach()
    p = curv.num_params
    for g in (1, 3, 4):
        out = lastlayer_full_ggn(phi.detach(), lam, layer, torch.zeros(p, p, dtype=DT), g)
        torch.testing.assert_close(out, curv.ggn, rtol=1e-10, atol=1e-10)


def test_kron_output_layer_keeps_outputs_and_features_for_the_fit() -> None:
    # KFAC over the output layer alone runs its forward without a graph and keeps
    # (f, phi) when asked (Laplace.fit asks), so Laplace.fit needs no forward pass of its
    # own; same statistics either way. A bare curvature fit keeps nothing batch-sized.
    model, x, y = _setup("classification")
    curv = make_curvature("kron", model, "classification", "last_layer")
    curv.update(model, x, y)
    assert curv.last_outputs is None
    curv.keep_outputs = True
    curv.update(model, x, y)
    assert curv.last_outputs is not None
    f, phi = curv.last_outputs
    torch.testing.assert_close(f, model(x).detach(), rtol=0, atol=0)
    torch.testing.assert_close(phi, model[1](model[0](x)).detach(), rtol=0, atol=0)
    everything = make_curvature("kron", model, "classification", "all")
    everything.keep_outputs = True
    everything.update(model, x, y)
    assert everything.last_outputs is None
    fits = []
    for keep in (True, False):
        la = gs.Laplace(model, "classification", "kron", "last_layer")
        la._feature_path = keep
        la.fit((x, y))
        fits.append((la._log_lik, la._grad, la._curvature.kron_factors()))
    torch.testing.assert_close(fits[0][0], fits[1][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fits[0][1], fits[1][1], rtol=1e-12, atol=1e-12)
    for key, (a, b, m) in fits[0][2].items():
        a2, b2, m2 = fits[1][2][key]
        assert torch.equal(a, a2) and torch.equal(b, b2) and torch.equal(m, m2)


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_outputs_are_kept_only_when_asked(structure: str) -> None:
    # a bare curvature fit holds no batch-sized tensors; with keep_outputs (Laplace.fit sets
    # it) the latest batch's outputs and output-layer features are handed over
    model, x, y = _setup("classification")
    curv = make_curvature(structure, model, "classification", "last_layer")
    curv.update(model, x, y)
    assert curv.last_outputs is None
    curv.keep_outputs = True
    curv.update(model, x, y)
    assert curv.last_outputs is not None
    f, phi = curv.last_outputs
    torch.testing.assert_close(f, model(x).detach(), rtol=0, atol=0)
    torch.testing.assert_close(phi, model[1](model[0](x)).detach(), rtol=0, atol=0)
