"""Variational inference in the GLM linearised at the MAP (Immer, Korzepa & Bauer 2021, "GLM VI").

The GGN turns the network into a generalised linear model around theta*,
f_lin(x; theta) = f(x; theta*) + J*(x) (theta - theta*) (their eq. 6); :class:`GLMVI` runs the
natural-gradient Gaussian VI of :mod:`gaussify.weight_space.ngvi` (thesis eq. 4.2-4.3) in that
model: every step samples theta_s ~ q_t and uses the gradient J*^T r(y, f_lin(x; theta_s)) and
the GGN J*^T Lambda(f_lin(x; theta_s)) J* (the curvature's ``offset`` mechanism: Lambda at the
linearised outputs, Jacobians at theta*). The Jacobians and the model's weights stay at theta*
throughout, and predictions use the GLM predictive of the same model (their eq. 7-8), which is
the predictive of :class:`~gaussify.weight_space.laplace.Laplace` after ``refine``.

It is :class:`~gaussify.weight_space.ngvi.LGVA` with a fixed linearisation point; for a model
that is linear in its parameters the two coincide.
"""

from __future__ import annotations

from gaussify.weight_space.ngvi import NaturalGradientVI

__all__ = ["GLMVI"]


class GLMVI(NaturalGradientVI):
    """Natural-gradient VI in the GLM linearised at the model's current weights theta* (train
    the MAP first, e.g. with :func:`gaussify.train_map`). q_0 is centred at theta*.

    Arguments as :class:`~gaussify.weight_space.ngvi.NaturalGradientVI`:
    ``GLMVI(model, likelihood, structure, prior_precision, lr, num_samples, subset, sigma_noise,
    init_precision=..., antithetic=..., seed=...)``. ``theta_lin`` holds theta*; ``mean`` the
    variational mean; ``predict`` defaults to the GLM predictive.
    """

    linearization = "map"
    sampling = True
    default_method = "glm"
