"""vbll's classification layers (``DiscClassification``, ``tDiscClassification``,
``HetClassification``, ``GenClassification``) with vbll's constructor arguments, parameter
names and objective (see :mod:`gaussify.compat.vbll`).

Logits ``z = W x + e`` with q(W) rows as in :mod:`.vbll_rows`. The predictive of the
discriminative layers is vbll's Monte-Carlo average of softmax over 20 draws of z (drawn with
torch's distributions in vbll's order, so the same seed gives the same draws); the generative
layer's is closed form.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, distributions, nn

from gaussify.compat.vbll.layers.regression import (
    VBLLReturn,
    _GammaNoise,
    _het_means,
    _HetRows,
    _rows,
    _weight_rows,
    wishart_term,
)
from gaussify.compat.vbll.rows import (
    Normal,
    Rows,
    check_parameterization,
    expected_gaussian_kl,
    gaussian_kl,
)

__all__ = ["DiscClassification", "GenClassification", "HetClassification", "tDiscClassification"]


def _mc_probs(logits: Normal, n_samples: int) -> Tensor:
    """Average softmax over ``n_samples`` draws of the logits, clipped to [0, 1]."""
    draws = logits.rsample(torch.Size([n_samples]))
    return torch.clip(F.softmax(draws, dim=-1).mean(0), min=0.0, max=1.0)


def _picked(values: Tensor, y: Tensor) -> Tensor:
    return values[torch.arange(values.shape[0]), y]


def _check_bound(value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"softmax_bound: expected one of {list(allowed)}, got {value!r}")
    return value


def _kn_alpha(module: nn.Module, softmax_bound: str, kn_alpha: float | None) -> None:
    """The learnable ``alpha`` of the reduced Knowles-Minka bound (0.1 unless given)."""
    if softmax_bound == "reduced_kn":
        module.alpha = nn.Parameter(torch.ones(1) * (0.1 if kn_alpha is None else kn_alpha))


class _Categorical(nn.Module):
    """Shared forward of the discriminative layers: Categorical predictive, losses, OOD score
    (the maximum predictive probability)."""

    return_ood: bool

    def logit_predictive(self, x: Tensor, *args: bool) -> Any:
        raise NotImplementedError

    def forward(self, x: Tensor) -> VBLLReturn:
        return self._output(x)

    def predictive(self, x: Tensor, n_samples: int = 20) -> Tensor:
        """vbll's Monte-Carlo predictive: softmax averaged over ``n_samples`` logit draws."""
        return _mc_probs(self.logit_predictive(x), n_samples)

    def _train_loss(self, x: Tensor) -> Callable[[Tensor], Tensor]:
        raise NotImplementedError

    def _output(self, x: Tensor, *args: bool) -> VBLLReturn:
        out = VBLLReturn(
            distributions.Categorical(probs=self.predictive(x, *args)),
            self._train_loss(x),
            lambda y: -torch.mean(torch.log(_picked(self.predictive(x, *args), y))),
        )
        if self.return_ood:
            out.ood_scores = self.max_predictive(x, *args)
        return out

    def max_predictive(self, x: Tensor, *args: bool) -> Tensor:
        return torch.max(self.predictive(x, *args), dim=-1)[0]


