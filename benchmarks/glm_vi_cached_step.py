"""Time of one full-batch GLM-VI step: cached J* (CachedGLMVI) vs the generic GLMVI step.

    python benchmarks/glm_vi_cached_step.py [--rows 200] [--repeats 3]

Data: the first ``--rows`` training rows of the bundled ``digits`` (D = 64, C = 10) and
``satellite`` (D = 36, C = 6) sets, the Table 1 network of Immer et al. (2021) (one hidden
layer of 50 tanh units; P = 3,760 and 2,156), float32, full covariance, S = 2 antithetic
draws, prior precision 1. Both engines start at the same GLM Laplace posterior and take the
same steps side by side in one process; the script reports the median of ``--repeats`` step
times of each, their ratio, and the largest difference of the means after the timed steps
(the cached step is the same step: round-off only). The step's cost is dominated by the
GGN (N C P^2 for the cached step, S N C P^2 plus the S N Jacobian rows for the generic one),
so the ratio carries over to the full training sets (N = 1,257 and 4,504); the absolute
seconds depend on the machine and its load (``load_avg`` in the JSON).

Writes ``benchmarks/results/glm_vi_cached_step.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from gaussify import data as gdata  # noqa: E402
from gaussify.cli_args import add_device_argument, synchronize  # noqa: E402
from gaussify.experiments.uci_classification import mlp  # noqa: E402
from gaussify.weight_space.glm_vi import GLMVI  # noqa: E402
from gaussify.weight_space.glm_vi_cached import CachedGLMVI  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--output", type=Path, default=ROOT / "benchmarks/results/glm_vi_cached_step.json"
    )
    add_device_argument(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    out = {
        "benchmark": "glm_vi_cached_step",
        "rows": args.rows,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "threads": 1,
        "load_avg_start": os.getloadavg(),
        "results": [],
    }
    for name in ("digits", "satellite"):
        ds = gdata.load(name, seed=0)
        x, y = ds.x_train[: args.rows].to(device), ds.y_train[: args.rows].to(device)
        torch.manual_seed(0)
        model = mlp(x.shape[1], int(ds.num_classes or 0)).to(device)
        opts = dict(prior_precision=1.0, lr=0.2, num_samples=2, antithetic=True, seed=0)
        engines = {
            "generic": GLMVI(model, "classification", "full", **opts),
            "cached": CachedGLMVI(model, "classification", "full", **opts),
        }
        times: dict[str, list[float]] = {k: [] for k in engines}
        for key, vi in engines.items():
            t = time.perf_counter()
            vi.init_laplace((x, y))
            times[f"{key}_init"] = [time.perf_counter() - t]
        for _ in range(args.repeats):
            for key, vi in engines.items():
                t = time.perf_counter()
                vi.step((x, y))
                synchronize(device)
                times[key].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        diff = float((engines["cached"].mean - engines["generic"].mean).abs().max())
        row = {
            "dataset": name,
            "num_params": engines["cached"].mean.numel(),
            "step_s_generic": med["generic"],
            "step_s_cached": med["cached"],
            "init_s_generic": med["generic_init"],
            "init_s_cached": med["cached_init"],
            "speedup": med["generic"] / med["cached"],
            "max_abs_mean_diff": diff,
            "step_times": times,
        }
        print(json.dumps({k: v for k, v in row.items() if k != "step_times"}))
        out["results"].append(row)
    out["load_avg_end"] = os.getloadavg()
    args.output.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
