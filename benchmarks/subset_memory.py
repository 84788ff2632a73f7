"""Peak memory of a Laplace fit over adapters follows the adapters, not the frozen backbone.

    python benchmarks/subset_memory.py          # ~1 min; writes results/subset_memory.json

A frozen MLP backbone ``784 -> w -> w -> 64`` (tanh) with w in {256, 1024, 2048, 4096} (0.3M to
21M frozen parameters) carries a fixed trainable part: a rank-4 LoRA adapter on a frozen
64 x 64 layer and a 64 -> 10 head (1,162 parameters), on 2,000 MNIST inputs. Each width runs in
a fresh subprocess (``GLIBC_TUNABLES`` mmap threshold 64 KiB, so the RSS high-water mark
measures live memory) and records, with the method of ``benchmarks/memory.py``: the RSS of
the built model (what the backbone costs anyway), the peak of a forward-only pass over the
data (the floor any method pays), and the peak of ``gs.Laplace(..., "full", subset="all")
.fit`` -- the curvature over exactly the parameters with ``requires_grad``. The claim: the fit's
peak above the forward floor stays flat as the backbone grows 70x (it is the P_sub^2 GGN plus
per-chunk Jacobians over P_sub, plus the backward activations of a chunk, which grow with w
only linearly), while a full GGN over all weights would need P_total^2 entries (3.6 PB at w =
4096).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import measured

import gaussify as gs
from gaussify.cli_args import add_device_argument

WIDTHS = (256, 1024, 2048, 4096)
RESULTS = Path(__file__).resolve().parent / "results" / "subset_memory.json"


class Adapter(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(0.1 * torch.randn(rank, base.in_features))
        self.b = nn.Parameter(0.1 * torch.randn(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.T) @ self.b.T


def build(width: int) -> nn.Module:
    backbone = nn.Sequential(
        nn.Linear(784, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 64)
    ).requires_grad_(False)
    return nn.Sequential(
        backbone, nn.Tanh(), Adapter(nn.Linear(64, 64)), nn.Tanh(), nn.Linear(64, 10)
    )


def worker(width: int, device: str = "cpu") -> dict[str, float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ds = gs.data.load("mnist", seed=0)
    x, y = ds.x_train[:2000].reshape(2000, -1).to(device), ds.y_train[:2000].to(device)
    model, model_bytes, _ = measured(lambda: build(width).eval().to(device))
    p_total = sum(p.numel() for p in model.parameters())
    p_sub = sum(p.numel() for p in model.parameters() if p.requires_grad)
    gs.Laplace(model, "classification", "full").fit((x[:64], y[:64]))  # warm-up

    def forward() -> None:
        with torch.no_grad():
            for xb in x.split(256):
                model(xb)

    _, floor, _ = measured(forward)
    la, fit_peak, fit_s = measured(
        lambda: gs.Laplace(model, "classification", "full", subset="all").fit((x, y))
    )
    storage = la.posterior_precision.numel() * 4
    return {
        "width": width,
        "p_total": p_total,
        "p_subset": p_sub,
        "model_mib": model_bytes / 2**20,
        "forward_floor_mib": floor / 2**20,
        "fit_peak_mib": fit_peak / 2**20,
        "fit_above_floor_mib": (fit_peak - floor) / 2**20,
        "ggn_storage_mib": storage / 2**20,
        "fit_s": fit_s,
    }


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        print("RESULT " + json.dumps(worker(int(sys.argv[2]), sys.argv[3])))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_device_argument(parser)  # memory figures are the host process's (RSS)
    args = parser.parse_args()
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}
    rows = []
    for width in WIDTHS:
        cmd = [sys.executable, __file__, "--worker", str(width), str(args.device)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
        rows.append(json.loads(out.split("RESULT ", 1)[1]))
        r = rows[-1]
        print(
            f"w={width:5d} P_total={r['p_total']:>9,d} P_sub={r['p_subset']:,d} "
            f"model {r['model_mib']:7.1f} MiB  fit above floor {r['fit_above_floor_mib']:6.1f} MiB"
            f"  (GGN {r['ggn_storage_mib']:.1f} MiB, {r['fit_s']:.2f} s)"
        )
    growth = rows[-1]["fit_above_floor_mib"] / max(rows[0]["fit_above_floor_mib"], 1e-9)
    summary = {
        "backbone_growth": rows[-1]["p_total"] / rows[0]["p_total"],
        "fit_memory_growth": growth,
    }
    RESULTS.write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
