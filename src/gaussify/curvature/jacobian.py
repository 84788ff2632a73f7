"""Per-sample output Jacobians and Jacobian-vector products with ``torch.func``.

The network Jacobian J(x) = d f(x; theta) / d theta (thesis eq. 2.22) is the feature map of the
linearised network (eq. 2.26 / 3.1); every Gauss-Newton curvature is built from products with it
(GGN J^T Lambda J, eq. 2.24 / 3.11; gradients J^T r, eq. 2.23). All functions here work for any
module that ``torch.func.functional_call`` can run (LayerNorm, BatchNorm in eval mode, skip
connections, non-Sequential models): the parameters of the chosen subset are the differentiated
inputs, every other parameter and buffer stays fixed at its current value.

The model must be in **eval mode** where that matters: a BatchNorm in training mode mixes the
samples of a batch (and would update its running statistics), and Dropout in training mode is
random; both raise a ``ValueError`` naming the module. Modes are never switched here.

Memory is bounded by chunking over samples: at most a ``(chunk, K, P)`` block of per-sample
products exists at once, never an ``(N, C, P)`` array over a whole data set unless asked for
(:func:`jacobians` returns one for the inputs it is given, which the caller chunks).

Speed: parameters of plain ``nn.Linear`` and ``nn.Conv2d`` layers (the bulk of most networks)
take a per-layer route in :func:`per_sample_vjp` and :func:`squared_vjp_sum`: one forward pass
with hooks and one batched (vmapped) backward pass over the K cotangents give each layer's
inputs a and output gradients delta, and the per-sample products are delta ⊗ a for a linear
layer (the identity KFAC and BackPACK use; the diagonal needs only (delta^2)^T (a^2)) and
sum_t delta_t a_t^T over the T output locations of a convolution, with a_t the unfolded input
patches (im2col, :func:`conv2d_patches`; any stride, padding, padding mode, dilation and
groups). A traced layer must have run once on batched inputs and each of its parameters must
enter the autograd graph of the outputs exactly once, so a weight that is also used outside
its module falls back to the generic ``torch.func`` path, which every other parameter takes.

Shapes: inputs ``x (N, ...)``, outputs ``f (N, C)``, parameters flattened in
``model.named_parameters()`` order of the subset, ``P = subset.num_params``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.func as tfunc
from torch import Tensor, nn
from torch.func import jacrev, vmap
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from gaussify.curvature.batched_backward import chain_squared_sums
from gaussify.curvature.patches import (
    conv2d_patches,
    conv_per_sample_elements,
    conv_weight_grads,
)
from gaussify.curvature.subset import ParameterSubset, require_whole_tensors, select_parameters
from gaussify.fastpath import forward_ad_unsupported, functional_call, warn_reverse_mode

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "MIN_CHUNK_ELEMENTS",
    "SubsetLike",
    "auto_chunk_size",
    "check_eval_mode",
    "chunk_slices",
    "conv2d_patches",
    "jacobians",
    "jvp",
    "jvp_with_outputs",
    "linear_output_traces",
    "model_outputs",
    "per_sample_vjp",
    "resolve_subset",
    "squared_vjp_sum",
    "traced_jvp",
    "vjp",
]

SubsetLike = str | Sequence[str] | Tensor | ParameterSubset

#: Budget (in tensor elements) for one chunk of per-sample products, ``chunk * K * P``.
#: 2**24 elements are 128 MiB in float64.
DEFAULT_CHUNK_ELEMENTS = 2**24
#: Smallest budget the structures use when they size chunks by their own storage (a curvature
#: of a few thousand entries should not loop over single samples): 2**16 elements, 512 KiB in
#: float64.
MIN_CHUNK_ELEMENTS = 2**16


def resolve_subset(
    model: nn.Module, subset: SubsetLike, *, subnetwork: bool = False
) -> ParameterSubset:
    """A :class:`ParameterSubset` for ``subset`` (passed through if it already is one). With
    ``subnetwork=True`` (callers that handle individual weights) a mask or index tensor gives a
    subnetwork (:mod:`gaussify.curvature.subset`); otherwise a subnetwork raises."""
    if isinstance(subset, ParameterSubset):
        if not subnetwork:
            require_whole_tensors(subset, "this computation")
        return subset
    return select_parameters(model, subset, subnetwork=subnetwork)


def auto_chunk_size(num_samples: int, per_sample: int, chunk_size: int | None = None) -> int:
    """Samples per chunk: ``chunk_size`` if given, else as many as fit the element budget."""
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size: expected a positive integer or None, got {chunk_size!r}")
        return chunk_size
    return max(1, min(max(num_samples, 1), DEFAULT_CHUNK_ELEMENTS // max(per_sample, 1)))


def chunk_slices(num_samples: int, chunk_size: int) -> Iterator[slice]:
    """Consecutive slices of at most ``chunk_size`` samples covering ``range(num_samples)``."""
    for start in range(0, num_samples, chunk_size):
        yield slice(start, min(start + chunk_size, num_samples))


def check_eval_mode(model: nn.Module) -> None:
    """Raise if a module whose output depends on the batch or on randomness is in training mode.

    Per-sample Jacobians assume f(x_n) depends on x_n only (thesis eq. 2.22); BatchNorm in
    training mode breaks that (and would update running statistics), Dropout makes f random.
    """
    for name, module in model.named_modules():
        if module.training and isinstance(module, _BatchNorm | _DropoutNd | nn.AlphaDropout):
            raise ValueError(
                f"model: module {name or '<root>'!r} ({type(module).__name__}) is in training "
                "mode; call model.eval() before computing Jacobians or curvature (per-sample "
                "Jacobians need outputs that depend on one sample only and are deterministic)"
            )


def _check_output(out: Tensor, batch: int) -> None:
    if not isinstance(out, Tensor):
        raise TypeError(
            f"model: expected the forward pass to return a Tensor of shape (N, C), "
            f"got {type(out).__name__}"
        )
    if out.ndim != 2 or out.shape[0] != batch:
        raise ValueError(
            f"model: expected outputs of shape (N, C) = ({batch}, C), got {tuple(out.shape)}; "
            "wrap the model so that it returns a 2-D output"
        )


def _split(
    model: nn.Module, subset: ParameterSubset
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(subset parameters, every other parameter), all detached from the autograd graph."""
    chosen = set(subset.names)
    named = dict(model.named_parameters())
    missing = [n for n in subset.names if n not in named]
    if missing:
        raise ValueError(f"subset: parameters {missing} are not parameters of the model")
    params = {n: named[n].detach() for n in subset.names}
    frozen = {n: p.detach() for n, p in named.items() if n not in chosen}
    return params, frozen


