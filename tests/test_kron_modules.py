"""KFAC on every parameterised module (issue 22): sequence Linear (expand / reduce), Conv1d/3d,
nn.MultiheadAttention's projections, nn.Embedding (diagonal input factor) and exact blocks for
everything else (norm layers, grouped convolutions), against float64 brute-force oracles."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev, vmap

import gaussify as gs
from gaussify.curvature.kron import KronGGN
from gaussify.curvature.kron_mha import attention_forward
from gaussify.curvature.kron_modules import conv_patches
from gaussify.likelihoods import Categorical, Gaussian

DT = torch.float64

# the brute-force Jacobians vmap over attention: functorch's (correct) slow batching fallback
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")


# ----------------------------------------------------------------------------- models


class TinyTransformer(nn.Module):
    """Embedding -> TransformerEncoderLayer -> mean pool -> Linear (the issue's model, smaller)."""

    def __init__(self, vocab: int = 12, dim: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.enc = nn.TransformerEncoderLayer(dim, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)).mean(1))


class CrossAttention(nn.Module):
    """Separate q/k/v projection weights (kdim, vdim != embed_dim), bias_k/bias_v."""

    def __init__(self, bias_kv: bool = False) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, kdim=3, vdim=5, batch_first=True)
        if bias_kv:
            self.attn = nn.MultiheadAttention(4, 2, kdim=3, vdim=5, add_bias_kv=True)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = x[..., :4], x[..., 4:7], x[..., 7:]
        if not self.attn.batch_first:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        out = self.attn(q, k, v)[0]
        if not self.attn.batch_first:
            out = out.transpose(0, 1)
        return self.head(out.mean(1))


class ResBlockNet(nn.Module):
    """A small ResNet-style CNN: conv-BN-ReLU, a residual conv-BN block, a grouped conv."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.bn0 = nn.BatchNorm2d(4)
        self.conv = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.grouped = nn.Conv2d(4, 4, 1, groups=2)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn0(self.stem(x)))
        h = torch.relu(h + self.bn1(self.conv(h)))
        h = self.grouped(h)
        return self.head(h.mean((2, 3)))


class SeqConv(nn.Module):
    """A Conv1d sequence model with LayerNorm and a Conv3d-free head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(3, 4, 3, padding=1, padding_mode="circular")
        self.norm = nn.GroupNorm(2, 4)
        self.c2 = nn.Conv1d(4, 5, 3, stride=2, dilation=2)
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.c1(x)))
        return self.head(torch.tanh(self.c2(h)).mean(-1))


def _randomise_norms(model: nn.Module, gen: torch.Generator) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.normal_(generator=gen)
            m.running_var.uniform_(0.5, 2.0, generator=gen)
        if getattr(m, "weight", None) is not None and isinstance(
            m, (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)
        ):
            with torch.no_grad():
                m.weight.normal_(generator=gen)
                m.bias.normal_(generator=gen)
    return model


# ----------------------------------------------------------------------------- oracles


