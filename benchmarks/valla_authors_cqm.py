"""Issue 19: the authors' own VaLLA against ours on the protocol of rows 003-F2-*-cqm.

The decisive check for the three off rows (VaLLA paper Fig. 2 table, "VaLLA performs best in
NLL and CQM"; ours: best NLL, CQM behind the MAP's): run the authors' public VaLLA
(github.com/Ludvins/Variational-LLA, imported from the folder given by ``--authors-repo``, never
copied into this repository) on exactly the protocol of
``gaussify.experiments.function_space_regression``, side by side with ours, and score both with
our metric code and with theirs.

Per data set and seed, shared by both fits (the experiment's own code, so everything is
identical to the committed ``experiments_function_space_regression_seeds.json`` /
``..._airline.json`` runs): the data split (``gs.data.load(name, seed, max_train=5000)``,
standardised), the 3 x 200 tanh MAP network (``make_mlp`` + ``train_map_eval``: 10 epochs), the
MAP's training RMSE, and the M = 100 inducing inputs (our k-means centres, handed to the
authors' class as its ``Z``).

* ours: ``function_space_regression._fit_methods(..., ["valla"])``: alpha = 1, prior precision and
  noise learned (noise started at the MAP's training RMSE), 10 epochs of batch 256 (200 steps),
  natural-gradient q(u) steps, cosine-decayed, no early stopping.
* authors: ``src.valla.VaLLARegression(create_ad_hoc_mlp(net), Z, ...)`` with the defaults of
  their ``scripts/regression/valla.py`` / ``utils/process_flags.py`` and the README's command
  line: alpha (``--bb_alpha``) 1, prior std 1 (learned), initial log noise variance
  (``--ll_log_var``) -5 (learned), inducing inputs learned, q(u) parameterised by their
  Cholesky factor L (started at I), Adam over all of these at lr 1e-3 (``--lr`` default), batch
  100, their ``utils.pytorch_learning.fit`` loop (a fixed number of iterations, no validation).
  Their README trains 40,000 iterations; here ``--iterations`` (default 500 = 10 epochs of the
  5000 rows at batch 100, the experiment's budget) and optionally ``--long-iterations`` (a
  second fit from the same start with a larger count, e.g. their 40,000).

Metrics: ours (``gaussify.metrics``: NLL, CRPS, exact CQM, the paper's 11-level trapezoid
``cqm_paper``) on each predictive; theirs (``utils.metrics.Regression`` through their
``utils.pytorch_learning.score`` over a test loader of batch 100, then the CQM of their
``plot_results.ipynb``: the trapezoid rule on |Q-k - k/10|, k = 0..10, with the gap at level 1
set to 1, reported as published and less that constant 0.05). Their scorer is applied twice:
to the predictive as their class returns it (variance of shape (B, 1, 1)) and with the variance
reshaped to (B, 1); the first broadcasts against the (B, 1) targets in their CRPS and coverage
code (see the JSON's notes).

Shims (in this script only; nothing in either code base is patched): ``properscoring`` (imported
by their metrics module, not installed here) is given a closed-form Gaussian CRPS; ``np.infty``
(removed in numpy 2, used by their ``fit``) is aliased to ``np.inf``; ``torch.pi``, which their
metrics module overwrites at import with float32 pi, is restored to ``math.pi`` (their alpha = 1
objective does not use it); the copy of the network handed to their class has its weights frozen
(their optimiser never steps them; this only skips the backward pass through them); their
constructor's prints are silenced.

Writes ``benchmarks/results/valla_authors_cqm.json``: per-seed records, per (data set, fit)
means and standard errors, paired differences over the seeds, the authors' commit, runtime and
``uptime`` load. Timings come from a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import io
import json
import math
import os
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy.special import ndtr
from torch.utils.data import DataLoader, TensorDataset

import gaussify as gs
from gaussify import metrics
from gaussify.cli_args import add_device_argument
from gaussify.experiments import function_space_regression as fr
from gaussify.experiments._runner import train_map_eval

MIRROR = Path("/work/.mirror/Ludvins+Variational-LLA/repo")
KEYS = ("nll", "crps", "cqm", "cqm_paper", "rmse")


# ---------------------------------------------------------------------- the authors' package
def _crps_gaussian(x: Any, mu: Any, sig: Any) -> np.ndarray:
    """Closed-form CRPS of N(mu, sig^2) at x (Gneiting & Raftery 2007), numpy broadcasting;
    the stand-in for ``properscoring.crps_gaussian`` their metrics module imports."""
    x, mu, sig = (np.asarray(a, dtype=np.float64) for a in (x, mu, sig))
    z = (x - mu) / sig
    pdf = np.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)
    cdf = ndtr(z)
    return sig * (z * (2 * cdf - 1) + 2 * pdf - 1 / math.sqrt(math.pi))


def load_authors(repo: Path) -> dict[str, types.ModuleType]:
    """Import the authors' ``src.valla``, ``utils.models``, ``utils.metrics`` and
    ``utils.pytorch_learning`` from ``repo`` (a copy of their repository's ``src`` and
    ``utils``), with the shims named in the module docstring."""
    needed = [repo / "src" / "valla.py", repo / "utils" / "metrics.py"]
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        raise SystemExit(
            f"--authors-repo {repo}: not a copy of github.com/Ludvins/Variational-LLA (missing "
            f"{', '.join(missing)}); make one with: git -C {MIRROR} archive HEAD src utils "
            f"scripts | tar -x -C {repo}"
        )
    if importlib.util.find_spec("properscoring") is None:
        shim = types.ModuleType("properscoring")
        shim.crps_gaussian = _crps_gaussian  # type: ignore[attr-defined]
        sys.modules["properscoring"] = shim
    if not hasattr(np, "infty"):
        setattr(np, "infty", np.inf)  # noqa: B010 (the removed alias their fit uses)
    sys.path.insert(0, str(repo))
    try:
        mods = {
            name: importlib.import_module(name)
            for name in ("src.valla", "utils.models", "utils.metrics", "utils.pytorch_learning")
        }
    finally:
        sys.path.remove(str(repo))
        torch.pi = math.pi  # type: ignore[attr-defined]
    return mods


def authors_commit(repo: Path) -> str | None:
    """The commit of the authors' repository the copy was made from (the read-only mirror's
    HEAD; a git work tree at ``repo`` itself wins)."""
    for where in (repo, MIRROR):
        try:
            out = subprocess.run(
                ["git", "-C", str(where), "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                check=True,
            )
            return out.stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            continue
    return None


def authors_cqm(q: dict[str, float]) -> tuple[float, float]:
    """The CQM of their ``plot_results.ipynb`` from the coverages Q-10 .. Q-90: the trapezoid
    rule over the levels 0, 0.1, ..., 1 of [0, |Q-10 - 0.1|, ..., |Q-90 - 0.9|, 1]; returned as
    published and less the 0.05 that the final 1 adds (the gap at level 1 is really 0)."""
    gaps = [0.0] + [abs(q[f"Q-{10 * k}"] - k / 10) for k in range(1, 10)] + [1.0]
    published = float(np.trapezoid(gaps, dx=0.1))
    return published, published - 0.05


class _Fixed:
    """A stand-in model for their ``score``: ``test_step`` returns the rows of a fixed
    predictive (the loader yields row indices as inputs)."""

    def __init__(self, mean: torch.Tensor, var: torch.Tensor) -> None:
        self.mean, self.var = mean, var

    def test_step(self, i: torch.Tensor, target: torch.Tensor) -> tuple[Any, ...]:
        rows = i.squeeze(-1).long()
        return torch.zeros(()), self.mean[rows], self.var[rows]


def authors_scores(
    mods: dict[str, types.ModuleType], mean: torch.Tensor, var: torch.Tensor, y: torch.Tensor
) -> dict[str, dict[str, float]]:
    """Their ``score(.., Regression)`` over a test loader of batch 100 (their script's) on a
    fixed predictive (mean (N, 1)): "broadcast" with the variance of shape (N, 1, 1), as their
    VaLLA (and laplace-torch's GLM predictive in their LLA script) returns it, "matched" with
    shape (N, 1), as their MAP script returns it."""
    learning, regression = mods["utils.pytorch_learning"], mods["utils.metrics"].Regression
    out = {}
    index = torch.arange(y.shape[0], dtype=torch.float64).unsqueeze(-1)
    loader = DataLoader(TensorDataset(index, y), batch_size=100)
    for label, shape in (("broadcast", (-1, 1, 1)), ("matched", (-1, 1))):
        d = learning.score(
            _Fixed(mean, var.reshape(shape)), loader, regression, dtype=torch.float64
        )
        out[label] = _their_scores(d)
    return out


def own_pipeline_scores(
    mods: dict[str, types.ModuleType], valla: Any, test: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, Any]:
    """Their scoring end to end, as their regression script does it: ``score(valla,
    test_loader, Regression)`` with the test loader of batch 100 (their ``test_step`` and
    ``forward``, no reshaping)."""
    loader = DataLoader(TensorDataset(*test), batch_size=100)
    d = mods["utils.pytorch_learning"].score(
        valla, loader, mods["utils.metrics"].Regression, dtype=torch.float64
    )
    return _their_scores(d)


def _their_scores(d: dict[str, Any]) -> dict[str, Any]:
    """The metrics this benchmark keeps from the dict their ``score`` returns: NLL, CRPS,
    RMSE, their CQM as published and corrected (:func:`authors_cqm`), the coverages."""
    published, corrected = authors_cqm(d)
    return {
        "nll": d["NLL"],
        "crps": d["CRPS"],
        "rmse": float(d["RMSE"]),
        "cqm_published": published,
        "cqm": corrected,
        "coverage": [d[f"Q-{10 * k}"] for k in range(1, 10)],
    }


def fit_authors(
    mods: dict[str, types.ModuleType],
    model: torch.nn.Module,
    z: torch.Tensor,
    train: tuple[torch.Tensor, torch.Tensor],
    iterations: int,
    seed: int,
) -> tuple[Any, float]:
    """The authors' VaLLARegression at their regression script's defaults, trained by their
    ``fit`` for ``iterations`` Adam steps (lr 1e-3, batch 100); returns (model, seconds)."""
    net = copy.deepcopy(model)
    for p in net.parameters():
        p.requires_grad_(False)
    torch.manual_seed(seed)  # their script seeds torch before building the loaders
    loader = DataLoader(TensorDataset(*train), batch_size=100, shuffle=True)
    with contextlib.redirect_stdout(io.StringIO()):
        valla = mods["src.valla"].VaLLARegression(
            mods["utils.models"].create_ad_hoc_mlp(net),
            z.detach().numpy().copy(),
            prior_std=1.0,
            num_data=train[0].shape[0],
            output_dim=1,
            log_variance=-5.0,
            track_inducing_locations=False,
            trainable_prior=True,
            y_mean=0.0,
            y_std=1.0,
            alpha=1.0,
            device=None,
            dtype=torch.float64,
        )
    opt = torch.optim.Adam(valla.parameters(recurse=False), lr=1e-3)
    t = time.perf_counter()
    mods["utils.pytorch_learning"].fit(valla, loader, opt, iterations=iterations)
    return valla, time.perf_counter() - t


def authors_predict(valla: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Their predictive (forward: network mean, function variance plus noise) in chunks of 100:
    mean (N, 1), variance (N, 1, 1), and the mean function variance (without the noise)."""
    valla.eval()
    means, variances = [], []
    with torch.no_grad():
        for i in range(0, x.shape[0], 100):
            m, v = valla(x[i : i + 100])
            means.append(m)
            variances.append(v)
    var = torch.cat(variances)
    noise = float(valla.log_variance.detach().exp())
    return torch.cat(means), var, float(var.mean()) - noise


# ---------------------------------------------------------------------- one seed
def our_scores(mean: torch.Tensor, var: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Our metrics (``gaussify.metrics``), as the experiment's ``evaluate``."""
    mean, var = mean.reshape(-1, 1), var.reshape(-1, 1)
    out = metrics.regression_metrics(mean, var, y)
    out["cqm_paper"] = metrics.cqm(mean, var.sqrt(), y, num_points=11)
    alphas = torch.linspace(0, 1, 11, dtype=torch.float64)
    out["coverage"] = metrics.cqm_curve(mean, var.sqrt(), y, alphas)[1:-1].tolist()
    return out


def run_seed(
    mods: dict[str, types.ModuleType],
    name: str,
    seed: int,
    iterations: int,
    long_iterations: int | None,
    baselines: list[str],
    ours_long_epochs: int | None = None,
) -> list[dict[str, Any]]:
    cfg = {
        "seed": seed,
        "epochs": 10,
        "num_inducing": 100,
        "fl_subset": 1000,
        "valla_epochs": 10,
        "valla_patience": None,
        "sampled_samples": 16,
        "sampled_epochs": 2,
    }
    ds = gs.data.load(name, seed=seed, dtype=torch.float64, max_train=5000)
    x, y = ds.x_train, ds.y_train
    model = fr.make_mlp(x.shape[1], 1, 200, 3, seed)
    train_map_eval(model, (x, y), "regression", cfg, batch_size=256)
    with torch.no_grad():
        sigma = float((model(x) - y).square().mean().sqrt())
        f_test = model(ds.x_test)
    base = {"dataset": name, "seed": seed, "n_train": x.shape[0], "map_train_rmse": sigma}
    records = []

    def add(
        fit: str,
        mean: torch.Tensor,
        var: torch.Tensor,
        extra: dict[str, Any],
        own: dict[str, float] | None = None,
    ) -> None:
        rec = {**base, "fit": fit, **extra}
        rec.update(our_scores(mean, var, ds.y_test))
        rec["authors_metric"] = authors_scores(
            mods, mean.reshape(-1, 1), var.reshape(-1, 1, 1), ds.y_test
        )
        if own is not None:
            rec["authors_metric"]["own_pipeline"] = own
        records.append(rec)
        print(
            json.dumps(
                {k: rec[k] for k in ("dataset", "seed", "fit", "nll", "cqm_paper", "rmse")}
                | {k: rec.get(k) for k in ("sigma_noise", "prior_precision", "fit_s")}
            ),
            flush=True,
        )

    add("map", f_test, torch.full_like(f_test, sigma**2), {"sigma_noise": sigma})

    (post, fit_s) = fr._fit_methods(model, (x, y), (ds.x_val, ds.y_val), ["valla"], sigma, cfg)[
        "valla"
    ]
    pred = post.predict(ds.x_test)
    f_var = pred.f_cov.diagonal(dim1=-2, dim2=-1) if pred.f_cov is not None else None
    add(
        "ours",
        pred.mean,
        pred.var,
        {
            "fit_s": fit_s,
            "steps": len(post.history["objective"]),
            "sigma_noise": float(post.sigma_noise),
            "prior_precision": float(post.prior_precision),
            "mean_test_function_var": float(f_var.mean()) if f_var is not None else None,
        },
    )
    if ours_long_epochs:  # single factor: our VaLLA with a longer budget, all else the same
        cfg_long = {**cfg, "valla_epochs": ours_long_epochs}
        (longer, long_s) = fr._fit_methods(
            model, (x, y), (ds.x_val, ds.y_val), ["valla"], sigma, cfg_long
        )["valla"]
        p = longer.predict(ds.x_test)
        f_var_long = p.f_cov.diagonal(dim1=-2, dim2=-1) if p.f_cov is not None else None
        add(
            "ours_long",
            p.mean,
            p.var,
            {
                "fit_s": long_s,
                "steps": len(longer.history["objective"]),
                "sigma_noise": float(longer.sigma_noise),
                "prior_precision": float(longer.prior_precision),
                "mean_test_function_var": (
                    float(f_var_long.mean()) if f_var_long is not None else None
                ),
            },
        )
    if baselines:  # the experiment's other methods, in its order, after ours (as there: seeded)
        fitted = fr._fit_methods(model, (x, y), (ds.x_val, ds.y_val), baselines, sigma, cfg)
        for method, (other, other_s) in fitted.items():
            p = other.predict(ds.x_test)
            add(method, p.mean, p.var, {"fit_s": other_s, **fr._hyper(other)})
    z = post.inducing_points.detach()
    for fit, its in (("authors", iterations), ("authors_long", long_iterations)):
        if not its:
            continue
        valla, fit_s = fit_authors(mods, model, z, (x, y), its, seed)
        mean, var, f_var_mean = authors_predict(valla, ds.x_test)
        own = own_pipeline_scores(mods, valla, (ds.x_test, ds.y_test))
        prior_std = float(valla.log_prior_std.detach().exp())
        add(
            fit,
            mean,
            var,
            {
                "fit_s": fit_s,
                "steps": its,
                "sigma_noise": float(valla.log_variance.detach().exp().sqrt()),
                "log_noise_variance": float(valla.log_variance.detach()),
                "prior_std": prior_std,
                "prior_precision": prior_std**-2,
                "mean_test_function_var": f_var_mean,
                "inducing_moved": float((valla.inducing_locations.detach() - z).norm() / z.norm()),
                "mean_matches_network": float((mean - f_test).abs().max()),
                "authors_var_shape": list(var.shape),
            },
            own,
        )
    return records


# ---------------------------------------------------------------------- summaries
def _mean_se(values: list[float]) -> tuple[float, float]:
    a = np.asarray(values, dtype=np.float64)
    se = float(a.std(ddof=1) / math.sqrt(a.size)) if a.size > 1 else float("nan")
    return float(a.mean()), se


def _value(rec: dict[str, Any], key: str) -> float:
    """A record's metric; ``broadcast_cqm``: the CQM by the authors' scorer as it treats their
    VaLLA's (B, 1, 1) variance."""
    if key == "broadcast_cqm":
        return rec["authors_metric"]["broadcast"]["cqm"]
    return rec[key]


def summarise(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Mean and standard error over the seeds per (data set, fit), and paired differences
    (fit a minus fit b, per seed) for the pairs that decide the rows."""
    summary, paired = [], []
    names = sorted({r["dataset"] for r in records})
    for name in names:
        rows = [r for r in records if r["dataset"] == name]
        by_fit: dict[str, dict[int, dict[str, Any]]] = {}
        for r in rows:
            by_fit.setdefault(r["fit"], {})[r["seed"]] = r
        for fit, per_seed in by_fit.items():
            row: dict[str, Any] = {"dataset": name, "fit": fit, "seeds": sorted(per_seed)}
            for key in KEYS:
                row[f"{key}_mean"], row[f"{key}_se"] = _mean_se([r[key] for r in per_seed.values()])
            for key in (
                "sigma_noise",
                "prior_precision",
                "fit_s",
                "mean_test_function_var",
                "steps",
            ):
                vals = [r[key] for r in per_seed.values() if r.get(key) is not None]
                if vals:
                    row[f"{key}_mean"], row[f"{key}_se"] = _mean_se(vals)
            for label in ("broadcast", "matched", "own_pipeline"):
                vals = [
                    r["authors_metric"][label]["cqm"]
                    for r in per_seed.values()
                    if label in r["authors_metric"]
                ]
                if vals:
                    m, se = _mean_se(vals)
                    row[f"authors_metric_{label}_cqm_mean"] = m
                    row[f"authors_metric_{label}_cqm_se"] = se
            summary.append(row)
        pairs = [("authors", "map"), ("authors", "ours"), ("ours", "map")]
        pairs += [("authors_long", "map"), ("authors_long", "ours"), ("authors_long", "authors")]
        pairs += [("ours_long", "map"), ("ours_long", "ours"), ("authors_long", "ours_long")]
        pairs += [(f, m) for f in ("ours", "authors", "authors_long") for m in fr.METHODS[1:-1]]
        for a, b in pairs:
            if a not in by_fit or b not in by_fit:
                continue
            seeds = sorted(set(by_fit[a]) & set(by_fit[b]))
            row = {"dataset": name, "a": a, "b": b, "seeds": seeds}
            for key in ("nll", "cqm_paper", "cqm", "crps", "broadcast_cqm"):
                diffs = [_value(by_fit[a][s], key) - _value(by_fit[b][s], key) for s in seeds]
                row[f"{key}_diff_mean"], row[f"{key}_diff_se"] = _mean_se(diffs)
                row[f"{key}_a_better_in"] = sum(d < 0 for d in diffs)
            paired.append(row)
    return summary, paired


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load average: " + " ".join(f"{v:.2f}" for v in os.getloadavg())


def _config(args: argparse.Namespace, seeds: list[int], baselines: list[str]) -> dict[str, Any]:
    return {
        "datasets": args.datasets.split(","),
        "seeds": seeds,
        "protocol": "function_space_regression: max_train 5000, 3 x 200 tanh MLP, 10 "
        "epochs MAP (Adam 1e-3, batch 256, prior precision 1), M = 100 k-means inducing "
        "inputs shared by both fits",
        "ours": "gs.VaLLA as the experiment: alpha 1, learn prior and noise (noise from the "
        "MAP training RMSE), kernel ntk, 10 epochs of batch 256, natural-gradient q(u), "
        "hyper_lr 0.1, cosine schedule, no early stopping",
        "authors": "VaLLARegression at their script defaults: alpha 1, prior_std 1 "
        "(learned), ll_log_var -5 (learned), Z learned, L = I, Adam lr 1e-3 on all, batch "
        "100, their fit loop, no validation",
        "authors_iterations": args.iterations,
        "authors_long_iterations": args.long_iterations,
        "baselines": baselines,
        "ours_long_epochs": args.ours_long_epochs,
    }


def merge(files: list[str], output: str) -> None:
    """One result from several runs' outputs (final or ``.partial``): records concatenated,
    summary and paired differences recomputed, each run's config, runtime and load kept."""
    records: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    seen: dict[tuple[str, int, str], dict[str, Any]] = {}
    for f in files:
        d = json.loads(Path(f).read_text())
        for rec in d["records"]:  # a fit scored by two runs (map, ours) is kept once
            key = (rec["dataset"], rec["seed"], rec["fit"])
            if key in seen:
                if seen[key]["nll"] != rec["nll"]:
                    raise SystemExit(f"--merge: {key} differs between runs")
                continue
            seen[key] = rec
            records.append(rec)
        runs.append(
            {
                "file": Path(f).name,
                **{k: v for k, v in d.items() if k not in ("records", "summary", "paired")},
            }
        )
    summary, paired = summarise(records)
    res = {
        "what": (__doc__ or "").splitlines()[0],
        "authors_repo": "github.com/Ludvins/Variational-LLA",
        "authors_commit": next(
            (r.get("authors_commit") for r in runs if r.get("authors_commit")), None
        ),
        "runs": runs,
        "summary": summary,
        "paired": paired,
        "records": records,
    }
    Path(output).write_text(json.dumps(res, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--authors-repo",
        type=Path,
        default=None,
        help="a copy of the authors' src/ and utils/ (git archive of the mirror)",
    )
    parser.add_argument("--datasets", default="protein,power", help="comma-separated")
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0 .. N-1")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument(
        "--iterations", type=int, default=500, help="their Adam steps (500 = 10 epochs)"
    )
    parser.add_argument("--long-iterations", type=int, default=None)
    parser.add_argument(
        "--baselines",
        default="",
        help="comma-separated methods of the experiment to score too (e.g. last_layer,kfac,ella)",
    )
    parser.add_argument(
        "--ours-long-epochs",
        type=int,
        default=None,
        help="also fit our VaLLA for this many epochs (single factor: the budget)",
    )
    parser.add_argument(
        "--merge", nargs="+", default=None, help="combine these outputs into --output; no run"
    )
    parser.add_argument("--output", default="benchmarks/results/valla_authors_cqm.json")
    add_device_argument(parser)
    args = parser.parse_args()
    if args.device.type != "cpu":
        parser.error(f"--device {args.device}: the experiment's data and MAP run on the host")
    if args.merge:
        merge(args.merge, args.output)
        return
    if args.authors_repo is None:
        parser.error("--authors-repo: required (a copy of the authors' repository)")
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    baselines = [m for m in args.baselines.split(",") if m]
    unknown = [m for m in baselines if m not in fr.METHODS or m in ("map", "valla")]
    if unknown:
        parser.error(f"--baselines: unknown {unknown}; choose from {fr.METHODS[1:-1]}")
    mods = load_authors(args.authors_repo.resolve())
    torch.set_num_threads(1)
    start, load_start = time.perf_counter(), _uptime()
    records: list[dict[str, Any]] = []
    per_dataset_s: dict[str, float] = {}

    def result(partial: bool) -> dict[str, Any]:
        summary, paired = summarise(records) if records else ([], [])
        return {
            "what": (__doc__ or "").splitlines()[0],
            "partial": partial,
            "authors_repo": "github.com/Ludvins/Variational-LLA",
            "authors_commit": authors_commit(args.authors_repo.resolve()),
            "config": _config(args, seeds, baselines),
            "load_start": load_start,
            "load_end": _uptime(),
            "runtime_s": time.perf_counter() - start,
            "runtime_per_dataset_s": per_dataset_s,
            "summary": summary,
            "paired": paired,
            "records": records,
        }

    partial_file = Path(args.output + ".partial")
    for name in args.datasets.split(","):
        t = time.perf_counter()
        for seed in seeds:
            records += run_seed(
                mods,
                name,
                seed,
                args.iterations,
                args.long_iterations,
                baselines,
                args.ours_long_epochs,
            )
            partial_file.write_text(json.dumps(result(True), indent=1))
        per_dataset_s[name] = time.perf_counter() - t
    Path(args.output).write_text(json.dumps(result(False), indent=1))
    if partial_file.exists():
        partial_file.unlink()


if __name__ == "__main__":
    main()
