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

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from gaussify.deferred_checks import check


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


def categorical(
    probs: Tensor, generator: torch.Generator | None = None, *, validate: bool = True
) -> Tensor:
    """One class index per row of ``probs (N, C)`` (rows need not be normalised), on
    ``probs``'s device; drawn on ``generator``'s device when one is given.

    argmax_c p_c / q_c with q_c ~ Exp(1) i.i.d.: the index c has probability
    p_c / sum p (the exponential race; the Gumbel-max trick with p / q = exp(log p - log q)
    and -log q Gumbel distributed). This is ``torch.multinomial(probs, 1)``'s own draw, from
    the same random numbers of the same generator (the draws are identical), without its
    validity test's host read: ``validate`` records that test (entries >= 0 and finite,
    ``ValueError`` naming ``probs``) as a check of :mod:`gaussify.deferred_checks`, tested
    at once outside a fit's scope and once per fit inside it (``validate=False``: the
    caller has checked, e.g. probabilities from a softmax of checked outputs)."""
    if validate and probs.numel():
        lo, hi = torch.aminmax(probs.detach())
        check((lo >= 0) & (hi < math.inf), "probs: entries must be finite and >= 0")
    if generator is None:
        q = torch.empty_like(probs).exponential_(1)
        return (probs / q).argmax(-1)
    p = probs.to(generator.device)
    q = torch.empty_like(p).exponential_(1, generator=generator)
    return (p / q).argmax(-1).to(probs.device)


def bernoulli(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """``y ~ Bernoulli(probs)`` elementwise, on ``probs``'s device; drawn on ``generator``'s
    device when one is given."""
    if generator is None:
        return torch.bernoulli(probs)
    return torch.bernoulli(probs.to(generator.device), generator=generator).to(probs.device)
