"""Gradients of the GLM predictive with respect to the inputs (Bayesian optimisation)."""

import pytest
import torch
from torch import nn

import gaussify as gs


def _fitted(structure: str, subset: str) -> gs.Laplace:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    model = model.double()
    x = torch.linspace(-2, 2, 30, dtype=torch.float64)[:, None]
    y = torch.sin(2 * x) + 0.1 * torch.randn_like(x)
    la = gs.Laplace(model, "regression", structure, subset, prior_precision=1.0, sigma_noise=0.2)
    return la.fit((x, y))


@pytest.mark.parametrize(
    ("structure", "subset"), [("full", "all"), ("kron", "all"), ("diag", "last_layer")]
)
def test_predictive_mean_and_variance_gradients_match_finite_differences(
    structure: str, subset: str
) -> None:
    la = _fitted(structure, subset)
    x = torch.tensor([[-0.7], [0.3], [1.9]], dtype=torch.float64, requires_grad=True)
    pred = la.predict(x)
    g_mean, g_var = (
        torch.autograd.grad(q.sum(), x, retain_graph=True)[0] for q in (pred.mean, pred.var)
    )
    eps = 1e-6
    with torch.no_grad():
        up, down = la.predict(x.detach() + eps), la.predict(x.detach() - eps)
    torch.testing.assert_close(g_mean, (up.mean - down.mean) / (2 * eps), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(g_var, (up.var - down.var) / (2 * eps), rtol=1e-6, atol=1e-8)
    assert g_var.abs().max() > 1e-4  # the variance really depends on x


def test_predict_without_input_grad_builds_no_graph() -> None:
    la = _fitted("full", "all")
    pred = la.predict(torch.zeros(2, 1, dtype=torch.float64))
    assert not pred.mean.requires_grad and not pred.var.requires_grad
