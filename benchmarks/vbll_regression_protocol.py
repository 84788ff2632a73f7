"""gaussify's ``VBLLRegression`` at its defaults vs the ``vbll`` package at every
``wishart_scale``, on one fixed-budget regression protocol (issue 19).

    pip install --no-deps vbll          # pure Python; never let pip pull another torch
    OMP_NUM_THREADS=1 python benchmarks/vbll_regression_protocol.py [--datasets boston ...]
        [--seeds 20] [--first-seed 0] [--epochs 150] [--methods ...] [--jobs 2]
        [--output benchmarks/results/vbll_regression_protocol.json]
    # parts run separately are combined with: --merge part1.json part2.json ...

The committed file is three parts run side by side on one 16-core machine (each record is one
single-threaded process), merged:

    --seeds 20 --methods gaussify gaussify_wzero vbll_ws1.0 --jobs 9
    --seeds 10 --methods gaussify_vbllcov gaussify_wstd1 gaussify_vbllinit --jobs 4
    --seeds 5 --methods vbll_ws0.01 vbll_ws0.1 vbll_ws10.0 --jobs 3

Cost: one run is 2,250 Adam steps on boston, 3.3 s of CPU for ours and 5.0 s for the package
(each record's ``cpu_seconds``; ``seconds`` is wall time, which on a loaded shared machine is
10-20 times longer). ``--jobs N`` runs N worker processes of one torch thread each. Runs are
deterministic (one thread, CPU), so a part rerun on unchanged code reproduces its records on the
same machine and torch version (another torch version moves a record by round-off, up to about
0.01 in test NLL after 150 epochs). The JSON's ``machine`` names the processor, the CPU count
and the load when it was written.

Protocol (both libraries in the same process, paired): for each data set and seed ``s``,
``gaussify.data.load(name, seed=s)`` (standardised inputs and targets; the training part only,
the validation part is not used), the App. G.2 feature network (2 x 50 leaky ReLU,
:func:`gaussify.experiments.vbll_uci.make_body`) and a regression head with KL weight
``1 / N``; AdamW (lr 1e-3, its default weight decay 1e-2), batch 32, a fixed 150 epochs, no
gradient clipping and no early stopping. ``torch.manual_seed(s)`` before building each model
and the same batch order for every head, so every method starts from the same body weights.
``"name/300"`` trains on the first 300 training rows only (a small, noisy set on which the
features over-fit within the budget: the regime where the noise collapses); ``power/1000``
keeps the 2-core run affordable (the full 6,900 training rows take 7 times longer).

Heads:

* ``gaussify``: ``VBLLRegression(50, 1, 1/N)`` -- the defaults (prior variance ``1/D``,
  ``W^-1(1, 1)`` noise prior, noise initialised at the target variance 1);
* ``gaussify_prior1``: the same with ``prior_scale=1.0``, the default before issue 19
  (prior variance 1 per weight, 50 times weaker at ``D = 50``);
* one-factor ablations (issue 19; ``results/vbll_regression_factors.json``), the defaults with
  one thing changed: ``gaussify_vbllstate`` (the package head's own initial draw copied into
  ours: isolates everything but the start), ``gaussify_wstd1`` (the default draw of the mean
  times ``sqrt(D)``: the package's ``N(0, 1)`` scale), ``gaussify_wnormal`` (a fresh ``N(0, 1)``
  mean), ``gaussify_wzero`` (a zero mean), ``gaussify_vbllcov`` (the package's random Cholesky
  factor of ``S``: log-diagonal ``N(-log(D)/2, 1)``, off-diagonal ``N(0, 1/D^2)``; ours
  ``S = I/D``), ``gaussify_cov{k}`` (``S = k I / D``), ``gaussify_wscale{c}`` (the default
  draw of the mean times ``sqrt(c)``: ``N(0, c / D)``), ``gaussify_vbllinit`` (both of the
  package's scales); any head with the suffix ``_headnowd`` (no weight decay on the head's
  parameters, 1e-2 on the body: the package tutorial's parameter groups), ``_f64`` (float64
  throughout: the size of round-off chaos over the run) or ``_redraw`` (the same head from
  another random draw: the generator is reseeded from its own stream before the head is built,
  so the body and batches are unchanged; ``vbll_ws1.0_redraw`` against ``vbll_ws1.0`` measures
  how much the package's result depends on which start it happened to draw);
* ``vbll_ws{w}``: ``vbll.Regression(50, 1, 1/N, wishart_scale=w)`` at the package's other
  defaults (prior variance ``1 / D``, ``dof=1``) for ``w`` in 0.01, 0.1, 1, 10. The package
  initialises ``log sigma ~ N(0, log(w)^2)``: away from ``w = 1`` the starting noise is a random
  draw over orders of magnitude, which 150 epochs of Adam at lr 1e-3 need not undo.

Reported per data set and head: test NLL (standardised units, the head's own predictive),
test and training MSE, mean predictive variance and final noise variance, mean ± standard error
over seeds and per seed; rows ``paired:A-B`` give the per-seed differences of test NLL (mean,
standard error, seeds where A is lower); ``best_vbll`` is the package's ``wishart_scale`` with
the lowest mean test NLL, chosen on the test set (an optimistic baseline), and the summary row
pairs our defaults with it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from concurrent.futures import ProcessPoolExecutor
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import gaussify as gs
from gaussify.cli_args import add_device_argument, synchronize
from gaussify.experiments.vbll_uci import make_body
from gaussify.last_layer import VBLLRegression

RESULTS = Path(__file__).resolve().parent / "results" / "vbll_regression_protocol.json"
#: Table 2 / 3's data sets that ship (energy does not; power on its first 1000 training rows),
#: and a small noisy subset
DATASETS = ("boston", "concrete", "wine_red", "yacht", "power/1000", "wine_red/300")
WISHART_SCALES = (0.01, 0.1, 1.0, 10.0)
WIDTH = 50


def _vbll_head(num_train: int, wishart_scale: float = 1.0) -> nn.Module:
    import vbll

    return vbll.Regression(WIDTH, 1, 1.0 / num_train, wishart_scale=wishart_scale)


def _copy_vbll_state(ours: VBLLRegression, theirs: nn.Module) -> None:
    """Set our head to the package head's parameters (noise stored as ``-log sigma``)."""
    with torch.no_grad():
        ours.W_mean.copy_(theirs.W_mean)
        ours.W_cov.logdiag.copy_(theirs.W_logdiag)
        ours.W_cov.offdiag.copy_(theirs.W_offdiag)
        ours.noise_cov.logdiag.copy_(-theirs.noise_logdiag)


