"""Warning classes of gaussify, so that users can filter or escalate them by category (each a
``UserWarning`` subclass, so the usual filters apply).

* :class:`SquashedOutputWarning`: the model already squashes its outputs before the
  likelihood's link.
* :class:`EvidenceWarning`: the log evidence dropped the non-MAP correction because its
  Newton model predicted an impossible log-likelihood (:mod:`gaussify.evidence`).
"""

from __future__ import annotations

__all__ = ["EvidenceWarning", "SquashedOutputWarning"]


class SquashedOutputWarning(UserWarning):
    """The model's last module already applies a softmax / log-softmax / sigmoid while the
    likelihood applies its own link to the model's outputs: the likelihood then treats
    probabilities as logits, and the predictive is squashed towards uniform (for C classes the
    largest class probability cannot exceed e / (e + C - 1), 0.40 for 5 classes)."""


class EvidenceWarning(UserWarning):
    """The Laplace log evidence was evaluated without the non-MAP correction (thesis
    Thm 3.3) because that correction's quadratic model of the log-likelihood reached a value
    above the likelihood's supremum (0 for class labels): see :mod:`gaussify.evidence`."""
