"""What a fit's time is made of on a GPU: kernel launches and their device time, per batch.

    python benchmarks/gpu_launches.py --device cuda [--cases cnn/32/10/diag/ggn ...]
        [--backends BackPackGGN AsdlGGN] [--repeats 3] [--label main] [--out FILE]

For each case of the fits table (``curvature_fits.cases``; the same models, data, batches and
float32 fits) and each side (gaussify's ``fit_curvature`` and the named laplace-torch
backends, each on a fresh, identically seeded model): the fit's wall time (median of
``--repeats`` alternating rounds, CUDA work waited for), then one profiled fit
(``torch.profiler``): the device kernels launched (CUDA events: kernels and copies), the sum of
their device times, and the operators dispatched on the host, each per batch. Where the wall
time is far above the kernels' device time, the fit is bound by launching them (the host's
per-operator cost), not by arithmetic: the fewer launches per batch, the faster.

On the CPU the same script reports the dispatched operators alone (no device kernels).
``--label`` names the code measured (e.g. a baseline run with ``PYTHONPATH`` pointing at an
older ``src``). Writes ``benchmarks/results/gpu_launches.json`` unless ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import curvature_fits as cf

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu_launches.json"
DEFAULT_CASES = [
    "cnn/32/10/diag/ggn",
    "cnn/256/10/diag/ggn",
    "cnn/32/10/kron/ggn",
    "mlp/32/100/kron/ggn",
    "mlp/256/10/full/ggn/last_layer",
    "cnn/256/10/full/ggn/last_layer",
]


def profile_fit(fit: Any) -> dict[str, float]:
    """One profiled call of ``fit``: device kernels (count, summed device seconds) and host
    operators (count)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    cf._sync()
    with profile(activities=activities) as prof:
        fit()
        cf._sync()
    kernels, device_us, host_ops = 0, 0.0, 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            device_us += getattr(event, "device_time", None) or getattr(event, "cuda_time", 0.0)
        elif event.name.startswith("aten::"):
            host_ops += 1
    return {"kernels": kernels, "device_s": device_us * 1e-6, "host_ops": host_ops}


def run_case(name: str, backends: list[str], device: str, repeats: int) -> dict[str, Any]:
    case = case_from_name(name)
    x, y = cf.load_data(case["model"], case["classes"], torch.float32, device)
    loader = DataLoader(TensorDataset(x, y), batch_size=case["batch"])
    batches = len(loader)
    warm = DataLoader(TensorDataset(x[: case["batch"]], y[: case["batch"]]), case["batch"])
    fits: dict[str, Any] = {}
    for side in ["gaussify", *backends]:
        model = cf.build_model(case["model"], case["classes"]).to(device).eval()
        if side == "gaussify":

            def fit(m=model, over=loader):  # type: ignore[no-untyped-def]
                return cf.gaussify_fit(case, m, over)
        else:

            def fit(m=model, over=loader, b=side):  # type: ignore[no-untyped-def]
                return cf.backend_fit(case, b, m, over)

        fit(over=warm)
        fits[side] = fit
    times = cf.alternating_rounds(fits, repeats)
    out: dict[str, Any] = {"case": case, "batches": batches, "sides": {}}
    for side, fit in fits.items():
        prof = profile_fit(fit)
        wall = statistics.median(times[side])
        out["sides"][side] = {
            "wall_s": wall,
            "wall_runs_s": times[side],
            "kernels_per_batch": prof["kernels"] / batches,
            "device_s": prof["device_s"],
            "host_ops_per_batch": prof["host_ops"] / batches,
            "wall_us_per_kernel": 1e6 * wall / prof["kernels"] if prof["kernels"] else None,
        }
    return out


def case_from_name(name: str) -> dict[str, Any]:
    parts = name.split("/")
    subset = "last_layer" if parts[-1] == "last_layer" else "all"
    model, batch, classes, structure, flavour = parts[:5]
    return cf._case(model, int(batch), int(classes), structure, flavour, subset)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES)
    parser.add_argument("--backends", nargs="*", default=["BackPackGGN", "AsdlGGN"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--label", default="main")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.cases:
        row = run_case(name, args.backends, args.device, args.repeats)
        rows.append(row)
        line = [f"{name:34s}"]
        for side, r in row["sides"].items():
            line.append(
                f"{side[:8]:>8s} {1e3 * r['wall_s']:8.1f} ms {r['kernels_per_batch']:7.1f} k/b "
                f"{1e3 * r['device_s']:7.1f} ms dev {r['host_ops_per_batch']:7.1f} ops/b"
            )
        print(" | ".join(line), flush=True)
        write(args, rows)


def write(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    settings = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": args.threads,
        "repeats": args.repeats,
        "label": args.label,
    }
    payload = {"benchmark": "gpu_launches", "settings": settings, "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
