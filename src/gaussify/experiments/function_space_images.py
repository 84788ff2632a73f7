"""VaLLA paper Sec. 5.3 (Fig. 3, Fig. 4), scaled: MNIST and Fashion-MNIST with a 2-layer MLP.

The paper trains a 2-layer tanh MLP on MNIST and FMNIST and compares MAP, last-layer / diagonal
/ KFAC Laplace, ELLA, Sampled-LLA and VaLLA by test accuracy, NLL, ECE, Brier score, OOD-AUROC
(predictive entropy separating MNIST from FMNIST test images and vice versa) and, on rotated
test images, NLL / ECE as the rotation grows. Here, on the bundled subsets (``mnist``: 10,000
training images split 70/15/15; ``fashion_mnist``: 10,000 + its 2,000 original test images),
scaled for a 2-core CPU:

* network: 784-``width``-``width``-10 tanh MLP (default width 100), float64, Adam lr 1e-3,
  batch 128, ``epochs`` passes (default 10) on ``max_train`` (default 2000) training images,
  prior precision 1 (``gs.train_map``); test sets capped at ``max_test`` (default 500);
* last-layer / diag / KFAC Laplace (``gs.Laplace``), prior precision by the marginal
  likelihood, GLM predictive with the probit link;
* FunctionalLaplace on a random subset of ``fl_subset`` (default 200) training images
  (N C = 2000), prior by its evidence; ELLA with ``ella_landmarks`` (default 200) random
  landmarks, prior by its Nyström evidence; VaLLA with ``num_inducing`` (default 200, the
  larger of the paper's two settings; 100 is its other) k-means
  inducing points, each carrying one class (VaLLA's default for classification, the authors'
  design: the label of the nearest training image; M inducing values, not M C), alpha = 1
  (probit expectation), prior learned, ``valla_epochs`` epochs with early stopping on the
  validation part (:data:`VALLA_EARLY_STOPPING`, the paper's rule: scored once per epoch,
  stopped at the first epoch that does not improve it, the best state kept). All predictives
  use the probit link.
  Sampled-LLA is left out of this table (its 10-class, 90k-parameter sample optimisation
  did not fit the time budget).
* shift: test images rotated by ``angles`` degrees (bilinear, zero fill); 0 degrees is the
  unrotated test set exactly.

:func:`demo_function_space` is the one function-space method for ``gaussify demo``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gaussify as gs
from gaussify import metrics
from gaussify.cli_args import finite_float, nonnegative_int, positive_int
from gaussify.experiments import function_space_regression as fs_regression
from gaussify.experiments._report import (
    run_main,
)
from gaussify.experiments._runner import (
    IMAGE_DATASETS,
    OOD_PARTNER,
    check_known,
    cli,
    group_records,
    train_map_eval,
)
from gaussify.experiments.function_space_regression import (
    WEIGHT_SPACE,
    run_datasets,
    weight_space_laplace,
)

__all__ = [
    "ANGLES",
    "DATASETS",
    "METHODS",
    "VALLA_EARLY_STOPPING",
    "ImageResults",
    "demo_function_space",
    "image_metrics",
    "main",
    "rotate",
    "run",
]

DATASETS = IMAGE_DATASETS
#: the methods of the regression benchmark but Sampled-LLA, with its labels
METHODS: tuple[str, ...] = tuple(m for m in fs_regression.METHODS if m != "sampled_lla")
LABELS: dict[str, str] = {m: fs_regression.LABELS[m] for m in METHODS}
ANGLES: tuple[float, ...] = (0.0, 45.0, 90.0, 180.0)
#: VaLLA's early stopping on the image data sets, the keywords of ``VaLLA.fit``: the paper's
#: rule (Sec. 3.3, App. C: the validation NLL computed every epoch, training stopped when it
#: worsens), i.e. one evaluation per epoch (``eval_every`` left at its default) and patience 1.
#: ``VaLLA.fit`` restores the state with the best validation NLL, the epoch before the stop
#: (the authors' ``fit`` returns the worsened state at the stop). Shared by this experiment and
#: the ``benchmarks/valla_*`` image scripts.
VALLA_EARLY_STOPPING: Mapping[str, int] = MappingProxyType({"patience": 1})


def rotate(images: Tensor, angle: float) -> Tensor:
    """Rotate ``images (N, 1, H, W)`` (or flattened (N, 784) 28 x 28 images, returned in the
    same shape) counter-clockwise by ``angle`` degrees about the centre, bilinear with zero
    fill. Multiples of 90 degrees are exact pixel permutations (``torch.rot90``)."""
    flat = images.ndim == 2
    x = images.reshape(-1, 1, 28, 28) if flat else images
    if x.ndim != 4:
        raise ValueError(f"images: expected (N, 1, H, W) or (N, 784), got {tuple(images.shape)}")
    quarter = angle / 90.0
    if float(quarter).is_integer():
        out = torch.rot90(x, int(quarter) % 4, dims=(-2, -1))
    else:
        rad = math.radians(angle)
        c, s = math.cos(rad), math.sin(rad)
        # affine_grid maps output to input coordinates (x right, y down): this sign makes the
        # interpolated path turn the same way as torch.rot90 for multiples of 90 degrees
        theta = torch.tensor([[c, -s, 0.0], [s, c, 0.0]], dtype=x.dtype).expand(x.shape[0], 2, 3)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        out = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out.reshape(images.shape)


def image_metrics(probs: Tensor, y: Tensor) -> dict[str, float]:
    """ACC, NLL, ECE (15 bins), Brier from ``gaussify.metrics``."""
    m = metrics.classification_metrics(probs, y)
    return {k: m[k] for k in ("acc", "nll", "ece", "brier")}


def make_mlp(d_in: int, width: int, num_classes: int, seed: int = 0) -> nn.Sequential:
    """``d_in``-``width``-``width``-``num_classes`` tanh MLP, float64, seeded."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d_in, width),
        nn.Tanh(),
        nn.Linear(width, width),
        nn.Tanh(),
        nn.Linear(width, num_classes),
    ).double()


