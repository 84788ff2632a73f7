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
that is linear in its parameters the two coincide. :meth:`GLMVI.init_laplace` starts q_0 at
the GLM's Laplace posterior N(theta*, (P0 + G(theta*))^-1) (one GGN pass), from which few
steps reach the variational optimum.
"""

from __future__ import annotations

from gaussify.batches import Batches
from gaussify.model_checks import in_eval_mode
from gaussify.state import transactional
from gaussify.validation import validated_batches
from gaussify.weight_space.ngvi import NaturalGradientVI
from gaussify.weight_space.ngvi_math import blend_curvature

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

    @transactional
    @in_eval_mode
    def init_laplace(self, data: Batches, batch_size: int = 256) -> GLMVI:
        """Set q_0 to the Laplace-GGN posterior of the GLM at theta*: mean theta*, precision
        Lambda_0 = P0 + G(theta*) with G = sum_n J_n^T Lambda(f(x_n; theta*)) J_n over ``data``
        (in the engine's structure; the same matrix as ``gs.Laplace(...).fit(data)``). This is
        one NGVI step with gamma = 1 and Lambda evaluated at the mode's outputs; it also sets
        N for later :meth:`step` calls. Returns ``self``."""
        batches = validated_batches(
            data, batch_size, model=self.model, task=self.task, owner="GLMVI.init_laplace"
        )
        self.model.eval()
        curvature = self._new_curvature()
        num_data = 0
        for x, y in batches:  # one pass: a generator is enough
            curvature.update(self.model, x, y)
            num_data += x.shape[0]
        self.num_data = num_data
        self._state = blend_curvature(
            self.structure, self._state, curvature.state_dict(), 1.0, self.num_data
        )
        assert self.theta_lin is not None
        self.mean = self.theta_lin.clone()
        self._write(self.mean)
        self._posterior = None
        return self
