"""VaLLA's inducing pairs (z_m, c_m): one output f_{c_m}(z_m) per inducing input (the authors'
design for classification). Oracles, in float64: K_ZZ and K_{Z x} are the NTK entries of the
chosen classes (from full Jacobians); with every pair (z_m, c) present the design is the
all-outputs design (same K_ZZ, closed-form q(u), predictive, KL and weight samples)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gaussify.function_space.valla import VaLLA

DTYPE = torch.float64
C = 3


def _problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(40, 4, dtype=DTYPE)
    y = torch.randint(0, C, (40,))
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, C)).to(DTYPE).eval()
    return model, x, y


def _jacobian(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Full Jacobian (N, C, P) by torch.func, independent of gaussify's routes."""
    params = dict(model.named_parameters())

    def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(model, p, (x,))

    jac = torch.func.jacrev(f)(params)
    return torch.cat([j.reshape(x.shape[0], C, -1) for j in jac.values()], -1)


@pytest.mark.parametrize("kernel", ["jacobian", "ntk"])
def test_pair_kernels_are_the_ntk_entries_of_the_chosen_classes(kernel):
    model, x, y = _problem()
    z, classes, prior = x[:5], torch.tensor([2, 0, 1, 1, 0]), 0.7
    post = VaLLA(
        model, "classification", None, prior, inducing_points=z, inducing_classes=classes,
        kernel=kernel, learn_prior=False,
    ).initialize((x, y))  # fmt: skip
    jz = _jacobian(model, z)[torch.arange(5), classes]  # (M, P): rows of the chosen classes
    assert torch.allclose(post.kernel_zz, jz @ jz.T / prior, atol=1e-12)
    k_zx, _ = post._batch_kernels(x[10:14])
    jx = _jacobian(model, x[10:14]).reshape(-1, jz.shape[1])
    assert torch.allclose(k_zx, jz @ jx.T / prior, atol=1e-12)
    assert torch.equal(post.inducing_classes, classes)
    assert post.chol_v.shape == (5, 5)


@pytest.mark.parametrize("kernel", ["jacobian", "ntk"])
def test_every_pair_present_equals_the_all_outputs_design(kernel):
    model, x, y = _problem()
    z = x[:4]
    common = {"prior_precision": 0.5, "kernel": kernel, "learn_prior": False}
    full = VaLLA(model, "classification", None, inducing_points=z, inducing_classes="all", **common)
    pairs = VaLLA(
        model, "classification", None, inducing_points=z.repeat_interleave(C, 0),
        inducing_classes=torch.arange(C).repeat(4), **common,
    )  # fmt: skip
    full.fit((x, y), method="closed_form")
    pairs.fit((x, y), method="closed_form")
    assert torch.allclose(pairs.kernel_zz, full.kernel_zz, atol=1e-12)
    assert torch.allclose(pairs.inducing_covariance, full.inducing_covariance, atol=1e-10)
    pf, pp = full.predict(x[20:], link="probit"), pairs.predict(x[20:], link="probit")
    assert torch.allclose(pp.f_cov, pf.f_cov, atol=1e-10)
    assert float(pf.f_cov.abs().max()) > 1e-3  # not trivially zero
    assert torch.allclose(pairs.kl(), full.kl(), atol=1e-10)
    bf, bp = full.batch_objective(x[:8], y[:8]), pairs.batch_objective(x[:8], y[:8])
    assert torch.allclose(bp, bf, atol=1e-10)
    sf = full.sample(6, generator=torch.Generator().manual_seed(1))
    sp = pairs.sample(6, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(sp, sf, atol=1e-10)


def test_sampled_weights_reproduce_the_pair_predictive_covariance():
    """theta ~ q(theta) by pathwise conditioning; J(x)(theta - theta*) has covariance
    Sigma(x, x) of eq. 17 (checked exactly through the sample's linear map: the empirical
    covariance of many draws, at a tolerance of a few standard errors)."""
    model, x, y = _problem()
    post = VaLLA(
        model, "classification", None, 0.5, inducing_points=x[:6],
        inducing_classes=torch.tensor([0, 1, 2, 0, 1, 2]), learn_prior=False,
    ).fit((x, y), method="closed_form")  # fmt: skip
    theta = post.sample(20000, generator=torch.Generator().manual_seed(0))
    jx = _jacobian(model, x[30:31])[0]  # (C, P)
    f = (theta - post.theta_star) @ jx.T
    emp = f.T @ f / f.shape[0]
    cov = post.predict(x[30:31], link="probit").f_cov[0]
    assert torch.allclose(emp, cov, atol=0.05 * float(cov.diagonal().max()))


def test_auto_design_labels_for_classification_and_all_outputs_otherwise():
    model, x, y = _problem()
    post = VaLLA(model, "classification", None, inducing_points=x[:7]).initialize((x, y))
    assert torch.equal(post.inducing_classes, y[:7])  # training inputs: their own labels
    assert post.kernel_zz.shape == (7, 7)
    cyc = VaLLA(model, "classification", None, inducing_points=x[:7], inducing_classes="cycle")
    assert torch.equal(cyc.initialize((x, y)).inducing_classes, torch.arange(7) % C)
    reg = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(DTYPE).eval()
    r = VaLLA(reg, "regression", None, inducing_points=x[:7]).initialize((x, y[:, None].to(DTYPE)))
    assert r.inducing_classes is None and r.kernel_zz.shape == (7, 7)
    allc = VaLLA(model, "classification", None, inducing_points=x[:7], inducing_classes="all")
    assert allc.initialize((x, y)).kernel_zz.shape == (7 * C, 7 * C)


def test_pair_state_round_trip():
    model, x, y = _problem()
    kw = {"inducing_points": x[:5], "inducing_classes": torch.tensor([1, 1, 0, 2, 2])}
    post = VaLLA(model, "classification", None, 0.5, **kw).fit((x, y), method="closed_form")
    state = post.state_dict()
    assert torch.equal(state["inducing_classes"], torch.tensor([1, 1, 0, 2, 2]))
    other = VaLLA(model, "classification", None, inducing_points=x[:5])
    other.load_state_dict(state)
    a, b = post.predict(x[20:], link="probit"), other.predict(x[20:], link="probit")
    assert torch.allclose(a.f_cov, b.f_cov, atol=1e-12)
    assert torch.equal(other.inducing_classes, post.inducing_classes)


@pytest.mark.parametrize(
    ("classes", "match"),
    [
        (torch.tensor([0, 1, 2]), r"inducing_classes: expected an integer tensor of shape \(5,\)"),
        (torch.tensor([0.0, 1, 2, 0, 1]), "inducing_classes: expected an integer tensor"),
        (torch.tensor([0, 1, 3, 0, 1]), r"inducing_classes: classes must lie in \[0, 3\)"),
        (torch.tensor([0, -1, 2, 0, 1]), r"inducing_classes: classes must lie in \[0, 3\)"),
    ],
)
def test_bad_inducing_classes(classes, match):
    model, x, y = _problem()
    post = VaLLA(model, "classification", None, inducing_points=x[:5], inducing_classes=classes)
    with pytest.raises(ValueError, match=match):
        post.initialize((x, y))


def test_unknown_inducing_classes_string():
    model, _, _ = _problem()
    with pytest.raises(ValueError, match="inducing_classes: expected 'auto', 'all', 'cycle'"):
        VaLLA(model, "classification", 5, inducing_classes="labels")  # type: ignore[arg-type]
