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
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "ngvi.md"
sys.path.insert(0, str(ROOT / "scripts"))

from docs_page import example_code, replace_block, run_example  # noqa: E402

FIGURES = ROOT / "docs" / "figures"
RESULTS = ROOT / "benchmarks" / "results" / "experiments_ngvi_predictive.json"


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
        print(f"example ran in {run_example(example_code(page, PAGE), PAGE):.1f} s")
    if args.no_experiments:
        return
    res = ngvi_predictive.run(steps=args.steps)
    print(res.table())
    print(f"experiments ran in {res.runtime_s:.1f} s")
    ngvi_predictive.plot(res, FIGURES)
    print(f"wrote {write_json(RESULTS, res.to_dict())}")
    PAGE.write_text(replace_block(page, "ngvi-table", res.table(), PAGE))


if __name__ == "__main__":
    main()
