"""Build docs/function_space.md's example figure and check its example.

1. Runs the page's first ```python block (the banana example) exactly as written, from the
   repository root with ``src/`` importable: a check that it runs as-is.
2. ``docs/figures/function_space_banana.png``: the example's posteriors on a grid. Same setup
   (banana, 2-50-2 tanh MLP, ``train_map`` 300 epochs at lr 1e-2, prior precision delta of
   ``FunctionalLaplace.optimize_prior``, ELLA on 40 k-means landmarks at that delta); the
   panels show the predictive standard deviation of the logit difference
   f_1 - f_0 = c^T f (c = (-1, 1)), i.e. sqrt(c^T Sigma(x) c) with Sigma(x) the posterior
   covariance of the outputs,

   (a) exact linearised Laplace: ``FunctionalLaplace`` (the GP with the NTK, thesis Thm 3.2);
       the weight-space ``gs.Laplace(..., "full")`` gives the same band (printed: max gap),
   (b) ELLA with M = 40 landmarks (marked),
   (c) the ratio (b) / (a), at most 1: the Nystrom kernel is below the exact one, so ELLA's
       variance never exceeds the exact GP's.

   ELLA with all N training points as landmarks is fitted too; with N C >= P it reproduces (a)
   (printed: max gap). :func:`compute` returns all four bands for the tests.

3. Rewrites the result tables between ``<!-- fs-regression-table:start/end -->`` and
   ``<!-- fs-images-table:start/end -->`` from
   ``benchmarks/results/experiments_function_space_{regression,images}.json`` (a missing file
   is skipped with a message).

The page's other figures come from elsewhere: ``function_space_toy.png`` from
``gaussify experiment function_space_toy --figure ...`` and ``function_space_explain.png`` from
``scripts/make_explain_figure.py``.

Usage: ``python scripts/make_function_space_docs.py [--no-example] [--no-figure]
[--no-tables] [--threads 1] [--out PATH]``; about half a minute on one CPU core.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "function_space.md"
FIGURE = ROOT / "docs" / "figures" / "function_space_banana.png"
RESULTS = ROOT / "benchmarks" / "results"
REGRESSION_JSON = RESULTS / "experiments_function_space_regression.json"
IMAGES_JSON = RESULTS / "experiments_function_space_images.json"
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from docs_page import example_code, replace_block, run_example  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import gaussify as gs  # noqa: E402
from gaussify.experiments.function_space_regression import LABELS  # noqa: E402
from gaussify.function_space.ella import ELLA  # noqa: E402
from gaussify.function_space.gp import FunctionalLaplace  # noqa: E402
from gaussify.plots import save_figure  # noqa: E402


@dataclass(frozen=True)
class Config:
    """The figure's setup; the defaults are the page example's (``width``, ``epochs``, ``lr``,
    ``landmarks``). ``max_train`` keeps the first rows of the training set (None: all 265)."""

    width: int = 50
    epochs: int = 300
    lr: float = 1e-2
    landmarks: int = 40
    grid: int = 80
    max_train: int | None = None
    seed: int = 0


@dataclass
class Bands:
    """Predictive standard deviations of f_1 - f_0 on the grid points ``grid (G^2, 2)`` (rows
    sweep x_1 fastest) of each posterior, and what they were fitted with."""

    axis: Tensor
    grid: Tensor
    x: Tensor
    y: Tensor
    landmarks: Tensor
    prior_precision: float
    lla: Tensor  # FunctionalLaplace
    weight_space: Tensor  # gs.Laplace(..., "full")
    ella: Tensor  # ELLA, M = config.landmarks (k-means)
    ella_all: Tensor  # ELLA, M = N
    num_params: int


def logit_difference_std(f_cov: Tensor) -> Tensor:
    """sqrt(c^T Sigma c) with c = (-1, 1): Var(f_1 - f_0) = S_00 + S_11 - 2 S_01."""
    var = f_cov[:, 0, 0] + f_cov[:, 1, 1] - 2.0 * f_cov[:, 0, 1]
    return var.clamp_min(0.0).sqrt()


def compute(cfg: Config = Config()) -> Bands:
    """Train the example's network and return the four posteriors' bands on the grid."""
    ds = gs.data.load("banana", seed=cfg.seed, dtype=torch.float64)
    x, y = ds.x_train, ds.y_train
    if cfg.max_train is not None:
        x, y = x[: cfg.max_train], y[: cfg.max_train]
    torch.manual_seed(cfg.seed)
    model = nn.Sequential(nn.Linear(2, cfg.width), nn.Tanh(), nn.Linear(cfg.width, 2)).double()
    gs.train_map(
        model, (x, y), "classification", prior_precision=1.0, epochs=cfg.epochs, lr=cfg.lr,
        seed=cfg.seed,
    )  # fmt: skip
    fl = FunctionalLaplace(model, "classification", prior_precision=1.0).fit((x, y))
    fl.optimize_prior()
    delta = fl.prior_precision.detach()
    la = gs.Laplace(model, "classification", "full", prior_precision=delta).fit((x, y))
    ella = ELLA(
        model, "classification", num_landmarks=cfg.landmarks, landmarks="kmeans",
        prior_precision=delta, seed=cfg.seed,
    ).fit((x, y))  # fmt: skip
    ella_all = ELLA(
        model, "classification", num_landmarks=x.shape[0], landmarks=x, prior_precision=delta
    ).fit((x, y))
    axis = torch.linspace(-3.0, 3.0, cfg.grid, dtype=torch.float64)
    grid = torch.cartesian_prod(axis, axis).flip(-1)
    return Bands(
        axis=axis,
        grid=grid,
        x=x,
        y=y,
        landmarks=ella.state_dict()["landmarks"],
        prior_precision=float(delta),
        lla=logit_difference_std(fl.functional_covariance(grid)),
        weight_space=logit_difference_std(la.predict(grid).f_cov),
        ella=logit_difference_std(ella.functional_covariance(grid)),
        ella_all=logit_difference_std(ella_all.functional_covariance(grid)),
        num_params=sum(p.numel() for p in model.parameters()),
    )


def plot(bands: Bands, out: Path) -> Path:
    """The three panels (exact LLA band, ELLA band, their ratio) as a PNG at ``out``."""
    g = bands.axis.shape[0]
    ratio = bands.ella / bands.lla.clamp_min(1e-300)
    panels = [
        (bands.lla, "(a) exact LLA (FunctionalLaplace)", "viridis", None),
        (bands.ella, f"(b) ELLA, M = {bands.landmarks.shape[0]} k-means", "viridis", None),
        (ratio, "(c) ratio (b) / (a)", "magma", (float(ratio.min()), 1.0)),
    ]
    vmax = float(torch.maximum(bands.lla.max(), bands.ella.max()))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharey=True)
    for ax, (value, title, cmap, lim) in zip(axes, panels, strict=True):
        lo, hi = lim or (0.0, vmax)
        im = ax.pcolormesh(
            bands.axis, bands.axis, value.reshape(g, g), cmap=cmap, vmin=lo, vmax=hi,
            shading="auto",
        )  # fmt: skip
        ax.scatter(*bands.x.T, c=bands.y, cmap="coolwarm", s=5, edgecolors="k", linewidths=0.2)
        ax.set_title(title)
        ax.set_xlabel("$x_1$")
        fig.colorbar(im, ax=ax, label="std of $f_1 - f_0$" if lim is None else "std ratio")
    axes[1].scatter(*bands.landmarks.T, marker="x", c="w", s=30, linewidths=1.2)
    axes[0].set_ylabel("$x_2$")
    n, p = bands.x.shape[0], bands.num_params
    fig.suptitle(
        f"banana (N = {n}), tanh MLP with P = {p} weights, evidence-tuned delta = "
        f"{bands.prior_precision:.3g}: predictive std of the logit difference"
    )
    return save_figure(fig, out)


def summary(bands: Bands) -> str:
    """The gaps the figure rests on, as text."""

    def rel(a: Tensor, b: Tensor) -> float:
        return float(((a - b).abs() / b.abs().clamp_min(1e-12)).max())

    n = bands.x.shape[0]
    return "\n".join(
        [
            f"N = {n}, N C = {2 * n}, P = {bands.num_params}, delta = {bands.prior_precision:.4g}",
            f"max rel. gap weight-space full Laplace vs FunctionalLaplace: "
            f"{rel(bands.weight_space, bands.lla):.2e}",
            f"max rel. gap ELLA (M = N) vs FunctionalLaplace: {rel(bands.ella_all, bands.lla):.2e}",
            f"ELLA (M = {bands.landmarks.shape[0]}) / exact std: "
            f"min {float((bands.ella / bands.lla).min()):.3f}, "
            f"max {float((bands.ella / bands.lla).max()):.4f}",
        ]
    )


def _rows(res: dict[str, Any]) -> tuple[list[str], list[str], dict[tuple[str, str], dict]]:
    """Data sets and methods in run order, and the record of each (data set, method)."""
    recs = res["records"]
    datasets = list(dict.fromkeys(r["dataset"] for r in recs))
    methods = list(dict.fromkeys(r["method"] for r in recs))
    return datasets, methods, {(r["dataset"], r["method"]): r for r in recs}


def _best(values: list[float], lower: bool = True) -> list[str]:
    """Cells with 3 decimals, the best one in bold."""
    best = min(values) if lower else max(values)
    return [f"**{v:.3f}**" if v == best else f"{v:.3f}" for v in values]


def regression_table(res: dict[str, Any]) -> str:
    """Markdown: NLL / CRPS / CQM per method (rows) and data set, best per column in bold."""
    datasets, methods, rec = _rows(res)
    keys = ("nll", "crps", "cqm")
    cols = {(d, k): _best([rec[d, m][k] for m in methods]) for d in datasets for k in keys}
    head = " | ".join(f"{d} {k.upper()}" for d in datasets for k in keys)
    lines = [f"| method | {head} | fit s |", "|---" * (len(datasets) * len(keys) + 2) + "|"]
    for i, m in enumerate(methods):
        cells = " | ".join(cols[d, k][i] for d in datasets for k in keys)
        fit = " / ".join(f"{rec[d, m]['fit_s']:.1f}" for d in datasets)
        lines.append(f"| {LABELS[m]} | {cells} | {fit} |")
    cfg = res["config"]
    lines += [
        "",
        f"{cfg['max_train']} training rows, {cfg['depth']} x {cfg['width']} tanh MLP, "
        f"{cfg['epochs']} epochs, FunctionalLaplace on {cfg['fl_subset']} points, "
        f"M = {cfg['num_inducing']}; standardised units, lower is better; runtime "
        f"{res['runtime_s']:.0f} s on one core.",
    ]
    return "\n".join(lines)


def images_table(res: dict[str, Any]) -> str:
    """Markdown: ACC / NLL / ECE / OOD-AUROC per method and data set, then the NLL on rotated
    test images per angle; best per column in bold."""
    datasets, methods, rec = _rows(res)
    keys = (("acc", False), ("nll", True), ("ece", True), ("ood_auroc", False))
    names = {"acc": "ACC", "nll": "NLL", "ece": "ECE", "ood_auroc": "OOD"}
    cols = {
        (d, k): _best([rec[d, m][k] for m in methods], lower) for d in datasets for k, lower in keys
    }
    head = " | ".join(f"{d} {names[k]}" for d in datasets for k, _ in keys)
    lines = [f"| method | {head} |", "|---" * (len(datasets) * len(keys) + 1) + "|"]
    for i, m in enumerate(methods):
        cells = " | ".join(cols[d, k][i] for d in datasets for k, _ in keys)
        lines.append(f"| {LABELS[m]} | {cells} |")
    angles = [a for a in res["config"]["angles"] if a != 0.0]
    rot = {
        (d, a): _best([rec[d, m]["rotated"][str(a)]["nll"] for m in methods])
        for d in datasets
        for a in angles
    }
    head = " | ".join(f"{d} {a:g}°" for d in datasets for a in angles)
    lines += ["", f"| NLL, rotated | {head} |", "|---" * (len(datasets) * len(angles) + 1) + "|"]
    for i, m in enumerate(methods):
        lines.append(f"| {LABELS[m]} | " + " | ".join(rot[k][i] for k in rot) + " |")
    cfg = res["config"]
    lines += [
        "",
        f"{cfg['max_train']} training / {cfg['max_test']} test images, 784-{cfg['width']}-"
        f"{cfg['width']}-10 tanh MLP, {cfg['epochs']} epochs, FunctionalLaplace on "
        f"{cfg['fl_subset']} images, ELLA M = {cfg['ella_landmarks']}, VaLLA M = "
        f"{cfg['num_inducing']}; OOD = AUROC of the predictive entropy against the other data "
        f"set's test images; runtime {res['runtime_s']:.0f} s on one core.",
    ]
    return "\n".join(lines)


def update_tables(page: str) -> str:
    """The page with both result tables rebuilt from the JSON files that exist."""
    for path, tag, table in (
        (REGRESSION_JSON, "fs-regression-table", regression_table),
        (IMAGES_JSON, "fs-images-table", images_table),
    ):
        if path.exists():
            page = replace_block(page, tag, table(json.loads(path.read_text())), PAGE)
            print(f"table {tag} updated")
        else:
            print(f"{path.relative_to(ROOT)} not found; {tag} left as is")
    return page


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--no-example", action="store_true", help="skip running the example")
    parser.add_argument("--no-figure", action="store_true", help="skip the figure")
    parser.add_argument("--no-tables", action="store_true", help="leave the tables as they are")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    parser.add_argument("--out", type=Path, default=FIGURE, help="figure path")
    args = parser.parse_args(argv)
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        if not args.no_example:
            seconds = run_example(example_code(PAGE.read_text(), PAGE), PAGE)
            print(f"example ran in {seconds:.1f} s")
        if not args.no_figure:
            start = time.perf_counter()
            bands = compute()
            print(summary(bands))
            path = plot(bands, args.out)
            print(f"wrote {path} ({time.perf_counter() - start:.1f} s)")
        if not args.no_tables:
            PAGE.write_text(update_tables(PAGE.read_text()))
    finally:
        torch.set_num_threads(before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
