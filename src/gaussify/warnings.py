"""Warning classes of gaussify, so that users can filter or escalate them by category."""

from __future__ import annotations

__all__ = ["ConvergenceWarning"]


class ConvergenceWarning(UserWarning):
    """An iterative fit (hyperparameter tuning) used its whole step budget without meeting its
    convergence test; the result it returns is the last iterate, not a verified optimum."""
