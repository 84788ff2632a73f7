"""The KFAC GLM predictive over ``nn.Linear`` layers without the (N, C, P) Jacobian.

For a linear layer ``s = W a + b`` the Jacobian of output ``f_c`` wrt the layer's
``[W, b]`` block is the rank-one ``delta_c [a, 1]^T``, so in the block's Kronecker eigenbasis
it is ``(Q_out^T delta_c)(Q_in^T [a, 1])^T`` and ``J Sigma J^T`` needs only each layer's
inputs and output gradients (:meth:`KronPosteriorPrecision.functional_cov_traced`). These
tests check in float64 that ``Laplace.predict`` on that route equals the dense Jacobian
route (``functional_cov(jacobians(...))``) to 1e-10 relative over every option that changes
the blocks (bias in or out, joint or separate bias blocks, per-tensor priors with a bias
shift, temperature, subsets, regression and classification, full and diagonal output
covariances), and that models the route does not cover still take the Jacobian route.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import gaussify as gs
import gaussify.weight_space.laplace_predict as laplace_module  # the predictive routes
from gaussify.curvature.kron import traced_predictive

TOL = 1e-10


def _mlp(bias: bool, c: int, d: int = 5) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(d, 7, bias=bias),
        nn.Tanh(),
        nn.Linear(7, 6, bias=bias),
        nn.Tanh(),
        nn.Linear(6, c, bias=bias),
    ).double()


def _data(task: str, c: int, n: int = 40, d: int = 5) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    xt = torch.randn(13, d, generator=g, dtype=torch.float64)
    if task == "regression":
        y = torch.randn(n, c, generator=g, dtype=torch.float64)
    else:
        y = torch.randint(0, c, (n,), generator=g)
    return x, y, xt


def _no_jacobians(*args: Any, **kwargs: Any) -> Tensor:
    raise AssertionError("the Jacobian route ran")


def _both_routes(
    la: Any, xt: Tensor, diagonal: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, Any]:
    """(fast predictive, with jacobians() forbidden; dense-Jacobian predictive)."""
    with monkeypatch.context() as m:
        m.setattr(laplace_module, "jacobians", _no_jacobians)
        fast = la.predict(xt, diagonal_output=diagonal, chunk_size=5)
    with monkeypatch.context() as m:
        m.setattr(laplace_module, "traced_predictive", lambda *a, **k: None)
        dense = la.predict(xt, diagonal_output=diagonal, chunk_size=5)
    return fast, dense


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


SUBSETS = {
    "all": "all",
    "named": ["0.weight", "0.bias", "2.bias", "4.weight"],
}


@pytest.mark.parametrize("task", ["classification", "regression"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("kron_bias", ["joint", "separate"])
@pytest.mark.parametrize("prior_kind", ["scalar", "per_tensor"])
@pytest.mark.parametrize("subset_key", list(SUBSETS))
def test_fast_route_equals_dense_jacobian_route(
    task: str,
    bias: bool,
    kron_bias: str,
    prior_kind: str,
    subset_key: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """f_mean and f_cov (full, and with ``diagonal_output`` its diagonal) of both routes agree
    to 1e-10 relative, with a non-zero mean shift (J (mu - theta*) enters the mean),
    temperature 0.5 and, per tensor, different weight and bias priors (the joint block's
    rank-one bias shift)."""
    if not bias and subset_key == "named":
        subset: Any = ["0.weight", "4.weight"]
    else:
        subset = SUBSETS[subset_key]
    c = 3 if task == "classification" else 2
    model = _mlp(bias, c)
    x, y, xt = _data(task, c)
    la = gs.Laplace(
        model,
        task,
        "kron",
        subset,
        sigma_noise=0.7 if task == "regression" else 1.0,  # only regression has noise
        temperature=0.5,
        kron_bias=kron_bias,
    )
    la.fit((x, y), batch_size=16)
    names = la.subset.names
    if prior_kind == "per_tensor":
        la.prior_precision = torch.linspace(0.3, 2.5, len(names), dtype=torch.float64)
    else:
        la.prior_precision = 0.8
    g = torch.Generator().manual_seed(2)
    la.mean = la.mean + 0.05 * torch.randn(la.mean.shape, generator=g, dtype=torch.float64)
    for diagonal in (False, True):
        fast, dense = _both_routes(la, xt, diagonal, monkeypatch)
        assert fast.f_cov.shape == dense.f_cov.shape == (xt.shape[0], c, c)
        assert _rel(fast.f_mean, dense.f_mean) < TOL
        assert _rel(fast.f_cov, dense.f_cov) < TOL
        if diagonal:
            off = fast.f_cov - torch.diag_embed(fast.f_cov.diagonal(dim1=-2, dim2=-1))
            assert float(off.abs().max()) == 0.0
        else:  # the C x C blocks are not diagonal: the off-diagonal terms are compared too
            off = dense.f_cov - torch.diag_embed(dense.f_cov.diagonal(dim1=-2, dim2=-1))
            assert float(off.abs().max()) > 1e-3 * float(dense.f_cov.abs().max())
        # a non-trivial comparison: the variances are not negligible
        assert float(dense.f_cov.diagonal(dim1=-2, dim2=-1).min()) > 1e-6


def test_functional_cov_traced_equals_functional_cov_of_the_jacobian() -> None:
    """The posterior method itself against ``functional_cov(jacobians(...))``, C = 4, with a
    joint block carrying a bias shift."""
    from gaussify.curvature.jacobian import jacobians, linear_output_traces

    model = _mlp(True, 4)
    x, y, xt = _data("classification", 4)
    la = gs.Laplace(model, "classification", "kron", "all").fit((x, y))
    la.prior_precision = torch.linspace(0.5, 3.0, 6, dtype=torch.float64)
    post = la.posterior
    traced = linear_output_traces(model, xt, la.subset)
    assert traced is not None
    f, traces = traced
    pairs = {p: (tr.inputs, tr.deltas) for p, tr in traces.items()}
    jac = jacobians(model, xt, la.subset)
    ref = post.functional_cov(jac)
    assert _rel(post.functional_cov_traced(pairs), ref) < TOL
    assert _rel(post.functional_cov_traced(pairs, diagonal=True), post.functional_var(jac)) < TOL
    with torch.no_grad():
        assert _rel(f, model(xt)) < TOL


@pytest.mark.parametrize("kron_bias", ["joint", "separate"])
def test_traced_covariance_gradients_wrt_prior_and_noise_match(kron_bias: str) -> None:
    """The traced covariance is differentiable in the per-tensor prior and the noise (through
    the eigenvalues), with the same gradients as the dense route."""
    from gaussify.curvature.jacobian import jacobians, linear_output_traces

    model = _mlp(True, 2)
    x, y, xt = _data("regression", 2)
    la = gs.Laplace(model, "regression", "kron", "all", kron_bias=kron_bias).fit((x, y))
    traced = linear_output_traces(model, xt, la.subset)
    assert traced is not None
    pairs = {p: (tr.inputs, tr.deltas) for p, tr in traced[1].items()}
    jac = jacobians(model, xt, la.subset)
    grads = []
    for dense in (False, True):
        prior = torch.linspace(0.5, 3.0, 6, dtype=torch.float64).requires_grad_(True)
        sigma = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)
        post = la.posterior_at(prior, sigma)
        cov = post.functional_cov(jac) if dense else post.functional_cov_traced(pairs)
        (cov * torch.tensor([[1.0, 0.3], [0.3, 2.0]], dtype=torch.float64)).sum().backward()
        assert prior.grad is not None and sigma.grad is not None
        grads.append(torch.cat([prior.grad, sigma.grad.reshape(1)]))
    assert _rel(grads[0], grads[1]) < TOL


class _SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(2 * 4 * 4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


class _SmallConv1d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(1, 2, 3)
        self.fc = nn.Linear(2 * 4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


class _TokenMLP(nn.Module):
    """A Linear applied to (N, T, in) inputs (KFAC supports it, the traced route does not)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Linear(3, 4)
        self.out = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.tok(x.view(-1, 2, 3))).flatten(1))


