"""Full (dense P x P) generalised Gauss-Newton / empirical Fisher curvature.

G = sum_n J_n^T Lambda_n J_n (thesis eq. 2.24, the data term of the Laplace-GGN precision
eq. 3.11) is accumulated as A^T A, one matrix product per chunk, where the rows of A are the
per-sample products (J_n^T L_n)^T with Lambda_n = L_n L_n^T. The posterior precision
A = scale * G + diag(prior) is factorised by Cholesky, or, for a scalar prior, through a cached
eigendecomposition G = V diag(e) V^T so that every marginal-likelihood step costs O(P):
log det A = sum log(scale * e + prior).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from gaussify.curvature.base import (
    GaussNewtonCurvature,
    as_hyperparameter,
    check_offset,
    cholesky_psd,
)
from gaussify.curvature.jacobian import SubsetLike
from gaussify.curvature.lastlayer import OutputLinear, lastlayer_factor_cov
from gaussify.curvature.subset import expand_prior
from gaussify.likelihoods import Likelihood

__all__ = [
    "CholeskyPrecision",
    "EigenPrecision",
    "FullGGN",
    "gram",
]


def gram(products: Tensor) -> Tensor:
    """sum_{n,k} a_{nk} a_{nk}^T for products (B, K, P): one (P, BK) x (BK, P) matmul."""
    flat = products.reshape(-1, products.shape[-1])
    return flat.T @ flat


def _flat_jac(jac: Tensor, num_params: int) -> Tensor:
    if jac.ndim != 3 or jac.shape[-1] != num_params:
        raise ValueError(f"jac: expected shape (N, C, {num_params}), got {tuple(jac.shape)}")
    return jac


class CholeskyPrecision:
    """Dense posterior precision A (P, P) with a lazily computed Cholesky factor A = L L^T."""

    def __init__(self, precision: Tensor) -> None:
        self.precision = precision
        self.num_params = precision.shape[-1]
        self._chol: Tensor | None = None
        self._inv_factor: Tensor | None = None

    @property
    def cholesky(self) -> Tensor:
        if self._chol is None:
            self._chol = cholesky_psd(self.precision)
        return self._chol

    def logdet(self) -> Tensor:
        return 2 * self.cholesky.diagonal().log().sum()

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        # L^{-T} z has covariance L^{-T} L^{-1} = A^{-1}.
        z = torch.randn(
            self.num_params,
            n,
            generator=generator,
            dtype=self.precision.dtype,
            device=self.precision.device,
        )
        return torch.linalg.solve_triangular(self.cholesky.T, z, upper=True).T

    def _whiten(self, jac: Tensor) -> Tensor:
        """L^{-1} J^T, shape (P, N, C)."""
        n, c, p = _flat_jac(jac, self.num_params).shape
        rhs = jac.reshape(n * c, p).T.to(self.precision.dtype)
        return torch.linalg.solve_triangular(self.cholesky, rhs, upper=False).reshape(p, n, c)

    def functional_cov(self, jac: Tensor) -> Tensor:
        w = self._whiten(jac)
        return torch.einsum("pna,pnb->nab", w, w)

    def functional_var(self, jac: Tensor) -> Tensor:
        return self._whiten(jac).square().sum(0)

    def _covariance_factor(self) -> Tensor:
        """L^{-T} (P, P), cached: Sigma = L^{-T} L^{-1} with rows in subset order."""
        if self._inv_factor is None:
            chol = self.cholesky
            eye = torch.eye(self.num_params, dtype=chol.dtype, device=chol.device)
            self._inv_factor = torch.linalg.solve_triangular(chol.mT, eye, upper=True)
        return self._inv_factor

    def functional_cov_lastlayer(self, phi: Tensor, layer: OutputLinear) -> Tensor:
        """J Sigma J^T (N, C, C) from the output layer's features phi (N, D): (J L^{-T})
        (J L^{-T})^T with J L^{-T} formed from phi and row blocks of L^{-T} (no Jacobian)."""
        return lastlayer_factor_cov(phi, self._covariance_factor(), layer)

    def functional_var_lastlayer(self, phi: Tensor, layer: OutputLinear) -> Tensor:
        """diag(J Sigma J^T) (N, C) from features phi (N, D)."""
        return lastlayer_factor_cov(phi, self._covariance_factor(), layer, var_only=True)

    def solve(self, v: Tensor) -> Tensor:
        lead = v.shape[:-1]
        rhs = v.reshape(-1, self.num_params).T.to(self.precision.dtype)
        return torch.cholesky_solve(rhs, self.cholesky).T.reshape(*lead, self.num_params)

    def precision_dense(self) -> Tensor:
        return self.precision

    def covariance_dense(self) -> Tensor:
        return torch.cholesky_inverse(self.cholesky)

    def covariance_diag(self) -> Tensor:
        eye = torch.eye(self.num_params, dtype=self.precision.dtype, device=self.precision.device)
        inv_chol = torch.linalg.solve_triangular(self.cholesky, eye, upper=False)
        return inv_chol.square().sum(0)


class EigenPrecision:
    """A = V diag(scale * e + prior) V^T for G = V diag(e) V^T and a scalar prior.

    Every operation is a product with V and a division by d = scale * e + prior, so log det A
    and its gradient cost O(P) once the eigendecomposition is cached.
    """

    def __init__(
        self, eigenvectors: Tensor, eigenvalues: Tensor, prior: Tensor, scale: Tensor
    ) -> None:
        self.eigenvectors = eigenvectors
        self.num_params = eigenvectors.shape[0]
        self.diag = scale * eigenvalues + prior
        if not bool((self.diag.detach() > 0).all()):
            raise ValueError(
                "posterior precision is not positive definite: scale * eig(G) + prior has "
                f"minimum {float(self.diag.detach().min()):.3g}; the curvature has an eigenvalue "
                f"{float(eigenvalues.min()):.3g} (a GGN is positive semi-definite, so the state "
                "is corrupted or the prior is too small)"
            )

    def logdet(self) -> Tensor:
        return self.diag.log().sum()

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        v = self.eigenvectors
        z = torch.randn(n, self.num_params, generator=generator, dtype=v.dtype, device=v.device)
        return (z * self.diag.rsqrt()) @ v.T

    def functional_cov(self, jac: Tensor) -> Tensor:
        jv = _flat_jac(jac, self.num_params).to(self.eigenvectors.dtype) @ self.eigenvectors
        return torch.einsum("nap,nbp->nab", jv / self.diag, jv)

    def functional_var(self, jac: Tensor) -> Tensor:
        jv = _flat_jac(jac, self.num_params).to(self.eigenvectors.dtype) @ self.eigenvectors
        return (jv.square() / self.diag).sum(-1)

    def functional_cov_lastlayer(self, phi: Tensor, layer: OutputLinear) -> Tensor:
        """J Sigma J^T (N, C, C) from the output layer's features phi (N, D): (J V) diag(1/d)
        (J V)^T with J V formed from phi and row blocks of V (no Jacobian)."""
        return lastlayer_factor_cov(phi, self.eigenvectors, layer, self.diag.reciprocal())

    def functional_var_lastlayer(self, phi: Tensor, layer: OutputLinear) -> Tensor:
        """diag(J Sigma J^T) (N, C) from features phi (N, D)."""
        return lastlayer_factor_cov(
            phi, self.eigenvectors, layer, self.diag.reciprocal(), var_only=True
        )

    def solve(self, v: Tensor) -> Tensor:
        vecs = self.eigenvectors
        return ((v.to(vecs.dtype) @ vecs) / self.diag) @ vecs.T

    def precision_dense(self) -> Tensor:
        return (self.eigenvectors * self.diag) @ self.eigenvectors.T

    def covariance_dense(self) -> Tensor:
        return (self.eigenvectors / self.diag) @ self.eigenvectors.T

    def covariance_diag(self) -> Tensor:
        return (self.eigenvectors.square() / self.diag).sum(-1)


class FullGGN(GaussNewtonCurvature):
    """Dense G = sum_n J_n^T Lambda_n J_n (GGN, thesis eq. 2.24 / 3.11), or the empirical Fisher
    sum_n g_n g_n^T (``ef=True``), or a Monte Carlo GGN (``mc_samples`` > 0).

    Extra option ``eig_cache`` (default True): for a scalar prior precision, :meth:`posterior`
    works from a cached eigendecomposition of G (computed once, lazily), so repeated
    marginal-likelihood evaluations cost O(P) for the log determinant; per-tensor and
    per-parameter priors use a Cholesky factorisation.
    """

    structure: ClassVar[str] = "full"

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood,
        subset: SubsetLike = "all",
        *,
        eig_cache: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, likelihood, subset, **kwargs)
        p = self.num_params
        self.ggn = torch.zeros(p, p, dtype=self.dtype, device=self.device)
        self.eig_cache = eig_cache
        self._eig: tuple[Tensor, Tensor] | None = None

    def _storage_elements(self) -> int:
        return self.num_params**2

    def update(self, model: nn.Module, x: Tensor, y: Tensor, offset: Tensor | None = None) -> None:
        """Add sum over the batch of J_n^T L_n L_n^T J_n, chunk by chunk (L_n at f_n +
        ``offset_n`` when an output offset (N, C) is given)."""
        self._check_batch(model, x, y)
        f, phi = self._forward(model, x, check_offset(offset, x.shape[0]))
        draws = self._draw(f)
        for block in self._products(model, x, y, f, phi, draws):
            flat = block.reshape(-1, block.shape[-1]).to(self.dtype)
            self.ggn.addmm_(flat.T, flat)
        self.num_data += x.shape[0]
        self._eig = None

    def eigendecomposition(self) -> tuple[Tensor, Tensor]:
        """(eigenvalues (P,), eigenvectors (P, P)) of G, cached until the next update."""
        if self._eig is None:
            sym = 0.5 * (self.ggn + self.ggn.T)
            evals, evecs = torch.linalg.eigh(sym)
            self._eig = (evals, evecs)
        return self._eig

    def posterior(
        self, prior_precision: Tensor | float, scale: Tensor | float = 1.0
    ) -> CholeskyPrecision | EigenPrecision:
        """A = scale * G + diag(prior) (thesis eq. 3.11)."""
        prior = as_hyperparameter(prior_precision, "prior_precision", self.ggn)
        scale_t = as_hyperparameter(scale, "scale", self.ggn)
        if self.eig_cache and prior.numel() == 1:
            evals, evecs = self.eigendecomposition()
            return EigenPrecision(evecs, evals, prior.reshape(()), scale_t)
        diag = expand_prior(prior, self.subset)
        return CholeskyPrecision(scale_t * self.ggn + torch.diag(diag))

    def state_dict(self) -> dict[str, Tensor]:
        return {"ggn": self.ggn.clone(), "num_data": torch.tensor(self.num_data)}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        p = self.num_params
        self.ggn = self._check_state_tensor(state, "ggn", (p, p)).clone()
        self._load_num_data(state)
        self._eig = None
