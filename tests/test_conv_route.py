"""The per-layer Conv2d route of the per-sample products and the diagonal GGN.

A convolution's per-sample gradient for an output vector u is sum_t delta_t a_t^T over its
output locations t (a_t the im2col patch, delta_t the gradient of u^T f at the layer's output),
so diag(sum_n J_n^T Lambda_n J_n) = sum_n sum_c (sum_t delta_{n,c,t} a_{n,t}^T)^2. These tests
compare it (float64) with the GGN formed from ``torch.autograd.functional.jacobian`` for every
convolution option (stride, padding and its modes, dilation, groups, bias), for classification
and regression, the Monte Carlo and empirical-Fisher variants, and check that the route is
really taken (the generic ``torch.func`` path is switched off) or correctly not taken.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

from gaussify.curvature import jacobian as jacobian_module
from gaussify.curvature import layer_traces, per_sample, per_sample_vjp
from gaussify.curvature.diag import DiagGGN
from gaussify.curvature.full import FullGGN
from gaussify.curvature.jacobian import conv2d_patches, squared_vjp_sum
from gaussify.likelihoods import Categorical, Gaussian, Likelihood

DT = torch.float64
N, C = 7, 3

CONFIGS = {
    "plain": {},
    "stride": {"stride": 2},
    "padding": {"padding": 1},
    "asymmetric": {"stride": (2, 1), "padding": (1, 2), "dilation": (1, 2)},
    "dilation": {"dilation": 2, "padding": 2},
    "groups": {"groups": 2},
    "no_bias": {"bias": False},
    "same": {"padding": "same"},
    "reflect": {"padding": 1, "padding_mode": "reflect"},
    "circular": {"padding": (1, 2), "padding_mode": "circular", "groups": 2, "stride": 2},
}


def small_cnn(seed: int = 0, **conv: object) -> nn.Module:
    """conv(2 -> 4, 3, **conv) - tanh - conv(4 -> 4, 2, groups 2) - relu - maxpool - linear."""
    torch.manual_seed(seed)
    body = nn.Sequential(
        nn.Conv2d(2, 4, 3, **conv),  # type: ignore[arg-type]
        nn.Tanh(),
        nn.Conv2d(4, 4, 2, groups=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    ).to(DT)
    width = body(torch.zeros(1, 2, 8, 9, dtype=DT)).shape[1]
    return nn.Sequential(*body, nn.Linear(width, C)).to(DT).eval()


def inputs(seed: int = 1) -> Tensor:
    return torch.randn(N, 2, 8, 9, generator=torch.Generator().manual_seed(seed), dtype=DT)


def autograd_jacobian(model: nn.Module, x: Tensor) -> Tensor:
    """(N, C, P) by ``torch.autograd.functional.jacobian`` of the flattened parameters."""
    named = {n: p.detach() for n, p in model.named_parameters()}
    shapes = [p.shape for p in named.values()]
    flat = torch.cat([p.reshape(-1) for p in named.values()])

    def f(theta: Tensor) -> Tensor:
        parts = torch.split(theta, [s.numel() for s in shapes])
        params = {n: t.view(s) for n, t, s in zip(named, parts, shapes, strict=True)}
        return functional_call(model, params, (x,))

    return torch.autograd.functional.jacobian(f, flat)  # (N, C, P)


def no_generic_path():  # type: ignore[no-untyped-def]
    """Patch out the generic per-sample path: every parameter must take a per-layer route."""

    def fail(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the generic torch.func per-sample path was used")

    return mock.patch.object(per_sample, "_generic_per_sample_vjp", fail)


def likelihood(kind: str) -> Likelihood:
    if kind == "regression":
        return Gaussian(torch.tensor([0.5, 1.3, 2.0], dtype=DT))
    return Categorical()


def targets(kind: str) -> Tensor:
    g = torch.Generator().manual_seed(3)
    if kind == "regression":
        return torch.randn(N, C, generator=g, dtype=DT)
    return torch.randint(0, C, (N,), generator=g)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("kind", ["classification", "regression"])
def test_conv_route_diag_and_full_equal_the_autograd_ggn(config: str, kind: str) -> None:
    model, x, y = small_cnn(**CONFIGS[config]), inputs(), targets(kind)
    lik = likelihood(kind)
    jac = autograd_jacobian(model, x)
    lam = lik.hessian(model(x).detach())
    ggn = torch.einsum("nap,nab,nbq->pq", jac, lam, jac)
    with no_generic_path():
        diag = DiagGGN(model, lik, last_layer_identity=False)
        diag.update(model, x[:4], y[:4])
        diag.update(model, x[4:], y[4:])
        full = FullGGN(model, lik, last_layer_identity=False)
        full.update(model, x, y)
        # one sample per chunk: the chunked conv route adds up to the same diagonal
        chunked = DiagGGN(model, lik, last_layer_identity=False, chunk_size=1)
        chunked.update(model, x, y)
    torch.testing.assert_close(diag.ggn_diag, ggn.diagonal(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(chunked.ggn_diag, ggn.diagonal(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(full.ggn, ggn, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("config", ["plain", "groups", "circular"])
def test_conv_route_per_sample_products_equal_the_jacobian(config: str) -> None:
    model, x = small_cnn(**CONFIGS[config]), inputs()
    jac = autograd_jacobian(model, x)
    cot = torch.randn(N, 2, C, generator=torch.Generator().manual_seed(5), dtype=DT)
    expected = torch.einsum("ncp,nkc->nkp", jac, cot)
    with no_generic_path():
        for chunk in (None, 3):
            got = per_sample_vjp(model, x, "all", cot, chunk_size=chunk)
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
        squares, _ = squared_vjp_sum(model, x, "all", lambda _f: cot, budget=1)
    torch.testing.assert_close(squares, expected.square().sum((0, 1)), rtol=1e-10, atol=1e-12)


def test_conv_route_empirical_fisher_and_monte_carlo() -> None:
    """EF: sum_n g_n^2 with g_n the per-sample gradient of log p(y_n | f_n) by autograd. MC:
    the same labels (same generator) give the same diagonal on the conv route and on the
    generic path, which is unbiased for the exact one (tested for MLPs elsewhere)."""
    model, x, y = small_cnn(**CONFIGS["asymmetric"]), inputs(), targets("classification")
    lik = Categorical()
    grads = []
    for i in range(N):
        logp = lik.log_prob(model(x[i : i + 1]), y[i : i + 1]).sum()
        g = torch.autograd.grad(logp, list(model.parameters()))
        grads.append(torch.cat([t.reshape(-1) for t in g]))
    ef_expected = torch.stack(grads).square().sum(0)
    with no_generic_path():
        ef = DiagGGN(model, lik, ef=True, last_layer_identity=False)
        ef.update(model, x, y)
        mc = DiagGGN(
            model, lik, mc_samples=4, generator=torch.Generator().manual_seed(7),
            last_layer_identity=False,
        )  # fmt: skip
        mc.update(model, x, y)
    torch.testing.assert_close(ef.ggn_diag, ef_expected, rtol=1e-10, atol=1e-12)
    with mock.patch.object(layer_traces, "_plain_conv2d", lambda _m: False):
        generic = DiagGGN(
            model, lik, mc_samples=4, generator=torch.Generator().manual_seed(7),
            last_layer_identity=False,
        )  # fmt: skip
        generic.update(model, x, y)
    torch.testing.assert_close(mc.ggn_diag, generic.ggn_diag, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(mc.ggn_diag, ef.ggn_diag)


class SharedConv(nn.Module):
    """One convolution applied twice (its weight has two uses in the graph), and a conv
    subclass with its own forward: both must fall back to the generic path."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.scaled = ScaledConv(2, 3, 3)
        self.head = nn.Linear(3, C)

    def forward(self, x: Tensor) -> Tensor:
        h = self.scaled(torch.tanh(self.conv(torch.tanh(self.conv(x)))))
        return self.head(h.mean((-2, -1)))


