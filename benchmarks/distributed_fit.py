"""Laplace fit on 1, 2 and 4 gloo processes (CPU): fit time, communication time, speed-up.

    python benchmarks/distributed_fit.py [--worlds 1 2 4] [--dataset fashion_mnist]

Data: the training split of a bundled image set (default the vendored ``fashion_mnist``,
8,333 images; ``fashion_mnist_full`` (60,000) when its files are installed), float64, in
batches of 256, sharded with :func:`gaussify.distributed.shard` (no padding). Model: an MLP
784-128-128-10 (tanh, P = 118,282) at a seeded initialisation (the fit's cost does not depend
on the weights). Structures: ``kron`` and ``diag`` over all parameters, ``full`` over the
last layer (P = 1,290). Every process runs with one thread (``OMP_NUM_THREADS=1``), so K processes
need K cores to scale.

Per world size K (``torch.multiprocessing.spawn``, gloo on 127.0.0.1) and structure, each rank
records, after a barrier: the wall time of ``Laplace.fit``, the time inside gaussify's
collectives split into ``wait`` (the status exchange, which also absorbs load imbalance) and
``comm`` (the payload all-reduce after every rank has arrived), and the bytes it reduced. The
table reports the slowest rank's fit time, the speed-up T_1 / T_K, the communication time, and
the largest difference of the log marginal likelihood from the one-process run (a correctness
check). Because the machine may be shared, it also records each rank's CPU time of the fit
(``time.process_time``): ``cpu-spd`` = CPU time of one process / (busiest rank's CPU time +
communication) is the speed-up the same run would have with a dedicated core per rank.
Writes ``benchmarks/results/distributed_fit.json`` and ``docs/figures/distributed_speedup.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

import gaussify as gs  # noqa: E402
from gaussify import data as gdata  # noqa: E402
from gaussify import distributed  # noqa: E402
from gaussify.cli_args import add_device_argument, synchronize  # noqa: E402

CASES = (("kron", "all"), ("diag", "all"), ("full", "last_layer"))
BATCH = 256


def _model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return (
        nn.Sequential(
            nn.Flatten(),
            nn.Linear(784, 128),
            nn.Tanh(),
            nn.Linear(128, 128),
            nn.Tanh(),
            nn.Linear(128, 10),
        )
        .double()
        .to(device)
    )


def _worker(rank: int, world: int, port: int, dataset: str, out: str, device: str = "cpu") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    ds = gdata.load(dataset, seed=0)
    x, y = distributed.shard(ds.x_train.double(), ds.y_train)
    x, y = x.to(device), y.to(device)
    # warm-up (torch.func / hooks first-call costs) on one batch, without communication
    with distributed.local():
        for structure, subset in CASES:
            la = gs.Laplace(_model(device), "classification", structure, subset)
            la.fit((x[:BATCH], y[:BATCH]))
    rows = []
    for structure, subset in CASES:
        la = gs.Laplace(_model(device), "classification", structure, subset, prior_precision=1.0)
        distributed.barrier(600)
        distributed.reset_comm_stats()
        start, cpu = time.perf_counter(), time.process_time()
        la.fit((x, y), batch_size=BATCH)
        synchronize(torch.device(device))
        fit_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu
        stats = distributed.comm_stats()
        rows.append(
            {
                "structure": structure,
                "subset": subset,
                "num_params": la.subset.num_params,
                "rank": rank,
                "shard": int(x.shape[0]),
                "fit_s": fit_s,
                "cpu_s": cpu_s,
                "wait_s": stats.wait_s,
                "comm_s": stats.comm_s,
                "bytes": stats.bytes,
                "lml": float(la.log_marginal_likelihood()),
                "num_data": la.num_data,
            }
        )
    Path(out, f"{world}_{rank}.json").write_text(json.dumps(rows))
    if world > 1:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def plot(report: dict[str, Any], path: Path) -> Path:
    """Speed-up and communication share vs processes, one line per structure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    worlds = sorted({r["world"] for r in report["rows"]})
    ax1.plot(worlds, worlds, "k:", label="ideal")
    for structure, subset in CASES:
        rows = [r for r in report["rows"] if (r["structure"], r["subset"]) == (structure, subset)]
        label = f"{structure} ({subset}, P={rows[0]['num_params']})"
        (line,) = ax1.plot(
            [r["world"] for r in rows], [r["speedup"] for r in rows], "o-", label=label
        )
        if "cpu_speedup" in rows[0]:
            ax1.plot(
                [r["world"] for r in rows],
                [r["cpu_speedup"] for r in rows],
                "s--",
                color=line.get_color(),
                alpha=0.6,
            )
        multi = [r for r in rows if r["world"] > 1]
        ax2.plot(
            [r["world"] for r in multi],
            [1e3 * r["comm_s"] for r in multi],
            "o-",
            label=label,
        )
    ax1.set(
        xlabel="processes (gloo, 1 thread each)",
        ylabel="speed-up: wall (solid), CPU-time (dashed)",
    )
    ax2.set(xlabel="processes", ylabel="payload all-reduce time (ms)", yscale="log")
    ax1.set_xticks(worlds)
    ax2.set_xticks(worlds)
    cpus = report["machine"]["cpus"]
    load = report["machine"]["load_avg_at_end"][0]
    ax1.set_title(
        f"{report['dataset']} (N={report['n_train']}), {cpus} CPU cores, load {load:.0f}",
        fontsize=9,
    )
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--dataset", default="fashion_mnist")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/distributed_fit.json"))
    parser.add_argument("--figure", default=str(ROOT / "docs/figures/distributed_speedup.png"))
    parser.add_argument("--plot-only", action="store_true", help="redraw from --out")
    add_device_argument(parser)  # every rank uses it (gloo backend)
    args = parser.parse_args(argv)
    if args.plot_only:
        print(plot(json.loads(Path(args.out).read_text()), Path(args.figure)))
        return 0
    tmp = Path(args.out).with_suffix(".parts")
    tmp.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for world in args.worlds:
        start = time.perf_counter()
        mp.spawn(
            _worker,
            args=(world, _free_port(), args.dataset, str(tmp), str(args.device)),
            nprocs=world,
        )
        ranks = [json.loads((tmp / f"{world}_{r}.json").read_text()) for r in range(world)]
        results[str(world)] = {"ranks": ranks, "launch_s": time.perf_counter() - start}
    rows = []
    base: dict[str, dict[str, float]] = {}
    for world in args.worlds:
        ranks = results[str(world)]["ranks"]
        for i, (structure, subset) in enumerate(CASES):
            per_rank = [r[i] for r in ranks]
            fit = max(r["fit_s"] for r in per_rank)
            row = {
                "world": world,
                "structure": structure,
                "subset": subset,
                "num_params": per_rank[0]["num_params"],
                "fit_s": fit,
                "cpu_s": max(r["cpu_s"] for r in per_rank),
                "comm_s": max(r["comm_s"] for r in per_rank),
                "wait_s": max(r["wait_s"] for r in per_rank),
                "bytes_per_rank": per_rank[0]["bytes"],
                "lml": per_rank[0]["lml"],
                "lml_rank_spread": max(r["lml"] for r in per_rank)
                - min(r["lml"] for r in per_rank),
                "num_data": per_rank[0]["num_data"],
            }
            key = f"{structure}/{subset}"
            if world == args.worlds[0]:
                base[key] = {"fit_s": fit, "lml": row["lml"], "cpu_s": row["cpu_s"]}
            row["speedup"] = base[key]["fit_s"] / fit
            # with a dedicated core per rank: the busiest rank's CPU time plus communication
            row["cpu_speedup"] = base[key]["cpu_s"] / (row["cpu_s"] + row["comm_s"])
            row["lml_diff_vs_first"] = abs(row["lml"] - base[key]["lml"])
            rows.append(row)
    header = f"{'K':>2} {'structure':<16}{'P':>8}{'fit s':>9}{'comm s':>9}{'wait s':>9}"
    print(header + f"{'MB/rank':>9}{'speedup':>9}{'cpu-spd':>9}{'|dLML|':>10}")
    for r in rows:
        print(
            f"{r['world']:>2} {r['structure'] + '/' + r['subset']:<16}{r['num_params']:>8}"
            f"{r['fit_s']:>9.2f}{r['comm_s']:>9.4f}{r['wait_s']:>9.2f}"
            f"{r['bytes_per_rank'] / 1e6:>9.2f}{r['speedup']:>9.2f}{r['cpu_speedup']:>9.2f}"
            f"{r['lml_diff_vs_first']:>10.2e}"
        )
    report = {
        "dataset": args.dataset,
        "n_train": rows[0]["num_data"],
        "model": "MLP 784-128-128-10 (tanh), float64, seeded init",
        "batch_size": BATCH,
        "backend": "gloo (127.0.0.1), torch.multiprocessing.spawn, 1 thread per process",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "load_avg_at_end": os.getloadavg(),
        },
        "rows": rows,
        "raw": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=2))
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    print(f"wrote {args.out} and {plot(report, Path(args.figure))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
