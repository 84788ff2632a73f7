"""Per-sample output Jacobians, their products, and the routes that compute them: one import
point.

The network Jacobian J(x) = d f(x; theta) / d theta (thesis eq. 2.22) is the feature map of the
linearised network (eq. 2.26 / 3.1); every Gauss-Newton curvature is built from products with it
(GGN J^T Lambda J, eq. 2.24 / 3.11; gradients J^T r, eq. 2.23). The computations live in three
modules, by concept, and are re-exported here under the names callers have always used:

- :mod:`gaussify.curvature.generic_jacobian`: the generic ``torch.func`` route for any module
  (``jacobians``, ``jvp``, ``jvp_with_outputs``, ``vjp``, ``model_outputs``), the chunking
  helpers (``DEFAULT_CHUNK_ELEMENTS``, ``auto_chunk_size``, ``chunk_slices``) and the eval-mode
  check;
- :mod:`gaussify.curvature.layer_traces`: the per-layer hook route for plain ``nn.Linear`` and
  ``nn.Conv2d`` layers (inputs a and output gradients delta; ``linear_output_traces``,
  ``traced_jvp``);
- :mod:`gaussify.curvature.per_sample`: per-sample products ``J_n^T u_{n,k}``
  (``per_sample_vjp``) and their squared sums, the diagonal GGN / EF (``squared_vjp_sum``),
  taking the per-layer route where it applies and the generic one elsewhere.

Shapes: inputs ``x (N, ...)``, outputs ``f (N, C)``, parameters flattened in
``model.named_parameters()`` order of the subset, ``P = subset.num_params``.
"""

from __future__ import annotations

from gaussify.curvature.generic_jacobian import (
    DEFAULT_CHUNK_ELEMENTS,
    MIN_CHUNK_ELEMENTS,
    SubsetLike,
    auto_chunk_size,
    check_eval_mode,
    chunk_slices,
    jacobians,
    jvp,
    jvp_with_outputs,
    model_outputs,
    resolve_subset,
    vjp,
)
from gaussify.curvature.layer_traces import linear_output_traces, traced_jvp
from gaussify.curvature.patches import conv2d_patches
from gaussify.curvature.per_sample import per_sample_vjp, squared_vjp_sum

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "MIN_CHUNK_ELEMENTS",
    "SubsetLike",
    "auto_chunk_size",
    "check_eval_mode",
    "chunk_slices",
    "conv2d_patches",
    "jacobians",
    "jvp",
    "jvp_with_outputs",
    "linear_output_traces",
    "model_outputs",
    "per_sample_vjp",
    "resolve_subset",
    "squared_vjp_sum",
    "traced_jvp",
    "vjp",
]
