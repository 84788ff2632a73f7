"""Full (dense P x P) generalised Gauss-Newton / empirical Fisher curvature.

G = sum_n J_n^T Lambda_n J_n (thesis eq. 2.24, the data term of the Laplace-GGN precision
eq. 3.11) is accumulated as A^T A, one matrix product per chunk, where the rows of A are the
per-sample products (J_n^T L_n)^T with Lambda_n = L_n L_n^T. The posterior precision
A = scale * G + diag(prior) is factorised by Cholesky, or, for a scalar prior, through a cached
eigendecomposition G = V diag(e) V^T so that every marginal-likelihood step costs O(P):
log det A = sum log(scale * e + prior). G is stored in the model's dtype, but both
factorisations run in float64 (G cast once) with results returned in the model's dtype: in
float32 they resolve eigenvalues only to ~eps * lambda_max, which moved log det A by up to
0.65 nat at small priors. Eigenvalues within round-off of 0 (>= -P eps lambda_max) are set
to 0; if the float64 eigensolver fails, the Cholesky route is used with a warning.
"""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from gaussify import draws
from gaussify.curvature.base import (
    GaussNewtonCurvature,
    _cannot_overflow,
    _max_abs,
    _sum_cannot_overflow,
    as_hyperparameter,
    check_offset,
    cholesky_psd,
)
from gaussify.curvature.jacobian import SubsetLike, chunk_slices
from gaussify.curvature.lastlayer import (
    OutputLinear,
    lastlayer_factor_cov,
    lastlayer_full_ggn,
)
from gaussify.curvature.subset import expand_prior
from gaussify.deferred_checks import check_finite, deferring_on
from gaussify.likelihoods import Likelihood, all_finite
from gaussify.memory_guard import check_allocation
from gaussify.state import (
    Integer,
    TensorSpec,
)

__all__ = [
    "CholeskyPrecision",
    "EigenPrecision",
    "FullGGN",
    "gram",
]

_NOT_FINITE = (
    "x: the batch gives NaN or infinite Jacobian products; the accumulated curvature is unchanged"
)
_FEATURES_NOT_FINITE = (
    "x: the batch gives NaN or infinite Jacobian products (features of the output layer not "
    "finite); the accumulated curvature is unchanged"
)
_OVERFLOW = (
    "x: the batch gives NaN or infinite Jacobian products (the sum overflowed); the "
    "accumulated curvature is unchanged"
)


#: What to use instead of a P x P matrix that does not fit (memory_guard messages).
FULL_ALTERNATIVES = (
    "structure='diag', 'kron' or 'lowrank', or a smaller subset ('last_layer', named "
    "modules, or a subnetwork of individual weights)"
)


def _add_checked(ggn: Tensor, term: Tensor) -> None:
    """G += T in place, only when T is finite and the sum cannot overflow (else G is left
    unchanged and the batch refused)."""
    top = _max_abs(term)
    if not (math.isfinite(top) and _cannot_overflow(top, ggn)):
        raise ValueError(_OVERFLOW)
    ggn += term


def gram(products: Tensor) -> Tensor:
    """sum_{n,k} a_{nk} a_{nk}^T for products (B, K, P): one (P, BK) x (BK, P) matmul."""
    flat = products.reshape(-1, products.shape[-1])
    return flat.T @ flat


#: Column blocks of the symmetric rank-k update (smallest block width).
SYRK_BLOCKS, SYRK_MIN_WIDTH = 8, 256


