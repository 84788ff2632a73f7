"""Figures for the CLI and docs (matplotlib, headless Agg backend). Library code never plots.

matplotlib is the ``plots`` extra: without it, importing this module raises one
``ImportError`` that names the pip command.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from gaussify.extras import require

require("matplotlib", "gaussify.plots (figures)")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from gaussify.metrics import ReliabilityDiagram  # noqa: E402

__all__ = ["plot_ood_histograms", "plot_reliability", "plot_shift", "save_figure"]


def save_figure(fig: Figure, path: str | Path, dpi: int = 110, layout: bool = True) -> Path:
    """Lay out ``fig`` (``tight_layout``, unless ``layout`` is False: placed by hand), write
    it to ``path`` (creating the folder) and close it."""
    if layout:
        fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _panels(count: int, size: float = 2.6) -> tuple[Figure, list]:
    """``count`` panels in a grid of at most 3 columns, row by row."""
    cols = min(3, count)
    grid = math.ceil(count / cols)
    fig, axes = plt.subplots(grid, cols, figsize=(size * cols + 0.4, size * grid), squeeze=False)
    for k in range(count, grid * cols):
        axes[k // cols, k % cols].axis("off")
    return fig, [axes[k // cols, k % cols] for k in range(count)]


def plot_reliability(
    diagrams: dict[str, ReliabilityDiagram], path: str | Path, title: str = ""
) -> Path:
    """One panel per method: accuracy against confidence per non-empty bin (outlined bars,
    perfect calibration on the diagonal, the gap to the bin's mean confidence shaded), above
    the fraction of inputs in each bin; the panel's title gives the method and its ECE."""
    cols = min(3, len(diagrams))
    grid = math.ceil(len(diagrams) / cols)
    height = 3.3 * grid + 0.5
    fig = plt.figure(figsize=(2.7 * cols + 0.4, height))
    # per row of panels: the diagram (3), its bin fractions (1), a spacer for labels (1.1)
    spec = fig.add_gridspec(
        3 * grid - 1, cols, height_ratios=([3, 1, 1.1] * grid)[:-1], hspace=0.0, wspace=0.3
    )
    fig.subplots_adjust(left=0.08, right=0.98, top=1 - 0.55 / height, bottom=0.45 / height)
    for k, (name, d) in enumerate(diagrams.items()):
        row, col = 3 * (k // cols), k % cols
        ax = fig.add_subplot(spec[row, col])
        hist = fig.add_subplot(spec[row + 1, col], sharex=ax)
        edges = d.edges.numpy()
        seen = (d.counts > 0).numpy()
        centres = 0.5 * (edges[:-1] + edges[1:])
        width = edges[1] - edges[0]
        acc, conf = d.accuracy.numpy(), d.confidence.numpy()
        ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1)
        ax.bar(centres[seen], acc[seen], width=width, fill=False, edgecolor="C0", label="accuracy")
        ax.bar(
            centres[seen],
            conf[seen] - acc[seen],
            bottom=acc[seen],
            width=width,
            color="C3",
            alpha=0.3,
            edgecolor="none",
            label="gap to confidence",
        )
        weights = d.counts.double() / max(int(d.counts.sum()), 1)
        gaps = (d.accuracy - d.confidence).abs().nan_to_num(0.0)  # empty bins: no gap
        ece = float((weights * gaps).sum())
        ax.set_title(f"{name} (ECE {ece:.3f})", fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.tick_params(labelbottom=False, labelsize=7)
        hist.bar(centres, weights.numpy(), width=width, color="grey")
        hist.set_xlabel("confidence", fontsize=8)
        hist.tick_params(labelsize=7)
        if k % cols == 0:
            ax.set_ylabel("accuracy", fontsize=8)
            hist.set_ylabel("fraction", fontsize=8)
        if k == 0:
            ax.legend(loc="upper left", fontsize=7)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path, dpi=110, layout=False)


def plot_shift(
    rows: dict[str, Sequence[dict[str, float]]],
    strengths: Sequence[float],
    path: str | Path,
    xlabel: str = "shift strength",
    title: str = "",
) -> Path:
    """NLL and ECE (and accuracy) of each method against the shift strength: ``rows[method]``
    holds one metrics dict per entry of ``strengths`` (0 = the unshifted test set)."""
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    for name, per in rows.items():
        style = {"linestyle": "--", "color": "black"} if name.startswith("map") else {}
        for ax, key in zip(axes, ("nll", "ece", "acc"), strict=True):
            ax.plot(list(strengths), [r[key] for r in per], marker="o", label=name, **style)
    for ax, label in zip(
        axes, ("NLL (lower is better)", "ECE (lower is better)", "accuracy"), strict=True
    ):
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_title(label, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def plot_ood_histograms(
    entropies: dict[str, tuple[Tensor, Tensor]], path: str | Path, title: str = ""
) -> Path:
    """One panel per method: histograms (outlines) of the predictive entropy on the
    in-distribution test inputs and on the OOD inputs, on shared bins from 0 to log C; the
    panel's title gives the OOD AUROC (the probability that an OOD input has the higher
    entropy)."""
    from gaussify.metrics import auroc

    fig, axes = _panels(len(entropies), size=2.8)
    top = max(float(max(e_in.max(), e_out.max())) for e_in, e_out in entropies.values())
    bins = [top * i / 25 for i in range(26)] if top > 0 else 25
    for k, (name, (e_in, e_out)) in enumerate(entropies.items()):
        ax = axes[k]
        ax.hist(e_in.numpy(), bins=bins, histtype="step", linewidth=1.5, label="test (in)")
        ax.hist(e_out.numpy(), bins=bins, histtype="step", linewidth=1.5, label="OOD")
        scores = e_in.new_tensor([*e_in.tolist(), *e_out.tolist()])
        labels = scores.new_zeros(len(scores), dtype=bool)
        labels[len(e_in) :] = True
        ax.set_title(f"{name} (AUROC {auroc(scores, labels):.3f})", fontsize=9)
        ax.set_xlabel("predictive entropy", fontsize=8)
        if k == 0:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)
