"""Size guards: refuse an allocation that cannot fit before it is attempted.

Several structures hold objects that grow super-linearly in a size the user does not always
see: the full GGN is P x P (P = 312k parameters: 389 GB in float32), a joint predictive is
(N C)^2, a function-space kernel (N C)^2 or (M C)^2, a Kronecker factor side^2, an exact last
layer C (D+1)^2. Asking the allocator for such a block either fails late with an opaque
allocator message or, with memory overcommit, gets the process killed when the pages are
touched. :func:`check_allocation` is called with the number of elements *before* the block is
created and raises :class:`AllocationError` naming the object, its size and the cheaper
alternatives when the size exceeds the allocation limit.

The limit, in bytes, is the first of these that is set:

1. the ``limit`` argument of :func:`check_allocation`;
2. the module setting :data:`MAX_BYTES` (e.g. ``with max_bytes(2e9): ...`` in a test);
3. the environment variable ``GAUSSIFY_MAX_BYTES`` (a number of bytes; ``inf`` disables
   the guard);
4. :data:`DEFAULT_FRACTION` of the memory available now on the target device: on CPU,
   ``MemAvailable`` of ``/proc/meminfo``, else the free physical pages from ``os.sysconf``,
   capped by a cgroup v2 ``memory.max`` and an address-space limit (``ulimit -v``); on
   CUDA, the free device memory plus what torch's caching allocator holds unused. Where
   none of these can be read, no limit.

One block of half the available memory is refused by default because none of these objects
is allocated alone: the full GGN is updated through a second P x P temporary and factorised
into a third, a kernel is Cholesky-factorised next to itself.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

__all__ = [
    "DEFAULT_FRACTION",
    "ENV_VAR",
    "MAX_BYTES",
    "AllocationError",
    "allocation_limit",
    "available_bytes",
    "check_allocation",
    "format_bytes",
    "max_bytes",
]

#: Module-level limit in bytes (None: use the environment variable or the default).
MAX_BYTES: float | None = None
#: Environment variable holding a limit in bytes ("inf" disables the guard).
ENV_VAR = "GAUSSIFY_MAX_BYTES"
#: Default limit as a fraction of the memory available on the device.
DEFAULT_FRACTION = 0.5


class AllocationError(ValueError, MemoryError):
    """An allocation was refused before it was attempted because it exceeds the limit.

    A ``ValueError`` (the arguments ask for an impossible size) and a ``MemoryError`` (code
    that catches out-of-memory conditions catches it too). ``num_bytes`` and ``limit`` are
    the requested size and the limit in bytes."""

    def __init__(self, message: str, num_bytes: int, limit: float) -> None:
        super().__init__(message)
        self.num_bytes = num_bytes
        self.limit = limit


def format_bytes(num_bytes: float) -> str:
    """A byte count in decimal units: '389.4 GB', '12.0 MB', '512 B'."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{int(num_bytes)} B"


def _read_int(path: str) -> int | None:
    try:
        with open(path) as fh:
            text = fh.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cpu_available() -> int | None:
    available: int | None = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        available = None
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = None
    cap, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if cap is not None and used is not None:
        room = max(cap - used, 0)
        available = room if available is None else min(available, room)
    room = _address_space_room()
    if room is not None:
        available = room if available is None else min(available, room)
    return available


def _address_space_room() -> int | None:
    """What an address-space limit (``ulimit -v``) leaves above the process's current size."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY or soft < 0:
            return None
        with open("/proc/self/statm") as fh:
            size = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (ImportError, OSError, ValueError, IndexError):
        return None
    return max(soft - size, 0)


def available_bytes(device: torch.device | str | None = None) -> int | None:
    """Memory available now on ``device`` (default CPU) in bytes, or None if unknown."""
    dev = torch.device("cpu" if device is None else device)
    if dev.type == "cuda":
        try:
            free, _ = torch.cuda.mem_get_info(dev)
            cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        except (RuntimeError, AssertionError):
            return None
        return int(free + max(cached, 0))
    if dev.type == "cpu":
        return _cpu_available()
    return None


def allocation_limit(device: torch.device | str | None = None) -> tuple[float, str]:
    """The limit in bytes for one allocation on ``device`` and where it comes from."""
    if MAX_BYTES is not None:
        return float(MAX_BYTES), "gaussify.memory_guard.MAX_BYTES"
    env = os.environ.get(ENV_VAR)
    if env is not None and env.strip():
        try:
            value = float(env)
        except ValueError as err:
            raise ValueError(
                f"{ENV_VAR}: expected a number of bytes (or 'inf'), got {env!r}"
            ) from err
        if math.isnan(value) or value < 0:
            raise ValueError(f"{ENV_VAR}: expected a number of bytes >= 0, got {env!r}")
        return value, f"the environment variable {ENV_VAR}"
    available = available_bytes(device)
    if available is None:
        return math.inf, "no limit (available memory unknown)"
    share = f"{DEFAULT_FRACTION:g} of the {format_bytes(available)} available"
    return DEFAULT_FRACTION * available, share


@contextmanager
def max_bytes(limit: float | None) -> Iterator[None]:
    """Set :data:`MAX_BYTES` inside a ``with`` block (tests, or a deliberate override)."""
    global MAX_BYTES
    previous = MAX_BYTES
    MAX_BYTES = limit
    try:
        yield
    finally:
        MAX_BYTES = previous


def check_allocation(
    num_elements: int,
    dtype: torch.dtype,
    what: str,
    alternatives: Sequence[str] | str,
    *,
    limit: float | None = None,
    device: torch.device | str | None = None,
) -> int:
    """Raise :class:`AllocationError` if ``num_elements`` of ``dtype`` on ``device`` exceed
    the allocation limit (module docstring); otherwise return the size in bytes.

    ``what`` names the object ("structure='full': the P x P GGN, P = 312,010");
    ``alternatives`` lists what to use instead (shown in the message).
    """
    num_bytes = int(num_elements) * torch.empty((), dtype=dtype).element_size()
    if limit is None:
        bound, source = allocation_limit(device)
    else:
        bound, source = float(limit), "the limit argument"
    if num_bytes <= bound:
        return num_bytes
    if not isinstance(alternatives, str):
        alternatives = ", ".join(alternatives)
    raise AllocationError(
        f"{what} needs {format_bytes(num_bytes)} ({int(num_elements):,} {dtype} numbers), more "
        f"than the allocation limit of {format_bytes(bound)} ({source}); use {alternatives} "
        f"instead, or raise the limit ({ENV_VAR} or gaussify.memory_guard.MAX_BYTES, in bytes)",
        num_bytes,
        bound,
    )
