"""``gaussify.draws``: seeded draws come from the generator's own device and land on the
target device (a CPU generator may seed draws for a CUDA model); unseeded ones come from the
target device's global stream. On a CPU-only machine the target ``meta`` stands in for a GPU
(the CUDA cases of tests/test_devices.py run the real thing where a GPU is present)."""

from __future__ import annotations

import torch

from gaussify import draws


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_normal_equals_the_generators_own_stream_and_lands_on_the_target() -> None:
    want = torch.randn(4, 3, generator=_gen(), dtype=torch.float64)
    got = draws.normal((4, 3), dtype=torch.float64, device="cpu", generator=_gen())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    moved = draws.normal((4, 3), dtype=torch.float64, device="meta", generator=_gen())
    assert moved.device.type == "meta" and moved.shape == (4, 3)


def test_unseeded_normal_uses_the_global_stream_of_the_device() -> None:
    torch.manual_seed(3)
    want = torch.randn(5)
    torch.manual_seed(3)
    torch.testing.assert_close(draws.normal((5,), dtype=torch.float32, device="cpu"), want)


def test_categorical_and_bernoulli_follow_the_generator() -> None:
    probs = torch.tensor([[0.2, 0.8], [0.5, 0.5], [0.9, 0.1]], dtype=torch.float64)
    want = torch.multinomial(probs, 1, generator=_gen(1)).squeeze(-1)
    torch.testing.assert_close(draws.categorical(probs, _gen(1)), want, rtol=0, atol=0)
    p = torch.full((6,), 0.3, dtype=torch.float64)
    torch.testing.assert_close(
        draws.bernoulli(p, _gen(2)), torch.bernoulli(p, generator=_gen(2)), rtol=0, atol=0
    )
    # frequencies: 4000 draws of a categorical row match its probabilities within 4 SE
    rows = probs[:1].expand(4000, 2)
    freq = draws.categorical(rows, _gen(5)).double().mean()
    assert abs(float(freq) - 0.8) < 4 * (0.8 * 0.2 / 4000) ** 0.5
