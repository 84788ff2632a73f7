"""Low-rank + diagonal generalised Gauss-Newton curvature.

G ≈ U diag(s) U^T + diag(d) with the top-k eigenpairs (U, s) of G = sum_n J_n^T Lambda_n J_n
(thesis eq. 2.24) found by matrix-free Lanczos (``scipy.sparse.linalg.eigsh`` on a
``LinearOperator``) whose matrix-vector product is G v = sum_n J_n^T M_n (J_n v): one forward-mode
``torch.func.jvp`` and one reverse-mode ``vjp`` per chunk, so neither G nor any Jacobian over the
data set is formed. The diagonal remainder d = diag(G) - diag(U diag(s) U^T) >= 0 keeps the exact
diagonal of G ("low-rank + diagonal"). The posterior precision
A = scale * G + diag(prior) = D + W W^T with D = scale * d + prior and W = U sqrt(scale * s) is
handled with the Woodbury identity and the matrix determinant lemma in O(P k^2).

Lanczos needs several passes over the data, so :meth:`LowRankGGN.update` keeps the batches
(inputs, or the final-layer features on the last-layer path) and the eigenpairs are computed
lazily on the first call that needs them, at the parameters seen by the first update (changing
the subset's parameters in between raises). A rank >= P uses a dense eigendecomposition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from scipy.sparse.linalg import LinearOperator, eigsh
from torch import Tensor, nn

from gaussify import draws
from gaussify.curvature.base import (
    GaussNewtonCurvature,
    as_hyperparameter,
    check_offset,
    cholesky_psd,
)
from gaussify.curvature.full import FULL_ALTERNATIVES, gram
from gaussify.curvature.jacobian import (
    SubsetLike,
    auto_chunk_size,
    chunk_slices,
    jvp_with_outputs,
    vjp,
)
from gaussify.curvature.lastlayer import (
    OutputLinear,
    lastlayer_factor_cov,
    lastlayer_jvp,
    lastlayer_num_outputs,
    lastlayer_vjp,
)
from gaussify.curvature.subset import expand_prior
from gaussify.likelihoods import Likelihood
from gaussify.memory_guard import check_allocation
from gaussify.state import (
    Integer,
    TensorSpec,
)

__all__ = ["LowRankGGN", "LowRankPrecision", "diag_remainder", "top_eigenpairs"]


def top_eigenpairs(
    matvec: Any,
    num_params: int,
    rank: int,
    *,
    v0: Tensor,
    tol: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Top-``rank`` eigenpairs of a symmetric PSD operator by Lanczos (ARPACK ``eigsh``).

    ``matvec`` maps a float64 (P,) tensor to (P,); returns (eigenvalues (k,) descending and
    clamped at 0, eigenvectors (P, k)) in float64.
    """

    def mv(v: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float64).reshape(-1))
        return matvec(t).detach().to(device="cpu", dtype=torch.float64).numpy()

    op = LinearOperator((num_params, num_params), matvec=mv, dtype=np.float64)
    vals, vecs = eigsh(op, k=rank, which="LA", v0=v0.double().cpu().numpy(), tol=tol)
    order = np.argsort(vals)[::-1]
    evals = torch.from_numpy(vals[order].copy()).clamp_min(0.0)
    evecs = torch.from_numpy(vecs[:, order].copy())
    return evals, evecs


def diag_remainder(ggn_diag: Tensor, eigenvectors: Tensor, eigenvalues: Tensor) -> Tensor:
    """d = diag(G) - diag(U diag(s) U^T), clamped at 0 (it is >= 0 in exact arithmetic)."""
    return (ggn_diag - (eigenvectors.square() * eigenvalues).sum(-1)).clamp_min(0.0)


