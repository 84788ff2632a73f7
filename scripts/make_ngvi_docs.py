"""Build docs/ngvi.md's figures and results tables (Immer thesis Sec. 5.2 and Fig. 5.2).

1. Runs the page's first ```python block exactly as written (from the repository root, with
   ``src/`` importable): a check that the example runs as-is.
2. Runs the experiment ``gaussify.experiments.ngvi_predictive`` (Laplace-GGN, VOGGN, LGVA and
   OGGN, each predicted by NN sampling and by the GLM, on the 1-D regression toy with a gap
   and on banana, over ``--seeds``; protocol in its docstring), writes
   ``docs/figures/ngvi_regression.png``, ``docs/figures/ngvi_banana.png`` and
   ``benchmarks/results/experiments_ngvi_predictive.json``, and rewrites the table between
   ``<!-- ngvi-table:start/end -->`` in the page.
3. Runs ``gaussify.experiments.marglik_regression`` (thesis Fig. 5.2: the evidence over prior
   precision and noise), writes ``docs/figures/marglik_regression.png`` and
   ``benchmarks/results/experiments_marglik_regression.json``, and rewrites the table between
   ``<!-- marglik-regression-table:start/end -->``.

The same runs from the command line: ``python -m gaussify.experiments.ngvi_predictive --seeds
0 1 2 --steps 200 --jobs 3 --output ... --figure docs/figures`` and ``python -m
gaussify.experiments.marglik_regression --output ... --figure ...``. ``--from-json`` rewrites
both tables from the committed JSON files without running anything.

Usage: ``python scripts/make_ngvi_docs.py [--no-example] [--no-experiments] [--from-json]
[--steps 200] [--seeds 0 1 2] [--jobs 3] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "ngvi.md"
sys.path.insert(0, str(ROOT / "scripts"))

from docs_page import example_code, replace_block, run_example  # noqa: E402

FIGURES = ROOT / "docs" / "figures"
RESULTS = ROOT / "benchmarks" / "results" / "experiments_ngvi_predictive.json"
SELECTION = ROOT / "benchmarks" / "results" / "experiments_marglik_regression.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-example", action="store_true")
    parser.add_argument("--no-experiments", action="store_true")
    parser.add_argument("--from-json", action="store_true", help="tables from the JSON files")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from gaussify.experiments import marglik_regression, ngvi_predictive
    from gaussify.experiments._report import write_json

    torch.set_num_threads(args.threads)
    page = PAGE.read_text()
    if not args.no_example:
        print(f"example ran in {run_example(example_code(page, PAGE), PAGE):.1f} s")
    if args.from_json:
        data = json.loads(RESULTS.read_text())
        res = ngvi_predictive.PredictiveResults(
            data["config"], data["records"], data["hyper"], data["notes"], data["runtime_s"]
        )
        sel = json.loads(SELECTION.read_text())
        selection = marglik_regression.RegressionSelection(
            sel["config"], sel["grid"], sel["summary"], sel["fixed_map"], sel["notes"],
            sel["runtime_s"],
        )  # fmt: skip
    elif args.no_experiments:
        return
    else:
        res = ngvi_predictive.run(steps=args.steps, seeds=args.seeds, jobs=args.jobs)
        print(f"ngvi_predictive ran in {res.runtime_s:.1f} s")
        ngvi_predictive.plot(res, FIGURES)
        print(f"wrote {write_json(RESULTS, res.to_dict())}")
        selection = marglik_regression.run()
        print(f"marglik_regression ran in {selection.runtime_s:.1f} s")
        marglik_regression.plot(selection, FIGURES / "marglik_regression.png")
        print(f"wrote {write_json(SELECTION, selection.to_dict())}")
    print(res.table())
    print(selection.table())
    page = replace_block(page, "ngvi-table", res.table(), PAGE)
    page = replace_block(page, "marglik-regression-table", selection.table(), PAGE)
    PAGE.write_text(page)


if __name__ == "__main__":
    main()
