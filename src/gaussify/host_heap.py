"""Keep the C heap from handing a pass's freed temporaries back to the kernel between chunks.

A chunked pass on the CPU (the curvature fits' backward chunks) allocates and frees the same
few-megabyte temporaries once per chunk. glibc's ``malloc`` serves a block above its mmap
threshold (128 KiB at start) with a fresh ``mmap`` and unmaps it when freed, and it trims the
heap's free top above twice that threshold: every chunk then touches fresh pages, each a page
fault the kernel zeroes. glibc raises both thresholds on its own once the process frees a
mapped block (the threshold becomes the block's size, at most 32 MiB), so the same fit runs
fast in a process that freed a large tensor before (any other library's fit) and slow in a
fresh one. Measured in fresh processes (``benchmarks/results/host_heap.json``, 2 threads) on
the 8 x 8 CNN at batch 256: the diagonal GGN's fit had 33,000 minor faults without and 3 with
it, 0.124 against 0.078 s; KFAC's 25,000 and 2, 0.090 against 0.056 s; at batch 32 (smaller
blocks, below glibc's starting thresholds) and on an MLP nothing changes. Called where a pass
is split into chunks (:func:`gaussify.curvature.batched_backward.rule_chunk`).

:func:`keep_freed_memory` makes that first free itself: one block of the pass's size is
allocated without touching its pages and freed at once (an ``mmap`` and ``munmap``, no page
faults), once per process and size. It changes nothing but the thresholds glibc would reach
by itself after the first such free, and is a no-op on other allocators (a ``malloc`` and
``free`` of an untouched block) and for devices other than the CPU. Its cost: freed blocks
up to twice the size stay in the process's heap for reuse instead of going back to the
kernel at once (glibc's own trade-off after any large free).
"""

from __future__ import annotations

import torch

__all__ = ["keep_freed_memory"]

#: glibc's cap on its dynamic mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit) less room
#: for the mapped chunk's header and page rounding: a freed block larger than the cap does
#: not raise the threshold at all
_MOST = 32 * 1024 * 1024 - 64 * 1024

#: the largest block freed so far by :func:`keep_freed_memory` in this process
_raised = 0


def keep_freed_memory(nbytes: int, device: torch.device) -> None:
    """Free one untouched block of ``nbytes`` (at most about 32 MiB) on the CPU, once per process
    and size, so that glibc keeps blocks of up to that size in its heap between a pass's
    chunks (module docstring)."""
    global _raised
    if device.type != "cpu":
        return
    size = min(int(nbytes), _MOST)
    if size <= _raised:
        return
    block = torch.empty(size + 1, dtype=torch.uint8)  # just above: the threshold is > size
    del block
    _raised = size
