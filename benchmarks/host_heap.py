"""Page faults and time of CPU curvature fits in a fresh process, with and without
``gaussify.host_heap.keep_freed_memory`` (issue 17).

    python benchmarks/host_heap.py [--threads 2] [--rounds 3] [--fits 5] [--cases ...]
        [--device cpu] [--out FILE]

glibc's ``malloc`` maps a block above its mmap threshold (128 KiB until the process frees a
larger mapped block) afresh and trims its heap's free top above twice that threshold, so a
chunked pass that frees its few-megabyte temporaries after every chunk touches fresh pages
(minor page faults, zeroed by the kernel) in every chunk of a fresh process.
``keep_freed_memory`` (called where the memory rule splits a pass into chunks) frees one
untouched block of twice the rule's allowance first. Per case (the cases of
``curvature_fits.py``) and round, two fresh subprocesses in turn (``on``: as shipped; ``off``:
``keep_freed_memory`` replaced by a no-op before anything runs) each run one warm-up fit and
``--fits`` timed fits, recording per fit the wall time and the minor page faults
(``getrusage``); medians over the fits, then over the rounds (the machine's speed drifts between
processes: the fault counts are the stable measure, the ratio of times per round the comparable
one). Writes ``benchmarks/results/host_heap.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "host_heap.json"
CASES = (
    "cnn/256/10/diag/ggn",
    "cnn/256/10/kron/ggn",
    "cnn/256/2/diag/ggn",
    "cnn/256/10/diag/ef",
    "cnn/32/10/diag/ggn",
    "mlp/256/100/diag/ggn",
)


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One fresh process: ``spec["side"]`` ``off`` disables the heap preparation."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import curvature_fits as cf

    if spec["side"] == "off":
        import gaussify.curvature.batched_backward as bb

        bb.keep_freed_memory = lambda nbytes, device: None  # type: ignore[assignment]
    torch.set_num_threads(spec["threads"])
    model_name, batch, classes, structure, flavour = spec["case"].split("/")
    case = cf._case(model_name, int(batch), int(classes), structure, flavour, "all")
    x, y = cf.load_data(model_name, int(classes), torch.float32, "cpu")
    loader = DataLoader(TensorDataset(x, y), batch_size=int(batch))
    model = cf.build_model(model_name, int(classes)).eval()
    cf.gaussify_fit(case, model, loader)  # warm-up
    times, faults = [], []
    for _ in range(spec["fits"]):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        cf.gaussify_fit(case, model, loader)
        times.append(time.perf_counter() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return {"time_s": statistics.median(times), "faults": statistics.median(faults)}


def run_side(case: str, side: str, args: argparse.Namespace) -> dict[str, Any]:
    spec = {"case": case, "side": side, "threads": args.threads, "fits": args.fits}
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fits", type=int, default=5)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--device", choices=["cpu"], default="cpu", help="the C heap is the host's: cpu only"
    )
    parser.add_argument("--worker", type=str, default=None)
    args = parser.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    start, load_start = time.perf_counter(), os.getloadavg()
    results = []
    for case in args.cases:
        rounds = []
        for r in range(args.rounds):
            order = ("on", "off") if r % 2 == 0 else ("off", "on")
            rounds.append({side: run_side(case, side, args) for side in order})
        ratio = statistics.median(x["off"]["time_s"] / x["on"]["time_s"] for x in rounds)
        row = {
            "case": case,
            "rounds": rounds,
            "faults_on": statistics.median(x["on"]["faults"] for x in rounds),
            "faults_off": statistics.median(x["off"]["faults"] for x in rounds),
            "time_on_s": statistics.median(x["on"]["time_s"] for x in rounds),
            "time_off_s": statistics.median(x["off"]["time_s"] for x in rounds),
            "speedup_off_over_on": ratio,
        }
        results.append(row)
        print(
            f"{case:24s} faults/fit {row['faults_off']:>8.0f} -> {row['faults_on']:>6.0f}  "
            f"time {row['time_off_s']:.4f} -> {row['time_on_s']:.4f} s  x{ratio:.2f}",
            flush=True,
        )
    out = {
        "benchmark": "host_heap",
        "settings": {"threads": args.threads, "rounds": args.rounds, "fits": args.fits},
        "load_average_start": list(load_start),
        "load_average_end": list(os.getloadavg()),
        "runtime_s": round(time.perf_counter() - start, 1),
        "results": results,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
