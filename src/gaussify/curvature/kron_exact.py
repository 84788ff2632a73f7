"""Exact GGN blocks for the parameters KFAC has no Kronecker form for.

Norm layers (``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.BatchNorm*`` in eval mode), grouped
convolutions, an attention's ``bias_k`` / ``bias_v``, a bare ``nn.Parameter`` (a positional
embedding) and any module without a KFAC adapter get, per parameter tensor ``theta_p``, the
exact GGN block (Immer thesis eq. 2.24)::

    G_pp = sum_n J_pn^T Lambda_n J_pn = sum_{n,k} (v_kn^T J_pn)^T (v_kn^T J_pn),

with ``v_kn`` the same output vectors as KFAC's B factors (the columns of ``L_n``, ``Lambda_n =
L_n L_n^T``, for the exact GGN; sampled or observed residuals for Monte-Carlo KFAC or the
empirical Fisher). An affine norm layer (``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.BatchNorm*``
in eval mode: output ``xhat * w + b`` per sample) gets its rows from its output gradients ``g``
(``v^T J_w = sum g * xhat``, ``v^T J_b = sum g`` over its positions), one forward and K backward
passes; every other tensor from the per-sample Jacobians of those tensors alone
(:func:`gaussify.curvature.jacobian.jacobians`). A tensor with at most ``full_max`` entries
(default :data:`EXACT_FULL_MAX` = 1024, a 8 MB float64 block) keeps the full ``(k, k)`` block;
a larger one keeps its diagonal. Blocks of different tensors are independent (block-diagonal,
as between KFAC's layers).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gaussify.curvature.jacobian import jacobians, resolve_subset
from gaussify.curvature.kron_mha import without_fused_fastpath
from gaussify.curvature.kron_posterior import kron_block_eigh
from gaussify.curvature.layer_traces import _graph_uses
from gaussify.curvature.subset import ParameterSubset
from gaussify.state import TensorSpec

__all__ = ["EXACT_FULL_MAX", "ExactBlocks"]

#: the largest parameter tensor (in entries) whose exact block is kept full; above, diagonal
EXACT_FULL_MAX = 1024


def _affine_norm(module: nn.Module) -> bool:
    """An affine norm layer whose output is ``xhat * w + b`` per sample: ``nn.LayerNorm``,
    ``nn.GroupNorm``, ``nn.BatchNorm1d/2d/3d`` in eval mode with running statistics (exact
    types or subclasses that keep the forward)."""
    kind = type(module)
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm)):
        return kind.forward in (nn.LayerNorm.forward, nn.GroupNorm.forward)
    return (
        kind in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
        and not module.training
        and module.running_mean is not None
        and module.running_var is not None
    )


def _normalized(module: nn.Module, inp: Tensor) -> Tensor:
    """``xhat`` of an :func:`_affine_norm` layer's input."""
    if isinstance(module, nn.LayerNorm):
        return F.layer_norm(inp, module.normalized_shape, None, None, module.eps)
    if isinstance(module, nn.GroupNorm):
        return F.group_norm(inp, module.num_groups, None, None, module.eps)
    shape = (1, -1) + (1,) * (inp.ndim - 2)
    mean = module.running_mean.reshape(shape)
    return (inp - mean) / (module.running_var.reshape(shape) + module.eps).sqrt()


def _per_sample(module: nn.Module, t: Tensor) -> Tensor:
    """Sum ``t`` (the layer's output shape) over everything but the data point and the
    parameter's own entries: ``(N, k)`` in the parameter's flattened order."""
    if isinstance(module, nn.LayerNorm):
        k = math.prod(module.normalized_shape)
        return t.reshape(t.shape[0], -1, k).sum(1)
    return t.reshape(t.shape[0], t.shape[1], -1).sum(-1)  # channel dim 1


