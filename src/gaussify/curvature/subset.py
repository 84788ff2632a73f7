"""Parameter subsets: which weights the curvature and posterior cover.

``subset`` is ``"all"``, ``"last_layer"`` (the parameters of the last module, in registration
order, that owns parameters) or a list of names; a name selects a parameter
(``"3.weight"``) or every parameter of a module (``"3"``, ``"encoder.fc"``). Parameters outside
the subset stay fixed at their current values (a "subnetwork" Laplace). Ordering is always
``model.named_parameters()`` order, which is the flattening order of every posterior.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["ParameterSubset", "check_prior", "expand_prior", "select_parameters"]


@dataclass(frozen=True)
class ParameterSubset:
    """An ordered selection of a model's parameters, with flatten/unflatten helpers.

    ``names`` are full parameter names (``model.named_parameters()`` order), ``shapes`` their
    shapes; ``num_params`` is P, the length of the flattened vector.
    """

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(int(torch.Size(s).numel()) for s in self.shapes)

    @property
    def num_params(self) -> int:
        return sum(self.numels)

    def params(self, model: nn.Module) -> dict[str, Tensor]:
        """The current values of the selected parameters, detached, as a name -> tensor dict."""
        named = dict(model.named_parameters())
        return {n: named[n].detach() for n in self.names}

    def flatten(self, params: dict[str, Tensor]) -> Tensor:
        """Concatenate a name -> tensor dict into a (P,) vector (or (..., P) for batched leaves
        whose trailing dims match the parameter shapes)."""
        parts = []
        for n, s in zip(self.names, self.shapes, strict=True):
            t = params[n]
            lead = t.shape[: t.ndim - len(s)]
            parts.append(t.reshape(*lead, -1))
        return torch.cat(parts, dim=-1)

    def unflatten(self, vector: Tensor) -> dict[str, Tensor]:
        """Split a (..., P) vector into a name -> tensor dict with shapes (..., *shape)."""
        if vector.shape[-1] != self.num_params:
            raise ValueError(
                f"vector: expected last dimension {self.num_params}, got {vector.shape[-1]}"
            )
        lead = vector.shape[:-1]
        chunks = torch.split(vector, list(self.numels), dim=-1)
        return {
            n: c.reshape(*lead, *s) for n, c, s in zip(self.names, chunks, self.shapes, strict=True)
        }

    def module_of(self, name: str) -> str:
        """The module path that owns parameter ``name`` ("" for the root)."""
        return name.rpartition(".")[0]


def _last_layer_names(model: nn.Module) -> list[str]:
    last: str | None = None
    for mod_name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            last = mod_name
    if last is None:
        raise ValueError("model: has no parameters, so there is no last layer")
    prefix = f"{last}." if last else ""
    module = model.get_submodule(last)
    return [prefix + n for n, p in module.named_parameters(recurse=False) if p.requires_grad]


def select_parameters(model: nn.Module, subset: str | Sequence[str] = "all") -> ParameterSubset:
    """Resolve ``subset`` against ``model`` (see the module docstring for the accepted values)."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
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
        for key in subset:
            if key in named:
                chosen.add(key)
                continue
            hits = [n for n in named if n.startswith(f"{key}.")]
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


def expand_prior(prior_precision: float | Tensor, subset: ParameterSubset) -> Tensor:
    """Expand a prior precision to one value per parameter, shape (P,).

    Accepted granularities: a scalar, one value per parameter tensor of the subset
    (``len(subset.names)``, "per layer" as in laplace-torch), or one value per parameter (P,).
    Gradients flow through (marginal-likelihood tuning differentiates this).
    """
    prior = _as_tensor64(prior_precision)
    if prior.ndim == 0 or prior.numel() == 1:
        return prior.reshape(()).expand(subset.num_params)
    if prior.ndim != 1:
        raise ValueError(
            f"prior_precision: expected a scalar or a 1-D tensor, got shape {tuple(prior.shape)}"
        )
    if prior.numel() == len(subset.names):
        sizes = torch.tensor(subset.numels, device=prior.device)
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