class ScaledConv(nn.Conv2d):
    def forward(self, x: Tensor) -> Tensor:
        return 0.5 * self._conv_forward(x, 2.0 * self.weight, self.bias)


def test_shared_or_custom_convolutions_fall_back_to_the_generic_path() -> None:
    torch.manual_seed(0)
    model, x = SharedConv().to(DT).eval(), inputs()
    jac = autograd_jacobian(model, x)
    lam = Categorical().hessian(model(x).detach())
    ggn = torch.einsum("nap,nab,nbq->pq", jac, lam, jac)
    assert list(layer_traces._hookable_linears(model, _all(model), convs=True)) == [
        "conv",
        "head",
    ]
    diag = DiagGGN(model, "classification", last_layer_identity=False)
    diag.update(model, x, targets("classification"))
    torch.testing.assert_close(diag.ggn_diag, ggn.diagonal(), rtol=1e-10, atol=1e-12)


def _all(model: nn.Module):  # type: ignore[no-untyped-def]
    return jacobian_module.resolve_subset(model, "all")


def test_conv2d_patches_match_the_convolution_and_name_the_module() -> None:
    """W a_t + b over the patches is the layer's output, for every config; a 3-D input is
    refused with the module's name."""
    x = inputs()
    for config in CONFIGS.values():
        torch.manual_seed(0)
        conv = nn.Conv2d(2, 4, 3, **config).to(DT)  # type: ignore[arg-type]
        if conv.groups != 1:
            continue
        out = conv(x)
        patches = conv2d_patches(conv, x)
        bias = 0.0 if conv.bias is None else conv.bias[:, None]
        lin = conv.weight.reshape(4, -1) @ patches + bias
        torch.testing.assert_close(lin.reshape(out.shape), out)
    with pytest.raises(ValueError, match=r"'body\.0'.*batched"):
        conv2d_patches(nn.Conv2d(2, 4, 3).to(DT), x[0], name="body.0")
