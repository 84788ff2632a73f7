"""Time per epoch of the natural-gradient VI variants relative to one plain SGD epoch.

    python benchmarks/ngvi_epoch_time.py [--quick] [--threads 1] [--repeats 3]

Data: the bundled ``concrete`` regression set (standardised training split, float32), in
minibatches of 64. Models (tanh MLPs, Gaussian likelihood):

* ``diag`` (gamma = 0.002) and ``kron`` (gamma = 0.02) on 8-50-50-1 (P = 3,051);
* ``full`` (gamma = 0.02) on 8-16-1 (P = 161; a dense P x P precision and one Cholesky per
  step).

For each (structure, variant, S) the script times one epoch of ``fit(..., monitor=False)``
(no ELBO evaluation) and, side by side in the same process and on the same batches, one epoch
of plain SGD (forward, backward, step) on the same MLP; both after a warm-up epoch, the
minimum of ``--repeats`` runs each. Variants: VOGGN and LGVA with S = 1 and 4, OGGN, GLM-VI
with S = 1. The ratio (NGVI epoch / SGD epoch) is what the JSON and the table report; the
absolute seconds depend on the machine and its load.

Writes ``benchmarks/results/ngvi_epoch_time.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import gaussify as gs  # noqa: E402
from gaussify.cli_args import add_device_argument, synchronize  # noqa: E402
from gaussify.weight_space.glm_vi import GLMVI  # noqa: E402
from gaussify.weight_space.ngvi import LGVA, OGGN, VOGGN  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "ngvi_epoch_time.json"
BATCH = 64
#: (structure, hidden widths, gamma): diagonal Gauss-Newton steps overshoot along correlated
#: weights of an MLP and diverge at the gamma the other structures take (timings do not depend
#: on gamma as long as the run stays finite).
CASES = (("diag", (50, 50), 0.002), ("kron", (50, 50), 0.02), ("full", (16,), 0.02))
VARIANTS = ((VOGGN, 1), (VOGGN, 4), (LGVA, 1), (LGVA, 4), (OGGN, 1), (GLMVI, 1))


def mlp(inputs: int, hidden: tuple[int, ...]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    width = inputs
    for h in hidden:
        layers += [nn.Linear(width, h), nn.Tanh()]
        width = h
    return nn.Sequential(*layers, nn.Linear(width, 1))


def batches(x: torch.Tensor, y: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return [(x[order[i : i + BATCH]], y[order[i : i + BATCH]]) for i in range(0, len(x), BATCH)]


def sgd_epoch(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    start = time.perf_counter()
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
    synchronize(data[0][0].device)
    return time.perf_counter() - start


def ngvi_epoch(vi: Any, data: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> float:
    start = time.perf_counter()
    for batch in data:
        vi.step(batch, n)
    synchronize(data[0][0].device)
    return time.perf_counter() - start


def run(repeats: int, quick: bool, device: str | torch.device = "cpu") -> list[dict[str, Any]]:
    ds = gs.data.load("concrete", seed=0)
    x, y = ds.x_train.float().to(device), ds.y_train.float().reshape(-1, 1).to(device)
    if quick:
        x, y = x[:256], y[:256]
    data = batches(x, y)
    rows = []
    for structure, hidden, gamma in CASES:
        for cls, samples in VARIANTS:
            sgd_model = mlp(x.shape[1], hidden).to(device)
            vi = cls(
                mlp(x.shape[1], hidden).to(device), "regression", structure, 1.0, lr=gamma,
                num_samples=samples, sigma_noise=0.5, init_precision=10.0, seed=0,
            )  # fmt: skip
            sgd_epoch(sgd_model, data)  # warm-up
            ngvi_epoch(vi, data, len(x))
            sgd, ngvi = [], []
            for _ in range(repeats):  # interleaved, so load changes hit both alike
                sgd.append(sgd_epoch(sgd_model, data))
                ngvi.append(ngvi_epoch(vi, data, len(x)))
            row = {
                "structure": structure,
                "hidden": list(hidden),
                "num_params": vi.mean.numel(),
                "variant": cls.__name__,
                "num_samples": samples if cls is not OGGN else 0,
                "lr": gamma,
                "batches": len(data),
                "sgd_epoch_s": min(sgd),
                "ngvi_epoch_s": min(ngvi),
                "ratio": min(ngvi) / min(sgd),
            }
            rows.append(row)
            print(
                f"{structure:5s} P={row['num_params']:5d} {cls.__name__:6s} S={samples} "
                f"SGD {row['sgd_epoch_s'] * 1e3:7.1f} ms  NGVI {row['ngvi_epoch_s'] * 1e3:8.1f} "
                f"ms  ratio {row['ratio']:7.1f}",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="256 examples, for a smoke test")
    add_device_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = run(args.repeats, args.quick, args.device)
    result = {
        "benchmark": "ngvi_epoch_time",
        "description": "one NGVI epoch (fit steps, no ELBO) / one plain SGD epoch, same MLP, "
        f"same {BATCH}-example batches of concrete (float32, Gaussian likelihood)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": args.threads,
        "repeats": args.repeats,
        "quick": args.quick,
        "rows": rows,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
