"""Which modules KFAC factorises, and how a module's parameters map onto a Kronecker block.

A block is a matrix ``(out, d)``: the weight reshaped ``(out, in)`` and, last, the bias column
(see :mod:`gaussify.curvature.kron`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from gaussify.curvature.subset import ParameterSubset

_SUPPORTED = (nn.Linear, nn.Conv2d)


@dataclass(frozen=True)
class _Layer:
    """One supported module whose parameters (weight and/or bias) are in the subset."""

    path: str
    weight: str | None  # full parameter name, or None if not in the subset
    bias: str | None
    in_features: int  # columns of the weight matrix (C_in * kh * kw for Conv2d)
    out_features: int

    @property
    def a_dim(self) -> int:
        return (self.in_features if self.weight else 0) + (1 if self.bias else 0)


def _display(path: str) -> str:
    return repr(path) if path else "'' (the model itself)"


def _build_layers(model: nn.Module, subset: ParameterSubset) -> list[_Layer]:
    """Group the subset's parameters by owning module and check that KFAC supports each one."""
    by_module: dict[str, dict[str, str]] = {}
    for name in subset.names:
        path, _, leaf = name.rpartition(".")
        by_module.setdefault(path, {})[leaf] = name
    layers = []
    for path, leaves in by_module.items():
        module = model.get_submodule(path)
        if not isinstance(module, _SUPPORTED):
            raise ValueError(
                f"kron: parameter(s) {sorted(leaves.values())} belong to module "
                f"{_display(path)} of type {type(module).__name__}, which Kronecker-factored "
                "(KFAC) curvature does not support (supported: nn.Linear, nn.Conv2d); "
                "use structure='full', 'diag' or 'lowrank', which support any module, or "
                "leave this module out of the subset"
            )
        unknown = set(leaves) - {"weight", "bias"}
        if unknown:
            raise ValueError(
                f"kron: module {_display(path)} ({type(module).__name__}) has parameters "
                f"{sorted(unknown)} besides weight/bias, which KFAC does not support"
            )
        if isinstance(module, nn.Conv2d):
            if module.groups != 1:
                raise ValueError(
                    f"kron: Conv2d module {_display(path)} has groups={module.groups}; "
                    "KFAC supports groups=1 only (use structure='full', 'diag' or 'lowrank')"
                )
            in_features = module.in_channels * math.prod(module.kernel_size)
            out_features = module.out_channels
        else:
            in_features, out_features = module.in_features, module.out_features
        layers.append(
            _Layer(path, leaves.get("weight"), leaves.get("bias"), in_features, out_features)
        )
    return layers


def _columns(ly: _Layer, names: list[str]) -> tuple[str, ...]:
    """A block's columns, in order: "weight" (the weight's ``in`` columns), "bias" (the last)."""
    return tuple("weight" if name == ly.weight else "bias" for name in names)


def _subset_offsets(subset: ParameterSubset) -> dict[str, int]:
    offsets, pos = {}, 0
    for name, numel in zip(subset.names, subset.numels, strict=True):
        offsets[name] = pos
        pos += numel
    return offsets
