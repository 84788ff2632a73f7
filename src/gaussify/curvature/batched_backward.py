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
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gaussify.curvature.patches import conv2d_patches
from gaussify.likelihoods import all_finite

__all__ = [
    "ChainPass",
    "backward_chunk",
    "backward_peak",
    "chain_forward",
    "chain_squared_sums",
    "conv_vector_group",
    "linear_chain",
    "module_chain",
    "rule_budget",
    "rule_chunk",
    "rule_columns",
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


def linear_chain(model: nn.Module) -> bool:
    """Whether ``model`` is a supported chain (:func:`module_chain`) whose only parametrised
    modules are ``nn.Linear`` (the diagonal then defers its additions, see
    :func:`chain_squared_sums`'s ``atomic``)."""
    chain = module_chain(model)
    return chain is not None and all(type(m) is not nn.Conv2d for _, m in chain)


@dataclass
class ChainPass:
    """The activations of one forward pass without a graph: ``acts[i]`` is the input of module
    i (``acts[-1]`` the output f), ``indices[i]`` the maxima of a ``MaxPool2d`` at i."""

    chain: list[tuple[str, nn.Module]]
    acts: list[Tensor]
    indices: dict[int, Tensor]
    #: the memory rule's per-batch sizes (:func:`rule_chunk`), computed once per pass
    sizes: dict[object, int] = field(default_factory=dict)
    #: per pass: weights detached in the gradients' dtype, ReLU masks (:func:`_vjp`)
    weights: dict[int, Tensor] = field(default_factory=dict)
    masks: dict[int, Tensor] = field(default_factory=dict)

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
    second K-fold tensor). Per chunk only the products themselves: the weights (detached, in
    g's dtype) and ReLU's masks come once per pass (:func:`_weight`, :func:`_mask`)."""
    m = run.chain[i][1]
    kind = type(m)
    if kind is nn.Linear:
        return g @ _weight(run, i, g.dtype)
    b, k = g.shape[:2]
    shape = run.acts[i].shape[1:]  # module i's input per sample (values not needed)
    if kind is nn.Conv2d:
        # the adjoint of the convolution: a transposed convolution (1.5-3 x faster on the CPU
        # than autograd's convolution_backward), its output padding restoring the input size
        flat = g.reshape(b * k, *g.shape[2:])
        extra = [
            shape[1 + d]
            - ((g.shape[3 + d] - 1) * m.stride[d] - 2 * m.padding[d])
            - m.dilation[d] * (m.kernel_size[d] - 1)
            - 1
            for d in (0, 1)
        ]
        grad = F.conv_transpose2d(
            flat,
            _weight(run, i, g.dtype),
            stride=m.stride,
            padding=m.padding,
            output_padding=tuple(extra),
            groups=m.groups,
            dilation=m.dilation,
        )
        return grad.view(b, k, *shape)
    if kind is nn.MaxPool2d:
        # autograd's rule: each output's gradient is added at the position of its maximum
        idx = run.indices[i][rows].flatten(-2).unsqueeze(1)
        src = g.flatten(-2)
        out = g.new_zeros(b, k, *shape[:-2], shape[-2] * shape[-1])
        out.scatter_add_(-1, idx.expand_as(src), src)
        return out.view(b, k, *shape)
    if kind is nn.Flatten or kind is nn.Unflatten:
        return g.reshape(b, k, *shape)
    if kind is nn.ReLU:
        mask = _mask(run, i)[rows]
        return g.mul_(mask) if owned else g * mask
    a = run.acts[i][rows]
    if kind in _ELEMENTWISE:
        deriv = _derivative(m, a, run.acts[i + 1][rows], g.dtype).unsqueeze(1)
        return g.mul_(deriv) if owned else g * deriv
    # a constant Jacobian: autograd's vector-Jacobian product at a zero input
    with torch.enable_grad():
        z = torch.zeros(b * k, *a.shape[1:], dtype=g.dtype, device=g.device)
        z.requires_grad_(True)
        (grad,) = torch.autograd.grad(m(z), z, g.reshape(b * k, *g.shape[2:]))
    return grad.view(b, k, *a.shape[1:])


def _weight(run: ChainPass, i: int, dtype: torch.dtype) -> Tensor:
    """Module i's weight, detached and in ``dtype``, once per pass."""
    w = run.weights.get(i)
    if w is None or w.dtype != dtype:
        w = run.weights[i] = run.chain[i][1].weight.detach().to(dtype)
    return w


def _mask(run: ChainPass, i: int) -> Tensor:
    """A ReLU's derivative on the whole batch, its output > 0 (threshold_backward), as a
    boolean (N, 1, *out) tensor, once per pass (counted by :func:`_held_activations`)."""
    mask = run.masks.get(i)
    if mask is None:
        mask = run.masks[i] = (run.acts[i + 1] > 0).unsqueeze(1)
    return mask


def _derivative(m: nn.Module, a: Tensor, out: Tensor, dtype: torch.dtype) -> Tensor:
    """phi'(a) of an element-wise module with input a and output ``out`` (autograd's own
    backward formulas for tanh and sigmoid; an autograd pass on a for the others; ReLU's is
    a mask, :func:`_mask`)."""
    kind = type(m)
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
    (sample, group) of the stacked gradients (K' out/G, T) with the patches (T, in/G) per
    group of K' = :func:`conv_vector_group` vectors (the K' per-sample weight gradients are
    at most about the size of the K gradients d)."""
    b, k, groups, t = d.shape[0], d.shape[1], conv.groups, patches.shape[-1]
    per = conv.out_channels // groups
    a = patches.view(b * groups, patches.shape[1] // groups, t).transpose(1, 2)
    step = conv_vector_group(conv, k, d[0, 0].numel())
    total = None
    for k0 in range(0, k, step):
        part = d[:, k0 : k0 + step]
        kk = part.shape[1]
        dd = part.reshape(b, kk, groups, per, t).transpose(1, 2).reshape(b * groups, kk * per, t)
        sums = torch.bmm(dd, a).view(b, groups, kk, per, -1).square_().sum((0, 2))
        total = sums if total is None else total.add_(sums)
    assert total is not None
    return total.reshape(conv.out_channels, -1)


def conv_vector_group(conv: nn.Conv2d, k: int, out: int) -> int:
    """Vectors K' whose per-sample weight gradients a convolution with ``out`` output
    elements per sample forms at once in the diagonal's reduction: K' C_out C_in kh kw / G
    at most about K out (the K gradients' own size), at least 1, at most K."""
    return max(1, min(k, (k * out) // conv.weight.numel()))


def chain_squared_sums(
    model: nn.Module,
    x: Tensor,
    layers: dict[str, list[str]],
    cotangents: Callable[[Tensor], Tensor],
    view: Callable[[str], Tensor],
    chunk_size: int | None,
    storage: int,
    row_cotangents: Callable[[Tensor, slice], Tensor] | None = None,
    atomic: bool = False,
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
    if atomic and any(type(run.chain[i][1]) is not nn.Linear for i in wanted):
        return None  # deferred additions are for linear layers: the caller sums apart
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
    # the (N, out) sums over K of the squared gradients of the linear layers, reduced once per
    # batch, where holding them costs few more chunks (they pay where chunks are small)
    sums = sum(n * run.acts[i + 1][0].numel() for i in wanted if type(chain[i][1]) is nn.Linear)
    if chunk_size is not None:
        chunk, cols, buffered, whole_rows = chunk_size, k, True, not rowwise
        staged = False  # buffered: the additions deferred and checked
        if rowwise and chunk < n:
            fits = rule_chunk(run, model, k, storage, wanted, copies=2, buffers=sums, floor=0)
            whole_rows = fits >= chunk
    else:
        cost, plan = _plan(run, model, k, storage, wanted, rowwise, sums)
        if atomic:
            # no batch temporary, the sums deferred to the end of the batch (buffered), where
            # that is cheaper than summing the batch apart (the batch's temporary: copies=2)
            deferred = _plan(run, model, k, storage, wanted, rowwise, sums, 1, True)
            staged = deferred[0] > cost
            plan = plan if staged else deferred[1]
        chunk, cols, buffered, whole_rows = plan
    if rowwise and (whole_rows or chunk >= n):
        # the vectors of the whole batch fit beside the chunks: form them once
        whole = vectors(slice(0, n))

        def vectors(rows: slice) -> Tensor:
            return whole[rows]

    with torch.no_grad():
        if atomic and staged:  # summed apart, added once complete and finite
            views = {name: torch.zeros_like(view(name)) for name in _names(layers)}
            _accumulate_squares(
                run, vectors, layers, wanted, views.__getitem__, chunk, buffered, cols
            )
            _add_staged(views, view)
        else:
            _accumulate_squares(run, vectors, layers, wanted, view, chunk, buffered, cols, atomic)
    return f


#: the rough cost, in tensor operations, of the steps of a chunk (each costs some 5-20 us of
#: fixed overhead on the CPU, which dominates the small products of small chunks): the
#: output vectors formed per chunk, a linear layer's reduction buffered (a product and a sum
#: into the batch's buffer) or not (the squared inputs and two products per chunk), a
#: product per module, the batch's reductions of the buffers
_COST_VECTORS, _COST_BUFFERED, _COST_PLAIN, _COST_MODULE, _COST_BUFFER = 12, 2, 8, 3, 5


def _plan(
    run: ChainPass,
    model: nn.Module,
    k: int,
    storage: int,
    wanted: dict[int, str],
    rowwise: bool,
    sums: int,
    copies: int = 2,
    buffered_only: bool = False,
) -> tuple[float, tuple[int, int, bool, bool]]:
    """(cost, (samples per chunk, vectors per pass, linear sums buffered per batch, output
    vectors formed for the whole batch)) for :func:`chain_squared_sums` under the memory
    rule: of the
    settings whose chunks hold at least one sample, the one with the fewest tensor operations
    by the cost model above (more, smaller chunks cost their fixed overheads; the vectors
    formed once or the buffers take budget from the chunks); where none does, one sample
    per chunk and groups of vectors (:func:`rule_columns`). ``copies``: storage-sized tensors
    held (2 with the diagonal's batch temporary); ``buffered_only``: the linear sums always
    buffered (deferred to the end of the batch)."""
    n = run.acts[0].shape[0]
    linear = sum(type(run.chain[i][1]) is nn.Linear for i in wanted)
    others = len(wanted) - linear
    passes = len(run.chain) - min(wanted)
    best: tuple[float, tuple[int, int, bool, bool]] | None = None
    for whole in (False, True) if rowwise else (True,):
        for buffers in (sums,) if buffered_only else (0, sums) if sums else (0,):
            c = rule_chunk(
                run,
                model,
                k,
                storage,
                wanted,
                rowwise=not whole,
                copies=copies,
                buffers=buffers,
                floor=0,
            )
            if c == 0:
                continue
            chunks = -(-n // c)
            per_chunk = passes * _COST_MODULE + others * _COST_PLAIN
            per_chunk += linear * (_COST_BUFFERED if buffers else _COST_PLAIN)
            per_chunk += 0 if whole else _COST_VECTORS
            fixed = (_COST_VECTORS if whole else 0) + (linear * _COST_BUFFER if buffers else 0)
            cost = chunks * per_chunk + fixed
            if best is None or cost < best[0]:
                best = (cost, (min(c, n), k, buffers > 0, whole))
    if best is not None:
        return best
    # one sample with all K vectors exceeds the rule: groups of K' vectors per pass
    buffers = sums if buffered_only else 0
    cols = rule_columns(
        run, model, k, storage, wanted, rowwise=rowwise, copies=copies, buffers=buffers
    )
    per_chunk = passes * _COST_MODULE + others * _COST_PLAIN + linear * _COST_PLAIN
    return n * -(-k // cols) * per_chunk + n * _COST_VECTORS, (1, cols, buffered_only, False)


def _accumulate_squares(
    run: ChainPass,
    vectors: Callable[[slice], Tensor],
    layers: dict[str, list[str]],
    wanted: dict[int, str],
    view: Callable[[str], Tensor],
    chunk: int,
    buffered: bool,
    cols: int | None = None,
    atomic: bool = False,
) -> None:
    """The chunked backward passes of :func:`chain_squared_sums` and their squared sums, in
    groups of ``cols`` output vectors (all K if None; the sums over K add up over groups).

    A linear layer's sums over K of the squared gradients, s_n = sum_k delta_{k,n}^2, give
    s^T (a^2) for the weight and sum_n s_n for the bias, per chunk, or with ``buffered`` written
    per chunk into an (N, out) buffer and reduced once per batch (two products per chunk
    instead of eight)."""
    f = run.output
    n = f.shape[0]
    # module position -> {"weight" / "bias": the view of ``out`` holding it}, once
    targets: dict[int, dict[str, Tensor]] = {}
    for i, name in wanted.items():
        prefix = f"{name}." if name else ""
        targets[i] = {kind: view(f"{prefix}{kind}") for kind in layers[name]}
    linear = {i for i in wanted if type(run.chain[i][1]) is nn.Linear}
    squares = {i: f.new_empty(n, run.acts[i + 1].shape[1]) for i in linear} if buffered else {}
    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        whole = vectors(rows)
        if whole.dtype != f.dtype:
            whole = whole.to(f.dtype)
        step = cols or whole.shape[1]
        for c0 in range(0, whole.shape[1], step):
            ut = whole if step >= whole.shape[1] else whole[:, c0 : c0 + step]
            _reduce_chunk(run, ut, rows, wanted, targets, linear, squares, buffered, c0 == 0)
            del ut  # the chunk's K-fold tensors, before the per-batch reductions
        del whole
    if atomic:
        _add_checked(run, squares, targets, wanted)
        return
    for i, sq in squares.items():
        _add_linear_squares(targets[i], sq, run.acts[i])


def _names(layers: dict[str, list[str]]) -> list[str]:
    """Parameter names ("module.weight") of ``layers`` (module name -> parameter kinds)."""
    return [f"{m}.{kind}" if m else kind for m, kinds in layers.items() for kind in kinds]


def _add_staged(staged: dict[str, Tensor], view: Callable[[str], Tensor]) -> None:
    """Add the batch's sums summed apart into ``view(name)`` once all are finite, else raise
    naming the first parameter that is not (the targets left as they were)."""
    for name, t in staged.items():
        if not all_finite(t):
            _raise_not_finite(name, t)
    for name, t in staged.items():
        view(name).add_(t)


def _raise_not_finite(name: str, t: Tensor) -> None:
    module = name.rpartition(".")[0]
    kind = "NaN" if bool(t.isnan().any()) else "infinite"
    raise ValueError(
        f"{kind} Jacobian in parameter {name!r} (module {module or '<root>'!r}, Linear): the "
        "network is not differentiable at the current parameters (e.g. sqrt or norm at "
        "zero); curvature cannot be computed"
    )


def _add_checked(
    run: ChainPass,
    squares: dict[int, Tensor],
    targets: dict[int, dict[str, Tensor]],
    wanted: dict[int, str],
) -> None:
    """Add the linear layers' buffered sums only if every addition is finite, else raise and
    leave the targets as they were. Sums of non-negative products of finite factors are at
    most N max(s) max(a^2): where that bound (plus the targets' largest entry) is far from
    the dtype's largest number, they are added directly; otherwise each addition is formed
    apart and checked first (a layer-sized temporary each, only then)."""
    n = run.acts[0].shape[0]
    safe = True
    for i, sq in squares.items():
        # one min/max reduction each: NaN and inf propagate into them
        s_hi = float(torch.aminmax(sq)[1]) if sq.numel() else 0.0
        a_lo, a_hi = (float(v) for v in torch.aminmax(run.acts[i]))
        top = max(float(t.max()) if t.numel() else 0.0 for t in targets[i].values())
        bound = n * s_hi * max(-a_lo, a_hi) ** 2 + top
        if not bound < torch.finfo(sq.dtype).max / 4:  # False for NaN and inf too
            safe = False
            break
    if safe:
        for i, sq in squares.items():
            _add_linear_squares(targets[i], sq, run.acts[i])
        return
    parts = {}
    for i, sq in squares.items():
        temps = {key: torch.zeros_like(view) for key, view in targets[i].items()}
        _add_linear_squares(temps, sq, run.acts[i])
        for key, t in temps.items():
            if not all_finite(t):
                _raise_not_finite(f"{wanted[i]}.{key}" if wanted[i] else key, t)
        parts[i] = temps
    for i, temps in parts.items():
        for key, t in temps.items():
            targets[i][key].add_(t)


def _reduce_chunk(
    run: ChainPass,
    ut: Tensor,
    rows: slice,
    wanted: dict[int, str],
    targets: dict[int, dict[str, Tensor]],
    linear: set[int],
    squares: dict[int, Tensor],
    buffered: bool,
    first: bool = True,
) -> None:
    """One batched backward pass of the vectors ``ut`` (B, K', C) of the samples ``rows`` and
    its squared sums into ``targets`` (or, ``buffered``, a linear layer's rows of
    ``squares``, written by the ``first`` group of vectors and added to by the others)."""
    for i, d in backward_chunk(run, ut, list(wanted), rows):
        if i in linear:
            if buffered and first:
                torch.sum(d * d, 1, out=squares[i][rows])  # (pow: 5 x slower than mul)
            elif buffered:
                squares[i][rows].add_((d * d).sum(1))
            else:
                _add_linear_squares(targets[i], (d * d).sum(1), run.acts[i][rows])
            continue
        module, views = run.chain[i][1], targets[i]
        assert isinstance(module, nn.Conv2d)
        if "weight" in views:
            w = views["weight"]
            a = run.acts[i][rows]
            sums = _conv_squared_grads(module, conv2d_patches(module, a), d)
            w.view(module.out_channels, -1).add_(sums.to(w.dtype))
        if "bias" in views:
            b = views["bias"]
            per = d.sum((-2, -1))
            b.add_((per * per).sum((0, 1)).to(b.dtype))


def _add_linear_squares(views: dict[str, Tensor], sq: Tensor, a: Tensor) -> None:
    """Add s^T (a^2) to a linear layer's weight view and sum_n s_n to its bias view, for
    s (B, out) the per-sample sums over K of the squared output gradients, a (B, in)."""
    if "weight" in views:
        w = views["weight"]
        w.addmm_(sq.T.to(w.dtype), (a * a).to(w.dtype))
    if "bias" in views:
        views["bias"].add_(sq.sum(0).to(views["bias"].dtype))


def rule_chunk(
    run: ChainPass,
    model: nn.Module,
    k: int,
    storage: int,
    per_sample_grads: Iterable[int] = (),
    *,
    rowwise: bool = False,
    copies: int = 1,
    buffers: int = 0,
    floor: int = 1,
) -> int:
    """Samples per backward chunk under the memory rule (see :func:`chain_squared_sums`):
    budget = 0.85 x 2 x (a training step's estimated allocations + ``storage``) less the
    activations, the output vectors and ``copies`` storage-sized tensors this pass holds
    anyway (all in elements), at least one sample; per sample the largest set of K-fold
    tensors alive at once during the backward pass (:func:`backward_peak`: two consecutive
    gradients while one module propagates, or a layer's gradient and its reduction's
    temporaries, for a convolution at ``per_sample_grads`` its patches and K per-sample weight
    gradients). ``rowwise``: the output vectors (K C per sample) are formed per chunk, not for
    the whole batch; ``buffers``: elements of the caller's per-batch buffers; ``floor``: the
    fewest samples returned (0 says the budget does not hold one)."""
    budget = rule_budget(run, model, k, storage, rowwise, copies, buffers)
    per = frozenset(per_sample_grads)
    if (k, per) not in run.sizes:
        run.sizes[(k, per)] = backward_peak(run, k, set(per))
    per_sample = run.sizes[(k, per)]
    per_sample += k * run.acts[-1][0].numel() if rowwise else 0
    return max(floor, budget // max(per_sample, 1))


def rule_budget(
    run: ChainPass,
    model: nn.Module,
    k: int,
    storage: int,
    rowwise: bool = True,
    copies: int = 1,
    buffers: int = 0,
) -> int:
    """Elements the K-fold backward tensors (or other per-chunk temporaries) may hold under
    the rule: see :func:`rule_chunk` (``rowwise``: no (N, K, C) output vectors held)."""
    n = run.acts[0].shape[0]
    if "step" not in run.sizes:  # once per pass: a Python loop over the modules' parameters
        held = _held_activations(run)
        run.sizes["step"] = _step_peak(run, model, held)
        run.sizes["held"] = sum(held) + _mask_elements(run)
    step, held_sum = run.sizes["step"], run.sizes["held"]
    # 2 (step + storage) with a 15 % margin, less what this pass holds anyway: the
    # activations, the output vectors (N K C) and ``copies`` storage-sized tensors (the
    # storage; a diagonal also sums a batch apart, to keep failures out: copies = 2)
    vectors = 0 if rowwise else n * k * run.acts[-1][0].numel()  # rowwise: per chunk
    budget = (17 * (step + storage)) // 10 - n * held_sum - vectors - copies * storage
    return budget - buffers


def rule_columns(
    run: ChainPass,
    model: nn.Module,
    k: int,
    storage: int,
    per_sample_grads: Iterable[int] = (),
    *,
    rowwise: bool = False,
    copies: int = 1,
    buffers: int = 0,
) -> int:
    """Output vectors propagated together when one sample with all K exceeds the rule's
    budget (:func:`rule_chunk` gives 0 samples): the most K' < K whose per-sample peak
    :func:`backward_peak` fits it (the backward pass is linear in the vectors, so the sums
    over K split into sums over groups of K' exactly), at least 1; K when one sample fits.
    With ``rowwise`` the K C vectors of the sample are formed whole per chunk."""
    budget = rule_budget(run, model, k, storage, rowwise, copies, buffers)
    budget -= k * run.acts[-1][0].numel() if rowwise else 0
    per = set(per_sample_grads)
    if backward_peak(run, k, per) <= budget:
        return k
    lo, hi = 1, k  # backward_peak grows with K: the largest K' with peak(K') <= budget
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if backward_peak(run, mid, per) <= budget else (lo, mid)
    return lo


def _mask_elements(run: ChainPass) -> int:
    """Elements (of the activations' size) per sample of the ReLU masks a pass holds
    (:func:`_mask`, one byte per output)."""
    width = run.acts[0].element_size()
    out = 0
    for i, (_, m) in enumerate(run.chain):
        if type(m) is nn.ReLU:
            out += -(-run.acts[i + 1][0].numel() // width)
    return out


def _held_activations(run: ChainPass) -> list[int]:
    """Elements per sample of the activations the pass allocated and holds, by position (not
    the caller's input; a max-pooling's int64 indices in elements of the activations)."""
    width = run.acts[0].element_size()
    held = [0] + [a[0].numel() if a.device.type != "meta" else 0 for a in run.acts[1:]]
    for i, idx in run.indices.items():
        held[i] += idx[0].numel() * idx.element_size() // width
    return held


def _step_peak(run: ChainPass, model: nn.Module, held: list[int]) -> int:
    """Elements a training step on the batch allocates at its peak: the activations its
    backward pass reads (``held``), all of them at the end of the forward pass; while module j
    propagates, those at positions <= j + 1 (the later ones are freed once read), the
    gradients of its output and input (not of the first module's input) and the weight
    gradients of modules j and above (measured: 0-11 % below a step's allocation peak on an
    MLP and a CNN with pooling); the model's parameters outside the chain count too."""
    n = run.acts[0].shape[0]
    per_act = [a[0].numel() for a in run.acts]
    sizes = [sum(p.numel() for p in m.parameters()) for _, m in run.chain]
    above = sum(p.numel() for p in model.parameters()) - sum(sizes)
    peak = n * sum(held)
    for j in range(len(run.chain) - 1, -1, -1):
        above += sizes[j]
        grads = per_act[j + 1] + (per_act[j] if j > 0 else 0)
        peak = max(peak, n * (sum(held[: j + 2]) + grads) + above)
    return peak


def backward_peak(run: ChainPass, k: int, per_sample_grads: set[int]) -> int:
    """Elements per sample alive at once in :func:`backward_chunk` with K vectors (and the
    reductions of :func:`chain_squared_sums` / the Gram sums at the positions it yields):
    the maximum over the modules of the gradient they receive (K out) plus what they
    allocate, K in for a product (none for an element-wise module, which works in place,
    K 2 in for an autograd product at a zero input, none for a reshape) or, at a layer being
    reduced, a K-fold squared or reordered copy of its gradient (for a linear layer at
    ``per_sample_grads`` with its sums over K and its squared input), or for a convolution at
    ``per_sample_grads`` its patches and K per-sample weight gradients (squared in place)."""
    per_act = [a[0].numel() for a in run.acts]
    peak = 0
    for i, (_, m) in enumerate(run.chain):
        out, inp = per_act[i + 1], per_act[i]
        kind = type(m)
        if kind in (nn.Flatten, nn.Unflatten):
            alive = k * out
        elif kind in _ELEMENTWISE:
            # in place, with phi'(a); a new product where g is still the caller's vectors
            alive = k * out + out + (k * out if i == len(run.chain) - 1 else 0)
        elif kind is nn.Conv2d and i > 0:
            alive = k * (out + inp) + k * _transposed_workspace(m, out, inp)
        elif kind in (nn.Linear, nn.Conv2d, nn.MaxPool2d):
            alive = k * (out + inp)
        else:
            alive = k * (out + 2 * inp)  # autograd's product at a zero input
        peak = max(peak, alive)
        if i in per_sample_grads and kind is nn.Conv2d:
            # the gradient, the patches and the per-sample weight gradients of a group of
            # vectors (squared in place)
            t = out // m.out_channels
            patches = m.weight[0].numel() * m.groups * t
            group = conv_vector_group(m, k, out)
            peak = max(peak, k * out + patches + group * m.weight.numel())
        elif kind in (nn.Linear, nn.Conv2d):
            # the gradient and its square / reordered copy; a diagonal's sums over K and the
            # squared inputs of a linear layer
            peak = max(peak, k * 2 * out + (out + inp if i in per_sample_grads else 0))
    return peak


def _transposed_workspace(conv: nn.Conv2d, out: int, inp: int) -> int:
    """Elements per vector of the CPU transposed convolution's workspace (oneDNN), ``out`` /
    ``inp`` the layer's output / input sizes per sample: the incoming gradient reordered into
    blocks of 16 channels, and the result too when its channels are not a multiple of 16
    (measured, 100 vectors: 1,047 for 16 -> 16 channels on 8 x 8 (bound 1,024), 1,985 for
    16 -> 1 (bound 2,048), 7,425 for 8 -> 3 on 16 x 16 (bound 8,192); the weight's reorder
    is a constant within the rule's margin).
    """
    t_out, t_in = out // conv.out_channels, inp // conv.in_channels
    ws = _blocked(conv.out_channels) * t_out
    if conv.in_channels % 16:
        ws += _blocked(conv.in_channels) * t_in
    return ws


def _blocked(channels: int) -> int:
    """Channels rounded up to oneDNN's blocks of 16."""
    return -(-channels // 16) * 16
