"""Gaussian Bayesian last layer trained on the exact marginal likelihood (GBLL).

The Bayesian-last-layer baseline of Watson et al. (2021) that Harrison, Willes & Snoek (2024,
Tables 2-3, App. F) compare VBLL with: Bayesian linear regression on the features
``phi = phi(x; theta) in R^D`` of a network,

    y_c = w_c^T phi + eps_c,    w_c ~ N(0, alpha^-1 I),    eps_c ~ N(0, sigma_c^2),

with the weights integrated out exactly and the feature weights ``theta``, the prior
precision ``alpha`` and the noise variances ``sigma_c^2`` trained *jointly* by maximising the
log marginal likelihood of the training targets (type-II maximum likelihood, full batch as in
Watson et al.). For each output c, with ``Phi (N, D)``, ``A_c = alpha I + Phi^T Phi /
sigma_c^2`` and the posterior mean ``m_c = A_c^-1 Phi^T y_c / sigma_c^2``,

    log p(y_c | Phi) = log N(y_c | 0, Phi Phi^T / alpha + sigma_c^2 I)
        = -N/2 log 2pi - N/2 log sigma_c^2 + D/2 log alpha - 1/2 log|A_c|
          - 1/2 (||y_c - Phi m_c||^2 / sigma_c^2 + alpha ||m_c||^2)

(Woodbury and the determinant lemma; one D x D Cholesky factor of ``A_c``, never the N x N
covariance: O(N D^2 + D^3) per output). ``train_loss(y) = -sum_c log p(y_c | Phi) / N``.

The posterior is that of the data given to :meth:`GBLLRegression.fit_posterior` (or
accumulated batch by batch with :meth:`GBLLRegression.update_posterior`): the head keeps the
sufficient statistics ``G = Phi^T Phi`` and ``B = Phi^T Y`` as buffers, and at the *current*
hyperparameters ``q(w_c) = N(m_c, A_c^-1)`` and the predictive is

    p(y_c | phi) = N(m_c^T phi, phi^T A_c^-1 phi + sigma_c^2).

Training changes the features, so call ``fit_posterior(body(x_train), y_train)`` after
training (a forward pass does not refit: the loss is traced by ``torch.func`` transforms and
must not write buffers). Before any data the posterior is the prior ``N(0, alpha^-1 I)``,
and using it warns (a forgotten ``fit_posterior`` would otherwise predict mean 0 silently).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.linalg import solve_triangular

from gaussify.last_layer.base import RegressionHead, check_positive, check_regression_targets
from gaussify.last_layer.covariance import DensePrecision, GaussianRows
from gaussify.last_layer.noise import NoiseCovariance
from gaussify.predictive import Predictive
from gaussify.validation import check_count

__all__ = ["GBLLEvidence", "GBLLRegression", "gbll_evidence"]

_LOG_2PI = math.log(2 * math.pi)


@dataclass
class GBLLEvidence:
    """The exact evidence of a Bayesian linear regression and its posterior, per output c:
    ``log_evidence (C,)`` = log p(y_c | Phi), ``mean (C, D)`` = m_c, ``precision_tril (C, D,
    D)`` = the Cholesky factor of A_c, ``info (C,)`` = ``torch.linalg.cholesky_ex``'s code
    (> 0: A_c is not positive definite in this precision, and the other fields are garbage)."""

    log_evidence: Tensor
    mean: Tensor
    precision_tril: Tensor
    info: Tensor


def _posterior(
    gram: Tensor, cross: Tensor, prior_precision: Tensor, noise_var: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(L (C, D, D), m (C, D), info (C,))`` from ``G = Phi^T Phi (D, D)``, ``B = Phi^T Y (D,
    C)``: ``A_c = alpha I + G / sigma_c^2 = L_c L_c^T``, ``m_c = A_c^-1 B_c / sigma_c^2``."""
    dim = gram.shape[-1]
    eye = torch.eye(dim, dtype=gram.dtype, device=gram.device)
    prec = prior_precision * eye + gram / noise_var[:, None, None]  # (C, D, D)
    tril, info = torch.linalg.cholesky_ex(0.5 * (prec + prec.mT))
    rhs = (cross.mT / noise_var[:, None]).unsqueeze(-1)  # (C, D, 1)
    mean = torch.cholesky_solve(rhs, tril).squeeze(-1)
    return tril, mean, info


