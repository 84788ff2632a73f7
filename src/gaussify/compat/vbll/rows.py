"""The Gaussian over the rows of a VBLL weight matrix, with the ``vbll`` package's meaning of
its parameters (so that a vbll checkpoint means the same here).

Row ``k`` of ``W (out, D)`` is ``N(W_mean[k], S_k)`` with ``S_k`` from ``W_logdiag`` (``d``) and
``W_offdiag`` (``O``) by ``parameterization``:

* ``"diagonal"``: ``S_k = diag(exp(d_k))^2`` (``exp(d)`` is a standard deviation);
* ``"dense"``: ``S_k = L_k L_k^T``, ``L_k = tril(O_k, -1) + diag(exp(d_k))`` (covariance Cholesky);
* ``"dense_precision"``: ``S_k = (L_k L_k^T)^-1`` with the same ``L_k`` (precision Cholesky);
* ``"lowrank"``: ``S_k = O_k O_k^T + diag(exp(d_k))`` (``exp(d)`` is a variance).

The layers need, per row, the quadratic form ``x^T S_k x``, ``tr S_k`` and ``log det S_k``; the
Gaussian of ``W x`` has standard deviation ``sqrt(max(x^T S_k x, 1e-12))`` (vbll's floor).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, distributions

__all__ = ["PARAMETERIZATIONS", "Normal", "Rows", "expected_gaussian_kl", "gaussian_kl"]

PARAMETERIZATIONS = ("dense", "diagonal", "lowrank", "dense_precision")
FLOOR = 1e-12


class Normal(distributions.Normal):
    """A diagonal Gaussian with the moment names vbll's predictives expose."""

    @property
    def var(self) -> Tensor:
        return self.scale**2

    @property
    def covariance_diagonal(self) -> Tensor:
        return self.var

    @property
    def covariance(self) -> Tensor:
        return torch.diag_embed(self.var)

    @property
    def chol_covariance(self) -> Tensor:
        return torch.diag_embed(self.scale)

    @property
    def precision(self) -> Tensor:
        return torch.diag_embed(1 / self.var)

    @property
    def trace_covariance(self) -> Tensor:
        return self.var.sum(-1)

    @property
    def trace_precision(self) -> Tensor:
        return (1 / self.var).sum(-1)

    @property
    def logdet_precision(self) -> Tensor:
        return -2 * self.scale.log().sum(-1)

    @property
    def logdet_covariance(self) -> Tensor:
        return 2 * self.scale.log().sum(-1)

    def plus(self, other: Normal) -> Normal:
        """The sum of two independent Gaussians (variances add, floored as vbll does)."""
        var = (self.var + other.var).clamp_min(FLOOR)
        return Normal(self.loc + other.loc, var.sqrt())


def check_parameterization(value: str, allowed: tuple[str, ...] = PARAMETERIZATIONS) -> str:
    if value not in allowed:
        raise ValueError(f"parameterization: expected one of {list(allowed)}, got {value!r}")
    return value