@dataclass
class ImageResults:
    """``records``: one dict per (dataset, method): test metrics, ``ood_auroc``, ``fit_s``,
    ``rotated`` (angle -> metrics)."""

    records: list[dict[str, Any]]
    config: dict[str, Any]
    notes: list[str]
    runtime_s: float

    def to_dict(self) -> dict[str, Any]:
        def plain(r: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in r.items() if not isinstance(v, Tensor)}

        return {
            "experiment": "function_space_images",
            "config": self.config,
            "records": [plain(r) for r in self.records],
            "notes": self.notes,
            "runtime_s": self.runtime_s,
        }

    def table(self) -> str:
        head = f"{'data':<14}{'method':<28}" + "".join(
            f"{k:>8}" for k in ("ACC", "NLL", "ECE", "Brier", "OOD", "fit s")
        )
        lines = [head, "-" * len(head)]
        for r in self.records:
            vals = [r["acc"], r["nll"], r["ece"], r["brier"], r["ood_auroc"], r["fit_s"]]
            lines.append(
                f"{r['dataset']:<14}{LABELS[r['method']]:<28}" + "".join(f"{v:>8.3f}" for v in vals)
            )
        angles = self.config["angles"]
        lines += ["", "rotated test images: NLL / ECE per angle"]
        lines.append(f"{'data':<14}{'method':<28}" + "".join(f"{a:>14g}" for a in angles))
        for r in self.records:
            cells = "".join(
                f"{r['rotated'][str(a)]['nll']:>8.2f}/{r['rotated'][str(a)]['ece']:.2f}"
                for a in angles
            )
            lines.append(f"{r['dataset']:<14}{LABELS[r['method']]:<28}{cells}")
        return "\n".join(lines)


def _fit(
    method: str,
    model: nn.Module,
    train: tuple[Tensor, Tensor],
    val: tuple[Tensor, Tensor],
    cfg: dict[str, Any],
) -> Any:
    x, y = train
    seed = cfg["seed"]
    if method == "map":
        return None
    if method in WEIGHT_SPACE:
        return weight_space_laplace(method, model, "classification").fit((x, y)).optimize_prior()
    if method == "functional_laplace":
        fl = gs.FunctionalLaplace(
            model,
            "classification",
            num_data_subset=cfg["fl_subset"],
            generator=torch.Generator().manual_seed(seed),
        )
        return fl.fit((x, y)).optimize_prior(method="grid")
    if method == "ella":
        ella = gs.ELLA(model, "classification", num_landmarks=cfg["ella_landmarks"], seed=seed)
        return ella.fit((x, y)).optimize_prior(method="grid")
    if method == "valla":
        return gs.VaLLA(
            model,
            "classification",
            num_inducing=cfg["num_inducing"],
            epochs=cfg["valla_epochs"],
            batch_size=128,
            kernel="ntk",
            seed=seed,
        ).fit((x, y), val, **VALLA_EARLY_STOPPING)
    raise ValueError(f"methods: unknown method {method!r}; choose from {METHODS}")


