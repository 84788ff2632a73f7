"""UCI regression with variational Bayesian last layers (Harrison, Willes & Snoek 2024, Table 2).

Protocol of App. G.2 of the paper, on every UCI regression set this library ships:

* features: the MLP of Watson et al. (2021), two hidden layers of 50 leaky-ReLU units;
* optimiser: AdamW, learning rate 1e-3, weight decay 1e-2 (on every parameter), gradients
  clipped to norm 1.0, batch size 32 (256 for power and protein);
* splits: ``gaussify.data.load(name, seed=s)``, train/val/test 0.72/0.18/0.10 at random, inputs
  standardised with the training statistics;
* epochs: train on the training part for at most the Table 5 number of epochs, computing the
  validation predictive NLL every 10 epochs; the selected number of epochs is the validation
  argmin; then train afresh on train + validation for that many epochs and evaluate on test.

Methods (all single-pass, same network, same protocol):

* ``vbll``: :class:`~gaussify.last_layer.VBLLRegression` head (dense covariance, prior
  ``N(0, I / D)`` -- the head's default, the authors' ``prior_scale=1`` --, noise prior
  ``W^-1(1, 1)``, KL weight ``1/N``) trained jointly with the features;
* ``map``: ``nn.Linear`` head with a Gaussian likelihood whose noise ``log sigma`` is learned
  (weight decay is the only regulariser);
* ``laplace``: the ``map`` network with a last-layer full-covariance Laplace posterior
  (``gs.Laplace(..., "regression", "full", subset="last_layer")``), prior precision and noise
  tuned by the marginal likelihood on train + validation, GLM predictive;
* ``laplace_map_noise``: the same with the noise kept at the MAP network's learned sigma (only
  the prior precision tuned). On small sets the network fits train + validation almost
  exactly, and type-II maximum likelihood then shrinks the noise to the training residuals
  (yacht: sigma^2 ~ 2e-5 in standardised units), so ``laplace`` is badly over-confident there.
* ``gbll``: :class:`~gaussify.last_layer.GBLLRegression` (Watson et al. 2021, the paper's GBLL
  row): the same network trained *full batch* (one step per epoch) on the exact negative log
  marginal likelihood per example, jointly in the features, the prior precision and the
  noise; validation NLL and test predictive from the exact posterior of the training part
  (train + validation for the final model) at the selected epoch.
* ``vbll_package`` (opt-in, needs the optional ``vbll`` package): the authors' own layer,
  ``vbll.Regression(50, 1, 1/N, parameterization, prior_scale=1, wishart_scale=1, dof=1)``
  (App. G.2: ``N(0, I)`` mean prior -- the package scales it by ``1 / width`` itself, the same
  prior as ``vbll`` --, ``W^-1(1, 1)`` noise prior, KL weight ``1/N``) on the same body,
  trained by the package's own ``train_loss_fn`` and validated by its ``val_loss_fn``, in the
  same stacked path, data, batches and epoch selection as ``vbll`` (its frozen noise mean
  stays frozen there). It runs the paper's protocol with the paper's code for the head.

Targets. The library standardises regression targets with the training mean and standard
deviation (``targets="standardized"``, the default here). The paper only centres them ("we did
not re-scale the output magnitudes, to retain comparability of NLLs"), so its NLL and RMSE are
in the original units; ``targets="centered"`` reproduces that exactly (the same priors then act
on unscaled outputs). Either way every reported ``test_nll`` / ``test_rmse`` is in original
units: for a standardised model ``NLL_orig = NLL_std + log y_std`` and ``RMSE_orig = y_std
RMSE_std`` (a change of variables ``y = y_mean + y_std z``), and the standardised values are
stored too.

Seeds are trained together: one vectorised model (``torch.func.vmap`` over stacked parameters,
:func:`train_stacked`) is exactly ``len(seeds)`` independent runs -- each with its own split,
initialisation, batch order, per-seed gradient clipping and early stopping -- at a fraction of
the Python overhead (tests check it against the plain loop).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
from torch import Tensor, nn

from gaussify import data as gdata
from gaussify import metrics
from gaussify.cli_args import positive_int
from gaussify.experiments._report import run_main
from gaussify.experiments._runner import (
    choose_datasets,
    cli,
    fmt,
    paper_table,
    result_fields,
    seed_list,
    summary_rows,
    torch_threads,
)
from gaussify.experiments.stacked_training import select_epoch
from gaussify.experiments.stacked_training import train_stacked as _train_stacked
from gaussify.last_layer import GBLLRegression, VBLLRegression
from gaussify.last_layer.base import VBLLHead
from gaussify.last_layer.gbll import gbll_evidence
from gaussify.weight_space import Laplace

__all__ = [
    "BATCH_SIZE",
    "DATASETS",
    "MAX_EPOCHS",
    "METHODS",
    "OPTIONAL",
    "PAPER_TABLE2",
    "MAPRegressor",
    "VBLLUCIResults",
    "main",
    "make_model",
    "make_package_head",
    "package_regression_class",
    "run",
    "select_epoch",
    "train_stacked",
    "vbll_loss",
]

#: Every UCI regression set the library ships (Energy of Table 2 is not shipped; protein is
#: not in Table 2).
DATASETS: tuple[str, ...] = ("boston", "concrete", "wine_red", "yacht", "power", "protein")
QUICK_DATASETS: tuple[str, ...] = ("yacht",)
METHODS: tuple[str, ...] = (
    "vbll",
    "vbll_package",
    "map",
    "laplace",
    "laplace_map_noise",
    "gbll",
)
#: the methods that train a network by default (``laplace*`` are fitted to the ``map``
#: network)
TRAINED: tuple[str, ...] = ("vbll", "map", "gbll")
#: trained methods run only when asked for (``vbll_package`` needs the optional ``vbll``)
OPTIONAL: tuple[str, ...] = ("vbll_package",)
METHOD_LABELS: dict[str, str] = {
    "vbll": "VBLL",
    "vbll_package": "VBLL (vbll package)",
    "map": "MAP",
    "laplace": "LL Laplace",
    "laplace_map_noise": "LL Laplace (MAP noise)",
    "gbll": "GBLL",
}

#: Table 5 (MAP features): the maximum number of epochs. Protein is not in the paper; 1000 is
#: our choice (it has 40x the rows of boston).
MAX_EPOCHS: dict[str, int] = {
    "boston": 3000,
    "concrete": 3000,
    "energy": 2000,
    "power": 3000,
    "wine_red": 1000,
    "yacht": 2000,
    "protein": 1000,
}
#: App. G.2: batch size 32, except power (256, "to accelerate training"); protein likewise.
BATCH_SIZE: dict[str, int] = {"power": 256, "protein": 256}
DEFAULT_BATCH = 32

#: Harrison, Willes & Snoek (2024), Tables 2 and 3: test NLL and RMSE, mean ± standard error
#: over 20 seeds, in the original units of the targets (outputs centred, not rescaled,
#: App. G.2). Baselines other than VBLL come from Watson et al. (2021). Keys are library
#: data-set names (the paper's "Wine" is wine_red; Energy is not shipped). The paper prints
#: LDGBLL's Energy NLL as 4.80 ± 0.18, evidently a copy of a neighbouring cell; transcribed as
#: printed.
_T2 = paper_table("harrison2024_table2")  # per data set one (nll, se, rmse, se) per row
_T2_ROWS = tuple(_T2.pop("_rows"))
PAPER_TABLE2: dict[str, dict[str, dict[str, tuple[float, float]]]] = {
    name: {
        row: {"nll": (v[0], v[1]), "rmse": (v[2], v[3])}
        for row, v in zip(_T2_ROWS, values, strict=True)
    }
    for name, values in _T2.items()
}
#: Our method -> the Table 2 row it is compared with. The paper's "MAP" is a Bayesian last layer
#: fitted to MAP features (Snoek et al. 2015): closest to our ``laplace``; our ``map`` (plain
#: network with learned noise) has no row of its own, so it is shown beside the same row.
PAPER_ROW: dict[str, str] = {
    "vbll": "VBLL",
    "vbll_package": "VBLL",
    "map": "MAP",
    "laplace": "MAP",
    "laplace_map_noise": "MAP",
    "gbll": "GBLL",
}

Targets = Literal["standardized", "centered"]


# --------------------------------------------------------------------------------------------
# models and losses


def make_body(d_in: int, width: int = 50, depth: int = 2) -> nn.Sequential:
    """The feature network of App. G.2 (Watson et al. 2021): ``depth`` hidden layers of
    ``width`` leaky-ReLU units."""
    layers: list[nn.Module] = []
    for k in range(depth):
        layers += [nn.Linear(d_in if k == 0 else width, width), nn.LeakyReLU()]
    return nn.Sequential(*layers)


class MAPRegressor(nn.Module):
    """The MAP baseline: ``net = Sequential(body, nn.Linear(width, 1))`` and a learned noise
    ``log_sigma``; ``loss`` is the mean Gaussian negative log-likelihood."""

    def __init__(self, body: nn.Module, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(body, nn.Linear(width, 1))
        self.log_sigma = nn.Parameter(torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        return -self.log_prob(x, y).mean()

    def log_prob(self, x: Tensor, y: Tensor) -> Tensor:
        """``log N(y | f(x), sigma^2)`` per example, (N,)."""
        f = self.net(x)
        var = torch.exp(2.0 * self.log_sigma)
        return (-0.5 * (math.log(2 * math.pi) + 2.0 * self.log_sigma + (y - f).square() / var)).sum(
            -1
        )


def package_regression_class() -> type[nn.Module]:
    """``vbll.Regression``, the vbll package's regression layer (an optional dependency)."""
    try:
        from vbll import Regression
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "method 'vbll_package' needs the optional vbll package (the authors' reference "
            "implementation): pip install vbll"
        ) from err
    return Regression


