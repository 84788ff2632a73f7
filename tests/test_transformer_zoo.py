"""Issue 22 oracles beyond the transformer: a small ResNet-style CNN (BatchNorm2d in eval mode,
a skip connection) and a Conv1d sequence model. full / diag / lowrank (at full rank) log
evidence and GLM predictive equal a float64 brute-force Jacobian computation
(tests/bruteforce_ggn.py); prior tuning reaches the brute-force optimum."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bruteforce_ggn as bf
import gaussify as gs

DELTA = 3.0


class TinyResNet(nn.Module):
    def __init__(self, c: int = 3, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(c)
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.stem(x)))
        h = torch.relu(h + self.bn2(self.conv(h)))  # the skip connection
        return self.head(h.mean((2, 3)))


class SeqConv1d(nn.Module):
    def __init__(self, channels: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(channels, 4, 3, padding=1)
        self.conv2 = nn.Conv1d(4, 4, 3, dilation=2, padding=2)
        self.head = nn.Linear(4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv2(torch.tanh(self.conv1(x))))
        return self.head(h.amax(-1))


def _resnet() -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyResNet().double()
    with torch.no_grad():  # non-trivial running statistics, then eval mode
        for bn in (model.bn1, model.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.2, 0.2)
    x = torch.randn(8, 1, 5, 5, dtype=torch.float64)
    return model.eval(), x, torch.randint(0, 3, (8,)), torch.randn(3, 1, 5, 5).double()


def _conv1d() -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = SeqConv1d().double().eval()
    x = torch.randn(8, 2, 7, dtype=torch.float64)
    return model, x, torch.randint(0, 3, (8,)), torch.randn(3, 2, 7).double()


MODELS = {"resnet": _resnet, "conv1d": _conv1d}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("structure", ["full", "diag", "lowrank"])
def test_evidence_and_glm_predictive_match_bruteforce(name: str, structure: str) -> None:
    model, x, y, xt = MODELS[name]()
    pred = bf.assert_laplace_matches(model, x, y, xt, structure, DELTA)
    with torch.no_grad():
        torch.testing.assert_close(pred.f_mean, model(xt), atol=1e-12, rtol=0)
    assert not any(m.training for m in model.modules())


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("structure", ["full", "diag"])
def test_optimize_prior_reaches_the_bruteforce_optimum(name: str, structure: str) -> None:
    model, x, y, _ = MODELS[name]()
    la = gs.Laplace(model, "classification", structure=structure, correction=False).fit((x, y))
    delta = float(la.optimize_prior().prior_precision)
    diag = structure == "diag"
    best = bf.log_evidence(model, x, y, delta, diag=diag)
    assert float(la.log_marginal_likelihood()) == pytest.approx(best, rel=1e-9, abs=1e-8)
    for factor in (0.95, 1.05):
        assert bf.log_evidence(model, x, y, delta * factor, diag=diag) < best
