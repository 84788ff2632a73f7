"""The Gram sums behind KFAC's Kronecker factors, A = sum a a^T and B = sum g g^T.

A layer's inputs a (im2col patches for a convolution) and the gradients g of the output
vectors with respect to its output, as (N, T, d) with T weight-sharing locations per data
point; :func:`gram` sums their outer products over (n, t) ("expand") or over n after
averaging / summing over t ("reduce", Eschenhagen et al. 2023). For an ``nn.Sequential`` of
supported modules (:mod:`gaussify.curvature.batched_backward`) the forward pass runs without
a graph (:func:`chain_capture`) and the K output vectors reach every layer in one batched
backward pass (:func:`chain_output_grams`) instead of K autograd passes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from gaussify.curvature.batched_backward import (
    ChainPass,
    add_layer_gradient,
    backward_chunk,
    chain_forward,
    module_chain,
    rule_budget,
    rule_chunk,
    rule_columns,
    structured_chain,
)
from gaussify.curvature.conv_gram import conv_input_gram, shift_gram_applies
from gaussify.curvature.patches import conv2d_patches
from gaussify.curvature.sqrt_factor import SqrtFactor

__all__ = [
    "ChainGradient",
    "KFACApprox",
    "augment",
    "chain_capture",
    "chain_input_budget",
    "chain_output_grams",
    "gram",
    "input_gram",
    "layer_inputs",
    "layer_output_grads",
]

KFACApprox = Literal["expand", "reduce"]


def layer_inputs(module: nn.Module, inp: Tensor, name: str = "") -> Tensor:
    """A layer's input as ``(N, T, in)``: T weight-sharing locations per data point."""
    if isinstance(module, nn.Conv2d):
        # im2col patches in the (channel, kh, kw) order of weight.reshape(out, -1)
        return conv2d_patches(module, inp, name).transpose(1, 2)
    if inp.ndim < 2:
        raise ValueError(
            f"kron: Linear expects a batched (N, ..., in) input, got shape {tuple(inp.shape)}"
        )
    return inp.reshape(inp.shape[0], -1, inp.shape[-1])


def layer_output_grads(module: nn.Module, grad: Tensor) -> Tensor:
    """Gradients wrt a layer's pre-activation as ``(N, T, out)``, matching :func:`layer_inputs`."""
    if isinstance(module, nn.Conv2d):
        return grad.flatten(2).transpose(1, 2)
    return grad.reshape(grad.shape[0], -1, grad.shape[-1])


def augment(a: Tensor, use_weight: bool, use_bias: bool) -> Tensor:
    """The block input ``(N, T, d)``: ``a`` if the weight is in the block, then 1 for the bias."""
    parts = []
    if use_weight:
        parts.append(a)
    if use_bias:
        parts.append(a.new_ones(*a.shape[:-1], 1))
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


def gram(
    x: Tensor, approx: KFACApprox, reduce_op: Literal["mean", "sum"], out: Tensor | None = None
) -> Tensor:
    """``sum x x^T`` over samples of ``x (N, T, k)``: over (n, t) for expand; for reduce over n
    after averaging (inputs) or summing (output gradients) over t (Eschenhagen et al. 2023).
    With ``out`` (k, k) the sum is added to it in place (no k x k temporary). A convolution's
    output gradients arrive as the transposed view of their (N, k, T) layout: with k <= T
    their per-sample Grams are batched instead ((N, k, k), no (N T, k) copy of the view;
    measured 1.6-2.5 x faster for 16-32 channels at 16-256 locations)."""
    if approx == "expand":
        xt = x.transpose(1, 2)
        batched = out is not None and x.dtype == out.dtype and x.shape[-1] <= x.shape[1]
        if batched and xt.is_contiguous():
            assert out is not None
            return out.add_(torch.bmm(xt, x).sum(0))
        x2 = x.reshape(-1, x.shape[-1])
    else:
        x2 = x.mean(1) if reduce_op == "mean" else x.sum(1)
    if out is None:
        return x2.mT @ x2
    return out.addmm_(x2.mT.to(out.dtype), x2.to(out.dtype))


def chain_capture(
    model: nn.Module, paths: list[str], x: Tensor
) -> tuple[ChainPass, dict[str, list[tuple[Tensor, Tensor]]]] | None:
    """(the forward pass without a graph, {path: [(input, output)]}) when ``model`` is a
    supported chain containing the modules ``paths``, else None (the caller then runs its
    forward pass with hooks and one autograd pass per output vector)."""
    chain = module_chain(model)
    if chain is None:
        return None
    names = [n for n, _ in chain]
    if not set(paths) <= set(names):
        return None
    run = chain_forward(chain, x)
    captured = {}
    for path in paths:
        i = run.position(path)
        captured[path] = [(run.acts[i], run.acts[i + 1])]
    return run, captured


