"""Paper-reproduction experiments: the quick versions run and their outputs are consistent.

* uci_classification (Immer, Korzepa & Bauer 2021, Table 1): the selected delta is the
  validation-NLL argmin, every reported NLL equals -mean log p(y) recomputed from the returned
  predictions, the summary equals the mean over splits, and the GLM predictive beats NN
  sampling from the same Laplace posterior (the paper's core claim) on average.
* marglik_selection (Immer thesis Sec. 5.1): the evidence equals both
  ``Laplace.log_marginal_likelihood`` on the returned model and an independent dense
  computation (explicit Jacobians, thesis Thm 3.3 with the non-MAP correction).
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from torch.func import functional_call, jacrev

import gaussify as gs
from gaussify.experiments import EXPERIMENTS, get, marglik_selection, uci_classification
from gaussify.experiments.uci_classification import METHODS, PAPER_TABLE1


@pytest.fixture(scope="module")
def uci() -> uci_classification.UCIResults:
    return uci_classification.run(quick=True, keep_predictions=True)


@pytest.fixture(scope="module")
def marglik() -> marglik_selection.MarglikResults:
    return marglik_selection.run(quick=True, keep_models=True)


# ---------------------------------------------------------------------------- UCI (Table 1)


def test_uci_quick_shape(uci: uci_classification.UCIResults) -> None:
    cfg = uci.config
    assert cfg["splits"] == [0, 1] and cfg["grid_size"] == 3
    assert cfg["datasets"] == list(uci_classification.QUICK_DATASETS)
    methods = {r["method"] for r in uci.records}
    refined = hasattr(gs.Laplace, "refine")
    expected = {m for m in METHODS if m != "glm_vi" and (refined or m != "glm_refine")}
    assert methods == expected == set(cfg["methods"]) - ({"glm_refine"} - set(methods))
    n = len(cfg["datasets"]) * len(cfg["splits"]) * cfg["grid_size"] * len(methods)
    assert len(uci.records) == n
    assert len(uci.rows) == len(cfg["datasets"]) * len(METHODS)
    for row in uci.rows:
        assert row["missing"] == (row["method"] not in methods)
    if not refined:
        assert uci_classification.REFINE_MISSING_NOTE in uci.notes


def test_uci_selected_delta_is_validation_argmin(uci: uci_classification.UCIResults) -> None:
    for sel in uci.selections:
        group = [
            r
            for r in uci.records
            if (r["dataset"], r["split"], r["method"])
            == (sel["dataset"], sel["split"], sel["method"])
        ]
        assert len(group) == uci.config["grid_size"]
        best = min(r["val_nll"] for r in group)
        assert sel["val_nll"] == best
        chosen = next(r for r in group if r["delta"] == sel["delta"])
        assert chosen["val_nll"] == best and chosen["test_nll"] == sel["test_nll"]


def test_uci_grid_is_paper_grid(uci: uci_classification.UCIResults) -> None:
    assert uci_classification.prior_grid("glass") == pytest.approx(np.logspace(-2, 2, 10))
    assert uci_classification.prior_grid("digits") == pytest.approx(np.logspace(-1, 2, 10))
    deltas = sorted({r["delta"] for r in uci.records if r["dataset"] == "glass"})
    assert deltas == pytest.approx([0.01, 1.0, 100.0])


def test_uci_nll_recomputed_from_predictions(uci: uci_classification.UCIResults) -> None:
    for name in uci.config["datasets"]:
        for split in uci.config["splits"]:
            y = gs.data.load(name, seed=split).y_test
            for r in (r for r in uci.records if (r["dataset"], r["split"]) == (name, split)):
                probs = uci.predictions[(name, split, r["delta"], r["method"])]
                assert probs.shape == (len(y), gs.data.info(name).num_classes)
                torch.testing.assert_close(probs.sum(-1), torch.ones(len(y)))
                log_p = probs.double().gather(1, y[:, None]).log().squeeze(1)
                assert r["test_nll"] == pytest.approx(float(-log_p.mean()), rel=1e-6)
                acc = float((probs.argmax(-1) == y).double().mean())
                assert r["test_acc"] == pytest.approx(acc)


def test_uci_summary_is_mean_and_standard_error(uci: uci_classification.UCIResults) -> None:
    for row in uci.rows:
        if row["missing"]:
            continue
        sel = sorted(
            (
                s
                for s in uci.selections
                if (s["dataset"], s["method"]) == (row["dataset"], row["method"])
            ),
            key=lambda s: s["split"],
        )
        values = np.array([s["test_nll"] for s in sel])
        assert row["test_nll_per_split"] == list(values)
        assert row["test_nll_mean"] == pytest.approx(values.mean())
        assert row["test_nll_se"] == pytest.approx(values.std(ddof=1) / math.sqrt(len(values)))
        paper = PAPER_TABLE1[row["dataset"]].get(row["method"])
        assert row["paper_nll"] == (list(paper) if paper else None)


def test_uci_glm_beats_nn_sampling(uci: uci_classification.UCIResults) -> None:
    """Immer et al. (2021): with the same GGN Laplace posterior, the GLM predictive has a lower
    test NLL than NN sampling (here on average over data sets and splits)."""

    def mean_nll(method: str) -> float:
        return float(np.mean([s["test_nll"] for s in uci.selections if s["method"] == method]))

    assert mean_nll("glm_laplace") < mean_nll("bnn_laplace")


def test_paper_table_transcription() -> None:
    assert set(PAPER_TABLE1) == set(uci_classification.DATASETS)
    for row in PAPER_TABLE1.values():
        assert len(row) == 7
        assert {"map", "bnn_laplace", "glm_refine"} <= set(row)
    # Spot checks against the paper's Table 1.
    assert PAPER_TABLE1["digits"]["map"] == (0.086, 0.003)
    assert PAPER_TABLE1["glass"]["bnn_laplace"] == (1.25, 0.00)
    assert PAPER_TABLE1["satellite"]["glm_refine"] == (0.240, 0.001)


def test_uci_main_is_deterministic(tmp_path: pytest.TempPathFactory) -> None:
    args = ["--datasets", "glass", "--splits", "1", "--grid-size", "2", "--epochs", "50"]
    args += ["--num-samples", "20", "--no-progress", "--methods", "glm_laplace", "glm_vi_diag"]
    outputs = []
    for k in range(2):
        path = tmp_path / f"uci{k}.json"  # type: ignore[operator]
        assert uci_classification.main([*args, "--output", str(path)]) == 0
        outputs.append(json.loads(path.read_text()))
    assert outputs[0]["records"] == outputs[1]["records"]
    assert outputs[0]["experiment"] == "uci_classification"


def test_uci_glm_vi_merge_and_map_cache(tmp_path: pytest.TempPathFactory) -> None:
    """GLM VI with zero steps is GLM Laplace (q_0 = the Laplace posterior at theta*, same
    predictive draws); with steps it moves away. A second run with the MAP cache reproduces
    the MAP bit for bit, and merging adds its methods and re-selects delta per method."""
    cache = tmp_path / "maps"  # type: ignore[operator]
    opts = {"datasets": ["glass"], "splits": [0], "grid_size": 2, "epochs": 60}
    opts |= {"num_samples": 50, "map_cache": cache}
    base = uci_classification.run(methods=["map", "glm_laplace"], **opts).to_dict()
    assert len(list(cache.iterdir())) == 2
    zero = uci_classification.run(methods=["glm_vi", "glm_vi_diag"], vi_steps=0, **opts)
    lap = {r["delta"]: r["test_nll"] for r in base["records"] if r["method"] == "glm_laplace"}
    for r in zero.records:
        if r["method"] == "glm_vi":
            assert r["test_nll"] == pytest.approx(lap[r["delta"]], rel=1e-5)
    vi = uci_classification.run(methods=["glm_vi", "glm_vi_diag"], vi_steps=3, **opts)
    merged = uci_classification.merge(base, vi)
    assert merged["config"]["merged"]["map_test_nll_diff"] == 0.0
    assert set(merged["config"]["methods"]) == {"map", "glm_laplace", "glm_vi", "glm_vi_diag"}
    assert len(merged["records"]) == 2 * 4
    vi_nll = {r["delta"]: r["test_nll"] for r in vi.records if r["method"] == "glm_vi"}
    assert any(abs(vi_nll[d] - lap[d]) > 1e-4 for d in lap)
    for sel in merged["selections"]:
        group = [
            r
            for r in merged["records"]
            if (r["dataset"], r["split"], r["method"]) == (sel["dataset"], 0, sel["method"])
        ]
        assert sel["val_nll"] == min(r["val_nll"] for r in group)
    rows = {r["method"]: r for r in merged["rows"]}
    assert rows["glm_vi"]["num_splits"] == 1 and rows["glm_vi"]["paper_nll"] == [0.75, 0.02]
    assert rows["bnn_laplace"]["missing"]


def test_uci_glm_vi_step_size_per_structure() -> None:
    """``vi_lr_diag`` is the diagonal GLM VI's gamma (App. B.3: 1e-3 full, 1e-2 diagonal) and
    leaves the full structure at ``vi_lr``: each predictive equals the one of a config whose
    single ``vi_lr`` is that structure's gamma, and differs from the other gamma's."""
    from gaussify.experiments.uci_methods import glm_vi_probs, mlp

    torch.manual_seed(0)
    x = torch.randn(40, 3)
    y = (x[:, 0] + 0.3 * torch.randn(40) > 0).long()
    model = mlp(3, 2, 6)

    def probs(structure: str, lr: float, lr_diag: float | None) -> torch.Tensor:
        cfg = uci_classification.Config(
            ["glass"], [0], 2, 10, 1e-2, 30, vi_steps=3, vi_lr=lr, vi_samples=1,
            vi_lr_diag=lr_diag,
        )  # fmt: skip
        return glm_vi_probs(copy.deepcopy(model), structure, 0.5, (x, y), x[:10], cfg, 7)

    assert torch.equal(probs("diag", 0.2, 0.05), probs("diag", 0.05, None))
    assert torch.equal(probs("full", 0.2, 0.05), probs("full", 0.2, None))
    assert (probs("diag", 0.2, 0.05) - probs("diag", 0.2, None)).abs().max() > 1e-4


def test_uci_cli_passes_the_glm_vi_and_thread_options(monkeypatch) -> None:
    """``--vi-lr``, ``--vi-lr-diag``, ``--vi-samples`` and ``--threads`` reach ``run``."""
    seen: dict = {}

    class Stop(Exception):
        pass

    def fake_run(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(uci_classification, "run", fake_run)
    args = ["--datasets", "glass", "--vi-lr", "1e-3", "--vi-lr-diag", "1e-2"]
    args += ["--vi-samples", "1", "--threads", "3", "--no-progress"]
    with pytest.raises(Stop):
        uci_classification.main(args)
    assert (seen["vi_lr"], seen["vi_lr_diag"], seen["vi_samples"]) == (1e-3, 1e-2, 1)
    assert seen["num_threads"] == 3


def test_uci_cli_merge_prints_the_merged_table(tmp_path, capsys) -> None:
    """``--merge``: the written file is ``merge(base, run)`` and the printed merged table has
    the base's columns beside the new ones (the run's own table has only MAP and GLM VI)."""
    opts = {"datasets": ["glass"], "splits": [0], "grid_size": 2, "epochs": 40}
    base = uci_classification.run(methods=["map", "glm_laplace"], num_samples=20, **opts)
    base_path, out = tmp_path / "base.json", tmp_path / "out.json"
    base_path.write_text(json.dumps(base.to_dict()))
    args = ["--datasets", "glass", "--split-seeds", "0", "--grid-size", "2", "--epochs", "40"]
    args += ["--num-samples", "20", "--methods", "glm_vi_diag", "--vi-steps", "2"]
    args += ["--no-progress", "--merge", str(base_path), "--output", str(out)]
    assert uci_classification.main(args) == 0
    printed = capsys.readouterr().out.split("Merged into")[1]
    assert "| dataset | NN MAP | GLM Laplace | GLM VI diag |" in printed
    merged = json.loads(out.read_text())
    assert uci_classification.UCIResults.from_dict(merged).table() in printed
    assert merged["config"]["merged"]["map_test_nll_diff"] == 0.0
    assert {r["method"] for r in merged["rows"] if not r["missing"]} == {
        "map", "glm_laplace", "glm_vi_diag"
    }  # fmt: skip


def test_uci_rejects_unknown_dataset() -> None:
    with pytest.raises(ValueError, match="datasets"):
        uci_classification.run(datasets=["no_such_data"])
    with pytest.raises(ValueError, match="methods"):
        uci_classification.run(datasets=["glass"], methods=["glm_ep"])


# ---------------------------------------------------------------- marglik (thesis Sec. 5.1)


def _dense_log_evidence(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, delta: float):
    """Laplace-GGN log evidence with the non-MAP correction (thesis Thm 3.3, eq. 3.18),
    computed from scratch: explicit Jacobian (N, P), dense A = J^T Lambda J + delta I."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def logits(flat: torch.Tensor) -> torch.Tensor:
        params, i = {}, 0
        for name, shape in zip(names, shapes, strict=True):
            k = math.prod(shape)
            params[name] = flat[i : i + k].reshape(shape)
            i += k
        return functional_call(model, params, (x,)).squeeze(-1)

    jac = jacrev(logits)(theta)
    f = logits(theta).detach()
    p = torch.sigmoid(f)
    ggn = jac.T @ ((p * (1 - p))[:, None] * jac)
    precision = ggn + delta * torch.eye(len(theta), dtype=theta.dtype)
    log_lik = (
        y * torch.nn.functional.logsigmoid(f) + (1 - y) * torch.nn.functional.logsigmoid(-f)
    ).sum()
    b = jac.T @ (y - p) - delta * theta
    return (
        log_lik
        - 0.5 * delta * theta @ theta
        + 0.5 * len(theta) * math.log(delta)
        - 0.5 * torch.linalg.slogdet(precision)[1]
        + 0.5 * b @ torch.linalg.solve(precision, b)
    )


