"""The per-layer (hook) route for plain ``nn.Linear`` and ``nn.Conv2d`` layers.

One forward pass with hooks records each traced layer's inputs a and output; backward passes
of the K output vectors u_k give its output gradients delta. The per-sample gradient of
u_k^T f_n with respect to a linear layer's weight is then delta_{n,k} a_n^T (its bias: delta),
the identity KFAC and BackPACK use, and for a convolution sum_t delta_t a_t^T over its T output
locations with a_t the im2col patches (:mod:`gaussify.curvature.patches`). A layer is traced
only if it ran exactly once on batched inputs and each of its parameters enters the autograd
graph of the outputs exactly once (counted by :func:`_graph_uses`), so a weight that is also
used outside its module falls back to the generic ``torch.func`` path
(:mod:`gaussify.curvature.generic_jacobian`).

:func:`linear_output_traces` / :func:`traced_jvp` give the Jacobian of a network of plain
linear layers without forming it (the fast GLM predictive); :mod:`gaussify.curvature.per_sample`
builds per-sample products and their squared sums from the traces.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gaussify.curvature.generic_jacobian import (
    SubsetLike,
    _check_output,
    check_eval_mode,
    nonfinite_jacobian_message,
    resolve_subset,
    value_kind,
)
from gaussify.curvature.subset import ParameterSubset
from gaussify.deferred_checks import check_finite_values, deferring_on

__all__ = ["linear_output_traces", "traced_jvp"]


def _plain_conv2d(module: nn.Module) -> bool:
    """An ``nn.Conv2d`` whose forward pass is the library's own (no subclass changing it)."""
    return (
        isinstance(module, nn.Conv2d)
        and type(module).forward is nn.Conv2d.forward
        and type(module)._conv_forward is nn.Conv2d._conv_forward
    )


def _hookable_linears(
    model: nn.Module, subset: ParameterSubset, *, convs: bool = False
) -> dict[str, list[str]]:
    """Plain ``nn.Linear`` modules (and, with ``convs``, plain ``nn.Conv2d`` modules) owning
    subset parameters that no other module shares: module name -> ["weight"] / ["bias"] /
    both."""
    owners = Counter(
        id(p) for m in model.modules() for p in m._parameters.values() if p is not None
    )
    chosen = set(subset.names)
    found: dict[str, list[str]] = {}
    for mod_name, module in model.named_modules():
        linear = isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
        if not (linear or (convs and _plain_conv2d(module))):
            continue
        prefix = f"{mod_name}." if mod_name else ""
        kinds = [
            kind
            for kind in ("weight", "bias")
            if f"{prefix}{kind}" in chosen
            and getattr(module, kind) is not None
            and owners[id(getattr(module, kind))] == 1
        ]
        if kinds:
            found[mod_name] = kinds
    return found


@dataclass
class _LinearTrace:
    """One plain linear layer on the per-layer route: its inputs a (B, D_in), the gradients of
    sum_n u_{n,k}^T f_n with respect to its outputs, delta (K, B, D_out), and its parameters in
    the subset as (kind, full name). For a convolution (``conv`` set) the inputs are the
    layer's (B, C_in, H, W) input and delta is (K, B, C_out, H_out, W_out)."""

    module: str
    inputs: Tensor
    deltas: Tensor
    params: list[tuple[str, str]]
    conv: nn.Conv2d | None = None
    #: the layer's output in the autograd graph of f (kept only by ``_traces_from(...,
    #: backward=False)``, whose caller runs the backward passes itself)
    output: Tensor | None = None


def _linear_traces(
    model: nn.Module,
    x: Tensor,
    linears: dict[str, list[str]],
    cotangents: Tensor | Callable[[Tensor], Tensor],
) -> tuple[Tensor, Tensor, list[_LinearTrace]]:
    """(f (N, C) detached, u (N, K, C), traces) from one forward pass with hooks and K batched
    backward passes.

    For a linear layer z_n = W a_n + b the per-sample gradient of u^T f_n is delta_n a_n^T
    (and delta_n for b), so per-sample products need only a and delta (the identity behind
    BackPACK and KFAC). A layer is traced only if it ran exactly once on 2-D inputs and each of
    its parameters in the subset has exactly one use in the autograd graph of f (then the
    batched parameter gradient is sum_n delta_n a_n^T); a weight also used elsewhere in the
    forward pass has two, and the layer then falls back to the generic path.
    """
    f, captured = _traced_forward(model, x, linears)
    u = cotangents(f.detach()) if callable(cotangents) else cotangents
    return _traces_from(model, f, captured, linears, u)


_Captured = dict[str, list[tuple[Tensor, Tensor]]]


