"""Evaluation metrics for classification and regression predictives.

Pure functions over tensors; every scalar metric returns a Python ``float``. Classification metrics
take ``probs (N, C)`` (rows on the simplex; a 1-D ``(N,)`` tensor is read as binary ``P(y=1)``) and
integer labels ``y (N,)``. Regression metrics take a Gaussian predictive ``mean``/``var`` (or
``std``) and targets ``y`` of shape ``(N,)`` or ``(N, C)``; with ``C`` outputs the per-sample score
is summed over outputs and averaged over ``N``.

Per-sample quantities are computed in the input dtype and averaged in float64, so float32 and
float64 inputs give the same number up to the rounding of the inputs themselves.

References: Guo et al. (2017), *On Calibration of Modern Neural Networks* (ECE/MCE, reliability
diagrams); Gneiting & Raftery (2007), *Strictly Proper Scoring Rules, Prediction, and Estimation*
(Brier score, CRPS, eq. 20-21); Ortega et al. (2024), *Variational Linearized Laplace Approximation
for Bayesian Deep Learning*, Sec. 5.2 eq. (22) and App. F eq. (74) (CQM); Mann & Whitney (1947) /
Hanley & McNeil (1982) for AUROC as a rank statistic.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "ReliabilityDiagram",
    "accuracy",
    "auroc",
    "brier",
    "classification_metrics",
    "cqm",
    "cqm_curve",
    "crps",
    "crps_gaussian",
    "crps_samples",
    "ece",
    "gaussian_nll",
    "mce",
    "nll",
    "ood_auroc",
    "predictive_entropy",
    "regression_metrics",
    "reliability_diagram",
    "rmse",
]

# Rows of ``probs`` must sum to one within this tolerance: loose enough for float32 softmax
# outputs over thousands of classes, tight enough to catch logits passed by mistake.
ROW_SUM_TOL = 1e-4


# --------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------


def _require_tensor(x: object, name: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def _require_float(x: Tensor, name: str) -> None:
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")


def _require_finite(x: Tensor, name: str) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name}: all entries must be finite (found NaN or inf)")


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _check_probs(probs: Tensor, name: str = "probs") -> Tensor:
    """Validate class probabilities and return them as an ``(N, C)`` tensor."""
    _require_tensor(probs, name)
    _require_float(probs, name)
    if probs.dim() == 1:
        # Binary given as P(y=1): expand to the two-column form every metric below expects.
        _require_finite(probs, name)
        if bool((probs < 0).any()) or bool((probs > 1).any()):
            raise ValueError(f"{name}: 1-D binary probabilities P(y=1) must lie in [0, 1]")
        probs = torch.stack([1 - probs, probs], dim=-1)
    elif probs.dim() != 2:
        raise ValueError(f"{name}: expected shape (N, C) or binary (N,), got {tuple(probs.shape)}")
    n, c = probs.shape
    if n == 0:
        raise ValueError(f"{name}: need at least one sample, got N = 0")
    if c < 2:
        raise ValueError(
            f"{name}: need at least 2 classes (columns), got {c}; "
            "give binary problems as P(y=1) of shape (N,) or as (N, 2)"
        )
    _require_finite(probs, name)
    if bool((probs < 0).any()):
        raise ValueError(f"{name}: probabilities must be non-negative, got min {probs.min():.3g}")
    deviation = float((probs.sum(dim=1) - 1).abs().max())
    if deviation > ROW_SUM_TOL:
        raise ValueError(
            f"{name}: rows must sum to 1 within {ROW_SUM_TOL:g} (did you pass logits?), "
            f"got max deviation {deviation:.3g}"
        )
    return probs


def _check_labels(y: Tensor, n: int, num_classes: int, name: str = "y") -> Tensor:
    """Validate integer class labels ``(N,)`` in ``[0, num_classes)`` and return them as int64."""
    _require_tensor(y, name)
    if not _is_integer_dtype(y.dtype):
        raise ValueError(f"{name}: labels must be an integer tensor, got dtype {y.dtype}")
    if y.dim() != 1:
        raise ValueError(f"{name}: labels must have shape (N,), got {tuple(y.shape)}")
    if y.shape[0] != n:
        raise ValueError(f"{name}: expected {n} labels to match probs, got {y.shape[0]}")
    lo, hi = int(y.min()), int(y.max())
    if lo < 0:
        raise ValueError(f"{name}: labels must be in [0, {num_classes}), got min {lo}")
    if hi >= num_classes:
        raise ValueError(f"{name}: labels must be in [0, {num_classes}), got max {hi}")
    return y.long()


def _check_num_bins(num_bins: int) -> None:
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins: must be a positive int, got {num_bins!r}")


def _check_regression(
    mean: Tensor, y: Tensor, scale: Tensor | None = None, scale_name: str = "var"
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Validate a regression predictive; return ``mean, y, scale`` in one common float dtype."""
    _require_tensor(mean, "mean")
    _require_float(mean, "mean")
    if mean.dim() not in (1, 2):
        raise ValueError(f"mean: expected shape (N,) or (N, C), got {tuple(mean.shape)}")
    if mean.shape[0] == 0:
        raise ValueError("mean: need at least one sample, got N = 0")
    _require_finite(mean, "mean")
    _require_tensor(y, "y")
    if y.shape != mean.shape:
        raise ValueError(f"y: shape must equal mean's {tuple(mean.shape)}, got {tuple(y.shape)}")
    if y.dtype == torch.bool or y.is_complex():
        raise ValueError(f"y: expected real-valued targets, got dtype {y.dtype}")
    _require_finite(y, "y")
    dtype = torch.promote_types(mean.dtype, y.dtype)
    if scale is not None:
        _require_tensor(scale, scale_name)
        _require_float(scale, scale_name)
        if scale.shape != mean.shape:
            raise ValueError(
                f"{scale_name}: shape must equal mean's {tuple(mean.shape)}, "
                f"got {tuple(scale.shape)}"
            )
        _require_finite(scale, scale_name)
        if bool((scale <= 0).any()):
            raise ValueError(f"{scale_name}: must be > 0, got min {scale.min():.3g}")
        dtype = torch.promote_types(dtype, scale.dtype)
        scale = scale.to(dtype)
    return mean.to(dtype), y.to(dtype), scale