def test_marglik_evidence_recomputed_independently(
    marglik: marglik_selection.MarglikResults,
) -> None:
    ds = gs.data.load("two_moons", seed=0, split=(0.15, 0.0, 0.85), dtype=torch.float64)
    x, y = ds.x_train, ds.y_train.double()
    assert len(y) == 150
    for row in marglik.delta_sweep[:2]:
        model = marglik_selection.mlp(row["width"], row["depth"])
        model.load_state_dict(marglik.models[(row["depth"], row["width"], row["delta"])])
        la = gs.Laplace(model, "binary", structure="full", prior_precision=row["delta"])
        la.fit((x, y))
        lib = float(la.log_marginal_likelihood())
        dense = float(_dense_log_evidence(model, x, y, row["delta"]))
        assert row["log_evidence"] == pytest.approx(lib, rel=1e-8, abs=1e-8)
        assert row["log_evidence"] == pytest.approx(dense, rel=1e-6, abs=1e-6)
        assert row["log_evidence_per_datum"] == pytest.approx(row["log_evidence"] / 150)


def test_marglik_selection_is_evidence_argmax(
    marglik: marglik_selection.MarglikResults,
) -> None:
    s = marglik.summary
    best = max(marglik.delta_sweep, key=lambda r: r["log_evidence"])
    assert s["delta_by_evidence"] == best["delta"]
    assert (
        s["delta_by_test_nll_map"]
        == min(marglik.delta_sweep, key=lambda r: r["test_nll_map"])["delta"]
    )
    for row in marglik.width_sweep:
        grid = [r for r in marglik.width_grid if r["width"] == row["width"]]
        assert row["log_evidence"] == max(r["log_evidence"] for r in grid)
        assert row["best_test_nll_map_over_delta"] == min(r["test_nll_map"] for r in grid)
    # The evidence is a proper log density of 150 binary labels: below 0, above 150 log(1/2)
    # for any sensible model, and the strongest prior loses to the evidence optimum.
    assert all(r["log_evidence"] < 0 for r in marglik.delta_sweep)
    assert best["log_evidence"] > 150 * math.log(0.5)


