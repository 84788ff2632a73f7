"""Exact GGN blocks for the parameters KFAC has no Kronecker form for.

Norm layers (``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.BatchNorm*`` in eval mode), grouped
convolutions, an attention's ``bias_k`` / ``bias_v``, a bare ``nn.Parameter`` (a positional
embedding) and any module without a KFAC adapter get, per parameter tensor ``theta_p``, the
exact GGN block (Immer thesis eq. 2.24)::

    G_pp = sum_n J_pn^T Lambda_n J_pn = sum_{n,k} (v_kn^T J_pn)^T (v_kn^T J_pn),

with ``v_kn`` the same output vectors as KFAC's B factors (the columns of ``L_n``, ``Lambda_n =
L_n L_n^T``, for the exact GGN; sampled or observed residuals for Monte-Carlo KFAC or the
empirical Fisher), from the per-sample Jacobians of those tensors alone
(:func:`gaussify.curvature.jacobian.jacobians`). A tensor with at most ``full_max`` entries
(default :data:`EXACT_FULL_MAX` = 1024, a 8 MB float64 block) keeps the full ``(k, k)`` block;
a larger one keeps its diagonal. Blocks of different tensors are independent (block-diagonal,
as between KFAC's layers).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

from gaussify.curvature.jacobian import jacobians, resolve_subset
from gaussify.curvature.kron_mha import without_fused_fastpath
from gaussify.curvature.kron_posterior import kron_block_eigh
from gaussify.curvature.subset import ParameterSubset
from gaussify.state import TensorSpec

__all__ = ["EXACT_FULL_MAX", "ExactBlocks"]

#: the largest parameter tensor (in entries) whose exact block is kept full; above, diagonal
EXACT_FULL_MAX = 1024


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

    def update(self, model: nn.Module, x: Tensor, vecs: Tensor) -> None:
        """Add ``sum_{k,n} (v_kn^T J_n)^T (v_kn^T J_n)`` per tensor for the output vectors
        ``vecs (K, N, C)``, in chunks of samples that bound the ``(B, C, P_exact)`` Jacobian."""
        if self.subset is None:
            return
        n, c = x.shape[0], vecs.shape[2]
        rows = max(1, min(n, (1 << 22) // max(1, c * self.subset.num_params)))
        for start in range(0, n, rows):
            sl = slice(start, start + rows)
            with without_fused_fastpath(), warnings.catch_warnings():
                # vmap over attention hits functorch's (correct, slower) batching fallback
                warnings.filterwarnings("ignore", "There is a performance drop because we have")
                jac = jacobians(model, x[sl], self.subset)  # (B, C, P_exact)
            u = torch.einsum("kbc,bcp->kbp", vecs[:, sl].to(jac.dtype), jac).reshape(
                -1, jac.shape[-1]
            )
            for name, part in zip(self.names, u.split(self.numels, dim=-1), strict=True):
                g = self.g[name]
                part = part.to(g.dtype)
                if self.full[name]:
                    g.addmm_(part.mT, part)
                else:
                    g.add_(part.square().sum(0))

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
