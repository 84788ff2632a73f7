"""A whole Laplace pipeline under torchrun: MAP, fit, prior tuning, predictive, report.

    torchrun --nproc_per_node=2 scripts/distributed_laplace.py --dataset digits
    python scripts/distributed_laplace.py --dataset digits        # the same, one process

Every rank loads the same bundled dataset. Rank 0 trains the MAP network (the same seeded
``train_map`` as one process) and broadcasts its weights. Each rank then fits the Laplace
posteriors on its shard of the training set (:func:`gaussify.distributed.shard`, no padding):
the curvature, log-likelihood, gradient and counts are all-reduced inside ``Laplace.fit``, so
every rank holds the one-process posterior and tunes the same prior precision. Each rank
predicts its shard of the test set; the probabilities are gathered and rank 0 prints (and
writes, with ``--out``) the report, identical to the one-process report up to float
round-off in the last digits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import gaussify as gs  # noqa: E402
from gaussify import data as gdata  # noqa: E402
from gaussify import distributed, metrics  # noqa: E402
from gaussify.training import train_map  # noqa: E402

#: (report name, structure, subset) as in ``gaussify demo``
POSTERIORS = (("laplace-kron", "kron", "all"), ("laplace-ll-full", "full", "last_layer"))


def _mlp(d_in: int, d_out: int, width: int) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(d_in, width),
        nn.Tanh(),
        nn.Linear(width, width),
        nn.Tanh(),
        nn.Linear(width, d_out),
    )


def run(args: argparse.Namespace) -> dict[str, object]:
    start = time.perf_counter()
    multi = distributed.init_process_group(timeout_s=args.timeout)
    k = distributed.world_size()
    ds = gdata.load(args.dataset, seed=args.seed)
    if ds.task != "classification":
        raise ValueError(
            f"dataset: expected a classification dataset, {args.dataset!r} is {ds.task}"
        )
    d_in = int(torch.tensor(ds.x_train.shape[1:]).prod())
    torch.manual_seed(args.seed)
    model = _mlp(d_in, ds.num_classes, args.width)
    if distributed.rank() == 0:
        train_map(
            model,
            (ds.x_train, ds.y_train),
            "classification",
            args.prior_precision,
            epochs=args.epochs,
            lr=args.lr,
            seed=args.seed,
        )
    with torch.no_grad():  # rank 0's MAP weights on every rank
        for p in model.parameters():
            p.copy_(distributed.broadcast(p.detach(), what="MAP weights"))
    distributed.reset_comm_stats()
    x, y = distributed.shard(ds.x_train, ds.y_train)
    xt, yt = distributed.shard(ds.x_test, ds.y_test)
    results: dict[str, dict[str, float]] = {}
    hyper: dict[str, dict[str, float]] = {}
    timing: dict[str, float] = {}
    with torch.no_grad():
        probs = torch.softmax(model(xt), dim=-1)
    results["map"] = metrics.classification_metrics(
        *distributed.all_gather_cat(probs, yt, what="test predictions")
    )
    for name, structure, subset in POSTERIORS:
        la = gs.Laplace(model, "classification", structure, subset, args.prior_precision)
        t0 = time.perf_counter()
        la.fit((x, y)).optimize_prior()
        timing[name] = time.perf_counter() - t0
        pred = la.predict(xt, method="glm", link="probit")
        assert pred.probs is not None
        probs, labels = distributed.all_gather_cat(pred.probs, yt, what="test predictions")
        results[name] = metrics.classification_metrics(probs, labels)
        hyper[name] = {
            "prior_precision": float(la.prior_precision),
            "log_marginal_likelihood": float(la.log_marginal_likelihood()),
            "num_data": la.num_data,
        }
    stats = distributed.comm_stats()
    report: dict[str, object] = {
        "dataset": ds.name,
        "processes": k,
        "distributed": multi,
        "n_train": int(ds.x_train.shape[0]),
        "n_test": int(ds.x_test.shape[0]),
        "test": results,
        "laplace": hyper,
        "fit_and_tune_s": timing,
        "comm_s": stats.comm_s,
        "comm_bytes": stats.bytes,
        "seconds": round(time.perf_counter() - start, 2),
    }
    distributed.print0(
        f"gaussify Laplace on {ds.name}: {k} process(es), "
        f"{'torch.distributed' if multi else 'no process group'}"
    )
    distributed.print0(
        f"\n{'method':<16}" + "".join(f"{m:>9}" for m in ("acc", "nll", "ece", "brier"))
    )
    for name, m in results.items():
        distributed.print0(
            f"{name:<16}" + "".join(f"{m[c]:>9.4f}" for c in ("acc", "nll", "ece", "brier"))
        )
    for name, h in hyper.items():
        distributed.print0(
            f"{name}: prior precision {h['prior_precision']:.6g}, "
            f"log marginal likelihood {h['log_marginal_likelihood']:.6f} (N = {h['num_data']})"
        )
    if args.out and distributed.rank() == 0:
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--width", type=int, default=50)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--prior-precision", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="collective timeout, s")
    parser.add_argument("--out", default="", help="JSON report (rank 0)")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
