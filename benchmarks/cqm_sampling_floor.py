"""The sampling floor of the CQM (VaLLA paper eq. 22) on the regression test sets.

For a perfectly calibrated Gaussian predictive the coverage levels u_n = 2 Phi(|z_n|) - 1 are
Uniform(0, 1), and the exact CQM (``gaussify.metrics.cqm``, the Wasserstein-1 distance of their
empirical distribution to the uniform) is still positive: about sqrt(2 / (pi n)) pi / 8 for n
test points. This draws y ~ N(0, 1) at mean 0, std 1 (calibrated by construction) 1000 times
at the size of each test set of ``function_space_regression`` (protein, power; seed 0) and
reports the mean, standard deviation and 5 / 50 / 95 % quantiles. CQMs inside that band cannot
be ordered on that test set. Writes ``benchmarks/results/cqm_sampling_floor.json``.
"""

from __future__ import annotations

import json
import math

import torch

import gaussify as gs
from gaussify import metrics


def main(draws: int = 1000) -> dict[str, dict[str, object]]:
    torch.set_num_threads(1)
    out: dict[str, dict[str, object]] = {}
    for name in ("power", "protein"):
        n = gs.data.load(name, seed=0, dtype=torch.float64, max_train=5000).x_test.shape[0]
        gen = torch.Generator().manual_seed(0)
        zero, one = torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64)
        vals = torch.tensor(
            [
                metrics.cqm(zero, one, torch.randn(n, dtype=torch.float64, generator=gen))
                for _ in range(draws)
            ],
            dtype=torch.float64,
        )
        q = torch.quantile(vals, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64))
        out[name] = {
            "n_test": n,
            "draws": draws,
            "mean": float(vals.mean()),
            "sd": float(vals.std()),
            "q05_q50_q95": q.tolist(),
            "approximation_sqrt(2/(pi n)) pi/8": math.sqrt(2 / (math.pi * n)) * math.pi / 8,
        }
        print(name, out[name], flush=True)
    with open("benchmarks/results/cqm_sampling_floor.json", "w") as fh:
        json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    import argparse

    from gaussify.cli_args import add_device_argument

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--draws", type=int, default=1000)
    add_device_argument(parser)
    args = parser.parse_args()
    if args.device.type != "cpu":
        parser.error(f"--device {args.device}: a host-side Monte Carlo of a metric")
    main(args.draws)
