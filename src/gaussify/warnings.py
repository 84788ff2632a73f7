"""Warning classes of gaussify, so that users can filter or escalate them by category."""

from __future__ import annotations

__all__ = ["SquashedOutputWarning"]


class SquashedOutputWarning(UserWarning):
    """The model's last module already applies a softmax / log-softmax / sigmoid while the
    likelihood applies its own link to the model's outputs: the likelihood then treats
    probabilities as logits, and the predictive is squashed towards uniform (for C classes the
    largest class probability cannot exceed e / (e + C - 1), 0.40 for 5 classes)."""
