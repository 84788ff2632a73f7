"""The `gaussify` command: dataset table and the demo's report and figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gaussify import data, metrics
from gaussify.cli import main


def test_datasets_lists_every_bundled_dataset(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["datasets"]) == 0
    out = capsys.readouterr().out
    names = data.list()
    real = [n for n in names if not data.info(n).synthetic]
    assert len(real) >= 18
    for name in names:
        assert name in out


def test_demo_writes_report_and_figure(tmp_path: Path) -> None:
    assert main(["demo", "--epochs", "3", "--out", str(tmp_path), "--dataset", "iris"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    png = (tmp_path / "reliability.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["dataset"] == "iris"
    # every family with a trained-network entry point appears in the demo
    families = {"map", "laplace-kron", "laplace-ll-full", "vbll-disc-posthoc", "ella"}
    assert families <= set(report["test"])
    for row in report["test"].values():
        assert 0 <= row["acc"] <= 1 and row["nll"] > 0 and 0 <= row["ece"] <= row["mce"] <= 1


def test_demo_is_deterministic_and_reports_the_metrics_of_its_model(tmp_path: Path) -> None:
    args = ["demo", "--epochs", "2", "--dataset", "wine", "--out"]
    main([*args, str(tmp_path / "a")])
    main([*args, str(tmp_path / "b")])
    a = json.loads((tmp_path / "a" / "report.json").read_text())["test"]
    b = json.loads((tmp_path / "b" / "report.json").read_text())["test"]
    assert a == b
    # a uniform predictor would score log(3) on wine; two epochs of MAP already beat chance
    uniform = metrics.nll(torch.full((10, 3), 1 / 3), torch.zeros(10, dtype=torch.long))
    assert a["map"]["nll"] < uniform


def test_demo_rejects_a_regression_dataset(tmp_path: Path) -> None:
    assert main(["demo", "--dataset", "yacht", "--out", str(tmp_path)]) == 2


def test_experiment_subcommand_dispatches_to_the_module(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["experiment", "nope"])
    with pytest.raises(SystemExit) as info:
        main(["experiment", "marglik_selection", "--help"])
    assert info.value.code == 0
    assert "--deltas" in capsys.readouterr().out
