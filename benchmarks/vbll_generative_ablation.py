"""Why G-VBLL's test NLL was twice the softmax DNN's on MNIST: one factor at a time (issue 19).

    python benchmarks/vbll_generative_ablation.py [--seeds 3] [--only NAME ...] [--quick]

The protocol of ``experiments/vbll_classification.py`` (MNIST, 7000 training images, MLP
784-128-128 ReLU features trained jointly with the head, AdamW lr 1e-3, weight decay 1e-2,
gradients clipped at 2.0, batch 128, 15 epochs, KL weight 1/N), and variants that change one
factor each, applied to two starting points:

* ``main``: the G-VBLL head as it was before issue 19's fix (class means drawn ``randn(K, D)``,
  norm about sqrt(D) = 11.3 for D = 128);
* ``fixed``: the class means drawn ``randn(K, D) / sqrt(D)`` (norm about 1, the default now).

The means are drawn from a generator seeded per seed and then scaled, so the two starting
points differ only in that scale. Factors: the mean's scale (also vbll's ``0.1 randn`` and
zeros), the noise's initial variance, the covariance parameterization of S_k and of Sigma,
the prior variance, the inverse-Wishart dof, the KL weight, the class prior (Dirichlet counts
or uniform), the learning rate, the number of epochs, the feature width and the weight decay.
References: the softmax DNN and D-VBLL of the experiment, and the ``vbll`` package's
``GenClassification`` trained by the same loop (its own initialisation, and with its class
means set to the ``main`` draw).

Per run: test accuracy, NLL and ECE of the paper's predictive (eq. 8); the NLL of two other
predictives of the same trained head (plug-in means: ``S_k = 0``; uniform class prior); the
best temperature of the predictive's log probabilities on the validation images and the test
NLL at it (a diagnostic of over-/under-confidence, not a method); the training-set NLL; the
class means' norm and the features' mean norm; the training time. Writes
``benchmarks/results/vbll_generative_ablation.json`` (per run and mean ± s.e. per variant);
``--dataset fashion_mnist --output ...`` runs the same on Fashion-MNIST.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gaussify import data as gdata
from gaussify import metrics
from gaussify.cli_args import add_device_argument, synchronize
from gaussify.experiments import vbll_classification as vc
from gaussify.last_layer import VBLLGenerative

RESULTS = Path(__file__).resolve().parent / "results"
TEMPERATURES = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)

# name -> (starting point, description, overrides); overrides: "head" (constructor kwargs),
# "train" (train() kwargs), "mean_scale" ("sqrtD" = 1/sqrt(D), a number, or 0), "width",
# "method" ("gvbll", "map", "dvbll", "vbll_pkg"), "uniform_prior" (Dirichlet prior 1e9)
BASE: dict[str, dict[str, Any]] = {
    "main": {"mean_scale": 1.0},
    "fixed": {"mean_scale": "sqrtD"},
}
FACTORS: dict[str, tuple[str, dict[str, Any]]] = {
    "baseline": ("no change", {}),
    "mean_0.1": ("class means 0.1 randn (vbll's init)", {"mean_scale": 0.1}),
    "mean_zero": ("class means 0", {"mean_scale": 0.0}),
    "noise_var_0.1": ("Sigma starts at 0.1 I", {"head": {"init_noise_var": 0.1}}),
    "noise_var_10": ("Sigma starts at 10 I", {"head": {"init_noise_var": 10.0}}),
    "cov_dense": ("S_k dense (Cholesky)", {"head": {"parameterization": "dense"}}),
    "noise_dense": ("Sigma dense", {"head": {"noise_parameterization": "dense"}}),
    "prior_0.01": ("prior variance 0.01", {"head": {"prior_scale": 0.01}}),
    "prior_100": ("prior variance 100", {"head": {"prior_scale": 100.0}}),
    "dof_128": ("inverse-Wishart dof 128 (half-moons setting)", {"head": {"dof": 128.0}}),
    "kl_0": ("KL and Wishart weight 0", {"reg": 0.0}),
    "kl_100": ("KL and Wishart weight 100 / N", {"reg": 100.0}),
    "uniform_prior": ("uniform class prior (Dirichlet prior 1e9)", {"uniform_prior": True}),
    "lr_3e-3": ("learning rate 3e-3", {"train": {"lr": 3e-3}}),
    "lr_3e-4": ("learning rate 3e-4", {"train": {"lr": 3e-4}}),
    "epochs_5": ("5 epochs", {"train": {"epochs": 5}}),
    "epochs_45": ("45 epochs", {"train": {"epochs": 45}}),
    "width_32": ("feature width 32", {"width": 32}),
    "width_512": ("feature width 512", {"width": 512}),
    "wd_0": ("no weight decay", {"train": {"weight_decay": 0.0}}),
}
REFERENCES: dict[str, tuple[str, dict[str, Any]]] = {
    "ref_map": ("softmax DNN (the experiment's MAP head)", {"method": "map"}),
    "ref_dvbll": ("D-VBLL (dense, 1000 samples)", {"method": "dvbll"}),
    "ref_map_lr_3e-3": (
        "softmax DNN, learning rate 3e-3",
        {"method": "map", "train": {"lr": 3e-3}},
    ),
    "ref_map_epochs_45": ("softmax DNN, 45 epochs", {"method": "map", "train": {"epochs": 45}}),
    "ref_vbll_pkg": ("vbll GenClassification, its own init", {"method": "vbll_pkg"}),
    "ref_vbll_pkg_main": (
        "vbll GenClassification, class means = the main draw (randn), noise and S as ours",
        {"method": "vbll_pkg", "mean_scale": 1.0, "match_init": True},
    ),
    "ref_vbll_pkg_fixed": (
        "vbll GenClassification, class means = the fixed draw (randn / sqrt(D)), noise and S "
        "as ours",
        {"method": "vbll_pkg", "mean_scale": "sqrtD", "match_init": True},
    ),
}


# the factors rerun from the fixed starting point by default (every factor with --all)
FIXED_FACTORS = ("baseline", "kl_0", "lr_3e-3", "epochs_45", "width_512")
DEFAULT_REFERENCES = ("ref_vbll_pkg", "ref_vbll_pkg_main", "ref_vbll_pkg_fixed")
# variants run with every seed; the others with --factor-seeds
FULL_SEEDS = ("main/baseline", "fixed/baseline")


def variants(quick: bool, everything: bool = False) -> dict[str, tuple[str, dict[str, Any]]]:
    """Variant names -> (description, merged overrides): every factor from ``main``, the
    ``FIXED_FACTORS`` from ``fixed`` and the default references (all of them with
    ``everything``)."""
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    factors = {k: FACTORS[k] for k in ("baseline", "mean_0.1")} if quick else FACTORS
    for base, base_over in BASE.items():
        for name, (desc, over) in factors.items():
            if base == "fixed" and (
                name == "mean_0.1" or (not everything and name not in FIXED_FACTORS)
            ):
                continue
            merged = {**base_over, **over}
            out[f"{base}/{name}"] = (f"{base}: {desc}", merged)
    refs = REFERENCES if everything else {k: REFERENCES[k] for k in DEFAULT_REFERENCES}
    out.update({"ref_map": REFERENCES["ref_map"]} if quick else refs)
    # the two starting points and the references first: a partial run answers the main question
    first = [k for k in (*FULL_SEEDS, *refs) if k in out]
    return {k: out[k] for k in (*first, *[k for k in out if k not in first])}


class _VBLLPackageHead(nn.Module):
    """The ``vbll`` package's GenClassification behind the head interface of ``vc.train``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def loss(self, phi: Tensor, y: Tensor) -> Tensor:
        return self.layer(phi).train_loss_fn(y)

    def probs(self, phi: Tensor) -> Tensor:
        return self.layer(phi).predictive.probs


