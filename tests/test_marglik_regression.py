"""Thesis Fig. 5.2 (``gaussify.experiments.marglik_regression``) and its toy
(``experiments/_gap_toy.py``): the stacked MAP training equals ``train_map`` per pair, the
evidence grid's maximum is where ``Laplace.optimize_prior`` (prior and noise jointly) ends to
grid resolution, and the selected pair is the grid's evidence argmax."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from gaussify.experiments import get
from gaussify.experiments import marglik_regression as exp
from gaussify.experiments._gap_toy import GAP, NOISE_VARIANCE, RANGE, gap_toy, truth
from gaussify.experiments._runner import tanh_mlp
from gaussify.training import train_map
from gaussify.weight_space import Laplace


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_gap_toy_follows_the_thesis_statement() -> None:
    """150 training inputs on [-2, 2] outside the gap, 1000 test inputs on the whole range,
    200 gap inputs; the noise about sin(4x) has the thesis's variance 0.09 (1350 residuals:
    the sample variance's standard error is 0.09 * sqrt(2 / 1350) = 0.0035); same seed, same
    draws; another seed, other draws."""
    toy = gap_toy(0)
    assert toy.x_train.shape == (150, 1) and toy.y_train.shape == (150, 1)
    assert toy.x_test.shape == (1000, 1) and toy.x_val.shape == (200, 1)
    x = toy.x_train[:, 0]
    assert bool(((x <= GAP[0]) | (x >= GAP[1])).all())
    assert RANGE[0] <= float(toy.x_test.min()) and float(toy.x_test.max()) <= RANGE[1]
    assert bool(((toy.x_val > GAP[0]) & (toy.x_val < GAP[1])).all())
    res = torch.cat([toy.y_train - truth(toy.x_train), toy.y_test - truth(toy.x_test),
                     toy.y_val - truth(toy.x_val)])  # fmt: skip
    assert abs(float(res.var()) - NOISE_VARIANCE) < 5 * 0.0035
    assert torch.equal(gap_toy(0).y_test, toy.y_test)
    assert not torch.equal(gap_toy(1).y_test, toy.y_test)
    with pytest.raises(ValueError, match="n_train"):
        gap_toy(0, n_train=0)


def test_stacked_maps_equal_train_map_per_pair() -> None:
    """Each stacked copy follows train_map's full-batch Adam (cosine decay) for its own prior
    precision and noise: the weights agree to round-off."""
    toy = gap_toy(0)
    pairs = [(0.63, 0.1), (1e-3, 1.0), (10.0, 0.01)]
    states = exp.train_maps(toy, pairs, 4, 1, 20, 1e-2, 3)
    for (delta, sigma2), state in zip(pairs, states, strict=True):
        model = tanh_mlp(1, 1, 4, 1, 3)
        train_map(
            model, (toy.x_train, toy.y_train), "regression", delta, 20, 1e-2,
            sigma_noise=math.sqrt(sigma2), batch_size=150, seed=3,
        )  # fmt: skip
        for key, value in model.state_dict().items():
            assert (value - state[key]).abs().max() < 1e-12, (delta, sigma2, key)


def test_evidence_grid_argmax_is_optimize_prior_to_grid_resolution() -> None:
    """At one MAP on the gap toy, the log evidence over a (delta, sigma^2) grid of 4 points
    per decade on the thesis's ranges peaks within one grid step (per coordinate, in log10)
    of the pair ``optimize_prior`` finds, and optimize_prior's value is at least the grid's
    best; the grid entries are the evidence at those hyperparameters."""
    toy = gap_toy(0)
    model = tanh_mlp(1, 1, 10, 1, 0)
    train_map(
        model, (toy.x_train, toy.y_train), "regression", 0.5, 300, 1e-2,
        sigma_noise=0.3, batch_size=150, seed=0,
    )  # fmt: skip
    la = Laplace(model, "regression", "full", prior_precision=0.5, sigma_noise=0.3)
    la.fit((toy.x_train, toy.y_train))
    deltas = np.logspace(-4, 2, 25)
    sigma2s = np.logspace(-3, 1, 17)
    surface = exp.evidence_grid(la, deltas, sigma2s)
    assert surface[3, 5] == pytest.approx(
        float(la.log_marginal_likelihood(float(deltas[3]), math.sqrt(sigma2s[5]))), abs=0
    )
    i, j = np.unravel_index(int(np.argmax(surface)), surface.shape)
    la.optimize_prior()
    delta, sigma2 = float(la.prior_precision), float(la.sigma_noise) ** 2
    assert abs(math.log10(delta / deltas[i])) <= 0.25 + 1e-9
    assert abs(math.log10(sigma2 / sigma2s[j])) <= 0.25 + 1e-9
    assert float(la.log_marginal_likelihood()) >= surface.max() - 1e-9


@pytest.fixture(scope="module")
def small() -> exp.RegressionSelection:
    return exp.run(
        deltas=[1e-3, 0.1, 10.0], sigma2s=[0.01, 0.1, 1.0], fine_points=4, width=5, depth=1,
        epochs=150,
    )  # fmt: skip


def test_run_selects_the_evidence_argmax_and_checks_the_tuner(small) -> None:
    """The selected pair is the grid row of largest evidence, the test-optimal pair the row
    of largest test log-likelihood; the fixed-MAP surface's argmax is within one fine step of
    optimize_prior's pair, and each row's evidence is that of a Laplace fit at its MAP."""
    best = max(small.grid, key=lambda r: r["log_evidence"])
    s = small.summary
    assert (s["delta_by_evidence"], s["sigma2_by_evidence"]) == (best["delta"], best["sigma2"])
    by_test = max(small.grid, key=lambda r: r["test_ll_map"])
    assert (s["delta_by_test_ll"], s["sigma2_by_test_ll"]) == (by_test["delta"], by_test["sigma2"])
    assert max(s["optimize_prior_vs_grid_decades"]) <= s["fine_grid_step_decades"] + 1e-9
    assert len(small.grid) == 9
    row = small.grid[4]
    la = small.fits[(row["delta"], row["sigma2"])]
    assert float(la.log_marginal_likelihood()) == pytest.approx(row["log_evidence"], rel=1e-12)
    assert float(la.prior_precision) == row["delta"]
    assert float(la.sigma_noise) ** 2 == pytest.approx(row["sigma2"], rel=1e-12)
    surface = np.array(small.fixed_map["log_evidence"])
    assert surface.shape == (len(small.fixed_map["deltas"]), len(small.fixed_map["sigma2s"]))
    payload = json.loads(json.dumps(small.to_dict()))
    assert payload["experiment"] == "marglik_regression" and payload["grid"] == small.grid
    assert "| thesis" in small.table()


def test_cli_writes_json_and_figure(tmp_path, monkeypatch) -> None:
    calls = {}
    real = exp.run

    def tiny(**kwargs):
        calls.update(kwargs)
        return real(**{**kwargs, "deltas": [0.1, 1.0], "sigma2s": [0.1, 1.0], "width": 3,
                       "depth": 1, "epochs": 20, "fine_points": 2})  # fmt: skip

    monkeypatch.setattr(exp, "run", tiny)
    out, fig = tmp_path / "r.json", tmp_path / "f.png"
    argv = ["--epochs", "20", "--no-progress", "--output", str(out), "--figure", str(fig)]
    assert get("marglik_regression").main(argv) == 0
    assert calls["epochs"] == 20
    assert json.loads(out.read_text())["summary"]["thesis_delta"] == exp.THESIS_DELTA
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"per_decade": 0}, "per_decade"), ({"deltas": [-1.0]}, "deltas"),
     ({"sigma2s": [float("nan")]}, "sigma2s")],
)  # fmt: skip
def test_bad_input(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        exp.run(**kwargs)


def test_train_maps_reports_each_pairs_objective_gradient_norm() -> None:
    """``grad_norms`` holds, per pair, ||grad|| of that pair's own objective
    sum_n (y_n - f_n)^2 / (2 sigma^2 N) + delta ||theta||^2 / (2 N) at the returned weights
    (float64 autograd oracle on a network loaded with the state)."""
    toy = gap_toy(0)
    pairs = [(0.5, 0.1), (1e-3, 1.0)]
    norms: list[float] = []
    states = exp.train_maps(toy, pairs, 4, 1, 15, 1e-2, 2, grad_norms=norms)
    assert len(norms) == 2
    for (delta, sigma2), state, norm in zip(pairs, states, norms, strict=True):
        model = tanh_mlp(1, 1, 4, 1, 2)
        model.load_state_dict(state)
        n = len(toy.y_train)
        theta = list(model.parameters())
        loss = ((toy.y_train - model(toy.x_train)) ** 2).sum() / (2 * sigma2 * n)
        loss = loss + delta * sum(p.square().sum() for p in theta) / (2 * n)
        grads = torch.autograd.grad(loss, theta)
        oracle = float(torch.cat([g.reshape(-1) for g in grads]).norm())
        assert norm == pytest.approx(oracle, rel=1e-9, abs=1e-12)


@pytest.fixture(scope="module")
def two_seeds() -> exp.RegressionSelection:
    return exp.run(
        deltas=[1e-3, 0.1, 10.0], sigma2s=[0.01, 0.1, 1.0], fine_points=2, width=4, depth=1,
        epochs=60, seeds=[0, 1], glm_grid=False,
    )  # fmt: skip


def test_several_seeds_select_on_the_surfaces_averaged_over_seeds(two_seeds) -> None:
    """With seeds [0, 1]: mean_grid is the per-pair mean of the two seeds' rows, the summary's
    pairs are the argmax of the mean evidence / mean test log-likelihood, per_seed holds each
    seed's own argmax, and the rank of the selected pair counts the pairs with a larger mean
    test log-likelihood."""
    res = two_seeds
    assert len(res.grid) == 18 and {r["seed"] for r in res.grid} == {0, 1}
    for m in res.mean_grid:
        here = [r for r in res.grid if (r["delta"], r["sigma2"]) == (m["delta"], m["sigma2"])]
        assert len(here) == 2
        for key in ("log_evidence", "test_ll_map", "test_ll_map_outside_gap"):
            assert m[key] == pytest.approx((here[0][key] + here[1][key]) / 2, rel=1e-14)
    s = res.summary
    best = max(res.mean_grid, key=lambda r: r["log_evidence"])
    top = max(res.mean_grid, key=lambda r: r["test_ll_map"])
    assert (s["delta_by_evidence"], s["sigma2_by_evidence"]) == (best["delta"], best["sigma2"])
    assert (s["delta_by_test_ll"], s["sigma2_by_test_ll"]) == (top["delta"], top["sigma2"])
    assert s["test_ll_map_best"] == top["test_ll_map"]
    assert s["test_ll_rank_at_evidence"] == 1 + sum(
        r["test_ll_map"] > best["test_ll_map"] for r in res.mean_grid
    )
    for per in s["per_seed"]:
        rows = [r for r in res.grid if r["seed"] == per["seed"]]
        own = max(rows, key=lambda r: r["log_evidence"])
        selected = (per["delta_by_evidence"], per["sigma2_by_evidence"])
        assert selected == (own["delta"], own["sigma2"])
        assert per["map_grad_norm_max"] == max(r["map_grad_norm"] for r in rows)
    assert res.config["seeds"] == [0, 1] and res.to_dict()["mean_grid"] == res.mean_grid


def test_outside_gap_log_likelihood_and_glm_nll_at_the_selected_pair(two_seeds) -> None:
    """A row's test log-likelihood outside the gap is the Gaussian average over the test
    inputs outside (-0.5, 0.5) (recomputed from a retrained MAP); without the GLM grid, the
    rows hold no GLM NLL and the summary's is the GLM predictive's at the selected pair with
    the first seed's MAP."""
    toy = gap_toy(0)
    row = next(r for r in two_seeds.grid if r["seed"] == 1 and r["delta"] == 0.1)
    state = exp.train_maps(toy, [(row["delta"], row["sigma2"])], 4, 1, 60, 1e-2, 1)[0]
    model, _ = exp.fit_point(toy, row["delta"], row["sigma2"], state, 4, 1)
    x = toy.x_test[:, 0]
    out = (x < GAP[0]) | (x > GAP[1])
    with torch.no_grad():
        f = model(toy.x_test)
    ll = -0.5 * math.log(2 * math.pi * row["sigma2"]) - 0.5 * (toy.y_test - f) ** 2 / row["sigma2"]
    assert row["test_ll_map_outside_gap"] == pytest.approx(float(ll[out].mean()), abs=1e-9)
    assert row["test_ll_map"] == pytest.approx(float(ll.mean()), abs=1e-9)
    assert 0 < int(out.sum()) < len(x)
    assert all(r["test_nll_glm"] is None for r in two_seeds.grid)
    s = two_seeds.summary
    states = exp.train_maps(toy, [(s["delta_by_evidence"], s["sigma2_by_evidence"])], 4, 1, 60,
                            1e-2, 0)  # fmt: skip
    _, la0 = exp.fit_point(toy, s["delta_by_evidence"], s["sigma2_by_evidence"], states[0], 4, 1)
    nll = float(-la0.predict(toy.x_test, method="glm").log_prob(toy.y_test).mean())
    assert s["test_nll_glm_at_evidence"] == pytest.approx(nll, rel=1e-9)


@pytest.mark.parametrize(
    ("kwargs", "name"), [({"seeds": [0, 0]}, "seeds"), ({"seeds": []}, "seeds"),
                         ({"jobs": 0}, "jobs")],
)  # fmt: skip
def test_bad_seeds_and_jobs(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        exp.run(**kwargs)
