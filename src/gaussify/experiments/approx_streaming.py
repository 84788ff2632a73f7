"""Streaming last layers with Gaussian likelihood approximations (Bui, Sec. 4.3, Fig. 4 / 15).

Only the last layer of a network is learnt, on top of a *random* feature extractor, while the
training points arrive one mini-batch at a time. After each batch the test accuracy and the
test log-likelihood (mean ``log p(y | x, D_seen)``) are recorded against the number of points
seen. Learners, all started from the same prior:

* exact inference in the approximate model (:class:`gaussify.last_layer.exact.ExactLastLayer`)
  for each Gaussian approximation ``moment-ori``, ``moment``, ``laplace``, ``variational`` and
  ``gauss``: a rank-B Kalman update per batch, which reaches the one-shot posterior of eq. (4)
  exactly, whatever the batching;
* approximate inference in the exact (softmax) model: ADF with a full Gaussian per output,
  a Monte Carlo log-normaliser and damping (:class:`gaussify.last_layer.adf.ADFLastLayer`),
  one point at a time;
* SGD with momentum on the cross-entropy, one step per arriving batch (``sgd+m``).

Features: ``phi(x) = relu((x - xbar) W + b)``, ``W ~ N(0, 2 / d_in)``, ``b ~ N(0, 0.01)``,
drawn once per seed (``xbar`` the training-pixel mean). The prior ``N(0, I / delta)`` on every
weight column uses ``delta = mean ||[phi, 1]||^2 / prior_logit_var``, so each logit has prior
variance ``prior_logit_var`` at a typical training input. The default
:data:`PRIOR_LOGIT_VAR` ``= trigamma(1) = pi^2/6`` is the paper's own map applied to the
uniform prior ``Dir(1)`` on the class probabilities: in the log basis each logit of a
``Dir(1)`` draw is ``log w``, ``w ~ Gamma(1, 1)`` (Sec. 2.2), whose moment-matched Gaussian
(Sec. 3.2) is ``N(digamma(1), trigamma(1))``
(:func:`gaussify.approx_likelihoods.closed_forms.dirichlet_logit_prior`; the common mean
cancels in the softmax). The paper states no prior for this experiment; this one uses no data
and is the same for every learner. Predictions: probit link for the Gaussian posteriors,
softmax of the weights for ``sgd+m``.

Scaled from the paper (full MNIST / Fashion-MNIST streams on a GPU) to the shipped subsets:
``num_points=2000`` streamed points, width 256, batches of 10, three seeds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gaussify import data as gdata
from gaussify import metrics
from gaussify.approx_likelihoods.closed_forms import dirichlet_logit_prior
from gaussify.cli_args import positive_float, positive_int
from gaussify.experiments._report import (
    progress_bar,
    run_main,
)
from gaussify.experiments._runner import check_known, cli
from gaussify.last_layer.adf import ADFLastLayer, SGDLastLayer
from gaussify.last_layer.exact import ExactLastLayer
from gaussify.plots import save_figure

__all__ = [
    "BASELINES",
    "DATASETS",
    "DEFAULT_ALPHA",
    "METHODS",
    "PRIOR_LOGIT_VAR",
    "StreamingResults",
    "checkpoints",
    "main",
    "make_learners",
    "plot",
    "random_features",
    "run",
    "stream",
]

DATASETS: tuple[str, ...] = ("mnist", "fashion_mnist")
METHODS: tuple[str, ...] = ("moment-ori", "moment", "laplace", "variational", "gauss")
BASELINES: tuple[str, ...] = ("adf", "sgd+m")
#: alpha_eps per approximation (the paper: 0.1-0.2 works well; moment-ori prefers smaller)
DEFAULT_ALPHA: dict[str, float] = {
    "moment-ori": 0.05,
    "moment": 0.1,
    "laplace": 0.1,
    "variational": 0.1,
}
COLOURS: dict[str, str] = {
    "moment-ori": "tab:blue",
    "moment": "tab:orange",
    "laplace": "tab:green",
    "variational": "tab:red",
    "gauss": "tab:gray",
    "adf": "tab:purple",
    "sgd+m": "tab:brown",
}
#: prior variance of each logit at a typical input: the moment-matched log-basis Gaussian of a
#: uniform Dir(1) prior on the class probabilities, trigamma(1) = pi^2/6 (Sec. 2.2, 3.2)
PRIOR_LOGIT_VAR: float = dirichlet_logit_prior(1.0, "moment")[1]
PRIOR_RULE = (
    "prior logit variance trigamma(1) = pi^2/6: the moment-matched log-basis Gaussian of the "
    "uniform Dir(1) prior on the class probabilities (Sec. 2.2, 3.2), for every learner"
)
#: "after few points": the checkpoints at which the ordering of the paper is checked
FEW_POINTS: tuple[int, ...] = (20, 50, 100)
F64 = torch.float64

Learner = ExactLastLayer | ADFLastLayer | SGDLastLayer


def random_features(
    x_train: Tensor, x_test: Tensor, width: int, seed: int
) -> tuple[Tensor, Tensor]:
    """A random one-layer ReLU body, ``phi(x) = relu((x - xbar) W + b)`` in float64, with
    ``W (d_in, width) ~ N(0, 2 / d_in)`` and ``b ~ N(0, 0.1^2)`` from ``seed``; inputs are
    flattened. Returns ``(phi_train, phi_test)``."""
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width: must be a positive integer, got {width!r}")
    xtr, xte = x_train.reshape(len(x_train), -1).to(F64), x_test.reshape(len(x_test), -1).to(F64)
    gen = torch.Generator().manual_seed(int(seed))
    d_in = xtr.shape[1]
    weight = torch.randn(d_in, width, generator=gen, dtype=F64) * math.sqrt(2.0 / d_in)
    bias = 0.1 * torch.randn(width, generator=gen, dtype=F64)
    centre = xtr.mean(0)
    return torch.relu((xtr - centre) @ weight + bias), torch.relu((xte - centre) @ weight + bias)


def checkpoints(num_points: int) -> list[int]:
    """Roughly log-spaced numbers of points seen, ``1, 2, 5 x 10^k`` up to ``num_points``
    (which is always the last one)."""
    if isinstance(num_points, bool) or not isinstance(num_points, int) or num_points < 1:
        raise ValueError(f"num_points: must be a positive integer, got {num_points!r}")
    out = {num_points}
    scale = 10
    while scale < num_points:
        out.update(m * scale for m in (1, 2, 5) if m * scale < num_points)
        scale *= 10
    return sorted(out)


def make_learners(
    width: int,
    num_classes: int,
    prior_precision: float,
    *,
    methods: Sequence[str] = METHODS + BASELINES,
    alpha_eps: dict[str, float] | None = None,
    noise: float = 0.1,
    sgd_lr: float = 0.1,
    sgd_momentum: float = 0.9,
    adf_samples: int = 100,
    seed: int = 0,
) -> dict[str, Learner]:
    """One fresh learner per name in ``methods`` (approximations and baselines)."""
    alphas = {**DEFAULT_ALPHA, **(alpha_eps or {})}
    learners: dict[str, Learner] = {}
    for name in methods:
        if name in METHODS:
            learners[name] = ExactLastLayer(
                width,
                num_classes,
                method=name,  # type: ignore[arg-type]
                alpha_eps=alphas.get(name, 0.1),
                noise=noise,
                prior_precision=prior_precision,
            )
        elif name == "adf":
            gen = torch.Generator().manual_seed(10_000 + int(seed))
            learners[name] = ADFLastLayer(
                width,
                num_classes,
                prior_precision=prior_precision,
                num_samples=adf_samples,
                generator=gen,
            )
        elif name == "sgd+m":
            learners[name] = SGDLastLayer(width, num_classes, lr=sgd_lr, momentum=sgd_momentum)
        else:
            raise ValueError(f"methods: unknown method {name!r}; choose from {METHODS + BASELINES}")
    return learners


def _probs(learner: Learner, phi: Tensor) -> Tensor:
    probs = learner.predict(phi).probs
    assert probs is not None
    return probs


def stream(
    learners: dict[str, Learner],
    phi: Tensor,
    y: Tensor,
    phi_test: Tensor,
    y_test: Tensor,
    stops: Sequence[int],
    batch_size: int = 10,
) -> dict[str, dict[str, list[float]]]:
    """Feed ``(phi, y)`` to every learner in batches of ``batch_size`` (never across a
    checkpoint) and evaluate on the test set at each number of points in ``stops``.

    Returns ``{name: {"acc": [...], "ll": [...], "seconds": [...]}}``, ``ll`` the mean test
    log-likelihood ``-metrics.nll`` and ``seconds`` the cumulative update time."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: must be a positive integer, got {batch_size!r}")
    stops = [int(s) for s in stops]
    if not stops or stops != sorted(set(stops)) or stops[0] < 1 or stops[-1] > len(y):
        raise ValueError(f"stops: expected increasing counts in [1, {len(y)}], got {stops}")
    curves = {name: {"acc": [], "ll": [], "seconds": []} for name in learners}
    elapsed = dict.fromkeys(learners, 0.0)
    seen = 0
    for stop in stops:
        for start in range(seen, stop, batch_size):
            end = min(start + batch_size, stop)
            for name, learner in learners.items():
                t0 = time.perf_counter()
                learner.update(phi[start:end], y[start:end])
                elapsed[name] += time.perf_counter() - t0
        seen = stop
        for name, learner in learners.items():
            probs = _probs(learner, phi_test)
            curves[name]["acc"].append(metrics.accuracy(probs, y_test))
            curves[name]["ll"].append(-metrics.nll(probs, y_test))
            curves[name]["seconds"].append(elapsed[name])
    return curves


