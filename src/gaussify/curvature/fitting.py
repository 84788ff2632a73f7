"""A curvature's whole fit: ``update`` over every batch, the checks tested once at the end.

Each ``update`` on its own tests its batch (finite outputs, labels in range, a finite sum)
and raises before changing the state: a host sync per check and batch. A fit over many
batches needs only to know, at its end, that every batch passed: :func:`fit_curvature` runs
the updates inside one :func:`gaussify.deferred_checks.deferred_checks` scope, so the checks
are computed on the device, recorded, and tested with one sync after the last batch; the
first failed one raises the same ``ValueError`` naming its batch. The fit stays
transactional as a whole: on failure the curvature's state is set back to what it was before
the call (its ``state_dict``; an empty curvature to zeros).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from gaussify.batches import Batches, as_batches
from gaussify.curvature.base import Curvature
from gaussify.deferred_checks import deferred_checks

__all__ = ["fit_curvature"]


def fit_curvature(
    curvature: Curvature, model: nn.Module, data: Batches, batch_size: int = 256
) -> Curvature:
    """Add every batch of ``data`` (a DataLoader or an (x, y) pair split into ``batch_size``
    rows) to ``curvature`` (``curvature.update(model, x, y)``) with the per-batch checks made
    on the device and tested once at the end (:mod:`gaussify.deferred_checks`). Returns the
    curvature. A failed check raises its ``ValueError`` with the batch named (counting from
    0) and leaves the curvature as it was before the call (as does any other error raised
    by an update)."""
    before = _snapshot(curvature)
    try:
        with deferred_checks() as scope:
            for i, (x, y) in enumerate(as_batches(data, batch_size)):
                scope.batch = i
                curvature.update(model, x, y)
    except Exception:  # a failed check, or any error in an update: the state set back
        curvature.load_state_dict(before())
        raise
    return curvature


def _snapshot(curvature: Curvature) -> Callable[[], dict[str, Any]]:
    """The state to set back on failure: a copy of a non-empty state (held during the fit);
    for an empty one only its shapes, whose zeros are made on failure (no second P-sized
    tensor held while fitting)."""
    if curvature.num_data:
        saved = curvature.state_dict()
        return lambda: saved
    state = curvature.state_dict()
    shapes = {k: (v.shape, v.dtype, v.device) for k, v in state.items() if isinstance(v, Tensor)}
    rest = {k: v for k, v in state.items() if not isinstance(v, Tensor)}
    del state

    def zeros() -> dict[str, Any]:
        made = {k: torch.zeros(s, dtype=d, device=dev) for k, (s, d, dev) in shapes.items()}
        return made | rest

    return zeros
