"""PyTorch's fused attention fast paths, routed around for every Jacobian and curvature pass.

In eval mode (and when no input requires a gradient, e.g. under ``torch.func.jvp``) PyTorch
replaces ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and ``nn.TransformerEncoder``
by fused kernels (``aten::_native_multi_head_attention``, ``aten::_transformer_encoder_layer_fwd``,
nested tensors for padded batches), and ``F.scaled_dot_product_attention`` dispatches to fused
flash / memory-efficient kernels. These compute the same function f(x; theta) but have no
forward-mode derivative (``torch.func.jvp``: lowrank, the GLM predictive's mean shift, the
function-space families' prior mean, Sampled-LLA) and no double backward, and have no batching
rule under ``vmap`` (a slow per-sample loop).

:func:`autodiff_safe` is the one place that routes around them: inside the block

* ``torch.backends.mha.set_fastpath_enabled(False)``: the attention modules run their
  composite (differentiable in every mode) Python path, which computes the same function;
* ``torch.nn.attention.sdpa_kernel([SDPBackend.MATH])``: scaled dot-product attention uses its
  composite "math" kernel (softmax(Q K^T / sqrt(d) + mask) V from ordinary operations), which
  has forward- and reverse-mode derivatives of every order;

and both settings are restored on exit, also when the block raises. The model's function is
unchanged (the fused and composite kernels agree to round-off), so curvature, Jacobians and
predictives are those of the same network. When ``model`` contains one of the fused modules the
first such block warns once per model (:class:`gaussify.warnings.FastPathWarning`), naming the
modules found and what was done.

:func:`forward_ad_unsupported` recognises PyTorch's error for an operation without a
forward-mode derivative (a user's custom ``autograd.Function`` without ``jvp``, a fused kernel
outside the list above), so callers can fall back to reverse mode (:func:`warn_reverse_mode`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.func
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from gaussify.warnings import FastPathWarning

__all__ = [
    "FUSED_MODULES",
    "autodiff_safe",
    "forward_ad_unsupported",
    "functional_call",
    "fused_modules",
    "warn_reverse_mode",
]

#: Modules of ``torch.nn`` that switch to a fused kernel without forward-mode AD in eval mode.
FUSED_MODULES: tuple[type[nn.Module], ...] = (
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerEncoder,
)

_WARNED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_WARNED_REVERSE: weakref.WeakSet[nn.Module] = weakref.WeakSet()


_INTERNAL = (
    os.path.dirname(os.path.abspath(__file__)),  # gaussify
    os.path.abspath(contextlib.__file__),  # the context managers' frames
    os.path.dirname(os.path.abspath(torch.__file__)),
)


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning issued by this module's caller chain at the
    first frame outside gaussify, the standard library and torch (the user's call)."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL):
        frame = frame.f_back
        level += 1
    return level


def fused_modules(model: nn.Module) -> list[tuple[str, str]]:
    """``(name, type name)`` of the outermost modules of ``model`` with a fused fast path (a
    ``TransformerEncoderLayer``'s own attention is not listed again)."""
    found: list[tuple[str, str]] = []
    for name, module in model.named_modules():
        if not isinstance(module, FUSED_MODULES):
            continue
        if any(name.startswith(outer + ".") for outer, _ in found if outer):
            continue
        found.append((name or "<root>", type(module).__name__))
    return found


def _warn_once(model: nn.Module) -> None:
    if model in _WARNED:
        return
    found = fused_modules(model)
    _WARNED.add(model)
    if not found:
        return
    listed = ", ".join(f"{name!r} ({kind})" for name, kind in found[:5])
    more = f" and {len(found) - 5} more" if len(found) > 5 else ""
    warnings.warn(
        f"model: {listed}{more} use(s) PyTorch's fused attention fast path in eval mode "
        "(aten::_native_multi_head_attention / aten::_transformer_encoder_layer_fwd / fused "
        "scaled_dot_product_attention kernels), which has no forward-mode derivative and no "
        "double backward; gaussify disables it (torch.backends.mha.set_fastpath_enabled(False) "
        "and the 'math' scaled_dot_product_attention kernel) during its Jacobian, curvature and "
        "predictive passes and restores your settings afterwards. The network's function is the "
        "same; only the kernels differ (shown once per model).",
        FastPathWarning,
        stacklevel=_user_stacklevel(),
    )


@contextmanager
def autodiff_safe(model: nn.Module | None = None) -> Iterator[None]:
    """Run the block with PyTorch's fused attention fast paths off (module docstring); the
    previous settings come back on exit, also on an exception. With ``model``, warn once per
    model (:class:`~gaussify.warnings.FastPathWarning`) when it holds a fused module."""
    if isinstance(model, nn.Module):
        _warn_once(model)
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


def functional_call(
    model: nn.Module,
    params: dict[str, Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    strict: bool = False,
) -> Any:
    """``torch.func.functional_call`` inside :func:`autodiff_safe` (warning once per model
    with a fused module): the network as a function of its parameters, evaluated by kernels
    with forward- and reverse-mode derivatives, for every gaussify Jacobian / JVP / VJP / vmap
    pass. Tied parameters stay tied (a tensor given under one of its names is used by every
    module that shares it)."""
    with autodiff_safe(model):
        return torch.func.functional_call(model, params, args, kwargs, strict=strict)


def forward_ad_unsupported(error: BaseException) -> bool:
    """Whether ``error`` is PyTorch's refusal of forward-mode AD for an operation."""
    if not isinstance(error, NotImplementedError | RuntimeError):
        return False
    text = str(error)
    return (
        "forward AD" in text
        or "forward-mode AD" in text
        or ("jvp" in text and "autograd.Function" in text)
    )


def warn_reverse_mode(model: nn.Module, error: BaseException) -> None:
    """Warn once per model that a forward-mode product falls back to reverse mode."""
    if model in _WARNED_REVERSE:
        return
    _WARNED_REVERSE.add(model)
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    warnings.warn(
        f"model: an operation has no forward-mode derivative ({first}); gaussify computes the "
        "Jacobian-vector products J v from reverse-mode Jacobians instead (C backward passes "
        "per chunk of inputs instead of one forward pass; shown once per model).",
        FastPathWarning,
        stacklevel=_user_stacklevel(),
    )
