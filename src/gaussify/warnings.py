"""Warning classes of gaussify (each a ``UserWarning`` subclass, so the usual filters apply).

* :class:`EvidenceWarning`: the log evidence dropped the non-MAP correction because its
  Newton model predicted an impossible log-likelihood (:mod:`gaussify.evidence`).
"""

from __future__ import annotations

__all__ = ["EvidenceWarning"]


class EvidenceWarning(UserWarning):
    """The Laplace log evidence was evaluated without the non-MAP correction (thesis
    Thm 3.3) because that correction's quadratic model of the log-likelihood reached a value
    above the likelihood's supremum (0 for class labels): see :mod:`gaussify.evidence`."""
