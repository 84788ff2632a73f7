"""Issue 19: why the GP-classification rows of Bui's Table 5 were off (magic MM / LM NLL at
ln 2, the class prior), one isolated factor at a time, on magic (split 0, float64, 1 thread).

* ``inputs``: the loader standardises the inputs (mean 0, std 1 per feature on the training
  part), so the RBF lengthscale initialisation sqrt(D) is on the right scale;
* ``alpha_eps``: ``moment`` and ``laplace`` at N = 500 for alpha_eps in 0.01 .. 1: the
  training log-likelihood of the MC predictive (the paper's selection criterion), the test
  error / NLL, the fitted signal variance and whether the fit is flat
  (:meth:`GPClassifier.flat_functions`); the MC, probit and mean links of the same fits;
* ``evidence``: ``moment`` at alpha_eps = 0.05 with a kernel shared by both classes: the log
  marginal likelihood of the constant function (signal variance e^-18) against the best
  point of a (log lengthscale, log variance) grid, N = 250 .. 2000 (positive gain: the
  evidence prefers a signal);
* ``training_size``: ``moment`` and ``laplace`` at alpha_eps = 0.2 for N = 500, 1000, 1500
  (the paper fits SVGP on all 14020 points);
* ``letter`` (``--letter``, written to its own file): ``moment-ori`` and ``moment`` on letter
  (split 0, the experiment's 390-point subsample, 15 per class) for alpha_eps in 0.01 .. 0.5:
  training and validation log-likelihoods and test error / NLL of the MC predictive.

The JSON is rewritten after each factor, so a partial run keeps what it finished.

    python benchmarks/gp_classification_factors.py [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import warnings
from pathlib import Path

import torch

from gaussify import data as gdata
from gaussify import metrics
from gaussify.approx_likelihoods import GPClassifier
from gaussify.cli_args import add_device_argument

DT = torch.float64
OUT = Path(__file__).resolve().parent / "results" / "gp_classification_factors.json"


def _fit(method: str, alpha: float, n: int, name: str = "magic") -> dict:
    ds = gdata.load(name, seed=0, max_train=n, dtype=DT)
    classes = int(ds.num_classes or 2)
    gp = GPClassifier(method, alpha)  # type: ignore[arg-type]
    start, cpu = time.perf_counter(), time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = gp.fit(ds.x_train, ds.y_train, classes, max_iter=100)
    out = {
        "method": method,
        "alpha_eps": alpha,
        "n_train": int(ds.x_train.shape[0]),
        "fit_s": time.perf_counter() - start,
        "fit_cpu_s": time.process_time() - cpu,
        "flat": result.flat,
        "variance": gp.variance.tolist(),
        "lengthscale": gp.lengthscale.flatten().tolist(),
        "lml": result.lml,
    }
    x_test, y_test = ds.x_test[:1000], ds.y_test[:1000]
    gen = torch.Generator().manual_seed(7)
    train = gp.predict_proba(ds.x_train, num_samples=1000, generator=gen)
    out["train_loglik"] = -metrics.nll(train.clamp_min(1e-12), ds.y_train)
    for link in ("mc", "probit", "mean"):
        probs = gp.predict_proba(x_test, link=link, num_samples=1000, generator=gen)
        out[f"test_{link}"] = {
            "error": 1.0 - metrics.accuracy(probs, y_test),
            "nll": metrics.nll(probs.clamp_min(1e-300), y_test),
        }
    val = gp.predict_proba(ds.x_val[:1000], num_samples=1000, generator=gen)  # drawn last
    out["val_loglik"] = -metrics.nll(val.clamp_min(1e-12), ds.y_val[:1000])
    return out


def inputs() -> dict:
    ds = gdata.load("magic", seed=0, max_train=500, dtype=DT)
    return {
        "max_abs_mean": float(ds.x_train.mean(0).abs().max()),
        "std_range": [float(ds.x_train.std(0).min()), float(ds.x_train.std(0).max())],
        "n_features": int(ds.x_train.shape[1]),
        "init_lengthscale": math.sqrt(ds.x_train.shape[1]),
    }


def evidence(sizes: tuple[int, ...] = (250, 500, 1000, 2000)) -> list[dict]:
    rows = []
    for n in sizes:
        ds = gdata.load("magic", seed=0, max_train=n, dtype=DT)
        gp = GPClassifier("moment", 0.05, hyperparameters="shared")
        gp.set_data(ds.x_train, ds.y_train, 2)

        def lml(log_ls: float, log_var: float, gp: GPClassifier = gp) -> float:
            with torch.no_grad():
                return float(
                    gp.log_marginal_likelihood(
                        torch.tensor([[log_ls]], dtype=DT), torch.tensor([log_var], dtype=DT)
                    )
                )

        constant = lml(5.0, -18.0)
        grid = [(a, b, lml(a, b)) for a in (0.0, 0.5, 1.0, 1.5, 2.0) for b in (-6, -2, 0, 2, 4, 6)]
        best = max(grid, key=lambda r: r[2])
        rows.append(
            {
                "n_train": n,
                "lml_constant": constant,
                "best_grid_point": {"log_lengthscale": best[0], "log_variance": best[1]},
                "lml_best_grid": best[2],
                "gain_of_signal_nats": best[2] - constant,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--letter", action="store_true", help="only the letter factor")
    parser.add_argument(
        "--letter-alphas", nargs="+", type=float, default=[0.01, 0.05, 0.1, 0.2, 0.5]
    )
    parser.add_argument("--letter-methods", nargs="+", default=["moment-ori", "moment"])
    add_device_argument(parser)
    args = parser.parse_args()
    if args.device.type != "cpu":
        # as benchmarks/gp_classification.py: the experiment's data and generators are CPU ones
        parser.error(f"--device {args.device}: this benchmark runs on the CPU only")
    if args.output is None:
        args.output = OUT.with_name(OUT.stem + "_letter.json") if args.letter else OUT
    torch.set_num_threads(1)
    payload: dict = {
        "benchmark": "gp_classification_factors",
        "issue": 19,
        "dataset": "magic (split 0, 1000 test points)",
        "torch": torch.__version__,
        "threads": 1,
        "load_average_start": os.getloadavg(),
        "factors": {},
    }
    start = time.perf_counter()

    def save() -> None:
        payload["runtime_s"] = time.perf_counter() - start
        payload["load_average_end"] = os.getloadavg()
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(payload, indent=1) + "\n")

    if args.letter:
        payload["dataset"] = "letter (split 0, 390 stratified training points, 1000 test points)"
        rows: list[dict] = []
        payload["factors"]["letter"] = rows
        for method in args.letter_methods:
            for alpha in args.letter_alphas:
                rows.append(_fit(method, alpha, 390, "letter"))
                save()
        return
    payload["factors"]["inputs"] = inputs()
    save()
    payload["factors"]["alpha_eps"] = [
        _fit(m, a, 500) for m in ("moment", "laplace") for a in (0.01, 0.05, 0.1, 0.2, 0.5, 1.0)
    ]
    save()
    payload["factors"]["evidence"] = evidence()
    save()
    payload["factors"]["training_size"] = [
        _fit(m, 0.2, n) for n in (500, 1000, 1500) for m in ("moment", "laplace")
    ]
    save()
    print(json.dumps({k: len(v) for k, v in payload["factors"].items()}))


if __name__ == "__main__":
    main()
