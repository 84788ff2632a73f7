"""UCI classification with GLM vs BNN predictives (Immer, Korzepa & Bauer 2021, Table 1).

Protocol of App. B.3 of the paper: a network with one hidden layer of 50 tanh units; for every
split (70/15/15, stratified, ``gaussify.data.load(name, seed=split)``) and every prior
precision delta on a grid of 10 log-spaced values (1e-2 .. 1e2; 1e-1 .. 1e2 for satellite and
digits), train the MAP with Adam on the full batch, build a full-GGN Laplace posterior at it and
evaluate the predictives (``methods``):

* ``map``: the network at theta* ("NN MAP");
* ``bnn_laplace``: NN sampling predictive, eq. (3) ("BNN Laplace");
* ``glm_laplace``: GLM predictive with the posterior mode at theta*, eq. (8) sampled
  ("GLM Laplace" without mode refinement);
* ``glm_refine``: GLM predictive after refining the posterior mean in the linearised model
  (``Laplace.refine``; the paper's "GLM Lapl" column, App. B.3: "we further optimize the GLM
  using Adam"). It is reported only where the library provides ``Laplace.refine``;
* ``glm_vi`` / ``glm_vi_diag``: natural-gradient Gaussian VI in the GLM linearised at theta*
  (:class:`~gaussify.weight_space.glm_vi.GLMVI`, full or diagonal covariance), started at the
  GLM Laplace posterior (``init_laplace``) and run for ``vi_steps`` full-batch steps of size
  ``vi_lr`` with ``vi_samples`` antithetic samples; GLM predictive as above ("GLM VI").
  The full-covariance steps reuse the Jacobians at theta*
  (:class:`~gaussify.weight_space.glm_vi_cached.CachedGLMVI`, the same steps as ``GLMVI``);
* ``glm_laplace_diag``: the diagonal-GGN Laplace posterior at theta*, GLM mode refined as
  ``glm_refine``, GLM predictive ("GLM Lapl diag");
* ``bbb``: Bayes by backprop (:class:`~gaussify.last_layer.bbb.MeanFieldGrid`): mean-field
  Gaussian VI over all weights with prior N(0, 1/delta), trained on the reparameterised ELBO
  with the local reparameterisation trick, all deltas of a split at once; predictive of
  ``num_samples`` draws ("BBB"). It needs no MAP.

delta is selected per split and per method on the validation NLL; the test NLL (mean and
standard error over splits) is reported beside the paper's Table 1.

Departures from the paper, for laptop scale: GLM VI takes 30 full-batch steps with
gamma = 0.2 from the Laplace posterior (paper: 250 steps at 1e-3 full / 1e-2 diagonal from an
unstated start);  the MAP is trained for ``epochs`` full-batch Adam
steps with learning rate ``lr`` (default 3000 at 1e-2, cosine-decayed) instead of 10000 at 1e-3;
on these data sets that reaches the same training loss (see ``map_grad_norm`` in the records
and the module's documentation in docs/laplace.md). BBB takes ``bbb_epochs`` (1000) full-batch
Adam steps at ``bbb_lr`` (1e-2, cosine-decayed) instead of 5000 at 1e-3.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor, nn

from gaussify import data as gdata
from gaussify import metrics
from gaussify.cli_args import (
    ArgumentParser,
    UsageError,
    nonnegative_int,
    positive_float,
    positive_int,
    prepare_output_dir,
)
from gaussify.experiments._report import (
    add_progress_argument,
    check_input_file,
    check_outputs,
    print_summary,
    run_main,
    write_json,
)
from gaussify.experiments._runner import (
    choose_datasets,
    fmt,
    mean_se,
    paper_table,
    seed_list,
    torch_threads,
)
from gaussify.experiments.uci_methods import (
    bbb_probs,
    diag_laplace_probs,
    glm_vi_probs,
    laplace_probs,
    mlp,
)
from gaussify.training import train_map

_T = TypeVar("_T")

__all__ = [
    "DATASETS",
    "METHODS",
    "METHOD_LABELS",
    "PAPER_TABLE1",
    "UCIResults",
    "main",
    "merge",
    "mlp",
    "prior_grid",
    "run",
]

#: The data sets of Table 1, in the paper's row order (library names).
DATASETS: tuple[str, ...] = (
    "australian",
    "breast_cancer",
    "ionosphere",
    "glass",
    "vehicle",
    "waveform",
    "digits",
    "satellite",
)
QUICK_DATASETS: tuple[str, ...] = ("ionosphere", "glass")
LARGE: frozenset[str] = frozenset({"satellite", "digits"})

METHODS: tuple[str, ...] = (
    "map",
    "bnn_laplace",
    "glm_laplace",
    "glm_refine",
    "glm_vi",
    "glm_vi_diag",
    "glm_laplace_diag",
    "bbb",
)
METHOD_LABELS: dict[str, str] = {
    "map": "NN MAP",
    "bnn_laplace": "BNN Laplace",
    "glm_laplace": "GLM Laplace",
    "glm_refine": "GLM refine",
    "glm_vi": "GLM VI",
    "glm_vi_diag": "GLM VI diag",
    "glm_laplace_diag": "GLM Lapl diag",
    "bbb": "BBB",
}
#: the methods that need the Laplace posterior at theta*
LAPLACE_METHODS: frozenset[str] = frozenset({"bnn_laplace", "glm_laplace", "glm_refine"})
#: methods that do not use the MAP network (a run of only these trains no MAP)
MAP_FREE: frozenset[str] = frozenset({"bbb"})
#: GLM-VI methods and their covariance structure
VI_METHODS: dict[str, str] = {"glm_vi": "full", "glm_vi_diag": "diag"}

#: Immer, Korzepa & Bauer (2021), Table 1: test NLL, mean ± standard error over 10 splits,
#: 1 hidden layer of 50 tanh units. Keys are library data-set names ("cancer" is
#: breast_cancer). The paper's "GLM Lapl" includes the mode refinement (App. B.3), so it is
#: the counterpart of our ``glm_refine``; ``glm_laplace`` (mode at theta*) has none.
PAPER_TABLE1: dict[str, dict[str, tuple[float, float]]] = {
    name: {method: (v[0], v[1]) for method, v in row.items()}
    for name, row in paper_table("immer2021_table1").items()
}

#: Newton steps of ``Laplace.refine`` stop once the Newton decrement (the predicted gain of
#: the GLM log joint, summed over the training set) is below 1e-4 nats; the library default
#: (1e-12) is below float32 resolution, so it would always run all ``max_iter`` GGN passes.
DEFAULT_REFINE: dict[str, Any] = {"tol": 1e-4, "max_iter": 20}

REFINE_MISSING_NOTE = (
    "Laplace.refine is not available in this version of gaussify; the GLM refine column "
    "(the paper's 'GLM Lapl', which optimises the GLM mode) was not computed"
)


def prior_grid(name: str, size: int = 10) -> list[float]:
    """The paper's prior-precision grid (App. B.3): ``size`` log-spaced values in 1e-2 .. 1e2,
    or 1e-1 .. 1e2 for the larger satellite and digits."""
    low = -1.0 if name in LARGE else -2.0
    return [float(v) for v in np.logspace(low, 2.0, size)]


@dataclass
class Config:
    """Everything that determines the numbers (stored with the results)."""

    datasets: list[str]
    splits: list[int]
    grid_size: int
    epochs: int
    lr: float
    num_samples: int
    width: int = 50
    glm_link: str = "mc"
    refine_kwargs: dict[str, Any] = field(default_factory=dict)
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    vi_steps: int = 30
    vi_lr: float = 0.2
    vi_samples: int = 2
    vi_lr_diag: float | None = None
    map_cache: str | None = None
    bbb_epochs: int = 1000
    bbb_lr: float = 1e-2
    bbb_init_std: float = 1e-3


@dataclass
class UCIResults:
    """Results of :func:`run`.

    ``rows``: one per data set and method with the test NLL (and accuracy, ECE) at the
    validation-selected delta, mean and standard error over splits, beside the paper's
    Table 1 value. ``selections``: one per data set, split and method (the selected delta and
    its metrics). ``records``: one per data set, split, delta and method (validation and test
    metrics, MAP diagnostics). ``predictions`` maps ``(dataset, split, delta, method)`` to the
    test-set probabilities ``(N_test, C)`` when ``keep_predictions=True`` (not serialised).
    """

    config: dict[str, Any]
    rows: list[dict[str, Any]]
    selections: list[dict[str, Any]]
    records: list[dict[str, Any]]
    notes: list[str]
    runtime_s: float
    predictions: dict[tuple[str, int, float, str], Tensor] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable view (without ``predictions``)."""
        return {
            "experiment": "uci_classification",
            "paper": "Immer, Korzepa & Bauer (2021), Table 1 (App. B.3 protocol)",
            "config": self.config,
            "runtime_s": self.runtime_s,
            "notes": self.notes,
            "rows": self.rows,
            "selections": self.selections,
            "records": self.records,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UCIResults:
        """The inverse of :meth:`to_dict` (e.g. for a file that :func:`merge` wrote), without
        predictions."""
        return cls(
            config=data["config"],
            rows=data["rows"],
            selections=data["selections"],
            records=data["records"],
            notes=list(data.get("notes", [])),
            runtime_s=float(data["runtime_s"]),
        )

    def table(self, metric: str = "nll") -> str:
        """Markdown table of ``metric`` ("nll", "acc" or "ece"): ours ± s.e. per method, and,
        for NLL, the paper's value in parentheses."""
        datasets = list(dict.fromkeys(r["dataset"] for r in self.rows))
        methods = [m for m in METHODS if m in self.config.get("methods", METHODS)]
        header = "| dataset | " + " | ".join(METHOD_LABELS[m] for m in methods) + " |"
        lines = [header, "|---" * (len(methods) + 1) + "|"]
        for name in datasets:
            cells = []
            for method in methods:
                row = next(r for r in self.rows if r["dataset"] == name and r["method"] == method)
                cells.append(_cell(row, metric))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _cell(row: dict[str, Any], metric: str) -> str:
    if row.get("missing"):
        ours = "missing"
    else:
        ours = fmt(row[f"test_{metric}_mean"], row[f"test_{metric}_se"])
    paper = row.get("paper_nll")
    if metric == "nll" and paper is not None:
        return f"{ours} ({fmt(*paper)})"
    return ours


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)


