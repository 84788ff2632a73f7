"""Warning classes of gaussify, so that users can filter or escalate them by category (each a
``UserWarning`` subclass, so the usual filters apply).

* :class:`SquashedOutputWarning`: the model already squashes its outputs before the
  likelihood's link.
* :class:`EvidenceWarning`: the log evidence dropped the non-MAP correction because its
  Newton model predicted an impossible log-likelihood (:mod:`gaussify.evidence`).
* :class:`ConvergenceWarning`: hyperparameter tuning stopped unconverged
  (:mod:`gaussify.tuning`).
* :class:`FastPathWarning`: the model uses PyTorch's fused attention fast path (or an
  operation without a forward-mode derivative) and gaussify routes its Jacobian passes around
  it (:mod:`gaussify.fastpath`).
* :class:`CollapsedSignalWarning`: a GP's evidence is maximised by a constant latent function
  (signal variance numerically 0), so its predictive ignores the inputs.
"""

from __future__ import annotations

__all__ = [
    "CollapsedSignalWarning",
    "ConvergenceWarning",
    "EvidenceWarning",
    "FastPathWarning",
    "SquashedOutputWarning",
]


class ConvergenceWarning(UserWarning):
    """An iterative fit (hyperparameter tuning) used its whole step budget without meeting its
    convergence test; the result it returns is the last iterate, not a verified optimum."""


class CollapsedSignalWarning(UserWarning):
    """Type-II maximum likelihood of a GP put (numerically) zero signal variance on a latent
    function: the evidence is maximised by the constant prior mean, so the posterior ignores
    the inputs and the predictive is flat (:class:`gaussify.approx_likelihoods.GPClassifier`)."""


class SquashedOutputWarning(UserWarning):
    """The model's last module already applies a softmax / log-softmax / sigmoid while the
    likelihood applies its own link to the model's outputs: the likelihood then treats
    probabilities as logits, and the predictive is squashed towards uniform (for C classes the
    largest class probability cannot exceed e / (e + C - 1), 0.40 for 5 classes)."""


class EvidenceWarning(UserWarning):
    """The Laplace log evidence was evaluated without the non-MAP correction (thesis
    Thm 3.3) because that correction's quadratic model of the log-likelihood reached a value
    above the likelihood's supremum (0 for class labels): see :mod:`gaussify.evidence`."""


class FastPathWarning(UserWarning):
    """The model hits one of PyTorch's fused fast paths (``nn.MultiheadAttention`` /
    ``nn.TransformerEncoderLayer`` in eval mode, fused ``scaled_dot_product_attention``
    kernels), which have no forward-mode derivative, or another operation without one: gaussify
    disabled the fast path (or fell back to reverse-mode Jacobians) for its passes. The
    network's function is unchanged; shown once per model."""
