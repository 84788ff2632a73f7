"""Likelihood residuals and Hessians against torch.autograd (float64, 1e-8)."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from gaussify.likelihoods import Bernoulli, Categorical, Gaussian, get_likelihood

N, C = 7, 4


def _data(kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    f = 3 * torch.randn(N, C, generator=g, dtype=torch.float64)
    if kind == "gaussian":
        y = torch.randn(N, C, generator=g, dtype=torch.float64)
    elif kind == "categorical":
        y = torch.randint(0, C, (N,), generator=g)
    else:
        y = torch.randint(0, 2, (N, C), generator=g).double()
    return f, y


LIKELIHOODS = {
    "gaussian": lambda: Gaussian(torch.tensor([0.5, 1.0, 2.0, 0.3], dtype=torch.float64)),
    "gaussian_scalar": lambda: Gaussian(0.7),
    "categorical": Categorical,
    "bernoulli": Bernoulli,
}


def _kind(name: str) -> str:
    return "gaussian" if name.startswith("gaussian") else name


@pytest.mark.parametrize("name", list(LIKELIHOODS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_residual_and_hessian_equal_autograd(name: str, seed: int) -> None:
    lik = LIKELIHOODS[name]()
    f, y = _data(_kind(name), seed)
    grads, hessians = [], []
    for n in range(N):
        fn = f[n : n + 1].clone().requires_grad_(True)

        def logp(fi: torch.Tensor, n: int = n) -> torch.Tensor:
            return lik.log_prob(fi, y[n : n + 1]).sum()

        grads.append(torch.autograd.functional.jacobian(logp, fn)[0])
        hessians.append(torch.autograd.functional.hessian(logp, fn)[0, :, 0, :])
    grad_ref, hess_ref = torch.stack(grads), torch.stack(hessians)
    torch.testing.assert_close(lik.residual(f, y), grad_ref, atol=1e-8, rtol=1e-8)
    torch.testing.assert_close(lik.hessian(f), -hess_ref, atol=1e-8, rtol=1e-8)
    torch.testing.assert_close(
        lik.hessian_diag(f), torch.diagonal(-hess_ref, dim1=-2, dim2=-1), atol=1e-8, rtol=1e-8
    )
    root = lik.hessian_sqrt(f)
    torch.testing.assert_close(root @ root.mT, -hess_ref, atol=1e-8, rtol=1e-8)


def test_log_prob_matches_scipy() -> None:
    f, y = _data("gaussian", 3)
    sigma = torch.tensor([0.5, 1.0, 2.0, 0.3], dtype=torch.float64)
    ref = stats.norm.logpdf(y.numpy(), f.numpy(), sigma.numpy()).sum(-1)
    torch.testing.assert_close(Gaussian(sigma).log_prob(f, y), torch.from_numpy(ref))

    f, y = _data("categorical", 3)
    p = torch.softmax(f, -1)
    ref = torch.log(p[torch.arange(N), y])
    torch.testing.assert_close(Categorical().log_prob(f, y), ref)

    f, y = _data("bernoulli", 3)
    p = torch.sigmoid(f).numpy()
    ref = stats.bernoulli.logpmf(y.numpy(), p).sum(-1)
    torch.testing.assert_close(Bernoulli().log_prob(f, y), torch.from_numpy(ref))


def test_inverse_link_is_mean_of_samples() -> None:
    g = torch.Generator().manual_seed(0)
    f = torch.tensor([[0.3, -1.0, 2.0]], dtype=torch.float64).expand(40000, 3)
    y = Categorical().sample(f, generator=g)
    freq = torch.bincount(y, minlength=3).double() / len(y)
    se = (freq * (1 - freq) / len(y)).sqrt()
    assert ((freq - Categorical().inverse_link(f)[0]).abs() < 5 * se).all()
    yb = Bernoulli().sample(f, generator=g)
    assert ((yb.mean(0) - torch.sigmoid(f[0])).abs() < 5 * (0.25 / len(y)) ** 0.5).all()
    yg = Gaussian(2.0).sample(f, generator=g)
    assert (yg.mean(0) - f[0]).abs().max() < 5 * 2 / math.sqrt(len(y))
    assert abs(yg.std(0).mean() - 2.0) < 0.05


def test_float64_stays_float64_and_large_logits_are_stable() -> None:
    f = torch.tensor([[800.0, -800.0]], dtype=torch.float64)
    assert Categorical().log_prob(f, torch.tensor([1])).item() == pytest.approx(-1600.0)
    assert Bernoulli().log_prob(f, torch.tensor([[1.0, 0.0]])).item() == pytest.approx(0.0)
    assert Categorical().hessian(f).dtype == torch.float64


def test_registry_names() -> None:
    assert isinstance(get_likelihood("classification"), Categorical)
    assert isinstance(get_likelihood("regression", sigma_noise=0.1), Gaussian)
    assert isinstance(get_likelihood("binary"), Bernoulli)
    lik = Bernoulli()
    assert get_likelihood(lik) is lik
    with pytest.raises(ValueError, match="likelihood: unknown name 'poisson'"):
        get_likelihood("poisson")
    with pytest.raises(TypeError, match="likelihood"):
        get_likelihood(3)  # type: ignore[arg-type]


def test_bad_input_names_the_argument() -> None:
    f = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=r"y: labels must be in \[0, 4\)"):
        Categorical().log_prob(f, torch.tensor([0, 1, 4]))
    with pytest.raises(ValueError, match=r"y: labels must be in \[0, 4\)"):
        Categorical().residual(f, torch.tensor([0, -1, 2]))
    with pytest.raises(ValueError, match="y: labels contain NaN"):
        Categorical().log_prob(f, torch.tensor([0.0, float("nan"), 1.0]))
    with pytest.raises(ValueError, match="y: targets contain NaN"):
        Gaussian().log_prob(f, torch.full((3, 4), float("nan")))
    with pytest.raises(ValueError, match="y: regression targets must have shape"):
        Gaussian().log_prob(f, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="y: batch size 2"):
        Categorical().log_prob(f, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="y: binary targets must be 0 or 1"):
        Bernoulli().log_prob(f, torch.full((3, 4), 0.5))
    with pytest.raises(ValueError, match=r"f: expected shape \(N, C\)"):
        Categorical().log_prob(torch.zeros(3), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="f: network outputs contain NaN"):
        Categorical().hessian(torch.full((2, 2), float("nan")))
    with pytest.raises(ValueError, match="sigma_noise: must be finite and > 0"):
        Gaussian(-1.0)
    with pytest.raises(ValueError, match="sigma_noise: has 2 entries"):
        Gaussian(torch.ones(2)).log_prob(f, torch.zeros(3, 4))


def test_gaussian_accepts_vector_targets_for_single_output() -> None:
    f = torch.zeros(5, 1, dtype=torch.float64)
    y = torch.arange(5, dtype=torch.float64)
    torch.testing.assert_close(Gaussian().residual(f, y), y.unsqueeze(-1))
