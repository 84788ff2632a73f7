"""The issue-19 comparison of ``VBLLRegression`` with the ``vbll`` package
(``benchmarks/vbll_regression_protocol.py``): the remaining differences between the two heads
are the initial draws and the ``wishart_scale`` default, pinned here for both libraries, and
the benchmark's redrawn starts, paired rows and machine record."""

from __future__ import annotations

import math
import os
import runpy
from pathlib import Path

import pytest
import torch

from gaussify import last_layer

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "vbll_regression_protocol.py"


@pytest.fixture(scope="module")
def bench() -> dict:
    return runpy.run_path(str(BENCHMARK))


def test_our_start_is_a_prior_draw_and_the_prior_covariance() -> None:
    """Ours: ``W_bar ~ N(0, 1/D)`` (a draw from the default prior ``N(0, I/D)``), ``S = I/D``
    exactly (the prior covariance), noise variance 1, ``wishart_scale`` 1."""
    d, heads = 40, 50
    torch.manual_seed(0)
    draws = [last_layer.VBLLRegression(d, 1, 0.01) for _ in range(heads)]
    means = torch.stack([h.W_mean.detach() for h in draws])
    # sample variance of 2000 N(0, 1/D) draws: relative s.e. sqrt(2/2000) = 3.2 %
    assert means.var().item() * d == pytest.approx(1.0, rel=0.12)
    head = last_layer.VBLLRegression(d, 1, 0.01)
    cov = head.W_cov().covariance.detach().reshape(-1, d, d)
    assert (cov[0] - torch.eye(d) / d).abs().max().item() < 1e-8
    assert float(head.noise_cov.variance.detach().squeeze()) == pytest.approx(1.0)
    assert head.wishart_scale == 1.0
    assert head.prior_scale == pytest.approx(1.0 / d)


def test_the_vbll_package_start_and_defaults() -> None:
    """The package (``vbll.Regression``, dense): ``W_bar ~ N(0, 1)``; a random Cholesky factor
    with log-diagonal ``N(-log(D)/2, 1)`` and off-diagonal ``N(0, 1/D^2)``, so its initial
    ``E[S_ii] = (e^2 + (i - 1)/D) / D`` (mean over i about ``(e^2 + 1/2) / D``, 8 times the
    prior's ``1/D``); ``log sigma = log(wishart_scale) z``, ``z ~ N(0, 1)`` (0 at
    ``wishart_scale = 1``); default ``wishart_scale`` 1e-2; prior variance ``prior_scale / D``."""
    vbll = pytest.importorskip("vbll")
    d, heads = 40, 200
    torch.manual_seed(0)
    draws = [vbll.Regression(d, 1, 0.01, wishart_scale=1.0) for _ in range(heads)]
    means = torch.stack([h.W_mean.detach() for h in draws])
    logdiag = torch.stack([h.W_logdiag.detach() for h in draws])
    below = torch.ones(d, d).tril(-1)  # the strictly lower triangle the package uses
    tril = torch.stack([h.W_offdiag.detach()[0] for h in draws]) * below
    assert means.var().item() == pytest.approx(1.0, rel=0.05)
    assert logdiag.mean().item() == pytest.approx(-0.5 * math.log(d), abs=0.045)
    assert logdiag.std().item() == pytest.approx(1.0, rel=0.05)
    rows, cols = torch.tril_indices(d, d, -1)
    off = tril[:, rows, cols]
    assert off.std().item() * d == pytest.approx(1.0, rel=0.05)
    assert all(float(h.noise_logdiag.detach()) == 0.0 for h in draws)  # randn * log(1)
    # the initial variance per weight S_ii = L_ii^2 + sum_j<i L_ij^2: the lognormal L_ii^2 has
    # median 1/D and mean e^2/D (too heavy-tailed to check by a sample mean); the
    # off-diagonal part has mean (i - 1)/D^2, (D - 1)/(2 D^2) over i
    diag_sq = logdiag.mul(2.0).exp()
    assert diag_sq.median().item() * d == pytest.approx(1.0, rel=0.12)
    off_part = tril.square().sum(-1).mean().item()
    assert off_part == pytest.approx((d - 1) / (2 * d * d), rel=0.03)
    default = vbll.Regression(d, 1, 0.01)
    assert default.wishart_scale == 1e-2
    assert default.prior_scale == pytest.approx(1.0 / d)
    torch.manual_seed(1)
    spread = torch.stack(
        [vbll.Regression(d, 1, 0.01, wishart_scale=0.1).noise_logdiag.detach() for _ in range(400)]
    )
    assert spread.std().item() == pytest.approx(abs(math.log(0.1)), rel=0.15)


def test_redraw_changes_only_the_head_start_and_is_reproducible(bench: dict) -> None:
    """``<head>_redraw`` builds the same head from another draw of the generator: a different
    start, the same one on every call under the same seed."""
    pytest.importorskip("vbll")
    make_head = bench["make_head"]
    for method in ("vbll_ws1.0", "gaussify"):
        torch.manual_seed(3)
        first = make_head(method, 100).W_mean.detach().clone()
        torch.manual_seed(3)
        redrawn = make_head(f"{method}_redraw", 100).W_mean.detach().clone()
        torch.manual_seed(3)
        again = make_head(f"{method}_redraw", 100).W_mean.detach().clone()
        assert not torch.equal(first, redrawn)
        assert torch.equal(redrawn, again)
        assert type(make_head(f"{method}_redraw", 100)) is type(make_head(method, 100))


