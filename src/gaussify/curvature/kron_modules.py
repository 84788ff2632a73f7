"""Which modules KFAC factorises, and how a module's parameters map onto a Kronecker block.

Every module type KFAC factorises is a linear map ``s_t = W a_t (+ b)`` applied at ``T``
weight-sharing locations per data point, and an *adapter* (a small registry keyed by module
type, :data:`ADAPTERS`, looked up along the type's MRO so subclasses inherit it) says how to
get the layer's inputs ``a (N, T, in)`` and its output gradients ``g (N, T, out)``:

* ``nn.Linear``: ``a`` the input with every leading dimension between the batch and the
  features as a location (sequence models: ``(N, T, in)``);
* ``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d`` (``groups=1``): the im2col patches of the
  module's receptive fields (``in = C_in prod(kernel)`` in the weight's own order);
* ``nn.Embedding``: one-hot inputs, ``s_t = W^T e_{i_t}``, so ``A = sum e e^T`` is the
  diagonal matrix of token counts, stored as a vector (never a dense vocabulary-sized factor)
  with the identity as eigenbasis; the block is the weight *transposed* (``(D, V)``). Padding
  tokens (``padding_idx``) get no gradient and are not counted. ``kfac_approx="reduce"`` would
  make A dense (``sum_n cbar_n cbar_n^T`` of per-sequence mean counts), so an Embedding always
  uses "expand";
* ``nn.MultiheadAttention``: its in-projection as three linear maps over the sequence (query,
  key and value rows of ``in_proj_weight`` / ``in_proj_bias``, or ``q_proj_weight`` /
  ``k_proj_weight`` / ``v_proj_weight`` with ``kdim``/``vdim``), each a block with its own
  input (the query / key / value sequence; the same tensor in self-attention), captured by
  the functional forward of :mod:`gaussify.curvature.kron_mha`; ``out_proj`` is an
  ``nn.Linear`` that forward calls as a module.

Every other parameter (norm layers, grouped convolutions, a bare ``nn.Parameter``, an
attention's ``bias_k`` / ``bias_v``, ...) gets an exact GGN block
(:mod:`gaussify.curvature.kron_exact`), so KFAC never refuses a model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gaussify.curvature.kron_grams import (
    KFACApprox,
    augment,
    gram,
    input_gram,
    layer_inputs,
    layer_output_grads,
)
from gaussify.curvature.subset import ParameterSubset

__all__ = ["ADAPTERS", "KronAdapter", "conv_patches", "register_kron_adapter"]


@dataclass(frozen=True)
class KronAdapter:
    """How KFAC sees one module type (see the module docstring).

    ``dims(module)``: ``(in, out)`` of the linear map, or None when this instance has no
    Kronecker form (then its parameters get exact blocks); ``inputs(module, inp, path)``:
    ``(N, T, in)``; ``output_grads(module, grad)``: ``(N, T, out)``; ``diagonal``: the inputs
    are one-hot, ``inputs`` returns the indices ``(N, T)`` (long) and A is the count vector.
    """

    dims: Callable[[nn.Module], tuple[int, int] | None]
    inputs: Callable[[nn.Module, Tensor, str], Tensor]
    output_grads: Callable[[nn.Module, Tensor], Tensor]
    diagonal: bool = False


def _linear_dims(m: nn.Module) -> tuple[int, int]:
    assert isinstance(m, nn.Linear)
    return m.in_features, m.out_features


def _conv_dims(m: nn.Module) -> tuple[int, int] | None:
    assert isinstance(m, nn.modules.conv._ConvNd)
    if m.groups != 1 or m.transposed:
        return None  # grouped convolutions: exact blocks
    return m.in_channels * math.prod(m.kernel_size), m.out_channels


def conv_patches(module: nn.Module, inp: Tensor, name: str = "") -> Tensor:
    """The unfolded input patches of a ``Conv1d`` / ``Conv2d`` / ``Conv3d`` (``groups=1``),
    ``(N, C_in prod(kernel), T)``: column t is the receptive field of output location t in the
    ``(channel, k_1, ..., k_d)`` order of ``weight.reshape(C_out, -1)``, so the layer is
    ``s_t = W a_t + b``. The module's own padding first (any ``padding_mode``), then one
    ``Tensor.unfold`` per spatial dimension (window ``(k - 1) dilation + 1``, every
    ``dilation``-th element kept)."""
    assert isinstance(module, nn.modules.conv._ConvNd)
    nd = len(module.kernel_size)
    if inp.ndim != nd + 2:
        raise ValueError(
            f"kron: {type(module).__name__} module {name or '<root>'!r} expects a batched "
            f"(N, C, {'...' if nd > 1 else 'L'}) input with {nd} spatial dimension(s), got "
            f"shape {tuple(inp.shape)}"
        )
    pads = module._reversed_padding_repeated_twice
    if any(pads):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        inp = F.pad(inp, list(pads), mode=mode)
    x = inp
    for i, (k, s, d) in enumerate(
        zip(module.kernel_size, module.stride, module.dilation, strict=True)
    ):
        x = x.unfold(2 + i, (k - 1) * d + 1, s)[..., ::d]
    order = (0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd))
    return x.permute(order).reshape(inp.shape[0], -1, math.prod(x.shape[2 : 2 + nd]))


def _conv_inputs(m: nn.Module, inp: Tensor, path: str) -> Tensor:
    if isinstance(m, nn.Conv2d):
        return layer_inputs(m, inp, path)  # kron_grams' own (tuned) Conv2d route
    return conv_patches(m, inp, path).transpose(1, 2)


def _conv_grads(m: nn.Module, grad: Tensor) -> Tensor:
    return grad.flatten(2).transpose(1, 2)


def _embedding_dims(m: nn.Module) -> tuple[int, int]:
    assert isinstance(m, nn.Embedding)
    return m.num_embeddings, m.embedding_dim


def _embedding_inputs(m: nn.Module, inp: Tensor, path: str) -> Tensor:
    if inp.ndim < 1:
        raise ValueError(f"kron: Embedding {path!r} expects batched (N, ...) token indices")
    return inp.reshape(inp.shape[0], -1)


def _embedding_grads(m: nn.Module, grad: Tensor) -> Tensor:
    return grad.reshape(grad.shape[0], -1, grad.shape[-1])


#: module type -> adapter (looked up along the MRO: subclasses inherit their base's adapter).
ADAPTERS: dict[type, KronAdapter] = {
    nn.Linear: KronAdapter(_linear_dims, lambda m, a, p: layer_inputs(m, a, p), layer_output_grads),
    nn.Conv1d: KronAdapter(_conv_dims, _conv_inputs, _conv_grads),
    nn.Conv2d: KronAdapter(_conv_dims, _conv_inputs, _conv_grads),
    nn.Conv3d: KronAdapter(_conv_dims, _conv_inputs, _conv_grads),
    nn.Embedding: KronAdapter(_embedding_dims, _embedding_inputs, _embedding_grads, True),
}


def register_kron_adapter(module_type: type, adapter: KronAdapter) -> None:
    """Teach KFAC a module type of your own (``weight (out, in)`` and optional ``bias``)."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type: expected an nn.Module subclass, got {module_type!r}")
    if not isinstance(adapter, KronAdapter):
        raise TypeError(f"adapter: expected a KronAdapter, got {type(adapter).__name__}")
    ADAPTERS[module_type] = adapter