def chain_output_grams(
    model: nn.Module,
    run: ChainPass,
    paths: list[str],
    vecs: Tensor | Callable[[slice], Tensor] | SqrtFactor,
    approx: KFACApprox,
    out: dict[str, Tensor],
    chunk_size: int | None,
    storage: int,
    gradient: ChainGradient | None = None,
) -> bool:
    """Add sum_{k,n} g g^T of the output vectors ``vecs`` (K, N, C), or ``vecs(rows)`` (K, B, C)
    formed per chunk of samples, backpropagated to the
    outputs of the modules ``paths`` into ``out[path]``, with one K-batched backward pass
    per chunk of samples (``chunk_size``, else the memory rule of
    :func:`gaussify.curvature.batched_backward.rule_chunk`). ``vecs`` may be a structured
    factor of the whole batch (:class:`gaussify.curvature.sqrt_factor.SqrtFactor`, for a
    chain ending with an ``nn.Linear`` not among ``paths``: the exact GGN's C vectors in
    2 C numbers per sample, their product with the final weight in O(C d)).

    ``gradient``: J^T r of these modules' parameters summed into its views from the same
    passes (:class:`ChainGradient`: r as one more vector, or the one vector itself); returns
    whether it was (not where the K vectors must be split into groups)."""
    n = run.output.shape[0]
    wanted = {run.position(p): p for p in paths}
    structured = isinstance(vecs, SqrtFactor)
    if structured and (not structured_chain(run) or len(run.chain) - 1 in wanted):
        vecs = vecs.dense().transpose(0, 1)  # not a final linear layer's input: dense
        structured = False
    rowwise = callable(vecs)
    if isinstance(vecs, SqrtFactor):
        k = vecs.num_vectors
    else:
        k = vecs(slice(0, 1)).shape[0] if callable(vecs) else vecs.shape[0]
    flags = {"structured": structured}
    extra = int(gradient is not None and gradient.residual is not None)
    chunk = chunk_size or rule_chunk(
        run, model, k + extra, storage, rowwise=rowwise, floor=0, **flags
    )
    if gradient is not None and chunk == 0:  # groups of vectors: the gradient is not folded
        gradient, extra = None, 0
        chunk = rule_chunk(run, model, k, storage, rowwise=rowwise, floor=0, **flags)
    cols = k
    if chunk == 0:  # one sample with all K vectors exceeds the rule: groups of K' vectors
        chunk, cols = 1, rule_columns(run, model, k, storage, rowwise=rowwise, **flags)
    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        for c0 in range(0, k, cols):
            u = _vectors(vecs, rows, c0, min(c0 + cols, k), k).to(run.output.dtype)
            r = None
            if gradient is not None and gradient.residual is not None:
                r = gradient.residual[rows].unsqueeze(1).to(run.output.dtype)
                u = u if isinstance(u, SqrtFactor) else torch.cat([u, r], 1)
            tail = r if isinstance(u, SqrtFactor) else None  # after the factor's product
            for i, d in backward_chunk(run, u, list(wanted), rows, extra=tail):
                assert isinstance(d, Tensor)
                module = run.chain[i][1]
                dk = d[:, :k] if extra else d
                g = layer_output_grads(module, dk.reshape(-1, *d.shape[2:]))
                gram(g, approx, "sum", out=out[wanted[i]])
                if gradient is not None:  # r's own column, or the one vector r itself
                    own = d[:, k] if extra else d[:, 0]
                    add_layer_gradient(module, own, run.acts[i][rows], gradient.views[i])
            del u
    return gradient is not None


@dataclass
class ChainGradient:
    """J^T r of the log-likelihood (``Laplace.fit``'s gradient) summed into KFAC's batched
    backward passes (:func:`chain_output_grams`): ``residual`` r (N, C), propagated as one
    more vector after the K, or None where the one vector is r itself (the empirical Fisher);
    ``views``: chain position -> {"weight": view, "bias": view} of the flat gradient."""

    residual: Tensor | None
    views: dict[int, dict[str, Tensor]]


def _vectors(
    vecs: Tensor | Callable[[slice], Tensor] | SqrtFactor, rows: slice, lo: int, hi: int, k: int
) -> Tensor | SqrtFactor:
    """The output vectors k in [lo, hi) of the samples ``rows`` as (B, K', C) (or a
    structured factor)."""
    if isinstance(vecs, SqrtFactor):
        part = vecs.rows(rows)
        return part if hi - lo >= k else part.columns(lo, hi)
    part = vecs(rows) if callable(vecs) else vecs[:, rows]
    return (part if hi - lo >= k else part[lo:hi]).transpose(0, 1)


def chain_input_budget(model: nn.Module, run: ChainPass, storage: int) -> int:
    """Elements the input factors' im2col patches may take under the memory rule
    (:func:`gaussify.curvature.batched_backward.rule_chunk`) once the backward pass is done:
    2 (a training step's peak + ``storage``) with its margin, less the activations and the
    storage."""
    return rule_budget(run, model, 0, storage)


def input_gram(
    module: nn.Module,
    inp: Tensor,
    block: tuple[str, bool, bool],
    approx: KFACApprox,
    out: Tensor,
    budget: int | None = None,
) -> int:
    """Add A = sum [a, 1] [a, 1]^T of a layer's input ``inp`` (N, ...) into ``out`` and return
    the number of terms M it adds (N T for "expand", N for "reduce"). ``block``: (module path,
    weight in the block, bias in the block). Chunks of samples keep the block inputs (a
    convolution's im2col patches are about kh kw times its input; 3 copies of them are alive
    at once, measured) within ``budget`` elements (the memory rule's,
    :func:`chain_input_budget`), else near the input's size. A stride-1 convolution's
    "expand" factor comes from shifted products instead of its patches where that is
    cheaper (:mod:`gaussify.curvature.conv_gram`)."""
    path, use_weight, use_bias = block
    if approx == "expand" and shift_gram_applies(module, inp):
        assert isinstance(module, nn.Conv2d)
        return conv_input_gram(module, inp, use_weight, use_bias, out, budget)
    n = inp.shape[0]
    per_sample = layer_inputs(module, inp[:1], path).numel() + 1
    if budget is None:
        rows = max(1, min(n, inp.numel() // per_sample))
    else:  # measured: 3 copies of the patches per sample (unfold's, [a, 1], one more)
        rows = max(1, min(n, budget // (3 * per_sample)))
    count = 0
    for start in range(0, n, rows):
        a = augment(layer_inputs(module, inp[start : start + rows], path), use_weight, use_bias)
        gram(a, approx, "mean", out=out)
        count += a.shape[0] * (a.shape[1] if approx == "expand" else 1)
    return count
