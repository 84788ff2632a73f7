"""Memory benchmark: peak memory of Laplace fits under the memory rule.

    python benchmarks/memory.py [--quick] [--threads 1] [--allocators live default]

The memory rule (issue 17, replacing the weight-space issue's "within 2x of the curvature's
own storage", which no method can meet when one batch of activations exceeds the storage): a
fit's peak memory <= 2 x (one training step's peak on the same batch + the curvature's storage,
the bytes of the tensors in its ``state_dict``). Cases: diag and last-layer fits on a
1000-class linear head over 512 features and on a 10^5-parameter MLP. The judged ratios are
``rule_curvature`` = curvature-fit peak / (training-step peak + storage) and ``rule_laplace``
= (``Laplace.fit`` peak - its 3 P vectors) / (training-step peak + storage), both above the
same start; the old storage-only ratios stay in the JSON for reference.

Cases (float32, batch size 256, the library defaults otherwise):

* ``head``: ``nn.Linear(512, 1000)`` on N = 2000 random 512-dimensional features (the output of
  a frozen feature extractor) with 1000-class labels, subset "last_layer" (P = 513,000):
  diag and kron, each exact (GGN) and Monte Carlo with one sampled label (``mc_samples=1``).
  Exact diag would need C = 1000 backward directions per sample on a generic Jacobian path;
  the last-layer path needs only the features and diag(Lambda). full is skipped: its P x P
  storage alone would be 2.6e11 entries (1 TB in float32).
* ``mlp``: 784-120-84-10 (ReLU; 105,214 parameters) on the bundled MNIST training inputs
  (7000 x 784, flattened): diag and kron over all weights, full and kron on the last layer
  (P = 850). The last-layer kron factors hold only 85^2 + 10^2 numbers (29 KiB, the output
  factor B in float64), less than one batch of inputs (256 x 784 floats, 784 KiB) and below
  the RSS noise of about 100 KiB: the RSS cannot resolve its ratio (``measurable``: storage of
  at least 256 KiB), so it is judged by the exact allocator measurement below.

Each case runs in a fresh subprocess. The worker builds the model and data, trains one SGD
epoch over the same batches (the timing reference), warms up every code path on a tiny model
of the same kind and then on the first two batches of the real one (lazy imports, thread pools,
vmap and BLAS workspaces are one-time costs), returns freed heap memory to the system
(``malloc_trim``), and then measures three phases, each from a reset RSS high-water mark
(``/proc/self/clear_refs`` 5, then ``VmHWM`` in ``/proc/self/status`` minus ``VmRSS`` before the
phase; tracemalloc does not see torch's allocations):

1. *floor*: one pass over the batches with the forward pass only (what any method pays for
   batching the data and running the network); for context the peak of one SGD epoch
   (forward, backward, step: the memory of plain training) is recorded too;
2. *curvature*: ``make_curvature(...)`` and ``update`` over the batches (the curvature's fit);
3. *Laplace*: ``Laplace(...).fit(...)`` (curvature, log-likelihood and its gradient), whose
   own state besides the curvature is the mean, the expansion point and the gradient (3 P).

Each phase runs three times, interleaved, and the minimum peak is kept (the phases are
deterministic; allocator and interpreter noise, about 100 KiB, only adds). Ratios (target
<= 2): ``curvature``: (peak of phase 2 - floor) / storage; ``laplace``: (peak of phase 3 -
floor - Laplace's vectors) / storage; ``raw``: peak of phase 3 / storage.

Exact allocator measurement: each phase runs once more under ``torch.profiler`` with
``profile_memory=True``, whose allocation and free events give the live bytes of torch's
CPU allocator exactly (no page granularity, no interpreter or allocator noise): the
``*_alloc`` peaks and ``ratio_*_alloc`` ratios, same formulas. They are what decides a case
whose storage is below the RSS resolution; the others are held to the target by the RSS
ratios (the allocator ratios are reported beside them).

Allocators: ``live`` runs the worker with glibc's mmap threshold fixed at 64 KiB
(``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=65536``), so a freed tensor leaves the RSS and the
high-water mark measures live memory; ``default`` keeps glibc's dynamic threshold, under which
freed blocks stay in the heap for reuse and count in the RSS (an upper bound that depends on
allocation order). The table and figure use ``live``; both are in the JSON.

Timings (the fastest of the three runs): fit (phase 3) over one SGD epoch (forward, backward,
step over the same batches), and the GLM predictive (probit) on test points: 64 for the head
(its (64, 1000, 1000) output covariance is 256 MB; the generic Jacobian path would need a
(64, 1000, 513000) Jacobian, 131 GB), 200 for the MLP (whose all-weights predictive takes the
generic Jacobian path).

Writes ``benchmarks/results/memory.json`` and ``benchmarks/results/memory.png``, prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

try:
    import gaussify as gs
except ModuleNotFoundError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import gaussify as gs

from gaussify.batches import as_batches
from gaussify.curvature import make_curvature

sys.path.insert(0, str(Path(__file__).resolve().parent))
from curvature_fits import alloc_peak

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BATCH_SIZE = 256
HEAD_FEATURES, HEAD_CLASSES, HEAD_N = 512, 1000, 2000
HEAD_TEST, MLP_TEST = 64, 200
TARGET = 2.0
REPEATS = 3
MEASURABLE_BYTES = 2**18  # storage below this is within the noise of an RSS measurement
ALLOCATOR_ENV = {
    "live": {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"},
    "default": {},
}
T = TypeVar("T")


@dataclass(frozen=True)
class Case:
    model: str  # "head" | "mlp"
    structure: str
    subset: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        extra = "".join(f",{k}={v}" for k, v in self.options.items())
        return f"{self.model}/{self.structure}/{self.subset}{extra}"


CASES = [
    Case("head", "diag", "last_layer"),
    Case("head", "diag", "last_layer", {"mc_samples": 1}),
    Case("head", "kron", "last_layer"),
    Case("head", "kron", "last_layer", {"mc_samples": 1}),
    Case("mlp", "diag", "all"),
    Case("mlp", "kron", "all"),
    Case("mlp", "full", "last_layer"),
    Case("mlp", "kron", "last_layer"),
]
SKIPPED = [
    {
        "case": "head/full/last_layer",
        "reason": "P = 513,000 parameters: the dense P x P curvature alone would be 2.6e11 "
        "entries (1.05 TB in float32); use diag, kron or lowrank for a 1000-class head",
    }
]


# ----------------------------------------------------------------------------- models and data


def build(name: str) -> tuple[nn.Module, Tensor, Tensor, Tensor]:
    """(model, x_train, y_train, x_test), seeded."""
    torch.manual_seed(0)
    if name == "head":
        g = torch.Generator().manual_seed(0)
        model = nn.Linear(HEAD_FEATURES, HEAD_CLASSES)
        x = torch.randn(HEAD_N + HEAD_TEST, HEAD_FEATURES, generator=g)
        y = torch.randint(0, HEAD_CLASSES, (HEAD_N,), generator=g)
        return model, x[:HEAD_N], y, x[HEAD_N:]
    if name == "mlp":
        ds = gs.data.load("mnist", seed=0)
        model = nn.Sequential(
            nn.Linear(784, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10)
        )
        return model, ds.x_train.flatten(1), ds.y_train, ds.x_test.flatten(1)[:MLP_TEST]
    raise ValueError(f"model: expected 'head' or 'mlp', got {name!r}")


def tiny(name: str) -> tuple[nn.Module, Tensor, Tensor]:
    """A small model of the same kind for the warm-up."""
    g = torch.Generator().manual_seed(1)
    if name == "head":
        model: nn.Module = nn.Linear(8, 5)
        x = torch.randn(40, 8, generator=g)
    else:
        model = nn.Sequential(
            nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)
        )
        x = torch.randn(40, 6, generator=g)
    num_classes = 5 if name == "head" else 3
    return model.eval(), x, torch.randint(0, num_classes, (40,), generator=g)


def gradient_epoch(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Seconds for one SGD epoch (forward, cross-entropy, backward, step) over the batches."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    start = time.perf_counter()
    for xb, yb in as_batches((x, y), batch_size=BATCH_SIZE):
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    seconds = time.perf_counter() - start
    opt.zero_grad(set_to_none=True)  # so that a measured epoch allocates its gradients
    return seconds


# ----------------------------------------------------------------------------- measurement


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _release() -> None:
    """Collect garbage and hand freed heap memory back to the system (glibc ``malloc_trim``)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def measured(fn: Callable[[], T]) -> tuple[T, int, float]:
    """(result, peak RSS increase in bytes, seconds) of ``fn()`` from a reset high-water mark."""
    _release()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
    base = _status_kib("VmRSS")
    start = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - start
    return out, (_status_kib("VmHWM") - base) * 1024, seconds