def _objective_grad_norm(model: nn.Module, x: Tensor, y: Tensor, delta: float) -> float:
    """||grad of the train_map objective|| at the trained weights: a convergence check."""
    model.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y) + 0.5 * delta / len(y) * sum(
        p.square().sum() for p in model.parameters()
    )
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return float(torch.cat([g.reshape(-1) for g in grads]).norm())


def _metrics(probs: Tensor, y: Tensor) -> dict[str, float]:
    # The paper's ECE uses 10 bins (App. B.3).
    return {
        "nll": metrics.nll(probs, y),
        "acc": metrics.accuracy(probs, y),
        "ece": metrics.ece(probs, y, num_bins=10),
    }


def _run_split(
    name: str, split: int, deltas: Sequence[float], cfg: Config, keep_predictions: bool
) -> tuple[list[dict[str, Any]], dict[tuple[str, int, float, str], Tensor], bool]:
    """Train and evaluate every delta of one split; returns (records, test probs, refined)."""
    ds = gdata.load(name, seed=split)
    x_tr, y_tr = ds.x_train, ds.y_train
    n_val = len(ds.y_val)
    x_eval = torch.cat([ds.x_val, ds.x_test])
    num_classes = int(ds.num_classes or 0)
    records: list[dict[str, Any]] = []
    kept: dict[tuple[str, int, float, str], Tensor] = {}
    refined = False
    bbb_all = None
    if "bbb" in cfg.methods:
        bbb_all = bbb_probs(deltas, (x_tr, y_tr), x_eval, num_classes, cfg, split)
    needs_map = any(m not in MAP_FREE for m in cfg.methods)
    for k, delta in enumerate(deltas):
        probs: dict[str, Any] = {}
        train_loss = grad_norm = None
        gen = 1000 * split + k
        if bbb_all is not None:
            probs["bbb"] = bbb_all[k]
        if not needs_map:
            _append_records(records, kept, name, split, delta, probs, ds, n_val, keep_predictions)
            continue
        # The same initialisation for every delta of a split (common random numbers).
        _seed_everything(split)
        model = mlp(x_tr.shape[1], num_classes, cfg.width)
        train_loss = _train_or_load(model, name, split, delta, cfg, (x_tr, y_tr))
        grad_norm = _objective_grad_norm(model, x_tr, y_tr, delta)
        with torch.no_grad():
            probs["map"] = torch.softmax(model(x_eval), dim=-1)
        for method, structure in VI_METHODS.items():
            if method in cfg.methods:
                probs[method] = glm_vi_probs(
                    model, structure, delta, (x_tr, y_tr), x_eval, cfg, gen
                )
        if LAPLACE_METHODS & set(cfg.methods):
            laplace_probs(model, delta, (x_tr, y_tr), x_eval, cfg, gen, probs)
            refined |= "glm_refine" in probs
        if "glm_laplace_diag" in cfg.methods:
            probs["glm_laplace_diag"] = diag_laplace_probs(
                model, delta, (x_tr, y_tr), x_eval, cfg, gen
            )
        refine_shift = probs.pop("refine_shift", None)
        probs = {m: p for m, p in probs.items() if m in cfg.methods}
        _append_records(
            records,
            kept,
            name,
            split,
            delta,
            probs,
            ds,
            n_val,
            keep_predictions,
            map_train_loss=train_loss,
            map_grad_norm=grad_norm,
            refine_shift=refine_shift,
        )
    return records, kept, refined


