"""Figures for the CLI and docs (matplotlib, headless Agg backend). Library code never plots."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from gaussify.metrics import ReliabilityDiagram

__all__ = ["plot_reliability", "save_figure"]


def save_figure(fig: Figure, path: str | Path, dpi: int = 110) -> Path:
    """Lay out ``fig``, write it to ``path`` (creating the folder) and close it."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_reliability(
    diagrams: dict[str, ReliabilityDiagram], path: str | Path, title: str = ""
) -> Path:
    """Draw one reliability curve per method (confidence vs accuracy per non-empty bin)
    beside the diagonal of perfect calibration, with a bin-count histogram below."""
    fig, (ax, hist) = plt.subplots(
        2, 1, figsize=(4.5, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="calibrated")
    for name, d in diagrams.items():
        seen = d.counts > 0
        ax.plot(d.confidence[seen].numpy(), d.accuracy[seen].numpy(), marker="o", label=name)
        centres = 0.5 * (d.edges[:-1] + d.edges[1:])
        width = float(d.edges[1] - d.edges[0])
        hist.bar(centres.numpy(), d.counts.numpy(), width=width, alpha=0.4, label=name)
    ax.set_ylabel("accuracy")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title)
    hist.set_xlabel("confidence")
    hist.set_ylabel("count")
    return save_figure(fig, path, dpi=120)