def _probs(post: Any, model: nn.Module, x: Tensor) -> Tensor:
    if post is None:
        with torch.no_grad():
            return torch.softmax(model(x), -1)
    return post.predict(x, link="probit").probs


def run(
    quick: bool = False,
    *,
    datasets: Sequence[str] | None = None,
    methods: Sequence[str] | None = None,
    angles: Sequence[float] | None = None,
    seed: int = 0,
    max_train: int | None = None,
    max_test: int | None = None,
    width: int | None = None,
    epochs: int | None = None,
    fl_subset: int | None = None,
    ella_landmarks: int | None = None,
    num_inducing: int | None = None,
    valla_epochs: int = 10,
    keep_predictions: bool = False,
    num_threads: int | None = 1,
    progress: bool = False,
) -> ImageResults:
    """The table (and rotation sweep) for each data set. ``quick=True``: 300 training and 200
    test images, width 16, 2 epochs, FL on 30 points, M = 20, angles (0, 90).
    ``keep_predictions``: keep each method's test probabilities (``probs``) and labels
    (``y``) in the records, and per angle (``probs_rot``), for tests."""
    start = time.perf_counter()
    datasets = list(datasets or DATASETS)
    methods = list(methods or METHODS)
    check_known(methods, METHODS, f"methods: unknown {{bad}}; choose from {METHODS}")
    check_known(datasets, OOD_PARTNER, f"datasets: {{bad}} not supported; choose from {DATASETS}")
    cfg: dict[str, Any] = {
        "datasets": datasets,
        "methods": methods,
        "angles": [float(a) for a in (angles or ((0.0, 90.0) if quick else ANGLES))],
        "seed": seed,
        "max_train": max_train or (300 if quick else 2000),
        "max_test": max_test or (200 if quick else 500),
        "width": width or (16 if quick else 100),
        "epochs": epochs or (2 if quick else 10),
        "fl_subset": fl_subset or (30 if quick else 200),
        "ella_landmarks": ella_landmarks or (20 if quick else 200),
        "num_inducing": num_inducing or (20 if quick else 200),
        "valla_epochs": valla_epochs,
        "quick": quick,
    }
    records = run_datasets(_run_dataset, cfg, keep_predictions, num_threads, progress)
    return ImageResults(records, cfg, _notes(records), time.perf_counter() - start)


def _load(name: str, cfg: dict[str, Any]) -> gs.data.Dataset:
    return gs.data.load(
        name, seed=cfg["seed"], dtype=torch.float64, flatten=True, max_train=cfg["max_train"]
    )


def _run_dataset(
    name: str, methods: list[str], cfg: dict[str, Any], keep: bool
) -> list[dict[str, Any]]:
    ds = _load(name, cfg)
    other = _load(OOD_PARTNER[name], cfg)
    n_test = cfg["max_test"]
    x_test, y_test = ds.x_test[:n_test], ds.y_test[:n_test]
    x_ood = other.x_test[:n_test]
    x, y = ds.x_train, ds.y_train
    model = make_mlp(x.shape[1], cfg["width"], int(ds.num_classes or 10), cfg["seed"])
    train_map_eval(model, (x, y), "classification", cfg, batch_size=128)
    records = []
    for method in methods:
        t = time.perf_counter()
        post = _fit(method, model, (x, y), (ds.x_val, ds.y_val), cfg)
        fit_s = time.perf_counter() - t
        probs = _probs(post, model, x_test)
        rec: dict[str, Any] = {"dataset": name, "method": method, "fit_s": fit_s}
        rec.update(image_metrics(probs, y_test))
        rec["ood_auroc"] = metrics.ood_auroc(probs, _probs(post, model, x_ood))
        rec["rotated"] = {}
        rot_probs = {}
        for angle in cfg["angles"]:
            p_rot = probs if angle == 0.0 else _probs(post, model, rotate(x_test, angle))
            rec["rotated"][str(angle)] = image_metrics(p_rot, y_test)
            rot_probs[str(angle)] = p_rot
        rec["predict_s"] = time.perf_counter() - t - fit_s
        if post is not None and hasattr(post, "prior_precision"):
            prior = torch.as_tensor(post.prior_precision)
            if prior.numel() == 1:
                rec["prior_precision"] = float(prior)
        if method == "valla":
            rec["steps"] = len(post.history["objective"])
            rec["val_nll_history"] = list(post.history["val_nll"])
        if keep:
            rec.update(probs=probs, y=y_test, probs_rot=rot_probs)
        records.append(rec)
    return records


