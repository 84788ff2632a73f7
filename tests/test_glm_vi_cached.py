"""CachedGLMVI (J* cached at the MAP): each step equals a GLMVI step (float64 oracle)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gaussify.weight_space.glm_vi import GLMVI
from gaussify.weight_space.glm_vi_cached import CachedGLMVI

DT = torch.float64


def _setup() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    x = torch.randn(40, 3, dtype=DT)
    y = torch.randint(0, 3, (40,))
    return model, (x, y)


@pytest.mark.parametrize("structure", ["full", "diag"])
@pytest.mark.parametrize("samples", [1, 2, 3])
def test_cached_steps_equal_glm_vi_steps(structure: str, samples: int) -> None:
    """Same draws (same seed), same J* (the model stays at theta*): q_0 and three steps give
    the same precision and mean as GLMVI, whose steps recompute J for every draw."""
    model, data = _setup()
    opts = dict(prior_precision=0.7, lr=0.3, num_samples=samples, seed=5)
    ref = GLMVI(model, "classification", structure, **opts).init_laplace(data)
    new = CachedGLMVI(model, "classification", structure, **opts).init_laplace(data)
    key = "ggn" if structure == "full" else "ggn_diag"
    torch.testing.assert_close(new._state[key], ref._state[key], rtol=1e-10, atol=1e-12)
    for _ in range(3):
        lik_ref = ref.step(data)
        lik_new = new.step(data)
        assert lik_new == pytest.approx(lik_ref, rel=1e-10)
        torch.testing.assert_close(new._state[key], ref._state[key], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(new.mean, ref.mean, rtol=1e-10, atol=1e-12)
    x_test = torch.randn(6, 3, dtype=DT)
    p_ref = ref.predict(x_test, link="probit").probs
    p_new = new.predict(x_test, link="probit").probs
    torch.testing.assert_close(p_new, p_ref, rtol=1e-10, atol=1e-12)


def test_step_on_other_data_is_refused() -> None:
    model, data = _setup()
    vi = CachedGLMVI(model, "classification", "full").init_laplace(data)
    x, y = data
    with pytest.raises(ValueError, match="batch: CachedGLMVI takes full-batch steps"):
        vi.step((x[:10], y[:10]))
    with pytest.raises(ValueError, match="batch: CachedGLMVI takes full-batch steps"):
        vi.step((x + 1.0, y))


def test_step_before_cache_and_kron_are_refused() -> None:
    model, data = _setup()
    with pytest.raises(RuntimeError, match="call init_laplace\\(data\\) or cache\\(data\\) first"):
        CachedGLMVI(model, "classification", "full").step(data)
    with pytest.raises(ValueError, match="structure: CachedGLMVI supports 'full' and 'diag'"):
        CachedGLMVI(model, "classification", "kron")
