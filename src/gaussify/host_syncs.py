"""Counting a piece of code's reads of tensor values on the host (host syncs).

``.item()``, ``bool(t)``, ``int(t)`` and ``float(t)`` of a tensor all dispatch
``aten::_local_scalar_dense``: on a GPU each waits for every queued kernel, on the CPU it is
a few more dispatched operations and a Python branch. :class:`HostSyncs` is a dispatch mode
that counts those calls made while it is active, e.g. to check that a fit reads the device
a fixed number of times whatever its number of batches (:mod:`gaussify.deferred_checks`).
Reads made inside an operator's own kernel (e.g. ``torch.multinomial``'s validity test) do
not pass through the mode and are not counted.

    with HostSyncs() as syncs:
        fit_curvature(curvature, model, loader)
    syncs.count
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncs"]


class HostSyncs(TorchDispatchMode):
    """A dispatch mode counting ``aten::_local_scalar_dense`` calls (``count``) while it is
    entered; every operation runs unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))
