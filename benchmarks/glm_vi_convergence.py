"""Issue 19: GLM VI's test NLL against its step count at the paper's and our step sizes
(Immer, Korzepa & Bauer 2021, Table 1, breast_cancer).

App. B.3 of the paper runs 250 full-batch natural-gradient steps with gamma 1e-3 (full
covariance) and 1e-2 (diagonal); the authors' published code starts the VI at the GLM Laplace
posterior at theta* with one sample per step (as ``GLMVI.init_laplace`` and S = 1 here). After
T steps the precision keeps the weight (1 - gamma)^T of that start: 0.78 for gamma 1e-3 and
T = 250, 0.08 for gamma 1e-2. This script follows the test and validation NLL of the GLM
predictive (1000 Monte Carlo samples, the experiment's) along the steps, for each split of the
Table 1 run at a fixed prior precision, for every step size of ``--gammas``: the same MAP
(``uci_classification``'s, loaded from ``--map-cache`` or retrained), the same engine
(``CachedGLMVI`` for the full structure, ``GLMVI`` for the diagonal) and the same seeds as
``uci_methods.glm_vi_probs``. Writes ``benchmarks/results/glm_vi_convergence.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from gaussify import data as gdata
from gaussify import metrics
from gaussify.cli_args import add_device_argument
from gaussify.experiments import uci_classification as uci
from gaussify.experiments.uci_methods import mlp
from gaussify.weight_space.glm_vi import GLMVI
from gaussify.weight_space.glm_vi_cached import CachedGLMVI

ROOT = Path(__file__).resolve().parents[1]


def trace(
    name: str, split: int, delta: float, structure: str, gamma: float, steps: int,
    every: list[int], samples: int, map_cache: str | None,
) -> dict[str, Any]:  # fmt: skip
    """Validation / test NLL of the GLM predictive after each step count in ``every``."""
    ds = gdata.load(name, seed=split)
    x_tr, y_tr = ds.x_train, ds.y_train
    cfg = uci.Config([name], [split], 10, 3000, 1e-2, 1000, map_cache=map_cache)
    torch.manual_seed(split)
    model = mlp(x_tr.shape[1], int(ds.num_classes or 0), cfg.width)
    uci._train_or_load(model, name, split, delta, cfg, (x_tr, y_tr))
    k = uci.prior_grid(name).index(delta)
    gen = 1000 * split + k
    engine = CachedGLMVI if structure == "full" else GLMVI
    vi = engine(
        model, "classification", structure, prior_precision=delta, lr=gamma,
        num_samples=samples, antithetic=samples % 2 == 0, seed=gen,
    )  # fmt: skip
    vi.init_laplace((x_tr, y_tr))
    x_eval = torch.cat([ds.x_val, ds.x_test])
    n_val = len(ds.y_val)
    points = []
    start = time.perf_counter()
    for t in range(steps + 1):
        if t in every:
            pred = vi.predict(
                x_eval, link="mc", num_samples=cfg.num_samples,
                generator=torch.Generator().manual_seed(gen),
            )  # fmt: skip
            assert pred.probs is not None
            p = pred.probs.detach()
            points.append({
                "step": t,
                "val_nll": metrics.nll(p[:n_val], ds.y_val),
                "test_nll": metrics.nll(p[n_val:], ds.y_test),
                "mean_shift": float((vi.mean - vi.theta_lin).norm()),
            })  # fmt: skip
        if t < steps:
            vi.step((x_tr, y_tr))
    return {
        "dataset": name, "split": split, "delta": delta, "structure": structure,
        "gamma": gamma, "num_samples": samples, "start_weight_left": (1 - gamma) ** steps,
        "runtime_s": time.perf_counter() - start, "points": points,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="breast_cancer")
    parser.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--deltas", type=float, nargs="+", required=True, help="one per split")
    parser.add_argument("--structure", default="full", choices=["full", "diag"])
    parser.add_argument("--gammas", type=float, nargs="+", default=[1e-3, 1e-2, 0.2])
    parser.add_argument("--steps", type=int, nargs="+", default=[1000, 1000, 30])
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 1, 2])
    parser.add_argument("--map-cache", default=None)
    parser.add_argument("--threads", type=int, default=1)
    add_device_argument(parser)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" /
                        "glm_vi_convergence.json")  # fmt: skip
    args = parser.parse_args()
    if args.device.type != "cpu":
        parser.error(f"--device {args.device}: the experiment's data and MAP run on the host")
    torch.set_num_threads(args.threads)
    grid = uci.prior_grid(args.dataset)
    runs = []
    for split, delta in zip(args.splits, args.deltas, strict=True):
        delta = min(grid, key=lambda d: abs(d - delta))
        for gamma, steps, samples in zip(args.gammas, args.steps, args.samples, strict=True):
            every = sorted({0, 10, 30, 100, 250, 500, 1000, 2000, steps} & set(range(steps + 1)))
            runs.append(trace(args.dataset, split, delta, args.structure, gamma, steps, every,
                              samples, args.map_cache))  # fmt: skip
            last = runs[-1]["points"]
            print(split, delta, gamma, [(p["step"], round(p["test_nll"], 4)) for p in last],
                  flush=True)  # fmt: skip
            out = {"benchmark": "glm_vi_convergence", "about": __doc__, "runs": runs,
                   "threads": args.threads, "load_average": list(os.getloadavg())}  # fmt: skip
            args.output.write_text(json.dumps(out, indent=1) + "\n")  # after every trace
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