def _jacobian(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Brute-force per-sample Jacobians (N, C, P) in named_parameters order."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def f(p, xn):
        return functional_call(model, p, (xn.unsqueeze(0),)).squeeze(0)

    jac = vmap(jacrev(f), (None, 0))(params, x)
    return torch.cat([jac[k].flatten(2) for k in params], -1)


def _ggn(model: nn.Module, x: torch.Tensor, lik) -> torch.Tensor:
    jac = _jacobian(model, x)
    lam = lik.hessian(model(x).detach())
    return torch.einsum("ncp,nck,nkq->pq", jac, lam, jac)


def _block_mask(post) -> torch.Tensor:
    mask = torch.zeros(post.num_params, post.num_params, dtype=torch.bool)
    for b in post.blocks:
        idx = b.index.reshape(-1)
        mask[idx[:, None], idx[None, :]] = True
    return mask


def _kron_ggn(kron: KronGGN) -> torch.Tensor:
    post = kron.posterior(1.0)
    return post.precision_dense() - torch.eye(post.num_params, dtype=DT), post


# ----------------------------------------------------------------------------- functional MHA


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize(
    "kw",
    [{}, {"kdim": 3, "vdim": 5}, {"add_bias_kv": True, "add_zero_attn": True}, {"bias": False}],
)
def test_attention_forward_equals_the_module(batch_first, kw):
    torch.manual_seed(0)
    m = nn.MultiheadAttention(8, 2, batch_first=batch_first, **kw).to(DT).eval()
    q = torch.randn(2, 4, 8, dtype=DT)
    k = torch.randn(2, 3, kw.get("kdim", 8), dtype=DT)
    v = torch.randn(2, 3, kw.get("vdim", 8), dtype=DT)
    if not batch_first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    pad = torch.tensor([[False, False, True], [False, False, False]])
    causal = torch.triu(torch.ones(4, 3, dtype=torch.bool), 1)
    for extra in ({}, {"key_padding_mask": pad}, {"attn_mask": causal, "need_weights": False}):
        seen: list = []
        ref = m(q, k, v, **extra)
        out = attention_forward(m, lambda *r, seen=seen: seen.append(r), q, k, v, **extra)
        torch.testing.assert_close(out[0], ref[0], rtol=0, atol=1e-12)
        if ref[1] is not None:
            torch.testing.assert_close(out[1], ref[1], rtol=0, atol=1e-12)
        # the projections are reported batch first, as linear maps of their inputs
        assert [p for p, _, _ in seen] == ["q", "k", "v"]
        for _, a, s in seen:
            assert a.shape[0] == 2 and s.shape[:2] == a.shape[:2] and s.shape[-1] == 8


# ----------------------------------------------------------------------------- conv patches


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv1d(3, 4, 3, padding=2, dilation=2),
        nn.Conv1d(3, 4, 4, stride=2, padding=1, padding_mode="reflect"),
        nn.Conv2d(3, 4, (2, 3), dilation=(1, 2), padding="same", padding_mode="circular"),
        nn.Conv3d(3, 4, 2, padding=1, stride=(1, 2, 1), dilation=(2, 1, 1)),
    ],
)
def test_conv_patches_reproduce_the_convolution(conv):
    conv = conv.to(DT)
    x = torch.randn(2, 3, *([7] * (conv.weight.ndim - 2)), dtype=DT)
    patches = conv_patches(conv, x)  # (N, C_in prod(k), T)
    out = conv.weight.reshape(conv.out_channels, -1) @ patches + conv.bias[:, None]
    ref = conv(x)
    torch.testing.assert_close(out, ref.flatten(2), rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- exactness


def _one_token_models():
    gen = torch.Generator().manual_seed(3)
    tr = _randomise_norms(TinyTransformer(classes=1), gen)
    conv3d = nn.Sequential(
        nn.Conv3d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.LayerNorm(3), nn.Linear(3, 1)
    )
    conv1d = nn.Sequential(nn.Conv1d(2, 3, 4), nn.Tanh(), nn.Flatten(), nn.Linear(3, 1))
    return [
        ("transformer", tr, torch.tensor([[5]])),
        ("cross_attention", CrossAttention(), torch.randn(1, 1, 12, generator=gen)),
        ("cross_attention_bias_kv", CrossAttention(True), torch.randn(1, 1, 12, generator=gen)),
        ("conv3d", conv3d, torch.randn(1, 2, 3, 3, 3, generator=gen)),
        ("conv1d", conv1d, torch.randn(1, 2, 4, generator=gen)),
    ]


@pytest.mark.parametrize("case", _one_token_models(), ids=lambda c: c[0])
def test_one_point_one_output_kfac_equals_the_exact_ggn_blocks(case):
    # One data point, one output, one location per layer: every Kronecker block (Linear,
    # attention projections, embedding, convolution) and every exact block (norm layers,
    # bias_k/bias_v) equals the exact GGN's block (float64).
    _, model, x = case
    torch.manual_seed(0)
    model = model.to(DT).eval()
    x = x.to(DT) if x.is_floating_point() else x
    lik = Gaussian()
    kron = KronGGN(model, lik, "all")
    kron.update(model, x, torch.zeros(1, 1, dtype=DT))
    g_kron, post = _kron_ggn(kron)
    g = _ggn(model, x, lik)
    mask = _block_mask(post)
    torch.testing.assert_close(g_kron, torch.where(mask, g, torch.zeros_like(g)), rtol=0, atol=1e-8)
    assert float(g[mask].abs().max()) > 1e-3  # not vacuous


@pytest.mark.parametrize("structure_of_output", ["per_location", "pooled"])
def test_sequence_linear_expand_and_reduce_are_exact_in_their_settings(structure_of_output):
    # Eschenhagen et al. (2023): a Linear over (N, T, in) with per-location outputs (Gaussian,
    # the T outputs flattened) has G = I kron sum_{n,t} a a^T, which KFAC-expand gives exactly;
    # mean-pooled over T (one data point), G = Lambda kron abar abar^T, which reduce gives.
    torch.manual_seed(0)
    lin = nn.Linear(3, 2).to(DT)
    if structure_of_output == "per_location":
        model, lik, n, exact_variant = nn.Sequential(lin, nn.Flatten()), Gaussian(), 3, "expand"
        y = torch.zeros(n, 10, dtype=DT)
    else:

        class Pooled(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = lin

            def forward(self, x):
                return self.lin(x).mean(1)

        model, lik, n, exact_variant = Pooled(), Categorical(), 1, "reduce"
        y = torch.zeros(n, dtype=torch.long)
    model.eval()
    x = torch.randn(n, 5, 3, dtype=DT)
    g = _ggn(model, x, lik)
    for variant in ("expand", "reduce"):
        kron = KronGGN(model, lik, "all", kfac_approx=variant)
        kron.update(model, x, y)
        g_kron, _ = _kron_ggn(kron)
        close = torch.allclose(g_kron, g, rtol=0, atol=1e-8)
        assert close == (variant == exact_variant), variant


def test_embedding_input_factor_is_the_diagonal_token_count():
    torch.manual_seed(0)

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(7, 3, padding_idx=0)
            self.head = nn.Linear(3, 2)

        def forward(self, x):
            return self.head(torch.tanh(self.emb(x)).mean(1))

    model = Bag().to(DT).eval()
    x = torch.tensor([[0, 1, 1, 4], [2, 0, 4, 4], [6, 6, 6, 1]])
    y = torch.tensor([0, 1, 1])
    kron = KronGGN(model, Categorical(), "all")
    kron.update(model, x, y)
    a, b, m = kron.kron_factors()["emb"]
    assert a.shape == (7,)  # a vector, never a (V, V) factor
    onehot = F.one_hot(x, 7).to(DT).reshape(-1, 7)
    onehot[:, 0] = 0  # padding tokens get no gradient
    dense = onehot.T @ onehot
    torch.testing.assert_close(torch.diag(a), dense, rtol=0, atol=0)
    assert float(m) == x.numel()
    # B = sum_{n,t,c} g g^T of the columns of L_n backpropagated to the embedding output
    out = {}
    h = model.emb.register_forward_hook(lambda mod, i, o: out.setdefault("e", o))
    f = model(x)
    h.remove()
    lsqrt = Categorical().hessian_sqrt(f.detach())  # (N, C, C)
    ref = torch.zeros(3, 3, dtype=DT)
    for c in range(2):
        (g,) = torch.autograd.grad(f, out["e"], lsqrt[:, :, c], retain_graph=True)
        g = g.reshape(-1, 3)
        ref += g.T @ g
    torch.testing.assert_close(b, ref, rtol=0, atol=1e-12)
    # "reduce" would make A a dense (V, V) matrix: an embedding always expands
    reduced = KronGGN(model, Categorical(), "all", kfac_approx="reduce")
    reduced.update(model, x, y)
    for got, want in zip(reduced.kron_factors()["emb"], (a, b, m), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("full_max", [1024, 2])
def test_exact_blocks_equal_the_exact_ggn_entries(full_max):
    # BatchNorm (eval, random statistics) and a grouped convolution have no Kronecker form:
    # their blocks are the exact GGN's, full up to exact_full_max entries, diagonal above.
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    model = _randomise_norms(ResBlockNet(), gen).to(DT).eval()
    x = torch.randn(5, 2, 5, 5, dtype=DT, generator=gen)
    y = torch.randint(0, 3, (5,), generator=gen)
    kron = KronGGN(model, Categorical(), "all", exact_full_max=full_max)
    kron.update(model, x, y)
    blocks = kron.exact_blocks()
    assert sorted(blocks) == [
        "bn0.bias",
        "bn0.weight",
        "bn1.bias",
        "bn1.weight",
        "grouped.bias",
        "grouped.weight",
    ]
    g = _ggn(model, x, Categorical())
    offsets, pos = {}, 0
    for name, p in model.named_parameters():
        offsets[name] = slice(pos, pos + p.numel())
        pos += p.numel()
    for name, block in blocks.items():
        ref = g[offsets[name], offsets[name]]
        if block.ndim == 1:
            assert full_max < block.numel()
            ref = ref.diagonal()
        torch.testing.assert_close(block, ref, rtol=0, atol=1e-8)


# ----------------------------------------------------------------------------- posterior


def test_mixed_block_posterior_matches_its_dense_matrix():
    # Kronecker blocks, a diagonal-A embedding block, exact full and exact diagonal blocks in
    # one posterior: logdet, solve, covariance diagonal, functional covariance and samples
    # agree with the dense precision; per-tensor priors and a GGN scale included.
    gen = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    model = _randomise_norms(TinyTransformer(), gen).to(DT).eval()
    x = torch.randint(0, 12, (6, 4), generator=gen)
    y = torch.randint(0, 3, (6,), generator=gen)
    kron = KronGGN(model, Categorical(), "all", exact_full_max=4)
    kron.update(model, x, y)
    assert any(b.ndim == 1 for b in kron.exact_blocks().values())
    names = kron.subset.names
    prior = torch.linspace(0.5, 2.0, len(names), dtype=DT)
    post = kron.posterior(prior, 0.7)
    dense = post.precision_dense()
    torch.testing.assert_close(dense, dense.mT, rtol=0, atol=1e-12)
    sigma = torch.linalg.inv(dense)
    torch.testing.assert_close(post.logdet(), torch.linalg.slogdet(dense)[1], rtol=1e-10, atol=0)
    v = torch.randn(3, post.num_params, dtype=DT, generator=gen)
    torch.testing.assert_close(post.solve(v), v @ sigma, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(post.covariance_diag(), sigma.diagonal(), rtol=1e-8, atol=1e-12)
    jac = _jacobian(model, x[:2])
    torch.testing.assert_close(
        post.functional_cov(jac), jac @ sigma @ jac.mT, rtol=1e-8, atol=1e-12
    )
    draws = post.sample(8000, generator=gen)
    proj = v @ sigma @ v.mT
    emp = (draws @ v.mT).square().mean(0)
    torch.testing.assert_close(emp, proj.diagonal(), rtol=0.06, atol=0)


# ----------------------------------------------------------------------------- whole models


def _case(name: str):
    gen = torch.Generator().manual_seed(4)
    torch.manual_seed(4)
    if name == "transformer":
        model = _randomise_norms(TinyTransformer(), gen)
        x = torch.randint(0, 12, (16, 5), generator=gen)
    elif name == "resnet":
        model = _randomise_norms(ResBlockNet(), gen)
        x = torch.randn(16, 2, 5, 5, generator=gen)
    else:
        model = _randomise_norms(SeqConv(), gen)
        x = torch.randn(16, 3, 9, generator=gen)
    model = model.to(DT).eval()
    x = x.to(DT) if x.is_floating_point() else x
    with torch.no_grad():
        y = model(x).argmax(-1)
    return model, x, y


@pytest.mark.parametrize("name", ["transformer", "resnet", "conv1d"])
def test_kron_fits_tunes_and_predicts_like_its_brute_force_twin(name):
    # structure="kron" on the three model families of issue 22: the evidence at the tuned
    # prior equals the formula with a dense slogdet of the same block-diagonal precision, the
    # tuned prior is a maximum, and the GLM predictive equals J Sigma J^T from brute-force
    # float64 Jacobians.
    model, x, y = _case(name)
    la = gs.Laplace(model, "classification", "kron", "all", correction=False).fit((x, y))
    la.optimize_prior()
    prior = la.prior_precision.reshape(())
    dense = la.posterior.precision_dense()
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    with torch.no_grad():
        log_lik = -F.cross_entropy(model(x), y, reduction="sum")
    num = theta.numel()
    ref = (
        log_lik
        - 0.5 * prior * theta.square().sum()
        + 0.5 * (num * prior.log() - torch.linalg.slogdet(dense)[1])
    )
    evidence = la.log_marginal_likelihood()
    torch.testing.assert_close(evidence.to(DT), ref, rtol=1e-9, atol=1e-8)
    for factor in (1.05, 1 / 1.05):
        assert float(la.log_marginal_likelihood(prior * factor)) <= float(evidence) + 1e-9
    pred = la.predict(x[:4], link="probit")
    jac = _jacobian(model, x[:4])
    sigma = torch.linalg.inv(dense)
    with torch.no_grad():
        f = model(x[:4])
    torch.testing.assert_close(pred.f_mean, f, rtol=0, atol=1e-10)
    torch.testing.assert_close(pred.f_cov, jac @ sigma @ jac.mT, rtol=1e-7, atol=1e-10)
    assert math.isfinite(float(evidence))


# ----------------------------------------------------------------------------- traced predictive


def test_traced_predictive_covers_conv2d_and_equals_the_jacobian_route():
    # issue 17/22: a Conv2d Kronecker block's Jacobian rows are sum_t delta_t f_t^T over its
    # output locations; the traced route builds them from patches and output gradients and
    # must equal functional_cov of the brute-force Jacobian (joint weight+bias blocks with
    # different priors: the rank-one bias terms), and the mean f + J shift.
    from gaussify.curvature.kron import traced_predictive

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1, stride=2),
        nn.Tanh(),
        nn.Conv2d(3, 4, 2, padding_mode="reflect", padding=1),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    )
    model = model.to(DT).eval()
    x = torch.randn(8, 2, 6, 6, dtype=DT)
    y = torch.randint(0, 3, (8,))
    kron = KronGGN(model, Categorical(), "all")
    kron.update(model, x, y)
    prior = torch.tensor([0.5, 2.0, 1.0, 3.0, 0.7, 1.5], dtype=DT)
    post = kron.posterior(prior, 0.9)
    shift = torch.randn(post.num_params, dtype=DT) * 0.01
    out = traced_predictive(post, model, x[:5], kron.subset, shift)
    assert out is not None  # the convolutions are on the traced route now
    jac = _jacobian(model, x[:5])
    with torch.no_grad():
        f = model(x[:5])
    torch.testing.assert_close(out[0], f + jac @ shift, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out[1], post.functional_cov(jac), rtol=1e-9, atol=1e-12)
    diag = traced_predictive(post, model, x[:5], kron.subset, shift, diagonal=True)
    assert diag is not None
    torch.testing.assert_close(
        diag[1].diagonal(dim1=-2, dim2=-1), post.functional_var(jac), rtol=1e-9, atol=1e-12
    )


def test_traced_predictive_declines_modules_off_its_route():
    # an embedding / exact block is not on the traced route: None, and Laplace then uses the
    # dense Jacobian route
    from gaussify.curvature.kron import traced_predictive

    model, x, y = _case("transformer")
    kron = KronGGN(model, Categorical(), "all")
    kron.update(model, x, y)
    post = kron.posterior(1.0)
    assert not post.traced_blocks()
    assert traced_predictive(post, model, x, kron.subset, torch.zeros(post.num_params)) is None


# ----------------------------------------------------------------------------- shared weights


def test_tied_weight_gets_exact_blocks_and_the_rest_stays_kronecker():
    # a weight used by two modules has no Kronecker form; its module's tensors fall back to
    # exact blocks (one warning), the other blocks are unchanged, all equal the exact GGN's
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 2)
            self.c = nn.Linear(3, 3)
            self.c.weight = self.a.weight

        def forward(self, x):
            return self.b(torch.tanh(self.c(torch.tanh(self.a(x)))))

    torch.manual_seed(0)
    model = Tied().to(DT).eval()
    x = torch.randn(1, 3, dtype=DT)
    kron = KronGGN(model, Gaussian(), "all")
    with pytest.warns(UserWarning, match="'a'.*shares its parameter 'a.weight'"):
        kron.update(model, x, torch.zeros(1, 2, dtype=DT))
    assert sorted(kron.exact_blocks()) == ["a.bias", "a.weight"]
    assert sorted(kron.kron_factors()) == ["b", "c"]
    g_kron, post = _kron_ggn(kron)
    g = _ggn(model, x, Gaussian())
    torch.testing.assert_close(
        g_kron, torch.where(_block_mask(post), g, torch.zeros_like(g)), rtol=0, atol=1e-10
    )


def test_out_proj_alone_is_captured_through_the_functional_attention():
    # out_proj is applied inside F.multi_head_attention_forward, so its hooks only fire on the
    # functional forward; with the in-projection outside the subset it must still be captured
    torch.manual_seed(0)
    model = _randomise_norms(TinyTransformer(classes=1), torch.Generator().manual_seed(0))
    model = model.to(DT).eval()
    names = ["enc.self_attn.out_proj.weight", "enc.self_attn.out_proj.bias"]
    x = torch.tensor([[3]])
    kron = KronGGN(model, Gaussian(), names)
    kron.update(model, x, torch.zeros(1, 1, dtype=DT))
    g_kron, _ = _kron_ggn(kron)
    full = _ggn(model, x, Gaussian())
    offsets = dict.fromkeys(n for n, _ in model.named_parameters())
    pos = 0
    for n, p in model.named_parameters():
        offsets[n] = pos
        pos += p.numel()
    start = offsets[names[0]]
    block = full[start : start + 8 * 8 + 8, start : start + 8 * 8 + 8]
    torch.testing.assert_close(g_kron, block, rtol=0, atol=1e-8)
    assert float(block.abs().max()) > 1e-3


def test_attention_factors_over_a_sequence_match_a_hand_written_attention():
    # T > 1: the q/k/v/out_proj factors from the captured projections equal the definition
    # A = sum_{n,t} [a, 1][a, 1]^T, B = sum_{n,t,c} g g^T with g the gradients of the output
    # vectors (columns of L_n) wrt each projection's output, computed on an independent
    # hand-written two-head attention sharing the module's weights
    torch.manual_seed(0)

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
            self.head = nn.Linear(4, 3)

        def forward(self, x):
            return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))

    model = Attn().to(DT).eval()
    n, t, e = 3, 5, 4
    x = torch.randn(n, t, e, dtype=DT)
    y = torch.randint(0, 3, (n,))
    kron = KronGGN(model, Categorical(), "all")
    kron.update(model, x, y)
    factors = kron.kron_factors()
    w, b = model.attn.in_proj_weight, model.attn.in_proj_bias
    proj = [x @ w[i * e : (i + 1) * e].mT + b[i * e : (i + 1) * e] for i in range(3)]
    proj = [p.detach().requires_grad_(True) for p in proj]

    def heads(z):
        return z.reshape(n, t, 2, 2).transpose(1, 2)

    q, k, v = (heads(p) for p in proj)
    att = torch.softmax(q @ k.mT / math.sqrt(2), -1) @ v
    o = att.transpose(1, 2).reshape(n, t, e)
    s = model.attn.out_proj(o)
    f = model.head(s.mean(1))
    lsqrt = Categorical().hessian_sqrt(f.detach())
    ones = torch.ones(n, t, 1, dtype=DT)
    for key, inp, out in [
        ("attn:q", x, proj[0]),
        ("attn:k", x, proj[1]),
        ("attn:v", x, proj[2]),
        ("attn.out_proj", o.detach(), s),
    ]:
        a_ref = torch.cat([inp, ones], -1).reshape(-1, e + 1)
        b_ref = torch.zeros(e, e, dtype=DT)
        for c in range(3):
            (g,) = torch.autograd.grad(f, out, lsqrt[:, :, c], retain_graph=True)
            b_ref += g.reshape(-1, e).mT @ g.reshape(-1, e)
        a, bb, m = factors[key]
        torch.testing.assert_close(a, a_ref.mT @ a_ref, rtol=0, atol=1e-10)
        torch.testing.assert_close(bb, b_ref, rtol=1e-8, atol=1e-10)
        assert float(m) == n * t
        assert float(bb.abs().max()) > 1e-4