class LowRankPrecision:
    """A = D + W W^T with diagonal D (P,) and W (P, k); Woodbury for solves and samples,
    the matrix determinant lemma for log det A = sum log D + log det(I + W^T D^{-1} W)."""

    def __init__(
        self, diag: Tensor, factor: Tensor, *, wide: tuple[Tensor, Tensor] | None = None
    ) -> None:
        if not bool((diag.detach() > 0).all()):
            raise ValueError(
                "posterior precision is not positive definite: scale * diag remainder + prior "
                f"has minimum {float(diag.detach().min()):.3g}"
            )
        self.diag = diag
        self.factor = factor
        self.num_params = diag.shape[0]
        k = factor.shape[1]
        self._scaled = factor / diag.unsqueeze(-1)  # D^{-1} W
        eye = torch.eye(k, dtype=diag.dtype, device=diag.device)
        self._chol = cholesky_psd(eye + factor.T @ self._scaled, "low-rank capacitance matrix")
        self._correction_factor: Tensor | None = None
        #: (D, W) formed in float64 for a float32 model, for the evidence (logdet_wide,
        #: solve_wide): its correction cancels against the prior term at large priors
        self._wide_parts = wide
        self._wide: LowRankPrecision | None = None

    def logdet(self) -> Tensor:
        return self.diag.log().sum() + 2 * self._chol.diagonal().log().sum()

    def _wide_precision(self) -> LowRankPrecision:
        if self._wide_parts is None:
            return self
        if self._wide is None:
            self._wide = LowRankPrecision(*self._wide_parts)
        return self._wide

    def logdet_wide(self) -> Tensor:
        """log det A from the float64 parts where there are some."""
        return self._wide_precision().logdet()

    def solve_wide(self, v: Tensor) -> Tensor:
        """A^-1 v from the float64 parts where there are some."""
        return self._wide_precision().solve(v)

    def _capacitance_solve(self, rhs: Tensor) -> Tensor:
        return torch.cholesky_solve(rhs, self._chol)

    def solve(self, v: Tensor) -> Tensor:
        lead = v.shape[:-1]
        flat = v.reshape(-1, self.num_params).to(self.diag.dtype)
        correction = self._capacitance_solve(self._scaled.T @ flat.T).T @ self._scaled.T
        return (flat / self.diag - correction).reshape(*lead, self.num_params)

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        # eps = D^{1/2} z1 + W z2 ~ N(0, A); A^{-1} eps ~ N(0, A^{-1}).
        d = self.diag
        z1 = draws.normal((n, self.num_params), dtype=d.dtype, device=d.device, generator=generator)
        z2 = draws.normal(
            (n, self.factor.shape[1]), dtype=d.dtype, device=d.device, generator=generator
        )
        return self.solve(z1 * d.sqrt() + z2 @ self.factor.T)

    def _jac(self, jac: Tensor) -> Tensor:
        if jac.ndim != 3 or jac.shape[-1] != self.num_params:
            raise ValueError(
                f"jac: expected shape (N, C, {self.num_params}), got {tuple(jac.shape)}"
            )
        return jac.to(self.diag.dtype)

    def _whitened(self, jac: Tensor) -> Tensor:
        """L_K^{-1} W^T D^{-1} J^T reshaped (k, N, C)."""
        n, c, _ = jac.shape
        b = (jac @ self._scaled).reshape(n * c, -1)  # J D^{-1} W
        return torch.linalg.solve_triangular(self._chol, b.T, upper=False).reshape(-1, n, c)

    def functional_cov(self, jac: Tensor) -> Tensor:
        jac = self._jac(jac)
        y = self._whitened(jac)
        return torch.einsum("nap,nbp->nab", jac / self.diag, jac) - torch.einsum(
            "kna,knb->nab", y, y
        )

    def functional_var(self, jac: Tensor) -> Tensor:
        jac = self._jac(jac)
        return (jac.square() / self.diag).sum(-1) - self._whitened(jac).square().sum(0)

    def _correction(self) -> Tensor:
        """S^T (P, k) with Sigma = D^{-1} - S^T S, S = L_K^{-1} W^T D^{-1} (cached)."""
        if self._correction_factor is None:
            s = torch.linalg.solve_triangular(self._chol, self._scaled.T, upper=False)
            self._correction_factor = s.T.contiguous()
        return self._correction_factor

    def functional_var_lastlayer(self, phi: Tensor, layer: OutputLinear) -> Tensor:
        """diag(J Sigma J^T) (N, C) from the output layer's features phi (N, D): the diagonal
        part (phi^2) D^{-1} minus ||J_n S^T||^2 row-wise. O(N C D k)."""
        c = lastlayer_num_outputs(self.num_params, phi.shape[1], layer)
        phi = phi.to(self.diag.dtype)
        diag = lastlayer_jvp(phi.square(), self.diag.reciprocal(), c, layer)
        return diag - lastlayer_factor_cov(phi, self._correction(), layer, var_only=True)

    def functional_cov_lastlayer(self, phi: Tensor, layer: OutputLinear) -> Tensor:
        """J Sigma J^T (N, C, C) from features phi (N, D) by Woodbury: diag((phi^2) D^{-1})
        minus (J S^T)(J S^T)^T with J S^T formed from phi (no Jacobian). O(N C D k + N C^2 k)."""
        c = lastlayer_num_outputs(self.num_params, phi.shape[1], layer)
        phi = phi.to(self.diag.dtype)
        diag = lastlayer_jvp(phi.square(), self.diag.reciprocal(), c, layer)
        return torch.diag_embed(diag) - lastlayer_factor_cov(phi, self._correction(), layer)

    def precision_dense(self) -> Tensor:
        return torch.diag(self.diag) + self.factor @ self.factor.T

    def covariance_dense(self) -> Tensor:
        inner = torch.cholesky_inverse(self._chol)
        return torch.diag(1.0 / self.diag) - self._scaled @ inner @ self._scaled.T

    def covariance_diag(self) -> Tensor:
        y = torch.linalg.solve_triangular(self._chol, self._scaled.T, upper=False)
        return 1.0 / self.diag - y.square().sum(0)


