"""docs/reproductions.md (issue 19): the committed page is the generator's output, every pointer
into benchmarks/results/ resolves, and the verdict rule on synthetic rows."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "make_reproductions", ROOT / "scripts" / "make_reproductions.py"
)
assert _spec is not None and _spec.loader is not None
mr = importlib.util.module_from_spec(_spec)
sys.modules["make_reproductions"] = mr  # dataclasses look their module up there
_spec.loader.exec_module(mr)


def _rows() -> list[dict[str, Any]]:
    return json.loads(mr.VALUES.read_text())["rows"]


def test_committed_page_equals_the_generator_output() -> None:
    assert mr.PAGE.read_text() == mr.build(), "run python scripts/make_reproductions.py"


def test_every_pointer_resolves_to_a_number_or_an_explained_null() -> None:
    cache: dict[Path, Any] = {}
    for row in _rows():
        keys = ("ours", "ours_error", "compare_ours", "compare_error")
        pointers = [row[k] for k in keys if k in row]
        pointers += [v for chain in row.get("claim", []) for v in chain[0::2] if isinstance(v, str)]
        for pointer in pointers:
            value = mr.resolve(pointer, mr.RESULTS, cache)
            if value is None:
                assert row.get("null_reason") or row.get("missing"), f"{row['id']}: {pointer}"
            else:
                assert isinstance(value, (int, float)), f"{row['id']}: {pointer} -> {value!r}"


def test_the_table_covers_the_five_papers_with_stated_sources() -> None:
    data = json.loads(mr.VALUES.read_text())
    rows = data["rows"]
    assert len(rows) >= 40
    assert {r["paper"] for r in rows} == set(data["papers"]) == {"000", "001", "002", "003", "004"}
    for row in rows:
        assert row["where"] and row["metric"] and row["method"], row["id"]
        # a row either points at our number, or says why it has none
        assert bool(row.get("ours")) != bool(row.get("missing")), row["id"]
        if not row.get("missing"):
            assert row.get("protocol"), f"{row['id']}: protocol differences not stated"
        # a value without a number in the text must say what the text claims instead
        if row.get("paper_value") is None and not row.get("missing"):
            assert row.get("paper_note") and row.get("claim"), row["id"]
        assert row.get("compare", "value") in ("value", "ordering"), row["id"]
    # every result file a row points into says whether it was rerun on the current code
    pointed = {r["ours"].partition(":")[0] for r in rows if r.get("ours")}
    assert pointed <= set(data["results"])
    assert all((mr.RESULTS / name).is_file() for name in data["results"])


def _write(tmp: Path, rows: list[dict[str, Any]]) -> list[Any]:
    (tmp / "r.json").write_text(
        json.dumps({"rows": [{"m": "a", "v": 1.0}, {"m": "b", "v": 2.0}, {"m": "c", "v": None}]})
    )
    return mr.evaluate(rows, tmp)


def _row(rid: str, value: float | None, error: float | None, ours: float, **kw: Any) -> dict:
    return {
        "id": rid,
        "paper": "000",
        "method": rid,
        "paper_value": value,
        "paper_error": error,
        "ours": f"r.json:rows[m={'a' if ours == 1.0 else 'b'}].v",
        **kw,
    }


def test_verdict_reproduced_within_error_bar_or_ten_percent(tmp_path: Path) -> None:
    # 1.0 vs paper 1.15 +- 0.2: 13 % off but inside the paper's error bar
    # 2.0 vs paper 2.15 +- 0.01: outside the error bar but 7 % off
    # 2.0 vs paper 2.5 +- 0.01: 20 % off, no group -> off with nothing to check
    res = _write(
        tmp_path,
        [
            _row("x", 1.15, 0.2, 1.0),
            _row("y", 2.15, 0.01, 2.0),
            _row("z", 2.5, 0.01, 2.0),
        ],
    )
    assert [r.verdict for r in res] == ["reproduced", "reproduced", "off"]
    assert "within error" in res[0].basis and "10 %" in res[1].basis
    assert res[2].basis == "not within error or 10 %, and no ordering to check"
    # with the metric's direction, a row with no ordering is judged against the paper's value
    lower = _write(tmp_path, [_row("z", 2.5, 0.01, 2.0, better="lower")])[0]
    higher = _write(tmp_path, [_row("z", 2.5, 0.01, 2.0, better="higher")])[0]
    assert (lower.verdict, higher.verdict) == ("qualitative", "off")
    assert lower.basis == "no ordering to check; ours better than the paper's value"


def test_verdict_ordering_decides_substitute_rows(tmp_path: Path) -> None:
    # ours equals the paper exactly, but on a substitute data set: only the ordering counts
    same = [
        _row("a", 1.0, 0.0, 1.0, compare="ordering", group="g"),
        _row("b", 2.0, 0.0, 2.0, compare="ordering", group="g"),
    ]
    assert [r.verdict for r in _write(tmp_path, same)] == ["qualitative", "qualitative"]
    # the paper orders a above b; ours below, by more than our errors -> off
    reversed_ = [
        _row("a", 3.0, 0.1, 1.0, compare="ordering", group="g"),
        _row("b", 2.0, 0.1, 2.0, compare="ordering", group="g"),
    ]
    res = _write(tmp_path, reversed_)
    assert [r.verdict for r in res] == ["off", "off"]
    assert res[0].basis == "contradicted: vs b"


def test_verdict_ties_within_errors_are_not_orderings_or_contradictions(tmp_path: Path) -> None:
    # the paper cannot separate 3.0 +- 0.6 from 2.0 +- 0.6: no ordering to check -> off
    res = _write(
        tmp_path,
        [
            _row("a", 3.0, 0.6, 1.0, compare="ordering", group="g"),
            _row("b", 2.0, 0.6, 2.0, compare="ordering", group="g"),
        ],
    )
    assert [r.verdict for r in res] == ["off", "off"]
    # ours reversed by 1.0 but our standard errors sum to 2.0: a tie, the ordering holds
    tie = [
        _row("a", 3.0, 0.1, 1.0, compare="ordering", group="g", ours_error="r.json:rows[0].v"),
        _row("b", 2.0, 0.1, 2.0, compare="ordering", group="g", ours_error="r.json:rows[m=a].v"),
    ]
    res = _write(tmp_path, tie)
    assert res[0].verdict == "qualitative" and "tie within error" in res[0].basis


def test_separation_is_judged_at_the_printed_precision(tmp_path: Path) -> None:
    # 0.17 +- 0.05 vs 0.11 +- 0.01: the gap 0.06 equals the summed errors; in floats
    # 0.17 - 0.11 = 0.06000000000000001 > 0.05 + 0.01 = 0.060000000000000005, which is not an
    # ordering the paper reports (004 Table 1, cancer)
    assert 0.17 - 0.11 > 0.05 + 0.01
    assert not mr.separated(0.17 - 0.11, 0.05 + 0.01)
    assert mr.separated(0.17 - 0.10, 0.05 + 0.01) and not mr.separated(0.0, 0.0)
    rows = [
        _row("a", 0.17, 0.05, 1.0, compare="ordering", group="g"),
        _row("b", 0.11, 0.01, 2.0, compare="ordering", group="g"),
    ]
    res = _write(tmp_path, rows)
    assert [r.verdict for r in res] == ["off", "off"]
    assert res[0].basis == "not within error or 10 %, and no ordering to check"


def test_orderings_use_the_common_run_value(tmp_path: Path) -> None:
    # the paper orders a (1.0) below b (3.0). Our a from its own run (10 splits) is 2.5, above
    # our b (2.0, 3 splits); on b's 3 splits a is 1.0: the ordering is checked there and holds
    (tmp_path / "ten.json").write_text(json.dumps({"a": 2.5}))
    (tmp_path / "three.json").write_text(json.dumps({"a": 1.0, "b": 2.0}))
    common = {"compare": "ordering", "group": "g", "paper_error": 0.1}
    rows = [
        {
            "id": "a",
            "paper": "0",
            "method": "a",
            "paper_value": 1.0,
            "ours": "ten.json:a",
            "compare_ours": "three.json:a",
            **common,
        },
        {
            "id": "b",
            "paper": "0",
            "method": "b",
            "paper_value": 3.0,
            "ours": "three.json:b",
            **common,
        },
    ]
    res = mr.evaluate(rows, tmp_path)
    assert (res[0].ours, res[0].compare_ours) == (2.5, 1.0)
    assert [r.verdict for r in res] == ["qualitative", "qualitative"]
    assert res[0].basis == "ordering holds: vs b"
    # without the common run's value, the cross-run pair is reversed: a contradiction
    del rows[0]["compare_ours"]
    assert [r.verdict for r in mr.evaluate(rows, tmp_path)] == ["off", "off"]


def test_verdict_missing_and_claims(tmp_path: Path) -> None:
    rows = [
        {"id": "m", "paper": "000", "method": "m", "missing": "cannot run offline: not shipped"},
        {
            "id": "n",
            "paper": "000",
            "method": "n",
            "ours": "r.json:rows[m=c].v",
            "null_reason": "too slow on 2 cores",
        },
        {
            "id": "c1",
            "paper": "000",
            "method": "c1",
            "ours": "r.json:rows[m=a].v",
            "claim": [["r.json:rows[m=a].v", "<", "r.json:rows[m=b].v", "<=", 2.0]],
        },
        {
            "id": "c2",
            "paper": "000",
            "method": "c2",
            "ours": "r.json:rows[m=b].v",
            "claim": [[0.5, "<", "r.json:rows[m=a].v"], ["r.json:rows[m=b].v", ">", 3]],
        },
    ]
    res = _write(tmp_path, rows)
    assert [(r.verdict, r.basis) for r in res[:2]] == [
        ("missing", "cannot run offline: not shipped"),
        ("missing", "too slow on 2 cores"),
    ]
    assert res[2].verdict == "qualitative" and res[2].basis == "ordering holds: claim 1 < 2 <= 2"
    assert res[3].verdict == "off" and res[3].basis == "contradicted: claim 2 > 3"


def test_claims_and_pointers_reject_bad_input(tmp_path: Path) -> None:
    (tmp_path / "r.json").write_text(json.dumps({"rows": [{"m": "a"}, {"m": "a"}], "k": 1}))

    def lookup(p: str) -> Any:
        return mr.resolve(p, tmp_path)

    with pytest.raises(ValueError, match=r"claim: unknown operators \['=='\]"):
        mr.check_claim([1, "==", 1], lookup)
    with pytest.raises(ValueError, match=r"claim: expected \[a, op, b, \.\.\.\]"):
        mr.check_claim([1, "<"], lookup)
    with pytest.raises(mr.PointerError, match=r"\[m=a\] matches 2 items, not 1"):
        lookup("r.json:rows[m=a]")
    with pytest.raises(mr.PointerError, match="no key 'x'"):
        lookup("r.json:x")
    with pytest.raises(mr.PointerError, match="index 5 out of range"):
        lookup("r.json:rows[5]")
    with pytest.raises(mr.PointerError, match=r"expected 'file\.json:path'"):
        lookup("r.json")
    with pytest.raises(mr.PointerError, match="no file"):
        lookup("nope.json:k")
