"""Make the figures of ``docs/approx_likelihoods.md`` (Bui, Fig. 1, 4 and App. A in small).

    python scripts/make_approx_docs.py            # writes docs/figures/approx_*.png (< 1 min)
    python scripts/make_approx_docs.py --tables   # prints the docs' result tables from the JSONs

* ``approx_densities.png``: the transformed Gamma (log basis) and Beta (logit basis) densities
  with their Gaussian approximations, as in the paper's Fig. 1;
* ``approx_pseudo_targets.png``: pseudo-target mean and variance against ``alpha_eps`` per
  method, for the labelled class and the others (log basis) and for the logit basis;
* ``approx_streaming.png``: one pass over the bundled *digits* data through fixed random ReLU
  features, one point at a time: exact last layers under each approximation (Kalman updates),
  ADF and SGD with momentum; test accuracy and log-likelihood against points seen (Fig. 4).

``--tables`` prints, from ``benchmarks/results/experiments_approx_{training,streaming}.json``,
the Markdown tables of ``docs/approx_likelihoods.md`` that show those results (MNIST at each
training budget against Table 1; the streaming log-likelihood at the checkpoints), so the
page's numbers are the committed ones.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

import gaussify as gs
from gaussify.approx_likelihoods import (
    BetaGaussian,
    DirichletGaussian,
    gaussian_approx,
)
from gaussify.last_layer.adf import ADFLastLayer, SGDLastLayer
from gaussify.last_layer.exact import ExactLastLayer

ROOT = Path(__file__).resolve().parents[1]
COLOURS = {
    "moment-ori": "tab:blue",
    "moment": "tab:orange",
    "laplace": "tab:green",
    "variational": "tab:red",
    "gauss": "tab:gray",
    "adf": "tab:purple",
    "sgd+m": "tab:brown",
}
F64 = torch.float64


def _normal_log_pdf(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    return -0.5 * ((x - mean) ** 2 / var + torch.log(2 * math.pi * var))


def densities(out: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    psi = torch.linspace(-12, 4, 800, dtype=F64)
    for ax, alpha in zip(axes[:2], (0.1, 1.1), strict=True):
        a = torch.tensor(alpha, dtype=F64)
        exact = torch.distributions.Gamma(a, 1.0).log_prob(psi.exp()) + psi
        ax.plot(psi, exact.exp(), "k", lw=2.5, label="exact")
        for method in ("moment-ori", "moment", "laplace", "variational"):
            m, v = gaussian_approx("gamma", method, alpha=a)
            ax.plot(psi, _normal_log_pdf(psi, m, v).exp(), color=COLOURS[method], label=method)
        ax.set(title=f"log basis: log of Gamma({alpha}, 1)", xlabel="psi = log omega")
    psi = torch.linspace(-25, 30, 800, dtype=F64)
    a, b = torch.tensor(1.1, dtype=F64), torch.tensor(0.1, dtype=F64)
    exact = (
        torch.distributions.Beta(a, b).log_prob(torch.sigmoid(psi).clamp(1e-15, 1 - 1e-15))
        + torch.nn.functional.logsigmoid(psi)
        + torch.nn.functional.logsigmoid(-psi)
    )
    axes[2].plot(psi, exact.exp(), "k", lw=2.5, label="exact")
    for method in ("moment", "laplace", "variational"):
        m, v = gaussian_approx("beta", method, alpha=a, beta=b)
        axes[2].plot(psi, _normal_log_pdf(psi, m, v).exp(), color=COLOURS[method], label=method)
    axes[2].set(title="logit basis: logit of Beta(1.1, 0.1)", xlabel="psi = logit omega")
    axes[0].set_ylabel("density")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "approx_densities.png", dpi=110)
    plt.close(fig)


def pseudo_targets(out: Path) -> None:
    grid = torch.logspace(-3, 1, 60, dtype=F64)
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    y = torch.tensor([0])
    for method in ("moment-ori", "moment", "laplace", "variational", "gauss"):
        means, variances = [], []
        for alpha in grid.tolist():
            m, v = DirichletGaussian(method, alpha_eps=alpha).pseudo_targets(y, 2, F64)
            means.append(m[0])
            variances.append(v[0])
        m, v = torch.stack(means), torch.stack(variances)
        c = COLOURS[method]
        axes[0].plot(grid, m[:, 0], color=c, label=method)
        axes[0].plot(grid, m[:, 1], color=c, ls="--")
        axes[1].plot(grid, v[:, 0], color=c)
        axes[1].plot(grid, v[:, 1], color=c, ls="--")
        if method == "moment-ori":
            continue
        means, variances = [], []
        for alpha in grid.tolist():
            m, v = BetaGaussian(method, alpha_eps=alpha).pseudo_targets(torch.tensor([1]), 2, F64)
            means.append(m[0, 0])
            variances.append(v[0, 0])
        axes[2].plot(grid, torch.stack(means), color=c)
        axes[3].plot(grid, torch.stack(variances), color=c)
    titles = (
        "log basis: mean (solid: label, dashed: other)",
        "log basis: variance",
        "logit basis: mean for y = 1",
        "logit basis: variance",
    )
    for ax, title in zip(axes, titles, strict=True):
        ax.set(xscale="log", title=title, xlabel="alpha_eps")
    for ax in (axes[0], axes[2]):
        ax.set_yscale("symlog", linthresh=1.0)
    for ax in (axes[1], axes[3]):
        ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "approx_pseudo_targets.png", dpi=110)
    plt.close(fig)


def streaming(out: Path, num_points: int, features: int) -> dict[str, list[float]]:
    ds = gs.data.load("digits", seed=0)
    gen = torch.Generator().manual_seed(0)
    proj = torch.randn(64, features, generator=gen) / 8.0  # a random ReLU "body"
    phi_train = torch.relu(ds.x_train @ proj).double()[:num_points]
    phi_test = torch.relu(ds.x_test @ proj).double()
    y_train, y_test = ds.y_train[:num_points], ds.y_test
    checkpoints = sorted({*range(10, num_points + 1, max(num_points // 20, 1)), num_points})
    learners = {
        m: ExactLastLayer(features, 10, method=m, alpha_eps=0.05 if m == "moment-ori" else 0.1)
        for m in ("moment-ori", "moment", "laplace", "variational", "gauss")
    }
    learners["adf"] = ADFLastLayer(features, 10, num_samples=64, generator=gen)
    learners["sgd+m"] = SGDLastLayer(features, 10, lr=0.02, momentum=0.9)
    curves: dict[str, dict[str, list[float]]] = {k: {"acc": [], "ll": []} for k in learners}
    seen = 0
    for stop in checkpoints:
        for layer in learners.values():
            layer.update(phi_train[seen:stop], y_train[seen:stop])
        seen = stop
        for name, layer in learners.items():
            probs = layer.predict(phi_test).probs
            curves[name]["acc"].append(gs.metrics.accuracy(probs, y_test))
            curves[name]["ll"].append(-gs.metrics.nll(probs, y_test))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, curve in curves.items():
        axes[0].plot(checkpoints, curve["acc"], color=COLOURS[name], label=name)
        axes[1].plot(checkpoints, curve["ll"], color=COLOURS[name], label=name)
    axes[0].set(xlabel="training points seen", ylabel="test accuracy", title="digits, streaming")
    axes[1].set(xlabel="training points seen", ylabel="test log-likelihood", ylim=(-2.5, 0))
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "approx_streaming.png", dpi=110)
    plt.close(fig)
    return {k: [v["acc"][-1], v["ll"][-1]] for k, v in curves.items()}


RESULTS = ROOT / "benchmarks" / "results"
#: Bui Table 1, VGG-11 on CIFAR-10: accuracy [%] and NLL
PAPER_T1 = {
    "exact": (91.05, 0.360),
    "gauss": (88.62, 1.598),
    "moment-ori": (91.33, 0.362),
    "moment": (89.66, 0.457),
    "laplace": (89.63, 0.604),
    "variational": (91.22, 0.366),
}


def _pm(mean: float, sem: float | None, digits: int = 3) -> str:
    if sem is None or not math.isfinite(sem):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {sem:.{digits}f}"


def training_table(path: Path = RESULTS / "experiments_approx_training.json") -> str:
    """MNIST (log basis): ACC and NLL per method at every training budget in the JSON (training
    images, epochs, seeds; mean ± s.e. over seeds), beside Table 1's VGG-11 values."""
    rows = json.loads(path.read_text())["rows"]
    mnist = [r for r in rows if (r["dataset"], r["basis"]) == ("mnist", "log")]
    budgets = sorted({(r.get("num_train", 2000), r["epochs"], r["num_seeds"]) for r in mnist})
    head = "| method (α_ε) | " + " | ".join(
        f"{t} images × {e} epochs, {n} seeds: ACC | NLL" for t, e, n in budgets
    )
    lines = [
        head + " | paper VGG-11: ACC [%] / NLL |",
        "|---|" + "---|---|" * len(budgets) + "---|",
    ]
    for method in PAPER_T1:
        cells = []
        label = method
        for budget in budgets:
            r = next(
                r for r in mnist
                if r["method"] == method
                and (r.get("num_train", 2000), r["epochs"], r["num_seeds"]) == budget
            )  # fmt: skip
            label = method if r["alpha_eps"] is None else f"{method} {r['alpha_eps']}"
            cells += [_pm(r["acc_mean"], r["acc_sem"]), _pm(r["nll_mean"], r["nll_sem"])]
        acc, nll = PAPER_T1[method]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {acc:.2f} / {nll:.3f} |")
    return "\n".join(lines)


