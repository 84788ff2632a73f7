"""vbll's regression layers (``Regression``, ``tRegression``, ``HetRegression``) with vbll's
constructor arguments, parameter names and objective, so a vbll checkpoint gives the same
loss and predictive (see :mod:`gaussify.compat.vbll`).

Notation: features ``x (N, D)``, ``out`` outputs, q(W) rows as in :mod:`.vbll_rows`,
``s`` the prior variance of W (vbll's ``prior_scale`` divided by the width as noted per class).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, distributions, nn

from gaussify.compat.vbll.rows import (
    Normal,
    Rows,
    check_parameterization,
    expected_gaussian_kl,
    gaussian_kl,
)

__all__ = ["HetRegression", "Regression", "VBLLReturn", "tRegression"]


@dataclass
class VBLLReturn:
    """What a vbll layer's forward returns: the predictive distribution, the training loss
    (negative ELBO per datum) and the validation loss (predictive NLL) as functions of y."""

    predictive: Any
    train_loss_fn: Callable[[Tensor], Tensor]
    val_loss_fn: Callable[[Tensor], Tensor]
    ood_scores: Any = None


def _rows_parameters(
    module: nn.Module,
    prefix: str,
    kind: str,
    shape: tuple[int, int],
    logdiag: Tensor,
    offdiag_scale: float,
    cov_rank: int | None,
) -> None:
    """Register ``{prefix}_logdiag`` and, for the non-diagonal kinds, ``{prefix}_offdiag``."""
    out, d = shape
    setattr(module, f"{prefix}_logdiag", nn.Parameter(logdiag))
    if kind == "diagonal":
        return
    if kind == "lowrank":
        if cov_rank is None:
            raise ValueError("cov_rank: parameterization 'lowrank' needs an integer rank")
        offdiag = torch.randn(out, d, cov_rank) * offdiag_scale
    else:
        offdiag = torch.randn(out, d, d) * offdiag_scale
    setattr(module, f"{prefix}_offdiag", nn.Parameter(offdiag))


def _rows(module: nn.Module, prefix: str, kind: str) -> Rows:
    return Rows(
        kind,
        getattr(module, f"{prefix}_mean"),
        getattr(module, f"{prefix}_logdiag"),
        getattr(module, f"{prefix}_offdiag", None),
    )


def _weight_rows(
    module: nn.Module,
    prefix: str,
    kind: str,
    shape: tuple[int, int],
    std: float,
    logdiag: tuple[float, float],
    offdiag_scale: float,
    cov_rank: int | None,
) -> None:
    """vbll's initialisation of a Gaussian layer, in vbll's order of random draws:
    ``{prefix}_mean = std * randn(shape)``, then ``{prefix}_logdiag = logdiag[0] * randn(shape)
    + logdiag[1]``, then the off-diagonal part (:func:`_rows_parameters`)."""
    setattr(module, f"{prefix}_mean", nn.Parameter(torch.randn(*shape) * std))
    diag = logdiag[0] * torch.randn(*shape) + logdiag[1]
    _rows_parameters(module, prefix, kind, shape, diag, offdiag_scale, cov_rank)


def _het_means(
    module: nn.Module, in_features: int, out_features: int, prior_scale: float, noise_scale: float
) -> None:
    """vbll's heteroscedastic layers: prior variances ``prior_scale / in`` (W) and
    ``noise_scale / in`` (M), the fixed zero noise mean, then ``W_mean`` and ``M_mean`` drawn
    ``N(0, 2 / in)`` in that order."""
    module.prior_scale = prior_scale / in_features
    module.noise_prior_scale = noise_scale / in_features
    module.noise_mean = nn.Parameter(torch.zeros(out_features), requires_grad=False)
    std = math.sqrt(2.0 / in_features)
    module.W_mean = nn.Parameter(torch.randn(out_features, in_features) * std)
    module.M_mean = nn.Parameter(torch.randn(out_features, in_features) * std)


class _HetRows(nn.Module):
    """q(W) and q(M) (the log-noise layer) of vbll's heteroscedastic layers."""

    parameterization: str

    @property
    def W(self) -> Rows:
        return _rows(self, "W", self.parameterization)

    @property
    def M(self) -> Rows:
        return _rows(self, "M", self.parameterization)

    def _noisy_outputs(self, x: Tensor, consistent_variance: bool) -> Normal:
        """``N(W x mean, (x^T S x + 1) sigma^2)`` with one draw of the log noise ``M x`` (of
        ``M`` itself with ``consistent_variance``), in vbll's order of draws."""
        if consistent_variance:
            sigma2 = (x @ self.M.rsample().T).exp()
        else:
            sigma2 = (self.M @ x).rsample().exp()
        wx = self.W @ x
        return Normal(wx.mean, ((wx.variance + 1) * sigma2).sqrt())


def wishart_term(module: Any, noise: Normal) -> Tensor:
    """vbll's Wishart-style noise penalty ``nu log det Sigma^-1 - wishart_scale / 2 tr
    Sigma^-1`` with ``nu = module.dof``."""
    return module.dof * noise.logdet_precision - 0.5 * module.wishart_scale * noise.trace_precision