def _per_sample(x: Tensor) -> Tensor:
    """Sum a per-entry score over outputs: ``(N,)`` stays, ``(N, C)`` -> ``(N,)``."""
    return x if x.dim() == 1 else x.sum(dim=-1)


def _mean64(x: Tensor) -> float:
    return float(x.double().mean())


# --------------------------------------------------------------------------------------------
# classification
# --------------------------------------------------------------------------------------------


def nll(probs: Tensor, y: Tensor) -> float:
    """Mean negative log-likelihood ``-1/N sum_n log p_n[y_n]`` of a categorical predictive.

    ``probs (N, C)`` (or binary ``P(y=1)`` of shape ``(N,)``), ``y (N,)`` integer labels. The
    probability of the true class is clamped from below at ``torch.finfo(probs.dtype).tiny`` so a
    hard zero gives a large finite penalty (about 87.3 in float32, 708.4 in float64) instead of
    ``inf``; only exact zeros and subnormals are affected. Equals scikit-learn's ``log_loss`` away
    from that clamp (which sklearn places at the dtype's machine epsilon instead).
    """
    p = _check_probs(probs)
    labels = _check_labels(y, p.shape[0], p.shape[1])
    p_true = p.gather(1, labels[:, None]).squeeze(1)
    return _mean64(-torch.log(p_true.clamp_min(torch.finfo(p.dtype).tiny)))


def accuracy(probs: Tensor, y: Tensor) -> float:
    """Fraction of samples whose arg-max class equals the label (ties: lowest class index).

    ``probs (N, C)`` (or binary ``(N,)``), ``y (N,)``.
    """
    p = _check_probs(probs)
    labels = _check_labels(y, p.shape[0], p.shape[1])
    return _mean64(p.argmax(dim=1) == labels)


