"""Side-by-side benchmark: gaussify's VBLL heads vs the ``vbll`` package (Harrison et al.).

    pip install --no-deps vbll          # pure Python; never let pip pull another torch
    python benchmarks/vbll_vs_vbll.py [--quick] [--epochs-reg 30] [--epochs-clf 4]

Cases (same model, data, optimiser, batches and hyperparameters for both libraries, in one
process):

* regression, ``dense`` and ``diagonal``: ``concrete`` (standardised, seed 0), the App. G.2
  network (2 x 50 leaky ReLU) + ``Regression`` head, AdamW lr 1e-3, weight decay 1e-2,
  gradients clipped at 1.0, batch 32;
* discriminative classification, ``dense``, ``diagonal`` and ``lowrank`` (rank 3):
  ``mnist`` (seed 0, 7000 training images), an MLP 784-128-128 (ReLU) + ``DiscClassification``
  head, same optimiser, clipping at 2.0, batch 128;
* generative classification (G-VBLL), ``diagonal`` (the only one ``vbll`` implements): the
  same data, MLP and optimiser + ``GenClassification`` / ``VBLLGenerative`` heads (class
  embeddings, shared diagonal feature noise; gaussify's Dirichlet class prior left uniform,
  which is what ``vbll`` uses).

``--device`` (default ``cpu``) moves models and data there; timings on a GPU are CUDA-
synchronised per epoch.

Conventions, mapped so both optimise the same objective: the ``vbll`` package divides its
``prior_scale`` by the feature width (``Regression``: prior variance ``prior_scale / D``;
``DiscClassification``: ``2 prior_scale / D``); gaussify's ``prior_scale`` *is* the prior
variance, so we pass ``vbll_prior / D`` (regression) and ``2 vbll_prior / D``
(classification). The inverse-Wishart terms are the same (``vbll`` stores
``(dof + dim + 1) / 2``); its KL omits a constant (no effect on gradients). gaussify's head is
initialised from the ``vbll`` head's parameters (same mean; log standard deviations copied;
the noise stored as ``-log sigma``, the log diagonal of the precision's Cholesky factor; for
``lowrank`` the diagonal is a variance in ``vbll`` and a squared ``exp`` here, so
``logdiag = vbll_logdiag / 2``), and both bodies start from the same weights, so for
``dense`` and ``diagonal`` the two runs follow the same trajectory up to float rounding
(Adam is invariant to negating a parameter, not to rescaling it, so ``lowrank`` differs).

Reported per case: time per epoch (median over the epochs, the two libraries alternating
epoch by epoch, at least 3 each) and its ratio gaussify / vbll; the final test NLL, RMSE
(regression) or accuracy (classification) of each library's own predictive (D-VBLL: Monte
Carlo with 1000 samples on both sides); the largest parameter difference at the end.
Writes ``benchmarks/results/vbll_vs_vbll.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import gaussify as gs
from gaussify import last_layer
from gaussify.experiments.vbll_uci import make_body

RESULTS = Path(__file__).resolve().parent / "results" / "vbll_vs_vbll.json"


# --------------------------------------------------------------------------------------------
# parameter mapping vbll -> gaussify


@torch.no_grad()
def copy_head(ref: nn.Module, ours: nn.Module, parameterization: str) -> None:
    """Set gaussify head ``ours`` to the state of ``vbll`` head ``ref`` (see module doc)."""
    if parameterization == "generative":
        ours.mu_mean.copy_(ref.mu_mean)
        ours.mu_cov.logdiag.copy_(ref.mu_logdiag)
        ours.noise_cov.logdiag.copy_(-ref.noise_logdiag)
        return
    ours.W_mean.copy_(ref.W_mean)
    cov = ours.W_cov
    if parameterization == "lowrank":
        cov.logdiag.copy_(0.5 * ref.W_logdiag)
        cov.factor.copy_(ref.W_offdiag)
    else:
        cov.logdiag.copy_(ref.W_logdiag)
        if parameterization == "dense":
            cov.offdiag.copy_(ref.W_offdiag)
    ours.noise_cov.logdiag.copy_(-ref.noise_logdiag)


def _max_param_diff(ref: nn.Module, ours: nn.Module, parameterization: str) -> float:
    """Largest absolute difference of the mapped head parameters."""
    if parameterization == "generative":
        pairs = [
            (ref.mu_mean, ours.mu_mean),
            (ref.mu_logdiag, ours.mu_cov.logdiag),
            (-ref.noise_logdiag, ours.noise_cov.logdiag),
        ]
        return max(float((a - b).abs().max()) for a, b in pairs)
    pairs = [(ref.W_mean, ours.W_mean), (-ref.noise_logdiag, ours.noise_cov.logdiag)]
    if parameterization == "lowrank":
        pairs += [(0.5 * ref.W_logdiag, ours.W_cov.logdiag), (ref.W_offdiag, ours.W_cov.factor)]
    else:
        pairs.append((ref.W_logdiag, ours.W_cov.logdiag))
        if parameterization == "dense":
            pairs.append((torch.tril(ref.W_offdiag, -1), torch.tril(ours.W_cov.offdiag, -1)))
    return max(float((a - b).abs().max()) for a, b in pairs)


def _max_body_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


# --------------------------------------------------------------------------------------------
# one case


class Runner:
    """One library's model (body + head), optimiser and epoch loop."""

    def __init__(self, body: nn.Module, head: nn.Module, clip: float) -> None:
        self.body, self.head, self.clip = body, head, clip
        self.params = [*body.parameters(), *head.parameters()]
        self.opt = torch.optim.AdamW(self.params, lr=1e-3, weight_decay=1e-2)
        self.times: list[float] = []

    def epoch(self, x: Tensor, y: Tensor, perm: Tensor, batch: int) -> float:
        start = time.perf_counter()
        for idx in perm.split(batch):
            self.opt.zero_grad(set_to_none=True)
            loss = self.head(self.body(x[idx])).train_loss_fn(y[idx])
            loss.backward()
            nn.utils.clip_grad_norm_(self.params, self.clip)
            self.opt.step()
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        self.times.append(time.perf_counter() - start)
        return float(loss.detach())