def test_chunked_and_batched_updates_give_the_same_factors():
    # the factors and exact blocks are sums over data: chunks and batches do not change them
    for name in ("transformer", "resnet", "conv1d"):
        model, x, y = _case(name)
        whole = KronGGN(model, Categorical(), "all")
        whole.update(model, x, y)
        parts = KronGGN(model, Categorical(), "all", chunk_size=5)
        parts.update(model, x[:7], y[:7])
        parts.update(model, x[7:], y[7:])
        sa, sb = whole.state_dict(), parts.state_dict()
        assert sa.keys() == sb.keys()
        for key in sa:
            torch.testing.assert_close(sb[key], sa[key], rtol=1e-12, atol=1e-12)


def test_a_subclass_that_changes_forward_gets_exact_blocks():
    # a Linear subclass computing W (2 a) + b is not the map the Linear adapter assumes
    class Doubled(nn.Linear):
        def forward(self, x):
            return super().forward(2 * x)

    class Plain(nn.Linear):  # same forward: still a Kronecker block
        pass

    torch.manual_seed(0)
    model = nn.Sequential(Doubled(3, 4), nn.Tanh(), Plain(4, 1)).to(DT).eval()
    x = torch.randn(1, 3, dtype=DT)
    kron = KronGGN(model, Gaussian(), "all")
    kron.update(model, x, torch.zeros(1, 1, dtype=DT))
    assert sorted(kron.exact_blocks()) == ["0.bias", "0.weight"]
    assert list(kron.kron_factors()) == ["2"]
    g_kron, post = _kron_ggn(kron)
    g = _ggn(model, x, Gaussian())
    torch.testing.assert_close(
        g_kron, torch.where(_block_mask(post), g, torch.zeros_like(g)), rtol=0, atol=1e-10
    )


