"""Exact Bayesian last layer with Gaussian pseudo-likelihoods, its streaming baselines and
active learning (Bui, eq. 4 and Sec. 4.3)."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from gaussify.approx_likelihoods import BetaGaussian, DirichletGaussian
from gaussify.approx_likelihoods.pseudo_targets import SUPPORTED_BASES
from gaussify.last_layer.active import ActiveLearner, active_learning, predictive_entropy
from gaussify.last_layer.adf import ADFLastLayer, SGDLastLayer, adf_moments
from gaussify.last_layer.exact import ExactLastLayer

F64 = torch.float64


def _data(n: int = 40, d: int = 5, c: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    phi = torch.randn(n, d, generator=gen, dtype=F64)
    w = torch.randn(d, c, generator=gen, dtype=F64)
    y = (phi @ w + 0.5 * torch.randn(n, c, generator=gen, dtype=F64)).argmax(-1)
    return phi, y


def _reference_posterior(phi, y, pl, num_classes, delta):
    """Textbook Bayesian linear regression per column, written out densely."""
    n = phi.shape[0]
    x = torch.cat([phi, torch.ones(n, 1, dtype=F64)], 1)
    m, v = pl.pseudo_targets(y, num_classes, dtype=F64)
    k = m.shape[-1]
    means, covs, log_ev = [], [], 0.0
    for j in range(k):
        prec = delta * torch.eye(x.shape[1], dtype=F64) + x.T @ torch.diag(1 / v[:, j]) @ x
        cov = torch.linalg.inv(prec)
        means.append(cov @ x.T @ (m[:, j] / v[:, j]))
        covs.append(cov)
        marginal = x @ x.T / delta + torch.diag(v[:, j])
        log_ev += float(
            torch.distributions.MultivariateNormal(torch.zeros(n, dtype=F64), marginal).log_prob(
                m[:, j]
            )
        )
    return torch.stack(means, 1), torch.stack(covs), log_ev


BATCHINGS = [[40], [1] * 40, [7, 1, 13, 19], [3, 30, 2, 5]]
#: every (method, basis) pair the pseudo-likelihoods support
SETTINGS = [(m, b) for m, bases in SUPPORTED_BASES.items() for b in bases]


@pytest.mark.parametrize(("method", "basis"), SETTINGS)
def test_streaming_equals_batch_posterior(method, basis):
    phi, y = _data()
    if basis == "logit":
        y = (y > 0).long()
    c = 3 if basis == "log" else 2
    kwargs = {"method": method, "basis": basis, "alpha_eps": 0.05, "prior_precision": 2.0}
    batch = ExactLastLayer(5, c, streaming=False, **kwargs).fit((phi, y))
    ref_mean, ref_cov, ref_log_ev = _reference_posterior(
        phi, y, batch.pseudo_likelihood, c, delta=2.0
    )
    torch.testing.assert_close(batch.mean, ref_mean, rtol=0, atol=1e-8)
    torch.testing.assert_close(batch.covariance, ref_cov, rtol=0, atol=1e-8)
    assert float(batch.log_marginal_likelihood()) == pytest.approx(ref_log_ev, abs=1e-8)
    for sizes in BATCHINGS:
        stream = ExactLastLayer(5, c, streaming=True, **kwargs)
        for chunk_phi, chunk_y in zip(phi.split(sizes), y.split(sizes), strict=True):
            stream.update(chunk_phi, chunk_y)
        torch.testing.assert_close(stream.mean, batch.mean, rtol=0, atol=1e-8)
        torch.testing.assert_close(stream.covariance, batch.covariance, rtol=0, atol=1e-8)
        torch.testing.assert_close(stream.precision, batch.precision, rtol=0, atol=1e-7)
        assert float(stream.log_marginal_likelihood()) == pytest.approx(ref_log_ev, abs=1e-8)
        assert stream.num_data == 40


def test_predictive_is_the_pushforward_of_the_posterior():
    phi, y = _data()
    layer = ExactLastLayer(5, 3, method="moment-ori").fit((phi, y), batch_size=8)
    test = torch.randn(6, 5, dtype=F64)
    pred = layer.predict(test)
    x = torch.cat([test, torch.ones(6, 1, dtype=F64)], 1)
    torch.testing.assert_close(pred.f_mean, x @ layer.mean)
    f_var = torch.stack([torch.einsum("nd,de,ne->n", x, c, x) for c in layer.covariance], 1)
    torch.testing.assert_close(pred.f_var, f_var)
    torch.testing.assert_close(pred.probs.sum(-1), torch.ones(6, dtype=F64))
    mc = layer.predict(
        test, link="mc", num_samples=20000, generator=torch.Generator().manual_seed(0)
    )
    assert (mc.probs - pred.probs).abs().max() < 0.05  # probit vs softmax of samples
    binary = ExactLastLayer(5, 2, basis="logit").fit((phi, (y > 0).long()))
    probs = binary.predict(test.float()).probs
    assert probs.shape == (6, 1) and probs.dtype == torch.float32


def test_state_dict_round_trip():
    phi, y = _data()
    for streaming in (True, False):
        layer = ExactLastLayer(5, 3, streaming=streaming, alpha_eps=0.2).fit((phi, y))
        buffer = io.BytesIO()
        torch.save(layer.state_dict(), buffer)
        buffer.seek(0)
        other = ExactLastLayer(5, 3, streaming=streaming)
        other.load_state_dict(torch.load(buffer, weights_only=True))
        assert other.pseudo_likelihood.alpha_eps == 0.2
        torch.testing.assert_close(other.predict(phi).probs, layer.predict(phi).probs)


def test_elbo_terms_and_gradient():
    phi, y = _data()
    layer = ExactLastLayer(5, 3, method="variational", prior_precision=1.5)
    base = torch.randn(64, 40, 3, dtype=F64, generator=torch.Generator().manual_seed(0))
    alpha = torch.tensor(0.1, dtype=F64, requires_grad=True)
    value = layer.elbo(phi, y, alpha, base_samples=base)
    (grad,) = torch.autograd.grad(value, alpha)
    h = 1e-6
    up = layer.elbo(phi, y, torch.tensor(0.1 + h, dtype=F64), base_samples=base)
    down = layer.elbo(phi, y, torch.tensor(0.1 - h, dtype=F64), base_samples=base)
    assert float(grad) == pytest.approx(float(up - down) / (2 * h), rel=1e-5)
    # The KL part equals torch.distributions' KL of the fitted posterior from the prior.
    fitted = ExactLastLayer(5, 3, method="variational", prior_precision=1.5, streaming=False).fit(
        (phi, y)
    )
    q = torch.distributions.MultivariateNormal(fitted.mean.T, fitted.covariance)
    p = torch.distributions.MultivariateNormal(
        torch.zeros(6, dtype=F64), torch.eye(6, dtype=F64) / 1.5
    )
    kl = float(torch.distributions.kl_divergence(q, p).sum())
    zero = torch.zeros_like(base)
    f_mean = torch.cat([phi, torch.ones(40, 1, dtype=F64)], 1) @ fitted.mean
    plug_in = float(torch.log_softmax(f_mean, -1).gather(1, y[:, None]).sum())
    assert float(layer.elbo(phi, y, base_samples=zero)) == pytest.approx(plug_in - kl, rel=1e-10)


def test_alpha_eps_tuning():
    phi, y = _data(n=60)
    layer = ExactLastLayer(5, 3, method="variational", alpha_eps=0.01)
    base = torch.randn(32, 60, 3, dtype=F64, generator=torch.Generator().manual_seed(0))
    before = float(layer.elbo(phi, y, base_samples=base))
    result = layer.tune_alpha_eps(phi, y, "variational", steps=60, lr=0.1, generator=None)
    assert layer.pseudo_likelihood.alpha_eps == result.alpha_eps != 0.01
    assert float(layer.elbo(phi, y, base_samples=base)) > before
    assert layer.num_data == 60  # refitted on the data
    grid = layer.tune_alpha_eps(phi, y, "train_likelihood", grid=(0.01, 0.1, 1.0))
    assert grid.alpha_eps == max(grid.scores, key=grid.scores.get)
    with pytest.raises(ValueError, match="strategy"):
        layer.tune_alpha_eps(phi, y, "marglik")


def test_bad_inputs():
    with pytest.raises(ValueError, match="alpha_eps"):
        ExactLastLayer(5, 3, alpha_eps=0.0)
    with pytest.raises(ValueError, match="basis"):
        ExactLastLayer(5, 2, method="moment-ori", basis="logit")
    with pytest.raises(ValueError, match="num_classes"):
        ExactLastLayer(5, 3, basis="logit")
    with pytest.raises(ValueError, match="prior_precision"):
        ExactLastLayer(5, 3, prior_precision=0.0)
    layer = ExactLastLayer(5, 3)
    with pytest.raises(ValueError, match="y"):
        layer.update(torch.randn(2, 5), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="phi"):
        layer.update(torch.randn(2, 4), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="y"):
        layer.update(torch.randn(2, 5), torch.tensor([0, 1, 1]))
    assert isinstance(
        ExactLastLayer(5, 2, pseudo_likelihood=BetaGaussian("laplace")).pseudo_likelihood,
        BetaGaussian,
    )
    assert ExactLastLayer(5, 4, pseudo_likelihood=DirichletGaussian("moment")).num_outputs == 4


# --- baselines ------------------------------------------------------------------------------


def test_adf_log_normaliser_matches_quadrature():
    """Two classes: Z = E[sigmoid(f_y - f_other)], a 1-D Gaussian integral."""
    a = torch.tensor([0.7, -0.4], dtype=F64)
    s = torch.tensor([1.5, 0.5], dtype=F64)
    eps = torch.randn(400000, 2, dtype=F64, generator=torch.Generator().manual_seed(0))
    log_z, grad_a, grad_s = adf_moments(a, s, 0, eps)

    def z_of(mean, var):
        return integrate.quad(
            lambda t: stats.norm.pdf(t) / (1 + math.exp(-(mean + math.sqrt(var) * t))), -12, 12
        )[0]

    ref = z_of(1.1, 2.0)
    assert float(log_z) == pytest.approx(math.log(ref), abs=5e-3)
    h = 1e-5
    d_mean = (math.log(z_of(1.1 + h, 2.0)) - math.log(z_of(1.1 - h, 2.0))) / (2 * h)
    d_var = (math.log(z_of(1.1, 2.0 + h)) - math.log(z_of(1.1, 2.0 - h))) / (2 * h)
    np.testing.assert_allclose(grad_a.numpy(), [d_mean, -d_mean], atol=1e-2)
    np.testing.assert_allclose(grad_s.numpy(), [d_var, d_var], atol=1e-2)


def test_adf_converges_on_a_separable_problem():
    gen = torch.Generator().manual_seed(0)
    y = torch.randint(0, 2, (120,), generator=gen)
    phi = (2.0 * y - 1.0).to(F64)[:, None] * 2 + 0.3 * torch.randn(120, 1, generator=gen, dtype=F64)
    adf = ADFLastLayer(1, 2, num_samples=200, generator=torch.Generator().manual_seed(1))
    confidence = []
    for chunk_phi, chunk_y in zip(phi.split(20), y.split(20), strict=True):
        adf.update(chunk_phi, chunk_y)
        probs = adf.predict(phi).probs
        confidence.append(float(probs.gather(1, y[:, None]).mean()))
    assert adf.predict(phi).probs.argmax(-1).eq(y).all()
    assert confidence[-1] > 0.9 and confidence[-1] > confidence[0]
    assert (torch.linalg.eigvalsh(adf.covariance) > 0).all()
    sgd = SGDLastLayer(1, 2, lr=0.1).fit((phi, y), batch_size=10)
    assert sgd.predict(phi).probs.argmax(-1).eq(y).all()


def test_adf_damping_keeps_the_covariance_valid():
    phi, y = _data(n=30)
    gen = torch.Generator().manual_seed(0)
    adf = ADFLastLayer(5, 3, prior_precision=1e-4, num_samples=2, min_ratio=0.1, generator=gen)
    adf.fit((phi * 30, y))
    assert adf.num_damped > 0
    assert (torch.linalg.eigvalsh(adf.covariance) > 0).all()


# --- active learning ------------------------------------------------------------------------


def test_active_learning_picks_the_max_entropy_point():
    phi, y = _data(n=50, c=2, seed=3)
    layer = ExactLastLayer(5, 2, basis="logit", method="variational")
    learner = ActiveLearner(layer, phi, y, initial=[0, 1, 2])
    for _ in range(5):
        available = learner.available.clone()
        probs = torch.sigmoid(
            layer.logit_distribution(phi)[0]
            / torch.sqrt(1 + math.pi / 8 * layer.logit_distribution(phi)[1])
        ).squeeze(-1)
        entropy = -(probs * probs.log() + (1 - probs) * (1 - probs).log())
        expected = int(torch.where(available, entropy, -torch.inf).argmax())
        assert learner.step() == expected
    # Rank-1 updates along the way equal a fresh fit on the labelled points.
    idx = torch.tensor(learner.labelled)
    fresh = ExactLastLayer(5, 2, basis="logit", method="variational", streaming=False)
    fresh.fit((phi[idx], y[idx]))
    torch.testing.assert_close(layer.mean, fresh.mean, rtol=0, atol=1e-8)
    scores = learner.scores()
    assert torch.isneginf(scores[idx]).all()
    entropy = predictive_entropy(layer.predict(phi))
    torch.testing.assert_close(scores[learner.available], entropy[learner.available])


def test_active_learning_loop():
    phi, y = _data(n=120, c=2, seed=4)
    result = active_learning(phi[:80], y[:80], phi[80:], y[80:], steps=15, num_initial=4)
    assert len(result.chosen) == 15 == len(set(result.chosen))
    assert result.num_labelled == list(range(4, 20))
    assert len(result.accuracy) == len(result.nll) == 16
    assert result.accuracy[-1] >= 0.8
    random = active_learning(phi[:80], y[:80], phi[80:], y[80:], steps=5, acquisition="random")
    assert len(random.chosen) == 5
    with pytest.raises(ValueError, match="acquisition"):
        active_learning(phi[:80], y[:80], phi[80:], y[80:], acquisition="bald")


def test_active_learning_bad_input_names_the_argument():
    phi, y = _data(n=30, c=2, seed=4)
    pool, test = (phi[:20], y[:20]), (phi[20:], y[20:])
    with pytest.raises(ValueError, match=r"y_pool: labels must be in \[0, 2\)"):
        active_learning(pool[0], pool[1] + 1, *test, steps=1)
    with pytest.raises(ValueError, match=r"y_test: labels must be in \[0, 2\)"):
        active_learning(*pool, test[0], test[1] - 1, steps=1)
    with pytest.raises(ValueError, match=r"y_pool: labels must be in \[0, 3\)"):
        active_learning(pool[0], pool[1] - 1, test[0], test[1] + 1, basis="log", steps=1)
    with pytest.raises(TypeError, match="y_pool"):
        active_learning(pool[0], pool[1].double(), *test, steps=1)
    with pytest.raises(ValueError, match="alpha_eps"):
        active_learning(*pool, *test, alpha_eps=0.0, steps=1)
    with pytest.raises(ValueError, match="basis"):
        active_learning(*pool, *test, method="moment-ori", basis="logit", steps=1)
