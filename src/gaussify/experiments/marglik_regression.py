"""Joint selection of prior precision and noise by the Laplace-GGN evidence (Immer thesis
Sec. 5.1, Fig. 5.2).

On the thesis's 1-D regression toy with a gap (:mod:`._gap_toy`: 150 training points, noise
variance 0.09, 1000 test points), a log grid over the thesis's ranges delta in [1e-4, 1e2] and
sigma^2 in [1e-3, 1e1]: for every pair (delta, sigma^2) the MAP of a tanh MLP is trained with
that prior and noise (full-batch Adam from the same initialisation), a full-GGN Laplace
posterior is fitted at it, and the log evidence (thesis eq. 3.17-3.18) is recorded beside the
average log-likelihood of the MAP on the training and the test data (thesis eq. 5.1) and the
test NLL of the GLM predictive. The selected pair is the grid point of largest evidence; the
thesis selects delta = 0.63, sigma^2 = 0.1 (its data: noise variance 0.09).

A second check ties the grid to the library's tuner: at the MAP of the selected pair, the
evidence of that one fit over a finer grid (``fine_points`` per decade, the MAP held fixed) has
its maximum where ``Laplace.optimize_prior`` (prior and noise jointly) ends, to grid
resolution.

Departure from the thesis: a 2 x 20 tanh MLP (``depth``, ``width``) instead of 5 x 25
(P = 2676), and the toy's function is sin(4x), not Snelson's data (not bundled).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from gaussify.cli_args import nonnegative_int, positive_int
from gaussify.experiments._gap_toy import NOISE_VARIANCE, GapToy, gap_toy
from gaussify.experiments._report import progress_bar, run_main
from gaussify.experiments._runner import cli, tanh_mlp, torch_threads
from gaussify.weight_space import Laplace

__all__ = [
    "THESIS_DELTA",
    "THESIS_SIGMA2",
    "RegressionSelection",
    "evidence_grid",
    "fit_point",
    "main",
    "plot",
    "run",
    "train_maps",
]

THESIS_DELTA = 0.63  # thesis Sec. 5.1: evidence-optimal prior precision on its regression toy
THESIS_SIGMA2 = 0.1  # ... and noise variance (data generated with 0.09)


def train_maps(
    toy: GapToy, pairs: Sequence[tuple[float, float]], width: int, depth: int, epochs: int,
    lr: float, seed: int,
) -> list[dict[str, Tensor]]:  # fmt: skip
    """The MAP of every (delta, sigma^2) in ``pairs``, trained together: one stacked copy of
    ``tanh_mlp(1, 1, width, depth, seed)`` per pair (``torch.func.vmap``), full-batch Adam with
    cosine decay on the sum over pairs of each pair's
    ``sum_n (y_n - f_n)^2 / (2 sigma^2 N) + delta ||theta||^2 / (2 N)``. Adam is element-wise
    and the pairs share no parameter, so each copy follows exactly the steps of
    ``gaussify.training.train_map`` on its own (up to round-off of the summed loss); returns
    one state dict per pair."""
    base = tanh_mlp(1, 1, width, depth, seed)
    n = len(toy.y_train)
    params = {k: v.detach().unsqueeze(0).repeat(len(pairs), *[1] * v.dim()) for k, v in
              base.named_parameters()}  # fmt: skip
    for v in params.values():
        v.requires_grad_(True)
    deltas = torch.tensor([d for d, _ in pairs], dtype=torch.float64)
    prec = 1.0 / torch.tensor([s2 for _, s2 in pairs], dtype=torch.float64)

    def forward(p: dict[str, Tensor]) -> Tensor:
        return functional_call(base, p, (toy.x_train,))

    opt = torch.optim.Adam(list(params.values()), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
    for _ in range(epochs):
        opt.zero_grad(set_to_none=True)
        f = vmap(forward)(params)  # (G, N, 1)
        sq = ((f - toy.y_train) ** 2).sum(dim=(1, 2))
        norm = sum((v**2).reshape(len(pairs), -1).sum(1) for v in params.values())
        loss = (0.5 * prec * sq + 0.5 * deltas * norm).sum() / n
        if not torch.isfinite(loss):
            raise FloatingPointError("train_maps: the loss became non-finite; lower lr")
        loss.backward()
        opt.step()
        sched.step()
    return [{k: v[g].detach().clone() for k, v in params.items()} for g in range(len(pairs))]


def fit_point(
    toy: GapToy, delta: float, sigma2: float, state: dict[str, Tensor], width: int, depth: int
) -> tuple[nn.Module, Laplace]:
    """The network with the MAP weights ``state`` and the full-GGN Laplace posterior for
    prior precision ``delta`` and noise variance ``sigma2`` fitted there."""
    model = tanh_mlp(1, 1, width, depth, 0)
    model.load_state_dict(state)
    la = Laplace(model, "regression", "full", prior_precision=delta, sigma_noise=sigma2**0.5)
    return model, la.fit((toy.x_train, toy.y_train))


def _gaussian_ll(y: Tensor, mean: Tensor, var: Tensor) -> float:
    """Average log N(y | mean, var)."""
    return float((-0.5 * torch.log(2 * math.pi * var) - 0.5 * (y - mean) ** 2 / var).mean())


def evidence_grid(la: Laplace, deltas: Sequence[float], sigma2s: Sequence[float]) -> np.ndarray:
    """log p(D | delta, sigma^2) of the fitted ``la`` (its MAP and GGN held fixed) on the grid,
    shape (len(deltas), len(sigma2s))."""
    out = np.empty((len(deltas), len(sigma2s)))
    for i, d in enumerate(deltas):
        for j, s2 in enumerate(sigma2s):
            out[i, j] = float(la.log_marginal_likelihood(float(d), math.sqrt(float(s2))))
    return out


def _step(values: Sequence[float]) -> float:
    """The largest log10 ratio of neighbouring grid values (nan for one value)."""
    v = sorted(values)
    return max((math.log10(b / a) for a, b in itertools.pairwise(v)), default=math.nan)


def _log_grid(lo: float, hi: float, per_decade: int) -> list[float]:
    n = round(math.log10(hi / lo) * per_decade) + 1
    return [float(v) for v in np.logspace(math.log10(lo), math.log10(hi), n)]


@dataclass
class RegressionSelection:
    """Results of :func:`run`: ``grid`` (one row per (delta, sigma^2): log evidence, train /
    test log-likelihood of the MAP, GLM test NLL), ``summary`` (selected pairs, the thesis's,
    the fixed-MAP check against ``optimize_prior``), ``fixed_map`` (the evidence surface of
    the selected fit). Not serialised: ``fits`` ((delta, sigma^2) -> Laplace) for
    :func:`plot`."""

    config: dict[str, Any]
    grid: list[dict[str, Any]]
    summary: dict[str, Any]
    fixed_map: dict[str, Any]
    notes: list[str]
    runtime_s: float
    fits: dict[tuple[float, float], Laplace] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable view (without ``fits``)."""
        return {
            "experiment": "marglik_regression",
            "paper": "Immer thesis (001) Sec. 5.1 / Fig. 5.2: evidence over (delta, sigma^2)",
            "config": self.config,
            "runtime_s": self.runtime_s,
            "summary": self.summary,
            "notes": self.notes,
            "fixed_map": self.fixed_map,
            "grid": self.grid,
        }

    def table(self) -> str:
        """Markdown: the selected pairs (evidence, test log-likelihood, optimize_prior at the
        selected MAP, thesis)."""
        s = self.summary
        rows = [
            ("evidence (grid, MAP per point)", s["delta_by_evidence"], s["sigma2_by_evidence"]),
            ("test log-lik. of the MAP (grid)", s["delta_by_test_ll"], s["sigma2_by_test_ll"]),
            ("evidence at the selected MAP (fine grid)", s["fixed_map_grid_delta"],
             s["fixed_map_grid_sigma2"]),
            ("optimize_prior at the selected MAP", s["optimize_prior_delta"],
             s["optimize_prior_sigma2"]),
            ("thesis (Snelson with a gap, 5 x 25 MLP)", THESIS_DELTA, THESIS_SIGMA2),
        ]  # fmt: skip
        lines = ["| selected by | delta | sigma^2 |", "|---|---|---|"]
        lines += [f"| {name} | {d:.3g} | {s2:.3g} |" for name, d, s2 in rows]
        return "\n".join(lines)


