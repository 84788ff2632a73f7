"""VBLL with variational features: collapsed VI (Harrison et al. 2024, Sec. 3.4, App. C.2).

The features get a mean-field Gaussian posterior q(theta) (Bayes by backprop, Blundell et al.
2015) while the last layer stays marginalised in closed form. The objective is eq. (64),

    E_{q(theta)}[ L(theta, eta) ] - (1/T) KL(q(xi) || p(xi)) - (1/T) KL(q(theta) || p(theta)),

whose outer expectation is estimated with ``num_samples`` feature samples (the inner one is
the head's deterministic bound). Prediction averages the head's predictive over feature
samples (eq. 69-70); for generative heads the feature density averages in log space (eq.
72-73) for OOD scores. ``feature_kl_weight`` is the coefficient of KL(q(theta) || p(theta)):
``1/T`` for the bound, Table 6's "feature KL weight" ``w`` is ``w / T``.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gaussify.last_layer.base import (
    ClassificationHead,
    VBLLHead,
    VBLLNames,
    VBLLOutput,
    check_positive,
)
from gaussify.last_layer.vbll_generative import VBLLGenerative
from gaussify.predictive import Predictive
from gaussify.validation import check_count

__all__ = [
    "VBLLBNN",
    "BNNOutput",
    "MeanFieldLinear",
    "mean_field_kl",
    "mix_predictives",
    "to_mean_field",
]


def _inverse_softplus(x: float) -> float:
    return x + math.log(-math.expm1(-x))


class MeanFieldLinear(nn.Module):
    """Linear layer with a factorised Gaussian posterior over its weights and bias.

    ``q(theta) = N(mean, diag(softplus(rho)^2))``, prior ``N(0, prior_std^2 I)``. Each forward
    draws one weight sample shared by the whole batch (so a batch sees one network, as eq. 70
    needs); ``sample=False`` uses the means. ``kl()`` is the closed-form KL.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        prior_std: float = 1.0,
        init_std: float = 1e-3,
    ) -> None:
        super().__init__()
        self.prior_std = check_positive(prior_std, "prior_std")
        init_std = check_positive(init_std, "init_std")
        self.in_features, self.out_features = in_features, out_features
        ref = nn.Linear(in_features, out_features, bias=bias)
        self.weight_mean = nn.Parameter(ref.weight.detach().clone())
        self.weight_rho = nn.Parameter(torch.full_like(ref.weight, _inverse_softplus(init_std)))
        if bias:
            assert ref.bias is not None
            self.bias_mean: nn.Parameter | None = nn.Parameter(ref.bias.detach().clone())
            self.bias_rho: nn.Parameter | None = nn.Parameter(
                torch.full_like(ref.bias, _inverse_softplus(init_std))
            )
        else:
            self.bias_mean = self.bias_rho = None
        self.sample = True

    def _pairs(self) -> list[tuple[Tensor, Tensor]]:
        pairs = [(self.weight_mean, self.weight_rho)]
        if self.bias_mean is not None and self.bias_rho is not None:
            pairs.append((self.bias_mean, self.bias_rho))
        return pairs

    def _draw(self, mean: Tensor, rho: Tensor) -> Tensor:
        if not self.sample:
            return mean
        return mean + F.softplus(rho) * torch.randn_like(mean)

    def forward(self, x: Tensor) -> Tensor:
        weight = self._draw(self.weight_mean, self.weight_rho)
        bias = None
        if self.bias_mean is not None and self.bias_rho is not None:
            bias = self._draw(self.bias_mean, self.bias_rho)
        return F.linear(x, weight, bias)

    def kl(self) -> Tensor:
        """KL(q(theta) || N(0, prior_std^2 I)) of this layer, a scalar."""
        total = self.weight_mean.new_zeros(())
        p2 = self.prior_std**2
        for mean, rho in self._pairs():
            var = F.softplus(rho).square()
            total = (
                total + 0.5 * ((var + mean.square()) / p2 - 1.0 - var.log() + math.log(p2)).sum()
            )
        return total

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias_mean is not None}, prior_std={self.prior_std}"
        )


def mean_field_kl(module: nn.Module) -> Tensor:
    """Sum of ``kl()`` over the :class:`MeanFieldLinear` layers of ``module``."""
    layers = [m for m in module.modules() if isinstance(m, MeanFieldLinear)]
    if not layers:
        raise ValueError("module: has no MeanFieldLinear layers (see to_mean_field)")
    return torch.stack([m.kl() for m in layers]).sum()


def to_mean_field(
    model: nn.Module,
    prior_std: float = 1.0,
    init_std: float = 1e-3,
    *,
    layer: type[MeanFieldLinear] | None = None,
) -> nn.Module:
    """A copy of ``model`` with every ``nn.Linear`` replaced by a :class:`MeanFieldLinear` (or
    the subclass ``layer``) whose means start at the original weights."""
    layer_cls = MeanFieldLinear if layer is None else layer

    def convert(module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, nn.Linear):
                new = layer_cls(
                    child.in_features,
                    child.out_features,
                    child.bias is not None,
                    prior_std,
                    init_std,
                ).to(child.weight)
                with torch.no_grad():
                    new.weight_mean.copy_(child.weight)
                    if child.bias is not None and new.bias_mean is not None:
                        new.bias_mean.copy_(child.bias)
                setattr(module, name, new)
            else:
                convert(child)

    out = copy.deepcopy(model)
    if isinstance(out, nn.Linear):
        wrapper = nn.Sequential(out)
        convert(wrapper)
        return wrapper[0]
    convert(out)
    return out