def make_package_head(
    width: int,
    num_train: int,
    *,
    prior_scale: float | None = None,
    wishart_scale: float = 1.0,
    dof: float = 1.0,
    parameterization: str = "dense",
) -> nn.Module:
    """``vbll.Regression(width, 1, 1/num_train, ...)`` with the priors given in this
    library's convention: ``prior_scale`` is the prior variance of each last-layer weight
    (None: ``1 / width``, the head's default); the package multiplies its own
    ``prior_scale`` by ``1 / width``, so it receives ``width * prior_scale`` (1 by default, the
    paper's ``N(0, I)``). ``wishart_scale`` and ``dof`` mean the same in both."""
    regression = package_regression_class()
    scale = 1.0 if prior_scale is None else float(prior_scale) * width
    return regression(
        width,
        1,
        1.0 / num_train,
        parameterization=parameterization,
        prior_scale=scale,
        wishart_scale=wishart_scale,
        dof=dof,
    )


def make_model(
    method: Literal["vbll", "vbll_package", "map", "gbll"],
    d_in: int,
    num_train: int,
    width: int = 50,
    depth: int = 2,
    **head_kwargs: Any,
) -> nn.Module:
    """A fresh network for ``method``: ``Sequential(body, VBLLRegression)`` (KL weight
    ``1/num_train``, paper priors unless ``head_kwargs`` say otherwise),
    ``Sequential(body, vbll.Regression)`` (:func:`make_package_head`, same priors), a
    :class:`MAPRegressor` or ``Sequential(body, GBLLRegression)``. The body is built first,
    so the same seed gives every method the same initial features."""
    body = make_body(d_in, width, depth)
    if method == "vbll":
        kwargs = {"prior_scale": None, "wishart_scale": 1.0, "dof": 1.0, **head_kwargs}
        return nn.Sequential(body, VBLLRegression(width, 1, 1.0 / num_train, **kwargs))
    if method == "vbll_package":
        return nn.Sequential(body, make_package_head(width, num_train, **head_kwargs))
    if method == "map":
        return MAPRegressor(body, width)
    if method == "gbll":
        return nn.Sequential(body, GBLLRegression(width, 1, **head_kwargs))
    raise ValueError(f"method: expected 'vbll', 'vbll_package', 'map' or 'gbll', got {method!r}")


