"""Build docs/ngvi.md's figures and results table (Immer thesis Sec. 5.2).

1. Runs the page's first ```python block exactly as written (from the repository root, with
   ``src/`` importable): a check that the example runs as-is.
2. The predictive comparison of thesis Sec. 5.2: Laplace-GGN (MAP + Laplace), VOGGN, LGVA and
   OGGN, each predicted by NN sampling and by the GLM predictive, on the 1-D regression toy
   with a gap (``valla_toy``) and on banana (binary). Writes
   ``docs/figures/ngvi_regression.png`` and ``docs/figures/ngvi_banana.png`` and rewrites the
   table between ``<!-- ngvi-table:start/end -->`` in the page.

Setup (one run, seed 0): a 2 x 20 tanh MLP (P = 481 / 501); the MAP by full-batch Adam, then
the prior precision (and for regression the noise) by the Laplace marginal likelihood
(``optimize_prior``), shared by all methods. The NGVI variants start from the same random
initialisation with Sigma_0 = 0.1 I (``init_precision=10``, as in the thesis), full structure,
full batches, S = 4 samples per step and the step size gamma decayed 0.1 -> 0.03 -> 0.01
(a third of the steps each): with few samples a constant gamma leaves the mean of the sampling
variants diffusing along directions that only the prior constrains.

Usage: ``python scripts/make_ngvi_docs.py [--no-example] [--no-experiments] [--steps 600]
[--threads 1]``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "ngvi.md"
FIGURES = ROOT / "docs" / "figures"
METHODS = ("Laplace-GGN", "VOGGN", "LGVA", "OGGN")
GAMMAS = (0.1, 0.03, 0.01)


def example_code(page: str) -> str:
    """The first ```python fenced block of the page."""
    match = re.search(r"```python\n(.*?)```", page, flags=re.DOTALL)
    if match is None:
        raise SystemExit(f"{PAGE}: no ```python block found")
    return match.group(1)


def run_example(code: str) -> float:
    """Execute the example in a fresh namespace from the repository root; return seconds."""
    cwd = Path.cwd()
    os.chdir(ROOT)
    start = time.perf_counter()
    try:
        exec(compile(code, str(PAGE), "exec"), {"__name__": "__ngvi_example__"})
    finally:
        os.chdir(cwd)
    return time.perf_counter() - start


def mlp(inputs: int, seed: int = 0) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(inputs, 20), nn.Tanh(), nn.Linear(20, 20), nn.Tanh(), nn.Linear(20, 1)
    ).double()