def streaming_table(
    path: Path = RESULTS / "experiments_approx_streaming.json",
    methods: tuple[str, ...] = ("variational", "moment-ori", "adf", "sgd+m"),
) -> str:
    """Mean ± s.e. test log-likelihood per data set, method and checkpoint."""
    res = json.loads(path.read_text())
    stops = res["checkpoints"]
    names = list(res["curves"])
    head = "| points seen | " + " | ".join(f"{d}: {m}" for d in names for m in methods) + " |"
    lines = [head, "|---|" + "---|" * (len(names) * len(methods))]
    for i, n in enumerate(stops):
        cells = []
        for d in names:
            best = max(methods, key=lambda m: res["curves"][d][m]["ll_mean"][i])
            for m in methods:
                c = res["curves"][d][m]
                text = _pm(c["ll_mean"][i], c["ll_sem"][i])
                cells.append(f"**{text}**" if m == best else text)
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "figures")
    parser.add_argument("--num-points", type=int, default=600)
    parser.add_argument("--features", type=int, default=100)
    parser.add_argument("--tables", action="store_true", help="print the result tables only")
    args = parser.parse_args()
    if args.tables:
        print(training_table(), streaming_table(), sep="\n\n")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    densities(args.out)
    pseudo_targets(args.out)
    final = streaming(args.out, args.num_points, args.features)
    for name, (acc, ll) in final.items():
        print(f"{name:12s} test accuracy {acc:.3f}  test log-likelihood {ll:.3f}")
    print(f"wrote {args.out}/approx_*.png in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