def _traced_forward(
    model: nn.Module, x: Tensor, linears: dict[str, list[str]]
) -> tuple[Tensor, _Captured]:
    """(f (N, C) with its autograd graph, module name -> [(input, output)] of each call): the
    forward pass of :func:`_linear_traces`, with hooks on the listed modules."""
    captured: _Captured = {name: [] for name in linears}
    handles = []
    for mod_name in linears:

        def hook(
            _m: nn.Module, inputs: tuple[Tensor, ...], out: Tensor, key: str = mod_name
        ) -> None:
            captured[key].append((inputs[0], out))

        handles.append(model.get_submodule(mod_name).register_forward_hook(hook))
    try:
        with torch.enable_grad():
            f = model(x)
    finally:
        for handle in handles:
            handle.remove()
    _check_output(f, x.shape[0])
    return f, captured


def _traces_from(
    model: nn.Module,
    f: Tensor,
    captured: _Captured,
    linears: dict[str, list[str]],
    u: Tensor,
    backward: bool = True,
) -> tuple[Tensor, Tensor, list[_LinearTrace]]:
    """The backward half of :func:`_linear_traces` for the outputs of :func:`_traced_forward`.
    With ``backward=False`` no backward pass runs: the traces keep their layer's output (in
    the graph of the returned f, which is then not detached) and empty deltas."""
    named = dict(model.named_parameters())
    if u.ndim != 3 or u.shape[0] != f.shape[0] or u.shape[2] != f.shape[1]:
        raise ValueError(f"cotangents: expected shape (N, K, C), got {tuple(u.shape)}")
    modules = {m: model.get_submodule(m) for m in linears}
    usable = [
        m
        for m, calls in captured.items()
        # one row per sample: a layer run on reshaped inputs (e.g. both members of a pair
        # stacked into 2N rows, or tokens) mixes rows across samples and takes the generic path
        # (a convolution: one (C, H, W) image per sample)
        if len(calls) == 1
        and calls[0][0].ndim == (4 if isinstance(modules[m], nn.Conv2d) else 2)
        and calls[0][0].shape[0] == f.shape[0]
        and calls[0][1].requires_grad
    ]
    if not usable or not f.requires_grad:
        return (f.detach() if backward else f), u, []
    outs = [captured[m][0][1] for m in usable]
    acts = [captured[m][0][0].detach() for m in usable]
    pnames = [(m, kind, f"{m}.{kind}" if m else kind) for m in usable for kind in linears[m]]
    params = [named[full] for _, _, full in pnames]
    u = u.to(f.dtype)
    uses = _graph_uses(f)  # before the backward pass frees the graph's buffers
    empty = u.new_empty(0)
    deltas = _batched_output_grads(f, outs, u.transpose(0, 1)) if backward else [empty] * len(outs)
    # The route is exact when each traced parameter enters the graph of f once (in its
    # module, which ran once): then d f / d W = sum_n delta_n a_n^T. Counting the parameter's
    # uses in the autograd graph finds weights also used elsewhere without computing any
    # parameter gradient (a numerical check against the batched gradient would hold K x P,
    # or at least P, extra numbers, more than a diagonal curvature itself).
    ok = dict.fromkeys(usable, True)
    for (m, _, _), p in zip(pnames, params, strict=True):
        if uses.get(id(p), 0) != 1:
            ok[m] = False
    traces = [
        _LinearTrace(
            module=m,
            inputs=acts[i],
            deltas=deltas[i],
            params=[(kind, f"{m}.{kind}" if m else kind) for kind in linears[m]],
            conv=modules[m] if isinstance(modules[m], nn.Conv2d) else None,
            output=None if backward else outs[i],
        )
        for i, m in enumerate(usable)
        if ok[m]
    ]
    return (f.detach() if backward else f), u, traces


def linear_output_traces(
    model: nn.Module, x: Tensor, subset: SubsetLike, *, convs: bool = False
) -> tuple[Tensor, dict[str, _LinearTrace]] | None:
    """(f (N, C) detached, module name -> trace) with every output's gradient at each layer:
    the traces' ``deltas`` are (C, N, out), row c the gradient of f_c with respect to the
    layer's output (cotangents the unit vectors e_c), ``inputs`` the layer's inputs a (N, in).

    One forward pass with hooks and C backward passes (:func:`_linear_traces`), no (N, C, P)
    Jacobian: the Jacobian of f_c with respect to a plain linear layer's weight is
    delta_c a^T and with respect to its bias delta_c. None (nothing to use) unless every
    parameter of the subset is on that route: a whole-tensor subset of plain ``nn.Linear``
    modules, each run once on (N, in) inputs, with unshared parameters that enter the graph of
    f once, and finite gradients (the generic path then reports the parameter of a NaN).
    ``convs``: plain ``nn.Conv2d`` modules are traced too (inputs (N, C_in, H, W), deltas
    (C, N, C_out, H_out, W_out)).
    """
    subset = resolve_subset(model, subset, subnetwork=True)
    if subset.indices is not None:
        return None
    check_eval_mode(model)
    linears = _hookable_linears(model, subset, convs=convs)
    covered = {f"{m}.{kind}" if m else kind for m, kinds in linears.items() for kind in kinds}
    if covered != set(subset.names):
        return None
    f, captured = _traced_forward(model, x, linears)
    eye = torch.eye(f.shape[1], dtype=f.dtype, device=f.device)
    f, _, traces = _traces_from(model, f, captured, linears, eye.expand(f.shape[0], -1, -1))
    if {name for tr in traces for _, name in tr.params} != set(subset.names):
        return None
    if deferring_on(f.device):  # an accelerator, inside a scope: recorded, no host read
        _record_finite_deltas(traces, subset, model)
    elif not all(bool(torch.isfinite(tr.deltas).all()) for tr in traces):
        return None
    return f, {tr.module: tr for tr in traces}


