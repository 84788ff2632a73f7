"""VaLLA paper Fig. 3 (right): VaLLA's fit time against ELLA's, side by side in one process.

Setting of ``gaussify.experiments.function_space_images`` on MNIST: 2000 training images,
784-100-100-10 tanh MLP (float64, 10 epochs), VaLLA with M = ``--num-inducing`` (default 200, the
experiment's) k-means inducing pairs (kernel "ntk", batch 128, 10 epochs, early stopping on the
validation part by the paper's rule, ``fi.VALLA_EARLY_STOPPING``: scored once per epoch, stopped at
the first epoch that does not improve it), ELLA with 200 random landmarks (all 10 outputs each:
2000 inducing values, as many as the paper's ELLA with 2000 landmarks of one output each) and its
prior by grid search on the Nyström evidence (what the experiment times: the paper's ELLA tunes its
prior by a grid search too), keeping every eigen-direction of the landmark kernel (R up to 2000,
the experiment's ELLA) and, as the paper's ELLA does (Deng et al.; the authors'
``scripts/multiclass/ella.py``: K = min(M, 20)), only the top ``--ella-features`` (default 20):
``eig_tol`` just below the 20th eigenvalue's share of the largest, read from the same landmarks'
kernel before the timed runs. Repeats alternate the methods; the ratio is the median of the
per-repeat ratios. Also the time of one VaLLA step, median over steps: for the two inducing designs
(inducing pairs, the default, against all C outputs at each inducing input) and, for pairs, with
the cached inducing factors (the default) against the uncached route that re-forms K_Zx and k(x, x)
from the network at Z every step (the code before issue 19's cache). Writes
``benchmarks/results/valla_vs_ella_time.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
from torch import Tensor

import gaussify as gs
from gaussify.cli_args import add_device_argument
from gaussify.experiments import function_space_images as fi
from gaussify.experiments._runner import train_map_eval
from gaussify.function_space.ella import select_landmarks
from gaussify.function_space.ntk import ntk


def mnist_setting(ella_features: int) -> tuple[torch.nn.Module, Tensor, Tensor, Any, float]:
    """The experiment's MNIST setting (2000 training images, the 784-100-100-10 tanh MAP after
    10 epochs) and ELLA's ``eig_tol`` keeping its top ``ella_features`` eigen-directions of the
    NTK at 200 random landmarks: ``(model, x, y, (x_val, y_val), eig_tol)``. Shared with
    ``valla_vs_ella_jacobian_route.py``."""
    ds = gs.data.load("mnist", seed=0, dtype=torch.float64, flatten=True, max_train=2000)
    x, y, val = ds.x_train, ds.y_train, (ds.x_val, ds.y_val)
    model = fi.make_mlp(x.shape[1], 100, 10, 0)
    train_map_eval(model, (x, y), "classification", {"epochs": 10, "seed": 0}, batch_size=128)
    z = select_landmarks((x, y), 200, "random", 0)
    k_zz = ntk(model, z, None, "all", 1.0)
    evals = torch.linalg.eigvalsh(k_zz.reshape(k_zz.shape[0] * k_zz.shape[1], -1)).flip(0)
    return model, x, y, val, float(evals[ella_features - 1] / evals[0]) * (1 - 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--num-inducing", type=int, default=200)
    parser.add_argument("--ella-features", type=int, default=20)
    parser.add_argument("--output", default="benchmarks/results/valla_vs_ella_time.json")
    add_device_argument(parser)
    args = parser.parse_args()
    if args.device.type != "cpu":
        parser.error(f"--device {args.device}: the experiment's data and MAP run on the host")
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    model, x, y, val, ella_tol = mnist_setting(args.ella_features)

    def valla(design: str, **kw):
        return gs.VaLLA(
            model, "classification", num_inducing=args.num_inducing, epochs=10, batch_size=128,
            kernel="ntk", seed=0, inducing_classes=design, **kw,
        )  # fmt: skip

    steps = {}
    for design in ("auto", "uncached", "all"):
        v = valla("all" if design == "all" else "auto").initialize((x, y))
        if design == "uncached":
            v._z_factors = None  # re-form the kernels at Z every step (before the cache)
        v._total_steps, v._step_count = args.steps, 0
        times = []
        for i in range(args.steps):
            xb, yb = x[i * 128 : (i + 1) * 128], y[i * 128 : (i + 1) * 128]
            t = time.perf_counter()
            v.step(xb, yb)
            times.append(time.perf_counter() - t)
        steps[design] = {
            "median_step_s": statistics.median(times),
            "step_s": times,
            "inducing_values": int(v.kernel_zz.shape[0]),
        }
        print(design, steps[design], flush=True)
    rows: list[dict[str, float]] = []

    def write() -> None:
        out = {
            "what": __doc__.split("\n")[0],
            "setting": f"mnist, 2000 training images, 784-100-100-10 tanh MLP, VaLLA M = "
            f"{args.num_inducing} pairs (ntk, batch 128, 10 epochs, early stopping "
            f"{dict(fi.VALLA_EARLY_STOPPING)}), ELLA 200 "
            f"landmarks + grid prior, all eigen-directions and the top {args.ella_features}; "
            "1 thread",
            "load_avg_start": load_start,
            "load_avg_end": os.getloadavg(),
            "step_time_by_design": steps,
            "step_ratio_all_over_pairs": steps["all"]["median_step_s"]
            / steps["auto"]["median_step_s"],
            "step_ratio_uncached_over_cached": steps["uncached"]["median_step_s"]
            / steps["auto"]["median_step_s"],
            "repeats": rows,
        }
        if rows:
            out["median_ratio_valla_over_ella"] = statistics.median(r["ratio"] for r in rows)
            out["median_valla_s"] = statistics.median(r["valla_s"] for r in rows)
            out["median_ella_s"] = statistics.median(r["ella_s"] for r in rows)
            out["median_ella_k_s"] = statistics.median(r["ella_k_s"] for r in rows)
            out["median_ratio_valla_over_ella_k"] = statistics.median(r["ratio_k"] for r in rows)
        with open(args.output, "w") as fh:
            json.dump(out, fh, indent=1)

    write()
    for r in range(args.repeats):
        t = time.perf_counter()
        v = valla("auto").fit((x, y), val, **fi.VALLA_EARLY_STOPPING)
        t_valla = time.perf_counter() - t
        t = time.perf_counter()
        ella = gs.ELLA(model, "classification", num_landmarks=200, seed=0).fit((x, y))
        t_ella_fit = time.perf_counter() - t
        ella.optimize_prior(method="grid")
        t_ella = time.perf_counter() - t
        t = time.perf_counter()
        ella_k = gs.ELLA(model, "classification", num_landmarks=200, seed=0, eig_tol=ella_tol)
        ella_k.fit((x, y)).optimize_prior(method="grid")
        t_ella_k = time.perf_counter() - t
        rows.append(
            {
                "repeat": r,
                "valla_s": t_valla,
                "ella_s": t_ella,
                "ella_fit_s": t_ella_fit,
                "ella_k_s": t_ella_k,
                "ella_k_features": ella_k.num_features,
                "ratio_k": t_valla / t_ella_k,
                "ratio": t_valla / t_ella,
                "valla_steps": len(v.history["objective"]),
            }
        )
        print(rows[-1], flush=True)
        write()


if __name__ == "__main__":
    main()
