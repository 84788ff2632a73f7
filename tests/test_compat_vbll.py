"""gaussify.compat.vbll: vbll user code runs unchanged and gives vbll's numbers. Workflows
run twice, against vbll (skipped when it is not installed) and against the compat layer, with
the same seeds; the tests without vbll check the compat layer against closed forms."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gaussify.compat import vbll as compat
from gaussify.compat.vbll.rows import Rows

try:
    import vbll as _vbll

    # its first dense layer pays one-off lazy initialisation (~2 s): pay it at collection
    _vbll.Regression(2, 1, 1.0)(torch.zeros(1, 2)).train_loss_fn(torch.zeros(1, 1)).backward()
except ImportError:  # CI does not install vbll: the parity tests skip
    _vbll = None

D, N = 5, 7


def _original():
    if _vbll is None:
        pytest.skip("vbll is not installed")
    return _vbll


CASES = [
    *[("Regression", 3, {"parameterization": p}) for p in ("dense", "diagonal", "dense_precision")],
    ("Regression", 3, {"parameterization": "lowrank", "cov_rank": 2}),
    *[("tRegression", 2, {"parameterization": p}) for p in ("dense", "diagonal")],
    ("tRegression", 2, {"parameterization": "lowrank", "cov_rank": 2}),
    *[("HetRegression", 1, {"parameterization": p}) for p in ("dense", "diagonal")],
    *[
        ("DiscClassification", 4, {"parameterization": p, "cov_rank": 2, "return_ood": True})
        for p in ("dense", "diagonal", "lowrank")
    ],
    *[
        (cls, 4, {"parameterization": p, "softmax_bound": b, "return_ood": True})
        for cls in ("tDiscClassification", "HetClassification")
        for p in ("dense", "diagonal")
        for b in ("reduced_kn", "semimontecarlo")
    ],
    ("GenClassification", 4, {"parameterization": "diagonal", "return_ood": True}),
]


def _layer_outputs(lib, name, out, kwargs, state=None, forward_kwargs=None):
    """What a user reads from one layer: parameters at init, losses, predictive, gradients."""
    torch.manual_seed(0)
    layer = getattr(lib, name)(D, out, 0.1, **kwargs)
    init = {k: v.clone() for k, v in layer.state_dict().items()}
    if state is not None:
        layer.load_state_dict(state)
    x = torch.randn(N, D)
    classification = "Classification" in name
    y = torch.randint(0, out, (N,)) if classification else torch.randn(N, out)
    torch.manual_seed(1)
    result = layer(x, **(forward_kwargs or {}))
    train = result.train_loss_fn(y)
    train.backward()
    pred = result.predictive
    return {
        "init": init,
        "train": train.detach(),
        "val": result.val_loss_fn(y).detach(),
        "pred": pred.probs if classification else pred.mean,
        "scale": None if classification else pred.stddev,
        "ood": result.ood_scores,
        "grads": {k: p.grad for k, p in layer.named_parameters() if p.grad is not None},
    }


def _perturbed(state):
    gen = torch.Generator().manual_seed(5)
    return {
        k: v + 0.3 * torch.randn(v.shape, generator=gen) if v.dtype.is_floating_point else v
        for k, v in state.items()
    }


@pytest.mark.parametrize(("name", "out", "kwargs"), CASES)
def test_layer_equals_vbll_for_same_seed_and_checkpoint(name, out, kwargs):
    vbll = _original()
    ref0 = _layer_outputs(vbll, name, out, kwargs)
    ours0 = _layer_outputs(compat, name, out, kwargs)
    assert ref0["init"].keys() == ours0["init"].keys()  # vbll's parameter names
    for key in ref0["init"]:  # same initial parameters under the same seed
        torch.testing.assert_close(ours0["init"][key], ref0["init"][key], rtol=1e-6, atol=1e-7)
    checkpoint = _perturbed(ref0["init"])  # a vbll checkpoint with trained-looking values
    ref = _layer_outputs(vbll, name, out, kwargs, checkpoint)
    ours = _layer_outputs(compat, name, out, kwargs, checkpoint)
    for key in ("train", "val", "pred", "scale", "ood"):
        if ref[key] is None:
            assert ours[key] is None
            continue
        torch.testing.assert_close(ours[key], ref[key], rtol=1e-5, atol=1e-6, equal_nan=True)
    assert ref["grads"].keys() == ours["grads"].keys()
    for key, grad in ref["grads"].items():
        torch.testing.assert_close(ours["grads"][key], grad, rtol=1e-4, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("name", ["HetRegression", "HetClassification"])
def test_consistent_variance_draws_equal_vbll(name):
    vbll = _original()
    out = 1 if name == "HetRegression" else 3
    kwargs = {"parameterization": "dense"}
    ref = _layer_outputs(vbll, name, out, kwargs, None, {"consistent_variance": True})
    ours = _layer_outputs(compat, name, out, kwargs, None, {"consistent_variance": True})
    for key in ("train", "val", "pred"):
        torch.testing.assert_close(ours[key], ref[key], rtol=1e-5, atol=1e-6)


def _train_readme_style(lib, name):
    """vbll's README pattern: a feature network with a VBLL head trained by Adam on
    ``out.train_loss_fn(y)``."""
    torch.manual_seed(0)
    x = torch.randn(64, 3)
    regression = name == "Regression"
    y = (x.sum(1, keepdim=True).sin()) if regression else (x[:, 0] > 0).long()
    head = getattr(lib, name)(16, 1 if regression else 2, 1 / 64, parameterization="dense")
    model = nn.Sequential(nn.Linear(3, 16), nn.ELU(), head)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0)
    for i in range(12):
        batch = slice((i % 4) * 16, (i % 4 + 1) * 16)
        opt.zero_grad()
        loss = model(x[batch]).train_loss_fn(y[batch])
        loss.backward()
        opt.step()
    torch.manual_seed(3)
    with torch.no_grad():
        out = model(x[:10])
    pred = out.predictive
    return loss.detach(), (pred.mean, pred.stddev) if regression else pred.probs


@pytest.mark.parametrize("name", ["Regression", "DiscClassification"])
def test_training_loop_equals_vbll(name):
    vbll = _original()
    ref_loss, ref_pred = _train_readme_style(vbll, name)
    loss, pred = _train_readme_style(compat, name)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pred, ref_pred, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------ without vbll


@pytest.mark.parametrize("kind", ["dense", "diagonal", "lowrank", "dense_precision"])
def test_rows_moments_match_dense_covariance(kind):
    """x^T S x, tr S and log det S of every parameterization against the dense S (float64)."""
    gen = torch.Generator().manual_seed(0)
    mean = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    logdiag = 0.3 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    offdiag = None
    if kind != "diagonal":
        last = 2 if kind == "lowrank" else 4
        offdiag = torch.randn(3, 4, last, generator=gen, dtype=torch.float64)
    rows = Rows(kind, mean, logdiag, offdiag)
    if kind == "diagonal":
        cov = torch.diag_embed(logdiag.exp() ** 2)
    elif kind == "lowrank":
        cov = offdiag @ offdiag.mT + torch.diag_embed(logdiag.exp())
    else:
        tril = torch.tril(offdiag, -1) + torch.diag_embed(logdiag.exp())
        cov = tril @ tril.mT if kind == "dense" else torch.linalg.inv(tril @ tril.mT)
    x = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(rows.quad(x), torch.einsum("nd,kde,ne->nk", x, cov, x))
    torch.testing.assert_close(rows.trace(), cov.diagonal(dim1=-2, dim2=-1).sum(-1))
    torch.testing.assert_close(rows.logdet(), torch.logdet(cov))
    torch.testing.assert_close(rows.covariance, cov)


def test_regression_loss_and_predictive_closed_form():
    """Regression's negative ELBO and predictive written out in float64, with vbll's prior
    variance prior_scale / in_features and nu = (dof + out + 1) / 2."""
    torch.manual_seed(0)
    layer = compat.Regression(4, 2, 0.3, parameterization="diagonal", prior_scale=2.0).double()
    x, y = torch.randn(6, 4).double(), torch.randn(6, 2).double()
    out = layer(x)
    s2 = (2 * layer.noise_logdiag).exp()  # noise variances
    v = (2 * layer.W_logdiag).exp()  # q(W) variances
    m = layer.W_mean
    quad = x.square() @ v.T
    log_lik = -0.5 * (y - x @ m.T).square() / s2 - 0.5 * torch.log(2 * math.pi * s2)
    fit = (log_lik - 0.5 * quad * (1 / s2).sum()).mean()
    prior = 2.0 / 4
    kl = 0.5 * (
        m.square().sum() / prior + v.sum() / prior + (4 * math.log(prior) - v.log().sum(-1)).sum()
    )
    nu = (1.0 + 2 + 1) / 2
    wishart = nu * (-s2.log().sum()) - 0.5 * 1e-2 * (1 / s2).sum()
    torch.testing.assert_close(out.train_loss_fn(y), -(fit + 0.3 * (wishart - kl)))
    torch.testing.assert_close(out.predictive.variance, quad + s2)
    torch.testing.assert_close(out.predictive.mean, x @ m.T)
    expected_val = (
        -torch.distributions.Normal(x @ m.T, (quad + s2).sqrt()).log_prob(y).sum(-1).mean()
    )
    torch.testing.assert_close(out.val_loss_fn(y), expected_val)


def test_generative_predictive_is_bayes_rule():
    """GenClassification's probabilities: softmax_k log N(x | mu_k, diag(v_k + sigma^2))."""
    torch.manual_seed(0)
    layer = compat.GenClassification(3, 4, 0.1, parameterization="diagonal").double()
    x = torch.randn(5, 3).double()
    var = (2 * layer.mu_logdiag).exp() + (2 * layer.noise_logdiag).exp()
    log_density = (
        -0.5 * (x[:, None, :] - layer.mu_mean).square() / var - 0.5 * torch.log(2 * math.pi * var)
    ).sum(-1)
    torch.testing.assert_close(layer(x).predictive.probs, torch.softmax(log_density, -1))


def test_parameter_names_and_argument_errors():
    layer = compat.Regression(4, 2, 0.1, parameterization="dense")
    assert list(layer.state_dict()) == [
        "noise_mean",
        "noise_logdiag",
        "W_mean",
        "W_logdiag",
        "W_offdiag",
    ]
    assert layer.prior_scale == pytest.approx(1 / 4)
    assert compat.tRegression(8, 1, 0.1, prior_scale=1.0).prior_scale == pytest.approx(2 / 8)
    assert compat.DiscClassification(8, 3, 0.1, prior_scale=1.0).prior_scale == pytest.approx(2 / 8)
    with pytest.raises(ValueError, match="parameterization: expected one of"):
        compat.Regression(4, 2, 0.1, parameterization="full")
    with pytest.raises(ValueError, match="cov_rank: parameterization 'lowrank' needs"):
        compat.Regression(4, 2, 0.1, parameterization="lowrank")
    with pytest.raises(ValueError, match="parameterization: GenClassification supports only"):
        compat.GenClassification(4, 2, 0.1)
    with pytest.raises(ValueError, match="softmax_bound: expected one of"):
        compat.DiscClassification(4, 2, 0.1, softmax_bound="adaptive")