def _mean_sem(values: Sequence[float]) -> tuple[float, float]:
    t = torch.tensor(list(values), dtype=F64)
    if len(t) < 2:
        return float(t.mean()), float("nan")
    return float(t.mean()), float(t.std(unbiased=True) / math.sqrt(len(t)))


@dataclass
class StreamingResults:
    """Results of :func:`run`.

    ``curves[dataset][method]``: per checkpoint, mean and standard error over seeds of the
    test accuracy and log-likelihood (``acc_mean``, ``acc_sem``, ``ll_mean``, ``ll_sem``) and
    the cumulative update seconds; ``records``: the per-seed curves; ``ordering``: per data set
    and checkpoint of :data:`FEW_POINTS`, whether ``best exact >= ADF >= SGD+m`` in mean test
    log-likelihood. ``learners[(dataset, seed)]`` and ``features[(dataset, seed)]`` (``phi``,
    ``y`` streamed, ``phi_test``, ``y_test``) are kept with ``keep=True`` (not serialised).
    """

    config: dict[str, Any]
    checkpoints: list[int]
    curves: dict[str, dict[str, dict[str, list[float]]]]
    records: list[dict[str, Any]]
    ordering: list[dict[str, Any]]
    notes: list[str]
    runtime_s: float
    learners: dict[tuple[str, int], dict[str, Learner]] = field(default_factory=dict)
    features: dict[tuple[str, int], tuple[Tensor, Tensor, Tensor, Tensor]] = field(
        default_factory=dict
    )

    def to_dict(self) -> dict[str, Any]:
        return {
            "experiment": "approx_streaming",
            "paper": "Bui, Sec. 4.3, Fig. 4 / Fig. 15 protocol at laptop scale (random-feature "
            "last layers on the shipped MNIST / Fashion-MNIST subsets)",
            "config": self.config,
            "runtime_s": self.runtime_s,
            "checkpoints": self.checkpoints,
            "notes": self.notes,
            "ordering": self.ordering,
            "curves": self.curves,
            "records": self.records,
        }

    def table(self, at: Sequence[int] | None = None) -> str:
        """Markdown table of the mean ± s.e. test log-likelihood (and accuracy) at ``at``."""
        at = [c for c in (at or self.checkpoints) if c in self.checkpoints]
        idx = [self.checkpoints.index(c) for c in at]
        head = "| data | method | " + " | ".join(f"n={c}" for c in at) + " |"
        lines = [head, "|---|---|" + "---|" * len(at)]
        for ds, methods in self.curves.items():
            for name, c in methods.items():
                cells = [
                    f"{c['ll_mean'][i]:.3f} ± {c['ll_sem'][i]:.3f} ({c['acc_mean'][i]:.3f})"
                    for i in idx
                ]
                lines.append(f"| {ds} | {name} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def run(
    datasets: Sequence[str] | None = None,
    seeds: int | Sequence[int] = 3,
    quick: bool = False,
    *,
    methods: Sequence[str] = METHODS + BASELINES,
    num_points: int = 2000,
    width: int = 256,
    batch_size: int = 10,
    prior_logit_var: float = PRIOR_LOGIT_VAR,
    alpha_eps: dict[str, float] | None = None,
    noise: float = 0.1,
    sgd_lr: float = 0.1,
    adf_samples: int = 100,
    num_test: int | None = None,
    keep: bool = False,
    num_threads: int | None = 1,
    progress: bool = False,
) -> StreamingResults:
    """Stream ``num_points`` training points of each data set through every learner and
    record the test curves (see the module docstring). ``seeds``: a count (0..n-1) or a list;
    a seed fixes the split, the random features, the stream order and ADF's samples.
    ``quick=True``: ``mnist``, one seed, 200 points, width 32, 500 test points (for tests)."""
    start = time.perf_counter()
    chosen = list(DATASETS if datasets is None else datasets)
    if quick:
        if datasets is None:
            chosen = ["mnist"]
        num_points, width, num_test = min(num_points, 200), min(width, 32), num_test or 500
    known = gdata.list()
    check_known(chosen, known, "datasets: unknown data set(s) {bad}; see gaussify.data.list()")
    seed_list = list(range(1 if quick else seeds)) if isinstance(seeds, int) else list(seeds)
    if not seed_list:
        raise ValueError("seeds: need at least one seed")
    if not prior_logit_var > 0:
        raise ValueError(f"prior_logit_var: must be positive, got {prior_logit_var}")
    unknown = [m for m in methods if m not in METHODS + BASELINES]
    if unknown:
        raise ValueError(f"methods: unknown {unknown}; choose from {METHODS + BASELINES}")
    for ds_name in chosen:  # every data set checked before the first one is streamed
        if gdata.info(ds_name).task != "classification":
            raise ValueError(f"datasets: {ds_name} is not a classification data set")
        n_train = len(gdata.load(ds_name, seed=seed_list[0]).y_train)
        if num_points > n_train:
            raise ValueError(
                f"num_points: {ds_name} has {n_train} training points, got {num_points}"
            )
    threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    stops = checkpoints(num_points)
    records: list[dict[str, Any]] = []
    result = StreamingResults(
        config={
            "datasets": chosen,
            "seeds": seed_list,
            "methods": list(methods),
            "num_points": num_points,
            "width": width,
            "batch_size": batch_size,
            "prior_logit_var": prior_logit_var,
            "prior_rule": PRIOR_RULE if prior_logit_var == PRIOR_LOGIT_VAR else "given",
            "alpha_eps": {**DEFAULT_ALPHA, **(alpha_eps or {})},
            "gauss_noise": noise,
            "sgd_lr": sgd_lr,
            "sgd_momentum": 0.9,
            "adf_samples": adf_samples,
            "num_test": num_test,
            "link": "probit",
        },
        checkpoints=stops,
        curves={},
        records=records,
        ordering=[],
        notes=[],
        runtime_s=0.0,
    )
    bar = progress_bar(progress, len(chosen) * len(seed_list), "streaming", unit="stream")
    try:
        for ds_name in chosen:
            for seed in seed_list:
                ds = gdata.load(ds_name, seed=seed)
                if ds.task != "classification" or ds.num_classes is None:
                    raise ValueError(f"datasets: {ds_name} is not a classification data set")
                if num_points > len(ds.y_train):
                    raise ValueError(
                        f"num_points: {ds_name} has {len(ds.y_train)} training points, "
                        f"got {num_points}"
                    )
                phi, phi_test = random_features(ds.x_train, ds.x_test, width, seed)
                order = torch.randperm(
                    len(ds.y_train), generator=torch.Generator().manual_seed(seed)
                )
                phi, y = phi[order[:num_points]], ds.y_train[order[:num_points]]
                y_test = ds.y_test
                if num_test is not None:
                    phi_test, y_test = phi_test[:num_test], y_test[:num_test]
                sq_norm = float((phi.square().sum(1) + 1.0).mean())
                delta = sq_norm / prior_logit_var
                learners = make_learners(
                    width,
                    int(ds.num_classes),
                    delta,
                    methods=methods,
                    alpha_eps=alpha_eps,
                    noise=noise,
                    sgd_lr=sgd_lr,
                    adf_samples=adf_samples,
                    seed=seed,
                )
                curves = stream(learners, phi, y, phi_test, y_test, stops, batch_size)
                for name, c in curves.items():
                    records.append(
                        {"dataset": ds_name, "seed": seed, "method": name, "delta": delta, **c}
                    )
                if keep:
                    result.learners[(ds_name, seed)] = learners
                    result.features[(ds_name, seed)] = (phi, y, phi_test, y_test)
                bar.update()
    finally:
        bar.close()
        torch.set_num_threads(threads)
    for ds_name in chosen:
        per_method: dict[str, dict[str, list[float]]] = {}
        for name in methods:
            recs = [r for r in records if r["dataset"] == ds_name and r["method"] == name]
            out: dict[str, list[float]] = {k: [] for k in ("acc_mean", "acc_sem", "ll_mean")}
            out.update(ll_sem=[], seconds=[])
            for i in range(len(stops)):
                for key in ("acc", "ll"):
                    m, s = _mean_sem([r[key][i] for r in recs])
                    out[f"{key}_mean"].append(m)
                    out[f"{key}_sem"].append(s)
                out["seconds"].append(_mean_sem([r["seconds"][i] for r in recs])[0])
            per_method[name] = out
        result.curves[ds_name] = per_method
        result.ordering.extend(_ordering(ds_name, per_method, stops))
    result.notes.extend(_notes(result))
    result.runtime_s = time.perf_counter() - start
    return result


