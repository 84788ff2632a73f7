"""A/B of the per-batch fixed cost of the diagonal and KFAC fits (issue 17): main's code vs
this checkout's, and laplace-torch's BackPack / ASDL backends, in ONE process.

    python benchmarks/fit_syncs_ab.py --baseline /path/to/main/src [--threads 2] [--repeats 7]
        [--cases mlp/256/10/diag/ef ...] [--device cpu] [--row-loader] [--out FILE]

Both versions of the package are imported in this process under the name ``gaussify`` (their
module tables swapped in ``sys.modules`` before each call, outside the timed region). Per
case (the case names and builders of ``curvature_fits.py``), after a warm-up fit of each
side, ``--repeats`` rounds time in turn the baseline's fit (its ``fit_curvature`` where it
has one, else a bare ``update`` loop, as its benchmark ran it), this checkout's fit
(``curvature_fits.gaussify_fit``: ``fit_curvature``, checks tested once per fit), with
``--row-loader`` also this checkout's fit with the DataLoader read row by row as main reads
it (``batches._tensor_loader`` off: what the curvature code alone gained) and each
laplace-torch backend; medians, ratios (best backend / each side; ``paired``: the median over
rounds of each round's best-backend / side ratio, robust to the load changing between
rounds), the host syncs per fit of each side (``aten::_local_scalar_dense`` calls, counted
by ``gaussify.host_syncs.HostSyncs`` on a fit of the timed batches and of twice as many) and
the largest relative difference of the two sides' values in float64 (Monte Carlo: both from
the same global seed; the draws are the same). Writes ``benchmarks/results/fit_syncs_ab.json``
(or ``--out``) with the load average before and after.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
CASES = (
    "mlp/256/10/diag/ef",
    "mlp/256/2/kron/ggn",
    "cnn/32/10/diag/ggn",
    "cnn/32/100/diag/ggn",
    "cnn/32/100/kron/ggn",
)


def _load(src: str) -> dict[str, Any]:
    """Import the package from ``src`` and return its module table."""
    for key in [k for k in sys.modules if k == "gaussify" or k.startswith("gaussify.")]:
        del sys.modules[key]
    sys.path.insert(0, src)
    import gaussify
    import gaussify.curvature  # noqa: F401

    sys.path.remove(src)
    return _table()


def _table() -> dict[str, Any]:
    return {k: v for k, v in sys.modules.items() if k == "gaussify" or k.startswith("gaussify.")}


def _activate(table: dict[str, Any]) -> None:
    for key in [k for k in sys.modules if k == "gaussify" or k.startswith("gaussify.")]:
        del sys.modules[key]
    sys.modules.update(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="src folder of the baseline")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--device", default="cpu", help="cpu or cuda (models and data there)")
    parser.add_argument(
        "--row-loader",
        action="store_true",
        help="also time this checkout's fit with a DataLoader read row by row (as main)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/fit_syncs_ab.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import warnings

    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    base = _load(args.baseline)
    ours = _load(str(ROOT / "src"))
    # the one host-read counter, this checkout's (it counts either side's reads)
    from gaussify.host_syncs import HostSyncs

    ours.update(_table())
    import curvature_fits as cf  # imports this checkout's package (active now)

    load_start = list(os.getloadavg())
    rows = []
    for name in args.cases:
        m, b, c, s, fl = name.split("/")
        case = cf._case(m, int(b), int(c), s, fl, "all")
        dev = args.device
        x, y = cf.load_data(m, int(c), torch.float32, dev)
        loader = DataLoader(TensorDataset(x, y), batch_size=int(b))
        model = cf.build_model(m, int(c)).to(dev).eval()

        def base_fit(mdl: Any, ld: Any, s: str = s, fl: str = fl) -> Any:
            _activate(base)
            from gaussify.curvature import make_curvature

            options: dict[str, Any] = {"ef": fl == "ef"}
            if fl == "mc":
                options["mc_samples"] = 1
            if s == "kron":
                options["kron_bias"] = "separate"
            curv = make_curvature(s, mdl, "classification", "all", **options)
            try:  # the baseline's own fit (checks tested once per fit), where it has one
                from gaussify.curvature.fitting import fit_curvature
            except ImportError:  # older baselines: the bare update loop
                for xb, yb in ld:
                    curv.update(mdl, xb, yb)
                return curv
            return fit_curvature(curv, mdl, ld)

        def our_fit(mdl: Any, ld: Any, case: dict[str, Any] = case) -> Any:
            _activate(ours)
            return cf.gaussify_fit(case, mdl, ld)

        def our_fit_row_loader(mdl: Any, ld: Any, case: dict[str, Any] = case) -> Any:
            # this checkout's fit with the loader iterated row by row, as main does
            _activate(ours)
            batches = sys.modules["gaussify.batches"]
            fast = batches._tensor_loader
            batches._tensor_loader = lambda data: False
            try:
                return cf.gaussify_fit(case, mdl, ld)
            finally:
                batches._tensor_loader = fast

        backends = ["BackPackGGN", "AsdlGGN"] + (["CurvlinopsGGN"] if s == "kron" else [])
        sides: dict[str, Callable[[], Any]] = {
            "main": functools.partial(base_fit, model, loader),
            "ours": functools.partial(our_fit, model, loader),
        }
        if args.row_loader:
            sides["ours_row_loader"] = functools.partial(our_fit_row_loader, model, loader)
        for bk in backends:  # each on its own (identically seeded) model: BackPack's hooks
            own = cf.build_model(m, int(c)).to(dev).eval()
            sides[bk] = functools.partial(cf.backend_fit, case, bk, own, loader)
        for key, fn in sides.items():  # warm-up (the lazily imported modules of each side)
            fn()
            if key == "main":
                base.update(_table())
            elif key == "ours":
                ours.update(_table())
        times = cf.alternating_rounds(sides, args.repeats)
        med = {k: statistics.median(v) for k, v in times.items()}
        low = {k: min(v) for k, v in times.items()}
        best = min(backends, key=lambda k: med[k])
        syncs = {}
        for key, fit in (("main", base_fit), ("ours", our_fit)):
            counts = []
            for rep in (1, 2):
                ld = DataLoader(
                    TensorDataset(x.repeat(rep, *[1] * (x.ndim - 1)), y.repeat(rep)),
                    batch_size=int(b),
                )
                with HostSyncs() as mode:
                    fit(model, ld)
                counts.append(mode.count)
            syncs[key] = {"batches": [len(loader), 2 * len(loader)], "syncs": counts}
        model64 = cf.build_model(m, int(c)).to(dev, torch.float64).eval()
        x64, y64 = cf.load_data(m, int(c), torch.float64, dev)
        ld64 = DataLoader(TensorDataset(x64, y64), batch_size=int(b))
        torch.manual_seed(0)  # Monte Carlo: the same global stream for both sides' draws
        v_main = cf.gaussify_values(case, base_fit(model64, ld64))
        torch.manual_seed(0)
        v_ours = cf.gaussify_values(case, our_fit(model64, ld64))
        diff = float((v_main - v_ours).abs().max() / v_main.abs().max())
        row = {
            "case": name,
            "median_s": med,
            "min_s": low,
            "ratio_main_min": low[best] / low["main"],
            "ratio_ours_min": low[best] / low["ours"],
            "runs_s": times,
            "best_backend": best,
            "ratio_main": med[best] / med["main"],
            "ratio_ours": med[best] / med["ours"],
            "ratio_ours_row_loader": (
                med[best] / med["ours_row_loader"] if "ours_row_loader" in med else None
            ),
            "ours_over_main_speedup": med["main"] / med["ours"],
            # per round (the sides of one round ran back to back): robust to the load
            # changing between rounds, where the medians of each side may mix regimes
            "paired": {
                f"ratio_{key}": statistics.median(
                    t_best / t for t_best, t in zip(times[best], times[key], strict=True)
                )
                for key in sides
                if key not in backends
            },
            "syncs_per_fit": syncs,
            "max_rel_diff_f64_main_vs_ours": diff,
        }
        rows.append(row)
        print(
            f"{name:24s} main {med['main']:.4f}s ours {med['ours']:.4f}s {best} "
            f"{med[best]:.4f}s  ratio main {row['ratio_main']:.2f}x ours "
            f"{row['ratio_ours']:.2f}x"
            + (
                f" (row loader {row['ratio_ours_row_loader']:.2f}x)"
                if row["ratio_ours_row_loader"]
                else ""
            )
            + f"  syncs main {syncs['main']['syncs']} ours "
            f"{syncs['ours']['syncs']}  diff {diff:.1e}",
            flush=True,
        )
        payload = {
            "benchmark": "fit_syncs_ab",
            "settings": {
                "threads": args.threads,
                "repeats": args.repeats,
                "baseline": args.baseline,
                "device": args.device,
                "torch": torch.__version__,
                "load_average_start": load_start,
                "load_average_end": list(os.getloadavg()),
                "cpus": os.cpu_count(),
            },
            "results": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
