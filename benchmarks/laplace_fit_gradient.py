"""A Laplace fit's log-likelihood gradient folded into the diagonal's backward passes (issue 17),
side by side in ONE process:

    python benchmarks/laplace_fit_gradient.py [--threads 2] [--repeats 7] [--cases ...]
        [--device cpu] [--structure diag|kron]

``Laplace.fit`` needs J^T r (the evidence's non-MAP correction) besides the curvature. Since
issue 17 the diagonal's batched route adds it as one more vector of its own backward passes
(``chain_diag.GradientSink``); before, the fit ran a forward pass and an autograd backward
pass of its own per batch (``laplace_fit.outputs_and_gradient``). Per case (the models, data
and case names of ``curvature_fits.py``, and ``mnist``: the pipeline's CNN of
``laplace_vs_laplace_torch.py`` on 2,000 28 x 28 MNIST images; exact GGN, or the empirical
Fisher for the cases ending in ``/ef`` against laplace-torch's EF backends; all weights,
diagonal), after a warm-up, ``--repeats`` rounds time in turn: ``folded``
(``gs.Laplace(...).fit``), ``separate`` (the same fit with the sink withheld, so the gradient
takes its own pass: the code before), the
curvature alone (``fit_curvature``, what ``--fits`` times) and laplace-torch's
``Laplace(...).fit`` with its BackPack and ASDL backends (whose fit returns the loss and the
curvature, no gradient). Medians, per-round ratios, and in float64 the largest relative
difference of the two sides' gradients and of each against autograd's gradient of
sum_n log p(y_n | f_n). Writes ``benchmarks/results/laplace_fit_gradient.json``.

``--structure kron``: the same for KFAC, whose B factors' batched passes take r as one more
vector on the chain route (:mod:`gaussify.curvature.kron_gradient`); writes
``laplace_fit_gradient_kron.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import gaussify as gs
from gaussify.cli_args import add_device_argument
from gaussify.curvature import make_curvature
from gaussify.curvature.fitting import fit_curvature
from gaussify.weight_space import laplace_fit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import curvature_fits as cf  # noqa: E402

CASES = (
    "mlp/256/10",
    "mlp/32/10",
    "cnn/256/10",
    "cnn/32/10",
    "cnn/32/100",
    "mnist/256/10",
    "mnist/32/10",
    "mlp/256/10/ef",
    "cnn/256/10/ef",
    "cnn/32/10/ef",
    "mnist/256/10/ef",
)


def _laplace(
    model: Any, loader: DataLoader, folded: bool = True, ef: bool = False, structure: str = "diag"
) -> gs.Laplace:
    la = gs.Laplace(model, "classification", structure, "all", ef=ef)
    if folded:
        return la.fit(loader)
    real = laplace_fit._gradient_sink
    laplace_fit._gradient_sink = lambda *args: None  # the gradient's own pass, as before
    try:
        return la.fit(loader)
    finally:
        laplace_fit._gradient_sink = real


def _autograd_gradient(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y, reduction="sum").neg().backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _model(m: str, c: int) -> torch.nn.Module:
    """``curvature_fits``' models, or ``mnist``: the CNN of ``laplace_vs_laplace_torch.py``'s
    pipeline (2 conv + pooling on 28 x 28 images; its own seed)."""
    if m != "mnist":
        return cf.build_model(m, c).eval()
    import laplace_vs_laplace_torch as lvl

    torch.manual_seed(0)
    return lvl.build_model("cnn").eval()


def _data(m: str, c: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if m != "mnist":
        return cf.load_data(m, c, dtype, "cpu")
    ds = gs.data.load("mnist", seed=0, max_train=2000)
    return ds.x_train.to(dtype), ds.y_train.long()


def _state_diff(a: Any, b: Any) -> float:
    """The largest relative difference of two curvatures' tensors (their state dicts)."""
    sa, sb = a.state_dict(), b.state_dict()
    return max(_rel(sa[k], v) for k, v in sb.items() if isinstance(v, torch.Tensor) and v.any())


