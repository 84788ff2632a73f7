"""What every VBLL head shares: argument checks, the training objective and the result object.

A head is an ``nn.Module`` whose ``forward(phi)`` returns a :class:`VBLLOutput`; the output
carries the predictive and ``train_loss(y)``, so replacing an ``nn.Linear`` head is two lines:

    out = head(phi)               # was: logits = linear(phi)
    loss = out.train_loss(y)      # was: loss = F.cross_entropy(logits, y)

The objective is the negative of eq. (61) of Harrison et al. (2024) per example,

    train_loss = -( mean_t bound_t + regularization_weight * (log p(Sigma) - KL(q || p)) ),

where ``bound_t`` is the head's per-example term (eq. 12/13/14/16) and
``regularization_weight`` is ``1/N`` for the ELBO (eq. 11); other values temper the KL
(Table 6 reports multipliers of ``1/N``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from gaussify.last_layer.covariance import GaussianRows, StructuredCovariance
from gaussify.last_layer.parameterization import make_covariance
from gaussify.predictive import Predictive
from gaussify.state import StateError, validate_module_state
from gaussify.validation import check_count, check_finite

__all__ = [
    "ClassificationHead",
    "LogNoiseLayer",
    "NormalGammaNoise",
    "RegressionHead",
    "VBLLHead",
    "VBLLOutput",
    "WishartNoise",
    "check_labels",
    "check_positive",
    "check_regression_targets",
    "initial_variance",
]


def check_positive(value: float, name: str) -> float:
    """``value`` as a float if it is a finite number > 0, else ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: expected a positive number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: must be > 0, got {value}")
    return float(value)


def _check_size(value: int, name: str) -> int:
    return check_count(value, name)


def initial_variance(in_features: int, prior_scale: float) -> float:
    """Initial posterior variance per weight: min(prior variance, 1 / in_features)."""
    # start the posterior tighter than the prior: a variance of 1/D keeps phi^T S phi O(1)
    return min(prior_scale, 1.0 / in_features)


def check_labels(y: Any, num: int, num_classes: int) -> Tensor:
    """Integer class labels ``y (num,)`` in ``[0, num_classes)``, else ``ValueError``."""
    if not isinstance(y, Tensor):
        raise TypeError(f"y: expected a torch.Tensor of labels, got {type(y).__name__}")
    if y.is_floating_point() and y.ndim > 0:
        check_finite(y, "y")  # a NaN / inf label is named as such, with its row
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ValueError(f"y: expected integer class labels, got dtype {y.dtype}")
    if y.shape != (num,):
        raise ValueError(f"y: expected shape ({num},) to match phi, got {tuple(y.shape)}")
    if num and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise ValueError(
            f"y: labels must be in [0, {num_classes}), got range [{int(y.min())}, {int(y.max())}]"
        )
    return y.long()


def check_regression_targets(y: Any, num: int, out_features: int, like: Tensor) -> Tensor:
    """Targets ``(num, out_features)`` (or ``(num,)`` for one output) as ``like``'s dtype."""
    if not isinstance(y, Tensor):
        raise TypeError(f"y: expected a torch.Tensor of targets, got {type(y).__name__}")
    if y.dim() == 1 and out_features == 1:
        y = y.unsqueeze(-1)
    if y.shape != (num, out_features):
        raise ValueError(
            f"y: expected shape ({num}, {out_features}) to match phi and out_features, "
            f"got {tuple(y.shape)}"
        )
    check_finite(y, "y")
    return y.to(like)


