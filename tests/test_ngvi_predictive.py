"""The thesis Sec. 5.2 experiment (``gaussify.experiments.ngvi_predictive``) on tiny configs,
checked against closed forms: on the linear model (depth 0, Gaussian likelihood) one step
with gamma = 1 of OGGN / LGVA is exact Bayesian linear regression (Thm 4.1) and the reported
GLM NLLs are the BLR predictive's; on an MLP the GLM predictive mean is the network at the
linearisation point (theta* for Laplace, mu for LGVA / OGGN) and the reported NLLs are those
of N(f, J Sigma J^T + sigma^2) formed densely here."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gaussify.curvature.jacobian import jacobians
from gaussify.experiments import get
from gaussify.experiments import ngvi_predictive as exp


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _gaussian_nll(y: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> float:
    return float((0.5 * torch.log(2 * math.pi * var) + 0.5 * (y - mean) ** 2 / var).mean())


def _blr(x: torch.Tensor, y: torch.Tensor, delta: float, sigma: float):
    """Bayesian linear regression posterior of f = W x + b, parameters in [W, b] order."""
    phi = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    prec = phi.T @ phi / sigma**2 + delta * torch.eye(phi.shape[1], dtype=x.dtype)
    return torch.linalg.solve(prec, phi.T @ y[:, 0] / sigma**2), prec


@pytest.fixture(scope="module")
def linear() -> exp.PredictiveResults:
    return exp.run(
        ["regression"], depth=0, map_epochs=1500, steps=1, gammas=(1.0,), num_samples=2,
        antithetic=True, predictive_samples=50, grid_points=(40, 10),
    )  # fmt: skip


def test_linear_gaussian_one_step_is_the_exact_posterior(linear) -> None:
    """depth 0: OGGN, LGVA (antithetic) and VOGGN (antithetic, J constant) land on the BLR
    posterior with the shared hyperparameters in one gamma = 1 step; Laplace's precision is the
    same matrix (the GGN of a linear model does not depend on theta)."""
    ds, _, y_test = exp._load("regression")
    hyper = linear.hyper["regression"]
    delta, sigma = hyper["prior_precision"], hyper["sigma_noise"]
    assert delta is not None and sigma is not None
    mean, prec = _blr(ds.x_train, ds.y_train, delta, sigma)
    posts = linear.posteriors["regression"]
    scale = prec.abs().max()
    for name in ("VOGGN", "LGVA", "OGGN"):
        assert (posts[name].mean - mean).abs().max() < 1e-8, name
        assert (posts[name].posterior_precision - prec).abs().max() < 1e-8 * scale, name
    assert (posts["Laplace-GGN"].posterior_precision - prec).abs().max() < 1e-8 * scale
    # the reported GLM NLLs are those of the BLR predictive N(phi m, phi S phi^T + sigma^2)
    cov = torch.linalg.inv(prec)
    rows = {(r["method"], r["predictive"]): r for r in linear.records}
    for x, y, key in ((ds.x_test, y_test, "nll_test"), (ds.x_val, ds.y_val[:, 0], "nll_gap")):
        phi = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
        var = (phi @ cov * phi).sum(1) + sigma**2
        expected = _gaussian_nll(y.reshape(-1), phi @ mean, var)
        for name in ("LGVA", "OGGN"):
            assert rows[(name, "glm")][key] == pytest.approx(expected, rel=1e-9), (name, key)


def test_linear_laplace_glm_mean_is_the_network_at_the_map(linear) -> None:
    """Laplace-GGN's GLM predictive mean is f(x; theta*), and theta* is the closed-form MAP
    of the hyperparameters the posterior uses (the evidence-selected pair, thesis Sec. 5.1 ->
    5.2), not of the prior 1 / noise 0.1 the selection started from; OGGN's is f(x; mu) =
    the BLR mean."""
    ds, _, _ = exp._load("regression")
    grid = linear.grids["regression"]
    la = linear.posteriors["regression"]["Laplace-GGN"]
    with torch.no_grad():
        at_map = la.model(grid)
    assert torch.allclose(linear.on_grid["regression"]["Laplace-GGN"]["glm"].mean, at_map)
    hyper = linear.hyper["regression"]
    delta, sigma = hyper["prior_precision"], hyper["sigma_noise"]
    assert delta is not None and sigma is not None
    assert float(la.prior_precision) == delta and float(la.sigma_noise) == sigma
    theta_map, _ = _blr(ds.x_train, ds.y_train, delta, sigma)
    assert (la.theta_star - theta_map).abs().max() < 1e-4
    start, _ = _blr(ds.x_train, ds.y_train, 1.0, 0.1)
    assert (la.theta_star - start).abs().max() > 1e-2  # the selection moved the MAP
    oggn = linear.posteriors["regression"]["OGGN"]
    phi = torch.cat([grid, torch.ones(len(grid), 1, dtype=grid.dtype)], dim=1)
    glm = linear.on_grid["regression"]["OGGN"]["glm"].mean[:, 0]
    assert torch.allclose(glm, phi @ oggn.mean, atol=1e-10)


@pytest.fixture(scope="module")
def mlp() -> exp.PredictiveResults:
    return exp.run(
        width=6, depth=1, map_epochs=150, steps=12, predictive_samples=40, grid_points=(30, 8)
    )


def test_mlp_glm_predictive_is_the_linearisation_at_its_point(mlp) -> None:
    """For every toy: the GLM predictive mean is the network at theta* (Laplace) or at the
    variational mean (LGVA, OGGN: the model holds mu), and the reported regression NLLs are
    those of N(f, J Sigma J^T + sigma^2) with J and Sigma formed densely here."""
    for toy in exp.TOYS:
        grid = mlp.grids[toy]
        for name in ("Laplace-GGN", "LGVA", "OGGN"):
            post = mlp.posteriors[toy][name]
            point = post.theta_star if name == "Laplace-GGN" else post.mean
            current = torch.cat([p.detach().reshape(-1) for p in post.model.parameters()])
            assert torch.equal(current, point)
            with torch.no_grad():
                f = post.model(grid)
            assert torch.allclose(mlp.on_grid[toy][name]["glm"].f_mean, f, atol=1e-12)
    ds, _, y_test = exp._load("regression")
    sigma = mlp.hyper["regression"]["sigma_noise"]
    rows = {(r["method"], r["predictive"]): r for r in mlp.records if r["toy"] == "regression"}
    for name in ("Laplace-GGN", "LGVA", "OGGN"):
        post = mlp.posteriors["regression"][name]
        jac = jacobians(post.model, ds.x_test, post.subset)[:, 0]
        var = (jac @ post.posterior_covariance * jac).sum(1) + sigma**2
        with torch.no_grad():
            f = post.model(ds.x_test)[:, 0]
        expected = _gaussian_nll(y_test[:, 0], f, var)
        assert rows[(name, "glm")]["nll_test"] == pytest.approx(expected, rel=1e-8), name


def test_mlp_records_table_and_json(mlp) -> None:
    """16 records (2 toys x 4 methods x 2 predictives); banana accuracies are those of the
    grid-free test predictive; the JSON view round-trips and the table has one line each."""
    assert len(mlp.records) == 16
    assert {(r["toy"], r["method"], r["predictive"]) for r in mlp.records} == {
        (t, m, p) for t in exp.TOYS for m in exp.METHODS for p in exp.PREDICTIVES
    }
    ds, _, y_test = exp._load("banana")
    post = mlp.posteriors["banana"]["OGGN"]
    probs = post.predict(ds.x_test, method="glm", link="probit").probs[:, 0]
    acc = float(((probs > 0.5).double() == y_test).double().mean())
    row = next(
        r
        for r in mlp.records
        if r["toy"] == "banana" and r["method"] == "OGGN" and r["predictive"] == "glm"
    )
    assert row["accuracy"] == acc
    payload = json.loads(json.dumps(mlp.to_dict()))
    assert payload["experiment"] == "ngvi_predictive" and payload["records"] == mlp.records
    assert len(mlp.table().splitlines()) == 2 + 16
    # hyperparameters are shared: every NGVI posterior uses Laplace's optimised prior
    for toy in exp.TOYS:
        delta = mlp.hyper[toy]["prior_precision"]
        for name in ("VOGGN", "LGVA", "OGGN"):
            assert float(mlp.posteriors[toy][name].prior_precision) == delta


def test_seeds_are_aggregated_as_mean_and_standard_error() -> None:
    """Records hold the mean over seeds, the standard error (ddof 1) and the per-seed values;
    each seed's values are those of a run with that seed alone, also from a worker process
    (``jobs``)."""
    kw = dict(width=3, depth=1, map_epochs=30, steps=2, predictive_samples=10, keep_grid=False)
    both = exp.run(["regression"], seeds=(0, 1), jobs=2, **kw)
    single = {s: exp.run(["regression"], seeds=(s,), **kw) for s in (0, 1)}
    for rec in both.records:
        key = (rec["method"], rec["predictive"])
        for field in ("nll_test", "nll_gap"):
            values = [
                next(r for r in single[s].records if (r["method"], r["predictive"]) == key)[field]
                for s in (0, 1)
            ]
            assert rec[field + "_seeds"] == values
            assert rec[field] == pytest.approx(sum(values) / 2, rel=1e-12)
            assert rec[field + "_se"] == pytest.approx(abs(values[0] - values[1]) / 2, rel=1e-9)
    assert both.hyper_seeds["regression"] == [single[s].hyper["regression"] for s in (0, 1)]
    assert single[0].records[0]["nll_test_se"] is None


def test_cli_writes_json_and_both_figures(tmp_path, capsys) -> None:
    out = tmp_path / "res.json"
    args = ["--toys", "banana", "--steps", "3", "--map-epochs", "20", "--width", "4"]
    args += ["--depth", "1", "--no-progress", "--output", str(out), "--figure", str(tmp_path)]
    assert get("ngvi_predictive").main(args) == 0
    assert "| banana | OGGN | GLM |" in capsys.readouterr().out
    assert json.loads(out.read_text())["config"]["steps"] == 3
    assert (tmp_path / "ngvi_banana.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "ngvi_regression.png").exists()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"toys": ["moons"]}, "toys"),
        ({"gammas": (0.0,)}, "gammas"),
        ({"steps": 0}, "steps"),
        ({"seeds": (1, 1)}, "seeds"),
        ({"seeds": ()}, "seeds"),
        ({"jobs": 0}, "jobs"),
    ],
)
def test_bad_input(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        exp.run(**kwargs)