def adapter_for(module: nn.Module) -> KronAdapter | None:
    """The adapter of the module's type or its nearest registered base class, provided the
    module runs that class's own ``forward`` (and, for a convolution, ``_conv_forward``): a
    subclass that changes the computation (e.g. scales its input) is not the linear map the
    adapter assumes, and gets exact blocks instead."""
    kind = type(module)
    for cls in kind.__mro__:
        if cls in ADAPTERS:
            same = kind.forward is cls.forward and getattr(kind, "_conv_forward", None) is getattr(
                cls, "_conv_forward", None
            )
            return ADAPTERS[cls] if same else None
    return None


# ----------------------------------------------------------------------------- layer bookkeeping


@dataclass(frozen=True)
class _Layer:
    """One Kronecker block's linear map: ``s = W a + b`` with ``W`` the rows
    ``[weight_row, weight_row + out)`` of the weight tensor (its transpose for an Embedding),
    ``b`` the rows ``[bias_row, bias_row + out)`` of the bias tensor.

    ``key`` names the factors (the module path; ``path:q`` etc. for an attention's
    in-projection parts), ``path`` the module whose call is captured."""

    path: str
    weight: str | None  # full parameter name, or None if not in the subset
    bias: str | None
    in_features: int  # columns of the weight matrix (C_in * prod(kernel) for a convolution)
    out_features: int
    key: str = ""
    part: str = ""  # "q" | "k" | "v" for an attention's in-projection, else ""
    weight_row: int = 0
    bias_row: int = 0
    transposed: bool = False  # the weight is stored (in, out): nn.Embedding
    diagonal: bool = False  # A is diagonal (one-hot inputs), stored as a vector

    @property
    def name(self) -> str:
        return self.key or self.path

    @property
    def a_dim(self) -> int:
        return (self.in_features if self.weight else 0) + (1 if self.bias else 0)


def _display(path: str) -> str:
    return repr(path) if path else "'' (the model itself)"


def _mha_layers(path: str, module: nn.MultiheadAttention, leaves: dict[str, str]) -> list[_Layer]:
    """The query / key / value blocks of an attention's in-projection (module docstring)."""
    e = module.embed_dim
    packed = module._qkv_same_embed_dim
    ins = {"q": e, "k": module.kdim, "v": module.vdim}
    layers = []
    for i, part in enumerate("qkv"):
        weight = leaves.get("in_proj_weight") if packed else leaves.get(f"{part}_proj_weight")
        bias = leaves.get("in_proj_bias")
        if weight is None and bias is None:
            continue
        layers.append(
            _Layer(
                path,
                weight,
                bias,
                ins[part],
                e,
                key=f"{path}:{part}",
                part=part,
                weight_row=i * e if packed else 0,
                bias_row=i * e,
            )
        )
    return layers


