"""gaussify.experiments._runner: the pieces every experiment shares (issue 21).

The aggregation is checked against float64 closed forms, the protocol helpers against the
errors and defaults the experiments documented before they shared them, and ``cli`` by a toy
``run`` whose received keywords and printed report are compared exactly."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import gaussify.data as gd
from gaussify.experiments import _runner
from gaussify.experiments._runner import (
    choose_datasets,
    cli,
    fmt,
    grid,
    mean_se,
    paper_table,
    seed_list,
    torch_threads,
)


def test_mean_se_is_mean_and_sample_standard_error() -> None:
    values = [0.3, 1.7, -2.25, 4.0, 0.125]
    arr = np.asarray(values, dtype=np.float64)
    se = math.sqrt(((arr - arr.mean()) ** 2).sum() / (len(arr) - 1)) / math.sqrt(len(arr))
    mean, got = mean_se(values)
    assert mean == pytest.approx(arr.mean(), rel=1e-15) and got == pytest.approx(se, rel=1e-14)
    assert mean_se([]) == (None, None)
    assert mean_se([2.5], single=None) == (2.5, None)
    assert mean_se([2.5], single=0.0) == (2.5, 0.0)
    one = mean_se(x for x in [1.0])  # any iterable; nan by default for one value
    assert one[0] == 1.0 and math.isnan(one[1])


def test_fmt_prints_mean_plus_minus_se() -> None:
    assert fmt(0.12345, 0.0061) == "0.123 ± 0.006"
    assert fmt(1.5, 0.25, digits=2) == "1.50 ± 0.25"
    assert fmt(1.5, None) == "1.500" and fmt(1.5, float("nan")) == "1.500"
    assert fmt(None, 0.1) == "–"


def test_seed_list_counts_quick_and_explicit() -> None:
    assert seed_list(4, 2) == [0, 1, 2, 3]
    assert seed_list(4, 2, quick=True) == [0, 1]
    assert seed_list([5, 7], 2, quick=True) == [5, 7]
    with pytest.raises(ValueError, match="splits: must be a positive integer, got 0"):
        seed_list(0, 2, name="splits")


def test_choose_datasets_defaults_and_refusals() -> None:
    shipped = set(gd.list())
    default = ("ionosphere", "not_shipped", "glass")
    assert choose_datasets(None, default) == [d for d in default if d in shipped]
    assert choose_datasets(None, default, ("glass",), quick=True) == ["glass"]
    assert choose_datasets(["glass"], default, task="classification") == ["glass"]
    with pytest.raises(ValueError, match=r"datasets: unknown \['nope'\]; available: "):
        choose_datasets(["nope"], default)
    with pytest.raises(
        ValueError, match=r"datasets: \['boston'\] are regression data sets, not classification"
    ):
        choose_datasets(
            ["boston"], default, task="classification",
            wrong_task="{} are regression data sets, not {}",
        )  # fmt: skip


def test_torch_threads_sets_and_restores_even_on_error() -> None:
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    with torch_threads(target):
        assert torch.get_num_threads() == target
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="boom"), torch_threads(target):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before
    with torch_threads(None):
        assert torch.get_num_threads() == before


def test_grid_runs_every_dataset_and_seed_in_order() -> None:
    calls = grid(["a", "b"], [3, 1], lambda name, seed: (name, seed))
    assert calls == [("a", 3), ("a", 1), ("b", 3), ("b", 1)]


def test_paper_tables_are_the_transcribed_values() -> None:
    from gaussify.experiments import uci_classification, vbll_uci

    t1 = paper_table("immer2021_table1")
    assert t1["digits"]["map"] == [0.086, 0.003]
    assert uci_classification.PAPER_TABLE1["glass"]["bnn_laplace"] == (1.25, 0.0)
    t2 = vbll_uci.PAPER_TABLE2
    assert t2["boston"]["VBLL"] == {"nll": (1.80, 0.04), "rmse": (1.42, 0.05)}
    assert t2["yacht"]["SWAG"] == {"nll": (1.11, 0.05), "rmse": (1.13, 0.20)}
    raw = json.loads(_runner.Path(_runner.__file__).with_name("paper_tables.json").read_text())
    assert set(t1) == set(raw["immer2021_table1"]) - {"_about"}


class _Result:
    notes = ("a note",)
    runtime_s = 1.25

    def __init__(self, kwargs: dict) -> None:
        self.kwargs = kwargs

    def table(self) -> str:
        return "| table |"

    def to_dict(self) -> dict:
        return {"kwargs": {k: str(v) for k, v in self.kwargs.items()}}


def test_cli_passes_each_option_to_run_and_reports(tmp_path, capsys) -> None:
    received: list[dict] = []

    def run(**kwargs):
        received.append(kwargs)
        return _Result(kwargs)

    options = [
        ("--seeds", dict(type=int, default=3)),
        ("--max-train", dict(type=int, default=None)),
        ("--quick", dict(action="store_true")),
    ]
    out = tmp_path / "r.json"
    argv = ["--seeds", "5", "--quick", "--output", str(out), "--no-progress"]
    code = cli(argv, "toy", "d", options, run, title=lambda r: f"T{r.kwargs['seeds']}",
               rename={"max_train": "cap"}, extra={"fixed": 1})  # fmt: skip
    assert code == 0
    assert received == [{"seeds": 5, "cap": None, "quick": True, "progress": False, "fixed": 1}]
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["T5", "| table |", "note: a note", "runtime 1.2 s", f"wrote {out}"]
    assert json.loads(out.read_text())["kwargs"]["seeds"] == "5"
    with pytest.raises(SystemExit) as exc:
        cli(["--seeds", "x"], "toy", "d", options, run)
    assert exc.value.code == 2