def make_head(method: str, num_train: int) -> nn.Module:
    """A fresh head for ``method`` (see the module doc); the optimiser and precision variants
    (``*_headnowd``, ``*_f64``) use the head of the name before the suffix."""
    for suffix in ("_headnowd", "_f64"):
        method = method.removesuffix(suffix)
    if method.endswith("_redraw"):
        # the same head from another random draw: the generator reseeded from its own stream
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
        method = method.removesuffix("_redraw")
    if method == "gaussify":
        return VBLLRegression(WIDTH, 1, 1.0 / num_train)
    if method == "gaussify_prior1":
        return VBLLRegression(WIDTH, 1, 1.0 / num_train, prior_scale=1.0)
    if method == "gaussify_vbllstate":
        # the package head's own initial draw, copied into ours: the trajectories must agree
        theirs = _vbll_head(num_train)
        head = VBLLRegression(WIDTH, 1, 1.0 / num_train)
        _copy_vbll_state(head, theirs)
        return head
    if method.startswith("gaussify_"):
        # one-factor ablations on top of the defaults (issue 19)
        head = VBLLRegression(WIDTH, 1, 1.0 / num_train)
        cov = head.W_cov
        # the default draw of the mean, N(0, 1/D)
        old_mean = head.W_mean.detach().clone()
        with torch.no_grad():
            if method == "gaussify_wstd1":  # that draw scaled to the package's N(0, 1)
                head.W_mean.copy_(old_mean * math.sqrt(WIDTH))
            elif method == "gaussify_wnormal":  # a fresh N(0, 1) draw of the mean
                head.W_mean.normal_()
            elif method == "gaussify_wzero":  # a zero mean: q(W) starts at the prior
                head.W_mean.zero_()
            elif method == "gaussify_vbllcov":  # the package's random S factor
                cov.logdiag.copy_(torch.randn_like(cov.logdiag) - 0.5 * math.log(WIDTH))
                cov.offdiag.copy_(torch.randn_like(cov.offdiag) / WIDTH)
            elif method.startswith("gaussify_wscale"):  # that draw scaled to N(0, c / D)
                head.W_mean.copy_(old_mean * math.sqrt(float(method[15:])))
            elif method.startswith("gaussify_cov"):  # S = k I / D
                cov.logdiag.fill_(0.5 * math.log(float(method[12:]) / WIDTH))
            elif method == "gaussify_vbllinit":  # both of the package's scales
                head.W_mean.copy_(old_mean * math.sqrt(WIDTH))
                cov.logdiag.copy_(torch.randn_like(cov.logdiag) - 0.5 * math.log(WIDTH))
                cov.offdiag.copy_(torch.randn_like(cov.offdiag) / WIDTH)
            else:
                raise ValueError(f"method: unknown {method!r}")
        return head
    if method.startswith("vbll_ws"):
        return _vbll_head(num_train, float(method[7:]))
    raise ValueError(f"method: unknown {method!r}")