def gbll_evidence(
    phi: Tensor, y: Tensor, prior_precision: Tensor, noise_var: Tensor
) -> GBLLEvidence:
    """Exact log evidence ``log N(y_c | 0, Phi Phi^T / alpha + sigma_c^2 I)`` of each output
    column of ``y (N, C)`` under features ``phi (N, D)``, prior precision ``alpha`` (scalar
    tensor) and noise variances ``noise_var (C,)``, in feature space (module docstring).

    No argument checks and no data-dependent branches, so ``torch.func.vmap`` can trace it;
    :meth:`GBLLRegression.log_marginal_likelihood` is the checked entry point (it refuses
    ``info > 0``)."""
    num, dim = phi.shape
    tril, mean, info = _posterior(phi.mT @ phi, phi.mT @ y, prior_precision, noise_var)
    resid = (y - phi @ mean.mT).square().sum(0)  # (C,)
    fit = resid / noise_var + prior_precision * mean.square().sum(-1)
    logdet_a = 2.0 * tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)
    log_ev = -0.5 * (
        num * _LOG_2PI + num * noise_var.log() - dim * prior_precision.log() + logdet_a + fit
    )
    return GBLLEvidence(log_ev, mean, tril, info)


class GBLLRegression(RegressionHead):
    """Bayesian last layer trained on its exact marginal likelihood (GBLL, Watson et al. 2021).

    ``forward(phi (N, in_features))`` returns a :class:`~gaussify.last_layer.VBLLOutput`:
    ``train_loss(y)`` is the negative log marginal likelihood of ``(phi, y)`` per example (the
    batch is the data set: train full batch), ``predictive`` the exact posterior predictive
    ``N(m^T phi, phi^T A^-1 phi + sigma^2)`` of the data given to :meth:`fit_posterior`.

    Learned, positive hyperparameters: the prior precision ``alpha`` of ``w_c ~ N(0, alpha^-1
    I)`` (stored as ``log_prior_precision``; started at ``prior_precision``, default
    ``in_features``: the prior function variance ``||phi||^2 / D`` of
    :class:`~gaussify.last_layer.VBLLRegression`'s default) and one noise variance per output
    (``noise_cov``, a diagonal :class:`~gaussify.last_layer.NoiseCovariance`, started at
    ``init_noise_var``). Targets should be centred (the model has no bias); append a constant
    feature for one.
    """

    def __init__(
        self, in_features: int, out_features: int, prior_precision: float | None = None,
        init_noise_var: float = 1.0,
    ) -> None:  # fmt: skip
        in_features = check_count(in_features, "in_features")
        if prior_precision is None:
            prior_precision = float(in_features)
        prior_precision = check_positive(prior_precision, "prior_precision")
        # regularization_weight has no role here (no KL term); prior_scale is the initial 1/alpha
        super().__init__(in_features, out_features, 0.0, 1.0 / prior_precision)
        init_noise_var = check_positive(init_noise_var, "init_noise_var")
        self.log_prior_precision = nn.Parameter(torch.tensor(math.log(prior_precision)))
        self.noise_cov = NoiseCovariance(out_features, "diagonal", init_noise_var)
        # sufficient statistics of the data the posterior conditions on (none: the prior)
        self.register_buffer("gram", torch.zeros(in_features, in_features))
        self.register_buffer("cross", torch.zeros(in_features, out_features))
        self.register_buffer("num_data", torch.zeros((), dtype=torch.long))

    # ---- hyperparameters ------------------------------------------------------------------

    @property
    def prior_precision(self) -> Tensor:
        """alpha, a scalar tensor (differentiable)."""
        return self.log_prior_precision.exp()

    @property
    def noise_var(self) -> Tensor:
        """sigma_c^2, (out_features,) (differentiable)."""
        return self.noise_cov.variance

    def _checked_hyperparameters(self) -> tuple[Tensor, Tensor]:
        alpha, noise = self.prior_precision, self.noise_var
        for name, value in (("prior_precision", alpha), ("noise_var", noise)):
            if not bool(torch.isfinite(value).all()) or not bool((value > 0).all()):
                raise ValueError(
                    f"{name}: must be finite and > 0, got {value.detach().tolist()} "
                    "(training diverged? lower the learning rate)"
                )
        return alpha, noise

    @torch.no_grad()
    def set_hyperparameters(
        self, prior_precision: float | None = None, noise_var: float | Tensor | None = None
    ) -> GBLLRegression:
        """Set alpha and/or sigma^2 (a number for every output, or a tensor
        ``(out_features,)``); each must be finite and > 0."""
        if prior_precision is not None:
            value = check_positive(prior_precision, "prior_precision")
            self.log_prior_precision.fill_(math.log(value))
        if noise_var is not None:
            var = torch.as_tensor(noise_var, dtype=self.noise_cov.logdiag.dtype)
            var = var.to(self.noise_cov.logdiag.device).expand(self.out_features).clone()
            if not bool(torch.isfinite(var).all()) or not bool((var > 0).all()):
                raise ValueError(f"noise_var: must be finite and > 0, got {var.tolist()}")
            self.noise_cov.logdiag.copy_(-0.5 * var.log())
        return self

    # ---- the evidence (training objective) ------------------------------------------------

    def log_marginal_likelihood(self, phi: Tensor, y: Tensor) -> Tensor:
        """``sum_c log p(y_c | Phi, alpha, sigma_c^2)`` of the batch ``(phi, y)``, a scalar
        (differentiable in the features and the hyperparameters). Raises ``ValueError`` for bad
        input and when ``A_c`` is not positive definite in the head's precision."""
        phi = self.check_features(phi)
        return self._log_evidence(phi, self.check_targets(y, phi.shape[0]))

    def _log_evidence(self, phi: Tensor, y: Tensor) -> Tensor:
        alpha, noise = self._checked_hyperparameters()
        ev = gbll_evidence(phi, y, alpha, noise)
        _check_info(ev.info, phi.dtype)
        return ev.log_evidence.sum()

    def train_loss(self, phi: Tensor, y: Tensor) -> Tensor:
        """``-log p(Y | Phi, alpha, sigma^2) / N``: the negative log marginal likelihood per
        example of the batch (full batch: the training set)."""
        phi = self.check_features(phi)
        if phi.shape[0] == 0:
            raise ValueError("phi: contains no examples")
        return -self._log_evidence(phi, self.check_targets(y, phi.shape[0])) / phi.shape[0]

    def elbo_terms(self, phi: Tensor, y: Tensor) -> dict[str, Tensor]:
        """``{"log_marginal_likelihood": ()}``: the head has no ELBO; its objective is the exact
        evidence (:meth:`log_marginal_likelihood`)."""
        return {"log_marginal_likelihood": self.log_marginal_likelihood(phi, y)}

    def log_likelihood_bound(self, phi: Tensor, y: Tensor) -> Tensor:
        """Per-example pieces do not exist for the exact evidence (it couples the examples);
        refused with the method to use."""
        raise NotImplementedError(
            "GBLLRegression.log_likelihood_bound: not supported: the exact evidence couples the "
            "examples; use log_marginal_likelihood(phi, y) or train_loss(phi, y)"
        )

    def kl(self) -> Tensor:
        """0: the weights are integrated out exactly (no variational posterior)."""
        return torch.zeros((), dtype=self._dtype(), device=self._device())

    # ---- the posterior --------------------------------------------------------------------

    def check_targets(self, y: Any, num: int) -> Tensor:
        return check_regression_targets(y, num, self.out_features, self.noise_cov.logdiag)

    @torch.no_grad()
    def reset_posterior(self) -> GBLLRegression:
        """Forget the data: the posterior is the prior again."""
        self.gram.zero_()
        self.cross.zero_()
        self.num_data.zero_()
        return self

    @torch.no_grad()
    def update_posterior(self, phi: Tensor, y: Tensor) -> GBLLRegression:
        """Condition on one more batch of features and targets (adds ``Phi^T Phi`` and
        ``Phi^T Y`` to the stored statistics; batches give the same posterior as one call)."""
        phi = self.check_features(phi)
        y = self.check_targets(y, phi.shape[0])
        gram = self.gram + (phi.mT @ phi).to(self.gram)
        cross = self.cross + (phi.mT @ y).to(self.cross)
        for name, value in (("phi", gram), ("y", cross)):
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"{name}: the sufficient statistics overflow (inf); rescale")
        self.gram.copy_(gram)
        self.cross.copy_(cross)
        self.num_data += phi.shape[0]
        return self

    def fit_posterior(self, phi: Tensor, y: Tensor) -> GBLLRegression:
        """Condition the posterior on the training set ``(phi, y)`` (replacing earlier data);
        call it after training with the final features: ``head.fit_posterior(body(x), y)``."""
        phi = self.check_features(phi)
        y = self.check_targets(y, phi.shape[0])
        self.reset_posterior()
        return self.update_posterior(phi, y)

    def _posterior(self) -> tuple[Tensor, Tensor]:
        """``(L (C, D, D), m (C, D))`` at the current hyperparameters; refuses a non-PD A and
        warns when no data was conditioned on (the prior: a forgotten ``fit_posterior``)."""
        if not bool(self.num_data > 0):
            warnings.warn(
                "GBLLRegression: the posterior conditions on no data, so this is the prior "
                "(mean 0); call fit_posterior(features, y) with the training set after training",
                UserWarning,
                stacklevel=3,
            )
        alpha, noise = self._checked_hyperparameters()
        tril, mean, info = _posterior(self.gram, self.cross, alpha, noise)
        _check_info(info, self.gram.dtype)
        return tril, mean

    def W(self) -> GaussianRows:
        """The posterior of the weights: row c ~ N(m_c, A_c^-1) (precision factor stored)."""
        tril, mean = self._posterior()
        return GaussianRows(mean, DensePrecision(tril))

    def predictive(self, phi: Tensor) -> Predictive:
        """``N(m_c^T phi, phi^T A_c^-1 phi + sigma_c^2)`` per output (independent outputs)."""
        tril, mean = self._posterior()
        f_mean = phi @ mean.mT
        f_var = _quad(tril, phi)
        return Predictive(
            "regression", f_mean, f_cov=torch.diag_embed(f_var), noise_var=self.noise_var
        )

    def log_prob(self, phi: Tensor, y: Tensor) -> Tensor:
        return self.predictive(phi).log_prob(y)

    def ood_score(self, phi: Tensor) -> Tensor:
        """Epistemic variance ``sum_c phi^T A_c^-1 phi`` (N,)."""
        tril, _ = self._posterior()
        return _quad(tril, phi).sum(-1)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"num_data={int(self.num_data)}"
        )


def _quad(tril: Tensor, phi: Tensor) -> Tensor:
    """``phi_n^T A_c^-1 phi_n = ||L_c^-1 phi_n||^2``, (N, C)."""
    rhs = phi.mT.unsqueeze(0).expand(tril.shape[0], -1, -1)  # (C, D, N)
    return solve_triangular(tril, rhs, upper=False).square().sum(-2).mT


def _check_info(info: Tensor, dtype: torch.dtype) -> None:
    if bool((info > 0).any()):
        bad = int(torch.nonzero(info > 0)[0, 0])
        raise ValueError(
            f"A = alpha I + Phi^T Phi / sigma^2: not positive definite for output {bad} in "
            f"{dtype} (features too large for the noise variance?); use float64 or rescale phi"
        )
