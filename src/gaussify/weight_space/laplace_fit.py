"""The data passes of a :class:`~gaussify.weight_space.laplace.Laplace` fit.

One pass over the data sums, at the expansion point theta* (or at the linearised network
f_lin = f(x; theta*) + J (theta - theta*) during refinement), the curvature G, the
log-likelihood sum_n log p(y_n | f_n), its gradient g = sum_n J_n^T r_n (r = d log p / df,
thesis eq. 2.23) and, for regression, the squared errors. On the last-layer feature path
(J_n = I_C ⊗ [phi_n, 1]^T, :mod:`gaussify.curvature.lastlayer`) the gradient and outputs come
from the output layer's input features alone. :func:`refine_mean` runs the Newton iteration to
the GLM mode (thesis eq. 3.12) on top of these passes. The functions take the posterior as a
:class:`~gaussify.weight_space.laplace_fields.LaplaceFields` and import nothing from
``laplace.py``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from gaussify import distributed
from gaussify.batches import Batches
from gaussify.curvature import make_curvature
from gaussify.curvature.chain_diag import GradientSink
from gaussify.curvature.jacobian import MIN_CHUNK_ELEMENTS, chunk_slices, jvp_with_outputs, vjp
from gaussify.curvature.lastlayer import forward_with_features, lastlayer_jvp, lastlayer_vjp
from gaussify.curvature.subset import expand_prior
from gaussify.deferred_checks import check_finite, deferred_checks
from gaussify.fastpath import functional_call
from gaussify.validation import validated_batches
from gaussify.weight_space.laplace_fields import LaplaceFields

__all__ = [
    "accumulate",
    "add_statistics",
    "features",
    "linearised_outputs",
    "refine_mean",
    "restore_statistics",
    "statistics",
]


def add_statistics(la: LaplaceFields, previous: tuple[Any, ...]) -> None:
    """Add an earlier fit's sums (from :meth:`_statistics`) to the current ones."""
    old_curv, old_sigma, old_n, old_log_lik, old_grad, old_sse, _ = previous
    if la.task == "regression" and not torch.equal(old_sigma, la._sigma_fit):
        restore_statistics(la, previous)
        raise ValueError(
            "reset: sigma_noise changed between incremental fits; the GGN of the earlier "
            "data was built with the old noise, refit with reset=True"
        )
    new_state = la._curvature.state_dict()
    old_state = old_curv.state_dict()
    la._curvature.load_state_dict({k: v + old_state[k] for k, v in new_state.items()})
    la.num_data += old_n
    la._log_lik = la._log_lik + old_log_lik
    la._grad = la._grad + old_grad
    if la._sse is not None and old_sse is not None:
        la._sse = la._sse + old_sse
    la._posterior = None


def accumulate(
    la: LaplaceFields, batches: Any, shift: Tensor | None, progress: bool = False
) -> None:
    """One pass over the data: curvature, log-likelihood, its gradient and (regression)
    squared errors of the network linearised at theta*, evaluated at theta* + ``shift``
    (f_lin = f(x; theta*) + J shift; shift None means f_lin = f)."""
    curvature = make_curvature(
        la.structure,
        la.model,
        la.likelihood,
        la.subset,
        generator=la.generator,
        **la.curvature_options,
    )
    log_lik = torch.zeros((), dtype=la._dtype, device=la._device)
    # the mean is not read here: before the first fit it is built on demand (P numbers)
    grad = torch.zeros(la.subset.num_params, dtype=la._dtype, device=la._device)
    sse: Tensor | None = None
    num_data = 0
    iterator = batches
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(batches, desc=f"Laplace fit ({la.structure})", unit="batch")
    if hasattr(curvature, "keep_outputs"):
        curvature.keep_outputs = True  # hand (f, phi) over instead of a second forward
    # the per-batch checks (finite outputs and gradients, labels in range, a finite
    # curvature) are made on the device and tested once, after the last batch (one host
    # sync per fit); a failure raises naming its batch, before anything is replaced
    with deferred_checks() as scope:
        for i, (x, y) in enumerate(iterator):
            scope.batch = i
            if shift is None:
                # One forward pass besides the curvature's own: none on the last-layer path
                # where the curvature kept its outputs and features, nor where its passes
                # added J^T r (a chain's diagonal), else one forward + backward that gives
                # f, log p(y | f) and J^T r together.
                sink = _gradient_sink(la, curvature, y, grad)
                curvature.update(la.model, x, y)
                f, phi = outputs_after_update(la, curvature, x)
                if sink is not None and sink.added:
                    f = curvature.last_outputs[0]
                    curvature.last_outputs = None
                    log_lik += la.likelihood.log_prob(f, y).sum()
                elif f is None or phi is None:
                    f = outputs_and_gradient(la, x, y, grad)
                    log_lik += la.likelihood.log_prob(f, y).sum()
                else:
                    log_lik += feature_statistics(la, f, phi, y, grad)
            else:
                f, offset, phi = linearised_outputs(la, x, shift)
                curvature.update(la.model, x, y, offset=offset)
                if phi is not None:
                    log_lik += feature_statistics(la, f, phi, y, grad)
                else:
                    log_lik += la.likelihood.log_prob(f, y).sum()
                    grad += vjp(la.model, x, la.subset, la.likelihood.residual(f, y))
            if la.task == "regression":
                sq = (y.reshape(f.shape).to(f.dtype) - f).square().sum(0)
                sse = sq if sse is None else sse + sq
            num_data += x.shape[0]
            del f, phi  # not kept alive while the next batch is drawn and processed
    # torch.distributed: every statistic above is a sum over data (no-op without a group)
    distributed.reduce_curvature(curvature)
    log_lik, grad, sse, num_data = distributed.all_reduce_sum(log_lik, grad, sse, num_data)
    if num_data == 0:
        raise ValueError("data: contains no examples")
    if hasattr(curvature, "last_outputs"):
        curvature.last_outputs = None  # the last batch's outputs and features: not state
    if hasattr(curvature, "gradient_sink"):
        curvature.gradient_sink = None
    la._curvature = curvature
    la._sigma_fit = la.sigma_noise.clone()  # the noise the curvature was built with
    la.num_data = num_data
    la._log_lik = log_lik
    la._grad = grad
    la._sse = sse
    la._posterior = None


