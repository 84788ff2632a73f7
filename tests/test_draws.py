"""``gaussify.draws``: seeded draws come from the generator's own device and land on the
target device (a CPU generator may seed draws for a CUDA model); unseeded ones come from the
target device's global stream. On a CPU-only machine the target ``meta`` stands in for a GPU
(the CUDA cases of tests/test_devices.py run the real thing where a GPU is present)."""

from __future__ import annotations

import pytest
import torch

from gaussify import draws
from gaussify.deferred_checks import deferred_checks
from gaussify.host_syncs import HostSyncs


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


def test_categorical_is_multinomials_draw_without_its_host_read() -> None:
    """The same indices as torch.multinomial from the same generator state (also
    unnormalised and strided rows, float32), the generator advanced alike; invalid rows
    raise a ValueError naming probs at once outside a fit's scope and at its end inside
    (no host read before), where multinomial's kernel reads the device to test them."""
    g = torch.Generator().manual_seed(4)
    probs = torch.rand(50, 12, generator=g)[:, ::2] * 3  # strided, unnormalised
    for p in (probs, probs.double(), torch.softmax(torch.randn(300, 100, generator=g), -1)):
        g1, g2 = _gen(7), _gen(7)
        want = torch.multinomial(p, 1, generator=g1).squeeze(-1)
        torch.testing.assert_close(draws.categorical(p, g2), want, rtol=0, atol=0)
        assert torch.equal(g1.get_state(), g2.get_state())
    torch.manual_seed(11)
    want = torch.multinomial(probs, 1).squeeze(-1)
    torch.manual_seed(11)
    torch.testing.assert_close(draws.categorical(probs), want, rtol=0, atol=0)
    bad = probs.clone()
    bad[3, 1] = -0.5
    with pytest.raises(ValueError, match=r"^probs: entries must be finite and >= 0$"):
        draws.categorical(bad, _gen())
    bad[3, 1] = float("nan")
    failure = r"^probs: .*\(batch 2 of"
    with HostSyncs() as mode, pytest.raises(ValueError, match=failure), deferred_checks() as scope:
        scope.batch = 2
        draws.categorical(bad, _gen())
        assert mode.count == 0
