"""A convolution's squared per-sample weight gradients from the maxima of the max-pooling after
it (the diagonal GGN of a conv -> activation -> max-pool block with many output vectors).

For a ``nn.Conv2d`` whose output reaches a ``nn.MaxPool2d`` with disjoint windows through
element-wise maps only (activations, eval-mode dropout and BatchNorm), the gradient delta_k
(K vectors, O output channels, T locations) of the convolution's output is non-zero only at
the W <= T / (window size) positions idx(o, w) of the maxima (the pooling's backward pass
scatters each window's gradient to its maximum; the maps after it multiply element-wise).
The per-sample weight gradient sum_t delta_{k,o,t} a_t (a_t: the im2col patch of location
t, F numbers) is then sum_w h_{k,o,w} P_{o,w} with h the gradients at the maxima and
P_{o,w} = a_{idx(o,w)}, and its square summed over the K vectors is

    sum_k G_k[o, f]^2 = sum_{w, w'} M_o[w, w'] P_{o,w,f} P_{o,w',f},
    M_o = sum_k h_{k,o} h_{k,o}^T  (W x W),

O W^2 (K + F) multiply-adds per sample instead of the dense products' K O T F, and no K-fold
weight gradients (its memory: the gathered patches and M P, 2 O W F, and M, O W^2; it is used
only where that is within the chain's per-sample peak under the memory rule, so the rule's
chunks do not change, and where the count pays: measured 1.6 x faster than the dense
products per chunk at K = 55 (16 -> 16 channels, 8 x 8, 2 x 2 pooling), 3 x slower at K = 9,
``benchmarks/conv_diag_split.py``).
"""

from __future__ import annotations

from torch import Tensor, nn

from gaussify.curvature.batched_backward import _ELEMENTWISE, ChainPass

__all__ = ["pooled_pays", "pooled_peak", "pooled_squared_grads", "pooling_after"]

#: shape-preserving element-wise maps allowed between the convolution and the pooling (a zero
#: gradient stays zero through them)
_POINTWISE = (*_ELEMENTWISE, nn.Identity, nn.Dropout, nn.Dropout2d, nn.BatchNorm2d)

#: the dense products' multiply-adds must exceed the pooled ones' this many times (the
#: gathers and small batched products cost more per multiply-add)
PAYS = 8


def pooling_after(run: ChainPass, i: int) -> int | None:
    """Position of the ``nn.MaxPool2d`` reached from the ungrouped ``nn.Conv2d`` at i through
    element-wise maps only, if its windows are disjoint (stride >= the window's extent in
    both dimensions, so each position is the maximum of at most one window); else None."""
    conv = run.chain[i][1]
    if type(conv) is not nn.Conv2d or conv.groups != 1:
        return None
    j = i + 1
    while j < len(run.chain) and type(run.chain[j][1]) in _POINTWISE:
        j += 1
    if j >= len(run.chain) or type(run.chain[j][1]) is not nn.MaxPool2d or j not in run.indices:
        return None
    pool = run.chain[j][1]
    assert isinstance(pool, nn.MaxPool2d)
    kernel, stride, dilation = (_pair(v) for v in (pool.kernel_size, pool.stride, pool.dilation))
    disjoint = all(stride[d] >= dilation[d] * (kernel[d] - 1) + 1 for d in (0, 1))
    return j if disjoint else None


def _pair(v: int | tuple[int, ...]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (v[0], v[-1])


def pooled_peak(run: ChainPass, i: int, j: int, k: int) -> int:
    """Elements per sample alive in :func:`pooled_squared_grads` for K vectors: the gradient
    (K O T) and the patches (F T) it is given, the gradients at the maxima (K O W), the
    gathered patches and their product with M (2 O W F) and M (O W^2)."""
    conv = run.chain[i][1]
    assert isinstance(conv, nn.Conv2d)
    out, w = run.acts[i + 1][0].numel(), run.indices[j][0].numel()
    t = out // conv.out_channels
    per = w // conv.out_channels
    f = conv.weight[0].numel()
    return k * out + f * t + k * w + 2 * w * f + w * per


def pooled_pays(run: ChainPass, i: int, j: int, k: int) -> bool:
    """Whether the pooled products' count (O W^2 (K + F)) is at most 1 / :data:`PAYS` of the
    dense ones' (K O T F)."""
    conv = run.chain[i][1]
    assert isinstance(conv, nn.Conv2d)
    t = run.acts[i + 1][0].numel() // conv.out_channels
    per = run.indices[j][0].numel() // conv.out_channels
    f = conv.weight[0].numel()
    return k * t * f >= PAYS * per * per * (k + f)


def pooled_squared_grads(patches: Tensor, d: Tensor, indices: Tensor) -> Tensor:
    """sum_{n,k} (sum_t delta_{k,n,t} a_{n,t}^T)^2, shape (O, F), from the patches (B, F, T),
    the gradient d (B, K, O, H, W) of the convolution's output (zero outside the maxima) and
    the pooling's indices (B, O, H', W') into H W: sum_{w,w'} M[w, w'] P[w] P[w'] per sample
    and channel (module docstring)."""
    b, k, o = d.shape[:3]
    flat = indices.flatten(-2)  # (B, O, W)
    w, f = flat.shape[-1], patches.shape[1]
    h = d.flatten(-2).gather(-1, flat.unsqueeze(1).expand(b, k, o, w))  # (B, K, O, W)
    ht = h.permute(0, 2, 3, 1).reshape(b * o, w, k)
    gram = ht @ ht.transpose(1, 2)  # (B O, W, W)
    del h, ht
    rows = flat.reshape(b, o * w, 1).expand(b, o * w, f)
    gathered = patches.transpose(1, 2).gather(1, rows).view(b * o, w, f)
    q = gram @ gathered
    return q.mul_(gathered).view(b, o, w, f).sum((0, 2))
