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
``benchmarks/conv_diag_split.py``). Where W K F <= W^2 (K + F) (few vectors, many maxima per
channel, as for a first convolution with a 2 x 2 pooling) the K gradients are formed directly
from the gathered patches instead, h_{k,o} P_o, W K F products per sample and channel.

For the first convolution of a pass (nothing below it is propagated) the backward pass can
stop at the pooling's output (:func:`maxima_gradient`): the gradient at the maxima is the
pooling's output gradient times the element-wise maps' derivatives evaluated there, so the
dense (K, O, T) gradient of the convolution's output, its scatter and the maps' full-size
products are never formed.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gaussify.curvature.batched_backward import _ELEMENTWISE, ChainPass, _derivative

__all__ = [
    "gathered_patches",
    "gradient_at_maxima",
    "maxima_gradient",
    "maxima_peak",
    "pooled_pays",
    "pooled_peak",
    "pooled_squared_grads",
    "pooling_after",
    "squares_at_maxima",
]

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
    the pooling's indices (B, O, H', W') into H W (:func:`squares_at_maxima` of the gradients
    gathered at the maxima)."""
    b, k, o = d.shape[:3]
    flat = indices.flatten(-2)  # (B, O, W)
    h = d.flatten(-2).gather(-1, flat.unsqueeze(1).expand(b, k, o, flat.shape[-1]))
    return squares_at_maxima(gathered_patches(patches, flat), h)


def gathered_patches(patches: Tensor, flat: Tensor) -> Tensor:
    """P (B O, W, F): the patches (B, F, T) at the maxima ``flat`` (B, O, W) of each channel."""
    b, o, w = flat.shape
    f = patches.shape[1]
    rows = flat.reshape(b, o * w, 1).expand(b, o * w, f)
    return patches.transpose(1, 2).gather(1, rows).view(b * o, w, f)


def gradient_at_maxima(gathered: Tensor, h: Tensor) -> Tensor:
    """sum_n sum_w h_{n,o,w} P_{n,o,w}, shape (O, F): the summed weight gradient of one vector
    from its gradients h (B, O, W) at the maxima and the gathered patches (B O, W, F)."""
    b, o, w = h.shape
    return torch.bmm(h.reshape(b * o, 1, w), gathered).view(b, o, -1).sum(0)


def squares_at_maxima(gathered: Tensor, h: Tensor) -> Tensor:
    """sum_{n,k} (sum_w h_{k,n,o,w} P_{n,o,w})^2, shape (O, F), from the gradients h
    (B, K, O, W) of the convolution's output at the maxima and the patches there
    (:func:`gathered_patches`, (B O, W, F)): the K gradients formed directly (W K F per
    sample and channel) or through the Gram M_o of the K gradients (W^2 (K + F)), whichever
    is fewer multiply-adds (module docstring)."""
    b, k, o, w = h.shape
    f = gathered.shape[-1]
    if k * f <= w * (k + f):  # the K gradients themselves: (K, W) x (W, F) per (sample, o)
        grads = torch.bmm(h.transpose(1, 2).reshape(b * o, k, w), gathered)
        return grads.mul_(grads).view(b, o, k, f).sum((0, 2))
    ht = h.permute(0, 2, 3, 1).reshape(b * o, w, k)
    gram = ht @ ht.transpose(1, 2)  # (B O, W, W)
    del ht
    q = gram @ gathered
    return q.mul_(gathered).view(b, o, w, f).sum((0, 2))


def maxima_peak(run: ChainPass, i: int, j: int, k: int) -> int:
    """Elements per sample alive in :func:`maxima_gradient` and :func:`squares_at_maxima`
    for K vectors, from the pooling's output gradient on: that gradient and h (2 K W), the
    patches (F T), the gathered patches (W F) and the K gradients (K O F) or the Gram and
    its product (O W'^2 + W F), W' = W / O the maxima per channel."""
    conv = run.chain[i][1]
    assert isinstance(conv, nn.Conv2d)
    w = run.indices[j][0].numel()
    t = run.acts[i + 1][0].numel() // conv.out_channels
    per = w // conv.out_channels
    f = conv.weight[0].numel()
    direct = k * f <= per * (k + f)
    products = k * conv.out_channels * f if direct else w * per + w * f
    return 2 * k * w + f * t + w * f + products


def maxima_gradient(run: ChainPass, i: int, j: int, g: Tensor, rows: slice) -> Tensor:
    """h (B, K, O, W): the gradient of the output of the convolution at i at the maxima of the
    max-pooling at j (:func:`pooling_after`), from g (B, K, O, H', W'), the gradient of the
    pooling's output, for the samples ``rows``: each window's gradient goes to its maximum
    and through the element-wise maps between, whose derivatives are evaluated there only
    (a ReLU's: its output > 0; eval-mode BatchNorm: its per-channel scale)."""
    b, k, o = g.shape[:3]
    flat = run.indices[j][rows].flatten(-2)  # (B, O, W)
    h = g.reshape(b, k, o, flat.shape[-1])
    for p in range(j - 1, i, -1):
        m = run.chain[p][1]
        if isinstance(m, nn.BatchNorm2d):
            assert m.running_var is not None  # eval mode with running statistics
            scale = (m.running_var + m.eps).rsqrt()
            if m.weight is not None:
                scale = scale * m.weight
            h = h * scale.detach().to(h.dtype).view(1, 1, o, 1)
            continue
        if type(m) not in _ELEMENTWISE:  # identity, eval-mode dropout
            continue
        if p in run.masks:  # a ReLU whose output the pass kept as its mask
            h = h * run.masks[p][rows, 0].flatten(-2).gather(-1, flat).unsqueeze(1)
            continue
        out = run.acts[p + 1][rows].flatten(-2).gather(-1, flat)
        if type(m) is nn.ReLU:
            h = h * (out > 0).unsqueeze(1)
            continue
        inp = run.acts[p]  # kept where the derivative reads it (not for tanh / sigmoid)
        a = out if inp.is_meta else inp[rows].flatten(-2).gather(-1, flat)
        h = h * _derivative(m, a, out, h.dtype).unsqueeze(1)
    return h
