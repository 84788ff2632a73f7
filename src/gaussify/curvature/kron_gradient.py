"""``Laplace.fit``'s log-likelihood gradient folded into KFAC's batched backward passes.

A Laplace fit needs g = sum_n J_n^T r_n, r_n = d log p(y_n | f_n) / df_n, for the evidence's
non-MAP correction. On KFAC's chain route (an ``nn.Sequential`` of linear and convolution
layers, :func:`gaussify.curvature.kron_grams.chain_output_grams`) the B factors already send
K output vectors back through the network per chunk of samples, so r goes back as one more
vector (or is the one vector itself: the empirical Fisher's residual at the observed y) and
each layer's gradient is summed from its own column of the same pass:

* a linear layer: g_W = sum_n delta_n a_n^T, g_b = sum_n delta_n;
* a convolution: its weight gradient from the same delta and input (``conv2d_weight``);
* a layer whose output is the model output: delta_n = r_n, no pass at all.

Used only where every parameter of the subset is in such a layer (no exact blocks), the
batch is one chunk and no output offset is given, and where it pays: always for the
empirical Fisher (r is its one vector: nothing more is propagated), on chains of linear
layers otherwise. With convolutions the extra vector costs as much as the fit's own pass or
more (one more convolution adjoint and weight gradient per layer and chunk, and smaller
chunks under the memory rule): measured 0.89-1.00 x on the fits table's CNNs and the MNIST
CNN against 1.03-1.13 x on its MLPs and 1.27-1.35 x for the empirical Fisher
(``benchmarks/laplace_fit_gradient.py --structure kron``). Elsewhere ``Laplace.fit`` keeps
its own forward and backward pass. The sink is :class:`gaussify.curvature.chain_diag.GradientSink`,
the diagonal's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from gaussify.curvature.batched_backward import ChainPass, add_layer_gradient
from gaussify.curvature.chain_diag import GradientSink
from gaussify.curvature.kron_grams import ChainGradient
from gaussify.curvature.kron_modules import _Layer
from gaussify.curvature.per_sample import param_views
from gaussify.curvature.subset import ParameterSubset
from gaussify.deferred_checks import check_finite

__all__ = ["FoldedGradient", "fold_gradient"]


@dataclass
class FoldedGradient:
    """The batch's residuals r (N, C), the flat gradient's views by parameter name, and the
    inner layers' views by chain position (``chain``, for ``chain_output_grams``)."""

    residual: Tensor
    view: Callable[[str], Tensor]
    chain: ChainGradient

    def add_final(self, module: nn.Module, layer: _Layer, inp: Tensor) -> None:
        """A layer whose output is the model output: its gradient is r^T a (and sum_n r_n)."""
        add_layer_gradient(module, self.residual, inp, _layer_views(layer, self.view))

    def finish(self, sink: GradientSink, subset: ParameterSubset) -> None:
        """Record that every parameter's summed gradient is finite and mark the sink added."""
        for name in subset.names:
            check_finite(
                self.view(name),
                f"non-finite gradient of the log-likelihood in parameter {name!r}: the outputs "
                "or the network's Jacobian are NaN/inf for this batch (check x)",
            )
        sink.added = True


def fold_gradient(
    sink: GradientSink | None,
    model: nn.Module,
    subset: ParameterSubset,
    run: ChainPass,
    inner: Sequence[_Layer],
    f: Tensor,
    shared: bool,
) -> FoldedGradient | None:
    """The batch's :class:`FoldedGradient` for the passes over the ``inner`` layers (those
    below the output) of the chain ``run`` at outputs ``f``, or None: no sink, a convolution
    where r would be one more vector (it does not pay, module docstring), or one whose
    padding the weight gradient does not take (a string or a non-zero mode). ``shared``: the
    pass's one vector is r itself (the empirical Fisher)."""
    if sink is None:
        return None
    for layer in inner:
        m = model.get_submodule(layer.path)
        if isinstance(m, nn.Conv2d) and (
            not shared or isinstance(m.padding, str) or m.padding_mode != "zeros"
        ):
            return None
    residual = sink.residual(f)
    if residual.shape != f.shape:
        raise ValueError(f"residual: expected shape {tuple(f.shape)}, got {residual.shape}")
    residual = residual.to(f.dtype)
    view = param_views(model, subset, sink.out)
    views = {run.position(ly.path): _layer_views(ly, view) for ly in inner}
    chain = ChainGradient(None if shared else residual, views)
    return FoldedGradient(residual, view, chain)


def _layer_views(layer: _Layer, view: Callable[[str], Tensor]) -> dict[str, Tensor]:
    """{"weight": ..., "bias": ...}: the views of the layer's parameters in the subset."""
    named = (("weight", layer.weight), ("bias", layer.bias))
    return {kind: view(name) for kind, name in named if name is not None}
