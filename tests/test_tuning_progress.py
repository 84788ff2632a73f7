"""Progress of prior tuning (issue 17): the stages of ``optimize_prior(progress=True)`` for a
full GGN (the factorisation the closed-form evidence needs, then the evidence evaluations),
on ``tqdm`` bars written to stderr, and nothing when progress is off."""

from __future__ import annotations

import re
import time

import pytest
import torch
from torch import nn

import gaussify as gs
from gaussify.tuning import progress_stage, tune_hyperparameters

DT = torch.float64


def _fitted(correction: bool) -> gs.Laplace:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1)).to(DT)
    x = torch.randn(40, 3, dtype=DT)
    y = torch.randn(40, 1, dtype=DT)
    return gs.Laplace(model, "regression", structure="full", correction=correction).fit((x, y))


def _evaluations_shown(err: str) -> int:
    """The last count on the evidence bar (tqdm redraws with a carriage return)."""
    counts = re.findall(r"Laplace\.optimize_prior: evidence: (\d+)eval", err)
    assert counts, err
    return int(counts[-1])


@pytest.mark.parametrize(("correction", "name"), [(True, "eigh"), (False, "eigvalsh")])
def test_optimize_prior_shows_decomposition_and_evaluations(
    correction: bool, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    la = _fitted(correction)
    p = la.subset.num_params
    la.optimize_prior(progress=True)
    err = capsys.readouterr().err
    # the factorisation stage names the routine the evidence needs: eigenvectors for the
    # non-MAP correction's projections, eigenvalues alone at the MAP
    assert f"Laplace.optimize_prior: {name} of the {p} x {p} curvature" in err
    assert _evaluations_shown(err) == la.tuning_result.evaluations
    # a second tuning reuses the cached decomposition: no factorisation stage
    la.optimize_prior(progress=True)
    err = capsys.readouterr().err
    assert "curvature" not in err
    assert _evaluations_shown(err) == la.tuning_result.evaluations


def test_progress_changes_nothing_but_the_display(capsys: pytest.CaptureFixture[str]) -> None:
    quiet, loud = _fitted(True), _fitted(True)
    quiet.optimize_prior()
    assert capsys.readouterr().err == ""
    loud.optimize_prior(progress=True)
    assert capsys.readouterr().err != ""
    assert torch.equal(quiet.prior_precision, loud.prior_precision)
    assert torch.equal(quiet.sigma_noise, loud.sigma_noise)
    assert quiet.tuning_result.evaluations == loud.tuning_result.evaluations


def test_grid_search_shows_the_decomposition(capsys: pytest.CaptureFixture[str]) -> None:
    la = _fitted(False)
    la.optimize_prior(method="grid", progress=True)
    assert "eigvalsh of the" in capsys.readouterr().err


def test_progress_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="progress: expected True or False, got 'yes'"):
        tune_hyperparameters(
            lambda prior, sigma: -(prior.log() ** 2).sum(),
            torch.ones(1, dtype=DT),
            None,
            tune_noise=False,
            progress="yes",  # type: ignore[arg-type]
        )


def test_progress_stage_refreshes_while_the_block_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with progress_stage("stage under test", True, refresh_s=0.01):
        time.sleep(0.2)
    err = capsys.readouterr().err
    assert "stage under test" in err
    # the bar was redrawn by the ticker while the block ran (tqdm writes one "\r" per draw):
    # the first draw, at least a few refreshes, the completed step and the closing postfix
    assert err.count("\r") >= 5
    assert re.search(r"1/1 .*0\.\d s", err)
    with progress_stage("quiet stage", False):
        pass
    assert capsys.readouterr().err == ""
