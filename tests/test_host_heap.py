"""gaussify.host_heap: after ``keep_freed_memory(n)`` glibc keeps freed blocks of up to n in the
heap, so a loop that allocates and frees a few megabytes per step stops faulting fresh pages
in (issue 17: the CPU fits' chunks). Measured in fresh processes (the heap's thresholds are
process-wide and only ever raised): minor page faults of steps 2-9 of a loop that allocates
four 2 MB tensors, writes them and frees them."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch

from gaussify.host_heap import keep_freed_memory

_LOOP = """
import resource, sys, torch
from gaussify.host_heap import keep_freed_memory
if sys.argv[1] == "on":
    keep_freed_memory(16 * 2**20, torch.device("cpu"))

def step():
    blocks = [torch.empty(2 * 2**20, dtype=torch.uint8) for _ in range(4)]
    for b in blocks:
        b.fill_(1)
    del blocks

step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(side: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _LOOP, side], capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="glibc's malloc thresholds",
)
def test_freed_blocks_stay_in_the_heap() -> None:
    off, on = _faults("off"), _faults("on")
    # one step's 8 MB is 2,048 pages. off: the freed 8 MB heap top exceeds glibc's trim
    # threshold (twice the 2 MB mapping threshold it reached by itself), so steps fault it
    # in again (measured 4,500-16,000 faults over the 8 steps); on: at most once
    assert on <= 2048 < off, (on, off)


def test_other_devices_and_smaller_sizes_do_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import gaussify.host_heap as heap

    made: list[int] = []
    real_empty = torch.empty

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        made.append(int(args[0]))
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(heap, "_raised", 0)
    monkeypatch.setattr(heap.torch, "empty", spy)
    keep_freed_memory(1 << 20, torch.device("meta"))
    assert made == []
    keep_freed_memory(1 << 20, torch.device("cpu"))
    keep_freed_memory(1 << 19, torch.device("cpu"))  # smaller: already kept
    keep_freed_memory(1 << 40, torch.device("cpu"))  # capped below glibc's 32 MiB maximum
    assert made == [(1 << 20) + 1, heap._MOST + 1]