def _append_records(
    records: list[dict[str, Any]],
    kept: dict[tuple[str, int, float, str], Tensor],
    name: str,
    split: int,
    delta: float,
    probs: dict[str, Tensor],
    ds: Any,
    n_val: int,
    keep_predictions: bool,
    *,
    map_train_loss: float | None = None,
    map_grad_norm: float | None = None,
    refine_shift: float | None = None,
) -> None:
    """One record per method of ``probs`` (validation rows first, then test rows)."""
    for method, p in probs.items():
        val = _metrics(p[:n_val], ds.y_val)
        test = _metrics(p[n_val:], ds.y_test)
        records.append(
            {
                "dataset": name,
                "split": split,
                "delta": delta,
                "method": method,
                **{f"val_{key}": v for key, v in val.items()},
                **{f"test_{key}": v for key, v in test.items()},
                "map_train_loss": None if method in MAP_FREE else map_train_loss,
                "map_grad_norm": None if method in MAP_FREE else map_grad_norm,
                "refine_shift": refine_shift if method == "glm_refine" else None,
            }
        )
        if keep_predictions:
            kept[(name, split, delta, method)] = p[n_val:].clone()


def _train_or_load(
    model: nn.Module, name: str, split: int, delta: float, cfg: Config, data: tuple[Tensor, Tensor]
) -> float:
    """Train the MAP (full-batch Adam, train_map) or load it from ``cfg.map_cache``; returns
    the final training loss. Cached weights are keyed by everything that determines them."""
    path = None
    if cfg.map_cache is not None:
        key = f"{name}_s{split}_d{delta:.8g}_e{cfg.epochs}_lr{cfg.lr:g}_w{cfg.width}.pt"
        path = Path(cfg.map_cache) / key
        if path.exists():
            saved = torch.load(path, weights_only=True)
            model.load_state_dict(saved["state"])
            return float(saved["train_loss"])
    _, history = train_map(
        model,
        data,
        "classification",
        prior_precision=delta,
        epochs=cfg.epochs,
        lr=cfg.lr,
        batch_size=len(data[1]),
        seed=split,
    )
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"state": model.state_dict(), "train_loss": history.loss[-1]}, path)
    return float(history.loss[-1])


