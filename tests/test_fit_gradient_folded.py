"""The log-likelihood gradient J^T r a Laplace fit needs (the non-MAP correction of the
evidence), added by the diagonal's batched backward passes as one more vector (issue 17: no
forward and backward pass of its own): equal to autograd's gradient of sum_n log p(y_n | f_n)
in float64 on every route (structured factor, dense vectors, a first convolution stopped at
its pooling, linear chains, the empirical Fisher's own vector), and formed the old way where
it is not folded (one vector other than the residual, a grouped convolution, a first
convolution without a pooling after it). The same for KFAC's B-factor passes
(:mod:`gaussify.curvature.kron_gradient`): folded on chains of linear layers and, for the
empirical Fisher (r is its one vector), on CNNs too, a convolution's gradient from its own
weight gradient; not for the other CNN fits (it does not pay) nor where KFAC takes its
hooked route (a grouped convolution)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gaussify as gs
from gaussify.weight_space import laplace_fit

DT = torch.float64


def _cnn(c: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(54, c),
    )  # fmt: skip


def _strided(c: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, stride=2, padding=1), nn.ELU(), nn.Conv2d(3, 4, 2), nn.Sigmoid(),
        nn.Flatten(), nn.Linear(144, c),
    )  # fmt: skip


def _mlp(c: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(196, 12), nn.Tanh(), nn.Linear(12, c))


def _grouped(c: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(),
        nn.Linear(400, c),
    )  # fmt: skip


CASES = {
    "cnn_pooled/classification": (_cnn, "classification", 7, {}, True),
    "cnn_pooled/classification/mc": (_cnn, "classification", 7, {"mc_samples": 3}, True),
    "cnn_pooled/regression": (_cnn, "regression", 3, {}, True),
    # a first convolution not followed by a pooling: the gradient's own pass is cheaper
    "cnn_strided/classification": (_strided, "classification", 5, {}, False),
    "mlp/classification": (_mlp, "classification", 6, {}, True),
    "mlp/regression": (_mlp, "regression", 2, {}, True),
    # the empirical Fisher: its one vector is the residual, summed as it is squared
    "cnn_pooled/classification/ef": (_cnn, "classification", 7, {"ef": True}, True),
    "mlp/regression/ef": (_mlp, "regression", 2, {"ef": True}, True),
    "grouped/classification/ef": (_grouped, "classification", 4, {"ef": True}, True),
    # one vector that is not the residual (one output), a grouped convolution: not folded
    "cnn_pooled/regression/one_output": (_cnn, "regression", 1, {}, False),
    "grouped/classification": (_grouped, "classification", 4, {}, False),
}


def _data(task: str, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 1, 14, 14, generator=g, dtype=DT)
    if task == "classification":
        return x, torch.randint(0, c, (40,), generator=g)
    return x, torch.randn(40, c, generator=g, dtype=DT)


def _count_own_passes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one for each forward and backward pass of the fit's own
    (``laplace_fit.outputs_and_gradient``, the route of a gradient that is not folded)."""
    passes: list[int] = []
    real = laplace_fit.outputs_and_gradient

    def counted(*args):  # type: ignore[no-untyped-def]
        passes.append(1)
        return real(*args)

    monkeypatch.setattr(laplace_fit, "outputs_and_gradient", counted)
    return passes


#: KFAC folds on the chain route (not the grouped convolution's hooked one) where it pays:
#: linear chains, and the empirical Fisher's CNNs
KRON_FOLDED = {
    name: not name.startswith("grouped") and (name.startswith("mlp") or name.endswith("/ef"))
    for name in CASES
}


@pytest.mark.parametrize("structure", ["diag", "kron"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_fit_gradient_equals_autograd(
    monkeypatch: pytest.MonkeyPatch, name: str, structure: str
) -> None:
    build, task, c, options, folded = CASES[name]
    folded = folded if structure == "diag" else KRON_FOLDED[name]
    torch.manual_seed(1)
    model = build(c).to(DT).eval()
    x, y = _data(task, c)
    passes = _count_own_passes(monkeypatch)
    kwargs = {**options, **({"sigma_noise": 0.7} if task == "regression" else {})}

    def fitted() -> gs.Laplace:
        generator = torch.Generator().manual_seed(5)  # Monte Carlo: the same draws
        la = gs.Laplace(model, task, structure, "all", generator=generator, **kwargs)
        return la.fit(DataLoader(TensorDataset(x, y), batch_size=10))

    la = fitted()
    assert (not passes) is folded  # folded: no forward and backward pass of its own
    # the oracle: autograd's gradient of the log-likelihood, in the parameters' order
    model.zero_grad()
    log_lik = la.likelihood.log_prob(model(x), y).sum()
    log_lik.backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(la._grad, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(la._log_lik, log_lik.detach(), rtol=1e-12, atol=1e-12)
    # the curvature is the one formed without the folded vector
    monkeypatch.setattr(laplace_fit, "_gradient_sink", lambda *args: None)
    plain = fitted()
    expected_state, state = plain._curvature.state_dict(), la._curvature.state_dict()
    assert expected_state.keys() == state.keys()
    for key, value in expected_state.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(state[key], value, rtol=1e-12, atol=1e-300, msg=key)


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_a_non_finite_folded_gradient_raises(structure: str) -> None:
    """NaN weights in the first convolution reach the outputs: the fit refuses (naming the
    outputs), as the unfolded route does, and keeps no state."""
    torch.manual_seed(1)
    model = _cnn(5).to(DT).eval()
    with torch.no_grad():
        model[0].weight[0, 0, 0, 0] = float("nan")
    x, y = _data("classification", 5)
    la = gs.Laplace(model, "classification", structure, "all")
    with pytest.raises(ValueError, match="network outputs contain NaN"):
        la.fit(DataLoader(TensorDataset(x, y), batch_size=10))
    assert la._curvature is None


def test_kron_fold_is_left_out_where_it_would_not_cover_the_gradient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """KFAC keeps the fit's own pass where its passes do not give every parameter's gradient:
    a module without a Kronecker form (exact blocks: a LayerNorm) and a batch split into
    ``chunk_size`` chunks; the gradient still equals autograd's."""
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(196, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3)
    ).to(DT)
    x, y = _data("classification", 3)
    passes = _count_own_passes(monkeypatch)
    for options, net in (({}, model.eval()), ({"chunk_size": 4}, _mlp(3).to(DT).eval())):
        passes.clear()
        la = gs.Laplace(net, "classification", "kron", "all", **options)
        la.fit(DataLoader(TensorDataset(x, y), batch_size=10))
        assert len(passes) == 4  # its own pass for each of the 4 batches
        net.zero_grad()
        la.likelihood.log_prob(net(x), y).sum().backward()
        expected = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
        torch.testing.assert_close(la._grad, expected, rtol=1e-10, atol=1e-12)
