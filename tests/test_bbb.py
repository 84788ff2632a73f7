"""Bayes by backprop (last_layer.bbb): the ELBO's KL against the closed form, the
reparameterised expected log-likelihood's gradient against its closed form on a linear
Gaussian model, and the joint training of a prior grid against separate training."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gaussify.last_layer.bbb import LocalReparamLinear, MeanFieldGrid

DT = torch.float64


def _grid(deltas: list[float], init_std: float = 0.3) -> MeanFieldGrid:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(DT)
    grid = MeanFieldGrid(net, deltas, "classification", init_std=init_std)
    with torch.no_grad():  # distinct means and standard deviations per network and weight
        for p in grid.params.values():
            p.add_(0.2 * torch.randn_like(p))
    return grid


def test_kl_matches_closed_form_per_network() -> None:
    grid = _grid([0.1, 1.0, 7.0])
    kl = grid.kl()
    for g, delta in enumerate([0.1, 1.0, 7.0]):
        ref = torch.zeros((), dtype=DT)
        for mean_name, rho_name in grid.pairs:
            m = grid.params[mean_name][g]
            s = nn.functional.softplus(grid.params[rho_name][g])
            q = torch.distributions.Normal(m, s)
            p = torch.distributions.Normal(torch.zeros_like(m), torch.full_like(m, delta**-0.5))
            ref = ref + torch.distributions.kl_divergence(q, p).sum()
        torch.testing.assert_close(kl[g], ref, rtol=1e-12, atol=1e-12)
        # the layer's own kl() with prior_std = delta^-1/2 agrees (same parameterisation)
        net = grid.network(g)
        own = sum(m.kl() for m in net.modules() if isinstance(m, LocalReparamLinear))
        torch.testing.assert_close(own, ref, rtol=1e-12, atol=1e-12)


def test_expected_log_lik_gradient_matches_closed_form_on_linear_model() -> None:
    """Linear regression f = w^T x + b, y ~ N(f, sigma^2): E_q[log p(y | f)] =
    -1/2 log(2 pi sigma^2) - ((y - m^T x - m_b)^2 + sum_d x_d^2 s_d^2 + s_b^2) / (2 sigma^2),
    so the loss gradient in (m, rho) is closed form; the reparameterised Monte Carlo
    gradient of :meth:`MeanFieldGrid.loss` averages to it."""
    torch.manual_seed(1)
    n, d, sigma = 5, 3, 0.7
    x = torch.randn(n, d, dtype=DT)
    y = torch.randn(n, 1, dtype=DT)
    grid = MeanFieldGrid(
        nn.Linear(d, 1).to(DT), [2.0], "regression", init_std=0.4, sigma_noise=sigma
    )
    params = grid.params
    # closed form of the loss (per example), a function of the parameters
    m_w, r_w = params["weight_mean"][0, 0], params["weight_rho"][0, 0]
    m_b, r_b = params["bias_mean"][0], params["bias_rho"][0]
    s_w, s_b = nn.functional.softplus(r_w), nn.functional.softplus(r_b)
    resid = (y[:, 0] - x @ m_w - m_b[0]).square()
    var = x.square() @ s_w.square() + s_b[0].square()
    ell = (-0.5 * math.log(2 * math.pi * sigma**2) - (resid + var) / (2 * sigma**2)).sum()
    exact = (grid.kl()[0] - ell) / n
    names = ["weight_mean", "weight_rho", "bias_mean", "bias_rho"]
    g_exact = torch.autograd.grad(exact, [params[k] for k in names])
    torch.manual_seed(2)
    # 100,000 copies of the data set: with one independent draw per row (local
    # reparameterisation), the loss of N = n examples is a 100,000-draw Monte Carlo estimate
    reps = 100_000
    loss = grid.loss(x.repeat(reps, 1), y.repeat(reps, 1), num_data=n)[0]
    g_mc = torch.autograd.grad(loss, [params[k] for k in names])
    torch.testing.assert_close(loss, exact, rtol=2e-2, atol=0.0)
    for a, b in zip(g_mc, g_exact, strict=True):
        torch.testing.assert_close(a, b, rtol=0.0, atol=0.02 * float(b.abs().max()) + 1e-3)


def test_local_reparameterisation_has_the_weight_sampling_distribution() -> None:
    """One input: the pre-activation of a LocalReparamLinear has mean m_W x + m_b and
    variance s_W^2 x^2 + s_b^2, as theta ~ q gives (checked on 200k draws)."""
    torch.manual_seed(3)
    layer = LocalReparamLinear(3, 2, init_std=0.5).to(DT)
    x = torch.randn(1, 3, dtype=DT).expand(200_000, 3)
    z = layer(x)
    mean = layer.weight_mean @ x[0] + layer.bias_mean
    var = nn.functional.softplus(layer.weight_rho).square() @ x[0].square()
    var = (var + nn.functional.softplus(layer.bias_rho).square()).detach()
    se = float(var.max()) ** 0.5 / 200_000**0.5
    torch.testing.assert_close(z.mean(0).detach(), mean.detach(), rtol=0, atol=5 * se)
    torch.testing.assert_close(z.var(0).detach(), var, rtol=0.02, atol=0)


def test_grid_training_equals_separate_training() -> None:
    """Adam is elementwise: training G networks jointly equals training each alone. The
    draws are switched off (``sample=False``, the means' forward) so that both see the same
    objective; the KL still couples each network to its own delta."""
    torch.manual_seed(4)
    x = torch.randn(20, 3, dtype=DT)
    y = torch.randint(0, 2, (20,))
    deltas = [0.5, 3.0]
    joint = _grid(deltas)
    start = {k: v.detach().clone() for k, v in joint.params.items()}
    # identical draws: replace the noise by zero (means only) through sample=False
    for m in joint.base.modules():
        if isinstance(m, LocalReparamLinear):
            m.sample = False
    joint.fit((x, y), epochs=8, lr=1e-2, seed=0)
    for g, delta in enumerate(deltas):
        alone = _grid([delta])
        with torch.no_grad():
            for k, v in alone.params.items():
                v.copy_(start[k][g : g + 1])
        for m in alone.base.modules():
            if isinstance(m, LocalReparamLinear):
                m.sample = False
        alone.fit((x, y), epochs=8, lr=1e-2, seed=0)
        for k in joint.params:
            torch.testing.assert_close(
                joint.params[k][g], alone.params[k][0], rtol=1e-10, atol=1e-12
            )


def test_predict_probs_shape_and_normalisation() -> None:
    grid = _grid([1.0, 2.0])
    p = grid.predict_probs(torch.randn(7, 3, dtype=DT), num_samples=5)
    assert p.shape == (2, 7, 2)
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 7, dtype=DT))


@pytest.mark.parametrize(
    ("deltas", "error", "match"),
    [
        ([], ValueError, "prior_precisions: expected at least one value"),
        ([1.0, 0.0], ValueError, "prior_precisions: every value must be finite and > 0"),
        ([float("nan")], ValueError, "prior_precisions: every value must be finite and > 0"),
        (["1"], TypeError, "prior_precisions: expected numbers"),
    ],
)
def test_bad_prior_precisions(deltas: list, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        MeanFieldGrid(nn.Linear(2, 2), deltas)


def test_bad_fit_arguments() -> None:
    grid = _grid([1.0])
    data = (torch.randn(4, 3, dtype=DT), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="lr: must be a number > 0"):
        grid.fit(data, epochs=1, lr=0.0)
    with pytest.raises(ValueError, match="epochs"):
        grid.fit(data, epochs=0)