def _progress(items: Iterable[_T], bar: Any) -> Iterator[_T]:
    for item in items:
        yield item
        if bar is not None:
            bar.update()


def _worker(
    args: tuple[str, int, list[float], Config, bool],
) -> tuple[list[dict[str, Any]], dict[tuple[str, int, float, str], Tensor], bool]:
    torch.set_num_threads(1)
    return _run_split(*args)


def select(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per data set, split and method, the record with the lowest validation NLL (ties: the
    smaller delta), as in App. B.3 ("selecting the best hyperparameter delta on the validation
    set")."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["dataset"], r["split"], r["method"]), []).append(r)
    out = []
    for (name, split, method), rs in groups.items():
        best = min(sorted(rs, key=lambda r: r["delta"]), key=lambda r: r["val_nll"])
        out.append(
            {
                "dataset": name,
                "split": split,
                "method": method,
                "delta": best["delta"],
                **{k: v for k, v in best.items() if k.startswith(("val_", "test_"))},
            }
        )
    return out


def summarise(selections: list[dict[str, Any]], datasets: Sequence[str]) -> list[dict[str, Any]]:
    """One row per data set and method: test metrics mean ± standard error over splits at the
    selected delta, with the paper's Table 1 NLL beside it."""
    rows = []
    for name in datasets:
        for method in METHODS:
            sel = [s for s in selections if s["dataset"] == name and s["method"] == method]
            sel.sort(key=lambda s: s["split"])
            row: dict[str, Any] = {
                "dataset": name,
                "method": method,
                "label": METHOD_LABELS[method],
                "num_splits": len(sel),
                "missing": not sel,
            }
            for metric in ("nll", "acc", "ece"):
                mean, se = mean_se([s[f"test_{metric}"] for s in sel])
                row[f"test_{metric}_mean"] = mean
                row[f"test_{metric}_se"] = None if se is None or math.isnan(se) else se
            row["test_nll_per_split"] = [s["test_nll"] for s in sel]
            row["selected_delta_per_split"] = [s["delta"] for s in sel]
            paper = PAPER_TABLE1.get(name, {}).get(method)
            row["paper_nll"] = list(paper) if paper is not None else None
            rows.append(row)
    return rows


