"""Per-sample Jacobians, jvp and vjp against plain torch.autograd (float64, 1e-10)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gaussify.curvature import jacobians, jvp, model_outputs, per_sample_vjp, vjp
from gaussify.curvature.jacobian import check_eval_mode, jvp_with_outputs, squared_vjp_sum
from gaussify.curvature.lastlayer import (
    find_output_linear,
    forward_with_features,
    lastlayer_diag,
    lastlayer_jacobians,
    lastlayer_jvp,
    lastlayer_vjp,
)
from gaussify.curvature.subset import select_parameters

DT = torch.float64
N, D, C = 6, 4, 3


class SkipNet(nn.Module):
    """Not a Sequential: a residual block with LayerNorm and a separate head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, 5)
        self.block = nn.Sequential(nn.Linear(5, 5), nn.Tanh())
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, C)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(self.norm(h + self.block(h)))


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(2 * 2 * 2, C)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _batchnorm_mlp() -> nn.Module:
    model = nn.Sequential(nn.Linear(D, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, C))
    model = model.to(DT)
    with torch.no_grad():  # non-trivial running statistics
        model(3 + 2 * torch.randn(40, D, dtype=DT))
    return model.eval()


MODELS = {
    "layernorm_mlp": lambda: nn.Sequential(
        nn.Linear(D, 5), nn.LayerNorm(5), nn.GELU(), nn.Linear(5, C)
    ),
    "batchnorm_eval": _batchnorm_mlp,
    "skip": SkipNet,
    "cnn": TinyCNN,
}


def _make(name: str, seed: int = 0) -> tuple[nn.Module, Tensor]:
    torch.manual_seed(seed)
    model = MODELS[name]().to(DT).eval()
    shape = (N, 1, 4, 4) if name == "cnn" else (N, D)
    return model, torch.randn(*shape, dtype=DT)


def autograd_jacobians(model: nn.Module, x: Tensor, names: list[str]) -> Tensor:
    """J (N, C, P) one output entry at a time with torch.autograd.grad on the plain model."""
    named = dict(model.named_parameters())
    params = [named[n] for n in names]
    out = model(x)
    rows = []
    for i in range(out.shape[0]):
        per_output = []
        for c in range(out.shape[1]):
            grads = torch.autograd.grad(out[i, c], params, retain_graph=True, allow_unused=True)
            per_output.append(
                torch.cat(
                    [
                        (g if g is not None else torch.zeros_like(p)).reshape(-1)
                        for g, p in zip(grads, params, strict=True)
                    ]
                )
            )
        rows.append(torch.stack(per_output))
    return torch.stack(rows)


def functional_reference(model: nn.Module, x: Tensor, names: list[str]) -> Tensor:
    """J (N, C, P) via torch.autograd.functional.jacobian of the batched network."""
    named = dict(model.named_parameters())
    others = {n: p.detach() for n, p in named.items() if n not in names}

    def fn(*ps: Tensor) -> Tensor:
        return torch.func.functional_call(model, {**others, **dict(zip(names, ps, strict=True))}, x)

    jac = torch.autograd.functional.jacobian(fn, tuple(named[n].detach() for n in names))
    n, c = model(x).shape
    return torch.cat([j.reshape(n, c, -1) for j in jac], dim=-1)


