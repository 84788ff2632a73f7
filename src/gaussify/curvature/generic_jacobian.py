"""The generic route: per-sample output Jacobians and Jacobian-vector products with
``torch.func``, for any module.

The network Jacobian J(x) = d f(x; theta) / d theta (thesis eq. 2.22) is the feature map of the
linearised network (eq. 2.26 / 3.1); every Gauss-Newton curvature is built from products with it
(GGN J^T Lambda J, eq. 2.24 / 3.11; gradients J^T r, eq. 2.23). The functions here work for any
module that ``torch.func.functional_call`` can run (LayerNorm, BatchNorm in eval mode, skip
connections, non-Sequential models): the parameters of the chosen subset are the differentiated
inputs, every other parameter and buffer stays fixed at its current value. The chunking helpers
(element budgets, ``chunk_slices``) and the eval-mode and finiteness checks shared by every
route live here too.

The model must be in **eval mode** where that matters: a BatchNorm in training mode mixes the
samples of a batch (and would update its running statistics), and Dropout in training mode is
random; both raise a ``ValueError`` naming the module. Modes are never switched here.

Shapes: inputs ``x (N, ...)``, outputs ``f (N, C)``, parameters flattened in
``model.named_parameters()`` order of the subset, ``P = subset.num_params``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.func as tfunc
from torch import Tensor, nn
from torch.func import jacrev, vmap
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from gaussify.curvature.subset import ParameterSubset, require_whole_tensors, select_parameters
from gaussify.deferred_checks import check_finite_values, deferring_on
from gaussify.fastpath import forward_ad_unsupported, functional_call, warn_reverse_mode

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "MIN_CHUNK_ELEMENTS",
    "SubsetLike",
    "auto_chunk_size",
    "check_eval_mode",
    "chunk_slices",
    "jacobians",
    "jvp",
    "jvp_with_outputs",
    "model_outputs",
    "resolve_subset",
    "vjp",
]

SubsetLike = str | Sequence[str] | Tensor | ParameterSubset

#: Budget (in tensor elements) for one chunk of per-sample products, ``chunk * K * P``.
#: 2**24 elements are 128 MiB in float64.
DEFAULT_CHUNK_ELEMENTS = 2**24
#: Smallest budget the structures use when they size chunks by their own storage (a curvature
#: of a few thousand entries should not loop over single samples): 2**16 elements, 512 KiB in
#: float64.
MIN_CHUNK_ELEMENTS = 2**16


def resolve_subset(
    model: nn.Module, subset: SubsetLike, *, subnetwork: bool = False
) -> ParameterSubset:
    """A :class:`ParameterSubset` for ``subset`` (passed through if it already is one). With
    ``subnetwork=True`` (callers that handle individual weights) a mask or index tensor gives a
    subnetwork (:mod:`gaussify.curvature.subset`); otherwise a subnetwork raises."""
    if isinstance(subset, ParameterSubset):
        if not subnetwork:
            require_whole_tensors(subset, "this computation")
        return subset
    return select_parameters(model, subset, subnetwork=subnetwork)


def auto_chunk_size(num_samples: int, per_sample: int, chunk_size: int | None = None) -> int:
    """Samples per chunk: ``chunk_size`` if given, else as many as fit the element budget."""
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size: expected a positive integer or None, got {chunk_size!r}")
        return chunk_size
    return max(1, min(max(num_samples, 1), DEFAULT_CHUNK_ELEMENTS // max(per_sample, 1)))


def chunk_slices(num_samples: int, chunk_size: int) -> Iterator[slice]:
    """Consecutive slices of at most ``chunk_size`` samples covering ``range(num_samples)``."""
    for start in range(0, num_samples, chunk_size):
        yield slice(start, min(start + chunk_size, num_samples))


def check_eval_mode(model: nn.Module) -> None:
    """Raise if a module whose output depends on the batch or on randomness is in training mode.

    Per-sample Jacobians assume f(x_n) depends on x_n only (thesis eq. 2.22); BatchNorm in
    training mode breaks that (and would update running statistics), Dropout makes f random.
    """
    for name, module in model.named_modules():
        if module.training and isinstance(module, _BatchNorm | _DropoutNd | nn.AlphaDropout):
            raise ValueError(
                f"model: module {name or '<root>'!r} ({type(module).__name__}) is in training "
                "mode; call model.eval() before computing Jacobians or curvature (per-sample "
                "Jacobians need outputs that depend on one sample only and are deterministic)"
            )


def _check_output(out: Tensor, batch: int) -> None:
    if not isinstance(out, Tensor):
        raise TypeError(
            f"model: expected the forward pass to return a Tensor of shape (N, C), "
            f"got {type(out).__name__}"
        )
    if out.ndim != 2 or out.shape[0] != batch:
        raise ValueError(
            f"model: expected outputs of shape (N, C) = ({batch}, C), got {tuple(out.shape)}; "
            "wrap the model so that it returns a 2-D output"
        )


def _split(
    model: nn.Module, subset: ParameterSubset
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(subset parameters, every other parameter), all detached from the autograd graph."""
    chosen = set(subset.names)
    named = dict(model.named_parameters())
    missing = [n for n in subset.names if n not in named]
    if missing:
        raise ValueError(f"subset: parameters {missing} are not parameters of the model")
    params = {n: named[n].detach() for n in subset.names}
    frozen = {n: p.detach() for n, p in named.items() if n not in chosen}
    return params, frozen


