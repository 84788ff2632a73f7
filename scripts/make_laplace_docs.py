"""Build docs/laplace.md's figure and result tables.

1. Runs the page's first ```python block exactly as written (from the repository root, with
   ``src/`` importable), which writes ``docs/figures/laplace_banana.png``; this checks that the
   example runs as-is and takes well under a minute.
2. Rewrites the tables between ``<!-- uci-table:start/end -->``,
   ``<!-- uci-vi-table:start/end -->``, ``<!-- uci-table1:start/end -->`` and
   ``<!-- marglik-table:start/end -->`` from
   ``benchmarks/results/experiments_*.json`` (``uci_classification_10splits`` and
   ``uci_classification`` for the first, the GLM-VI columns of ``uci_classification`` beside
   its MAP and Laplace columns for the second, every Table 1 column of ``uci_classification``
   (BBB and GLM Laplace diag included) for the third, ``marglik_selection`` for the last; a missing
   file is skipped with a message).

Usage: ``python scripts/make_laplace_docs.py [--no-example] [--no-tables] [--threads N]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "laplace.md"
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

from docs_page import example_code, replace_block, run_example  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
UCI_JSONS = (
    (RESULTS / "experiments_uci_classification_10splits.json", "All 10 splits (16-core machine)"),
    (RESULTS / "experiments_uci_classification.json", "Laptop-scale run (2-core machine)"),
)
MARGLIK_JSON = RESULTS / "experiments_marglik_selection.json"
METHODS = ("map", "bnn_laplace", "glm_laplace", "glm_refine")
VI_METHODS = ("map", "glm_laplace", "glm_refine", "glm_vi", "glm_vi_diag")
#: Table 1's column order (the paper's "GLM Lapl" is our GLM refine)
TABLE1_METHODS = (
    "map",
    "bbb",
    "bnn_laplace",
    "glm_refine",
    "glm_laplace_diag",
    "glm_vi",
    "glm_vi_diag",
)
LABELS = {
    "map": "NN MAP",
    "bnn_laplace": "BNN Laplace",
    "glm_laplace": "GLM Laplace",
    "glm_refine": "GLM refine",
    "glm_vi": "GLM VI",
    "glm_vi_diag": "GLM VI diag",
    "glm_laplace_diag": "GLM Lapl diag",
    "bbb": "BBB",
}


def _fmt(mean: float | None, se: float | None, digits: int = 3) -> str:
    if mean is None:
        return "–"
    if se is None:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {se:.{digits}f}"


def uci_tables() -> str | None:
    """The UCI tables of every result file that exists, each under its heading."""
    parts = [
        f"**{title}** (`{path.relative_to(ROOT)}`)\n\n{uci_table(json.loads(path.read_text()))}"
        for path, title in UCI_JSONS
        if path.exists()
    ]
    return "\n\n".join(parts) if parts else None


def uci_table(res: dict[str, Any]) -> str:
    """Markdown: test NLL ours (paper) per data set and method, plus the run's settings."""
    rows = res["rows"]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    lines = [
        "| data set | " + " | ".join(LABELS[m] for m in METHODS) + " |",
        "|---" * (len(METHODS) + 1) + "|",
    ]
    for name in datasets:
        cells = []
        for method in METHODS:
            row = next(r for r in rows if r["dataset"] == name and r["method"] == method)
            ours = "missing" if row["missing"] else _fmt(row["test_nll_mean"], row["test_nll_se"])
            paper = row.get("paper_nll")
            cells.append(f"{ours} ({_fmt(*paper)})" if paper else ours)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    cfg = res["config"]
    lines += [
        "",
        f"Settings: {len(cfg['splits'])} splits (seeds {cfg['splits']}), "
        f"{cfg['grid_size']} prior precisions, MAP by {cfg['epochs']} full-batch Adam steps "
        f"at lr {cfg['lr']:g} (cosine decay), {cfg['num_samples']} Monte Carlo samples for "
        f"both predictives; runtime {res['runtime_s'] / 60:.1f} min "
        f"({cfg.get('n_jobs', 1)} process(es)). Accuracy and ECE are in the JSON.",
    ]
    lines += [f"Note: {n}" for n in res.get("notes", []) if "not available" in n]
    if "runtime_note" in res:
        lines.append(f"Runtime: {res['runtime_note']}")
    return "\n".join(lines)


def uci_vi_table(res: dict[str, Any], methods: tuple[str, ...] = VI_METHODS) -> str:
    """Markdown: the GLM-VI columns (full, diagonal) beside NN MAP, GLM Laplace and GLM
    refine of the same run (or the columns ``methods``), test NLL mean ± s.e. over splits
    (paper in parentheses); a cell over fewer splits than the run's says how many."""
    rows = res["rows"]
    splits = len(res["config"]["splits"])
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    lines = [
        "| data set | " + " | ".join(LABELS[m] for m in methods) + " |",
        "|---" * (len(methods) + 1) + "|",
    ]
    for name in datasets:
        cells = []
        for method in methods:
            row = next(
                (r for r in rows if r["dataset"] == name and r["method"] == method),
                {"missing": True, "paper_nll": None},
            )
            ours = "missing" if row["missing"] else _fmt(row["test_nll_mean"], row["test_nll_se"])
            if not row["missing"] and row["num_splits"] < splits:
                ours += f" [{row['num_splits']} split{'s' if row['num_splits'] > 1 else ''}]"
            paper = row.get("paper_nll")
            cells.append(f"{ours} ({_fmt(*paper)})" if paper else ours)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    merged = res["config"].get("merged")
    if merged:
        runs = merged.get("runs", [merged])
        minutes = sum(r["runtime_s"] for r in runs) / 60
        diff = max((r["map_test_nll_diff"] or 0.0) for r in runs)
        lines += [
            "",
            f"GLM VI: {_vi_settings(runs)}, from the GLM Laplace posterior; "
            f"{splits} splits (seeds {res['config']['splits']}), delta selected on validation "
            f"NLL per split and method. `config.merged.runs` lists the {len(runs)} runs that "
            f"added columns ({minutes:.0f} min of compute in all, superseded ones included); "
            f"those that need a MAP retrain the same networks (largest test-NLL difference to "
            f"the MAP records of the base run: {diff:.1g}; BBB needs none).",
        ]
    return "\n".join(lines)


