"""Issue 19: run ``function_space_regression`` (its defaults, one seed) keeping the predictives,
write the experiment JSON (as ``--output`` does) and the CQM curve m(alpha) - alpha (VaLLA
paper Fig. 2 right / App. F) of every method's test predictive from the same run.

    python benchmarks/function_space_regression_curves.py --seed 0 \
        --output benchmarks/results/experiments_function_space_regression.json
"""

from __future__ import annotations

from pathlib import Path

import torch

from gaussify import metrics
from gaussify.experiments import function_space_regression as reg
from gaussify.experiments._report import write_json


def main(seed: int, out: Path) -> None:
    res = reg.run(seed=seed, keep_predictions=True)
    alphas = torch.linspace(0, 1, 11, dtype=torch.float64)
    curves = {}
    for r in res.records:
        mean, var, y = r.pop("mean"), r.pop("var"), r.pop("y")
        gap = metrics.cqm_curve(mean, var.sqrt(), y, alphas) - alphas
        curves[f"{r['dataset']}/{r['method']}"] = {
            "m(alpha)-alpha at alpha=0,0.1,..,1": [round(float(v), 4) for v in gap],
            "mean_var": float(var.mean()),
            "var_cv": float(var.std() / var.mean()),
        }
    write_json(out, res.to_dict())
    write_json(out.with_name(out.stem + "_cqm_curves.json"), {"curves": curves})
    print(res.table())


if __name__ == "__main__":
    import argparse

    from gaussify.cli_args import add_device_argument

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, required=True)
    add_device_argument(parser)
    args = parser.parse_args()
    if args.device.type != "cpu":
        parser.error(f"--device {args.device}: the experiment runs on the host")
    main(args.seed, args.output)
