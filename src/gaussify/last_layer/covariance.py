"""Covariance parameterizations of a VBLL variational posterior (Harrison et al. 2024, App. D).

Two layers, as everywhere in gaussify:

* :class:`StructuredCovariance` and its subclasses are plain objects over tensors holding a
  batch of ``K`` positive definite ``D x D`` matrices in a structured form. They answer
  the questions a VBLL bound asks (``quad_form`` phi^T S phi, ``inv_quad`` x^T S^-1 x,
  ``logdet``, ``trace``, ``diagonal``, samples, dense views) at the cost the structure
  allows: O(D^2) per vector for ``Dense`` (App. D.1, ``phi^T S phi = ||L^T phi||^2``) and
  for ``DensePrecision`` (a triangular solve), O(D r) for ``LowRank``, O(D) for ``Diagonal``.
* The ``nn.Module`` s holding the unconstrained parameters, and the registry of names, live in
  :mod:`gaussify.last_layer.parameterization`.

:class:`GaussianRows` is the Gaussian over a weight matrix whose rows are independent, row
``r`` having covariance ``S_{k(r)}``: one shared block is the matrix normal ``MN(W, I, S)``
of App. A, one block per row the mean-field-over-classes posterior of Sec. 3.2.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.linalg import solve_triangular

from gaussify import draws

__all__ = [
    "Dense",
    "DensePrecision",
    "Diagonal",
    "GaussianRows",
    "LowRank",
    "StructuredCovariance",
    "gaussian_kl",
]


def _lead(x: Tensor, trailing: int) -> tuple[tuple[int, ...], Tensor]:
    """Flatten the leading dims of ``x`` (keeping the last ``trailing``) into one batch dim."""
    lead = tuple(x.shape[: x.dim() - trailing])
    return lead, x.reshape(-1, *x.shape[x.dim() - trailing :])


def _tril_solve_sq(tril: Tensor, x: Tensor) -> Tensor:
    """||L_k^-1 x_{b,k}||^2 for ``tril (K, D, D)`` and ``x (B, K, D)`` -> (B, K), O(B K D^2)."""
    rhs = x.permute(1, 2, 0)  # (K, D, B)
    return solve_triangular(tril, rhs, upper=False).square().sum(-2).mT


class StructuredCovariance(ABC):
    """A batch of ``K`` symmetric positive definite ``D x D`` matrices ``S_k``.

    ``quad_form(phi (..., D)) -> (..., K)`` evaluates phi^T S_k phi for one vector shared by
    all blocks (what a last layer needs); ``inv_quad(x (..., K, D)) -> (..., K)`` evaluates
    x_k^T S_k^-1 x_k for one vector per block (Gaussian densities).
    """

    @property
    @abstractmethod
    def covariance(self) -> Tensor:
        """Dense matrices (K, D, D)."""

    @property
    @abstractmethod
    def logdet(self) -> Tensor:
        """log det S_k, (K,)."""

    @property
    @abstractmethod
    def trace(self) -> Tensor:
        """tr S_k, (K,)."""

    @property
    @abstractmethod
    def diagonal(self) -> Tensor:
        """diag S_k, (K, D)."""

    @abstractmethod
    def quad_form(self, phi: Tensor) -> Tensor:
        """phi^T S_k phi for ``phi (..., D)``: (..., K)."""

    @abstractmethod
    def inv_quad(self, x: Tensor) -> Tensor:
        """x_k^T S_k^-1 x_k for ``x (..., K, D)``: (..., K)."""

    @abstractmethod
    def rsample(
        self, sample_shape: tuple[int, ...] = (), generator: torch.Generator | None = None
    ) -> Tensor:
        """Reparameterised zero-mean samples ``(*sample_shape, K, D)`` from N(0, S_k)."""

    @property
    @abstractmethod
    def _ref(self) -> Tensor:
        """A tensor whose dtype/device the structure uses."""

    @property
    def num_blocks(self) -> int:
        return self._ref.shape[0]

    @property
    def dim(self) -> int:
        return self._ref.shape[-1]

    @property
    def scale_tril(self) -> Tensor:
        """Lower Cholesky factors (K, D, D) (O(D^3) unless the structure stores them)."""
        return torch.linalg.cholesky(self.covariance)

    def add(self, other: StructuredCovariance) -> StructuredCovariance:
        """``S_k + T_k`` (blocks broadcast, e.g. one noise matrix for K classes). The result
        keeps the structure where it is closed under addition; otherwise it is ``Dense``
        through one O(K D^3) Cholesky."""
        return Dense(torch.linalg.cholesky(self.covariance + other.covariance))

    def _noise(
        self, shape: tuple[int, ...], generator: torch.Generator | None, dim: int | None = None
    ) -> Tensor:
        ref = self._ref
        size = (*shape, self.num_blocks, self.dim if dim is None else dim)
        return draws.normal(size, dtype=ref.dtype, device=ref.device, generator=generator)


class Dense(StructuredCovariance):
    """S = L L^T from its lower Cholesky factor ``scale_tril (K, D, D)`` (App. D.1)."""

    def __init__(self, scale_tril: Tensor) -> None:
        self._tril = scale_tril

    @property
    def _ref(self) -> Tensor:
        return self._tril

    @property
    def scale_tril(self) -> Tensor:
        return self._tril

    @property
    def covariance(self) -> Tensor:
        return self._tril @ self._tril.mT

    @property
    def logdet(self) -> Tensor:
        return 2.0 * self._tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)

    @property
    def trace(self) -> Tensor:
        # tr(L L^T) = ||L||_F^2 (eq. 80): O(D^2)
        return self._tril.square().sum((-2, -1))

    @property
    def diagonal(self) -> Tensor:
        return self._tril.square().sum(-1)

    def quad_form(self, phi: Tensor) -> Tensor:
        # phi^T L L^T phi = ||L^T phi||^2: one matrix-vector product, O(D^2) per block
        return torch.einsum("...d,kdj->...kj", phi, self._tril).square().sum(-1)

    def inv_quad(self, x: Tensor) -> Tensor:
        lead, flat = _lead(x, 2)
        return _tril_solve_sq(self._tril, flat).reshape(*lead, -1)

    def rsample(
        self, sample_shape: tuple[int, ...] = (), generator: torch.Generator | None = None
    ) -> Tensor:
        return torch.einsum("kij,...kj->...ki", self._tril, self._noise(sample_shape, generator))


class Diagonal(StructuredCovariance):
    """S = diag(var) from ``var (K, D)`` (mean field within each block)."""

    def __init__(self, var: Tensor) -> None:
        self._var = var

    @property
    def _ref(self) -> Tensor:
        return self._var

    @property
    def covariance(self) -> Tensor:
        return torch.diag_embed(self._var)

    @property
    def scale_tril(self) -> Tensor:
        return torch.diag_embed(self._var.sqrt())

    @property
    def logdet(self) -> Tensor:
        return self._var.log().sum(-1)

    @property
    def trace(self) -> Tensor:
        return self._var.sum(-1)

    @property
    def diagonal(self) -> Tensor:
        return self._var

    def quad_form(self, phi: Tensor) -> Tensor:
        return phi.square() @ self._var.mT

    def inv_quad(self, x: Tensor) -> Tensor:
        return (x.square() / self._var).sum(-1)

    def rsample(
        self, sample_shape: tuple[int, ...] = (), generator: torch.Generator | None = None
    ) -> Tensor:
        return self._var.sqrt() * self._noise(sample_shape, generator)

    def add(self, other: StructuredCovariance) -> StructuredCovariance:
        if isinstance(other, Diagonal):
            return Diagonal(self._var + other._var)
        if isinstance(other, LowRank):
            return other.add(self)
        return super().add(other)


class LowRank(StructuredCovariance):
    """S = U U^T + diag(d) from ``factor (K, D, r)`` and ``diag (K, D)``: O(D r) quadratic
    forms, O(D r^2 + r^3) log determinants and solves (matrix determinant lemma, Woodbury)."""

    def __init__(self, factor: Tensor, diag: Tensor) -> None:
        self.factor = factor
        self.diag = diag

    @property
    def _ref(self) -> Tensor:
        return self.diag

    def _capacitance_tril(self) -> Tensor:
        u = self.factor
        cap = u.mT @ (u / self.diag.unsqueeze(-1))
        eye = torch.eye(u.shape[-1], dtype=u.dtype, device=u.device)
        return torch.linalg.cholesky(cap + eye)

    @property
    def covariance(self) -> Tensor:
        return self.factor @ self.factor.mT + torch.diag_embed(self.diag)

    @property
    def logdet(self) -> Tensor:
        cap = self._capacitance_tril()
        return self.diag.log().sum(-1) + 2.0 * cap.diagonal(dim1=-2, dim2=-1).log().sum(-1)

    @property
    def trace(self) -> Tensor:
        return self.diag.sum(-1) + self.factor.square().sum((-2, -1))

    @property
    def diagonal(self) -> Tensor:
        return self.diag + self.factor.square().sum(-1)

    def quad_form(self, phi: Tensor) -> Tensor:
        low = torch.einsum("...d,kdr->...kr", phi, self.factor).square().sum(-1)
        return phi.square() @ self.diag.mT + low

    def inv_quad(self, x: Tensor) -> Tensor:
        # Woodbury: x^T D^-1 x - ||C^-1 U^T D^-1 x||^2 with C C^T = I + U^T D^-1 U
        lead, flat = _lead(x, 2)
        scaled = flat / self.diag
        proj = torch.einsum("bkd,kdr->bkr", scaled, self.factor)
        correction = _tril_solve_sq(self._capacitance_tril(), proj)
        return ((flat * scaled).sum(-1) - correction).reshape(*lead, -1)

    def rsample(
        self, sample_shape: tuple[int, ...] = (), generator: torch.Generator | None = None
    ) -> Tensor:
        low = self._noise(sample_shape, generator, dim=self.factor.shape[-1])
        return torch.einsum("kdr,...kr->...kd", self.factor, low) + self.diag.sqrt() * self._noise(
            sample_shape, generator
        )

    def add(self, other: StructuredCovariance) -> StructuredCovariance:
        if isinstance(other, Diagonal):
            diag = self.diag + other.diagonal
            return LowRank(self.factor.expand(diag.shape[0], -1, -1), diag)
        return super().add(other)


class DensePrecision(StructuredCovariance):
    """S^-1 = L L^T from the lower Cholesky factor of the *precision*, ``precision_tril
    (K, D, D)``. Quadratic forms cost one triangular solve, O(D^2); ``trace`` and
    ``diagonal`` need the triangular inverse, O(D^3) once per evaluation (not per example).
    """

    def __init__(self, precision_tril: Tensor) -> None:
        self.precision_tril = precision_tril

    @property
    def _ref(self) -> Tensor:
        return self.precision_tril

    def _tril_inverse(self) -> Tensor:
        eye = torch.eye(self.dim, dtype=self._ref.dtype, device=self._ref.device)
        return solve_triangular(
            self.precision_tril, eye.expand_as(self.precision_tril), upper=False
        )

    @property
    def covariance(self) -> Tensor:
        return torch.cholesky_inverse(self.precision_tril)

    @property
    def precision(self) -> Tensor:
        return self.precision_tril @ self.precision_tril.mT

    @property
    def logdet(self) -> Tensor:
        return -2.0 * self.precision_tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)

    @property
    def trace(self) -> Tensor:
        return self._tril_inverse().square().sum((-2, -1))

    @property
    def diagonal(self) -> Tensor:
        # S = L^-T L^-1, so S_ii is the squared norm of column i of L^-1
        return self._tril_inverse().square().sum(-2)

    def quad_form(self, phi: Tensor) -> Tensor:
        lead, flat = _lead(phi, 1)
        k = self.num_blocks
        return _tril_solve_sq(self.precision_tril, flat.unsqueeze(1).expand(-1, k, -1)).reshape(
            *lead, k
        )

    def inv_quad(self, x: Tensor) -> Tensor:
        return torch.einsum("...kd,kdj->...kj", x, self.precision_tril).square().sum(-1)

    def rsample(
        self, sample_shape: tuple[int, ...] = (), generator: torch.Generator | None = None
    ) -> Tensor:
        # L^-T eps has covariance L^-T L^-1 = S
        lead, eps = _lead(self._noise(sample_shape, generator), 2)
        out = solve_triangular(self.precision_tril.mT, eps.permute(1, 2, 0), upper=True)
        return out.permute(2, 0, 1).reshape(*lead, self.num_blocks, self.dim)


# --------------------------------------------------------------------------------------------
# Gaussian over the rows of a weight matrix


def gaussian_kl(
    mean: Tensor,
    cov: StructuredCovariance,
    prior_var: float,
    prior_mean: Tensor | float = 0.0,
    mean_weight: Tensor | None = None,
) -> Tensor:
    """sum_r KL(N(mean_r, S_{k(r)}) || N(prior_mean_r, prior_var I)), a scalar.

    ``mean (R, D)``; ``cov`` has one block shared by all rows (the matrix normal KL of
    App. D eq. 81, with its constant) or one block per row. ``mean_weight (R,)`` multiplies
    the mean term: for a Normal-Gamma posterior ``q(w | tau) = N(mean, S / tau)`` against
    ``p(w | tau) = N(0, prior_var / tau I)``, ``E_q[KL]`` is this with ``mean_weight = E[tau]``
    (the traces and log determinants do not depend on tau).
    """
    num_rows, dim = mean.shape
    sq = (mean - prior_mean).square().sum(-1) / prior_var
    if mean_weight is not None:
        sq = sq * mean_weight
    per_block = cov.trace / prior_var - cov.logdet + dim * math.log(prior_var) - dim
    if per_block.shape[0] == 1:
        per_block = per_block.expand(num_rows)
    return 0.5 * (sq + per_block).sum()


@dataclass
class GaussianRows:
    """q(W) for ``W (R, D)`` with independent rows, row ``r ~ N(mean_r, S_{k(r)})``.

    ``cov`` has one block (the matrix normal ``MN(mean, I, S)`` of App. A, shared by all
    rows) or ``R`` blocks (one per row, Sec. 3.2). This is what every head's ``W()`` returns.
    """

    mean: Tensor
    cov: StructuredCovariance

    def _rows(self, per_block: Tensor) -> Tensor:
        return per_block.expand(*per_block.shape[:-1], self.mean.shape[0])

    @property
    def covariance(self) -> Tensor:
        """Dense row covariances (R, D, D)."""
        c = self.cov.covariance
        return c.expand(self.mean.shape[0], -1, -1)

    @property
    def scale_tril(self) -> Tensor:
        return self.cov.scale_tril.expand(self.mean.shape[0], -1, -1)

    def output_moments(self, phi: Tensor) -> tuple[Tensor, Tensor]:
        """Mean ``phi W^T`` and variance ``phi^T S_r phi`` of ``W phi``, each (N, R)."""
        return phi @ self.mean.mT, self._rows(self.cov.quad_form(phi))

    def rsample(
        self, sample_shape: tuple[int, ...] = (), generator: torch.Generator | None = None
    ) -> Tensor:
        """Samples ``(*sample_shape, R, D)``; rows are independent even when they share S."""
        num_rows = self.mean.shape[0]
        if self.cov.num_blocks == 1 and num_rows > 1:
            noise = self.cov.rsample((*sample_shape, num_rows), generator).squeeze(-2)
        else:
            noise = self.cov.rsample(sample_shape, generator)
        return self.mean + noise

    def distribution(self) -> torch.distributions.MultivariateNormal:
        """The rows as a ``torch.distributions.MultivariateNormal`` with batch shape (R,)."""
        return torch.distributions.MultivariateNormal(self.mean, scale_tril=self.scale_tril)

    def kl(
        self, prior_var: float, prior_mean: Tensor | float = 0.0, mean_weight: Tensor | None = None
    ) -> Tensor:
        """KL to the isotropic prior N(prior_mean, prior_var I) per row (see ``gaussian_kl``)."""
        return gaussian_kl(self.mean, self.cov, prior_var, prior_mean, mean_weight)