def _single_sample_fn(
    model: nn.Module, frozen: dict[str, Tensor]
) -> Callable[[dict[str, Tensor], Tensor], Tensor]:
    """f(params, x_n) -> (C,), the network on one sample as a function of the subset."""

    def f(params: dict[str, Tensor], x_n: Tensor) -> Tensor:
        out = functional_call(model, {**frozen, **params}, (x_n.unsqueeze(0),))
        _check_output(out, 1)
        return out.squeeze(0)

    return f


def _batch_fn(
    model: nn.Module, frozen: dict[str, Tensor], x: Tensor
) -> Callable[[dict[str, Tensor]], Tensor]:
    """f(params) -> (N, C) on a batch (valid for products because samples are independent)."""

    def f(params: dict[str, Tensor]) -> Tensor:
        out = functional_call(model, {**frozen, **params}, (x,))
        _check_output(out, x.shape[0])
        return out

    return f


def _check_finite(block: Tensor, subset: ParameterSubset, model: nn.Module) -> None:
    """Raise naming the first parameter tensor whose Jacobian entries are NaN or infinite."""
    # One reduction first (NaN/inf propagate into the sum); the per-entry scan runs only when
    # it is not finite, which keeps the check to one read of the block.
    if torch.isfinite(block.sum()) or torch.isfinite(block).all():
        return
    parts = torch.split(block, list(subset.counts), dim=-1)
    for name, part in zip(subset.names, parts, strict=True):
        if not torch.isfinite(part).all():
            mod_name = subset.module_of(name)
            module = model.get_submodule(mod_name)
            kind = "NaN" if torch.isnan(part).any() else "infinite"
            raise ValueError(
                f"{kind} Jacobian in parameter {name!r} (module {mod_name or '<root>'!r}, "
                f"{type(module).__name__}): the network is not differentiable at the current "
                "parameters (e.g. sqrt or norm at zero); curvature cannot be computed"
            )


def model_outputs(model: nn.Module, x: Tensor, chunk_size: int | None = None) -> Tensor:
    """Network outputs f (N, C) without gradients, computed in chunks of ``chunk_size``."""
    n = x.shape[0]
    chunk = n if chunk_size is None else auto_chunk_size(n, 1, chunk_size)
    outs = []
    with torch.no_grad():
        for sl in chunk_slices(n, max(chunk, 1)):
            out = model(x[sl])
            _check_output(out, x[sl].shape[0])
            outs.append(out)
    if not outs:
        raise ValueError("x: got an empty batch")
    return torch.cat(outs)


def _generic_per_sample_vjp(
    model: nn.Module, subset: ParameterSubset
) -> Callable[[Tensor, Tensor], Tensor]:
    """(x (B, ...), u (B, K, C)) -> (B, K, P): vmap over samples of a vmap over K of vjp."""
    params, frozen = _split(model, subset)
    f_single = _single_sample_fn(model, frozen)

    def one(x_n: Tensor, u_n: Tensor) -> Tensor:
        _, pullback = tfunc.vjp(lambda p: f_single(p, x_n), params)
        (grads,) = vmap(pullback)(u_n)
        return subset.flatten(grads)

    return vmap(one)