def brier(probs: Tensor, y: Tensor) -> float:
    """Multi-class Brier score ``1/N sum_n sum_c (p_nc - 1[y_n = c])^2`` (Brier 1950; range [0, 2]).

    ``probs (N, C)`` (or binary ``(N,)``), ``y (N,)``. This is the original multi-class definition
    (Gneiting & Raftery 2007, Sec. 3.2, the quadratic score up to sign and constant). For binary
    problems scikit-learn's ``brier_score_loss(y, p1)`` scores only the positive class,
    ``1/N sum_n (p1_n - y_n)^2``, which equals this value divided by 2 (the negative class adds an
    identical squared error); ``brier_score_loss(..., scale_by_half=False)`` matches it exactly.
    """
    p = _check_probs(probs)
    labels = _check_labels(y, p.shape[0], p.shape[1])
    onehot = torch.nn.functional.one_hot(labels, p.shape[1]).to(p.dtype)
    return _mean64(((p - onehot) ** 2).sum(dim=1))


def predictive_entropy(probs: Tensor) -> Tensor:
    """Shannon entropy ``H[p_n] = -sum_c p_nc log p_nc`` of each predictive, in nats.

    ``probs (N, C)`` (or binary ``(N,)``) -> tensor ``(N,)`` in the probs' dtype, with the
    convention ``0 log 0 = 0``. Used as the OOD score of ``ood_auroc`` (VaLLA paper, Sec. 5.3,
    OOD-AUC).
    """
    p = _check_probs(probs)
    return -torch.special.xlogy(p, p).sum(dim=1)


class ReliabilityDiagram(NamedTuple):
    """Binned top-label calibration statistics (Guo et al. 2017, Sec. 2), ready for plotting.

    ``edges (B+1,)`` equal-width bin edges on [0, 1]; bin ``b`` holds confidences in
    ``(edges[b], edges[b+1]]`` (bin 0 also holds 0). ``confidence (B,)`` and ``accuracy (B,)`` are
    the mean top-label confidence and accuracy in each bin (float64, NaN for empty bins);
    ``counts (B,)`` the number of samples per bin (int64, sums to N).
    """

    edges: Tensor
    confidence: Tensor
    accuracy: Tensor
    counts: Tensor


def reliability_diagram(probs: Tensor, y: Tensor, num_bins: int = 15) -> ReliabilityDiagram:
    """Bin samples by top-label confidence ``max_c p_nc`` into ``num_bins`` equal-width bins.

    ``probs (N, C)`` (or binary ``(N,)``), ``y (N,)``. Returns edges, per-bin mean confidence
    ``conf(B_b)``, accuracy ``acc(B_b)`` and counts ``|B_b|`` as defined in Guo et al. (2017),
    Sec. 2 (eq. for acc(B_m) and conf(B_m)); ``ece`` and ``mce`` are functions of this result.
    Confidences are compared with edges in the probs' dtype, so a confidence lying exactly on an
    edge goes to the lower bin.
    """
    _check_num_bins(num_bins)
    p = _check_probs(probs)
    labels = _check_labels(y, p.shape[0], p.shape[1])
    conf, pred = p.max(dim=1)
    edges = torch.linspace(0.0, 1.0, num_bins + 1, dtype=p.dtype, device=p.device)
    # right=False puts x into bin i with inner_edges[i-1] < x <= inner_edges[i]: (lower, upper].
    idx = torch.bucketize(conf, edges[1:-1], right=False)
    counts = torch.bincount(idx, minlength=num_bins)
    conf_sum = torch.zeros(num_bins, dtype=torch.float64, device=p.device)
    conf_sum.index_add_(0, idx, conf.double())
    acc_sum = torch.zeros(num_bins, dtype=torch.float64, device=p.device)
    acc_sum.index_add_(0, idx, (pred == labels).double())
    nonempty = counts > 0
    denom = counts.clamp_min(1).double()
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=p.device)
    return ReliabilityDiagram(
        edges=edges,
        confidence=torch.where(nonempty, conf_sum / denom, nan),
        accuracy=torch.where(nonempty, acc_sum / denom, nan),
        counts=counts,
    )


def _calibration_gaps(diagram: ReliabilityDiagram) -> tuple[Tensor, Tensor]:
    """Per-bin ``|acc - conf|`` and weights ``|B_b| / N`` over non-empty bins (float64)."""
    nonempty = diagram.counts > 0
    gaps = (diagram.accuracy - diagram.confidence).abs()[nonempty]
    weights = diagram.counts[nonempty].double() / diagram.counts.sum().double()
    return gaps, weights


