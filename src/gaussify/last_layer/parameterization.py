"""Covariance parameterizations of a VBLL posterior as ``nn.Module`` s (Harrison et al. 2024,
App. D): the unconstrained parameters that build a
:class:`~gaussify.last_layer.covariance.StructuredCovariance` on ``forward()``.

``PARAMETERIZATIONS`` maps the names used by the ``vbll`` package (``"dense"``,
``"diagonal"``, ``"lowrank"``, ``"dense_precision"``) to the classes; a new structure is one
new pair (structured covariance + parameter module) registered there. Cholesky factors are
parameterized as ``L = tril(L_d, -1) + diag(exp(m))`` (eq. 78).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn

from gaussify.last_layer.covariance import (
    Dense,
    DensePrecision,
    Diagonal,
    LowRank,
    StructuredCovariance,
)

__all__ = [
    "PARAMETERIZATIONS",
    "CovarianceParameter",
    "DenseParameter",
    "DensePrecisionParameter",
    "DiagonalParameter",
    "LowRankParameter",
    "ParameterizationName",
    "make_covariance",
]

ParameterizationName = Literal["dense", "diagonal", "lowrank", "dense_precision"]


def _tril_from(logdiag: Tensor, offdiag: Tensor) -> Tensor:
    """L = tril(L_d, -1) + diag(exp(m)) (eq. 78)."""
    return torch.tril(offdiag, diagonal=-1) + torch.diag_embed(logdiag.exp())


class CovarianceParameter(nn.Module, ABC):
    """Unconstrained parameters of ``num_blocks`` covariances over R^dim; ``forward()`` returns
    the :class:`StructuredCovariance`. Initialised at ``init_var * I``."""

    name: ClassVar[str]

    def __init__(self, num_blocks: int, dim: int, init_var: float, rank: int | None = None):
        super().__init__()
        self.num_blocks, self.dim = num_blocks, dim

    @abstractmethod
    def forward(self) -> StructuredCovariance: ...

    @abstractmethod
    def set_covariance(self, cov: Tensor) -> None:
        """Set the parameters from dense matrices ``cov (K, D, D)``: exactly where the
        structure can represent them, otherwise the structure's natural projection."""


class DenseParameter(CovarianceParameter):
    """``"dense"``: Cholesky factor of the covariance (App. D, eq. 78)."""

    name = "dense"

    def __init__(self, num_blocks: int, dim: int, init_var: float, rank: int | None = None):
        super().__init__(num_blocks, dim, init_var)
        self.logdiag = nn.Parameter(torch.full((num_blocks, dim), 0.5 * math.log(init_var)))
        self.offdiag = nn.Parameter(torch.zeros(num_blocks, dim, dim))

    def forward(self) -> Dense:
        return Dense(_tril_from(self.logdiag, self.offdiag))

    @torch.no_grad()
    def set_covariance(self, cov: Tensor) -> None:
        tril = torch.linalg.cholesky(cov.to(self.logdiag))
        self.logdiag.copy_(tril.diagonal(dim1=-2, dim2=-1).log())
        self.offdiag.copy_(torch.tril(tril, diagonal=-1))


class DiagonalParameter(CovarianceParameter):
    """``"diagonal"``: log standard deviations."""

    name = "diagonal"

    def __init__(self, num_blocks: int, dim: int, init_var: float, rank: int | None = None):
        super().__init__(num_blocks, dim, init_var)
        self.logdiag = nn.Parameter(torch.full((num_blocks, dim), 0.5 * math.log(init_var)))

    def forward(self) -> Diagonal:
        return Diagonal(torch.exp(2.0 * self.logdiag))

    @torch.no_grad()
    def set_covariance(self, cov: Tensor) -> None:
        """Keeps the diagonal of ``cov``."""
        self.logdiag.copy_(0.5 * cov.to(self.logdiag).diagonal(dim1=-2, dim2=-1).log())


