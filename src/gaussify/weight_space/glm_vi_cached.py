"""GLM VI with the Jacobians at the MAP computed once (Immer, Korzepa & Bauer 2021, "GLM VI").

In the GLM linearised at theta*, f_lin(x; theta) = f(x; theta*) + J*(x) (theta - theta*), every
NGVI step of :class:`~gaussify.weight_space.glm_vi.GLMVI` needs the GGN
sum_s sum_n J*_n^T Lambda(f_{s,n}) J*_n over its S draws theta_s ~ q_t, where only the output
Hessians Lambda change from step to step: J* is the same matrix every time. The generic engine
recomputes J* for all S x N rows each step and forms S x N rank-C products. Here J* (N, C, P)
and f* = f(x; theta*) are computed once (:meth:`CachedGLMVI.cache`), and a step's GGN is

    sum_n J*_n^T M_n J*_n,   M_n = sum_s Lambda(f*_n + J*_n (theta_s - theta*))   (C x C),

one product over N rows whatever S is: M_n = V diag(e) V^T (eigenvalues clamped at 0, M_n is
positive semi-definite) gives the factor L_n = V diag(sqrt e) and the GGN is
(L^T J*)^T (L^T J*), a symmetric rank-NC update. The result is the same matrix as the generic
path's (up to round-off), so each step equals a :class:`GLMVI` step; the mean update, the
diagonal structure's safeguard and the predictive are the engine's.

It needs the full training set in memory and full-batch steps on it (``step(data)`` with the
cached ``data``): the memory is N C P numbers for J* (in the dtype the GGN is held in).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor, nn

from gaussify.curvature.full import mirror_lower_, syrk_lower_
from gaussify.curvature.jacobian import jacobians
from gaussify.model_checks import in_eval_mode
from gaussify.state import transactional
from gaussify.validation import check_inputs, check_targets
from gaussify.weight_space.glm_vi import GLMVI
from gaussify.weight_space.ngvi_math import blend_curvature

__all__ = ["CachedGLMVI"]


def _blocks(num_params: int, count: int = 8) -> list[tuple[int, int]]:
    """``count`` near-equal column blocks of [0, num_params) for :func:`syrk_lower_`."""
    count = min(count, num_params)
    edges = [round(i * num_params / count) for i in range(count + 1)]
    return [(a, b) for a, b in itertools.pairwise(edges) if b > a]


class _CachedGGN:
    """Stands in for the engine's per-step curvature: ``update(model, x, y, offset)`` with
    ``x`` the cached inputs repeated k times (the engine's S draws) adds the GGN of those
    rows with Lambda at f* + offset, from the cached J*."""

    def __init__(self, owner: CachedGLMVI) -> None:
        self.owner = owner
        self.key = "ggn" if owner.structure == "full" else "ggn_diag"
        template = owner._holder.state_dict()[self.key]
        self.value = torch.zeros_like(template)
        self.num_data = 0

    def update(self, model: nn.Module, x: Tensor, y: Tensor, offset: Tensor | None = None) -> None:
        owner = self.owner
        assert owner._x is not None and owner._jac is not None and owner._f is not None
        n = owner._x.shape[0]
        rows = x.shape[0]
        if rows % n or not torch.equal(x.reshape(rows // n, *owner._x.shape)[0], owner._x):
            raise ValueError(
                "batch: CachedGLMVI takes full-batch steps on the data it cached "
                f"({n} rows); got {rows} rows that are not those data"
            )
        k = rows // n
        f = owner._f.repeat(k, 1)
        if offset is not None:
            f = f + offset.to(f.dtype)
        hess = owner.likelihood.hessian(f).reshape(k, n, f.shape[1], f.shape[1]).sum(0)
        evals, evecs = torch.linalg.eigh(hess.to(owner._jac.dtype))
        factor = evecs * evals.clamp_min(0.0).sqrt().unsqueeze(-2)  # M_n = L_n L_n^T
        flat = torch.einsum("ncd,ncp->ndp", factor, owner._jac).reshape(-1, owner._jac.shape[-1])
        if self.key == "ggn":
            blocks = _blocks(flat.shape[1])
            syrk_lower_(self.value, flat.to(self.value.dtype), blocks)
            mirror_lower_(self.value, blocks)
        else:
            self.value += flat.square().sum(0).to(self.value.dtype)
        self.num_data += rows

    def state_dict(self) -> dict[str, Tensor]:
        return {
            self.key: self.value,
            "num_data": torch.tensor(self.num_data, device=self.value.device),
        }


class CachedGLMVI(GLMVI):
    """:class:`~gaussify.weight_space.glm_vi.GLMVI` with J* and f* cached over the training
    set (module docstring); structures "full" and "diag". Same arguments as
    :class:`GLMVI`; call :meth:`init_laplace` (or :meth:`cache`) with the full data ``(x, y)``,
    then :meth:`step` with the same ``(x, y)``."""

    def __init__(self, model: nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(model, *args, **kwargs)
        if self.structure not in ("full", "diag"):
            raise ValueError(
                f"structure: CachedGLMVI supports 'full' and 'diag', got {self.structure!r}"
            )
        self._x: Tensor | None = None
        self._jac: Tensor | None = None
        self._f: Tensor | None = None

    @in_eval_mode
    def cache(self, data: tuple[Tensor, Tensor]) -> CachedGLMVI:
        """Compute J* (N, C, P) and f* = f(x; theta*) on the full data ``(x, y)`` (the model
        at theta*); later steps reuse them. Returns ``self``."""
        x, y = data
        check_inputs(x, self.model)
        check_targets(y, self.task, name="y", num_rows=x.shape[0])
        self.model.eval()
        wide = self._holder.state_dict()["ggn" if self.structure == "full" else "ggn_diag"].dtype
        with torch.no_grad():
            f = self.model(x).detach()
        self._jac = jacobians(self.model, x, self.subset).to(wide)
        self._f, self._x = f, x
        return self

    def _new_curvature(self) -> Any:
        if self._jac is None:
            raise RuntimeError("CachedGLMVI: call init_laplace(data) or cache(data) first")
        return _CachedGGN(self)

    @transactional
    @in_eval_mode
    def init_laplace(self, data: tuple[Tensor, Tensor], batch_size: int = 256) -> CachedGLMVI:  # type: ignore[override]
        """Cache J* and f* on ``data`` and set q_0 to the GLM Laplace posterior
        N(theta*, (P0 + G(theta*))^-1), as :meth:`GLMVI.init_laplace` (``batch_size`` is
        unused: the GGN is one product over the cached rows). Returns ``self``."""
        x, y = data
        if self._x is None or not (self._x.shape == x.shape and torch.equal(self._x, x)):
            self.cache((x, y))
        curvature = self._new_curvature()
        curvature.update(self.model, x, y)
        self.num_data = int(x.shape[0])
        self._state = blend_curvature(
            self.structure, self._state, curvature.state_dict(), 1.0, self.num_data
        )
        assert self.theta_lin is not None
        self.mean = self.theta_lin.clone()
        self._write(self.mean)
        self._posterior = None
        return self
