"""The issue-19 comparison of our VaLLA with the authors' own code on the regression CQM rows
(``benchmarks/valla_authors_cqm.py``): the stand-in for ``properscoring`` equals our closed-form
CRPS, the authors' notebook CQM is our 11-level trapezoid plus the constant 0.05, a folder that
is not their repository is refused, merged runs keep a fit scored twice once, and (where the
read-only mirror of their repository exists) their scorer agrees with ours on a predictive of
shape (N, 1) and broadcasts one of shape (N, 1, 1)."""

from __future__ import annotations

import json
import math
import runpy
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from gaussify import metrics

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "valla_authors_cqm.py"
MIRROR = Path("/work/.mirror/Ludvins+Variational-LLA/repo")


@pytest.fixture(scope="module")
def bench() -> dict:
    return runpy.run_path(str(BENCHMARK))


def _heteroscedastic(n: int = 400, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A calibrated heteroscedastic predictive: variances from 0.01 to 4 by point, each
    target drawn from its own N(mean_n, var_n)."""
    gen = torch.Generator().manual_seed(seed)
    mean = torch.randn(n, 1, generator=gen, dtype=torch.float64)
    var = 0.01 + 4 * torch.rand(n, 1, generator=gen, dtype=torch.float64) ** 2
    y = mean + var.sqrt() * torch.randn(n, 1, generator=gen, dtype=torch.float64)
    return mean, var, y


def test_crps_stand_in_is_the_gaussian_closed_form(bench: dict) -> None:
    mean, var, y = _heteroscedastic()
    ours = metrics.crps_gaussian(mean, var.sqrt(), y)
    theirs = bench["_crps_gaussian"](y.numpy(), mean.numpy(), var.sqrt().numpy())
    assert theirs.shape == (400, 1)
    assert float(theirs.mean()) == pytest.approx(ours, rel=1e-12)
    # numpy broadcasting, as properscoring's: a (N, 1, 1) scale against (N, 1) targets
    assert bench["_crps_gaussian"](y, mean, var.reshape(-1, 1, 1).sqrt()).shape == (400, 400, 1)


def test_authors_cqm_is_our_trapezoid_plus_the_level_one_constant(bench: dict) -> None:
    mean, var, y = _heteroscedastic()
    alphas = torch.linspace(0, 1, 11, dtype=torch.float64)
    coverage = metrics.cqm_curve(mean, var.sqrt(), y, alphas)
    q = {f"Q-{10 * k}": float(coverage[k]) for k in range(1, 10)}
    published, corrected = bench["authors_cqm"](q)
    ours = metrics.cqm(mean, var.sqrt(), y, num_points=11)
    assert corrected == pytest.approx(ours, abs=1e-12)
    # their last gap is 1 instead of |m(1) - 1| = 0: 0.1 * (0 + 1) / 2 more
    assert published - corrected == pytest.approx(0.05, abs=1e-15)


def test_a_folder_that_is_not_their_repository_is_refused(bench: dict, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"--authors-repo .*missing .*src/valla\.py"):
        bench["load_authors"](tmp_path)


def _record(fit: str, nll: float, seed: int = 0) -> dict:
    scored = {"cqm": 0.01, "nll": nll}
    return {
        "dataset": "power",
        "seed": seed,
        "fit": fit,
        "nll": nll,
        "crps": 0.1,
        "cqm": 0.01,
        "cqm_paper": 0.01,
        "rmse": 0.2,
        "authors_metric": {"broadcast": scored, "matched": scored},
    }


def test_merge_keeps_a_fit_scored_by_two_runs_once(bench: dict, tmp_path: Path) -> None:
    a = {"records": [_record("map", 0.5), _record("ours", 0.4)], "runtime_s": 3.0}
    b = {"records": [_record("map", 0.5), _record("authors", 0.45)], "runtime_s": 4.0}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    out = tmp_path / "m.json"
    bench["merge"]([str(tmp_path / "a.json"), str(tmp_path / "b.json")], str(out))
    res = json.loads(out.read_text())
    assert [r["fit"] for r in res["records"]] == ["map", "ours", "authors"]
    assert [r["runtime_s"] for r in res["runs"]] == [3.0, 4.0]
    pair = next(p for p in res["paired"] if (p["a"], p["b"]) == ("authors", "ours"))
    assert pair["nll_diff_mean"] == pytest.approx(0.05)
    b["records"][0]["nll"] = 0.6  # the same fit, a different value: refused
    (tmp_path / "b.json").write_text(json.dumps(b))
    with pytest.raises(SystemExit, match=r"\('power', 0, 'map'\) differs between runs"):
        bench["merge"]([str(tmp_path / "a.json"), str(tmp_path / "b.json")], str(out))


@pytest.mark.slow  # imports their modules (scikit-learn, scipy): about 5 s
@pytest.mark.skipif(
    not (MIRROR / "HEAD").exists() or shutil.which("git") is None,
    reason="the read-only mirror of github.com/Ludvins/Variational-LLA is not on this machine",
)
def test_their_scorer_matches_ours_on_n_by_1_and_broadcasts_n_by_1_by_1(
    bench: dict, tmp_path: Path
) -> None:
    archive = subprocess.run(
        ["git", "-C", str(MIRROR), "archive", "HEAD", "src", "utils"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive, check=True)
    mods = bench["load_authors"](tmp_path)
    assert torch.pi == math.pi  # restored after their module overwrote it
    mean, var, y = _heteroscedastic(n=300)
    scores = bench["authors_scores"](mods, mean, var.reshape(-1, 1, 1), y)
    matched, broadcast = scores["matched"], scores["broadcast"]
    # their coverages are float32 means: agreement to 1e-6
    assert matched["cqm"] == pytest.approx(
        metrics.cqm(mean, var.sqrt(), y, num_points=11), abs=1e-6
    )
    assert matched["crps"] == pytest.approx(metrics.crps_gaussian(mean, var.sqrt(), y))
    assert matched["nll"] == pytest.approx(metrics.gaussian_nll(mean, var, y))
    # (N, 1, 1) against (N, 1) targets: the coverage of y_j is counted with the standard
    # deviation of every point i of its batch of 100, i.e. the batch's mixture of scales
    levels = torch.arange(1, 10, dtype=torch.float64) / 10
    half = torch.distributions.Normal(0.0, 1.0).icdf(0.5 + levels / 2).double()
    expected = []
    for d in half:
        inside = []
        for start in range(0, 300, 100):
            m, s, t = (a[start : start + 100, 0] for a in (mean, var.sqrt(), y))
            inside.append(((t[None] - m[None]).abs() < d * s[:, None]).double().mean())
        expected.append(float(torch.stack(inside).mean()))
    # their coverage is accumulated in float32
    assert broadcast["coverage"] == pytest.approx(expected, abs=1e-6)
    assert broadcast["nll"] == pytest.approx(matched["nll"])  # their NLL squeezes first
    # calibrated point by point, so ours is near 0; their broadcast scores the batch mixture
    assert matched["cqm"] < 0.03
    assert broadcast["cqm"] > 0.04
    assert np.isfinite(broadcast["crps"])
