"""Pool-based active learning with an exact Bayesian last layer (Bui, Sec. 4.3, last paragraph).

A Bayesian logistic regression on fixed features (or a softmax last layer) with a Gaussian
pseudo-likelihood has a closed-form posterior, so each acquired label is one rank-1 Kalman
update (:class:`gaussify.last_layer.exact.ExactLastLayer`). At every step the pool point with
the highest predictive entropy ``H[p(y | x, D)]`` is labelled (one point per step); a
``"random"`` acquisition is the usual control.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from gaussify import metrics
from gaussify.approx_likelihoods.pseudo_targets import Basis, Method, check_labels
from gaussify.last_layer.exact import ExactLastLayer, check_features
from gaussify.predictive import LinkName, Predictive
from gaussify.validation import check_count, check_inputs

__all__ = ["ActiveLearner", "ActiveLearningResult", "active_learning", "predictive_entropy"]

Acquisition = Literal["entropy", "random"]


def _class_probs(pred: Predictive) -> Tensor:
    assert pred.probs is not None
    probs = pred.probs
    if pred.task == "binary":  # P(y = 1), (N, 1) -> (N, 2)
        probs = torch.cat([1 - probs, probs], dim=-1)
    return probs


def predictive_entropy(pred: Predictive) -> Tensor:
    """Entropy ``-sum_c p_c log p_c`` of the predictive class distribution, ``(N,)``."""
    p = _class_probs(pred)
    return -torch.special.xlogy(p, p).sum(-1)


class ActiveLearner:
    """Pool-based active learning around a streaming :class:`ExactLastLayer`.

    ``layer`` (reset here, then conditioned on the ``initial`` pool indices), the pool
    ``phi_pool (P, D)``, ``y_pool (P,)`` (labels are revealed only when acquired);
    ``acquisition``: ``"entropy"`` (max predictive entropy) or ``"random"``.
    """

    def __init__(
        self,
        layer: ExactLastLayer,
        phi_pool: Tensor,
        y_pool: Tensor,
        initial: Sequence[int] | Tensor,
        *,
        acquisition: Acquisition = "entropy",
        link: LinkName = "probit",
        generator: torch.Generator | None = None,
    ) -> None:
        if acquisition not in ("entropy", "random"):
            raise ValueError(f"acquisition: expected 'entropy' or 'random', got {acquisition!r}")
        check_features(phi_pool, layer.in_features, "phi_pool", allow_empty=False)
        if phi_pool.shape[0] != y_pool.shape[0]:
            raise ValueError(f"y_pool: expected {phi_pool.shape[0]} labels, got {y_pool.shape[0]}")
        check_labels(y_pool, layer.num_classes, "y_pool")
        initial = torch.as_tensor(initial, dtype=torch.long).reshape(-1)
        if initial.numel() and (int(initial.min()) < 0 or int(initial.max()) >= len(y_pool)):
            raise ValueError(f"initial: indices must be in [0, {len(y_pool)})")
        self.layer, self.phi_pool, self.y_pool = layer, phi_pool, y_pool
        self.acquisition, self.link, self.generator = acquisition, link, generator
        self.available = torch.ones(len(y_pool), dtype=torch.bool)
        self.available[initial] = False
        self.labelled: list[int] = initial.tolist()
        layer.reset()
        if initial.numel():
            layer.update(phi_pool[initial], y_pool[initial])

    def scores(self) -> Tensor:
        """Acquisition scores over the whole pool ``(P,)``: predictive entropy (``-inf`` for
        points already labelled)."""
        entropy = predictive_entropy(self.layer.predict(self.phi_pool, link=self.link))
        return entropy.masked_fill(~self.available, -torch.inf)

    def step(self) -> int:
        """Acquire one point, update the posterior with its label, and return its pool index."""
        if not bool(self.available.any()):
            raise ValueError("pool: no unlabelled points left")
        if self.acquisition == "entropy":
            index = int(self.scores().argmax())
        else:
            candidates = self.available.nonzero().squeeze(-1)
            pick = torch.randint(len(candidates), (1,), generator=self.generator)
            index = int(candidates[pick])
        self.available[index] = False
        self.labelled.append(index)
        self.layer.update(self.phi_pool[index : index + 1], self.y_pool[index : index + 1])
        return index


@dataclass
class ActiveLearningResult:
    """Per step (the first entry before any acquisition): number of labels, test accuracy
    and test NLL; ``chosen`` the acquired pool indices in order."""

    chosen: list[int] = field(default_factory=list)
    num_labelled: list[int] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)


def active_learning(
    phi_pool: Tensor,
    y_pool: Tensor,
    phi_test: Tensor,
    y_test: Tensor,
    *,
    steps: int = 200,
    num_initial: int = 10,
    method: Method = "variational",
    basis: Basis = "logit",
    alpha_eps: float = 0.1,
    prior_precision: float = 1.0,
    acquisition: Acquisition = "entropy",
    link: LinkName = "probit",
    seed: int = 0,
) -> ActiveLearningResult:
    """Run Sec. 4.3's active-learning loop: ``num_initial`` random labelled points, then
    ``steps`` acquisitions of one point each, evaluating test accuracy and NLL after each.

    ``basis="logit"`` is Bayesian logistic regression (labels in {0, 1}); ``"log"`` a
    softmax last layer (classes ``0..max label``). Returns an :class:`ActiveLearningResult`.
    """
    steps = check_count(steps, "steps", minimum=0)
    num_initial = check_count(num_initial, "num_initial", minimum=0)
    for name, phi in (("phi_pool", phi_pool), ("phi_test", phi_test)):
        check_inputs(phi, name=name)
    generator = torch.Generator().manual_seed(seed)
    if basis == "logit":
        num_classes = 2
    else:
        num_classes = max(int(max(int(y_pool.max()), int(y_test.max())) + 1), 2)
    y_pool = check_labels(y_pool, num_classes, "y_pool")
    y_test = check_labels(y_test, num_classes, "y_test")
    layer = ExactLastLayer(
        phi_pool.shape[1],
        num_classes,
        method=method,
        basis=basis,
        alpha_eps=alpha_eps,
        prior_precision=prior_precision,
        streaming=True,
    )
    initial = torch.randperm(len(y_pool), generator=generator)[:num_initial]
    learner = ActiveLearner(
        layer, phi_pool, y_pool, initial, acquisition=acquisition, link=link, generator=generator
    )
    result = ActiveLearningResult()

    def record() -> None:
        probs = _class_probs(layer.predict(phi_test, link=link))
        result.num_labelled.append(len(learner.labelled))
        result.accuracy.append(metrics.accuracy(probs, y_test))
        result.nll.append(metrics.nll(probs, y_test))

    record()
    for _ in range(min(steps, int(learner.available.sum()))):
        result.chosen.append(learner.step())
        record()
    return result
