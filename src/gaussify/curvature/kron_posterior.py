"""Posterior precision of a Kronecker-factored GGN, in each block's Kronecker eigenbasis.

**Posterior.** ``posterior(prior, scale)`` returns ``scale * G + diag(prior)`` with the prior
added to the eigenvalues of each Kronecker block (laplace-torch's ``KronDecomposed`` without
damping): with ``A = Q_a diag(l_a) Q_a^T``, ``B = Q_b diag(l_b) Q_b^T`` the block has
eigenvectors ``Q_b kron Q_a`` and eigenvalues ``scale * l_b l_a^T / M + delta``, which gives
log-determinants, solves, samples and functional covariances in closed form, differentiable
in ``prior`` and ``scale``. The prior may be a scalar or one value per parameter tensor ("per
layer"); a per-parameter (P,) prior must be constant within each tensor. When a joint block's
weight and bias have different priors, the bias column carries an extra ``delta_b - delta_W``,
which commutes with ``Q_b kron I``: per eigenvector of B it is a rank-one update handled
exactly by Sherman-Morrison and the matrix determinant lemma.

**Mixed blocks.** A block whose input factor is diagonal (``nn.Embedding``'s token counts)
has ``q_in = None``, the identity; an exact GGN block of a parameter without a Kronecker form
(:mod:`gaussify.curvature.kron_exact`) is a block with one output row, ``q_out = [[1]]`` and
``q_in`` the eigenvectors of the exact block (or None for a diagonal one), so every operation
below handles all blocks alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gaussify import draws
from gaussify.curvature.kron_grams import augment
from gaussify.curvature.lastlayer import (
    OutputLinear,
    lastlayer_chunked,
    lastlayer_features,
    lastlayer_index,
    lastlayer_num_outputs,
)

__all__ = ["KronPosteriorPrecision", "kron_block_eigh"]


def kron_block_eigh(factor: Tensor) -> tuple[Tensor, Tensor]:
    """Eigendecomposition ``(eigenvalues, eigenvectors)`` of a symmetric PSD Kronecker factor,
    computed in float64 whatever the factor's dtype and returned in that dtype.

    The factor is symmetrised first. Gram matrices are PSD, and ``eigh`` is backward stable:
    every computed eigenvalue is within about ``k * eps * lambda_max`` of an exact one
    (``k`` the size, ``eps`` the machine epsilon of the dtype it runs in). In float32 that
    error reaches the small eigenvalues that, next to a small prior, set the GLM predictive
    variance (a float32 model with features of mean 100 and prior 1e-4 was off by 1e-3
    relative from its float64 twin; 1e-6 with the decomposition in float64), so it runs in
    float64. Eigenvalues below the float64 bound (negative ones included) cannot be told
    apart from 0 and are set to 0, so an exact null direction (the all-ones vector of a
    softmax's summed Hessian, a feature that is always 0) stays one instead of becoming a
    round-off eigenvalue that the scale then multiplies. (Zeroing at the float32 bound
    instead would also remove real eigenvalues, such as those of the example above.)
    """
    mat = factor.to(torch.float64)
    eigvals, eigvecs = torch.linalg.eigh(0.5 * (mat + mat.mT))
    if eigvals.numel() == 0:
        return eigvals.to(factor.dtype), eigvecs.to(factor.dtype)
    tol = factor.shape[-1] * torch.finfo(mat.dtype).eps * eigvals.abs().max()
    eigvals = torch.where(eigvals > tol, eigvals, torch.zeros_like(eigvals))
    return eigvals.to(factor.dtype), eigvecs.to(factor.dtype)


@dataclass(frozen=True)
class _Block:
    """One Kronecker block over an ``(out, d)`` matrix: precision
    ``Q diag(eig) Q^T + shift * diag(last column)`` with ``Q = q_out kron q_in``.

    ``index (out, d)`` holds each entry's position in subset order. ``shift`` (or None) is
    ``delta_bias - delta_weight`` for a joint weight+bias block whose two tensors have
    different prior precisions; the bias is the last column.
    """

    index: Tensor
    q_out: Tensor
    q_in: Tensor | None  # None: the identity (a diagonal A: nn.Embedding, diagonal exact blocks)
    eig: Tensor  # (out, d): eigenvalues of scale * G + delta_weight
    shift: Tensor | None = None
    #: the owning module's path and the block's columns, ("weight",), ("bias",) or
    #: ("weight", "bias") (None: unknown, e.g. a block built by hand): used by
    #: :meth:`KronPosteriorPrecision.functional_cov_traced`
    module: str | None = None
    columns: tuple[str, ...] = ()


@dataclass(frozen=True)
class _RankOne:
    """Sherman-Morrison terms of a block with a bias shift ``c``, per eigenvector ``i`` of B.

    In the basis ``q_out kron q_in`` the precision is block-diagonal over ``i`` with blocks
    ``diag(E_i) + c u u^T``, ``u = q_in[-1, :]`` (the bias row). With ``K_i = diag(1/E_i)``:
    ``ue_i = K_i u``, ``h_i = u^T K_i u``, ``denom_i = 1 + c h_i`` (> 0) and
    ``beta_i = c / denom_i``, so that ``(diag(E_i) + c u u^T)^-1 = K_i - beta_i ue_i ue_i^T``
    and ``log det = sum log E_i + log denom_i``.
    """

    ue: Tensor  # (out, d)
    h: Tensor  # (out,)
    denom: Tensor  # (out,)
    beta: Tensor  # (out,)


def _rank_one(b: _Block) -> _RankOne | None:
    if b.shift is None:
        return None
    assert b.q_in is not None  # a bias shift needs a joint weight+bias block
    u = b.q_in[-1]
    ue = u / b.eig
    h = (u * ue).sum(-1)
    denom = 1 + b.shift * h
    return _RankOne(ue, h, denom, b.shift / denom)


class KronPosteriorPrecision:
    """Block-diagonal Kronecker posterior precision ``A = scale * G + diag(prior)``, Sigma = A^-1.

    Every vector is in the subset's flattened order (``model.named_parameters()``), shape
    ``(..., P)``. All operations work in each block's Kronecker eigenbasis (plus a rank-one
    Sherman-Morrison term per row when a joint block's weight and bias have different priors),
    so they cost ``O(out^3 + d^3)`` per block rather than ``O(P^3)``, and are differentiable
    wrt the prior precision and the GGN scale.
    """

    def __init__(
        self,
        blocks: list[_Block],
        num_params: int,
        *,
        permutation: tuple[Tensor, Tensor] | None = None,
        eig_flat: Tensor | None = None,
    ) -> None:
        """``blocks`` must cover the P subset positions exactly once (checked, unless a
        ``permutation`` ``(perm, inv_perm)`` that was checked before is passed, as
        :meth:`KronGGN.posterior` does once per fit). ``eig_flat`` (P,), if given, is the
        concatenation of the blocks' ``eig`` (block order), of which they are views; it turns
        :meth:`logdet` into one ``log().sum()``."""
        self.blocks = blocks
        self.num_params = num_params
        if permutation is None:
            perm = torch.cat([b.index.reshape(-1) for b in blocks])
            if perm.numel() != num_params or not torch.equal(
                torch.sort(perm).values, torch.arange(num_params, device=perm.device)
            ):
                raise ValueError(
                    "kron: the Kronecker blocks do not cover the parameters exactly once"
                )
            permutation = (perm, torch.argsort(perm))
        self._perm, self._inv_perm = permutation  # block order <-> subset position
        self._sizes = [b.eig.numel() for b in blocks]
        self._r1 = [_rank_one(b) for b in blocks]
        self._eig_flat = eig_flat

    # -- helpers
    def _split(self, v: Tensor) -> list[Tensor]:
        """``(..., P)`` in subset order -> list of ``(..., out, d)`` block matrices."""
        parts = torch.split(v[..., self._perm], self._sizes, dim=-1)
        return [
            p.reshape(*v.shape[:-1], *b.eig.shape) for p, b in zip(parts, self.blocks, strict=True)
        ]

    def _merge(self, mats: list[Tensor]) -> Tensor:
        """Inverse of :meth:`_split`."""
        flat = torch.cat([m.reshape(*m.shape[:-2], -1) for m in mats], dim=-1)
        return flat[..., self._inv_perm]

    @staticmethod
    def _to_eigbasis(b: _Block, m: Tensor) -> Tensor:
        m = b.q_out.mT @ m
        return m if b.q_in is None else m @ b.q_in

    @staticmethod
    def _from_eigbasis(b: _Block, m: Tensor) -> Tensor:
        m = b.q_out @ m
        return m if b.q_in is None else m @ b.q_in.mT

    @staticmethod
    def _bias_column(b: _Block, m: Tensor) -> Tensor:
        """``m`` with every column but the last (bias) zeroed."""
        mask = torch.zeros(b.eig.shape[-1], dtype=m.dtype, device=m.device)
        mask[-1] = 1
        return m * mask

    def _inner_cov(self, b: _Block, r1: _RankOne | None) -> Tensor:
        """Sigma in the block's eigenbasis, ``(out * d, out * d)``."""
        if r1 is None:
            return torch.diag(b.eig.reciprocal().reshape(-1))
        inner = torch.diag_embed(b.eig.reciprocal()) - r1.beta[:, None, None] * (
            r1.ue.unsqueeze(-1) * r1.ue.unsqueeze(-2)
        )
        return torch.block_diag(*inner.unbind(0))

    def _dense(self, covariance: bool) -> Tensor:
        mats = []
        for b, r1 in zip(self.blocks, self._r1, strict=True):
            q_in = b.q_in if b.q_in is not None else torch.eye(b.eig.shape[-1]).to(b.eig)
            q = torch.kron(b.q_out.contiguous(), q_in.contiguous())
            if covariance:
                mats.append(q @ self._inner_cov(b, r1) @ q.mT)
            else:
                mat = (q * b.eig.reshape(-1)) @ q.mT
                if b.shift is not None:
                    diag = self._bias_column(b, torch.ones_like(b.eig)).reshape(-1)
                    mat = mat + torch.diag(b.shift * diag)
                mats.append(mat)
        dense = torch.block_diag(*mats)
        return dense[self._inv_perm][:, self._inv_perm]

    # -- protocol
    def logdet(self) -> Tensor:
        """``log det A`` (scalar): ``sum log eig`` plus ``sum log denom`` of the rank-one terms."""
        if self._eig_flat is not None and all(r1 is None for r1 in self._r1):
            return self._eig_flat.log().sum()
        total = 0
        for b, r1 in zip(self.blocks, self._r1, strict=True):
            total = total + b.eig.log().sum()
            if r1 is not None:
                total = total + r1.denom.log().sum()
        return total

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """``(n, P)`` draws from ``N(0, A^-1)``."""
        ref = self.blocks[0].eig
        z = draws.normal(
            (n, self.num_params), dtype=ref.dtype, device=ref.device, generator=generator
        )
        mats = []
        for b, r1, zb in zip(self.blocks, self._r1, torch.split(z, self._sizes, -1), strict=True):
            xi = zb.reshape(n, *b.eig.shape)
            if r1 is not None:
                # K^1/2 (I - alpha w w^T) xi with w = K^1/2 u and (I - alpha w w^T)^2 =
                # I - beta w w^T, i.e. alpha = (1 - denom^-1/2) / h.
                w = r1.ue * b.eig.sqrt()
                alpha = (1 - r1.denom.rsqrt()) / r1.h
                xi = xi - (alpha * (xi * w).sum(-1)).unsqueeze(-1) * w
            mats.append(self._from_eigbasis(b, xi * b.eig.rsqrt()))
        return self._merge(mats)

    def solve(self, v: Tensor) -> Tensor:
        """``A^-1 v`` for ``v (..., P)``."""
        mats = []
        for b, r1, m in zip(self.blocks, self._r1, self._split(v), strict=True):
            w = self._to_eigbasis(b, m)
            x = w / b.eig
            if r1 is not None:
                x = x - (r1.beta * (w * r1.ue).sum(-1)).unsqueeze(-1) * r1.ue
            mats.append(self._from_eigbasis(b, x))
        return self._merge(mats)

    def matvec(self, v: Tensor) -> Tensor:
        """``A v`` for ``v (..., P)``."""
        mats = []
        for b, m in zip(self.blocks, self._split(v), strict=True):
            out = self._from_eigbasis(b, self._to_eigbasis(b, m) * b.eig)
            if b.shift is not None:
                out = out + b.shift * self._bias_column(b, m)
            mats.append(out)
        return self._merge(mats)

    def functional_cov(self, jac: Tensor) -> Tensor:
        """``J Sigma J^T`` for ``jac (N, C, P)`` -> ``(N, C, C)``."""
        out = 0
        for b, r1, m in zip(self.blocks, self._r1, self._split(jac), strict=True):
            jt = self._to_eigbasis(b, m)  # (N, C, out, d)
            out = out + torch.einsum("ncij,nkij->nck", jt / b.eig, jt)
            if r1 is not None:
                p = (jt * r1.ue).sum(-1)  # (N, C, out)
                out = out - torch.einsum("nci,nki->nck", p * r1.beta, p)
        return out

    def functional_var(self, jac: Tensor) -> Tensor:
        """Diagonal of :meth:`functional_cov`, ``(N, C)``, without forming the C x C blocks."""
        out = 0
        for b, r1, m in zip(self.blocks, self._r1, self._split(jac), strict=True):
            jt = self._to_eigbasis(b, m)
            out = out + (jt.square() / b.eig).sum((-2, -1))
            if r1 is not None:
                out = out - ((jt * r1.ue).sum(-1).square() * r1.beta).sum(-1)
        return out

    @staticmethod
    def _row_variances(b: _Block, r1: _RankOne | None, feats: Tensor) -> Tensor:
        """``s (N, out)`` for block features ``feats (N, d)`` (a Jacobian row ``e_i f_n^T``
        per output row i): with ``psi_n = Q_A^T f_n``,
        ``s_ni = sum_j psi_nj^2 / E_ij - beta_i (ue_i . psi_n)^2``, the variance of the
        eigenbasis row i's coordinates along ``psi_n`` (rows are uncorrelated, also with the
        bias rank-one term, which is per row)."""
        psi = feats.to(b.eig.dtype) if b.q_in is None else feats.to(b.q_in.dtype) @ b.q_in
        s = psi.square() @ b.eig.reciprocal().mT
        if r1 is not None:
            s = s - r1.beta * (psi @ r1.ue.mT).square()
        return s

    def traced_blocks(self) -> bool:
        """Whether every block knows its module and columns (:meth:`functional_cov_traced`)."""
        return all(b.module is not None and b.columns for b in self.blocks)

    def functional_cov_traced(
        self, traces: dict[str, tuple[Tensor, Tensor]], diagonal: bool = False
    ) -> Tensor:
        """``J Sigma J^T`` ``(N, C, C)`` (its diagonal ``(N, C)`` with ``diagonal``) when
        every block belongs to a linear layer ``s_t = W a_t + b``, from ``traces``: module path
        -> ``(a (N, in), delta (C, N, out))`` (one location) or ``(a (N, T, in),
        delta (C, N, T, out))`` (T weight-sharing locations, a convolution's patches), with
        ``delta_c`` the gradient of ``f_c`` wrt ``s``
        (:func:`gaussify.curvature.jacobian.linear_output_traces`).

        With one location the block's Jacobian rows are rank one, ``J_c = delta_c f^T`` with
        block features ``f = [a, 1]`` (or ``a``, or ``[1]``, by the block's columns), so in
        the eigenbasis ``Q_out^T J_c Q_in = u_c psi^T`` with ``u_c = Q_out^T delta_c``,
        ``psi = Q_in^T f`` and ``J_c Sigma J_k^T = sum_i u_ci u_ki s_i``, ``s`` from
        :meth:`_row_variances`: O(N (d^2 + out d + C out^2 + C^2 out)) per block instead of
        the dense route's O(N C (out^2 d + out d^2)), and no ``(N, C, P)`` Jacobian. With T
        locations the rotated rows ``sum_t u_ct psi_t^T`` (one batched matmul, ``(N, C, out,
        d)`` per block) go through :meth:`functional_cov`'s eigenbasis formula. Equal to
        :meth:`functional_cov` of the Jacobian in exact arithmetic.
        """
        if not self.traced_blocks():
            raise ValueError("kron: these blocks do not name their layers; use functional_cov")
        out: Tensor | int = 0
        for b, r1 in zip(self.blocks, self._r1, strict=True):
            assert b.module is not None
            a, delta = traces[b.module]
            if a.ndim == 3 and a.shape[1] != 1:  # T locations: the rotated block Jacobian
                feats = augment(a, "weight" in b.columns, "bias" in b.columns).to(b.eig.dtype)
                psi = feats if b.q_in is None else feats @ b.q_in  # (N, T, d)
                u = delta.to(b.q_out.dtype) @ b.q_out  # (C, N, T, out)
                jt = torch.einsum("cnti,ntj->ncij", u, psi)  # (N, C, out, d)
                if diagonal:
                    out = out + (jt.square() / b.eig).sum((-2, -1))
                else:
                    out = out + torch.einsum("ncij,nkij->nck", jt / b.eig, jt)
                if r1 is not None:
                    p = (jt * r1.ue).sum(-1)  # (N, C, out)
                    if diagonal:
                        out = out - (p.square() * r1.beta).sum(-1)
                    else:
                        out = out - torch.einsum("nci,nki->nck", p * r1.beta, p)
                continue
            if a.ndim == 3:  # one location given as (N, 1, in), (C, N, 1, out)
                a, delta = a[:, 0], delta[:, :, 0]
            feats = augment(a.unsqueeze(1), "weight" in b.columns, "bias" in b.columns)
            s = self._row_variances(b, r1, feats[:, 0])  # (N, out)
            u = delta.to(b.q_out.dtype) @ b.q_out  # (C, N, out)
            if diagonal:
                out = out + torch.einsum("cni,ni->nc", u.square(), s)
            else:
                ut = u.transpose(0, 1)  # (N, C, out)
                out = out + (ut * s.unsqueeze(1)) @ ut.mT
        assert isinstance(out, Tensor)
        return out

    def _lastlayer_terms(self, phi: Tensor, layer: OutputLinear) -> list[tuple[Tensor, Tensor]]:
        """``[(Q_B (C, C), s (N, C))]`` with ``J_n Sigma J_n^T = sum Q_B diag(s_n) Q_B^T`` on a
        final ``nn.Linear`` subset, one term per distinct ``Q_B`` (two blocks of one layer,
        as with ``kron_bias="separate"``, share it, so their ``s`` are summed).

        A block over the ``(C, d)`` matrix ``m`` with block features ``f_n`` (columns of
        ``[phi_n, 1]``) has ``J_n m = m f_n = Q_B X psi_n`` with ``X`` the eigenbasis
        coordinates and ``psi_n = Q_A^T f_n``; the coordinates of different rows ``i`` are
        uncorrelated (also with the bias rank-one term, which is per row), so
        ``s_ni = sum_j psi_nj^2 / E_ij - beta_i (ue_i . psi_n)^2``: O(N (d^2 + C d)).
        """
        dim = phi.shape[1]
        c = lastlayer_num_outputs(self.num_params, dim, layer)
        device = self._perm.device
        index = lastlayer_index(c, dim, layer, device=device)
        width = index.shape[1]
        row_of = torch.empty(self.num_params, dtype=torch.long, device=device)
        col_of = torch.empty_like(row_of)
        row_of[index.reshape(-1)] = torch.arange(c, device=device).repeat_interleave(width)
        col_of[index.reshape(-1)] = torch.arange(width, device=device).repeat(c)
        feats = lastlayer_features(phi, layer)
        rows = torch.arange(c, device=device).unsqueeze(-1)
        terms: dict[int, tuple[Tensor, Tensor]] = {}
        for b, r1 in zip(self.blocks, self._r1, strict=True):
            cols = col_of[b.index[0]]
            if (
                b.index.shape[0] != c
                or not torch.equal(row_of[b.index], rows.expand_as(b.index))
                or not torch.equal(col_of[b.index], cols.expand_as(b.index))
            ):
                raise ValueError(
                    f"kron: the Kronecker blocks do not match the [W, b] layout of the output "
                    f"layer {layer.name!r}; use functional_cov with Jacobians"
                )
            s = self._row_variances(b, r1, feats[:, cols])  # (N, C)
            key = id(b.q_out)
            terms[key] = (b.q_out, s if key not in terms else terms[key][1] + s)
        return list(terms.values())

    def functional_cov_lastlayer(self, phi: Tensor, layer: OutputLinear) -> Tensor:
        """``J Sigma J^T`` ``(N, C, C)`` from the output layer's features ``phi (N, D)``:
        ``Q_B diag(s_n) Q_B^T`` (see :meth:`_lastlayer_terms`), O(N (d^2 + C d + C^3)), with
        no Jacobian and no ``(C d)``-sized intermediate per sample."""
        terms = self._lastlayer_terms(phi, layer)
        c = terms[0][0].shape[0]
        svals = torch.stack([s for _, s in terms], dim=1)  # (N, T, C)

        def block(sl_s: Tensor) -> Tensor:
            out = 0
            for t, (q, _) in enumerate(terms):
                out = out + (q * sl_s[:, t, None, :]) @ q.mT
            return out

        return lastlayer_chunked(block, svals, 2 * c * c, (c, c))

    def functional_var_lastlayer(self, phi: Tensor, layer: OutputLinear) -> Tensor:
        """Diagonal of :meth:`functional_cov_lastlayer`, ``(N, C)``: ``s_n (Q_B^2)^T``, O(N C^2)
        beyond the features' O(N (d^2 + C d))."""
        return sum(s @ q.square().mT for q, s in self._lastlayer_terms(phi, layer))

    def precision_dense(self) -> Tensor:
        """``A`` as a dense ``(P, P)`` matrix (small models / tests)."""
        return self._dense(covariance=False)

    def covariance_dense(self) -> Tensor:
        """``Sigma = A^-1`` as a dense ``(P, P)`` matrix."""
        return self._dense(covariance=True)

    def covariance_diag(self) -> Tensor:
        """``diag(Sigma)``, ``(P,)``: ``(Q_out^2) diag(1/eig) (Q_in^2)^T`` per block (minus the
        rank-one terms)."""
        mats = []
        for b, r1 in zip(self.blocks, self._r1, strict=True):
            diag = b.q_out.square() @ b.eig.reciprocal()
            if b.q_in is not None:
                diag = diag @ b.q_in.square().mT
            if r1 is not None:
                assert b.q_in is not None
                r = r1.ue @ b.q_in.mT  # (out, d): row i is Q_in K_i u
                diag = diag - b.q_out.square() @ (r1.beta.unsqueeze(-1) * r.square())
            mats.append(diag)
        return self._merge(mats)