class DiscClassification(_Categorical):
    """Discriminative VBLL classification (vbll ``DiscClassification``): z = W x + e,
    e ~ N(0, diag(exp(noise_logdiag))^2); prior W ~ N(0, s I), s = 2 prior_scale / in_features.
    Train loss (negative of) ``mean_n[E z_y - logsumexp_k(E z_k + Var z_k / 2)]`` (Jensen bound)
    ``+ regularization_weight (nu log det Sigma^-1 - wishart_scale/2 tr Sigma^-1 - KL)``,
    ``nu = (dof + out + 1) / 2``.
    """

    def __init__(
        self, in_features: int, out_features: int, regularization_weight: float,
        parameterization: str = "dense", softmax_bound: str = "jensen", return_ood: bool = False,
        prior_scale: float = 1.0, wishart_scale: float = 1.0, dof: float = 1.0,
        cov_rank: int | None = 3,
    ) -> None:  # fmt: skip
        super().__init__()
        self.parameterization = check_parameterization(
            parameterization, ("dense", "diagonal", "lowrank")
        )
        _check_bound(softmax_bound, ("jensen",))
        self.wishart_scale = wishart_scale
        self.dof = (dof + out_features + 1.0) / 2.0
        self.regularization_weight = regularization_weight
        self.prior_scale = prior_scale * 2.0 / in_features
        self.noise_mean = nn.Parameter(torch.zeros(out_features), requires_grad=False)
        self.noise_logdiag = nn.Parameter(torch.randn(out_features) - 1)
        shape, std = (out_features, in_features), math.sqrt(2.0 / in_features)
        logdiag = (1e-3, -math.log(in_features))
        _weight_rows(self, "W", parameterization, shape, std, logdiag, 1e-3 / in_features, cov_rank)
        self.return_ood = return_ood

    def W(self) -> Rows:
        return _rows(self, "W", self.parameterization)

    def noise(self) -> Normal:
        return Normal(self.noise_mean, self.noise_logdiag.exp())

    def logit_predictive(self, x: Tensor) -> Normal:
        return (self.W() @ x).plus(self.noise())

    def jensen_bound(self, x: Tensor, y: Tensor) -> Tensor:
        z = self.logit_predictive(x)
        return _picked(z.mean, y) - torch.logsumexp(z.mean + 0.5 * z.var, dim=-1)

    softmax_bound = jensen_bound

    def _train_loss(self, x: Tensor) -> Callable[[Tensor], Tensor]:
        def loss(y: Tensor) -> Tensor:
            noise = self.noise()
            wishart = wishart_term(self, noise)
            reg = wishart - gaussian_kl(self.W(), self.prior_scale)
            return -(torch.mean(self.softmax_bound(x, y)) + self.regularization_weight * reg)

        return loss


def _kn_bound(wx: Normal, y: Tensor, alpha: Tensor, exp_cov: Tensor, exp_prec: Tensor) -> Tensor:
    """vbll's reduced Knowles-Minka bound on E log softmax(z)_y with c = Var(W x) + 1."""
    c = wx.variance + 1
    lse = torch.logsumexp(wx.mean + alpha * c, dim=-1)
    penalty = c * (exp_cov / 4 + exp_prec * alpha**2 - alpha)
    return _picked(wx.mean, y) - lse - 0.5 * penalty.sum(-1)


def _semi_mc_bound(z: Normal, y: Tensor) -> Tensor:
    return _picked(z.mean, y) - torch.logsumexp(z.mean + 0.5 * z.var, dim=-1)


