"""The per-layer fast route of the Jacobian products only applies when each linear layer sees
one row per sample; a model that stacks rows across samples must give exact results too."""

import torch
from torch import nn

from gaussify.curvature import make_curvature
from gaussify.curvature.jacobian import jacobians
from gaussify.likelihoods import Bernoulli


class PairDiff(nn.Module):
    """f(x) = g(x[:, 0]) - g(x[:, 1]) with both members stacked through one Linear call."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.g(x.reshape(-1, 3)).reshape(x.shape[0], 2)
        return r[:, :1] - r[:, 1:]


def _oracle_jacobian(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    names = [n for n, _ in model.named_parameters()]
    params = tuple(p.detach() for _, p in model.named_parameters())

    def f(*ps: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, dict(zip(names, ps, strict=True)), (x,))

    blocks = torch.autograd.functional.jacobian(f, params)
    return torch.cat([b.reshape(x.shape[0], 1, -1) for b in blocks], dim=-1)


def test_stacked_rows_take_the_exact_route() -> None:
    torch.manual_seed(0)
    model = PairDiff()
    x = torch.randn(6, 2, 3, dtype=torch.float64)
    jac = jacobians(model, x)
    torch.testing.assert_close(jac, _oracle_jacobian(model, x), rtol=1e-12, atol=1e-12)
    y = torch.randint(0, 2, (6, 1)).double()
    diag = make_curvature("diag", model, Bernoulli())
    full = make_curvature("full", model, Bernoulli())
    for curv in (diag, full):
        curv.update(model, x, y)
    p = torch.sigmoid(model(x).detach())[:, 0]
    ggn = torch.einsum("nip,n,niq->pq", jac, p * (1 - p), jac)
    torch.testing.assert_close(full.state_dict()["ggn"], ggn, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        diag.state_dict()["ggn_diag"], ggn.diagonal(), rtol=1e-10, atol=1e-12
    )
