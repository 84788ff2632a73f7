"""Structured square roots of Lambda_n for the batched backward pass of a chain.

The exact GGN's output vectors are the columns of a factor L_n with L_n L_n^T = Lambda_n
(thesis eq. 2.24). For the built-in likelihoods that factor is diagonal minus rank one,

    L_n = diag(s_n) - q_n s_n^T,   column k: u_{n,k} = s_{n,k} (e_k - q_n),

softmax: s = sqrt(p), q = p (``Categorical.hessian_sqrt``: L L^T = diag(p) - p p^T as
sum(p) = 1), or the C - 1 columns of a rank-(C - 1) root (:func:`softmax_factor`, the one
used: Lambda has rank C - 1); a diagonal Lambda (Gaussian, Bernoulli, heteroscedastic
Gaussian): s = sqrt(diag Lambda), q = 0. Held as the two (N, C) tensors s and q, the K
vectors cost 2 C numbers per sample instead of K C, and their product with a final
``nn.Linear``'s weight W (C, d), the first step of the backward pass, is

    u_{n,k}^T W = s_{n,k} (W_k - q_n^T W)     (B, K, d) in O(B K d), not O(B K C d),

with the layer's own reduction sum_k u_{n,k,c}^2 = q_c^2 sum_k s_k^2 + s_c^2 (1 - 2 q_c)
(the diagonal of Lambda_n for all K vectors) in O(B C). Any square root gives the same
diagonal GGN and Kronecker factors (they depend on L L^T only), so the values equal the
dense route's to round-off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gaussify.likelihoods import Bernoulli, Categorical, Gaussian, HeteroscedasticGaussian

__all__ = ["SqrtFactor", "softmax_factor", "sqrt_factor"]

#: likelihoods whose ``hessian_sqrt`` is diag_embed(sqrt(hessian_diag)) (q = 0)
_DIAGONAL = (Gaussian, Bernoulli, HeteroscedasticGaussian)


@dataclass(frozen=True)
class SqrtFactor:
    """The output vectors u_{n,k} = s_{n,k} (e_k - q_n) of the rows of ``s`` (B, C), for the
    columns k in [``lo``, ``hi``) (a group of vectors; all C by default); ``q`` (B, C) or
    None (q = 0)."""

    s: Tensor
    q: Tensor | None
    lo: int = 0
    hi: int | None = None

    @property
    def num_vectors(self) -> int:
        return (self.s.shape[1] if self.hi is None else self.hi) - self.lo

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, K, C), the shape of the dense vectors."""
        return (self.s.shape[0], self.num_vectors, self.s.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.s.dtype

    def rows(self, rows: slice) -> SqrtFactor:
        """The vectors of the samples ``rows`` (views)."""
        q = None if self.q is None else self.q[rows]
        return SqrtFactor(self.s[rows], q, self.lo, self.hi)

    def columns(self, lo: int, hi: int) -> SqrtFactor:
        """The vectors k in [lo, hi) of this group (relative to it)."""
        start = self.lo + lo
        return SqrtFactor(self.s, self.q, start, min(self.lo + hi, self.lo + self.num_vectors))

    def to(self, dtype: torch.dtype) -> SqrtFactor:
        q = None if self.q is None else self.q.to(dtype)
        return SqrtFactor(self.s.to(dtype), q, self.lo, self.hi)

    def dense(self) -> Tensor:
        """The vectors as a (B, K, C) tensor: row k is s_k (e_k - q)."""
        b, k, c = self.shape
        hi = self.lo + k
        s = self.s[:, self.lo : hi]
        out = torch.zeros(b, k, c, dtype=self.s.dtype, device=self.s.device)
        if self.q is not None:
            out.sub_(s.unsqueeze(-1) * self.q.unsqueeze(1))
        out[:, :, self.lo : hi].diagonal(dim1=-2, dim2=-1).add_(s)
        return out

    def through_linear(self, weight: Tensor) -> Tensor:
        """u_k^T W for W (C, d), a final linear layer's weight: (B, K, d) = s_k (W_k - q^T W),
        one broadcast product (and q W, B d numbers) instead of a (B, K, C) @ (C, d) product."""
        hi = self.lo + self.num_vectors
        s = self.s[:, self.lo : hi].unsqueeze(-1)
        rows = weight[self.lo : hi].unsqueeze(0)
        if self.q is None:
            return s * rows
        return (rows - (self.q @ weight).unsqueeze(1)).mul_(s)

    def squared_sums(self) -> Tensor:
        """sum_k u_{k,c}^2 over this group's vectors, (B, C): q_c^2 sum_k s_k^2 plus, for c in
        the group, s_c^2 (1 - 2 q_c)."""
        hi = self.lo + self.num_vectors
        s2 = self.s[:, self.lo : hi] * self.s[:, self.lo : hi]
        if self.q is None:
            out = torch.zeros_like(self.s)
            out[:, self.lo : hi] = s2
            return out
        out = self.q * self.q * s2.sum(1, keepdim=True)
        out[:, self.lo : hi].add_(s2 * (1 - 2 * self.q[:, self.lo : hi]))
        return out


def sqrt_factor(likelihood: object, f: Tensor) -> SqrtFactor | None:
    """The structured factor of Lambda at the outputs f (N, C) for the built-in likelihoods
    (exact types: a subclass may override ``hessian_sqrt``), else None. The likelihood's own
    checks of f run (NaN / inf outputs raise as ``hessian_sqrt`` does)."""
    kind = type(likelihood)
    if kind is Categorical:
        p = likelihood.inverse_link(f)  # softmax, with f's checks
        return softmax_factor(p)
    if kind in _DIAGONAL:
        return SqrtFactor(likelihood.hessian_diag(f).sqrt(), None)  # type: ignore[attr-defined]
    return None


def softmax_factor(p: Tensor) -> SqrtFactor:
    """The C - 1 vectors of a rank-(C - 1) square root of Lambda = diag(p) - p p^T (softmax
    probabilities p (N, C), C >= 2): u_k = sqrt(p_k) (e_k - q), k < C, with
    q_c = p_c / (1 + sqrt(p_C)) for c < C and q_C = sqrt(p_C).

    Derivation: Lambda 1 = 0, so v^T Lambda v = w^T Lambda_11 w for w = T v, T = [I, -1]
    ((C - 1) x C): Lambda = T^T Lambda_11 T with Lambda_11 = diag(p') - p' p'^T (the leading
    block, p' = p_{1..C-1}) = D^1/2 (I - a a^T) D^1/2, D = diag(p'), a = sqrt(p'),
    |a|^2 = 1 - p_C. Its square root D^1/2 (I - alpha a a^T) needs 2 alpha - alpha^2 |a|^2 = 1:
    alpha = 1 / (1 + sqrt(p_C)); L = T^T D^1/2 (I - alpha a a^T) has the columns above
    (the last row: -sqrt(p_k) (1 - alpha (1 - p_C)) = -sqrt(p_k) sqrt(p_C)). One vector
    fewer than ``Categorical.hessian_sqrt``'s C: half the backward pass for C = 2."""
    c = p.shape[1]
    if c < 2:
        return SqrtFactor(p.sqrt(), p)
    root_last = p[:, -1:].sqrt()
    q = p / (1 + root_last)
    q[:, -1:] = root_last
    return SqrtFactor(p.sqrt(), q, 0, c - 1)
