"""Parameter subsets: which weights the curvature and posterior cover.

``subset`` is ``"all"``, ``"last_layer"`` (the parameters of the last module, in registration
order, that owns parameters) or a list of names; a name selects a parameter
(``"3.weight"``) or every parameter of a module (``"3"``, ``"encoder.fc"``). Parameters outside
the subset stay fixed at their current values. Ordering is always
``model.named_parameters()`` order, which is the flattening order of every posterior.

Where enabled (``subnetwork=True``: the Jacobian-based curvatures and ``gs.Laplace``),
``subset`` may also be a *subnetwork* of individual weights (subnetwork inference, Daxberger
et al. 2021): a boolean mask with one entry per trainable parameter, or an integer tensor of
indices, both into the vector of every parameter with ``requires_grad`` flattened in
``named_parameters()`` order (laplace-torch's ``subnetwork_indices``). It resolves to the
parameter tensors that contain selected weights (the *support*) plus ``indices``, the sorted
positions of the selected weights in the support's flattened vector; every other weight stays
at its current value (a point mass at the MAP). A mask that covers whole tensors resolves to
the plain tensor subset.

Tied parameters (one tensor registered under several names, e.g. ``head.weight =
emb.weight``) are one parameter, counted once as ``model.parameters()`` does, under their
first name in registration order (the *canonical* name ``named_parameters()`` yields);
:func:`tied_parameters` gives the mapping. Selecting any of a tied tensor's names (or a module
that uses it) selects the canonical name; Jacobians are taken through ``functional_call``,
which keeps the tie, so a column of J is the sum of the contributions of every use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = [
    "ParameterSubset",
    "check_prior",
    "expand_prior",
    "require_whole_tensors",
    "select_parameters",
    "tied_parameters",
]


@dataclass(frozen=True, eq=False)
class ParameterSubset:
    """An ordered selection of a model's parameters, with flatten/unflatten helpers.

    ``names`` are full parameter names (``model.named_parameters()`` order), ``shapes`` their
    shapes; ``num_params`` is P, the length of the flattened vector. ``indices`` (a subnetwork,
    optional): sorted positions, into the concatenation of the named tensors, of the weights
    the vector holds; None means every entry of every named tensor.
    """

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    indices: Tensor | None = None

    def __post_init__(self) -> None:
        idx = self.indices
        if idx is None:
            return
        width = sum(self.numels)
        if (
            not isinstance(idx, Tensor)
            or idx.dtype != torch.long
            or idx.ndim != 1
            or idx.numel() == 0
            or int(idx.min()) < 0
            or int(idx.max()) >= width
            or not bool((idx[1:] > idx[:-1]).all())
        ):
            raise ValueError(
                f"indices: expected a non-empty, strictly increasing 1-D LongTensor of positions "
                f"in [0, {width}), got {idx!r}"
            )

    @property
    def numels(self) -> tuple[int, ...]:
        """Elements of each named tensor."""
        return tuple(int(torch.Size(s).numel()) for s in self.shapes)

    @property
    def counts(self) -> tuple[int, ...]:
        """Entries of each named tensor in the flattened vector (``numels`` unless this is a
        subnetwork); splitting a (P,) vector by them gives one chunk per tensor."""
        if self.indices is None:
            return self.numels
        ends = torch.tensor(self.numels).cumsum(0)
        owner = torch.searchsorted(ends, self.indices.cpu(), right=True)
        return tuple(int(c) for c in torch.bincount(owner, minlength=len(self.names)))

    @property
    def num_params(self) -> int:
        return sum(self.numels) if self.indices is None else int(self.indices.numel())

    @property
    def support(self) -> ParameterSubset:
        """The whole named tensors (the subset itself unless it is a subnetwork)."""
        if self.indices is None:
            return self
        return ParameterSubset(names=self.names, shapes=self.shapes)

    def gather(self, block: Tensor) -> Tensor:
        """The subnetwork's columns (..., P) of a block (..., P_support) over the support
        (e.g. Jacobians or gradients of the named tensors); the block itself otherwise."""
        if self.indices is None:
            return block
        return block.index_select(-1, self.indices.to(block.device))

    def params(self, model: nn.Module) -> dict[str, Tensor]:
        """The current values of the selected parameters, detached, as a name -> tensor dict."""
        named = dict(model.named_parameters())
        return {n: named[n].detach() for n in self.names}

    def flatten(self, params: dict[str, Tensor]) -> Tensor:
        """Concatenate a name -> tensor dict into a (P,) vector (or (..., P) for batched leaves
        whose trailing dims match the parameter shapes); a subnetwork keeps its entries."""
        parts = []
        for n, s in zip(self.names, self.shapes, strict=True):
            t = params[n]
            lead = t.shape[: t.ndim - len(s)]
            parts.append(t.reshape(*lead, -1))
        return self.gather(torch.cat(parts, dim=-1))

    def unflatten(self, vector: Tensor, base: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """Split a (..., P) vector into a name -> tensor dict with shapes (..., *shape).

        For a subnetwork the entries outside it come from ``base`` (name -> tensor of the
        full shape, e.g. ``self.params(model)`` to place weight samples in the MAP network),
        or are 0 when ``base`` is None (a direction, e.g. the tangent of a Jacobian-vector
        product). ``base`` is not used otherwise.
        """
        if vector.shape[-1] != self.num_params:
            raise ValueError(
                f"vector: expected last dimension {self.num_params}, got {vector.shape[-1]}"
            )
        lead = vector.shape[:-1]
        if self.indices is not None:
            width = sum(self.numels)
            if base is None:
                full = vector.new_zeros(*lead, width)
            else:
                full = self.support.flatten(base).to(vector).expand(*lead, width)
            vector = full.index_copy(-1, self.indices.to(vector.device), vector)
        chunks = torch.split(vector, list(self.numels), dim=-1)
        return {
            n: c.reshape(*lead, *s) for n, c, s in zip(self.names, chunks, self.shapes, strict=True)
        }

    def module_of(self, name: str) -> str:
        """The module path that owns parameter ``name`` ("" for the root)."""
        return name.rpartition(".")[0]


def _canonical_names(model: nn.Module) -> dict[str, str]:
    """Every name of every parameter (``named_parameters(remove_duplicate=False)``) -> the
    canonical (first) name of its tensor."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(param), name)
    return out