def _gradient_sink(
    la: LaplaceFields, curvature: Any, y: Tensor, grad: Tensor
) -> GradientSink | None:
    """A sink for J^T r of this batch (r = d log p(y | f) / df) handed to a curvature that
    can add it in its own backward passes (``gradient_sink``: the diagonal's batched route,
    :class:`gaussify.curvature.chain_diag.GradientSink`); None for the others and for a
    subnetwork (whose gradient is its entries of the support's)."""
    if not hasattr(curvature, "gradient_sink") or la.subset.indices is not None:
        return None
    sink = GradientSink(lambda f: la.likelihood.residual(f, y), grad)
    curvature.gradient_sink = sink
    return sink


def feature_statistics(
    la: LaplaceFields, f: Tensor, phi: Tensor, y: Tensor, grad: Tensor
) -> Tensor:
    """Last-layer path: adds J^T r to ``grad`` in place from the features phi and returns
    sum_n log p(y_n | f_n); in chunks, so that the likelihood's (B, C) temporaries
    (softmax, one-hot, residual) of a many-class batch stay about as large as the
    parameter vector."""
    assert la._output_layer is not None
    log_lik = torch.zeros((), dtype=grad.dtype, device=grad.device)
    budget = max(la.subset.num_params, MIN_CHUNK_ELEMENTS)
    for sl in chunk_slices(f.shape[0], max(1, budget // (8 * f.shape[1]))):
        log_lik += la.likelihood.log_prob(f[sl], y[sl]).sum()
        residual = la.likelihood.residual(f[sl], y[sl])
        lastlayer_vjp(phi[sl], residual, la._output_layer, out=grad)
    return log_lik


def outputs_after_update(
    la: LaplaceFields, curvature: Any, x: Tensor
) -> tuple[Tensor | None, Tensor | None]:
    """(f, phi) of the batch just added to ``curvature`` on the last-layer feature path:
    taken from the curvature when it kept them (``last_outputs``), else one forward pass
    without gradients; (None, None) off the feature path (the caller then needs a forward
    pass with a graph anyway)."""
    if not la._feature_path or la._output_layer is None:
        return None, None
    kept = getattr(curvature, "last_outputs", None)
    if kept is not None and kept[1] is not None and kept[0].shape[0] == x.shape[0]:
        curvature.last_outputs = None  # handed over: freed with the caller's references
        return kept
    f, phi = features(la, x)
    return (f, phi) if phi is not None else (None, None)


def outputs_and_gradient(la: LaplaceFields, x: Tensor, y: Tensor, grad: Tensor) -> Tensor:
    """f (N, C), adding J^T r to ``grad`` (P,) in place: one forward pass with a
    ``torch.func.vjp`` pullback, whose outputs give the residual r = d log p(y | f) / df
    that is pulled back (thesis eq. 2.23). Each parameter tensor's gradient goes into its
    slice of ``grad`` (no flattened P-sized copy); all are checked finite before any is
    added."""
    named = dict(la.model.named_parameters())
    params = {n: named[n].detach() for n in la.subset.names}
    frozen = {n: p.detach() for n, p in named.items() if n not in params}

    def outputs(p: dict[str, Tensor]) -> Tensor:
        return functional_call(la.model, {**frozen, **p}, (x,))

    f, pullback = torch.func.vjp(outputs, params)
    if not isinstance(f, Tensor) or f.ndim != 2 or f.shape[0] != x.shape[0]:
        shape = tuple(f.shape) if isinstance(f, Tensor) else type(f).__name__
        raise ValueError(f"model: expected outputs of shape (N, C), got {shape}")
    f = f.detach()
    (grads,) = pullback(la.likelihood.residual(f, y).to(f.dtype))
    for name in la.subset.names:
        check_finite(
            grads[name],
            f"non-finite gradient of the log-likelihood in parameter {name!r}: the "
            "outputs or the network's Jacobian are NaN/inf for this batch (check x)",
        )
    if la.subset.indices is not None:  # a subnetwork: its entries of the tensors
        grad += la.subset.flatten(grads)
        return f
    start = 0
    for name, numel in zip(la.subset.names, la.subset.numels, strict=True):
        grad[start : start + numel] += grads.pop(name).reshape(-1).to(grad.dtype)
        start += numel
    return f


def features(la: LaplaceFields, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """f(x; theta*) (N, C) and, on the last-layer feature path, the inputs phi (N, D) of
    the output layer (None otherwise)."""
    layer = la._output_layer if la._feature_path else None
    # differentiable in x when x requires grad (input gradients, e.g. BO acquisitions)
    with torch.set_grad_enabled(x.requires_grad):
        f, phi = forward_with_features(la.model, x, layer)
    if not x.requires_grad:
        return f, None if phi is None else phi.detach()
    return f, phi


def linearised_outputs(
    la: LaplaceFields, x: Tensor, shift: Tensor | None
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """f_lin(x) = f(x; theta*) + J(x) shift (N, C), the offset J shift (None if no
    shift) and the output layer's features phi (N, D) on the last-layer path (else None)."""
    f, phi = features(la, x)
    if shift is None:
        return f, None, phi
    if phi is not None and la._output_layer is not None:
        offset = lastlayer_jvp(phi, shift.to(phi.dtype), f.shape[1], la._output_layer)
        return f + offset, offset, phi
    f, offset = jvp_with_outputs(la.model, x, la.subset, shift)
    return f + offset, offset, None


def refine_mean(
    la: LaplaceFields,
    data: Batches,
    *,
    max_iter: int,
    tol: float | None,
    batch_size: int,
    progress: bool,
) -> None:
    """The Newton / quasi-Newton iteration of :meth:`Laplace.refine` (its docstring states
    the steps and the stopping rules): sets ``la.mean`` to the GLM mode and the statistics
    to the ones at that mean; each curvature pass goes through ``la._accumulate``."""
    la._require_fit()
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 0:
        raise ValueError(f"max_iter: expected an integer >= 0, got {max_iter!r}")
    if tol is None:
        tol = 10 * torch.finfo(la.mean.dtype).eps
    elif not math.isfinite(tol) or tol < 0:
        raise ValueError(f"tol: expected a finite number >= 0 or None, got {tol!r}")
    batches = validated_batches(
        data,
        batch_size,
        model=la.model,
        task=la.task,
        owner="Laplace.refine",
        multi_pass=True,
    )
    shift = la.mean - la.theta_star
    prior_vec = expand_prior(la.prior_precision, la.subset).to(la.mean.dtype)

    def log_joint(step: Tensor) -> float:
        total = torch.zeros((), dtype=la.mean.dtype, device=la.mean.device)
        for x, y in batches:
            total += la.likelihood.log_prob(linearised_outputs(la, x, step)[0], y).sum()
        theta = la.theta_star + step - la.prior_mean
        value = distributed.all_reduce_sum(total) - 0.5 * (prior_vec * theta.square()).sum()
        return float(value)

    current = log_joint(shift)
    previous: tuple[Tensor, float, tuple[Any, ...]] | None = None
    for _ in range(max_iter):
        theta = la.theta_star + shift
        # gradient of the GLM log joint at theta (prior N(m0, P0^-1))
        b = la._grad - prior_vec * (theta - la.prior_mean)
        direction = la.posterior.solve(b)
        decrement = 0.5 * float((b * direction).sum())  # predicted gain of a full step
        if previous is not None and not decrement < previous[1]:
            # the last unverifiable step did not bring the decrement down: undo it
            shift, _, state = previous
            restore_statistics(la, state)
            break
        step_size = float(direction.abs().max())
        if decrement <= 0 or step_size <= tol * max(1.0, float(theta.abs().max())):
            break
        if decrement > tol * max(1.0, abs(current)):
            step, value = 1.0, -math.inf
            while step >= 1e-4:
                candidate = shift + step * direction
                value = log_joint(candidate)
                if value > current:
                    break
                step /= 2
            if not value > current:
                break  # no step improves h
            shift, current, previous = candidate, value, None
        else:
            previous = (shift, decrement, statistics(la))
            shift = shift + direction
        la._accumulate(batches, shift, progress)
    la.mean = la.theta_star + shift


#: what :func:`accumulate` sets, in the order of :func:`statistics`
STATISTICS = ("_curvature", "_sigma_fit", "num_data", "_log_lik", "_grad", "_sse", "_posterior")


def statistics(la: LaplaceFields) -> tuple[Any, ...]:
    """What :func:`accumulate` sets (to undo a refinement step without a data pass)."""
    return tuple(getattr(la, name) for name in STATISTICS)


def restore_statistics(la: LaplaceFields, state: tuple[Any, ...]) -> None:
    """Set back what :func:`statistics` returned."""
    for name, value in zip(STATISTICS, state, strict=True):
        setattr(la, name, value)