def syrk_blocks(num_params: int) -> list[tuple[int, int]]:
    """[start, stop) column blocks for :func:`syrk_lower_`: up to ``SYRK_BLOCKS`` of width
    >= ``SYRK_MIN_WIDTH`` (a function of P alone, so every update uses the same blocks)."""
    count = max(1, min(SYRK_BLOCKS, num_params // SYRK_MIN_WIDTH))
    edges = [round(i * num_params / count) for i in range(count + 1)]
    return list(itertools.pairwise(edges))


def syrk_lower_(out: Tensor, flat: Tensor, blocks: list[tuple[int, int]]) -> Tensor:
    """out += flat^T flat on the block lower triangle only (blocks (i, j) with i >= j; the
    diagonal blocks in full): a symmetric rank-k update in (k + 1) / (2k) of the matmul's
    flops for k blocks (56 % for 8), the upper blocks left for :func:`mirror_lower_`."""
    for i, (a, b) in enumerate(blocks):
        rows = flat[:, a:b].T
        stop = blocks[i][1]
        out[a:b, :stop].addmm_(rows, flat[:, :stop])
    return out


def mirror_lower_(matrix: Tensor, blocks: list[tuple[int, int]]) -> Tensor:
    """Copy the block lower triangle onto the upper one (blocks above the diagonal)."""
    for i, (a, b) in enumerate(blocks):
        if i + 1 < len(blocks):
            matrix[a:b, b:] = matrix[b:, a:b].T
    return matrix


def _factor_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype dense factorisations run in: float64 for narrower floating dtypes."""
    return torch.float64 if torch.finfo(dtype).bits < 64 else dtype


def _flat_jac(jac: Tensor, num_params: int) -> Tensor:
    if jac.ndim != 3 or jac.shape[-1] != num_params:
        raise ValueError(f"jac: expected shape (N, C, {num_params}), got {tuple(jac.shape)}")
    return jac


class CholeskyPrecision:
    """Dense posterior precision A (P, P) with a lazily computed Cholesky factor A = L L^T.

    ``precision`` may be in a wider dtype than the results (``dtype``; float64 for a float32
    model): the factorisation and log det A = 2 sum log diag(L) then run in it (a float32
    Cholesky moved log det A by 0.2 nat at a small prior, like float32 eigh), after which the
    wide matrices are dropped and L is kept in ``dtype`` for solves and samples.
    """

    def __init__(self, precision: Tensor, *, dtype: torch.dtype | None = None) -> None:
        self.dtype = precision.dtype if dtype is None else dtype
        self._wide: Tensor | None = precision if precision.dtype != self.dtype else None
        self.precision = precision.to(self.dtype)
        self.num_params = precision.shape[-1]
        self._chol: Tensor | None = None
        self._wide_chol: Tensor | None = None
        self._logdet: Tensor | None = None
        self._inv_factor: Tensor | None = None

    @property
    def cholesky(self) -> Tensor:
        if self._chol is None:
            if self._wide is None:
                self._chol = cholesky_psd(self.precision)
            else:
                wide = self._wide_factor()
                self._chol, self._wide, self._wide_chol = wide.to(self.dtype), None, None
        return self._chol

    def _wide_factor(self) -> Tensor:
        """The float64 Cholesky factor, kept until :attr:`cholesky` is first needed (the
        evidence's log det and solve use it; predictions and samples drop it)."""
        if self._wide_chol is None:
            assert self._wide is not None
            self._wide_chol = cholesky_psd(self._wide)
            self._logdet = 2 * self._wide_chol.diagonal().log().sum()
        return self._wide_chol

    def logdet(self) -> Tensor:
        return self.logdet_wide().to(self.dtype)

    def logdet_wide(self) -> Tensor:
        """log det A in the factorisation's dtype (float64 for a float32 model)."""
        if self._logdet is None:
            if self._wide is not None:
                self._wide_factor()
            else:
                self._logdet = 2 * self.cholesky.diagonal().log().sum()
        assert self._logdet is not None
        return self._logdet

    def solve_wide(self, v: Tensor) -> Tensor:
        """A^-1 v in float64 with the float64 factor where there is one (the evidence's
        correction b^T A^-1 b cancels against the prior term at large priors)."""
        factor = self._wide_factor() if self._wide is not None else self.cholesky
        lead = v.shape[:-1]
        rhs = v.reshape(-1, self.num_params).T.to(factor.dtype)
        return torch.cholesky_solve(rhs, factor).T.reshape(*lead, self.num_params)

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        # L^{-T} z has covariance L^{-T} L^{-1} = A^{-1}.
        prec = self.precision
        z = draws.normal(
            (self.num_params, n), dtype=prec.dtype, device=prec.device, generator=generator
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
    and its gradient cost O(P) once the eigendecomposition is cached. The eigenvalues may be
    in a wider dtype than V (float64 for a float32 G): log det A is summed in it and
    returned in V's dtype, like every other result.

    A GGN is positive semi-definite, but the computed eigenvalues of a G accumulated in
    ``roundoff`` precision (default: V's dtype) scatter around 0 by round-off: those
    >= -P eps lambda_max are set to 0; a more negative one means G is not PSD (a corrupted
    state) and raises.
    """

    def __init__(
        self,
        eigenvectors: Tensor,
        eigenvalues: Tensor,
        prior: Tensor,
        scale: Tensor,
        *,
        roundoff: torch.dtype | None = None,
    ) -> None:
        self.eigenvectors = eigenvectors
        self.num_params = eigenvectors.shape[0]
        dtype = eigenvectors.dtype
        eps = torch.finfo(roundoff or dtype).eps
        evals = eigenvalues.detach()
        top = float(evals.abs().max()) if evals.numel() else 0.0
        floor = -self.num_params * eps * top
        if evals.numel() and float(evals.min()) < floor:
            raise ValueError(
                "posterior precision is not positive definite: the curvature has an "
                f"eigenvalue {float(evals.min()):.3g}, below the round-off bound {floor:.3g} "
                "(-P eps lambda_max); a GGN is positive semi-definite, so the state is corrupted"
            )
        eigenvalues = eigenvalues.clamp_min(0.0)
        wide = eigenvalues.dtype
        diag = scale.to(wide) * eigenvalues + prior.to(wide)
        if not bool((diag.detach() > 0).all()):
            raise ValueError(
                "posterior precision is not positive definite: scale * eig(G) + prior has "
                f"minimum {float(diag.detach().min()):.3g}"
            )
        self._diag_wide = diag
        self.diag = diag.to(dtype)

    def logdet(self) -> Tensor:
        return self.logdet_wide().to(self.eigenvectors.dtype)

    def logdet_wide(self) -> Tensor:
        """log det A summed in the eigenvalues' dtype (float64 for a float32 model)."""
        return self._diag_wide.log().sum()

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        v = self.eigenvectors
        z = draws.normal((n, self.num_params), dtype=v.dtype, device=v.device, generator=generator)
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

    Extra option ``eig_cache``: for a scalar prior precision, :meth:`posterior` works from a
    cached eigendecomposition of G, so repeated marginal-likelihood evaluations cost O(P) for
    the log determinant; per-tensor and per-parameter priors use a Cholesky factorisation.
    True: the eigendecomposition is computed at the first scalar-prior posterior; False:
    never; None (default): it is used once cached (e.g. by prior tuning with the non-MAP
    correction) and computed at the second scalar-prior posterior since the last update, so
    a single evaluation costs one Cholesky factorisation (P = 3760: 1 s against 26 s for
    ``eigh`` on one core) and repeated ones one ``eigh``. Prior tuning does not need either:
    :meth:`spectrum` gives it the eigenvalues (``eigvalsh``, 3 s at P = 3760).
    ``kron_features`` (default True): on a final ``nn.Linear`` subset, G is accumulated as
    sum_n M_n ⊗ phi~_n phi~_n^T from the layer's features, C times fewer flops than the
    per-sample products. Updates compute only G's block lower triangle (a symmetric rank-k
    update, about 56 % of the flops) and the ``ggn`` property mirrors it on access.
    """

    structure: ClassVar[str] = "full"

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood,
        subset: SubsetLike = "all",
        *,
        eig_cache: bool | None = None,
        kron_features: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, likelihood, subset, **kwargs)
        #: on a final nn.Linear subset, accumulate G = sum_n M_n ⊗ phi~ phi~^T from the
        #: features (O(N C^2 D^2)) instead of the per-sample products (O(N C^3 D^2))
        self.kron_features = kron_features
        p = self.num_params
        # accumulated in float64 for a float32 model: a float32 sum resolves eigenvalues only
        # to ~eps * lambda_max (a null direction came out at 7e-8 against 3e-16), which then
        # dominates log det A at small priors; the sum of float64 products keeps a Gram matrix
        wide = _factor_dtype(self.dtype)
        check_allocation(
            p * p,
            wide,
            f"structure='full': the P x P GGN (P = {p:,} parameters)",
            FULL_ALTERNATIVES,
            device=self.device,
        )
        self._ggn = torch.zeros(p, p, dtype=wide, device=self.device)
        self._blocks = syrk_blocks(p)
        self._mirror_pending = False  # upper blocks of _ggn not yet copied from the lower ones
        self.eig_cache = eig_cache
        self._eig: tuple[Tensor, Tensor] | None = None
        self._evals: Tensor | None = None  # eigenvalues alone (eigvalsh), for prior tuning
        self._scalar_requests = 0  # scalar-prior posteriors since the last update
        self._eig_failed = False  # the eigensolver failed on the current G: Cholesky route

    def _storage_elements(self) -> int:
        return self.num_params**2

    @property
    def ggn(self) -> Tensor:
        """G (P, P). Updates accumulate only its block lower triangle (a symmetric rank-k
        update, :func:`syrk_lower_`); the upper blocks are copied over on first access."""
        if self._mirror_pending:
            mirror_lower_(self._ggn, self._blocks)
            self._mirror_pending = False
        return self._ggn

    @ggn.setter
    def ggn(self, value: Tensor) -> None:
        self._ggn = value
        self._mirror_pending = False

    def update(self, model: nn.Module, x: Tensor, y: Tensor, offset: Tensor | None = None) -> None:
        """Add sum over the batch of J_n^T L_n L_n^T J_n, chunk by chunk (L_n at f_n +
        ``offset_n`` when an output offset (N, C) is given).

        Transactional: a batch that fails (NaN outputs or Jacobians) leaves G unchanged. A
        batch of one chunk is checked before it is added; a batch of several chunks is summed
        into a (P, P) temporary first (that happens only when P is small next to the batch:
        a chunk holds about P / (2K) samples, see ``_chunk_budget``)."""
        self._check_batch(model, x, y)
        f, phi = self._forward(model, x, check_offset(offset, x.shape[0]))
        draws = self._draw(f)
        if phi is not None and self._layer is not None and self.kron_features:
            self._update_from_features(f, y, phi, draws)
            self.num_data += x.shape[0]
            self._forget()
            return
        k = self._num_factors(f.shape[1])
        single = self._chunk(f.shape[0], k * self.subset.support.num_params) >= f.shape[0]
        # on an accelerator, inside a fit's deferred_checks scope, the checks are recorded
        # (no host read per batch; the fit sets the state back on failure)
        deferred = deferring_on(self._ggn.device)
        target = self._ggn if single else torch.zeros_like(self._ggn)
        for block in self._products(model, x, y, f, phi, draws):
            flat = block.reshape(-1, block.shape[-1]).to(self._ggn.dtype)
            if deferred:
                check_finite(flat, _NOT_FINITE)
            else:
                top = _max_abs(flat)
                if not math.isfinite(top):
                    raise ValueError(_NOT_FINITE)
                # one chunk added directly only where its Gram cannot overflow G
                if target is self._ggn and not _cannot_overflow(flat.shape[0] * top * top, target):
                    target = torch.zeros_like(self._ggn)
            syrk_lower_(target, flat, self._blocks)
        if deferred:  # finite products whose squares overflowed the sum
            if target is not self._ggn:
                self._ggn += target
            check_finite(self._ggn, _OVERFLOW)
        elif target is not self._ggn:
            _add_checked(self._ggn, target)
        self._mirror_pending = True
        self.num_data += x.shape[0]
        self._forget()

    def _update_from_features(
        self, f: Tensor, y: Tensor, phi: Tensor, draws: Tensor | None
    ) -> None:
        """Last-layer path: G += sum_n M_n ⊗ phi~_n phi~_n^T from the output layer's features
        (:func:`gaussify.curvature.lastlayer.lastlayer_full_ggn`), M_n = L_n L_n^T, in chunks
        of samples whose (B, C, C) and (B, C D') temporaries fit the chunk budget.

        Transactional without a (P, P) temporary where possible: the features are checked
        finite first, and when every M_n is finite and the bound N max|M| max(phi^2, 1) +
        max|G| is far below the dtype's largest number (:func:`_sum_cannot_overflow`, one
        cheap pass over the (B, C, C) middles) no entry can overflow, so the chunks are added
        to G directly. Otherwise they are summed into a (P, P) temporary, checked, then
        added, so a failing batch leaves G unchanged."""
        deferred = deferring_on(self._ggn.device)  # checks recorded, the batch added directly
        if deferred:
            check_finite(phi, _FEATURES_NOT_FINITE)
        elif not all_finite(phi):
            raise ValueError(_FEATURES_NOT_FINITE)
        n, c = f.shape
        width = self.num_params // c
        # the chunk budget split in two: classes per matmul block so that its (D', g C D')
        # product takes half, samples per chunk so that their (B, g C D') right-hand side
        # (and (B, C, C) middles) take the other half
        half = self._chunk_budget() // 2
        per_block = max(1, min(c, half // max(1, c * width * width)))
        per_sample = 2 * (c * c + 2 * per_block * c * width)
        slices = list(chunk_slices(n, self._chunk(n, per_sample)))

        def middle(sl: slice) -> Tensor:
            factor = self._factor(f[sl], y[sl], None if draws is None else draws[:, sl])
            return factor @ factor.mT

        # one chunk (the usual case): its middles formed once, for the bound and the sum
        first = middle(slices[0]) if len(slices) == 1 and not deferred else None
        bounded = middle if first is None else (lambda sl: first)
        direct = deferred or _sum_cannot_overflow(phi, slices, bounded, self._ggn)
        target = self._ggn if direct else torch.zeros_like(self._ggn)
        assert self._layer is not None
        for sl in slices:
            block = middle(sl) if first is None else first
            if deferred:
                check_finite(block, _NOT_FINITE)
            elif not all_finite(block):
                raise ValueError(_NOT_FINITE)
            lastlayer_full_ggn(phi[sl], block, self._layer, target, per_block)
        if deferred:
            check_finite(self._ggn, _OVERFLOW)
        elif target is not self._ggn:
            _add_checked(self._ggn, target)

    def _forget(self) -> None:
        """Drop what was derived from G (it changed)."""
        self._eig, self._evals, self._eig_failed, self._scalar_requests = None, None, False, 0

    def eigendecomposition(self) -> tuple[Tensor, Tensor] | None:
        """(eigenvalues (P,) in float64, eigenvectors (P, P) in G's dtype) of G, cached until
        the next update; None when the eigensolver fails (then :meth:`posterior` uses a
        Cholesky factorisation).

        The decomposition runs in float64 whatever G's dtype (G is cast once): float32
        ``eigh`` resolves small eigenvalues only to about eps * lambda_max, which moved
        log det A by ~0.1 nat on a small CNN, and it can fail to converge on a near-singular
        G. Eigenvalues stay float64 (log det sums P logarithms); eigenvectors are cast back.
        """
        if self._eig is None and not self._eig_failed:
            if not torch.isfinite(self.ggn).all():
                raise ValueError("curvature: the accumulated GGN contains NaN or inf")
            sym = self.ggn.to(_factor_dtype(self.dtype))
            sym = 0.5 * (sym + sym.T)
            try:
                evals, evecs = torch.linalg.eigh(sym)
            except torch.linalg.LinAlgError as err:
                warnings.warn(
                    f"full GGN: the float64 eigendecomposition failed ({err}); using a "
                    "Cholesky factorisation of the posterior precision instead",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._eig_failed = True
                return None
            self._eig = (evals, evecs.to(self.dtype))
        return self._eig

    def posterior(
        self, prior_precision: Tensor | float, scale: Tensor | float = 1.0
    ) -> CholeskyPrecision | EigenPrecision:
        """A = scale * G + diag(prior) (thesis eq. 3.11)."""
        prior = as_hyperparameter(prior_precision, "prior_precision", self.ggn)
        scale_t = as_hyperparameter(scale, "scale", self.ggn)
        eig = self._eig_for_posterior() if prior.numel() == 1 else None
        if eig is not None:
            evals, evecs = eig
            return EigenPrecision(evecs, evals, prior.reshape(()), scale_t, roundoff=self.dtype)
        if not torch.isfinite(self.ggn).all():
            raise ValueError("curvature: the accumulated GGN contains NaN or inf")
        diag = expand_prior(prior, self.subset)
        wide = _factor_dtype(self.dtype)  # A formed and factorised in float64 (see class)
        precision = scale_t.to(wide) * self.ggn.to(wide) + torch.diag(diag.to(wide))
        return CholeskyPrecision(precision, dtype=self.dtype)

    def state_dict(self) -> dict[str, Tensor]:
        return {"ggn": self.ggn.clone(), "num_data": torch.tensor(self.num_data)}

    def state_schema(self) -> dict[str, Any]:
        # G is held in float64 for a float32 model; a state in the model's dtype loads too
        dtypes = (self.dtype, _factor_dtype(self.dtype))
        return {"ggn": TensorSpec(("P", "P"), dtypes), "num_data": Integer()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        valid = self._validated_state(state)
        self.ggn = valid["ggn"].to(self._ggn.dtype).clone()
        self.num_data = valid["num_data"]
        self._forget()

    @property
    def eigenbasis_cached(self) -> bool:
        """Whether G's eigendecomposition is at hand (then the evidence is evaluated per
        eigenvector, :func:`gaussify.evidence.eigenbasis_log_evidence`, at no extra cost)."""
        return self._eig is not None

    def _eig_for_posterior(self) -> tuple[Tensor, Tensor] | None:
        """The eigendecomposition a scalar-prior posterior uses, per ``eig_cache``, or None
        for a Cholesky factorisation."""
        self._scalar_requests += 1
        if self.eig_cache is False:
            return None
        if self.eig_cache or self._eig is not None or self._scalar_requests >= 2:
            return self.eigendecomposition()
        return None

    def eigenvalues(self) -> Tensor:
        """Eigenvalues of G (P,), float64, clamped at 0 like :class:`EigenPrecision` does
        (raising if one is below the round-off bound): from the cached eigendecomposition if
        there is one, else from ``eigvalsh`` (cached; about 9x cheaper than ``eigh``)."""
        if self._eig is not None:
            evals = self._eig[0]
        else:
            if self._evals is None:
                if not torch.isfinite(self.ggn).all():
                    raise ValueError("curvature: the accumulated GGN contains NaN or inf")
                sym = self.ggn.to(_factor_dtype(self.dtype))
                self._evals = torch.linalg.eigvalsh(0.5 * (sym + sym.T))
            evals = self._evals
        evals = evals.to(torch.float64)
        floor = -self.num_params * torch.finfo(self.dtype).eps * float(evals.abs().max())
        if evals.numel() and float(evals.min()) < floor:
            raise ValueError(
                "posterior precision is not positive definite: the curvature has an "
                f"eigenvalue {float(evals.min()):.3g}, below the round-off bound {floor:.3g}"
            )
        return evals.clamp_min(0.0)

    def pending_decomposition(self, vectors: bool) -> str | None:
        """The factorisation :meth:`spectrum` will run now: ``"eigh"`` when eigenvectors are
        needed (``vectors``) and not cached, ``"eigvalsh"`` when only the eigenvalues are
        needed and neither they nor the eigendecomposition are cached, else None (for a
        progress display; the choice itself is made by :meth:`spectrum`)."""
        if self._eig is not None or (vectors and self._eig_failed):
            return None
        if vectors:
            return "eigh"
        return None if self._evals is not None else "eigvalsh"

    def spectrum(
        self, groups: Tensor, vectors: list[Tensor]
    ) -> tuple[Tensor, Tensor, list[Tensor]] | None:
        """(eigenvalues (P,), prior group per eigenvector (P,), [V^T v for v in vectors]) for
        closed-form prior tuning (:mod:`gaussify.spectral`), or None when the prior groups
        ``groups`` (P,) are not all one (a per-tensor or per-parameter prior does not commute
        with G's eigenvectors) or the eigensolver failed. The eigenvectors are computed only
        when ``vectors`` is not empty (``eigvalsh`` otherwise)."""
        if groups.numel() and bool((groups != groups[0]).any()):
            return None
        projections: list[Tensor] = []
        if vectors:
            eig = self.eigendecomposition()
            if eig is None:
                return None
            evecs = eig[1].to(torch.float64)
            projections = [evecs.T @ v.to(torch.float64) for v in vectors]
        return self.eigenvalues(), groups, projections
