"""Checks of a fit's batches made on the device and tested once, at the end of the fit.

A check of a tensor's values (finite outputs, labels in range, a finite curvature) needs its
answer on the host: ``bool(t)`` waits for every queued kernel (a host sync on a GPU; on the
CPU a few more dispatched operations and a Python branch). Inside a fit's loop over batches
that is one wait per check and batch. Here a check records small tensors computed where the
data live: outside a scope it is tested at once (the behaviour of a lone call); inside
:func:`deferred_checks` it is recorded with its message and the scope's current batch number,
and nothing is read. When the scope ends normally the records are stacked and tested with
ONE sync; if one failed, the first failed check (in recording order, so the earliest batch)
is located after the fact and raised as the ``ValueError`` its caller would have raised at
once, with the batch named: ``"<message> (batch <i> of the fit, counting from 0)"``.

Three kinds, each as cheap per batch as its reduction: :func:`check_finite` (the min and max
of a tensor, one ``aminmax``, must be finite), :func:`check_finite_values` (given 0-dim
values, e.g. per-tensor maxima, must be finite), :func:`check_range` (integer labels: the
min >= 0 and the max < an upper bound) and the general :func:`check` (a 0-dim bool flag).
The tests of a scope's records are vectorised at its end (a few operations per fit).

What the caller of a scope must accept: work done after a failed check (the rest of the bad
batch and the batches after it) is not undone by the scope. Fits that open one build their
statistics in new objects that replace the old ones only after the scope has ended
(``Laplace.fit``), or set the state back (:func:`gaussify.curvature.fitting.fit_curvature`),
so a failed fit still leaves the previous state untouched.

Scopes nest: an inner :func:`deferred_checks` joins the outer one (one test at the outer end).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "DeferredChecks",
    "check",
    "check_finite",
    "check_finite_values",
    "check_range",
    "deferred_checks",
    "deferring",
    "deferring_on",
]

#: a message, or a function of the failed check's values (read on the host only on failure)
Message = str | Callable[..., str]


class DeferredChecks:
    """The checks recorded in one scope, by kind, each with its message, the batch number
    it was recorded in (``batch``, set by the fit's loop) and its position in recording
    order. The recorded tensors are kept as given (the checks below pass values that need
    no gradient: reductions of detached tensors, integer labels, bool flags)."""

    def __init__(self) -> None:
        self.batch: int | None = None
        self._count = 0
        self._finite: list[Tensor] = []  # 0-dim values that must be finite
        self._finite_meta: list[tuple[int, Message, tuple[Any, ...], int | None]] = []
        self._flags: list[Tensor] = []  # 0-dim bools that must be True
        self._flag_meta: list[tuple[int, Message, tuple[Any, ...], int | None]] = []
        self._lo: list[Tensor] = []  # ranges: lo >= 0 and hi < upper
        self._hi: list[Tensor] = []
        self._upper: list[int] = []
        self._range_meta: list[tuple[int, Message, tuple[Any, ...], int | None]] = []

    def __len__(self) -> int:
        return self._count

    def _meta(self, message: Message, args: tuple[Any, ...]) -> tuple[Any, ...]:
        self._count += 1
        return (self._count - 1, message, args, self.batch)

    def add_finite(self, values: Sequence[Tensor], message: Message, *args: Any) -> None:
        """Record 0-dim ``values`` that must be finite; ``message(i, value, *args)`` names
        the failure of the i-th if callable."""
        for i, v in enumerate(values):
            self._finite.append(v)
            self._finite_meta.append(self._meta(message, (i, *args)))

    def add_flag(self, ok: Tensor, message: Message, *args: Any) -> None:
        """Record the 0-dim bool ``ok`` (False: the check failed)."""
        self._flags.append(ok.reshape(()))
        self._flag_meta.append(self._meta(message, args))

    def add_range(self, lo: Tensor, hi: Tensor, upper: int, message: Message) -> None:
        """Record that integers in [lo, hi] must lie in [0, upper)."""
        self._lo.append(lo)
        self._hi.append(hi)
        self._upper.append(upper)
        self._range_meta.append(self._meta(message, ()))

    def _failures(self) -> int:
        """Number of failed records: the tests stacked per device (labels may live on
        another device than the outputs), one host read per device (one in practice)."""
        counts: dict[torch.device, list[Tensor]] = {}
        for flags, test in ((self._finite, _not_finite), (self._flags, _false)):
            for device, group in _by_device(flags).items():
                counts.setdefault(device, []).append(test(torch.stack(group)))
        ranges = zip(self._lo, self._hi, self._upper, strict=True)
        groups: dict[torch.device, list[tuple[Tensor, Tensor, int]]] = {}
        for lo, hi, upper in ranges:
            groups.setdefault(hi.device, []).append((lo, hi, upper))
        for device, group in groups.items():
            lo = torch.stack([g[0] for g in group])
            hi = torch.stack([g[1] for g in group])
            upper = torch.tensor([g[2] for g in group], device=device)
            counts.setdefault(device, []).append(((lo < 0) | (hi >= upper)).sum())
        return sum(int(torch.stack(parts).sum()) for parts in counts.values())

    def raise_first(self) -> None:
        """Test every record with one host sync; raise the first failed check's
        ``ValueError`` (naming its batch). The records are cleared either way."""
        if not self._count:
            return
        failed = self._failures()
        if not failed:
            self.__init__()  # type: ignore[misc]
            return
        # only on failure: locate the first failed record of each kind, then the earliest
        first: list[tuple[int, str, int | None]] = []
        for v, (pos, message, args, batch) in zip(self._finite, self._finite_meta, strict=True):
            if not bool(torch.isfinite(v)):
                first.append((pos, _text(message, args[0], v, *args[1:]), batch))
                break
        for ok, (pos, message, args, batch) in zip(self._flags, self._flag_meta, strict=True):
            if not bool(ok):
                first.append((pos, _text(message, *args), batch))
                break
        ranges = zip(self._lo, self._hi, self._upper, self._range_meta, strict=True)
        for lo, hi, upper, (pos, message, _, batch) in ranges:
            if int(lo) < 0 or int(hi) >= upper:
                first.append((pos, _text(message, int(lo), int(hi)), batch))
                break
        self.__init__()  # type: ignore[misc]
        _, text, batch = min(first, key=lambda item: item[0])
        if batch is not None:
            text += f" (batch {batch} of the fit, counting from 0)"
        raise ValueError(text)


def _by_device(tensors: list[Tensor]) -> dict[torch.device, list[Tensor]]:
    groups: dict[torch.device, list[Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return groups


def _not_finite(values: Tensor) -> Tensor:
    return (~torch.isfinite(values)).sum()


def _false(flags: Tensor) -> Tensor:
    return (~flags).sum()


_ACTIVE: ContextVar[DeferredChecks | None] = ContextVar("gaussify_deferred_checks", default=None)


def deferring() -> bool:
    """Whether a :func:`deferred_checks` scope is open (checks are recorded, not tested)."""
    return _ACTIVE.get() is not None


#: whether :func:`deferring_on` defers on the CPU too (tests set it to run the accelerators'
#: route on the CPU)
DEFER_ON_CPU = False


def deferring_on(device: torch.device) -> bool:
    """Whether a check of a tensor on ``device`` is recorded rather than read at once: a scope
    is open and the device is an accelerator, where a host read waits for every queued
    kernel. On the CPU a read costs a few dispatched operations, and one record per batch or
    chunk held between a fit's large blocks fragmented glibc's heap (the full GGN's CNN fit:
    146 -> 261 MiB of RSS, 5-10 % slower, live allocations unchanged). Used by the checks
    added for the GPU in issue 17's session 9 (the full GGN's, the generic Jacobian's, the
    traced KFAC predictive's); the diagonal's and KFAC's fit checks defer on every device."""
    return (DEFER_ON_CPU or device.type != "cpu") and deferring()


@contextmanager
def deferred_checks() -> Iterator[DeferredChecks]:
    """A scope whose checks are recorded and tested once when it ends normally (an exception
    inside it propagates without the test). Nested scopes join the outer one."""
    outer = _ACTIVE.get()
    if outer is not None:
        yield outer
        return
    scope = DeferredChecks()
    token = _ACTIVE.set(scope)
    try:
        yield scope
    finally:
        _ACTIVE.reset(token)
    scope.raise_first()


def _text(message: Message, *args: Any) -> str:
    return message(*args) if callable(message) else message


def check(ok: Tensor, message: Message, *args: Any) -> None:
    """Require the 0-dim bool tensor ``ok``: recorded inside a :func:`deferred_checks`
    scope (no host sync); outside, tested now and ``ValueError(message)`` raised if False
    (``message(*args)`` if it is callable)."""
    scope = _ACTIVE.get()
    if scope is not None:
        scope.add_flag(ok, message, *args)
    elif not bool(ok):
        raise ValueError(_text(message, *args))


def check_finite(t: Tensor, message: str) -> None:
    """Require every entry of the floating tensor ``t`` to be finite, from one min/max
    reduction (NaN propagates into both, +-inf reaches one): no per-entry mask; recorded
    inside a scope, tested now outside."""
    if t.numel() == 0 or not t.is_floating_point():
        return
    lo, hi = torch.aminmax(t.detach())
    scope = _ACTIVE.get()
    if scope is not None:
        scope.add_finite((lo, hi), message)
    elif not bool(torch.isfinite(lo) & torch.isfinite(hi)):
        raise ValueError(message)


def check_finite_values(values: Sequence[Tensor], message: Callable[[int, Tensor], str]) -> None:
    """Require the 0-dim ``values`` to be finite; ``message(i, value)`` for the first that is
    not. Recorded inside a scope (no host sync), tested now outside."""
    scope = _ACTIVE.get()
    if scope is not None:
        scope.add_finite(values, message)
        return
    for i, v in enumerate(values):
        if not bool(torch.isfinite(v)):
            raise ValueError(message(i, v))


def check_range(lo: Tensor, hi: Tensor, upper: int, message: Callable[[int, int], str]) -> None:
    """Require integers whose min is ``lo`` and max is ``hi`` (0-dim) to lie in
    [0, ``upper``); ``message(lo, hi)`` names the failure. Recorded inside a scope, tested now
    outside."""
    scope = _ACTIVE.get()
    if scope is not None:
        scope.add_range(lo, hi, upper, message)
    elif int(lo) < 0 or int(hi) >= upper:
        raise ValueError(message(int(lo), int(hi)))
