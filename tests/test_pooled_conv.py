"""A convolution's squared per-sample weight gradients from the maxima of the max-pooling
after it (issue 17, cnn/32/100/diag): equal to the dense im2col products in float64 on the
pass's own gradients, used in a diagonal fit only where it applies and pays, and the fit's
values those of the dense route."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gaussify.curvature import chain_diag, make_curvature
from gaussify.curvature.batched_backward import backward_chunk, chain_forward, module_chain
from gaussify.curvature.fitting import fit_curvature
from gaussify.curvature.patches import conv2d_patches
from gaussify.curvature.pooled_conv import (
    gathered_patches,
    gradient_at_maxima,
    maxima_gradient,
    pooled_squared_grads,
    pooling_after,
    squares_at_maxima,
)

DT = torch.float64


def _cnn(between: list[nn.Module], pool: nn.MaxPool2d, c: int = 20, size: int = 4) -> nn.Module:
    torch.manual_seed(0)
    body = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Conv2d(2, 3, 3, padding=1), *between, pool
    )
    with torch.no_grad():
        flat = body(torch.zeros(1, 1, size, size)).numel()
    return nn.Sequential(*body, nn.Flatten(), nn.Linear(flat, c)).to(DT).eval()


BLOCKS = {
    "relu_2x2": ([nn.ReLU()], nn.MaxPool2d(2)),
    "leaky_batchnorm_3x3_padded": (
        [nn.BatchNorm2d(3), nn.LeakyReLU(0.1)],
        nn.MaxPool2d(3, stride=3, padding=1),
    ),
    "tanh_2x3_ceil": ([nn.Tanh()], nn.MaxPool2d((2, 3), ceil_mode=True)),
}


@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_pooled_squares_equal_the_dense_products_in_float64(block: str) -> None:
    between, pool = BLOCKS[block]
    model = _cnn(between, pool, size=6)
    if isinstance(between[0], nn.BatchNorm2d):  # non-trivial running statistics
        between[0].running_mean.uniform_(-0.5, 0.5)
        between[0].running_var.uniform_(0.5, 2.0)
    chain = module_chain(model)
    assert chain is not None
    x = torch.randn(5, 1, 6, 6, generator=torch.Generator().manual_seed(1), dtype=DT)
    run = chain_forward(chain, x)
    j = pooling_after(run, 2)
    assert j == 3 + len(between)
    u = torch.randn(5, 7, 20, generator=torch.Generator().manual_seed(2), dtype=DT)
    rows = slice(1, 4)
    d = next(g for i, g in backward_chunk(run, u[rows], [2], rows) if i == 2)
    patches = conv2d_patches(chain[2][1], run.acts[2][rows])
    dense = chain_diag._conv_squared_grads(chain[2][1], patches, d)
    pooled = pooled_squared_grads(patches, d, run.indices[j][rows])
    torch.testing.assert_close(pooled, dense, rtol=1e-12, atol=1e-300)


def test_overlapping_or_grouped_or_unpooled_convolutions_are_not_pooled() -> None:
    """Overlapping windows (a position may be the maximum of two), a grouped convolution or
    a convolution not followed by a max-pooling keep the dense products."""
    x = torch.randn(2, 1, 6, 6, dtype=DT)
    for model, i in (
        (_cnn([nn.ReLU()], nn.MaxPool2d(2, stride=1), size=6), 2),
        (_cnn([nn.ReLU()], nn.MaxPool2d(3, stride=2), size=6), 2),
        (_cnn([nn.ReLU()], nn.MaxPool2d(2, dilation=2, stride=2), size=6), 2),
        (_cnn([nn.ReLU()], nn.MaxPool2d(2), size=6), 0),  # conv 0 -> ReLU -> conv 2
    ):
        chain = module_chain(model)
        assert chain is not None
        assert pooling_after(chain_forward(chain, x), i) is None
    grouped = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, groups=2), nn.ReLU(), nn.MaxPool2d(2)).to(
        DT
    )
    chain = module_chain(grouped.eval())
    assert chain is not None
    assert pooling_after(chain_forward(chain, torch.randn(2, 2, 4, 4, dtype=DT)), 0) is None


@pytest.mark.parametrize(("classes", "taken"), [(20, True), (4, False)])
def test_diag_fit_uses_the_pooled_squares_where_they_pay_at_the_dense_values(
    monkeypatch: pytest.MonkeyPatch, classes: int, taken: bool
) -> None:
    """With 19 vectors per pass (20 classes; chunks of 4 samples given, so all vectors go
    together) the second convolution's squares come from the pooling's maxima, with 3 the
    dense products pay; the fitted diagonal equals the dense route's to 1e-12 in float64
    (and the per-vector autograd route's)."""
    model = _cnn([nn.ReLU()], nn.MaxPool2d(2), c=classes)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 1, 4, 4, generator=g, dtype=DT)
    y = torch.randint(0, classes, (24,), generator=g)
    calls: list[int] = []
    real = chain_diag.pooled_squared_grads

    def counted(*args):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(chain_diag, "pooled_squared_grads", counted)
    fitted = fit_curvature(make_curvature("diag", model, "classification", chunk_size=4),
                           model, (x, y), 8)  # fmt: skip
    assert bool(calls) is taken
    monkeypatch.setattr(chain_diag, "_pooled_convs", lambda *args, **kwargs: {})
    dense = fit_curvature(make_curvature("diag", model, "classification", chunk_size=4),
                          model, (x, y), 8)  # fmt: skip
    torch.testing.assert_close(fitted.ggn_diag, dense.ggn_diag, rtol=1e-12, atol=1e-300)
    monkeypatch.undo()
    per_vector = make_curvature("diag", model, "classification", chunk_size=8)
    monkeypatch.setattr(chain_diag, "module_chain", lambda m: None)  # the generic route
    per_vector = fit_curvature(per_vector, model, (x, y), 8)
    torch.testing.assert_close(fitted.ggn_diag, per_vector.ggn_diag, rtol=1e-10, atol=1e-300)


