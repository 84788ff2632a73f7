"""The log evidence of a fitted :class:`Laplace`: which formula of :mod:`gaussify.evidence`
evaluates it, and with what.

Where the curvature structure has an eigenbasis that diagonalises the prior without a new
factorisation (its ``spectrum``: diag with any prior, kron with one prior per block, full with
a scalar prior once G's eigendecomposition is cached), the evidence is evaluated per
eigenvector (:func:`gaussify.evidence.eigenbasis_log_evidence`: the correction merged with the
prior term, the same formula that :mod:`gaussify.spectral` tunes); elsewhere from the
posterior precision's log det and solves (:func:`gaussify.evidence.laplace_log_evidence`),
in float64 where the structure offers ``logdet_wide`` / ``solve_wide``. Both apply the rule
that drops an impossible non-MAP correction; a drop warns once per fit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gaussify.curvature.subset import expand_prior
from gaussify.evidence import (
    EvidenceValue,
    eigenbasis_log_evidence,
    gaussian_log_likelihood,
    laplace_log_evidence,
    log_likelihood_supremum,
    warn_dropped_correction,
)
from gaussify.spectral import Spectrum, build_spectrum
from gaussify.weight_space.laplace_fields import Granularity, LaplaceFields

__all__ = ["fitted_log_evidence", "fitted_spectrum", "log_lik_and_supremum", "prior_groups"]


def log_lik_and_supremum(la: LaplaceFields, sigma: Tensor) -> tuple[Tensor, Tensor | None]:
    """(tempered log-likelihood at theta*, its supremum L_sup for the correction's rule, or
    None without the correction)."""
    outputs = 1 if la._sse is None else la._sse.numel()
    sup = log_likelihood_supremum(la.likelihood, la.num_data, outputs, sigma, la.temperature)
    sup = sup if la.correction else None
    if la.task != "regression":
        return la._log_lik / la.temperature, sup
    assert la._sse is not None
    return gaussian_log_likelihood(la._sse, la.num_data, sigma, la.temperature), sup


def _eigenbasis(
    la: LaplaceFields, prior: Tensor, theta: Tensor
) -> tuple[Tensor, Tensor, list] | None:
    """The structure's (eigenvalues, prior group per eigenvector, [V^T g, V^T theta] with the
    correction) for ``prior``'s granularity, when it has them without a new factorisation."""
    method = getattr(la._curvature, "spectrum", None)
    if method is None or not getattr(la._curvature, "eigenbasis_cached", True):
        return None
    p, k = la.subset.num_params, prior.numel()
    per_tensor = k == len(la.subset.names) and k != p
    groups = prior_groups(la, "scalar" if k == 1 else ("layer" if per_tensor else "diag"))
    return method(groups, [la._grad, theta] if la.correction else [])


def fitted_log_evidence(la: LaplaceFields, prior: Tensor, sigma: Tensor) -> EvidenceValue:
    """The log evidence of the fitted ``la`` at prior precision ``prior`` and noise ``sigma``
    (float64, differentiable in both; warns where the correction is dropped)."""
    post = la.posterior_at(prior, sigma)  # validates prior and sigma
    scale = la._scale(sigma)
    log_lik, supremum = log_lik_and_supremum(la, sigma)
    theta = la.mean - la.prior_mean  # the prior N(m0, P0^-1) sees theta - m0
    prior_vec = expand_prior(prior, la.subset)
    parts = _eigenbasis(la, prior, theta)
    if parts is not None:
        evals, eig_groups, projections = parts
        delta = prior.reshape(-1).to(torch.float64)[eig_groups.to(prior.device)]
        result = eigenbasis_log_evidence(
            log_lik, evals, scale, delta, prior_vec, theta, projections, supremum=supremum
        )
    else:
        result = laplace_log_evidence(
            log_lik,
            theta,
            prior_vec,
            getattr(post, "logdet_wide", post.logdet)(),
            getattr(post, "solve_wide", post.solve),
            la._grad * scale if la.correction else None,  # g / T scales like G
            supremum=supremum,
        )
    if result.dropped:
        warn_dropped_correction(result, la, la._curvature)
    return result


def prior_groups(la: LaplaceFields, granularity: Granularity) -> Tensor:
    """(P,) index of the prior value each parameter takes at ``granularity``."""
    p = la.subset.num_params
    if granularity == "scalar":
        return torch.zeros(p, dtype=torch.long)
    if granularity == "layer":
        counts = torch.tensor(list(la.subset.counts))
        return torch.arange(len(counts)).repeat_interleave(counts)
    return torch.arange(p)


def fitted_spectrum(
    la: LaplaceFields, granularity: Granularity, *, tune_noise: bool = False
) -> Spectrum | None:
    """The fitted evidence as a closed-form function of the prior at ``granularity`` (and,
    with ``tune_noise``, of a scalar regression noise): a :class:`gaussify.spectral.Spectrum`,
    or None where the structure's eigenbasis does not diagonalise that prior (full with a
    per-tensor or per-parameter prior, kron with per-parameter or joint weight+bias blocks
    under per-tensor priors, lowrank, user structures): those tune through autograd."""
    method = getattr(la._curvature, "spectrum", None)
    if not la._spectral_tuning or method is None:
        return None
    if tune_noise and la.sigma_noise.ndim != 0:
        return None
    theta = la.mean - la.prior_mean
    groups = prior_groups(la, granularity)
    out = method(groups, [la._grad, theta] if la.correction else [])
    if out is None:
        return None
    eigenvalues, eig_groups, projections = out
    sigma = la.sigma_noise
    scale = float(la._scale(sigma))
    log_lik, supremum = log_lik_and_supremum(la, sigma)
    tunable = tune_noise and la.task == "regression"
    sse = la._sse
    return build_spectrum(
        eigenvalues,
        eig_groups,
        theta,
        projections,
        scale_ref=scale,
        sigma_ref=float(sigma.reshape(-1)[0]),
        log_lik_ref=float(log_lik),
        temperature=la.temperature,
        sse=float(sse.sum()) if tunable and sse is not None else None,
        count=la.num_data * (sse.numel() if sse is not None else 1),
        param_group=groups,
        supremum_ref=None if supremum is None else float(supremum),
    )