def run_case(
    task: str,
    parameterization: str,
    data: dict[str, Tensor],
    epochs: int,
    vbll_prior: float = 1.0,
    seed: int = 0,
    device: str = "cpu",
) -> dict[str, Any]:
    import vbll

    x, y, x_test, y_test = data["x"], data["y"], data["x_test"], data["y_test"]
    n = len(y)
    torch.manual_seed(seed)
    if task == "regression":
        width, batch, clip = 50, 32, 1.0
        body = make_body(x.shape[1], width)
        kwargs = {"parameterization": parameterization, "wishart_scale": 1.0, "dof": 1.0}
        ref_head = vbll.Regression(width, 1, 1.0 / n, prior_scale=vbll_prior, **kwargs)
        ours_head = last_layer.VBLLRegression(
            width, 1, 1.0 / n, prior_scale=vbll_prior / width, **kwargs
        )
        mapped_prior = vbll_prior / width
    elif task == "generative":
        # G-VBLL: vbll's GenClassification supports the diagonal only and takes its
        # prior_scale as the prior variance (no 1 / D), like gaussify
        width, batch, clip = 128, 128, 2.0
        num_classes = int(y.max()) + 1
        body = nn.Sequential(
            nn.Flatten(), nn.Linear(x[0].numel(), width), nn.ReLU(), nn.Linear(width, width)
        )
        body.append(nn.ReLU())
        kwargs = {"parameterization": "diagonal", "wishart_scale": 1.0, "dof": 1.0}
        ref_head = vbll.GenClassification(
            width, num_classes, 1.0 / n, prior_scale=vbll_prior, **kwargs
        )
        ours_head = last_layer.VBLLGenerative(
            width, num_classes, 1.0 / n, prior_scale=vbll_prior, **kwargs
        )
        mapped_prior = vbll_prior
    else:
        width, batch, clip = 128, 128, 2.0
        num_classes = int(y.max()) + 1
        body = nn.Sequential(
            nn.Flatten(), nn.Linear(x[0].numel(), width), nn.ReLU(), nn.Linear(width, width)
        )
        body.append(nn.ReLU())
        kwargs = {"parameterization": parameterization, "wishart_scale": 1.0, "dof": 1.0}
        rank = {"cov_rank": 3} if parameterization == "lowrank" else {}
        ref_head = vbll.DiscClassification(
            width, num_classes, 1.0 / n, prior_scale=vbll_prior, **kwargs, cov_rank=3
        )
        ours_head = last_layer.VBLLDiscriminative(
            width, num_classes, 1.0 / n, prior_scale=2 * vbll_prior / width, **kwargs, **rank
        )
        mapped_prior = 2 * vbll_prior / width
    copy_head(ref_head, ours_head, parameterization)
    body, ours_head, ref_head = body.to(device), ours_head.to(device), ref_head.to(device)
    x, y, x_test, y_test = (t.to(device) for t in (x, y, x_test, y_test))
    ours = Runner(copy.deepcopy(body), ours_head, clip)
    ref = Runner(copy.deepcopy(body), ref_head, clip)
    gen = torch.Generator().manual_seed(seed)
    losses: dict[str, float] = {}
    for epoch in range(epochs):
        perm = torch.randperm(n, generator=gen).to(device)
        # alternate which library goes first, so drifts in machine load hit both alike
        order = (ours, ref) if epoch % 2 == 0 else (ref, ours)
        for runner in order:
            torch.manual_seed(1000 + epoch)
            value = runner.epoch(x, y, perm, batch)
            losses["gaussify" if runner is ours else "vbll"] = value
    out: dict[str, Any] = {
        "task": task,
        "parameterization": parameterization,
        "epochs": epochs,
        "n_train": n,
        "n_test": len(y_test),
        "feature_width": width,
        "batch_size": batch,
        "vbll_prior_scale": vbll_prior,
        "gaussify_prior_scale": mapped_prior,
        "time_per_epoch_gaussify_s": statistics.median(ours.times),
        "time_per_epoch_vbll_s": statistics.median(ref.times),
        "epoch_times_gaussify_s": ours.times,
        "epoch_times_vbll_s": ref.times,
        "final_train_loss_gaussify": losses["gaussify"],
        "final_train_loss_vbll": losses["vbll"],
        "max_head_param_diff": _max_param_diff(ref.head, ours.head, parameterization),
        "max_body_param_diff": _max_body_diff(ref.body, ours.body),
    }
    out["time_ratio"] = out["time_per_epoch_gaussify_s"] / out["time_per_epoch_vbll_s"]
    with torch.no_grad():
        for runner, name in ((ours, "gaussify"), (ref, "vbll")):
            runner.body.eval()
            phi = runner.body(x_test)
            if task == "regression":
                if runner is ours:
                    pred = ours.head(phi).predictive
                    mean, var = pred.mean, pred.var
                else:
                    dist = ref.head(phi).predictive
                    mean, var = dist.mean, dist.variance
                out[f"test_nll_{name}"] = gs.metrics.gaussian_nll(mean, var, y_test)
                out[f"test_rmse_{name}"] = gs.metrics.rmse(mean, y_test)
            elif task == "generative":
                probs = runner.head(phi).predictive.probs
                out[f"test_nll_{name}"] = gs.metrics.nll(probs, y_test)
                out[f"test_acc_{name}"] = gs.metrics.accuracy(probs, y_test)
            else:
                torch.manual_seed(7)
                if runner is ours:
                    ours.head.num_samples = 1000
                    probs = ours.head(phi).predictive.probs
                else:
                    probs = ref.head.predictive(phi, n_samples=1000)
                out[f"test_nll_{name}"] = gs.metrics.nll(probs, y_test)
                out[f"test_acc_{name}"] = gs.metrics.accuracy(probs, y_test)
    return out


