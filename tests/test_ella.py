"""ELLA (Nystrom linearised Laplace, Deng et al. 2022) against the exact functional Laplace:
exact with all training points as landmarks (where the Nystrom kernel is exact), never more
predictive variance than the exact GP with fewer, and hyperparameter changes after fitting."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from gaussify.function_space.ella import ELLA, nystrom_projection, select_landmarks
from gaussify.function_space.gp import FunctionalLaplace
from gaussify.function_space.ntk import ntk

DT = torch.float64
N = 30
CASES = {"regression": 1, "classification": 3, "binary": 1}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # tiny tensors: thread start-up costs more than it saves (much more on a loaded machine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _problem(task: str, hidden: int = 6) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, CASES[task]))
    model = model.double().eval()
    x = torch.randn(N, 2, generator=g, dtype=DT)
    if task == "regression":
        y = torch.sin(2 * x[:, :1]) + 0.3 * torch.randn(N, 1, generator=g, dtype=DT)
    elif task == "classification":
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    else:
        y = (x[:, :1] * x[:, 1:] > 0).to(DT)
    return model, x, y


XT = torch.randn(6, 2, generator=torch.Generator().manual_seed(5), dtype=DT)


@pytest.mark.parametrize("task", list(CASES))
def test_all_landmarks_equal_the_exact_gp(task: str) -> None:
    # P = 25 (regression, binary) or 39 (3 classes) <= N C: the training Jacobians span the
    # parameters, so the Nystrom kernel is exact at every input
    model, x, y = _problem(task)
    sigma = 0.5 if task == "regression" else 1.0  # only regression has observation noise
    exact = FunctionalLaplace(model, task, prior_precision=0.7, sigma_noise=sigma).fit((x, y))
    ella = ELLA(model, task, num_landmarks=N, prior_precision=0.7, sigma_noise=sigma).fit((x, y))
    p_e, p_n = exact.predict(XT), ella.predict(XT)
    torch.testing.assert_close(p_n.f_mean, p_e.f_mean)
    torch.testing.assert_close(p_n.f_cov, p_e.f_cov, atol=1e-8, rtol=0)
    torch.testing.assert_close(
        ella.log_marginal_likelihood(), exact.log_marginal_likelihood(), atol=1e-8, rtol=0
    )
    # a new scalar prior (and noise) after fitting equals refitting with it
    torch.testing.assert_close(
        ella.log_marginal_likelihood(2.0, 0.3),
        exact.log_marginal_likelihood(2.0, 0.3),
        atol=1e-8,
        rtol=0,
    )


def test_all_landmarks_with_more_parameters_than_outputs() -> None:
    # P = 45 > N C = 30: training kernel (hence evidence) exact, test variance only below
    model, x, y = _problem("binary", hidden=11)
    exact = FunctionalLaplace(model, "binary", prior_precision=0.7).fit((x, y))
    ella = ELLA(model, "binary", num_landmarks=N, prior_precision=0.7).fit((x, y))
    torch.testing.assert_close(
        ella.log_marginal_likelihood(), exact.log_marginal_likelihood(), atol=1e-8, rtol=0
    )
    gap = exact.predict(XT).f_var - ella.predict(XT).f_var
    assert bool((gap > -1e-10).all())


@pytest.mark.parametrize("landmarks", ["random", "kmeans"])
@pytest.mark.parametrize("task", ["regression", "classification"])
def test_fewer_landmarks_never_exceed_the_exact_variance(task: str, landmarks: str) -> None:
    model, x, y = _problem(task)
    exact = FunctionalLaplace(model, task, prior_precision=0.7).fit((x, y)).predict(XT)
    for m in (4, 12):
        ella = ELLA(model, task, num_landmarks=m, landmarks=landmarks, prior_precision=0.7)
        pred = ella.fit((x, y)).predict(XT)
        # the Nystrom kernel is below the exact one in the PSD order, and so is the posterior
        diff = exact.f_cov - pred.f_cov
        assert bool((torch.linalg.eigvalsh(diff) > -1e-10).all())
        assert ella.num_features <= m * CASES[task]


def test_features_reproduce_the_nystrom_kernel() -> None:
    model, x, y = _problem("classification")
    ella = ELLA(model, "classification", num_landmarks=8, prior_precision=2.0).fit((x, y))
    z = select_landmarks((x, y), 8, "random", seed=0)
    k_zx = ntk(model, z, XT, prior_precision=2.0).reshape(24, -1)
    k_zz = ntk(model, z, prior_precision=2.0).reshape(24, 24)
    nystrom = (k_zx.T @ torch.linalg.pinv(k_zz, hermitian=True) @ k_zx).reshape(6, 3, 6, 3)
    phi = ella.features(XT)
    torch.testing.assert_close(torch.einsum("arc,brd->acbd", phi, phi), nystrom)
    proj = nystrom_projection(ntk(model, z, prior_precision=2.0))
    assert proj.shape == (24, ella.num_features)


def test_given_landmarks_tuning_and_state_dict() -> None:
    model, x, y = _problem("regression")
    ella = ELLA(model, "regression", landmarks=x[:10], num_landmarks=10, sigma_noise=1.0)
    ella.fit((x, y))
    assert ella.state_dict()["landmarks"].shape == (10, 2)
    before = float(ella.log_marginal_likelihood())
    ella.optimize_prior(n_steps=40)
    assert float(ella.log_marginal_likelihood()) > before
    assert ella.sigma_noise.ndim == 0 and float(ella.sigma_noise) != 1.0
    buf = io.BytesIO()
    torch.save(ella.state_dict(), buf)
    buf.seek(0)
    other = ELLA(model, "regression", num_landmarks=10)
    other.load_state_dict(torch.load(buf, weights_only=True))
    torch.testing.assert_close(other.predict(XT).var, ella.predict(XT).var)
    ella.optimize_prior(method="grid", grid=torch.logspace(-1, 1, 5, dtype=DT))
    assert ella.prior_precision.ndim == 0


def test_bad_inputs_name_the_argument() -> None:
    model, x, y = _problem("classification")
    with pytest.raises(ValueError, match="num_landmarks"):
        ELLA(model, "classification", num_landmarks=N + 1).fit((x, y))
    with pytest.raises(ValueError, match="num_landmarks"):
        ELLA(model, "classification", num_landmarks=0)
    with pytest.raises(ValueError, match="landmarks"):
        ELLA(model, "classification", num_landmarks=5, landmarks="grid")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="landmarks"):
        select_landmarks((x, y), 5, "grid")  # type: ignore[arg-type]
    ella = ELLA(model, "classification", num_landmarks=5, prior_precision=torch.ones(4, dtype=DT))
    with pytest.raises(RuntimeError, match="fit"):
        ella.predict(x)
    ella.fit((x, y))
    with pytest.raises(ValueError, match="prior_precision"):
        ella.log_marginal_likelihood(2.0)
    with pytest.raises(ValueError, match="method"):
        ella.predict(x, method="nn")  # type: ignore[arg-type]
