"""Last-layer curvature through the Kronecker identity, from features alone.

For an output layer f = W phi + b with W (C x D) and b (C,), the per-sample Jacobian with
respect to [vec(W), b] (row-major vec, i.e. ``named_parameters()`` flattening) is
J_n = [I_C ⊗ phi_n^T, I_C] (thesis eq. 2.22 for a linear model), so no Jacobian needs to be
formed:

* J_n^T u   = [u ⊗ phi_n, u]                      (per-sample products with factors L_n),
* J_n v     = V_W phi_n + v_b                       (Jacobian-vector products),
* diag GGN  = sum_n diag(Lambda_n) ⊗ phi_n^2  and  sum_n diag(Lambda_n)   (eq. 2.24, diagonal),
* full GGN  = sum_n Lambda_n ⊗ [phi_n, 1][phi_n, 1]^T  (in the [W, b] ordering),
* J_n F     = F_W phi_n + F_b for a matrix F (P, K) whose rows are parameters (the GLM
  predictive J Sigma J^T = (J F)(J F)^T for a factor Sigma = F F^T, thesis eq. 3.15),

which costs O(N C D) for the diagonal, so thousands of classes fit. The features phi are the
inputs of the final ``nn.Linear``, captured with a forward hook; the fast path is used only
when that layer's output *is* the model output (checked on every batch), otherwise callers
fall back to the generic ``torch.func`` path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gaussify.curvature.jacobian import auto_chunk_size, chunk_slices
from gaussify.curvature.subset import ParameterSubset, tied_parameters

__all__ = [
    "OutputLinear",
    "find_output_linear",
    "forward_with_features",
    "lastlayer_chunked",
    "lastlayer_diag",
    "lastlayer_factor_cov",
    "lastlayer_factor_products",
    "lastlayer_features",
    "lastlayer_index",
    "lastlayer_jacobians",
    "lastlayer_jvp",
    "lastlayer_num_outputs",
    "lastlayer_products",
    "lastlayer_vjp",
]


@dataclass(frozen=True)
class OutputLinear:
    """Which ``nn.Linear`` the subset covers and whether its weight / bias are included
    (``in_features`` / ``out_features``: its sizes D and C, 0 if unknown; used to check
    features handed to the predictive)."""

    name: str
    has_weight: bool
    has_bias: bool
    in_features: int = 0
    out_features: int = 0


def find_output_linear(model: nn.Module, subset: ParameterSubset) -> OutputLinear | None:
    """The ``nn.Linear`` whose weight and/or bias are exactly the subset, else ``None``.

    Whether its output is the model output is checked later, per batch, by
    :func:`forward_with_features`.
    """
    modules = {subset.module_of(n) for n in subset.names}
    if len(modules) != 1 or subset.indices is not None:  # a subnetwork is not the whole layer
        return None
    name = modules.pop()
    module = model.get_submodule(name)
    # A subclass may override forward; only the plain affine map has the identity.
    if type(module).forward is not nn.Linear.forward or not isinstance(module, nn.Linear):
        return None
    if set(subset.names) & set(tied_parameters(model)):
        return None  # a tensor also used by another module: J is not I ⊗ phi alone
    prefix = f"{name}." if name else ""
    names = set(subset.names)
    if not names <= {f"{prefix}weight", f"{prefix}bias"}:
        return None
    return OutputLinear(
        name=name,
        has_weight=f"{prefix}weight" in names,
        has_bias=f"{prefix}bias" in names,
        in_features=module.in_features,
        out_features=module.out_features,
    )


def forward_with_features(
    model: nn.Module, x: Tensor, layer: OutputLinear | None
) -> tuple[Tensor, Tensor | None]:
    """(f (N, C), phi (N, D) or None): the outputs and, when ``layer`` is the output layer of
    this forward pass (its output tensor is returned unchanged and it ran once), its inputs."""
    if layer is None:
        return model(x), None
    module = model.get_submodule(layer.name)
    captured: list[tuple[Tensor, Tensor]] = []

    def hook(_mod: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        captured.append((inputs[0], output))

    handle = module.register_forward_hook(hook)
    try:
        f = model(x)
    finally:
        handle.remove()
    if len(captured) != 1 or captured[0][1] is not f or captured[0][0].ndim != 2:
        return f, None
    return f, captured[0][0]


def lastlayer_products(phi: Tensor, factors: Tensor, layer: OutputLinear) -> Tensor:
    """Per-sample products (J_n^T L_n)^T, shape (N, K, P), from features phi (N, D) and
    factors L (N, C, K): rows [L_{:,k} ⊗ phi_n, L_{:,k}] in the subset's [vec(W), b] order
    (written into one preallocated block, so the block is the only (N, K, P) tensor)."""
    n, c, k = factors.shape
    dim = phi.shape[1]
    lt = factors.transpose(1, 2)  # (N, K, C)
    if torch.is_grad_enabled() and (phi.requires_grad or factors.requires_grad):
        parts = []  # differentiable (out= is not)
        if layer.has_weight:
            parts.append(torch.einsum("nkc,nd->nkcd", lt, phi).reshape(n, k, c * dim))
        if layer.has_bias:
            parts.append(lt)
        return torch.cat(parts, dim=-1)
    dtype = torch.promote_types(phi.dtype, factors.dtype)
    size = c * (dim * layer.has_weight + layer.has_bias)
    out = torch.empty(n, k, size, dtype=dtype, device=factors.device)
    offset = 0
    if layer.has_weight:
        view = out[..., : c * dim].view(n, k, c, dim)
        torch.mul(lt.unsqueeze(-1).to(dtype), phi[:, None, None, :].to(dtype), out=view)
        offset = c * dim
    if layer.has_bias:
        out[..., offset:] = lt
    return out


def lastlayer_jacobians(phi: Tensor, num_outputs: int, layer: OutputLinear) -> Tensor:
    """Per-sample Jacobians J_n = [I_C ⊗ phi_n^T, I_C], shape (N, C, P) (for tests and small
    problems; the curvature code never forms them)."""
    eye = torch.eye(num_outputs, dtype=phi.dtype, device=phi.device)
    return lastlayer_products(phi, eye.expand(phi.shape[0], -1, -1), layer)


def lastlayer_diag(
    phi: Tensor, middle_diag: Tensor, layer: OutputLinear, out: Tensor | None = None
) -> Tensor:
    """diag(sum_n J_n^T M_n J_n), shape (P,), from phi (N, D) and diag(M_n) (N, C) only:
    [sum_n diag(M_n) ⊗ phi_n^2, sum_n diag(M_n)] (thesis eq. 2.24 on the diagonal).

    With ``out`` (P,) the sum is added to it in place (one matmul into its weight block), so
    no P-sized temporary exists; otherwise a new (P,) tensor is returned."""
    return _accumulate(phi, middle_diag, layer, out, square=True)


def lastlayer_vjp(phi: Tensor, u: Tensor, layer: OutputLinear, out: Tensor | None = None) -> Tensor:
    """sum_n J_n^T u_n = [vec(sum_n u_n phi_n^T), sum_n u_n], shape (P,); u (N, C).

    With ``out`` (P,) the sum is added to it in place (no P-sized temporary)."""
    return _accumulate(phi, u, layer, out)


def _accumulate(
    phi: Tensor, u: Tensor, layer: OutputLinear, out: Tensor | None, square: bool = False
) -> Tensor:
    """``[vec(sum_n u_n phi_n^T), sum_n u_n]`` (P,) from ``phi (N, D)`` (squared elementwise
    in ``out``'s dtype when ``square``) and ``u (N, C)``, added into ``out`` in place when
    given (one matmul into its weight block), else new."""
    num_outputs = u.shape[1]
    size = num_outputs * (phi.shape[1] * layer.has_weight + layer.has_bias)
    if out is None:
        out = u.new_zeros(size)
    elif out.shape != (size,):
        raise ValueError(f"out: expected shape ({size},), got {tuple(out.shape)}")
    u = u.to(out.dtype)
    offset = 0
    if layer.has_weight:
        block = out[: num_outputs * phi.shape[1]].view(num_outputs, phi.shape[1])
        x = phi.to(out.dtype)
        block.addmm_(u.T, x.square() if square else x)
        offset = block.numel()
    if layer.has_bias:
        out[offset:] += u.sum(0)
    return out


def _split_vector(v: Tensor, num_outputs: int, dim: int, layer: OutputLinear) -> tuple:
    weight = bias = None
    offset = 0
    if layer.has_weight:
        weight = v[: num_outputs * dim].reshape(num_outputs, dim)
        offset = num_outputs * dim
    if layer.has_bias:
        bias = v[offset : offset + num_outputs]
    return weight, bias


def lastlayer_jvp(phi: Tensor, v: Tensor, num_outputs: int, layer: OutputLinear) -> Tensor:
    """J_n v = V_W phi_n + v_b for every sample, shape (N, C); v (P,)."""
    weight, bias = _split_vector(v, num_outputs, phi.shape[1], layer)
    out = torch.zeros(phi.shape[0], num_outputs, dtype=phi.dtype, device=phi.device)
    if weight is not None:
        out = out + phi @ weight.T
    if bias is not None:
        out = out + bias
    return out


# --------------------------------------------------------------------------- GLM predictive


def lastlayer_num_outputs(num_params: int, dim: int, layer: OutputLinear) -> int:
    """C from P = C * D' with D' = D (weight) + 1 (bias); ``ValueError`` if P or the layer's
    known sizes do not fit."""
    width = dim * layer.has_weight + layer.has_bias
    wrong_dim = layer.has_weight and layer.in_features and dim != layer.in_features
    if width == 0 or num_params % width or wrong_dim:
        raise ValueError(
            f"phi: features of dimension {dim} do not match the {num_params} parameters of "
            f"the output layer {layer.name!r} (weight={layer.has_weight}, bias={layer.has_bias})"
        )
    num_outputs = num_params // width
    if layer.out_features and num_outputs != layer.out_features:
        raise ValueError(
            f"layer: the output layer {layer.name!r} has {layer.out_features} outputs, but the "
            f"posterior's {num_params} parameters give {num_outputs}"
        )
    return num_outputs


def lastlayer_features(phi: Tensor, layer: OutputLinear) -> Tensor:
    """The per-output Jacobian row phi~_n (N, D'): phi (weight only), [phi, 1] (weight and
    bias) or 1 (bias only), so that J_n = I_C ⊗ phi~_n^T up to the parameter order."""
    parts = []
    if layer.has_weight:
        parts.append(phi)
    if layer.has_bias:
        parts.append(phi.new_ones(phi.shape[0], 1))
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


def lastlayer_index(
    num_outputs: int, dim: int, layer: OutputLinear, device: torch.device | None = None
) -> Tensor:
    """(C, D') subset positions of the layer's parameters laid out as the matrix [W, b]:
    entry (c, d') multiplies phi~_{n, d'} in output c (W row-major first, then b)."""
    rows = torch.arange(num_outputs, device=device).unsqueeze(-1)
    cols = []
    if layer.has_weight:
        cols.append(rows * dim + torch.arange(dim, device=device))
    if layer.has_bias:
        cols.append(num_outputs * dim * layer.has_weight + rows)
    return torch.cat(cols, dim=-1)


def lastlayer_factor_products(
    phi: Tensor, factor: Tensor, num_outputs: int, layer: OutputLinear
) -> Tensor:
    """J_n F for every sample, shape (N, C, K), for F (P, K) with rows in subset order:
    F_W phi_n + F_b with F_W the first C * D rows as (C, D, K) (views only, so a P x K factor
    is never copied). The matrix version of :func:`lastlayer_jvp`."""
    n, dim = phi.shape
    k = factor.shape[-1]
    out: Tensor | None = None
    offset = 0
    if layer.has_weight:
        weight = factor[: num_outputs * dim].reshape(num_outputs, dim, k)
        out = torch.matmul(phi.to(factor.dtype), weight).transpose(0, 1)  # (N, C, K)
        offset = num_outputs * dim
    if layer.has_bias:
        bias = factor[offset : offset + num_outputs]
        out = bias.expand(n, num_outputs, k) if out is None else out + bias
    assert out is not None
    return out


def lastlayer_chunked(
    fn: Callable[[Tensor], Tensor], phi: Tensor, per_sample: int, out_shape: tuple[int, ...]
) -> Tensor:
    """``fn`` applied to chunks of phi (N, D) whose intermediates hold about ``per_sample``
    elements per sample (chunk * per_sample <= the Jacobian chunk budget), written into one
    preallocated (N, *out_shape) result, so memory stays at one chunk plus the output."""
    n = phi.shape[0]
    chunk = auto_chunk_size(n, per_sample)
    if chunk >= n:
        return fn(phi)
    out: Tensor | None = None
    for sl in chunk_slices(n, chunk):
        part = fn(phi[sl])
        if out is None:
            out = part.new_empty(n, *out_shape)
        out[sl] = part
    assert out is not None
    return out


def lastlayer_factor_cov(
    phi: Tensor,
    factor: Tensor,
    layer: OutputLinear,
    weights: Tensor | None = None,
    *,
    var_only: bool = False,
) -> Tensor:
    """J Sigma J^T (N, C, C), or its diagonal (N, C) (``var_only``), for a covariance
    Sigma = F diag(w) F^T given by a factor F (P, K) with rows in subset order and weights
    w (K,) (None: w = 1): W_n = J_n F from the features phi (N, D)
    (:func:`lastlayer_factor_products`), then W_n diag(w) W_n^T (thesis eq. 3.15), chunked
    over samples. Costs O(N C D' K + N C^2 K) and never forms a Jacobian."""
    num_outputs = lastlayer_num_outputs(factor.shape[0], phi.shape[1], layer)
    root = None if weights is None else weights.sqrt()

    def block(ph: Tensor) -> Tensor:
        w = lastlayer_factor_products(ph, factor, num_outputs, layer)
        if root is not None:
            w = w * root
        return w.square().sum(-1) if var_only else w @ w.mT

    shape = (num_outputs,) if var_only else (num_outputs, num_outputs)
    return lastlayer_chunked(block, phi, 2 * num_outputs * factor.shape[-1], shape)


# --------------------------------------------------------------------------- full GGN


def lastlayer_full_ggn(
    phi: Tensor, middle: Tensor, layer: OutputLinear, out: Tensor, classes_per_block: int = 0
) -> Tensor:
    """Add sum_n M_n ⊗ phi~_n phi~_n^T to ``out`` (P, P) in subset order, from features
    phi (N, D) and middle matrices M (N, C, C) (Lambda_n, or L_n L_n^T for Monte Carlo / EF).

    In the [W, b] matrix layout entry ((c, d), (c', d')) is sum_n phi~_nd M_n[c, c'] phi~_nd'.
    For a block of g classes c it is one matmul Phi~^T R with R[n] = M_n[c, :] ⊗ phi~_n
    (N, g C D'), added through views to the W rows c D .. c D + D - 1 and the bias rows
    C D + c of ``out``. The cost is O(N C^2 D'^2) (the generic product route J^T L L^T J costs
    O(N C^3 D'^2)), no Jacobian is formed, and the temporaries are (N, g C D') and
    (D', g C D'), g = ``classes_per_block`` (0: all C)."""
    num_outputs = middle.shape[1]
    feats = lastlayer_features(phi, layer).to(out.dtype)
    n, width = feats.shape
    dim = phi.shape[1] if layer.has_weight else 0
    bias_at = num_outputs * dim  # first bias row / column in subset order
    middle = middle.to(out.dtype)
    step = classes_per_block or num_outputs
    for c0 in range(0, num_outputs, step):
        c1 = min(c0 + step, num_outputs)
        g = c1 - c0
        rhs = middle[:, c0:c1, :, None] * feats[:, None, None, :]
        block = (feats.T @ rhs.reshape(n, -1)).view(width, g, num_outputs, width)
        if layer.has_weight:
            rows = out[c0 * dim : c1 * dim].unflatten(0, (g, dim))  # (g, D, P), a view
            rows[..., :bias_at].unflatten(-1, (num_outputs, dim)).add_(
                block[:dim, :, :, :dim].permute(1, 0, 2, 3)
            )
            if layer.has_bias:
                rows[..., bias_at:].add_(block[:dim, :, :, dim].permute(1, 0, 2))
        if layer.has_bias:
            rows = out[bias_at + c0 : bias_at + c1]  # (g, P)
            if layer.has_weight:
                rows[:, :bias_at].unflatten(-1, (num_outputs, dim)).add_(block[dim, :, :, :dim])
            rows[:, bias_at:].add_(block[width - 1, :, :, width - 1])
    return out
