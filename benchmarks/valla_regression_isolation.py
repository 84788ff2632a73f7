"""Issue 19: isolating runs for VaLLA's regression rows (VaLLA paper Fig. 2 table).

One factor changed per run against the experiment's VaLLA setting
(``gaussify.experiments.function_space_regression``: protein / power, 5000 training rows,
3 x 200 tanh MLP for 10 epochs, M = 100 k-means inducing points, alpha = 1, prior and noise
learned, 10 epochs with early stopping). Factors: noise learned or fixed at the MAP's training
RMSE, M, epochs / patience, the KL form (``mean_kl``), alpha. Writes
``benchmarks/results/valla_regression_isolation.json``. Timings come from a shared 2-core machine.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

import gaussify as gs
from gaussify.experiments import function_space_regression as fr
from gaussify.experiments._runner import train_map_eval

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "noise_fixed": {"learn_noise": False},
    "M=200": {"num_inducing": 200},
    "M=50": {"num_inducing": 50},
    "epochs=30+patience=4": {"epochs": 30, "patience": 4},
    "mean_kl": {"mean_kl": True},
    "alpha=0.5": {"alpha": 0.5},
    "no_early_stop": {"patience": None},
    "epochs=30": {"epochs": 30},
    "patience=4": {"patience": 4},
    "schedule=constant": {"schedule": "constant"},
}


def run(datasets: list[str], variants: list[str], seed: int = 0) -> list[dict[str, Any]]:
    out = []
    for name in datasets:
        ds = gs.data.load(name, seed=seed, dtype=torch.float64, max_train=5000)
        x, y = ds.x_train, ds.y_train
        model = fr.make_mlp(x.shape[1], 1, 200, 3, seed)
        train_map_eval(model, (x, y), "regression", {"epochs": 10, "seed": seed}, batch_size=256)
        with torch.no_grad():
            sigma = float((model(x) - y).square().mean().sqrt())
            test_rmse = float((model(ds.x_test) - ds.y_test).square().mean().sqrt())
        for v in variants:
            opts = dict(VARIANTS[v])
            patience = opts.pop("patience", 2)
            epochs = opts.pop("epochs", 10)
            kw: dict[str, Any] = {"num_inducing": 100, "learn_noise": True}
            kw.update(opts)
            t = time.perf_counter()
            post = gs.VaLLA(
                model,
                "regression",
                sigma_noise=sigma,
                epochs=epochs,
                kernel="ntk",
                seed=seed,
                **kw,
            ).fit(
                (x, y),
                (ds.x_val, ds.y_val),
                patience=patience,
                eval_every=max(1, x.shape[0] // 256 // 2),
            )
            fit_s = time.perf_counter() - t
            pred = post.predict(ds.x_test)
            rec = {
                "dataset": name,
                "seed": seed,
                "variant": v,
                "fit_s": fit_s,
                "map_train_rmse": sigma,
                "map_test_rmse": test_rmse,
                "prior_precision": float(post.prior_precision),
                "sigma_noise": float(post.sigma_noise),
                "steps": len(post.history["objective"]),
                "val_nll": post.history["val_nll"],
                "mean_epistemic_var": float(pred.f_cov.diagonal(dim1=-2, dim2=-1).mean())
                if pred.f_cov is not None
                else None,
            }
            rec.update(fr.evaluate(pred, ds.y_test))
            print(
                json.dumps(
                    {
                        k: rec[k]
                        for k in (
                            "dataset",
                            "variant",
                            "nll",
                            "cqm",
                            "crps",
                            "sigma_noise",
                            "prior_precision",
                            "fit_s",
                        )
                    }
                ),
                flush=True,
            )
            out.append(rec)
    return out


def main() -> None:
    import argparse

    from gaussify.cli_args import add_device_argument

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--datasets", default="power,protein", help="comma-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="benchmarks/results/valla_regression_isolation.json")
    add_device_argument(parser)
    args = parser.parse_args()
    if args.device.type != "cpu":
        parser.error(f"--device {args.device}: the experiment's data and MAP run on the host")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    recs = run(args.datasets.split(","), args.variants.split(","), args.seed)
    res = {
        "what": (__doc__ or "").split("\n")[0],
        "load_avg_start": os.getloadavg(),
        "runtime_s": time.perf_counter() - t0,
        "records": recs,
    }
    with open(args.output, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