def _first_pooled(between: list[nn.Module], pool: nn.MaxPool2d, c: int, size: int) -> nn.Module:
    """conv -> ``between`` -> ``pool`` first, then a second convolution and a linear head."""
    torch.manual_seed(0)
    body = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), *between, pool, nn.Conv2d(3, 2, 2), nn.Sigmoid()
    ).to(DT)
    with torch.no_grad():
        flat = body(torch.zeros(1, 2, size, size, dtype=DT)).numel()
    model = nn.Sequential(*body, nn.Flatten(), nn.Linear(flat, c)).to(DT).eval()
    for m in between:
        if isinstance(m, nn.BatchNorm2d):  # non-trivial running statistics and affine map
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("block", sorted(BLOCKS))
@pytest.mark.parametrize("k", [1, 3, 40])
def test_squares_from_the_pooling_output_gradient_equal_the_dense_products(
    block: str, k: int
) -> None:
    """The first convolution's squared sums from the gradient of the pooling's output alone
    (the pass stopped there; the maps' derivatives at the maxima) equal the dense im2col
    products of its full output gradient in float64, and so does its bias's, with K = 1
    vector, few (the K gradients formed directly) and many (the Gram route)."""
    between, pool = BLOCKS[block]
    model = _first_pooled(between, pool, c=41, size=7)
    chain = module_chain(model)
    assert chain is not None
    x = torch.randn(5, 2, 7, 7, generator=torch.Generator().manual_seed(1), dtype=DT)
    run = chain_forward(chain, x)
    j = pooling_after(run, 0)
    assert j == 1 + len(between)
    u = torch.randn(5, k, 41, generator=torch.Generator().manual_seed(2), dtype=DT)
    rows = slice(1, 4)
    d = dict(backward_chunk(run, u[rows], [0], rows))[0]
    g = dict(backward_chunk(run, u[rows], [0], rows, stop=j))[0]
    assert g.shape[-2:] == run.acts[j + 1].shape[-2:]  # the pooling's output gradient
    patches = conv2d_patches(chain[0][1], run.acts[0][rows])
    dense = chain_diag._conv_squared_grads(chain[0][1], patches, d)
    h = maxima_gradient(run, 0, j, g, rows)
    flat = run.indices[j][rows].flatten(-2)
    gathered = gathered_patches(patches, flat)
    torch.testing.assert_close(squares_at_maxima(gathered, h), dense, rtol=1e-12, atol=1e-300)
    bias = d.sum((-2, -1)).square().sum((0, 1))
    torch.testing.assert_close(h.sum(-1).square().sum((0, 1)), bias, rtol=1e-12, atol=1e-300)
    # one vector's summed (not squared) weight gradient, the folded residual's
    summed = torch.einsum("bot,bft->of", d[:, -1].flatten(-2), patches)
    torch.testing.assert_close(gradient_at_maxima(gathered, h[:, -1]), summed, rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("flavour", "taken"), [({}, True), ({"mc_samples": 19}, True), ({"ef": True}, False)]
)
@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_diag_fit_stops_at_the_first_pooling_at_the_dense_values(
    monkeypatch: pytest.MonkeyPatch, flavour: dict, taken: bool, block: str
) -> None:
    """A diagonal fit (exact GGN and Monte Carlo with 19 vectors) of a network whose first
    convolution is followed by a max-pooling stops its backward passes at the pooling, at
    the values of the dense route (to 1e-12 in float64) and of the per-vector autograd route;
    with one vector (the empirical Fisher) the patches would exceed the pass's memory and
    the dense route stays."""
    between, pool = BLOCKS[block]
    model = _first_pooled(between, pool, c=20, size=12)
    for m in between:  # its affine map fixed: the fit's parameters are the chain's layers'
        m.requires_grad_(False)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 2, 12, 12, generator=g, dtype=DT)
    y = torch.randint(0, 20, (24,), generator=g)
    stops: list[int | None] = []
    real = chain_diag._stop_at_pooling

    def counted(*args):  # type: ignore[no-untyped-def]
        stops.append(real(*args))
        return stops[-1]

    def fit() -> torch.Tensor:
        curv = make_curvature("diag", model, "classification", chunk_size=5, **flavour)
        if "mc_samples" in flavour:
            curv.generator = torch.Generator().manual_seed(4)
        return fit_curvature(curv, model, (x, y), 8).ggn_diag

    monkeypatch.setattr(chain_diag, "_stop_at_pooling", counted)
    stopped = fit()
    assert stops
    assert all(s == (1 + len(between) if taken else None) for s in stops)
    monkeypatch.setattr(chain_diag, "_stop_at_pooling", lambda *args: None)
    monkeypatch.setattr(chain_diag, "_pooled_convs", lambda *args, **kwargs: {})
    torch.testing.assert_close(stopped, fit(), rtol=1e-12, atol=1e-300)
    monkeypatch.setattr(chain_diag, "module_chain", lambda m: None)  # the generic route
    torch.testing.assert_close(stopped, fit(), rtol=1e-10, atol=1e-300)
