"""KFAC's input factor of a stride-1 convolution from shifted products, not im2col patches.

The "expand" input factor of an ``nn.Conv2d`` is A = sum_{n,t} a_{n,t} a_{n,t}^T over the
im2col patches a_{n,t} (C_in kh kw entries, :func:`gaussify.curvature.patches.
conv2d_patches`): as one product, N T d^2 multiply-adds for d = C_in kh kw. With stride 1
the patch of output location t at kernel offset o = (i, j) reads the input at u = t + o D - p
(dilation D, zero padding p), so the entry of offsets o1, o2 and channels c1, c2 is

    A[(c1, o1), (c2, o2)] = sum_n sum_{u in R(o1)} x_n[c1, u] x_n[c2, u + (o2 - o1) D],

R(o1) = {u : u - o1 D + p in the output grid}, a rectangle of the input grid (x is zero
outside it). It depends on o2 only through the shift Delta = o2 - o1, one of
(2 kh - 1)(2 kw - 1). So: P[u, c1, (c2, Delta)] = sum_n x_n[c1, u] x_n[c2, u + Delta D] (one
batched product over the input locations u, N H W C^2 (2 kh - 1)(2 kw - 1) multiply-adds:
3.2 x fewer than the patches' product for a 3 x 3 "same" convolution), then the sums over the
rectangles Q[o1] = sum_{u in R(o1)} P[u] (a product with the rectangles' 0/1 indicators) and
A's blocks read off Q. The bias entries are the rectangles' sums of x and N T. Exact (the
same sums, reordered); chunks of samples and of input locations keep the shifted copies and P
within a budget.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["conv_input_gram", "shift_gram_applies"]

#: multiply-adds of the patches' product below which the shifted route's fixed cost (about
#: ten tensor operations per chunk) does not pay (measured: a 1-channel 3 x 3 layer on 8 x 8
#: inputs is faster through the patches at any batch)
MIN_MACS = 2_000_000


def _out_size(conv: nn.Conv2d, h: int, w: int) -> tuple[int, int]:
    (kh, kw), (dh, dw), (ph, pw) = conv.kernel_size, conv.dilation, conv.padding
    return h + 2 * ph - dh * (kh - 1), w + 2 * pw - dw * (kw - 1)


def shift_gram_applies(conv: nn.Module, inp: Tensor) -> bool:
    """Whether :func:`conv_input_gram` computes this layer's factor (a plain ``nn.Conv2d``
    with stride 1, one group, numeric zero padding, a batched 4-D input) and is expected
    to be faster than the patches' product (at least :data:`MIN_MACS` multiply-adds there
    and a 3.2-fold saving or more by the counts in the module docstring)."""
    if type(conv) is not nn.Conv2d or inp.ndim != 4 or conv.groups != 1:
        return False
    if conv.stride != (1, 1) or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return False
    n, c, h, w = inp.shape
    h_out, w_out = _out_size(conv, h, w)
    if h_out < 1 or w_out < 1:
        return False
    (kh, kw), dw = conv.kernel_size, conv.dilation[1]
    d = c * kh * kw
    old = n * h_out * w_out * d * d
    # the shifts Delta >= 0, over the grid's rows with their padding columns
    new = n * h * (w + (kw - 1) * dw) * c * c * ((2 * kh - 1) * (2 * kw - 1) + 1) // 2
    return old >= MIN_MACS and 2 * new <= old


def conv_input_gram(
    conv: nn.Conv2d,
    x: Tensor,
    use_weight: bool,
    use_bias: bool,
    out: Tensor,
    budget: int | None = None,
) -> int:
    """Add A = sum_{n,t} [a_{n,t}, 1][a_{n,t}, 1]^T ("expand"; the weight's entries if
    ``use_weight``, then the bias's 1 if ``use_bias``) of the input ``x`` (N, C, H, W) of a
    stride-1 convolution into ``out`` and return the number of terms N T, in ``out``'s dtype,
    from shifted products (module docstring).

    The input is laid out once per chunk of samples as (location, C, N) and (location, N, C)
    copies of x padded with (kw - 1) D_w zero columns after each row and (kh - 1) D_h zero
    rows below, flattened over the locations: a shift Delta (rows a, columns b) is then the
    flat offset a W' + b (W' = W + (kw - 1) D_w) and its products for all locations are one
    batched product of two contiguous slices (the padding's zeros stand for the outside of
    the grid). Only the shifts Delta >= 0 (row-major) are formed; A's blocks of -Delta are
    the transposed ones (A is symmetric). ``budget`` (elements) bounds the two copies of a
    chunk of samples (None: the input's size)."""
    n, c, h, w = x.shape
    (kh, kw), (dh, dw), (ph, pw) = conv.kernel_size, conv.dilation, conv.padding
    h_out, w_out = _out_size(conv, h, w)
    count = n * h_out * w_out
    k2, shifts = kh * kw, (2 * kh - 1) * (2 * kw - 1)
    d = c * k2
    if not use_weight:
        out[-1, -1] += count
        return count
    ah, aw = (kh - 1) * dh, (kw - 1) * dw
    # one more zero row where the last shift (ah, aw) runs aw locations past the rows
    pitch, rows = w + aw, h + ah + (1 if aw else 0)
    locs = h * pitch  # the flat locations of the grid's rows (with their padding columns)
    geometry = (h, w, kh, kw, dh, dw, ph, pw)
    rect, src_o, src_d, direct = _layout(geometry, out.dtype, out.device)
    center = (kh - 1) * (2 * kw - 1) + (kw - 1)  # the index of Delta = 0
    offsets = [
        (k, (k // (2 * kw - 1) - (kh - 1)) * dh * pitch + (k % (2 * kw - 1) - (kw - 1)) * dw)
        for k in range(center, shifts)
    ]
    per_sample = 2 * c * rows * pitch + c * h * w
    budget = x.numel() if budget is None else budget
    step = max(1, min(n, budget // per_sample))
    q = out.new_zeros(k2, shifts, c * c)  # Q[o1, Delta, (c1, c2)]
    for s0 in range(0, n, step):
        xs = F.pad(x[s0 : s0 + step].to(out.dtype), (0, aw, 0, rows - h))  # (n, C, rows, W')
        # (loc, C, n) and (loc, n, C) copies (contiguous: bmm's fast path)
        left = xs.permute(2, 3, 1, 0).contiguous().view(rows * pitch, c, -1)
        right = xs.permute(2, 3, 0, 1).contiguous().view(rows * pitch, -1, c)
        del xs
        lhs = left[:locs]
        for k, off in offsets:
            prod = torch.bmm(lhs, right[off : off + locs])  # (loc, C1, C2)
            q[:, k].addmm_(rect, prod.view(locs, c * c))
        del left, right, lhs
    # A's blocks: [(c1, o1), (c2, o2)] = Q[o1, o2 - o1, c1, c2] for o2 - o1 >= 0, else the
    # transpose of the block (o2, o1)
    qv = q.view(k2, shifts, c, c)
    blocks = qv[src_o, src_d]  # (k2, k2, C, C)
    blocks = torch.where(direct[:, :, None, None], blocks, blocks.transpose(-1, -2))
    out[:d, :d] += blocks.permute(2, 0, 3, 1).reshape(d, d)
    if use_bias:
        grid = rect.view(k2, h, pitch)[:, :, :w].reshape(k2, h * w)
        sums = grid @ x.to(out.dtype).sum(0).reshape(c, h * w).T  # (k2, C): over R(o1)
        edge = sums.T.reshape(d)
        out[:d, d] += edge
        out[d, :d] += edge
        out[d, d] += count
    return count


@functools.lru_cache(maxsize=64)
def _layout(
    geometry: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per layer geometry (H, W, kh, kw, D_h, D_w, p_h, p_w), once: rect (k2, H W') with
    rect[o1, u] = 1 where the flat location u lies in R(o1) (0 at the padding columns), and
    for every pair of offsets (o1, o2) the source of its block in Q: the offset, the shift's
    index and whether it is Q's block itself (o2 - o1 >= 0) or the transpose of the block
    (o2, o1) (:func:`conv_input_gram`). Small (k2 H W' + 3 k2^2 numbers)."""
    h, w, kh, kw, dh, dw, ph, pw = geometry
    h_out, w_out = h + 2 * ph - dh * (kh - 1), w + 2 * pw - dw * (kw - 1)
    r_ind = _indicator(h, kh, dh, ph, h_out, dtype, device)  # (kh, H)
    c_ind = F.pad(_indicator(w, kw, dw, pw, w_out, dtype, device), (0, (kw - 1) * dw))
    rect = (r_ind[:, None, :, None] * c_ind[None, :, None, :]).reshape(kh * kw, -1)
    o1, delta = _pairs(kh, kw, device)
    direct = delta >= (kh - 1) * (2 * kw - 1) + (kw - 1)
    src_o = torch.where(direct, o1, o1.T)
    src_d = torch.where(direct, delta, delta.T)
    return rect, src_o, src_d, direct


def _indicator(
    size: int, k: int, dil: int, pad: int, out_size: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """(k, size) 0/1: input position u is in R(o) along one axis, u - o dil + pad in
    [0, out_size)."""
    u = torch.arange(size, device=device)
    o = torch.arange(k, device=device).unsqueeze(1)
    t = u - o * dil + pad
    return ((t >= 0) & (t < out_size)).to(dtype)


def _pairs(kh: int, kw: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(o1, Delta index) grids (k2, k2) over the pairs of kernel offsets (o1, o2): o1 and the
    index of o2 - o1 in the (2 kh - 1) x (2 kw - 1) unfold order (rows then columns, from
    -(k - 1))."""
    i = torch.arange(kh, device=device)
    j = torch.arange(kw, device=device)
    oi, oj = torch.meshgrid(i, j, indexing="ij")
    oi, oj = oi.reshape(-1), oj.reshape(-1)
    k2 = kh * kw
    o1 = torch.arange(k2, device=device).unsqueeze(1).expand(k2, k2)
    o2 = o1.T
    di = oi[o2] - oi[o1] + kh - 1
    dj = oj[o2] - oj[o1] + kw - 1
    return o1, di * (2 * kw - 1) + dj