class Rows:
    """q(W) for the parameterization above, built from the layer's parameter tensors."""

    def __init__(self, kind: str, mean: Tensor, logdiag: Tensor, offdiag: Tensor | None) -> None:
        self.kind, self.mean, self.logdiag, self.offdiag = kind, mean, logdiag, offdiag

    def _tril(self) -> Tensor:
        assert self.offdiag is not None
        return torch.tril(self.offdiag, diagonal=-1) + torch.diag_embed(self.logdiag.exp())

    def quad(self, x: Tensor) -> Tensor:
        """``x_n^T S_k x_n`` for ``x (N, D)``: (N, out)."""
        if self.kind == "diagonal":
            return x.square() @ (2 * self.logdiag).exp().T
        if self.kind == "lowrank":
            assert self.offdiag is not None
            low = torch.einsum("kdr,nd->nkr", self.offdiag, x).square().sum(-1)
            return x.square() @ self.logdiag.exp().T + low
        tril = self._tril()
        if self.kind == "dense":
            return torch.einsum("kdj,nd->nkj", tril, x).square().sum(-1)
        # dense_precision: x^T (L L^T)^-1 x = |L^-1 x|^2
        rhs = x.T.unsqueeze(0).expand(tril.shape[0], -1, -1)
        sol = torch.linalg.solve_triangular(tril, rhs, upper=False)  # (out, D, N)
        return sol.square().sum(1).T

    def trace(self) -> Tensor:
        """``tr S_k``: (out,)."""
        if self.kind == "diagonal":
            return (2 * self.logdiag).exp().sum(-1)
        if self.kind == "lowrank":
            assert self.offdiag is not None
            return self.logdiag.exp().sum(-1) + self.offdiag.square().sum((-1, -2))
        tril = self._tril()
        if self.kind == "dense":
            return tril.square().sum((-1, -2))
        eye = torch.eye(tril.shape[-1], dtype=tril.dtype).expand_as(tril)
        return torch.linalg.solve_triangular(tril, eye, upper=False).square().sum((-1, -2))

    def logdet(self) -> Tensor:
        """``log det S_k``: (out,)."""
        if self.kind in ("diagonal", "dense"):
            return 2 * self.logdiag.sum(-1)
        if self.kind == "dense_precision":
            return -2 * self.logdiag.sum(-1)
        assert self.offdiag is not None
        diag = self.logdiag.exp()
        inner = self.offdiag.mT @ (self.offdiag / diag.unsqueeze(-1))
        eye = torch.eye(inner.shape[-1], dtype=inner.dtype)
        return self.logdiag.sum(-1) + torch.logdet(inner + eye)

    @property
    def covariance(self) -> Tensor:
        """Dense ``S_k`` (out, D, D)."""
        if self.kind == "diagonal":
            return torch.diag_embed((2 * self.logdiag).exp())
        if self.kind == "lowrank":
            assert self.offdiag is not None
            return self.offdiag @ self.offdiag.mT + torch.diag_embed(self.logdiag.exp())
        tril = self._tril()
        if self.kind == "dense":
            return tril @ tril.mT
        return torch.linalg.inv(tril @ tril.mT)

    @property
    def chol_covariance(self) -> Tensor:
        """Lower Cholesky factor of ``S_k`` (out, D, D)."""
        if self.kind == "dense":
            return self._tril()
        return torch.linalg.cholesky(self.covariance)

    @property
    def trace_covariance(self) -> Tensor:
        return self.trace()

    @property
    def logdet_covariance(self) -> Tensor:
        return self.logdet()

    def __matmul__(self, x: Tensor) -> Normal:
        """The Gaussian of ``W x_n`` for ``x (N, D)``: mean (N, out), floored std."""
        return Normal(x @ self.mean.T, self.quad(x).clamp_min(FLOOR).sqrt())

    def distribution(self) -> Any:
        """The torch distribution over the rows (for weight samples)."""
        if self.kind == "diagonal":
            return Normal(self.mean, self.logdiag.exp())
        if self.kind == "lowrank":
            assert self.offdiag is not None
            return distributions.LowRankMultivariateNormal(
                self.mean, self.offdiag, self.logdiag.exp()
            )
        tril = self._tril()
        if self.kind == "dense":
            return distributions.MultivariateNormal(self.mean, scale_tril=tril)
        return distributions.MultivariateNormal(
            self.mean, precision_matrix=tril @ tril.mT, validate_args=False
        )

    def rsample(self) -> Tensor:
        return self.distribution().rsample()


def gaussian_kl(rows: Rows, prior_var: float) -> Tensor:
    """KL(q(W) || N(0, prior_var I)) without its constant: 1/2 sum_k [|m_k|^2 / s +
    tr S_k / s + D log s - log det S_k]."""
    d = rows.mean.shape[-1]
    return 0.5 * (
        rows.mean.square().sum() / prior_var
        + (rows.trace() / prior_var).sum()
        + (d * math.log(prior_var) - rows.logdet()).sum()
    )


def expected_gaussian_kl(rows: Rows, prior_var: float, factor: Tensor) -> Tensor:
    """The KL above with row k's mean term weighted by ``factor[..., k]`` (an expected noise
    precision; vbll weights only the mean term); ``factor`` (out,) or (N, out) gives a scalar
    or (N,)."""
    d = rows.mean.shape[-1]
    mean_term = (factor * rows.mean.square().sum(-1) / prior_var).sum(-1)
    rest = (rows.trace() / prior_var).sum() + (d * math.log(prior_var) - rows.logdet()).sum()
    return 0.5 * (mean_term + rest)
