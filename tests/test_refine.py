"""GLM mean refinement (thesis eq. 3.12): Newton on the linearised model's log joint."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from torch import nn

import gaussify as gs


def _logistic_data() -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(150, 3))
    y = (x @ np.array([1.0, -2.0, 0.5]) + rng.normal(size=150) > 0).astype(float)
    return torch.from_numpy(x), torch.from_numpy(y)


@pytest.mark.parametrize("structure", ["full", "kron"])
def test_refine_reaches_the_logistic_map_and_its_hessian(structure: str) -> None:
    # A model linear in its parameters is its own linearisation, so the GLM mode is the MAP.
    x, y = _logistic_data()
    delta = 2.0
    ref = LogisticRegression(C=1 / delta, fit_intercept=False, tol=1e-12, max_iter=10_000)
    ref.fit(x.numpy(), y.numpy())
    model = nn.Linear(3, 1, bias=False).double()
    with torch.no_grad():
        model.weight.fill_(0.1)  # far from the MAP
    la = gs.Laplace(model, "binary", structure, prior_precision=delta).fit((x, y))
    la.refine((x, y))
    np.testing.assert_allclose(la.mean.numpy(), ref.coef_[0], atol=1e-6)
    if structure == "full":
        _assert_logistic_hessian(la, x, delta)
    # the linearisation point is unchanged, so the network itself was not touched
    torch.testing.assert_close(model.weight.detach()[0], torch.full((3,), 0.1, dtype=x.dtype))


def _assert_logistic_hessian(la: gs.Laplace, x: torch.Tensor, delta: float) -> None:
    p = torch.sigmoid(x @ la.mean)
    hessian = x.T @ (x * (p * (1 - p))[:, None]) + delta * torch.eye(3, dtype=x.dtype)
    torch.testing.assert_close(la.posterior_precision, hessian, atol=1e-8, rtol=1e-8)


def test_refine_is_one_exact_step_for_a_gaussian_likelihood() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 2, generator=g, dtype=torch.float64)
    y = (x @ torch.tensor([1.0, -1.0], dtype=torch.float64)).unsqueeze(-1)
    y = y + 0.2 * torch.randn(40, 1, generator=g, dtype=torch.float64)
    model = nn.Linear(2, 1, bias=False).double()
    la = gs.Laplace(model, "regression", "full", prior_precision=1.0, sigma_noise=0.2)
    la.fit((x, y)).refine((x, y))
    ridge = torch.linalg.solve(x.T @ x / 0.04 + torch.eye(2, dtype=x.dtype), x.T @ y[:, 0] / 0.04)
    torch.testing.assert_close(la.mean, ridge, atol=1e-10, rtol=0)


def test_refine_makes_the_mlp_glm_stationary() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, 2, generator=g, dtype=torch.float64)
    y = (x[:, 0] ** 2 + x[:, 1] > 0.5).long()
    model = nn.Sequential(nn.Linear(2, 10), nn.Tanh(), nn.Linear(10, 2)).double()
    gs.train_map(model, (x, y), "classification", 1.0, epochs=30, lr=1e-2, seed=0)  # not converged
    la = gs.Laplace(model, "classification", "full", prior_precision=1.0).fit((x, y))
    la.refine((x, y))
    prior = 1.0
    b = la._grad - prior * la.mean
    assert b.abs().max() < 1e-5  # stationary point of the GLM log joint
    pred = la.predict(x[:5])
    torch.testing.assert_close(pred.probs.sum(-1), torch.ones(5, dtype=torch.float64))


@pytest.mark.parametrize("structure", ["full", "diag", "kron", "lowrank"])
def test_curvature_offset_equals_shifting_the_output_bias(structure: str) -> None:
    # Adding a constant c to the last bias shifts f by c and leaves every Jacobian unchanged,
    # so the curvature with offset c must equal the curvature of the shifted network.
    from gaussify.curvature import make_curvature

    g = torch.Generator().manual_seed(3)
    x = torch.randn(30, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (30,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double().eval()
    shift = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    options = {"rank": 5} if structure == "lowrank" else {}
    with_offset = make_curvature(structure, model, "classification", **options)
    with_offset.update(model, x, y, offset=shift.expand(30, 3))
    shifted = copy.deepcopy(model)
    with torch.no_grad():
        shifted[2].bias += shift
    reference = make_curvature(structure, shifted, "classification", **options)
    reference.update(shifted, x, y)
    torch.testing.assert_close(
        with_offset.posterior(1.0).precision_dense(), reference.posterior(1.0).precision_dense()
    )
    plain = make_curvature(structure, model, "classification", **options)
    plain.update(model, x, y)
    assert not torch.allclose(
        plain.posterior(1.0).precision_dense(), reference.posterior(1.0).precision_dense()
    )
    with pytest.raises(ValueError, match="offset: expected shape"):
        plain.update(model, x, y, offset=shift)
