"""The one ``optimize_prior`` of the evidence families (gaussify.prior_tuning.EvidenceTuning):
the same public signature and order of checks for Laplace, FunctionalLaplace and ELLA."""

from __future__ import annotations

import inspect
import pydoc

import pytest
import torch
from torch import nn

from gaussify.evidence import finite_evidence
from gaussify.function_space.ella import ELLA
from gaussify.function_space.gp import FunctionalLaplace
from gaussify.prior_tuning import EvidenceTuning
from gaussify.weight_space.laplace import Laplace

KEYWORDS = (
    "data",
    "method",
    "granularity",
    "tune_noise",
    "n_steps",
    "lr",
    "grid",
    "optimizer",
    "fixed_steps",
    "progress",
)


@pytest.mark.parametrize("family", [Laplace, FunctionalLaplace, ELLA])
def test_one_method_whose_help_lists_every_keyword(family: type) -> None:
    assert family.optimize_prior is EvidenceTuning.optimize_prior
    params = inspect.signature(family.optimize_prior).parameters
    assert tuple(params)[1:] == KEYWORDS
    assert params["n_steps"].default == 100 and params["optimizer"].default == "lbfgs"
    text = pydoc.render_doc(family.optimize_prior, renderer=pydoc.plaintext)
    for name in KEYWORDS:
        assert f"{name}:" in text


@pytest.mark.parametrize(
    ("family", "allowed"),
    [(ELLA, ["scalar"]), (FunctionalLaplace, ["scalar", "layer"]), (Laplace, None)],
)
def test_granularity_is_checked_before_anything_is_fitted(family: type, allowed: list) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1)).double().eval()
    x = torch.randn(8, 2, dtype=torch.float64)
    y = x[:, :1].sin()
    post = (
        Laplace(model, "regression", "diag")
        if family is Laplace
        else family(model, "regression", **({"num_landmarks": 4} if family is ELLA else {}))
    )
    message = f"granularity: expected one of {allowed or ['diag', 'layer', 'scalar']}"
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        post.optimize_prior((x, y), granularity="blocks")
    assert post.tuning_result is None
    assert not post._is_fitted()  # the data was not fitted: the check came first


def test_finite_evidence_names_the_hyperparameters() -> None:
    value = torch.tensor(-3.5, dtype=torch.float64)
    assert finite_evidence(value) is value
    with pytest.raises(FloatingPointError, match=r"^log marginal likelihood is nan: check prior_"):
        finite_evidence(torch.tensor(float("nan")))