def fit_all(x: Any, y: Any, likelihood: str, steps: int) -> tuple[dict[str, Any], dict]:
    """The four posteriors of Sec. 5.2 on ``(x, y)``, and the hyperparameters used."""
    import gaussify as gs
    from gaussify.weight_space.ngvi import LGVA, OGGN, VOGGN

    regression = likelihood == "regression"
    model = mlp(x.shape[1])
    sigma = 0.1 if regression else 1.0
    gs.train_map(
        model, (x, y), likelihood, prior_precision=1.0, epochs=2000, lr=1e-2,
        sigma_noise=sigma, batch_size=len(y), seed=0,
    )  # fmt: skip
    la = gs.Laplace(model, likelihood, "full", prior_precision=1.0, sigma_noise=sigma)
    la.fit((x, y)).optimize_prior()
    delta, sigma = float(la.prior_precision), float(la.sigma_noise)
    posts: dict[str, Any] = {"Laplace-GGN": la}
    for cls in (VOGGN, LGVA, OGGN):
        vi = cls(
            mlp(x.shape[1]), likelihood, "full", delta, lr=GAMMAS[0], num_samples=4,
            sigma_noise=sigma, init_precision=10.0, seed=0,
        )  # fmt: skip
        for gamma in GAMMAS:
            vi.lr = gamma
            vi.fit((x, y), epochs=steps // len(GAMMAS), batch_size=len(y), monitor=False)
        posts[cls.__name__] = vi
    return posts, {"prior_precision": delta, "sigma_noise": sigma if regression else None}


def predictives(post: Any, x: Any) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    return {
        "nn": post.predict(x, method="nn", num_samples=500, generator=g),
        "glm": post.predict(x, method="glm", link="probit"),
    }


def function_samples(post: Any, x: Any, method: str, pred: Any) -> Any:
    """Three joint function samples (3, N): networks from q (NN sampling), or the linearised
    network at weights from q (GLM; the predictive itself holds only per-input marginals)."""
    import torch

    from gaussify.curvature.jacobian import jacobians

    if method == "nn":
        return pred.f_samples[:3, :, 0]
    thetas = post.sample(3, generator=torch.Generator().manual_seed(1))
    point = getattr(post, "theta_star", None)
    if point is None:  # NGVI: theta* for GLM-VI, else the mean
        point = post.theta_lin if post.theta_lin is not None else post.mean
    with torch.no_grad():
        f = post.model(x)[:, 0]
    return f + (jacobians(post.model, x, post.subset)[:, 0] @ (thetas - point).T).T


def regression(steps: int) -> list[dict[str, Any]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    import gaussify as gs

    ds = gs.data.load("valla_toy", seed=0, dtype=torch.float64)
    posts, hyper = fit_all(ds.x_train, ds.y_train, "regression", steps)
    grid = torch.linspace(-3.5, 3.5, 300, dtype=torch.float64).unsqueeze(-1)
    fig, axes = plt.subplots(2, 4, figsize=(14, 5.6), sharex=True, sharey=True)
    rows = []
    for col, name in enumerate(METHODS):
        post = posts[name]
        on_grid = predictives(post, grid)
        on_val = predictives(post, ds.x_val)
        on_test = predictives(post, ds.x_test)
        for row, method in enumerate(("nn", "glm")):
            pred = on_grid[method]
            mean, std = pred.mean[:, 0], pred.var[:, 0].sqrt()
            ax = axes[row, col]
            ax.fill_between(grid[:, 0], mean - 2 * std, mean + 2 * std, alpha=0.3, color="C0")
            ax.plot(grid[:, 0], mean, color="C0")
            samples = function_samples(post, grid, method, pred)
            ax.plot(grid[:, 0], samples.T, color="C1", lw=0.7, alpha=0.8)
            ax.scatter(ds.x_train[:, 0], ds.y_train[:, 0], s=6, color="k", zorder=3)
            ax.set_ylim(-4, 4)
            ax.set_title(f"{name}: {'NN sampling' if method == 'nn' else 'GLM'}", fontsize=9)
            rows.append(
                {
                    "data": "regression (gap / extrapolation)",
                    "method": name,
                    "predictive": method,
                    "nll_val": float(-on_val[method].log_prob(ds.y_val).mean()),
                    "nll_test": float(-on_test[method].log_prob(ds.y_test).mean()),
                }
            )
    fig.suptitle(
        f"1-D regression with a gap (prior precision {hyper['prior_precision']:.3g}, "
        f"noise {hyper['sigma_noise']:.3g}): mean, ±2 std and 3 samples",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(FIGURES / "ngvi_regression.png", dpi=110)
    plt.close(fig)
    return rows


def banana(steps: int) -> list[dict[str, Any]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    import gaussify as gs

    ds = gs.data.load("banana", seed=0, dtype=torch.float64)
    y_train = ds.y_train.to(torch.float64).unsqueeze(-1)
    posts, hyper = fit_all(ds.x_train, y_train, "binary", steps)
    lin = torch.linspace(-3.0, 3.0, 60, dtype=torch.float64)
    g1, g2 = torch.meshgrid(lin, lin, indexing="xy")
    grid = torch.stack([g1.reshape(-1), g2.reshape(-1)], dim=-1)
    fig, axes = plt.subplots(2, 4, figsize=(14, 6.6), sharex=True, sharey=True)
    rows = []
    y_test = ds.y_test.to(torch.float64)
    for col, name in enumerate(METHODS):
        post = posts[name]
        on_grid = predictives(post, grid)
        on_test = predictives(post, ds.x_test)
        for row, method in enumerate(("nn", "glm")):
            probs = on_grid[method].probs[:, 0].reshape(g1.shape)
            ax = axes[row, col]
            ax.contourf(g1, g2, probs, levels=torch.linspace(0, 1, 11).tolist(), cmap="RdBu_r")
            ax.contour(g1, g2, probs, levels=[0.5], colors="k", linewidths=0.8)
            for label, color in ((0, "C0"), (1, "C3")):
                pts = ds.x_train[ds.y_train == label]
                ax.scatter(pts[:, 0], pts[:, 1], s=5, color=color, edgecolors="w", lw=0.2)
            ax.set_title(f"{name}: {'NN sampling' if method == 'nn' else 'GLM'}", fontsize=9)
            pred = on_test[method]
            correct = (pred.probs[:, 0] > 0.5).double() == y_test
            rows.append(
                {
                    "data": "banana",
                    "method": name,
                    "predictive": method,
                    "nll_test": float(-pred.log_prob(y_test).mean()),
                    "accuracy": float(correct.double().mean()),
                }
            )
    fig.suptitle(
        f"banana (prior precision {hyper['prior_precision']:.3g}): predictive p(y = 1)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(FIGURES / "ngvi_banana.png", dpi=110)
    plt.close(fig)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| data | method | predictive | test NLL | gap NLL / accuracy |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        extra = f"{r['nll_val']:.3f}" if "nll_val" in r else f"{r['accuracy']:.3f}"
        label = "NN sampling" if r["predictive"] == "nn" else "GLM"
        lines.append(f"| {r['data']} | {r['method']} | {label} | {r['nll_test']:.3f} | {extra} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-example", action="store_true")
    parser.add_argument("--no-experiments", action="store_true")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    torch.set_num_threads(args.threads)
    page = PAGE.read_text()
    if not args.no_example:
        print(f"example ran in {run_example(example_code(page)):.1f} s")
    if args.no_experiments:
        return
    FIGURES.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    rows = regression(args.steps) + banana(args.steps)
    print(table(rows))
    print(f"experiments ran in {time.perf_counter() - start:.1f} s")
    pattern = r"(<!-- ngvi-table:start -->\n).*?(<!-- ngvi-table:end -->)"
    if re.search(pattern, page, flags=re.DOTALL) is None:
        raise SystemExit(f"{PAGE}: no <!-- ngvi-table:start/end --> markers")
    body = table(rows) + "\n"
    new = re.sub(pattern, lambda m: m.group(1) + body + m.group(2), page, flags=re.DOTALL)
    PAGE.write_text(new)


if __name__ == "__main__":
    main()
