"""Prior tuning of a full GGN: where the time goes, by size (issue 17).

    python benchmarks/full_prior_tuning.py [--sizes 500 1500 3760] [--repeats 3] [--device cpu]

For an MLP regression model with P = 500, 1,500 and 3,760 parameters (one hidden tanh layer,
widths chosen to hit P exactly) fitted with ``Laplace(structure="full")`` on 512 synthetic
rows (float64), times (median of ``--repeats``, one process):

* the factorisations of the P x P GGN that prior tuning can use: ``eigvalsh`` (eigenvalues
  only: the closed-form evidence at the MAP), ``eigh`` (eigenvectors too: the closed form with
  the non-MAP correction, which projects the gradient and the weights on them) and one
  Cholesky factorisation of G + delta I (a single evidence evaluation);
* ``optimize_prior()`` end to end from a fresh fit, with the correction (the default for an
  exact full GGN: ``eigh``) and without it (``eigvalsh``), and the number of evidence
  evaluations it made.

Writes ``benchmarks/results/full_prior_tuning.json`` with the 1-minute load average of the
machine at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gaussify as gs

RESULTS = Path(__file__).resolve().parent / "results" / "full_prior_tuning.json"
#: (inputs, hidden, outputs) with P = (d + 1) h + (h + 1) k
SHAPES = {500: (3, 83, 2), 1500: (11, 107, 2), 3760: (19, 179, 1)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _problem(size: int, device: torch.device) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    d, h, k = SHAPES[size]
    gen = torch.Generator().manual_seed(size)
    model = nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, k)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) / p.shape[-1] ** 0.5)
    x = torch.randn(512, d, generator=gen, dtype=torch.float64)
    y = torch.randn(512, k, generator=gen, dtype=torch.float64)
    assert sum(p.numel() for p in model.parameters()) == size
    return model.to(device), x.to(device), y.to(device)


def run_size(size: int, repeats: int, device: torch.device) -> dict[str, Any]:
    model, x, y = _problem(size, device)

    def fitted(correction: bool) -> gs.Laplace:
        return gs.Laplace(model, "regression", structure="full", correction=correction).fit((x, y))

    la = fitted(True)
    ggn = la._curvature.ggn.double()
    out: dict[str, Any] = {"num_params": size, "shape": SHAPES[size]}
    out["eigvalsh_s"] = _median_time(lambda: torch.linalg.eigvalsh(ggn), repeats, device)
    out["eigh_s"] = _median_time(lambda: torch.linalg.eigh(ggn), repeats, device)
    shifted = ggn + torch.eye(size, dtype=ggn.dtype, device=ggn.device)
    out["cholesky_s"] = _median_time(lambda: torch.linalg.cholesky(shifted), repeats, device)
    for correction in (True, False):
        key = "with_correction" if correction else "at_map"
        fits = [fitted(correction) for _ in range(repeats)]
        runs = iter(fits)
        out[f"optimize_prior_{key}_s"] = _median_time(
            lambda runs=runs: next(runs).optimize_prior(), repeats, device
        )
        out[f"evaluations_{key}"] = fits[0].tuning_result.evaluations
        out[f"prior_{key}"] = float(fits[0].prior_precision)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=sorted(SHAPES), choices=SHAPES)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    load_start = os.getloadavg()[0]
    rows = []
    for size in args.sizes:
        rows.append(run_size(size, args.repeats, device))
        r = rows[-1]
        print(
            f"P={size}: eigvalsh {r['eigvalsh_s']:.3f} s, eigh {r['eigh_s']:.3f} s, cholesky "
            f"{r['cholesky_s']:.3f} s; optimize_prior {r['optimize_prior_with_correction_s']:.3f} "
            f"s (correction, eigh) / {r['optimize_prior_at_map_s']:.3f} s (at MAP, eigvalsh)",
            flush=True,
        )
    result = {
        "benchmark": "full_prior_tuning",
        "torch": torch.__version__,
        "platform": platform.platform(),
        "device": str(device),
        "threads": args.threads,
        "repeats": args.repeats,
        "load_1min_start": load_start,
        "load_1min_end": os.getloadavg()[0],
        "cases": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
