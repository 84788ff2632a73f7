"""KFAC's input factor of a stride-1 convolution from shifted products
(gaussify.curvature.conv_gram): equal in float64 to the im2col patches' Gram for kernel
sizes, paddings, dilations and the weight / bias blocks, in chunks; used by the KFAC fit only
where it applies, with the same factors as the patches' route. Also the diagonal's
single-vector route for a convolution's per-sample gradients (one grouped
convolution_backward), equal to the patches' products."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
from torch import nn

import gaussify.curvature.kron_grams as grams
from gaussify.curvature import make_curvature
from gaussify.curvature.conv_gram import conv_input_gram, shift_gram_applies
from gaussify.curvature.kron_grams import augment, gram, layer_inputs

#: the benchmark's models and its measurement of a peak (not copies of them)
BENCH = runpy.run_path(
    str(Path(__file__).resolve().parents[1] / "benchmarks" / "curvature_fits.py")
)


def patches_gram(conv: nn.Conv2d, x: torch.Tensor, use_weight: bool, use_bias: bool):
    a = augment(layer_inputs(conv, x), use_weight, use_bias)
    return gram(a, "expand", "mean"), a.shape[0] * a.shape[1]


CONFIGS = [
    # (C_in, kernel, padding, dilation, (H, W))
    (16, 3, 1, 1, (8, 8)),  # the benchmark's second layer ("same")
    (3, 3, 0, 1, (7, 7)),  # "valid"
    (4, (3, 2), (2, 1), (1, 2), (9, 7)),  # rectangular kernel, wide padding, dilation
    (5, 5, 2, 1, (6, 8)),
    (2, 1, 0, 1, (5, 5)),  # 1 x 1
    (3, 3, 3, 2, (4, 5)),  # padding wider than the input
]


@pytest.mark.parametrize(("c_in", "kernel", "padding", "dilation", "hw"), CONFIGS)
@pytest.mark.parametrize(("use_weight", "use_bias"), [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("budget", [None, 1])
def test_shifted_gram_equals_patches_gram(
    c_in: int,
    kernel: int | tuple[int, int],
    padding: int | tuple[int, int],
    dilation: int | tuple[int, int],
    hw: tuple[int, int],
    use_weight: bool,
    use_bias: bool,
    budget: int | None,
) -> None:
    """A (weight entries in weight.reshape(out, -1)'s order, then the bias's 1) and the count
    N T equal the patches' sum of [a, 1][a, 1]^T in float64, added into a non-zero ``out``;
    budget 1: one sample per chunk."""
    torch.manual_seed(0)
    conv = nn.Conv2d(c_in, 3, kernel, padding=padding, dilation=dilation).double()
    x = torch.randn(5, c_in, *hw, dtype=torch.float64)
    expected, count = patches_gram(conv, x, use_weight, use_bias)
    start = torch.randn(expected.shape, dtype=torch.float64)
    out = start.clone()
    assert conv_input_gram(conv, x, use_weight, use_bias, out, budget) == count
    torch.testing.assert_close(out - start, expected, rtol=1e-12, atol=1e-12)


def test_applies_only_to_stride_one_ungrouped_zero_padded_and_large_enough() -> None:
    x = torch.randn(64, 16, 8, 8)
    assert shift_gram_applies(nn.Conv2d(16, 16, 3, padding=1), x)
    assert not shift_gram_applies(nn.Conv2d(16, 16, 3, padding=1, stride=2), x)
    assert not shift_gram_applies(nn.Conv2d(16, 16, 3, padding=1, groups=2), x)
    assert not shift_gram_applies(nn.Conv2d(16, 16, 3, padding=1, padding_mode="reflect"), x)
    assert not shift_gram_applies(nn.Conv2d(16, 16, 3, padding="same"), x)
    assert not shift_gram_applies(nn.Linear(16, 16), x)
    # one input channel: the patches' product is small (below MIN_MACS)
    assert not shift_gram_applies(nn.Conv2d(1, 16, 3, padding=1), torch.randn(64, 1, 8, 8))
    # 1 x 1: no saving over the patches (one shift, the same product)
    assert not shift_gram_applies(nn.Conv2d(16, 16, 1), x)
    assert not shift_gram_applies(nn.Conv2d(16, 16, 3, padding=1), x[0])  # not batched


@pytest.mark.parametrize("kron_bias", ["separate", "joint"])
def test_kfac_fit_uses_the_shifted_route_with_the_patches_factors(
    kron_bias: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The KFAC fit of a CNN takes the shifted route for its 16-channel convolution and
    gives the same A factors (and B, M) as the patches' route in float64."""
    torch.manual_seed(0)
    model = (
        nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * 4 * 4, 5),
        )
        .double()
        .eval()
    )
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 1, 8, 8, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 5, (40,), generator=gen)
    calls = []
    shifted = grams.conv_input_gram
    monkeypatch.setattr(
        grams, "conv_input_gram", lambda *a, **k: calls.append(1) or shifted(*a, **k)
    )
    curv = make_curvature("kron", model, "classification", kron_bias=kron_bias)
    curv.update(model, x, y)
    assert calls
    with monkeypatch.context() as m:
        m.setattr(grams, "shift_gram_applies", lambda conv, inp: False)
        ref = make_curvature("kron", model, "classification", kron_bias=kron_bias)
        ref.update(model, x, y)
    for key in ref._a:
        torch.testing.assert_close(curv._a[key], ref._a[key], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(curv._b[key], ref._b[key], rtol=1e-12, atol=1e-15)
        assert curv._m[key] == ref._m[key]


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
        ),
    ],
)
def test_shifted_gram_on_the_inputs_device(device: str) -> None:
    """The factor is formed on the input's device (the indicator and index tensors too) and
    equals the patches' Gram there."""
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 4, 3, padding=1).double().to(device)
    x = torch.randn(7, 6, 5, 6, dtype=torch.float64, device=device)
    expected, count = patches_gram(conv, x, True, True)
    out = torch.zeros_like(expected)
    assert conv_input_gram(conv, x, True, True, out) == count
    assert out.device == x.device
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("conv", "hw"),
    [
        (nn.Conv2d(4, 6, 3, padding=1), (7, 7)),
        (nn.Conv2d(4, 6, (3, 2), stride=2, padding=(1, 0), dilation=(1, 2), groups=2), (9, 8)),
        (nn.Conv2d(3, 5, 1), (4, 4)),
    ],
)
def test_single_vector_squared_grads_equal_the_patches_route(
    conv: nn.Conv2d, hw: tuple[int, int]
) -> None:
    """The diagonal's per-sample squared weight gradients for one vector per sample, from one
    grouped convolution_backward (the samples as groups), equal the patches' products in
    float64 (strides, dilations, groups, rectangular kernels)."""
    from gaussify.curvature.chain_diag import _conv_squared_grads, _single_vector_squared_grads
    from gaussify.curvature.patches import conv2d_patches

    torch.manual_seed(0)
    conv = conv.double()
    a = torch.randn(5, conv.in_channels, *hw, dtype=torch.float64)
    d = torch.randn(5, 1, *conv(a).shape[1:], dtype=torch.float64)
    expected = _conv_squared_grads(conv, conv2d_patches(conv, a), d)
    torch.testing.assert_close(
        _single_vector_squared_grads(conv, a, d), expected, rtol=1e-12, atol=0
    )


@pytest.mark.parametrize(("classes", "ef"), [(10, True), (2, False)])
def test_single_vector_diagonal_keeps_the_memory_rule(classes: int, ef: bool) -> None:
    """The empirical Fisher's diagonal of the benchmark's CNN and the binary exact GGN's (one
    vector per sample: the grouped route, chunks from its own per-sample model): peak of live
    allocations <= 2 (training step + storage), measured as the benchmark does."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(32, 1, 8, 8, generator=gen)
    y = torch.randint(0, classes, (32,), generator=gen)
    model = BENCH["build_model"]("cnn", classes).eval()

    def fit():  # type: ignore[no-untyped-def]
        curv = make_curvature("diag", model, "classification", ef=ef)
        curv.update(model, x, y)
        return curv

    fit()
    curv, peak = BENCH["alloc_peak"](fit)
    _, step = BENCH["alloc_peak"](lambda: BENCH["train_step"](model, x, y))
    storage = sum(t.numel() * t.element_size() for t in curv.state_dict().values())
    assert peak <= 2 * (step + storage), (peak, step, storage)
