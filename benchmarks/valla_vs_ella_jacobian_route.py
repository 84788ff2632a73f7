"""VaLLA paper Fig. 3 (right): VaLLA against ELLA at the paper's budget, with ELLA's features
formed from per-layer NTK factors (our default) and from per-sample Jacobians.

MNIST setting of ``gaussify.experiments.function_space_images`` (2000 training images,
784-100-100-10 tanh MLP, float64). VaLLA: M = 200 inducing pairs, ntk kernel, batch 128, 10 epochs,
early stopping by the paper's rule (``VALLA_EARLY_STOPPING``). ELLA: 200 landmarks x 10 outputs
(2000 inducing values, the paper's count), the top 20 eigen-directions (Deng et al.'s K, via
``eig_tol``), prior by a grid on its evidence; once with ``route="auto"`` (per-layer factors) and
once with ``route="jacobian"`` (per-sample Jacobians of the landmarks and of each batch, the kind
of computation the authors' ELLA does). One process, ``--repeats`` alternating repeats (each
Jacobian-route fit takes tens of minutes on the shared 2-core machine). Writes
``benchmarks/results/valla_vs_ella_jacobian_route.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from valla_vs_ella_time import mnist_setting  # this folder: the same setting

import gaussify as gs
from gaussify.cli_args import add_device_argument
from gaussify.experiments import function_space_images as fi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--output", default="benchmarks/results/valla_vs_ella_jacobian_route.json")
    add_device_argument(parser)
    args = parser.parse_args()
    if args.device.type != "cpu":
        parser.error(f"--device {args.device}: the experiment's data and MAP run on the host")
    torch.set_num_threads(1)
    model, x, y, val, tol = mnist_setting(20)
    out: dict[str, object] = {"what": __doc__.split("\n")[0], "load_avg_start": os.getloadavg()}
    rows = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        gs.VaLLA(
            model, "classification", num_inducing=200, epochs=10, batch_size=128, kernel="ntk",
            seed=0,
        ).fit((x, y), val, **fi.VALLA_EARLY_STOPPING)  # fmt: skip
        t_valla = time.perf_counter() - t
        times = {}
        for route in ("jacobian", "auto"):
            t = time.perf_counter()
            ella = gs.ELLA(
                model, "classification", num_landmarks=200, seed=0, eig_tol=tol, route=route
            )
            ella.fit((x, y)).optimize_prior(method="grid")
            times[route] = time.perf_counter() - t
        rows.append(
            {"valla_s": t_valla, "ella_k20_jacobian_route_s": times["jacobian"],
             "ella_k20_s": times["auto"], "features": ella.num_features}
        )  # fmt: skip
        print(rows[-1], flush=True)
    out.update(rows=rows, load_avg_end=os.getloadavg())
    with open(args.output, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
