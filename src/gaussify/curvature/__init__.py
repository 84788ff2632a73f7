"""Curvature of the log likelihood for Laplace-GGN posteriors (thesis Sec. 2.3, 3.1-3.4).

``make_curvature(structure, model, likelihood, subset)`` builds one of the registered
structures; each accumulates G = sum_n J_n^T Lambda_n J_n (GGN, eq. 2.24) or the empirical
Fisher batch by batch (``update``) and returns the posterior precision
``scale * G + diag(prior)`` (eq. 3.11) through ``posterior``. The registry maps a structure name
to the module that defines it; modules are imported only when asked for, so a structure whose
module is missing (e.g. ``"kron"`` before it exists) breaks nothing else. Users add their own
with :func:`register_curvature`.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch
from torch import nn

from gaussify.curvature.base import Curvature, GaussNewtonCurvature, PosteriorPrecision
from gaussify.curvature.jacobian import (
    SubsetLike,
    jacobians,
    jvp,
    model_outputs,
    per_sample_vjp,
    vjp,
)
from gaussify.curvature.subset import (
    ParameterSubset,
    check_prior,
    expand_prior,
    select_parameters,
)
from gaussify.likelihoods import Likelihood

__all__ = [
    "Curvature",
    "GaussNewtonCurvature",
    "ParameterSubset",
    "PosteriorPrecision",
    "available_structures",
    "check_prior",
    "expand_prior",
    "get_curvature_class",
    "jacobians",
    "jvp",
    "make_curvature",
    "model_outputs",
    "per_sample_vjp",
    "register_curvature",
    "select_parameters",
    "vjp",
]

#: structure name -> module path (imported lazily) or the class itself. The module must define
#: exactly one class whose ``structure`` class attribute equals the name.
_REGISTRY: dict[str, str | type] = {
    "full": "gaussify.curvature.full",
    "diag": "gaussify.curvature.diag",
    "lowrank": "gaussify.curvature.lowrank",
    "kron": "gaussify.curvature.kron",
}


def register_curvature(name: str, target: str | type) -> None:
    """Register a structure: ``target`` is a class or the path of a module defining one whose
    ``structure`` attribute equals ``name``. Re-registering a name replaces it."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    _REGISTRY[name] = target


def available_structures() -> list[str]:
    """Registered structure names (their modules may still fail to import)."""
    return sorted(_REGISTRY)


def get_curvature_class(structure: str) -> type:
    """The class registered for ``structure`` (importing its module on first use)."""
    if structure not in _REGISTRY:
        raise ValueError(
            f"structure: unknown curvature structure {structure!r}; "
            f"choose one of {available_structures()}"
        )
    target = _REGISTRY[structure]
    if isinstance(target, type):
        return target
    try:
        module = importlib.import_module(target)
    except ModuleNotFoundError as err:
        if err.name != target:
            raise
        raise ValueError(
            f"structure: {structure!r} is registered but its module {target} is not available"
        ) from err
    matches = [
        obj
        for obj in vars(module).values()
        if inspect.isclass(obj)
        and obj.__module__ == module.__name__
        and getattr(obj, "structure", None) == structure
    ]
    if len(matches) != 1:
        raise ValueError(
            f"structure: module {target} defines {len(matches)} classes with "
            f"structure = {structure!r}; expected exactly one"
        )
    _REGISTRY[structure] = matches[0]
    return matches[0]


def make_curvature(
    structure: str,
    model: nn.Module,
    likelihood: str | Likelihood,
    subset: SubsetLike = "all",
    *,
    ef: bool = False,
    mc_samples: int = 0,
    chunk_size: int | None = None,
    generator: torch.Generator | None = None,
    **options: Any,
) -> Curvature:
    """Build the curvature ``structure`` ("full", "diag", "lowrank", "kron", or a registered
    name) for ``model`` and ``likelihood`` over ``subset`` ("all", "last_layer", names).

    ``ef`` selects the empirical Fisher, ``mc_samples`` > 0 a Monte Carlo GGN with that many
    sampled labels per input, ``chunk_size`` bounds the samples per Jacobian chunk,
    ``generator`` seeds sampling; ``options`` go to the structure (e.g. ``rank`` for
    "lowrank", ``eig_cache`` for "full").
    """
    if not isinstance(structure, str):
        raise TypeError(f"structure: expected a string, got {type(structure).__name__}")
    cls = get_curvature_class(structure)
    return cls(
        model,
        likelihood,
        subset,
        ef=ef,
        mc_samples=mc_samples,
        chunk_size=chunk_size,
        generator=generator,
        **options,
    )
