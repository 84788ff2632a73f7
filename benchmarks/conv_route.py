"""Side-by-side benchmark: the per-layer Conv2d route of the diagonal GGN vs the generic one.

    python benchmarks/conv_route.py [--threads 1] [--repeats 5]

The CNN of ``laplace_vs_laplace_torch.py`` (conv(1->8,3)-relu-maxpool2-conv(8->16,3)-relu-
maxpool4-linear(64->10), P = 1898, batch 32, 2000 ``mnist`` points, MAP weights trained with
the same seed and settings) is fitted, interleaved in one run:

* one gradient epoch (forward + backward of the summed NLL over the same batches), the unit;
* ``Laplace(structure="diag")`` fits (exact GGN, ``mc_samples=1``, ``ef=True``) with the
  convolutions on the per-layer route (im2col patches and output gradients,
  ``gaussify.curvature.jacobian``) and with the route switched off (the generic ``torch.func``
  per-sample path every Conv2d took before);
* the full-GGN fit both ways (its per-sample products use the same route);
* laplace-torch's diagonal fit with BackPackGGN (its fastest backend for this case).

Each time is the median of ``--repeats``; the two routes' diagonals are checked to agree.
Writes ``benchmarks/results/conv_route.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import laplace_vs_laplace_torch as bench

import gaussify as gs
from gaussify.cli_args import add_device_argument, synchronize
from gaussify.curvature import layer_traces

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "conv_route.json"


def diag_fit(model: nn.Module, loader: DataLoader, generic: bool, **options: Any) -> gs.Laplace:
    """A diag (or other) Laplace fit; ``generic`` switches the Conv2d route off."""
    structure = options.pop("structure", "diag")
    la = gs.Laplace(model, "classification", structure, "all", **options)
    if generic:
        with mock.patch.object(layer_traces, "_plain_conv2d", lambda _m: False):
            return la.fit(loader)
    return la.fit(loader)


def backpack_diag(model: nn.Module, loader: DataLoader) -> None:
    """laplace-torch's diagonal fit with BackPackGGN (on a copy: BackPack extends the model's
    modules in place with hooks that torch.func cannot run through)."""
    from laplace import Laplace
    from laplace.curvature import BackPackGGN

    Laplace(
        model, "classification", subset_of_weights="all", hessian_structure="diag",
        backend=BackPackGGN,
    ).fit(loader)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    add_device_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    spec = bench.MODEL_SPECS["cnn"]
    with tempfile.TemporaryDirectory() as tmp:
        info = bench.prepare_model(spec, Path(tmp), spec.epochs)
        model, data = bench.load_bundle(Path(tmp), "cnn")
    model = model.to(args.device)
    data = {k: v.to(args.device) if isinstance(v, torch.Tensor) else v for k, v in data.items()}
    loader = bench.make_loader(data, spec.batch_size)
    tasks: dict[str, Callable[[], Any]] = {
        "gradient_epoch": lambda: bench.gradient_epoch(copy.deepcopy(model), loader),
        "diag_conv_route": lambda: diag_fit(model, loader, False),
        "diag_generic": lambda: diag_fit(model, loader, True),
        "diag_mc1_conv_route": lambda: diag_fit(model, loader, False, mc_samples=1),
        "diag_mc1_generic": lambda: diag_fit(model, loader, True, mc_samples=1),
        "diag_ef_conv_route": lambda: diag_fit(model, loader, False, ef=True),
        "diag_ef_generic": lambda: diag_fit(model, loader, True, ef=True),
        "full_conv_route": lambda: diag_fit(model, loader, False, structure="full"),
        "full_generic": lambda: diag_fit(model, loader, True, structure="full"),
        "laplace_torch_backpack_diag": lambda: backpack_diag(copy.deepcopy(model), loader),
    }
    samples: dict[str, list[float]] = {k: [] for k in tasks}
    for task in tasks.values():  # warm-up
        task()
    start = time.perf_counter()
    for _ in range(args.repeats):
        for key, task in tasks.items():
            t0 = time.perf_counter()
            task()
            synchronize(args.device)
            samples[key].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in samples.items()}
    fast = diag_fit(model, loader, False)._curvature.ggn_diag
    slow = diag_fit(model, loader, True)._curvature.ggn_diag
    agree = float((fast - slow).abs().max() / slow.abs().max())
    epoch = med["gradient_epoch"]
    over_epoch = {k: v / epoch for k, v in med.items() if k != "gradient_epoch"}
    result = {
        "benchmark": "conv_route",
        "machine": bench.machine_info(args.threads),
        "model": {"name": "cnn", **info},
        "repeats": args.repeats,
        "seconds": med,
        "over_gradient_epoch": over_epoch,
        "speedup_generic_over_conv_route": {
            kind: med[f"{kind}_generic"] / med[f"{kind}_conv_route"]
            for kind in ("diag", "diag_mc1", "diag_ef", "full")
        },
        "diag_conv_route_vs_backpack": med["laplace_torch_backpack_diag"] / med["diag_conv_route"],
        "diag_max_rel_diff_routes": agree,
        "wall_s": time.perf_counter() - start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"gradient epoch {epoch:.4f} s; fit time / epoch:")
    for key, value in over_epoch.items():
        print(f"  {key:32s} {value:7.2f}")
    print("generic / conv route:", result["speedup_generic_over_conv_route"])
    print(f"BackPack diag / gaussify diag: {result['diag_conv_route_vs_backpack']:.2f}")
    print(f"max rel diff of the diagonals: {agree:.2e}")


if __name__ == "__main__":
    main()