def _notes(records: list[dict[str, Any]]) -> list[str]:
    notes = []
    for name, rows in group_records(records).items():
        best_nll = min(rows, key=lambda r: r["nll"])
        best_ood = max(rows, key=lambda r: r["ood_auroc"])
        notes.append(
            f"{name}: best NLL {LABELS[best_nll['method']]} ({best_nll['nll']:.3f}), best "
            f"OOD-AUROC {LABELS[best_ood['method']]} ({best_ood['ood_auroc']:.3f})"
        )
    return notes


def demo_function_space(
    ds: gs.data.Dataset, model: nn.Module, *, num_landmarks: int = 50, seed: int = 0
) -> tuple[Tensor, dict[str, Any]]:
    """Fit ELLA (Nyström linearised Laplace, Deng et al. 2022) to a trained classifier and
    return its test class probabilities ``(N_test, C)`` and an info dict.

    ``model`` maps ``ds.x_train`` to C logits at its MAP weights. ``num_landmarks`` random
    training points (at most N) form the Nyström basis; the scalar prior precision is chosen
    by the Nyström evidence on a grid (10^-4 .. 10^4) and the predictive uses the probit
    link. ELLA was chosen over VaLLA for the demo: on ``digits`` with a 64-50-50-10 tanh MLP
    it fits in a few seconds (one pass over the data, no optimisation loop) with a better test
    NLL than VaLLA's at M = 50-100 (0.23 vs 0.40-0.47 on a loaded 2-core machine).
    Inputs are cast to the model's dtype.
    """
    if ds.task != "classification":
        raise ValueError(f"ds: demo_function_space needs a classification data set, got {ds.task}")
    dtype = next(model.parameters()).dtype
    x, y = ds.x_train.to(dtype), ds.y_train
    if x.ndim > 2:
        x = x.flatten(1)
    x_test = ds.x_test.to(dtype)
    if x_test.ndim > 2:
        x_test = x_test.flatten(1)
    start = time.perf_counter()
    ella = gs.ELLA(
        model, "classification", num_landmarks=min(num_landmarks, x.shape[0]), seed=seed
    ).fit((x, y))
    ella.optimize_prior(method="grid")
    probs = ella.predict(x_test, link="probit").probs
    info = {
        "method": "ELLA",
        "num_landmarks": ella._z.shape[0],
        "num_features": ella.num_features,
        "prior_precision": float(ella.prior_precision),
        "log_marginal_likelihood": float(ella.log_marginal_likelihood()),
        "fit_s": time.perf_counter() - start,
    }
    return probs, info


def main(argv: list[str] | None = None) -> int:
    """CLI: ``gaussify experiment function_space_images [--quick] [--output J]``."""
    options = [
        ("--quick", dict(action="store_true", help="tiny sizes")),
        ("--datasets", dict(nargs="+", default=None)),
        ("--methods", dict(nargs="+", default=None)),
        ("--angles", dict(type=finite_float, nargs="+", default=None)),
        ("--max-train", dict(type=positive_int, default=None)),
        ("--epochs", dict(type=positive_int, default=None)),
        ("--seed", dict(type=nonnegative_int, default=0)),
    ]
    description = "VaLLA Sec. 5.3 scaled: MNIST / FMNIST with LLA variants, OOD and rotation."
    return cli(argv, "function_space_images", description, options, run)


if __name__ == "__main__":
    run_main(main)
