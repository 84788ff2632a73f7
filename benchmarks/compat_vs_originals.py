"""Timing of user code through gaussify.compat against the original packages.

    python benchmarks/compat_vs_originals.py [--repeats 3]

The same script body runs with ``laplace`` / ``vbll`` and with ``gaussify.compat.laplace`` /
``gaussify.compat.vbll`` (only the import differs), interleaved, median of ``--repeats``:

* laplace: MLP 64-50-10 (tanh) trained on ``digits`` (float32); per structure x subset,
  ``Laplace(...)`` + ``fit`` + ``optimize_prior_precision(method="marglik")`` (100 Adam steps)
  + the probit GLM predictive on the test set; the agreement of the tuned prior and the
  predictive is recorded too;
* vbll: one epoch (742 / 32 batches) of Adam steps on ``out.train_loss_fn(y)`` for a
  ``Regression`` (D = 64, dense) and a ``DiscClassification`` (D = 64, 10 classes, dense) head
  on fixed random features, plus the predictive of 1000 points.

Writes ``benchmarks/results/compat_vs_originals.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
import gaussify as gs  # noqa: E402
from gaussify.cli_args import add_device_argument, synchronize  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "compat_vs_originals.json"
CASES = [("all", "diag"), ("all", "kron"), ("last_layer", "kron"), ("last_layer", "full")]


def laplace_run(lib: Any, model: nn.Module, data: dict[str, Any], subset: str, structure: str):
    start = time.perf_counter()
    la = lib.Laplace(model, "classification", subset_of_weights=subset, hessian_structure=structure)
    la.fit(data["train"])
    la.optimize_prior_precision(method="marglik", pred_type="glm", link_approx="probit")
    probs = la(data["x_test"], pred_type="glm", link_approx="probit")
    synchronize(probs.device)
    return time.perf_counter() - start, la.prior_precision.detach(), probs.detach()


def vbll_run(lib: Any, name: str, x: torch.Tensor, y: torch.Tensor) -> float:
    torch.manual_seed(0)
    out = 1 if name == "Regression" else 10
    head = getattr(lib, name)(64, out, 1 / len(x), parameterization="dense").to(x.device)
    opt = torch.optim.Adam(head.parameters(), lr=1e-3)
    start = time.perf_counter()
    for i in range(0, len(x), 32):
        opt.zero_grad()
        head(x[i : i + 32]).train_loss_fn(y[i : i + 32]).backward()
        opt.step()
    with torch.no_grad():
        head(torch.randn(1000, 64, device=x.device)).predictive  # noqa: B018 (computed)
    synchronize(x.device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    add_device_argument(parser)
    args = parser.parse_args()
    device = args.device
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    originals = {
        "laplace": importlib.import_module("laplace"),
        "vbll": importlib.import_module("vbll"),
    }
    compat = {
        "laplace": importlib.import_module("gaussify.compat.laplace"),
        "vbll": importlib.import_module("gaussify.compat.vbll"),
    }
    ds = gs.data.load("digits", seed=0)
    x_train, y_train, x_test = (t.to(device) for t in (ds.x_train, ds.y_train, ds.x_test))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 50), nn.Tanh(), nn.Linear(50, 10)).to(device)
    gs.train_map(model, (x_train, y_train), "classification", epochs=100, lr=1e-2, seed=0)
    model.eval()
    data = {
        "train": DataLoader(TensorDataset(x_train, y_train), batch_size=256),
        "x_test": x_test,
    }
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": 1},
        "device": str(device),
        "laplace": [],
        "vbll": [],
    }
    for subset, structure in CASES:
        times: dict[str, list[float]] = {"original": [], "compat": []}
        outputs = {}
        for _ in range(args.repeats):
            for key, lib in (("original", originals["laplace"]), ("compat", compat["laplace"])):
                seconds, prior, probs = laplace_run(lib, model, data, subset, structure)
                times[key].append(seconds)
                outputs[key] = (prior, probs)
        row = {
            "subset": subset,
            "structure": structure,
            "original_s": statistics.median(times["original"]),
            "compat_s": statistics.median(times["compat"]),
            "prior_rel_diff": float(
                ((outputs["compat"][0] - outputs["original"][0]) / outputs["original"][0])
                .abs()
                .max()
            ),
            "probs_max_abs_diff": float(
                (outputs["compat"][1] - outputs["original"][1]).abs().max()
            ),
        }
        row["speedup"] = row["original_s"] / row["compat_s"]
        results["laplace"].append(row)
        print(
            f"laplace {subset:>10} {structure:>4}: {row['original_s']:.3f}s -> "
            f"{row['compat_s']:.3f}s  x{row['speedup']:.1f}  prior rel diff "
            f"{row['prior_rel_diff']:.1e}  probs diff {row['probs_max_abs_diff']:.1e}"
        )
    x = torch.randn(742, 64).to(device)
    targets = {
        "Regression": torch.randn(742, 1).to(device),
        "DiscClassification": torch.randint(0, 10, (742,)).to(device),
    }
    for name, y in targets.items():
        times = {"original": [], "compat": []}
        for _ in range(args.repeats):
            times["original"].append(vbll_run(originals["vbll"], name, x, y))
            times["compat"].append(vbll_run(compat["vbll"], name, x, y))
        row = {
            "layer": name,
            "original_s": statistics.median(times["original"]),
            "compat_s": statistics.median(times["compat"]),
        }
        row["speedup"] = row["original_s"] / row["compat_s"]
        results["vbll"].append(row)
        print(
            f"vbll {name:>18}: {row['original_s']:.3f}s -> {row['compat_s']:.3f}s "
            f"x{row['speedup']:.1f}"
        )
    OUT.write_text(json.dumps(results, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
