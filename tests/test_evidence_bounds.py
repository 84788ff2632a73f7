"""The Laplace evidence is never impossible (issue 16, point 1).

Oracles: (1) the evidence of discrete labels is a probability, so log Z <= 0 for every
structure, subset and likelihood, also for a classifier far from its MAP (logits scaled x10,
x100) and after prior tuning; the non-MAP correction is dropped there by the rule of
``gaussify.evidence`` with an ``EvidenceWarning``, and the dropped value is exactly the
evidence without the correction. (2) A float32 model gives the float64 model's evidence to
1e-4 relative for prior precisions 1e-8 ... 1e12 (everything is evaluated in float64, the
correction merged with the prior term per eigenvector), where it used to collapse to 0 or
-131072. (3) The exact Gaussian case is untouched: the rule never fires for the full GGN of a
linear model (its Newton model is the exact log-likelihood).
"""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import gaussify as gs
from gaussify.evidence import log_likelihood_supremum
from gaussify.warnings import EvidenceWarning

DT = torch.float64
STRUCTURES = ["full", "diag", "kron", "lowrank"]
PRIORS = [1e-8, 1e-4, 1.0, 1e4, 1e8, 1e10, 1e12]


def _data(task: str, n: int = 60, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g, dtype=DT)
    if task == "binary":
        noise = torch.randn(n, generator=g, dtype=DT)  # overlapping classes
        return x, (x[:, 0] + 0.5 * x[:, 1] + noise > 0).to(DT).reshape(-1, 1)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


_CACHE: dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]] = {}


def _trained(task: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A small MLP trained to its MAP (prior precision 1), cached per task."""
    if task not in _CACHE:
        torch.manual_seed(0)
        out = 1 if task == "binary" else 3
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, out)).double()
        x, y = _data(task)
        lik = "binary" if task == "binary" else "classification"
        gs.train_map(model, (x, y), lik, prior_precision=1.0, epochs=200, lr=1e-2, seed=0)
        _CACHE[task] = (model, x, y)
    return _CACHE[task]


@pytest.fixture(scope="module", autouse=True)
def _warm() -> None:
    """Train the two MLPs once (and import the low-rank eigensolver) before the tests."""
    import scipy.sparse.linalg  # noqa: F401

    for task in ("multiclass", "binary"):
        model, x, y = _trained(task)
        _laplace(model, task, "full").fit((x, y)).log_marginal_likelihood()


def _scaled(task: str, factor: float) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The trained MLP with its logits scaled by ``factor`` (last layer weights and bias)."""
    model, x, y = _trained(task)
    model = copy.deepcopy(model)
    with torch.no_grad():
        model[2].weight.mul_(factor)
        model[2].bias.mul_(factor)
    return model, x, y


def _laplace(model: nn.Module, task: str, structure: str, **options: object) -> gs.Laplace:
    lik = "binary" if task == "binary" else "classification"
    if structure == "lowrank":
        options.setdefault("rank", 6)
    return gs.Laplace(model, lik, structure, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("factor", [1.0, 10.0, 100.0])
@pytest.mark.parametrize("task", ["multiclass", "binary"])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("structure", STRUCTURES)
def test_discrete_label_evidence_is_at_most_zero(
    structure: str, subset: str, task: str, factor: float
) -> None:
    model, x, y = _scaled(task, factor)
    for correction in (None, True):  # the default and the correction forced on
        la = _laplace(model, task, structure, subset=subset, correction=correction)
        la.fit((x, y))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EvidenceWarning)
            for prior in (1e-6, 1e-2, 1.0, 1e3):
                assert float(la.log_marginal_likelihood(prior)) <= 0.0, (correction, prior)
            la.optimize_prior(n_steps=60)
            assert float(la.log_marginal_likelihood()) <= 0.0, correction
            la.optimize_prior(method="grid")
            assert float(la.log_marginal_likelihood()) <= 0.0, correction


def test_scaled_logits_full_drops_the_correction_with_a_warning() -> None:
    model, x, y = _scaled("multiclass", 10.0)
    on = _laplace(model, "multiclass", "full").fit((x, y))
    off = _laplace(model, "multiclass", "full", correction=False).fit((x, y))
    assert on.correction  # on by default for the full GGN
    with pytest.warns(EvidenceWarning, match="supremum 0"):
        value = on.log_marginal_likelihood(1e-3)
    # dropped: exactly the evidence without the correction (and <= 0)
    assert float(value) == pytest.approx(float(off.log_marginal_likelihood(1e-3)), rel=1e-12)
    assert float(value) < 0
    # the Newton model claims a log-likelihood above 0 there: what made log Z positive
    spec = on.spectrum("scalar")
    assert spec is not None and spec.correction_dropped(np.log([1e-3]))
    # warned once per fit, not at every tuning step
    with warnings.catch_warnings():
        warnings.simplefilter("error", EvidenceWarning)
        on.optimize_prior()
        on.log_marginal_likelihood()


def test_near_the_map_the_correction_is_kept() -> None:
    """At the MAP (trained with prior 1) the rule does not fire at moderate priors and the
    correction is the Newton gain 1/2 b^T A^-1 b >= 0."""
    model, x, y = _trained("multiclass")
    on = _laplace(model, "multiclass", "full").fit((x, y))
    off = _laplace(model, "multiclass", "full", correction=False).fit((x, y))
    with warnings.catch_warnings():
        warnings.simplefilter("error", EvidenceWarning)
        for prior in (0.3, 1.0, 3.0):
            gain = float(on.log_marginal_likelihood(prior) - off.log_marginal_likelihood(prior))
            assert gain >= 0.0


def test_spectral_and_dense_paths_apply_the_same_rule() -> None:
    """The closed-form tuning objective (gaussify.spectral) equals the evaluated evidence on
    both sides of the rule, so tuning cannot chase a value the evidence refuses."""
    model, x, y = _scaled("multiclass", 10.0)
    la = _laplace(model, "multiclass", "full", eig_cache=False).fit((x, y))  # Cholesky route
    spec = la.spectrum("scalar")
    assert spec is not None
    fired = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EvidenceWarning)
        for log_prior in np.linspace(math.log(1e-6), math.log(1e6), 13):
            value, _, _ = spec.evidence(np.array([log_prior]))
            dense = float(la.log_marginal_likelihood(math.exp(log_prior)))
            assert value == pytest.approx(dense, rel=1e-9, abs=1e-9)
            fired.add(spec.correction_dropped(np.array([log_prior])))
    assert True in fired