def allocated(fn: Callable[[], T]) -> tuple[T, int]:
    """(result, peak of torch's live CPU allocations above the start, in bytes) of ``fn()``
    after returning freed heap memory: ``curvature_fits.alloc_peak`` (the profiler's
    allocation / free events; exact, deterministic), the measurement both benchmarks share."""
    _release()
    return alloc_peak(fn)


def tensor_bytes(tensors: Any) -> int:
    values = tensors.values() if isinstance(tensors, dict) else tensors
    return sum(t.numel() * t.element_size() for t in values if isinstance(t, Tensor))


def fit_curvature(case: Case, model: nn.Module, x: Tensor, y: Tensor) -> Any:
    curvature = make_curvature(case.structure, model, "classification", case.subset, **case.options)
    for xb, yb in as_batches((x, y), batch_size=BATCH_SIZE):
        curvature.update(model, xb, yb)
    return curvature


def fit_laplace(case: Case, model: nn.Module, x: Tensor, y: Tensor) -> gs.Laplace:
    la = gs.Laplace(model, "classification", case.structure, case.subset, **case.options)
    return la.fit((x, y), batch_size=BATCH_SIZE)


def forward_pass(model: nn.Module, x: Tensor, y: Tensor) -> None:
    with torch.no_grad():
        for xb, _ in as_batches((x, y), batch_size=BATCH_SIZE):
            model(xb)