def test_marglik_figure_and_cli(tmp_path: pytest.TempPathFactory) -> None:
    fig = tmp_path / "m.png"  # type: ignore[operator]
    out = tmp_path / "m.json"  # type: ignore[operator]
    args = ["--quick", "--epochs", "100", "--no-progress", "--figure", str(fig)]
    assert marglik_selection.main([*args, "--output", str(out)]) == 0
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(out.read_text())
    assert data["experiment"] == "marglik_selection"
    assert len(data["delta_sweep"]) == 3 and len(data["width_sweep"]) == 2


def test_experiment_registry() -> None:
    assert {"uci_classification", "marglik_selection"} <= set(EXPERIMENTS)
    for name in EXPERIMENTS:
        module = get(name)
        assert callable(module.run) and callable(module.main)
    with pytest.raises(ValueError, match="unknown experiment"):
        get("table_99")


@pytest.mark.slow
def test_uci_australian_three_splits_glm_refine_beats_bnn() -> None:
    res = uci_classification.run(datasets=["australian"], splits=3)
    rows = {r["method"]: r for r in res.rows}
    assert rows["glm_laplace"]["test_nll_mean"] < rows["bnn_laplace"]["test_nll_mean"]
    if not rows["glm_refine"]["missing"]:
        assert rows["glm_refine"]["test_nll_mean"] < rows["bnn_laplace"]["test_nll_mean"]


