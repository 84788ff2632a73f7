"""Seeded random draws for tensors on any device.

A ``torch.Generator`` lives on one device, and torch refuses to draw from a CPU generator
into a CUDA tensor (``Expected a 'cuda' device type for generator``). Every seeded draw of
the library therefore goes through this module: with a generator, the numbers come from the
generator's own device and are copied to the target device, so one CPU generator gives the
same draws to a model on the CPU and on a GPU; without one, they come from the target
device's global stream (no host copy). ``tests/test_device_rules.py`` refuses a seeded draw
made elsewhere with an explicit ``device=``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def normal(
    shape: Sequence[int],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``eps ~ N(0, I)`` of ``shape`` on ``device``: from ``generator`` (on its device, then
    copied) when one is given, else from ``device``'s global stream."""
    if generator is None:
        return torch.randn(tuple(shape), dtype=dtype, device=device)
    eps = torch.randn(tuple(shape), generator=generator, dtype=dtype, device=generator.device)
    return eps.to(device)


def categorical(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One class index per row of ``probs (N, C)`` (rows need not be normalised), on
    ``probs``'s device; drawn on ``generator``'s device when one is given."""
    if generator is None:
        return torch.multinomial(probs, 1).squeeze(-1)
    draw = torch.multinomial(probs.to(generator.device), 1, generator=generator)
    return draw.squeeze(-1).to(probs.device)


def bernoulli(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """``y ~ Bernoulli(probs)`` elementwise, on ``probs``'s device; drawn on ``generator``'s
    device when one is given."""
    if generator is None:
        return torch.bernoulli(probs)
    return torch.bernoulli(probs.to(generator.device), generator=generator).to(probs.device)