def tied_parameters(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Canonical name -> every name (canonical first) of each parameter tensor that the model
    registers under more than one name (weight tying); empty when nothing is tied."""
    groups: dict[str, list[str]] = {}
    for name, canonical in _canonical_names(model).items():
        groups.setdefault(canonical, []).append(name)
    return {c: tuple(names) for c, names in groups.items() if len(names) > 1}


def _last_layer_names(model: nn.Module) -> list[str]:
    last: str | None = None
    for mod_name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            last = mod_name
    if last is None:
        raise ValueError("model: has no parameters, so there is no last layer")
    prefix = f"{last}." if last else ""
    module = model.get_submodule(last)
    canonical = _canonical_names(model)
    return [
        canonical[prefix + n]
        for n, p in module.named_parameters(recurse=False, remove_duplicate=False)
        if p.requires_grad
    ]


def select_parameters(
    model: nn.Module, subset: str | Sequence[str] | Tensor = "all", *, subnetwork: bool = False
) -> ParameterSubset:
    """Resolve ``subset`` against ``model`` (see the module docstring for the accepted values;
    a mask or index tensor only with ``subnetwork=True``)."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if isinstance(subset, Tensor):
        if not subnetwork:
            raise ValueError(
                "subset: a subnetwork (a mask or indices over individual weights) is supported "
                "by gs.Laplace and the full / diag / lowrank curvatures; here pass 'all', "
                "'last_layer' or a list of parameter/module names"
            )
        return _subnetwork(named, subset)
    if isinstance(subset, str):
        if subset == "all":
            chosen = set(named)
        elif subset == "last_layer":
            chosen = set(_last_layer_names(model))
        else:
            raise ValueError(
                f"subset: expected 'all', 'last_layer' or a list of parameter/module names, "
                f"got {subset!r}"
            )
    else:
        chosen = set()
        canonical = _canonical_names(model)
        for key in subset:
            if not isinstance(key, str):
                raise TypeError(
                    f"subset: names must be strings, got {key!r} ({type(key).__name__}); pass "
                    "a subnetwork of individual weights as a torch tensor of indices or a mask"
                )
            if key in named:
                chosen.add(key)
                continue
            if canonical.get(key) in named:  # another name of a tied tensor
                chosen.add(canonical[key])
                continue
            hits = [c for n, c in canonical.items() if c in named and n.startswith(f"{key}.")]
            if not hits:
                raise ValueError(
                    f"subset: {key!r} names no trainable parameter or module; "
                    f"parameters are {sorted(named)}"
                )
            chosen.update(hits)
    names = tuple(n for n in named if n in chosen)
    if not names:
        raise ValueError(f"subset: {subset!r} selects no trainable parameters of the model")
    return ParameterSubset(names=names, shapes=tuple(named[n].shape for n in names))


def _subnetwork(named: dict[str, Tensor], spec: Tensor) -> ParameterSubset:
    """A subnetwork from a boolean mask (P_all,) or integer indices into the vector of all
    trainable parameters (``named``, in order); validated, sorted, reduced to its support."""
    names_all = list(named)
    sizes = torch.tensor([named[n].numel() for n in names_all], dtype=torch.long)
    total = int(sizes.sum())
    where = "the trainable parameters flattened in named_parameters() order"
    if spec.dtype == torch.bool:
        if spec.ndim != 1 or spec.numel() != total:
            raise ValueError(
                f"subset: a boolean mask needs one entry per trainable parameter, shape "
                f"({total},) ({where}), got shape {tuple(spec.shape)}"
            )
        idx = spec.detach().cpu().nonzero().flatten()
    elif spec.is_floating_point() or spec.is_complex():
        raise TypeError(
            f"subset: a subnetwork is a boolean mask or an integer tensor of indices, got "
            f"dtype {spec.dtype}"
        )
    else:
        if spec.ndim != 1:
            raise ValueError(
                f"subset: subnetwork indices must be a 1-D tensor, got shape {tuple(spec.shape)}"
            )
        idx = spec.detach().cpu().long()
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= total):
            raise ValueError(
                f"subset: subnetwork indices must lie in [0, {total}) ({where}), got values "
                f"from {int(idx.min())} to {int(idx.max())}"
            )
        idx = idx.sort().values
        repeated = idx[1:][idx[1:] == idx[:-1]]
        if repeated.numel():
            raise ValueError(
                f"subset: subnetwork indices must be unique, got {int(repeated[0])} more than once"
            )
    if idx.numel() == 0:
        raise ValueError("subset: the subnetwork is empty (the mask or indices select no weight)")
    ends = sizes.cumsum(0)
    owner = torch.searchsorted(ends, idx, right=True)
    keep = owner.unique()
    counts = torch.bincount(owner, minlength=len(names_all))
    names = tuple(names_all[i] for i in keep.tolist())
    shapes = tuple(named[n].shape for n in names)
    if bool((counts[keep] == sizes[keep]).all()):
        return ParameterSubset(names=names, shapes=shapes)  # whole tensors: a plain subset
    # position of each tensor's first entry in the support's concatenated vector
    support_start = torch.zeros(len(names_all), dtype=torch.long)
    support_start[keep] = torch.cat([torch.zeros(1, dtype=torch.long), sizes[keep].cumsum(0)])[:-1]
    local = idx - (ends - sizes)[owner] + support_start[owner]
    return ParameterSubset(names=names, shapes=shapes, indices=local)


