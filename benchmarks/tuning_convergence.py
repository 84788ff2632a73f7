"""Hyperparameter tuning from bad starts and on rescaled targets (issue 16, point 2).

    PYTHONPATH=src python benchmarks/tuning_convergence.py [--json out.json]

Runs against whatever ``gaussify`` is importable, so the same script measures the code before
and after the shared tuning routine (``PYTHONPATH=/path/to/old/src``).

* ``digits``: a 64-50-10 tanh MLP trained by ``train_map`` (prior precision 1, 60 epochs) on the
  bundled digits training split, ``Laplace(structure="kron")``, ``optimize_prior()`` with the
  defaults from prior precisions 1e-4, 1, 100 and 1e4: tuned prior, log evidence, and
  (after) the tuning result. Before: a fixed 100 Adam steps, so the result depends on the start.
* ``regression x1000``: a 13-50-1 tanh MLP trained on the standardised boston targets, then its
  output layer and the targets multiplied by 1000 (the same fit on a data scale 1000 times
  larger), ``Laplace(structure="kron")``, ``optimize_prior()`` (prior and noise) from prior 1
  and sigma 1, with one scalar prior and with one prior per layer (weights and biases apart):
  tuned sigma against the residual standard deviation, and the log evidence. A scalar prior
  cannot suit the unscaled first layer and the x1000 output layer at once; its evidence
  optimum (checked on a 2-D grid) has sigma far above the residual sd, the per-layer one near it.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings

import torch
from torch import nn

import gaussify as gs
from gaussify.cli_args import add_device_argument


def _result(la: gs.Laplace) -> dict[str, object]:
    res = getattr(la, "tuning_result", None)
    if res is None:
        return {}
    return {
        "converged": res.converged,
        "steps": res.steps,
        "evaluations": res.evaluations,
        "grad_norm": res.grad_norm,
    }


def digits(device: str | torch.device = "cpu") -> list[dict[str, object]]:
    ds = gs.data.load("digits")
    x, y = ds.x_train.float().to(device), ds.y_train.long().to(device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 50), nn.Tanh(), nn.Linear(50, 10)).to(device)
    gs.train_map(model, (x, y), "classification", prior_precision=1.0, epochs=60, lr=1e-2, seed=0)
    rows = []
    for start in (1e-4, 1.0, 100.0, 1e4):
        la = gs.Laplace(model, "classification", "kron", prior_precision=start).fit((x, y))
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            la.optimize_prior()
        seconds = time.perf_counter() - t0
        rows.append(
            {
                "case": "digits kron",
                "start": start,
                "prior": float(la.prior_precision),
                "log_evidence": float(la.log_marginal_likelihood()),
                "seconds": seconds,
                "warnings": [str(w.message)[:120] for w in caught],
                **_result(la),
            }
        )
    return rows


def regression(
    scale: float = 1000.0, device: str | torch.device = "cpu"
) -> list[dict[str, object]]:
    ds = gs.data.load("boston")
    x, y = ds.x_train.float().to(device), ds.y_train.float().reshape(-1, 1).to(device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(x.shape[1], 50), nn.Tanh(), nn.Linear(50, 1)).to(device)
    gs.train_map(model, (x, y), "regression", prior_precision=1.0, epochs=200, lr=1e-2, seed=0)
    with torch.no_grad():
        model[2].weight.mul_(scale)
        model[2].bias.mul_(scale)
        residual_sd = float((scale * y - model(x)).std())
    rows = []
    for granularity in ("scalar", "layer"):
        options = {"kron_bias": "separate"} if granularity == "layer" else {}
        la = gs.Laplace(
            model, "regression", "kron", prior_precision=1.0, sigma_noise=1.0, **options
        ).fit((x, scale * y))
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            la.optimize_prior(granularity=granularity)
        seconds = time.perf_counter() - t0
        tuned = float(la.log_marginal_likelihood())
        at_sd = float(la.log_marginal_likelihood(la.prior_precision, residual_sd))
        rows.append(
            {
                "case": f"boston kron targets x{scale:g}, {granularity} prior",
                "residual_sd": residual_sd,
                "sigma": float(la.sigma_noise),
                "prior": la.prior_precision.tolist(),
                "log_evidence": tuned,
                "log_evidence_at_residual_sd": at_sd,
                "seconds": seconds,
                "warnings": [str(w.message)[:120] for w in caught],
                **_result(la),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    add_device_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = digits(args.device) + regression(device=args.device)
    for row in rows:
        print(
            {
                k: (f"{v:.6g}" if isinstance(v, float) and math.isfinite(v) else v)
                for k, v in row.items()
            }
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