def _mean_draw(seed: int, k: int, d: int, scale: Any) -> Tensor:
    gen = torch.Generator().manual_seed(1000 + seed)
    raw = torch.randn(k, d, generator=gen)
    if scale == "sqrtD":
        return raw / math.sqrt(d)
    return raw * float(scale)


def _train_package(
    body: nn.Module, head: nn.Module, x: Tensor, y: Tensor, *, epochs: int, lr: float,
    weight_decay: float, batch_size: int, seed: int,
) -> None:  # fmt: skip
    params = [*body.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(seed)
    body.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=gen).split(batch_size):
            opt.zero_grad(set_to_none=True)
            head.loss(body(x[idx]), y[idx]).backward()
            nn.utils.clip_grad_norm_(params, 2.0)
            opt.step()
    body.eval()


def one_run(
    name: str, over: dict[str, Any], seed: int, dataset: str = "mnist",
    device: torch.device | None = None,
) -> dict[str, Any]:  # fmt: skip
    device = torch.device("cpu") if device is None else device
    ds = gdata.load(dataset, seed=seed)
    data = {key: getattr(ds, key).to(device) for key in ("x_train", "y_train", "x_val", "y_val",
                                                         "x_test", "y_test")}  # fmt: skip
    method = over.get("method", "gvbll")
    width = int(over.get("width", 128))
    train_kw: dict[str, Any] = {
        "epochs": 15,
        "lr": 1e-3,
        "weight_decay": 1e-2,
        "batch_size": 128,
        **over.get("train", {}),
    }
    n, k = len(data["y_train"]), 10
    torch.manual_seed(seed)
    body, w = vc.feature_net("mlp", width, data["x_train"].shape[1:])
    body.to(device)
    synchronize(device)
    t0 = time.perf_counter()
    head: nn.Module
    if method == "vbll_pkg":
        import vbll

        layer = vbll.GenClassification(w, k, 1.0 / n, parameterization="diagonal")
        if over.get("match_init"):
            with torch.no_grad():
                layer.mu_mean.copy_(_mean_draw(seed, k, w, over["mean_scale"]))
                layer.mu_logdiag.fill_(0.5 * math.log(min(1.0, 1.0 / w)))  # log std, as ours
                layer.noise_logdiag.zero_()  # Sigma = I, as ours
        head = _VBLLPackageHead(layer).to(device)
        _train_package(body, head, data["x_train"], data["y_train"], seed=seed, **train_kw)
        prob_fn = head.probs
    else:
        kwargs = dict(over.get("head", {}))
        if method == "dvbll":
            kwargs.update({"parameterization": "dense", "num_samples": 1000})
        if method == "gvbll":
            kwargs.setdefault("parameterization", "diagonal")
            if over.get("uniform_prior"):
                kwargs["dirichlet_prior"] = 1e9
        head = vc.make_head(method, w, k, n, **kwargs).to(device)
        if method == "gvbll":
            assert isinstance(head, VBLLGenerative)
            head.regularization_weight = float(over.get("reg", 1.0)) / n
            with torch.no_grad():
                head.mu_mean.copy_(_mean_draw(seed, k, w, over["mean_scale"]))
        vc.train(
            body, head, data["x_train"], data["y_train"], max_grad_norm=2.0, seed=seed, **train_kw
        )

        def prob_fn(phi: Tensor) -> Tensor:
            return vc.predict_probs(head, phi)

    synchronize(device)
    train_s = time.perf_counter() - t0
    with torch.no_grad():
        phi_te, phi_va, phi_tr = (
            vc.features(body, data["x_test"]),
            vc.features(body, data["x_val"]),
            vc.features(body, data["x_train"]),
        )
        torch.manual_seed(10_000 + seed)
        p_te, p_va, p_tr = prob_fn(phi_te), prob_fn(phi_va), prob_fn(phi_tr)
        res = metrics.classification_metrics(p_te, data["y_test"])
        lp_va, lp_te = p_va.clamp_min(1e-30).log(), p_te.clamp_min(1e-30).log()

        def tnll(lp: Tensor, y: Tensor, t: float) -> float:
            return float(nn.functional.cross_entropy(lp / t, y))

        best_t = min(TEMPERATURES, key=lambda t: tnll(lp_va, data["y_val"], t))
        rec: dict[str, Any] = {
            "variant": name,
            "seed": seed,
            "acc": res["acc"],
            "nll": res["nll"],
            "ece": res["ece"],
            "train_nll": float(metrics.classification_metrics(p_tr, data["y_train"])["nll"]),
            "best_temperature_val": best_t,
            "nll_at_best_temperature": tnll(lp_te, data["y_test"], best_t),
            "feature_norm": float(phi_te.norm(dim=-1).mean()),
            "train_seconds": train_s,
        }
        if method == "gvbll":
            assert isinstance(head, VBLLGenerative)
            rec["mean_norm"] = float(head.mu_mean.norm(dim=-1).mean())
            rec["noise_var_median"] = float(head.noise_cov.variance.median())
            marginal = head.noise()  # plug-in: S_k = 0
            from gaussify.last_layer.bounds import generative_log_joint

            plug = generative_log_joint(phi_te, head.mu_mean, marginal, head.log_class_prior())
            rec["nll_plugin_means"] = float(nn.functional.cross_entropy(plug, data["y_test"]))
            uni = head.log_joint(phi_te) - head.log_class_prior()
            rec["nll_uniform_class_prior"] = float(nn.functional.cross_entropy(uni, data["y_test"]))
    return rec