def _record_finite_deltas(
    traces: list[_LinearTrace], subset: ParameterSubset, model: nn.Module
) -> None:
    """Record (:func:`gaussify.deferred_checks.check_finite_values`) that every trace's
    output gradients are finite, from their largest |entry| (one ``_foreach_norm``), with the
    generic path's message for the layer's first parameter in the subset (its Jacobian is
    delta a^T, so a NaN or infinite delta makes it one)."""
    maxima = torch._foreach_norm([tr.deltas.detach() for tr in traces], float("inf"))
    index = [subset.names.index(tr.params[0][1]) for tr in traces]
    check_finite_values(
        maxima,
        lambda i, value: nonfinite_jacobian_message(subset, model, index[i], value_kind(value)),
    )


def traced_jvp(traces: dict[str, _LinearTrace], tangents: dict[str, Tensor]) -> Tensor:
    """J v (N, C) from :func:`linear_output_traces` traces covering the subset, for a tangent
    given per parameter name (shapes of the parameters): ``sum_layers delta_c . (dW a + db)``."""
    total: Tensor | int = 0
    for tr in traces.values():
        change = tr.deltas.new_zeros(tr.deltas.shape[1:])  # (N, out)
        for kind, name in tr.params:
            t = tangents[name].to(change.dtype)
            change = change + (tr.inputs @ t.mT if kind == "weight" else t)
        total = total + torch.einsum("cno,no->nc", tr.deltas, change)
    assert isinstance(total, Tensor)
    return total


def _graph_uses(f: Tensor) -> dict[int, int]:
    """{id(leaf tensor): number of edges into its AccumulateGrad node} over the autograd
    graph of ``f``: how many operations of the forward pass used each leaf (parameter)."""
    counts: dict[int, int] = {}
    if f.grad_fn is None:
        return counts
    seen = {f.grad_fn}
    stack = [f.grad_fn]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            variable = getattr(child, "variable", None)
            if variable is not None:  # AccumulateGrad: a leaf
                counts[id(variable)] = counts.get(id(variable), 0) + 1
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return counts


def _batched_output_grads(
    f: Tensor, inputs: list[Tensor], grad_outputs: Tensor, retain_graph: bool = False
) -> list[Tensor]:
    """Gradients of sum(grad_outputs[k] * f) with respect to ``inputs`` for every k, each
    stacked to (K, *input.shape) (see :func:`_output_grads`). Unused inputs get zeros."""
    per_k = list(_output_grads(f, inputs, grad_outputs, retain_graph))
    return [torch.stack([row[i] for row in per_k]) for i in range(len(inputs))]


def _output_grads(
    f: Tensor, inputs: list[Tensor], grad_outputs: Tensor, retain_graph: bool = False
) -> Iterator[list[Tensor]]:
    """For k = 1..K, the gradients of sum(grad_outputs[k] * f) with respect to ``inputs``
    (zeros for an unused one), one backward pass each (the graph is kept until the last).

    K plain backward passes, not one vmapped pass (``is_grads_batched``): torch's batching
    rules for pooling and activation backward kernels fall back to slow per-slice loops, and
    measured on the benchmark CNN and a 784-120-84-10 MLP (batch 32 / 256, 10 vectors, one
    thread) the loop takes 20 ms vs 44 ms and 2 ms vs 10 ms. A caller that consumes the
    gradients one k at a time holds one batch of them instead of K."""
    k = grad_outputs.shape[0]
    for j in range(k):
        grads = torch.autograd.grad(
            f,
            inputs,
            grad_outputs=grad_outputs[j],
            retain_graph=retain_graph or j < k - 1,
            allow_unused=True,
        )
        yield [
            g.detach() if g is not None else torch.zeros_like(t)
            for g, t in zip(grads, inputs, strict=True)
        ]