class VBLLHead(nn.Module, ABC):
    """Base class of the VBLL heads: ``forward(phi (N, in_features)) -> VBLLOutput``.

    Subclasses implement the per-example bound, the KL, the noise log prior and the
    predictive; everything user-facing (checks, loss, output object) lives here.
    """

    task: ClassVar[str]

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict`` after checking the whole state first (keys, shapes,
        NaN/inf; :func:`gaussify.state.validate_module_state`), so that a bad state raises
        one ``ValueError`` and leaves the head unchanged."""
        validate_module_state(self, state_dict, strict=strict)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        # also when the head is loaded as part of a larger model: no NaN/inf posterior
        for key, value in state_dict.items():
            mine = key.startswith(prefix) and isinstance(value, Tensor)
            if mine and value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise StateError(
                    f"{type(self).__name__}.load_state_dict: invalid state: {key!r}: "
                    "contains NaN or inf"
                )
        super()._load_from_state_dict(state_dict, prefix, *args)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        regularization_weight: float,
        prior_scale: float,
    ) -> None:
        super().__init__()
        self.in_features = _check_size(in_features, "in_features")
        self.out_features = _check_size(out_features, "out_features")
        if (
            isinstance(regularization_weight, bool)
            or not isinstance(regularization_weight, (int, float))
            or not math.isfinite(regularization_weight)
            or regularization_weight < 0
        ):
            raise ValueError(
                "regularization_weight: expected a number >= 0 (1 / N for the ELBO), "
                f"got {regularization_weight!r}"
            )
        self.regularization_weight = float(regularization_weight)
        self.prior_scale = check_positive(prior_scale, "prior_scale")

    # ---- checks ---------------------------------------------------------------------------

    def check_features(self, phi: Any) -> Tensor:
        if not isinstance(phi, Tensor):
            raise TypeError(f"phi: expected a torch.Tensor, got {type(phi).__name__}")
        if phi.dim() != 2 or phi.shape[-1] != self.in_features:
            raise ValueError(
                f"phi: expected features of shape (N, {self.in_features}) "
                f"(in_features={self.in_features}), got {tuple(phi.shape)}"
            )
        if not phi.is_floating_point():
            raise ValueError(f"phi: expected a floating point tensor, got {phi.dtype}")
        check_finite(phi, "phi")  # one min/max reduction; the bad row only on failure
        return phi

    @abstractmethod
    def check_targets(self, y: Any, num: int) -> Tensor:
        """Validate targets for ``num`` examples; returns them in the head's layout."""

    # ---- the pieces of the objective ------------------------------------------------------

    @abstractmethod
    def log_likelihood_bound(self, phi: Tensor, y: Tensor) -> Tensor:
        """Per-example lower bound on E_q[log p(y | phi, xi)] (exact for Gaussian
        regression heads), (N,). ``y`` already checked."""

    def kl(self) -> Tensor:
        """KL(q(xi) || p(xi)) of the last-layer variational posterior, a scalar; here
        ``KL(q(W) || N(0, prior_scale I))``."""
        return self.W().kl(self.prior_scale)

    def log_prior(self) -> Tensor:
        """Log prior of point-estimated quantities (the noise covariance); 0 if none."""
        return torch.zeros((), dtype=self._dtype(), device=self._device())

    def elbo_terms(self, phi: Tensor, y: Tensor) -> dict[str, Tensor]:
        """``{"bound": (N,), "kl": (), "log_prior": ()}`` for checked ``phi`` and raw ``y``;
        the sum ``bound.sum() - kl`` is the (unnormalised) ELBO of eq. (11)."""
        phi = self.check_features(phi)
        y = self.check_targets(y, phi.shape[0])
        return {
            "bound": self.log_likelihood_bound(phi, y),
            "kl": self.kl(),
            "log_prior": self.log_prior(),
        }

    def train_loss(self, phi: Tensor, y: Tensor) -> Tensor:
        """Negative regularised bound per example (eq. 61 divided by N), a scalar."""
        terms = self.elbo_terms(phi, y)
        reg = self.regularization_weight * (terms["log_prior"] - terms["kl"])
        return -(terms["bound"].mean() + reg)

    # ---- prediction -----------------------------------------------------------------------

    @abstractmethod
    def predictive(self, phi: Tensor) -> Any:
        """The posterior predictive at ``phi``: a :class:`~gaussify.Predictive`, or a torch
        distribution where a Predictive cannot express it (Student-t)."""

    def to_predictive(self, phi: Tensor) -> Predictive:
        """The predictive as a :class:`~gaussify.Predictive` (moment-matched where the exact
        predictive is not Gaussian)."""
        pred = self.predictive(phi)
        assert isinstance(pred, Predictive)
        return pred

    @abstractmethod
    def log_prob(self, phi: Tensor, y: Tensor) -> Tensor:
        """Exact (or stated) predictive log density of targets, (N,)."""

    @abstractmethod
    def ood_score(self, phi: Tensor) -> Tensor:
        """Out-of-distribution score (N,), higher = more unusual (for ``metrics.auroc``)."""

    def forward(self, phi: Tensor) -> VBLLOutput:
        return VBLLOutput(self, self.check_features(phi))

    # ---- the trained-posterior protocol (gaussify.posterior.TrainedPosterior) ------------

    def predict(self, phi: Tensor) -> Predictive:
        """The posterior predictive at features ``phi (N, in_features)`` as a
        :class:`~gaussify.Predictive` (``head(phi).to_predictive()``)."""
        return self.to_predictive(self.check_features(phi))

    def sample(self, num_samples: int = 100, generator: torch.Generator | None = None) -> Tensor:
        """Draws W_s ~ q(W) of the head's Gaussian weights (``W()``: R rows of length D, the
        class means of the generative head), flattened to (S, R D) in row-major order
        (``.reshape(S, R, D)`` gives the matrices); no gradient flows to the head."""
        num_samples = check_count(num_samples, "num_samples")
        with torch.no_grad():
            draws = self.W().rsample((num_samples,), generator)
        return draws.reshape(num_samples, -1)

    # ---- the Gaussian layers q(W) (and q(M), q(mu)) ---------------------------------------

    def add_gaussian_rows(
        self,
        name: str,
        mean: Tensor,
        num_blocks: int,
        parameterization: str,
        prior_scale: float,
        cov_rank: int | None,
    ) -> None:
        """Register the Gaussian layer ``name``: rows of ``{name}_mean = mean (out_features,
        in_features)`` with ``num_blocks`` covariances (1: one S shared by the rows, as in
        MN(W_bar, I, S); ``out_features``: one S_k per row) in ``parameterization``, started
        at :func:`initial_variance` for a prior variance ``prior_scale``, as ``{name}_cov``.
        ``mean`` is drawn before the covariance (the order of the random draws)."""
        self.parameterization = parameterization
        setattr(self, f"{name}_mean", nn.Parameter(mean))
        init_var = initial_variance(self.in_features, prior_scale)
        cov = make_covariance(parameterization, num_blocks, self.in_features, init_var, cov_rank)
        setattr(self, f"{name}_cov", cov)

    def random_rows(self) -> Tensor:
        """The initial weight mean ``randn(out, in) / sqrt(in)`` (unit-variance outputs)."""
        return torch.randn(self.out_features, self.in_features) / math.sqrt(self.in_features)

    def W(self) -> GaussianRows:
        """q(W): the rows of the last layer (``W_mean``, ``W_cov``)."""
        return GaussianRows(self.W_mean, self.W_cov())

    # ---- helpers --------------------------------------------------------------------------

    def _dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def _device(self) -> torch.device:
        return next(self.parameters()).device

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"regularization_weight={self.regularization_weight:.3g}"
        )


