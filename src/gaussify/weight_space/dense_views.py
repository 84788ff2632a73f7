"""Dense views of a weight-space Gaussian posterior N(mu, A^-1), shared by Laplace and the
NGVI family: the (P, P) precision A and covariance A^-1, each refused before allocation when
P^2 numbers exceed the memory limit (:mod:`gaussify.memory_guard`), and the marginal
variances diag(A^-1), which need no P x P matrix.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from gaussify.curvature.subset import ParameterSubset
from gaussify.memory_guard import check_allocation

__all__ = ["DenseViews"]


class DenseViews:
    """Mixin for a posterior with ``posterior`` (a structured posterior precision with
    ``precision_dense``, ``covariance_dense``, ``covariance_diag``), ``subset`` and ``mean``."""

    posterior: Any
    subset: ParameterSubset
    mean: Tensor

    @property
    def posterior_precision(self) -> Tensor:
        """Dense posterior precision A (P, P) (refused when P^2 exceeds the allocation limit,
        :mod:`gaussify.memory_guard`)."""
        self._check_dense("posterior_precision")
        return self.posterior.precision_dense()

    @property
    def posterior_covariance(self) -> Tensor:
        """Dense posterior covariance A^-1 (P, P) (refused like :attr:`posterior_precision`)."""
        self._check_dense("posterior_covariance")
        return self.posterior.covariance_dense()

    @property
    def posterior_variance(self) -> Tensor:
        """Marginal posterior variances diag(A^-1) (P,)."""
        return self.posterior.covariance_diag()

    def _check_dense(self, what: str) -> None:
        p = self.subset.num_params
        check_allocation(
            p * p,
            self.mean.dtype,
            f"{what}: the dense P x P matrix (P = {p:,})",
            "posterior_variance (the diagonal), sample(), predict(), or a smaller subset",
            device=self.mean.device,
        )