def run(
    *,
    deltas: Sequence[float] | None = None,
    sigma2s: Sequence[float] | None = None,
    per_decade: int = 2,
    fine_points: int = 8,
    width: int = 20,
    depth: int = 2,
    epochs: int = 2000,
    lr: float = 1e-2,
    seed: int = 0,
    threads: int | None = 1,
    progress: bool = False,
) -> RegressionSelection:
    """The Fig. 5.2 sweep (module docstring). ``deltas`` / ``sigma2s``: the grid (default
    ``per_decade`` log-spaced points per decade over the thesis's ranges); ``fine_points``:
    points per decade of the fixed-MAP check; ``seed``: the network initialisation (the data
    are the toy's seed 0). Deterministic given the arguments."""
    if per_decade < 1 or fine_points < 1:
        raise ValueError(f"per_decade, fine_points: must be >= 1, got {per_decade}, {fine_points}")
    deltas = [float(d) for d in (deltas or _log_grid(1e-4, 1e2, per_decade))]
    sigma2s = [float(s) for s in (sigma2s or _log_grid(1e-3, 1e1, per_decade))]
    bad = [v for v in deltas + sigma2s if not (math.isfinite(v) and v > 0)]
    if bad:
        raise ValueError(f"deltas, sigma2s: must be finite and > 0, got {bad}")
    start = time.perf_counter()
    toy = gap_toy(seed=0)
    rows: list[dict[str, Any]] = []
    fits: dict[tuple[float, float], Laplace] = {}
    pairs = [(d, s2) for d in deltas for s2 in sigma2s]
    bar = progress_bar(progress, len(pairs), "evidence grid", "fit")
    with torch_threads(threads):
        states = train_maps(toy, pairs, width, depth, epochs, lr, seed)
        try:
            for (delta, sigma2), state in zip(pairs, states, strict=True):
                model, la = fit_point(toy, delta, sigma2, state, width, depth)
                with torch.no_grad():
                    f_train, f_test = model(toy.x_train), model(toy.x_test)
                var = torch.tensor(sigma2, dtype=torch.float64)
                glm = la.predict(toy.x_test, method="glm")
                rows.append({
                    "delta": delta, "sigma2": sigma2,
                    "log_evidence": float(la.log_marginal_likelihood()),
                    "train_ll_map": _gaussian_ll(toy.y_train, f_train, var),
                    "test_ll_map": _gaussian_ll(toy.y_test, f_test, var),
                    "test_nll_glm": float(-glm.log_prob(toy.y_test).mean()),
                })  # fmt: skip
                fits[(delta, sigma2)] = la
                bar.update()
        finally:
            bar.close()
        best = max(rows, key=lambda r: r["log_evidence"])
        by_test = max(rows, key=lambda r: r["test_ll_map"])
        la = fits[(best["delta"], best["sigma2"])]
        fine_d = _log_grid(1e-4, 1e2, fine_points)
        fine_s = _log_grid(1e-3, 1e1, fine_points)
        surface = evidence_grid(la, fine_d, fine_s)
        i, j = np.unravel_index(int(np.argmax(surface)), surface.shape)
        la.optimize_prior()
        opt_d, opt_s2 = float(la.prior_precision), float(la.sigma_noise) ** 2
        la.prior_precision, la.sigma_noise = best["delta"], math.sqrt(best["sigma2"])
    step = 1.0 / fine_points
    summary = {
        "delta_by_evidence": best["delta"],
        "sigma2_by_evidence": best["sigma2"],
        "delta_by_test_ll": by_test["delta"],
        "sigma2_by_test_ll": by_test["sigma2"],
        "test_ll_map_at_evidence": best["test_ll_map"],
        "test_ll_map_best": by_test["test_ll_map"],
        "evidence_vs_test_ll_decades": [
            abs(math.log10(best["delta"] / by_test["delta"])),
            abs(math.log10(best["sigma2"] / by_test["sigma2"])),
        ],
        "grid_step_decades": [_step(deltas), _step(sigma2s)],
        "test_nll_glm_at_evidence": best["test_nll_glm"],
        "noise_variance_true": NOISE_VARIANCE,
        "sigma2_by_evidence_over_true": best["sigma2"] / NOISE_VARIANCE,
        "fixed_map_grid_delta": fine_d[i],
        "fixed_map_grid_sigma2": fine_s[j],
        "optimize_prior_delta": opt_d,
        "optimize_prior_sigma2": opt_s2,
        "optimize_prior_vs_grid_decades": [
            abs(math.log10(opt_d / fine_d[i])),
            abs(math.log10(opt_s2 / fine_s[j])),
        ],
        "fine_grid_step_decades": step,
        "thesis_delta": THESIS_DELTA,
        "thesis_sigma2": THESIS_SIGMA2,
    }
    res = RegressionSelection(
        config={
            "dataset": "gap toy (experiments/_gap_toy.py, seed 0): y = sin(4x) + N(0, 0.09), "
            "150 train on [-2, 2] without (-0.5, 0.5), 1000 test on [-2, 2]",
            "network": f"{depth} x {width} tanh MLP, float64",
            "width": width,
            "depth": depth,
            "deltas": deltas,
            "sigma2s": sigma2s,
            "fine_points_per_decade": fine_points,
            "epochs": epochs,
            "lr": lr,
            "seed": seed,
            "structure": "full GGN",
            "torch": torch.__version__,
        },
        grid=rows,
        summary=summary,
        fixed_map={"deltas": fine_d, "sigma2s": fine_s, "log_evidence": surface.tolist()},
        notes=[
            "MAP retrained for every (delta, sigma^2) from the same initialisation; the "
            "fixed-MAP surface and optimize_prior use the MAP of the selected pair.",
        ],
        runtime_s=time.perf_counter() - start,
        fits=fits,
    )
    return res


