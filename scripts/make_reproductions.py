"""Write ``docs/reproductions.md``: every headline result of the five papers beside ours, with a
verdict computed by one stated rule (issue 19).

    python scripts/make_reproductions.py            # (re)write docs/reproductions.md
    python scripts/make_reproductions.py --check    # exit 1 if the committed page is stale
    python scripts/make_docs.py reproductions       # the same, from the docs registry

Inputs (nothing is run, only read): ``benchmarks/paper_values.json`` -- the papers' values,
one item of ``rows`` per result, typed from the paper texts, with pointers to our numbers -- and
the result JSONs under ``benchmarks/results/``. A pointer is ``"file.json:path"``; the path is
dot-separated keys, ``[i]`` list indices and ``[key=value,...]`` list filters that must match
exactly one item.

The verdict rule (:func:`verdict`), per row:

* **missing**: the row names why we have no result, or its pointer holds null;
* **reproduced**: same data set (``compare = "value"``) and ``|ours - paper| <= max(paper error,
  our standard error)`` or ``<= 10 %`` of ``|paper|``;
* otherwise the paper's ordering decides. The orderings are (a) the row's ``claim`` chains and
  (b) every other row of its ``group`` (same table, data set and metric): a pair is an ordering
  when the paper separates the two values by more than the sum of their reported errors, and it
  is contradicted when our two values are in the opposite order by more than the sum of our
  standard errors (claims are checked strictly, without errors). "More than" is decided at the
  papers' printed precision (a relative 1e-9 margin), so 0.17 - 0.11 is not "more than"
  0.05 + 0.01 through float rounding. Our two values are compared on the same splits: a row
  whose own value comes from a run the rest of its group was not part of names the common run's
  value in ``compare_ours`` / ``compare_error``, and the orderings use those.
  **qualitative**: at least one ordering and none contradicted; **off**: an ordering
  contradicted. A same-data-set row with no ordering to check is qualitative when ours is
  better than the paper's value (in the metric's direction ``better``) and off when worse;
  a substitute-data-set row with no ordering to check is off.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VALUES = ROOT / "benchmarks" / "paper_values.json"
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "reproductions.md"
VERDICTS = ("reproduced", "qualitative", "off", "missing")
RELATIVE_TOLERANCE = 0.10
SEPARATION_MARGIN = 1e-9
_OPS = {
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
}
_SEGMENT = re.compile(r"([^.\[\]]+)|\[([^\]]*)\]")


class PointerError(LookupError):
    """A pointer that does not resolve (a missing file, key, index or an ambiguous filter)."""


def resolve(pointer: str, results: Path = RESULTS, _cache: dict[Path, Any] | None = None) -> Any:
    """The value ``pointer = "file.json:path"`` names in ``results`` (see the module doc)."""
    name, sep, path = pointer.partition(":")
    if not sep or not path:
        raise PointerError(f"pointer {pointer!r}: expected 'file.json:path'")
    file = results / name
    cache = {} if _cache is None else _cache
    if file not in cache:
        if not file.is_file():
            raise PointerError(f"pointer {pointer!r}: no file {file}")
        cache[file] = json.loads(file.read_text())
    node = cache[file]
    pos = 0
    for match in _SEGMENT.finditer(path):
        if path[pos : match.start()] not in ("", "."):
            raise PointerError(f"pointer {pointer!r}: cannot parse {path[pos:]!r}")
        pos = match.end()
        key, bracket = match.groups()
        node = _step(node, key, bracket, pointer)
    if pos != len(path):
        raise PointerError(f"pointer {pointer!r}: cannot parse {path[pos:]!r}")
    return node


def _step(node: Any, key: str | None, bracket: str | None, pointer: str) -> Any:
    if key is not None:
        if not isinstance(node, dict) or key not in node:
            raise PointerError(f"pointer {pointer!r}: no key {key!r}")
        return node[key]
    assert bracket is not None
    if not isinstance(node, list):
        raise PointerError(f"pointer {pointer!r}: [{bracket}] applied to a non-list")
    if re.fullmatch(r"-?\d+", bracket):
        index = int(bracket)
        if not -len(node) <= index < len(node):
            raise PointerError(f"pointer {pointer!r}: index {index} out of range")
        return node[index]
    wanted = dict(part.split("=", 1) for part in bracket.split(","))
    hits = [
        item
        for item in node
        if isinstance(item, dict) and all(str(item.get(k)) == v for k, v in wanted.items())
    ]
    if len(hits) != 1:
        raise PointerError(f"pointer {pointer!r}: [{bracket}] matches {len(hits)} items, not 1")
    return hits[0]


@dataclass
class Result:
    """One row with our numbers filled in and its verdict."""

    row: dict[str, Any]
    ours: float | None = None
    ours_error: float | None = None
    compare_ours: float | None = None
    compare_error: float | None = None
    verdict: str = "missing"
    basis: str = ""
    claims_checked: list[tuple[str, bool]] = field(default_factory=list)


def _number(value: Any, scale: float) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise PointerError(f"expected a number, got {value!r}")
    return float(value) * scale


def _operand(value: Any, lookup: Any) -> float:
    if isinstance(value, str):
        number = _number(lookup(value), 1.0)
        if number is None:
            raise PointerError(f"claim operand {value!r} is null")
        return number
    return float(value)


def check_claim(chain: list[Any], lookup: Any) -> tuple[bool, str]:
    """Whether ``a op b (op c ...)`` holds; ``lookup`` resolves pointer operands."""
    if len(chain) < 3 or len(chain) % 2 == 0:
        raise ValueError(f"claim: expected [a, op, b, ...], got {chain!r}")
    values = [_operand(v, lookup) for v in chain[0::2]]
    ops = chain[1::2]
    bad = [op for op in ops if op not in _OPS]
    if bad:
        raise ValueError(f"claim: unknown operators {bad}; allowed {sorted(_OPS)}")
    holds = all(_OPS[op](a, b) for a, b, op in zip(values, values[1:], ops, strict=False))
    text = " ".join(f"{_fmt(v)} {op}" for v, op in zip(values, ops, strict=False))
    return holds, f"{text} {_fmt(values[-1])}"


def separated(gap: float, errors: float) -> bool:
    """Whether ``|gap|`` is more than ``errors`` at the printed precision (relative 1e-9)."""
    return abs(gap) > errors + SEPARATION_MARGIN * max(abs(gap), errors, 1e-300)


def verdict(result: Result, group: list[Result]) -> tuple[str, str]:
    """The verdict of ``result`` against the other rows of its group (rule in the module doc)."""
    row = result.row
    if row.get("missing"):
        return "missing", row["missing"]
    if result.ours is None and row.get("ours"):
        return "missing", row.get("null_reason", "the result JSON holds no value for this cell")
    paper = row.get("paper_value")
    if row.get("compare", "value") == "value" and paper is not None and result.ours is not None:
        diff = abs(result.ours - paper)
        tol = max(row.get("paper_error") or 0.0, result.ours_error or 0.0)
        if diff <= tol:
            return "reproduced", f"difference {_fmt(diff)} within error {_fmt(tol)}"
        if diff <= RELATIVE_TOLERANCE * abs(paper):
            return "reproduced", f"difference {_fmt(diff)} within 10 %"
    held, broken = [], []
    for text, holds in result.claims_checked:
        (held if holds else broken).append(f"claim {text}")
    for other in group:
        if other is result or other.compare_ours is None or result.compare_ours is None:
            continue
        p_other = other.row.get("paper_value")
        if paper is None or p_other is None:
            continue
        d_paper = paper - p_other
        if not separated(
            d_paper, (row.get("paper_error") or 0.0) + (other.row.get("paper_error") or 0.0)
        ):
            continue
        d_ours = result.compare_ours - other.compare_ours
        noise = (result.compare_error or 0.0) + (other.compare_error or 0.0)
        name = other.row["method"].split(" (")[0]
        if math.copysign(1, d_ours) == math.copysign(1, d_paper) and d_ours != 0:
            held.append(f"vs {name}")
        elif abs(d_ours) <= noise:
            held.append(f"vs {name} (tie within error)")
        else:
            broken.append(f"vs {name}")
    if broken:
        return "off", "contradicted: " + "; ".join(broken)
    if held:
        return "qualitative", "ordering holds: " + "; ".join(held)
    better = row.get("better")
    same_data = row.get("compare", "value") == "value"
    if (
        same_data
        and paper is not None
        and result.ours is not None
        and better in ("lower", "higher")
    ):
        ahead = result.ours < paper if better == "lower" else result.ours > paper
        if ahead:
            return "qualitative", "no ordering to check; ours better than the paper's value"
        return "off", "no ordering to check; ours worse than the paper's value"
    return "off", "not within error or 10 %, and no ordering to check"


def evaluate(rows: list[dict[str, Any]], results: Path = RESULTS) -> list[Result]:
    """Fill in our numbers and the verdict of every row."""
    cache: dict[Path, Any] = {}

    def lookup(pointer: str) -> Any:
        return resolve(pointer, results, cache)

    out = []
    for row in rows:
        res = Result(row)
        scale = float(row.get("scale", 1.0))
        if row.get("ours") and not row.get("missing"):
            res.ours = _number(lookup(row["ours"]), scale)
            if row.get("ours_error"):
                res.ours_error = _number(lookup(row["ours_error"]), scale)
            res.compare_ours, res.compare_error = res.ours, res.ours_error
            if row.get("compare_ours"):
                res.compare_ours = _number(lookup(row["compare_ours"]), scale)
                res.compare_error = None
                if row.get("compare_error"):
                    res.compare_error = _number(lookup(row["compare_error"]), scale)
        if row.get("claim") and not row.get("missing") and res.ours is not None:
            for chain in row["claim"]:
                holds, text = check_claim(chain, lookup)
                res.claims_checked.append((text, holds))
        out.append(res)
    groups: dict[str, list[Result]] = {}
    for res in out:
        if res.row.get("group"):
            groups.setdefault(res.row["group"], []).append(res)
    for res in out:
        res.verdict, res.basis = verdict(res, groups.get(res.row.get("group", ""), []))
    return out


def _fmt(value: float | None) -> str:
    if value is None:
        return "—"
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3g}"
    return f"{value:.4g}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _paper_cell(row: dict[str, Any]) -> str:
    value = row.get("paper_value")
    if value is None:
        return _cell(row.get("paper_note", "—"))
    text = _fmt(value)
    if row.get("paper_error") is not None:
        text += f" ± {_fmt(row['paper_error'])}"
    if row.get("paper_note"):
        text += f" ({row['paper_note']})"
    return _cell(text)


def _ours_cell(res: Result) -> str:
    if res.ours is None:
        return "—"
    text = _fmt(res.ours)
    if res.ours_error is not None:
        text += f" ± {res.ours_error:.2g}"
    return text


def _protocol_cell(row: dict[str, Any], files: dict[str, str], res: Result) -> str:
    text = row.get("protocol", "")
    if row.get("compare_ours") and res.compare_ours is not None:
        common = _fmt(res.compare_ours)
        if res.compare_error is not None:
            common += f" ± {res.compare_error:.2g}"
        text += (
            f". Orderings within the group use this method's {common} from "
            f"`{row['compare_ours'].partition(':')[0]}`, the run every column of the group is in "
            "(same splits)"
        )
    if row.get("ours") and not row.get("missing"):
        status = files[row["ours"].partition(":")[0]]
        text = f"{text}. Result file: {status}" if text else f"Result file: {status}"
    return text


def _source_cell(row: dict[str, Any]) -> str:
    if not row.get("ours") or row.get("missing"):
        return ""
    scale = f" × {_fmt(row['scale'])}" if row.get("scale", 1.0) != 1.0 else ""
    return f"`{row['ours']}`{scale}"


def render(
    results: list[Result], papers: dict[str, dict[str, str]], files: dict[str, str], vbll: str
) -> str:
    """The markdown page."""
    counts = Counter(r.verdict for r in results)
    lines = [
        "# Reproductions of the papers' results",
        "",
        "<!-- generated by scripts/make_reproductions.py from benchmarks/paper_values.json and "
        "benchmarks/results/*.json: do not edit by hand -->",
        "",
        f"**{len(results)} results: "
        + ", ".join(f"{counts.get(v, 0)} {v}" for v in VERDICTS)
        + ".**",
        "",
        "Every headline result of the five papers this library implements, beside our number "
        "from the committed result JSONs (`benchmarks/results/`). The papers' values are typed "
        "from the paper texts into `benchmarks/paper_values.json`; the texts have no page "
        "numbers, so each row names its table or figure and section. Ours is the mean ± "
        "standard error over seeds or splits (no error: one seed).",
        "",
        "**Verdict rule.** *reproduced*: same data set and |ours − paper| within either error "
        "bar (the paper's reported error or our standard error) or within 10 % of the paper's "
        "value. Otherwise the paper's ordering decides: the row's stated claim, and every other "
        "method of the same table, data set and metric that the paper separates by more than "
        "their summed errors (at the printed precision: 0.17 − 0.11 is not more than "
        "0.05 + 0.01). An ordering is contradicted when ours is reversed by more than our "
        "summed standard errors (a claim: strictly); our two values are compared on the same "
        "splits (a row from a run the rest of its group was not part of is compared through the "
        "common run's value, named in its protocol). *qualitative*: at least one ordering "
        "and none contradicted; "
        "*off*: an ordering contradicted; *missing*: no result of ours, with the reason. A row "
        "with no ordering to check is qualitative when ours beats the paper's value and off "
        "when it is worse. Rows on a substitute data set or network (column *ours on*) can "
        "only be qualitative (an ordering holds) or off.",
        "",
        "| paper | reproduced | qualitative | off | missing | rows |",
        "|---|---|---|---|---|---|",
    ]
    for key in papers:
        sub = Counter(r.verdict for r in results if r.row["paper"] == key)
        lines.append(
            f"| {key} | "
            + " | ".join(str(sub.get(v, 0)) for v in VERDICTS)
            + f" | {sum(sub.values())} |"
        )
    for key, paper in papers.items():
        lines += ["", f"## {key}: {paper['title']}", "", f"Text: `{paper['file']}`.", ""]
        lines += [
            "| id | where | data set | ours on | method | metric | paper | ours | verdict | "
            "basis | protocol differences | our value |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for res in results:
            row = res.row
            if row["paper"] != key:
                continue
            cells = [
                row["id"],
                row["where"],
                row["dataset"],
                row.get("ours_dataset", "same"),
                row["method"],
                row["metric"],
                _paper_cell(row),
                _ours_cell(res),
                f"**{res.verdict}**",
                res.basis,
                _protocol_cell(row, files, res),
                _source_cell(row),
            ]
            lines.append(
                "| " + " | ".join(_cell(c) if i != 11 else c for i, c in enumerate(cells)) + " |"
            )
    lines += [
        "",
        "## Result files",
        "",
        "Whether each result file behind the rows was rerun on the current code:",
        "",
        "| file | status |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {_cell(status)} |" for name, status in files.items()]
    lines += ["", vbll.rstrip(), ""]
    return "\n".join(lines)


def _paired_row(
    name: str, head: str, ours: dict[int, float], best_name: str, best: dict[int, float]
) -> str:
    """One row of the paired comparison ``head`` vs the package's best ``wishart_scale``."""
    seeds = sorted(set(ours) & set(best))
    diffs = [ours[s] - best[s] for s in seeds]
    mean = sum(diffs) / len(diffs)
    se = (
        math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
        if len(diffs) > 1
        else math.nan
    )
    if mean <= 0:
        word = "ours at least as good"
    elif mean <= se:
        word = "ours worse, within one standard error"
    else:
        word = f"ours worse ({sum(d > 0 for d in diffs)} of {len(diffs)} seeds)"
    label = name if head == "gaussify" else f"{name} (`{head}`)"
    return (
        f"| {label} | {len(seeds)} | {_fmt(sum(ours[s] for s in seeds) / len(seeds))} | "
        f"`{best_name}` | {_fmt(sum(best[s] for s in seeds) / len(seeds))} | "
        f"{_fmt(mean)} ± {se:.2g} | {word} |"
    )


