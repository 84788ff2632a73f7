"""The traced KFAC GLM predictive: rank-one Jacobian rows instead of the (N, C, P) Jacobian."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gaussify.curvature.jacobian import linear_output_traces, traced_jvp
from gaussify.curvature.kron_posterior import KronPosteriorPrecision
from gaussify.curvature.subset import ParameterSubset

__all__ = ["traced_predictive"]


def traced_predictive(
    post: KronPosteriorPrecision,
    model: nn.Module,
    x: Tensor,
    subset: ParameterSubset,
    shift: Tensor,
    diagonal: bool = False,
) -> tuple[Tensor, Tensor] | None:
    """The GLM predictive ``(f + J shift (N, C), J Sigma J^T (N, C, C))`` of a Kronecker
    posterior over plain ``nn.Linear`` layers without the ``(N, C, P)`` Jacobian: one forward
    pass with hooks and C backward passes give each layer's inputs and output gradients
    (:func:`gaussify.curvature.jacobian.linear_output_traces`), then
    :meth:`KronPosteriorPrecision.functional_cov_traced`; the covariance is
    ``diag_embed`` of the variances with ``diagonal``. None when some parameter of ``subset``
    is not on that route (a convolution, another module, a shared weight, ...): use the
    Jacobian."""
    if not post.traced_blocks():
        return None
    traced = linear_output_traces(model, x, subset)
    if traced is None:
        return None
    f, traces = traced
    mean = f + traced_jvp(traces, subset.unflatten(shift))
    pairs = {path: (tr.inputs, tr.deltas) for path, tr in traces.items()}
    cov = post.functional_cov_traced(pairs, diagonal)
    return mean, torch.diag_embed(cov) if diagonal else cov