def per_sample_vjp(
    model: nn.Module,
    x: Tensor,
    subset: SubsetLike,
    cotangents: Tensor,
    chunk_size: int | None = None,
) -> Tensor:
    """Per-sample vector-Jacobian products ``J_n^T u_{n,k}``, shape (N, K, P).

    ``cotangents`` has shape (N, K, C): K output-space vectors per sample. With the columns of a
    factor L_n (Lambda_n = L_n L_n^T) this gives the rows of the GGN square root, so that
    sum_n J_n^T Lambda_n J_n = A^T A (thesis eq. 2.24 / 3.11); with the residual r_n it gives the
    per-sample gradient J_n^T r_n (eq. 2.23). Computed in chunks of ``chunk_size`` samples
    (default: a fixed element budget). Parameters of plain ``nn.Linear`` layers take the
    per-layer route (K batched backward passes give each layer's output gradients delta, and
    the per-sample products are delta ⊗ a, written in place; see :func:`_linear_traces`);
    every other parameter uses ``vmap`` over samples of a ``vmap`` over K of
    ``torch.func.vjp``. A subnetwork's products are those of its support tensors with the
    selected columns gathered, chunk by chunk (chunks sized by the support).
    """
    subset = resolve_subset(model, subset, subnetwork=True)
    check_eval_mode(model)
    if cotangents.ndim != 3 or cotangents.shape[0] != x.shape[0]:
        raise ValueError(
            f"cotangents: expected shape (N, K, C) with N = {x.shape[0]}, "
            f"got {tuple(cotangents.shape)}"
        )
    if subset.indices is not None:
        support = subset.support
        n, k = cotangents.shape[:2]
        chunk = auto_chunk_size(n, k * support.num_params, chunk_size)
        return torch.cat(
            [
                subset.gather(per_sample_vjp(model, x[sl], support, cotangents[sl], chunk))
                for sl in chunk_slices(n, chunk)
            ]
        )
    linears = _hookable_linears(model, subset, convs=True)
    generic = None if linears else _generic_per_sample_vjp(model, subset)
    named = dict(model.named_parameters())
    offsets = dict(zip(subset.names, _offsets(subset), strict=True))
    dtype = named[subset.names[0]].dtype
    n, k = cotangents.shape[:2]
    chunk = auto_chunk_size(n, k * subset.num_params, chunk_size)
    blocks = []
    for sl in chunk_slices(n, chunk):
        u = cotangents[sl].to(dtype)
        if generic is not None:
            block = generic(x[sl], u)
        else:
            _, _, traces = _linear_traces(model, x[sl], linears, u)
            block = torch.empty(u.shape[0], k, subset.num_params, dtype=u.dtype, device=u.device)
            filled: set[str] = set()
            for tr in traces:
                if tr.conv is not None:
                    _write_conv_products(tr, block, offsets)
                    filled.update(name for _, name in tr.params)
                    continue
                deltas = tr.deltas.permute(1, 0, 2)  # (B, K, out)
                for kind, name in tr.params:
                    start, numel = offsets[name]
                    target = block[:, :, start : start + numel]
                    if kind == "weight":
                        out_dim, in_dim = named[name].shape
                        view = target.view(u.shape[0], k, out_dim, in_dim)
                        torch.mul(deltas.unsqueeze(-1), tr.inputs[:, None, None, :], out=view)
                    else:
                        target.copy_(deltas)
                    filled.add(name)
            rest = [name for name in subset.names if name not in filled]
            if rest:
                sub = ParameterSubset(names=tuple(rest), shapes=tuple(named[r].shape for r in rest))
                rest_block = _generic_per_sample_vjp(model, sub)(x[sl], u)
                for name, part in zip(
                    rest, torch.split(rest_block, list(sub.numels), dim=-1), strict=True
                ):
                    start, numel = offsets[name]
                    block[:, :, start : start + numel] = part
        _check_finite(block, subset, model)
        blocks.append(block)
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


def _write_conv_products(
    tr: _LinearTrace, block: Tensor, offsets: dict[str, tuple[int, int]]
) -> None:
    """Write a traced convolution's per-sample products into ``block`` (B, K, P): the weight
    columns sum_t delta_t a_t^T (:func:`conv_weight_grads`), the bias columns sum_t delta_t."""
    conv = tr.conv
    assert conv is not None
    k, b = tr.deltas.shape[:2]
    for kind, name in tr.params:
        start, numel = offsets[name]
        target = block[:, :, start : start + numel]
        if kind == "weight":
            patches = conv2d_patches(conv, tr.inputs)
            rows = target.view(b, k, conv.out_channels, -1)
            for j in range(k):
                rows[:, j].copy_(conv_weight_grads(conv, patches, tr.deltas[j]))
        else:
            target.copy_(tr.deltas.sum((-2, -1)).transpose(0, 1))


def jacobians(
    model: nn.Module, x: Tensor, subset: SubsetLike = "all", chunk_size: int | None = None
) -> Tensor:
    """Per-sample output Jacobians J_n = d f(x_n) / d theta_subset, shape (N, C, P).

    Thesis eq. 2.22, computed with ``vmap(jacrev(functional_call))`` over samples (C batched
    backward passes), in chunks of ``chunk_size`` samples. The result is (N, C, P) for the
    inputs given; to bound memory over a data set, call it per batch. Raises ``ValueError``
    naming the parameter when an entry is NaN or infinite. A subnetwork's Jacobian is the
    support tensors' one with the selected columns gathered per chunk (chunks sized by the
    support), so at most one chunk's (B, C, P_support) block exists at a time.
    """
    subset = resolve_subset(model, subset, subnetwork=True)
    check_eval_mode(model)
    params, frozen = _split(model, subset)
    f_single = _single_sample_fn(model, frozen)
    batched = vmap(jacrev(f_single), in_dims=(None, 0))
    n = x.shape[0]
    if n == 0:
        raise ValueError("x: got an empty batch")
    support = subset.support
    # C is unknown before the first forward; budget as if C were 16 and let users override.
    chunk = auto_chunk_size(n, 16 * support.num_params, chunk_size)
    blocks = []
    for sl in chunk_slices(n, chunk):
        block = support.flatten(batched(params, x[sl]))
        _check_finite(block, support, model)
        blocks.append(subset.gather(block))
    return torch.cat(blocks)