def run(
    datasets: Sequence[str] | None = None,
    splits: int | Sequence[int] = 10,
    quick: bool = False,
    progress: bool = False,
    *,
    epochs: int | None = None,
    lr: float | None = None,
    grid_size: int | None = None,
    num_samples: int | None = None,
    n_jobs: int = 1,
    num_threads: int | None = 1,
    keep_predictions: bool = False,
    refine_kwargs: dict[str, Any] | None = None,
    methods: Sequence[str] | None = None,
    vi_steps: int | None = None,
    vi_lr: float = 0.2,
    vi_samples: int = 2,
    vi_lr_diag: float | None = None,
    map_cache: str | Path | None = None,
    bbb_epochs: int | None = None,
    bbb_lr: float = 1e-2,
) -> UCIResults:
    """Run the Table 1 protocol of Immer, Korzepa & Bauer (2021) and return the results.

    ``datasets``: library names (default: every Table 1 data set that ``gaussify.data.list()``
    ships); ``splits``: a number of splits (seeds 0..splits-1) or explicit seeds;
    ``quick=True``: 2 splits, 3 grid values, ionosphere and glass, 500 Adam steps and 200
    samples (for tests, well under a minute). ``refine_kwargs`` go to ``Laplace.refine``
    (default :data:`DEFAULT_REFINE`). ``epochs``/``lr``: full-batch Adam steps and
    learning rate of the MAP (default 3000 and 1e-2, cosine-decayed); ``grid_size``: number of
    prior precisions (default 10); ``num_samples``: Monte Carlo samples of the NN and GLM
    predictives (default 1000). ``n_jobs > 1`` runs splits in that many processes (one thread
    each); ``num_threads`` sets torch's intra-op threads for the run and restores them after
    (default 1: these small networks run fastest single-threaded, and many times faster on a
    busy machine; None keeps the current setting). ``methods``: which of :data:`METHODS` to
    evaluate (default all, without ``glm_vi`` when ``quick``; the MAP is always reported);
    ``vi_steps``/``vi_lr``/``vi_samples``: GLM-VI steps (default 30, 5 with ``quick``),
    gamma and samples S per step (antithetic pairs when S is even); ``vi_lr_diag``: gamma of
    the diagonal GLM VI when it differs (App. B.3: 1e-3 full, 1e-2 diagonal; default
    ``vi_lr``); ``map_cache``: a directory where MAP weights are stored
    and reused (keyed by data set, split, delta, epochs, lr and width), so that further
    methods cost no retraining. ``bbb_epochs``/``bbb_lr``: full-batch Adam steps (default
    1000, 100 with ``quick``) and initial learning rate (cosine-decayed) of Bayes by backprop.
    Deterministic given these arguments.
    """
    start = time.perf_counter()
    chosen = choose_datasets(
        datasets,
        DATASETS,
        QUICK_DATASETS,
        quick=quick,
        task="classification",
        wrong_task="{} are regression data sets, not {}",
    )
    seeds = seed_list(splits, 2, quick=quick, name="splits")
    if n_jobs <= 0:
        raise ValueError(f"n_jobs: must be a positive integer, got {n_jobs}")
    if methods is None:  # quick: no full-covariance GLM VI (a dense GGN per step)
        methods = [m for m in METHODS if not (quick and m == "glm_vi")]
    chosen_methods = list(methods)
    bad = [m for m in chosen_methods if m not in METHODS]
    if bad:
        raise ValueError(f"methods: unknown {bad}; expected a subset of {METHODS}")
    if "map" not in chosen_methods and not set(chosen_methods) <= MAP_FREE:
        chosen_methods.insert(0, "map")
    cfg = Config(
        datasets=chosen,
        splits=seeds,
        grid_size=grid_size or (3 if quick else 10),
        epochs=epochs or (500 if quick else 3000),
        lr=lr or 1e-2,
        num_samples=num_samples or (200 if quick else 1000),
        refine_kwargs=dict(DEFAULT_REFINE if refine_kwargs is None else refine_kwargs),
        methods=[m for m in METHODS if m in chosen_methods],
        vi_steps=vi_steps if vi_steps is not None else (5 if quick else 30),
        vi_lr=vi_lr,
        vi_samples=vi_samples,
        vi_lr_diag=vi_lr_diag,
        map_cache=None if map_cache is None else str(map_cache),
        bbb_epochs=bbb_epochs if bbb_epochs is not None else (100 if quick else 1000),
        bbb_lr=bbb_lr,
    )
    # Largest data sets first so that parallel workers finish together.
    order = sorted(chosen, key=lambda d: -gdata.info(d).n)
    tasks = [
        (name, split, prior_grid(name, cfg.grid_size), cfg, keep_predictions)
        for name in order
        for split in seeds
    ]
    records: list[dict[str, Any]] = []
    predictions: dict[tuple[str, int, float, str], Tensor] = {}
    refined_any = False
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(tasks), desc="UCI classification", unit="split")
    if n_jobs == 1:
        with torch_threads(num_threads):
            outputs = [_run_split(*t) for t in _progress(tasks, bar)]
    else:
        with ProcessPoolExecutor(n_jobs, mp_context=get_context("spawn")) as pool:
            outputs = list(_progress(pool.map(_worker, tasks), bar))
    for recs, kept, refined in outputs:
        records += recs
        predictions.update(kept)
        refined_any |= refined
    if bar is not None:
        bar.close()
    records.sort(key=lambda r: (chosen.index(r["dataset"]), r["split"], r["delta"]))
    selections = select(records)
    selections.sort(key=lambda s: (chosen.index(s["dataset"]), s["split"], s["method"]))
    notes = [
        "GLM predictive: Monte Carlo link over the output Gaussian (paper eq. 8), "
        f"{cfg.num_samples} samples; BNN predictive: {cfg.num_samples} network samples.",
        f"MAP: {cfg.epochs} full-batch Adam steps, lr {cfg.lr:g}, cosine decay (paper: 10000 "
        "steps at 1e-3).",
        "Paper 'GLM Lapl' includes the GLM mode refinement (App. B.3) and is listed beside "
        "our 'GLM refine'; our 'GLM Laplace' keeps the mode at theta*.",
    ]
    if set(VI_METHODS) & set(cfg.methods):
        gammas = f"gamma {cfg.vi_lr:g}"
        if cfg.vi_lr_diag is not None and cfg.vi_lr_diag != cfg.vi_lr:
            gammas = f"gamma {cfg.vi_lr:g} full / {cfg.vi_lr_diag:g} diag"
        draws = "antithetic" if cfg.vi_samples % 2 == 0 else "independent"
        notes.append(
            f"GLM VI: q_0 = GLM Laplace at theta*, {cfg.vi_steps} full-batch natural-gradient "
            f"steps, {gammas}, S = {cfg.vi_samples} ({draws}) (paper: 250 steps, "
            "gamma 1e-3 full / 1e-2 diag)."
        )
    if "glm_laplace_diag" in cfg.methods:
        notes.append(
            "GLM Lapl diag: diagonal-GGN Laplace at theta*, GLM mode refined (Laplace.refine, "
            "quasi-Newton with the diagonal precision), GLM predictive as GLM refine."
        )
    if "bbb" in cfg.methods:
        notes.append(
            f"BBB: mean-field Gaussian VI over all weights, prior N(0, 1/delta), means started "
            f"at the MAP's initialisation, sd {cfg.bbb_init_std:g}; {cfg.bbb_epochs} full-batch "
            f"Adam steps at lr {cfg.bbb_lr:g} (cosine decay), one local-reparameterisation "
            f"draw per step; {cfg.num_samples}-sample predictive (paper: 5000 steps at 1e-3)."
        )
    if not refined_any and "glm_refine" in cfg.methods:
        notes.append(REFINE_MISSING_NOTE)
    return UCIResults(
        config={**cfg.__dict__, "n_jobs": n_jobs, "torch": torch.__version__},
        rows=summarise(selections, chosen),
        selections=selections,
        records=records,
        notes=notes,
        runtime_s=time.perf_counter() - start,
        predictions=predictions,
    )