def vbll_section(results: Path = RESULTS) -> str:
    """Our ``VBLLRegression`` at its defaults vs the ``vbll`` package at its best
    ``wishart_scale`` on the issue-19 protocol (``benchmarks/vbll_regression_protocol.py``)."""
    data = json.loads((results / "vbll_regression_protocol.json").read_text())
    rows = {(r["dataset"], r["method"]): r for r in data["rows"]}
    lines = [
        "## VBLL head vs the vbll package (issue 19 protocol)",
        "",
        f"`benchmarks/vbll_regression_protocol.json`: {data['protocol']}. Test NLL in "
        "standardised units, means over the seeds both heads ran (paired: same body "
        "initialisation and batch order); *best vbll* is the package's "
        "`wishart_scale` with the lowest mean test NLL (chosen on the test set: an optimistic "
        "baseline). Ours is `VBLLRegression` at its defaults.",
        "",
        "| data set | paired seeds | ours (defaults) | best vbll | vbll NLL | ours − best "
        "(paired, ± s.e.) | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    per_seed: dict[tuple[str, str], dict[int, float]] = {}
    for rec in data["records"]:
        per_seed.setdefault((rec["dataset"], rec["method"]), {})[rec["seed"]] = rec["test_nll"]
    for (name, method), row in rows.items():
        if method != "summary":
            continue
        best = per_seed[(name, row["best_vbll"])]
        for head in ("gaussify", "gaussify_wstd1", "gaussify_vbllinit"):
            if (name, head) in per_seed:
                ours = per_seed[(name, head)]
                lines.append(_paired_row(name, head, ours, row["best_vbll"], best))
    lines += [
        "",
        "Every head of the benchmark (`gaussify_prior1`: the pre-issue-19 prior variance 1; "
        "`gaussify_wstd1` / `gaussify_vbllinit`: ours with the package's initial draws, see the "
        "benchmark's module doc):",
        "",
        "| data set | head | seeds | test NLL | test MSE | noise variance |",
        "|---|---|---|---|---|---|",
    ]
    for (name, method), row in rows.items():
        if method == "summary" or method.startswith("paired:"):
            continue
        lines.append(
            f"| {name} | `{method}` | {row['num_seeds']} | {_fmt(row['test_nll_mean'])} ± "
            f"{row['test_nll_se']:.2g} | {_fmt(row['test_mse_mean'])} | "
            f"{_fmt(row['noise_var_mean'])} |"
        )
    return "\n".join(lines)


def build(values: Path = VALUES, results: Path = RESULTS) -> str:
    """The page's text from the values file and the result JSONs."""
    data = json.loads(values.read_text())
    ids = [r["id"] for r in data["rows"]]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"paper_values: duplicate row ids {dup}")
    files = {row["ours"].partition(":")[0] for row in data["rows"] if row.get("ours")}
    unknown = sorted(files - set(data["results"]))
    if unknown:
        raise ValueError(f"paper_values: results: no rerun status for {unknown}")
    return render(
        evaluate(data["rows"], results), data["papers"], data["results"], vbll_section(results)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    parser.add_argument("--output", type=Path, default=PAGE)
    args = parser.parse_args(argv)
    text = build()
    if args.check:
        current = args.output.read_text() if args.output.is_file() else ""
        if current != text:
            print(f"{args.output} is stale: run python scripts/make_reproductions.py")
            return 1
        return 0
    args.output.write_text(text)
    counts = Counter(line.split("**")[1] for line in text.splitlines() if "| **" in line)
    print(f"wrote {args.output}: {dict(counts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