def _single_sample_fn(
    model: nn.Module, frozen: dict[str, Tensor]
) -> Callable[[dict[str, Tensor], Tensor], Tensor]:
    """f(params, x_n) -> (C,), the network on one sample as a function of the subset."""

    def f(params: dict[str, Tensor], x_n: Tensor) -> Tensor:
        out = functional_call(model, {**frozen, **params}, (x_n.unsqueeze(0),))
        _check_output(out, 1)
        return out.squeeze(0)

    return f


def _batch_fn(
    model: nn.Module, frozen: dict[str, Tensor], x: Tensor
) -> Callable[[dict[str, Tensor]], Tensor]:
    """f(params) -> (N, C) on a batch (valid for products because samples are independent)."""

    def f(params: dict[str, Tensor]) -> Tensor:
        out = functional_call(model, {**frozen, **params}, (x,))
        _check_output(out, x.shape[0])
        return out

    return f


def _check_finite(block: Tensor, subset: ParameterSubset, model: nn.Module) -> None:
    """Raise naming the first parameter tensor whose Jacobian entries are NaN or infinite.

    On an accelerator inside a :func:`gaussify.deferred_checks.deferred_checks` scope
    (:func:`gaussify.deferred_checks.deferring_on`) the largest |entry|
    of each parameter's columns is recorded instead (no host read) and the same message is
    raised at the scope's end: per column max(max, -min) over the rows (NaN and +-inf reach
    it), then one ``_foreach_max`` over the parameters' column ranges. Only P-sized
    temporaries: the block is not copied (its columns split per parameter are strided)."""
    if deferring_on(block.device):
        flat = block.detach().reshape(-1, block.shape[-1])
        top = torch.maximum(flat.amax(0), flat.amin(0).neg())
        check_finite_values(
            torch._foreach_max(list(torch.split(top, list(subset.counts)))),
            lambda i, value: nonfinite_jacobian_message(subset, model, i, value_kind(value)),
        )
        return
    # One reduction first (NaN/inf propagate into the sum); the per-entry scan runs only when
    # it is not finite, which keeps the check to one read of the block.
    if torch.isfinite(block.sum()) or torch.isfinite(block).all():
        return
    parts = torch.split(block, list(subset.counts), dim=-1)
    for i, part in enumerate(parts):
        if not torch.isfinite(part).all():
            kind = "NaN" if torch.isnan(part).any() else "infinite"
            raise ValueError(nonfinite_jacobian_message(subset, model, i, kind))


def value_kind(value: Tensor) -> str:
    """What a failed check's value (read on failure only) is: "NaN" or "infinite"."""
    return "NaN" if bool(torch.isnan(value)) else "infinite"


def nonfinite_jacobian_message(subset: ParameterSubset, model: nn.Module, i: int, kind: str) -> str:
    """The error for a ``kind`` ("NaN" or "infinite") Jacobian in the subset's ``i``-th
    parameter tensor, naming it and its module."""
    name = subset.names[i]
    module = subset.module_of(name)
    return (
        f"{kind} Jacobian in parameter {name!r} (module {module or '<root>'!r}, "
        f"{type(model.get_submodule(module)).__name__}): the network is not differentiable "
        "at the current parameters (e.g. sqrt or norm at zero); curvature cannot be computed"
    )


def model_outputs(model: nn.Module, x: Tensor, chunk_size: int | None = None) -> Tensor:
    """Network outputs f (N, C) without gradients, computed in chunks of ``chunk_size``."""
    n = x.shape[0]
    chunk = n if chunk_size is None else auto_chunk_size(n, 1, chunk_size)
    outs = []
    with torch.no_grad():
        for sl in chunk_slices(n, max(chunk, 1)):
            out = model(x[sl])
            _check_output(out, x[sl].shape[0])
            outs.append(out)
    if not outs:
        raise ValueError("x: got an empty batch")
    return torch.cat(outs)


def _generic_per_sample_vjp(
    model: nn.Module, subset: ParameterSubset
) -> Callable[[Tensor, Tensor], Tensor]:
    """(x (B, ...), u (B, K, C)) -> (B, K, P): vmap over samples of a vmap over K of vjp."""
    params, frozen = _split(model, subset)
    f_single = _single_sample_fn(model, frozen)

    def one(x_n: Tensor, u_n: Tensor) -> Tensor:
        _, pullback = tfunc.vjp(lambda p: f_single(p, x_n), params)
        (grads,) = vmap(pullback)(u_n)
        return subset.flatten(grads)

    return vmap(one)


