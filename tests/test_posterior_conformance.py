"""Every posterior family against the protocol of :mod:`gaussify.posterior`.

One registry (``CASES``: a fitted-posterior family, ``HEADS``: the trained VBLL heads) runs
the same checks over every public posterior class: protocol membership, refusal before
``fit`` naming the fix, predict shapes and dtypes for float32 and float64 models,
determinism under a seed, bit-identical ``state_dict`` round trips into a fresh object,
a finite evidence where the family defines one, ``optimize_prior`` that does not lower it,
and a ``NotImplementedError`` naming the reason for each method a family declares
unsupported. ``test_registry_covers_every_public_posterior`` fails when a new public
posterior class is added without a case here.
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import gaussify as gs
from gaussify import approx_likelihoods, function_space, last_layer, weight_space
from gaussify.posterior import METHODS, Posterior, TrainedPosterior, capabilities

N, D, C = 24, 3, 3
DTYPES = (torch.float32, torch.float64)


def _problem(task: str, dtype: torch.dtype) -> tuple[nn.Module, tuple[Tensor, Tensor], Tensor]:
    """A tiny MLP (D -> 5 -> C), N training points and 7 test inputs, all in ``dtype``."""
    torch.manual_seed(0)
    out = 1 if task in ("regression", "binary") else C
    model = nn.Sequential(nn.Linear(D, 5), nn.Tanh(), nn.Linear(5, out)).to(dtype)
    x = torch.randn(N, D, dtype=dtype)
    if task == "regression":
        y: Tensor = torch.randn(N, 1, dtype=dtype)
    elif task == "binary":
        y = (x[:, :1] > 0).to(dtype)
    else:
        y = torch.randint(0, C, (N,))
    return model, (x, y), torch.randn(7, D, dtype=dtype)


def _features(dtype: torch.dtype) -> tuple[None, tuple[Tensor, Tensor], Tensor]:
    torch.manual_seed(1)
    phi = torch.randn(N, D, dtype=dtype)
    return None, (phi, torch.randint(0, C, (N,))), torch.randn(7, D, dtype=dtype)


@dataclass
class Case:
    """One posterior family. ``make(model, dtype)`` builds an unfitted posterior over
    ``model`` (None for families on features); ``fit(post, data)`` fits it."""

    name: str
    cls: type
    make: Callable[[Any, torch.dtype], Any]
    task: str = "classification"
    features: bool = False  # works on (phi, y) features instead of a network
    before_fit: str = "refuses"  # or "prior": q before fit is the prior / initial q
    fit: Callable[[Any, Any], Any] = field(default=lambda post, data: post.fit(data))
    mc: dict[str, Any] = field(default_factory=lambda: {"link": "mc", "num_samples": 8})
    predict_args: dict[str, Any] = field(default_factory=dict)
    optimize_args: dict[str, Any] = field(default_factory=dict)

    def problem(self, dtype: torch.dtype) -> tuple[Any, tuple[Tensor, Tensor], Tensor]:
        return _features(dtype) if self.features else _problem(self.task, dtype)


def _laplace(structure: str, subset: str, task: str = "classification") -> Case:
    def make(model: nn.Module, dtype: torch.dtype) -> gs.Laplace:
        chosen: Any = subset
        if subset == "subnetwork":  # every other weight of the network
            total = sum(p.numel() for p in model.parameters())
            chosen = torch.arange(0, total, 2)
        options = {"rank": 4} if structure == "lowrank" else {}
        return gs.Laplace(model, task, structure, chosen, prior_precision=0.5, **options)

    return Case(f"Laplace-{structure}-{subset}-{task}", gs.Laplace, make, task=task)


def _fit_valla(post: gs.VaLLA, data: Any) -> gs.VaLLA:
    return post.fit(data)


def _gp_fit(post: approx_likelihoods.GPClassifier, data: Any) -> Any:
    post.fit(*data, max_iter=5)
    return post


CASES: list[Case] = [
    *[
        _laplace(structure, subset)
        for structure in ("full", "diag", "kron", "lowrank")
        for subset in ("all", "last_layer", "subnetwork")
        if not (structure == "kron" and subset == "subnetwork")
    ],
    _laplace("full", "all", "regression"),
    _laplace("kron", "all", "binary"),
    Case(
        "FunctionalLaplace",
        gs.FunctionalLaplace,
        lambda m, dt: gs.FunctionalLaplace(m, "classification", prior_precision=0.5),
    ),
    Case(
        "FunctionalLaplace-regression",
        gs.FunctionalLaplace,
        lambda m, dt: gs.FunctionalLaplace(m, "regression", prior_precision=0.5),
        task="regression",
    ),
    Case(
        "ELLA",
        gs.ELLA,
        lambda m, dt: gs.ELLA(m, "classification", num_landmarks=6, prior_precision=0.5),
    ),
    Case(
        "SampledLLA",
        gs.SampledLLA,
        lambda m, dt: gs.SampledLLA(m, "classification", 0.5, num_samples=6, solver="solve"),
        mc={"num_samples": 6},
    ),
    Case(
        "VaLLA",
        gs.VaLLA,
        lambda m, dt: gs.VaLLA(m, "classification", num_inducing=4, max_steps=3, batch_size=8),
        fit=_fit_valla,
    ),
    *[
        Case(
            cls.__name__,
            cls,
            (lambda c: lambda m, dt: c(m, "classification", "diag", 0.5, num_data=N))(cls),
            before_fit="prior",
        )
        for cls in (gs.VOGGN, gs.OGGN, gs.LGVA, gs.GLMVI)
    ],
    Case(
        "ExactLastLayer",
        last_layer.ExactLastLayer,
        lambda m, dt: last_layer.ExactLastLayer(D, C, dtype=dt),
        features=True,
        before_fit="prior",
    ),
    Case(
        "ExactLastLayer-batch",
        last_layer.ExactLastLayer,
        lambda m, dt: last_layer.ExactLastLayer(D, C, dtype=dt, streaming=False),
        features=True,
        before_fit="prior",
    ),
    Case(
        "ADFLastLayer",
        last_layer.ADFLastLayer,
        lambda m, dt: last_layer.ADFLastLayer(
            D, C, dtype=dt, num_samples=8, generator=torch.Generator().manual_seed(0)
        ),
        features=True,
        before_fit="prior",
    ),
    Case(
        "GPClassifier",
        approx_likelihoods.GPClassifier,
        lambda m, dt: approx_likelihoods.GPClassifier(dtype=dt),
        features=True,
        fit=_gp_fit,
        optimize_args={"max_iter": 5},
    ),
]

HEADS: list[Callable[[], nn.Module]] = [
    lambda: last_layer.VBLLRegression(D, 2, 0.1),
    lambda: last_layer.VBLLStudentTRegression(D, 2, 0.1),
    lambda: last_layer.VBLLHeteroscedasticRegression(D, 2, 0.1),
    lambda: last_layer.VBLLDiscriminative(D, C, 0.1),
    lambda: last_layer.VBLLStudentTDiscriminative(D, C, 0.1),
    lambda: last_layer.VBLLHeteroscedasticDiscriminative(D, C, 0.1),
    lambda: last_layer.VBLLGenerative(D, C, 0.1),
    lambda: last_layer.GBLLRegression(D, 2),
]

#: public classes that are not posteriors (or not here), each with the reason
NOT_POSTERIORS: dict[str, str] = {
    "NaturalGradientVI": "abstract base of VOGGN / OGGN / LGVA / GLMVI (refuses construction)",
    "VBLLHead": "abstract base of the VBLL heads",
    "SGDLastLayer": "a point estimate trained by SGD (the paper's baseline), no posterior",
    "GVBLLMAP": "a MAP point estimate of the generative head's parameters",
    "GaussianApproxLoss": "a training loss on Gaussian pseudo-targets",
    "VBLLOutput": "the result object of a head's forward pass",
    "BNNOutput": "the result object of VBLLBNN's forward pass",
    "VBLLBNN": "a network of mean-field layers and a VBLL head (the head is covered in HEADS)",
    "MeanFieldLinear": "a mean-field layer of VBLLBNN, trained inside it",
    "Predictive": "the predictive result every posterior returns",
}


def _case_id(case: Case) -> str:
    return case.name


def _fitted(case: Case, dtype: torch.dtype) -> tuple[Any, Any, Any, Tensor]:
    model, data, x = case.problem(dtype)
    post = case.make(model, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ConvergenceWarning of the few-step fits
        case.fit(post, data)
    return post, model, data, x


def _predict(case: Case, post: Any, x: Tensor, **kwargs: Any) -> Any:
    return post.predict(x, **{**case.predict_args, **kwargs})


def _seeded_predict(case: Case, post: Any, x: Tensor) -> Any:
    """predict with its random draws (MC links, NN samples) from a generator seeded alike."""
    if "generator" in inspect.signature(post.predict).parameters:
        return _predict(case, post, x, generator=torch.Generator().manual_seed(7))
    return _predict(case, post, x)


def _same(a: Any, b: Any) -> None:
    """Bit-identical predictives."""
    for name in ("f_mean", "f_cov", "probs", "mean", "var"):
        u, v = getattr(a, name, None), getattr(b, name, None)
        assert (u is None) == (v is None), name
        if isinstance(u, Tensor):
            assert torch.equal(u, v), name


# ---------------------------------------------------------------------------- registry


def _public_classes() -> dict[str, type]:
    found: dict[str, type] = {}
    for module in (gs, weight_space, function_space, last_layer, approx_likelihoods):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj):
                found.setdefault(obj.__name__, obj)
    return found


def _looks_like_posterior(cls: type) -> bool:
    has = any(hasattr(cls, m) for m in ("predict", "train_loss", "to_predictive"))
    named = any(k in cls.__name__ for k in ("Laplace", "LLA", "VI", "VBLL", "LastLayer"))
    return has or named


def test_registry_covers_every_public_posterior() -> None:
    covered = {case.cls.__name__ for case in CASES} | {type(h()).__name__ for h in HEADS}
    candidates = {n for n, c in _public_classes().items() if _looks_like_posterior(c)}
    missing = candidates - covered - set(NOT_POSTERIORS)
    assert not missing, f"posterior classes without a conformance case: {sorted(missing)}"
    stale = set(NOT_POSTERIORS) - set(_public_classes())
    assert not stale, f"NOT_POSTERIORS names classes that are no longer public: {stale}"


# ---------------------------------------------------------------------------- protocol


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_is_a_posterior_and_declares_its_gaps(case: Case) -> None:
    model, _data, _x = case.problem(torch.float64)
    post = case.make(model, torch.float64)
    assert isinstance(post, Posterior)
    supported = capabilities(post)
    for method in set(METHODS) - supported:
        reason = case.cls.unsupported[method]
        with pytest.raises(NotImplementedError, match=f"{case.cls.__name__}.{method}: not sup"):
            getattr(post, method)()
        # the reason names what to use instead
        assert re.search(r"\b(use|call|tune|choose)\b", reason), reason
    assert {"fit", "predict", "state_dict", "load_state_dict"} <= supported


def test_declared_capabilities_refuse_misdeclarations() -> None:
    from gaussify.posterior import DeclaredCapabilities

    with pytest.raises(TypeError, match="'evidence' is not in"):
        type("Bad", (DeclaredCapabilities,), {"unsupported": {"evidence": "x"}})
    with pytest.raises(TypeError, match="'sample' is declared unsupported but defined"):
        type("Bad", (DeclaredCapabilities,), {"unsupported": {"sample": "x"}, "sample": len})


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_before_fit(case: Case) -> None:
    model, _data, x = case.problem(torch.float64)
    post = case.make(model, torch.float64)
    if case.before_fit == "refuses":
        with pytest.raises(RuntimeError, match=r"call fit\(.*\) first|call fit\(data\) before"):
            post.predict(x)
        with pytest.raises(RuntimeError, match="fit"):
            post.state_dict()
        if "sample" in capabilities(post):
            with pytest.raises(RuntimeError, match="fit"):
                post.sample(2)
    else:  # q before fit is the prior (last layers) or the initial q_0 (NGVI): usable
        pred = post.predict(x)
        assert bool(torch.isfinite(pred.f_mean).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fit_predict_sample_shapes_and_dtypes(case: Case, dtype: torch.dtype) -> None:
    post, _model, _data, x = _fitted(case, dtype)
    pred = _predict(case, post, x)
    assert isinstance(pred, gs.Predictive)
    outputs = 1 if case.task in ("regression", "binary") else C
    assert pred.f_mean.shape == (7, outputs)
    assert pred.f_mean.dtype == dtype
    if pred.f_cov is not None:  # sample-based predictives carry the samples instead
        assert pred.f_cov.shape == (7, outputs, outputs)
    if case.task == "classification":
        assert pred.probs is not None and pred.probs.shape == (7, C)
        assert pred.probs.dtype == dtype
        torch.testing.assert_close(
            pred.probs.sum(-1), torch.ones(7, dtype=dtype), rtol=0, atol=1e-5
        )
    if "sample" in capabilities(post):
        draws = post.sample(3)
        assert draws.ndim == 2 and draws.shape[0] == 3
        assert draws.dtype == dtype
        assert bool(torch.isfinite(draws).all())


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_deterministic_under_a_seed(case: Case) -> None:
    post, _model, _data, x = _fitted(case, torch.float64)
    if "sample" in capabilities(post):
        a = post.sample(4, torch.Generator().manual_seed(3))
        b = post.sample(4, torch.Generator().manual_seed(3))
        assert torch.equal(a, b)
    if case.task != "regression" and not isinstance(post, gs.SampledLLA):
        a = _predict(case, post, x, generator=torch.Generator().manual_seed(5), **case.mc)
        b = _predict(case, post, x, generator=torch.Generator().manual_seed(5), **case.mc)
        _same(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_state_round_trip_is_bit_identical(case: Case, dtype: torch.dtype) -> None:
    post, model, _data, x = _fitted(case, dtype)
    state = post.state_dict()
    fresh = case.make(model, dtype)
    fresh.load_state_dict(state)
    _same(_seeded_predict(case, post, x), _seeded_predict(case, fresh, x))
    if "sample" in capabilities(post):
        a = post.sample(3, torch.Generator().manual_seed(1))
        b = fresh.sample(3, torch.Generator().manual_seed(1))
        assert torch.equal(a, b)
    if "log_marginal_likelihood" in capabilities(post):
        assert torch.equal(post.log_marginal_likelihood(), fresh.log_marginal_likelihood())


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if "log_marginal_likelihood" in capabilities(c.cls)],
    ids=_case_id,
)
def test_evidence_finite_and_not_lowered_by_optimize_prior(case: Case) -> None:
    post, _model, data, _x = _fitted(case, torch.float64)
    before = post.log_marginal_likelihood()
    assert before.shape == () and bool(torch.isfinite(before))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = post.optimize_prior(data, **case.optimize_args)
    assert out is post
    after = post.log_marginal_likelihood()
    assert bool(torch.isfinite(after))
    assert float(after) >= float(before) - 1e-8 * max(1.0, abs(float(before)))


@pytest.mark.parametrize(
    "case",
    [
        c
        for c in CASES
        if "optimize_prior" in capabilities(c.cls)
        and "log_marginal_likelihood" not in capabilities(c.cls)
    ],
    ids=_case_id,
)
def test_optimize_prior_without_an_evidence_returns_the_tuned_posterior(case: Case) -> None:
    post, _model, data, x = _fitted(case, torch.float64)
    before = post.prior_precision.clone()
    assert post.optimize_prior(data, **case.optimize_args) is post
    assert not torch.equal(post.prior_precision, before)
    assert bool(torch.isfinite(_predict(case, post, x).f_mean).all())


# ---------------------------------------------------------------------------- VBLL heads


def _head_id(make: Callable[[], nn.Module]) -> str:
    return type(make()).__name__


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("make", HEADS, ids=_head_id)
def test_trained_heads(make: Callable[[], nn.Module], dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    head = make().to(dtype)
    assert isinstance(head, TrainedPosterior)
    assert not isinstance(head, Posterior)  # trained with the network: no fit / evidence
    phi = torch.randn(6, D, dtype=dtype)
    pred = head.predict(phi)
    assert isinstance(pred, gs.Predictive)
    assert pred.f_mean.dtype == dtype and pred.f_mean.shape[0] == 6
    a = head.sample(4, torch.Generator().manual_seed(2))
    assert torch.equal(a, head.sample(4, torch.Generator().manual_seed(2)))
    assert a.dtype == dtype and a.shape[0] == 4
    mean = head.W().mean  # the draws scatter around q(W)'s mean
    assert a.shape[1] == mean.numel()
    y = torch.randn(6, 2, dtype=dtype) if head.task == "regression" else torch.randint(0, C, (6,))
    loss = head.train_loss(phi, y)
    assert loss.shape == () and bool(torch.isfinite(loss))
    fresh = make().to(dtype)
    fresh.load_state_dict(head.state_dict())
    torch.manual_seed(4)  # the heads' MC predictives draw from the global generator
    before = head.predict(phi)
    torch.manual_seed(4)
    _same(before, fresh.predict(phi))
    assert torch.equal(a, fresh.sample(4, torch.Generator().manual_seed(2)))
