"""Predictive distributions from a Gaussian over outputs, shared by every posterior.

A posterior hands over either an output-space Gaussian ``f ~ N(f_mean (N, C), f_cov (N, C, C))``
(the GLM / linearised predictive, Immer thesis eq. 3.15-3.16; Immer et al. 2021, eq. 6) or a
stack of function samples ``(S, N, C)`` (NN sampling, thesis eq. 3.14). This module turns it into
a :class:`Predictive` for the likelihood:

* regression: closed form ``N(f_mean, f_cov + diag(sigma^2))``;
* classification: ``link="probit"`` (MacKay 1992; the multi-class form
  ``softmax(mu / sqrt(1 + pi/8 var))``), ``"bridge"`` (the Laplace bridge to a Dirichlet,
  Hobbhahn et al. 2022, eq. 5) or ``"mc"`` (average of the inverse link over samples).

A new link approximation is one function registered in ``LINKS``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from gaussify import draws
from gaussify.validation import check_count

__all__ = [
    "LINKS",
    "LinkName",
    "Predictive",
    "gaussian_samples",
    "laplace_bridge",
    "noise_variance",
    "posterior_predictive",
    "predictive_from_gaussian",
    "predictive_from_samples",
    "probit",
]

LinkName = Literal["probit", "bridge", "mc"]


def _stable_cholesky(cov: Tensor) -> Tensor:
    """Cholesky factor of a batch of PSD matrices, adding jitter (with one warning) if needed."""
    chol, info = torch.linalg.cholesky_ex(cov)
    if not bool((info > 0).any()):
        return chol
    eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)
    scale = cov.diagonal(dim1=-2, dim2=-1).abs().mean().clamp_min(1e-30)
    for exponent in range(-10, 0):
        jitter = float(scale) * 10.0**exponent
        chol, info = torch.linalg.cholesky_ex(cov + jitter * eye)
        if not bool((info > 0).any()):
            warnings.warn(
                f"f_cov: not positive definite; added jitter {jitter:.2e} to sample from it",
                stacklevel=3,
            )
            return chol
    raise ValueError("f_cov: not positive semi-definite (Cholesky failed even with jitter)")


def gaussian_samples(
    mean: Tensor, cov: Tensor, num_samples: int, generator: torch.Generator | None = None
) -> Tensor:
    """Draw ``(S, N, C)`` samples from ``N(mean (N, C), cov (N, C, C))`` independently per n."""
    num_samples = check_count(num_samples, "num_samples")
    chol = _stable_cholesky(cov)
    eps = draws.normal(
        (num_samples, *mean.shape), dtype=mean.dtype, device=mean.device, generator=generator
    )
    return mean + torch.einsum("nij,snj->sni", chol, eps)


def probit(f_mean: Tensor, f_var: Tensor, task: str = "classification") -> Tensor:
    """Probit approximation of E[softmax(f)] (or E[sigmoid(f)] for ``task="binary"``) under
    ``f ~ N(f_mean, diag(f_var))``: the inverse link of ``f_mean / sqrt(1 + pi/8 f_var)``."""
    kappa = f_mean / torch.sqrt(1.0 + math.pi / 8.0 * f_var)
    return torch.sigmoid(kappa) if task == "binary" else torch.softmax(kappa, dim=-1)


def laplace_bridge(f_mean: Tensor, f_var: Tensor) -> Tensor:
    """Mean of the Laplace-bridge Dirichlet (Hobbhahn et al. 2022, eq. 5) for softmax outputs:
    alpha_k = (1 - 2/K + e^{mu_k} / K^2 sum_l e^{-mu_l}) / var_k, probs = alpha / sum(alpha).

    Uses the diagonal variances; the exponential term is formed in log space so large logits
    do not overflow before the normalisation.
    """
    num_classes = f_mean.shape[-1]
    log_term = f_mean - 2 * math.log(num_classes) + torch.logsumexp(-f_mean, dim=-1, keepdim=True)
    # log alpha_k = log(1 - 2/K + exp(log_term)) - log var_k, computed stably.
    # For K = 2 the constant 1 - 2/K vanishes; its log is then -inf and logaddexp handles it.
    log_base = math.log(1.0 - 2.0 / num_classes) if num_classes > 2 else -math.inf
    log_alpha = torch.logaddexp(torch.full_like(log_term, log_base), log_term) - f_var.log()
    return torch.softmax(log_alpha, dim=-1)


def _mc_link(
    f_mean: Tensor,
    f_cov: Tensor,
    task: str,
    num_samples: int,
    generator: torch.Generator | None,
) -> Tensor:
    samples = gaussian_samples(f_mean, f_cov, num_samples, generator)
    return _inverse_link(samples, task).mean(0)


LINKS: dict[str, Callable[..., Tensor]] = {
    "probit": lambda m, c, task, s, g: probit(m, c.diagonal(dim1=-2, dim2=-1), task),
    "bridge": lambda m, c, task, s, g: laplace_bridge(m, c.diagonal(dim1=-2, dim2=-1)),
    "mc": _mc_link,
}


def _inverse_link(f: Tensor, task: str) -> Tensor:
    if task == "classification":
        return torch.softmax(f, dim=-1)
    if task == "binary":
        return torch.sigmoid(f)
    return f


@dataclass
class Predictive:
    """The predictive of any posterior in the library at N inputs with C outputs.

    Attributes: ``task``; ``f_mean (N, C)`` and ``f_cov (N, C, C)`` of the latent function
    (``f_cov`` is None for sample-based predictives); ``f_samples (S, N, C)`` when the
    predictive came from samples; ``noise_var (C,)`` for regression; ``probs (N, C)`` for
    classification (softmax) and binary (per-output sigmoid) tasks. Optionally ``noise_cov
    (C, C)``, a full regression noise covariance (correlated outputs, e.g. VBLL regression,
    Harrison et al. 2024 eq. 17): when set, ``noise_var`` must be its diagonal, ``cov`` adds
    the full matrix and ``log_prob`` is the joint multivariate Gaussian density. ``joint_cov
    (N C, N C)``, when a joint predictive was asked for, is the covariance of the latent
    function across all test points and outputs (row ``n * C + c``); its diagonal blocks are
    ``f_cov``.
    """

    task: str
    f_mean: Tensor
    f_cov: Tensor | None = None
    f_samples: Tensor | None = None
    noise_var: Tensor | None = None
    probs: Tensor | None = None
    noise_cov: Tensor | None = None
    joint_cov: Tensor | None = None

    @property
    def f_var(self) -> Tensor:
        """Variance of the latent function, (N, C)."""
        if self.f_cov is not None:
            return self.f_cov.diagonal(dim1=-2, dim2=-1)
        assert self.f_samples is not None
        return self.f_samples.var(0, unbiased=False)

    @property
    def _latent_mean(self) -> Tensor:
        if self.f_samples is not None and self.f_cov is None:
            return self.f_samples.mean(0)
        return self.f_mean

    @property
    def _half(self) -> int:
        return self.f_mean.shape[-1] // 2

    def _expected_noise(self) -> Tensor:
        """Heteroscedastic tasks: E[sigma^2] = E[exp(s)] over the latent log variance s,
        exp(m_s + v_s / 2) for a Gaussian s, the sample mean for samples. (N, C)."""
        c = self._half
        if self.f_samples is not None and self.f_cov is None:
            return self.f_samples[..., c:].exp().mean(0)
        return torch.exp(self.f_mean[:, c:] + 0.5 * self.f_var[:, c:])

    @property
    def mean(self) -> Tensor:
        """Regression: predictive mean of y. Classification: mean of the latent f. (N, C)
        (for heteroscedastic regression, the mean half of the outputs)."""
        if self.task == "heteroscedastic":
            return self._latent_mean[:, : self._half]
        return self._latent_mean

    @property
    def var(self) -> Tensor:
        """Predictive variance (N, C): function variance, plus noise for regression (the
        expected input-dependent noise for heteroscedastic regression)."""
        if self.task == "heteroscedastic":
            return self.f_var[:, : self._half] + self._expected_noise()
        if self.task == "regression" and self.noise_var is not None:
            return self.f_var + self.noise_var
        return self.f_var

    @property
    def cov(self) -> Tensor | None:
        """Predictive covariance (N, C, C) when available (plus noise for regression)."""
        if self.f_cov is None:
            return None
        if self.task == "heteroscedastic":
            c = self._half
            return self.f_cov[:, :c, :c] + torch.diag_embed(self._expected_noise())
        if self.task == "regression" and self.noise_cov is not None:
            return self.f_cov + self.noise_cov
        if self.task == "regression" and self.noise_var is not None:
            return self.f_cov + torch.diag_embed(self.noise_var.expand_as(self.f_mean))
        return self.f_cov

    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> Tensor:
        """Samples of the latent function, (S, N, C): drawn from the Gaussian, or the stored
        samples (the first S) for sample-based predictives."""
        if self.f_cov is not None:
            return gaussian_samples(self.f_mean, self.f_cov, num_samples, generator)
        assert self.f_samples is not None
        if num_samples > self.f_samples.shape[0]:
            raise ValueError(
                f"num_samples: this predictive holds {self.f_samples.shape[0]} samples, "
                f"asked for {num_samples}"
            )
        return self.f_samples[:num_samples]

    def log_prob(self, y: Tensor) -> Tensor:
        """Predictive log density of targets, (N,): Gaussian for regression (diagonal; the
        joint density with ``cov`` when ``noise_cov`` is set), the log of ``probs`` at the
        labels for classification and binary tasks."""
        if self.task == "regression" and self.noise_cov is not None and self.f_cov is not None:
            cov = self.cov
            assert cov is not None
            y = y.reshape(self.f_mean.shape).to(self.f_mean)
            dist = torch.distributions.MultivariateNormal(self.f_mean, covariance_matrix=cov)
            return dist.log_prob(y)
        if self.task in ("regression", "heteroscedastic"):
            mean, var = self.mean, self.var
            y = y.reshape(mean.shape).to(mean)
            return (-0.5 * ((y - mean).square() / var + var.log() + math.log(2 * math.pi))).sum(-1)
        assert self.probs is not None
        if self.task == "classification":
            return self.probs.clamp_min(1e-12).log().gather(-1, y.long().unsqueeze(-1)).squeeze(-1)
        y = y.reshape(self.probs.shape).to(self.probs)
        p = self.probs.clamp(1e-12, 1 - 1e-12)
        return (y * p.log() + (1 - y) * (1 - p).log()).sum(-1)

    def decompose(
        self, num_samples: int = 1000, generator: torch.Generator | None = None
    ) -> dict[str, Tensor]:
        """Split the predictive variance into aleatoric and epistemic parts (N, C).

        Regression: aleatoric = sigma^2 (heteroscedastic: E[sigma^2(x)]), epistemic = Var[f]
        of the mean. Classification / binary (Kwon
        et al. 2020; Immer et al. 2021, App. B eq. B11): with p = inverse link of sampled f,
        aleatoric = E[p (1 - p)], epistemic = E[(p - E p)^2]; their sum is E p (1 - E p).
        Also returns ``entropy`` (total predictive entropy), ``expected_entropy`` and
        ``mutual_information`` (N,) for classification.
        """
        if self.task == "heteroscedastic":
            noise, epistemic = self._expected_noise(), self.f_var[:, : self._half]
            return {"aleatoric": noise, "epistemic": epistemic, "total": noise + epistemic}
        if self.task == "regression":
            noise = (
                torch.zeros_like(self.f_mean)
                if self.noise_var is None
                else self.noise_var.expand_as(self.f_mean)
            )
            return {"aleatoric": noise, "epistemic": self.f_var, "total": noise + self.f_var}
        f = (
            self.f_samples
            if self.f_cov is None
            else gaussian_samples(self.f_mean, self.f_cov, num_samples, generator)
        )
        assert f is not None
        p = _inverse_link(f, self.task)
        p_bar = p.mean(0)
        out = {
            "aleatoric": (p * (1 - p)).mean(0),
            "epistemic": (p - p_bar).square().mean(0),
        }
        out["total"] = out["aleatoric"] + out["epistemic"]
        if self.task == "classification":
            entropy = -torch.special.xlogy(p_bar, p_bar).sum(-1)
            expected = -torch.special.xlogy(p, p).sum(-1).mean(0)
            out.update(
                entropy=entropy, expected_entropy=expected, mutual_information=entropy - expected
            )
        return out


def predictive_from_gaussian(
    f_mean: Tensor,
    f_cov: Tensor,
    task: str,
    *,
    link: LinkName = "probit",
    noise_var: Tensor | None = None,
    num_samples: int = 100,
    generator: torch.Generator | None = None,
) -> Predictive:
    """Build the predictive from an output-space Gaussian ``N(f_mean (N, C), f_cov (N, C, C))``.

    ``task`` is the likelihood's task; ``link`` chooses the classification approximation;
    ``noise_var (C,)`` is the observation noise of a regression likelihood.
    """
    if f_cov.shape != (*f_mean.shape, f_mean.shape[-1]):
        raise ValueError(
            f"f_cov: expected shape {(*f_mean.shape, f_mean.shape[-1])}, got {tuple(f_cov.shape)}"
        )
    if not torch.isfinite(f_cov).all():
        raise ValueError("f_cov: contains NaN or inf (the posterior covariance is not valid)")
    if task in ("regression", "heteroscedastic"):
        return Predictive(task, f_mean, f_cov=f_cov, noise_var=noise_var)
    if link not in LINKS:
        raise ValueError(f"link: expected one of {sorted(LINKS)}, got {link!r}")
    if link == "bridge" and task != "classification":
        raise ValueError("link: 'bridge' approximates softmax outputs; use 'probit' or 'mc'")
    probs = LINKS[link](f_mean, f_cov, task, num_samples, generator)
    return Predictive(task, f_mean, f_cov=f_cov, probs=probs)


def predictive_from_samples(
    f_samples: Tensor, task: str, *, noise_var: Tensor | None = None
) -> Predictive:
    """Build the predictive from function samples ``(S, N, C)`` (e.g. NN sampling, thesis
    eq. 3.14): probs are the average of the inverse link over samples."""
    if f_samples.ndim != 3:
        raise ValueError(f"f_samples: expected shape (S, N, C), got {tuple(f_samples.shape)}")
    regression = task in ("regression", "heteroscedastic")
    probs = None if regression else _inverse_link(f_samples, task).mean(0)
    return Predictive(
        task, f_samples.mean(0), f_samples=f_samples, noise_var=noise_var, probs=probs
    )


def noise_variance(task: str, sigma_noise: Tensor) -> Tensor | None:
    """The observation noise variance sigma^2 per output (flattened) of a regression
    likelihood; None for the other tasks (their predictive adds no noise)."""
    return sigma_noise.square().reshape(-1) if task == "regression" else None


def posterior_predictive(
    f_mean: Tensor,
    f_cov: Tensor,
    task: str,
    sigma_noise: Tensor,
    link: LinkName = "probit",
    num_samples: int = 100,
    generator: torch.Generator | None = None,
) -> Predictive:
    """:func:`predictive_from_gaussian` of a posterior's output Gaussian N(f_mean, f_cov), with
    the noise of ``sigma_noise`` added for regression (:func:`noise_variance`)."""
    return predictive_from_gaussian(
        f_mean,
        f_cov,
        task,
        link=link,
        noise_var=noise_variance(task, sigma_noise),
        num_samples=num_samples,
        generator=generator,
    )
