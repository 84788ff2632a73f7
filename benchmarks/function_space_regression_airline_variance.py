"""Issue 19 (h19-airline): where VaLLA's predictive variance on ``airline`` comes from.

For each seed, the 003-F2 network and VaLLA fit of ``function_space_regression`` on ``airline``
(same code path, same seed, so the same fit as ``experiments_function_space_regression_airline``
and its ``_full`` variant; the script checks VaLLA's learned noise against it), and on each
part of the temporal split -- the training rows (January to 13 February), validation (the
next 5,000 flights, 13-20 February) and test (20-27 February) -- VaLLA's mean predictive
variance (its learned noise sigma^2 plus the mean function variance) beside the mean squared
error of the network's mean there, and the MAP's single variance (the training MSE).

    PYTHONPATH=src OMP_NUM_THREADS=1 \
        python benchmarks/function_space_regression_airline_variance.py \
        --output benchmarks/results/function_space_regression_airline_variance.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

import gaussify as gs
from gaussify.cli_args import add_device_argument
from gaussify.experiments import function_space_regression as reg
from gaussify.experiments._runner import train_map_eval

RESULTS = Path(__file__).parent / "results"
REFERENCE = {
    5000: "experiments_function_space_regression_airline.json",
    30000: "experiments_function_space_regression_airline_full.json",
}


def one(seed: int, max_train: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "seed": seed,
        "epochs": 10,
        "num_inducing": 100,
        "valla_epochs": 10,
        "valla_patience": None,
    }
    ds = gs.data.load("airline", seed=seed, dtype=torch.float64, max_train=max_train)
    x, y = ds.x_train, ds.y_train
    model = reg.make_mlp(x.shape[1], 1, 200, 3, seed)
    train_map_eval(model, (x, y), "regression", cfg, batch_size=256)
    with torch.no_grad():
        sigma = float((model(x) - y).square().mean().sqrt())
    post = reg._fit_methods(model, (x, y), (ds.x_val, ds.y_val), ["valla"], sigma, cfg)["valla"][0]
    noise = float(post.sigma_noise) ** 2
    out: dict[str, Any] = {"valla_sigma_noise": float(post.sigma_noise), "map_var": sigma**2}
    for part in ("train", "val", "test"):
        xp, yp = ds.tensors(part)
        pred = post.predict(xp)
        out[part] = {
            "valla_mean_var": float(pred.var.mean()),
            "valla_mean_function_var": float(pred.var.mean()) - noise,
            "mse": float((pred.mean - yp.reshape(pred.mean.shape)).square().mean()),
        }
    committed = json.loads((RESULTS / REFERENCE[max_train]).read_text())
    ref = next(r for r in committed["records"] if r["seed"] == seed and r["method"] == "valla")
    out["same_as_committed"] = abs(ref["sigma_noise"] - out["valla_sigma_noise"]) < 1e-9
    return out


def main(seeds: int, full_seeds: int, out: Path) -> None:
    start = time.perf_counter()
    torch.set_num_threads(1)
    runs: dict[str, Any] = {}
    for max_train, count in ((5000, seeds), (30000, full_seeds)):
        for seed in range(count):
            runs[f"n{max_train}/seed{seed}"] = res = one(seed, max_train)
            print(max_train, seed, json.dumps(res), flush=True)
    payload = {
        "what": (__doc__ or "").split("\n\n")[0],
        "runs": runs,
        "runtime_s": time.perf_counter() - start,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 at 5000 rows")
    parser.add_argument("--full-seeds", type=int, default=1, help="seeds at all 30,000 rows")
    parser.add_argument("--output", type=Path, required=True)
    add_device_argument(parser)
    args = parser.parse_args()
    if args.device.type != "cpu":
        parser.error(f"--device {args.device}: the experiment runs on the host")
    main(args.seeds, args.full_seeds, args.output)