def merge(base: dict[str, Any], new: UCIResults | dict[str, Any]) -> dict[str, Any]:
    """Add the methods computed in ``new`` (other than the MAP) to the serialised results
    ``base`` (``UCIResults.to_dict()``): their records replace any of the same data set, split
    and method (so runs over different data sets merge one after another), the
    selections and rows are recomputed over ``base``'s data sets, and the config gains the
    new run's settings under ``"merged"``. The MAP records of both runs must describe the same
    networks: the largest difference of their test NLL is recorded as ``map_test_nll_diff``
    (0 when the MAP weights are bit-identical)."""
    extra = new.to_dict() if isinstance(new, UCIResults) else new
    added = [m for m in extra["config"]["methods"] if m != "map"]
    key = lambda r: (r["dataset"], r["split"], r["delta"])
    base_map = {key(r): r["test_nll"] for r in base["records"] if r["method"] == "map"}
    diffs = [
        abs(base_map[key(r)] - r["test_nll"])
        for r in extra["records"]
        if r["method"] == "map" and key(r) in base_map
    ]
    new_records = [r for r in extra["records"] if r["method"] in added]
    replaced = {(r["dataset"], r["split"], r["method"]) for r in new_records}
    records = [
        r for r in base["records"] if (r["dataset"], r["split"], r["method"]) not in replaced
    ]
    records += new_records
    datasets = list(base["config"]["datasets"])
    records.sort(key=lambda r: (datasets.index(r["dataset"]), r["split"], r["delta"]))
    selections = select(records)
    selections.sort(key=lambda s: (datasets.index(s["dataset"]), s["split"], s["method"]))
    methods = [m for m in METHODS if m in {*base["config"].get("methods", METHODS[:4]), *added}]
    merged_cfg = {k: v for k, v in extra["config"].items() if k not in ("n_jobs", "torch")}
    merged_cfg["map_test_nll_diff"] = max(diffs) if diffs else None
    merged_cfg["runtime_s"] = extra["runtime_s"]
    merged_cfg["datasets"] = sorted({r["dataset"] for r in new_records})
    previous = base["config"].get("merged")
    runs = [*(previous.get("runs", [previous]) if previous else []), merged_cfg]
    notes = list(dict.fromkeys([*base["notes"], *extra["notes"]]))
    return {
        **base,
        "config": {**base["config"], "methods": methods, "merged": {**merged_cfg, "runs": runs}},
        "notes": notes,
        "rows": summarise(selections, datasets),
        "selections": selections,
        "records": records,
    }


