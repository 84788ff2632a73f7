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

import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gaussify.curvature.sqrt_factor import SqrtFactor
from gaussify.host_heap import keep_freed_memory

__all__ = [
    "ChainPass",
    "add_layer_gradient",
    "backward_chunk",
    "backward_peak",
    "chain_forward",
    "conv_reduction_peak",
    "conv_vector_group",
    "linear_chain",
    "module_chain",
    "rule_budget",
    "rule_chunk",
    "rule_columns",
    "rule_margin",
    "structured_chain",
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
    :func:`gaussify.curvature.chain_diag.chain_squared_sums`'s ``atomic``)."""
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
    #: whether ``sizes`` is the table shared with the model's passes of the same shapes
    shared: bool = False
    #: per pass: weights detached in the gradients' dtype (:func:`_vjp`)
    weights: dict[int, Tensor] = field(default_factory=dict)
    #: the derivative (output > 0, (N, 1, *out) booleans) of each ReLU at i whose output
    #: :func:`chain_forward` freed (:func:`_mask_only`)
    masks: dict[int, Tensor] = field(default_factory=dict)
    #: per pass: convolution weights as their adjoint's (:func:`_flipped_weight`)
    flipped: dict[int, Tensor] = field(default_factory=dict)

    @property
    def output(self) -> Tensor:
        return self.acts[-1]

    def position(self, name: str) -> int:
        return next(i for i, (n, _) in enumerate(self.chain) if n == name)


def chain_forward(chain: list[tuple[str, nn.Module]], x: Tensor) -> ChainPass:
    """Run the chain on ``x`` without a graph, keeping the module inputs whose values the
    backward pass reads (:func:`_needed`; the others become shape-only ``meta`` tensors, so
    the pass holds about what a training step saves). A ReLU output read only for the ReLU's
    derivative (the next module is not a linear layer or convolution, e.g. a max-pooling)
    is kept as its boolean mask (``ChainPass.masks``, a quarter of a float32 activation)
    instead."""
    acts = [x]
    indices: dict[int, Tensor] = {}
    masks: dict[int, Tensor] = {}
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
            elif i > 0 and _mask_only(chain, i):
                masks[i - 1] = (acts[i] > 0).unsqueeze(1)
                acts[i] = acts[i].to("meta")
    return ChainPass(chain, acts, indices, masks=masks)


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


def _mask_only(chain: list[tuple[str, nn.Module]], i: int) -> bool:
    """Whether the values of module i's input are read only as the derivative of the ReLU
    before it (not by module i itself: not a linear layer or convolution, nor an element-wise
    module differentiated from its input)."""
    kind = type(chain[i][1])
    if kind in (nn.Linear, nn.Conv2d) or (kind in _ELEMENTWISE and kind not in _FROM_OUTPUT):
        return False
    return type(chain[i - 1][1]) is nn.ReLU


def _vjp(run: ChainPass, i: int, g: Tensor, rows: slice, owned: bool) -> Tensor:
    """g (B, K, *out_i) -> g J_i (B, K, *in_i) for module i on the samples ``rows`` (sample
    major, so that the K vectors of a sample are contiguous: a convolution's per-sample
    products then need no copy). With ``owned`` an element-wise module overwrites g (no
    second K-fold tensor). Per chunk only the products themselves: the weights (detached, in
    g's dtype) come once per pass (:func:`_weight`); a ReLU's derivative per chunk
    (:func:`_relu_derivative`)."""
    m = run.chain[i][1]
    kind = type(m)
    b, k = g.shape[:2]
    if kind is nn.Linear:  # one (B K, out) x (out, in) product (a 3-D matmul may batch it)
        flat = g.reshape(b * k, g.shape[-1]) @ _weight(run, i, g.dtype)
        return flat.view(b, k, flat.shape[-1])
    shape = run.acts[i].shape[1:]  # module i's input per sample (values not needed)
    if kind is nn.Conv2d:
        flat = g.reshape(b * k, *g.shape[2:])
        flipped = _flipped_weight(run, i, g.dtype)
        if flipped is not None:  # stride 1, one group: a plain convolution
            pad = [m.dilation[d] * (m.kernel_size[d] - 1) - m.padding[d] for d in (0, 1)]
            grad = F.conv2d(flat, flipped, padding=tuple(pad), dilation=m.dilation)
            return grad.view(b, k, *shape)
        # the adjoint of the convolution: a transposed convolution (1.5-3 x faster on the CPU
        # than autograd's convolution_backward), its output padding restoring the input size
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
        mask = _relu_derivative(run, i, rows, g.dtype)
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


def add_layer_gradient(
    module: nn.Module, grad_out: Tensor, inp: Tensor, views: dict[str, Tensor]
) -> None:
    """Add the summed weight and bias gradients of an ``nn.Linear`` / ``nn.Conv2d`` with
    input ``inp`` and output gradient ``grad_out`` (one vector per sample) to ``views``:
    g^T a for a linear layer, the convolution's own weight gradient
    (``torch.nn.grad.conv2d_weight``) for a convolution; the bias gets the summed g."""
    if isinstance(module, nn.Conv2d):
        if "weight" in views:
            w = views["weight"]
            gw = torch.nn.grad.conv2d_weight(
                inp.to(grad_out.dtype),
                module.weight.shape,
                grad_out,
                module.stride,
                module.padding,  # type: ignore[arg-type]
                module.dilation,
                module.groups,
            )
            w.add_(gw.to(w.dtype))
        if "bias" in views:
            views["bias"].add_(grad_out.sum((0, 2, 3)).to(views["bias"].dtype))
        return
    g = grad_out.reshape(-1, grad_out.shape[-1])
    if "weight" in views:
        w = views["weight"]
        w.addmm_(g.T.to(w.dtype), inp.reshape(-1, inp.shape[-1]).to(w.dtype))
    if "bias" in views:
        views["bias"].add_(g.sum(0).to(views["bias"].dtype))


def _weight(run: ChainPass, i: int, dtype: torch.dtype) -> Tensor:
    """Module i's weight, detached and in ``dtype``, once per pass."""
    w = run.weights.get(i)
    if w is None or w.dtype != dtype:
        w = run.weights[i] = run.chain[i][1].weight.detach().to(dtype)
    return w


def _flipped_weight(run: ChainPass, i: int, dtype: torch.dtype) -> Tensor | None:
    """The weight of the convolution at i as the weight of its adjoint's plain convolution
    (in and out channels swapped, the kernel flipped), once per pass, where the adjoint is
    one: stride 1, one group and padding at most the kernel's extent, the adjoint then a
    convolution with padding dilation (kernel - 1) - padding (oneDNN's convolution, 25-30 %
    faster on the CPU than the transposed one here, e.g. 3.6 against 5.1 ms for 603 16 x 11
    x 11 gradients through a 3 x 3, 8 -> 16 convolution at one thread); else None."""
    m = run.chain[i][1]
    assert isinstance(m, nn.Conv2d)
    if m.groups != 1 or tuple(m.stride) != (1, 1):
        return None
    if any(m.padding[d] > m.dilation[d] * (m.kernel_size[d] - 1) for d in (0, 1)):
        return None
    w = run.flipped.get(i)
    if w is None or w.dtype != dtype:
        w = _weight(run, i, dtype).flip((2, 3)).transpose(0, 1).contiguous()
        run.flipped[i] = w
    return w


def _relu_derivative(run: ChainPass, i: int, rows: slice, dtype: torch.dtype) -> Tensor:
    """The derivative of the ReLU at i for the samples ``rows`` in ``dtype``, (B, 1, *out),
    for a product with the K-fold gradient: from the ReLU's kept output (its sign: 1 where
    it is > 0, else 0; no mask held for the pass), or the mask :func:`chain_forward` kept
    where it freed the output, converted for the chunk (a product with a boolean mask costs
    about 3 x a same-dtype one on the CPU, measured)."""
    mask = run.masks.get(i)
    if mask is not None:
        return mask[rows].to(dtype)
    return run.acts[i + 1][rows].unsqueeze(1).sign().to(dtype)


def _derivative(m: nn.Module, a: Tensor, out: Tensor, dtype: torch.dtype) -> Tensor:
    """phi'(a) of an element-wise module with input a and output ``out`` (autograd's own
    backward formulas for tanh and sigmoid; an autograd pass on a for the others; ReLU's is
    a mask, :func:`_relu_derivative`)."""
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
    run: ChainPass,
    u: Tensor | SqrtFactor,
    wanted: list[int],
    rows: slice,
    stop: int | None = None,
    extra: Tensor | None = None,
) -> Iterator[tuple[int, Tensor | SqrtFactor]]:
    """(i, delta_i (B, K, *out_i)) for the module positions ``wanted``, from the last to the
    first, for the output vectors ``u`` (B, K, C) of the samples ``rows``; each delta is the
    gradient of sum_n u_{k,n}^T f_n with respect to module i's output. Stops at the first
    wanted module (nothing below it is propagated); one K-batched product per module. A
    structured ``u`` (:class:`gaussify.curvature.sqrt_factor.SqrtFactor`, for a chain whose
    last module is an ``nn.Linear``: :func:`structured_chain`) is yielded as itself at that
    module and its product with the weight formed in O(B K d). ``stop``: the position of a
    max-pooling above the first wanted module, reached from it through element-wise maps
    only (:func:`gaussify.curvature.pooled_conv.pooling_after`), where the pass stops: the
    first wanted module is yielded with the gradient of the pooling's output instead of its
    own (:func:`gaussify.curvature.pooled_conv.maxima_gradient` takes it from there).
    ``extra`` (B, K_e, C): plain vectors appended after a structured ``u``'s, from its
    product with the final weight on (a dense ``u`` carries them as its own columns)."""
    first = min(wanted)
    targets = set(wanted)
    g = u if isinstance(u, SqrtFactor) else u.detach()
    owned = False  # g is the caller's u until the first product replaces it
    for i in range(len(run.chain) - 1, first - 1, -1):
        if i == stop:
            yield first, g
            return
        if i in targets:
            yield i, g
        if i > first:
            if torch.is_grad_enabled():  # the weights require grad: no graph of the products
                with torch.no_grad():
                    g = _propagate(run, i, g, rows, owned, extra)
            else:
                g = _propagate(run, i, g, rows, owned, extra)
            owned = True


