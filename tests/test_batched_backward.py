"""The batched backward route (one pass for the K output vectors through an nn.Sequential):
equal to a float64 brute-force Jacobian GGN and to the per-vector autograd route it replaces,
for the diagonal and the KFAC factors, exact / Monte Carlo / empirical Fisher."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

from gaussify.curvature import make_curvature
from gaussify.curvature.base import middle_factor
from gaussify.curvature.batched_backward import (
    backward_peak,
    chain_forward,
    module_chain,
    rule_chunk,
)
from gaussify.likelihoods import get_likelihood


class Wrapped(nn.Module):
    """The same network behind a custom forward: not a chain, so the per-vector route runs."""

    def __init__(self, net: nn.Sequential) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


#: CPU, and CUDA where a GPU is present
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]


def generator(device: str, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return (
        nn.Sequential(
            nn.Linear(5, 7),
            nn.Tanh(),
            nn.Sequential(nn.Linear(7, 6), nn.ReLU()),
            nn.Linear(6, 6),
            nn.GELU(),
            nn.Dropout(0.3),
            nn.Linear(6, 4),
        )
        .double()
        .eval()
    )


def cnn(seed: int = 0, groups: int = 2) -> nn.Sequential:
    torch.manual_seed(seed)
    bn = nn.BatchNorm2d(4, affine=False)  # parameters of other modules: the generic path
    bn.running_mean.uniform_(-0.5, 0.5)
    bn.running_var.uniform_(0.5, 2.0)
    return (
        nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1),
            nn.ReLU(),
            bn,
            nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=groups),
            nn.Sigmoid(),
            nn.MaxPool2d(2, ceil_mode=True),
            nn.Conv2d(4, 3, 1),
            nn.ELU(),
            nn.AvgPool2d(1),
            nn.Flatten(),
            nn.Linear(3 * 2 * 2, 5),
        )
        .double()
        .eval()
    )


def data(kind: str, n: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = (
        torch.randn(n, 5, generator=gen, dtype=torch.float64)
        if kind == "mlp"
        else torch.randn(n, 2, 7, 7, generator=gen, dtype=torch.float64)
    )
    c = 4 if kind == "mlp" else 5
    return x, torch.randint(0, c, (n,), generator=gen)


def brute_diag(model: nn.Module, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """sum_n sum_k (J_n^T L_n[:, k])^2 from per-sample float64 Jacobians (N, C, P)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def f(p: dict, xn: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (xn.unsqueeze(0),)).squeeze(0)

    jac = vmap(jacrev(f), in_dims=(None, 0))(params, x)
    j = torch.cat([jac[k].flatten(2) for k in params], dim=2)  # (N, C, P)
    return torch.einsum("ncp,nck->nkp", j, factor).square().sum((0, 1))


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("flavour", ["exact", "mc", "ef"])
@pytest.mark.parametrize("device", DEVICES)
def test_diag_equals_float64_brute_force(kind: str, flavour: str, device: str) -> None:
    model = (mlp() if kind == "mlp" else cnn()).to(device)
    assert module_chain(model) is not None
    x, y = (t.to(device) for t in data(kind))
    opts = {"ef": flavour == "ef", "mc_samples": 3 if flavour == "mc" else 0}
    curv = make_curvature("diag", model, "classification", generator=generator(device, 5), **opts)
    curv.update(model, x, y)
    lik = get_likelihood("classification")
    with torch.no_grad():
        f = model(x)
    draws = None
    if flavour == "mc":  # the same draws as the curvature's (same generator, same chunks)
        twin = make_curvature(
            "diag", model, "classification", generator=generator(device, 5), **opts
        )
        draws = twin._draw(f)
    factor = middle_factor(lik, f, y, ef=flavour == "ef", draws=draws)
    expected = brute_diag(model, x, factor)
    torch.testing.assert_close(curv.ggn_diag, expected, rtol=1e-10, atol=1e-12)
    assert not curv.ggn_diag.requires_grad  # no autograd graph across batches


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("flavour", ["exact", "mc", "ef"])
def test_diag_equals_per_vector_route(kind: str, flavour: str) -> None:
    """The chain route and the per-vector autograd route (the same network behind a custom
    forward) give the same diagonal, also in chunks of 2 samples (Monte Carlo: same draws)."""
    net = mlp() if kind == "mlp" else cnn()
    x, y = data(kind)
    opts = {"ef": flavour == "ef", "mc_samples": 2 if flavour == "mc" else 0}
    results = []
    for model, chunk in [(net, None), (net, 2), (Wrapped(net).eval(), None)]:
        curv = make_curvature(
            "diag",
            model,
            "classification",
            generator=torch.Generator().manual_seed(3),
            chunk_size=chunk,
            **opts,
        )
        curv.update(model, x, y)
        results.append(curv.ggn_diag)
    torch.testing.assert_close(results[0], results[2], rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(results[1], results[2], rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("flavour", ["exact", "mc", "ef"])
@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_kron_factors_equal_per_vector_route(kind: str, flavour: str, approx: str) -> None:
    net = mlp() if kind == "mlp" else cnn(groups=1)  # KFAC: groups = 1
    x, y = data(kind)
    opts = {"ef": flavour == "ef", "mc_samples": 3 if flavour == "mc" else 0}
    factors = []
    for model in (net, Wrapped(net).eval()):
        curv = make_curvature(
            "kron",
            model,
            "classification",
            generator=torch.Generator().manual_seed(3),
            kfac_approx=approx,
            **opts,
        )
        curv.update(model, x, y)
        factors.append({k.removeprefix("net."): v for k, v in curv.kron_factors().items()})
    assert factors[0].keys() == factors[1].keys()
    for path, (a, b, m) in factors[0].items():
        a2, b2, m2 = factors[1][path]
        torch.testing.assert_close(a, a2, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(b, b2, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(m, m2)


def test_kron_single_sample_is_exact_ggn_block() -> None:
    """For one data point KFAC's blocks are exact (module docstring of kron): the diagonal of
    B ⊗ A / M over a linear layer's [W, b] equals the float64 brute-force GGN diagonal."""
    model = mlp()
    x, y = data("mlp", n=1)
    curv = make_curvature("kron", model, "classification")
    curv.update(model, x, y)
    lik = get_likelihood("classification")
    with torch.no_grad():
        f = model(x)
    diag = brute_diag(model, x, lik.hessian_sqrt(f))
    a, b, m = curv.kron_factors()["2.0"]  # Linear(7, 6) inside the nested Sequential
    block = torch.kron(b, a) / m  # rows (out, [in, 1])
    names = [n for n, _ in model.named_parameters()]
    sizes = [p.numel() for p in model.parameters()]
    start = sum(sizes[: names.index("2.0.weight")])
    w_diag = diag[start : start + 42].view(6, 7)
    b_diag = diag[start + 42 : start + 48]
    kd = block.diagonal().view(6, 8)
    torch.testing.assert_close(kd[:, :7], w_diag, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(kd[:, 7], b_diag, rtol=1e-10, atol=1e-13)


def test_one_batched_pass_instead_of_one_per_vector(monkeypatch: pytest.MonkeyPatch) -> None:
    """The K = C = 4 columns of Lambda^{1/2} go back together: no autograd pass per column for
    a chain of Linear / ReLU / Tanh layers (the per-vector route made K of them)."""
    calls = []
    grad = torch.autograd.grad

    def counting(*args, **kwargs):
        calls.append(1)
        return grad(*args, **kwargs)

    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    conv = nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.Sigmoid(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(12, 4)
    )
    model, conv = model.double(), conv.double()
    monkeypatch.setattr(torch.autograd, "grad", counting)
    for net, kind in ((model, "mlp"), (conv, "cnn")):
        x, y = data(kind)
        for structure in ("diag", "kron"):
            curv = make_curvature(structure, net.eval(), "classification")
            curv.update(net, x, y)
    assert calls == []


def test_module_chain_refuses_what_it_cannot_propagate() -> None:
    assert module_chain(Wrapped(mlp())) is None  # custom forward
    assert module_chain(nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))) is None
    shared = nn.Linear(3, 3)
    assert module_chain(nn.Sequential(shared, nn.Tanh(), shared)) is None  # a module twice
    assert module_chain(nn.Sequential(nn.Conv2d(1, 2, 3, padding="same"))) is None
    assert module_chain(nn.Sequential(nn.Conv2d(1, 2, 3, padding_mode="reflect"))) is None
    assert module_chain(nn.Sequential(nn.Dropout(0.5).train())) is None
    names = [name for name, _ in module_chain(mlp())]
    assert names == ["0", "1", "2.0", "2.1", "3", "4", "5", "6"]


def test_rule_chunk_follows_the_memory_rule() -> None:
    """Samples per chunk = (1.7 (step + S) - N sum(a) - N K C - S - buffers) // peak, with a
    training step's allocations step = max_j N (sum_{i <= j+1} a_i + g_j + g_{j+1}) + P_{>=j}
    in elements (the activations not yet freed, the gradients of one module's input and output,
    the weight gradients above it), a the activations the backward pass reads and that are allocated
    (the tanh's output and f here; not the caller's x; the tanh's input is shape-only), and
    peak the most K-fold elements alive at once per sample: the first linear layer's gradient
    and its square, 2 K 20 (more than K (20 + 10) while it propagates)."""
    model = nn.Sequential(nn.Linear(10, 20), nn.Tanh(), nn.Linear(20, 3))
    run = chain_forward(list(model.named_children()), torch.randn(50, 10))
    assert run.acts[1].device.type == "meta" and run.acts[2].device.type == "cpu"
    acts, storage, k = 20 + 3, 283, 3
    # at the tanh: its output, its two gradients and the last layer's 63 weight gradients
    step = max(50 * (acts + 3 + 20) + 63, 50 * (20 + 20 + 20) + 63, 50 * 20 + 283)
    budget = (17 * (step + storage)) // 10 - 50 * acts - 50 * k * 3 - storage
    assert backward_peak(run, k, set()) == 2 * k * 20
    assert backward_peak(run, k, {0}) == 2 * k * 20 + 20 + 10  # + the sums, the input squared
    assert rule_chunk(run, model, k, storage) == budget // (2 * k * 20)
    budget -= storage  # a diagonal's batch temporary
    assert rule_chunk(run, model, k, storage, copies=2) == budget // (2 * k * 20)
    assert rule_chunk(run, model, k, storage, copies=2, buffers=700) == (budget - 700) // (
        2 * k * 20
    )
    budget += 50 * k * 3  # the vectors formed per chunk instead: K C more per sample
    assert rule_chunk(run, model, k, storage, copies=2, rowwise=True) == budget // (
        2 * k * 20 + k * 3
    )


def test_backward_peak_counts_a_convolution_s_per_sample_gradients() -> None:
    """At a convolution whose per-sample weight gradients are formed (the diagonal), the
    gradient K out, the im2col patches (C_in kh kw T) and K per-sample weight gradients
    (C_out C_in kh kw) are alive at once; through a max-pooling both its gradients, K (in +
    out)."""
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16, 2)
    )
    run = chain_forward(list(model.named_children()), torch.randn(6, 1, 4, 4))
    k, t = 2, 16
    conv = k * 4 * t + 9 * t + k * 4 * 9
    assert backward_peak(run, k, {0}) == conv
    # the Gram route (no per-sample gradients): the gradient and its reordered copy, 2 K 64
    assert backward_peak(run, k, set()) == 2 * k * 64
    # a deeper pooling: its two gradients dominate, K (in + out)
    pool_run = chain_forward([("0", nn.MaxPool2d(2))], torch.randn(3, 4, 8, 8))
    assert backward_peak(pool_run, k, set()) == k * (256 + 64)


