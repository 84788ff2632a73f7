"""The methods added so that every family answers the posterior protocol, checked against
their math: FunctionalLaplace's pathwise weight samples against the dense Laplace-GGN
covariance, the last layers' weight samples against their Gaussians, ExactLastLayer's prior
search against the evidence on every grid point, GPClassifier's saved state, SampledLLA's
seeded choice of its fitted samples, and the declared gaps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gaussify as gs
from gaussify import approx_likelihoods, last_layer
from gaussify.posterior import capabilities
from gaussify.state import StateError

DT = torch.float64


def _mlp(out: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, out)).to(DT)


@pytest.mark.parametrize(("task", "out"), [("regression", 1), ("classification", 3), ("binary", 1)])
def test_functional_laplace_samples_have_the_laplace_ggn_covariance(task: str, out: int) -> None:
    """theta = theta* + e - P0^-1 J^T L B^-1 (L^T J e + xi) ~ N(theta*, (G + P0)^-1): the
    covariance of 20000 draws matches Laplace(full)'s dense covariance (sampling error
    ~ sqrt(2 / S) ~ 1 %), and the mean is theta*."""
    model = _mlp(out)
    x = torch.randn(12, 2, dtype=DT)
    if task == "regression":
        y = torch.randn(12, 1, dtype=DT)
    elif task == "classification":
        y = torch.randint(0, 3, (12,))
    else:
        y = (x[:, :1] > 0).to(DT)
    sigma = 0.5 if task == "regression" else 1.0
    prior = torch.tensor(0.7, dtype=DT)
    fl = gs.FunctionalLaplace(model, task, prior_precision=prior, sigma_noise=sigma).fit((x, y))
    la = gs.Laplace(model, task, "full", prior_precision=prior, sigma_noise=sigma).fit((x, y))
    draws = fl.sample(20000, torch.Generator().manual_seed(1))
    reference = la.posterior_covariance
    scale = float(reference.diagonal().max())
    assert float((torch.cov(draws.T) - reference).abs().max()) < 0.05 * scale
    assert float((draws.mean(0) - la.mean).abs().max()) < 0.05 * scale**0.5


@pytest.mark.parametrize("cls", [last_layer.ExactLastLayer, last_layer.ADFLastLayer])
def test_last_layer_samples_follow_their_gaussian_columns(cls: type) -> None:
    torch.manual_seed(2)
    phi, y = torch.randn(40, 3, dtype=DT), torch.randint(0, 3, (40,))
    layer = cls(3, 3).fit((phi, y))
    draws = layer.sample(30000, torch.Generator().manual_seed(0)).reshape(-1, 4, 3)
    torch.testing.assert_close(draws.mean(0), layer.mean, rtol=0, atol=0.03)
    for k in range(3):
        cov = torch.cov(draws[:, :, k].T)
        torch.testing.assert_close(cov, layer.covariance[k], rtol=0, atol=0.03)


def test_exact_last_layer_optimize_prior_is_the_best_evidence_on_the_grid() -> None:
    torch.manual_seed(3)
    phi, y = torch.randn(30, 3, dtype=DT), torch.randint(0, 3, (30,))
    grid = [0.01, 0.1, 1.0, 10.0]
    layer = last_layer.ExactLastLayer(3, 3, prior_precision=0.37).fit((phi, y))
    start = float(layer.log_marginal_likelihood())
    layer.optimize_prior((phi, y), grid=grid)
    scores = {
        d: float(
            last_layer.ExactLastLayer(3, 3, prior_precision=d)
            .fit((phi, y))
            .log_marginal_likelihood()
        )
        for d in [*grid, 0.37]
    }
    best = max(scores, key=scores.__getitem__)
    assert layer.prior_precision == pytest.approx(best)
    assert float(layer.log_marginal_likelihood()) == pytest.approx(scores[best], abs=1e-10)
    assert scores[best] >= start
    with pytest.raises(ValueError, match=r"data: ExactLastLayer\.optimize_prior refits"):
        layer.optimize_prior()


def test_gp_classifier_state_names_a_mismatched_setting() -> None:
    torch.manual_seed(4)
    x, y = torch.randn(10, 2, dtype=DT), torch.randint(0, 3, (10,))
    gp = approx_likelihoods.GPClassifier()
    gp.fit(x, y, max_iter=3)
    other = approx_likelihoods.GPClassifier(hyperparameters="shared")
    with pytest.raises(StateError, match="'hyperparameters'"):
        other.load_state_dict(gp.state_dict())
    with pytest.raises(RuntimeError, match=r"state_dict: call fit\(x, y\) first"):
        approx_likelihoods.GPClassifier().state_dict()
    # optimize_prior continues from the fitted hyperparameters (the data already set are
    # kept, not reset to the defaults), so the evidence does not go down
    before = float(gp.log_marginal_likelihood())
    lengthscale = gp.lengthscale.clone()
    gp.optimize_prior((x, y), max_iter=20)
    assert float(gp.log_marginal_likelihood()) >= before
    assert not torch.equal(gp.lengthscale, lengthscale)
    fresh = approx_likelihoods.GPClassifier()
    fresh.optimize_prior((x, y), max_iter=20)  # no data yet: set, then tuned
    assert fresh.num_classes == 3


def test_sampled_lla_seeded_sample_draws_distinct_fitted_samples() -> None:
    model = _mlp(3)
    x, y = torch.randn(10, 2, dtype=DT), torch.randint(0, 3, (10,))
    post = gs.SampledLLA(model, "classification", 1.0, num_samples=8, solver="solve").fit((x, y))
    everything = post.sample()
    chosen = post.sample(5, torch.Generator().manual_seed(0))
    again = post.sample(5, torch.Generator().manual_seed(0))
    assert torch.equal(chosen, again)
    rows = [int((everything == row).all(-1).nonzero()) for row in chosen]
    assert len(set(rows)) == 5  # without replacement
    assert torch.equal(post.sample(3), everything[:3])  # without a generator: the first S


def test_sampled_lla_em_reaches_the_laplace_evidence_stationary_point() -> None:
    """alpha = (P - alpha tr A^-1) / ||theta*||^2 with tr A^-1 from the samples is the
    stationary point of the Laplace-GGN evidence without the correction: 2000 exact samples
    land within a few percent of Laplace(full).optimize_prior's alpha, and per-tensor
    priors get one update each."""
    model = _mlp(3)
    x, y = torch.randn(30, 2, dtype=DT), torch.randint(0, 3, (30,))
    post = gs.SampledLLA(model, "classification", 1.0, num_samples=2000, solver="solve")
    post.optimize_prior((x, y), n_steps=50, tol=1e-4)
    la = gs.Laplace(model, "classification", "full", correction=False).fit((x, y))
    la.optimize_prior()
    assert float(post.prior_precision) == pytest.approx(float(la.prior_precision), rel=0.05)
    layered = gs.SampledLLA(model, "classification", torch.ones(4, dtype=DT), num_samples=500)
    layered.solver = "solve"
    layered.optimize_prior((x, y), n_steps=2)
    assert layered.prior_precision.shape == (4,)
    assert len(set(layered.prior_precision.tolist())) == 4
    with pytest.raises(ValueError, match="prior_precision: the EM update needs a scalar"):
        gs.SampledLLA(model, "classification", torch.ones(27, dtype=DT)).optimize_prior((x, y))
    with pytest.raises(ValueError, match=r"data: SampledLLA\.optimize_prior refits"):
        post.optimize_prior()


def test_vbll_head_samples_scatter_around_the_mean() -> None:
    head = last_layer.VBLLDiscriminative(3, 4, 0.1).to(DT)
    draws = head.sample(20000, torch.Generator().manual_seed(0))
    mean = head.W().mean.detach().reshape(-1)
    assert float((draws.mean(0) - mean).abs().max()) < 0.05


def test_capabilities_and_declared_gaps() -> None:
    assert capabilities(gs.Laplace) == frozenset(
        {"fit", "predict", "sample", "log_marginal_likelihood", "optimize_prior"}
        | {"state_dict", "load_state_dict"}
    )
    assert "sample" not in capabilities(gs.ELLA)
    assert "log_marginal_likelihood" not in capabilities(gs.VOGGN)
    assert "optimize_prior" in capabilities(last_layer.ExactLastLayer)
    with pytest.raises(NotImplementedError, match=r"GLMVI\.log_marginal_likelihood: not supported"):
        gs.GLMVI(_mlp(3), "classification").log_marginal_likelihood()


def test_hyperparameters_or_current_keeps_the_graph_and_the_current_values() -> None:
    from gaussify.prior_tuning import hyperparameters_or_current

    model = _mlp(3)
    x, y = torch.randn(10, 2, dtype=DT), torch.randint(0, 3, (10,))
    la = gs.Laplace(model, "classification", "full", prior_precision=0.5).fit((x, y))
    prior, sigma = hyperparameters_or_current(la, None, None, DT)
    assert prior is la.prior_precision and sigma is la.sigma_noise
    wanted = torch.tensor(2.0, requires_grad=True)
    prior, _ = hyperparameters_or_current(la, wanted, None, DT)
    assert prior.dtype == DT and prior.device == la.prior_precision.device
    prior.backward()
    assert wanted.grad is not None  # the evidence stays differentiable in the prior