def _vi_settings(runs: list[dict[str, Any]]) -> str:
    """The GLM-VI steps, gamma and S in force per column and data set: a later run's records
    replace an earlier one's, so the last run that added a (data set, column) decides."""
    latest: dict[tuple[str, str], tuple[int, float, int]] = {}
    for run in runs:
        for method in ("glm_vi", "glm_vi_diag"):
            if method not in run.get("methods", []) or "vi_steps" not in run:
                continue
            lr = run["vi_lr"]
            if method == "glm_vi_diag" and run.get("vi_lr_diag") is not None:
                lr = run["vi_lr_diag"]
            for name in run["datasets"]:
                latest[(name, method)] = (run["vi_steps"], lr, run["vi_samples"])
    groups: dict[tuple[int, float, int], list[str]] = {}
    for (name, method), setting in latest.items():
        groups.setdefault(setting, []).append(f"{name} {LABELS[method]}")
    if len(groups) <= 1:
        return "; ".join(_vi_text(*k) for k in groups) or "no GLM-VI run"
    common = max(groups, key=lambda k: len(groups[k]))
    others = [f"{', '.join(v)}: {_vi_text(*k)}" for k, v in groups.items() if k != common]
    return f"{_vi_text(*common)} ({'; '.join(others)})"


def _vi_text(steps: int, lr: float, samples: int) -> str:
    draws = "antithetic samples" if samples % 2 == 0 else "sample" if samples == 1 else "samples"
    return f"{steps} full-batch steps, gamma {lr:g}, S = {samples} {draws}"


def uci_table1(res: dict[str, Any]) -> str:
    """Markdown: every column of the paper's Table 1 that the run holds, in its order."""
    return uci_vi_table(res, TABLE1_METHODS).split("\n\n")[0]


def marglik_table(res: dict[str, Any]) -> str:
    """Markdown: the evidence-selected delta and width beside the test-NLL optimum."""
    s = res["summary"]
    cfg = res["config"]
    rho = s["spearman_evidence_vs_neg_test_nll_delta"]
    return "\n".join(
        [
            "| selection | by evidence | by test NLL (MAP) | test NLL at evidence choice |"
            " best test NLL |",
            "|---|---|---|---|---|",
            f"| δ ({cfg['depth']}×{cfg['width']} tanh) | {s['delta_by_evidence']:.3g} | "
            f"{s['delta_by_test_nll_map']:.3g} | {s['test_nll_map_at_evidence_delta']:.3f} | "
            f"{s['test_nll_map_best']:.3f} |",
            f"| width (1 layer) | {s['width_by_evidence']} | {s['width_by_test_nll_map']} | "
            f"{s['test_nll_map_at_evidence_width']:.3f} | {s['test_nll_map_best_width']:.3f} |",
            "",
            f"Thesis (5×25 tanh, Fig. 5.3): evidence optimum δ = {s['thesis_delta_by_evidence']},"
            f" plateau {s['thesis_plateau'][0]}–{s['thesis_plateau'][1]} in line with the test"
            " log likelihood. Here the Spearman rank correlation between log evidence and"
            f" negative test NLL over the δ grid is {rho:.3f};"
            f" runtime {res['runtime_s'] / 60:.1f} min.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-example", action="store_true", help="skip running the example")
    parser.add_argument("--no-tables", action="store_true", help="leave the tables as they are")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    args = parser.parse_args(argv)
    page = PAGE.read_text()
    if not args.no_example:
        seconds = run_example(example_code(page, PAGE), PAGE, args.threads)
        print(f"example ran in {seconds:.1f} s -> docs/figures/laplace_banana.png")
    if not args.no_tables:
        uci = uci_tables()
        if uci is None:
            print("no UCI result file found; uci-table left as is")
        else:
            page = replace_block(page, "uci-table", uci, PAGE)
            print("table uci-table updated")
        laptop = UCI_JSONS[1][0]
        if laptop.exists():
            vi = uci_vi_table(json.loads(laptop.read_text()))
            page = replace_block(page, "uci-vi-table", vi, PAGE)
            print("table uci-vi-table updated")
            table1 = uci_table1(json.loads(laptop.read_text()))
            page = replace_block(page, "uci-table1", table1, PAGE)
            print("table uci-table1 updated")
        if MARGLIK_JSON.exists():
            page = replace_block(
                page, "marglik-table", marglik_table(json.loads(MARGLIK_JSON.read_text())), PAGE
            )
            print("table marglik-table updated")
        else:
            print(f"{MARGLIK_JSON.relative_to(ROOT)} not found; marglik-table left as is")
        PAGE.write_text(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