def plot(res: RegressionSelection, path: str | Path) -> Path:
    """Thesis Fig. 5.2 as a PNG: top, log evidence / N, train and test log-likelihood of the
    MAP over (delta, sigma^2) with the evidence optimum (star) and the thesis's pair (x);
    bottom, the GLM predictive (mean +- 2 std) at the optimum, an overfitting (A: smallest
    delta and sigma^2) and an underfitting pair (B: largest delta, the selected sigma^2),
    refitted when ``res`` was read back from JSON (no ``fits``)."""
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    deltas, sigma2s = res.config["deltas"], res.config["sigma2s"]
    n_train = 150
    fig = Figure(figsize=(13, 7.5), layout="constrained")
    axes = fig.subplots(2, 3)
    s = res.summary
    panels = (
        ("log_evidence", "log evidence / N", n_train),
        ("train_ll_map", "train log-lik. (MAP)", 1),
        ("test_ll_map", "test log-lik. (MAP)", 1),
    )
    for ax, (key, label, scale) in zip(axes[0], panels, strict=True):
        z = np.array([[r[key] for r in res.grid if r["delta"] == d] for d in deltas]) / scale
        z = np.maximum(z, z.max() - 2.0)  # the top 2 nats per point, for a readable scale
        mesh = ax.pcolormesh(sigma2s, deltas, z, shading="nearest", cmap="viridis")
        fig.colorbar(mesh, ax=ax)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("noise variance σ²")
        ax.set_ylabel("prior precision δ")
        ax.set_title(f"{label} (clipped 2 below its max)", fontsize=10)
        ax.plot(s["sigma2_by_evidence"], s["delta_by_evidence"], "*", color="w", ms=14)
        ax.plot(THESIS_SIGMA2, THESIS_DELTA, "x", color="r", ms=9)
    toy = gap_toy(seed=0)
    xs = torch.linspace(-3.0, 3.0, 200, dtype=torch.float64).unsqueeze(-1)
    picks = (
        ("★ evidence optimum", s["delta_by_evidence"], s["sigma2_by_evidence"]),
        ("A (overfit)", deltas[0], sigma2s[0]),
        ("B (underfit)", deltas[-1], s["sigma2_by_evidence"]),
    )
    fits = dict(res.fits)
    missing = [(d, s2) for _, d, s2 in picks if (d, s2) not in fits]
    if missing:  # results read back from JSON: refit the three pairs drawn
        cfg = res.config
        args = (cfg["width"], cfg["depth"], cfg["epochs"], cfg["lr"], cfg["seed"])
        for (d, s2), state in zip(missing, train_maps(toy, missing, *args), strict=True):
            fits[(d, s2)] = fit_point(toy, d, s2, state, cfg["width"], cfg["depth"])[1]
    for ax, (name, d, s2) in zip(axes[1], picks, strict=True):
        pred = fits[(d, s2)].predict(xs, method="glm")
        mean, std = pred.mean[:, 0], pred.var[:, 0].sqrt()
        ax.fill_between(xs[:, 0], mean - 2 * std, mean + 2 * std, alpha=0.3, color="C0")
        ax.plot(xs[:, 0], mean, color="C0")
        ax.scatter(toy.x_train[:, 0], toy.y_train[:, 0], s=5, color="k", zorder=3)
        ax.set_ylim(-3, 3)
        ax.set_title(f"{name}: δ = {d:.3g}, σ² = {s2:.3g}", fontsize=10)
    fig.suptitle(
        "Laplace-GGN evidence over prior precision and noise (thesis Fig. 5.2); "
        "star: evidence optimum, x: the thesis's (δ = 0.63, σ² = 0.1)",
        fontsize=10,
    )
    fig.savefig(path, dpi=100)
    return path


def main(argv: list[str] | None = None) -> int:
    """CLI: ``gaussify experiment marglik_regression [options]``."""
    options = [
        ("--per-decade", dict(type=positive_int, default=2, help="grid points per decade (2)")),
        ("--fine-points", dict(type=positive_int, default=8, help="fixed-MAP check (8)")),
        ("--width", dict(type=positive_int, default=20)),
        ("--depth", dict(type=positive_int, default=2)),
        ("--epochs", dict(type=positive_int, default=2000, help="MAP Adam steps (2000)")),
        ("--seed", dict(type=nonnegative_int, default=0)),
        ("--threads", dict(type=positive_int, default=1)),
    ]
    description = (
        "Immer thesis Sec. 5.1 / Fig. 5.2: Laplace-GGN evidence over prior precision and "
        "noise variance on the 1-D regression toy with a gap."
    )
    return cli(
        argv, "marglik_regression", description, options, run,
        title="Thesis Fig. 5.2: (delta, sigma^2) selected", plot=plot,
        figure_help="write the Fig. 5.2 PNG",
    )  # fmt: skip


if __name__ == "__main__":
    run_main(main)