def summarise(records: list[dict[str, Any]], descs: dict[str, str]) -> list[dict[str, Any]]:
    rows = []
    for name, desc in descs.items():
        mine = [r for r in records if r["variant"] == name]
        if not mine:
            continue
        row: dict[str, Any] = {"variant": name, "description": desc, "num_seeds": len(mine)}
        for key in mine[0]:
            if key in ("variant", "seed"):
                continue
            vals = [float(r[key]) for r in mine]
            row[f"{key}_mean"] = statistics.fmean(vals)
            row[f"{key}_se"] = (
                statistics.stdev(vals) / math.sqrt(len(vals)) if len(vals) > 1 else 0.0
            )
        rows.append(row)
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The summary as a Markdown table (mean ± s.e.; s.e. omitted for one seed)."""

    def cell(row: dict[str, Any], key: str, digits: int = 3) -> str:
        if f"{key}_mean" not in row:
            return "–"
        mean, se = row[f"{key}_mean"], row[f"{key}_se"]
        return f"{mean:.{digits}f}" + (f" ± {se:.{digits}f}" if row["num_seeds"] > 1 else "")

    lines = [
        "| variant | change | seeds | ACC | NLL | ECE | best T (val) | NLL at best T "
        "| NLL plug-in means | final ‖μ_k‖ |",
        "|---" * 10 + "|",
    ]
    for r in rows:
        lines.append(
            f"| `{r['variant']}` | {r['description'].split(': ', 1)[-1]} | {r['num_seeds']} | "
            + " | ".join(
                [
                    cell(r, "acc"),
                    cell(r, "nll"),
                    cell(r, "ece"),
                    cell(r, "best_temperature_val", 2),
                    cell(r, "nll_at_best_temperature"),
                    cell(r, "nll_plugin_means"),
                    cell(r, "mean_norm", 1),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only", nargs="+", default=None, help="variant names to run")
    parser.add_argument(
        "--factor-seeds", type=int, default=1, help="seeds of the one-factor variants"
    )
    parser.add_argument("--all", action="store_true", help="every factor from both starts")
    parser.add_argument("--dataset", default="mnist", choices=("mnist", "fashion_mnist"))
    add_device_argument(parser)
    parser.add_argument(
        "--table", type=Path, default=None, help="print the Markdown table of a result file"
    )
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep the output file's runs of other variants (rerun variants replace theirs)",
    )
    parser.add_argument("--quick", action="store_true", help="few variants, 1 seed")
    parser.add_argument("--output", type=Path, default=RESULTS / "vbll_generative_ablation.json")
    args = parser.parse_args(argv)
    if args.table is not None:
        print(markdown_table(json.loads(args.table.read_text())["rows"]))
        return 0
    torch.set_num_threads(1)
    table = variants(args.quick, args.all)
    if args.only:
        unknown = sorted(set(args.only) - set(table))
        if unknown:
            parser.error(f"--only: unknown variants {unknown}; known: {sorted(table)}")
        table = {k: table[k] for k in args.only}
    seeds = [0] if args.quick else list(range(args.seeds))
    start = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    records: list[dict[str, Any]] = []
    descriptions = {k: v[0] for k, v in table.items()}
    if args.append and args.output.exists():
        old = json.loads(args.output.read_text())
        records = [r for r in old["records"] if r["variant"] not in table]
        known = {r["variant"] for r in records}
        full = variants(False, True)
        descriptions = {k: full[k][0] for k in full if k in known or k in table}
        start -= old.get("runtime_s", 0.0)  # the runtime covers every run in the file

    def write(complete: bool) -> None:
        rows = summarise(records, descriptions)
        payload = {
            "benchmark": "vbll_generative_ablation",
            "dataset": args.dataset,
            "protocol": (
                "7000 train / 1500 val / test images, MLP 784-W-W ReLU (W = 128 unless "
                "stated) trained jointly with the head, AdamW lr 1e-3 wd 1e-2, clip 2.0, batch "
                "128, 15 epochs, KL weight 1/N, one thread"
            ),
            "complete": complete,
            "seeds_per_variant": {
                k: [r["seed"] for r in records if r["variant"] == k] for k in descriptions
            },
            "torch": torch.__version__,
            "platform": platform.platform(),
            "machine_load_1min_at_start": load,
            "runtime_s": time.perf_counter() - start,
            "rows": rows,
            "records": records,
        }
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(payload, indent=1) + "\n")

    for name, (_, over) in table.items():
        for seed in seeds if name in FULL_SEEDS else seeds[: args.factor_seeds]:
            rec = one_run(name, over, seed, args.dataset, args.device)
            records.append(rec)
            write(False)
            print(
                f"{name:28s} seed {seed}: acc {rec['acc']:.4f} nll {rec['nll']:.4f} "
                f"ece {rec['ece']:.4f} T* {rec['best_temperature_val']:g} "
                f"nll(T*) {rec['nll_at_best_temperature']:.4f} ({rec['train_seconds']:.1f} s)",
                flush=True,
            )
    write(True)
    print(markdown_table(summarise(records, descriptions)))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