@pytest.mark.parametrize("name", list(MODELS))
def test_jacobians_match_autograd(name: str) -> None:
    model, x = _make(name)
    names = [n for n, _ in model.named_parameters()]
    jac = jacobians(model, x)
    assert jac.dtype == DT
    assert jac.shape == (N, C, sum(p.numel() for p in model.parameters()))
    torch.testing.assert_close(jac, autograd_jacobians(model, x, names), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(jac, functional_reference(model, x, names), rtol=1e-10, atol=1e-12)
    # chunking changes nothing
    torch.testing.assert_close(jacobians(model, x, chunk_size=1), jac, rtol=0, atol=1e-14)


@pytest.mark.parametrize("name", list(MODELS))
def test_jvp_vjp_consistent_with_jacobian(name: str) -> None:
    model, x = _make(name, seed=1)
    jac = jacobians(model, x)
    g = torch.Generator().manual_seed(0)
    v = torch.randn(jac.shape[-1], generator=g, dtype=DT)
    u = torch.randn(N, C, generator=g, dtype=DT)
    torch.testing.assert_close(jvp(model, x, "all", v), jac @ v, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        jvp(model, x, "all", v, chunk_size=2), jac @ v, rtol=1e-10, atol=1e-12
    )
    expected = torch.einsum("ncp,nc->p", jac, u)
    torch.testing.assert_close(vjp(model, x, "all", u), expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        vjp(model, x, "all", u, chunk_size=4), expected, rtol=1e-10, atol=1e-12
    )
    cot = torch.randn(N, 2, C, generator=g, dtype=DT)
    torch.testing.assert_close(
        per_sample_vjp(model, x, "all", cot, chunk_size=4),
        torch.einsum("ncp,nkc->nkp", jac, cot),
        rtol=1e-10,
        atol=1e-12,
    )
    f, _ = jvp_with_outputs(model, x, "all", v)
    torch.testing.assert_close(f, model_outputs(model, x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("subset", ["last_layer", ["inp"], ["block.0.weight", "head.bias"]])
def test_subset_jacobians_are_columns_of_full(subset: str | list[str]) -> None:
    model, x = _make("skip")
    full = jacobians(model, x)
    sel = select_parameters(model, subset)
    all_names = [n for n, _ in model.named_parameters()]
    sizes = dict(zip(all_names, (p.numel() for p in model.parameters()), strict=True))
    offsets, start = {}, 0
    for n in all_names:
        offsets[n] = start
        start += sizes[n]
    cols = torch.cat([torch.arange(offsets[n], offsets[n] + sizes[n]) for n in sel.names])
    sub = jacobians(model, x, subset)
    torch.testing.assert_close(sub, full[..., cols], rtol=0, atol=1e-14)
    torch.testing.assert_close(sub, autograd_jacobians(model, x, list(sel.names)))


def test_float32_model_stays_float32() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 5), nn.Tanh(), nn.Linear(5, C)).eval()
    x = torch.randn(N, D)
    jac = jacobians(model, x)
    assert jac.dtype == torch.float32
    ref = autograd_jacobians(model, x, [n for n, _ in model.named_parameters()])
    torch.testing.assert_close(jac, ref, rtol=1e-5, atol=1e-6)


def test_lastlayer_identity_matches_generic() -> None:
    model, x = _make("skip", seed=3)
    subset = select_parameters(model, "last_layer")
    layer = find_output_linear(model, subset)
    assert layer is not None and layer.name == "head" and layer.has_bias
    _, phi = forward_with_features(model, x, layer)
    assert phi is not None
    jac = jacobians(model, x, subset)
    torch.testing.assert_close(lastlayer_jacobians(phi, C, layer), jac, rtol=0, atol=1e-14)
    g = torch.Generator().manual_seed(1)
    v = torch.randn(subset.num_params, generator=g, dtype=DT)
    u = torch.randn(N, C, generator=g, dtype=DT)
    torch.testing.assert_close(lastlayer_jvp(phi, v, C, layer), jac @ v)
    torch.testing.assert_close(lastlayer_vjp(phi, u, layer), torch.einsum("ncp,nc->p", jac, u))
    mdiag = torch.rand(N, C, generator=g, dtype=DT)
    torch.testing.assert_close(
        lastlayer_diag(phi, mdiag, layer), torch.einsum("ncp,nc->p", jac.square(), mdiag)
    )
    # weight-only subset
    sub_w = select_parameters(model, ["head.weight"])
    layer_w = find_output_linear(model, sub_w)
    assert layer_w is not None and not layer_w.has_bias
    torch.testing.assert_close(
        lastlayer_jacobians(phi, C, layer_w), jacobians(model, x, sub_w), rtol=0, atol=1e-14
    )


def test_lastlayer_path_refuses_post_processed_outputs() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(D, C)

        def forward(self, x: Tensor) -> Tensor:
            return 2.0 * self.fc(x)

    model = Scaled().to(DT).eval()
    subset = select_parameters(model, "last_layer")
    layer = find_output_linear(model, subset)
    assert layer is not None
    _, phi = forward_with_features(model, torch.randn(N, D, dtype=DT), layer)
    assert phi is None  # the output is not the Linear's output: no identity
    # a subset spanning two modules or a non-Linear module has no identity either
    model2, _ = _make("skip")
    assert find_output_linear(model2, select_parameters(model2, "all")) is None
    assert find_output_linear(model2, select_parameters(model2, ["norm"])) is None


def test_training_mode_modules_are_named() -> None:
    model = _batchnorm_mlp().train()
    x = torch.randn(N, D, dtype=DT)
    with pytest.raises(ValueError, match=r"'1' \(BatchNorm1d\) is in training mode"):
        jacobians(model, x)
    drop = nn.Sequential(nn.Linear(D, 4), nn.Dropout(0.5), nn.Linear(4, C)).to(DT).train()
    with pytest.raises(ValueError, match="Dropout"):
        vjp(drop, x, "all", torch.ones(N, C, dtype=DT))
    check_eval_mode(drop.eval())


def test_nan_jacobian_names_the_parameter() -> None:
    class Abs(nn.Module):
        """|w| written as sqrt(w^2): its derivative at w = 0 is 0 * inf = NaN."""

        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.zeros(C, dtype=DT))

        def forward(self, h: Tensor) -> Tensor:
            return h * (self.scale.square()).sqrt() + h

    model = nn.Sequential(nn.Linear(D, C), Abs()).to(DT).eval()
    x = torch.randn(N, D, dtype=DT)
    with pytest.raises(ValueError, match=r"NaN Jacobian in parameter '1.scale' \(module '1', Abs"):
        jacobians(model, x)
    with pytest.raises(ValueError, match=r"NaN Jacobian in parameter '1\.scale'"):
        per_sample_vjp(model, x, "all", torch.ones(N, 1, C, dtype=DT))
    # the other parameters are fine
    assert torch.isfinite(jacobians(model, x, ["0"])).all()