def ece(probs: Tensor, y: Tensor, num_bins: int = 15) -> float:
    """Expected calibration error ``ECE = sum_b |B_b|/N |acc(B_b) - conf(B_b)|``.

    Top-label confidence, ``num_bins`` equal-width bins on [0, 1] (Guo et al. 2017, eq. 3; Naeini
    et al. 2015). ``probs (N, C)`` (or binary ``(N,)``), ``y (N,)``. See ``reliability_diagram`` for
    the binning convention.
    """
    gaps, weights = _calibration_gaps(reliability_diagram(probs, y, num_bins))
    return float((weights * gaps).sum())


def mce(probs: Tensor, y: Tensor, num_bins: int = 15) -> float:
    """Maximum calibration error ``MCE = max_b |acc(B_b) - conf(B_b)|`` over non-empty bins.

    Guo et al. (2017), eq. 5, with the same binning as ``ece``. ``probs (N, C)``, ``y (N,)``.
    """
    gaps, _ = _calibration_gaps(reliability_diagram(probs, y, num_bins))
    return float(gaps.max())


def auroc(scores: Tensor, labels: Tensor) -> float:
    """Area under the ROC curve via the Mann-Whitney U statistic, ties counted as 1/2.

    ``AUROC = (R_+ - n_+ (n_+ + 1) / 2) / (n_+ n_-)`` where ``R_+`` is the sum of the (average,
    for ties) ranks of the positive samples among all scores (Hanley & McNeil 1982, eq. 2 ff.).
    Equals the probability that a random positive scores above a random negative, plus half the
    probability of a tie, i.e. scikit-learn's ``roc_auc_score``. ``scores (N,)`` real, higher
    means more positive; ``labels (N,)`` bool or integer in {0, 1} with both classes present.
    Cost O(N log N).
    """
    _require_tensor(scores, "scores")
    if scores.dim() != 1:
        raise ValueError(f"scores: expected shape (N,), got {tuple(scores.shape)}")
    if scores.dtype == torch.bool or scores.is_complex():
        raise ValueError(f"scores: expected real-valued scores, got dtype {scores.dtype}")
    _require_finite(scores, "scores")
    _require_tensor(labels, "labels")
    if labels.shape != scores.shape:
        raise ValueError(
            f"labels: shape must equal scores' {tuple(scores.shape)}, got {tuple(labels.shape)}"
        )
    if not (labels.dtype == torch.bool or _is_integer_dtype(labels.dtype)):
        raise ValueError(f"labels: expected bool or integer 0/1 labels, got dtype {labels.dtype}")
    if labels.dtype != torch.bool and bool(((labels != 0) & (labels != 1)).any()):
        raise ValueError("labels: binary labels must be 0 or 1")
    positive = labels.bool()
    n_pos = int(positive.sum())
    n_neg = positive.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(
            f"labels: need both classes present, got {n_pos} positives and {n_neg} negatives"
        )
    sorted_scores, order = torch.sort(scores.double())
    _, group, counts = torch.unique_consecutive(
        sorted_scores, return_inverse=True, return_counts=True
    )
    # 1-based rank of each tie group's last member, minus half the group's extent: average rank.
    last = counts.cumsum(0).double()
    average_rank = last - (counts.double() - 1) / 2
    ranks = torch.empty_like(sorted_scores)
    ranks[order] = average_rank[group]
    u = ranks[positive].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


def ood_auroc(probs_in: Tensor, probs_out: Tensor) -> float:
    """AUROC of telling out-of-distribution from in-distribution inputs by predictive entropy.

    OOD samples are the positive class and a higher entropy ``H[p]`` means "more OOD" (VaLLA paper,
    Sec. 5.3, OOD-AUC; Hendrycks & Gimpel 2017). ``probs_in (N_in, C)``, ``probs_out (N_out, C)``
    from the same model (same ``C``). Computed by ``auroc``.
    """
    p_in = _check_probs(probs_in, "probs_in")
    p_out = _check_probs(probs_out, "probs_out")
    if p_out.shape[1] != p_in.shape[1]:
        raise ValueError(
            f"probs_out: must have the same number of classes as probs_in ({p_in.shape[1]}), "
            f"got {p_out.shape[1]}"
        )
    scores = torch.cat([predictive_entropy(p_in), predictive_entropy(p_out)])
    labels = torch.cat(
        [
            torch.zeros(p_in.shape[0], dtype=torch.bool, device=scores.device),
            torch.ones(p_out.shape[0], dtype=torch.bool, device=scores.device),
        ]
    )
    return auroc(scores, labels)


