"""Guards at the library's boundary (issue 16, point 4, second half):

* size guards refuse a super-linear allocation before it is attempted, naming its size and
  the alternatives (:mod:`gaussify.memory_guard`);
* a model ending in a softmax / log-softmax / sigmoid given to a classification or binary
  likelihood warns (:class:`gaussify.warnings.SquashedOutputWarning`);
* every fit / predict restores the model's per-module train/eval flags, also when it raises;
* ``sigma_noise`` other than 1 for a likelihood without observation noise raises, and a
  one-element ``sigma_noise`` tensor is the scalar it holds.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import gaussify as gs
from gaussify import memory_guard
from gaussify.approx_likelihoods import GPClassifier
from gaussify.last_layer import ExactLastLayer
from gaussify.memory_guard import AllocationError, check_allocation, max_bytes
from gaussify.model_checks import eval_mode, last_module
from gaussify.warnings import SquashedOutputWarning


def _mlp(d_in: int = 2, hidden: int = 8, c: int = 3, *, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, c)).double()


def _data(n: int = 24, d_in: int = 2, c: int = 3, *, task: str = "classification", seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=gen, dtype=torch.float64)
    if task == "classification":
        return x, torch.randint(0, c, (n,), generator=gen)
    return x, torch.randn(n, c, generator=gen, dtype=torch.float64)


# ---------------------------------------------------------------------------- size guards


def test_check_allocation_limit_is_inclusive_and_message_names_size_and_alternatives() -> None:
    # 1000 float64 numbers = 8000 bytes: allowed at a limit of 8000, refused at 7999
    assert check_allocation(1000, torch.float64, "thing", "other", limit=8000) == 8000
    with pytest.raises(AllocationError) as info:
        check_allocation(1000, torch.float64, "thing X", ["diag", "kron"], limit=7999)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, MemoryError)
    assert err.num_bytes == 8000 and err.limit == 7999
    assert str(err).startswith("thing X needs 8.0 kB (1,000 torch.float64 numbers)")
    assert "use diag, kron instead" in str(err)


def test_limit_sources_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(memory_guard.ENV_VAR, "1000")
    assert memory_guard.allocation_limit()[0] == 1000.0
    with max_bytes(5e9):  # the module setting wins over the environment
        assert memory_guard.allocation_limit()[0] == 5e9
        with pytest.raises(AllocationError, match=r"gaussify\.memory_guard\.MAX_BYTES"):
            check_allocation(10**9, torch.float64, "x", "y")
    with pytest.raises(AllocationError, match=f"environment variable {memory_guard.ENV_VAR}"):
        check_allocation(1000, torch.float32, "x", "y")
    monkeypatch.setenv(memory_guard.ENV_VAR, "inf")
    assert check_allocation(10**15, torch.float32, "x", "y") == 4 * 10**15
    monkeypatch.setenv(memory_guard.ENV_VAR, "lots")
    with pytest.raises(ValueError, match="GAUSSIFY_MAX_BYTES: expected a number of bytes"):
        check_allocation(1, torch.float32, "x", "y")
    monkeypatch.delenv(memory_guard.ENV_VAR)
    # default: a fraction of the memory available now (read once: a fixed reading here, since
    # the machine's free memory moves between two reads under load)
    available = memory_guard.available_bytes()
    if available is not None:
        monkeypatch.setattr(memory_guard, "available_bytes", lambda device=None: available)
        limit, source = memory_guard.allocation_limit()
        assert limit == memory_guard.DEFAULT_FRACTION * available
        assert "available" in source


def test_full_laplace_with_312k_parameters_refused_before_allocating_389_gb() -> None:
    """The issue's example: P = 312,100 makes the P x P GGN 389.6 GB in float32, and 779.3 GB
    as it is accumulated now (in float64 also for a float32 model, for the evidence's
    precision). The guard refuses it at the start of fit (the data is never read, the
    posterior stays unfitted); main asked the allocator for 389,625,640,000 bytes."""
    torch.manual_seed(0)
    model = nn.Linear(3120, 100)
    assert sum(p.numel() for p in model.parameters()) == 312_100
    read = []

    def data():
        read.append(1)
        yield torch.randn(4, 3120), torch.randint(0, 100, (4,))

    la = gs.Laplace(model, "classification", structure="full")
    with max_bytes(64e9), pytest.raises(AllocationError) as info:
        la.fit(data())
    msg = str(info.value)
    assert "structure='full': the P x P GGN (P = 312,100 parameters) needs 779.3 GB" in msg
    assert "structure='diag', 'kron' or 'lowrank'" in msg and "subset" in msg
    assert info.value.num_bytes == 312_100**2 * 8
    assert read == [] and la._curvature is None
    with max_bytes(64e9):  # the same model fits with the diagonal structure
        gs.Laplace(model, "classification", structure="diag").fit(data())


def test_full_guard_uses_the_default_limit_without_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(memory_guard.ENV_VAR, raising=False)
    monkeypatch.setattr(memory_guard, "available_bytes", lambda device=None: 10**9)
    model = nn.Linear(3120, 100)
    with pytest.raises(AllocationError, match=r"limit of 500\.0 MB \(0\.5 of the 1\.0 GB"):
        gs.Laplace(model, "classification", structure="full").fit(
            (torch.randn(4, 3120), torch.randint(0, 100, (4,)))
        )


@pytest.mark.parametrize("structure", ["full", "kron", "diag", "lowrank"])
def test_small_models_pass_and_dense_views_are_guarded(structure: str) -> None:
    model = _mlp()
    x, y = _data()
    p = sum(t.numel() for t in model.parameters())  # 51
    with max_bytes(p * p * 8):  # exactly one P x P float64 matrix: allowed
        la = gs.Laplace(model, "classification", structure=structure).fit((x, y))
        assert la.posterior_covariance.shape == (p, p)
    with max_bytes(p * p * 8 - 1):
        with pytest.raises(AllocationError, match="posterior_covariance: the dense P x P matrix"):
            _ = la.posterior_covariance
        with pytest.raises(AllocationError, match="posterior_precision"):
            _ = la.posterior_precision
        assert la.posterior_variance.shape == (p,)  # the diagonal is not guarded
        la.predict(x)


def test_kron_factor_of_a_wide_layer_is_refused() -> None:
    model = nn.Sequential(nn.Linear(2000, 2))
    with max_bytes(1e6), pytest.raises(AllocationError) as info:
        gs.Laplace(model, "classification", structure="kron").fit(
            (torch.randn(3, 2000), torch.tensor([0, 1, 0]))
        )
    # factors 2001^2 + 2^2 float32 numbers
    assert info.value.num_bytes == (2001**2 + 4) * 4
    assert "Kronecker factors (largest: '0', side 2,001)" in str(info.value)
    assert "structure='diag' or 'lowrank'" in str(info.value)
    with max_bytes(1e6):  # the diagonal structure fits
        gs.Laplace(model, "classification", structure="diag").fit(
            (torch.randn(3, 2000), torch.tensor([0, 1, 0]))
        )


def test_joint_predictive_refused_before_the_jacobian() -> None:
    model = _mlp()
    x, y = _data()
    la = gs.Laplace(model, "classification", structure="diag").fit((x, y))
    xt = torch.randn(200, 2, dtype=torch.float64)
    rows, p = 600, la.subset.num_params
    with max_bytes((rows * rows + rows * p) * 8 - 1), pytest.raises(AllocationError) as info:
        la.predict(xt, joint=True)
    assert "joint=True: the (N C)^2 joint covariance" in str(info.value)
    assert "N C = 600" in str(info.value) and "joint=False" in str(info.value)
    with max_bytes((rows * rows + rows * p) * 8):
        assert la.predict(xt, joint=True).joint_cov.shape == (rows, rows)


def _function_space_cases() -> list[tuple[str, Callable[[nn.Module], Any], str]]:
    return [
        ("FunctionalLaplace", lambda m: gs.FunctionalLaplace(m, "classification"), "(N C)^2"),
        ("ELLA", lambda m: gs.ELLA(m, "classification", num_landmarks=20), "(M C)^2"),
        (
            "VaLLA",
            lambda m: gs.VaLLA(
                m, "classification", None, inducing_points=_data(20)[0], epochs=1, max_steps=1
            ),
            "(M C)^2",
        ),
        (
            "SampledLLA",
            lambda m: gs.SampledLLA(m, "classification", num_samples=2, solver="solve"),
            "P x P",
        ),
        ("VOGGN", lambda m: gs.VOGGN(m, "classification", structure="full"), "P x P"),
    ]


@pytest.mark.parametrize("case", _function_space_cases(), ids=lambda c: c[0])
def test_every_family_refuses_its_quadratic_allocation(case: tuple) -> None:
    _, build, shape = case
    model = _mlp()
    x, y = _data(n=40)
    # 2 kB: every quadratic object above is larger
    with max_bytes(2000), pytest.raises(AllocationError, match=re.escape(shape)) as info:
        build(model).fit((x, y))
    assert "instead" in str(info.value)
    with max_bytes(1e8):  # and they fit under a normal limit
        build(model).fit((x, y))


def test_gp_classifier_and_exact_last_layer_refused() -> None:
    x = torch.randn(300, 2, dtype=torch.float64)
    y = torch.randint(0, 3, (300,))
    with max_bytes(1e6), pytest.raises(AllocationError, match="the 3 N x N kernel") as info:
        GPClassifier().fit(x, y, optimize=False)
    assert info.value.num_bytes == 3 * 300 * 300 * 8
    with max_bytes(3 * 300 * 300 * 8 + 10**6):
        GPClassifier().fit(x, y, optimize=False)
    with max_bytes(1e6), pytest.raises(AllocationError, match=r"10 \(D\+1\) x \(D\+1\)"):
        ExactLastLayer(500, 10)
    assert ExactLastLayer(50, 10).num_features == 51


# ---------------------------------------------------------------------------- squashed outputs


def _labels(task: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, 2, dtype=torch.float64)
    if task == "binary":
        return x, torch.randint(0, 2, (8, 1)).double()
    return x, torch.randint(0, 3, (8,))


def _constructors() -> list[tuple[str, Callable[[nn.Module, str], Any]]]:
    return [
        ("Laplace", lambda m, t: gs.Laplace(m, t)),
        ("FunctionalLaplace", lambda m, t: gs.FunctionalLaplace(m, t)),
        ("ELLA", lambda m, t: gs.ELLA(m, t)),
        ("SampledLLA", lambda m, t: gs.SampledLLA(m, t)),
        ("VaLLA", lambda m, t: gs.VaLLA(m, t)),
        ("VOGGN", lambda m, t: gs.VOGGN(m, t, structure="diag")),
        ("LGVA", lambda m, t: gs.LGVA(m, t, structure="diag")),
        ("OGGN", lambda m, t: gs.OGGN(m, t, structure="diag")),
        ("GLMVI", lambda m, t: gs.GLMVI(m, t, structure="diag")),
        ("train_map", lambda m, t: gs.train_map(m, _labels(t), t, epochs=1)),
    ]


@pytest.mark.parametrize("build", _constructors(), ids=lambda c: c[0])
@pytest.mark.parametrize(
    ("task", "squash", "c"),
    [
        ("classification", nn.Softmax(dim=-1), 3),
        ("classification", nn.LogSoftmax(dim=-1), 3),
        ("binary", nn.Sigmoid(), 1),
    ],
)
def test_squashed_output_warns_in_every_family(build: tuple, task: str, squash: nn.Module, c: int):
    model = nn.Sequential(_mlp(c=c), squash)  # nested: the last leaf is the squashing module
    with pytest.warns(SquashedOutputWarning, match=f"nn.{type(squash).__name__}"):
        build[1](model, task)


@pytest.mark.parametrize("build", _constructors()[:5], ids=lambda c: c[0])
def test_logits_and_regression_do_not_warn(build: tuple) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", SquashedOutputWarning)
        build[1](_mlp(), "classification")
        build[1](nn.Sequential(_mlp(), nn.Softmax(-1)), "regression")


def test_squashed_predictive_is_bounded_by_e_over_e_plus_c_minus_1() -> None:
    """Why it warns: softmax of probabilities p in [0, 1] is at most e / (e + C - 1)."""
    model = nn.Sequential(_mlp(c=5), nn.Softmax(dim=-1))
    x, y = _data(c=5)
    with pytest.warns(SquashedOutputWarning):
        la = gs.Laplace(model, "classification", structure="diag").fit((x, y))
    assert float(la.predict(x).probs.max()) <= math.e / (math.e + 4) + 1e-12
    assert last_module(model) is model[1]
    # trailing modules that leave values unchanged are looked through
    flat = nn.Sequential(nn.Linear(2, 3), nn.LogSoftmax(-1), nn.Flatten(), nn.Identity())
    assert isinstance(last_module(flat), nn.LogSoftmax)
    assert isinstance(last_module(nn.Linear(2, 3)), nn.Linear)


# ---------------------------------------------------------------------------- train/eval mode


def _mixed_mode_model(c: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(2, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, c)
    ).double()
    model.train()
    model[3].eval()  # a frozen submodule inside a model in training mode
    return model


def _flags(model: nn.Module) -> list[bool]:
    return [m.training for m in model.modules()]


def _mode_cases() -> list[tuple[str, Callable[[nn.Module, Any], Any]]]:
    return [
        ("Laplace.fit", lambda m, d: gs.Laplace(m, "classification", structure="diag").fit(d)),
        (
            "Laplace.refine",
            lambda m, d: (
                gs.Laplace(m, "classification", structure="diag").fit(d).refine(d, max_iter=1)
            ),
        ),
        ("FunctionalLaplace.fit", lambda m, d: gs.FunctionalLaplace(m, "classification").fit(d)),
        ("ELLA.fit", lambda m, d: gs.ELLA(m, "classification", num_landmarks=5).fit(d)),
        (
            "SampledLLA.fit",
            lambda m, d: gs.SampledLLA(m, "classification", num_samples=2, epochs=1).fit(d),
        ),
        (
            "VaLLA.fit",
            lambda m, d: gs.VaLLA(m, "classification", num_inducing=5, max_steps=1).fit(d),
        ),
        ("VOGGN.fit", lambda m, d: gs.VOGGN(m, "classification", structure="diag").fit(d)),
        ("GLMVI.init_laplace", lambda m, d: gs.GLMVI(m, "classification").init_laplace(d)),
    ]


@pytest.mark.parametrize("case", _mode_cases(), ids=lambda c: c[0])
def test_fit_restores_every_module_mode(case: tuple) -> None:
    model = _mixed_mode_model()
    before = _flags(model)
    assert before == [True, True, True, True, False, True, True]
    x, y = _data()
    post = case[1](model, (x, y))
    assert _flags(model) == before
    # predictions run in eval mode (dropout off) and leave the flags alone as well
    if hasattr(post, "predict") and not isinstance(post, gs.SampledLLA | gs.VaLLA):
        p1 = post.predict(x[:4], generator=torch.Generator().manual_seed(0)).probs
        assert _flags(model) == before
        assert torch.equal(
            p1, post.predict(x[:4], generator=torch.Generator().manual_seed(0)).probs
        )


@pytest.mark.parametrize("case", _mode_cases(), ids=lambda c: c[0])
def test_fit_that_raises_restores_every_module_mode(case: tuple) -> None:
    model = _mixed_mode_model()
    before = _flags(model)
    _, y = _data()
    wide = torch.randn(y.shape[0], 5, dtype=torch.float64)  # the model takes 2 inputs
    with pytest.raises((ValueError, RuntimeError)):
        case[1](model, (wide, y))
    assert _flags(model) == before


def test_laplace_predict_after_fit_matches_eval_mode_predictions() -> None:
    model = _mixed_mode_model()
    x, y = _data()
    la = gs.Laplace(model, "classification", structure="kron").fit((x, y))
    assert model.training
    train_mode = la.predict(x)
    model.eval()
    assert torch.allclose(train_mode.probs, la.predict(x).probs, atol=0, rtol=0)


def test_eval_mode_context_restores_on_exception() -> None:
    model = _mixed_mode_model()
    before = _flags(model)
    with pytest.raises(RuntimeError), eval_mode(model):
        assert not any(_flags(model))
        raise RuntimeError("boom")
    assert _flags(model) == before


# ---------------------------------------------------------------------------- sigma_noise


def _sigma_families() -> list[tuple[str, Callable[..., Any]]]:
    return [
        ("Laplace", lambda m, t, s: gs.Laplace(m, t, sigma_noise=s)),
        ("FunctionalLaplace", lambda m, t, s: gs.FunctionalLaplace(m, t, sigma_noise=s)),
        ("ELLA", lambda m, t, s: gs.ELLA(m, t, sigma_noise=s, num_landmarks=10)),
        ("SampledLLA", lambda m, t, s: gs.SampledLLA(m, t, sigma_noise=s, num_samples=2)),
        ("VaLLA", lambda m, t, s: gs.VaLLA(m, t, sigma_noise=s, num_inducing=10)),
        ("VOGGN", lambda m, t, s: gs.VOGGN(m, t, structure="diag", sigma_noise=s)),
        ("GLMVI", lambda m, t, s: gs.GLMVI(m, t, structure="diag", sigma_noise=s)),
        ("train_map", lambda m, t, s: gs.train_map(m, _labels(t), t, sigma_noise=s, epochs=1)),
        ("get_likelihood", lambda m, t, s: gs.get_likelihood(t, sigma_noise=s)),
    ]


@pytest.mark.parametrize("family", _sigma_families(), ids=lambda c: c[0])
@pytest.mark.parametrize("task", ["classification", "binary"])
@pytest.mark.parametrize("sigma", [2.0, torch.tensor([0.5, 0.5, 0.5])])
def test_sigma_noise_for_a_likelihood_without_noise_raises(family, task, sigma) -> None:
    model = _mlp(c=3 if task == "classification" else 1)
    with pytest.raises(ValueError, match="sigma_noise: only a regression"):
        family[1](model, task, sigma)
    family[1](model, task, 1.0)  # the default value is accepted
    family[1](model, task, torch.tensor([1.0]))


def test_sigma_noise_setter_and_likelihood_objects() -> None:
    la = gs.Laplace(_mlp(), "classification")
    with pytest.raises(ValueError, match=r"sigma_noise: .*'classification' likelihood"):
        la.sigma_noise = 0.3
    la.sigma_noise = 1.0
    with pytest.raises(ValueError, match="sigma_noise"):
        gs.Laplace(_mlp(c=1), gs.Bernoulli(), sigma_noise=3.0)


def test_one_element_sigma_tensor_is_a_scalar_for_the_gaussian_likelihood() -> None:
    f = torch.randn(5, 2, dtype=torch.float64)
    y = torch.randn(5, 2, dtype=torch.float64)
    lik = gs.Gaussian(torch.tensor([0.5], dtype=torch.float64))
    assert lik.sigma_noise.shape == ()
    ref = gs.Gaussian(0.5)
    assert torch.allclose(lik.log_prob(f, y), ref.log_prob(f, y), rtol=0, atol=1e-14)
    assert torch.allclose(lik.hessian(f), ref.hessian(f))
    sigma = torch.tensor([0.5], dtype=torch.float64, requires_grad=True)
    gs.Gaussian(sigma).log_prob(f, y).sum().backward()  # stays differentiable
    assert sigma.grad is not None and sigma.grad.shape == (1,)


@pytest.mark.parametrize("structure", ["full", "kron"])
def test_one_element_sigma_tensor_laplace_equals_scalar(structure: str) -> None:
    x, y = _data(task="regression", c=2)
    one = gs.Laplace(
        _mlp(c=2), "regression", structure=structure, sigma_noise=torch.tensor([0.7])
    ).fit((x, y))
    ref = gs.Laplace(_mlp(c=2), "regression", structure=structure, sigma_noise=0.7).fit((x, y))
    assert one.sigma_noise.shape == ()
    assert torch.allclose(one.log_marginal_likelihood(), ref.log_marginal_likelihood())
    assert torch.allclose(one.predict(x).var, ref.predict(x).var)
    one.sigma_noise = torch.tensor([0.9])  # the setter too
    assert one.sigma_noise.shape == ()


@pytest.mark.parametrize(
    "build",
    [
        lambda m, s: gs.FunctionalLaplace(m, "regression", sigma_noise=s),
        lambda m, s: gs.ELLA(m, "regression", sigma_noise=s, num_landmarks=10),
        lambda m, s: gs.VOGGN(m, "regression", structure="diag", sigma_noise=s),
    ],
    ids=["FunctionalLaplace", "ELLA", "VOGGN"],
)
def test_one_element_sigma_tensor_in_other_families(build: Callable[..., Any]) -> None:
    x, y = _data(task="regression", c=2)
    one = build(_mlp(c=2), torch.tensor([0.7], dtype=torch.float64)).fit((x, y))
    ref = build(_mlp(c=2), 0.7).fit((x, y))
    assert one.sigma_noise.shape == ()
    assert torch.allclose(one.predict(x).var, ref.predict(x).var)


def test_explain_restores_every_module_mode() -> None:
    model = _mixed_mode_model()
    before = _flags(model)
    x, y = _data()
    gs.function_space.explain(model, x[:2], x, y, top_k=2)
    assert _flags(model) == before