def test_bad_shapes_raise() -> None:
    model, x = _make("layernorm_mlp")
    p = sum(q.numel() for q in model.parameters())
    with pytest.raises(ValueError, match="v: expected shape"):
        jvp(model, x, "all", torch.zeros(p + 1, dtype=DT))
    with pytest.raises(ValueError, match="u: expected shape"):
        vjp(model, x, "all", torch.zeros(N + 1, C, dtype=DT))
    with pytest.raises(ValueError, match="cotangents"):
        per_sample_vjp(model, x, "all", torch.zeros(N, C, dtype=DT))
    with pytest.raises(ValueError, match="chunk_size"):
        jacobians(model, x, chunk_size=0)
    flat = nn.Sequential(nn.Linear(D, 1), nn.Flatten(0)).to(DT).eval()
    with pytest.raises(ValueError, match=r"outputs of shape \(N, C\)"):
        jacobians(flat, x)
    with pytest.raises(ValueError, match="subset"):
        jacobians(model, x, ["nope"])


class Reuse(nn.Module):
    """A Linear called twice and a weight also used outside its module: the per-layer route
    must notice both and fall back to per-sample products."""

    def __init__(self) -> None:
        super().__init__()
        self.twice = nn.Linear(D, D)
        self.tied = nn.Linear(D, 5)
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, C)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.twice(torch.tanh(self.twice(x))))
        h = self.norm(torch.tanh(self.tied(h)) + h @ self.tied.weight.T)
        return self.head(h)


class Sequence(nn.Module):
    """A Linear applied to (N, T, D) inputs: per-sample gradients sum over T, so the per-layer
    squared-sum identity does not hold and the route must not be taken."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, 5)
        self.head = nn.Linear(5, C)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.proj(x.reshape(x.shape[0], 2, D))).mean(1))


@pytest.mark.parametrize("name", ["skip", "batchnorm_eval", "reuse", "sequence", "cnn"])
def test_linear_layer_route_equals_per_sample_products(name: str) -> None:
    if name == "reuse":
        torch.manual_seed(0)
        model, x = Reuse().to(DT).eval(), torch.randn(N, D, dtype=DT)
    elif name == "sequence":
        torch.manual_seed(0)
        model, x = Sequence().to(DT).eval(), torch.randn(N, 2 * D, dtype=DT)
    else:
        model, x = _make(name, seed=4)
    g = torch.Generator().manual_seed(2)
    cot = torch.randn(N, 2, C, generator=g, dtype=DT)
    jac = autograd_jacobians(model, x, [n for n, _ in model.named_parameters()])
    expected = torch.einsum("ncp,nkc->nkp", jac, cot).square().sum((0, 1))
    got, f = squared_vjp_sum(model, x, "all", lambda out: cot, chunk_size=4)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    products = torch.einsum("ncp,nkc->nkp", jac, cot)
    for chunk in (None, 4):
        torch.testing.assert_close(
            per_sample_vjp(model, x, "all", cot, chunk_size=chunk),
            products,
            rtol=1e-10,
            atol=1e-12,
        )
    torch.testing.assert_close(f, model(x).detach())
    sub = select_parameters(model, "last_layer")
    got_sub, _ = squared_vjp_sum(model, x, sub, lambda out: cot)
    cols = expected[-sub.num_params :]
    torch.testing.assert_close(got_sub, cols, rtol=1e-10, atol=1e-12)