def test_reduce_refuses_a_sequence_first_layer_and_expand_does_not_care():
    # a Linear applied to (T, N, in): "expand" sums over every row, so it equals the
    # batch-first twin; "reduce" would average over the wrong axis and says so
    class SeqFirst(nn.Module):
        def __init__(self, lin, head, batch_first):
            super().__init__()
            self.lin, self.head, self.batch_first = lin, head, batch_first

        def forward(self, x):
            h = torch.tanh(self.lin(x if self.batch_first else x.transpose(0, 1)))
            return self.head(h.mean(1 if self.batch_first else 0))

    torch.manual_seed(0)
    lin, head = nn.Linear(3, 4).to(DT), nn.Linear(4, 2).to(DT)
    x, y = torch.randn(5, 4, 3, dtype=DT), torch.randint(0, 2, (5,))
    states = []
    for batch_first in (True, False):
        model = SeqFirst(lin, head, batch_first).eval()
        kron = KronGGN(model, Categorical(), "all")
        kron.update(model, x, y)
        states.append(kron.state_dict())
    for key in states[0]:
        torch.testing.assert_close(states[1][key], states[0][key], rtol=1e-12, atol=1e-12)
    model = SeqFirst(lin, head, False).eval()
    kron = KronGGN(model, Categorical(), "all", kfac_approx="reduce")
    with pytest.raises(ValueError, match=r"kfac_approx='reduce'.*'lin'.*\(4, 5, 3\).*'expand'"):
        kron.update(model, x, y)


