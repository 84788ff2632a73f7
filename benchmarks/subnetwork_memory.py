"""Peak memory of a subnetwork Laplace fit follows the support tensors, never N x C x P_all.

    python benchmarks/subnetwork_memory.py     # ~2 min; writes results/subnetwork_memory.json

A float32 MLP ``784 -> w -> w -> 10`` (tanh) with w in {256, 1024, 2048} (0.27 M to 5.8 M
weights) and a subnetwork of 1,000 weights, ``gs.Laplace(..., "full", subset=indices).fit`` on
N = 256 random inputs with 10-class labels, chosen two ways:

* ``magnitude``: the 1,000 largest-magnitude weights (``gs.subnetwork.largest_magnitude``),
  whose support (the tensors that contain selected weights, whose per-sample Jacobians are
  formed and gathered; ``support_names`` in the JSON) holds 68 K to 1.6 M weights;
* ``last``: 1,000 random weights of the output layer's weight (support 10 w).

Each case runs in a fresh subprocess (``GLIBC_TUNABLES`` mmap threshold 64 KiB so the RSS
high-water mark measures live memory; the method of ``benchmarks/memory.py``) and records the
fit's peak above a forward pass over the same data, next to the sizes it is compared with:
the (1000 x 1000) GGN, one sample's Jacobian over the support (C x P_support) and the
N x C x P_all Jacobian the fit never forms.
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

WIDTHS = (256, 1024, 2048)
N, C, SUBNET = 256, 10, 1000
RESULTS = Path(__file__).resolve().parent / "results" / "subnetwork_memory.json"
MIB = 2**20


def worker(width: int, kind: str, device: str = "cpu") -> dict[str, float | int | str]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, C)
    ).eval()
    x, y = torch.randn(N, 784), torch.randint(0, C, (N,))
    model, x, y = model.to(device), x.to(device), y.to(device)
    p_all = gs.subnetwork.num_weights(model)
    if kind == "magnitude":
        idx = gs.subnetwork.largest_magnitude(model, SUBNET)
    else:
        start = p_all - C * width - C  # the output layer's weight
        gen = torch.Generator().manual_seed(0)
        idx = start + torch.randperm(C * width, generator=gen)[:SUBNET]
    gs.Laplace(model, "classification", "full", subset=idx).fit((x[:8], y[:8]))  # warm-up

    def forward() -> None:
        with torch.no_grad():
            model(x)

    _, floor, _ = measured(forward)
    la, peak, seconds = measured(
        lambda: gs.Laplace(model, "classification", "full", subset=idx).fit((x, y))
    )
    support = la.subset.support.num_params
    return {
        "width": width,
        "kind": kind,
        "p_all": p_all,
        "p_support": support,
        "support_names": list(la.subset.names),
        "fit_above_floor_mib": (peak - floor) / MIB,
        "ggn_mib": SUBNET**2 * 4 / MIB,
        "one_sample_support_jacobian_mib": C * support * 4 / MIB,
        "all_weights_jacobian_mib": N * C * p_all * 4 / MIB,
        "fit_s": seconds,
    }


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        print("RESULT " + json.dumps(worker(int(sys.argv[2]), sys.argv[3], sys.argv[4])))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_device_argument(parser)  # memory figures are the host process's (RSS)
    args = parser.parse_args()
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}
    rows = []
    for kind in ("magnitude", "last"):
        for width in WIDTHS:
            cmd = [sys.executable, __file__, "--worker", str(width), kind, str(args.device)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
            r = json.loads(out.split("RESULT ", 1)[1])
            rows.append(r)
            print(
                f"{kind:9s} w={width:5d} P_all={r['p_all']:>9,d} P_support={r['p_support']:>9,d}"
                f"  fit above floor {r['fit_above_floor_mib']:7.1f} MiB (1-sample support "
                f"Jacobian {r['one_sample_support_jacobian_mib']:6.1f}, N x C x P_all "
                f"{r['all_weights_jacobian_mib']:8.0f} MiB)  {r['fit_s']:.1f} s"
            )
    RESULTS.write_text(json.dumps({"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
