"""Issue 19 (h19-airline): why VaLLA does not win the CQM on ``airline`` (rows 003-F2-airline-*).

Reruns the 003-F2 protocol of ``function_space_regression`` on ``airline`` (the same seeds,
5000 training rows or ``--max-train``; the methods named, default MAP, last-layer, KFAC, ELLA
and VaLLA: each method's fit depends only on the seed, so these records equal those of
``experiments_function_space_regression_airline.json``, or ``--reference``, which the script
checks), keeps the
test predictives and writes, per seed and method:

* the CQM curve ``m(alpha) - alpha`` at alpha = 0, 0.1, ..., 1 (``gaussify.metrics.cqm_curve``;
  above 0: intervals too wide, below: too narrow);
* ``mean_var`` and ``var_cv``: mean and coefficient of variation of the predictive variance
  (VaLLA's is its learned noise sigma^2 plus the input-dependent function variance);
* ``spearman_sd_abs_err``: the rank correlation of the predictive standard deviation with the
  absolute test error |y - mean| (does the input-dependent variance track the errors? 0 for a
  constant variance, which carries no ranking);
* for the MAP, the shape of the standardised test residuals z = (y - mean) / sigma (kurtosis,
  the fraction with |z| < 0.5 against the Gaussian's 0.383) and ``best_constant_sigma``: the
  lowest CQM any single noise level reaches with the network's mean (the scale of sigma chosen
  on the test points themselves, a grid of 0.3-3 times the training RMSE): the floor of a
  homoscedastic Gaussian on these data.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/function_space_regression_airline_curves.py \
        --output benchmarks/results/function_space_regression_airline_curves.json
    ... --max-train 30000 --methods map valla \
        --reference experiments_function_space_regression_airline_full.json \
        --output benchmarks/results/function_space_regression_airline_full_curves.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from gaussify import metrics
from gaussify.cli_args import add_device_argument
from gaussify.experiments import function_space_regression as reg
from gaussify.experiments._report import write_json

RESULTS = Path(__file__).parent / "results"
ALPHAS = torch.linspace(0, 1, 11, dtype=torch.float64)


def _ranks(v: torch.Tensor) -> torch.Tensor:
    r = torch.empty_like(v)
    r[v.argsort()] = torch.arange(len(v), dtype=v.dtype)
    return r


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Rank correlation of ``a`` and ``b`` (0 when either is constant)."""
    if float(a.std()) == 0.0 or float(b.std()) == 0.0:
        return 0.0
    ra, rb = _ranks(a), _ranks(b)
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def describe(mean: torch.Tensor, var: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    mean, var, y = mean.reshape(-1), var.reshape(-1), y.reshape(-1).to(mean)
    sd = var.sqrt()
    gap = metrics.cqm_curve(mean, sd, y, ALPHAS) - ALPHAS
    return {
        "m(alpha)-alpha at alpha=0,0.1,..,1": [round(float(v), 4) for v in gap],
        "cqm_paper": metrics.cqm(mean, sd, y, num_points=11),
        "mean_var": float(var.mean()),
        "var_cv": float(var.std() / var.mean()),
        "spearman_sd_abs_err": spearman(sd, (y - mean).abs()),
    }


def homoscedastic(mean: torch.Tensor, sigma: float, y: torch.Tensor) -> dict[str, Any]:
    """Residual shape and the best CQM of a single noise level around ``mean``."""
    mean, y = mean.reshape(-1), y.reshape(-1).to(mean)
    z = (y - mean) / sigma
    kurt = float(((z - z.mean()) ** 4).mean() / z.var(unbiased=False) ** 2)
    scales = torch.linspace(0.3, 3.0, 55, dtype=torch.float64)
    cqms = [metrics.cqm(mean, torch.full_like(mean, sigma * float(c)), y, 11) for c in scales]
    best = min(range(len(cqms)), key=cqms.__getitem__)
    return {
        "test_residual_kurtosis": kurt,
        "frac_abs_z_below_0.5": float((z.abs() < 0.5).double().mean()),
        "gaussian_frac_abs_z_below_0.5": 0.3829,
        "best_constant_sigma": {
            "scale_of_train_rmse": float(scales[best]),
            "cqm_paper": cqms[best],
        },
    }


def main(seeds: int, methods: list[str], max_train: int, reference: str, out: Path) -> None:
    start = time.perf_counter()
    res = reg.run(
        datasets=["airline"],
        methods=methods,
        seeds=seeds,
        max_train=max_train,
        keep_predictions=True,
    )
    committed = json.loads((RESULTS / reference).read_text())
    ref = {(r["seed"], r["method"]): r["cqm_paper"] for r in committed["records"]}
    rows: dict[str, Any] = {}
    for r in res.records:
        mean, var, y = r.pop("mean"), r.pop("var"), r.pop("y")
        key = f"seed{r['seed']}/{r['method']}"
        rows[key] = describe(mean, var, y)
        rows[key]["same_as_committed"] = abs(ref[(r["seed"], r["method"])] - r["cqm_paper"]) < 1e-9
        if "sigma_noise" in r:
            rows[key]["sigma_noise"] = r["sigma_noise"]
        if r["method"] == "map":
            rows[key].update(homoscedastic(mean, float(var.reshape(-1)[0].sqrt()), y))
    payload = {
        "what": (__doc__ or "").split("\n\n")[0],
        "config": res.config,
        "per_seed": rows,
        "runtime_s": time.perf_counter() - start,
    }
    write_json(out, payload)
    print(
        json.dumps(
            {
                k: {kk: v[kk] for kk in ("cqm_paper", "spearman_sd_abs_err")}
                for k, v in rows.items()
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument(
        "--methods", nargs="+", default=["map", "last_layer", "kfac", "ella", "valla"]
    )
    parser.add_argument("--max-train", type=int, default=5000)
    parser.add_argument(
        "--reference",
        default="experiments_function_space_regression_airline.json",
        help="the committed run (under benchmarks/results) whose records these must equal",
    )
    parser.add_argument("--output", type=Path, required=True)
    add_device_argument(parser)
    args = parser.parse_args()
    if args.device.type != "cpu":
        parser.error(f"--device {args.device}: the experiment runs on the host")
    main(args.seeds, args.methods, args.max_train, args.reference, args.output)
