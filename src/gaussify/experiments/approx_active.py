"""Active learning with Gaussian likelihood approximations (Bui, Sec. 4.3 last part, Fig. 5 / 16).

A Bayesian logistic regression on fixed features, with the logit-basis pseudo-likelihood of
Sec. 3.3 (``Beta(alpha_eps + y, beta_eps + 1 - y)`` matched by a Gaussian), has a closed-form
posterior, so each acquired label is one rank-1 Kalman update
(:func:`gaussify.last_layer.active.active_learning`). From ``num_initial`` random labelled
points, ``steps`` pool points are acquired one at a time, either the one of maximum
predictive entropy ``H[p(y | x, D)]`` or one at random; test accuracy and NLL are recorded
after every step. The same initial set is used for both acquisitions of a seed.

Scaled from the paper (IMDB with Gemma-2B features, pool 5000, test 10000, 200 steps, 50
seeds) to the shipped binary tabular sets: *magic* (pool: 2000 random training rows, test:
the 2853-row test part) and *breast_cancer* (pool: all 398 training rows), standardised raw
features with a bias, prior ``N(0, I)``, alpha_eps = beta_eps = 0.1 (the paper's fixed value),
probit predictive, 200 steps, 8 seeds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gaussify import data as gdata
from gaussify.cli_args import positive_int
from gaussify.experiments._report import (
    progress_bar,
    run_main,
)
from gaussify.experiments._runner import check_known, cli
from gaussify.last_layer.active import active_learning
from gaussify.plots import save_figure

__all__ = ["ACQUISITIONS", "DATASETS", "METHODS", "ActiveResults", "labels_to_reach", "main", "run"]

DATASETS: tuple[str, ...] = ("magic", "breast_cancer")
METHODS: tuple[str, ...] = ("moment", "laplace", "variational", "gauss")
ACQUISITIONS: tuple[str, ...] = ("entropy", "random")
COLOURS: dict[str, str] = {
    "moment": "tab:orange",
    "laplace": "tab:green",
    "variational": "tab:red",
    "gauss": "tab:gray",
}


def labels_to_reach(
    num_labelled: Sequence[int], accuracy: Sequence[float], level: float
) -> int | None:
    """The first number of labels at which ``accuracy`` reaches ``level`` (None: never)."""
    for n, acc in zip(num_labelled, accuracy, strict=True):
        if acc >= level:
            return int(n)
    return None


def _mean_sem(rows: list[list[float]]) -> tuple[list[float], list[float]]:
    t = torch.tensor(rows, dtype=torch.float64)
    mean = t.mean(0)
    sem = (
        t.std(0, unbiased=True) / math.sqrt(len(rows))
        if len(rows) > 1
        else torch.full_like(mean, float("nan"))
    )
    return mean.tolist(), sem.tolist()


@dataclass
class ActiveResults:
    """Results of :func:`run`: ``curves[dataset][f"{method}/{acquisition}"]`` with the number
    of labels and mean / s.e. over seeds of test accuracy and NLL per step; ``reach``: labels
    needed by the mean accuracy curve to reach each level; ``records``: per-seed curves and
    acquired indices."""

    config: dict[str, Any]
    curves: dict[str, dict[str, dict[str, list[float]]]]
    reach: list[dict[str, Any]]
    records: list[dict[str, Any]]
    runtime_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "experiment": "approx_active",
            "paper": "Bui, Sec. 4.3 (Fig. 5 / 16) protocol at laptop scale: Bayesian logistic "
            "regression with logit-basis Gaussian pseudo-likelihoods on shipped tabular sets",
            "config": self.config,
            "runtime_s": self.runtime_s,
            "reach": self.reach,
            "curves": self.curves,
            "records": self.records,
        }

    def table(self, at: Sequence[int] = (10, 30, 60, 110, 210)) -> str:
        lines = []
        for ds, curves in self.curves.items():
            first = next(iter(curves.values()))
            cols = [i for i, n in enumerate(first["num_labelled"]) if n in at]
            head = " | ".join(f"n={int(first['num_labelled'][i])}" for i in cols)
            lines += [f"| {ds} | {head} |", "|---|" + "---|" * len(cols)]
            for key, c in curves.items():
                cells = [f"{c['acc_mean'][i]:.3f} / {c['nll_mean'][i]:.3f}" for i in cols]
                lines.append(f"| {key} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def run(
    datasets: Sequence[str] | None = None,
    seeds: int | Sequence[int] = 8,
    quick: bool = False,
    *,
    methods: Sequence[str] = METHODS,
    acquisitions: Sequence[str] = ACQUISITIONS,
    pool_size: int = 2000,
    num_initial: int = 10,
    steps: int = 200,
    alpha_eps: float = 0.1,
    prior_precision: float = 1.0,
    levels: Sequence[float] = (0.75, 0.78, 0.9, 0.95),
    num_threads: int | None = 1,
    progress: bool = False,
) -> ActiveResults:
    """Run the active-learning loop for every data set, method, acquisition and seed.

    A seed fixes the split, the pool (the first ``pool_size`` rows of a random permutation
    of the training part) and the initial labelled set. ``quick=True``: *breast_cancer*, one
    seed, 20 steps, two methods (for tests)."""
    start = time.perf_counter()
    chosen = list(DATASETS if datasets is None else datasets)
    if quick:
        chosen = ["breast_cancer"] if datasets is None else chosen
        steps, methods = min(steps, 20), list(methods)[:2]
    known = gdata.list()
    check_known(chosen, known, "datasets: unknown data set(s) {bad}; see gaussify.data.list()")
    check_known(methods, METHODS, f"methods: unknown {{bad}}; the logit basis has {list(METHODS)}")
    allowed = list(ACQUISITIONS)
    check_known(acquisitions, allowed, f"acquisitions: unknown {{bad}}; choose from {allowed}")
    for name, value in (("pool_size", pool_size), ("steps", steps), ("num_initial", num_initial)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    seed_list = list(range(1 if quick else seeds)) if isinstance(seeds, int) else list(seeds)
    if not seed_list:
        raise ValueError("seeds: need at least one seed")
    threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    for ds_name in chosen:  # every name checked before the first one is run
        if gdata.info(ds_name).num_classes != 2:
            raise ValueError(f"datasets: {ds_name} is not a binary classification set")
    records: list[dict[str, Any]] = []
    runs = len(chosen) * len(seed_list) * len(methods) * len(acquisitions)
    bar = progress_bar(progress, runs, "active learning")
    try:
        for ds_name in chosen:
            for seed in seed_list:
                ds = gdata.load(ds_name, seed=seed)
                if ds.num_classes != 2:
                    raise ValueError(f"datasets: {ds_name} is not a binary classification set")
                order = torch.randperm(
                    len(ds.y_train), generator=torch.Generator().manual_seed(seed)
                )[:pool_size]
                x_pool, y_pool = ds.x_train[order].double(), ds.y_train[order]
                x_test, y_test = ds.x_test.double(), ds.y_test
                for method in methods:
                    for acq in acquisitions:
                        t0 = time.perf_counter()
                        res = active_learning(
                            x_pool,
                            y_pool,
                            x_test,
                            y_test,
                            steps=steps,
                            num_initial=num_initial,
                            method=method,  # type: ignore[arg-type]
                            basis="logit",
                            alpha_eps=alpha_eps,
                            prior_precision=prior_precision,
                            acquisition=acq,  # type: ignore[arg-type]
                            seed=seed,
                        )
                        records.append(
                            {
                                "dataset": ds_name,
                                "seed": seed,
                                "method": method,
                                "acquisition": acq,
                                "pool_size": len(y_pool),
                                "num_labelled": res.num_labelled,
                                "accuracy": res.accuracy,
                                "nll": res.nll,
                                "chosen": res.chosen,
                                "seconds": time.perf_counter() - t0,
                            }
                        )
                        bar.update()
    finally:
        bar.close()
        torch.set_num_threads(threads)
    curves: dict[str, dict[str, dict[str, list[float]]]] = {}
    reach: list[dict[str, Any]] = []
    for ds_name in chosen:
        curves[ds_name] = {}
        for method in methods:
            for acq in acquisitions:
                recs = [
                    r
                    for r in records
                    if (r["dataset"], r["method"], r["acquisition"]) == (ds_name, method, acq)
                ]
                acc_m, acc_s = _mean_sem([r["accuracy"] for r in recs])
                nll_m, nll_s = _mean_sem([r["nll"] for r in recs])
                n = [float(v) for v in recs[0]["num_labelled"]]
                curves[ds_name][f"{method}/{acq}"] = {
                    "num_labelled": n,
                    "acc_mean": acc_m,
                    "acc_sem": acc_s,
                    "nll_mean": nll_m,
                    "nll_sem": nll_s,
                }
                for level in levels:
                    reach.append(
                        {
                            "dataset": ds_name,
                            "method": method,
                            "acquisition": acq,
                            "accuracy_level": level,
                            "labels": labels_to_reach(n, acc_m, level),
                        }
                    )
    return ActiveResults(
        config={
            "datasets": chosen,
            "seeds": seed_list,
            "methods": list(methods),
            "acquisitions": list(acquisitions),
            "pool_size": pool_size,
            "num_initial": num_initial,
            "steps": steps,
            "alpha_eps": alpha_eps,
            "beta_eps": alpha_eps,
            "prior_precision": prior_precision,
            "features": "standardised raw features + bias",
            "link": "probit",
        },
        curves=curves,
        reach=reach,
        records=records,
        runtime_s=time.perf_counter() - start,
    )


def plot(result: ActiveResults, path: str | Path) -> Path:
    """Test accuracy (top) and NLL (bottom) against labels, per data set; solid: entropy,
    dashed: random acquisition; bands: ± s.e. over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result.curves)
    fig, axes = plt.subplots(2, len(names), figsize=(5.2 * len(names), 6.4), squeeze=False)
    for col, ds_name in enumerate(names):
        for key, c in result.curves[ds_name].items():
            method, acq = key.split("/")
            style = "-" if acq == "entropy" else "--"
            x = c["num_labelled"]
            for row, metric in enumerate(("acc", "nll")):
                mean = torch.tensor(c[f"{metric}_mean"])
                sem = torch.tensor(c[f"{metric}_sem"]).nan_to_num(0.0)
                ax = axes[row, col]
                ax.plot(x, mean, style, color=COLOURS.get(method), label=key)
                ax.fill_between(x, mean - sem, mean + sem, color=COLOURS.get(method), alpha=0.12)
        axes[0, col].set(title=f"{ds_name}: active learning", ylabel="test accuracy")
        axes[1, col].set(xlabel="labelled points", ylabel="test NLL")
        for row in range(2):
            axes[row, col].grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7, ncol=2)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    """CLI: ``gaussify experiment approx_active [options]``."""
    options = [
        ("--datasets", dict(nargs="+", default=None, help="magic breast_cancer")),
        ("--seeds", dict(type=positive_int, default=8)),
        ("--steps", dict(type=positive_int, default=200)),
        ("--pool-size", dict(type=positive_int, default=2000)),
        ("--quick", dict(action="store_true", help="breast_cancer, 1 seed, 20 steps")),
    ]
    description = (
        "Bui Sec. 4.3 / Fig. 5: active learning of a Bayesian logistic regression with "
        "logit-basis Gaussian pseudo-likelihoods, max-entropy vs random acquisition."
    )
    title = "Test accuracy / NLL (mean over seeds) against labelled points"
    return cli(
        argv, "approx_active", description, options, run, title=title, plot=plot,
        figure_help="write the curves PNG",
    )  # fmt: skip


if __name__ == "__main__":
    run_main(main)
