"""KFAC fit time over a whole transformer, against one gradient epoch and the diagonal GGN.

    python benchmarks/transformer_kron.py [--threads 1] [--repeats 3]

The tiny transformer classifier of issue 22 (``nn.Embedding`` -> ``nn.TransformerEncoderLayer``
in eval mode -> mean pool -> ``nn.Linear``; vocabulary 20, width 16, 2 heads, feed-forward 48,
2 classes: P = 3,106) on 1024 random token sequences of length 16, batch size 128, float32.
Timed side by side in one process, interleaved, median of ``--repeats``:

* ``epoch``: one gradient epoch (forward, cross-entropy, backward, Adam step per batch);
* ``kron``: ``Laplace(structure="kron", subset="all").fit`` over the same batches (KFAC blocks
  for the embedding (diagonal A), the attention's q/k/v projections and out_proj, the
  feed-forward and the head; exact blocks for the two LayerNorms);
* ``diag``: ``Laplace(structure="diag", subset="all").fit``.

One untimed warm-up of each comes first (the exact blocks' first vmap'd Jacobian pays a
one-time functorch set-up). Also recorded: the numbers each curvature stores. Writes
``benchmarks/results/transformer_kron.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import gaussify as gs
from gaussify.cli_args import add_device_argument, synchronize

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "transformer_kron.json"


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 20, dim: int = 16, classes: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.enc = nn.TransformerEncoderLayer(dim, 2, 48, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)).mean(1))


def epoch(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for start in range(0, len(y), batch):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(
            model(x[start : start + batch]), y[start : start + batch]
        )
        loss.backward()
        opt.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    add_device_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 20, (1024, 16), generator=gen)
    y = (x < 10).sum(1).gt(8).long()
    x, y = x.to(args.device), y.to(args.device)
    batch = 128
    model = TinyTransformer().to(args.device)
    num_params = sum(p.numel() for p in model.parameters())
    trained = TinyTransformer().to(args.device)
    trained.load_state_dict(model.state_dict())

    def run(key: str) -> tuple[float, int]:
        t0 = time.perf_counter()
        stored = 0
        if key == "epoch":
            trained.train()
            epoch(trained, x, y, batch)
        else:
            model.eval()
            la = gs.Laplace(model, "classification", key, "all").fit((x, y), batch_size=batch)
            stored = sum(t.numel() for t in la.state_dict()["curvature"].values())
        synchronize(args.device)
        return time.perf_counter() - t0, stored

    keys = ["epoch", "kron", "diag"]
    for key in keys:  # warm-up
        run(key)
    samples: dict[str, list[float]] = {k: [] for k in keys}
    stored: dict[str, int] = {}
    for _ in range(args.repeats):
        for key in keys:
            sec, stored[key] = run(key)
            samples[key].append(sec)
    med = {k: statistics.median(v) for k, v in samples.items()}
    result = {
        "benchmark": "transformer_kron",
        "model": "Embedding(20, 16) -> TransformerEncoderLayer(16, 2 heads, ff 48, eval) -> "
        "mean pool -> Linear(16, 2), float32",
        "num_params": num_params,
        "num_data": len(y),
        "batch_size": batch,
        "threads": args.threads,
        "device": str(args.device),
        "load": Path("/proc/loadavg").read_text().split()[:3],
        "torch": torch.__version__,
        "repeats": args.repeats,
        "seconds": med,
        "samples": samples,
        "kron_over_epoch": med["kron"] / med["epoch"],
        "diag_over_epoch": med["diag"] / med["epoch"],
        "stored_numbers": {k: v for k, v in stored.items() if k != "epoch"},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"P = {num_params}, N = {len(y)}, batch {batch}, {args.threads} thread(s)")
    for key in keys:
        print(f"{key}: {med[key]:.3f} s")
    print(f"kron / epoch: {result['kron_over_epoch']:.1f}x")
    print(f"diag / epoch: {result['diag_over_epoch']:.1f}x")


if __name__ == "__main__":
    main()