def main(argv: list[str] | None = None) -> int:
    """CLI: ``gaussify experiment uci_classification [options]``; prints the NLL table
    (ours, paper in parentheses) and writes JSON with ``--output``."""
    parser = ArgumentParser(
        prog="gaussify experiment uci_classification",
        description="Immer, Korzepa & Bauer (2021) Table 1: UCI classification, "
        "GLM vs BNN predictive of a full-GGN Laplace posterior.",
    )
    parser.add_argument("--datasets", nargs="+", default=None, help="default: all of Table 1")
    parser.add_argument(
        "--splits", type=positive_int, default=10, help="number of splits (seeds 0..)"
    )
    parser.add_argument("--quick", action="store_true", help="2 splits, 3 deltas, 2 data sets")
    parser.add_argument("--epochs", type=positive_int, default=None, help="MAP Adam steps (3000)")
    parser.add_argument("--lr", type=positive_float, default=None, help="MAP learning rate (1e-2)")
    parser.add_argument(
        "--grid-size", type=positive_int, default=None, help="prior precisions (10)"
    )
    parser.add_argument("--num-samples", type=positive_int, default=None, help="MC samples (1000)")
    parser.add_argument("--n-jobs", type=positive_int, default=1, help="worker processes (1)")
    parser.add_argument(
        "--threads", type=positive_int, default=1, help="torch threads with --n-jobs 1 (1)"
    )
    parser.add_argument("--methods", nargs="+", default=None, help=f"subset of {METHODS}")
    parser.add_argument(
        "--split-seeds", nargs="+", type=nonnegative_int, default=None, help="explicit"
    )
    parser.add_argument("--vi-steps", type=positive_int, default=None, help="GLM-VI steps (30)")
    parser.add_argument("--vi-lr", type=positive_float, default=0.2, help="GLM-VI gamma (0.2)")
    parser.add_argument(
        "--vi-lr-diag", type=positive_float, default=None, help="diagonal GLM-VI gamma (--vi-lr)"
    )
    parser.add_argument("--vi-samples", type=positive_int, default=2, help="GLM-VI S (2)")
    parser.add_argument("--map-cache", type=Path, default=None, help="reuse MAP weights here")
    parser.add_argument(
        "--bbb-epochs", type=positive_int, default=None, help="Bayes-by-backprop steps (1000)"
    )
    parser.add_argument(
        "--merge", type=Path, default=None, help="add the computed methods to this results JSON"
    )
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON")
    add_progress_argument(parser)
    args = parser.parse_args(argv)
    check_outputs(args)
    check_input_file(args.merge, "--merge")
    if args.merge is not None and args.output is None:
        raise UsageError("argument --merge: needs --output (where the merged results go)")
    base = None if args.merge is None else json.loads(args.merge.read_text())  # read it now
    if args.map_cache is not None:
        prepare_output_dir(args.map_cache, "--map-cache", (), force=True)
    res = run(
        datasets=args.datasets,
        splits=args.split_seeds if args.split_seeds else args.splits,
        quick=args.quick,
        progress=args.progress,
        epochs=args.epochs,
        lr=args.lr,
        grid_size=args.grid_size,
        num_samples=args.num_samples,
        n_jobs=args.n_jobs,
        num_threads=args.threads,
        methods=args.methods,
        vi_steps=args.vi_steps,
        vi_lr=args.vi_lr,
        vi_samples=args.vi_samples,
        vi_lr_diag=args.vi_lr_diag,
        map_cache=args.map_cache,
        bbb_epochs=args.bbb_epochs,
    )
    print_summary(res, "Test NLL, ours (paper Table 1) — mean ± s.e. over splits")
    if args.output is not None:
        out = res.to_dict()
        if base is not None:
            out = merge(base, res)
            print(f"Merged into {args.merge}: test NLL, ours (paper Table 1), all methods")
            print(UCIResults.from_dict(out).table("nll"))
        print(f"wrote {write_json(args.output, out)}")
    return 0


if __name__ == "__main__":
    run_main(main)