class tDiscClassification(_GammaNoise, _Categorical):
    """Student-t VBLL classification (vbll ``tDiscClassification``): a Gamma posterior on each
    logit's noise precision, prior Gamma(dof, 1 / wishart_scale); W prior variance
    2 prior_scale / (E[sigma^2] in_features) with E[sigma^2] = rate / (dof - 1)."""

    def __init__(
        self, in_features: int, out_features: int, regularization_weight: float,
        parameterization: str = "dense", softmax_bound: str = "reduced_kn",
        return_ood: bool = False, prior_scale: float = 1.0, wishart_scale: float = 1.0,
        dof: float = 2.0, cov_rank: int | None = None, kn_alpha: float | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.parameterization = check_parameterization(parameterization, ("dense", "diagonal"))
        self.bound = _check_bound(softmax_bound, ("semimontecarlo", "reduced_kn"))
        self.regularization_weight = regularization_weight
        self._init_gamma_noise(out_features, dof, wishart_scale)
        exp_cov = self.prior_rate / (dof - 1)
        self.prior_scale = prior_scale * 2.0 / (exp_cov * in_features)
        shape, std = (out_features, in_features), math.sqrt(2.0 / in_features)
        logdiag = (1e-3, -0.5 * math.log(in_features))
        _weight_rows(self, "W", parameterization, shape, std, logdiag, 1e-3, None)
        _kn_alpha(self, softmax_bound, kn_alpha)
        self.return_ood = return_ood

    @property
    def W(self) -> Rows:
        return _rows(self, "W", self.parameterization)

    def softmax_bound(self, x: Tensor, y: Tensor) -> Tensor:
        if self.bound == "semimontecarlo":
            return _semi_mc_bound(self.logit_predictive(x), y)
        exp_cov = (self.noise_log_rate - self.noise_log_dof + 1).exp()
        exp_prec = (self.noise_log_dof - self.noise_log_rate).exp()
        return _kn_bound(self.W @ x, y, self.alpha, exp_cov, exp_prec)

    def logit_predictive(self, x: Tensor) -> Normal:
        sigma2 = 1.0 / self.noise.rsample(torch.Size([x.shape[0]]))
        wx = self.W @ x
        return Normal(wx.mean, ((wx.variance + 1) * sigma2).sqrt())

    def _train_loss(self, x: Tensor) -> Callable[[Tensor], Tensor]:
        def loss(y: Tensor) -> Tensor:
            noise = self.noise
            kl = distributions.kl_divergence(noise, self.noise_prior).sum(-1)
            factor = noise.concentration / noise.rate
            kl = kl + expected_gaussian_kl(self.W, self.prior_scale, factor)
            return -(torch.mean(self.softmax_bound(x, y)) - self.regularization_weight * kl)

        return loss


class HetClassification(_HetRows, _Categorical):
    """Heteroscedastic VBLL classification (vbll ``HetClassification``): log sigma^2(x) = M x
    with q(M) like q(W); prior variances prior_scale / in_features and
    noise_prior_scale / in_features."""

    def __init__(
        self, in_features: int, out_features: int, regularization_weight: float,
        parameterization: str = "dense", softmax_bound: str = "reduced_kn",
        return_ood: bool = False, prior_scale: float = 1.0, noise_prior_scale: float = 0.01,
        cov_rank: int | None = None, kn_alpha: float | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.parameterization = check_parameterization(parameterization, ("dense", "diagonal"))
        self.bound = _check_bound(softmax_bound, ("semimontecarlo", "reduced_kn"))
        self.regularization_weight = regularization_weight
        _het_means(self, in_features, out_features, prior_scale, noise_prior_scale)
        shape = (out_features, in_features)
        self.W_logdiag = nn.Parameter(1e-3 * torch.randn(*shape) - 0.5 * math.log(in_features))
        self.M_logdiag = nn.Parameter(
            1e-3 * torch.randn(*shape) + 0.5 * math.log(noise_prior_scale / in_features)
        )
        if parameterization == "dense":
            square = (out_features, in_features, in_features)
            self.W_offdiag = nn.Parameter(1e-3 * torch.randn(*square) / in_features)
            self.M_offdiag = nn.Parameter(
                1e-3 * torch.randn(*square) / in_features + 0.5 * math.log(noise_prior_scale)
            )
        _kn_alpha(self, softmax_bound, kn_alpha)
        self.return_ood = return_ood

    def softmax_bound(self, x: Tensor, y: Tensor) -> Tensor:
        if self.bound == "semimontecarlo":
            return _semi_mc_bound(self.logit_predictive(x, False), y)
        log_noise = self.M @ x
        half_var = 0.5 * log_noise.scale**2
        exp_cov = (log_noise.mean + half_var).exp()
        exp_prec = (-log_noise.mean + half_var).exp()
        return _kn_bound(self.W @ x, y, self.alpha, exp_cov, exp_prec)

    def logit_predictive(self, x: Tensor, consistent_variance: bool) -> Normal:
        return self._noisy_outputs(x, consistent_variance)

    def forward(self, x: Tensor, consistent_variance: bool = False) -> VBLLReturn:
        return self._output(x, consistent_variance)

    def predictive(  # type: ignore[override]
        self, x: Tensor, consistent_variance: bool, n_samples: int = 20
    ) -> Tensor:
        return _mc_probs(self.logit_predictive(x, consistent_variance), n_samples)

    def _train_loss(self, x: Tensor) -> Callable[[Tensor], Tensor]:
        def loss(y: Tensor) -> Tensor:
            log_noise = self.M @ x
            inv_sigma2 = (-log_noise.mean + 0.5 * log_noise.scale**2).exp()
            kl_w = torch.mean(expected_gaussian_kl(self.W, self.prior_scale, inv_sigma2))
            kl_m = gaussian_kl(self.M, self.noise_prior_scale)
            bound = torch.mean(self.softmax_bound(x, y))
            return -(bound - self.regularization_weight * (kl_w + kl_m))

        return loss


class GenClassification(_Categorical):
    """Generative VBLL classification (vbll ``GenClassification``, "diagonal" only): class
    embeddings mu_k ~ q = N(mu_mean_k, diag(exp(mu_logdiag_k))^2), features
    x | y=k ~ N(mu_k, diag(exp(noise_logdiag))^2); prior mu_k ~ N(0, prior_scale I) (not divided
    by the width). Logits: log N(x | mu_mean_k, Var mu_k + Sigma) summed over features;
    predictive softmax of the logits (closed form)."""

    def __init__(
        self, in_features: int, out_features: int, regularization_weight: float,
        parameterization: str = "dense", softmax_bound: str = "jensen", return_ood: bool = False,
        prior_scale: float = 1.0, wishart_scale: float = 1.0, dof: float = 1.0,
    ) -> None:  # fmt: skip
        super().__init__()
        if parameterization != "diagonal":
            raise ValueError(
                "parameterization: GenClassification supports only 'diagonal' (as vbll), got "
                f"{parameterization!r}"
            )
        _check_bound(softmax_bound, ("jensen",))
        self.parameterization = parameterization
        self.wishart_scale = wishart_scale
        self.dof = (dof + in_features + 1.0) / 2.0
        self.regularization_weight = regularization_weight
        self.prior_scale = prior_scale
        self.noise_mean = nn.Parameter(torch.zeros(in_features), requires_grad=False)
        self.noise_logdiag = nn.Parameter(torch.randn(in_features))
        self.mu_mean = nn.Parameter(0.1 * torch.randn(out_features, in_features))
        self.mu_logdiag = nn.Parameter(torch.randn(out_features, in_features))
        self.return_ood = return_ood

    def mu(self) -> Normal:
        return Normal(self.mu_mean, self.mu_logdiag.exp())

    def noise(self) -> Normal:
        return Normal(self.noise_mean, self.noise_logdiag.exp())

    def logit_predictive(self, x: Tensor) -> Tensor:
        return self.mu().plus(self.noise()).log_prob(x.unsqueeze(-2)).sum(-1)

    def jensen_bound(self, x: Tensor, y: Tensor) -> Tensor:
        noise = self.noise()
        linear = Normal(noise.mean + self.mu_mean[y], noise.scale).log_prob(x).sum(-1)
        trace = (self.mu().var[y] / noise.var).sum(-1)
        return linear - 0.5 * trace - torch.logsumexp(self.logit_predictive(x), dim=-1)

    softmax_bound = jensen_bound

    def predictive(self, x: Tensor) -> Tensor:  # type: ignore[override]
        return torch.clip(F.softmax(self.logit_predictive(x), dim=-1), min=0.0, max=1.0)

    def _train_loss(self, x: Tensor) -> Callable[[Tensor], Tensor]:
        def loss(y: Tensor) -> Tensor:
            noise = self.noise()
            wishart = wishart_term(self, noise)
            rows = Rows("diagonal", self.mu_mean, self.mu_logdiag, None)
            reg = wishart - gaussian_kl(rows, self.prior_scale)
            return -(torch.mean(self.softmax_bound(x, y)) + self.regularization_weight * reg)

        return loss
