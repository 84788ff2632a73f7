"""What ``gaussify demo`` evaluates: a trained classifier's test set, the same test set under a
shift of several strengths, and an out-of-distribution (OOD) set, all in the model's input space.

The shifts and the OOD sets are chosen per kind of data so that each is honest:

* images (``digits``, 8 x 8 with values 0..16 standardised per pixel; ``mnist`` and
  ``fashion_mnist``, 28 x 28 in [0, 1]): the shift rotates the test images by
  ``IMAGE_ANGLES`` degrees (bilinear, zero fill, in pixel space, then standardised with the
  training statistics); the OOD set is the *other* bundled image collection at the same
  resolution and intensity range (Fashion-MNIST test images for the digit sets, averaged down
  to 8 x 8 and scaled to 0..16 for ``digits``; MNIST test images for ``fashion_mnist``);
* tabular data (standardised features): the shift adds Gaussian noise with standard deviation
  ``TABULAR_NOISE`` (in units of each feature's training standard deviation); the OOD set
  takes the test rows with every feature permuted independently across rows (each feature's
  marginal is kept, the joint structure that the classes live in is destroyed).

Every set is drawn from a seeded generator: the same seed gives the same sets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from gaussify import data as gdata
from gaussify import metrics

__all__ = [
    "IMAGE_ANGLES",
    "METRICS",
    "TABULAR_NOISE",
    "EvaluationSets",
    "evaluate",
    "evaluation_sets",
    "rotate_images",
]

#: rotation angles (degrees) of the image shift
IMAGE_ANGLES: tuple[float, ...] = (5.0, 10.0, 20.0, 30.0)
#: noise standard deviations (in training standard deviations) of the tabular shift
TABULAR_NOISE: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0)
#: the metrics reported per method and evaluation set
METRICS: tuple[str, ...] = ("acc", "nll", "ece", "brier")

#: image data set -> the bundled image data set used as its OOD set
_IMAGE_OOD = {
    "digits": "fashion_mnist",
    "mnist": "fashion_mnist",
    "fashion_mnist": "mnist",
}


@dataclass(frozen=True)
class EvaluationSets:
    """The demo's inputs besides the test set. ``shifted[k]`` is the test set under
    ``strengths[k]`` of the shift described by ``shift`` (labels are ``y_test``);
    ``ood`` holds inputs of no training class, described by ``ood_name``."""

    shift: str
    strength_name: str
    strengths: tuple[float, ...]
    shifted: tuple[Tensor, ...]
    ood_name: str
    ood: Tensor


def rotate_images(images: Tensor, angle: float) -> Tensor:
    """Rotate ``images (N, 1, H, W)`` counter-clockwise by ``angle`` degrees about the centre,
    bilinear with zero fill (zero = no ink). The rotation matrix R(angle) maps each output
    pixel's centre to the input location it is read from (``affine_grid`` convention)."""
    if images.ndim != 4:
        raise ValueError(f"images: expected (N, 1, H, W), got {tuple(images.shape)}")
    rad = torch.deg2rad(torch.tensor(float(angle), dtype=torch.float64))
    c, s = float(torch.cos(rad)), float(torch.sin(rad))
    theta = torch.tensor([[c, -s, 0.0], [s, c, 0.0]], dtype=images.dtype)
    grid = F.affine_grid(theta.expand(images.shape[0], 2, 3), list(images.shape), False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _pixels(ds: gdata.Dataset, x: Tensor) -> Tensor:
    """``x`` of ``ds`` as images ``(N, 1, H, W)`` in the data set's pixel units."""
    if ds.x_mean is not None and ds.x_std is not None:
        x = x * ds.x_std.to(x.dtype) + ds.x_mean.to(x.dtype)
    side = round(x[0].numel() ** 0.5)
    return x.reshape(-1, 1, side, side)


def _inputs(ds: gdata.Dataset, images: Tensor, like: Tensor) -> Tensor:
    """Pixel ``images`` back into ``ds``'s input space (standardised, shaped like ``like``)."""
    x = images.reshape(images.shape[0], *like.shape[1:]).to(like.dtype)
    if ds.x_mean is not None and ds.x_std is not None:
        x = (x - ds.x_mean.to(x.dtype)) / ds.x_std.to(x.dtype)
    return x


def evaluation_sets(ds: gdata.Dataset, seed: int = 0) -> EvaluationSets:
    """The shifted test sets and the OOD set of ``ds`` (see the module docstring); the OOD set
    has as many inputs as the test set (fewer if its source has fewer)."""
    gen = torch.Generator().manual_seed(seed)
    x_test = ds.x_test
    n = x_test.shape[0]
    if ds.name in _IMAGE_OOD:
        pixels = _pixels(ds, x_test)
        shifted = tuple(_inputs(ds, rotate_images(pixels, a), x_test) for a in IMAGE_ANGLES)
        other = gdata.load(_IMAGE_OOD[ds.name], seed=seed)
        pick = torch.randperm(other.x_test.shape[0], generator=gen)[:n]
        ood_pixels = other.x_test[pick].reshape(-1, 1, 28, 28).to(x_test.dtype)
        side = pixels.shape[-1]
        if side != 28:  # digits: average down to 8 x 8 and rescale [0, 1] to the 0..16 range
            ood_pixels = F.adaptive_avg_pool2d(ood_pixels, side) * 16.0
        ood_name = f"{other.name} test images" + (
            f" averaged to {side} x {side}, scaled to 0..16" if side != 28 else ""
        )
        return EvaluationSets(
            shift="test images rotated",
            strength_name="degrees",
            strengths=IMAGE_ANGLES,
            shifted=shifted,
            ood_name=ood_name,
            ood=_inputs(ds, ood_pixels, x_test),
        )
    shifted = tuple(
        x_test + s * torch.randn(x_test.shape, generator=gen, dtype=x_test.dtype)
        for s in TABULAR_NOISE
    )
    columns = [x_test[torch.randperm(n, generator=gen), j] for j in range(x_test.shape[1])]
    return EvaluationSets(
        shift="Gaussian noise added to the standardised test inputs",
        strength_name="noise std",
        strengths=TABULAR_NOISE,
        shifted=shifted,
        ood_name="test inputs with every feature permuted independently across rows",
        ood=torch.stack(columns, dim=1),
    )


def evaluate(
    probs_test: Tensor,
    probs_shifted: list[Tensor],
    probs_ood: Tensor,
    y_test: Tensor,
) -> dict[str, object]:
    """One method's numbers: ``in_distribution`` and ``shifted`` (all strengths pooled) as
    ``{"acc", "nll", "ece", "brier"}``, ``by_strength`` (a list of those, one per strength),
    and ``ood`` ``{"auroc"}``: the AUROC of telling the OOD inputs from the test inputs by
    the predictive entropy (``metrics.ood_auroc``)."""

    def row(p: Tensor, y: Tensor) -> dict[str, float]:
        m = metrics.classification_metrics(p, y)
        return {k: m[k] for k in METRICS}

    pooled = torch.cat(probs_shifted)
    y_pooled = y_test.repeat(len(probs_shifted))
    return {
        "in_distribution": row(probs_test, y_test),
        "shifted": row(pooled, y_pooled),
        "by_strength": [row(p, y_test) for p in probs_shifted],
        "ood": {"auroc": metrics.ood_auroc(probs_test, probs_ood)},
    }
