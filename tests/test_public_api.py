"""The public names of every family are reachable as ``gs.<Name>`` and behave as their modules'."""

import torch

import gaussify as gs
from gaussify.function_space.gp import FunctionalLaplace
from gaussify.weight_space.ngvi import LGVA


def test_every_public_name_resolves() -> None:
    for name in gs.__all__:
        assert getattr(gs, name) is not None, name


def test_family_exports_are_the_module_classes() -> None:
    assert gs.FunctionalLaplace is FunctionalLaplace
    assert gs.LGVA is LGVA
    assert set(gs.experiments.EXPERIMENTS) >= {"uci_classification", "vbll_uci"}


def test_exported_functional_laplace_matches_weight_space_laplace() -> None:
    # a GP view through the public names reproduces the weight-space GLM predictive variance
    torch.manual_seed(0)
    x = torch.randn(20, 3, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.1 * torch.randn(20).double()
    model = torch.nn.Linear(3, 1).double()
    la = gs.Laplace(model, "regression", "full", prior_precision=2.0, sigma_noise=0.3)
    la.fit((x, y[:, None]))
    fl = gs.FunctionalLaplace(model, "regression", prior_precision=2.0, sigma_noise=0.3)
    fl.fit((x, y[:, None]))
    xt = torch.randn(5, 3, dtype=torch.float64)
    v_w = la.predict(xt).f_cov
    v_f = fl.predict(xt).f_cov
    torch.testing.assert_close(v_f, v_w, rtol=1e-8, atol=1e-10)
