"""The generative VBLL head (G-VBLL) term by term: its training loss against a closed form
written out per dimension, its parity with the ``vbll`` package's ``GenClassification`` at
equal parameters (float64), and the scale of its initial class means (issue 19).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from scipy.special import logsumexp, multigammaln

from gaussify import last_layer

DT = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _random_head(d: int, k: int, weight: float, seed: int, **kwargs) -> last_layer.VBLLGenerative:
    torch.manual_seed(seed)
    head = last_layer.VBLLGenerative(d, k, weight, "diagonal", **kwargs).double()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        head.mu_mean.copy_(torch.randn(k, d, generator=g, dtype=DT))
        head.mu_cov.logdiag.copy_(0.4 * torch.randn(k, d, generator=g, dtype=DT) - 0.5)
        head.noise_cov.logdiag.copy_(0.4 * torch.randn(d, generator=g, dtype=DT))
    return head


def _inverse_wishart_log_density(sigma_diag: np.ndarray, dof: float, scale: float) -> float:
    """log W^-1(Sigma | dof, scale I) with its normaliser, through the Wishart density of the
    precision Lambda = Sigma^-1 ~ W(dof, (scale I)^-1) and the Jacobian |dLambda / dSigma| =
    |Sigma|^-(D + 1)."""
    d = sigma_diag.shape[0]
    wishart = stats.wishart(df=dof, scale=np.eye(d) / scale)
    return float(wishart.logpdf(np.diag(1.0 / sigma_diag))) - (d + 1) * np.log(sigma_diag).sum()


def test_train_loss_is_eq14_with_kl_and_inverse_wishart_closed_form() -> None:
    """train_loss = -(mean_n [log N(phi_n | mu_y, Sigma) - 1/2 tr(Sigma^-1 S_y) + log a_y
    - LSE_k(log N(phi_n | mu_k, Sigma + S_k) + log a_k)] + w (log W^-1(Sigma) - KL(q || p)))
    with a_k the Dirichlet predictive, the KL against N(0, s I) and the inverse-Wishart
    density up to its normaliser; every term written out per dimension in float64."""
    d, k, n, w, s, dof, m, a0 = 4, 3, 7, 0.3, 2.5, 6.0, 1.7, 0.5
    head = _random_head(d, k, w, 0, prior_scale=s, dof=dof, wishart_scale=m, dirichlet_prior=a0)
    y_train = torch.tensor([0, 1, 1, 2, 2, 2])
    head.set_class_counts(y_train)
    g = torch.Generator().manual_seed(5)
    phi = torch.randn(n, d, generator=g, dtype=DT)
    y = torch.tensor([0, 1, 2, 2, 1, 0, 2])
    with torch.no_grad():
        loss = head(phi).train_loss(y)
        mu = head.mu_mean.numpy()
        s_k = np.exp(2 * head.mu_cov.logdiag.numpy())  # (K, D) variances
        sig = np.exp(-2 * head.noise_cov.logdiag.numpy())  # (D,) variances
        x, labels = phi.numpy(), y.tolist()
    counts = np.array([1.0, 2.0, 3.0])
    log_a = np.log((counts + a0) / (counts + a0).sum())
    per_example = []
    for i, c in enumerate(labels):
        lin = sum(
            -0.5 * math.log(2 * math.pi * sig[j]) - 0.5 * (x[i, j] - mu[c, j]) ** 2 / sig[j]
            for j in range(d)
        )
        trace = sum(s_k[c, j] / sig[j] for j in range(d))
        joint = [
            sum(
                -0.5 * math.log(2 * math.pi * (sig[j] + s_k[q, j]))
                - 0.5 * (x[i, j] - mu[q, j]) ** 2 / (sig[j] + s_k[q, j])
                for j in range(d)
            )
            + log_a[q]
            for q in range(k)
        ]
        per_example.append(lin - 0.5 * trace + log_a[c] - logsumexp(joint))
    # KL(N(m, v) || N(0, s)) per coordinate
    kl = sum(
        0.5 * (s_k[q, j] / s + mu[q, j] ** 2 / s - 1.0 + math.log(s / s_k[q, j]))
        for q in range(k)
        for j in range(d)
    )
    # the objective carries the inverse-Wishart log density without its normaliser (App. C.3):
    # log W^-1 = ours + (dof D / 2) log(m / 2) - log Gamma_D(dof / 2)
    normaliser = 0.5 * dof * d * math.log(m / 2) - multigammaln(dof / 2, d)
    log_iw = _inverse_wishart_log_density(sig, dof, m) - normaliser
    expected = -(np.mean(per_example) + w * (log_iw - kl))
    assert float(loss) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    terms = head(phi).elbo_terms(y)
    assert float(terms["kl"].detach()) == pytest.approx(kl, rel=1e-12)
    assert float(terms["log_prior"].detach()) == pytest.approx(log_iw, rel=1e-12)


@pytest.mark.parametrize("d", [16, 1024])
def test_initial_class_means_have_unit_scale_and_an_unsaturated_predictive(d: int) -> None:
    """The class means start at randn(K, D) / sqrt(D): E||mu_k||^2 = 1 for every width. With
    Sigma + S_k = (1 + 1/D) I and phi ~ N(0, I) the logit differences
    phi^T (mu_k - mu_j) / (1 + 1/D) - (||mu_k||^2 - ||mu_j||^2) / (2 (1 + 1/D)) then have
    variance about 2, not 2 D, so the initial predictive is not saturated (with unit-variance
    means, D = 1024 gives logit gaps of ~45 and max probabilities of ~1)."""
    k = 10
    torch.manual_seed(7)
    head = last_layer.VBLLGenerative(d, k, 0.01).double()
    torch.manual_seed(7)
    expected = (torch.randn(k, d) / math.sqrt(d)).double()
    torch.testing.assert_close(head.mu_mean.detach(), expected)
    sq_norm = head.mu_mean.detach().square().sum(-1).mean()
    assert abs(float(sq_norm) - 1.0) < 5 * math.sqrt(2.0 / (k * d)) + 1e-12
    phi = torch.randn(200, d, generator=torch.Generator().manual_seed(8), dtype=DT)
    with torch.no_grad():
        top = head(phi).predictive.probs.amax(-1).mean()
    assert float(top) < 0.6, float(top)


def test_parity_with_vbll_gen_classification_at_equal_parameters() -> None:
    """At equal parameters (vbll stores log standard deviations: ``mu_logdiag`` is our
    ``mu_cov.logdiag``; ``noise_logdiag = log sigma`` is minus our ``noise_cov.logdiag``, the
    log diagonal of the precision's Cholesky factor) and a uniform class prior (vbll has
    none): the per-example bound (eq. 14), the predictive, the inverse-Wishart term and the
    gradients agree in float64; our logits are vbll's plus ``log(1/K)`` and our KL is vbll's
    minus its omitted constant ``K D / 2``, so our loss is vbll's minus ``w K D / 2``."""
    vbll = pytest.importorskip("vbll", reason="the vbll package is not installed")
    d, k, n, w, s, dof, m = 5, 4, 9, 0.2, 0.7, 2.0, 1.3
    torch.manual_seed(0)
    ref = vbll.GenClassification(
        d, k, w, parameterization="diagonal", prior_scale=s, wishart_scale=m, dof=dof
    ).double()
    ours = last_layer.VBLLGenerative(d, k, w, "diagonal", prior_scale=s, wishart_scale=m, dof=dof)
    ours = ours.double()
    with torch.no_grad():
        ours.mu_mean.copy_(ref.mu_mean)
        ours.mu_cov.logdiag.copy_(ref.mu_logdiag)
        ours.noise_cov.logdiag.copy_(-ref.noise_logdiag)
    g = torch.Generator().manual_seed(1)
    phi = 0.5 * torch.randn(n, d, generator=g, dtype=DT)
    y = torch.randint(0, k, (n,), generator=g)

    bound_ref = ref.jensen_bound(phi, y)
    bound_ours = ours(phi).elbo_terms(y)["bound"]
    torch.testing.assert_close(bound_ours, bound_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        ours.log_joint(phi), ref.logit_predictive(phi) - math.log(k), rtol=1e-12, atol=1e-12
    )
    torch.testing.assert_close(
        ours(phi).predictive.probs, ref(phi).predictive.probs, rtol=1e-12, atol=1e-12
    )
    noise = ref.noise()
    wishart_ref = ref.dof * noise.logdet_precision - 0.5 * ref.wishart_scale * noise.trace_precision
    torch.testing.assert_close(ours.log_prior(), wishart_ref, rtol=1e-12, atol=1e-12)

    loss_ref = ref(phi).train_loss_fn(y)
    loss_ours = ours(phi).train_loss(y)
    torch.testing.assert_close(loss_ours - loss_ref, torch.tensor(-w * k * d / 2, dtype=DT))
    grads_ref = torch.autograd.grad(loss_ref, [ref.mu_mean, ref.mu_logdiag, ref.noise_logdiag])
    grads_ours = torch.autograd.grad(
        loss_ours, [ours.mu_mean, ours.mu_cov.logdiag, ours.noise_cov.logdiag]
    )
    for a, b, sign in zip(grads_ours, grads_ref, (1.0, 1.0, -1.0), strict=True):
        torch.testing.assert_close(a, sign * b, rtol=1e-10, atol=1e-12)