@pytest.mark.parametrize("name", ["transformer", "resnet", "conv1d"])
def test_affine_norm_blocks_come_from_output_gradients(name, monkeypatch):
    # LayerNorm / BatchNorm2d (eval) / GroupNorm: v^T J_w = sum (g * xhat), v^T J_b = sum g
    # over the layer's positions, no per-sample Jacobian (the generic route is switched off
    # here); the blocks equal the brute-force GGN's
    import gaussify.curvature.kron_exact as kron_exact

    model, x, y = _case(name)
    x, y = x[:6], y[:6]
    kron = KronGGN(model, Categorical(), "all", exact_full_max=4)
    if name != "resnet":  # the resnet's grouped conv still needs the generic route
        monkeypatch.setattr(kron_exact, "jacobians", None)
    kron.update(model, x, y)
    g = _ggn(model, x, Categorical())
    offsets, pos = {}, 0
    for pname, p in model.named_parameters():
        offsets[pname] = slice(pos, pos + p.numel())
        pos += p.numel()
    norms = [n for n in kron.exact_blocks() if "norm" in n or "bn" in n]
    assert norms
    for pname in norms:
        block, ref = kron.exact_blocks()[pname], g[offsets[pname], offsets[pname]]
        ref = ref.diagonal() if block.ndim == 1 else ref
        torch.testing.assert_close(block, ref, rtol=1e-10, atol=1e-10)
