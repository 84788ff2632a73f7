"""im2col patches of a convolution and the per-sample weight gradients built from them.

A plain ``nn.Conv2d`` is s_t = W a_t + b at each of its T output locations, with a_t the
unfolded receptive field of location t (:func:`conv2d_patches`); the per-sample weight gradient
of u^T f_n is then sum_t delta_t a_t^T, delta the gradient with respect to the layer's output
(:func:`conv_weight_grads`). Used by the per-layer Jacobian routes and KFAC.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["conv2d_patches", "conv_per_sample_elements", "conv_weight_grads"]


def conv2d_patches(module: nn.Conv2d, inp: Tensor, name: str = "") -> Tensor:
    """The unfolded input patches (im2col) of a ``nn.Conv2d``, shape (N, C_in kh kw, T).

    The module's own padding first (any ``padding_mode``, ``'same'`` and ``'valid'``
    included), then ``F.unfold`` with its kernel size, dilation and stride: column t is the
    receptive field a_t of output location t in the (channel, kh, kw) order of
    ``weight.reshape(C_out, -1)``, so the layer is s_t = W a_t + b at each of its T output
    locations (with ``groups`` = G, group g's rows are its C_in / G channels and its weight
    rows are output channels [g C_out / G, (g + 1) C_out / G)). ``name`` only labels errors.
    """
    if not isinstance(module, nn.Conv2d):
        raise TypeError(f"module: expected an nn.Conv2d, got {type(module).__name__}")
    if inp.ndim != 4:
        raise ValueError(
            f"Conv2d module {name or '<root>'!r}: expected a batched (N, C, H, W) input, got "
            f"shape {tuple(inp.shape)} (the per-sample route needs one batch dimension)"
        )
    left, right, top, bottom = module._reversed_padding_repeated_twice
    if module.padding_mode == "zeros" and left == right and top == bottom:
        padding = (top, left)  # unfold pads with zeros itself, without a padded copy
    else:
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        inp = F.pad(inp, (left, right, top, bottom), mode=mode)
        padding = (0, 0)
    return F.unfold(
        inp, module.kernel_size, dilation=module.dilation, padding=padding, stride=module.stride
    )


def conv_weight_grads(conv: nn.Conv2d, patches: Tensor, deltas: Tensor) -> Tensor:
    """Per-sample weight gradients of a convolution for one output vector, (B, C_out, in/G).

    For sample n: sum_t delta_{n,o,t} a_{n,i,t} over the T output locations, one batched matmul
    over (sample, group) of delta (out/G, T) with the patches (T, in/G), in = C_in kh kw.
    ``patches`` (B, C_in kh kw, T) from :func:`conv2d_patches`, ``deltas`` (B, C_out, H_out,
    W_out). Row o is W[o] flattened (the weight's own (C_out, C_in/G, kh, kw) order).
    """
    b, groups, t = deltas.shape[0], conv.groups, patches.shape[-1]
    d = deltas.reshape(b * groups, conv.out_channels // groups, t)
    a = patches.view(b * groups, patches.shape[1] // groups, t)
    return torch.bmm(d, a.transpose(1, 2)).view(b, conv.out_channels, -1)


def conv_per_sample_elements(conv: nn.Conv2d, inp: int, out: int) -> int:
    """Elements one sample's conv route holds while it streams over the output vectors: its
    input ``inp`` and output ``out`` sizes (saved by the forward pass), one output gradient,
    the patches and one weight gradient."""
    t = out // conv.out_channels
    patches = conv.weight[0].numel() * conv.groups * t
    return 2 * out + inp + patches + conv.weight.numel()
