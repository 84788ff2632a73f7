"""Samples of a last layer's weights W (D', K) whose columns are independent Gaussians.

The exact (Kalman) and ADF last layers keep q(W) = prod_k N(w_k | m_k, S_k): one mean column
m_k and one (D', D') covariance S_k per output k. A draw is w_k = m_k + C_k eps_k with
C_k C_k^T = S_k and eps_k ~ N(0, I).
"""

from __future__ import annotations

import torch
from torch import Tensor

from gaussify.validation import check_count

__all__ = ["ColumnSampler", "sample_columns"]


def sample_columns(
    mean: Tensor, covariance: Tensor, num_samples: int, generator: torch.Generator | None
) -> Tensor:
    """``num_samples`` draws of W with columns w_k ~ N(mean[:, k], covariance[k]) for
    ``mean (D', K)`` and ``covariance (K, D', D')``, flattened to (S, D' K) in the row-major
    order of ``mean`` (``.reshape(S, D', K)`` gives the matrices). Raises ``ValueError``
    where a covariance is not positive definite."""
    chol, info = torch.linalg.cholesky_ex(covariance)
    if bool((info > 0).any()):
        bad = int(torch.nonzero(info > 0)[0, 0])
        raise ValueError(
            f"covariance: the posterior covariance of output {bad} is not positive definite; "
            "refit the layer (or use a larger prior precision)"
        )
    d, k = mean.shape
    eps = torch.randn(num_samples, k, d, generator=generator, dtype=mean.dtype).to(mean.device)
    columns = mean.T + torch.einsum("kde,ske->skd", chol, eps)  # (S, K, D')
    return columns.transpose(1, 2).reshape(num_samples, d * k)


class ColumnSampler:
    """The ``sample`` method of a last layer with ``mean (D', K)`` and per-column
    ``covariance (K, D', D')`` (the exact and the ADF last layers)."""

    mean: Tensor
    covariance: Tensor

    def sample(self, num_samples: int = 100, generator: torch.Generator | None = None) -> Tensor:
        """Draws of the weights W ~ q(W) (columns independent Gaussians), (S, D' K) in the
        row-major order of :attr:`mean` (D', K) (:func:`sample_columns`)."""
        num_samples = check_count(num_samples, "num_samples")
        return sample_columns(self.mean, self.covariance, num_samples, generator)