class WishartNoise:
    """Mixin of the heads with a point-estimated noise covariance ``noise_cov`` (a
    :class:`~gaussify.last_layer.noise.NoiseCovariance`) under the inverse-Wishart prior
    ``W^-1(dof, wishart_scale I)`` (App. C.3, eq. 65): its checks, ``noise()`` and the
    ``log_prior`` term of the objective."""

    noise_cov: Any
    wishart_scale: float
    dof: float

    def set_wishart_prior(self, wishart_scale: float, dof: float) -> None:
        """Check and store the inverse-Wishart prior's scale and degrees of freedom."""
        self.wishart_scale = check_positive(wishart_scale, "wishart_scale")
        self.dof = check_positive(dof, "dof")

    def noise(self) -> StructuredCovariance:
        """The noise covariance (outputs' Sigma, diagonal logit noise or G-VBLL's feature
        noise), as a structured covariance."""
        return self.noise_cov.structured()

    def log_prior(self) -> Tensor:
        """``log W^-1(Sigma | dof, wishart_scale I)`` of the MAP noise covariance."""
        return self.noise_cov.log_prior(self.dof, self.wishart_scale)


class NormalGammaNoise:
    """Mixin of the heads whose noise precisions are inferred: ``q(tau) = Gamma(a, b)`` in
    ``noise_gamma`` (a :class:`~gaussify.last_layer.noise.GammaNoise`) and ``q(W | tau)`` with
    covariance ``S / tau`` (the conjugate Normal-Gamma form)."""

    noise_gamma: Any
    prior_scale: float

    def noise(self) -> Any:
        """q(tau): Gamma posterior over the noise precisions, batch (out_features,)."""
        return self.noise_gamma.distribution()

    def kl(self) -> Tensor:
        """KL of the Normal-Gamma pair: ``E_q(tau)[KL(q(W | tau) || p(W | tau))] +
        KL(q(tau) || p(tau))``, the mean term weighted by ``E[tau] = a / b``."""
        a, b = self.noise_gamma.concentration, self.noise_gamma.rate
        return self.W().kl(self.prior_scale, mean_weight=a / b) + self.noise_gamma.kl()  # type: ignore[attr-defined]