def _data(task: str, max_train: int | None) -> dict[str, Tensor]:
    if task == "regression":
        ds = gs.data.load("concrete", seed=0)
    else:
        ds = gs.data.load("mnist", seed=0, max_train=max_train)
    return {"x": ds.x_train, "y": ds.y_train, "x_test": ds.x_test, "y_test": ds.y_test}


CASES = (
    ("regression", "dense"),
    ("regression", "diagonal"),
    ("classification", "dense"),
    ("classification", "diagonal"),
    ("classification", "lowrank"),
    ("generative", "generative"),
)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| task | param. | s/epoch gaussify | s/epoch vbll | ratio | NLL gaussify | NLL vbll "
        "| RMSE/ACC gaussify | RMSE/ACC vbll | max param diff |",
        "|---" * 10 + "|",
    ]
    for r in rows:
        key = "rmse" if r["task"] == "regression" else "acc"
        lines.append(
            f"| {r['task']} | {r['parameterization']} | {r['time_per_epoch_gaussify_s']:.4f} | "
            f"{r['time_per_epoch_vbll_s']:.4f} | {r['time_ratio']:.2f} | "
            f"{r['test_nll_gaussify']:.4f} | {r['test_nll_vbll']:.4f} | "
            f"{r[f'test_{key}_gaussify']:.4f} | {r[f'test_{key}_vbll']:.4f} | "
            f"{r['max_head_param_diff']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 epochs, 2000 images")
    parser.add_argument("--epochs-reg", type=int, default=30)
    parser.add_argument("--epochs-clf", type=int, default=4)
    parser.add_argument("--max-train", type=int, default=None, help="mnist training images")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--device", default="cpu", help="torch device for the model and data (default cpu)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_at_start = os.getloadavg()[0]
    start = time.perf_counter()
    epochs = {
        "regression": args.epochs_reg,
        "classification": args.epochs_clf,
        "generative": args.epochs_clf,
    }
    max_train = 2000 if args.quick and args.max_train is None else args.max_train
    if args.quick:
        epochs = {"regression": 3, "classification": 3, "generative": 3}
    rows = []
    cache: dict[str, dict[str, Tensor]] = {}
    for task, param in CASES:
        if task not in cache:
            cache[task] = _data(task, max_train)
        rows.append(run_case(task, param, cache[task], max(3, epochs[task]), device=args.device))
        r = rows[-1]
        print(
            f"{task:>14} {param:>9}: ratio {r['time_ratio']:.2f}, NLL "
            f"{r['test_nll_gaussify']:.4f} vs {r['test_nll_vbll']:.4f}",
            flush=True,
        )
    result = {
        "benchmark": "vbll_vs_vbll",
        "versions": {"gaussify": version("gaussify") if _installed() else "src", **_versions()},
        "platform": platform.platform(),
        "threads": args.threads,
        "device": args.device,
        "machine_load_1min_at_start": load_at_start,
        "quick": args.quick,
        "prior_scale_mapping": "gaussify prior_scale (prior variance) = vbll prior_scale / D "
        "(Regression) or 2 vbll prior_scale / D (DiscClassification), D = feature width",
        "runtime_s": time.perf_counter() - start,
        "cases": rows,
    }
    print(table(rows))
    ratios = [r["time_ratio"] for r in rows]
    print(f"geometric mean ratio {math.exp(sum(map(math.log, ratios)) / len(ratios)):.2f}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output} in {result['runtime_s']:.1f} s")
    return 0


def _installed() -> bool:
    try:
        version("gaussify")
    except Exception:
        return False
    return True


def _versions() -> dict[str, str]:
    return {"vbll": version("vbll"), "torch": torch.__version__}


if __name__ == "__main__":
    raise SystemExit(main())