def classification_metrics(probs: Tensor, y: Tensor, num_bins: int = 15) -> dict[str, float]:
    """All standard classification metrics at once: ``{"acc", "nll", "ece", "mce", "brier"}``.

    ``probs (N, C)`` (or binary ``(N,)``), ``y (N,)``; see the individual functions.
    """
    return {
        "acc": accuracy(probs, y),
        "nll": nll(probs, y),
        "ece": ece(probs, y, num_bins),
        "mce": mce(probs, y, num_bins),
        "brier": brier(probs, y),
    }


# --------------------------------------------------------------------------------------------
# regression
# --------------------------------------------------------------------------------------------


def gaussian_nll(mean: Tensor, var: Tensor, y: Tensor) -> float:
    """Mean Gaussian negative log-likelihood ``1/N sum_n sum_c -log N(y_nc | mean_nc, var_nc)``.

    ``-log N(y | m, v) = 0.5 [log(2 pi v) + (y - m)^2 / v]``; ``var`` is the full predictive
    variance (epistemic plus observation noise). Shapes ``(N,)`` or ``(N, C)``, all equal; ``var``
    must be > 0. Summed over outputs, averaged over samples.
    """
    mean, y, var = _check_regression(mean, y, var, "var")
    per_entry = 0.5 * (math.log(2 * math.pi) + torch.log(var) + (y - mean) ** 2 / var)
    return _mean64(_per_sample(per_entry))


def rmse(mean: Tensor, y: Tensor) -> float:
    """Root mean squared error ``sqrt(1/(N C) sum_nc (mean_nc - y_nc)^2)`` over all entries.

    Shapes ``(N,)`` or ``(N, C)``, equal.
    """
    mean, y, _ = _check_regression(mean, y)
    return math.sqrt(_mean64((mean - y) ** 2))


def _crps_gaussian_entries(mean: Tensor, std: Tensor, y: Tensor) -> Tensor:
    z = (y - mean) / std
    pdf = torch.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)
    cdf = torch.special.ndtr(z)
    return std * (z * (2 * cdf - 1) + 2 * pdf - 1 / math.sqrt(math.pi))


def crps_gaussian(mean: Tensor, std: Tensor, y: Tensor) -> float:
    """Closed-form CRPS of a Gaussian predictive, averaged over samples (lower is better).

    ``CRPS(N(m, s^2), y) = s [z (2 Phi(z) - 1) + 2 phi(z) - 1 / sqrt(pi)]`` with ``z = (y - m)/s``
    (Gneiting & Raftery 2007, eq. 21; the general definition is eq. 20,
    ``CRPS(F, y) = int (F(x) - 1[x >= y])^2 dx``). Takes the standard deviation ``std``, not the
    variance. Shapes ``(N,)`` or ``(N, C)``, all equal; summed over outputs, averaged over samples.
    """
    mean, y, std = _check_regression(mean, y, std, "std")
    return _mean64(_per_sample(_crps_gaussian_entries(mean, std, y)))


def crps(mean: Tensor, std: Tensor, y: Tensor) -> float:
    """Alias of ``crps_gaussian`` (the name used in DESIGN.md's API table)."""
    return crps_gaussian(mean, std, y)


