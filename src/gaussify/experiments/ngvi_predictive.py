"""Immer thesis Sec. 5.2: NN-sampling vs GLM predictive of Laplace-GGN, VOGGN, LGVA and OGGN.

The thesis compares, on a 1-D regression toy and on the banana classification toy, the four
Gaussian posteriors of Ch. 3-4 -- Laplace-GGN at the MAP and the three natural-gradient VI
variants (:mod:`gaussify.weight_space.ngvi`) -- each predicted in two ways: by sampling
networks theta ~ q ("NN sampling") and by the GLM predictive, the network linearised at its
linearisation point theta_lin with f_* ~ N(f(x_*; theta_lin) + J_*(mu - theta_lin),
J_* Sigma J_*^T) (Sec. 4.6). Protocol here (each of ``seeds``; the seed sets the network
initialisation and every random draw of the methods, never the data):

* data: the thesis's regression toy as far as stated (:mod:`._gap_toy`: y = sin(4x) +
  N(0, 0.09), 150 training inputs on [-2, 2] without the gap (-0.5, 0.5), 1000 test inputs on
  the whole range, 200 more in the gap reported on their own) and ``banana`` (binary; its
  training and test splits; the thesis uses two moons);
* network: a 2 x 20 tanh MLP in float64 (``depth`` hidden layers of ``width`` units; the
  thesis's is 5 x 25; depth 0 is the linear model f = W x + b, for which every method's
  Gaussian is exact Bayesian linear regression: Thm 4.1);
* hyperparameters (thesis Sec. 5.1 -> 5.2: the evidence-selected pair, and the MAP of that
  pair): the MAP by ``map_epochs`` full-batch Adam steps at prior precision 1 (noise 0.1 for
  regression), the prior precision (and noise) by the full-GGN Laplace evidence
  (``optimize_prior``), then the MAP retrained from the same initialisation at the selected
  pair; the Laplace-GGN posterior is fitted at that MAP with that pair, and all methods share
  the pair;
* VOGGN, LGVA, OGGN: from the same random initialisation, Sigma_0 = 0.1 I
  (``init_precision=10``), full structure, full-batch steps, S samples per step
  (``num_samples``), ``steps`` steps with gamma taking the values of ``gammas`` for equal
  shares of the steps. The thesis's S = 1 and 1000 predictive samples are the defaults; its
  "step size beta = 0.999" is not: read as gamma (precision *and* mean step) it makes every
  step an undamped Gauss-Newton step, and OGGN's mean then oscillates without converging on
  this toy (training log-likelihood per point jumping between -2.3 and -16.7 over 60 steps,
  where gamma = 0.3 settles at -0.28 within 15; docs/ngvi.md), while the thesis trains "until
  convergence". The default schedule 0.3 -> 0.1 -> 0.03 over 200 steps converges
  (``gammas=(0.999,)`` gives the literal reading).

Reported per toy, method and predictive: the mean over seeds and its standard error of the test
NLL, and of the NLL in the gap (regression) or the test accuracy (banana). :func:`plot` draws
one figure per toy for the first seed: predictive mean, +-2 std and three joint function
samples (regression), or p(y = 1) (banana), NN sampling in the top row and GLM in the bottom
row.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import gaussify as gs
from gaussify.cli_args import ArgumentParser, nonnegative_int, positive_float, positive_int
from gaussify.curvature.jacobian import jacobians
from gaussify.experiments._gap_toy import gap_toy
from gaussify.experiments._report import (
    add_output_arguments,
    add_progress_argument,
    check_outputs,
    report,
    run_main,
)
from gaussify.experiments._runner import fmt, mean_se, tanh_mlp
from gaussify.predictive import Predictive
from gaussify.weight_space.ngvi import LGVA, OGGN, VOGGN

__all__ = [
    "METHODS",
    "PREDICTIVES",
    "TOYS",
    "Config",
    "PredictiveResults",
    "fit_posteriors",
    "main",
    "make_model",
    "plot",
    "run",
]

TOYS: tuple[str, ...] = ("regression", "banana")
METHODS: tuple[str, ...] = ("Laplace-GGN", "VOGGN", "LGVA", "OGGN")
PREDICTIVES: tuple[str, ...] = ("nn", "glm")
PREDICTIVE_LABELS: dict[str, str] = {"nn": "NN sampling", "glm": "GLM"}
TOY_LABELS: dict[str, str] = {
    "regression": "regression (gap toy)",
    "banana": "banana",
}
#: likelihood of each toy and the noise the MAP is trained with
_LIKELIHOODS: dict[str, tuple[str, float]] = {
    "regression": ("regression", 0.1),
    "banana": ("binary", 1.0),
}


@dataclass
class Config:
    """Everything that determines the numbers (stored with the results)."""

    toys: list[str] = field(default_factory=lambda: list(TOYS))
    width: int = 20
    depth: int = 2
    map_epochs: int = 2000
    map_lr: float = 1e-2
    steps: int = 200
    gammas: list[float] = field(default_factory=lambda: [0.3, 0.1, 0.03])
    num_samples: int = 1
    antithetic: bool = False
    init_precision: float = 10.0
    predictive_samples: int = 1000
    seeds: list[int] = field(default_factory=lambda: [0])
    seed: int = 0
    regression_grid: int = 300
    banana_grid: int = 60


def make_model(inputs: int, width: int = 20, depth: int = 2, seed: int = 0) -> nn.Module:
    """``inputs``-``width``-...-1 tanh MLP with ``depth`` hidden layers (depth 0: one linear
    layer), float64, initialised from ``torch.manual_seed(seed)``."""
    if depth < 0 or width < 1:
        raise ValueError(f"depth, width: expected depth >= 0 and width >= 1, got {depth}, {width}")
    return tanh_mlp(inputs, 1, width, depth, seed)


def _schedule(steps: int, gammas: Sequence[float]) -> list[tuple[float, int]]:
    """(gamma, number of steps) pairs: equal shares of ``steps``, the remainder to the last."""
    share = steps // len(gammas)
    counts = [share] * len(gammas)
    counts[-1] += steps - share * len(gammas)
    return [(float(g), c) for g, c in zip(gammas, counts, strict=True) if c > 0]


def _map(x: Tensor, y: Tensor, likelihood: str, cfg: Config, delta: float, sigma: float):
    """The MAP for prior precision ``delta`` and noise ``sigma`` (full-batch Adam from the
    seed's initialisation)."""
    model = make_model(x.shape[1], cfg.width, cfg.depth, cfg.seed)
    gs.train_map(
        model, (x, y), likelihood, prior_precision=delta, epochs=cfg.map_epochs, lr=cfg.map_lr,
        sigma_noise=sigma, batch_size=len(y), seed=cfg.seed,
    )  # fmt: skip
    return model


def fit_posteriors(
    x: Tensor, y: Tensor, likelihood: str, cfg: Config
) -> tuple[dict[str, Any], dict[str, float | None]]:
    """The four posteriors of Sec. 5.2 on ``(x, y)`` and the hyperparameters they share.

    Hyperparameters: MAP at prior precision 1 (noise 0.1), then prior precision and
    (regression) noise by the full-GGN Laplace marginal likelihood. Laplace-GGN: the MAP
    retrained at the selected pair and a full-GGN posterior there with that pair (the thesis
    fits the Laplace-GGN at the MAP of the selected hyperparameters). VOGGN / LGVA / OGGN:
    full structure from the same initialisation as the MAP with Lambda_0 = ``init_precision``
    I, ``steps`` full-batch steps under the gamma schedule."""
    regression = likelihood == "regression"
    sigma = _LIKELIHOODS["regression"][1] if regression else 1.0
    model = _map(x, y, likelihood, cfg, 1.0, sigma)
    selection = gs.Laplace(model, likelihood, "full", prior_precision=1.0, sigma_noise=sigma)
    selection.fit((x, y)).optimize_prior()
    delta, sigma = float(selection.prior_precision), float(selection.sigma_noise)
    model = _map(x, y, likelihood, cfg, delta, sigma)
    la = gs.Laplace(model, likelihood, "full", prior_precision=delta, sigma_noise=sigma)
    la.fit((x, y))
    posts: dict[str, Any] = {"Laplace-GGN": la}
    for cls in (VOGGN, LGVA, OGGN):
        vi = cls(
            make_model(x.shape[1], cfg.width, cfg.depth, cfg.seed), likelihood, "full", delta,
            lr=cfg.gammas[0], num_samples=cfg.num_samples, sigma_noise=sigma,
            init_precision=cfg.init_precision, antithetic=cfg.antithetic, seed=cfg.seed,
        )  # fmt: skip
        for gamma, count in _schedule(cfg.steps, cfg.gammas):
            vi.lr = gamma
            vi.fit((x, y), epochs=count, batch_size=len(y), monitor=False)
        posts[cls.__name__] = vi
    return posts, {"prior_precision": delta, "sigma_noise": sigma if regression else None}


def _predict(post: Any, x: Tensor, method: str, cfg: Config) -> Predictive:
    """NN sampling (``cfg.predictive_samples`` networks, fixed generator) or the GLM
    predictive (probit link for banana; Gaussian for regression)."""
    if method == "nn":
        g = torch.Generator().manual_seed(cfg.seed)
        return post.predict(x, method="nn", num_samples=cfg.predictive_samples, generator=g)
    return post.predict(x, method="glm", link="probit")


def function_samples(post: Any, x: Tensor, method: str, pred: Predictive, num: int = 3) -> Tensor:
    """``num`` joint function samples (num, N): the NN predictive's first networks, or the
    linearised network f(x; theta_lin) + J (theta - theta_lin) at weights theta ~ q (the GLM
    predictive holds only per-input marginals)."""
    if method == "nn":
        assert pred.f_samples is not None
        return pred.f_samples[:num, :, 0]
    thetas = post.sample(num, generator=torch.Generator().manual_seed(1))
    point = getattr(post, "theta_star", None)
    if point is None:  # NGVI: theta* for GLM-VI, else the mean
        point = post.theta_lin if post.theta_lin is not None else post.mean
    with torch.no_grad():
        f = post.model(x)[:, 0]
    return f + (jacobians(post.model, x, post.subset)[:, 0] @ (thetas - point).T).T


def _load(toy: str) -> tuple[Any, Tensor, Tensor]:
    """The data set, its training targets in the likelihood's shape and its test targets."""
    if toy == "regression":
        toy_data = gap_toy(seed=0)
        return toy_data, toy_data.y_train, toy_data.y_test
    ds = gs.data.load("banana", seed=0, dtype=torch.float64)
    return ds, ds.y_train.to(torch.float64).unsqueeze(-1), ds.y_test.to(torch.float64)


def _grid(toy: str, cfg: Config) -> Tensor:
    if toy == "regression":
        return torch.linspace(-3.0, 3.0, cfg.regression_grid, dtype=torch.float64).unsqueeze(-1)
    lin = torch.linspace(-3.0, 3.0, cfg.banana_grid, dtype=torch.float64)
    g1, g2 = torch.meshgrid(lin, lin, indexing="xy")
    return torch.stack([g1.reshape(-1), g2.reshape(-1)], dim=-1)


@dataclass
class PredictiveResults:
    """Results of :func:`run`.

    ``records``: one per toy, method and predictive with the mean over seeds of ``nll_test``
    and ``nll_gap`` (regression) or ``accuracy`` (banana), each with its standard error
    (``*_se``, ddof 1; null for one seed) and its per-seed values (``*_seeds``); ``hyper``:
    per toy the marginal-likelihood prior precision and noise shared by all methods, the
    first seed's, and ``hyper_seeds`` (toy -> one pair per seed). Not serialised (first seed
    only): ``posteriors`` (toy -> method -> fitted object), ``grids`` (toy -> inputs) and
    ``on_grid`` (toy -> method -> predictive -> :class:`~gaussify.predictive.Predictive` on
    the grid), for :func:`plot`."""

    config: dict[str, Any]
    records: list[dict[str, Any]]
    hyper: dict[str, dict[str, float | None]]
    notes: list[str]
    runtime_s: float
    hyper_seeds: dict[str, list[dict[str, float | None]]] = field(default_factory=dict)
    posteriors: dict[str, dict[str, Any]] = field(default_factory=dict)
    grids: dict[str, Tensor] = field(default_factory=dict)
    on_grid: dict[str, dict[str, dict[str, Predictive]]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable view (without the posteriors and grid predictives)."""
        return {
            "experiment": "ngvi_predictive",
            "paper": "Immer thesis (001) Sec. 5.2: NN-sampling vs GLM predictive",
            "config": self.config,
            "runtime_s": self.runtime_s,
            "hyper": self.hyper,
            "hyper_seeds": self.hyper_seeds,
            "notes": self.notes,
            "records": self.records,
        }

    def table(self) -> str:
        """Markdown: test NLL and gap NLL (regression) or accuracy (banana) per toy, method
        and predictive (mean ± standard error over seeds)."""
        lines = [
            "| data | method | predictive | test NLL | gap NLL / accuracy |",
            "|---|---|---|---|---|",
        ]
        for r in self.records:
            key = "nll_gap" if r["toy"] == "regression" else "accuracy"
            lines.append(
                f"| {TOY_LABELS[r['toy']]} | {r['method']} | "
                f"{PREDICTIVE_LABELS[r['predictive']]} | {fmt(r['nll_test'], r['nll_test_se'])} "
                f"| {fmt(r[key], r[key + '_se'])} |"
            )
        return "\n".join(lines)


def _evaluate(
    toy: str, post: Any, ds: Any, y_test: Tensor, method: str, cfg: Config
) -> dict[str, Any]:
    """One record: test NLL and gap NLL (regression) or accuracy (banana)."""
    pred = _predict(post, ds.x_test, method, cfg)
    rec: dict[str, Any] = {"nll_test": float(-pred.log_prob(y_test).mean())}
    if toy == "regression":
        gap = _predict(post, ds.x_val, method, cfg)
        rec["nll_gap"] = float(-gap.log_prob(ds.y_val).mean())
    else:
        assert pred.probs is not None
        rec["accuracy"] = float(((pred.probs[:, 0] > 0.5).double() == y_test).double().mean())
    return rec


def _seed_run(toy: str, cfg: Config, keep_grid: bool) -> tuple[Any, ...]:
    """One seed (``cfg.seed``) of one toy: the shared hyperparameters, the records per
    (method, predictive), and for ``keep_grid`` the posteriors and their grid predictives."""
    ds, y_train, y_test = _load(toy)
    posts, hyper = fit_posteriors(ds.x_train, y_train, _LIKELIHOODS[toy][0], cfg)
    recs = {
        (name, method): _evaluate(toy, posts[name], ds, y_test, method, cfg)
        for name in METHODS
        for method in PREDICTIVES
    }
    if not keep_grid:
        return hyper, recs, None, None
    grid = _grid(toy, cfg)
    on_grid = {name: {m: _predict(posts[name], grid, m, cfg) for m in PREDICTIVES}
               for name in METHODS}  # fmt: skip
    return hyper, recs, posts, on_grid


def _collect(
    res: PredictiveResults,
    toys: Sequence[str],
    seeds: list[int],
    cfg: Config,
    futures: dict[tuple[str, int], Any],
    keep_grid: bool,
    bar: Any,
) -> None:
    """Fill ``res`` seed by seed: the first seed (and every seed without a worker future) runs
    here, the others are read from ``futures``; records aggregate the seeds."""
    for toy in toys:
        per_seed: dict[tuple[str, str], list[dict[str, float]]] = {}
        res.hyper_seeds[toy] = []
        for seed in seeds:
            if (toy, seed) not in futures:
                out = _seed_run(toy, replace(cfg, seed=seed), keep_grid and seed == seeds[0])
            else:
                out = futures[(toy, seed)].result()
            hyper, recs, posts, on_grid = out
            res.hyper_seeds[toy].append(hyper)
            for key, rec in recs.items():
                per_seed.setdefault(key, []).append(rec)
            if seed == seeds[0]:
                res.hyper[toy], res.posteriors[toy] = hyper, posts
                if keep_grid:
                    res.grids[toy], res.on_grid[toy] = _grid(toy, cfg), on_grid
            if bar is not None:
                bar.update()
        for (name, method), recs in per_seed.items():
            row: dict[str, Any] = {"toy": toy, "method": name, "predictive": method}
            for key in recs[0]:
                values = [r[key] for r in recs]
                row[key], row[key + "_se"] = mean_se(values, single=None)
                row[key + "_seeds"] = values
            res.records.append(row)


def run(
    toys: Sequence[str] = TOYS,
    *,
    width: int = 20,
    depth: int = 2,
    map_epochs: int = 2000,
    steps: int = 200,
    gammas: Sequence[float] = (0.3, 0.1, 0.03),
    num_samples: int = 1,
    antithetic: bool = False,
    init_precision: float = 10.0,
    predictive_samples: int = 1000,
    seeds: Sequence[int] = (0,),
    grid_points: tuple[int, int] = (300, 60),
    progress: bool = False,
    keep_grid: bool = True,
    jobs: int = 1,
) -> PredictiveResults:
    """Run the Sec. 5.2 comparison (protocol in the module docstring) on ``toys`` for each
    of ``seeds`` and return the results. ``grid_points``: inputs of the regression plot and
    points per axis of the banana plot; ``keep_grid=False`` skips the grid predictives (no
    :func:`plot`); ``jobs`` > 1 runs the other seeds in that many - 1 forked worker processes
    (the same numbers). Deterministic given the arguments."""
    bad = [t for t in toys if t not in TOYS]
    if bad or not toys:
        raise ValueError(f"toys: expected a non-empty subset of {TOYS}, got {list(toys)}")
    if steps < 1 or not gammas or any(not 0 < g <= 1 for g in gammas):
        raise ValueError(
            f"steps, gammas: need steps >= 1 and gammas in (0, 1], got {steps}, {gammas}"
        )
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs: expected an integer >= 1, got {jobs!r}")
    seeds = [int(s) for s in seeds]
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds: expected distinct non-negative integers, got {seeds}")
    cfg = Config(
        toys=list(toys), width=width, depth=depth, map_epochs=map_epochs, steps=steps,
        gammas=[float(g) for g in gammas], num_samples=num_samples, antithetic=antithetic,
        init_precision=init_precision, predictive_samples=predictive_samples, seeds=seeds,
        seed=seeds[0], regression_grid=grid_points[0], banana_grid=grid_points[1],
    )  # fmt: skip
    start = time.perf_counter()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(toys) * len(seeds), desc="NGVI predictive", unit="run")
    res = PredictiveResults(config=asdict(cfg), records=[], hyper={}, notes=[], runtime_s=0.0)
    tasks = [(toy, seed) for toy in toys for seed in seeds[1:]]
    pool = None
    futures: dict[tuple[str, int], Any] = {}
    if jobs > 1 and tasks:
        import concurrent.futures
        import multiprocessing

        pool = concurrent.futures.ProcessPoolExecutor(
            min(jobs - 1, len(tasks)), mp_context=multiprocessing.get_context("fork")
        )
        futures = {task: pool.submit(_seed_run, task[0], replace(cfg, seed=task[1]), False)
                   for task in tasks}  # fmt: skip
    try:
        _collect(res, toys, seeds, cfg, futures, keep_grid, bar)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    if bar is not None:
        bar.close()
    res.notes = [
        f"{cfg.depth} x {cfg.width} tanh MLP, seeds {seeds} (mean ± standard error); "
        "hyperparameters by the Laplace marginal likelihood at the MAP, the MAP retrained at "
        "them, shared by all methods.",
        f"NGVI: full structure, full batches, S = {cfg.num_samples}"
        + (" (antithetic)" if cfg.antithetic else "")
        + f", Sigma_0 = {1 / cfg.init_precision:g} I, {cfg.steps} steps, gamma "
        + " -> ".join(f"{g:g}" for g in cfg.gammas)
        + f"; NN sampling with {cfg.predictive_samples} networks, GLM with the probit link.",
    ]
    res.runtime_s = time.perf_counter() - start
    return res


def _plot_regression(res: PredictiveResults, path: Path) -> Path:
    import matplotlib.pyplot as plt

    from gaussify.plots import save_figure

    ds, _, _ = _load("regression")
    grid = res.grids["regression"]
    fig, axes = plt.subplots(2, len(METHODS), figsize=(14, 5.6), sharex=True, sharey=True)
    for col, name in enumerate(METHODS):
        post = res.posteriors["regression"][name]
        for row, method in enumerate(PREDICTIVES):
            pred = res.on_grid["regression"][name][method]
            mean, std = pred.mean[:, 0], pred.var[:, 0].sqrt()
            ax = axes[row, col]
            ax.fill_between(grid[:, 0], mean - 2 * std, mean + 2 * std, alpha=0.3, color="C0")
            ax.plot(grid[:, 0], mean, color="C0")
            samples = function_samples(post, grid, method, pred)
            ax.plot(grid[:, 0], samples.T, color="C1", lw=0.7, alpha=0.8)
            ax.scatter(ds.x_train[:, 0], ds.y_train[:, 0], s=6, color="k", zorder=3)
            ax.set_ylim(-4, 4)
            ax.set_title(f"{name}: {PREDICTIVE_LABELS[method]}", fontsize=9)
    hyper = res.hyper["regression"]
    fig.suptitle(
        f"1-D regression with a gap (prior precision {hyper['prior_precision']:.3g}, "
        f"noise {hyper['sigma_noise']:.3g}): mean, ±2 std and 3 samples",
        fontsize=10,
    )
    return save_figure(fig, path)


def _plot_banana(res: PredictiveResults, path: Path) -> Path:
    import matplotlib.pyplot as plt

    from gaussify.plots import save_figure

    ds, _, _ = _load("banana")
    grid = res.grids["banana"]
    side = math.isqrt(len(grid))
    g1, g2 = grid[:, 0].reshape(side, side), grid[:, 1].reshape(side, side)
    fig, axes = plt.subplots(2, len(METHODS), figsize=(14, 6.6), sharex=True, sharey=True)
    for col, name in enumerate(METHODS):
        for row, method in enumerate(PREDICTIVES):
            probs = res.on_grid["banana"][name][method].probs
            assert probs is not None
            p = probs[:, 0].reshape(side, side)
            ax = axes[row, col]
            ax.contourf(g1, g2, p, levels=torch.linspace(0, 1, 11).tolist(), cmap="RdBu_r")
            ax.contour(g1, g2, p, levels=[0.5], colors="k", linewidths=0.8)
            for label, color in ((0, "C0"), (1, "C3")):
                pts = ds.x_train[ds.y_train == label]
                ax.scatter(pts[:, 0], pts[:, 1], s=5, color=color, edgecolors="w", lw=0.2)
            ax.set_title(f"{name}: {PREDICTIVE_LABELS[method]}", fontsize=9)
    fig.suptitle(
        f"banana (prior precision {res.hyper['banana']['prior_precision']:.3g}): "
        "predictive p(y = 1)",
        fontsize=10,
    )
    return save_figure(fig, path)


def plot(res: PredictiveResults, folder: str | Path) -> Path:
    """Write ``ngvi_regression.png`` and ``ngvi_banana.png`` (for the toys run) into
    ``folder``; returns the folder. Needs ``run(..., keep_grid=True)``."""
    import matplotlib

    matplotlib.use("Agg")
    folder = Path(folder)
    if "regression" in res.on_grid:
        _plot_regression(res, folder / "ngvi_regression.png")
    if "banana" in res.on_grid:
        _plot_banana(res, folder / "ngvi_banana.png")
    return folder


def main(argv: list[str] | None = None) -> int:
    """CLI: ``gaussify experiment ngvi_predictive [options]``; prints the table, writes JSON
    with ``--output`` and the two figures into the folder ``--figure``."""
    parser = ArgumentParser(
        prog="gaussify experiment ngvi_predictive",
        description="Immer thesis Sec. 5.2: Laplace-GGN, VOGGN, LGVA and OGGN with the "
        "NN-sampling and GLM predictives on a 1-D regression toy and banana.",
    )
    parser.add_argument("--toys", nargs="+", default=list(TOYS), choices=TOYS)
    parser.add_argument("--steps", type=positive_int, default=200, help="NGVI steps (200)")
    parser.add_argument(
        "--map-epochs", type=positive_int, default=2000, help="MAP Adam steps (2000)"
    )
    parser.add_argument(
        "--width", type=positive_int, default=20, help="hidden units per layer (20)"
    )
    parser.add_argument("--depth", type=nonnegative_int, default=2, help="hidden layers (2)")
    parser.add_argument("--num-samples", type=positive_int, default=1, help="S per NGVI step (1)")
    parser.add_argument(
        "--gammas",
        type=positive_float,
        nargs="+",
        default=[0.3, 0.1, 0.03],
        help="step sizes for equal shares of the steps (0.3 0.1 0.03)",
    )
    parser.add_argument(
        "--predictive-samples", type=positive_int, default=1000, help="NN-sampling draws (1000)"
    )
    parser.add_argument("--seeds", type=nonnegative_int, nargs="+", default=[0], help="seeds (0)")
    parser.add_argument("--jobs", type=positive_int, default=1, help="worker processes (1)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads (1)")
    add_progress_argument(parser)
    add_output_arguments(parser, "folder for ngvi_regression.png and ngvi_banana.png")
    args = parser.parse_args(argv)
    check_outputs(args, folders={"figure": ("ngvi_regression.png", "ngvi_banana.png")})
    torch.set_num_threads(args.threads)
    res = run(
        args.toys, width=args.width, depth=args.depth, map_epochs=args.map_epochs,
        steps=args.steps, num_samples=args.num_samples, gammas=args.gammas,
        predictive_samples=args.predictive_samples, seeds=args.seeds, jobs=args.jobs,
        progress=args.progress, keep_grid=args.figure is not None,
    )  # fmt: skip
    title = "Thesis Sec. 5.2: test NLL and gap NLL (regression) / accuracy (banana)"
    return report(res, args, title=title, plot=plot)


if __name__ == "__main__":
    run_main(main)
