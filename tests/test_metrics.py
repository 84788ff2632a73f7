"""Tests for gaussify.metrics against scikit-learn / scipy references and closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats
from sklearn.metrics import accuracy_score, brier_score_loss, log_loss, roc_auc_score

from gaussify import metrics as M

SEEDS = [0, 1, 2, 3, 4]


def random_classification(
    seed: int, n: int = 200, c: int = 4, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(n, c, generator=g, dtype=torch.float64)
    probs = torch.softmax(logits, dim=1).to(dtype)
    y = torch.randint(0, c, (n,), generator=g)
    return probs, y


def random_regression(
    seed: int, shape: tuple[int, ...] = (300,)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(shape, generator=g, dtype=torch.float64)
    var = torch.exp(torch.randn(shape, generator=g, dtype=torch.float64))
    y = mean + 1.5 * torch.randn(shape, generator=g, dtype=torch.float64)
    return mean, var, y


# ------------------------------------------------------------------ classification references


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("c", [2, 3, 10])
def test_nll_accuracy_match_sklearn(seed: int, c: int) -> None:
    probs, y = random_classification(seed, c=c)
    p, t = probs.numpy(), y.numpy()
    assert M.nll(probs, y) == pytest.approx(log_loss(t, p, labels=list(range(c))), abs=1e-6)
    assert M.accuracy(probs, y) == pytest.approx(accuracy_score(t, p.argmax(1)), abs=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_binary_given_as_one_column_matches_two_columns(seed: int) -> None:
    probs, y = random_classification(seed, c=2)
    p1 = probs[:, 1].contiguous()
    assert M.nll(p1, y) == pytest.approx(log_loss(y.numpy(), p1.numpy()), abs=1e-6)
    for fn in (M.nll, M.accuracy, M.brier, M.ece):
        assert fn(p1, y) == pytest.approx(fn(probs, y), abs=1e-12)


def test_nll_clamps_zero_probability_to_finite() -> None:
    probs = torch.tensor([[1.0, 0.0], [0.5, 0.5]], dtype=torch.float64)
    y = torch.tensor([1, 0])
    expected = 0.5 * (-math.log(torch.finfo(torch.float64).tiny) + math.log(2))
    assert M.nll(probs, y) == pytest.approx(expected, rel=1e-12)
    assert math.isfinite(M.nll(probs.float(), y))


@pytest.mark.parametrize("seed", SEEDS)
def test_brier_binary_is_twice_sklearn(seed: int) -> None:
    probs, y = random_classification(seed, c=2)
    p1, t = probs[:, 1].numpy(), y.numpy()
    sk_binary = brier_score_loss(t, p1)  # positive class only
    assert M.brier(probs, y) == pytest.approx(2 * sk_binary, abs=1e-6)
    sk_unscaled = brier_score_loss(t, p1, scale_by_half=False)
    assert M.brier(probs, y) == pytest.approx(sk_unscaled, abs=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("c", [3, 7])
def test_brier_multiclass_matches_numpy_formula(seed: int, c: int) -> None:
    probs, y = random_classification(seed, c=c)
    p, t = probs.numpy(), y.numpy()
    onehot = np.eye(c)[t]
    expected = np.mean(np.sum((p - onehot) ** 2, axis=1))
    assert M.brier(probs, y) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_predictive_entropy_matches_scipy(seed: int) -> None:
    probs, _ = random_classification(seed, c=5)
    h = M.predictive_entropy(probs)
    assert h.shape == (probs.shape[0],)
    np.testing.assert_allclose(h.numpy(), stats.entropy(probs.numpy(), axis=1), atol=1e-10)
    onehot = torch.tensor([[1.0, 0.0, 0.0]])
    assert M.predictive_entropy(onehot).item() == 0.0


@pytest.mark.parametrize("seed", SEEDS)
def test_auroc_matches_sklearn_with_and_without_ties(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (500,), generator=g)
    labels[:2] = torch.tensor([0, 1])
    continuous = torch.randn(500, generator=g, dtype=torch.float64) + 0.7 * labels
    tied = torch.round(continuous * 2) / 2  # heavy ties across both classes
    for scores in (continuous, tied, tied.float()):
        expected = roc_auc_score(labels.numpy(), scores.numpy())
        assert M.auroc(scores, labels) == pytest.approx(expected, abs=1e-6)
        assert M.auroc(scores, labels.bool()) == pytest.approx(expected, abs=1e-6)
    assert M.auroc(torch.ones(6), torch.tensor([0, 1, 0, 1, 1, 0])) == 0.5


@pytest.mark.parametrize("seed", SEEDS)
def test_ood_auroc_matches_sklearn_on_entropy(seed: int) -> None:
    probs_in, _ = random_classification(seed, n=150, c=5)
    g = torch.Generator().manual_seed(100 + seed)
    probs_out = torch.softmax(0.7 * torch.randn(120, 5, generator=g, dtype=torch.float64), 1)
    ent = np.concatenate(
        [stats.entropy(probs_in.numpy(), axis=1), stats.entropy(probs_out.numpy(), axis=1)]
    )
    labels = np.r_[np.zeros(150), np.ones(120)]
    assert M.ood_auroc(probs_in, probs_out) == pytest.approx(roc_auc_score(labels, ent), abs=1e-6)
    # flatter OOD predictives => higher entropy => AUROC well above chance
    assert M.ood_auroc(probs_in, probs_out) > 0.7


# ------------------------------------------------------------------ calibration


def test_ece_mce_hand_computed() -> None:
    probs = torch.tensor(
        [[0.9, 0.05, 0.05], [0.7, 0.2, 0.1], [0.5, 0.3, 0.2], [0.1, 0.85, 0.05]],
        dtype=torch.float64,
    )
    y = torch.tensor([0, 1, 0, 1])
    # 5 bins of width 0.2: confidences .9/.85 -> bin 4 (conf .875, acc 1), .7 -> bin 3 (acc 0),
    # .5 -> bin 2 (acc 1). ECE = .5*.125 + .25*.7 + .25*.5 = .3625, MCE = .7.
    assert M.ece(probs, y, num_bins=5) == pytest.approx(0.3625, abs=1e-12)
    assert M.mce(probs, y, num_bins=5) == pytest.approx(0.7, abs=1e-12)
    diag = M.reliability_diagram(probs, y, num_bins=5)
    assert diag.counts.tolist() == [0, 0, 1, 1, 2]
    np.testing.assert_allclose(diag.confidence[2:].numpy(), [0.5, 0.7, 0.875])
    np.testing.assert_allclose(diag.accuracy[2:].numpy(), [1.0, 0.0, 1.0])
    assert torch.isnan(diag.confidence[:2]).all() and torch.isnan(diag.accuracy[:2]).all()
    np.testing.assert_allclose(diag.edges.numpy(), np.linspace(0, 1, 6))
    # float32 gives the same numbers up to input rounding
    assert M.ece(probs.float(), y, num_bins=5) == pytest.approx(0.3625, abs=1e-6)


def test_confidence_on_bin_edge_goes_to_lower_bin() -> None:
    probs = torch.tensor([[0.6, 0.4], [0.4, 0.6]], dtype=torch.float64)
    diag = M.reliability_diagram(probs, torch.tensor([0, 0]), num_bins=5)
    assert diag.counts.tolist() == [0, 0, 2, 0, 0]  # 0.6 lies in (0.4, 0.6]


def test_ece_near_zero_for_calibrated_and_positive_for_overconfident() -> None:
    g = torch.Generator().manual_seed(0)
    n, c = 200_000, 4
    probs = torch.softmax(1.5 * torch.randn(n, c, generator=g, dtype=torch.float64), dim=1)
    y = torch.multinomial(probs, 1, generator=g).squeeze(1)  # labels drawn from the probs
    # Per-bin |acc - conf| has std <= sqrt(.25/|B|); the count-weighted sum is then at most
    # about sqrt(B/N)/2 ~ 0.004 for 15 bins, so 0.01 is a > 2-sigma-per-bin margin.
    calibrated = M.ece(probs, y)
    assert calibrated < 0.01
    sharpened = torch.softmax(3 * torch.log(probs), dim=1)  # same labels, overconfident probs
    assert M.ece(sharpened, y) > 0.05


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("num_bins", [1, 5, 15, 40])
def test_ece_le_mce_and_diagram_consistent(seed: int, num_bins: int) -> None:
    probs, y = random_classification(seed, n=300, c=3)
    e, m = M.ece(probs, y, num_bins), M.mce(probs, y, num_bins)
    assert 0.0 <= e <= m + 1e-12 <= 1.0 + 1e-12
    diag = M.reliability_diagram(probs, y, num_bins)
    assert int(diag.counts.sum()) == probs.shape[0]
    assert diag.edges.shape == (num_bins + 1,) and diag.counts.shape == (num_bins,)
    full = diag.counts > 0
    gap = (diag.accuracy[full] - diag.confidence[full]).abs()
    weighted = float((diag.counts[full].double() / probs.shape[0] * gap).sum())
    assert weighted == pytest.approx(e, abs=1e-12)
    if num_bins == 1:  # one bin: ECE = |accuracy - mean confidence|
        expected = abs(M.accuracy(probs, y) - float(probs.max(1).values.mean()))
        assert e == pytest.approx(expected, abs=1e-12)


def test_classification_metrics_dict() -> None:
    probs, y = random_classification(0)
    out = M.classification_metrics(probs, y)
    assert set(out) == {"acc", "nll", "ece", "mce", "brier"}
    assert out["nll"] == M.nll(probs, y) and out["ece"] == M.ece(probs, y)
    assert all(isinstance(v, float) for v in out.values())


# ------------------------------------------------------------------ regression


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", [(300,), (100, 3)])
def test_gaussian_nll_and_rmse_match_scipy_numpy(seed: int, shape: tuple[int, ...]) -> None:
    mean, var, y = random_regression(seed, shape)
    m, v, t = mean.numpy(), var.numpy(), y.numpy()
    logpdf = stats.norm.logpdf(t, loc=m, scale=np.sqrt(v))
    expected_nll = -(logpdf if logpdf.ndim == 1 else logpdf.sum(-1)).mean()
    assert M.gaussian_nll(mean, var, y) == pytest.approx(expected_nll, abs=1e-6)
    assert M.rmse(mean, y) == pytest.approx(np.sqrt(np.mean((m - t) ** 2)), abs=1e-6)
    # float32 inputs agree to float32 rounding
    assert M.gaussian_nll(mean.float(), var.float(), y.float()) == pytest.approx(
        expected_nll, abs=1e-5
    )


def _crps_quad(mu: float, sigma: float, y: float) -> float:
    """CRPS(F, y) = int (F(x) - 1[x >= y])^2 dx by adaptive quadrature, split at y."""
    cdf = stats.norm(mu, sigma).cdf
    below, _ = integrate.quad(lambda x: cdf(x) ** 2, -np.inf, y, epsabs=1e-12, epsrel=1e-12)
    above, _ = integrate.quad(lambda x: (1 - cdf(x)) ** 2, y, np.inf, epsabs=1e-12, epsrel=1e-12)
    return below + above


@pytest.mark.parametrize(
    ("mu", "sigma", "y"), [(0.0, 1.0, 0.0), (0.3, 0.5, 1.7), (-2.0, 3.0, 1.0), (1.0, 0.1, 0.95)]
)
def test_crps_gaussian_closed_form_matches_quadrature(mu: float, sigma: float, y: float) -> None:
    t = lambda v: torch.tensor([v], dtype=torch.float64)
    assert M.crps_gaussian(t(mu), t(sigma), t(y)) == pytest.approx(
        _crps_quad(mu, sigma, y), abs=1e-6
    )


def test_crps_gaussian_matches_samples_within_monte_carlo_error() -> None:
    g = torch.Generator().manual_seed(0)
    n, s = 5, 200_000
    mean = torch.randn(n, generator=g, dtype=torch.float64)
    std = 0.3 + torch.rand(n, generator=g, dtype=torch.float64)
    y = mean + 1.2 * torch.randn(n, generator=g, dtype=torch.float64)
    samples = mean + std * torch.randn(s, n, generator=g, dtype=torch.float64)
    # The fair estimator is a U-statistic; its first-order (Hajek) variance is
    # Var[|X - y| - g(X)] / S with g(x) = E|x - X'| = sigma [w(2 Phi(w) - 1) + 2 phi(w)],
    # w = (x - mu) / sigma. Estimate that variance from the samples; mean over n => / n^2.
    w = ((samples - mean) / std).numpy()
    g_x = std.numpy() * (w * (2 * stats.norm.cdf(w) - 1) + 2 * stats.norm.pdf(w))
    h = np.abs(samples.numpy() - y.numpy()) - g_x
    sd = math.sqrt(h.var(axis=0).sum() / s) / n
    closed = M.crps_gaussian(mean, std, y)
    assert sd < 2e-3
    assert abs(M.crps_samples(samples, y) - closed) < 5 * sd
    assert abs(M.crps_samples(samples, y, estimator="plugin") - closed) < 5 * sd


@pytest.mark.parametrize("seed", SEEDS)
def test_crps_samples_sorted_formula_equals_pairwise(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    s, n = 37, 6
    samples = torch.randn(s, n, generator=g, dtype=torch.float64)
    y = torch.randn(n, generator=g, dtype=torch.float64)
    term1 = (samples - y).abs().mean(0)
    pair = (samples[:, None, :] - samples[None, :, :]).abs().sum((0, 1))
    fair = (term1 - 0.5 * pair / (s * (s - 1))).mean()
    plugin = (term1 - 0.5 * pair / s**2).mean()
    assert M.crps_samples(samples, y) == pytest.approx(float(fair), abs=1e-12)
    assert M.crps_samples(samples, y, estimator="plugin") == pytest.approx(float(plugin), abs=1e-12)
    # (S, N, C) with y (N, C): summed over outputs
    samples3 = samples.reshape(s, 3, 2)
    y3 = y.reshape(3, 2)
    per_entry = term1 - 0.5 * pair / (s * (s - 1))
    expected = per_entry.reshape(3, 2).sum(-1).mean()
    assert M.crps_samples(samples3, y3) == pytest.approx(float(expected), abs=1e-12)


def test_crps_multi_output_sums_over_outputs() -> None:
    mean, var, y = random_regression(0, (50, 3))
    std = var.sqrt()
    per_output = [M.crps_gaussian(mean[:, c], std[:, c], y[:, c]) for c in range(3)]
    assert M.crps_gaussian(mean, std, y) == pytest.approx(sum(per_output), abs=1e-12)
    assert M.crps(mean, std, y) == M.crps_gaussian(mean, std, y)


# ------------------------------------------------------------------ CQM (VaLLA eq. 22 / 74)


def _population_cqm(scale: float) -> float:
    """CQM for N -> inf when the predicted std is `scale` times the true one.

    Then z = Z / scale with Z ~ N(0, 1), so m(alpha) = P(|Z| < scale q) = 2 Phi(scale q) - 1,
    q = Phi^-1((1 + alpha) / 2).
    """

    def gap(a: float) -> float:
        return abs(2 * stats.norm.cdf(scale * stats.norm.ppf((1 + a) / 2)) - 1 - a)

    value, _ = integrate.quad(gap, 0, 1, limit=200, epsabs=1e-10)
    return value


def test_cqm_hand_computed_extremes() -> None:
    one = torch.ones(1, dtype=torch.float64)
    # u = 2 Phi(|z|) - 1 = 1/2: m = 0 on [0, 1/2), 1 after => int = 1/8 + 1/8
    y = torch.tensor([stats.norm.ppf(0.75)], dtype=torch.float64)
    assert M.cqm(0 * one, one, y) == pytest.approx(0.25, abs=1e-12)
    # every target on its mean: m(alpha) = 1 for alpha > 0 => CQM = 1/2, the upper bound
    assert M.cqm(torch.zeros(4), torch.ones(4), torch.zeros(4)) == pytest.approx(0.5, abs=1e-12)
    # trapezoid on 11 levels (paper's grid) misses the jump at alpha = 0: 0.5 - 0.05
    assert M.cqm(torch.zeros(4), torch.ones(4), torch.zeros(4), num_points=11) == pytest.approx(
        0.45, abs=1e-12
    )
    # u = .1, .3, .5, .7, .9: staircase m = k/5 on [u_k, u_k+1); area .005 + 4 * .01 + .005
    u = torch.tensor([0.1, 0.3, 0.5, 0.7, 0.9], dtype=torch.float64)
    z = torch.from_numpy(stats.norm.ppf((1 + u.numpy()) / 2))
    assert M.cqm(torch.zeros(5), torch.ones(5), z) == pytest.approx(0.05, abs=1e-12)


@pytest.mark.parametrize("scale", [1.0, 0.5, 2.0])
def test_cqm_matches_population_value(scale: float) -> None:
    g = torch.Generator().manual_seed(1)
    n = 100_000
    mean = torch.randn(n, generator=g, dtype=torch.float64)
    sigma = 0.2 + torch.rand(n, generator=g, dtype=torch.float64)
    y = mean + sigma * torch.randn(n, generator=g, dtype=torch.float64)
    # |CQM_N - CQM_pop| <= sup_alpha |m_N - m| <= eps with prob >= 1 - 2 exp(-2 n eps^2) (DKW);
    # eps below has failure probability 1e-6.
    eps = math.sqrt(math.log(2 / 1e-6) / (2 * n))
    value = M.cqm(mean, scale * sigma, y)
    assert abs(value - _population_cqm(scale)) < eps
    if scale == 1.0:
        assert value < eps  # calibrated: the ideal value 0
    # trapezoid with many levels converges to the exact integral
    assert M.cqm(mean, scale * sigma, y, num_points=2001) == pytest.approx(value, abs=1e-3)


def test_cqm_curve_direction_for_mis_scaled_variance() -> None:
    g = torch.Generator().manual_seed(2)
    n = 50_000
    mean = torch.zeros(n, dtype=torch.float64)
    y = torch.randn(n, generator=g, dtype=torch.float64)
    alphas = torch.linspace(0.1, 0.9, 9, dtype=torch.float64)
    over = M.cqm_curve(mean, 2.0 * torch.ones(n), y, alphas)  # variance over-estimated
    under = M.cqm_curve(mean, 0.5 * torch.ones(n), y, alphas)  # variance under-estimated
    calibrated = M.cqm_curve(mean, torch.ones(n), y, alphas)
    assert (over > alphas).all() and (under < alphas).all()
    assert (calibrated - alphas).abs().max() < 0.01
    ends = M.cqm_curve(mean, torch.ones(n), y, torch.tensor([0.0, 1.0], dtype=torch.float64))
    assert ends.tolist() == [0.0, 1.0]
    # farther from the diagonal with stronger mis-scaling
    c1 = M.cqm(mean, 1.5 * torch.ones(n), y)
    c2 = M.cqm(mean, 3.0 * torch.ones(n), y)
    assert 0.0 < c1 < c2 < 0.5


def test_regression_metrics_dict() -> None:
    mean, var, y = random_regression(0, (40, 2))
    out = M.regression_metrics(mean, var, y)
    assert set(out) == {"rmse", "nll", "crps", "cqm"}
    assert out["nll"] == M.gaussian_nll(mean, var, y)
    assert out["crps"] == M.crps_gaussian(mean, var.sqrt(), y)
    assert out["cqm"] == M.cqm(mean, var.sqrt(), y)


# ------------------------------------------------------------------ validation


def _probs() -> torch.Tensor:
    return torch.full((4, 3), 1 / 3)


BAD_CALLS = [
    (lambda: M.nll(torch.randn(4, 3), torch.zeros(4, dtype=torch.long)), "probs"),
    (lambda: M.nll(torch.full((4, 3, 1), 1 / 3), torch.zeros(4, dtype=torch.long)), "probs"),
    (lambda: M.nll(torch.full((4, 1), 1.0), torch.zeros(4, dtype=torch.long)), "probs"),
    (lambda: M.nll(torch.full((4, 3), float("nan")), torch.zeros(4, dtype=torch.long)), "probs"),
    (lambda: M.nll(_probs(), torch.tensor([0, 1, 2, 12])), r"y: labels must be in \[0, 3\)"),
    (lambda: M.nll(_probs(), torch.tensor([0, -1, 2, 1])), r"y: labels must be in \[0, 3\)"),
    (lambda: M.accuracy(_probs(), torch.zeros(4)), "y"),
    (lambda: M.accuracy(_probs(), torch.zeros(5, dtype=torch.long)), "y"),
    (lambda: M.brier(_probs(), torch.zeros(4, 1, dtype=torch.long)), "y"),
    (lambda: M.ece(_probs(), torch.zeros(4, dtype=torch.long), num_bins=0), "num_bins"),
    (lambda: M.mce(_probs(), torch.zeros(4, dtype=torch.long), num_bins=2.5), "num_bins"),
    (lambda: M.gaussian_nll(torch.zeros(3), torch.tensor([1.0, 0.0, 1.0]), torch.zeros(3)), "var"),
    (lambda: M.gaussian_nll(torch.zeros(3), torch.ones(3), torch.zeros(4)), "y"),
    (lambda: M.gaussian_nll(torch.zeros(3), torch.ones(2), torch.zeros(3)), "var"),
    (lambda: M.rmse(torch.zeros(2, 2, 2), torch.zeros(2, 2, 2)), "mean"),
    (lambda: M.crps_gaussian(torch.zeros(3), -torch.ones(3), torch.zeros(3)), "std"),
    (lambda: M.crps_samples(torch.zeros(10, 4), torch.zeros(3)), "samples"),
    (lambda: M.crps_samples(torch.zeros(1, 3), torch.zeros(3)), "samples"),
    (lambda: M.crps_samples(torch.zeros(5, 3), torch.zeros(3), estimator="x"), "estimator"),
    (lambda: M.cqm(torch.zeros(3), torch.zeros(3), torch.zeros(3)), "std"),
    (lambda: M.cqm(torch.zeros(3), torch.ones(3), torch.zeros(3), num_points=1), "num_points"),
    (lambda: M.auroc(torch.randn(5), torch.ones(5, dtype=torch.long)), "labels"),
    (lambda: M.auroc(torch.randn(5), torch.tensor([0, 1, 2, 0, 1])), "labels"),
    (lambda: M.auroc(torch.randn(5, 1), torch.tensor([0, 1, 1, 0, 1])), "scores"),
    (lambda: M.ood_auroc(_probs(), torch.full((2, 4), 0.25)), "probs_out"),
    (lambda: M.predictive_entropy(torch.full((2, 3), 0.5)), "probs"),
]


@pytest.mark.parametrize(("call", "name"), BAD_CALLS)
def test_bad_input_raises_value_error_naming_argument(call, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        call()


def test_float32_probs_within_row_tolerance_are_accepted() -> None:
    probs, y = random_classification(0, n=1000, c=1000, dtype=torch.float32)
    assert M.nll(probs, y) == pytest.approx(M.nll(probs.double(), y), rel=1e-6)
