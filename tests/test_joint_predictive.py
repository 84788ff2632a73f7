"""Joint predictives across test points and weight-shared function samples (issue 10)."""

import pytest
import torch
from torch import nn

import gaussify as gs
from gaussify.weight_space.joint import function_samples, joint_predictive


def _fitted(structure: str, task: str) -> tuple[gs.Laplace, torch.Tensor]:
    torch.manual_seed(0)
    c = 1 if task == "regression" else 3
    model = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, c)).double()
    x = torch.randn(40, 2, dtype=torch.float64)
    y = torch.randn(40, 1).double() if task == "regression" else torch.randint(0, 3, (40,))
    sigma = 0.3 if task == "regression" else 1.0  # only regression has observation noise
    la = gs.Laplace(model, task, structure, prior_precision=0.5, sigma_noise=sigma)
    la.fit((x, y))
    return la, torch.randn(5, 2, dtype=torch.float64)


@pytest.mark.parametrize("structure", ["full", "diag", "kron", "lowrank"])
@pytest.mark.parametrize("task", ["regression", "classification"])
def test_joint_diagonal_blocks_equal_the_per_point_predictive(structure: str, task: str) -> None:
    la, x = _fitted(structure, task)
    joint = joint_predictive(la, x)
    single = la.predict(x)
    assert joint.joint_cov is not None and single.f_cov is not None
    n, c = single.f_mean.shape
    torch.testing.assert_close(joint.f_mean, single.f_mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(joint.f_cov, single.f_cov, rtol=1e-9, atol=1e-12)
    blocks = joint.joint_cov.reshape(n, c, n, c)
    for i in range(n):
        torch.testing.assert_close(blocks[i, :, i], single.f_cov[i], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(joint.joint_cov, joint.joint_cov.T, rtol=0, atol=1e-12)
    assert torch.linalg.eigvalsh(joint.joint_cov).min() > -1e-10
    if task == "classification":
        torch.testing.assert_close(joint.probs, single.probs)


def test_glm_function_samples_have_the_joint_covariance() -> None:
    la, x = _fitted("full", "classification")
    joint = joint_predictive(la, x).joint_cov
    assert joint is not None
    s = 40000
    f = function_samples(la, x, s, generator=torch.Generator().manual_seed(3))
    flat = f.reshape(s, -1)
    emp = torch.cov(flat.T)
    # Monte Carlo standard error of a covariance entry: sqrt((S_ii S_jj + S_ij^2) / s)
    d = joint.diagonal()
    se = ((d[:, None] * d[None, :] + joint.square()) / s).sqrt()
    assert ((emp - joint).abs() / se).max() < 5.0
    torch.testing.assert_close(
        flat.mean(0),
        joint_predictive(la, x).f_mean.reshape(-1),
        atol=float(5 * (d / s).sqrt().max()),
        rtol=0,
    )


def test_samples_share_weight_draws_across_inputs() -> None:
    la, x = _fitted("kron", "regression")
    gen = torch.Generator().manual_seed(0)
    both = function_samples(la, x, 7, generator=gen)
    gen = torch.Generator().manual_seed(0)
    first = function_samples(la, x[:2], 7, generator=gen)
    torch.testing.assert_close(both[:, :2], first)  # same draws, whatever the inputs
    nn_s = function_samples(la, x, 7, method="nn", generator=torch.Generator().manual_seed(0))
    assert nn_s.shape == both.shape
    with pytest.raises(ValueError, match="method"):
        function_samples(la, x, 3, method="mc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_samples"):
        function_samples(la, x, 0)
