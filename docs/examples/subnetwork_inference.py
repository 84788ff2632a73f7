"""Subnetwork inference: a full-covariance Laplace over a few chosen weights.

    python docs/examples/subnetwork_inference.py   # ~1 min; docs/figures/workflow_subnetwork.png

A 1-32-32-1 tanh MLP (1,153 weights) is trained on a 1-D regression toy with a gap between
two clusters of inputs (Daxberger et al. 2021, Fig. 1 style). A full Laplace-GGN over all
weights gives the reference predictive; subnetwork Laplaces keep a full covariance over n
selected weights and the MAP for the rest, with the weights chosen by the largest marginal
variance of a diagonal Laplace (the paper's rule), by the largest magnitude, or at random.
The figure shows the predictive of the all-weights and of one subnetwork posterior, and the
mean predictive standard deviation of the function over the test range (and in the gap) as
the subnetwork grows, with the same prior precision and noise (tuned on the all-weights
posterior) everywhere. Numbers go to ``docs/examples/results/subnetwork_inference.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

import gaussify as gs

ROOT = Path(__file__).resolve().parents[1]
FIGURE = ROOT / "figures" / "workflow_subnetwork.png"
RESULTS = ROOT / "examples" / "results" / "subnetwork_inference.json"
SIZES = (10, 30, 100, 300, 1000)
SHOWN = 100  # subnetwork size drawn in the left panel


def toy(gen: torch.Generator) -> tuple[Tensor, Tensor]:
    x = torch.cat(
        [torch.rand(40, 1, generator=gen) * 1.5 - 3, torch.rand(40, 1, generator=gen) * 1.5 + 1.5]
    )
    x = x.double()
    y = torch.sin(2 * x) + 0.1 * torch.randn(80, 1, generator=gen, dtype=torch.float64)
    return x, y


def trained_model(x: Tensor, y: Tensor, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    ).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3000):
        opt.zero_grad()
        loss = 0.5 * (model(x) - y).square().sum() / 0.1**2
        (loss + 0.5 * sum(p.square().sum() for p in model.parameters())).backward()
        opt.step()
    return model.eval()


def mean_std(la: gs.Laplace, grid: Tensor, gap: Tensor) -> tuple[float, float, Tensor]:
    sd = la.predict(grid).f_var[:, 0].sqrt()
    return float(sd.mean()), float(sd[gap].mean()), sd


def run(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    x, y = toy(gen)
    model = trained_model(x, y, seed)
    grid = torch.linspace(-4, 4, 200, dtype=torch.float64)[:, None]
    gap = (grid[:, 0] > -1.5) & (grid[:, 0] < 1.5)
    every = gs.Laplace(model, "regression", "full", sigma_noise=0.1).fit((x, y))
    every.optimize_prior(n_steps=200)
    prior, sigma = every.prior_precision.detach(), every.sigma_noise.detach()
    full_mean, full_gap, full_sd = mean_std(every, grid, gap)
    selections = {
        "largest variance (diag Laplace)": lambda n: gs.subnetwork.largest_variance(
            model, "regression", (x, y), n, prior_precision=prior, sigma_noise=sigma
        ),
        "largest magnitude": lambda n: gs.subnetwork.largest_magnitude(model, n),
        "random": lambda n: gs.subnetwork.random(model, n, torch.Generator().manual_seed(seed)),
    }
    curves: dict[str, dict[str, list[float]]] = {}
    shown: dict[str, Tensor] = {}
    for name, select in selections.items():
        curve: dict[str, list[float]] = {"mean_std": [], "gap_std": []}
        for n in SIZES:
            la = gs.Laplace(
                model,
                "regression",
                "full",
                subset=select(n),
                prior_precision=prior,
                sigma_noise=sigma,
            ).fit((x, y))
            m, g, sd = mean_std(la, grid, gap)
            curve["mean_std"].append(m)
            curve["gap_std"].append(g)
            if n == SHOWN:
                shown[name] = sd
        curves[name] = curve
    return {
        "x": x,
        "y": y,
        "grid": grid,
        "full_sd": full_sd,
        "shown_sd": shown,
        # the GLM mean is f(x; theta*) for every posterior here (the mean is the MAP)
        "mean": every.predict(grid).f_mean[:, 0],
        "summary": {
            "num_weights": gs.subnetwork.num_weights(model),
            "sizes": list(SIZES),
            "prior_precision": float(prior),
            "sigma_noise": float(sigma),
            "all_weights": {"mean_std": full_mean, "gap_std": full_gap},
            "subnetworks": curves,
        },
    }


def main() -> None:
    out = run()
    summary = out["summary"]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    import matplotlib.pyplot as plt

    from gaussify.plots import save_figure  # sets the headless backend

    g = out["grid"][:, 0]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    left.scatter(out["x"][:, 0], out["y"][:, 0], s=6, c="k", label="data")
    mean = out["mean"].detach()
    left.plot(g, mean, "k", lw=1)
    bands = [(out["full_sd"], f"all {summary['num_weights']} weights", "0.6")]
    bands += [
        (sd, f"{SHOWN} weights, {name}", f"C{i}")
        for i, (name, sd) in enumerate(out["shown_sd"].items())
    ]
    for sd, label, color in bands:
        left.fill_between(g, mean - 2 * sd, mean + 2 * sd, alpha=0.3, color=color, label=label)
    left.set_ylim(-3, 3)
    left.legend(fontsize=7, loc="lower left")
    left.set_title("GLM predictive ± 2 sd (function)", fontsize=9)
    for i, (name, curve) in enumerate(summary["subnetworks"].items()):
        right.plot(summary["sizes"], curve["mean_std"], "o-", color=f"C{i}", label=name)
        right.plot(summary["sizes"], curve["gap_std"], "o--", color=f"C{i}", alpha=0.6)
    right.axhline(summary["all_weights"]["mean_std"], color="k", lw=1, label="all weights")
    right.axhline(summary["all_weights"]["gap_std"], color="k", lw=1, ls="--")
    right.set_xscale("log")
    right.set_xlabel("subnetwork size n")
    right.set_ylabel("mean function sd")
    right.set_title("solid: over [-4, 4]; dashed: in the gap", fontsize=9)
    right.legend(fontsize=7)
    print(f"wrote {save_figure(fig, FIGURE, dpi=120)}")


if __name__ == "__main__":
    main()
