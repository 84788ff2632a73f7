"""Per-sample vector-Jacobian products J_n^T u_{n,k} and their elementwise squared sums.

:func:`per_sample_vjp` gives the (N, K, P) products (with the columns of a factor of Lambda_n,
the rows of the GGN square root, thesis eq. 2.24 / 3.11; with the residual, per-sample
gradients, eq. 2.23); :func:`squared_vjp_sum` gives sum_n sum_k (J_n^T u_{n,k})^2, the diagonal
GGN / empirical Fisher, without forming per-sample tensors where the layer allows it.

Parameters of plain ``nn.Linear`` and ``nn.Conv2d`` layers take the per-layer route of
:mod:`gaussify.curvature.layer_traces` (an ``nn.Sequential`` of supported modules takes the
batched backward pass of :mod:`gaussify.curvature.batched_backward` for the squared sums);
every other parameter takes the generic ``torch.func`` route
(:mod:`gaussify.curvature.generic_jacobian`). Memory is bounded by chunking over samples: at
most a ``(chunk, K, P)`` block of per-sample products exists at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from gaussify.curvature import generic_jacobian
from gaussify.curvature.chain_diag import GradientSink, chain_squared_sums
from gaussify.curvature.generic_jacobian import (
    SubsetLike,
    _check_finite,
    _generic_per_sample_vjp,
    auto_chunk_size,
    check_eval_mode,
    chunk_slices,
    model_outputs,
    resolve_subset,
)
from gaussify.curvature.layer_traces import (
    _hookable_linears,
    _linear_traces,
    _LinearTrace,
    _output_grads,
    _traced_forward,
    _traces_from,
)
from gaussify.curvature.patches import (
    conv2d_patches,
    conv_per_sample_elements,
    conv_weight_grads,
)
from gaussify.curvature.sqrt_factor import SqrtFactor
from gaussify.curvature.subset import ParameterSubset

__all__ = ["per_sample_vjp", "squared_vjp_sum"]


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
    atomic: bool = False,
    factor: Callable[[Tensor], SqrtFactor | None] | None = None,
    checked: bool = True,
    num_vectors: Callable[[int], int] | None = None,
    plans: dict[Any, Any] | None = None,
    gradient: GradientSink | None = None,
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
    temporary). ``atomic``: ``out`` changes only if the batch's sums are complete and finite
    (else it is left as it was and the error raised): a chain of linear layers defers its
    additions to the end of the batch and checks them first (no P-sized temporary); every
    other route sums into a temporary added at the end. ``factor``: the cotangents as a
    structured factor of f, for the batched route (:func:`chain_squared_sums`).
    ``checked=False``: the sums are not tested for finite values here (nor is ``atomic``
    honoured): the caller tests the accumulated result (a fit's deferred checks,
    :func:`gaussify.curvature.diag.check_diagonal`). ``num_vectors(C)``: K for C outputs,
    if the caller knows it (the batched route then forms no vectors to read it);
    ``plans``: the caller's table of the batched route's chunk plans, kept across batches.
    ``gradient``: J^T r added to its ``out`` in the batched route's passes where it can be
    (:class:`gaussify.curvature.chain_diag.GradientSink`, ``added`` set then; never on the
    other routes).
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
        views = param_views(model, subset, out)
        if gradient is not None:
            gradient.view = param_views(model, subset, gradient.out)
        chained = chain_squared_sums(
            model,
            x,
            linears,
            cotangents,
            views,
            chunk_size,
            out.numel(),
            row_cotangents,
            atomic=atomic,
            factor=factor,
            checked=checked,
            num_vectors=num_vectors,
            plans=plans,
            gradient=gradient,
        )
    total = out
    if chained is None and atomic and checked:
        out = torch.zeros_like(total)  # summed apart, added once complete and finite
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
    if checked:
        _check_finite(out, subset, model)
    if out is not total:
        out = total.add_(out)
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
        chunk = min(chunk, generic_jacobian.DEFAULT_CHUNK_ELEMENTS // conv)
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
    view = param_views(model, subset, out)
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


def param_views(model: nn.Module, subset: ParameterSubset, out: Tensor) -> Callable[[str], Tensor]:
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