def require_whole_tensors(subset: ParameterSubset, what: str) -> None:
    """Raise a ``ValueError`` naming ``subset`` when it is a subnetwork of individual weights
    and ``what`` (e.g. a curvature structure) needs whole parameter tensors."""
    if subset.indices is not None:
        raise ValueError(
            f"subset: {what} needs whole parameter tensors, but the subset is a subnetwork of "
            f"{subset.num_params} individual weights; select whole tensors by name, or use "
            "gs.Laplace with structure 'full' (the subnetwork-inference choice), 'diag' or "
            "'lowrank'"
        )


def expand_prior(prior_precision: float | Tensor, subset: ParameterSubset) -> Tensor:
    """Expand a prior precision to one value per parameter, shape (P,).

    Accepted granularities: a scalar, one value per parameter tensor of the subset
    (``len(subset.names)``, "per layer" as in laplace-torch; for a subnetwork it applies to
    the tensor's selected weights), or one value per parameter (P,). Gradients flow through
    (marginal-likelihood tuning differentiates this).
    """
    prior = _as_tensor64(prior_precision)
    if prior.ndim == 0 or prior.numel() == 1:
        return prior.reshape(()).expand(subset.num_params)
    if prior.ndim != 1:
        raise ValueError(
            f"prior_precision: expected a scalar or a 1-D tensor, got shape {tuple(prior.shape)}"
        )
    if prior.numel() == len(subset.names):
        sizes = torch.tensor(subset.counts, device=prior.device)
        return prior.repeat_interleave(sizes)
    if prior.numel() == subset.num_params:
        return prior
    raise ValueError(
        f"prior_precision: expected a scalar, {len(subset.names)} values (one per parameter "
        f"tensor) or {subset.num_params} values (one per parameter), got {prior.numel()}"
    )


def check_prior(prior_precision: float | Tensor) -> Tensor:
    """Validate that a prior precision is finite and strictly positive; return it as a tensor."""
    prior = _as_tensor64(prior_precision)
    if not torch.isfinite(prior).all() or (prior <= 0).any():
        raise ValueError(f"prior_precision: must be finite and > 0, got {prior}")
    return prior


def _as_tensor64(value: float | Tensor) -> Tensor:
    """Tensors pass through; Python numbers become float64 so no precision is lost on the way
    to a float64 model (a float32 model casts them down where they are used)."""
    return value if isinstance(value, Tensor) else torch.as_tensor(value, dtype=torch.float64)