class LowRankParameter(CovarianceParameter):
    """``"lowrank"``: factor ``U (D, rank)`` and log standard deviations of the diagonal.

    The factor starts small and random: at ``U = 0`` every gradient with respect to ``U``
    vanishes (a saddle point), so a zero start would never leave the diagonal.
    """

    name = "lowrank"

    def __init__(self, num_blocks: int, dim: int, init_var: float, rank: int | None = None):
        super().__init__(num_blocks, dim, init_var)
        if rank is None or isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(
                f"cov_rank: parameterization 'lowrank' needs a positive integer rank, got {rank!r}"
            )
        if rank > dim:
            raise ValueError(f"cov_rank: must be <= in_features ({dim}), got {rank}")
        self.rank = rank
        self.logdiag = nn.Parameter(torch.full((num_blocks, dim), 0.5 * math.log(init_var)))
        self.factor = nn.Parameter(1e-2 * math.sqrt(init_var) * torch.randn(num_blocks, dim, rank))

    def forward(self) -> LowRank:
        return LowRank(self.factor, torch.exp(2.0 * self.logdiag))

    @torch.no_grad()
    def set_covariance(self, cov: Tensor) -> None:
        """Top-``rank`` eigenvectors above the mean remaining eigenvalue, plus the residual
        diagonal (exact when ``cov`` is low rank plus isotropic)."""
        cov = cov.to(self.logdiag)
        evals, evecs = torch.linalg.eigh(cov)
        top_vals, top_vecs = evals[..., -self.rank :], evecs[..., -self.rank :]
        rest = evals[..., : -self.rank]
        floor = rest.mean(-1, keepdim=True) if rest.shape[-1] else 0.5 * evals[..., :1]
        factor = top_vecs * (top_vals - floor).clamp_min(0.0).sqrt().unsqueeze(-2)
        resid = (cov - factor @ factor.mT).diagonal(dim1=-2, dim2=-1)
        tiny = 1e-6 * evals.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        self.factor.copy_(factor)
        self.logdiag.copy_(0.5 * resid.clamp_min(tiny).log())


class DensePrecisionParameter(CovarianceParameter):
    """``"dense_precision"``: Cholesky factor of the precision S^-1 (the natural-scale
    counterpart of ``"dense"``; the form the ``vbll`` package calls ``DenseNormalPrec``)."""

    name = "dense_precision"

    def __init__(self, num_blocks: int, dim: int, init_var: float, rank: int | None = None):
        super().__init__(num_blocks, dim, init_var)
        self.logdiag = nn.Parameter(torch.full((num_blocks, dim), -0.5 * math.log(init_var)))
        self.offdiag = nn.Parameter(torch.zeros(num_blocks, dim, dim))

    def forward(self) -> DensePrecision:
        return DensePrecision(_tril_from(self.logdiag, self.offdiag))

    @torch.no_grad()
    def set_covariance(self, cov: Tensor) -> None:
        tril = torch.linalg.cholesky(torch.linalg.inv(cov.to(self.logdiag)))
        self.logdiag.copy_(tril.diagonal(dim1=-2, dim2=-1).log())
        self.offdiag.copy_(torch.tril(tril, diagonal=-1))


PARAMETERIZATIONS: dict[str, type[CovarianceParameter]] = {
    cls.name: cls
    for cls in (DenseParameter, DiagonalParameter, LowRankParameter, DensePrecisionParameter)
}


def make_covariance(
    parameterization: str, num_blocks: int, dim: int, init_var: float, rank: int | None = None
) -> CovarianceParameter:
    """Build the registered :class:`CovarianceParameter` for ``parameterization``."""
    if parameterization not in PARAMETERIZATIONS:
        raise ValueError(
            f"parameterization: expected one of {sorted(PARAMETERIZATIONS)}, "
            f"got {parameterization!r}"
        )
    return PARAMETERIZATIONS[parameterization](num_blocks, dim, init_var, rank)