def _stack_moments(means: Tensor, covs: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Mean and covariance of a uniform mixture from component ``means (S, N, C)`` and
    ``covs (S, N, C, C)``: average covariance plus covariance of the means."""
    mean = means.mean(0)
    if covs is None:
        return mean, None
    centred = means - mean
    spread = torch.einsum("sni,snj->nij", centred, centred) / means.shape[0]
    return mean, covs.mean(0) + spread


def mix_predictives(preds: list[Predictive]) -> Predictive:
    """The uniform mixture of predictives from one head at different feature samples (eq. 70).

    Regression: moment-matched (exact mean and covariance of the mixture, Gaussian shape);
    classification: averaged probabilities (eq. 71), latent moments as for regression, or the
    pooled samples for sample-based predictives.
    """
    first = preds[0]
    means = torch.stack([p.f_mean for p in preds])
    covs = torch.stack([p.f_cov for p in preds]) if first.f_cov is not None else None  # type: ignore[misc]
    mean, cov = _stack_moments(means, covs)
    if first.task in ("regression", "heteroscedastic"):
        return Predictive(
            first.task, mean, f_cov=cov, noise_var=first.noise_var, noise_cov=first.noise_cov
        )
    probs = torch.stack([p.probs for p in preds]).mean(0)  # type: ignore[misc]
    samples = None
    if cov is None and first.f_samples is not None:
        samples = torch.cat([p.f_samples for p in preds])  # type: ignore[misc]
    return Predictive(first.task, mean, f_cov=cov, f_samples=samples, probs=probs)


class BNNOutput(VBLLNames):
    """What :class:`VBLLBNN` returns: the head outputs at ``S`` feature samples plus the
    feature KL; the same interface as :class:`~gaussify.last_layer.VBLLOutput`."""

    def __init__(self, outputs: list[VBLLOutput], feature_kl: Tensor, feature_kl_weight: float):
        self.outputs, self.feature_kl, self.feature_kl_weight = (
            outputs,
            feature_kl,
            feature_kl_weight,
        )
        self._predictive: Predictive | None = None

    @property
    def head(self) -> VBLLHead:
        return self.outputs[0].head

    def train_loss(self, y: Tensor) -> Tensor:
        """Negative eq. (64) per example: the head losses averaged over feature samples plus
        ``feature_kl_weight * KL(q(theta) || p(theta))``."""
        losses = torch.stack([o.train_loss(y) for o in self.outputs])
        return losses.mean() + self.feature_kl_weight * self.feature_kl

    def log_prob(self, y: Tensor) -> Tensor:
        """Exact log density of the mixture over feature samples (eq. 70), (N,)."""
        logs = torch.stack([o.log_prob(y) for o in self.outputs])
        return torch.logsumexp(logs, dim=0) - math.log(len(self.outputs))

    def val_loss(self, y: Tensor) -> Tensor:
        return -self.log_prob(y).mean()

    @property
    def predictive(self) -> Predictive:
        if self._predictive is None:
            self._predictive = mix_predictives([o.to_predictive() for o in self.outputs])
        return self._predictive

    def to_predictive(self) -> Predictive:
        return self.predictive

    def ood_score(self) -> Tensor:
        """Generative heads: negative log of the feature density averaged over feature samples
        (eq. 72-74); other classifiers: negative maximum averaged probability; regression:
        the mixture's latent variance summed over outputs."""
        head = self.head
        if isinstance(head, VBLLGenerative):
            dens = torch.stack([head.feature_log_density(o.features) for o in self.outputs])
            return -(torch.logsumexp(dens, dim=0) - math.log(len(self.outputs)))
        pred = self.predictive
        if isinstance(head, ClassificationHead):
            assert pred.probs is not None
            return -pred.probs.amax(-1)
        return pred.f_var.sum(-1)


class VBLLBNN(nn.Module):
    """A feature network with mean-field weights (some :class:`MeanFieldLinear` layers, e.g.
    from :func:`to_mean_field`) and a VBLL head, trained jointly by collapsed VI (eq. 64).

    ``forward(x, num_samples=1)`` runs the features ``num_samples`` times (fresh weight
    samples) and returns a :class:`BNNOutput`. The paper predicts with 10 to 100 samples.
    """

    def __init__(self, features: nn.Module, head: VBLLHead, feature_kl_weight: float) -> None:
        super().__init__()
        if not any(isinstance(m, MeanFieldLinear) for m in features.modules()):
            raise ValueError("features: has no MeanFieldLinear layers (see to_mean_field)")
        if (
            isinstance(feature_kl_weight, bool)
            or not isinstance(feature_kl_weight, (int, float))
            or not math.isfinite(feature_kl_weight)
            or feature_kl_weight < 0
        ):
            raise ValueError(
                f"feature_kl_weight: expected a number >= 0, got {feature_kl_weight!r}"
            )
        self.features, self.head = features, head
        self.feature_kl_weight = float(feature_kl_weight)

    def forward(self, x: Tensor, num_samples: int = 1) -> BNNOutput:
        num_samples = check_count(num_samples, "num_samples")
        outputs = [self.head(self.features(x)) for _ in range(num_samples)]
        return BNNOutput(outputs, mean_field_kl(self.features), self.feature_kl_weight)