def _ordering(
    ds_name: str, curves: dict[str, dict[str, list[float]]], stops: list[int]
) -> list[dict[str, Any]]:
    exact = [m for m in METHODS if m in curves]
    if not exact or "adf" not in curves or "sgd+m" not in curves:
        return []
    out = []
    for n in FEW_POINTS:
        if n not in stops:
            continue
        i = stops.index(n)
        ll = {m: curves[m]["ll_mean"][i] for m in curves}
        best = max(exact, key=lambda m: ll[m])
        out.append(
            {
                "dataset": ds_name,
                "points": n,
                "best_exact": best,
                "ll_best_exact": ll[best],
                "ll_variational": ll.get("variational"),
                "ll_adf": ll["adf"],
                "ll_sgd": ll["sgd+m"],
                "best_exact_ge_adf": ll[best] >= ll["adf"],
                "adf_ge_sgd": ll["adf"] >= ll["sgd+m"],
                "holds": ll[best] >= ll["adf"] >= ll["sgd+m"],
            }
        )
    return out


def _notes(result: StreamingResults) -> list[str]:
    notes = []
    for o in result.ordering:
        verdict = "holds" if o["holds"] else "does not hold"
        notes.append(
            f"{o['dataset']}, {o['points']} points: exact ({o['best_exact']}) "
            f"{o['ll_best_exact']:.3f} vs ADF {o['ll_adf']:.3f} vs SGD+m {o['ll_sgd']:.3f} "
            f"-> ordering exact >= ADF >= SGD+m {verdict}"
        )
    return notes