def crps_samples(
    samples: Tensor, y: Tensor, estimator: Literal["fair", "plugin"] = "fair"
) -> float:
    """Sample estimate of the CRPS, ``E|X - y| - 1/2 E|X - X'|``, averaged over data points.

    Gneiting & Raftery (2007), eq. 21 (energy form of the CRPS), with both expectations replaced
    by averages over the ``S`` samples. The pairwise term is computed exactly in O(S log S) with
    the sorted-sample identity ``sum_{i,j} |x_i - x_j| = 2 sum_i (2i - S - 1) x_(i)``. With
    ``estimator="fair"`` (default) it is divided by ``S (S - 1)`` (unbiased U-statistic over
    distinct pairs, the "fair" CRPS of Ferro 2014); ``"plugin"`` divides by ``S^2`` (the CRPS of
    the empirical distribution, biased by ``E|X - X'| / (2S)``). ``samples (S, N)`` with
    ``y (N,)``, or ``samples (S, N, C)`` with ``y (N, C)`` (summed over outputs). Computed in
    float64 because the weighted sum cancels heavily for large ``S``.
    """
    _require_tensor(samples, "samples")
    _require_float(samples, "samples")
    _require_tensor(y, "y")
    if y.dim() not in (1, 2) or y.shape[0] == 0:
        raise ValueError(f"y: expected shape (N,) or (N, C) with N > 0, got {tuple(y.shape)}")
    if samples.dim() != y.dim() + 1 or samples.shape[1:] != y.shape:
        raise ValueError(
            f"samples: expected shape (S, *y.shape) = (S, {', '.join(map(str, y.shape))}), "
            f"got {tuple(samples.shape)}"
        )
    if estimator not in ("fair", "plugin"):
        raise ValueError(f"estimator: must be 'fair' or 'plugin', got {estimator!r}")
    num = samples.shape[0]
    if num < 2:
        raise ValueError(f"samples: need at least 2 samples (S >= 2), got S = {num}")
    _require_finite(samples, "samples")
    if y.dtype == torch.bool or y.is_complex():
        raise ValueError(f"y: expected real-valued targets, got dtype {y.dtype}")
    _require_finite(y, "y")
    x = samples.double()
    abs_error = (x - y.double()).abs().mean(dim=0)
    x_sorted, _ = torch.sort(x, dim=0)
    weights = 2 * torch.arange(1, num + 1, dtype=torch.float64, device=x.device) - num - 1
    weights = weights.reshape(-1, *([1] * y.dim()))
    pair_sum = 2 * (weights * x_sorted).sum(dim=0)
    pair_mean = pair_sum / (num * (num - 1) if estimator == "fair" else num * num)
    return float(_per_sample(abs_error - 0.5 * pair_mean).mean())


def _centered_levels(mean: Tensor, std: Tensor, y: Tensor) -> Tensor:
    """Smallest centred-interval mass that contains each target: ``u = 2 Phi(|z|) - 1`` (flat).

    ``y`` lies in the open interval of mass ``alpha`` iff ``|z| < Phi^-1((1 + alpha) / 2)``, i.e.
    iff ``u < alpha``; under a calibrated predictive ``u ~ Uniform(0, 1)``.
    """
    z = ((y - mean) / std).double()
    return torch.erf(z.abs() / math.sqrt(2)).flatten()


def cqm_curve(mean: Tensor, std: Tensor, y: Tensor, alphas: Tensor) -> Tensor:
    """Empirical coverage ``m(alpha)`` of the centred Gaussian intervals, for each ``alpha``.

    VaLLA paper, Sec. 5.2 and App. F: ``m(alpha) = 1/N sum_n 1[y_n in (mean_n - d_n, mean_n +
    d_n)]`` with ``d_n = std_n Phi^-1((1 + alpha) / 2)``, the open interval around the mean holding
    probability mass ``alpha`` (so ``m(1) = 1``). A calibrated predictive has ``m(alpha) ~ alpha``;
    values above the diagonal mean over-estimated variance. Shapes of ``mean, std, y``: ``(N,)``
    or ``(N, C)`` (every entry counts as one point); ``alphas (K,)`` in [0, 1]. Returns
    ``(K,)`` float64, the curve plotted in the paper's Figures 2 (right) and 8.
    """
    mean, y, std = _check_regression(mean, y, std, "std")
    _require_tensor(alphas, "alphas")
    if alphas.dim() != 1 or not alphas.is_floating_point():
        raise ValueError(f"alphas: expected a 1-D float tensor, got {alphas.dtype} {alphas.shape}")
    if not bool(((alphas >= 0) & (alphas <= 1)).all()):
        raise ValueError("alphas: all levels must lie in [0, 1]")
    levels, _ = torch.sort(_centered_levels(mean, std, y))
    a = alphas.double().to(levels.device)
    # side="left" counts levels strictly below alpha: the open interval excludes its end points.
    inside = torch.searchsorted(levels, a, side="left").double() / levels.numel()
    # The alpha = 1 interval is the whole real line; guard against erf rounding to 1 for |z| > 8.
    return torch.where(a >= 1, torch.ones_like(inside), inside)


