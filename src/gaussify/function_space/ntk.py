"""The (scaled) neural tangent kernel of the linearised network, k(x, x') = J(x) S0 J(x')^T.

A Gaussian prior N(0, S0) on the parameters of the linearised network (Immer thesis eq. 3.1)
makes its outputs a Gaussian process with covariance function k(x, x') = J(x) S0 J(x')^T
(thesis eq. 3.4; Ortega et al. 2024, VaLLA Sec. 2.1), a C x C block for every pair of inputs.
S0 = diag(prior precision)^-1 for a scalar, per-tensor or per-parameter prior precision.

Two routes compute the same kernel:

* **per-layer** (Ortega et al. 2024, App. E.3): for a plain ``nn.Linear`` layer z = W a + b,
  dz/dW for output c of sample x is delta_c(x) a(x)^T, so its contribution to the kernel is
  (delta_c(x) . delta_d(x')) (a(x) . a(x')) / prior_W (plus (delta_c(x) . delta_d(x')) /
  prior_b for the bias): only layer inputs a and output gradients delta, no P-sized vector.
  The inputs and output gradients come from one forward pass with hooks and one batched
  backward pass over the C outputs (``curvature.jacobian``'s per-layer machinery).
* **Jacobian**: per-sample Jacobians J (B, C, P) from ``torch.func`` for every other parameter
  (convolutions, normalisation layers, shared weights, per-parameter priors on a layer).

``route="auto"`` takes the per-layer route for each linear layer whose prior is constant over
each of its parameter tensors, and the Jacobian route for the rest; ``route="jacobian"`` forces
the Jacobian route everywhere (the reference the per-layer route is tested against).

Memory: the inputs are processed in blocks of rows of x1 and x2 whose per-sample factors
(Jacobian rows, or inputs and output gradients) fit an element budget, so at most two blocks
of factors exist at once besides the (N1, C, N2, C) result; the factors of x2 are kept across
blocks of x1 when they all fit the budget, and recomputed otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from gaussify.curvature.jacobian import (
    DEFAULT_CHUNK_ELEMENTS,
    SubsetLike,
    auto_chunk_size,
    check_eval_mode,
    chunk_slices,
    jacobians,
    model_outputs,
    resolve_subset,
)
from gaussify.curvature.layer_traces import _hookable_linears, _linear_traces
from gaussify.curvature.subset import ParameterSubset, check_prior, expand_prior
from gaussify.validation import check_count, check_inputs

__all__ = ["Route", "ntk", "ntk_components", "ntk_diag", "per_layer_modules", "prior_scales"]

Route = Literal["auto", "jacobian"]
_ROUTES = ("auto", "jacobian")


# ---------------------------------------------------------------------- prior handling
def prior_scales(prior_precision: float | Tensor, subset: ParameterSubset) -> dict[str, Tensor]:
    """The prior variance S0 per parameter tensor: name -> 0-d tensor where the precision is
    constant over the tensor (scalar or per-tensor priors), else name -> (numel,) variances.
    Differentiable in ``prior_precision``."""
    check_prior(prior_precision)
    vec = expand_prior(prior_precision, subset)
    scales: dict[str, Tensor] = {}
    for name, seg in zip(subset.names, torch.split(vec, list(subset.numels)), strict=True):
        scales[name] = 1.0 / seg[0] if bool((seg == seg[0]).all()) else 1.0 / seg
    return scales


def _check_route(route: str) -> None:
    if route not in _ROUTES:
        raise ValueError(f"route: expected one of {_ROUTES}, got {route!r}")


def per_layer_modules(
    model: nn.Module, subset: SubsetLike = "all", prior_precision: float | Tensor = 1.0
) -> list[str]:
    """Names of the ``nn.Linear`` modules eligible for the per-layer route (plain linear layers
    owning subset parameters, not shared with other modules, with a prior constant over each
    of their parameter tensors). A layer that turns out not to be traceable on some input
    (e.g. it sees 3-D inputs) still falls back to the Jacobian route at run time."""
    subset = resolve_subset(model, subset)
    scales = prior_scales(prior_precision, subset)
    linears = _hookable_linears(model, subset)
    return [
        m
        for m, kinds in linears.items()
        if all(scales[f"{m}.{k}" if m else k].ndim == 0 for k in kinds)
    ]


# ---------------------------------------------------------------------- per-block factors
@dataclass
class _Factors:
    """Per-sample factors of one block of B inputs: for traced linear layers their inputs
    a (B, D_in) and output gradients delta (B, C, D_out); for every other parameter tensor
    its Jacobian columns (B, C, numel)."""

    linear: dict[str, tuple[Tensor, Tensor, list[tuple[str, str]]]] = field(default_factory=dict)
    jac: dict[str, Tensor] = field(default_factory=dict)
    outputs: Tensor | None = None

    def dense(self, name: str, module: str | None) -> Tensor:
        """The Jacobian columns of parameter ``name`` (B, C, numel), formed from the per-layer
        factors if the parameter is traced."""
        if name in self.jac:
            return self.jac[name]
        assert module is not None
        a, delta, params = self.linear[module]
        kind = dict((n, k) for k, n in params)[name]
        if kind == "weight":
            return (delta.unsqueeze(-1) * a[:, None, None, :]).flatten(2)
        return delta


class _KernelPlan:
    """Which route each parameter tensor takes, and the per-block factor computation."""

    def __init__(
        self,
        model: nn.Module,
        subset: ParameterSubset,
        scales: dict[str, Tensor],
        route: Route,
        chunk_size: int | None,
    ) -> None:
        _check_route(route)
        if chunk_size is not None:
            chunk_size = check_count(chunk_size, "chunk_size")
        check_eval_mode(model)
        dtype = dict(model.named_parameters())[subset.names[0]].dtype
        # a float32 model gets a float32 kernel even though Python-number priors arrive in
        # float64 (the cast is differentiable)
        self.scales = {n: s.to(dtype) for n, s in scales.items()}
        self.model, self.subset, self.dtype = model, subset, dtype
        self.num_outputs: int | None = None
        linears = _hookable_linears(model, subset) if route == "auto" else {}
        self.linears = {
            m: kinds
            for m, kinds in linears.items()
            if all(self.scales[self._full(m, k)].ndim == 0 for k in kinds)
        }
        self.module_of = {self._full(m, k): m for m, kinds in self.linears.items() for k in kinds}
        self.chunk_size = chunk_size

    @staticmethod
    def _full(module: str, kind: str) -> str:
        return f"{module}.{kind}" if module else kind

    def per_sample_elements(self, num_outputs: int) -> int:
        """Elements of the factors of one sample (to size blocks by the budget)."""
        named = dict(self.model.named_parameters())
        rest = sum(
            named[n].numel() for n in self.subset.names if n not in self.module_of
        )  # Jacobian columns
        layer = sum(
            self.model.get_submodule(m).in_features
            + num_outputs * self.model.get_submodule(m).out_features
            for m in self.linears
        )
        return max(1, num_outputs * rest + layer)

    def factors(self, x: Tensor) -> _Factors:
        out = _Factors()
        done: set[str] = set()
        if self.linears:
            c = self.outputs_of(x)
            eye = torch.eye(c, dtype=self.dtype, device=x.device)
            u = eye.expand(x.shape[0], c, c)
            f, _, traces = _linear_traces(self.model, x, self.linears, u)
            out.outputs = f
            for tr in traces:
                delta = tr.deltas.permute(1, 0, 2)  # (B, C, D_out)
                out.linear[tr.module] = (tr.inputs, delta, tr.params)
                done.update(name for _, name in tr.params)
        rest = [n for n in self.subset.names if n not in done]
        if rest:
            named = dict(self.model.named_parameters())
            sub = ParameterSubset(names=tuple(rest), shapes=tuple(named[n].shape for n in rest))
            jac = jacobians(self.model, x, sub, chunk_size=x.shape[0])
            for name, part in zip(rest, torch.split(jac, list(sub.numels), dim=-1), strict=True):
                out.jac[name] = part
        # parameters traced on the per-layer route are looked up through their module
        for name in self.subset.names:
            if name not in out.jac and self.module_of.get(name) not in out.linear:
                raise RuntimeError(f"internal: no factors for parameter {name!r}")
        return out

    def outputs_of(self, x: Tensor) -> int:
        """C, from one forward pass on the first input (once per plan)."""
        if self.num_outputs is None:
            self.num_outputs = int(model_outputs(self.model, x[:1]).shape[1])
        return self.num_outputs

    def _scaled(self, name: str, jac: Tensor) -> Tensor:
        return jac * self.scales[name]

    def cross(self, fa: _Factors, fb: _Factors, groups: dict[str, int], num_groups: int) -> Tensor:
        """Kernel blocks (G, Ba, C, Bb, C) between two factor blocks, one per group."""
        ba = _block_len(fa)
        bb = _block_len(fb)
        c = _num_outputs(fa)
        out = torch.zeros(num_groups, ba, c, bb, c, dtype=self.dtype, device=_device(fa))
        handled: set[str] = set()
        # per-layer route: both blocks traced this module
        for module in self.linears:
            if module in fa.linear and module in fb.linear:
                a1, d1, params = fa.linear[module]
                a2, d2, _ = fb.linear[module]
                dd = torch.einsum("aci,bdi->acbd", d1, d2)
                for kind, name in params:
                    s = self.scales[name]
                    term = dd * (a1 @ a2.T)[:, None, :, None] if kind == "weight" else dd
                    out[groups[name]] += term * s
                    handled.add(name)
        # Jacobian route for the rest (or where one side could not be traced)
        for name in self.subset.names:
            if name in handled:
                continue
            module = self.module_of.get(name)
            ja = fa.dense(name, module)
            jb = fb.dense(name, module)
            ja_s = self._scaled(name, ja)
            out[groups[name]] += (ja_s.reshape(ba * c, -1) @ jb.reshape(bb * c, -1).T).reshape(
                ba, c, bb, c
            )
        return out

    def diag(self, fa: _Factors, groups: dict[str, int], num_groups: int) -> Tensor:
        """Per-sample kernel blocks (G, B, C, C)."""
        b = _block_len(fa)
        c = _num_outputs(fa)
        out = torch.zeros(num_groups, b, c, c, dtype=self.dtype, device=_device(fa))
        handled: set[str] = set()
        for module in self.linears:
            if module in fa.linear:
                a, d, params = fa.linear[module]
                dd = torch.einsum("aci,adi->acd", d, d)
                for kind, name in params:
                    term = dd * a.square().sum(-1)[:, None, None] if kind == "weight" else dd
                    out[groups[name]] += term * self.scales[name]
                    handled.add(name)
        for name in self.subset.names:
            if name in handled:
                continue
            j = fa.dense(name, self.module_of.get(name))
            out[groups[name]] += torch.einsum("acp,adp->acd", self._scaled(name, j), j)
        return out


def _block_len(f: _Factors) -> int:
    if f.jac:
        return next(iter(f.jac.values())).shape[0]
    return next(iter(f.linear.values()))[0].shape[0]


def _num_outputs(f: _Factors) -> int:
    if f.jac:
        return next(iter(f.jac.values())).shape[1]
    return next(iter(f.linear.values()))[1].shape[1]


def _device(f: _Factors) -> torch.device:
    if f.jac:
        return next(iter(f.jac.values())).device
    return next(iter(f.linear.values()))[0].device


# ---------------------------------------------------------------------- public functions
def _check_inputs(x: Tensor, what: str, model: nn.Module | None = None) -> None:
    """The shared boundary checks (:func:`gaussify.validation.check_inputs`): a non-empty,
    finite tensor of the model's dtype and first-layer width."""
    check_inputs(x, model, what)


