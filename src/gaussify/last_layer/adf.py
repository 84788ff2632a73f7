"""Streaming baselines for the exact softmax last layer (Bui, Sec. 4.3).

* :class:`ADFLastLayer`: assumed density filtering (Opper 1998; the probabilistic
  backpropagation updates of Hernández-Lobato & Adams 2015, eq. 12-13) with a correlated
  Gaussian per output column, ``q(W) = prod_k N(w_k; mu_k, Sigma_k)``. For each new point the
  tilted distribution ``q(W) softmax(W^T x)_y`` is projected back onto ``q``:

      log Z(a, s) = log E_{f ~ N(a, diag s)}[softmax(f)_y],  a_k = x^T mu_k, s_k = x^T Sigma_k x,
      mu_k    += Sigma_k x  dlogZ/da_k,
      Sigma_k -= (Sigma_k x)(Sigma_k x)^T  [(dlogZ/da_k)^2 - 2 dlogZ/ds_k].

  ``log Z`` is a Monte Carlo estimate with reparameterised samples, differentiated by autograd.
  Damping scales both updates by ``damping``, and any column whose update would make the
  variance along ``x`` non-positive (possible with a noisy ``log Z``) is damped further so that
  it shrinks by at most a factor ``min_ratio`` (counted in ``num_damped``).
* :class:`SGDLastLayer`: SGD with momentum on the softmax cross-entropy, a few steps per
  arriving batch.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from gaussify.approx_likelihoods.pseudo_targets import check_labels
from gaussify.batches import Batches
from gaussify.last_layer.columns import ColumnSampler
from gaussify.last_layer.exact import augment, check_features
from gaussify.posterior import DeclaredCapabilities
from gaussify.predictive import LinkName, Predictive, predictive_from_gaussian
from gaussify.state import (
    Choice,
    Integer,
    Maybe,
    TensorSpec,
    copy_state,
    transactional,
    validate_state,
)
from gaussify.validation import check_count, validated_batches

__all__ = ["ADFLastLayer", "SGDLastLayer", "adf_moments"]


def adf_moments(a: Tensor, s: Tensor, y: int, eps: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Monte Carlo ``log Z = log mean_s softmax(a + sqrt(s) eps_s)_y`` and its gradients
    ``(dlogZ/da, dlogZ/ds)``, ``(K,)`` each, for base samples ``eps (S, K)``."""
    a = a.detach().requires_grad_(True)
    s = s.detach().requires_grad_(True)
    f = a + s.sqrt() * eps
    log_z = torch.logsumexp(torch.log_softmax(f, dim=-1)[:, y], dim=0) - math.log(eps.shape[0])
    grad_a, grad_s = torch.autograd.grad(log_z, (a, s))
    return log_z.detach(), grad_a, grad_s