def make_optimizer(method: str, body: nn.Module, head: nn.Module) -> torch.optim.Optimizer:
    """AdamW lr 1e-3 at its default weight decay 1e-2 on every parameter; ``*_headnowd``: no
    weight decay on the head (the ``vbll`` package's examples), 1e-2 on the body."""
    if method.endswith("_headnowd"):
        groups = [{"params": list(body.parameters())},
                  {"params": list(head.parameters()), "weight_decay": 0.0}]  # fmt: skip
        return torch.optim.AdamW(groups, lr=1e-3)
    return torch.optim.AdamW([*body.parameters(), *head.parameters()], lr=1e-3)


def _moments(head: nn.Module, phi: Tensor) -> tuple[Tensor, Tensor, float]:
    """Predictive mean (N, 1), variance (N, 1) and the noise variance of either library."""
    pred = head(phi).predictive
    if isinstance(head, VBLLRegression):
        return pred.mean, pred.var, float(head.noise_cov.variance.squeeze())
    return pred.mean, pred.variance, float(head.noise().variance.squeeze())


def load(name: str, seed: int, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    base, _, rows = name.partition("/")
    ds = gs.data.load(base, seed=seed)
    x, y, x_val, y_val = ds.x_train, ds.y_train, ds.x_val, ds.y_val
    if rows:
        # the split's validation share (0.18 against 0.72 for training) of the kept rows
        x, y = x[: int(rows)], y[: int(rows)]
        x_val, y_val = x_val[: max(1, int(rows) // 4)], y_val[: max(1, int(rows) // 4)]
    out = {"x": x, "y": y, "x_val": x_val, "y_val": y_val, "x_test": ds.x_test, "y_test": ds.y_test}
    return {k: v.to(device) for k, v in out.items()}


def run_one(
    name: str,
    seed: int,
    method: str,
    epochs: int,
    batch: int = 32,
    device: str | torch.device = "cpu",
    trace_every: int = 0,
    select_every: int = 0,
) -> dict[str, Any]:
    torch.set_num_threads(1)
    data = load(name, seed, device)
    dtype = torch.float64 if method.endswith("_f64") else torch.float32
    data = {k: v.to(dtype) for k, v in data.items()}
    x, y = data["x"], data["y"]
    torch.manual_seed(seed)
    body = make_body(x.shape[1], WIDTH).to(x.device, dtype)
    head = make_head(method, len(x)).to(x.device, dtype)
    opt = make_optimizer(method, body, head)
    gen = torch.Generator().manual_seed(seed)
    trace: list[dict[str, float]] = []
    selected = {"val_nll": math.inf, "epoch": 0, "test_nll": math.nan}
    start, cpu_start = time.perf_counter(), time.process_time()
    for epoch in range(epochs):
        for idx in torch.randperm(len(x), generator=gen).to(x.device).split(batch):
            opt.zero_grad(set_to_none=True)
            head(body(x[idx])).train_loss_fn(y[idx]).backward()
            opt.step()
        if trace_every and (epoch + 1) % trace_every == 0:
            trace.append({"epoch": epoch + 1, **_state(head, body, data)})
        if select_every and (epoch + 1) % select_every == 0:
            with torch.no_grad():
                val_nll = float(head(body(data["x_val"])).val_loss_fn(data["y_val"]))
                if val_nll < selected["val_nll"]:
                    test_nll = float(head(body(data["x_test"])).val_loss_fn(data["y_test"]))
                    selected = {"val_nll": val_nll, "epoch": epoch + 1, "test_nll": test_nll}
    synchronize(x.device)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    with torch.no_grad():
        phi_test = body(data["x_test"])
        nll = float(head(phi_test).val_loss_fn(data["y_test"]))
        mean, var, noise = _moments(head, phi_test)
        train_mean, _, _ = _moments(head, body(x))
    return {
        "dataset": name,
        "seed": seed,
        "method": method,
        "num_train": len(x),
        "test_nll": nll,
        "test_mse": float((mean - data["y_test"]).square().mean()),
        "train_mse": float((train_mean - y).square().mean()),
        "pred_var": float(var.mean()),
        "noise_var": noise,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        **({"trace": trace} if trace_every else {}),
        **({f"selected_{k}": v for k, v in selected.items()} if select_every else {}),
    }


def _state(head: nn.Module, body: nn.Module, data: dict[str, Tensor]) -> dict[str, float]:
    """Where a run is (for ``--trace-every``): test and validation NLL, test and training MSE, noise
    variance, ``||W_bar||^2``, mean epistemic variance ``phi^T S phi`` on the test inputs and
    ``tr S``, and the prior function variance ``prior_scale ||phi||^2`` on the training
    inputs (the package's ``prior_scale`` attribute is the variance too)."""
    with torch.no_grad():
        phi_test = body(data["x_test"])
        phi_train = body(data["x"])
        mean, var, noise = _moments(head, phi_test)
        train_mean, _, _ = _moments(head, body(data["x"]))
        cov = head.W().covariance
        return {
            "test_nll": float(head(phi_test).val_loss_fn(data["y_test"])),
            "val_nll": float(head(body(data["x_val"])).val_loss_fn(data["y_val"])),
            "test_mse": float((mean - data["y_test"]).square().mean()),
            "train_mse": float((train_mean - data["y"]).square().mean()),
            "noise_var": noise,
            "w_norm2": float(head.W_mean.square().sum()),
            "epistemic_var": float(var.mean()) - noise,
            "trace_s": float(cov.diagonal(dim1=-2, dim2=-1).sum()),
            "prior_function_var": float(head.prior_scale * phi_train.square().sum(-1).mean()),
        }


def _run_task(task: tuple) -> dict[str, Any]:
    return run_one(*task)


def _mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def _paired_row(
    name: str, a: str, b: str, nll: dict[str, dict[int, float]], prefix: str = "paired"
) -> dict[str, Any]:
    """Paired test-NLL difference ``a - b`` over the seeds both ran (mean, s.e.)."""
    seeds = sorted(set(nll[a]) & set(nll[b]))
    diffs = [nll[a][s] - nll[b][s] for s in seeds]
    mean, se = _mean_se(diffs) if diffs else (float("nan"), float("nan"))
    return {
        "dataset": name,
        "method": f"{prefix}:{a}-{b}",
        "seeds": seeds,
        "diff_mean": mean,
        "diff_se": se,
        "diff_per_seed": diffs,
        "a_better_seeds": sum(d < 0 for d in diffs),
    }


def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for name in dict.fromkeys(r["dataset"] for r in records):
        by_method: dict[str, dict[str, Any]] = {}
        for method in dict.fromkeys(r["method"] for r in records if r["dataset"] == name):
            sel = sorted(
                (r for r in records if r["dataset"] == name and r["method"] == method),
                key=lambda r: r["seed"],
            )
            row: dict[str, Any] = {"dataset": name, "method": method, "num_seeds": len(sel)}
            for key in ("test_nll", "test_mse", "train_mse", "pred_var", "noise_var",
                        "selected_test_nll", "selected_epoch"):  # fmt: skip
                if all(key in r for r in sel):
                    row[f"{key}_mean"], row[f"{key}_se"] = _mean_se([r[key] for r in sel])
            row["test_nll_per_seed"] = [r["test_nll"] for r in sel]
            row["noise_var_per_seed"] = [r["noise_var"] for r in sel]
            by_method[method] = row
            rows.append(row)
        nll = {
            m: {
                r["seed"]: r["test_nll"]
                for r in records
                if r["dataset"] == name and r["method"] == m
            }
            for m in by_method
        }
        if "gaussify" in by_method:
            for method in by_method:  # one factor per row: paired against the defaults
                if method != "gaussify":
                    rows.append(_paired_row(name, method, "gaussify", nll))
        selected = {  # the test NLL at the epoch chosen on the validation NLL (--select-every)
            m: {
                r["seed"]: r["selected_test_nll"]
                for r in records
                if r["dataset"] == name and r["method"] == m and "selected_test_nll" in r
            }
            for m in by_method
        }
        if selected.get("gaussify"):
            for method in by_method:
                if method != "gaussify" and selected[method]:
                    rows.append(_paired_row(name, method, "gaussify", selected, "selected"))
        for method in by_method:  # a redrawn start against the same head's own start
            base = method.removesuffix("_redraw")
            if method != base and base in by_method:
                rows.append(_paired_row(name, method, base, nll))
        vbll_rows = [
            r for m, r in by_method.items() if m.startswith("vbll_ws") and "_" not in m[7:]
        ]
        if vbll_rows and "gaussify" in by_method:
            best = min(vbll_rows, key=lambda r: r["test_nll_mean"])
            ours = by_method["gaussify"]
            paired = _paired_row(name, "gaussify", best["method"], nll)
            rows.append(
                {
                    "dataset": name,
                    "method": "summary",
                    "best_vbll": best["method"],
                    "best_vbll_nll": best["test_nll_mean"],
                    "gaussify_nll": ours["test_nll_mean"],
                    "gaussify_minus_best_vbll": ours["test_nll_mean"] - best["test_nll_mean"],
                    "paired_seeds": paired["seeds"],
                    "paired_diff_mean": paired["diff_mean"],
                    "paired_diff_se": paired["diff_se"],
                    "ours_better_seeds": paired["a_better_seeds"],
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS))
    parser.add_argument("--seeds", type=int, default=20, help="the paper's 20 (App. G.2)")
    parser.add_argument("--first-seed", type=int, default=0, help="seeds first .. first+n-1")
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["gaussify", "gaussify_prior1", *(f"vbll_ws{w}" for w in WISHART_SCALES)],
    )
    parser.add_argument(
        "--trace-every", type=int, default=0, help="record the run's state every K epochs"
    )
    parser.add_argument(
        "--select-every",
        type=int,
        default=0,
        help="also report the test NLL at the epoch (a multiple of K) with the lowest "
        "validation NLL (App. G.2's selection, without its retraining on train + validation)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--merge", nargs="+", type=Path, default=None, help="combine the records of earlier runs"
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="worker processes (one torch thread each)"
    )
    add_device_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    records: list[dict[str, Any]] = []
    runtime = 0.0
    for path in args.merge or []:
        part = json.loads(path.read_text())
        records += part["records"]
        runtime += part["runtime_s"]
    tasks = [
        (name, seed, method, args.epochs, 32, args.device, args.trace_every, args.select_every)
        for name in ([] if args.merge else args.datasets)
        for seed in range(args.first_seed, args.first_seed + args.seeds)
        for method in args.methods
    ]

    def report(rec: dict[str, Any]) -> None:
        records.append(rec)
        print(
            f"{rec['dataset']:14s} {rec['method']:24s} seed {rec['seed']}: NLL "
            f"{rec['test_nll']:8.3f} MSE {rec['test_mse']:.3f} (train {rec['train_mse']:.3f}) "
            f"noise {rec['noise_var']:.3g} [{rec['cpu_seconds']:.1f} s cpu]",
            flush=True,
        )
        _write(args, records, runtime + time.perf_counter() - start)  # partial results

    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            for rec in pool.map(_run_task, tasks):
                report(rec)
    else:
        for task in tasks:
            report(_run_task(task))
    rows = _write(args, records, runtime + time.perf_counter() - start)
    for row in rows:
        if row["method"] == "summary":
            print(
                f"{row['dataset']:14s} gaussify {row['gaussify_nll']:.3f}  best vbll "
                f"({row['best_vbll']}) {row['best_vbll_nll']:.3f}"
            )
    print(f"wrote {args.output}")
    return 0


def machine() -> dict[str, Any]:
    """Where the records were computed: processor, CPU count and the load at the time of
    writing (the 1-minute load average; ``None`` where the platform has none)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"processor": model, "cpus": os.cpu_count(), "load_1min": load}


def _write(args: argparse.Namespace, records: list[dict[str, Any]], runtime: float) -> list:
    """Write the JSON (after every head, so an interrupted run keeps what it finished)."""
    rows = summarise(records)
    out = {
        "benchmark": "vbll_regression_protocol",
        "protocol": "2x50 leaky-ReLU body + head, AdamW lr 1e-3 (weight decay 1e-2), batch 32, "
        f"{args.epochs} epochs, no clipping, no early stopping; standardised units; "
        "seeds per data set and head in num_seeds; paired (same body init and batch order per "
        "seed)",
        "machine": machine(),
        "versions": {
            "torch": torch.__version__,
            "vbll": version("vbll"),
            "python": platform.python_version(),
        },
        "runtime_s": runtime,
        "rows": rows,
        "records": records,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    partial = args.output.with_name(args.output.name + ".part")  # never a half-written file
    partial.write_text(json.dumps(out, indent=1) + "\n")
    partial.replace(args.output)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