class ExactBlocks:
    """The exact GGN blocks ``{name: (k, k) or (k,)}`` of the parameter tensors ``names``."""

    def __init__(
        self,
        model: nn.Module,
        names: list[str],
        numels: list[int],
        full_max: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.names = names
        self.numels = numels
        self.full = {n: k <= full_max for n, k in zip(names, numels, strict=True)}
        self.subset: ParameterSubset | None = (
            resolve_subset(model, list(names), subnetwork=True) if names else None
        )
        self.g: dict[str, Tensor] = {
            n: torch.zeros((k, k) if self.full[n] else (k,), dtype=dtype, device=device)
            for n, k in zip(names, numels, strict=True)
        }

    def _add(self, name: str, part: Tensor) -> None:
        g = self.g[name]
        part = part.to(g.dtype)
        if self.full[name]:
            g.addmm_(part.mT, part)
        else:
            g.add_(part.square().sum(0))

    def _update_norms(self, model: nn.Module, x: Tensor, vecs: Tensor) -> set[str]:
        """The blocks of affine norm layers (output ``xhat * w + b`` per sample) from one
        forward pass with hooks and K backward passes: the per-sample Jacobian rows are
        ``v^T J_w = sum (g * xhat)`` and ``v^T J_b = sum g`` over the layer's positions, with
        ``g`` the output vector's gradient at the layer's output. Returns the names done."""
        owners: dict[str, list[tuple[str, str]]] = {}
        for name in self.names:
            path, _, leaf = name.rpartition(".")
            module = model.get_submodule(path)
            if leaf in ("weight", "bias") and _affine_norm(module):
                owners.setdefault(path, []).append((leaf, name))
        if not owners:
            return set()
        captured: dict[str, list[tuple[Tensor, Tensor]]] = {p: [] for p in owners}

        def make_hook(path: str):
            def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
                captured[path].append((inputs[0].detach(), output))

            return hook

        handles = [model.get_submodule(p).register_forward_hook(make_hook(p)) for p in owners]
        try:
            with torch.enable_grad(), without_fused_fastpath():
                f = model(x)
        finally:
            for h in handles:
                h.remove()
        usable = [
            p for p, calls in captured.items() if len(calls) == 1 and calls[0][1].requires_grad
        ]
        uses = _graph_uses(f)
        usable = [
            p
            for p in usable
            if all(uses.get(id(model.get_parameter(n)), 0) == 1 for _, n in owners[p])
        ]
        if not usable:
            return set()
        outs = [captured[p][0][1] for p in usable]
        xhat = {p: _normalized(model.get_submodule(p), captured[p][0][0]) for p in usable}
        for k in range(vecs.shape[0]):
            grads = torch.autograd.grad(
                f,
                outs,
                grad_outputs=vecs[k].to(f.dtype),
                retain_graph=k < vecs.shape[0] - 1,
                allow_unused=True,
                materialize_grads=True,
            )
            for p, g in zip(usable, grads, strict=True):
                module = model.get_submodule(p)
                for leaf, name in owners[p]:
                    term = g * xhat[p] if leaf == "weight" else g
                    self._add(name, _per_sample(module, term))
        return {n for p in usable for _, n in owners[p]}

    def update(self, model: nn.Module, x: Tensor, vecs: Tensor) -> None:
        """Add ``sum_{k,n} (v_kn^T J_n)^T (v_kn^T J_n)`` per tensor for the output vectors
        ``vecs (K, N, C)``: affine norm layers from their output gradients
        (:meth:`_update_norms`), the rest from per-sample Jacobians in chunks of samples that
        bound the ``(B, C, P_exact)`` Jacobian."""
        if self.subset is None:
            return
        done = self._update_norms(model, x, vecs)
        rest = [n for n in self.names if n not in done]
        if not rest:
            return
        subset = self.subset if not done else resolve_subset(model, rest, subnetwork=True)
        numels = [k for n, k in zip(self.names, self.numels, strict=True) if n not in done]
        n, c = x.shape[0], vecs.shape[2]
        rows = max(1, min(n, (1 << 22) // max(1, c * subset.num_params)))
        for start in range(0, n, rows):
            sl = slice(start, start + rows)
            with without_fused_fastpath(), warnings.catch_warnings():
                # vmap over attention hits functorch's (correct, slower) batching fallback
                warnings.filterwarnings("ignore", "There is a performance drop because we have")
                jac = jacobians(model, x[sl], subset)  # (B, C, P_exact)
            u = torch.einsum("kbc,bcp->kbp", vecs[:, sl].to(jac.dtype), jac).reshape(
                -1, jac.shape[-1]
            )
            for name, part in zip(rest, u.split(numels, dim=-1), strict=True):
                self._add(name, part)

    def eigh(self, name: str) -> tuple[Tensor, Tensor | None]:
        """``(eigenvalues (k,), eigenvectors (k, k) or None = identity)`` of a block."""
        g = self.g[name]
        if not self.full[name]:
            return g.clamp_min(0), None
        return kron_block_eigh(g)

    def state(self) -> dict[str, Tensor]:
        return {f"G.{n}": g.clone() for n, g in self.g.items()}

    def schema(self) -> dict[str, Any]:
        return {f"G.{n}": TensorSpec(tuple(g.shape), g.dtype) for n, g in self.g.items()}

    def load(self, valid: dict[str, Tensor]) -> None:
        for n in self.names:
            self.g[n] = valid[f"G.{n}"].to(device=self.g[n].device).clone()
