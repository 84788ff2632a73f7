"""One batched backward pass of K output vectors through a chain of layers.

The diagonal GGN and KFAC need, for every plain ``nn.Linear`` / ``nn.Conv2d`` layer, the
gradients delta_{k,n} = (d s_n / d f_n)^T u_{n,k} of K output vectors u_{n,k} (the columns of
Lambda_n^{1/2}, sampled residuals, or the residual; thesis eq. 2.24) with respect to the
layer's output s_n. Autograd gives them with K backward passes (one per vector: a fixed cost
per pass that dominates on small layers). Here the K vectors travel backwards together as one
(K, N, ...) tensor, layer by layer, from the activations of a single forward pass without a
graph (what BackPACK does for its square-root factors):

* ``nn.Linear``: delta W (any leading dimensions);
* ``nn.Conv2d`` (zero padding): the transposed convolution of the K N gradients at once;
* ``nn.MaxPool2d``: a scatter-add through the indices of the maxima (autograd's rule);
* element-wise activations: the product with phi'(a) (one autograd pass on N rows gives it);
* maps whose Jacobian does not depend on the input (``Flatten``, ``Unflatten``, ``Identity``,
  dropout and BatchNorm in eval mode, average pooling): autograd's vector-Jacobian product of
  the K N rows at a zero input.

The route applies to an ``nn.Sequential`` (nested ones flattened) of these modules in eval
mode, each module used once; :func:`module_chain` returns None otherwise and the callers keep
their per-vector autograd passes. Memory: the forward activations of the batch (what one
training step holds) plus K copies of the two largest consecutive activations of the chunk of
samples being propagated (see :func:`backward_chunk`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gaussify.curvature.patches import conv2d_patches

__all__ = [
    "ChainPass",
    "backward_chunk",
    "chain_forward",
    "chain_squared_sums",
    "module_chain",
    "rule_chunk",
]

#: Element-wise activations: the vector-Jacobian product is g * phi'(a).
_ELEMENTWISE = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Softplus,
    nn.Softsign,
    nn.Hardtanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.LogSigmoid,
    nn.Tanhshrink,
)
#: Per-sample maps whose Jacobian does not depend on the input (in eval mode).
_CONSTANT_JACOBIAN = (
    nn.Flatten,
    nn.Unflatten,
    nn.Identity,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
)


def _supported(module: nn.Module) -> bool:
    kind = type(module)
    if kind is nn.Linear:
        return True
    if kind is nn.Conv2d:
        return module.padding_mode == "zeros" and not isinstance(module.padding, str)
    if kind is nn.MaxPool2d:
        return True
    if kind in (nn.BatchNorm1d, nn.BatchNorm2d):
        # eval mode with running statistics: an affine map per sample
        return not module.training and module.running_mean is not None
    if kind in (nn.Dropout, nn.Dropout1d, nn.Dropout2d):
        return not module.training  # the identity in eval mode
    return kind in _CONSTANT_JACOBIAN or kind in _ELEMENTWISE


def module_chain(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """[(qualified name, module)] of an ``nn.Sequential`` (nested plain ``nn.Sequential``
    flattened) whose every module the batched route supports and which uses no module twice;
    None for any other model."""
    if type(model) is not nn.Sequential:
        return None
    chain: list[tuple[str, nn.Module]] = []

    def walk(seq: nn.Module, prefix: str) -> bool:
        # _modules, not named_children(), which skips a module's second appearance
        for name, child in seq._modules.items():
            if child is None:
                return False
            full = f"{prefix}{name}"
            if type(child) is nn.Sequential:
                if not walk(child, f"{full}."):
                    return False
            elif _supported(child):
                chain.append((full, child))
            else:
                return False
        return True

    if not walk(model, "") or not chain:
        return None
    if len({id(m) for _, m in chain}) != len(chain):
        return None
    return chain


@dataclass
class ChainPass:
    """The activations of one forward pass without a graph: ``acts[i]`` is the input of module
    i (``acts[-1]`` the output f), ``indices[i]`` the maxima of a ``MaxPool2d`` at i."""

    chain: list[tuple[str, nn.Module]]
    acts: list[Tensor]
    indices: dict[int, Tensor]

    @property
    def output(self) -> Tensor:
        return self.acts[-1]

    def position(self, name: str) -> int:
        return next(i for i, (n, _) in enumerate(self.chain) if n == name)


def chain_forward(chain: list[tuple[str, nn.Module]], x: Tensor) -> ChainPass:
    """Run the chain on ``x`` without a graph, keeping the module inputs whose values the
    backward pass reads (:func:`_needed`; the others become shape-only ``meta`` tensors, so
    the pass holds about what a training step saves)."""
    acts = [x]
    indices: dict[int, Tensor] = {}
    h = x
    with torch.no_grad():
        for i, (_, m) in enumerate(chain):
            if type(m) is nn.MaxPool2d:
                h, idx = F.max_pool2d(
                    h,
                    m.kernel_size,
                    m.stride,
                    m.padding,
                    m.dilation,
                    ceil_mode=m.ceil_mode,
                    return_indices=True,
                )
                indices[i] = idx
            else:
                h = m(h)
            acts.append(h)
            if i > 0 and not _needed(chain, i):
                acts[i] = acts[i].to("meta")  # only its shape is used: free it now
    return ChainPass(chain, acts, indices)


#: element-wise modules whose derivative comes from their output (:func:`_derivative`)
_FROM_OUTPUT = (nn.ReLU, nn.Tanh, nn.Sigmoid)


def _needed(chain: list[tuple[str, nn.Module]], i: int) -> bool:
    """Whether the backward pass reads the values of module i's input, not only its shape:
    a Linear / Conv2d input (the layer's products), the input of an element-wise module
    differentiated by autograd, or the output of a ReLU / tanh / sigmoid before it."""
    kind = type(chain[i][1])
    if kind in (nn.Linear, nn.Conv2d):
        return True
    if kind in _ELEMENTWISE and kind not in _FROM_OUTPUT:
        return True
    return type(chain[i - 1][1]) in _FROM_OUTPUT


def _vjp(run: ChainPass, i: int, g: Tensor, rows: slice, owned: bool) -> Tensor:
    """g (B, K, *out_i) -> g J_i (B, K, *in_i) for module i on the samples ``rows`` (sample
    major, so that the K vectors of a sample are contiguous: a convolution's per-sample
    products then need no copy). With ``owned`` an element-wise module overwrites g (no
    second K-fold tensor)."""
    m = run.chain[i][1]
    a = run.acts[i][rows]
    b, k = g.shape[:2]
    kind = type(m)
    if kind is nn.Linear:
        return g @ m.weight.detach().to(g.dtype)
    if kind is nn.Conv2d:
        flat = g.reshape(b * k, *g.shape[2:])
        grad = torch.nn.grad.conv2d_input(
            (b * k, *a.shape[1:]),
            m.weight.detach().to(g.dtype),
            flat,
            m.stride,
            m.padding,
            m.dilation,
            m.groups,
        )
        return grad.view(b, k, *a.shape[1:])
    if kind is nn.MaxPool2d:
        # autograd's rule: each output's gradient is added at the position of its maximum
        idx = run.indices[i][rows].flatten(-2).unsqueeze(1)
        src = g.flatten(-2)
        out = g.new_zeros(b, k, *a.shape[1:-2], a.shape[-2] * a.shape[-1])
        out.scatter_add_(-1, idx.expand_as(src), src)
        return out.view(b, k, *a.shape[1:])
    if kind is nn.Flatten or kind is nn.Unflatten:
        return g.reshape(b, k, *a.shape[1:])
    if kind in _ELEMENTWISE:
        deriv = _derivative(m, a, run.acts[i + 1][rows], g.dtype).unsqueeze(1)
        return g.mul_(deriv) if owned else g * deriv
    # a constant Jacobian: autograd's vector-Jacobian product at a zero input
    with torch.enable_grad():
        z = torch.zeros(b * k, *a.shape[1:], dtype=g.dtype, device=g.device)
        z.requires_grad_(True)
        (grad,) = torch.autograd.grad(m(z), z, g.reshape(b * k, *g.shape[2:]))
    return grad.view(b, k, *a.shape[1:])


def _derivative(m: nn.Module, a: Tensor, out: Tensor, dtype: torch.dtype) -> Tensor:
    """phi'(a) of an element-wise module with input a and output ``out`` (autograd's own
    backward formulas for ReLU, tanh and sigmoid; an autograd pass on a for the others)."""
    kind = type(m)
    if kind is nn.ReLU:
        return (out > 0).to(dtype)  # threshold_backward: the gradient where the output > 0
    if kind is nn.Tanh:
        y = out.to(dtype)
        return 1 - y * y  # tanh_backward: g (1 - y^2)
    if kind is nn.Sigmoid:
        y = out.to(dtype)
        return (1 - y) * y  # sigmoid_backward: g (1 - y) y
    with torch.enable_grad():
        a_req = a.detach().requires_grad_(True)
        (deriv,) = torch.autograd.grad(m(a_req).sum(), a_req)
    return deriv.to(dtype)


def backward_chunk(
    run: ChainPass, u: Tensor, wanted: list[int], rows: slice
) -> Iterator[tuple[int, Tensor]]:
    """(i, delta_i (B, K, *out_i)) for the module positions ``wanted``, from the last to the
    first, for the output vectors ``u`` (B, K, C) of the samples ``rows``; each delta is the
    gradient of sum_n u_{k,n}^T f_n with respect to module i's output. Stops at the first
    wanted module (nothing below it is propagated); one K-batched product per module."""
    first = min(wanted)
    targets = set(wanted)
    g = u.detach()
    owned = False  # g is the caller's u until the first product replaces it
    for i in range(len(run.chain) - 1, first - 1, -1):
        if i in targets:
            yield i, g
        if i > first:
            with torch.no_grad():  # the weights require grad: no graph of the products
                g = _vjp(run, i, g, rows, owned)
            owned = True


def _conv_squared_grads(conv: nn.Conv2d, patches: Tensor, d: Tensor) -> Tensor:
    """sum_{k,n} (sum_t delta_{k,n,t} a_{n,t}^T)^2, shape (C_out, C_in / G * kh * kw), from the
    patches (B, C_in kh kw, T) and d (B, K, C_out, H_out, W_out): one batched matmul over
    (sample, group) of the K stacked gradients (K out/G, T) with the patches (T, in/G)."""
    b, k, groups, t = d.shape[0], d.shape[1], conv.groups, patches.shape[-1]
    per = conv.out_channels // groups
    dd = d.reshape(b, k, groups, per, t).transpose(1, 2).reshape(b * groups, k * per, t)
    a = patches.view(b * groups, patches.shape[1] // groups, t)
    grads = torch.bmm(dd, a.transpose(1, 2)).view(b, groups, k, per, -1)
    return grads.square_().sum((0, 2)).reshape(conv.out_channels, -1)


def chain_squared_sums(
    model: nn.Module,
    x: Tensor,
    layers: dict[str, list[str]],
    cotangents: Callable[[Tensor], Tensor],
    view: Callable[[str], Tensor],
    chunk_size: int | None,
    storage: int,
    row_cotangents: Callable[[Tensor, slice], Tensor] | None = None,
) -> Tensor | None:
    """sum_n sum_k (per-sample gradient of u_{n,k}^T f_n)^2 of the parameters of the plain
    linear / convolution modules ``layers`` (module name -> ["weight"] / ["bias"] / both),
    added into ``view(parameter name)``; returns f (N, C), or None (before ``cotangents`` is
    called). ``row_cotangents(f[rows], rows)``, if given, forms the vectors per chunk of
    samples instead (the exact GGN's N C^2 factor is far larger than a training step for
    many classes); it must equal ``cotangents(f)[rows]``. None is returned
    when the model is not a supported chain or a linear layer's input is not 2-D.

    Linear: sum_{k,n} delta^2 a^2 = sum_n (sum_k delta_{k,n}^2) a_n^2 and the bias
    sum_n sum_k delta^2. Convolution: the per-sample gradient sum_t delta_t a_t^T (im2col
    patches) is formed for the K vectors of a chunk of samples at once, squared and summed.

    Chunks of samples (``chunk_size`` if given) keep the pass within the memory rule: a fit's
    peak <= 2 x (one training step's peak + the curvature's storage). The forward activations
    of the batch are what a training step holds too; the K-fold backward tensors of a chunk get
    the rest of that budget (:func:`rule_chunk`)."""
    chain = module_chain(model)
    if chain is None or not layers:
        return None
    names = {n for n, _ in chain}
    if not set(layers) <= names:
        return None
    run = chain_forward(chain, x)
    f = run.output
    n = x.shape[0]
    wanted = {run.position(m): m for m in layers}
    for i in wanted:
        if type(run.chain[i][1]) is nn.Linear and run.acts[i].ndim != 2:
            return None
    if f.ndim != 2 or f.shape[0] != n:
        return None
    if row_cotangents is None:
        whole = cotangents(f)
        if whole.ndim != 3 or whole.shape[0] != n or whole.shape[2] != f.shape[1]:
            raise ValueError(f"cotangents: expected shape (N, K, C), got {tuple(whole.shape)}")

        def vectors(rows: slice) -> Tensor:
            return whole[rows]
    else:

        def vectors(rows: slice) -> Tensor:
            return row_cotangents(f[rows], rows)

    k = vectors(slice(0, 1)).shape[1]
    rowwise = row_cotangents is not None
    chunk = chunk_size or rule_chunk(run, model, k, storage, wanted, rowwise=rowwise, copies=2)
    with torch.no_grad():
        _accumulate_squares(run, vectors, layers, wanted, view, chunk)
    return f


def _accumulate_squares(
    run: ChainPass,
    vectors: Callable[[slice], Tensor],
    layers: dict[str, list[str]],
    wanted: dict[int, str],
    view: Callable[[str], Tensor],
    chunk: int,
) -> None:
    """The chunked backward passes of :func:`chain_squared_sums` and their squared sums."""
    f = run.output
    n = f.shape[0]
    # module position -> {"weight" / "bias": the view of ``out`` holding it}, once
    targets: dict[int, dict[str, Tensor]] = {}
    for i, name in wanted.items():
        prefix = f"{name}." if name else ""
        targets[i] = {kind: view(f"{prefix}{kind}") for kind in layers[name]}
    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        ut = vectors(rows).to(f.dtype)
        for i, d in backward_chunk(run, ut, list(wanted), rows):
            module, views = run.chain[i][1], targets[i]
            a = run.acts[i][rows]
            if type(module) is nn.Linear:
                sq = d.square().sum(1)  # (linalg.vector_norm over K: 100 x slower)
                if "weight" in views:
                    w = views["weight"]
                    w.addmm_(sq.T.to(w.dtype), a.square().to(w.dtype))
                if "bias" in views:
                    views["bias"].add_(sq.sum(0).to(views["bias"].dtype))
                continue
            assert isinstance(module, nn.Conv2d)
            if "weight" in views:
                w = views["weight"]
                sums = _conv_squared_grads(module, conv2d_patches(module, a), d)
                w.view(module.out_channels, -1).add_(sums.to(w.dtype))
            if "bias" in views:
                b = views["bias"]
                b.add_(d.sum((-2, -1)).square().sum((0, 1)).to(b.dtype))


def rule_chunk(
    run: ChainPass,
    model: nn.Module,
    k: int,
    storage: int,
    per_sample_grads: Iterable[int] = (),
    *,
    rowwise: bool = False,
    copies: int = 1,
) -> int:
    """Samples per backward chunk under the memory rule (see :func:`chain_squared_sums`):
    budget = 0.9 x 2 x (a training step's estimated allocations + ``storage``) less the
    activations, the output vectors and ``copies`` storage-sized tensors this pass holds
    anyway (all in elements), at least one sample; per sample K x (the two
    largest consecutive activations + the largest one) and, per convolution at the positions
    ``per_sample_grads``, its patches and K per-sample weight gradients. ``rowwise``: the
    output vectors (K C per sample) are formed per chunk, not for the whole batch."""
    n = run.acts[0].shape[0]
    per_act = [a[0].numel() for a in run.acts]
    held = sum(a[0].numel() for a in run.acts if a.device.type != "meta")
    pair = max(per_act[i] + per_act[i + 1] for i in range(len(per_act) - 1))
    params = sum(p.numel() for p in model.parameters())
    # a training step on the batch allocates the activations its backward pass reads (the
    # ones held here), gradients of about half of two consecutive ones at a time during its
    # backward pass (measured: within 35 % of a step's allocation peak on an MLP and a CNN)
    # and the weights' gradients
    step = n * (held + pair // 2) + params
    # 2 (step + storage) with a 10 % margin, less what this pass holds anyway: the
    # activations, the output vectors (N K C) and ``copies`` storage-sized tensors (the
    # storage; a diagonal also sums a batch apart, to keep failures out: copies = 2)
    vectors = 0 if rowwise else n * k * per_act[-1]  # rowwise: per chunk, below
    budget = (9 * 2 * (step + storage)) // 10 - n * held - vectors - copies * storage
    # the K-fold gradients of two consecutive activations, and one more of the largest (a
    # squared copy, an element-wise product)
    per_sample = k * (pair + max(per_act[1:])) + (k * per_act[-1] if rowwise else 0)
    for i in per_sample_grads:
        module = run.chain[i][1]
        if type(module) is nn.Conv2d:
            t = per_act[i + 1] // module.out_channels
            fan_in = module.weight[0].numel()
            per_sample += fan_in * module.groups * t + k * module.weight.numel()
    return max(1, budget // max(per_sample, 1))