class _GammaNoise(nn.Module):
    """vbll's Student-t noise: ``q(tau_k) = Gamma(exp(noise_log_dof), exp(noise_log_rate))``
    against the prior ``Gamma(dof, 1 / wishart_scale)``."""

    def _init_gamma_noise(self, out_features: int, dof: float, wishart_scale: float) -> None:
        self.wishart_scale = wishart_scale
        self.prior_dof = dof
        self.prior_rate = 1.0 / wishart_scale
        self.noise_log_dof = nn.Parameter(torch.ones(out_features) * math.log(dof))
        self.noise_log_rate = nn.Parameter(torch.ones(out_features) * math.log(self.prior_rate))

    @property
    def noise(self) -> distributions.Gamma:
        return distributions.Gamma(self.noise_log_dof.exp(), self.noise_log_rate.exp())

    @property
    def noise_prior(self) -> distributions.Gamma:
        return distributions.Gamma(self.prior_dof, self.prior_rate)


class Regression(nn.Module):
    """Variational Bayesian last-layer regression (vbll ``Regression``).

    y = W x + e, e ~ N(0, diag(sigma^2)) with sigma = exp(noise_logdiag) learned as a point
    estimate under a Wishart-style penalty; q(W) per ``parameterization``; prior
    W ~ N(0, s I) with s = prior_scale / in_features. Train loss (the negative of)
    ``mean_{n,k}[log N(y_nk | m_k^T x_n, sigma_k^2) - 1/2 x_n^T S_k x_n sum_j sigma_j^-2]
    + regularization_weight (nu log det Sigma^-1 - wishart_scale/2 tr Sigma^-1 - KL)`` with
    ``nu = (dof + out + 1) / 2``. Predictive: N(W x, x^T S x + sigma^2) per output.
    """

    def __init__(
        self, in_features: int, out_features: int, regularization_weight: float,
        parameterization: str = "dense", prior_scale: float = 1.0, wishart_scale: float = 1e-2,
        cov_rank: int | None = None, dof: float = 1.0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.parameterization = check_parameterization(parameterization)
        self.wishart_scale = wishart_scale
        self.dof = (dof + out_features + 1.0) / 2.0
        self.regularization_weight = regularization_weight
        self.prior_scale = prior_scale / in_features
        self.noise_mean = nn.Parameter(torch.zeros(out_features), requires_grad=False)
        self.noise_logdiag = nn.Parameter(torch.randn(out_features) * math.log(wishart_scale))
        sign = 1.0 if parameterization == "dense_precision" else -1.0
        scale = 0.0 if parameterization == "dense_precision" else 1.0 / in_features
        shift = sign * 0.5 * math.log(in_features)
        shape = (out_features, in_features)
        _weight_rows(self, "W", parameterization, shape, 1.0, (1.0, shift), scale, cov_rank)

    def W(self) -> Rows:
        return _rows(self, "W", self.parameterization)

    def noise(self) -> Normal:
        return Normal(self.noise_mean, self.noise_logdiag.exp())

    def forward(self, x: Tensor) -> VBLLReturn:
        return VBLLReturn(self.predictive(x), self._train_loss(x), self._val_loss(x))

    def predictive(self, x: Tensor) -> Normal:
        return (self.W() @ x).plus(self.noise())

    def _train_loss(self, x: Tensor) -> Callable[[Tensor], Tensor]:
        def loss(y: Tensor) -> Tensor:
            w, noise = self.W(), self.noise()
            log_lik = distributions.Normal(x @ w.mean.T, noise.scale).log_prob(y)
            trace = 0.5 * w.quad(x) * noise.trace_precision
            elbo = torch.mean(log_lik - trace) + self.regularization_weight * (
                wishart_term(self, noise) - gaussian_kl(w, self.prior_scale)
            )
            return -elbo

        return loss

    def _val_loss(self, x: Tensor) -> Callable[[Tensor], Tensor]:
        return lambda y: -self.predictive(x).log_prob(y).sum(-1).mean(0)


class tRegression(_GammaNoise):
    """Student-t VBLL regression (vbll ``tRegression``): a Gamma posterior q(tau_k) =
    Gamma(exp(noise_log_dof), exp(noise_log_rate)) on each output's noise precision, prior
    Gamma(dof, 1 / wishart_scale); prior W ~ N(0, s I), s = 2 prior_scale / in_features.
    Predictive: Student-t with 2 alpha degrees of freedom, scale sqrt((x^T S x + 1) beta/alpha).
    Train loss (negative of) ``-1/2 mean_n[sum_k E[tau_k] (y - m_k^T x)^2 + sum_k x^T S_k x -
    sum_k E[log tau_k]] - regularization_weight (KL_W + KL_tau)`` with the W KL's mean term
    weighted by E[tau_k] (vbll's form).
    """

    def __init__(
        self, in_features: int, out_features: int, regularization_weight: float,
        parameterization: str = "dense", prior_scale: float = 100.0, wishart_scale: float = 100.0,
        cov_rank: int | None = None, dof: float = 1.0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.parameterization = check_parameterization(
            parameterization, ("dense", "diagonal", "lowrank")
        )
        self.regularization_weight = regularization_weight
        self._init_gamma_noise(out_features, dof, wishart_scale)
        self.prior_scale = prior_scale * 2.0 / in_features
        scale = 1e-3 / in_features if parameterization == "dense" else 1e-3
        shape, std = (out_features, in_features), math.sqrt(2.0 / in_features)
        logdiag = (1e-3, -0.5 * math.log(in_features))
        _weight_rows(self, "W", parameterization, shape, std, logdiag, scale, cov_rank)

    @property
    def W(self) -> Rows:
        return _rows(self, "W", self.parameterization)

    def forward(self, x: Tensor) -> VBLLReturn:
        return VBLLReturn(self.predictive(x), self._train_loss(x), self._val_loss(x))

    def predictive(self, x: Tensor) -> distributions.StudentT:
        noise = self.noise
        wx = self.W @ x
        scale2 = (wx.variance + 1) * noise.rate / noise.concentration
        return distributions.StudentT(2 * noise.concentration, wx.mean, scale2.sqrt())

    def _train_loss(self, x: Tensor) -> Callable[[Tensor], Tensor]:
        def loss(y: Tensor) -> Tensor:
            w, noise = self.W, self.noise
            factor = noise.concentration / noise.rate  # E[tau_k]
            fit = (factor * (y - x @ w.mean.T) ** 2).sum(-1)
            log_tau = (torch.digamma(noise.concentration) - noise.rate.log()).sum(-1)
            kl = expected_gaussian_kl(w, self.prior_scale, factor)
            kl = kl + distributions.kl_divergence(noise, self.noise_prior).sum(-1)
            elbo = -0.5 * torch.mean(fit + w.quad(x).sum(-1) - log_tau)
            return -(elbo - self.regularization_weight * kl)

        return loss

    def _val_loss(self, x: Tensor) -> Callable[[Tensor], Tensor]:
        return lambda y: -self.predictive(x).log_prob(y).sum(-1).mean(0)


class HetRegression(_HetRows):
    """Heteroscedastic VBLL regression (vbll ``HetRegression``): log sigma^2(x) = M x with a
    second Gaussian q(M) (same parameterization, "dense" or "diagonal"); prior variances
    prior_scale / in_features (W) and noise_prior_scale / in_features (M). The forward's
    predictive is one draw of the noise (``consistent_variance``: one draw of M instead of
    one of M x): N(W x mean, (x^T S x + 1) sigma^2). The training loss keeps vbll's exact
    expression, including how its (N,) and (N, out) terms broadcast.
    """

    def __init__(
        self, in_features: int, out_features: int, regularization_weight: float,
        parameterization: str = "dense", prior_scale: float = 1.0,
        noise_prior_scale: float = 0.01, grad_correction_scale: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.parameterization = check_parameterization(parameterization, ("dense", "diagonal"))
        self.regularization_weight = regularization_weight
        self.grad_correction = grad_correction_scale
        _het_means(self, in_features, out_features, prior_scale, noise_prior_scale)
        shape = (out_features, in_features)
        for prefix, shift in (
            ("W", -0.5 * math.log(in_features)),
            ("M", 0.5 * math.log(noise_prior_scale / in_features)),
        ):
            logdiag = 1e-3 * torch.randn(*shape) + shift
            _rows_parameters(
                self, prefix, parameterization, shape, logdiag, 1e-3 / in_features, None
            )

    def forward(self, x: Tensor, consistent_variance: bool = False) -> VBLLReturn:
        return VBLLReturn(
            self.predictive_sample(x, consistent_variance),
            self._train_loss(x),
            self._val_loss(x, consistent_variance),
        )

    def predictive_sample(self, x: Tensor, consistent_variance: bool) -> Normal:
        return self._noisy_outputs(x, consistent_variance)

    def _train_loss(self, x: Tensor) -> Callable[[Tensor], Tensor]:
        def loss(y: Tensor) -> Tensor:
            w = self.W
            log_noise = self.M @ x
            inv_sigma2 = (-log_noise.mean + 0.5 * log_noise.scale**2).exp()  # E[sigma^-2]
            weight = inv_sigma2.detach() ** self.grad_correction
            mse = ((y - x @ w.mean.T).pow(2) * inv_sigma2).sum(-1)
            terms = mse + log_noise.mean.sum(-1) + w.quad(x)
            elbo = -0.5 * torch.mean(weight * terms)
            kl_w = torch.mean(weight * expected_gaussian_kl(w, self.prior_scale, inv_sigma2))
            kl_m = torch.mean(weight * gaussian_kl(self.M, self.noise_prior_scale))
            return -(elbo - self.regularization_weight * (kl_w + kl_m))

        return loss

    def _val_loss(self, x: Tensor, consistent_variance: bool, n_samples: int = 20) -> Any:
        def loss(y: Tensor) -> Tensor:
            total: Tensor | float = 0.0
            for _ in range(n_samples):
                pred = self.predictive_sample(x, consistent_variance)
                total = total - torch.mean(pred.log_prob(y).sum(-1))
            return total / n_samples  # type: ignore[return-value]

        return loss
