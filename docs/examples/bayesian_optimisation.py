"""Bayesian optimisation of a 1-D function with a Laplace surrogate and expected improvement.

    python docs/examples/bayesian_optimisation.py    # ~1 min; writes docs/figures/workflow_bo.png

Each round retrains a small MLP on the evaluations so far, fits a full Laplace posterior with
evidence-tuned prior precision and noise, and maximises expected improvement (for minimisation)

    EI(x) = (y_best - m(x)) Phi(z) + s(x) phi(z),   z = (y_best - m(x)) / s(x),

by gradient ascent in x from several starts: ``la.predict`` is differentiable in its input, so
the GLM predictive mean m(x) and standard deviation s(x) give exact EI gradients.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

import gaussify as gs

FIGURE = Path(__file__).resolve().parents[1] / "figures" / "workflow_bo.png"
LOW, HIGH = -1.0, 2.0


def objective(x: Tensor) -> Tensor:
    return torch.sin(3 * x) + x.square() - 0.7 * x


def surrogate(x: Tensor, y: Tensor, seed: int) -> gs.Laplace:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )
    model = model.double()
    gs.train_map(model, (x, y), "regression", prior_precision=1e-2, epochs=600, lr=1e-2, seed=seed)
    la = gs.Laplace(model, "regression", "full", prior_precision=1e-2, sigma_noise=0.1)
    return la.fit((x, y)).optimize_prior()


def expected_improvement(la: gs.Laplace, x: Tensor, best: float) -> Tensor:
    pred = la.predict(x)
    mean, std = pred.mean[:, 0], pred.f_var[:, 0].clamp_min(1e-12).sqrt()
    z = (best - mean) / std
    normal = torch.distributions.Normal(0.0, 1.0)
    return (best - mean) * normal.cdf(z) + std * normal.log_prob(z).exp()


def propose(la: gs.Laplace, best: float, starts: int = 8, steps: int = 60) -> Tensor:
    x = torch.linspace(LOW, HIGH, starts, dtype=torch.float64)[:, None].requires_grad_(True)
    opt = torch.optim.Adam([x], lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        (-expected_improvement(la, x, best).sum()).backward()
        opt.step()
        with torch.no_grad():
            x.clamp_(LOW, HIGH)
    with torch.no_grad():
        x = x.detach()
        return x[expected_improvement(la, x, best).argmax()][None]


def run(rounds: int = 8, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    x = LOW + (HIGH - LOW) * torch.rand(3, 1, generator=gen, dtype=torch.float64)
    y = objective(x)
    for r in range(rounds):
        la = surrogate(x, y, seed + r)
        x_next = propose(la, float(y.min()))
        x, y = torch.cat([x, x_next]), torch.cat([y, objective(x_next)])
    return {"x": x, "y": y, "laplace": surrogate(x, y, seed + rounds)}


def main() -> None:
    out = run()
    grid = torch.linspace(LOW, HIGH, 400, dtype=torch.float64)[:, None]
    true_min = float(objective(grid).min())
    best = float(out["y"].min())
    print(
        f"{len(out['y'])} evaluations: best {best:.4f}, true minimum {true_min:.4f}, "
        f"regret {best - true_min:.2e}"
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    la = out["laplace"]
    with torch.no_grad():
        pred = la.predict(grid)
        ei = expected_improvement(la, grid, best)
    mean, sd = pred.mean[:, 0], pred.f_var[:, 0].sqrt()
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(6, 4.5), sharex=True, height_ratios=[3, 1])
    g = grid[:, 0]
    ax.plot(g, objective(grid)[:, 0], "k--", lw=1, label="objective")
    ax.plot(g, mean, label="Laplace GLM mean")
    ax.fill_between(g, mean - 2 * sd, mean + 2 * sd, alpha=0.3, label="± 2 sd (epistemic)")
    ax.scatter(
        out["x"][:, 0],
        out["y"][:, 0],
        c=range(len(out["y"])),
        cmap="viridis",
        zorder=3,
        label="evaluations (colour: order)",
    )
    ax.legend(fontsize=7)
    ax2.plot(g, ei)
    ax2.set_ylabel("EI")
    ax2.set_xlabel("x")
    fig.tight_layout()
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE, dpi=120)
    print(f"wrote {FIGURE}")


if __name__ == "__main__":
    main()
