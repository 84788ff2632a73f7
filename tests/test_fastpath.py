"""PyTorch's fused attention fast paths routed around (gaussify.fastpath, issue 22): settings
restored (also on an exception), one FastPathWarning per model naming the fused modules,
forward-mode products through eval-mode attention and fused SDPA kernels, and the reverse-mode
fallback for an operation without a forward-mode derivative."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gaussify as gs
from gaussify.curvature import jacobians, jvp
from gaussify.fastpath import autodiff_safe, fused_modules
from gaussify.warnings import FastPathWarning


def _encoder(d: int = 4) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d, 2, dim_feedforward=8, dropout=0.0, batch_first=True)
    return nn.Sequential(
        nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), _Pool(), nn.Linear(d, 2)
    ).eval()


class _Pool(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.mean(1)


def test_autodiff_safe_sets_and_restores_the_settings_also_on_error() -> None:
    assert torch.backends.mha.get_fastpath_enabled()
    with autodiff_safe():
        assert not torch.backends.mha.get_fastpath_enabled()
        assert not torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.mha.get_fastpath_enabled() and torch.backends.cuda.flash_sdp_enabled()
    with pytest.raises(RuntimeError, match="boom"), autodiff_safe():
        raise RuntimeError("boom")
    assert torch.backends.mha.get_fastpath_enabled() and torch.backends.cuda.flash_sdp_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # a user's own choice is kept
    try:
        with autodiff_safe():
            pass
        assert not torch.backends.mha.get_fastpath_enabled()
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


def test_fused_modules_lists_the_outermost() -> None:
    assert fused_modules(_encoder()) == [("0", "TransformerEncoder")]
    assert fused_modules(nn.Sequential(nn.Linear(2, 2))) == []


def test_one_warning_per_model_naming_the_fused_module() -> None:
    model = _encoder().double()
    x = torch.randn(6, 3, 4, dtype=torch.float64)
    y = torch.randint(0, 2, (6,))
    with pytest.warns(FastPathWarning, match=r"'0' \(TransformerEncoder\).*disables it") as rec:
        gs.Laplace(model, "classification", structure="lowrank", rank=3).fit((x, y)).predict(x)
    assert sum(issubclass(w.category, FastPathWarning) for w in rec) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", FastPathWarning)
        gs.Laplace(model, "classification", structure="diag").fit((x, y))  # same model: silent
        mlp = nn.Sequential(nn.Linear(4, 2)).double()
        gs.Laplace(mlp, "classification", structure="full").fit((x[:, 0], y))


def test_jvp_through_an_eval_encoder_stack_equals_the_jacobian() -> None:
    """Forward mode through nn.TransformerEncoder in eval mode (fused on main: NotImplementedError
    'forward AD with aten::_transformer_encoder_layer_fwd')."""
    model = _encoder().double()
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    p = sum(q.numel() for q in model.parameters())
    v = torch.randn(p, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FastPathWarning)
        jv = jvp(model, x, "all", v)
        jac = jacobians(model, x, "all")
    torch.testing.assert_close(jv, jac @ v, atol=1e-10, rtol=1e-8)


class _SDPA(nn.Module):
    """A user's attention calling F.scaled_dot_product_attention on (N, H, T, D) inputs, where
    PyTorch picks a fused CPU kernel without forward AD or double backward."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(4, 12)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 2).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v)
        return self.out(h.transpose(1, 2).reshape(x.shape[0], x.shape[1], 4).mean(1))


def test_jvp_through_fused_scaled_dot_product_attention() -> None:
    torch.manual_seed(0)
    model = _SDPA().eval()
    x = torch.randn(5, 3, 4)
    v = torch.randn(sum(q.numel() for q in model.parameters()))
    jv = jvp(model, x, "all", v)
    torch.testing.assert_close(jv, jacobians(model, x, "all") @ v, atol=1e-5, rtol=1e-4)


class _NoForwardAD(torch.autograd.Function):
    """tanh with a backward but no jvp: forward-mode AD is unsupported."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # type: ignore[override]
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class _Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_NoForwardAD.apply(self.a(x)))


def test_forward_mode_falls_back_to_reverse_mode_with_one_warning() -> None:
    torch.manual_seed(0)
    model = _Custom().double().eval()
    x = torch.randn(6, 3, dtype=torch.float64)
    v = torch.randn(26, dtype=torch.float64)
    with pytest.warns(FastPathWarning, match="no forward-mode derivative.*reverse-mode") as rec:
        jv = jvp(model, x, "all", v)
        jvp(model, x, "all", v)
    assert len([w for w in rec if issubclass(w.category, FastPathWarning)]) == 1
    with torch.no_grad():
        h = torch.tanh(model.a(x))
    # J v by hand: b(tanh(a x)) with tangents (dA, da, dB, db)
    da_w, da_b, db_w, db_b = v.split([12, 4, 8, 2])
    dh = (1 - h * h) * (x @ da_w.view(4, 3).T + da_b)
    expected = h @ db_w.view(2, 4).T + db_b + dh @ model.b.weight.detach().T
    torch.testing.assert_close(jv, expected, atol=1e-12, rtol=1e-10)


def test_lowrank_and_sampled_lla_on_a_model_without_forward_ad() -> None:
    """The structures and families built on forward mode work through the fallback: lowrank
    at full rank equals full; Sampled-LLA's jvp route runs."""
    torch.manual_seed(0)
    model = _Custom().double().eval()
    x = torch.randn(8, 3, dtype=torch.float64)
    y = torch.randint(0, 2, (8,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FastPathWarning)
        full = gs.Laplace(model, "classification", structure="full", correction=False)
        full.fit((x, y))
        low = gs.Laplace(model, "classification", structure="lowrank", rank=26, correction=False)
        low.fit((x, y))
        slla = gs.SampledLLA(model, "classification", num_samples=3, epochs=1, route="jvp")
        pred = slla.fit((x, y)).predict(x[:2])
    assert float(low.log_marginal_likelihood()) == pytest.approx(
        float(full.log_marginal_likelihood()), rel=1e-10
    )
    assert pred.f_samples.shape == (3, 2, 2)


class _PaddedEncoder(nn.Module):
    """Token model whose padding mask comes from its input (id 0): in eval mode the encoder's
    fast path would turn the batch into nested tensors."""

    def __init__(self, vocab: int = 9, d: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d, 2, dim_feedforward=8, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1)
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = x == 0
        h = self.enc(self.emb(x), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


def test_padded_token_encoder_lowrank_matches_the_bruteforce_ggn() -> None:
    import bruteforce_ggn as bf

    torch.manual_seed(0)
    model = _PaddedEncoder().double().eval()
    x = torch.randint(1, 9, (8, 5))
    x[:, 3:] = 0
    x[0, 1:] = 0
    y = torch.randint(0, 2, (8,))
    p = sum(q.numel() for q in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FastPathWarning)
        la = gs.Laplace(
            model,
            "classification",
            structure="lowrank",
            rank=p,
            prior_precision=2.0,
            correction=False,
        ).fit((x, y))
        cov = la.predict(x[:3]).f_cov
    assert float(la.log_marginal_likelihood()) == pytest.approx(
        bf.log_evidence(model, x, y, 2.0), rel=1e-10
    )
    torch.testing.assert_close(cov, bf.glm_cov(model, x, x[:3], 2.0), atol=1e-10, rtol=1e-8)