def worker(case: Case, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    model, x, y, x_test = build(case.model)
    device = os.environ.get("GAUSSIFY_BENCHMARK_DEVICE", "cpu")  # --device, via the parent
    model, x, y, x_test = model.to(device), x.to(device), y.to(device), x_test.to(device)
    epoch_s = gradient_epoch(model, x, y)
    model.eval()
    for p in model.parameters():
        p.grad = None
    # Warm-up: every code path once on a tiny model of the same kind, then on the first two
    # batches of the real one (one-time costs: lazy imports, thread pools, vmap and BLAS
    # workspaces, which later fits reuse and which are not the fit's memory).
    small, sx, sy = tiny(case.model)
    fit_curvature(case, small, sx, sy)
    fit_laplace(case, small, sx, sy).predict(sx[:4])
    forward_pass(small, sx, sy)
    head = slice(0, 2 * BATCH_SIZE)
    fit_curvature(case, model, x[head], y[head])
    fit_laplace(case, model, x[head], y[head]).predict(x_test[:2])

    # Each phase REPEATS times, interleaved; the minimum is the estimate (the phases are
    # deterministic, and allocator and interpreter noise only ever adds to a peak).
    trained = copy.deepcopy(model).train()
    floors, epoch_peaks, curv_peaks, curv_times, fit_peaks, fit_times = [], [], [], [], [], []
    for _ in range(REPEATS):
        floors.append(measured(lambda: forward_pass(model, x, y))[1])
        epoch_peaks.append(measured(lambda: gradient_epoch(trained, x, y))[1])
        curvature, peak, seconds = measured(lambda: fit_curvature(case, model, x, y))
        storage = tensor_bytes(curvature.state_dict())
        curv_peaks.append(peak)
        curv_times.append(seconds)
        del curvature
        la, peak, seconds = measured(lambda: fit_laplace(case, model, x, y))
        fit_peaks.append(peak)
        fit_times.append(seconds)
    floor, curv_peak, fit_peak = min(floors), min(curv_peaks), min(fit_peaks)
    curv_s, fit_s = min(curv_times), min(fit_times)
    vectors = tensor_bytes([la.mean, la.theta_star, la._grad])
    floor_alloc = allocated(lambda: forward_pass(model, x, y))[1]
    epoch_alloc = allocated(lambda: gradient_epoch(trained, x, y))[1]
    curv_alloc = allocated(lambda: fit_curvature(case, model, x, y))[1]
    fit_alloc = allocated(lambda: fit_laplace(case, model, x, y))[1]
    num_test = x_test.shape[0]
    pred, predict_peak, predict_s = measured(lambda: la.predict(x_test, link="probit"))
    assert torch.isfinite(pred.probs).all()
    return {
        "case": case.name,
        "model": case.model,
        "structure": case.structure,
        "subset": case.subset,
        "options": case.options,
        "num_params": la.subset.num_params,
        "num_data": int(x.shape[0]),
        "storage_bytes": storage,
        "laplace_vectors_bytes": vectors,
        "floor_bytes": floor,
        "gradient_epoch_peak_bytes": min(epoch_peaks),
        "repeats": {"floor": floors, "curvature": curv_peaks, "laplace": fit_peaks},
        "curvature_peak_bytes": curv_peak,
        "laplace_peak_bytes": fit_peak,
        "ratio_curvature": (curv_peak - floor) / storage,
        "ratio_laplace": (fit_peak - floor - vectors) / storage,
        "ratio_raw": fit_peak / storage,
        "floor_alloc_bytes": floor_alloc,
        "curvature_alloc_bytes": curv_alloc,
        "laplace_alloc_bytes": fit_alloc,
        "ratio_curvature_alloc": (curv_alloc - floor_alloc) / storage,
        "gradient_epoch_alloc_bytes": epoch_alloc,
        "rule_curvature": curv_peak / (min(epoch_peaks) + storage),
        "rule_laplace": (fit_peak - vectors) / (min(epoch_peaks) + storage),
        "rule_curvature_alloc": curv_alloc / (epoch_alloc + storage),
        "rule_laplace_alloc": (fit_alloc - vectors) / (epoch_alloc + storage),
        "ratio_laplace_alloc": (fit_alloc - floor_alloc - vectors) / storage,
        "curvature_fit_s": curv_s,
        "fit_s": fit_s,
        "epoch_s": epoch_s,
        "fit_over_epoch": fit_s / epoch_s,
        "predict_points": num_test,
        "predict_s": predict_s,
        "predict_peak_bytes": predict_peak,
        "feature_path": la._output_layer is not None,
        "measurable": storage >= MEASURABLE_BYTES,
    }


def spawn(case: Case, allocator: str, threads: int, timeout_s: float) -> dict[str, Any]:
    """Run ``case`` in a fresh interpreter with the allocator settings; errors are recorded."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(asdict(case))]
    cmd += ["--threads", str(threads)]
    env = {**os.environ, **ALLOCATOR_ENV[allocator]}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"case": case.name, "error": f"timeout after {timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"case": case.name, "error": f"exit {proc.returncode}: {' '.join(tail)[:500]}"}
    return json.loads(lines[-1][len("RESULT ") :])


# ----------------------------------------------------------------------------- report


def _mib(b: float) -> str:
    return f"{b / 2**20:8.2f}"


def judged(row: dict[str, Any], which: str) -> float:
    """The memory-rule ratio a case is held to: the RSS one (``rule_<which>``) where the RSS
    resolves the storage, else the exact allocator one (``rule_<which>_alloc``)."""
    return row[f"rule_{which}" if row["measurable"] else f"rule_{which}_alloc"]


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'case':36s} {'P':>7s} {'storage':>8s} {'floor':>8s} {'epoch pk':>8s} {'curv pk':>8s} "
        f"{'fit pk':>8s} "
        f"{'r_curv':>6s} {'r_lap':>6s} {'r_raw':>6s} {'a_curv':>6s} {'a_lap':>6s} "
        f"{'fit s':>7s} {'fit/ep':>7s} {'pred s':>7s} {'rule_c':>6s} {'rule_l':>6s}"
    )
    print(head + "\n" + "-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['case']:36s} ERROR {r['error']}")
            continue
        name = r["case"] + ("" if r["measurable"] else " *")
        print(
            f"{name:36s} {r['num_params']:7d} {_mib(r['storage_bytes'])} "
            f"{_mib(r['floor_bytes'])} {_mib(r['gradient_epoch_peak_bytes'])} "
            f"{_mib(r['curvature_peak_bytes'])} "
            f"{_mib(r['laplace_peak_bytes'])} {r['ratio_curvature']:6.2f} "
            f"{r['ratio_laplace']:6.2f} {r['ratio_raw']:6.2f} "
            f"{r['ratio_curvature_alloc']:6.2f} {r['ratio_laplace_alloc']:6.2f} {r['fit_s']:7.2f} "
            f"{r['fit_over_epoch']:7.1f} {r['predict_s']:7.2f} "
            f"{judged(r, 'curvature'):6.2f} {judged(r, 'laplace'):6.2f}"
        )
    print(
        "(memory in MiB; rule_c = curv pk / (epoch pk + storage), rule_l = (fit pk - 3P "
        "vectors) / (epoch pk + storage): the memory rule, target <= 2 (* = storage below the "
        "RSS resolution: torch's exact allocator peaks); for reference the old storage-only "
        "ratios: r_curv = (curv pk - floor) / storage, r_lap = (fit pk - floor - 3P vectors) / "
        "storage, r_raw = fit pk / storage, a_curv, a_lap from the allocator)"
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "error" not in r]
    names = [
        r["case"].replace("/last_layer", "/last").replace(",mc_samples=1", ",mc1")
        + ("" if r["measurable"] else " (alloc)")
        for r in rows
    ]
    idx = torch.arange(len(rows)).numpy()
    width = 0.27
    fig, ax = plt.subplots(figsize=(13, 4.8))
    step = [r["gradient_epoch_peak_bytes"] / 2**20 for r in rows]
    storage = [r["storage_bytes"] / 2**20 for r in rows]
    budget = [a + b for a, b in zip(step, storage, strict=True)]
    # the judged ratios (RSS, or the exact allocator where the RSS cannot resolve the storage)
    curv = [max(judged(r, "curvature"), 0) * s for r, s in zip(rows, budget, strict=True)]
    lap = [max(judged(r, "laplace"), 0) * s for r, s in zip(rows, budget, strict=True)]
    ax.bar(idx - width, budget, width, label="training-step peak + storage", color="0.6")
    ax.bar(idx, curv, width, label="curvature fit: peak", color="tab:blue")
    ax.bar(idx + width, lap, width, label="Laplace.fit: peak - 3P vectors", color="tab:orange")
    for i, s in enumerate(budget):
        ax.hlines(TARGET * s, i - 1.5 * width, i + 1.5 * width, colors="red", linestyles="--")
    ax.plot([], [], "r--", label=f"{TARGET:g} x (step + storage): the memory rule")
    ax.set_yscale("log")
    ax.set_ylabel("MiB (log scale)")
    ax.set_xticks(idx, names, rotation=30, ha="right", fontsize=8)
    ax.set_title("Peak memory of the fit under the memory rule (float32, batch 256)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--allocators", nargs="+", default=["live", "default"])
    parser.add_argument("--quick", action="store_true", help="only the head cases")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "memory.json")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help="torch device (memory: host RSS)")
    args = parser.parse_args(argv)
    if args.worker is None:  # a worker takes the parent's, from its environment
        os.environ["GAUSSIFY_BENCHMARK_DEVICE"] = args.device
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        raw = json.loads(args.worker)
        case = Case(raw["model"], raw["structure"], raw["subset"], raw["options"])
        print("RESULT " + json.dumps(worker(case, args.threads)), flush=True)
        return
    cases = [c for c in CASES if c.model == "head"] if args.quick else CASES
    results: dict[str, list[dict[str, Any]]] = {}
    for allocator in args.allocators:
        rows = []
        for case in cases:
            print(f"[{allocator}] {case.name} ...", flush=True)
            rows.append(spawn(case, allocator, args.threads, args.timeout))
        results[allocator] = rows
        print(f"\nallocator: {allocator}")
        print_table(rows)
    main_rows = results.get("live") or next(iter(results.values()))
    ok = [r for r in main_rows if "error" not in r]
    report = {
        "description": "peak memory of curvature and Laplace fits under the memory rule: "
        "peak <= 2 x (one training step's peak + the curvature's storage) (see "
        "benchmarks/memory.py for the protocol)",
        "target_ratio": TARGET,
        "batch_size": BATCH_SIZE,
        "dtype": "float32",
        "threads": args.threads,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "load_average_end": list(os.getloadavg()),
        },
        "skipped": SKIPPED,
        "results": results,
        "all_within_rule (RSS ratios; allocator ratios below the RSS resolution)": {
            "curvature": all(judged(r, "curvature") <= TARGET for r in ok),
            "laplace": all(judged(r, "laplace") <= TARGET for r in ok),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(main_rows, args.out.with_suffix(".png"))
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}")
    for skip in SKIPPED:
        print(f"skipped {skip['case']}: {skip['reason']}")


if __name__ == "__main__":
    main()