def test_conv2d_takes_the_traced_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain Conv2d is on the traced route since issue 22: no Jacobian is built."""
    g = torch.Generator().manual_seed(0)
    model = _SmallCNN().double()
    x = torch.randn(20, 1, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (20,), generator=g)
    la = gs.Laplace(model, "classification", "kron", "all").fit((x, y))
    shift = torch.zeros(la.subset.num_params, dtype=torch.float64)
    assert traced_predictive(la.posterior, model, x[:4], la.subset, shift) is not None
    monkeypatch.setattr(laplace_module, "jacobians", None)  # would fail if called
    assert torch.isfinite(la.predict(x[:4]).f_cov).all()


@pytest.mark.parametrize("net", ["conv1d", "tokens"])
def test_unsupported_models_take_the_jacobian_route(
    net: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Conv1d, or a Linear over several locations per sample, is not on the traced
    route: ``traced_predictive`` declines (None) and ``predict`` builds the Jacobian."""
    g = torch.Generator().manual_seed(0)
    if net == "conv1d":
        model: nn.Module = _SmallConv1d().double()
        x = torch.randn(20, 1, 6, generator=g, dtype=torch.float64)
    else:
        model = _TokenMLP().double()
        x = torch.randn(20, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (20,), generator=g)
    la = gs.Laplace(model, "classification", "kron", "all").fit((x, y))
    shift = torch.zeros(la.subset.num_params, dtype=torch.float64)
    assert traced_predictive(la.posterior, model, x[:4], la.subset, shift) is None
    calls: list[int] = []
    real = laplace_module.jacobians

    def spy(*args: Any, **kwargs: Any) -> Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(laplace_module, "jacobians", spy)
    pred = la.predict(x[:4])
    assert calls and torch.isfinite(pred.f_cov).all()


def test_inputs_requiring_grad_take_the_jacobian_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """The traced route's gradients are detached, so inputs that require grad (input
    gradients of the predictive) keep the differentiable Jacobian route."""
    model = _mlp(True, 3)
    x, y, xt = _data("classification", 3)
    la = gs.Laplace(model, "classification", "kron", "all").fit((x, y))
    monkeypatch.setattr(laplace_module, "traced_predictive", _no_jacobians)
    pred = la.predict(xt.clone().requires_grad_(True))
    pred.f_cov.diagonal(dim1=-2, dim2=-1).sum().backward()