def jvp_with_outputs(
    model: nn.Module,
    x: Tensor,
    subset: SubsetLike,
    v: Tensor,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(f (N, C), J v (N, C)): outputs and Jacobian-vector products J_n v for one v (P,).

    Forward-mode ``torch.func.jvp`` of the batched network (the linearised network's change,
    thesis eq. 2.26), chunked over samples; where an operation has no forward-mode derivative,
    J_n from reverse mode times v (:mod:`gaussify.fastpath`, warned once per model).
    """
    subset = resolve_subset(model, subset, subnetwork=True)
    check_eval_mode(model)
    if v.shape != (subset.num_params,):
        raise ValueError(f"v: expected shape ({subset.num_params},), got {tuple(v.shape)}")
    params, frozen = _split(model, subset)
    tangents = {name: t.to(params[name].dtype) for name, t in subset.unflatten(v).items()}
    n = x.shape[0]
    chunk = n if chunk_size is None else auto_chunk_size(n, 1, chunk_size)
    outs, prods = [], []
    for sl in chunk_slices(n, max(chunk, 1)):
        try:
            out, prod = tfunc.jvp(_batch_fn(model, frozen, x[sl]), (params,), (tangents,))
        except (NotImplementedError, RuntimeError) as error:
            if not forward_ad_unsupported(error):
                raise
            warn_reverse_mode(model, error)
            out = model_outputs(model, x[sl])
            prod = torch.einsum("ncp,p->nc", jacobians(model, x[sl], subset), v.to(out.dtype))
        if not torch.isfinite(prod).all():
            raise ValueError(
                "NaN Jacobian-vector product: the network is not differentiable at the current "
                f"parameters in the subset {list(subset.names)}"
            )
        outs.append(out)
        prods.append(prod)
    if not outs:
        raise ValueError("x: got an empty batch")
    return torch.cat(outs), torch.cat(prods)


def jvp(
    model: nn.Module, x: Tensor, subset: SubsetLike, v: Tensor, chunk_size: int | None = None
) -> Tensor:
    """Jacobian-vector products J_n v for every sample, shape (N, C); v has shape (P,)."""
    return jvp_with_outputs(model, x, subset, v, chunk_size)[1]


def vjp(
    model: nn.Module, x: Tensor, subset: SubsetLike, u: Tensor, chunk_size: int | None = None
) -> Tensor:
    """sum_n J_n^T u_n, shape (P,), for output-space vectors u (N, C) (thesis eq. 2.23 with
    u = r gives the gradient of the log likelihood). Reverse mode on the batched network."""
    subset = resolve_subset(model, subset, subnetwork=True)
    check_eval_mode(model)
    n = x.shape[0]
    if u.ndim != 2 or u.shape[0] != n:
        raise ValueError(f"u: expected shape (N, C) with N = {n}, got {tuple(u.shape)}")
    params, frozen = _split(model, subset)
    chunk = n if chunk_size is None else auto_chunk_size(n, 1, chunk_size)
    total: Tensor | None = None
    for sl in chunk_slices(n, max(chunk, 1)):
        out, pullback = tfunc.vjp(_batch_fn(model, frozen, x[sl]), params)
        if out.shape != u[sl].shape:
            raise ValueError(f"u: expected shape {tuple(out.shape)} per chunk, got {u[sl].shape}")
        (grads,) = pullback(u[sl].to(out.dtype))
        flat = subset.flatten(grads)
        total = flat if total is None else total + flat
    if total is None:
        raise ValueError("x: got an empty batch")
    _check_finite(total, subset, model)
    return total


def _plain_conv2d(module: nn.Module) -> bool:
    """An ``nn.Conv2d`` whose forward pass is the library's own (no subclass changing it)."""
    return (
        isinstance(module, nn.Conv2d)
        and type(module).forward is nn.Conv2d.forward
        and type(module)._conv_forward is nn.Conv2d._conv_forward
    )


def _hookable_linears(
    model: nn.Module, subset: ParameterSubset, *, convs: bool = False
) -> dict[str, list[str]]:
    """Plain ``nn.Linear`` modules (and, with ``convs``, plain ``nn.Conv2d`` modules) owning
    subset parameters that no other module shares: module name -> ["weight"] / ["bias"] /
    both."""
    owners = Counter(
        id(p) for m in model.modules() for p in m._parameters.values() if p is not None
    )
    chosen = set(subset.names)
    found: dict[str, list[str]] = {}
    for mod_name, module in model.named_modules():
        linear = isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
        if not (linear or (convs and _plain_conv2d(module))):
            continue
        prefix = f"{mod_name}." if mod_name else ""
        kinds = [
            kind
            for kind in ("weight", "bias")
            if f"{prefix}{kind}" in chosen
            and getattr(module, kind) is not None
            and owners[id(getattr(module, kind))] == 1
        ]
        if kinds:
            found[mod_name] = kinds
    return found


@dataclass
class _LinearTrace:
    """One plain linear layer on the per-layer route: its inputs a (B, D_in), the gradients of
    sum_n u_{n,k}^T f_n with respect to its outputs, delta (K, B, D_out), and its parameters in
    the subset as (kind, full name). For a convolution (``conv`` set) the inputs are the
    layer's (B, C_in, H, W) input and delta is (K, B, C_out, H_out, W_out)."""

    module: str
    inputs: Tensor
    deltas: Tensor
    params: list[tuple[str, str]]
    conv: nn.Conv2d | None = None
    #: the layer's output in the autograd graph of f (kept only by ``_traces_from(...,
    #: backward=False)``, whose caller runs the backward passes itself)
    output: Tensor | None = None


def _linear_traces(
    model: nn.Module,
    x: Tensor,
    linears: dict[str, list[str]],
    cotangents: Tensor | Callable[[Tensor], Tensor],
) -> tuple[Tensor, Tensor, list[_LinearTrace]]:
    """(f (N, C) detached, u (N, K, C), traces) from one forward pass with hooks and K batched
    backward passes.

    For a linear layer z_n = W a_n + b the per-sample gradient of u^T f_n is delta_n a_n^T
    (and delta_n for b), so per-sample products need only a and delta (the identity behind
    BackPACK and KFAC). A layer is traced only if it ran exactly once on 2-D inputs and each of
    its parameters in the subset has exactly one use in the autograd graph of f (then the
    batched parameter gradient is sum_n delta_n a_n^T); a weight also used elsewhere in the
    forward pass has two, and the layer then falls back to the generic path.
    """
    f, captured = _traced_forward(model, x, linears)
    u = cotangents(f.detach()) if callable(cotangents) else cotangents
    return _traces_from(model, f, captured, linears, u)


_Captured = dict[str, list[tuple[Tensor, Tensor]]]


def _traced_forward(
    model: nn.Module, x: Tensor, linears: dict[str, list[str]]
) -> tuple[Tensor, _Captured]:
    """(f (N, C) with its autograd graph, module name -> [(input, output)] of each call): the
    forward pass of :func:`_linear_traces`, with hooks on the listed modules."""
    captured: _Captured = {name: [] for name in linears}
    handles = []
    for mod_name in linears:

        def hook(
            _m: nn.Module, inputs: tuple[Tensor, ...], out: Tensor, key: str = mod_name
        ) -> None:
            captured[key].append((inputs[0], out))

        handles.append(model.get_submodule(mod_name).register_forward_hook(hook))
    try:
        with torch.enable_grad():
            f = model(x)
    finally:
        for handle in handles:
            handle.remove()
    _check_output(f, x.shape[0])
    return f, captured


def _traces_from(
    model: nn.Module,
    f: Tensor,
    captured: _Captured,
    linears: dict[str, list[str]],
    u: Tensor,
    backward: bool = True,
) -> tuple[Tensor, Tensor, list[_LinearTrace]]:
    """The backward half of :func:`_linear_traces` for the outputs of :func:`_traced_forward`.
    With ``backward=False`` no backward pass runs: the traces keep their layer's output (in
    the graph of the returned f, which is then not detached) and empty deltas."""
    named = dict(model.named_parameters())
    if u.ndim != 3 or u.shape[0] != f.shape[0] or u.shape[2] != f.shape[1]:
        raise ValueError(f"cotangents: expected shape (N, K, C), got {tuple(u.shape)}")
    modules = {m: model.get_submodule(m) for m in linears}
    usable = [
        m
        for m, calls in captured.items()
        # one row per sample: a layer run on reshaped inputs (e.g. both members of a pair
        # stacked into 2N rows, or tokens) mixes rows across samples and takes the generic path
        # (a convolution: one (C, H, W) image per sample)
        if len(calls) == 1
        and calls[0][0].ndim == (4 if isinstance(modules[m], nn.Conv2d) else 2)
        and calls[0][0].shape[0] == f.shape[0]
        and calls[0][1].requires_grad
    ]
    if not usable or not f.requires_grad:
        return (f.detach() if backward else f), u, []
    outs = [captured[m][0][1] for m in usable]
    acts = [captured[m][0][0].detach() for m in usable]
    pnames = [(m, kind, f"{m}.{kind}" if m else kind) for m in usable for kind in linears[m]]
    params = [named[full] for _, _, full in pnames]
    u = u.to(f.dtype)
    uses = _graph_uses(f)  # before the backward pass frees the graph's buffers
    empty = u.new_empty(0)
    deltas = _batched_output_grads(f, outs, u.transpose(0, 1)) if backward else [empty] * len(outs)
    # The route is exact when each traced parameter enters the graph of f once (in its
    # module, which ran once): then d f / d W = sum_n delta_n a_n^T. Counting the parameter's
    # uses in the autograd graph finds weights also used elsewhere without computing any
    # parameter gradient (a numerical check against the batched gradient would hold K x P,
    # or at least P, extra numbers, more than a diagonal curvature itself).
    ok = dict.fromkeys(usable, True)
    for (m, _, _), p in zip(pnames, params, strict=True):
        if uses.get(id(p), 0) != 1:
            ok[m] = False
    traces = [
        _LinearTrace(
            module=m,
            inputs=acts[i],
            deltas=deltas[i],
            params=[(kind, f"{m}.{kind}" if m else kind) for kind in linears[m]],
            conv=modules[m] if isinstance(modules[m], nn.Conv2d) else None,
            output=None if backward else outs[i],
        )
        for i, m in enumerate(usable)
        if ok[m]
    ]
    return (f.detach() if backward else f), u, traces


def linear_output_traces(
    model: nn.Module, x: Tensor, subset: SubsetLike
) -> tuple[Tensor, dict[str, _LinearTrace]] | None:
    """(f (N, C) detached, module name -> trace) with every output's gradient at each layer:
    the traces' ``deltas`` are (C, N, out), row c the gradient of f_c with respect to the
    layer's output (cotangents the unit vectors e_c), ``inputs`` the layer's inputs a (N, in).

    One forward pass with hooks and C backward passes (:func:`_linear_traces`), no (N, C, P)
    Jacobian: the Jacobian of f_c with respect to a plain linear layer's weight is
    delta_c a^T and with respect to its bias delta_c. None (nothing to use) unless every
    parameter of the subset is on that route: a whole-tensor subset of plain ``nn.Linear``
    modules, each run once on (N, in) inputs, with unshared parameters that enter the graph of
    f once, and finite gradients (the generic path then reports the parameter of a NaN).
    """
    subset = resolve_subset(model, subset, subnetwork=True)
    if subset.indices is not None:
        return None
    check_eval_mode(model)
    linears = _hookable_linears(model, subset)
    covered = {f"{m}.{kind}" if m else kind for m, kinds in linears.items() for kind in kinds}
    if covered != set(subset.names):
        return None
    f, captured = _traced_forward(model, x, linears)
    eye = torch.eye(f.shape[1], dtype=f.dtype, device=f.device)
    f, _, traces = _traces_from(model, f, captured, linears, eye.expand(f.shape[0], -1, -1))
    if {name for tr in traces for _, name in tr.params} != set(subset.names):
        return None
    if not all(bool(torch.isfinite(tr.deltas).all()) for tr in traces):
        return None
    return f, {tr.module: tr for tr in traces}


def traced_jvp(traces: dict[str, _LinearTrace], tangents: dict[str, Tensor]) -> Tensor:
    """J v (N, C) from :func:`linear_output_traces` traces covering the subset, for a tangent
    given per parameter name (shapes of the parameters): ``sum_layers delta_c . (dW a + db)``."""
    total: Tensor | int = 0
    for tr in traces.values():
        change = tr.deltas.new_zeros(tr.deltas.shape[1:])  # (N, out)
        for kind, name in tr.params:
            t = tangents[name].to(change.dtype)
            change = change + (tr.inputs @ t.mT if kind == "weight" else t)
        total = total + torch.einsum("cno,no->nc", tr.deltas, change)
    assert isinstance(total, Tensor)
    return total


def _graph_uses(f: Tensor) -> dict[int, int]:
    """{id(leaf tensor): number of edges into its AccumulateGrad node} over the autograd
    graph of ``f``: how many operations of the forward pass used each leaf (parameter)."""
    counts: dict[int, int] = {}
    if f.grad_fn is None:
        return counts
    seen = {f.grad_fn}
    stack = [f.grad_fn]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            variable = getattr(child, "variable", None)
            if variable is not None:  # AccumulateGrad: a leaf
                counts[id(variable)] = counts.get(id(variable), 0) + 1
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return counts


def _batched_output_grads(
    f: Tensor, inputs: list[Tensor], grad_outputs: Tensor, retain_graph: bool = False
) -> list[Tensor]:
    """Gradients of sum(grad_outputs[k] * f) with respect to ``inputs`` for every k, each
    stacked to (K, *input.shape) (see :func:`_output_grads`). Unused inputs get zeros."""
    per_k = list(_output_grads(f, inputs, grad_outputs, retain_graph))
    return [torch.stack([row[i] for row in per_k]) for i in range(len(inputs))]


def _output_grads(
    f: Tensor, inputs: list[Tensor], grad_outputs: Tensor, retain_graph: bool = False
) -> Iterator[list[Tensor]]:
    """For k = 1..K, the gradients of sum(grad_outputs[k] * f) with respect to ``inputs``
    (zeros for an unused one), one backward pass each (the graph is kept until the last).

    K plain backward passes, not one vmapped pass (``is_grads_batched``): torch's batching
    rules for pooling and activation backward kernels fall back to slow per-slice loops, and
    measured on the benchmark CNN and a 784-120-84-10 MLP (batch 32 / 256, 10 vectors, one
    thread) the loop takes 20 ms vs 44 ms and 2 ms vs 10 ms. A caller that consumes the
    gradients one k at a time holds one batch of them instead of K."""
    k = grad_outputs.shape[0]
    for j in range(k):
        grads = torch.autograd.grad(
            f,
            inputs,
            grad_outputs=grad_outputs[j],
            retain_graph=retain_graph or j < k - 1,
            allow_unused=True,
        )
        yield [
            g.detach() if g is not None else torch.zeros_like(t)
            for g, t in zip(grads, inputs, strict=True)
        ]


def _offsets(subset: ParameterSubset) -> list[tuple[int, int]]:
    """(start, numel) of each parameter tensor in the flattened subset vector."""
    out, start = [], 0
    for numel in subset.numels:
        out.append((start, numel))
        start += numel
    return out


def squared_vjp_sum(
    model: nn.Module,
    x: Tensor,
    subset: SubsetLike,
    cotangents: Callable[[Tensor], Tensor],
    chunk_size: int | None = None,
    *,
    budget: int | None = None,
    out: Tensor | None = None,
    row_cotangents: Callable[[Tensor, slice], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """(sum_n sum_k (J_n^T u_{n,k})^2 elementwise (P,), outputs f (N, C)).

    The diagonal of sum_n J_n^T U_n^T U_n J_n (the diagonal GGN, thesis eq. 2.24, for U_n the
    transposed factor of Lambda_n; the diagonal empirical Fisher for U_n = r_n^T). The
    cotangents depend on the outputs, so they are given as a function ``f (N, C) -> U (N, K, C)``
    evaluated after the forward pass (once, on all N outputs).

    Parameters of plain ``nn.Linear`` and ``nn.Conv2d`` layers take the per-layer route
    (:func:`_linear_traces`), about K gradient passes in all: for a linear weight the squared
    per-sample gradient summed over samples is (delta^2)^T (a^2), with no per-sample tensor;
    a convolution's per-sample gradient sum_t delta_t a_t^T (over its T output locations, from
    the im2col patches) does not factor that way, so it is formed for chunks of samples,
    squared and summed. Every other parameter uses chunked ``torch.func`` per-sample products.
    ``budget`` (elements) bounds one chunk's linear-layer gradients delta (K x the layers'
    output sizes per sample) and inputs; a convolution's per-sample tensors (its output
    gradients, patches and weight gradients, which exceed a small curvature's storage for a
    single image) are bounded by the fixed budget ``DEFAULT_CHUNK_ELEMENTS`` instead, the one
    the generic per-sample products use. When the batch exceeds them, the outputs and
    cotangents are computed first by a forward pass without gradients and the per-layer route
    runs over chunks of samples (``chunk_size``, if given, also sets the chunks of both
    routes). With ``out`` (P,) the sums are added to it in place (it is returned), so no
    P-sized temporaries are formed besides the check of the route.
    A subnetwork's sums are its entries of the support tensors' sums (one P_support
    temporary).
    """
    subset = resolve_subset(model, subset, subnetwork=True)
    check_eval_mode(model)
    if subset.indices is not None:
        total, f = squared_vjp_sum(model, x, subset.support, cotangents, chunk_size, budget=budget)
        if out is None:
            return subset.gather(total), f
        if out.shape != (subset.num_params,):
            raise ValueError(f"out: expected shape ({subset.num_params},), got {tuple(out.shape)}")
        return out.add_(subset.gather(total).to(out.dtype)), f
    linears = _hookable_linears(model, subset, convs=True)
    n = x.shape[0]
    if out is None:
        dtype = dict(model.named_parameters())[subset.names[0]].dtype
        out = torch.zeros(subset.num_params, dtype=dtype, device=x.device)
    elif out.shape != (subset.num_params,):
        raise ValueError(f"out: expected shape ({subset.num_params},), got {tuple(out.shape)}")
    covered = {f"{m}.{kind}" if m else kind for m, kinds in linears.items() for kind in kinds}
    chained = None
    if covered == set(subset.names):
        # the K vectors in one batched backward pass (an nn.Sequential of supported modules)
        views = _param_views(model, subset, out)
        chained = chain_squared_sums(
            model, x, linears, cotangents, views, chunk_size, out.numel(), row_cotangents
        )
    if chained is not None:
        f = chained
    elif not linears or (budget is None and chunk_size is None):
        f = _add_squared_sums(model, x, subset, linears, cotangents, chunk_size, out)
    else:
        # The layers' sizes per sample from a forward pass on one sample: if the whole batch
        # fits the budget, one pass with hooks does everything; else the outputs (hence the
        # cotangents) come from a forward pass without gradients and the per-layer route runs
        # over chunks of samples.
        sizes = _layer_sizes(model, x[:1], list(linears))
        chunk = chunk_size or _layer_chunk(model, sizes, n, budget)
        if chunk >= n:
            f = _add_squared_sums(model, x, subset, linears, cotangents, chunk_size, out)
        else:
            f = model_outputs(model, x)
            u = cotangents(f)
            if u.ndim != 3 or u.shape[0] != n or u.shape[2] != f.shape[1]:
                raise ValueError(f"cotangents: expected shape (N, K, C), got {tuple(u.shape)}")
            for sl in chunk_slices(n, chunk):
                _add_squared_sums(model, x[sl], subset, linears, u[sl], chunk_size, out)
    _check_finite(out, subset, model)
    return out, f


def _layer_sizes(model: nn.Module, x: Tensor, modules: list[str]) -> dict[str, tuple[int, int]]:
    """{module: (input, output) elements per sample} from a forward pass without gradients on
    ``x`` (one sample), for sizing the chunks of the per-layer route."""
    sizes: dict[str, tuple[int, int]] = {}
    handles = []
    for name in modules:

        def hook(_m: nn.Module, inputs: tuple[Tensor, ...], out: Tensor, key: str = name) -> None:
            rows = max(x.shape[0], 1)
            sizes[key] = (inputs[0].numel() // rows, out.numel() // rows)

        handles.append(model.get_submodule(name).register_forward_hook(hook))
    try:
        model_outputs(model, x)
    finally:
        for handle in handles:
            handle.remove()
    return sizes


def _layer_chunk(
    model: nn.Module, sizes: dict[str, tuple[int, int]], n: int, budget: int | None
) -> int:
    """Samples per chunk of the per-layer route, which streams over the output vectors: the
    linear layers' per-sample tensors (one delta and sum_k delta^2 (out each), the saved
    output and input and a^2: 3 out + 2 in) within ``budget``, the convolutions' within the
    fixed ``DEFAULT_CHUNK_ELEMENTS``."""
    linear = conv = 0
    for name, (inp, out) in sizes.items():
        module = model.get_submodule(name)
        if isinstance(module, nn.Conv2d):
            conv += conv_per_sample_elements(module, inp, out)
        else:
            linear += 3 * out + 2 * inp
    chunk = n
    if linear:
        chunk = min(chunk, (budget or n * linear) // linear)
    if conv:
        chunk = min(chunk, DEFAULT_CHUNK_ELEMENTS // conv)
    return max(1, chunk)


def _add_squared_sums(
    model: nn.Module,
    x: Tensor,
    subset: ParameterSubset,
    linears: dict[str, list[str]],
    cotangents: Tensor | Callable[[Tensor], Tensor],
    chunk_size: int | None,
    out: Tensor,
) -> Tensor:
    """One pass of :func:`squared_vjp_sum` over ``x``, added into ``out`` (P,); returns f."""
    named = dict(model.named_parameters())
    view = _param_views(model, subset, out)
    f, captured = _traced_forward(model, x, linears)
    u = cotangents(f.detach()) if callable(cotangents) else cotangents
    f, u, traces = _traces_from(model, f, captured, linears, u, backward=False)
    del captured
    _stream_squares(traces, f, u, view, out.dtype)
    f = f.detach()
    done = {name for tr in traces for _, name in tr.params}
    rest = [n for n in subset.names if n not in done]
    if rest:
        sub = ParameterSubset(names=tuple(rest), shapes=tuple(named[n].shape for n in rest))
        generic = _generic_per_sample_vjp(model, sub)
        chunk = auto_chunk_size(u.shape[0], u.shape[1] * sub.num_params, chunk_size)
        total = torch.zeros(sub.num_params, dtype=f.dtype, device=f.device)
        for sl in chunk_slices(u.shape[0], chunk):
            total += generic(x[sl], u[sl].to(f.dtype)).square().sum((0, 1))
        for name, value in sub.unflatten(total).items():
            view(name).add_(value.to(out.dtype))
    return f


def _param_views(model: nn.Module, subset: ParameterSubset, out: Tensor) -> Callable[[str], Tensor]:
    """name -> the view of the flat ``out`` (P,) holding that parameter, in its shape."""
    named = dict(model.named_parameters())
    offsets = dict(zip(subset.names, _offsets(subset), strict=True))

    def view(name: str) -> Tensor:
        start, numel = offsets[name]
        return out[start : start + numel].view(named[name].shape)

    return view


def _stream_squares(
    traces: list[_LinearTrace],
    f: Tensor,
    u: Tensor,
    view: Callable[[str], Tensor],
    dtype: torch.dtype,
) -> None:
    """sum_n sum_k (per-sample gradient)^2 of the traced layers' parameters, added into
    ``view(name)``, with one backward pass per output vector k whose layer gradients delta
    are used and dropped before the next (one batch of them is alive, not K).

    Linear: sum_{k,n} delta^2 a^2 = sum_n (sum_k delta^2) a^2, so sum_k delta^2 (B, out) is
    accumulated and multiplied by a^2 once. Convolution: the per-sample gradient
    sum_t delta_t a_t^T does not factor, so it is formed per k (one batched matmul with the
    im2col patches, :func:`conv_weight_grads`), squared and summed; its bias gradient is
    sum_t delta_t.
    """
    if not traces:
        return
    d_sq: dict[str, Tensor] = {}  # linear layers: sum_k delta_k^2 (B, out)
    patches: dict[str, Tensor] = {}
    for tr in traces:
        kinds = dict(tr.params)
        if tr.conv is not None and "weight" in kinds:
            patches[tr.module] = conv2d_patches(tr.conv, tr.inputs, tr.module)
    outputs = [tr.output for tr in traces]
    assert all(o is not None for o in outputs)
    for grads in _output_grads(f, outputs, u.transpose(0, 1)):  # type: ignore[arg-type]
        for tr, d in zip(traces, grads, strict=True):
            kinds = dict(tr.params)
            if tr.conv is None:
                if tr.module in d_sq:
                    d_sq[tr.module].addcmul_(d, d)
                else:
                    d_sq[tr.module] = d * d
                continue
            if "weight" in kinds:
                grads_w = conv_weight_grads(tr.conv, patches[tr.module], d)
                view(kinds["weight"]).view(tr.conv.out_channels, -1).add_(
                    grads_w.square_().sum(0).to(dtype)
                )
            if "bias" in kinds:
                view(kinds["bias"]).add_(d.sum((-2, -1)).square().sum(0).to(dtype))
        del grads
    for tr in traces:
        if tr.conv is not None or tr.module not in d_sq:
            continue
        sq = d_sq.pop(tr.module).to(dtype)
        for kind, name in tr.params:
            if kind == "weight":
                view(name).addmm_(sq.T, tr.inputs.to(dtype).square())
            else:
                view(name).add_(sq.sum(0))
