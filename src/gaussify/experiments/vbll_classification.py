"""Classification with variational Bayesian last layers (Harrison, Willes & Snoek 2024).

Three pieces, at laptop scale:

* :func:`run` -- the protocol of Sec. 4.2 / App. G.3 (Tables 1 and 4: accuracy, ECE, NLL and
  OOD AUROC of D-VBLL, G-VBLL and a softmax DNN) on the shipped image sets instead of CIFAR
  with a Wide ResNet: ``mnist`` and ``fashion_mnist`` with a small MLP (or CNN) feature
  extractor trained jointly with the head. OOD data is the other image set (MNIST ->
  Fashion-MNIST and back). OOD scores: predictive entropy for every model
  (``gs.metrics.ood_auroc``); maximum softmax probability (the paper's choice for the DNN and
  D-VBLL); the G-VBLL feature density (eq. 74, ``out.ood_score()``) and the post-hoc
  G-VBLL-MAP density (App. C.7) for G-VBLL.
* :func:`halfmoons` / :func:`plot_halfmoons` -- the paper's Fig. 1 (right) with the App. G.1
  protocol: G-VBLL on 1000 half-moon points (noise 0.2) with a residual MLP of width 128, SGD
  with momentum (lr 3e-2, beta 0.9, weight decay 1e-4), 100 epochs, batch 32, inverse-Wishart
  dof 128 and scale 1; the predictive probability (eq. 8), the feature log density (eq. 74, the
  OOD score) and the rescaled class-conditional difference ``p(x | y=1) - p(x | y=0)`` over a
  grid.
* :func:`demo_vbll` -- a VBLL head on a user's feature network for ``gaussify demo``.

Hyperparameters (App. G.3 where it applies): AdamW (lr 1e-3, weight decay 1e-2 -- the paper
uses SGD with a cosine schedule for its WRN), gradients clipped at norm 2.0, last-layer KL
weight ``1/N`` (the paper's "KL weight 1.0"), the library's priors (``prior_scale=1``: prior
variance 1; inverse-Wishart ``dof=1``, scale 1), dense covariance for D-VBLL and diagonal for
G-VBLL (App. D.2). D-VBLL probabilities average the softmax over Monte Carlo logit samples.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from gaussify import data as gdata
from gaussify import metrics
from gaussify.cli_args import ArgumentParser, positive_int
from gaussify.data import Dataset
from gaussify.experiments._report import (
    add_progress_argument,
    check_outputs,
    print_summary,
    run_main,
    write_json,
)
from gaussify.experiments._runner import (
    IMAGE_DATASETS,
    OOD_PARTNER,
    check_known,
    fmt,
    result_fields,
    seed_list,
    summary_rows,
    torch_threads,
)
from gaussify.last_layer import GVBLLMAP, VBLLDiscriminative, VBLLGenerative
from gaussify.plots import save_figure

__all__ = [
    "DATASETS",
    "METHODS",
    "OOD_PAIR",
    "VBLLClassificationResults",
    "demo_vbll",
    "feature_net",
    "halfmoons",
    "main",
    "plot_halfmoons",
    "run",
]

DATASETS = IMAGE_DATASETS
OOD_PAIR = OOD_PARTNER  # in-distribution set -> the OOD set scored against it
METHODS: tuple[str, ...] = ("map", "dvbll", "gvbll")
METHOD_LABELS: dict[str, str] = {"map": "MAP softmax", "dvbll": "D-VBLL", "gvbll": "G-VBLL"}

FeatureKind = Literal["mlp", "cnn"]
HeadKind = Literal["discriminative", "generative"]


# --------------------------------------------------------------------------------------------
# networks


def feature_net(kind: FeatureKind = "mlp", width: int = 128, in_shape: Sequence[int] = (1, 28, 28)):
    """A small feature extractor for 28x28 grey images: ``"mlp"`` (two ReLU layers of
    ``width``) or ``"cnn"`` (two 3x3 conv + max-pool blocks, 16 and 32 channels, then a ReLU
    layer of ``width``). Returns ``(net, width)``; ``net(x (N, 1, 28, 28)) -> (N, width)``."""
    d_in = int(np.prod(in_shape))
    if kind == "mlp":
        net = nn.Sequential(
            nn.Flatten(), nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU()
        )
    elif kind == "cnn":
        side = in_shape[-1] // 4
        net = nn.Sequential(
            nn.Conv2d(in_shape[0], 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * side * side, width),
            nn.ReLU(),
        )
    else:
        raise ValueError(f"kind: expected 'mlp' or 'cnn', got {kind!r}")
    return net, width


def make_head(
    method: str, width: int, num_classes: int, num_train: int, **kwargs: Any
) -> nn.Module:
    """The head of ``method``: ``nn.Linear`` (``"map"``), D-VBLL (dense) or G-VBLL (diagonal),
    with KL weight ``1/num_train``."""
    if method == "map":
        return nn.Linear(width, num_classes)
    if method == "dvbll":
        return VBLLDiscriminative(width, num_classes, 1.0 / num_train, **kwargs)
    if method == "gvbll":
        return VBLLGenerative(width, num_classes, 1.0 / num_train, **kwargs)
    raise ValueError(f"method: expected one of {METHODS}, got {method!r}")


def _loss(head: nn.Module, phi: Tensor, y: Tensor) -> Tensor:
    if isinstance(head, nn.Linear):
        return nn.functional.cross_entropy(head(phi), y)
    return head(phi).train_loss(y)


def train(
    body: nn.Module, head: nn.Module, x: Tensor, y: Tensor, *, epochs: int, lr: float = 1e-3,
    weight_decay: float = 1e-2, batch_size: int = 128, max_grad_norm: float | None = 2.0,
    seed: int = 0, optimizer: Literal["adamw", "sgd"] = "adamw", momentum: float = 0.9,
    schedule: Literal["constant", "cosine"] = "constant", progress: Any = None,
) -> list[float]:  # fmt: skip
    """Train ``body`` and ``head`` jointly on ``(x, y)`` (mean training loss per epoch
    returned). G-VBLL heads get their Dirichlet counts from ``y`` first. Batches come from
    ``torch.randperm`` with a generator seeded by ``seed``; ``schedule="cosine"`` anneals the
    learning rate to 0 over ``epochs``."""
    if isinstance(head, VBLLGenerative):
        head.set_class_counts(y)
    params = [*body.parameters(), *head.parameters()]
    opt: torch.optim.Optimizer
    if optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    elif optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    else:
        raise ValueError(f"optimizer: expected 'adamw' or 'sgd', got {optimizer!r}")
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"schedule: expected 'constant' or 'cosine', got {schedule!r}")
    sched = (
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs) if schedule == "cosine" else None
    )
    gen = torch.Generator().manual_seed(seed)
    body.train()
    head.train()
    history = []
    for _ in range(epochs):
        total = 0.0
        for idx in torch.randperm(len(y), generator=gen).split(batch_size):
            opt.zero_grad(set_to_none=True)
            loss = _loss(head, body(x[idx]), y[idx])
            loss.backward()
            if max_grad_norm is not None:
                nn.utils.clip_grad_norm_(params, max_grad_norm)
            opt.step()
            total += float(loss.detach()) * len(idx)
        if sched is not None:
            sched.step()
        history.append(total / len(y))
        if not math.isfinite(history[-1]):
            raise FloatingPointError(f"train: loss became {history[-1]}")
        if progress is not None:
            progress.update()
    body.eval()
    head.eval()
    return history


@torch.no_grad()
def features(body: nn.Module, x: Tensor, batch_size: int = 1000) -> Tensor:
    """``body(x)`` in evaluation mode, in chunks."""
    body.eval()
    return torch.cat([body(xs) for xs in x.split(batch_size)])


@torch.no_grad()
def predict_probs(head: nn.Module, phi: Tensor) -> Tensor:
    """Class probabilities ``(N, C)`` of a head at features ``phi``."""
    if isinstance(head, nn.Linear):
        return head(phi).softmax(-1)
    probs = head(phi).predictive.probs
    assert probs is not None
    return probs


# --------------------------------------------------------------------------------------------
# image sets


@dataclass
class Config:
    """Everything that determines the numbers (stored with the results)."""

    datasets: list[str]
    seeds: list[int]
    features: str
    width: int
    epochs: int
    lr: float
    weight_decay: float
    batch_size: int
    max_grad_norm: float
    max_train: int | None
    num_samples: int
    dvbll: dict[str, Any] = field(default_factory=dict)
    gvbll: dict[str, Any] = field(default_factory=dict)


@dataclass
class VBLLClassificationResults:
    """Results of :func:`run`.

    ``rows``: one per data set and method, mean ± standard error over seeds of the test
    accuracy, ECE, NLL, Brier and OOD AUROCs. ``records``: one per data set, seed and method.
    ``predictions[(dataset, seed, method)]``: the in-distribution test probabilities and the
    OOD probabilities and scores when ``keep_predictions=True``; ``models`` likewise with
    ``keep_models=True`` (``(body, head)``). Neither is serialised.
    """

    config: dict[str, Any]
    rows: list[dict[str, Any]]
    records: list[dict[str, Any]]
    notes: list[str]
    runtime_s: float
    predictions: dict[tuple[str, int, str], dict[str, Tensor]] = field(default_factory=dict)
    models: dict[tuple[str, int, str], tuple[nn.Module, nn.Module]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "experiment": "vbll_classification",
            "paper": "Harrison, Willes & Snoek (2024), Sec. 4.2 / Tables 1, 4 protocol at "
            "laptop scale (MNIST / Fashion-MNIST subsets instead of CIFAR with a WRN-28-10)",
            "config": self.config,
            "runtime_s": self.runtime_s,
            "notes": self.notes,
            "rows": self.rows,
            "records": self.records,
        }

    def table(self) -> str:
        keys = (
            "acc",
            "ece",
            "nll",
            "auroc_entropy",
            "auroc_maxprob",
            "auroc_density",
            "auroc_density_map",
        )
        head = (
            "| data | method | ACC | ECE | NLL | AUROC entropy | AUROC max-prob "
            "| AUROC density | AUROC density (G-VBLL-MAP) |"
        )
        lines = [head, "|---" * 9 + "|"]
        for r in self.rows:
            cells = [fmt(r.get(f"{k}_mean"), r.get(f"{k}_se"), 3) for k in keys]
            lines.append(f"| {r['dataset']} | {r['label']} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _ood_auroc(score_in: Tensor, score_out: Tensor) -> float:
    """AUROC of telling OOD (positives) from in-distribution by ``score`` (higher = OOD)."""
    scores = torch.cat([score_in, score_out]).double()
    labels = torch.cat(
        [torch.zeros(len(score_in), dtype=torch.bool), torch.ones(len(score_out), dtype=torch.bool)]
    )
    return metrics.auroc(scores, labels)


def _evaluate(
    method: str,
    body: nn.Module,
    head: nn.Module,
    ds: Dataset,
    x_ood: Tensor,
    seed: int,
) -> tuple[dict[str, float], dict[str, Tensor]]:
    phi_in, phi_out = features(body, ds.x_test), features(body, x_ood)
    torch.manual_seed(10_000 + seed)  # D-VBLL's Monte Carlo predictive
    p_in, p_out = predict_probs(head, phi_in), predict_probs(head, phi_out)
    out = metrics.classification_metrics(p_in, ds.y_test)
    out["auroc_entropy"] = metrics.ood_auroc(p_in, p_out)
    out["auroc_maxprob"] = _ood_auroc(-p_in.amax(-1), -p_out.amax(-1))
    kept = {"probs_in": p_in, "probs_out": p_out}
    if isinstance(head, VBLLGenerative):
        with torch.no_grad():
            s_in, s_out = head(phi_in).ood_score(), head(phi_out).ood_score()
            out["auroc_density"] = _ood_auroc(s_in, s_out)
            phi_train = features(body, ds.x_train)
            gmap = GVBLLMAP.from_head(head, phi_train, ds.y_train)
            out["auroc_density_map"] = _ood_auroc(gmap.ood_score(phi_in), gmap.ood_score(phi_out))
        kept.update({"density_in": s_in, "density_out": s_out})
    return out, kept


def run(
    datasets: Sequence[str] | None = None, seeds: int | Sequence[int] = 3, quick: bool = False,
    progress: bool = False, *, features_kind: FeatureKind = "mlp", width: int = 128,
    epochs: int | None = None, lr: float = 1e-3, weight_decay: float = 1e-2,
    batch_size: int = 128, max_train: int | None = None, num_samples: int = 1000,
    keep_predictions: bool = False, keep_models: bool = False, num_threads: int | None = 1,
) -> VBLLClassificationResults:  # fmt: skip
    """Train MAP softmax, D-VBLL and G-VBLL heads with the same feature network on each image
    set and evaluate accuracy, ECE (15 bins), NLL, Brier and OOD AUROCs against the other set.

    ``seeds``: a number (0..n-1) or explicit seeds (one split and initialisation each; every
    method of a seed starts from the same feature-network initialisation). ``epochs`` default
    15; ``max_train`` subsamples the training part; ``num_samples``: Monte Carlo samples of
    the D-VBLL predictive. ``quick=True``: mnist, 1 seed, 2 epochs, 1000 training images (for
    tests). Deterministic given the arguments.
    """
    start = time.perf_counter()
    chosen = list(DATASETS if datasets is None else datasets)
    if quick and datasets is None:
        chosen = ["mnist"]
    check_known(chosen, OOD_PAIR, f"datasets: expected names from {DATASETS}, got {{bad}}")
    seed_ids = seed_list(seeds, 1, quick=quick)
    cfg = Config(
        datasets=chosen,
        seeds=seed_ids,
        features=features_kind,
        width=width,
        epochs=epochs if epochs is not None else (2 if quick else 15),
        lr=lr,
        weight_decay=weight_decay,
        batch_size=batch_size,
        max_grad_norm=2.0,
        max_train=max_train if max_train is not None else (1000 if quick else None),
        num_samples=num_samples,
        dvbll={"parameterization": "dense", "num_samples": num_samples},
        gvbll={"parameterization": "diagonal"},
    )
    bar = None
    if progress:
        from tqdm.auto import tqdm

        total = len(chosen) * len(seed_ids) * len(METHODS) * cfg.epochs
        bar = tqdm(total=total, desc="VBLL images", unit="epoch")
    records: list[dict[str, Any]] = []
    predictions: dict[tuple[str, int, str], dict[str, Tensor]] = {}
    models: dict[tuple[str, int, str], tuple[nn.Module, nn.Module]] = {}

    def one(name: str, seed: int) -> None:
        ds = gdata.load(name, seed=seed, max_train=cfg.max_train)
        ood = gdata.load(OOD_PAIR[name], seed=seed)
        num_classes = int(ds.num_classes or 0)
        for method in METHODS:
            torch.manual_seed(seed)
            body, w = feature_net(features_kind, width, ds.x_train.shape[1:])
            head = make_head(method, w, num_classes, len(ds.y_train), **getattr(cfg, method, {}))
            t0 = time.perf_counter()
            history = train(
                body,
                head,
                ds.x_train,
                ds.y_train,
                epochs=cfg.epochs,
                lr=lr,
                weight_decay=weight_decay,
                batch_size=batch_size,
                max_grad_norm=cfg.max_grad_norm,
                seed=seed,
                progress=bar,
            )
            train_s = time.perf_counter() - t0
            res, kept = _evaluate(method, body, head, ds, ood.x_test, seed)
            records.append(
                {
                    "dataset": name,
                    "ood_dataset": OOD_PAIR[name],
                    "seed": seed,
                    "method": method,
                    "n_train": len(ds.y_train),
                    "n_test": len(ds.y_test),
                    "n_ood": len(ood.y_test),
                    "final_train_loss": history[-1],
                    "train_seconds": train_s,
                    **res,
                }
            )
            if keep_predictions:
                predictions[(name, seed, method)] = {
                    **kept,
                    "y_test": ds.y_test,
                }
            if keep_models:
                models[(name, seed, method)] = (body, head)

    with torch_threads(num_threads):
        try:
            for name in chosen:
                for seed in seed_ids:
                    one(name, seed)
        finally:
            if bar is not None:
                bar.close()
    notes = [
        f"{len(seed_ids)} seeds; features: {features_kind} of width {width}, trained jointly "
        f"with each head for {cfg.epochs} epochs (AdamW lr {lr:g}, weight decay "
        f"{weight_decay:g}, batch {batch_size}, clip 2.0).",
        "OOD: the other image set's test images; 'entropy' = predictive entropy, 'max-prob' = "
        "maximum probability (paper's DNN/D-VBLL score), 'density' = G-VBLL feature density "
        "(eq. 74), 'density_map' = G-VBLL-MAP (App. C.7).",
        f"D-VBLL probabilities: Monte Carlo over {num_samples} logit samples.",
    ]
    return VBLLClassificationResults(
        **result_fields(cfg, summarise(records, chosen), records, notes, start),
        predictions=predictions,
        models=models,
    )


def summarise(records: list[dict[str, Any]], datasets: Sequence[str]) -> list[dict[str, Any]]:
    """One row per data set and method: every metric's mean and standard error over seeds."""
    keys = (
        "acc",
        "ece",
        "nll",
        "brier",
        "auroc_entropy",
        "auroc_maxprob",
        "auroc_density",
        "auroc_density_map",
    )
    return summary_rows(records, datasets, METHODS, METHOD_LABELS, keys)