def cqm(mean: Tensor, std: Tensor, y: Tensor, num_points: int | None = None) -> float:
    """Centered quantile metric ``CQM = int_0^1 |m(alpha) - alpha| d alpha`` (lower is better).

    VaLLA paper (Ortega et al. 2024), Sec. 5.2 eq. (22) and App. F eq. (74): for a Gaussian
    predictive ``N(mean_n, std_n^2)`` the open centred interval of mass ``alpha`` is
    ``(mean_n - d_n, mean_n + d_n)``, ``d_n = std_n Phi^-1((1 + alpha) / 2)``; ``m(alpha)`` is the
    fraction of targets inside it (``cqm_curve``) and CQM is the area between the curve and the
    diagonal. It lies in [0, 1/2]: 0 for perfect calibration, 1/2 when every target sits exactly
    on its mean (infinitely over-estimated variance) or when the variance tends to zero.

    With ``num_points=None`` (default) the integral is exact: ``m`` is the empirical CDF of
    ``u_n = 2 Phi(|z_n|) - 1``, a step function, so CQM is the Wasserstein-1 distance between the
    ``u_n`` and Uniform(0, 1), summed segment by segment. With an integer ``num_points >= 2`` it
    uses the trapezoid rule on ``num_points`` equally spaced levels in [0, 1], as the paper does
    (the authors' code used 11 levels 0, 0.1, ..., 1). Shapes ``(N,)`` or ``(N, C)`` (every entry
    counts as one point); ``std`` > 0.
    """
    if num_points is not None and (
        isinstance(num_points, bool) or not isinstance(num_points, int) or num_points < 2
    ):
        raise ValueError(f"num_points: must be None (exact) or an int >= 2, got {num_points!r}")
    mean, y, std = _check_regression(mean, y, std, "std")
    if num_points is not None:
        alphas = torch.linspace(0.0, 1.0, num_points, dtype=torch.float64, device=mean.device)
        gap = (cqm_curve(mean, std, y, alphas) - alphas).abs()
        return float(torch.trapezoid(gap, alphas))
    levels, _ = torch.sort(_centered_levels(mean, std, y))
    m = levels.numel()
    zero = levels.new_zeros(1)
    lower = torch.cat([zero, levels])  # segment k is [u_(k), u_(k+1)), with u_(0)=0, u_(M+1)=1
    upper = torch.cat([levels, zero + 1])
    height = torch.arange(m + 1, dtype=torch.float64, device=levels.device) / m
    # int_a^b |alpha - c| d alpha = ((b - c)|b - c| - (a - c)|a - c|) / 2 for any a <= b, c.
    area = (upper - height) * (upper - height).abs() - (lower - height) * (lower - height).abs()
    return float(area.sum() / 2)


def regression_metrics(mean: Tensor, var: Tensor, y: Tensor) -> dict[str, float]:
    """All standard regression metrics at once: ``{"rmse", "nll", "crps", "cqm"}``.

    ``mean``, ``var`` (full predictive variance, > 0) and ``y`` of shape ``(N,)`` or ``(N, C)``.
    NLL is ``gaussian_nll``, CRPS the Gaussian closed form with ``std = sqrt(var)`` and CQM the
    exact-integral centered quantile metric of the VaLLA paper.
    """
    mean_c, y_c, var_c = _check_regression(mean, y, var, "var")
    std = var_c.sqrt()
    return {
        "rmse": rmse(mean_c, y_c),
        "nll": gaussian_nll(mean_c, var_c, y_c),
        "crps": crps_gaussian(mean_c, std, y_c),
        "cqm": cqm(mean_c, std, y_c),
    }