def test_uci_bbb_alone_trains_no_map_and_merges(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run of only ``bbb`` trains no MAP (it needs none): its records carry no MAP
    diagnostics, the MAP column is missing, and merging it into a run with a MAP adds the
    BBB column with the paper's value beside it (no MAP to compare: diff None)."""
    opts = {"datasets": ["glass"], "splits": [0], "grid_size": 2, "epochs": 20}
    opts |= {"num_samples": 20, "bbb_epochs": 5}
    base = uci_classification.run(methods=["map"], **opts).to_dict()
    monkeypatch.setattr(uci_classification, "train_map", lambda *a, **k: pytest.fail("trained"))
    bbb = uci_classification.run(methods=["bbb"], **opts)
    assert bbb.config["methods"] == ["bbb"]
    assert {r["method"] for r in bbb.records} == {"bbb"} and len(bbb.records) == 2
    assert all(r["map_train_loss"] is None for r in bbb.records)
    rows = {r["method"]: r for r in bbb.rows}
    assert rows["map"]["missing"] and not rows["bbb"]["missing"]
    merged = uci_classification.merge(base, bbb)
    assert merged["config"]["merged"]["map_test_nll_diff"] is None
    rows = {r["method"]: r for r in merged["rows"]}
    assert rows["bbb"]["paper_nll"] == [0.90, 0.06] and rows["bbb"]["num_splits"] == 1
    assert rows["map"]["num_splits"] == 1


def test_uci_glm_laplace_diag_is_the_refined_diagonal_laplace(
    tmp_path: pytest.TempPathFactory,
) -> None:
    """The ``glm_laplace_diag`` column is the GLM predictive of Laplace(structure="diag") at
    the run's MAP after Laplace.refine (same predictive draws): recomputed here from the
    cached MAP weights, its test NLL matches the record to round-off."""
    import torch

    from gaussify import data as gdata
    from gaussify import metrics
    from gaussify.weight_space import Laplace

    cache = tmp_path / "maps"  # type: ignore[operator]
    opts = {"datasets": ["glass"], "splits": [0], "grid_size": 2, "epochs": 20}
    res = uci_classification.run(
        methods=["glm_laplace_diag"], num_samples=30, map_cache=cache, **opts
    )
    ds = gdata.load("glass", seed=0)
    for k, delta in enumerate(uci_classification.prior_grid("glass", 2)):
        model = uci_classification.mlp(ds.x_train.shape[1], int(ds.num_classes or 0))
        key = f"glass_s0_d{delta:.8g}_e20_lr0.01_w50.pt"
        model.load_state_dict(torch.load(cache / key, weights_only=True)["state"])
        la = Laplace(model, "classification", structure="diag", prior_precision=delta)
        la.fit((ds.x_train, ds.y_train))
        la.refine((ds.x_train, ds.y_train), **uci_classification.DEFAULT_REFINE)
        pred = la.predict(
            torch.cat([ds.x_val, ds.x_test]),
            method="glm",
            link="mc",
            num_samples=30,
            generator=torch.Generator().manual_seed(k),
        )
        nll = metrics.nll(pred.probs[len(ds.y_val) :], ds.y_test)
        rec = next(
            r for r in res.records if r["delta"] == delta and r["method"] == "glm_laplace_diag"
        )
        assert rec["test_nll"] == pytest.approx(nll, rel=1e-6)
