"""The traced KFAC GLM predictive: the Jacobian's rows from layer inputs and output gradients.

For a layer ``s_t = W a_t + b`` at ``T`` locations, the Jacobian of ``f_c`` with respect to its
block ``[W, b]`` is ``J_c = sum_t delta_ct f_t^T`` with block features ``f_t = [a_t, 1]`` and
``delta_ct`` the gradient of ``f_c`` with respect to ``s_t``. One forward pass with hooks and
C backward passes give every ``a`` and ``delta``
(:func:`gaussify.curvature.jacobian.linear_output_traces`), and
:meth:`KronPosteriorPrecision.functional_cov_traced` forms ``J Sigma J^T`` from them in each
block's Kronecker eigenbasis without the ``(N, C, P)`` Jacobian:

* ``nn.Linear`` on ``(N, in)`` inputs (``T = 1``): the rows are rank one,
  ``Q_out^T J_c Q_in = u_c psi^T``;
* plain ``nn.Conv2d`` (``groups=1``): ``T`` output locations, the im2col patches of the
  input are the ``a_t``; the rotated Jacobian ``sum_t u_ct psi_t^T`` is one batched matmul
  per block (no per-sample vmap'd Jacobian of the whole network).

Anything else (a sequence Linear, Conv1d/3d, an embedding, an attention, an exact block, a
shared weight) takes the dense Jacobian route: :func:`traced_predictive` returns None.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gaussify.curvature.jacobian import linear_output_traces
from gaussify.curvature.kron_posterior import KronPosteriorPrecision
from gaussify.curvature.patches import conv2d_patches
from gaussify.curvature.subset import ParameterSubset

__all__ = ["traced_predictive"]


def _layer_terms(tr) -> tuple[Tensor, Tensor]:
    """``(a (N, T, in), delta (C, N, T, out))`` of one trace."""
    if tr.conv is None:
        return tr.inputs.unsqueeze(1), tr.deltas.unsqueeze(2)
    a = conv2d_patches(tr.conv, tr.inputs, tr.module).transpose(1, 2)
    return a, tr.deltas.flatten(3).transpose(2, 3)


def _jvp(terms: dict[str, tuple[Tensor, Tensor]], traces, tangents: dict[str, Tensor]) -> Tensor:
    """``J v (N, C)``: ``sum_layers sum_t delta_ct . (dW a_t + db)``."""
    total: Tensor | int = 0
    for path, tr in traces.items():
        a, delta = terms[path]
        change = delta.new_zeros(delta.shape[1:])  # (N, T, out)
        for kind, name in tr.params:
            t = tangents[name].to(change.dtype)
            change = change + (a @ t.reshape(t.shape[0], -1).mT if kind == "weight" else t)
        total = total + torch.einsum("cnto,nto->nc", delta, change)
    assert isinstance(total, Tensor)
    return total


def traced_predictive(
    post: KronPosteriorPrecision,
    model: nn.Module,
    x: Tensor,
    subset: ParameterSubset,
    shift: Tensor,
    diagonal: bool = False,
) -> tuple[Tensor, Tensor] | None:
    """The GLM predictive ``(f + J shift (N, C), J Sigma J^T (N, C, C))`` of a Kronecker
    posterior over plain ``nn.Linear`` / ``nn.Conv2d`` layers without the ``(N, C, P)``
    Jacobian (module docstring); the covariance is ``diag_embed`` of the variances with
    ``diagonal``. None when some parameter of ``subset`` is not on that route (a sequence
    Linear, another module, an exact block, a shared weight, ...): use the Jacobian."""
    if not post.traced_blocks():
        return None
    traced = linear_output_traces(model, x, subset, convs=True)
    if traced is None:
        return None
    f, traces = traced
    terms = {path: _layer_terms(tr) for path, tr in traces.items()}
    mean = f + _jvp(terms, traces, subset.unflatten(shift))
    cov = post.functional_cov_traced(terms, diagonal)
    return mean, torch.diag_embed(cov) if diagonal else cov