def run_case(
    name: str, repeats: int, device: torch.device, structure: str = "diag"
) -> dict[str, Any]:
    m, b, c, *flavour = name.split("/")
    ef = flavour == ["ef"]
    x, y = (t.to(device) for t in _data(m, int(c), torch.float32))
    loader = DataLoader(TensorDataset(x, y), batch_size=int(b))
    model = _model(m, int(c)).to(device)
    case = cf._case(m, int(b), int(c), structure, "ef" if ef else "ggn", "all")
    sides: dict[str, Callable[[], Any]] = {
        "folded": lambda: _laplace(model, loader, ef=ef, structure=structure),
        "separate": lambda: _laplace(model, loader, folded=False, ef=ef, structure=structure),
        "curvature_only": lambda: fit_curvature(
            make_curvature(structure, model, "classification", ef=ef), model, loader
        ),
    }
    for backend in ("BackPackGGN", "AsdlGGN"):
        own = _model(m, int(c)).to(device)  # BackPack's hooks: each its own model
        sides[backend] = lambda bk=backend, own=own: cf.backend_fit(case, bk, own, loader)
    unavailable = {}
    for key, fn in list(sides.items()):
        try:
            fn()
        except NotImplementedError as err:  # e.g. BackPack's KFAC of the empirical Fisher
            unavailable[key] = str(err)
            del sides[key]
    times = cf.alternating_rounds(sides, repeats)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = min((k for k in ("BackPackGGN", "AsdlGGN") if k in med), key=lambda k: med[k])

    def paired(num: str, den: str) -> float:
        return statistics.median(a / b for a, b in zip(times[num], times[den], strict=True))

    model64 = _model(m, int(c)).to(device, torch.float64)
    x64, y64 = (t.to(device) for t in _data(m, int(c), torch.float64))
    ld64 = DataLoader(TensorDataset(x64, y64), batch_size=int(b))
    folded = _laplace(model64, ld64, ef=ef, structure=structure)
    separate = _laplace(model64, ld64, folded=False, ef=ef, structure=structure)
    reference = _autograd_gradient(model64, x64, y64)
    return {
        "case": name,
        "median_s": med,
        "runs_s": times,
        "best_backend": best,
        "separate_over_folded": paired("separate", "folded"),
        "best_backend_over_folded": paired(best, "folded"),
        "best_backend_over_separate": paired(best, "separate"),
        "gradient_share_before": 1 - paired("curvature_only", "separate"),
        "rel_diff_f64_folded_vs_separate": _rel(folded._grad, separate._grad),
        "rel_diff_f64_folded_vs_autograd": _rel(folded._grad, reference),
        "rel_diff_f64_curvature": _state_diff(folded._curvature, separate._curvature),
        "unavailable": unavailable,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    add_device_argument(parser)
    parser.add_argument("--structure", choices=("diag", "kron"), default="diag")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.out is None:
        suffix = "" if args.structure == "diag" else f"_{args.structure}"
        args.out = ROOT / f"benchmarks/results/laplace_fit_gradient{suffix}.json"
    torch.set_num_threads(args.threads)
    import warnings

    warnings.filterwarnings("ignore")
    load_start = list(os.getloadavg())
    rows = []
    for name in args.cases:
        row = run_case(name, args.repeats, args.device, args.structure)
        rows.append(row)
        print(
            f"{name:12s} folded {row['median_s']['folded']:.4f}s separate "
            f"{row['median_s']['separate']:.4f}s ({row['separate_over_folded']:.2f}x) "
            f"{row['best_backend']} {row['median_s'][row['best_backend']]:.4f}s: "
            f"{row['best_backend_over_folded']:.2f}x (was {row['best_backend_over_separate']:.2f}x)"
            f"  grad diff {row['rel_diff_f64_folded_vs_autograd']:.1e}",
            flush=True,
        )
    payload = {
        "benchmark": "laplace_fit_gradient",
        "settings": {
            "threads": args.threads,
            "repeats": args.repeats,
            "structure": args.structure,
            "device": str(args.device),
            "torch": torch.__version__,
            "load_average_start": load_start,
            "load_average_end": list(os.getloadavg()),
        },
        "results": rows,
    }
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
