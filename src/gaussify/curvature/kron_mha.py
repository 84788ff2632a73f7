"""The inputs and output gradients of an ``nn.MultiheadAttention``'s projections, for KFAC.

``nn.MultiheadAttention`` applies its projections inside ``F.multi_head_attention_forward``
(or a fused kernel), so forward hooks see neither the in-projection nor ``out_proj``. During
the KFAC curvature pass, :func:`capture_attention` swaps each attention's ``forward`` for
:func:`attention_forward`, which

1. projects the query, key and value sequences itself, batch first: ``q = query W_q^T + b_q``
   (``W_q`` the first ``E`` rows of ``in_proj_weight``, or ``q_proj_weight``; the same for k
   and v), and reports each ``(input (N, T, in), output (N, T, E))`` pair;
2. runs PyTorch's own ``F.multi_head_attention_forward`` on the projected sequences with
   identity projections (``x I^T + 0 = x`` exactly), so masks, ``bias_k`` / ``bias_v``,
   ``add_zero_attn``, causal masking and dropout behave exactly as in the module;
3. applies ``out_proj`` as a module call on the batch-first output (its forward hooks fire
   as for any ``nn.Linear`` on ``(N, T, E)``).

The outputs equal the module's own (tests check it). :func:`without_fused_fastpath` turns off
PyTorch's fused transformer fast path (``TransformerEncoderLayer`` in eval mode bypasses its
submodules) for the curvature pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gaussify.fastpath import autodiff_safe

__all__ = ["attention_forward", "capture_attention", "without_fused_fastpath"]

Record = Callable[[str, Tensor, Tensor], None]


@contextmanager
def without_fused_fastpath() -> Iterator[None]:
    """PyTorch's fused MHA / transformer fast paths and fused SDPA kernels off inside the block
    (restored after): the library-wide :func:`gaussify.fastpath.autodiff_safe` (the family's
    entry point already warned once per model)."""
    with autodiff_safe():
        yield


def _projection(m: nn.MultiheadAttention, part: str) -> tuple[Tensor, Tensor | None]:
    e = m.embed_dim
    i = "qkv".index(part)
    if m._qkv_same_embed_dim:
        weight = m.in_proj_weight[i * e : (i + 1) * e]
    else:
        weight = getattr(m, f"{part}_proj_weight")
    bias = None if m.in_proj_bias is None else m.in_proj_bias[i * e : (i + 1) * e]
    return weight, bias


def attention_forward(
    m: nn.MultiheadAttention,
    record: Record,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None = None,
    need_weights: bool = True,
    attn_mask: Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``m(query, key, value, ...)`` with the projections reported to ``record(part, input,
    output)`` (part "q", "k", "v"; batch-first tensors) and ``out_proj`` called as a module."""
    if query.ndim != 3:
        raise ValueError(
            "kron: nn.MultiheadAttention needs batched (3-D) query/key/value inputs for KFAC, "
            f"got a {query.ndim}-D query; use structure='diag', 'full' or 'lowrank'"
        )
    if not m.batch_first:  # to (N, T, E): the data points first, as KFAC's factors need
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    projected = []
    for part, seq in zip("qkv", (query, key, value), strict=True):
        weight, bias = _projection(m, part)
        out = F.linear(seq, weight, bias)
        record(part, seq, out)
        projected.append(out.transpose(0, 1))  # (T, N, E) for the functional call
    e = m.embed_dim
    eye = torch.eye(e, dtype=query.dtype, device=query.device)
    zeros = query.new_zeros(3 * e)
    out, weights = F.multi_head_attention_forward(
        *projected,
        e,
        m.num_heads,
        None,
        zeros,
        m.bias_k,
        m.bias_v,
        m.add_zero_attn,
        m.dropout,
        eye,
        zeros[:e],
        training=m.training,
        key_padding_mask=key_padding_mask,
        need_weights=need_weights,
        attn_mask=attn_mask,
        use_separate_proj_weight=True,
        q_proj_weight=eye,
        k_proj_weight=eye,
        v_proj_weight=eye,
        average_attn_weights=average_attn_weights,
        is_causal=is_causal,
    )
    # batch first (N, T, E), and a module call, so out_proj's hooks see data points first
    out = m.out_proj(out.transpose(0, 1))
    return (out if m.batch_first else out.transpose(0, 1)), weights


@contextmanager
def capture_attention(
    modules: dict[str, nn.MultiheadAttention], record: Callable[[str, str, Tensor, Tensor], None]
) -> Iterator[None]:
    """Run every attention of ``modules`` (path -> module) through :func:`attention_forward`
    inside the block, reporting ``record(path, part, input, output)``; the fused fast path is
    off (:func:`without_fused_fastpath`). The modules' own ``forward`` is restored after."""
    patched: list[tuple[nn.Module, Any]] = []

    def bind(path: str, m: nn.MultiheadAttention) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
            return attention_forward(m, lambda p, a, o: record(path, p, a, o), *args, **kwargs)

        return forward

    try:
        for path, m in modules.items():
            patched.append((m, m.__dict__.get("forward")))
            m.forward = bind(path, m)  # type: ignore[method-assign]
        with without_fused_fastpath():
            yield
    finally:
        for m, before in patched:
            if before is None:
                del m.forward
            else:
                m.forward = before  # type: ignore[method-assign]
