"""Closed-form prior (and noise) tuning from the curvature's eigenvalues.

The Laplace log evidence (evidence.py, Immer thesis eq. 3.17-3.18) of a fitted posterior
depends on the prior precision P0 and the GGN scale s (1 / T, times sigma_fit^2 / sigma^2 for
a Gaussian likelihood) only through

    log det(s G + P0),   theta^T P0 theta,   log det P0,   b^T (s G + P0)^-1 b,  b = s g - P0 theta.

When P0 is constant on each eigenvector of G, i.e. G = V diag(lambda) V^T and
P0 V = V diag(delta_{k(j)}) with k(j) the prior group of eigenvector j (a scalar prior on any
structure; a per-layer prior on Kronecker blocks that hold one tensor each; any diagonal prior
on a diagonal G, whose eigenbasis is the identity), with u = V^T g and w = V^T theta cached
once per fit:

    log Z = L(sigma) - 1/2 sum_k delta_k t_k + 1/2 sum_k n_k log delta_k
            - 1/2 sum_j log d_j + 1/2 sum_j r_j^2 / d_j,
    d_j = s lambda_j + delta_{k(j)},   r_j = s u_j - delta_{k(j)} w_j,

with t_k = sum of theta_i^2 and n_k the number of parameters in group k (the last sum is the
non-MAP correction of Thm 3.3, present only when it is switched on). Evaluated as in
:mod:`gaussify.evidence`, without cancellation at large priors: with e_j = s lambda_j,
h_j = s u_j and hw_j = h_j w_j + 1/2 e_j w_j^2,

    log Z = L - 1/2 sum_j log1p(e_j / delta_j) + sum_j (1/2 h_j^2 - delta_j hw_j) / d_j

with the correction, L - 1/2 sum_k delta_k t_k - 1/2 sum_j log1p(e_j / delta_j) without it,
and the rule of :mod:`gaussify.evidence`: where the Newton model's log-likelihood
L + sum_j (h_j z_j - 1/2 e_j z_j^2), z_j = r_j / d_j, exceeds the likelihood's supremum
(``supremum_ref``; for a tunable Gaussian noise -N C (log sigma + 1/2 log 2 pi) / T) the value
and gradient are those without the correction. Each evaluation and its gradient cost O(P) on
(P,) vectors, whatever the structure; tuning runs a hand-written Adam (the update of
``torch.optim.Adam`` with its defaults) on the log-hyperparameters, in float64 NumPy, without
autograd or any (P, P) matrix. The gradient is

    d log Z / d log delta_k = sum_{j in k} (1/2 e_j / d_j - delta_j (hw_j e_j + 1/2 h_j^2) / d_j^2)
                              (with the correction),
    d log Z / d log delta_k = sum_{j in k} 1/2 e_j / d_j - 1/2 delta_k t_k (without),
    d log Z / d s = sum_j (-1/2 lambda_j / d_j + u_j z_j - 1/2 lambda_j z_j^2),
    d log Z / d log sigma = dL / d log sigma - 2 s d log Z / d s,

(the z terms with the correction only) and for a Gaussian likelihood L(sigma) = (-SSE /
(2 sigma^2) - N C log sigma - N C log(2 pi) / 2) / T with dL / d log sigma = (SSE / sigma^2 -
N C) / T.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from gaussify.evidence import rule_fires

__all__ = ["Spectrum", "adam_maximize", "build_spectrum"]

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


@dataclass(frozen=True)
class Spectrum:
    """What the evidence needs from one fit, as float64 NumPy arrays (see the module doc).

    ``eigenvalues (P,)`` lambda of G; ``group (P,)`` prior group of each eigenvector;
    ``group_size (K,)`` n_k; ``theta_sq (K,)`` t_k; ``grad_proj``/``theta_proj (P,)`` u and w
    (None without the correction). Noise: ``scale_ref`` s at ``sigma_ref``, so that
    s(sigma) = scale_ref (sigma_ref / sigma)^2; ``log_lik_ref`` L at sigma_ref; ``sse``
    (sum over outputs and data) and ``count`` (N C) for a tunable Gaussian noise, else None.
    """

    eigenvalues: np.ndarray
    group: np.ndarray
    group_size: np.ndarray
    theta_sq: np.ndarray
    grad_proj: np.ndarray | None
    theta_proj: np.ndarray | None
    scale_ref: float
    sigma_ref: float
    log_lik_ref: float
    temperature: float
    sse: float | None = None
    count: int = 0
    supremum_ref: float | None = None

    @property
    def num_groups(self) -> int:
        return int(self.group_size.shape[0])

    def _group_sum(self, values: np.ndarray) -> np.ndarray:
        if self.num_groups == 1:
            return np.array([values.sum()])
        return np.bincount(self.group, weights=values, minlength=self.num_groups)

    def _noise(self, log_sigma: float | None) -> tuple[float, float, float, float | None]:
        """(s, L, dL / d log sigma, L_sup) at sigma = exp(log_sigma) (None: the reference
        noise); L_sup is the likelihood's supremum for the correction's rule (None: none)."""
        if log_sigma is None or self.sse is None:
            return self.scale_ref, self.log_lik_ref, 0.0, self.supremum_ref
        inv_var = math.exp(-2.0 * log_sigma)
        scale = self.scale_ref * self.sigma_ref**2 * inv_var
        norm = self.count * (log_sigma + 0.5 * math.log(2 * math.pi)) / self.temperature
        log_lik = -0.5 * self.sse * inv_var / self.temperature - norm
        supremum = None if self.supremum_ref is None else -norm
        return scale, log_lik, (self.sse * inv_var - self.count) / self.temperature, supremum

    def evidence(
        self, log_prior: np.ndarray, log_sigma: float | None = None, *, value: bool = True
    ) -> tuple[float, np.ndarray, float]:
        """(log Z or nan if not ``value``, d log Z / d log delta (K,), d log Z / d log sigma).

        With the correction, the rule of :mod:`gaussify.evidence` applies: where the Newton
        model's log-likelihood L + sum_j (h_j z_j - 1/2 e_j z_j^2) exceeds L_sup, the value and
        gradient are those without the correction (:meth:`correction_dropped` tells)."""
        prior = np.exp(log_prior)
        delta = prior[0] if self.num_groups == 1 else prior[self.group]
        scale, log_lik, dlik, supremum = self._noise(log_sigma)
        lam = self.eigenvalues
        e = scale * lam
        d = e + delta
        inv = 1.0 / d
        per_dir = 0.5 * e * inv  # d/d log delta_j of -1/2 log1p(e_j / delta_j)
        d_scale = -0.5 * float(lam @ inv)
        out = math.nan
        logdet_term = -0.5 * float(np.log1p(e / delta).sum()) if value else math.nan
        terms = self._correction_terms(scale, delta, d, log_lik, supremum)
        if terms is None:
            if value:
                out = log_lik - 0.5 * float(prior @ self.theta_sq) + logdet_term
            grad_prior = self._group_sum(per_dir) - 0.5 * prior * self.theta_sq
        else:
            h, hw, z = terms
            assert self.grad_proj is not None
            if value:
                out = log_lik + float(((0.5 * h * h - delta * hw) * inv).sum()) + logdet_term
            # d/d delta of (1/2 h^2 - delta hw) / d is -(hw e + 1/2 h^2) / d^2
            per_dir = per_dir - delta * (hw * e + 0.5 * h * h) * inv * inv
            grad_prior = self._group_sum(per_dir)
            d_scale += float(self.grad_proj @ z) - 0.5 * float(lam @ (z * z))
        grad_sigma = dlik - 2.0 * scale * d_scale if self.sse is not None else 0.0
        return out, grad_prior, grad_sigma

    def _correction_terms(
        self,
        scale: float,
        delta: np.ndarray | float,
        d: np.ndarray,
        log_lik: float,
        supremum: float | None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(h = s u, h w + 1/2 e w^2, z = (h - delta w) / d) when the correction applies, None
        without it or where the rule drops it."""
        if self.grad_proj is None or self.theta_proj is None:
            return None
        u, w = self.grad_proj, self.theta_proj
        h = scale * u
        z = (h - delta * w) / d
        e = scale * self.eigenvalues
        if rule_fires(log_lik, float((h * z - 0.5 * e * z * z).sum()), supremum):
            return None
        return h, h * w + 0.5 * e * w * w, z

    def correction_dropped(self, log_prior: np.ndarray, log_sigma: float | None = None) -> bool:
        """Whether the rule of :mod:`gaussify.evidence` drops the correction at these
        hyperparameters (False without the correction)."""
        if self.grad_proj is None:
            return False
        prior = np.exp(log_prior)
        delta = prior[0] if self.num_groups == 1 else prior[self.group]
        scale, log_lik, _, supremum = self._noise(log_sigma)
        d = scale * self.eigenvalues + delta
        return self._correction_terms(scale, delta, d, log_lik, supremum) is None


