"""Last-layer curvature through the Kronecker identity, from features alone.

For an output layer f = W phi + b with W (C x D) and b (C,), the per-sample Jacobian with
respect to [vec(W), b] (row-major vec, i.e. ``named_parameters()`` flattening) is
J_n = [I_C ⊗ phi_n^T, I_C] (thesis eq. 2.22 for a linear model), so no Jacobian needs to be
formed:

* J_n^T u   = [u ⊗ phi_n, u]                      (per-sample products with factors L_n),
* J_n v     = V_W phi_n + v_b                       (Jacobian-vector products),
* diag GGN  = sum_n diag(Lambda_n) ⊗ phi_n^2  and  sum_n diag(Lambda_n)   (eq. 2.24, diagonal),
* full GGN  = sum_n Lambda_n ⊗ [phi_n, 1][phi_n, 1]^T  (in the [W, b] ordering),

which costs O(N C D) for the diagonal, so thousands of classes fit. The features phi are the
inputs of the final ``nn.Linear``, captured with a forward hook; the fast path is used only
when that layer's output *is* the model output (checked on every batch), otherwise callers
fall back to the generic ``torch.func`` path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gaussify.curvature.subset import ParameterSubset

__all__ = [
    "OutputLinear",
    "find_output_linear",
    "forward_with_features",
    "lastlayer_diag",
    "lastlayer_jacobians",
    "lastlayer_jvp",
    "lastlayer_products",
    "lastlayer_vjp",
]


@dataclass(frozen=True)
class OutputLinear:
    """Which ``nn.Linear`` the subset covers and whether its weight / bias are included."""

    name: str
    has_weight: bool
    has_bias: bool


def find_output_linear(model: nn.Module, subset: ParameterSubset) -> OutputLinear | None:
    """The ``nn.Linear`` whose weight and/or bias are exactly the subset, else ``None``.

    Whether its output is the model output is checked later, per batch, by
    :func:`forward_with_features`.
    """
    modules = {subset.module_of(n) for n in subset.names}
    if len(modules) != 1:
        return None
    name = modules.pop()
    module = model.get_submodule(name)
    # A subclass may override forward; only the plain affine map has the identity.
    if type(module).forward is not nn.Linear.forward or not isinstance(module, nn.Linear):
        return None
    prefix = f"{name}." if name else ""
    names = set(subset.names)
    if not names <= {f"{prefix}weight", f"{prefix}bias"}:
        return None
    return OutputLinear(
        name=name, has_weight=f"{prefix}weight" in names, has_bias=f"{prefix}bias" in names
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
    factors L (N, C, K): rows [L_{:,k} ⊗ phi_n, L_{:,k}] in the subset's [vec(W), b] order."""
    n, c, k = factors.shape
    lt = factors.transpose(1, 2)  # (N, K, C)
    parts = []
    if layer.has_weight:
        parts.append(torch.einsum("nkc,nd->nkcd", lt, phi).reshape(n, k, c * phi.shape[1]))
    if layer.has_bias:
        parts.append(lt)
    return torch.cat(parts, dim=-1)


def lastlayer_jacobians(phi: Tensor, num_outputs: int, layer: OutputLinear) -> Tensor:
    """Per-sample Jacobians J_n = [I_C ⊗ phi_n^T, I_C], shape (N, C, P) (for tests and small
    problems; the curvature code never forms them)."""
    eye = torch.eye(num_outputs, dtype=phi.dtype, device=phi.device)
    return lastlayer_products(phi, eye.expand(phi.shape[0], -1, -1), layer)


def lastlayer_diag(phi: Tensor, middle_diag: Tensor, layer: OutputLinear) -> Tensor:
    """diag(sum_n J_n^T M_n J_n), shape (P,), from phi (N, D) and diag(M_n) (N, C) only:
    [sum_n diag(M_n) ⊗ phi_n^2, sum_n diag(M_n)] (thesis eq. 2.24 on the diagonal)."""
    parts = []
    if layer.has_weight:
        parts.append(torch.einsum("nc,nd->cd", middle_diag, phi.square()).reshape(-1))
    if layer.has_bias:
        parts.append(middle_diag.sum(0))
    return torch.cat(parts)


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


def lastlayer_vjp(phi: Tensor, u: Tensor, layer: OutputLinear) -> Tensor:
    """sum_n J_n^T u_n = [vec(sum_n u_n phi_n^T), sum_n u_n], shape (P,); u (N, C)."""
    parts = []
    if layer.has_weight:
        parts.append((u.T @ phi).reshape(-1))
    if layer.has_bias:
        parts.append(u.sum(0))
    return torch.cat(parts)
