"""The `gaussify` command: dataset table and the demo's report and figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gaussify import cli, data, metrics
from gaussify.cli import main
from gaussify.data import raw


def test_datasets_lists_every_bundled_dataset(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["datasets"]) == 0
    out = capsys.readouterr().out
    names = data.list()
    real = [n for n in names if not data.info(n).synthetic]
    assert len(real) >= 18
    for name in names:
        assert name in out


def test_demo_writes_report_and_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--epochs", "3", "--out", str(tmp_path), "--dataset", "iris"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    for name in cli.DEMO_OUTPUTS[1:]:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["dataset"] == "iris"
    # every family with a trained-network entry point appears in every section, MAP first
    families = ["map", "laplace-kron", "laplace-ll-full", "vbll-disc-posthoc", "ella"]
    metric_keys = {"acc", "nll", "ece", "brier"}
    for section in ("in_distribution", "shifted", "ood"):
        assert list(report[section]) == families
    for name in families:
        for section in ("in_distribution", "shifted"):
            row = report[section][name]
            assert set(row) == metric_keys
            assert 0 <= row["acc"] <= 1 and row["nll"] > 0 and 0 <= row["ece"] <= 1
        assert set(report["ood"][name]) == {"auroc"} and 0 <= report["ood"][name]["auroc"] <= 1
        per = report["shift"]["by_strength"][name]
        assert len(per) == len(report["shift"]["strengths"]) == 4
        # the pooled shifted accuracy is the mean of the equally sized strengths' accuracies
        assert report["shifted"][name]["acc"] == pytest.approx(
            sum(r["acc"] for r in per) / len(per), abs=1e-12
        )
    assert report["ood_set"]["n"] == report["n_test"]
    # the printed table: one line saying what each section shows, then its rows as in the JSON
    out = capsys.readouterr().out.splitlines()
    heads = [i for i, line in enumerate(out) if line.split(":")[0] in cli_sections()]
    assert [out[i].split(":")[0] for i in heads] == list(cli_sections())
    ood_rows = out[heads[2] + 2 : heads[2] + 2 + len(families)]
    assert [line.split() for line in ood_rows] == [
        [name, f"{report['ood'][name]['auroc']:.4f}"] for name in families
    ]


def cli_sections() -> tuple[str, ...]:
    return ("in-distribution", "shifted", "out-of-distribution")


def test_demo_is_deterministic_and_reports_the_metrics_of_its_model(tmp_path: Path) -> None:
    args = ["demo", "--epochs", "2", "--dataset", "wine", "--out"]
    main([*args, str(tmp_path / "a")])
    main([*args, str(tmp_path / "b")])
    a = json.loads((tmp_path / "a" / "report.json").read_text())
    b = json.loads((tmp_path / "b" / "report.json").read_text())
    for section in ("in_distribution", "shifted", "ood", "shift"):
        assert a[section] == b[section]
    # a uniform predictor would score log(3) on wine; two epochs of MAP already beat chance
    uniform = metrics.nll(torch.full((10, 3), 1 / 3), torch.zeros(10, dtype=torch.long))
    assert a["in_distribution"]["map"]["nll"] < uniform


@pytest.mark.slow
def test_demo_on_digits_shows_where_the_gaussian_methods_help(tmp_path: Path) -> None:
    """The demo's claims on its real run (default settings, digits, about 20 s): MAP has the
    best in-distribution NLL, yet a Gaussian method beats it on the rotated images' NLL and on
    telling Fashion-MNIST from digits (the README's table)."""
    assert main(["demo", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["dataset"] == "digits" and report["shift"]["strengths"] == [5, 10, 20, 30]
    nll_in = {name: row["nll"] for name, row in report["in_distribution"].items()}
    assert min(nll_in, key=nll_in.get) == "map"
    gaussian = [name for name in report["shifted"] if not name.startswith("map")]
    shifted = report["shifted"]
    auroc = {name: row["auroc"] for name, row in report["ood"].items()}
    # more than one Gaussian method beats MAP on both, by a clear margin
    better = [
        n
        for n in gaussian
        if shifted[n]["nll"] < 0.9 * shifted["map"]["nll"] and auroc[n] > auroc["map"] + 0.03
    ]
    assert len(better) >= 2, (shifted, auroc)
    for name in gaussian:  # the accuracy is the MAP network's: the Gaussians change confidence
        assert report["in_distribution"][name]["acc"] == pytest.approx(
            report["in_distribution"]["map"]["acc"], abs=0.02
        )


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


# --------------------------------------------------------------- refusals before any work


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """Exit status (argparse's SystemExit included) and the lines written to stderr."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err.splitlines()


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the demo reads a data set or trains a network."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the demo started working before refusing its arguments")

    monkeypatch.setattr(cli, "train_map", refuse)
    monkeypatch.setattr(cli.gdata, "load", refuse)


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("--width", "0", "a positive integer"),
        ("--width", "-5", "a positive integer"),
        ("--width", "2.5", "a positive integer"),
        ("--epochs", "0", "a positive integer"),
        ("--epochs", "ten", "a positive integer"),
        ("--lr", "nan", "a finite number > 0"),
        ("--lr", "-0.001", "a finite number > 0"),
        ("--prior-precision", "0", "a finite number > 0"),
        ("--prior-precision", "inf", "a finite number > 0"),
        ("--seed", "-1", "a non-negative integer"),
        ("--seed", "1.5", "a non-negative integer"),
    ],
)
def test_demo_refuses_a_bad_number_in_one_line_before_any_work(
    option: str,
    value: str,
    expected: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_work: None,
) -> None:
    code, err = run_cli(["demo", option, value, "--out", str(tmp_path / "out")], capsys)
    assert code == 2
    assert err == [
        f"gaussify: error: argument {option}: expected {expected}, got '{value}' "
        "(see 'gaussify demo --help')"
    ]
    assert not (tmp_path / "out").exists()


def test_demo_refuses_an_output_path_it_cannot_use_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    code, err = run_cli(["demo", "--out", str(afile)], capsys)
    assert (code, err) == (
        2,
        [f"gaussify: error: argument --out: '{afile}' is a file, not a folder"],
    )
    code, err = run_cli(["demo", "--out", str(afile / "sub" / "deeper")], capsys)
    assert code == 2
    assert err == [
        f"gaussify: error: argument --out: '{afile / 'sub' / 'deeper'}' cannot be created, "
        f"'{afile}' is a file"
    ]
    assert afile.read_text() == "keep me"


def test_demo_refuses_to_overwrite_its_outputs_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "report.json").write_text("{}")
    code, err = run_cli(["demo", "--dataset", "iris", "--out", str(tmp_path)], capsys)
    assert code == 2
    assert err == [
        f"gaussify: error: argument --out: '{tmp_path}' already holds report.json from an "
        "earlier run; pass --force to replace them, or choose another folder"
    ]
    assert (tmp_path / "report.json").read_text() == "{}"

    class Reached(Exception):
        pass

    def reached(*args: object, **kwargs: object) -> None:
        raise Reached

    monkeypatch.setattr(cli, "train_map", reached)
    with pytest.raises(Reached):  # with --force the same folder is accepted and training starts
        main(["demo", "--dataset", "iris", "--epochs", "1", "--force", "--out", str(tmp_path)])
    fresh = tmp_path / "fresh" / "nested"  # a folder that does not exist yet is created
    with pytest.raises(Reached):
        main(["demo", "--dataset", "iris", "--epochs", "1", "--out", str(fresh)])
    assert fresh.is_dir()


@pytest.mark.parametrize(
    ("dataset", "message"),
    [
        ("yacht", "'yacht' is a regression data set, the demo needs a classification one; "),
        ("nope", "unknown data set 'nope'; "),
    ],
)
def test_demo_refuses_a_dataset_it_cannot_use_before_loading(
    dataset: str,
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_work: None,
) -> None:
    code, err = run_cli(["demo", "--dataset", dataset, "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and len(err) == 1
    choices = ", ".join(data.list(task="classification", available_only=True))
    assert err[0] == f"gaussify: error: argument --dataset: {message}choose one of {choices}"
    assert not (tmp_path / "o").exists()


def test_library_errors_are_one_line_and_debug_shows_the_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def bad_value(*args: object, **kwargs: object) -> None:
        raise ValueError("epochs: must be\na positive integer")

    monkeypatch.setattr(cli, "train_map", bad_value)
    argv = ["demo", "--dataset", "iris", "--no-progress", "--out", str(tmp_path / "o")]
    code, err = run_cli(argv, capsys)
    # raised outside gaussify (as inside torch): the line says how to see where
    hint = " (--debug shows the traceback)"
    assert (code, err) == (2, [f"gaussify: error: epochs: must be a positive integer{hint}"])
    monkeypatch.setattr(cli, "train_map", lambda *a, **k: data.info("nope"))
    code, err = run_cli([*argv, "--force"], capsys)  # raised by gaussify's own checks
    assert code == 2 and len(err) == 1
    assert err[0].startswith("gaussify: error: name: unknown data set 'nope'; available: ")
    assert not err[0].endswith(hint)
    monkeypatch.setattr(cli, "train_map", bad_value)
    with pytest.raises(ValueError, match="epochs: must be"):
        main(["--debug", *argv, "--force"])
    with pytest.raises(ValueError, match="epochs: must be"):
        main([*argv, "--force", "--debug"])

    def bug(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("a bug keeps its traceback")

    monkeypatch.setattr(cli, "train_map", bug)
    with pytest.raises(ZeroDivisionError):
        main([*argv, "--force"])


def test_corrupted_bundled_file_is_one_line_naming_dataset_and_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / "files"
    copy.mkdir()
    good = (raw.FILES_DIR / "wine.npz").read_bytes()
    (copy / "wine.npz").write_bytes(good[: len(good) // 2])  # truncated
    monkeypatch.setattr(raw, "FILES_DIR", copy)
    raw.read_npz.cache_clear()
    monkeypatch.setattr(cli, "train_map", lambda *a, **k: pytest.fail("trained on bad data"))
    code, err = run_cli(["demo", "--dataset", "wine", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and len(err) == 1
    assert err[0].startswith(
        f"gaussify: error: wine: bundled file {copy / 'wine.npz'} is corrupted or truncated"
    )


def test_datasets_table_shows_every_cell_in_full(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["datasets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in data.list():
        spec = data.info(name)
        row = next(line for line in lines if line.split()[0] == name)
        assert row.rstrip().endswith(spec.licence) and f"  {spec.source}  " in row


def test_experiment_without_a_name_lists_every_experiment(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from gaussify.experiments import EXPERIMENTS, get

    assert main(["experiment"]) == 0
    out = capsys.readouterr().out
    for name in EXPERIMENTS:
        line = next(line for line in out.splitlines() if line.split()[:1] == [name])
        first = " ".join(get(name).__doc__.split("\n\n")[0].split())
        assert line.split(None, 1)[1] == first


# ------------------------------------------------------------------ gaussify experiment

#: one bad value per experiment: (option, value, what the option expects)
BAD_EXPERIMENT_VALUE = {
    "approx_active": ("--steps", "0", "a positive integer"),
    "approx_gp_classification": ("--splits", "0", "a positive integer"),
    "approx_streaming": ("--width", "0", "a positive integer"),
    "approx_training": ("--epochs", "0", "a positive integer"),
    "function_space_images": ("--angles", "nan", "a finite number"),
    "function_space_regression": ("--max-train", "0", "a positive integer"),
    "function_space_toy": ("--num-inducing", "0", "a positive integer"),
    "marglik_selection": ("--lr", "0", "a finite number > 0"),
    "marglik_regression": ("--epochs", "0", "a positive integer"),
    "ngvi_predictive": ("--depth", "-1", "a non-negative integer"),
    "uci_classification": ("--n-jobs", "0", "a positive integer"),
    "vbll_classification": ("--seeds", "0", "a positive integer"),
    "vbll_uci": ("--patience", "0", "a positive integer"),
}


@pytest.fixture
def no_experiment_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any experiment's ``run`` (or the demo's training) is called."""
    from gaussify import experiments

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the experiment started before refusing its arguments")

    for name in experiments.EXPERIMENTS:
        monkeypatch.setattr(experiments.get(name), "run", refuse)


def test_bad_values_table_covers_every_experiment() -> None:
    from gaussify.experiments import EXPERIMENTS

    assert set(BAD_EXPERIMENT_VALUE) == set(EXPERIMENTS)


@pytest.mark.parametrize("name", sorted(BAD_EXPERIMENT_VALUE))
def test_every_experiment_refuses_a_bad_number_in_one_line_before_running(
    name: str, capsys: pytest.CaptureFixture[str], no_experiment_runs: None
) -> None:
    option, value, expected = BAD_EXPERIMENT_VALUE[name]
    code, err = run_cli(["experiment", name, option, value], capsys)
    assert code == 2
    assert err == [
        f"gaussify: error: argument {option}: expected {expected}, got '{value}' "
        f"(see 'gaussify experiment {name} --help')"
    ]


@pytest.mark.parametrize("name", sorted(BAD_EXPERIMENT_VALUE))
def test_every_experiment_refuses_an_unwritable_output_before_running(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_experiment_runs: None
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    target = afile / "results.json"
    code, err = run_cli(["experiment", name, "--output", str(target)], capsys)
    assert code == 2
    assert err == [
        f"gaussify: error: argument --output: '{target}' cannot be created, '{afile}' is a file"
    ]


@pytest.mark.parametrize("name", sorted(BAD_EXPERIMENT_VALUE))
def test_every_experiment_has_the_same_progress_switch(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import inspect

    from gaussify import experiments

    with pytest.raises(SystemExit) as info:
        main(["experiment", name, "--help"])
    assert info.value.code == 0
    assert "--progress, --no-progress" in capsys.readouterr().out
    # the switch reaches run(): every experiment's run takes progress, off by default
    parameter = inspect.signature(experiments.get(name).run).parameters["progress"]
    assert parameter.default is False


def test_experiment_notes_an_output_it_will_replace_and_reports_library_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gaussify.experiments import marglik_selection, uci_classification

    old = tmp_path / "old.json"
    old.write_text("{}")

    def bad_value(**kwargs: object) -> None:
        assert kwargs["progress"] is False  # --no-progress reached run()
        raise ValueError("deltas: must be positive")

    monkeypatch.setattr(marglik_selection, "run", bad_value)
    argv = ["experiment", "marglik_selection", "--no-progress", "--output", str(old)]
    code, err = run_cli(argv, capsys)
    assert code == 2
    assert err[0] == f"note: --output '{old}' exists and will be replaced"
    assert err[1].startswith("gaussify: error: deltas: must be positive") and len(err) == 2
    assert old.read_text() == "{}"
    # a regression set in a classification table: refused by run() before any training
    monkeypatch.setattr(uci_classification, "train_map", lambda *a, **k: pytest.fail("trained"))
    code, err = run_cli(["experiment", "uci_classification", "--datasets", "iris", "yacht"], capsys)
    assert code == 2
    assert err == [
        "gaussify: error: datasets: ['yacht'] are regression data sets, not classification"
    ]


def test_python_dash_m_entry_point_reports_errors_the_same_way(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from gaussify.experiments._report import run_main

    def main_raising(argv: list[str]) -> int:
        assert argv == ["--quick"]  # --debug is taken out
        raise ValueError("datasets: unknown\n['nope']")

    with pytest.raises(SystemExit) as info:
        run_main(main_raising, ["--quick"])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "gaussify: error: datasets: unknown ['nope'] (--debug shows the traceback)"
    ]
    with pytest.raises(ValueError, match="datasets: unknown"):
        run_main(main_raising, ["--quick", "--debug"])