class ADFLastLayer(ColumnSampler, DeclaredCapabilities):
    """ADF for the softmax last layer with a full Gaussian per output (Sec. 4.3 baseline).

    ``prior_precision`` delta of ``N(0, I/delta)`` per column; ``num_samples`` Monte Carlo
    samples for ``log Z``; ``damping`` in (0, 1]; ``min_ratio`` the smallest factor the
    variance along a point may shrink by in one update; ``generator`` for the samples.
    """

    unsupported: ClassVar[dict[str, str]] = {
        "log_marginal_likelihood": "ADF projects after every point (with damping and a floor "
        "on the variance), so its one-step normalisers are no estimate of log p(D) that "
        "tuning could trust; use ExactLastLayer.log_marginal_likelihood",
        "optimize_prior": "ADF has no evidence to maximise; choose the prior with "
        "ExactLastLayer.optimize_prior on the same features and pass it in",
    }

    def __init__(
        self, in_features: int, num_classes: int, *, prior_precision: float = 1.0,
        bias: bool = True, num_samples: int = 100, damping: float = 1.0, min_ratio: float = 1e-3,
        generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64,
    ) -> None:  # fmt: skip
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes: must be an integer >= 2, got {num_classes!r}")
        if not 0 < damping <= 1:
            raise ValueError(f"damping: must be in (0, 1], got {damping}")
        if not 0 < min_ratio < 1:
            raise ValueError(f"min_ratio: must be in (0, 1), got {min_ratio}")
        if not prior_precision > 0:
            raise ValueError(f"prior_precision: must be positive, got {prior_precision}")
        num_samples = check_count(num_samples, "num_samples")
        self.in_features, self.num_classes = in_features, num_classes
        self.prior_precision, self.bias = float(prior_precision), bias
        self.num_samples, self.damping, self.min_ratio = num_samples, damping, min_ratio
        self.generator, self.dtype = generator, dtype
        self.num_features = in_features + int(bias)
        self.task = "classification"
        self.reset()

    def reset(self) -> ADFLastLayer:
        """Back to the prior."""
        d, k = self.num_features, self.num_classes
        self.mean = torch.zeros(d, k, dtype=self.dtype)
        self.covariance = torch.eye(d, dtype=self.dtype).expand(k, d, d) / self.prior_precision
        self.num_data = 0
        self.num_damped = 0
        return self

    @transactional
    def update(self, phi: Tensor, y: Tensor) -> ADFLastLayer:
        """Absorb the points of a batch one at a time (ADF is sequential by construction)."""
        x_all = augment(check_features(phi, self.in_features), self.bias, self.dtype)
        labels = check_labels(y.reshape(-1), self.num_classes)
        if labels.shape[0] != x_all.shape[0]:
            raise ValueError(f"y: expected {x_all.shape[0]} labels, got {labels.shape[0]}")
        for x, label in zip(x_all, labels.tolist(), strict=True):
            self._update_point(x, label)
        return self

    def _update_point(self, x: Tensor, y: int) -> None:
        cov_x = self.covariance @ x  # (K, D')
        a, s = x @ self.mean, cov_x @ x
        eps = torch.randn(
            self.num_samples, self.num_classes, generator=self.generator, dtype=self.dtype
        )
        _, grad_a, grad_s = adf_moments(a, s, y, eps)
        shrink = self.damping * (grad_a.square() - 2 * grad_s)
        # Variance along x becomes s (1 - shrink s); keep the factor >= min_ratio.
        limit = (1 - self.min_ratio) / s
        invalid = shrink > limit
        self.num_damped += int(invalid.any())
        shrink = torch.where(invalid, limit, shrink)
        self.mean = self.mean + self.damping * (cov_x * grad_a[:, None]).T
        cov = self.covariance - shrink[:, None, None] * cov_x[:, :, None] * cov_x[:, None, :]
        self.covariance = 0.5 * (cov + cov.transpose(-1, -2))
        self.num_data += 1

    @transactional
    def fit(self, data: Batches, batch_size: int = 256) -> ADFLastLayer:
        """Reset and absorb ``data`` point by point, in order."""
        batches = validated_batches(
            data, batch_size, task=self.task, owner="ADFLastLayer.fit", input_name="phi"
        )
        self.reset()
        for phi, y in batches:
            self.update(phi, y)
        return self

    def predict(
        self, phi: Tensor, link: LinkName = "probit", *, num_samples: int = 100,
        generator: torch.Generator | None = None,
    ) -> Predictive:  # fmt: skip
        """Predictive at ``phi (N, D)`` from the current Gaussian (as for the exact layer)."""
        num_samples = check_count(num_samples, "num_samples")
        x = augment(check_features(phi, self.in_features, allow_empty=False), self.bias, self.dtype)
        f_var = torch.einsum("nd,kde,ne->nk", x, self.covariance, x).clamp_min(0)
        pred = predictive_from_gaussian(
            x @ self.mean,
            torch.diag_embed(f_var),
            self.task,
            link=link,
            num_samples=num_samples,
            generator=generator,
        )
        assert pred.probs is not None and pred.f_cov is not None
        return Predictive(
            pred.task,
            pred.f_mean.to(phi.dtype),
            f_cov=pred.f_cov.to(phi.dtype),
            probs=pred.probs.to(phi.dtype),
        )

    def state_dict(self) -> dict[str, Any]:
        """Posterior state (tensors and plain values, copies)."""
        return copy_state(
            {
                "task": self.task,
                "mean": self.mean,
                "covariance": self.covariance,
                "num_data": self.num_data,
                "num_damped": self.num_damped,
            }
        )

    @transactional
    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Restore :meth:`state_dict`; the whole state is validated first
        (:mod:`gaussify.state`) and a failed load changes nothing. ``strict`` is accepted for
        the posterior protocol: a layer on features holds no network weights to compare, so
        the state is always checked in full."""
        d, k, dt = self.num_features, self.num_classes, self.dtype
        schema = {
            "task": Maybe(Choice((self.task,), "the task of this layer")),
            "mean": TensorSpec((d, k), dt),
            "covariance": TensorSpec((k, d, d), dt),
            "num_data": Integer(0),
            "num_damped": Integer(0),
        }
        valid = validate_state(state, schema, owner=type(self).__name__)
        self.mean, self.covariance = valid["mean"].clone(), valid["covariance"].clone()
        self.num_data, self.num_damped = valid["num_data"], valid["num_damped"]


class SGDLastLayer:
    """SGD with momentum on the softmax cross-entropy (Sec. 4.3 baseline): ``steps`` steps on
    each arriving batch; ``weight_decay`` plays the Gaussian prior. Weights start at zero."""

    def __init__(
        self, in_features: int, num_classes: int, *, lr: float = 0.1, momentum: float = 0.9,
        weight_decay: float = 0.0, steps: int = 1, bias: bool = True,
        dtype: torch.dtype = torch.float64,
    ) -> None:  # fmt: skip
        if lr <= 0:
            raise ValueError(f"lr: must be positive, got {lr}")
        steps = check_count(steps, "steps")
        self.in_features, self.num_classes, self.bias, self.dtype = (
            in_features,
            num_classes,
            bias,
            dtype,
        )
        self.lr, self.momentum, self.weight_decay, self.steps = lr, momentum, weight_decay, steps
        self.task = "classification"
        self.reset()

    def reset(self) -> SGDLastLayer:
        """Zero weights and a fresh optimiser."""
        d = self.in_features + int(self.bias)
        self.weight = torch.zeros(d, self.num_classes, dtype=self.dtype, requires_grad=True)
        self._opt = torch.optim.SGD(
            [self.weight], lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
        )
        self.num_data = 0
        return self

    def update(self, phi: Tensor, y: Tensor) -> SGDLastLayer:
        """``steps`` SGD steps on the mean cross-entropy of one batch."""
        x = augment(check_features(phi, self.in_features), self.bias, self.dtype)
        labels = check_labels(y.reshape(-1), self.num_classes)
        for _ in range(self.steps):
            self._opt.zero_grad()
            torch.nn.functional.cross_entropy(x @ self.weight, labels).backward()
            self._opt.step()
        self.num_data += x.shape[0]
        return self

    @transactional
    def fit(self, data: Batches, batch_size: int = 256) -> SGDLastLayer:
        """Reset and take the batches of ``data`` in order."""
        batches = validated_batches(
            data, batch_size, task=self.task, owner="SGDLastLayer.fit", input_name="phi"
        )
        self.reset()
        for phi, y in batches:
            self.update(phi, y)
        return self

    @torch.no_grad()
    def predict(self, phi: Tensor) -> Predictive:
        """Point-estimate predictive: ``softmax(f)`` with zero logit covariance."""
        x = augment(check_features(phi, self.in_features, allow_empty=False), self.bias, self.dtype)
        f = (x @ self.weight).to(phi.dtype)
        cov = f.new_zeros(*f.shape, f.shape[-1])
        return Predictive(self.task, f, f_cov=cov, probs=torch.softmax(f, dim=-1))
