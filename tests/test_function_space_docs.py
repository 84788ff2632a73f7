"""scripts/make_function_space_docs.py: the docs figure's bands on a small config are the exact
linearised-Laplace bands (weight space = function space, ELLA with M = N = exact, ELLA with
M < N below exact), and the figure is written."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import matplotlib.image
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "make_function_space_docs.py"


def _script():
    spec = importlib.util.spec_from_file_location("make_function_space_docs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return _script()


@pytest.fixture(scope="module")
def bands(script):
    # N C = 80 >= P = 42: the training Jacobians span the parameters, so ELLA with every
    # training point as a landmark is exact away from the training set too
    cfg = script.Config(width=8, epochs=30, landmarks=10, grid=9, max_train=40)
    return script.compute(cfg)


def test_logit_difference_std_is_the_std_of_c_f(script) -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(5, 2, 2, dtype=torch.float64, generator=gen)
    cov = a @ a.transpose(-1, -2)
    c = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    expected = torch.einsum("i,nij,j->n", c, cov, c).sqrt()
    torch.testing.assert_close(script.logit_difference_std(cov), expected)


def test_lla_band_equals_weight_space_full_laplace(bands) -> None:
    """Thesis Thm 3.2: the GP with the NTK is the full Laplace-GGN GLM predictive."""
    assert bands.lla.shape == (81,) and bool((bands.lla > 0).all())
    torch.testing.assert_close(bands.weight_space, bands.lla, rtol=1e-8, atol=1e-12)


def test_ella_with_all_points_equals_lla_and_fewer_landmarks_stay_below(bands) -> None:
    n, p = bands.x.shape[0], bands.num_params
    assert 2 * n >= p
    torch.testing.assert_close(bands.ella_all, bands.lla, rtol=1e-6, atol=1e-10)
    assert bands.landmarks.shape == (10, 2)
    # the Nystrom kernel is below the exact one in the Loewner order: variance never larger
    assert bool((bands.ella <= bands.lla * (1 + 1e-9)).all())
    assert float((bands.ella / bands.lla).min()) < 1 - 1e-6  # and M = 10 < N loses some


def test_figure_is_written(script, bands, tmp_path) -> None:
    out = script.plot(bands, tmp_path / "figs" / "bands.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = matplotlib.image.imread(out).shape[:2]
    assert width > 2 * height > 0  # three panels side by side


def test_defaults_are_the_page_example(script) -> None:
    """The figure's default setup is the one the page's first example runs."""
    code = script.example_code(script.PAGE.read_text())
    cfg = script.Config()
    assert f"nn.Linear(2, {cfg.width})" in code
    assert re.search(rf"epochs={cfg.epochs}\b", code)
    lr = re.search(r"\blr=([0-9.e+-]+)", code)
    assert lr is not None and float(lr.group(1)) == cfg.lr
    assert f"num_landmarks={cfg.landmarks}" in code and 'landmarks="kmeans"' in code


@pytest.mark.slow
def test_page_example_runs_as_written(script) -> None:
    assert script.run_example(script.example_code(script.PAGE.read_text())) > 0


def test_page_tables_are_the_committed_results(script) -> None:
    """The page's result tables are what the script builds from the committed JSON files, and
    the bold cell of each column is its best value."""
    page = script.PAGE.read_text()
    assert script.update_tables(page) == page
    reg = json.loads(script.REGRESSION_JSON.read_text())
    table = script.regression_table(reg)
    nll = {r["method"]: r["nll"] for r in reg["records"] if r["dataset"] == "power"}
    best = min(nll, key=nll.get)
    assert f"| {script.LABELS[best]} |" in next(
        line for line in table.splitlines() if f"**{nll[best]:.3f}**" in line
    )


def test_replace_block_needs_both_markers(script) -> None:
    text = "a\n<!-- t:start -->\nold\n<!-- t:end -->\nb"
    assert script.replace_block(text, "t", "new") == "a\n<!-- t:start -->\nnew\n<!-- t:end -->\nb"
    with pytest.raises(SystemExit, match="markers"):
        script.replace_block("no markers here", "t", "new")