def _propagate(
    run: ChainPass, i: int, g: Tensor | SqrtFactor, rows: slice, owned: bool, extra: Tensor | None
) -> Tensor | SqrtFactor:
    """g J_i for :func:`backward_chunk`: a structured factor through the final linear layer
    (its ``extra`` plain vectors appended after the product), else :func:`_vjp`."""
    if isinstance(g, SqrtFactor):
        weight = _weight(run, i, g.dtype)
        out = g.through_linear(weight)
        if extra is not None:
            out = torch.cat([out, extra.to(out.dtype) @ weight], 1)
        return out
    return _vjp(run, i, g, rows, owned)


def structured_chain(run: ChainPass) -> bool:
    """Whether the chain's output is a final ``nn.Linear``'s, so that structured output
    vectors (:class:`gaussify.curvature.sqrt_factor.SqrtFactor`) can enter
    :func:`backward_chunk`."""
    return type(run.chain[-1][1]) is nn.Linear and run.output.ndim == 2


def conv_vector_group(conv: nn.Conv2d, k: int, out: int) -> int:
    """Vectors K' whose per-sample weight gradients a convolution with ``out`` output
    elements per sample forms at once in the diagonal's reduction: K' C_out C_in kh kw / G
    at most about K out (the K gradients' own size), at least 1, at most K; the groups of
    vectors as even as their count allows (K = 9 with at most 4: 3 + 3 + 3, not 4 + 4 + 1)."""
    most = max(1, min(k, (k * out) // conv.weight.numel()))
    groups = -(-k // most)
    return -(-k // groups)


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
    structured: bool = False,
) -> int:
    """Samples per backward chunk under the memory rule (see
    :func:`gaussify.curvature.chain_diag.chain_squared_sums`):
    budget = 2 x (a training step's estimated allocations + ``storage``) less a margin
    (:func:`rule_margin`: 15 %, 25 % on CUDA) and less the
    activations, the output vectors and ``copies`` storage-sized tensors this pass holds
    anyway (all in elements), at least one sample; per sample the largest set of K-fold
    tensors alive at once during the backward pass (:func:`backward_peak`: two consecutive
    gradients while one module propagates, or a layer's gradient and its reduction's
    temporaries, for a convolution at ``per_sample_grads`` its patches and K per-sample weight
    gradients). ``rowwise``: the output vectors (K C per sample) are formed per chunk, not for
    the whole batch; ``buffers``: elements of the caller's per-batch buffers; ``floor``: the
    fewest samples returned (0 says the budget does not hold one); ``structured``: the output
    vectors are a :class:`gaussify.curvature.sqrt_factor.SqrtFactor` of the whole batch (2 C
    numbers per sample) entering the final linear layer (:func:`backward_peak`)."""
    budget = rule_budget(run, model, k, storage, rowwise, copies, buffers, structured)
    per = frozenset(per_sample_grads)
    sizes = _pass_sizes(run, model)
    if (k, per, structured) not in sizes:
        sizes[(k, per, structured)] = backward_peak(run, k, set(per), structured)
    per_sample = sizes[(k, per, structured)]
    per_sample += k * run.acts[-1][0].numel() if rowwise and not structured else 0
    chunk = max(floor, budget // max(per_sample, 1))
    if chunk < run.acts[0].shape[0]:
        _keep_chunks_memory(run, model, storage)
    return chunk


#: per model: the memory rule's sizes of its passes, by the pass's modules and shapes
_SIZES: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], dict[object, int]]] = (
    weakref.WeakKeyDictionary()
)


def _pass_sizes(run: ChainPass, model: nn.Module) -> dict[object, int]:
    """``run.sizes``, shared by every pass of ``model`` with the same modules and the same
    shapes, dtypes and devices of activations and pooling indices: the sizes (a training
    step's peak, the K-fold tensors per sample) depend on nothing else, so a fit's batches
    compute them once instead of looping over the modules' parameters per batch."""
    if run.shared:
        return run.sizes
    key = (
        tuple(id(m) for _, m in run.chain),
        tuple((tuple(a.shape), a.dtype, a.device) for a in run.acts),
        tuple((i, tuple(t.shape), t.dtype) for i, t in sorted(run.indices.items())),
    )
    table = _SIZES.setdefault(model, {})
    if key not in table and len(table) > 32:  # e.g. many batch sizes: keep it small
        table.clear()
    run.sizes = table.setdefault(key, run.sizes)
    run.shared = True
    return run.sizes


def rule_budget(
    run: ChainPass,
    model: nn.Module,
    k: int,
    storage: int,
    rowwise: bool = True,
    copies: int = 1,
    buffers: int = 0,
    structured: bool = False,
) -> int:
    """Elements the K-fold backward tensors (or other per-chunk temporaries) may hold under
    the rule: see :func:`rule_chunk` (``rowwise``: no (N, K, C) output vectors held;
    ``structured``: the 2 N C numbers of a structured factor instead)."""
    n = run.acts[0].shape[0]
    step, held_sum = _step_and_held(run, model)
    # 2 (step + storage) with a 15 % margin, less what this pass holds anyway: the
    # activations, the output vectors (N K C) and ``copies`` storage-sized tensors (the
    # storage; a diagonal also sums a batch apart, to keep failures out: copies = 2)
    vectors = 0 if rowwise else n * k * run.acts[-1][0].numel()  # rowwise: per chunk
    vectors = 2 * n * run.acts[-1][0].numel() if structured else vectors
    tenths = 20 - rule_margin(run.acts[0].device)
    budget = (tenths * (step + storage)) // 10 - n * held_sum - vectors - copies * storage
    return budget - buffers


def _step_and_held(run: ChainPass, model: nn.Module) -> tuple[int, int]:
    """(a training step's estimated peak, elements per sample the pass holds: activations
    and masks), computed once per model and shapes (a Python loop over the modules'
    parameters) and kept in the pass's shared sizes."""
    sizes = _pass_sizes(run, model)
    if "step" not in sizes:
        sizes["step"] = _step_peak(run, model, _held_activations(run, training=True))
        sizes["held"] = sum(_held_activations(run)) + _mask_elements(run)
    return sizes["step"], sizes["held"]


def _keep_chunks_memory(run: ChainPass, model: nn.Module, storage: int) -> None:
    """A pass split into chunks allocates and frees blocks of up to the rule's allowance,
    2 (step + storage), once per chunk: on the CPU they are kept in the C heap, not handed
    back to the kernel and faulted in again per chunk (:mod:`gaussify.host_heap`; twice the
    allowance: the intra-op threads free theirs in their own arenas, measured)."""
    if run.acts[0].device.type != "cpu":
        return
    allowance = 2 * (_step_and_held(run, model)[0] + storage)
    keep_freed_memory(2 * allowance * run.acts[0].element_size(), run.acts[0].device)


def rule_margin(device: torch.device) -> int:
    """Tenths of (a training step's estimated allocations + the storage) the rule's budget
    keeps free: the budget is (20 - margin) / 10 of it. 3 (1.7 x, 15 % under the rule's 2 x)
    where the estimate (:func:`_step_peak`) was calibrated: CPU allocations, where it is
    0-11 % below a measured step. 5 (1.5 x) on CUDA: there the caching allocator's step
    (cuDNN) measured 11 % below the estimate (the 8 x 8 CNN at batch 32: 528 against 592 kB),
    and a diagonal fit planned with the CPU's margin reached 2.03 x a step + storage (one
    H100 run). Other accelerators, not measured, get CUDA's wider margin."""
    return 3 if device.type == "cpu" else 5


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
    structured: bool = False,
) -> int:
    """Output vectors propagated together when one sample with all K exceeds the rule's
    budget (:func:`rule_chunk` gives 0 samples): the most K' < K whose per-sample peak
    :func:`backward_peak` fits it (the backward pass is linear in the vectors, so the sums
    over K split into sums over groups of K' exactly), at least 1; K when one sample fits.
    With ``rowwise`` the K C vectors of the sample are formed whole per chunk."""
    budget = rule_budget(run, model, k, storage, rowwise, copies, buffers, structured)
    budget -= k * run.acts[-1][0].numel() if rowwise and not structured else 0
    per = set(per_sample_grads)
    if backward_peak(run, k, per, structured) <= budget:
        return k
    _keep_chunks_memory(run, model, storage)
    lo, hi = 1, k  # backward_peak grows with K: the largest K' with peak(K') <= budget
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if backward_peak(run, mid, per, structured) <= budget else (lo, mid)
    return lo