def _groups_index(
    subset: ParameterSubset, groups: Sequence[Sequence[str]] | None
) -> tuple[dict[str, int], int]:
    if groups is None:
        return dict.fromkeys(subset.names, 0), 1
    index: dict[str, int] = {}
    for g, names in enumerate(groups):
        for name in names:
            if name not in subset.names:
                raise ValueError(f"groups: {name!r} is not a parameter of the subset")
            if name in index:
                raise ValueError(f"groups: parameter {name!r} appears in more than one group")
            index[name] = g
    missing = [n for n in subset.names if n not in index]
    if missing:
        raise ValueError(f"groups: parameters {missing} are in no group")
    return index, len(groups)


def _kernel(
    model: nn.Module,
    x1: Tensor,
    x2: Tensor | None,
    subset: SubsetLike,
    scales_or_prior: dict[str, Tensor] | float | Tensor,
    groups: Sequence[Sequence[str]] | None,
    chunk_size: int | None,
    route: Route,
) -> Tensor:
    """(G, N1, C, N2, C) kernels, blocked over rows of x1 and x2."""
    subset = resolve_subset(model, subset)
    _check_inputs(x1, "x1", model)
    if x2 is not None:
        _check_inputs(x2, "x2", model)
        if x2.shape[1:] != x1.shape[1:]:
            raise ValueError(
                f"x2: inputs must have the same per-sample shape as x1 {tuple(x1.shape[1:])}, "
                f"got {tuple(x2.shape[1:])}"
            )
    scales = (
        scales_or_prior
        if isinstance(scales_or_prior, dict)
        else prior_scales(scales_or_prior, subset)
    )
    plan = _KernelPlan(model, subset, scales, route, chunk_size)
    index, num_groups = _groups_index(subset, groups)
    c = plan.outputs_of(x1)
    per_sample = plan.per_sample_elements(c)
    chunk = auto_chunk_size(x1.shape[0], per_sample, chunk_size)
    if chunk_size is None:
        # a block pair (B, C, B, C) and its temporaries also stay within the budget
        chunk = min(chunk, max(1, math.isqrt(DEFAULT_CHUNK_ELEMENTS) // c))
    symmetric = x2 is None
    xb = x1 if x2 is None else x2
    n1, n2 = x1.shape[0], xb.shape[0]
    # keep the factors of x2 when they all fit the budget, else recompute them per block
    cache_b = n2 * per_sample <= DEFAULT_CHUNK_ELEMENTS or (
        chunk_size is not None and n2 <= chunk_size
    )
    slices_b = list(chunk_slices(n2, chunk))
    cached: dict[int, _Factors] = {}

    def factors_b(j: int) -> _Factors:
        if j in cached:
            return cached[j]
        fb = plan.factors(xb[slices_b[j]])
        if cache_b:
            cached[j] = fb
        return fb

    out: Tensor | None = None
    for i, sa in enumerate(chunk_slices(n1, chunk)):
        fa = factors_b(i) if symmetric else plan.factors(x1[sa])
        for j, sb in enumerate(slices_b):
            if symmetric and j < i:
                continue  # filled from the transposed block
            fb = fa if symmetric and j == i else factors_b(j)
            block = plan.cross(fa, fb, index, num_groups)
            if out is None:
                out = torch.zeros(num_groups, n1, c, n2, c, dtype=block.dtype, device=block.device)
            out[:, sa, :, sb, :] = block
            if symmetric and j > i:
                out[:, sb, :, sa, :] = block.permute(0, 3, 4, 1, 2)
    assert out is not None
    return out


def ntk(
    model: nn.Module,
    x1: Tensor,
    x2: Tensor | None = None,
    subset: SubsetLike = "all",
    prior_precision: float | Tensor = 1.0,
    chunk_size: int | None = None,
    *,
    route: Route = "auto",
) -> Tensor:
    """The kernel k(x1_n, x2_m) = J(x1_n) S0 J(x2_m)^T of the linearised network, shape
    (N1, C, N2, C) (``x2=None``: the symmetric kernel of x1 with itself, computed once per
    block pair).

    Immer thesis eq. 3.4 (Ortega et al. 2024, VaLLA eq. 5 and App. E.3 for the per-layer
    route). ``prior_precision``: a scalar, one value per parameter tensor of the subset, or
    one per parameter; S0 is its inverse, differentiable. ``chunk_size`` sets the rows per
    block (default: an element budget on the per-sample factors); ``route``: "auto" (per-layer
    for eligible ``nn.Linear`` layers, Jacobians for the rest) or "jacobian".
    """
    return _kernel(model, x1, x2, subset, prior_precision, None, chunk_size, route)[0]


def ntk_components(
    model: nn.Module,
    x1: Tensor,
    x2: Tensor | None = None,
    subset: SubsetLike = "all",
    groups: Sequence[Sequence[str]] | None = None,
    chunk_size: int | None = None,
    *,
    route: Route = "auto",
) -> Tensor:
    """Unit-prior kernels of groups of parameter tensors, (G, N1, C, N2, C):
    component g is sum over tensors t in ``groups[g]`` of J_t(x1) J_t(x2)^T, so that the kernel
    with a prior precision delta_g constant on each group is sum_g component_g / delta_g
    (what marginal-likelihood tuning of per-layer priors differentiates). ``groups=None``:
    one group holding the whole subset."""
    subset = resolve_subset(model, subset)
    dtype = dict(model.named_parameters())[subset.names[0]].dtype
    unit = {n: torch.ones((), dtype=dtype) for n in subset.names}
    return _kernel(model, x1, x2, subset, unit, groups, chunk_size, route)


def ntk_diag(
    model: nn.Module,
    x: Tensor,
    subset: SubsetLike = "all",
    prior_precision: float | Tensor = 1.0,
    chunk_size: int | None = None,
    *,
    route: Route = "auto",
) -> Tensor:
    """The per-sample kernel blocks k(x_n, x_n) = J(x_n) S0 J(x_n)^T, shape (N, C, C): the
    prior function covariance at each input (thesis eq. 3.4), in blocks of rows."""
    subset = resolve_subset(model, subset)
    _check_inputs(x, "x", model)
    plan = _KernelPlan(model, subset, prior_scales(prior_precision, subset), route, chunk_size)
    index, _ = _groups_index(subset, None)
    c = plan.outputs_of(x)
    chunk = auto_chunk_size(x.shape[0], plan.per_sample_elements(c), chunk_size)
    blocks = [plan.diag(plan.factors(x[sl]), index, 1)[0] for sl in chunk_slices(x.shape[0], chunk)]
    return torch.cat(blocks)