class LogNoiseLayer:
    """Mixin of the heads with input-dependent noise ``exp(m^T phi)``: a second Gaussian layer
    ``q(M)`` (``M_mean``, ``M_cov``) against ``N(0, noise_prior_scale I)``."""

    noise_prior_scale: float
    prior_scale: float

    def M(self) -> GaussianRows:
        """q(M): the log-noise-variance layer."""
        return GaussianRows(self.M_mean, self.M_cov())  # type: ignore[attr-defined]

    def kl(self) -> Tensor:
        """``KL(q(W) || N(0, prior_scale I)) + KL(q(M) || N(0, noise_prior_scale I))``."""
        return self.W().kl(self.prior_scale) + self.M().kl(self.noise_prior_scale)  # type: ignore[attr-defined]

    def _moments(self, phi: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Mean and variance of ``W phi`` and of the log noise ``M phi``, each (N, out)."""
        mean, quad = self.W().output_moments(phi)  # type: ignore[attr-defined]
        m, v = self.M().output_moments(phi)
        return mean, quad, m, v


class RegressionHead(VBLLHead):
    """Shared target checks of the regression heads."""

    task = "regression"

    def check_targets(self, y: Any, num: int) -> Tensor:
        return check_regression_targets(y, num, self.out_features, self.W_mean)


class ClassificationHead(VBLLHead):
    """Shared label checks and label-based predictive density of the classification heads."""

    task = "classification"

    def __init__(
        self, in_features: int, out_features: int, regularization_weight: float,
        prior_scale: float, link: str = "mc", num_samples: int = 100,
    ) -> None:  # fmt: skip
        super().__init__(in_features, out_features, regularization_weight, prior_scale)
        if link not in ("mc", "probit", "bridge"):
            raise ValueError(f"link: expected 'mc', 'probit' or 'bridge', got {link!r}")
        num_samples = check_count(num_samples, "num_samples")
        self.link, self.num_samples = link, num_samples

    def check_targets(self, y: Any, num: int) -> Tensor:
        return check_labels(y, num, self.out_features)

    def log_prob(self, phi: Tensor, y: Tensor) -> Tensor:
        probs = self.predictive(phi).probs
        return probs.clamp_min(1e-12).log().gather(-1, y.unsqueeze(-1)).squeeze(-1)

    def ood_score(self, phi: Tensor) -> Tensor:
        """Negative maximum predictive probability (Hendrycks & Gimpel 2017; App. C.7)."""
        return -self.predictive(phi).probs.amax(-1)


class VBLLNames:
    """The ``vbll`` package's names of an output's methods (``train_loss_fn``,
    ``val_loss_fn``), shared by :class:`VBLLOutput` and the BNN output."""

    train_loss: Callable[[Tensor], Tensor]
    val_loss: Callable[[Tensor], Tensor]

    @property
    def train_loss_fn(self) -> Callable[[Tensor], Tensor]:
        """The ``vbll`` package's name for :meth:`train_loss`."""
        return self.train_loss

    @property
    def val_loss_fn(self) -> Callable[[Tensor], Tensor]:
        """The ``vbll`` package's name for :meth:`val_loss`."""
        return self.val_loss


class VBLLOutput(VBLLNames):
    """The result of ``head(phi)``: the predictive and the training loss at these features.

    ``predictive`` (computed on first access), ``train_loss(y)`` (``train_loss_fn`` is the
    ``vbll`` package's name for it), ``val_loss(y)`` (negative mean predictive log density,
    ``val_loss_fn``), ``log_prob(y)`` (N,), ``to_predictive()`` (always a
    :class:`~gaussify.Predictive`), ``ood_score()`` (N,), ``elbo_terms(y)``.
    """

    def __init__(self, head: VBLLHead, phi: Tensor) -> None:
        self.head = head
        self.features = phi
        self._predictive: Any = None

    @property
    def predictive(self) -> Any:
        if self._predictive is None:
            self._predictive = self.head.predictive(self.features)
        return self._predictive

    def train_loss(self, y: Tensor) -> Tensor:
        return self.head.train_loss(self.features, y)

    def val_loss(self, y: Tensor) -> Tensor:
        return -self.log_prob(y).mean()

    def log_prob(self, y: Tensor) -> Tensor:
        y = self.head.check_targets(y, self.features.shape[0])
        return self.head.log_prob(self.features, y)

    def to_predictive(self) -> Predictive:
        return self.head.to_predictive(self.features)

    def ood_score(self) -> Tensor:
        return self.head.ood_score(self.features)

    def elbo_terms(self, y: Tensor) -> dict[str, Tensor]:
        return self.head.elbo_terms(self.features, y)

    @property
    def ood_scores(self) -> Tensor:
        return self.ood_score()
