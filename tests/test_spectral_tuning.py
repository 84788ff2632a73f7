"""Closed-form (spectral) prior tuning equals the dense evidence and the autograd path.

Oracle: ``Laplace.log_marginal_likelihood`` (dense log det / solve of A = s G + P0 through the
structure's posterior, thesis eq. 3.17-3.18 with the Thm 3.3 correction) and its autograd
gradient. The spectral evidence (gaussify.spectral: log det A = sum log(s lambda + delta),
correction from V^T g and V^T theta) must equal it to 1e-10 in float64 for full, kron (several
blocks, one prior per layer) and diag, for classification and for regression with the noise;
the tuned hyperparameters must equal those of the autograd path (same Adam) and a fine grid's
argmax.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import gaussify as gs

DT = torch.float64


def _model(outputs: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, outputs)
    ).double()


def _data(task: str, n: int = 40, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=DT)
    if task == "classification":
        return x, torch.randint(0, 3, (n,), generator=g)
    return x, torch.sin(x[:, :2]) + 0.1 * torch.randn(n, 2, generator=g, dtype=DT)


def _laplace(task: str, structure: str, trained: bool = False, **options: object) -> gs.Laplace:
    model = _model(3 if task == "classification" else 2)
    x, y = _data(task)
    if trained:  # near a MAP, where the evidence has an interior optimum in the prior
        gs.train_map(model, (x, y), task, prior_precision=0.7, epochs=300, lr=1e-2, seed=0)
    sigma = 0.4 if task == "regression" else 1.0  # only regression has observation noise
    la = gs.Laplace(model, task, structure, prior_precision=0.7, sigma_noise=sigma, **options)
    return la.fit((x, y))


def _num_groups(la: gs.Laplace, granularity: str) -> int:
    return {"scalar": 1, "layer": len(la.subset.names), "diag": la.subset.num_params}[granularity]


def _dense(
    la: gs.Laplace, granularity: str, log_prior: torch.Tensor, log_sigma: float | None
) -> tuple[float, np.ndarray, float]:
    """(log Z, d/d log prior, d/d log sigma) from the dense path with autograd."""
    lp = log_prior.clone().requires_grad_(True)
    ls = torch.tensor(0.0 if log_sigma is None else log_sigma, dtype=DT, requires_grad=True)
    prior = lp.exp().squeeze(0) if granularity == "scalar" else lp.exp()
    sigma = ls.exp() if log_sigma is not None else None
    value = la.log_marginal_likelihood(prior, sigma)
    value.backward()
    return float(value.detach()), lp.grad.numpy(), float(ls.grad) if log_sigma is not None else 0.0


CASES = [
    # (task, structure, options, granularity, correction)
    ("classification", "full", {}, "scalar", True),
    ("classification", "full", {"correction": False}, "scalar", False),
    ("classification", "kron", {"kron_bias": "separate"}, "layer", False),
    ("classification", "kron", {"kron_bias": "separate", "correction": True}, "layer", True),
    ("classification", "kron", {}, "scalar", False),
    ("classification", "diag", {}, "diag", False),
    ("classification", "diag", {"correction": True}, "layer", True),
    ("regression", "full", {}, "scalar", True),
    ("regression", "kron", {"kron_bias": "separate", "correction": True}, "layer", True),
    ("regression", "kron", {}, "scalar", False),
    ("regression", "diag", {"correction": True}, "diag", True),
    # tempered posterior and a non-zero prior mean (theta - m0 in every prior term)
    ("regression", "full", {"temperature": 0.5, "prior_mean": 0.1}, "scalar", True),
    (
        "classification",
        "kron",
        {"kron_bias": "separate", "temperature": 2.0, "prior_mean": -0.2},
        "layer",
        False,
    ),
]


@pytest.mark.parametrize("task, structure, options, granularity, correction", CASES)
def test_spectral_evidence_and_gradient_equal_dense(
    task: str, structure: str, options: dict, granularity: str, correction: bool
) -> None:
    la = _laplace(task, structure, **options)
    assert la.correction is correction
    tune = task == "regression"
    spec = la.spectrum(granularity, tune_noise=tune)  # type: ignore[arg-type]
    assert spec is not None
    assert (spec.grad_proj is not None) is correction
    k = _num_groups(la, granularity)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        log_prior = torch.empty(k, dtype=DT).uniform_(-3, 2, generator=g)
        log_sigma = float(torch.empty(()).uniform_(-2, 1, generator=g)) if tune else None
        value, grad_prior, grad_sigma = spec.evidence(log_prior.numpy(), log_sigma)
        ref_value, ref_prior, ref_sigma = _dense(la, granularity, log_prior, log_sigma)
        assert math.isclose(value, ref_value, rel_tol=1e-10, abs_tol=1e-10)
        np.testing.assert_allclose(grad_prior, ref_prior, rtol=1e-10, atol=1e-10)
        assert math.isclose(grad_sigma, ref_sigma, rel_tol=1e-10, abs_tol=1e-10)


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
def test_spectral_logdet_equals_dense_logdet(structure: str) -> None:
    options = {"kron_bias": "separate"} if structure == "kron" else {}
    la = _laplace("classification", structure, **options)
    granularity = "scalar" if structure == "full" else "layer"
    eigenvalues, groups, _ = la._curvature.spectrum(la._prior_groups(granularity), [])
    k = _num_groups(la, granularity)
    prior = torch.linspace(0.05, 3.0, k, dtype=DT)
    for scale in (0.3, 1.0, 7.0):
        spectral = float((scale * eigenvalues + prior[groups]).log().sum())
        dense = la._curvature.posterior(prior.squeeze(0) if k == 1 else prior, scale)
        ref = float(torch.linalg.slogdet(dense.precision_dense())[1])
        assert math.isclose(spectral, ref, rel_tol=1e-10)


def test_spectrum_none_where_the_prior_does_not_commute_with_the_eigenbasis() -> None:
    assert _laplace("classification", "full").spectrum("layer") is None
    assert _laplace("classification", "full").spectrum("diag") is None
    # joint weight+bias Kronecker blocks: a per-tensor prior gives the bias a rank-one shift
    assert _laplace("classification", "kron").spectrum("layer") is None
    assert _laplace("classification", "kron").spectrum("scalar") is not None
    assert _laplace("classification", "lowrank", rank=5).spectrum("scalar") is None


TUNE_CASES = [
    ("classification", "full", {}, "scalar"),
    ("classification", "full", {"correction": False}, "scalar"),  # the one-prior fast path
    ("classification", "kron", {}, "scalar"),
    ("classification", "kron", {"kron_bias": "separate"}, "layer"),
    ("classification", "diag", {}, "diag"),
    ("regression", "full", {}, "scalar"),
    ("regression", "kron", {"kron_bias": "separate"}, "layer"),
    ("regression", "diag", {"correction": True}, "layer"),
]


@pytest.mark.parametrize("task, structure, options, granularity", TUNE_CASES)
def test_spectral_tuning_equals_autograd_tuning(
    task: str, structure: str, options: dict, granularity: str
) -> None:
    tuned = {}
    for spectral in (True, False):
        la = _laplace(task, structure, **options)
        la._spectral_tuning = spectral
        la.optimize_prior(granularity=granularity, n_steps=150, lr=0.1)  # type: ignore[arg-type]
        tuned[spectral] = (la.prior_precision.clone(), la.sigma_noise.clone())
    torch.testing.assert_close(tuned[True][0], tuned[False][0], rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(tuned[True][1], tuned[False][1], rtol=1e-8, atol=1e-10)
    if task == "regression":
        assert not torch.equal(tuned[True][1], torch.tensor(0.4, dtype=DT))  # noise was tuned


@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
def test_spectral_tuned_scalar_prior_is_the_fine_grid_argmax(structure: str) -> None:
    la = _laplace("classification", structure, trained=True)
    la.optimize_prior(n_steps=1500, lr=0.05)
    tuned = float(la.prior_precision)

    def argmax(grid: torch.Tensor) -> float:
        with torch.no_grad():
            scores = torch.stack([la.log_marginal_likelihood(v) for v in grid])
        return float(grid[int(scores.argmax())])

    coarse = argmax(torch.logspace(-3, 3, 61, dtype=DT))  # log10 spacing 0.1
    fine = torch.logspace(math.log10(coarse) - 0.1, math.log10(coarse) + 0.1, 201, dtype=DT)
    best = argmax(fine)  # log10 spacing 1e-3
    assert abs(math.log10(tuned) - math.log10(best)) <= 1e-3
    # the grid method (spectral scores) picks the same point as the dense scores
    la.optimize_prior(method="grid", grid=fine)
    assert float(la.prior_precision) == best


def test_regression_noise_tuned_spectrally_is_the_joint_grid_argmax() -> None:
    la = _laplace("regression", "full", trained=True)
    la.optimize_prior(n_steps=2000, lr=0.05)
    prior, sigma = float(la.prior_precision), float(la.sigma_noise)
    spec = la.spectrum("scalar", tune_noise=True)
    assert spec is not None
    logs_p = np.log(prior) + np.linspace(-0.05, 0.05, 41)
    logs_s = np.log(sigma) + np.linspace(-0.05, 0.05, 41)
    scores = np.array([[spec.evidence(np.array([a]), b)[0] for b in logs_s] for a in logs_p])
    i, j = np.unravel_index(scores.argmax(), scores.shape)
    assert (i, j) == (20, 20)  # the tuned point is the local grid maximum
    # and the spectral value there is the dense one
    dense = float(la.log_marginal_likelihood(prior, sigma))
    assert math.isclose(scores[20, 20], dense, rel_tol=1e-10)