_MHA_KRON = {"in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight"}


def _build_layers(model: nn.Module, subset: ParameterSubset) -> tuple[list[_Layer], list[str]]:
    """Group the subset's parameters by owning module: ``(Kronecker blocks, names of the
    parameters that get an exact block)``."""
    by_module: dict[str, dict[str, str]] = {}
    for name in subset.names:
        path, _, leaf = name.rpartition(".")
        by_module.setdefault(path, {})[leaf] = name
    layers: list[_Layer] = []
    exact: list[str] = []
    for path, leaves in by_module.items():
        module = model.get_submodule(path)
        if isinstance(module, nn.MultiheadAttention):
            layers += _mha_layers(path, module, leaves)
            exact += [n for leaf, n in leaves.items() if leaf not in _MHA_KRON]
            continue
        adapter = adapter_for(module)
        dims = None if adapter is None else adapter.dims(module)
        if dims is None:
            exact += list(leaves.values())
            continue
        exact += [n for leaf, n in leaves.items() if leaf not in ("weight", "bias")]
        weight, bias = leaves.get("weight"), leaves.get("bias")
        if weight is None and bias is None:
            continue
        assert adapter is not None
        if adapter.diagonal:
            layers.append(_Layer(path, weight, None, *dims, transposed=True, diagonal=True))
            if bias is not None:
                exact.append(bias)
        else:
            layers.append(_Layer(path, weight, bias, *dims))
    exact.sort(key=subset.names.index)
    return layers, exact


def _columns(ly: _Layer, names: list[str]) -> tuple[str, ...]:
    """A block's columns, in order: "weight" (the weight's ``in`` columns), "bias" (the last)."""
    return tuple("weight" if name == ly.weight else "bias" for name in names)


def _subset_offsets(subset: ParameterSubset) -> dict[str, int]:
    offsets, pos = {}, 0
    for name, numel in zip(subset.names, subset.numels, strict=True):
        offsets[name] = pos
        pos += numel
    return offsets


def block_index(
    ly: _Layer, names: list[str], offsets: dict[str, int], device: torch.device
) -> Tensor:
    """Subset positions ``(out, d)`` of the block's matrix entries: row o is output o of the
    map, the columns are the weight's ``in`` columns then the bias (by ``names``)."""
    cols = []
    rows = torch.arange(ly.out_features).unsqueeze(-1)
    inputs = torch.arange(ly.in_features)
    for name in names:
        off = offsets[name]
        if name == ly.weight and ly.transposed:  # stored (in, out)
            cols.append(off + inputs * ly.out_features + rows)
        elif name == ly.weight:
            cols.append(off + (ly.weight_row + rows) * ly.in_features + inputs)
        else:
            cols.append(off + ly.bias_row + rows)
    return torch.cat(cols, dim=-1).to(device)


# ----------------------------------------------------------------------------- factor terms


def output_grads(ly: _Layer, module: nn.Module, grad: Tensor) -> Tensor:
    """The layer's output gradients as ``(N, T, out)``."""
    if ly.part:  # an attention's projection, batch first (N, T, E)
        return grad.reshape(grad.shape[0], -1, grad.shape[-1])
    adapter = adapter_for(module)
    assert adapter is not None
    return adapter.output_grads(module, grad)


def add_input_factor(
    ly: _Layer,
    module: nn.Module,
    inp: Tensor,
    approx: KFACApprox,
    a_sum: Tensor,
    budget: int | None = None,
) -> int:
    """Add the layer's input factor A (its sum over the batch ``inp``) into ``a_sum`` and
    return the number of terms M it adds: ``sum [a, 1][a, 1]^T`` over the layer's inputs
    (the gram of :mod:`gaussify.curvature.kron_grams`), or for an Embedding the token counts
    (padding tokens excluded), always "expand". ``budget``: see :func:`input_gram`."""
    if isinstance(module, (nn.Linear, nn.Conv2d)) and not ly.part:
        block = (ly.path, ly.weight is not None, ly.bias is not None)
        return input_gram(module, inp, block, approx, a_sum, budget)
    if ly.diagonal:  # one-hot inputs: A = diag(token counts)
        assert isinstance(module, nn.Embedding)
        idx = inp.reshape(inp.shape[0], -1)
        keep = idx.reshape(-1)
        if module.padding_idx is not None:
            keep = keep[keep != module.padding_idx]
        a_sum += torch.bincount(keep, minlength=ly.in_features).to(a_sum)
        return idx.numel()
    if ly.part:
        a = inp.reshape(inp.shape[0], -1, inp.shape[-1])
    else:
        adapter = adapter_for(module)
        assert adapter is not None
        a = adapter.inputs(module, inp, ly.path)
    a = augment(a, ly.weight is not None, ly.bias is not None)
    gram(a, approx, "mean", out=a_sum)
    return a.shape[0] * (a.shape[1] if approx == "expand" else 1)