def test_summary_pairs_a_redrawn_head_with_its_own_start(bench: dict) -> None:
    """The row ``paired:X_redraw-X``: per-seed differences, their mean and standard error."""
    a = [0.3, 0.5, 0.1, 0.2]
    b = [0.2, 0.6, 0.0, 0.4]
    records = [
        {"dataset": "toy", "seed": s, "method": m, "test_nll": v, "test_mse": 0.0,
         "train_mse": 0.0, "pred_var": 1.0, "noise_var": 1.0}
        for m, vals in (("vbll_ws1.0", a), ("vbll_ws1.0_redraw", b))
        for s, v in enumerate(vals)
    ]  # fmt: skip
    rows = bench["summarise"](records)
    row = next(r for r in rows if r["method"] == "paired:vbll_ws1.0_redraw-vbll_ws1.0")
    diffs = [y - x for x, y in zip(a, b, strict=True)]
    mean = sum(diffs) / 4
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 3 / 4)
    assert row["diff_mean"] == pytest.approx(mean)
    assert row["diff_se"] == pytest.approx(se)
    assert row["a_better_seeds"] == sum(d < 0 for d in diffs)
    # a redrawn package head never competes for the package's best setting
    assert not any(r["method"] == "summary" for r in rows)


def test_machine_record(bench: dict) -> None:
    info = bench["machine"]()
    assert info["cpus"] == os.cpu_count()
    assert isinstance(info["processor"], str) and info["processor"]
    assert info["load_1min"] is None or info["load_1min"] >= 0.0


def test_selected_epoch_is_the_validation_argmin_of_the_trace(bench: dict) -> None:
    """``select_every``: the reported epoch is the checkpoint with the lowest validation NLL
    (the first on ties) and its test NLL is that checkpoint's; the fixed-budget record is the
    same with or without the selection and the trace (they draw no random numbers)."""
    run = bench["run_one"]
    traced = run("yacht/60", 0, "gaussify", 6, trace_every=2, select_every=2)
    plain = run("yacht/60", 0, "gaussify", 6)
    assert traced["test_nll"] == plain["test_nll"]
    assert [t["epoch"] for t in traced["trace"]] == [2, 4, 6]
    val = [t["val_nll"] for t in traced["trace"]]
    best = val.index(min(val))
    assert traced["selected_epoch"] == traced["trace"][best]["epoch"]
    assert traced["selected_val_nll"] == val[best]
    assert traced["selected_test_nll"] == traced["trace"][best]["test_nll"]
    assert traced["trace"][-1]["test_nll"] == pytest.approx(plain["test_nll"], abs=1e-6)


def test_subset_keeps_the_split_validation_share(bench: dict) -> None:
    """``name/rows``: the first ``rows`` training rows and the first ``rows // 4`` validation
    rows (the split's 0.18 against 0.72); the test set is whole."""
    import gaussify as gs

    ds = gs.data.load("yacht", seed=1)
    data = bench["load"]("yacht/60", 1)
    assert torch.equal(data["x"], ds.x_train[:60])
    assert torch.equal(data["x_val"], ds.x_val[:15])
    assert torch.equal(data["y_test"], ds.y_test)


def test_summary_pairs_the_selected_test_nll(bench: dict) -> None:
    """Rows ``selected:X-gaussify`` pair the test NLL at each run's validation-chosen epoch."""
    fixed, chosen = [0.3, 0.5, 0.1], [0.2, 0.4, 0.4]
    records = [
        {"dataset": "toy", "seed": s, "method": m, "test_nll": f, "selected_test_nll": c + off,
         "selected_epoch": 10, "test_mse": 0.0, "train_mse": 0.0, "pred_var": 1.0,
         "noise_var": 1.0}
        for m, off in (("gaussify", 0.0), ("vbll_ws1.0", 0.1))
        for s, (f, c) in enumerate(zip(fixed, chosen, strict=True))
    ]  # fmt: skip
    rows = bench["summarise"](records)
    row = next(r for r in rows if r["method"] == "selected:vbll_ws1.0-gaussify")
    assert row["diff_mean"] == pytest.approx(0.1)
    assert row["a_better_seeds"] == 0
    ours = next(r for r in rows if r["method"] == "gaussify")
    assert ours["selected_test_nll_mean"] == pytest.approx(sum(chosen) / 3)


def test_wscale_head_scales_the_default_draw(bench: dict) -> None:
    """``gaussify_wscale{c}``: the default head's own draw of the mean times ``sqrt(c)``
    (``N(0, c / D)``); everything else at the defaults."""
    torch.manual_seed(5)
    base = bench["make_head"]("gaussify", 100)
    torch.manual_seed(5)
    scaled = bench["make_head"]("gaussify_wscale4", 100)
    assert torch.allclose(scaled.W_mean, 2.0 * base.W_mean)
    assert torch.equal(scaled.W_cov().covariance, base.W_cov().covariance)