def build_spectrum(
    eigenvalues: Tensor,
    group: Tensor,
    theta: Tensor,
    projections: Sequence[Tensor],
    *,
    scale_ref: float,
    sigma_ref: float,
    log_lik_ref: float,
    temperature: float,
    sse: float | None = None,
    count: int = 0,
    param_group: Tensor | None = None,
    supremum_ref: float | None = None,
) -> Spectrum:
    """A :class:`Spectrum` from torch tensors: ``eigenvalues`` and ``group`` (P,) per
    eigenvector, ``theta (P,)`` = theta* - m0 in parameter order with its groups
    ``param_group`` (default ``group``, for an identity eigenbasis), ``projections`` either
    empty (no correction) or (V^T g, V^T theta)."""
    param_group = group if param_group is None else param_group
    num_groups = int(param_group.max()) + 1 if param_group.numel() else 1

    def np64(t: Tensor) -> np.ndarray:
        return t.detach().to(device="cpu", dtype=torch.float64).numpy()

    pg = param_group.detach().cpu().numpy().astype(np.int64)
    theta64 = np64(theta)
    grad_proj = np64(projections[0]) if projections else None
    theta_proj = np64(projections[1]) if projections else None
    return Spectrum(
        eigenvalues=np.ascontiguousarray(np64(eigenvalues)),
        group=np.ascontiguousarray(group.detach().cpu().numpy().astype(np.int64)),
        group_size=np.bincount(pg, minlength=num_groups).astype(np.float64),
        theta_sq=np.bincount(pg, weights=theta64 * theta64, minlength=num_groups),
        grad_proj=grad_proj,
        theta_proj=theta_proj,
        scale_ref=float(scale_ref),
        sigma_ref=float(sigma_ref),
        log_lik_ref=float(log_lik_ref),
        temperature=float(temperature),
        sse=sse,
        count=count,
        supremum_ref=supremum_ref,
    )