def test_strided_dilated_convolutions_restore_the_input_size() -> None:
    """The convolution's adjoint (a transposed convolution) restores inputs that a stride drops
    rows of: 8 x 8 -> 4 x 4 (stride 2, dilation 2: one row and column dropped) and 4 x 4 ->
    1 x 1 (kernel 2, stride 3: two dropped); the diagonal GGN equals the float64 brute force."""
    torch.manual_seed(3)
    model = (
        nn.Sequential(
            nn.Conv2d(2, 3, 3, stride=2, padding=2, dilation=2),
            nn.Tanh(),
            nn.Conv2d(3, 2, 2, stride=3),
            nn.Flatten(),
            nn.Linear(2, 3),
        )
        .double()
        .eval()
    )
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 2, 8, 8, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (6,), generator=gen)
    assert module_chain(model) is not None
    curv = make_curvature("diag", model, "classification")
    curv.update(model, x, y)
    with torch.no_grad():
        factor = middle_factor(get_likelihood("classification"), model(x), y, ef=False, draws=None)
    expected = brute_diag(model, x, factor)
    torch.testing.assert_close(curv.ggn_diag, expected, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_groups_of_vectors_equal_all_vectors(
    kind: str, structure: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When one sample with all K vectors exceeds the memory rule, the vectors go back in
    groups of K' (rule_columns): the sums over K are sums over the groups, so the diagonal
    equals the float64 brute force and KFAC's factors equal those of one pass with all K
    (K' = 2 of K = 4 / 5 forced here, one sample per chunk)."""
    from gaussify.curvature import chain_diag, kron_grams

    net = mlp() if kind == "mlp" else cnn(groups=1)
    x, y = data(kind)
    opts = {"kron_bias": "separate"} if structure == "kron" else {}
    reference = make_curvature(structure, net, "classification", **opts)
    reference.update(net, x, y)
    calls = []

    def no_sample_fits(*args: object, floor: int = 1, **kwargs: object) -> int:
        return floor

    def two(*args: object, **kwargs: object) -> int:
        calls.append(args[2])  # K
        return 2

    for module in (chain_diag, kron_grams):
        monkeypatch.setattr(module, "rule_chunk", no_sample_fits)
        monkeypatch.setattr(module, "rule_columns", two)
    curv = make_curvature(structure, net, "classification", **opts)
    curv.update(net, x, y)
    assert calls and all(k > 2 for k in calls)
    if structure == "diag":
        with torch.no_grad():
            f = net(x)
        factor = middle_factor(get_likelihood("classification"), f, y, ef=False, draws=None)
        expected = brute_diag(net, x, factor)
        torch.testing.assert_close(curv.ggn_diag, expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(curv.ggn_diag, reference.ggn_diag, rtol=1e-10, atol=1e-13)
        return
    for path, (a, b, m) in reference.kron_factors().items():
        a2, b2, m2 = curv.kron_factors()[path]
        torch.testing.assert_close(a2, a, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(b2, b, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(m2, m)


@pytest.mark.parametrize("groups", [1, 2])
def test_conv_squared_grads_in_groups_of_vectors_equal_the_brute_force(groups: int) -> None:
    """A convolution whose weight is far larger than its output (8 -> 6 channels, 3 x 3
    kernel on a 4 x 4 input: 24 outputs, 216 weights per group's block) forms the per-sample
    weight gradients of K' = K out / weight = 1 vector at a time: the squared sums over
    (sample, vector) equal the float64 brute force sum_{n,k} (sum_t d a_t^T)^2."""
    from gaussify.curvature.batched_backward import conv_vector_group
    from gaussify.curvature.chain_diag import _conv_squared_grads
    from gaussify.curvature.patches import conv2d_patches, conv_weight_grads

    torch.manual_seed(0)
    conv = nn.Conv2d(8, 6, 3, groups=groups).double()
    x = torch.randn(3, 8, 4, 4, dtype=torch.float64)
    k = 5
    d = torch.randn(3, k, 6, 2, 2, dtype=torch.float64)
    assert conv_vector_group(conv, k, d[0, 0].numel()) == 1
    patches = conv2d_patches(conv, x)
    expected = sum(conv_weight_grads(conv, patches, d[:, j]).square().sum(0) for j in range(k))
    got = _conv_squared_grads(conv, patches, d)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert conv_vector_group(nn.Conv2d(1, 4, 3), k, 4 * 16) == k  # small weight: all K


def test_conv_vector_groups_are_even() -> None:
    """At most K out / weight vectors per group, in as few groups as that allows and as
    even as their count allows: 9 vectors with at most 4 per group (16 -> 16 channels, 3 x 3
    kernel, 8 x 8 outputs: 9 * 1024 // 2304 = 4) go as 3 + 3 + 3, not 4 + 4 + 1; 16 with at
    most 7 as 6 + 6 + 4."""
    from gaussify.curvature.batched_backward import conv_vector_group

    conv = nn.Conv2d(16, 16, 3, padding=1)
    assert conv_vector_group(conv, 9, 16 * 64) == 3
    assert conv_vector_group(conv, 16, 16 * 64) == 6
    assert conv_vector_group(conv, 1, 16 * 64) == 1
    for k in range(1, 40):
        step = conv_vector_group(conv, k, 16 * 64)
        most = max(1, min(k, k * 16 * 64 // conv.weight.numel()))
        assert step <= most and -(-k // step) == -(-k // most)


def test_relu_output_read_only_as_a_mask_is_kept_as_the_mask() -> None:
    """A ReLU whose output only the ReLU's derivative reads (a max-pooling follows) keeps its
    boolean mask, not its values (a quarter of a float32 activation); a ReLU feeding a
    convolution keeps its output (the convolution's patches read it). The memory rule counts
    the mask for the pass and the full output for a training step (autograd saves it), and
    the backward pass through the pooling and both ReLUs equals autograd's."""
    from gaussify.curvature.batched_backward import _held_activations, backward_chunk

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16, 3),
    ).double()  # fmt: skip
    x = torch.randn(5, 1, 4, 4, dtype=torch.float64)
    run = chain_forward(list(model.named_children()), x)
    assert run.acts[4].is_meta and set(run.masks) == {3}  # the pooling's input: a mask
    assert run.masks[3].dtype == torch.bool
    assert not run.acts[2].is_meta  # the second convolution's input: its values
    indices = 4 * 2 * 2  # the pooling's int64 indices, one float64 element each
    assert _held_activations(run)[4] == indices
    assert _held_activations(run, training=True)[4] == 4 * 4 * 4 + indices
    u = torch.randn(5, 2, 3, dtype=torch.float64)
    grads = dict(backward_chunk(run, u, [0, 2], slice(0, 5)))
    out = model[:4](x)
    pooled = model[4:](out)
    for j in range(2):
        (expected,) = torch.autograd.grad(pooled, out, u[:, j], retain_graph=True)
        torch.testing.assert_close(grads[2][:, j], expected * (out > 0), rtol=0, atol=1e-12)
    # through the first ReLU, whose output the second convolution reads: its derivative from
    # that output, no mask held for the pass
    assert set(run.masks) == {3}
    h1 = model[0](x)
    (expected1,) = torch.autograd.grad(model[1:](h1), h1, u[:, 0])
    torch.testing.assert_close(grads[0][:, 0], expected1, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("kernel", "padding", "dilation"),
    [(3, 0, 1), (3, 1, 1), (3, 2, 1), (3, 1, 2), (3, 4, 2), ((2, 3), (1, 0), (2, 1)), (3, 3, 1)],
)
def test_convolution_adjoint_equals_autograd(
    kernel: object, padding: object, dilation: object
) -> None:
    """The adjoint of a stride-1 convolution (a plain convolution with the flipped kernel,
    padding dilation (kernel - 1) - padding; the transposed one where the padding exceeds the
    kernel's extent, the last case) equals autograd's vector-Jacobian product in float64."""
    from gaussify.curvature.batched_backward import _flipped_weight, _vjp

    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, kernel, padding=padding, dilation=dilation).double().eval()
    x = torch.randn(5, 3, 9, 8, dtype=torch.float64, requires_grad=True)
    chain = module_chain(nn.Sequential(conv))
    assert chain is not None
    run = chain_forward(chain, x.detach())
    out = conv(x)
    g = torch.randn(5, 2, *out.shape[1:], dtype=torch.float64)
    got = _vjp(run, 0, g, slice(0, 5), False)
    for k in range(2):
        (expected,) = torch.autograd.grad(out, x, g[:, k], retain_graph=True)
        torch.testing.assert_close(got[:, k], expected, rtol=1e-12, atol=1e-12)
    extent = [dilation if isinstance(dilation, int) else dilation[d] for d in (0, 1)]
    ks = [kernel if isinstance(kernel, int) else kernel[d] for d in (0, 1)]
    pads = [padding if isinstance(padding, int) else padding[d] for d in (0, 1)]
    falls_back = any(pads[d] > extent[d] * (ks[d] - 1) for d in (0, 1))
    assert (_flipped_weight(run, 0, torch.float64) is None) is falls_back
