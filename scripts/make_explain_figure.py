"""Build docs/figures/function_space_explain.png: which training digits make a test digit a 4
rather than a 9, through the GP view of a small MLP (Immer thesis Sec. 5.3, eq. 5.2).

A 64-32-10 tanh MLP is trained to the MAP on the bundled ``digits`` data (8x8 images) with
``gs.train_map`` and finished by full-batch L-BFGS, so the decomposition
f(x*) - m(x*) = sum_n k(x*, x_n) r_n is exact up to the remaining gradient. For the test 4 that
looks most like a 9 (smallest logit margin f_4 - f_9), the contribution of each training
image n to f_4 - f_9 is [k(x*, x_n) r_n]_4 - [k(x*, x_n) r_n]_9; the figure shows the training
images with the largest positive (supporting "4") and negative (supporting "9")
contributions. Runs in well under a minute on a CPU.

Usage: ``python scripts/make_explain_figure.py [--out PATH]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import gaussify as gs  # noqa: E402
from gaussify.function_space.explain import explain  # noqa: E402
from gaussify.training import log_prior  # noqa: E402

PRIOR = 5.0
A, B = 4, 9
TOP = 6


def train(x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)).double()
    gs.train_map(model, (x, y), "classification", PRIOR, epochs=60, lr=3e-3, seed=0)
    # finish at a stationary point so that eq. 5.2 holds (up to the final gradient)
    lik = gs.Categorical()
    opt = torch.optim.LBFGS(
        model.parameters(), max_iter=300, tolerance_grad=1e-9, line_search_fn="strong_wolfe"
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = -lik.log_prob(model(x), y).sum() - log_prior(model, PRIOR)
        loss.backward()
        return loss

    model.train()
    opt.step(closure)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "docs/figures/function_space_explain.png"
    )
    args = parser.parse_args()
    start = time.perf_counter()
    torch.set_num_threads(1)
    data = gs.data.load("digits", seed=0)
    x, y = data.x_train.double(), data.y_train
    xt, yt = data.x_test.double(), data.y_test
    model = train(x, y)
    with torch.no_grad():
        ft = model(xt)
    acc = float((ft.argmax(-1) == yt).double().mean())
    fours = (yt == A).nonzero()[:, 0]
    pick = int(fours[(ft[fours, A] - ft[fours, B]).argmin()])
    ex = explain(model, xt[pick : pick + 1], x, y, "classification", PRIOR, top_k=TOP)
    contrast = ex.contrast(A, B)[0]
    support = contrast.topk(TOP).indices
    oppose = (-contrast).topk(TOP).indices
    margin = float(ex.f[0, A] - ex.f[0, B])
    shift = float(contrast.sum())
    prior_part = float(ex.prior_mean[0, A] - ex.prior_mean[0, B])

    mean, std = data.x_mean, data.x_std

    def image(v: torch.Tensor) -> torch.Tensor:
        return (v.double() * std + mean).reshape(8, 8)

    fig = plt.figure(figsize=(11, 5.6))
    grid = fig.add_gridspec(3, TOP + 2, width_ratios=[1.3, 0.25] + [1] * TOP)
    ax = fig.add_subplot(grid[0:2, 0])
    ax.imshow(image(xt[pick]), cmap="gray_r")
    ax.set_title(
        f"test digit (label {int(yt[pick])})\n"
        f"p(4)={float(torch.softmax(ex.f[0], -1)[A]):.2f}, "
        f"p(9)={float(torch.softmax(ex.f[0], -1)[B]):.2f}",
        fontsize=9,
    )
    ax.axis("off")
    ax = fig.add_subplot(grid[2, 0])
    ax.plot(contrast.sort().values, lw=1.2, color="k")
    ax.axhline(0, color="0.7", lw=0.8)
    ax.set_title("sorted contributions\nto $f_4 - f_9$", fontsize=8)
    ax.tick_params(labelsize=7)
    for row, (idx, label, colour) in enumerate(
        [(support, "supports 4", "tab:blue"), (oppose, "supports 9", "tab:red")]
    ):
        for j, n in enumerate(idx.tolist()):
            ax = fig.add_subplot(grid[row, j + 2])
            ax.imshow(image(x[n]), cmap="gray_r")
            ax.set_title(
                f"y={int(y[n])}  {float(contrast[n]):+.2f}\n"
                f"sim {float(ex.similarity[0, n]):.2f}, "
                f"r$_4$-r$_9$ {float(ex.alpha[n, A] - ex.alpha[n, B]):+.2f}",
                fontsize=7,
                color=colour,
            )
            ax.axis("off")
            if j == 0:
                ax.text(
                    -0.15,
                    0.5,
                    label,
                    transform=ax.transAxes,
                    rotation=90,
                    va="center",
                    ha="right",
                    color=colour,
                    fontsize=10,
                )
    ax = fig.add_subplot(grid[2, 2:])
    ax.axis("off")
    ax.text(
        0.0,
        0.75,
        f"$f_4 - f_9$ = {margin:+.2f} = prior mean {prior_part:+.2f} + "
        f"sum of training contributions {shift:+.2f}  "
        f"(MAP gap {float(ex.gap.abs().max()):.1e})\n"
        f"MLP 64-32-10, prior precision {PRIOR:g}, {x.shape[0]} training digits, "
        f"test accuracy {acc:.3f}.\n"
        "Contribution of training digit n: $[k(x_*, x_n)\\,r_n]_4 - [k(x_*, x_n)\\,r_n]_9$ "
        "(kernel $J S_0 J^\\top$ times the residual, thesis eq. 5.2).",
        fontsize=8,
        va="top",
    )
    fig.suptitle("Which training digits make this a 4 rather than a 9? (GP view of an MLP)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110, bbox_inches="tight")
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