def adam_maximize(
    spectrum: Spectrum,
    log_prior: np.ndarray,
    log_sigma: float | None,
    *,
    n_steps: int,
    lr: float,
) -> tuple[np.ndarray, float | None]:
    """``n_steps`` of Adam (``torch.optim.Adam``'s update, betas (0.9, 0.999), eps 1e-8) on
    -log Z over the log prior (K,) and, when ``log_sigma`` is not None, the log noise."""
    beta1, beta2 = ADAM_BETAS
    if log_sigma is None and spectrum.num_groups == 1 and spectrum.grad_proj is None:
        return np.array([_adam_scalar(spectrum, float(log_prior[0]), n_steps, lr)]), None
    x = np.array(log_prior, dtype=np.float64)
    tune = log_sigma is not None
    if tune:
        x = np.append(x, float(log_sigma))
    k = x.shape[0] - (1 if tune else 0)
    m = np.zeros_like(x)
    v = np.zeros_like(x)
    for t in range(1, n_steps + 1):
        _, g_prior, g_sigma = spectrum.evidence(x[:k], float(x[k]) if tune else None, value=False)
        g = -np.append(g_prior, g_sigma) if tune else -g_prior
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        step = lr / (1 - beta1**t)
        x = x - step * m / (np.sqrt(v) / math.sqrt(1 - beta2**t) + ADAM_EPS)
    return x[:k], (float(x[k]) if tune else None)


def _adam_scalar(spectrum: Spectrum, x: float, n_steps: int, lr: float) -> float:
    """:func:`adam_maximize` for one prior, no correction, fixed noise, in Python floats:
    d log Z / d log delta = -delta t / 2 + n / 2 - delta / 2 sum_j 1 / (s lambda_j + delta),
    one pass over the eigenvalues per step."""
    beta1, beta2 = ADAM_BETAS
    scaled = spectrum.scale_ref * spectrum.eigenvalues
    t_sq, half_n = float(spectrum.theta_sq[0]), 0.5 * float(spectrum.group_size[0])
    m = v = 0.0
    for t in range(1, n_steps + 1):
        delta = math.exp(x)
        trace = float(np.reciprocal(scaled + delta).sum())
        g = -(half_n - 0.5 * delta * (t_sq + trace))  # Adam minimises -log Z
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        x -= lr / (1 - beta1**t) * m / (math.sqrt(v) / math.sqrt(1 - beta2**t) + ADAM_EPS)
    return x