@pytest.mark.parametrize("correction", [None, True])
@pytest.mark.parametrize("structure", STRUCTURES)
def test_float32_evidence_equals_float64(structure: str, correction: bool | None) -> None:
    model64, x, y = _trained("multiclass")
    model32 = copy.deepcopy(model64).float()
    values = {}
    for dtype, model in ((torch.float32, model32), (torch.float64, model64)):
        la = _laplace(model, "multiclass", structure, correction=correction)
        la.fit((x.to(dtype), y))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EvidenceWarning)
            values[dtype] = [float(la.log_marginal_likelihood(p)) for p in PRIORS]
    for prior, v32, v64 in zip(PRIORS, values[torch.float32], values[torch.float64], strict=True):
        assert v64 <= 0.0
        assert v32 == pytest.approx(v64, rel=1e-4), (prior, v32, v64)


def test_float32_tuning_from_a_huge_prior_stays_possible() -> None:
    """Observed: optimize_prior from 1e12 on a float32 full Laplace ended at +4096."""
    model64, x, y = _trained("multiclass")
    la = _laplace(copy.deepcopy(model64).float(), "multiclass", "full", prior_precision=1e12)
    la.fit((x.float(), y))
    la.optimize_prior()
    assert float(la.log_marginal_likelihood()) <= 0.0


def test_supremum_of_each_likelihood() -> None:
    lik = gs.likelihoods.get_likelihood("regression", sigma_noise=0.5)
    sup = log_likelihood_supremum(lik, 10, 2, torch.tensor(0.5, dtype=DT), temperature=2.0)
    assert sup is not None
    assert float(sup) == pytest.approx(-10 * 2 * (math.log(0.5) + 0.5 * math.log(2 * math.pi)) / 2)
    for name in ("classification", "binary"):
        sup = log_likelihood_supremum(gs.likelihoods.get_likelihood(name), 10, 3)
        assert sup is not None and float(sup) == 0.0