def vbll_loss(head: VBLLHead, phi: Tensor, y: Tensor) -> Tensor:
    """``head.train_loss(phi, y)`` without the argument checks, so that ``torch.func.vmap``
    can trace it (the checks branch on data): the negative of eq. (61) per example,
    ``-(mean bound + regularization_weight (log p(Sigma) - KL))``. ``y`` must already be in
    the head's layout (``(N, out_features)``)."""
    bound = head.log_likelihood_bound(phi, y)
    return -(bound.mean() + head.regularization_weight * (head.log_prior() - head.kl()))


def training_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """The per-model training objective of either method (traceable by vmap)."""
    if isinstance(model, MAPRegressor):
        return model.loss(x, y)
    body, head = model[0], model[1]
    if isinstance(head, GBLLRegression):  # exact evidence of the batch, unchecked (vmap)
        ev = gbll_evidence(body(x), y, head.prior_precision, head.noise_var)
        return -ev.log_evidence.sum() / x.shape[0]
    if isinstance(head, VBLLHead):
        return vbll_loss(head, body(x), y)
    # the vbll package's layer: its own negative ELBO per example
    return head(body(x)).train_loss_fn(y)


@torch.no_grad()
def predictive_nll(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Mean predictive negative log density ``-1/N sum log p(y_n | x_n)`` (the paper's
    validation and test NLL), in the units of ``y``."""
    if isinstance(model, MAPRegressor):
        return float(-model.log_prob(x, y).mean())
    if not isinstance(model[1], VBLLHead | GBLLRegression):  # the vbll package's layer
        return float(model(x).val_loss_fn(y))
    return float(model(x).val_loss(y))


@torch.no_grad()
def gbll_nll(model: nn.Module, x: Tensor, y: Tensor, *, num_fit: int) -> float:
    """GBLL's validation NLL: ``(x, y)`` are the training rows (the first ``num_fit``) followed
    by the evaluation rows; the posterior is fitted to the former and the predictive NLL of the
    latter returned (``train_stacked`` passes one tensor pair per model)."""
    body, head = model[0], model[1]
    head.fit_posterior(body(x[:num_fit]), y[:num_fit])
    return float(model(x[num_fit:]).val_loss(y[num_fit:]))


#: :func:`~gaussify.experiments.stacked_training.train_stacked` with this experiment's
#: objective (``training_loss``) and validation NLL (``predictive_nll``) as defaults.
train_stacked = partial(_train_stacked, loss=training_loss, val_nll=predictive_nll)


# --------------------------------------------------------------------------------------------
# the protocol


@dataclass
class Config:
    """Everything that determines the numbers (stored with the results)."""

    datasets: list[str]
    seeds: list[int]
    targets: str
    max_epochs: dict[str, int]
    batch_size: dict[str, int]
    patience: int | None
    eval_every: int
    max_train: dict[str, int | None]
    methods: list[str] = field(default_factory=lambda: list(TRAINED))
    width: int = 50
    depth: int = 2
    lr: float = 1e-3
    weight_decay: float = 1e-2
    max_grad_norm: float = 1.0
    prior_scale: float | None = None  # None: the head's default 1 / width
    wishart_scale: float = 1.0
    dof: float = 1.0
    parameterization: str = "dense"


@dataclass
class VBLLUCIResults:
    """Results of :func:`run`.

    ``rows``: one per data set and method, test NLL and RMSE (original units) mean ± standard
    error over seeds beside the paper's Table 2 entry. ``records``: one per data set, seed and
    method (selected epochs, validation curve, test metrics in original and standardised
    units, fitted hyperparameters). ``models`` maps ``(dataset, seed, method)`` to the final
    model when ``keep_models=True`` (``laplace``: the fitted ``Laplace`` object; not
    serialised).
    """

    config: dict[str, Any]
    rows: list[dict[str, Any]]
    records: list[dict[str, Any]]
    notes: list[str]
    runtime_s: float
    models: dict[tuple[str, int, str], Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable view (without ``models``)."""
        return {
            "experiment": "vbll_uci",
            "paper": "Harrison, Willes & Snoek (2024), Tables 2, 3 (App. G.2 protocol)",
            "config": self.config,
            "runtime_s": self.runtime_s,
            "notes": self.notes,
            "paper_table2": PAPER_TABLE2,
            "rows": self.rows,
            "records": self.records,
        }

    def table(self) -> str:
        """Markdown table: test NLL and RMSE (original units), ours ± s.e. (paper)."""
        lines = [
            "| dataset | method | seeds | NLL ours | NLL paper | RMSE ours | RMSE paper |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            paper = r.get("paper") or {}
            lines.append(
                f"| {r['dataset']} | {r['label']} | {r['num_seeds']} | "
                f"{_fmt(r['test_nll_mean'], r['test_nll_se'])} | "
                f"{_fmt(*paper['nll']) if 'nll' in paper else '–'} | "
                f"{_fmt(r['test_rmse_mean'], r['test_rmse_se'])} | "
                f"{_fmt(*paper['rmse']) if 'rmse' in paper else '–'} |"
            )
        return "\n".join(lines)


_fmt = partial(fmt, digits=2)


def unstandardize_nll(nll_std: float, y_std: float) -> float:
    """NLL of ``y = y_mean + y_std z`` from the NLL of ``z``: ``NLL_std + log y_std``
    (the Jacobian of the change of variables, per scalar output)."""
    return nll_std + math.log(y_std)


def _load(name: str, seed: int, targets: str, max_train: int | None) -> dict[str, Any]:
    ds = gdata.load(name, seed=seed, max_train=max_train)
    assert ds.y_std is not None
    # "centered": the paper's convention, targets in original units minus the training mean
    scale = ds.y_std if targets == "centered" else 1.0
    return {
        "ds": ds,
        "x_train": ds.x_train,
        "y_train": ds.y_train * scale,
        "x_val": ds.x_val,
        "y_val": ds.y_val * scale,
        "x_test": ds.x_test,
        "y_test": ds.y_test * scale,
        "unit_scale": ds.y_std / scale,  # model units -> original units
    }


def _test_metrics(mean: Tensor, var: Tensor, y: Tensor, unit_scale: float) -> dict[str, float]:
    """Test metrics in model units and in original units (``unit_scale`` = original units per
    model unit: y_std for standardised targets, 1 for centred)."""
    nll_model = metrics.gaussian_nll(mean, var, y)
    rmse_model = metrics.rmse(mean, y)
    return {
        "test_nll": unstandardize_nll(nll_model, unit_scale),
        "test_rmse": rmse_model * unit_scale,
        "test_nll_model_units": nll_model,
        "test_rmse_model_units": rmse_model,
    }


def _run_dataset(
    name: str, cfg: Config, keep_models: bool, bar: Any
) -> tuple[list[dict[str, Any]], dict[tuple[str, int, str], Any]]:
    splits = [_load(name, s, cfg.targets, cfg.max_train[name]) for s in cfg.seeds]
    stack = {k: torch.stack([sp[k] for sp in splits]) for k in ("x_train", "y_train")}
    vstack = {k: torch.stack([sp[k] for sp in splits]) for k in ("x_val", "y_val")}
    x_full = torch.cat([stack["x_train"], vstack["x_val"]], dim=1)
    y_full = torch.cat([stack["y_train"], vstack["y_val"]], dim=1)
    n_train, n_full = stack["x_train"].shape[1], x_full.shape[1]
    d_in = stack["x_train"].shape[-1]
    max_epochs = cfg.max_epochs[name]
    batch = cfg.batch_size[name]
    head_kwargs = {
        "prior_scale": cfg.prior_scale,
        "wishart_scale": cfg.wishart_scale,
        "dof": cfg.dof,
        "parameterization": cfg.parameterization,
    }

    def fresh(method: str, num_data: int) -> list[nn.Module]:
        out = []
        for s in cfg.seeds:
            torch.manual_seed(s)
            kwargs = head_kwargs if method in ("vbll", "vbll_package") else {}
            out.append(make_model(method, d_in, num_data, cfg.width, cfg.depth, **kwargs))  # type: ignore[arg-type]
        return out

    common = {
        "batch_size": batch,
        "seeds": cfg.seeds,
        "lr": cfg.lr,
        "weight_decay": cfg.weight_decay,
        "max_grad_norm": cfg.max_grad_norm,
    }
    records: list[dict[str, Any]] = []
    kept: dict[tuple[str, int, str], Any] = {}
    for method in cfg.methods:
        # GBLL: full batch; its validation predictive conditions on the training part
        full_batch = method == "gbll"
        validation = (vstack["x_val"], vstack["y_val"])
        extra_args: dict[str, Any] = {}
        if full_batch:
            validation = (x_full, y_full)
            extra_args["val_nll"] = partial(gbll_nll, num_fit=n_train)
        # 1. choose the number of epochs on the validation part
        sel = train_stacked(
            fresh(method, n_train),
            stack["x_train"],
            stack["y_train"],
            epochs=max_epochs,
            validation=validation,
            eval_every=cfg.eval_every,
            patience=cfg.patience,
            progress=bar,
            **{**common, **({"batch_size": n_train} if full_batch else {})},
            **extra_args,
        )
        chosen = [select_epoch(sel.val_epochs, c) for c in sel.val_curves]
        # 2. train afresh on train + validation for that many epochs
        full = train_stacked(
            fresh(method, n_full),
            x_full,
            y_full,
            epochs=max(chosen),
            snapshots=chosen,
            progress=bar,
            **{**common, **({"batch_size": n_full} if full_batch else {})},
        )
        models = fresh(method, n_full)
        for k, (seed, sp) in enumerate(zip(cfg.seeds, splits, strict=True)):
            model = models[k]
            model.load_state_dict(full.states[k])
            model.eval()
            base = {
                "dataset": name,
                "seed": seed,
                "n_train": n_train,
                "n_train_val": n_full,
                "n_test": len(sp["y_test"]),
                "y_std": sp["ds"].y_std,
                "selected_epochs": chosen[k],
                "stopped_at": sel.stopped[k],
                "val_epochs": sel.val_epochs,
                "val_nll_curve": [None if math.isnan(v) else v for v in sel.val_curves[k]],
                "select_seconds": sel.seconds / len(cfg.seeds),
                "full_seconds": full.seconds / len(cfg.seeds),
            }
            with torch.no_grad():
                if method == "gbll":
                    model[1].fit_posterior(model[0](x_full[k]), y_full[k])
                if method == "vbll_package":
                    pred = model(sp["x_test"]).predictive
                    mean, var = pred.mean, pred.variance
                    extra = {"noise_var": float(torch.exp(2.0 * model[1].noise_logdiag[0]))}
                elif method in ("vbll", "gbll"):
                    pred = model(sp["x_test"]).predictive
                    mean, var = pred.mean, pred.var
                    extra = {"noise_var": float(model[1].noise_cov.variance[0])}
                    if method == "gbll":
                        extra["prior_precision"] = float(model[1].prior_precision)
                else:
                    mean = model(sp["x_test"])
                    var = torch.exp(2.0 * model.log_sigma).expand_as(mean)
                    extra = {"noise_var": float(var[0, 0])}
            records.append(
                {
                    **base,
                    "method": method,
                    **_test_metrics(mean, var, sp["y_test"], sp["unit_scale"]),
                    **extra,
                }
            )
            if keep_models:
                kept[(name, seed, method)] = model
            if method != "map":
                continue
            for variant, tune_noise in (("laplace", True), ("laplace_map_noise", False)):
                la = _laplace(model, x_full[k], y_full[k], tune_noise)
                pred = la.predict(sp["x_test"], method="glm")
                records.append(
                    {
                        **base,
                        "method": variant,
                        **_test_metrics(pred.mean, pred.var, sp["y_test"], sp["unit_scale"]),
                        "noise_var": float(la.sigma_noise.square()),
                        "prior_precision": float(la.prior_precision),
                    }
                )
                if keep_models:
                    kept[(name, seed, variant)] = la
    return records, kept


def _laplace(model: MAPRegressor, x: Tensor, y: Tensor, tune_noise: bool = True) -> Laplace:
    """Last-layer full Laplace on the MAP network, prior precision (and, with ``tune_noise``,
    the noise, starting from the MAP sigma) by the evidence."""
    sigma = float(torch.exp(model.log_sigma.detach()))
    la = Laplace(model.net, "regression", "full", subset="last_layer", sigma_noise=sigma)
    return la.fit((x, y)).optimize_prior(tune_noise=tune_noise)


def summarise(records: list[dict[str, Any]], datasets: Sequence[str]) -> list[dict[str, Any]]:
    """One row per data set and method: test NLL / RMSE mean ± standard error over seeds
    (original units), with the paper's Table 2 entry of :data:`PAPER_ROW`."""
    keys = ("test_nll", "test_rmse", "test_nll_model_units", "selected_epochs")
    rows = summary_rows(records, datasets, METHODS, METHOD_LABELS, keys, sort_key="seed")
    for row in rows:
        row["paper_row"] = PAPER_ROW[row["method"]]
        row["paper"] = PAPER_TABLE2.get(row["dataset"], {}).get(row["paper_row"])
    return rows


def run(
    datasets: Sequence[str] | None = None, seeds: int | Sequence[int] = 20, quick: bool = False,
    progress: bool = False, *, targets: Targets = "standardized",
    max_epochs: int | dict[str, int] | None = None, patience: int | None = None,
    eval_every: int = 10, max_train: int | dict[str, int] | None = None,
    keep_models: bool = False, num_threads: int | None = 1, parameterization: str = "dense",
    methods: Sequence[str] | None = None, prior_scale: float | None = None,
) -> VBLLUCIResults:  # fmt: skip
    """Run the Table 2 protocol (App. G.2) and return the results.

    ``datasets``: library names (default: every shipped UCI regression set, :data:`DATASETS`);
    ``seeds``: a number (seeds 0..n-1; the paper uses 20) or explicit seeds; ``targets``:
    ``"standardized"`` (library default) or ``"centered"`` (the paper's). ``max_epochs``: an
    int for every data set or a dict (default Table 5, :data:`MAX_EPOCHS`); ``patience``:
    stop a seed's selection run after that many validation checks (``eval_every`` epochs
    apart) without improvement (default None: train to ``max_epochs`` as the paper does);
    ``max_train``: subsample the training part (an int for every data set or a dict; for the
    large sets). ``quick=True``: yacht, 2
    seeds, 40 epochs, patience 2 (for tests). ``num_threads``: torch intra-op threads during
    the run (restored after). ``methods``: the trained methods to run (default all of
    :data:`TRAINED`; ``laplace*`` come with ``map``; ``"vbll_package"`` of :data:`OPTIONAL`
    only when named). ``prior_scale``: the prior variance of each last-layer weight of the
    ``vbll`` and ``vbll_package`` heads (default None: ``1 / width``, the paper's ``N(0, I)`` at
    the package's ``prior_scale=1``; 1.0 is the literal ``N(0, I)``). Deterministic given these
    arguments.
    """
    start = time.perf_counter()
    chosen = choose_datasets(None, DATASETS, QUICK_DATASETS, quick=quick)
    if datasets is not None:
        available = set(gdata.list())
        chosen = list(datasets)
        unknown = [d for d in chosen if d not in available or gdata.info(d).task != "regression"]
        if unknown:
            raise ValueError(f"datasets: not shipped UCI regression sets: {unknown}")
    seed_ids = seed_list(seeds, 2, quick=quick, name="seeds")
    chosen_methods = list(TRAINED) if methods is None else list(methods)
    allowed = list(TRAINED + OPTIONAL)
    bad = [m for m in chosen_methods if m not in allowed]
    if bad or not chosen_methods:
        raise ValueError(f"methods: expected some of {allowed}, got {list(chosen_methods)}")
    if "vbll_package" in chosen_methods:
        package_regression_class()  # a clear ImportError before any work
    if prior_scale is not None and not (math.isfinite(prior_scale) and prior_scale > 0):
        raise ValueError(
            f"prior_scale: expected a positive finite number or None, got {prior_scale}"
        )
    if targets not in ("standardized", "centered"):
        raise ValueError(f"targets: expected 'standardized' or 'centered', got {targets!r}")
    if quick:
        max_epochs = 40 if max_epochs is None else max_epochs
        patience = 2 if patience is None else patience
    if max_epochs is None:
        epochs = {d: MAX_EPOCHS[d] for d in chosen}
    elif isinstance(max_epochs, int):
        epochs = dict.fromkeys(chosen, max_epochs)
    else:
        epochs = {d: max_epochs.get(d, MAX_EPOCHS[d]) for d in chosen}
    cfg = Config(
        datasets=chosen,
        seeds=seed_ids,
        targets=targets,
        max_epochs=epochs,
        batch_size={d: BATCH_SIZE.get(d, DEFAULT_BATCH) for d in chosen},
        patience=patience,
        eval_every=eval_every,
        max_train={
            d: max_train.get(d) if isinstance(max_train, dict) else max_train for d in chosen
        },
        parameterization=parameterization,
        methods=chosen_methods,
        prior_scale=prior_scale,
    )
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(desc="VBLL UCI", unit="epoch")
    records: list[dict[str, Any]] = []
    kept: dict[tuple[str, int, str], Any] = {}
    with torch_threads(num_threads):
        try:
            for name in chosen:
                if bar is not None:
                    bar.set_postfix(dataset=name)
                recs, models = _run_dataset(name, cfg, keep_models, bar)
                records += recs
                kept.update(models)
        finally:
            if bar is not None:
                bar.close()
    notes = [
        f"{len(seed_ids)} seeds (paper: 20); splits gaussify.data.load(name, seed) 0.72/0.18/0.10.",
        f"targets {targets}: NLL and RMSE reported in original units "
        "(standardised: NLL + log y_std, RMSE * y_std); the paper centres without rescaling.",
        "epochs: validation NLL every "
        f"{eval_every} epochs, argmin selected, retrained on train+val; max epochs "
        f"{epochs}" + (f", early stopping patience {patience} checks" if patience else "") + ".",
        "paper 'MAP' (Table 2) is a Bayesian last layer on MAP features; it is shown beside "
        "both our MAP (learned-noise network) and our last-layer Laplace.",
    ]
    capped = {d: v for d, v in cfg.max_train.items() if v is not None}
    if capped:
        notes.append(f"training parts subsampled to at most {capped} rows.")
    return VBLLUCIResults(
        **result_fields(cfg, summarise(records, chosen), records, notes, start),
        models=kept,
    )


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m gaussify.experiments.vbll_uci [options]``; prints the table (ours vs
    the paper's Table 2) and writes JSON with ``--output``."""
    options = [
        ("--datasets", dict(nargs="+", default=None, help="default: all shipped")),
        ("--seeds", dict(type=positive_int, default=20, help="number of seeds (0..n-1)")),
        ("--quick", dict(action="store_true", help="yacht, 2 seeds, 40 epochs")),
        ("--targets", dict(choices=("standardized", "centered"), default="standardized")),
        ("--max-epochs", dict(type=positive_int, default=None, help="default: Table 5")),
        ("--patience", dict(type=positive_int, default=None, help="validation checks")),
        ("--max-train", dict(type=positive_int, default=None, help="subsample training rows")),
        (
            "--methods",
            dict(
                nargs="+",
                choices=TRAINED + OPTIONAL,
                default=None,
                help="default: " + " ".join(TRAINED),
            ),
        ),
    ]
    description = (
        "Harrison et al. (2024) Table 2: UCI regression with VBLL, MAP, last-layer Laplace and "
        "GBLL (App. G.2 protocol)."
    )
    title = "Test NLL / RMSE (original units), mean ± s.e. over seeds; paper Table 2 beside"
    return cli(argv, "vbll_uci", description, options, run, title=title)


if __name__ == "__main__":
    run_main(main)
