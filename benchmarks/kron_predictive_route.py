"""Side-by-side benchmark: the KFAC GLM predictive over ``nn.Linear`` layers on the traced
route (layer inputs and output gradients, rank-one Jacobian rows) vs the dense Jacobian route.

    python benchmarks/kron_predictive_route.py [--model mlp|cnn] [--threads 1] [--repeats 3]

The model of ``gaussify.experiments.function_space_images``: a 784-100-100-10 tanh MLP in
float64 (P = 89,610), ``Laplace(structure="kron", subset="all")`` fitted on 1000 ``mnist``
training images, prior 1. Timed, interleaved in one run: ``predict`` (probit link, full
C x C covariance) on one chunk of 256 test images on each route (the dense route is what
every ``nn.Linear`` model took before: ``jacobians`` (256, 10, P), then each block rotated
into its Kronecker eigenbasis by two dense matmuls per output row). Each time is the median
of ``--repeats``; the two routes' means and covariances are checked to agree. Writes
``benchmarks/results/kron_predictive_route.json``.

``--model cnn`` (issue 22): a LeNet-style CNN (Conv2d 1->8 5x5, max-pool, Conv2d 8->16 5x5,
max-pool, Linear 256->10; float64) on the same images, whose Conv2d blocks joined the traced
route (patches and output gradients); writes ``kron_predictive_route_cnn.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

import gaussify as gs
import gaussify.weight_space.laplace_predict as laplace_module  # the predictive routes
from gaussify.cli_args import add_device_argument, synchronize
from gaussify.experiments.function_space_images import make_mlp

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def make_cnn() -> torch.nn.Sequential:
    """The LeNet-style CNN of ``--model cnn`` (seeded, float64)."""
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(256, 10),
    ).double()


def predict(la: gs.Laplace, x: torch.Tensor, dense: bool) -> gs.Predictive:
    """GLM probit predictive on one chunk; ``dense`` switches the traced route off."""
    if dense:
        with mock.patch.object(laplace_module, "traced_predictive", lambda *a, **k: None):
            return la.predict(x, link="probit", chunk_size=x.shape[0])
    return la.predict(x, link="probit", chunk_size=x.shape[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    parser.add_argument("--out", type=Path, default=None)
    add_device_argument(parser)
    args = parser.parse_args()
    if args.out is None:
        suffix = "" if args.model == "mlp" else "_cnn"
        args.out = RESULTS / f"kron_predictive_route{suffix}.json"
    torch.set_num_threads(args.threads)
    ds = gs.data.load("mnist", seed=0, dtype=torch.float64, max_train=1000)
    if args.model == "mlp":
        x, y = ds.x_train.flatten(1), ds.y_train
        xt = ds.x_test[: args.chunk].flatten(1)
        model = make_mlp(x.shape[1], 100, 10).eval()
        description = "784-100-100-10 tanh MLP, float64"
    else:
        x, y = ds.x_train.reshape(-1, 1, 28, 28), ds.y_train
        xt = ds.x_test[: args.chunk].reshape(-1, 1, 28, 28)
        model = make_cnn().eval()
        description = "LeNet-style CNN (conv 8 5x5, pool, conv 16 5x5, pool, linear), float64"
    model = model.to(args.device)
    x, y, xt = x.to(args.device), y.to(args.device), xt.to(args.device)
    num_params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    la = gs.Laplace(model, "classification", "kron", "all").fit((x, y), batch_size=256)
    fit_s = time.perf_counter() - t0
    _ = la.posterior  # built once, outside the timings
    samples: dict[str, list[float]] = {"traced": [], "dense": []}
    preds = {}
    for _ in range(args.repeats):
        for key in samples:
            t0 = time.perf_counter()
            preds[key] = predict(la, xt, key == "dense")
            synchronize(args.device)
            samples[key].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in samples.items()}
    ref = preds["dense"]
    rel_cov = float((preds["traced"].f_cov - ref.f_cov).abs().max() / ref.f_cov.abs().max())
    rel_mean = float((preds["traced"].f_mean - ref.f_mean).abs().max() / ref.f_mean.abs().max())
    result = {
        "benchmark": "kron_predictive_route",
        "model": description,
        "num_params": num_params,
        "chunk": int(xt.shape[0]),
        "threads": args.threads,
        "device": str(args.device),
        "load": Path("/proc/loadavg").read_text().split()[:3],
        "torch": torch.__version__,
        "repeats": args.repeats,
        "fit_s": fit_s,
        "seconds": med,
        "samples": samples,
        "speedup_dense_over_traced": med["dense"] / med["traced"],
        "max_rel_diff_f_cov": rel_cov,
        "max_rel_diff_f_mean": rel_mean,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"P = {num_params}, chunk {xt.shape[0]}, {args.threads} thread(s)")
    print(f"predict: traced {med['traced']:.3f} s, dense {med['dense']:.3f} s")
    print(f"dense / traced: {result['speedup_dense_over_traced']:.1f}x")
    print(f"max rel diff: f_cov {rel_cov:.2e}, f_mean {rel_mean:.2e}")


if __name__ == "__main__":
    main()