def _mask_elements(run: ChainPass) -> int:
    """Elements (of the activations' size) per sample of the ReLU masks the pass holds
    (``run.masks``, one byte per output; the other ReLUs' derivative comes from their kept
    output)."""
    width = run.acts[0].element_size()
    return sum(-(-mask[0].numel() // width) for mask in run.masks.values())


def _held_activations(run: ChainPass, training: bool = False) -> list[int]:
    """Elements per sample of the activations the pass allocated and holds, by position (not
    the caller's input; a max-pooling's int64 indices in elements of the activations).
    ``training``: those a training step holds instead, with the ReLU outputs the pass keeps
    as masks only (:func:`chain_forward`) at their full size (autograd saves them)."""
    width = run.acts[0].element_size()
    masked = {i + 1 for i in run.masks}  # outputs freed, their ReLUs' masks kept
    held = [0] + [
        a[0].numel() if a.device.type != "meta" or (training and i in masked) else 0
        for i, a in enumerate(run.acts[1:], 1)
    ]
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


def backward_peak(
    run: ChainPass, k: int, per_sample_grads: set[int], structured: bool = False
) -> int:
    """Elements per sample alive at once in :func:`backward_chunk` with K vectors (and the
    reductions of :func:`gaussify.curvature.chain_diag.chain_squared_sums` / the Gram sums
    at the positions it yields):
    the maximum over the modules of the gradient they receive (K out) plus what they
    allocate, K in for a product (none for an element-wise module, which works in place,
    K 2 in for an autograd product at a zero input, none for a reshape) or, at a layer being
    reduced, a K-fold squared or reordered copy of its gradient (for a linear layer at
    ``per_sample_grads`` with its sums over K and its squared input), or for a convolution at
    ``per_sample_grads`` its patches and K per-sample weight gradients (squared in place).
    ``structured``: the final linear layer takes a structured factor (no K-fold input, its
    reduction O(out))."""
    per_act = [a[0].numel() for a in run.acts]
    peak = 0
    last = len(run.chain) - 1
    for i, (_, m) in enumerate(run.chain):
        out, inp = per_act[i + 1], per_act[i]
        kind = type(m)
        if structured and i == last:
            # u^T W = s (W - q^T W): the K-fold product and q^T W; the reduction's (B, out)
            peak = max(peak, k * inp + inp + (3 * out + inp if i in per_sample_grads else 0))
            continue
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
            peak = max(peak, conv_reduction_peak(m, k, out, inp))
        elif kind in (nn.Linear, nn.Conv2d):
            # the gradient and its square / reordered copy; a diagonal's sums over K and the
            # squared inputs of a linear layer
            peak = max(peak, k * 2 * out + (out + inp if i in per_sample_grads else 0))
    return peak


def conv_reduction_peak(conv: nn.Conv2d, k: int, out: int, inp: int) -> int:
    """Elements per sample of a convolution's diagonal reduction with K vectors (``out`` /
    ``inp`` its output / input sizes per sample): for K = 1 one grouped
    ``convolution_backward`` (:func:`gaussify.curvature.chain_diag.
    _single_vector_squared_grads`): the gradient and input and the oneDNN reorders of both,
    and the per-sample weight gradients (measured within the rule's margin); else the
    gradient, the im2col patches and the per-sample weight gradients of a group of vectors
    (squared in place)."""
    if k == 1:
        return 2 * (out + inp) + conv.weight.numel()
    t = out // conv.out_channels
    patches = conv.weight[0].numel() * conv.groups * t
    return k * out + patches + conv_vector_group(conv, k, out) * conv.weight.numel()


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