def test_exact_gaussian_linear_model_never_drops_the_correction() -> None:
    """Bayesian linear regression at an arbitrary theta*: the full-GGN evidence with the
    correction is the exact evidence and the rule never fires, also for a tiny noise."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 3, generator=g, dtype=DT)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=DT) + 0.1 * torch.randn(
        30, 1, generator=g, dtype=DT
    )
    model = nn.Linear(3, 1).double()
    with torch.no_grad():
        model.weight.fill_(3.0)  # far from the MAP
    for sigma in (1e-3, 0.1, 1.0):
        la = gs.Laplace(model, "regression", "full", sigma_noise=sigma).fit((x, y))
        spec = la.spectrum("scalar")
        assert spec is not None
        with warnings.catch_warnings():
            warnings.simplefilter("error", EvidenceWarning)
            for prior in (1e-6, 1.0, 1e6):
                la.log_marginal_likelihood(prior)
                assert not spec.correction_dropped(np.log([prior]))


@pytest.mark.parametrize("factor", [1.0, 10.0, 100.0])
def test_function_space_evidence_obeys_the_same_rule(factor: float) -> None:
    """FunctionalLaplace and ELLA (all points as landmarks) equal the full-GGN Laplace
    evidence at any theta*, so they drop the impossible correction at the same priors, and
    class labels get log Z <= 0, also after tuning."""
    model, x, y = _scaled("multiclass", factor)
    la = _laplace(model, "multiclass", "full").fit((x, y))
    fl = gs.FunctionalLaplace(model, "classification").fit((x, y))
    ella = gs.ELLA(model, "classification", num_landmarks=x.shape[0], seed=0).fit((x, y))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EvidenceWarning)
        for prior in (1e-6, 1e-2, 1.0, 1e3):
            ref = float(la.log_marginal_likelihood(prior))
            assert ref <= 0.0
            assert float(fl.log_marginal_likelihood(prior)) == pytest.approx(ref, rel=1e-7)
            assert float(ella.log_marginal_likelihood(prior)) == pytest.approx(ref, rel=1e-7)
        for post in (fl, ella):
            post.optimize_prior(method="grid")
            assert float(post.log_marginal_likelihood()) <= 0.0


def test_function_space_drop_warns() -> None:
    model, x, y = _scaled("multiclass", 10.0)
    fl = gs.FunctionalLaplace(model, "classification").fit((x, y))
    with pytest.warns(EvidenceWarning, match="supremum 0"):
        fl.log_marginal_likelihood(1e-2)
    ella = gs.ELLA(model, "classification", num_landmarks=x.shape[0], seed=0).fit((x, y))
    with pytest.warns(EvidenceWarning, match="supremum 0"):
        ella.log_marginal_likelihood(1e-2)


def test_functional_laplace_float32_equals_float64() -> None:
    """Evaluated in float64 (the kernel cast): at small priors 1/2 v^T K v cancels against
    the Cholesky term. Below 1e-4 the float32 kernel itself (1e8 J J^T, not PSD to round-off)
    limits the agreement; there B = I + L^T K L can even fail to factorise, which raises."""
    model64, x, y = _trained("multiclass")
    values = {}
    for dtype in (torch.float32, torch.float64):
        model = copy.deepcopy(model64).to(dtype)
        fl = gs.FunctionalLaplace(model, "classification").fit((x.to(dtype), y))
        values[dtype] = [float(fl.log_marginal_likelihood(p)) for p in PRIORS[1:]]
    for prior, v32, v64 in zip(
        PRIORS[1:], values[torch.float32], values[torch.float64], strict=True
    ):
        assert v32 == pytest.approx(v64, rel=1e-4), (prior, v32, v64)


def test_ngvi_kl_of_a_float32_posterior_is_never_negative() -> None:
    """The ELBO's KL(q || p) >= 0: summed in float64 its large cancelling terms (tr(P0 Sigma)
    against P, the log-determinants) no longer make it negative (-0.00195 in float32)."""
    from gaussify.curvature.diag import DiagonalPrecision
    from gaussify.weight_space.ngvi_math import gaussian_kl

    g = torch.Generator().manual_seed(0)
    p = 5000
    mean = 1e-5 * torch.randn(p, generator=g, dtype=DT)
    ggn = 10 * torch.rand(p, generator=g, dtype=DT)
    for prior in (1e-2, 1e4, 1e8, 1e10):
        kl = {}
        for dtype in (torch.float32, torch.float64):
            pv = torch.full((p,), prior, dtype=dtype)
            kl[dtype] = float(
                gaussian_kl(mean.to(dtype), DiagonalPrecision(ggn.to(dtype) + pv), pv)
            )
        assert kl[torch.float32] >= 0.0
        assert kl[torch.float32] == pytest.approx(kl[torch.float64], rel=1e-3, abs=1e-3)