@dataclass
class _Batch:
    """What a GGN-vector product needs again: inputs (generic path) or features, outputs,
    targets and, for Monte Carlo, the sampled labels."""

    x: Tensor | None
    phi: Tensor | None
    f: Tensor
    y: Tensor
    draws: Tensor | None


class LowRankGGN(GaussNewtonCurvature):
    """Top-``rank`` eigenpairs of the GGN (thesis eq. 2.24) by Lanczos, plus the diagonal
    remainder (``diag_remainder=True``). Supports ``ef=True`` and ``mc_samples`` like the other
    structures (the middle matrix becomes r r^T or the sampled estimate of Lambda).

    Extra options: ``rank`` (k, default 20), ``diag_remainder`` (default True), ``tol`` (Lanczos
    relative tolerance, 0 = machine precision).
    """

    structure: ClassVar[str] = "lowrank"

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood,
        subset: SubsetLike = "all",
        *,
        rank: int = 20,
        diag_remainder: bool = True,
        tol: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, likelihood, subset, **kwargs)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank: expected a positive integer, got {rank!r}")
        self.rank = rank
        self.use_diag_remainder = diag_remainder
        self.tol = float(tol)
        self.ggn_diag = torch.zeros(self.num_params, dtype=self.dtype, device=self.device)
        self._model: nn.Module | None = None
        self._reference: Tensor | None = None
        self._batches: list[_Batch] = []
        self._eig: tuple[Tensor, Tensor] | None = None
        self._loaded = False

    # -- accumulation --------------------------------------------------------------------

    def update(self, model: nn.Module, x: Tensor, y: Tensor, offset: Tensor | None = None) -> None:
        """Record the batch for the Lanczos passes and add its exact diagonal (Lambda at
        f + ``offset`` when an output offset (N, C) is given)."""
        if self._loaded:
            raise ValueError(
                "update: this low-rank GGN was loaded from a state_dict; its eigenpairs cannot "
                "be extended with new data (build a new one and update it with all data)"
            )
        self._check_batch(model, x, y)
        offset = check_offset(offset, x.shape[0])
        if self._model is not None and model is not self._model:
            raise ValueError("model: a low-rank GGN accumulates batches of one model object")
        self._check_unchanged()
        # Transactional: everything is computed first and the state changes only once the
        # batch succeeded (``_diag_batch`` adds into ``ggn_diag`` after its own checks).
        if self.use_diag_remainder:
            _, f, phi, draws = self._diag_batch(model, x, y, offset, out=self.ggn_diag)
        else:
            f, phi = self._forward(model, x, offset)
            draws = self._draw(f)
        if self._model is None:
            self._model = model
            self._reference = self.subset.flatten(self.subset.params(model)).clone()
        on_features = phi is not None and self._layer is not None
        self._batches.append(
            _Batch(x=None if on_features else x.detach(), phi=phi, f=f, y=y, draws=draws)
        )
        self.num_data += x.shape[0]
        self._eig = None

    def _check_unchanged(self) -> None:
        if self._model is None or self._reference is None:
            return
        current = self.subset.flatten(self.subset.params(self._model))
        if not torch.equal(current, self._reference):
            raise ValueError(
                "model: the subset's parameters changed since the first update(); a low-rank "
                "GGN is computed at one set of parameters (refit it after training)"
            )

    def ggn_matvec(self, v: Tensor) -> Tensor:
        """G v = sum_n J_n^T L_n L_n^T J_n v over the recorded batches, shape (P,)."""
        if self._model is None:
            raise ValueError("update: no data has been added; call update() first")
        v = v.to(dtype=self.dtype, device=self.device)
        out = torch.zeros(self.num_params, dtype=self.dtype, device=self.device)
        for b in self._batches:
            n, c = b.f.shape
            k = self._num_factors(c)
            chunk = auto_chunk_size(n, c * k, self.chunk_size)
            for sl in chunk_slices(n, chunk):
                if b.phi is not None and self._layer is not None:
                    jv = lastlayer_jvp(b.phi[sl], v, c, self._layer)
                else:
                    assert b.x is not None
                    _, jv = jvp_with_outputs(self._model, b.x[sl], self.subset, v)
                factor = self._factor(b.f[sl], b.y[sl], None if b.draws is None else b.draws[:, sl])
                w = torch.einsum("nck,nk->nc", factor, torch.einsum("nck,nc->nk", factor, jv))
                if b.phi is not None and self._layer is not None:
                    lastlayer_vjp(b.phi[sl], w, self._layer, out=out)
                else:
                    assert b.x is not None
                    out += vjp(self._model, b.x[sl], self.subset, w)
        return out

    def _dense_ggn(self) -> Tensor:
        assert self._model is not None
        p = self.num_params
        check_allocation(p * p, self.dtype, f"the dense P x P GGN (P = {p:,})", FULL_ALTERNATIVES)
        ggn = torch.zeros(p, p, dtype=self.dtype, device=self.device)
        for b in self._batches:
            for block in self._products(self._model, b.x, b.y, b.f, b.phi, b.draws):
                ggn += gram(block.to(self.dtype))
        return ggn

    def eigendecomposition(self) -> tuple[Tensor, Tensor]:
        """(eigenvalues (k,) descending, eigenvectors (P, k)) of G, computed once, lazily."""
        if self._eig is not None:
            return self._eig
        if self._model is None:
            raise ValueError("update: no data has been added; call update() first")
        self._check_unchanged()
        p = self.num_params
        if self.rank >= p:
            ggn = self._dense_ggn().to(torch.float64)  # float64 like the Lanczos route
            evals, evecs = torch.linalg.eigh(0.5 * (ggn + ggn.T))
            evals, evecs = evals.flip(0).clamp_min(0.0), evecs.flip(1)
        else:
            # on the host (scipy's eigsh takes it there): CPU and GPU fits start alike
            v0 = draws.normal((p,), dtype=torch.float64, device="cpu", generator=self.generator)
            evals, evecs = top_eigenpairs(self.ggn_matvec, p, self.rank, v0=v0, tol=self.tol)
        self._eig = (
            evals.to(dtype=self.dtype, device=self.device),
            evecs.to(dtype=self.dtype, device=self.device),
        )
        return self._eig

    # -- posterior -----------------------------------------------------------------------

    def posterior(
        self, prior_precision: Tensor | float, scale: Tensor | float = 1.0
    ) -> LowRankPrecision:
        """A = scale * (U diag(s) U^T + diag(d)) + diag(prior) (thesis eq. 3.11)."""
        evals, evecs = self.eigendecomposition()
        prior = as_hyperparameter(prior_precision, "prior_precision", evecs)
        scale_t = as_hyperparameter(scale, "scale", evecs)
        remainder = (
            diag_remainder(self.ggn_diag, evecs, evals)
            if self.use_diag_remainder
            else torch.zeros_like(self.ggn_diag)
        )
        diag = scale_t * remainder + expand_prior(prior, self.subset)
        # sqrt(scale) separately: sqrt(s) at s = 0 would give NaN gradients.
        factor = evecs * evals.sqrt() * scale_t.sqrt()
        wide = None
        if evecs.dtype != torch.float64:  # float64 parts for the evidence
            s64 = scale_t.to(torch.float64)
            wide = (
                s64 * remainder.to(torch.float64) + expand_prior(prior, self.subset).to(s64),
                evecs.to(s64) * evals.to(s64).sqrt() * s64.sqrt(),
            )
        return LowRankPrecision(diag, factor, wide=wide)

    def state_dict(self) -> dict[str, Tensor]:
        evals, evecs = self.eigendecomposition()
        return {
            "eigenvalues": evals.clone(),
            "eigenvectors": evecs.clone(),
            "ggn_diag": self.ggn_diag.clone(),
            "num_data": torch.tensor(self.num_data),
        }

    def state_schema(self) -> dict[str, Any]:
        return {
            "eigenvalues": TensorSpec(("K",), self.dtype),
            "eigenvectors": TensorSpec(("P", "K"), self.dtype),
            "ggn_diag": TensorSpec(("P",), self.dtype),
            "num_data": Integer(),
        }

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        valid = self._validated_state(state)
        self.ggn_diag = valid["ggn_diag"].clone()
        self.num_data = valid["num_data"]
        self._eig = (valid["eigenvalues"].clone(), valid["eigenvectors"].clone())
        self._batches = []
        self._model = None
        self._reference = None
        self._loaded = True