def jacobians(
    model: nn.Module, x: Tensor, subset: SubsetLike = "all", chunk_size: int | None = None
) -> Tensor:
    """Per-sample output Jacobians J_n = d f(x_n) / d theta_subset, shape (N, C, P).

    Thesis eq. 2.22, computed with ``vmap(jacrev(functional_call))`` over samples (C batched
    backward passes), in chunks of ``chunk_size`` samples. The result is (N, C, P) for the
    inputs given; to bound memory over a data set, call it per batch. Raises ``ValueError``
    naming the parameter when an entry is NaN or infinite. A subnetwork's Jacobian is the
    support tensors' one with the selected columns gathered per chunk (chunks sized by the
    support), so at most one chunk's (B, C, P_support) block exists at a time.
    """
    subset = resolve_subset(model, subset, subnetwork=True)
    check_eval_mode(model)
    params, frozen = _split(model, subset)
    f_single = _single_sample_fn(model, frozen)
    batched = vmap(jacrev(f_single), in_dims=(None, 0))
    n = x.shape[0]
    if n == 0:
        raise ValueError("x: got an empty batch")
    support = subset.support
    # C is unknown before the first forward; budget as if C were 16 and let users override.
    chunk = auto_chunk_size(n, 16 * support.num_params, chunk_size)
    blocks = []
    for sl in chunk_slices(n, chunk):
        block = support.flatten(batched(params, x[sl]))
        _check_finite(block, support, model)
        blocks.append(subset.gather(block))
    return torch.cat(blocks)


def jvp_with_outputs(
    model: nn.Module,
    x: Tensor,
    subset: SubsetLike,
    v: Tensor,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(f (N, C), J v (N, C)): outputs and Jacobian-vector products J_n v for one v (P,).

    Forward-mode ``torch.func.jvp`` of the batched network (the linearised network's change,
    thesis eq. 2.26), chunked over samples; where an operation has no forward-mode derivative,
    J_n from reverse mode times v (:mod:`gaussify.fastpath`, warned once per model).
    """
    subset = resolve_subset(model, subset, subnetwork=True)
    check_eval_mode(model)
    if v.shape != (subset.num_params,):
        raise ValueError(f"v: expected shape ({subset.num_params},), got {tuple(v.shape)}")
    params, frozen = _split(model, subset)
    tangents = {name: t.to(params[name].dtype) for name, t in subset.unflatten(v).items()}
    n = x.shape[0]
    chunk = n if chunk_size is None else auto_chunk_size(n, 1, chunk_size)
    outs, prods = [], []
    for sl in chunk_slices(n, max(chunk, 1)):
        try:
            out, prod = tfunc.jvp(_batch_fn(model, frozen, x[sl]), (params,), (tangents,))
        except (NotImplementedError, RuntimeError) as error:
            if not forward_ad_unsupported(error):
                raise
            warn_reverse_mode(model, error)
            out = model_outputs(model, x[sl])
            prod = torch.einsum("ncp,p->nc", jacobians(model, x[sl], subset), v.to(out.dtype))
        if not torch.isfinite(prod).all():
            raise ValueError(
                "NaN Jacobian-vector product: the network is not differentiable at the current "
                f"parameters in the subset {list(subset.names)}"
            )
        outs.append(out)
        prods.append(prod)
    if not outs:
        raise ValueError("x: got an empty batch")
    return torch.cat(outs), torch.cat(prods)


def jvp(
    model: nn.Module, x: Tensor, subset: SubsetLike, v: Tensor, chunk_size: int | None = None
) -> Tensor:
    """Jacobian-vector products J_n v for every sample, shape (N, C); v has shape (P,)."""
    return jvp_with_outputs(model, x, subset, v, chunk_size)[1]


def vjp(
    model: nn.Module, x: Tensor, subset: SubsetLike, u: Tensor, chunk_size: int | None = None
) -> Tensor:
    """sum_n J_n^T u_n, shape (P,), for output-space vectors u (N, C) (thesis eq. 2.23 with
    u = r gives the gradient of the log likelihood). Reverse mode on the batched network."""
    subset = resolve_subset(model, subset, subnetwork=True)
    check_eval_mode(model)
    n = x.shape[0]
    if u.ndim != 2 or u.shape[0] != n:
        raise ValueError(f"u: expected shape (N, C) with N = {n}, got {tuple(u.shape)}")
    params, frozen = _split(model, subset)
    chunk = n if chunk_size is None else auto_chunk_size(n, 1, chunk_size)
    total: Tensor | None = None
    for sl in chunk_slices(n, max(chunk, 1)):
        out, pullback = tfunc.vjp(_batch_fn(model, frozen, x[sl]), params)
        if out.shape != u[sl].shape:
            raise ValueError(f"u: expected shape {tuple(out.shape)} per chunk, got {u[sl].shape}")
        (grads,) = pullback(u[sl].to(out.dtype))
        flat = subset.flatten(grads)
        total = flat if total is None else total + flat
    if total is None:
        raise ValueError("x: got an empty batch")
    _check_finite(total, subset, model)
    return total
