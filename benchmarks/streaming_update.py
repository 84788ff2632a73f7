"""Cost of one streaming (Kalman) update of the exact last layer, as ratios.

    python benchmarks/streaming_update.py [--quick]       # < 1 min on one busy core

For feature width D (D' = D + 1 with the bias), K = 10 classes and batch size B, times
(minimum over repeats, as the machine is shared; one thread, float64, the variational
pseudo-likelihood):

* ``update``: ``ExactLastLayer(streaming=True).update(phi (B, D), y (B,))`` on a warm
  posterior: ``Sigma X^T`` (K x D'^2 B), the K Cholesky factors of ``S = X Sigma X^T + V``
  (B x B), the mean and the rank-B covariance downdate (K x D'^2 B) and the evidence term;
* ``matmul``: one batched product ``Sigma @ X^T`` for the K columns, ``(K, D', D') @ (D', B)``,
  the least any covariance-form update must do;
* ``oneshot``: the one-shot posterior of the same B points from the prior
  (``streaming=False``: information update ``sum_n v_nk^-1 x_n x_n^T`` and one Cholesky solve
  with the covariance), the cost of refitting instead of updating.

Reported: ``update / matmul`` and ``update / oneshot`` per (D, B), the time per point of the
update, and, for a stream of N points in batches of B, the total streaming time against one
one-shot fit on all N points. Writes ``benchmarks/results/streaming_update.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from gaussify.cli_args import add_device_argument, synchronize
from gaussify.last_layer.exact import ExactLastLayer

ROOT = Path(__file__).resolve().parents[1]
K = 10
F64 = torch.float64
#: where the layers and the data live (``--device``)
DEVICE = torch.device("cpu")


def _min_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(DEVICE)
        times.append(time.perf_counter() - t0)
    return min(times)  # the least-disturbed run on a shared machine


def _data(n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    phi = torch.randn(n, d, generator=gen, dtype=F64)
    return phi.to(DEVICE), torch.randint(0, K, (n,), generator=gen).to(DEVICE)


def _layer(d: int, streaming: bool = True) -> ExactLastLayer:
    return ExactLastLayer(
        d, K, method="variational", prior_precision=1.0, streaming=streaming, device=DEVICE
    )


def case(d: int, b: int, repeats: int, stream_points: int) -> dict[str, float]:
    phi0, y0 = _data(200, d, 0)
    phi, y = _data(b, d, 1)
    layer = _layer(d).update(phi0, y0)
    state = layer.state_dict()

    def update() -> None:
        layer.load_state_dict(state)
        layer.update(phi, y)

    def load_only() -> None:
        layer.load_state_dict(state)

    cov = layer.covariance.clone()
    x = torch.cat([phi, torch.ones(b, 1, dtype=F64, device=DEVICE)], dim=1)

    def matmul() -> None:
        cov @ x.T

    def oneshot() -> None:
        one = _layer(d, streaming=False)
        one.update(phi, y)
        _ = one.mean, one.covariance

    repeats = repeats * max(1, 30 // (b * repeats))  # cheap cases: more tries at a quiet moment
    t_update = max(_min_time(update, repeats) - _min_time(load_only, repeats), 1e-9)
    t_matmul = _min_time(matmul, repeats)
    t_oneshot = _min_time(oneshot, repeats)
    phi_s, y_s = _data(stream_points, d, 2)

    def stream() -> None:
        lay = _layer(d)
        for start in range(0, stream_points, b):
            lay.update(phi_s[start : start + b], y_s[start : start + b])

    def fit_all() -> None:
        one = _layer(d, streaming=False)
        one.update(phi_s, y_s)
        _ = one.mean, one.covariance

    reps = max(1, repeats // 5)
    t_stream, t_fit = _min_time(stream, reps), _min_time(fit_all, reps)
    return {
        "width": d,
        "batch": b,
        "update_s": t_update,
        "update_per_point_s": t_update / b,
        "matmul_s": t_matmul,
        "oneshot_s": t_oneshot,
        "update_over_matmul": t_update / t_matmul,
        "update_over_oneshot": t_update / t_oneshot,
        "stream_points": stream_points,
        "stream_total_s": t_stream,
        "oneshot_all_s": t_fit,
        "stream_over_oneshot_all": t_stream / t_fit,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/streaming_update.json"
    )
    add_device_argument(parser)
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    torch.set_num_threads(args.threads)
    widths = (64, 256) if args.quick else (64, 256, 512)
    batches = (1, 10, 100)
    repeats = 5 if args.quick else 10
    stream_points = 200 if args.quick else 500
    start = time.perf_counter()
    rows = [case(d, b, repeats, stream_points) for d in widths for b in batches]
    print(
        "| D | B | update [ms] | per point [ms] | update/matmul | update/one-shot(B) "
        f"| stream {stream_points} / one-shot {stream_points} |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['width']} | {r['batch']} | {1e3 * r['update_s']:.3f} "
            f"| {1e3 * r['update_per_point_s']:.4f} | {r['update_over_matmul']:.1f} "
            f"| {r['update_over_oneshot']:.2f} | {r['stream_over_oneshot_all']:.2f} |"
        )
    out = {
        "benchmark": "streaming_update",
        "description": "ExactLastLayer Kalman update per batch vs one batched Sigma X^T matmul "
        "and vs the one-shot (information-form) posterior; K = 10, float64",
        "threads": args.threads,
        "device": str(DEVICE),
        "num_classes": K,
        "repeats": repeats,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "runtime_s": time.perf_counter() - start,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
