"""Build docs/ngvi.md's figures and results table (Immer thesis Sec. 5.2).

1. Runs the page's first ```python block exactly as written (from the repository root, with
   ``src/`` importable): a check that the example runs as-is.
2. Runs the experiment ``gaussify.experiments.ngvi_predictive`` (Laplace-GGN, VOGGN, LGVA and
   OGGN, each predicted by NN sampling and by the GLM, on the 1-D regression toy with a gap
   and on banana; protocol in its docstring), writes ``docs/figures/ngvi_regression.png``,
   ``docs/figures/ngvi_banana.png`` and
   ``benchmarks/results/experiments_ngvi_predictive.json``, and rewrites the table between
   ``<!-- ngvi-table:start/end -->`` in the page. The same run from the command line:
   ``python -m gaussify.experiments.ngvi_predictive --output ... --figure docs/figures``.

Usage: ``python scripts/make_ngvi_docs.py [--no-example] [--no-experiments] [--steps 600]
[--threads 1]``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "ngvi.md"
FIGURES = ROOT / "docs" / "figures"
RESULTS = ROOT / "benchmarks" / "results" / "experiments_ngvi_predictive.json"


def example_code(page: str) -> str:
    """The first ```python fenced block of the page."""
    match = re.search(r"```python\n(.*?)```", page, flags=re.DOTALL)
    if match is None:
        raise SystemExit(f"{PAGE}: no ```python block found")
    return match.group(1)


def run_example(code: str) -> float:
    """Execute the example in a fresh namespace from the repository root; return seconds."""
    cwd = Path.cwd()
    os.chdir(ROOT)
    start = time.perf_counter()
    try:
        exec(compile(code, str(PAGE), "exec"), {"__name__": "__ngvi_example__"})
    finally:
        os.chdir(cwd)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-example", action="store_true")
    parser.add_argument("--no-experiments", action="store_true")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from gaussify.experiments import ngvi_predictive
    from gaussify.experiments._report import write_json

    torch.set_num_threads(args.threads)
    page = PAGE.read_text()
    if not args.no_example:
        print(f"example ran in {run_example(example_code(page)):.1f} s")
    if args.no_experiments:
        return
    res = ngvi_predictive.run(steps=args.steps)
    print(res.table())
    print(f"experiments ran in {res.runtime_s:.1f} s")
    ngvi_predictive.plot(res, FIGURES)
    print(f"wrote {write_json(RESULTS, res.to_dict())}")
    pattern = r"(<!-- ngvi-table:start -->\n).*?(<!-- ngvi-table:end -->)"
    if re.search(pattern, page, flags=re.DOTALL) is None:
        raise SystemExit(f"{PAGE}: no <!-- ngvi-table:start/end --> markers")
    body = res.table() + "\n"
    new = re.sub(pattern, lambda m: m.group(1) + body + m.group(2), page, flags=re.DOTALL)
    PAGE.write_text(new)


if __name__ == "__main__":
    main()
