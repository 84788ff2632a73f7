"""Diagonal generalised Gauss-Newton / empirical Fisher curvature.

diag(G) = sum_n sum_k (J_n^T L_n)_{:,k}^2 with Lambda_n = L_n L_n^T (thesis eq. 2.24 on the
diagonal): exact with the C columns of Lambda^{1/2} (C batched per-sample backward passes), or
Monte Carlo with S sampled labels (``mc_samples=S``, S passes, for many classes), or the
empirical Fisher sum_n g_n^2 (one pass). On a final ``nn.Linear`` subset it needs only the
features: diag(G) = sum_n diag(Lambda_n) ⊗ [phi_n, 1]^2, O(N C D).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from gaussify import draws
from gaussify.curvature.base import GaussNewtonCurvature, as_hyperparameter, check_offset
from gaussify.curvature.jacobian import SubsetLike
from gaussify.curvature.lastlayer import OutputLinear, lastlayer_jvp, lastlayer_num_outputs
from gaussify.curvature.subset import expand_prior
from gaussify.likelihoods import Likelihood
from gaussify.state import Integer, TensorSpec

__all__ = ["DiagGGN", "DiagonalPrecision"]


class DiagonalPrecision:
    """A = diag(scale * g + prior), shape (P,); Sigma = diag(1 / A)."""

    def __init__(self, precision: Tensor) -> None:
        if not bool((precision.detach() > 0).all()):
            raise ValueError(
                "posterior precision is not positive definite: scale * diag(G) + prior has "
                f"minimum {float(precision.detach().min()):.3g} (a GGN diagonal is >= 0, so the "
                "state is corrupted or the prior is not positive)"
            )
        self.precision = precision
        self.num_params = precision.shape[0]

    def logdet(self) -> Tensor:
        return self.precision.log().sum()

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        prec = self.precision
        z = draws.normal(
            (n, self.num_params), dtype=prec.dtype, device=prec.device, generator=generator
        )
        return z * prec.rsqrt()

    def _jac(self, jac: Tensor) -> Tensor:
        if jac.ndim != 3 or jac.shape[-1] != self.num_params:
            raise ValueError(
                f"jac: expected shape (N, C, {self.num_params}), got {tuple(jac.shape)}"
            )
        return jac.to(self.precision.dtype)

    def functional_cov(self, jac: Tensor) -> Tensor:
        jac = self._jac(jac)
        return torch.einsum("nap,nbp->nab", jac / self.precision, jac)

    def functional_var(self, jac: Tensor) -> Tensor:
        return (self._jac(jac).square() / self.precision).sum(-1)

    def functional_var_lastlayer(self, phi: Tensor, layer: OutputLinear) -> Tensor:
        """diag(J Sigma J^T) (N, C) from the output layer's features phi (N, D):
        sum_d' phi~_{n,d'}^2 Sigma_{(c,d')}, i.e. (phi^2) Sigma_W^T + Sigma_b. O(N C D)."""
        c = lastlayer_num_outputs(self.num_params, phi.shape[1], layer)
        return lastlayer_jvp(
            phi.to(self.precision.dtype).square(), self.precision.reciprocal(), c, layer
        )

    def functional_cov_lastlayer(self, phi: Tensor, layer: OutputLinear) -> Tensor:
        """J Sigma J^T (N, C, C), diagonal in the outputs for a diagonal Sigma (the outputs
        share no parameter of the last layer)."""
        return torch.diag_embed(self.functional_var_lastlayer(phi, layer))

    def solve(self, v: Tensor) -> Tensor:
        return v.to(self.precision.dtype) / self.precision

    def precision_dense(self) -> Tensor:
        return torch.diag(self.precision)

    def covariance_dense(self) -> Tensor:
        return torch.diag(1.0 / self.precision)

    def covariance_diag(self) -> Tensor:
        return 1.0 / self.precision


class DiagGGN(GaussNewtonCurvature):
    """diag(sum_n J_n^T Lambda_n J_n) (thesis eq. 2.24), exact, Monte Carlo (``mc_samples``) or
    the empirical Fisher (``ef=True``); see :class:`GaussNewtonCurvature` for the options."""

    structure: ClassVar[str] = "diag"

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood,
        subset: SubsetLike = "all",
        **kwargs: Any,
    ) -> None:
        super().__init__(model, likelihood, subset, **kwargs)
        self.ggn_diag = torch.zeros(self.num_params, dtype=self.dtype, device=self.device)

    def update(self, model: nn.Module, x: Tensor, y: Tensor, offset: Tensor | None = None) -> None:
        """Add the diagonal of the batch's GGN (or EF), with Lambda at f + ``offset``."""
        self._check_batch(model, x, y)
        # Accumulated in place: no P-sized temporary on the last-layer path.
        self._diag_batch(model, x, y, check_offset(offset, x.shape[0]), out=self.ggn_diag)
        self.num_data += x.shape[0]

    def posterior(
        self, prior_precision: Tensor | float, scale: Tensor | float = 1.0
    ) -> DiagonalPrecision:
        """A = scale * diag(G) + prior (thesis eq. 3.11 with a diagonal G)."""
        prior = as_hyperparameter(prior_precision, "prior_precision", self.ggn_diag)
        scale_t = as_hyperparameter(scale, "scale", self.ggn_diag)
        return DiagonalPrecision(scale_t * self.ggn_diag + expand_prior(prior, self.subset))

    def spectrum(
        self, groups: Tensor, vectors: list[Tensor]
    ) -> tuple[Tensor, Tensor, list[Tensor]]:
        """(diag(G) (P,), ``groups``, ``vectors``) in float64: a diagonal G's eigenbasis is the
        identity, so every prior granularity tunes in closed form (:mod:`gaussify.spectral`)."""
        return (
            self.ggn_diag.to(torch.float64),
            groups,
            [v.to(torch.float64) for v in vectors],
        )

    def state_dict(self) -> dict[str, Tensor]:
        return {"ggn_diag": self.ggn_diag.clone(), "num_data": torch.tensor(self.num_data)}

    def state_schema(self) -> dict[str, Any]:
        return {"ggn_diag": TensorSpec(("P",), self.dtype), "num_data": Integer()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        valid = self._validated_state(state)
        self.ggn_diag = valid["ggn_diag"].clone()
        self.num_data = valid["num_data"]