def plot(result: StreamingResults, path: str | Path) -> Path:
    """Fig. 4 layout: one column per data set, test accuracy (top) and test log-likelihood
    (bottom) against points seen (log axis), mean ± s.e. over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result.curves)
    fig, axes = plt.subplots(2, len(names), figsize=(5.2 * len(names), 6.4), squeeze=False)
    x = result.checkpoints
    for col, ds_name in enumerate(names):
        for name, c in result.curves[ds_name].items():
            for row, key in enumerate(("acc", "ll")):
                ax = axes[row, col]
                mean = torch.tensor(c[f"{key}_mean"])
                sem = torch.tensor(c[f"{key}_sem"]).nan_to_num(0.0)
                ax.plot(x, mean, color=COLOURS.get(name), label=name, marker=".")
                ax.fill_between(x, mean - sem, mean + sem, color=COLOURS.get(name), alpha=0.2)
        axes[0, col].set(title=f"{ds_name} (random features)", ylabel="test accuracy")
        axes[1, col].set(xlabel="training points seen", ylabel="test log-likelihood")
        axes[1, col].set_ylim(bottom=max(axes[1, col].get_ylim()[0], -3.0))
        for row in range(2):
            axes[row, col].set_xscale("log")
            axes[row, col].grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    """CLI: ``gaussify experiment approx_streaming [options]``."""
    options = [
        ("--datasets", dict(nargs="+", default=None, help="default mnist fashion_mnist")),
        ("--seeds", dict(type=positive_int, default=3)),
        ("--num-points", dict(type=positive_int, default=2000)),
        ("--width", dict(type=positive_int, default=256)),
        ("--batch-size", dict(type=positive_int, default=10)),
        (
            "--prior-logit-var",
            dict(
                type=positive_float,
                default=PRIOR_LOGIT_VAR,
                help="default pi^2/6, the uniform Dir(1) prior's",
            ),
        ),
        ("--quick", dict(action="store_true", help="mnist, 1 seed, 200 points")),
    ]
    description = (
        "Bui Sec. 4.3 / Fig. 4: streaming random-feature last layers with Gaussian likelihood "
        "approximations (exact Kalman updates) vs ADF and SGD with momentum."
    )
    title = "Test log-likelihood ± s.e. (accuracy) against points seen"
    return cli(
        argv, "approx_streaming", description, options, run, title=title, plot=plot,
        figure_help="write the Fig. 4 PNG",
    )  # fmt: skip


if __name__ == "__main__":
    run_main(main)