# --------------------------------------------------------------------------------------------
# half moons (Fig. 1 right, App. G.1)


class ResidualMLP(nn.Module):
    """``h_0 = W_0 x``, ``h_l = h_{l-1} + relu(W_l h_{l-1})`` ("each hidden layer is added to the
    layer input", App. G.1); returns ``h_depth``, (N, width)."""

    def __init__(self, d_in: int = 2, width: int = 128, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + torch.relu(layer(h))
        return h


def halfmoons(
    seed: int = 0, epochs: int = 100, width: int = 128, depth: int = 3, grid_size: int = 120,
    dof: float = 128.0, wishart_scale: float = 1.0, max_grad_norm: float | None = 2.0,
) -> dict[str, Any]:  # fmt: skip
    """Train G-VBLL on all 1000 points of ``two_moons`` (sklearn ``make_moons``, noise 0.2, raw
    coordinates) with the App. G.1 protocol and evaluate over a ``grid_size`` square grid.

    Returns ``x, y`` (the data), ``xx, yy`` (grid, (G, G)), ``prob`` (p(y=1 | x), eq. 8),
    ``log_density`` (log p(phi(x)), eq. 74; its negative is the OOD score), ``class_diff``
    (``p(phi | y=1) - p(phi | y=0)`` divided by its largest absolute value on the grid, the
    paper's Fig. 1 right), the head and the network. Departures: gradients are clipped at
    ``max_grad_norm`` (2.0, as in the paper's regression toy) -- without clipping SGD at lr
    3e-2 diverges within the first epochs (the dof-128 inverse-Wishart prior pulls the noise
    variance to about 1/257, so feature gradients are large) -- and the learning rate is
    cosine-annealed: at a constant 3e-2 the training accuracy keeps jumping between 0.8 and
    0.96 from epoch to epoch. Runs single-threaded (restored after).
    """
    with torch_threads(1):
        return _halfmoons(seed, epochs, width, depth, grid_size, dof, wishart_scale, max_grad_norm)


def _halfmoons(
    seed: int,
    epochs: int,
    width: int,
    depth: int,
    grid_size: int,
    dof: float,
    wishart_scale: float,
    max_grad_norm: float | None,
) -> dict[str, Any]:
    ds = gdata.load("two_moons", seed=seed, standardize=False)
    x = torch.cat([ds.x_train, ds.x_val, ds.x_test])
    y = torch.cat([ds.y_train, ds.y_val, ds.y_test])
    torch.manual_seed(seed)
    body = ResidualMLP(2, width, depth)
    head = VBLLGenerative(width, 2, 1.0 / len(y), dof=dof, wishart_scale=wishart_scale)
    history = train(
        body,
        head,
        x,
        y,
        epochs=epochs,
        lr=3e-2,
        weight_decay=1e-4,
        batch_size=32,
        max_grad_norm=max_grad_norm,
        seed=seed,
        optimizer="sgd",
        momentum=0.9,
        schedule="cosine",
    )
    lo, hi = x.min(0).values - 1.5, x.max(0).values + 1.5
    g0 = torch.linspace(float(lo[0]), float(hi[0]), grid_size)
    g1 = torch.linspace(float(lo[1]), float(hi[1]), grid_size)
    xx, yy = torch.meshgrid(g0, g1, indexing="xy")
    grid = torch.stack([xx.reshape(-1), yy.reshape(-1)], dim=-1)
    with torch.no_grad():
        phi = features(body, grid)
        out = head(phi)
        prob = out.predictive.probs[:, 1]
        log_density = head.feature_log_density(phi)
        # log p(phi | y = k) = log N(phi | mu_k, Sigma + S_k): the joint minus the class prior
        cond = head.log_joint(phi) - head.log_class_prior()
        top = cond.max()
        diff = (cond[:, 1] - top).exp() - (cond[:, 0] - top).exp()
        diff = diff / diff.abs().max().clamp_min(1e-300)
        train_acc = metrics.accuracy(predict_probs(head, features(body, x)), y)
    shape = (grid_size, grid_size)
    return {
        "x": x,
        "y": y,
        "xx": xx,
        "yy": yy,
        "prob": prob.reshape(shape),
        "log_density": log_density.reshape(shape),
        "class_diff": diff.reshape(shape),
        "train_accuracy": train_acc,
        "final_train_loss": history[-1],
        "head": head,
        "body": body,
    }


def plot_halfmoons(result: dict[str, Any], path: str | Path) -> Path:
    """Three panels over the grid of :func:`halfmoons`: predictive probability, feature log
    density (OOD score), rescaled ``p(x | y=1) - p(x | y=0)``. Uses the Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13.5, 4.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    xx, yy = result["xx"].numpy(), result["yy"].numpy()
    x, y = result["x"].numpy(), result["y"].numpy()
    # the density spans hundreds of nats far from the data: clip for a readable colour scale
    dens = result["log_density"].numpy()
    dens_lo = float(np.quantile(dens, 0.02))
    panels = (
        (result["prob"].numpy(), "RdBu_r", (0.0, 1.0), "predictive p(y=1 | x) (eq. 8)"),
        (np.clip(dens, dens_lo, None), "viridis", None, "feature log density log p(φ(x)) (eq. 74)"),
        (result["class_diff"].numpy(), "RdBu_r", (-1.0, 1.0), "p(x | y=1) − p(x | y=0), rescaled"),
    )
    for ax, (z, cmap, lim, title) in zip(axes, panels, strict=True):
        kw = {} if lim is None else {"vmin": lim[0], "vmax": lim[1]}
        mesh = ax.contourf(xx, yy, z, levels=30, cmap=cmap, **kw)
        fig.colorbar(mesh, ax=ax, shrink=0.85)
        ax.scatter(x[y == 0, 0], x[y == 0, 1], s=3, c="k", alpha=0.5)
        ax.scatter(x[y == 1, 0], x[y == 1, 1], s=3, c="w", edgecolors="k", linewidths=0.2)
        ax.set_title(title, fontsize=10)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(
        "G-VBLL on half moons (residual MLP, width 128; App. G.1)  "
        f"train acc {result['train_accuracy']:.3f}",
        fontsize=11,
    )
    return save_figure(fig, path)


# --------------------------------------------------------------------------------------------
# gaussify demo


def demo_vbll(
    ds: Dataset,
    features_model: nn.Module,
    *,
    head: HeadKind = "discriminative",
    mode: Literal["joint", "posthoc"] = "joint",
    epochs: int = 30,
    lr: float = 3e-3,
    weight_decay: float = 1e-2,
    batch_size: int = 128,
    seed: int = 0,
    progress: bool = False,
) -> tuple[str, Tensor]:
    """A VBLL head on ``features_model`` for ``gaussify demo``: returns ``(name, probs)`` with
    the test-set class probabilities ``probs (N_test, C)`` of ``ds``.

    ``features_model`` maps ``ds.x_*`` to features ``(N, D)`` (e.g. the demo MLP without its
    last ``nn.Linear``); ``D`` is read off one forward pass. ``mode="joint"`` trains a *copy*
    of it together with the head (the VBLL recipe: swap the last layer and the loss);
    ``mode="posthoc"`` keeps it frozen and fits only the head on its features (for an already
    trained MAP body). ``head``: ``"discriminative"`` (D-VBLL, dense covariance, Monte Carlo
    predictive with 1000 samples) or ``"generative"`` (G-VBLL, diagonal). AdamW with gradient
    clipping at 2.0, KL weight ``1/N``. ``name`` is ``"vbll-disc"`` / ``"vbll-gen"`` with
    ``"-posthoc"`` appended in post-hoc mode. The input model is never modified.
    """
    if ds.task != "classification":
        raise ValueError(f"ds: demo_vbll needs a classification data set, {ds.name} is {ds.task}")
    if head not in ("discriminative", "generative"):
        raise ValueError(f"head: expected 'discriminative' or 'generative', got {head!r}")
    if mode not in ("joint", "posthoc"):
        raise ValueError(f"mode: expected 'joint' or 'posthoc', got {mode!r}")
    torch.manual_seed(seed)
    body = copy.deepcopy(features_model)
    with torch.no_grad():
        body.eval()
        probe = body(ds.x_train[:2])
    if probe.dim() != 2:
        raise ValueError(
            f"features_model: expected features of shape (N, D), got {tuple(probe.shape)}"
        )
    width, num_classes, n = probe.shape[1], int(ds.num_classes or 0), len(ds.y_train)
    if head == "discriminative":
        vbll: nn.Module = VBLLDiscriminative(width, num_classes, 1.0 / n, num_samples=1000)
    else:
        vbll = VBLLGenerative(width, num_classes, 1.0 / n)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=epochs, desc=f"VBLL {head} ({mode})", unit="epoch")
    try:
        net, inputs = body, ds.x_train
        if mode != "joint":  # post hoc: a frozen body, the head trained on its features
            for p in body.parameters():
                p.requires_grad_(False)
            net, inputs = nn.Identity(), features(body, ds.x_train)
        train(
            net,
            vbll,
            inputs,
            ds.y_train,
            epochs=epochs,
            lr=lr,
            weight_decay=weight_decay,
            batch_size=batch_size,
            seed=seed,
            progress=bar,
        )
    finally:
        if bar is not None:
            bar.close()
    torch.manual_seed(seed)
    probs = predict_probs(vbll, features(body, ds.x_test))
    name = "vbll-disc" if head == "discriminative" else "vbll-gen"
    return (name if mode == "joint" else f"{name}-posthoc"), probs


# --------------------------------------------------------------------------------------------
# command line


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m gaussify.experiments.vbll_classification [options]``: the image-set
    table (``--output`` JSON) and the half-moons figure (``--figure``)."""
    parser = ArgumentParser(
        prog="gaussify experiment vbll_classification",
        description="Harrison et al. (2024): D-/G-VBLL vs a MAP softmax head on MNIST / "
        "Fashion-MNIST subsets (ACC, ECE, NLL, OOD AUROC) and the half-moons G-VBLL figure.",
    )
    parser.add_argument("--datasets", nargs="+", default=None, help="mnist, fashion_mnist")
    parser.add_argument("--seeds", type=positive_int, default=3)
    parser.add_argument("--epochs", type=positive_int, default=None, help="default 15")
    parser.add_argument("--features", choices=("mlp", "cnn"), default="mlp")
    parser.add_argument("--max-train", type=positive_int, default=None)
    parser.add_argument("--quick", action="store_true", help="mnist, 1 seed, 2 epochs")
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--figure", type=Path, default=None, help="write the half-moons PNG")
    parser.add_argument("--skip-images", action="store_true", help="only the figure")
    add_progress_argument(parser)
    args = parser.parse_args(argv)
    check_outputs(args)
    payload: dict[str, Any] = {}
    if not args.skip_images:
        res = run(
            datasets=args.datasets,
            seeds=args.seeds,
            quick=args.quick,
            progress=args.progress,
            features_kind=args.features,
            epochs=args.epochs,
            max_train=args.max_train,
        )
        title = "Test metrics, mean ± s.e. over seeds (OOD: the other image set)"
        print_summary(res, title)
        payload = res.to_dict()
    if args.figure is not None:
        t0 = time.perf_counter()
        moons = halfmoons()
        path = plot_halfmoons(moons, args.figure)
        seconds = time.perf_counter() - t0
        print(f"half moons: train accuracy {moons['train_accuracy']:.3f}, wrote {path}")
        payload["halfmoons"] = {
            "figure": str(path),
            "train_accuracy": moons["train_accuracy"],
            "final_train_loss": moons["final_train_loss"],
            "seconds": seconds,
        }
    if args.output is not None and payload:
        print(f"wrote {write_json(args.output, payload)}")
    return 0


if __name__ == "__main__":
    run_main(main)
