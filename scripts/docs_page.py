"""What the ``scripts/make_*_docs.py`` builders share: a docs page's runnable example (its first
```python block, run as written from the repository root) and its generated blocks (text
between ``<!-- tag:start -->`` and ``<!-- tag:end -->``)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def example_code(page: str, source: Path | str = "page") -> str:
    """The first ```python fenced block of ``page`` (``source`` names it in the error)."""
    match = re.search(r"```python\n(.*?)```", page, flags=re.DOTALL)
    if match is None:
        raise SystemExit(f"{source}: no ```python block found")
    return match.group(1)


def run_example(code: str, source: Path | str = "page", threads: int | None = None) -> float:
    """Execute ``code`` in a fresh namespace from the repository root; return seconds.

    With ``threads``, torch runs with that many intra-op threads meanwhile (small examples
    are fastest single-threaded, and extra threads slow them down on a busy machine)."""
    before = None
    if threads is not None:
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(threads)
    cwd = Path.cwd()
    os.chdir(ROOT)
    start = time.perf_counter()
    try:
        exec(compile(code, str(source), "exec"), {"__name__": "__docs_example__"})
    finally:
        os.chdir(cwd)
        if before is not None:
            import torch

            torch.set_num_threads(before)
    return time.perf_counter() - start


def replace_block(page: str, tag: str, body: str, source: Path | str = "page") -> str:
    """``page`` with the text between ``<!-- tag:start -->`` and ``<!-- tag:end -->``
    replaced by ``body``; a page without both markers is an error naming ``source``."""
    start, end = f"<!-- {tag}:start -->", f"<!-- {tag}:end -->"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), flags=re.DOTALL)
    if not pattern.search(page):
        raise SystemExit(f"{source}: markers {start} ... {end} not found")
    return pattern.sub(lambda _: f"{start}\n{body}\n{end}", page)
