"""The diagonal GGN / EF of a chain's linear and convolution layers from one batched backward
pass (:mod:`gaussify.curvature.batched_backward`): sum_n sum_k (per-sample gradient of
u_{n,k}^T f_n)^2, squared and summed per layer (thesis eq. 2.24 on the diagonal).

Linear: sum_{k,n} delta^2 a^2 = sum_n (sum_k delta_{k,n}^2) a_n^2 (the sums over K buffered
per batch or reduced per chunk); convolution: the per-sample gradient sum_t delta_t a_t^T from
the im2col patches, for groups of vectors (:func:`gaussify.curvature.batched_backward.
conv_vector_group`). The plan of the chunks follows the memory rule
(:func:`gaussify.curvature.batched_backward.rule_chunk`) and an op-count cost model; on a
chain of linear layers the batch's sums can be deferred and checked before they are added
(``atomic``: no P-sized batch temporary).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gaussify.curvature.batched_backward import (
    ChainPass,
    add_layer_gradient,
    backward_chunk,
    backward_peak,
    chain_forward,
    conv_vector_group,
    module_chain,
    rule_chunk,
    rule_columns,
    structured_chain,
)
from gaussify.curvature.patches import conv2d_patches
from gaussify.curvature.pooled_conv import (
    gathered_patches,
    gradient_at_maxima,
    maxima_gradient,
    maxima_peak,
    pooled_pays,
    pooled_peak,
    pooled_squared_grads,
    pooling_after,
    squares_at_maxima,
)
from gaussify.curvature.sqrt_factor import SqrtFactor
from gaussify.deferred_checks import check_finite
from gaussify.likelihoods import all_finite

__all__ = ["GradientSink", "chain_squared_sums"]


@dataclass
class GradientSink:
    """J^T r of the chain's parameters, sum_n J_n^T r_n for the residuals ``residual(f)``
    (N, C), added into ``view(parameter name)`` by :func:`chain_squared_sums` in the backward
    passes of the squares, as one more vector where all K go in one pass, K >= 2 and it pays
    (:func:`_fold_pays`), or from the one vector itself where that is the residual
    (``shared``, the empirical Fisher); ``added`` tells the caller that it was, else it
    forms J^T r itself: the gradient of the log-likelihood a Laplace fit needs, without a
    forward and backward pass of its own. ``out``: the flat gradient (P,) in the parameters' order;
    ``view`` is set by :func:`gaussify.curvature.per_sample.squared_vjp_sum` from it."""

    residual: Callable[[Tensor], Tensor]
    out: Tensor
    view: Callable[[str], Tensor] | None = None
    added: bool = False
    #: the K = 1 vectors are the residuals themselves (the empirical Fisher's): their
    #: gradients are summed as they are squared, no vector is added
    shared: bool = False


def _conv_squared_grads(conv: nn.Conv2d, patches: Tensor, d: Tensor) -> Tensor:
    """sum_{k,n} (sum_t delta_{k,n,t} a_{n,t}^T)^2, shape (C_out, C_in / G * kh * kw), from the
    patches (B, C_in kh kw, T) and d (B, K, C_out, H_out, W_out): one batched matmul over
    (sample, group) of the stacked gradients (K' out/G, T) with the patches (T, in/G) per
    group of K' = :func:`conv_vector_group` vectors (the K' per-sample weight gradients are
    at most about the size of the K gradients d)."""
    b, k, groups, t = d.shape[0], d.shape[1], conv.groups, patches.shape[-1]
    per = conv.out_channels // groups
    a = patches.view(b * groups, patches.shape[1] // groups, t).transpose(1, 2)
    step = conv_vector_group(conv, k, d.shape[2:].numel())
    total = None
    for k0 in range(0, k, step):
        part = d[:, k0 : k0 + step]
        kk = part.shape[1]
        if groups == 1:  # a view: the K' vectors of a sample are contiguous
            dd = part.reshape(b, kk * per, t)
        else:
            dd = part.reshape(b, kk, groups, per, t).transpose(1, 2)
            dd = dd.reshape(b * groups, kk * per, t)
        grads = torch.bmm(dd, a)
        sums = grads.mul_(grads).view(b, groups, kk, per, -1).sum((0, 2))
        del grads  # before the next group's are formed
        total = sums if total is None else total.add_(sums)
    assert total is not None
    return total.reshape(conv.out_channels, -1)


def _single_vector_squared_grads(
    conv: nn.Conv2d, a: Tensor, d: Tensor, summed: Tensor | None = None
) -> Tensor:
    """sum_n (per-sample weight gradient of u_n^T f_n)^2 for one vector per sample (K = 1:
    the empirical Fisher, one Monte Carlo draw, a binary softmax's rank-1 root), shape
    (C_out, C_in / G * kh * kw), from the input a (B, C_in, H, W) and d (B, 1, C_out, H', W'):
    the B samples are the groups of one convolution (B G groups; its weight gradient is the B
    per-sample gradients, (B C_out, C_in / G, kh, kw)), one ``convolution_backward`` call
    instead of the im2col patches and B products (measured 3 x faster at B = 32 and 256 on
    the CPU; slower from K = 9 vectors on, so only for K = 1). The weight is only a shape
    there (a stride-0 expansion of one number). ``summed``: the view of a shared residual's
    summed gradient (:attr:`GradientSink.shared`), the per-sample gradients' sum added to it."""
    b = a.shape[0]
    weight = d.new_empty(()).expand(b * conv.out_channels, *conv.weight.shape[1:])
    grads = torch.ops.aten.convolution_backward(
        d.reshape(1, b * conv.out_channels, *d.shape[-2:]),
        a.reshape(1, b * conv.in_channels, *a.shape[-2:]).to(d.dtype),
        weight,
        None,
        conv.stride,
        conv.padding,
        conv.dilation,
        False,
        (0, 0),
        b * conv.groups,
        (False, True, False),
    )[1]
    per = grads.view(b, conv.out_channels, -1)
    if summed is not None:  # the vector's summed gradient too (the residual's, shared)
        summed.view(conv.out_channels, -1).add_(per.sum(0).to(summed.dtype))
    return per.mul_(per).sum(0)


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
    factor: Callable[[Tensor], SqrtFactor | None] | None = None,
    checked: bool = True,
    num_vectors: Callable[[int], int] | None = None,
    plans: dict[Any, Any] | None = None,
    gradient: GradientSink | None = None,
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
    the rest of that budget (:func:`rule_chunk`).

    ``factor(f)``, if given and the chain ends with an ``nn.Linear``, gives the vectors as a
    structured factor (:class:`gaussify.curvature.sqrt_factor.SqrtFactor`, None where the
    likelihood has none) that must equal ``cotangents(f)``: 2 C numbers per sample, its
    product with the final weight in O(C d) and that layer's squared sums in O(C).

    ``checked=False`` (a fit's deferred checks test the accumulated sum instead): with
    ``atomic`` the deferred additions are made without the finiteness and overflow tests (no
    host sync) and never summed apart first. ``num_vectors(C)``, if given, is K (else the
    vectors of one sample are formed to read it). ``plans``: a table the caller keeps
    across batches (a fit's), where the chunk plan of each setting is computed once.
    ``gradient``: J^T r added in the same passes where it can be (:class:`GradientSink`)."""
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
    structured = factor(f) if factor is not None and structured_chain(run) else None
    if structured is not None:

        def vectors(rows: slice) -> Tensor | SqrtFactor:
            return structured.rows(rows)
    elif row_cotangents is None:
        whole = cotangents(f)
        if whole.ndim != 3 or whole.shape[0] != n or whole.shape[2] != f.shape[1]:
            raise ValueError(f"cotangents: expected shape (N, K, C), got {tuple(whole.shape)}")

        def vectors(rows: slice) -> Tensor:
            return whole[rows]
    else:

        def vectors(rows: slice) -> Tensor:
            return row_cotangents(f[rows], rows)

    k = num_vectors(f.shape[1]) if num_vectors is not None else vectors(slice(0, 1)).shape[1]
    rowwise = row_cotangents is not None and structured is None
    flags = {"structured": structured is not None}
    # the (N, out) sums over K of the squared gradients of the linear layers, reduced once per
    # batch, where holding them costs few more chunks (they pay where chunks are small)
    sums = sum(n * run.acts[i + 1][0].numel() for i in wanted if type(chain[i][1]) is nn.Linear)
    if chunk_size is not None:
        chunk, cols, buffered, whole_rows = chunk_size, k, True, not rowwise
        staged = False  # buffered: the additions deferred and checked
        if rowwise and chunk < n:
            fits = rule_chunk(
                run, model, k, storage, wanted, copies=2, buffers=sums, floor=0, **flags
            )
            whole_rows = fits >= chunk
    else:
        options = {"atomic": atomic, "structured": structured is not None, "checked": checked}
        chunk, cols, buffered, whole_rows, staged = _cached_plan(
            run, model, k, storage, wanted, rowwise, sums, plans=plans, **options
        )
    fold = gradient is not None and k >= 2 and cols >= k and _fold_pays(run, wanted, k, structured)
    if fold and chunk_size is None:  # planned for the K + 1 vectors
        plan = _cached_plan(
            run, model, k + 1, storage, wanted, rowwise, sums, plans=plans, **options
        )
        fold = plan[1] >= k + 1
        if fold:
            chunk, cols, buffered, whole_rows, staged = plan
    if rowwise and (whole_rows or chunk >= n):
        # the vectors of the whole batch fit beside the chunks: form them once
        whole = vectors(slice(0, n))

        def vectors(rows: slice) -> Tensor:
            return whole[rows]

    sink = None
    if gradient is not None and gradient.shared and k == 1 and structured is None:
        assert gradient.view is not None  # the vectors are r: sum what is squared
        sink = _Sink(f.new_empty(0), gradient.view, False, shared=True)
    elif fold:
        assert gradient is not None and gradient.view is not None
        residual = gradient.residual(f)
        if residual.shape != f.shape:
            raise ValueError(f"residual: expected shape {tuple(f.shape)}, got {residual.shape}")
        sink = _Sink(residual.to(f.dtype), gradient.view, structured is not None)
        if structured is None:  # the residual as the last of the chunk's vectors
            plain = vectors

            def vectors(rows: slice) -> Tensor:
                u = plain(rows)
                return torch.cat([u.to(f.dtype), sink.residual[rows].unsqueeze(1)], 1)

        cols = None  # every vector in one pass
    with torch.no_grad():
        if atomic and staged and checked:  # summed apart, added once complete and finite
            views = {name: torch.zeros_like(view(name)) for name in _names(layers)}
            targets = views.__getitem__
            _accumulate_squares(
                run, vectors, layers, wanted, targets, chunk, buffered, cols, False, structured,
                sink,
            )  # fmt: skip
            _add_staged(views, view)
        else:
            checked_adds = atomic and checked  # the buffered sums tested before they are added
            _accumulate_squares(
                run, vectors, layers, wanted, view, chunk, buffered, cols, checked_adds, structured,
                sink,
            )  # fmt: skip
    if gradient is not None and sink is not None:
        for name in _names(layers):
            check_finite(
                sink.view(name),
                f"non-finite gradient of the log-likelihood in parameter {name!r}: the outputs "
                "or the network's Jacobian are NaN/inf for this batch (check x)",
            )
        gradient.added = True
    return f


@dataclass
class _Sink:
    """A pass's :class:`GradientSink`: the batch's residuals r (N, C), the views of the
    gradient and whether the vectors are a structured factor (r then enters after its
    product with the final weight, ``backward_chunk``'s ``extra``)."""

    residual: Tensor
    view: Callable[[str], Tensor]
    structured: bool
    #: the vectors are the residuals (:attr:`GradientSink.shared`)
    shared: bool = False


def _fold_pays(
    run: ChainPass, wanted: dict[int, str], k: int, structured: SqrtFactor | None
) -> bool:
    """Whether J^T r goes into the K-vector passes (:class:`GradientSink`): no wanted
    convolution grouped (the folded products assume one group), and either no convolution at
    all or a first one whose pass stops at the pooling after it (:func:`_stop_at_pooling`,
    its gradient then from the maxima). Elsewhere the extra vector costs a dense per-sample
    reduction and an adjoint per layer, more than the gradient's own forward and backward
    pass: measured at 2 threads (benchmarks/laplace_fit_gradient.py), folded / own pass 0.97
    / 0.81 x the time on the MLP at batch 256 / 32 and 0.88 x on the MNIST CNN (first
    convolution pooled), but 1.09 / 1.08 x on the 8 x 8 CNN whose first convolution is not."""
    convs = [i for i in wanted if type(run.chain[i][1]) is nn.Conv2d]
    if any(getattr(run.chain[i][1], "groups", 1) != 1 for i in convs):
        return False
    if not convs:
        return True
    return min(wanted) in convs and _stop_at_pooling(run, wanted, k + 1, structured) is not None


#: a chunk plan of :func:`_cached_plan`
_Plan = tuple[int, int, bool, bool, bool]


def _cached_plan(
    run: ChainPass,
    model: nn.Module,
    k: int,
    storage: int,
    wanted: dict[int, str],
    rowwise: bool,
    sums: int,
    atomic: bool,
    structured: bool,
    plans: dict[Any, Any] | None,
    checked: bool = True,
) -> _Plan:
    """(samples per chunk, vectors per pass, linear sums buffered, output vectors formed for
    the whole batch, batch summed apart first) of :func:`_plan` (with ``atomic``: the
    cheaper of the batch summed apart and the deferred, buffered additions), computed once
    per setting in ``plans`` (the caller's table, e.g. a curvature's for its fit; None:
    not kept): the plan depends only on the modules, the shapes, dtypes and device of the
    pass's activations and the arguments, not on the values, so the batches of a fit (all
    but a last, smaller one) share it instead of re-running the memory rule's Python loops
    over the modules per batch. Unchecked (a fit's deferred checks: the batch is added to
    the curvature directly, no batch temporary and nothing summed apart) the pass holds one
    storage-sized tensor, the curvature's own: ``copies=1``, any plan."""
    key = (
        tuple(id(m) for _, m in run.chain),
        tuple((tuple(a.shape), a.dtype, a.device) for a in run.acts),
        k,
        storage,
        tuple(sorted(wanted.items())),
        rowwise,
        sums,
        atomic,
        structured,
        checked,
    )
    if plans is None:
        plans = {}
    if key in plans:
        return plans[key]
    if len(plans) > 32:  # e.g. many batch sizes: keep the table small
        plans.clear()
    flags = {"structured": structured}
    if not checked:  # added directly: no batch temporary (copies=1), nothing staged
        plans[key] = (*_plan(run, model, k, storage, wanted, rowwise, sums, 1, **flags)[1], False)
        return plans[key]
    cost, plan = _plan(run, model, k, storage, wanted, rowwise, sums, **flags)
    staged = False
    if atomic:
        # no batch temporary, the sums deferred to the end of the batch (buffered), where
        # that is cheaper than summing the batch apart (the batch's temporary: copies=2)
        deferred = _plan(run, model, k, storage, wanted, rowwise, sums, 1, True, **flags)
        staged = deferred[0] > cost
        plan = plan if staged else deferred[1]
    plans[key] = (*plan, staged)
    return plans[key]


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
    structured: bool = False,
) -> tuple[float, tuple[int, int, bool, bool]]:
    """(cost, (samples per chunk, vectors per pass, linear sums buffered per batch, output
    vectors formed for the whole batch)) for :func:`chain_squared_sums` under the memory
    rule: of the
    settings whose chunks hold at least one sample, the one with the fewest tensor operations
    by the cost model above (more, smaller chunks cost their fixed overheads; the vectors
    formed once or the buffers take budget from the chunks); where none does, one sample
    per chunk and groups of vectors (:func:`rule_columns`). ``copies``: storage-sized tensors
    held (2 with the diagonal's batch temporary); ``buffered_only``: the linear sums always
    buffered (deferred to the end of the batch); ``structured``: the vectors are a
    structured factor (:func:`gaussify.curvature.batched_backward.rule_chunk`)."""
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
                structured=structured,
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
        run,
        model,
        k,
        storage,
        wanted,
        rowwise=rowwise,
        copies=copies,
        buffers=buffers,
        structured=structured,
    )
    per_chunk = passes * _COST_MODULE + others * _COST_PLAIN + linear * _COST_PLAIN
    return n * -(-k // cols) * per_chunk + n * _COST_VECTORS, (1, cols, buffered_only, False)


def _accumulate_squares(
    run: ChainPass,
    vectors: Callable[[slice], Tensor | SqrtFactor],
    layers: dict[str, list[str]],
    wanted: dict[int, str],
    view: Callable[[str], Tensor],
    chunk: int,
    buffered: bool,
    cols: int | None = None,
    atomic: bool = False,
    structured: SqrtFactor | None = None,
    sink: _Sink | None = None,
) -> None:
    """The chunked backward passes of :func:`chain_squared_sums` and their squared sums, in
    groups of ``cols`` output vectors (all K if None; the sums over K add up over groups).
    ``structured``: the batch's vectors as a structured factor entering the chain's final
    ``nn.Linear``, whose sums over K, sum_k u_{n,k,c}^2 (O(N C), no backward pass), are
    formed once for the batch (one reduction instead of one per chunk and group).

    A linear layer's sums over K of the squared gradients, s_n = sum_k delta_{k,n}^2, give
    s^T (a^2) for the weight and sum_n s_n for the bias, per chunk, or with ``buffered`` written
    per chunk into an (N, out) buffer and reduced once per batch (two products per chunk
    instead of eight). ``sink``: the last vector of each pass is the residual, whose
    gradients are summed into the sink's views (not squared)."""
    f = run.output
    n = f.shape[0]
    # module position -> {"weight" / "bias": the view of ``out`` holding it}, once
    targets: dict[int, dict[str, Tensor]] = {}
    grads: dict[int, dict[str, Tensor]] = {}
    for i, name in wanted.items():
        prefix = f"{name}." if name else ""
        targets[i] = {kind: view(f"{prefix}{kind}") for kind in layers[name]}
        if sink is not None:
            grads[i] = {kind: sink.view(f"{prefix}{kind}") for kind in layers[name]}
    linear = {i for i in wanted if type(run.chain[i][1]) is nn.Linear}
    pooled: dict[int, int] | None = None  # the convolutions reduced from the pooling's maxima
    stop: int | None = None  # the pooling where the passes stop (:func:`_stop_at_pooling`)
    last = len(run.chain) - 1
    once = structured is not None and last in linear
    if once:  # the chunks' passes below skip it (they start at the product with W)
        linear.discard(last)
    squares = {i: f.new_empty(n, run.acts[i + 1].shape[1]) for i in linear} if buffered else {}
    if once:
        assert structured is not None
        final = structured.squared_sums()
        if buffered:
            squares[last] = final
        else:
            _add_linear_squares(targets[last], final, run.acts[last])
        del final
        if sink is not None and not sink.shared:  # the final layer's gradient, once
            add_layer_gradient(run.chain[last][1], sink.residual, run.acts[last], grads[last])
    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        whole = vectors(rows)
        if whole.dtype != f.dtype:
            whole = whole.to(f.dtype)
        step = cols or whole.shape[1]
        if pooled is None:
            cols_now = min(step, whole.shape[1]) + (1 if sink and sink.structured else 0)
            stop = (
                None
                if sink and sink.shared
                else _stop_at_pooling(run, wanted, cols_now, structured)
            )
            pooled = _pooled_convs(run, wanted, cols_now, structured, skip=min(wanted), now=stop)

        for c0 in range(0, whole.shape[1], step):
            ut = whole if step >= whole.shape[1] else _columns(whole, c0, c0 + step)
            first = c0 == 0
            extra = sink.residual[rows].unsqueeze(1) if sink and sink.structured else None
            _reduce_chunk(
                run, ut, rows, wanted, targets, linear, squares, buffered, first, pooled, stop,
                extra, grads if sink else None, bool(sink and sink.shared),
            )  # fmt: skip
            del ut  # the chunk's K-fold tensors, before the per-batch reductions
        del whole
    if atomic:
        _add_checked(run, squares, targets, wanted)
        return
    for i, sq in squares.items():
        _add_linear_squares(targets[i], sq, run.acts[i])


def _stop_at_pooling(
    run: ChainPass, wanted: dict[int, str], k: int, structured: SqrtFactor | None
) -> int | None:
    """The position of the max-pooling where the backward passes stop, if the first wanted
    module is a convolution whose output reaches one through element-wise maps
    (:func:`gaussify.curvature.pooled_conv.pooling_after`) and the reduction at its maxima
    holds no more per sample than the chain's backward pass at K vectors (what the memory
    rule sized the chunks by); else None. Its squares then come from the maxima
    (:func:`gaussify.curvature.pooled_conv.maxima_gradient`): no dense K-fold gradient of
    the convolution's output, at most the dense products' count of multiply-adds."""
    i = min(wanted)
    j = pooling_after(run, i)
    if j is None:
        return None
    peak = backward_peak(run, k, set(wanted), structured is not None)
    return j if maxima_peak(run, i, j, k) <= peak else None


def _pooled_convs(
    run: ChainPass,
    wanted: dict[int, str],
    k: int,
    structured: SqrtFactor | None,
    skip: int | None = None,
    now: int | None = None,
) -> dict[int, int]:
    """{convolution position: max-pooling position} for the wanted convolutions whose squared
    sums come from the pooling's maxima (:mod:`gaussify.curvature.pooled_conv`) with K > 1
    vectors per pass: where the product count pays and the memory is within the chain's
    per-sample peak at K vectors (what the memory rule sized the chunks by), so the pass's
    peak does not grow. The convolution at ``skip`` is left out where the passes stop at
    its pooling (``now`` not None, :func:`_stop_at_pooling`)."""
    out: dict[int, int] = {}
    if k < 2:
        return out
    peak = None
    for i in wanted:
        if i == skip and now is not None:
            continue
        j = pooling_after(run, i)
        if j is None or not pooled_pays(run, i, j, k):
            continue
        if peak is None:
            peak = backward_peak(run, k, set(wanted), structured is not None)
        if pooled_peak(run, i, j, k) <= peak:
            out[i] = j
    return out


def _columns(u: Tensor | SqrtFactor, lo: int, hi: int) -> Tensor | SqrtFactor:
    """The output vectors k in [lo, hi) of ``u`` (B, K, C)."""
    return u.columns(lo, hi) if isinstance(u, SqrtFactor) else u[:, lo:hi]


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
    ut: Tensor | SqrtFactor,
    rows: slice,
    wanted: dict[int, str],
    targets: dict[int, dict[str, Tensor]],
    linear: set[int],
    squares: dict[int, Tensor],
    buffered: bool,
    first: bool = True,
    pooled: dict[int, int] | None = None,
    stop: int | None = None,
    extra: Tensor | None = None,
    grads: dict[int, dict[str, Tensor]] | None = None,
    shared: bool = False,
) -> None:
    """One batched backward pass of the vectors ``ut`` (B, K', C) of the samples ``rows`` and
    its squared sums into ``targets`` (or, ``buffered``, a linear layer's rows of
    ``squares``, written by the ``first`` group of vectors and added to by the others).
    ``pooled``: convolution position -> position of the max-pooling whose maxima give its
    squared sums (:func:`_pooled_convs`); ``stop``: the max-pooling where the pass stops, the
    first wanted convolution's squares taken from its maxima (:func:`_stop_at_pooling`).
    ``grads``: the last vector is the residual (after a structured ``ut``'s: ``extra``), its
    summed gradients added to these views (a convolution's from the patches its squares
    use); with ``shared`` the one vector is the residual itself, summed as it is squared."""
    for i, d in backward_chunk(run, ut, list(wanted), rows, stop, extra):
        if isinstance(d, SqrtFactor):  # the final linear layer: summed once per batch
            continue
        if stop is not None and i == min(wanted):
            _add_maxima_squares(run, i, stop, d, rows, targets[i], grads and grads[i])
            continue
        r = None
        if grads is not None and shared:  # the one vector is the residual
            if i in linear:
                add_layer_gradient(run.chain[i][1], d[:, 0], run.acts[i][rows], grads[i])
        elif grads is not None:  # the residual's gradient, then the K vectors' squares
            d, r = d[:, :-1], d[:, -1]
            if i in linear:
                add_layer_gradient(run.chain[i][1], r, run.acts[i][rows], grads[i])
        if i in linear:
            if buffered and first and d.shape[1] == 1:  # one vector: its square, one product
                torch.mul(d[:, 0], d[:, 0], out=squares[i][rows])
            elif buffered and first:
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
            if d.shape[1] == 1 and r is None:  # one vector: as a grouped conv's gradients
                summed = grads[i]["weight"] if grads is not None and shared else None
                sums = _single_vector_squared_grads(module, a, d, summed)
            else:
                patches = conv2d_patches(module, a)
                if pooled and i in pooled:  # from the maxima of the pooling after it
                    idx = run.indices[pooled[i]][rows]
                    sums = pooled_squared_grads(patches, d, idx)
                else:
                    sums = _conv_squared_grads(module, patches, d)
                if r is not None and grads is not None:  # ungrouped: one contraction
                    gw = grads[i]["weight"]
                    summed = torch.einsum("bot,bft->of", r.flatten(2), patches)
                    gw.view(module.out_channels, -1).add_(summed.to(gw.dtype))
                # freed before the pass goes on: the next module's product allocates
                # (:func:`gaussify.curvature.batched_backward.backward_peak` counts them
                # apart)
                del patches
            w.view(module.out_channels, -1).add_(sums.to(w.dtype))
            del sums
        if "bias" in views:
            b = views["bias"]
            per = d.sum((-2, -1))
            b.add_((per * per).sum((0, 1)).to(b.dtype))
            if grads is not None and (r is not None or shared):
                one = d[:, 0] if shared else r
                assert one is not None
                grads[i]["bias"].add_(one.sum((0, 2, 3)).to(grads[i]["bias"].dtype))


def _add_maxima_squares(
    run: ChainPass,
    i: int,
    j: int,
    g: Tensor,
    rows: slice,
    views: dict[str, Tensor],
    grads: dict[str, Tensor] | None = None,
) -> None:
    """Add the squared sums of the convolution at i from the gradient g (B, K, O, H', W') of
    the max-pooling's output at j (:func:`gaussify.curvature.pooled_conv.maxima_gradient`):
    the weight's from the gathered patches (:func:`gaussify.curvature.pooled_conv.
    squares_at_maxima`), the bias's from the sums of the gradients at the maxima. ``grads``:
    the last vector is the residual, its summed gradient added there."""
    module = run.chain[i][1]
    assert isinstance(module, nn.Conv2d)
    h = maxima_gradient(run, i, j, g, rows)  # (B, K, O, W)
    r = None
    if grads is not None:
        h, r = h[:, :-1], h[:, -1]
    if "weight" in views:
        w = views["weight"]
        patches = conv2d_patches(module, run.acts[i][rows])
        gathered = gathered_patches(patches, run.indices[j][rows].flatten(-2))
        del patches
        sums = squares_at_maxima(gathered, h)
        w.view(module.out_channels, -1).add_(sums.to(w.dtype))
        if grads is not None and r is not None:
            gw = grads["weight"]
            gw.view(module.out_channels, -1).add_(gradient_at_maxima(gathered, r).to(gw.dtype))
    if "bias" in views:
        b = views["bias"]
        per = h.sum(-1)
        b.add_((per * per).sum((0, 1)).to(b.dtype))
        if grads is not None and r is not None:
            grads["bias"].add_(r.sum((0, 2)).to(grads["bias"].dtype))


def _add_linear_squares(views: dict[str, Tensor], sq: Tensor, a: Tensor) -> None:
    """Add s^T (a^2) to a linear layer's weight view and sum_n s_n to its bias view, for
    s (B, out) the per-sample sums over K of the squared output gradients, a (B, in)."""
    if "weight" in views:
        w = views["weight"]
        if sq.dtype != w.dtype or a.dtype != w.dtype:
            sq, a = sq.to(w.dtype), a.to(w.dtype)
        w.addmm_(sq.T, a * a)
    if "bias" in views:
        b = views["bias"]
        b.add_(sq.sum(0) if sq.dtype == b.dtype else sq.sum(0).to(b.dtype))
