"""Laplace over LoRA adapters of a tiny transformer (the backbone stays frozen).

    python docs/examples/lora_transformer.py      # ~1 min on 2 CPU cores; writes the figure

A two-layer-norm, one-head transformer is "pre-trained" on one synthetic sequence task, frozen,
given rank-2 LoRA adapters on its query and value projections and a new head, and fine-tuned
on a second task. ``gs.Laplace(..., subset="all")`` then covers exactly the parameters that
require gradients -- the adapters and the head -- so the posterior's size follows the
adapters, not the backbone. The figure compares the predictive entropy of MAP and Laplace on
held-out sequences of the task and on shifted sequences (a token distribution never seen).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor, nn

import gaussify as gs

VOCAB, SEQ, WIDTH = 16, 12, 32
FIGURE = Path(__file__).resolve().parents[1] / "figures" / "workflow_lora.png"


class LoRALinear(nn.Module):
    """``base(x) + x A^T B^T`` with the base layer frozen and B initialised at zero."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(rank))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + (x @ self.lora_a.T) @ self.lora_b.T


class TinyTransformer(nn.Module):
    """Token + position embedding, one self-attention block and an MLP block (post-norm),
    mean pooling and a linear head: ``(B, T)`` token ids to ``(B, classes)`` logits."""

    def __init__(self, classes: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(0.1 * torch.randn(SEQ, WIDTH))
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)
        )
        self.head = nn.Linear(WIDTH, classes)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids) + self.pos
        scores = self.q(h) @ self.k(h).transpose(-1, -2) / math.sqrt(WIDTH)
        h = self.norm1(h + self.o(torch.softmax(scores, dim=-1) @ self.v(h)))
        h = self.norm2(h + self.mlp(h))
        return self.head(h.mean(dim=1))


def sequences(
    n: int, task: int, gen: torch.Generator, shifted: bool = False
) -> tuple[Tensor, Tensor]:
    """Task 0: does token 3 occur? Task 1: does token 5 occur more often than token 7?
    ``shifted`` draws only tokens 5 and 7 (out of distribution)."""
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)
    if shifted:  # only the two tokens that decide the label: far more of them than in training
        ids = torch.where(torch.rand(n, SEQ, generator=gen) < 0.5, 5, 7)
    y = (ids == 3).any(dim=1) if task == 0 else (ids == 5).sum(dim=1) > (ids == 7).sum(dim=1)
    flip = torch.rand(n, generator=gen) < 0.1  # 10% label noise: the task is not separable
    return ids, (y ^ flip).long()


def train(model: nn.Module, ids: Tensor, y: Tensor, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=3e-3)
    for _ in range(steps):
        idx = torch.randint(0, len(ids), (64,), generator=gen)
        loss = nn.functional.cross_entropy(model(ids[idx]), y[idx])
        loss = loss + 0.5 / len(ids) * sum(p.square().sum() for p in params)  # prior prec. 1
        opt.zero_grad()
        loss.backward()
        opt.step()


def adapt(model: TinyTransformer, rank: int = 2) -> TinyTransformer:
    """Freeze everything, add LoRA adapters on q and v, and a fresh trainable head."""
    model.requires_grad_(False)
    model.q, model.v = LoRALinear(model.q, rank), LoRALinear(model.v, rank)
    model.head = nn.Linear(WIDTH, 2)
    return model


def build(
    n_pre: int = 2000, n: int = 300, pre_steps: int = 600, steps: int = 400, seed: int = 0
) -> dict:
    """Pre-train, adapt, fine-tune; returns the model and the task-1 data splits."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = TinyTransformer()
    train(model, *sequences(n_pre, 0, gen), pre_steps, seed)
    adapt(model)
    x, y = sequences(n, 1, gen)
    train(model, x, y, steps, seed + 1)
    x_test, y_test = sequences(1000, 1, gen)
    x_ood, _ = sequences(1000, 1, gen, shifted=True)
    return {"model": model.eval(), "train": (x, y), "test": (x_test, y_test), "ood": x_ood}


def main() -> None:
    run = build()
    model, train_data = run["model"], run["train"]
    n_adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_total = sum(p.numel() for p in model.parameters())
    la = gs.Laplace(model, "classification", "full", subset="all", prior_precision=1.0)
    la.fit(train_data).optimize_prior()
    x_test, y_test = run["test"]
    with torch.no_grad():
        p_map = torch.softmax(model(x_test), -1)
        p_map_ood = torch.softmax(model(run["ood"]), -1)
    p_la = la.predict(x_test).probs
    p_la_ood = la.predict(run["ood"]).probs
    assert p_la is not None and p_la_ood is not None
    print(
        f"posterior over {n_adapter} adapter/head parameters of {n_total}; "
        f"evidence-tuned prior precision {float(la.prior_precision):.3g}"
    )
    for name, p, q in (("MAP", p_map, p_map_ood), ("Laplace", p_la, p_la_ood)):
        m = gs.metrics.classification_metrics(p, y_test)
        auroc = gs.metrics.ood_auroc(p, q)
        print(
            f"{name:8s} acc {m['acc']:.3f} nll {m['nll']:.3f} ece {m['ece']:.3f} "
            f"OOD-AUROC {auroc:.3f}"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3), sharey=True)
    bins = torch.linspace(0, math.log(2), 30).numpy()
    for ax, (name, p, q) in zip(
        axes, (("MAP", p_map, p_map_ood), ("LoRA Laplace", p_la, p_la_ood)), strict=True
    ):
        ax.hist(gs.metrics.predictive_entropy(p).numpy(), bins, alpha=0.6, label="task 2 test")
        ax.hist(gs.metrics.predictive_entropy(q).numpy(), bins, alpha=0.6, label="shifted")
        ax.set_title(name)
        ax.set_xlabel("predictive entropy")
    axes[0].legend()
    fig.tight_layout()
    FIGURE.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURE, dpi=120)
    print(f"wrote {FIGURE}")


if __name__ == "__main__":
    main()
