"""Kernel factors at VaLLA's fixed inducing inputs, kept between steps (the "ntk" route).

With the inducing inputs Z and the weights theta* fixed, everything on the Z side of the
linearised kernel k(z, x) = J(z) P0^-1 J(x)^T is the same at every step; only the minibatch
side and the prior precision change. For a plain linear layer z = W a + b (VaLLA App. E.3,
eq. 70-73) the Jacobian of output c at input z with respect to W is delta_c(z) a(z)^T, so

    k_g(u, x)[d] = sum_{layers l in g} (delta_u . delta_d(x)) (a_u . a(x) + [bias in g])

for an inducing value u = f_{c_u}(z_u) with output gradient delta_u = delta_{c_u}(z_u) and
layer input a_u = a(z_u). Cached here, once: a_u and delta_u of each traced layer, for the
D kept inducing values only (M pairs, or all M C outputs), and the Jacobian columns of the
kept rows for every other parameter tensor. A step then needs the factors of its minibatch
(one forward pass and one batched backward pass over the C outputs, shared by K_{Z x} and the
per-sample blocks k(x_n, x_n)) and products of size D x B x C.

The kernels are returned as unit-prior components, one per prior group g (a group shares
one prior value delta_g), so that K = sum_g K_g / delta_g: a learned prior enters only through
that weighted sum and its gradient needs no pass through the factors. The components are
constants (no autograd graph); they equal :func:`gaussify.function_space.ntk.ntk_components`
restricted to the kept rows (float64 oracle in the tests).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from gaussify.curvature.jacobian import chunk_slices
from gaussify.curvature.subset import ParameterSubset
from gaussify.function_space.ntk import _Factors, _KernelPlan

__all__ = ["InducingFactors"]


class InducingFactors:
    """Factors of the D kept inducing values at fixed inducing inputs ``z (M, ...)``.

    ``rows``: the kept rows m C + c_m of the all-outputs kernel (None: all M C).
    ``groups``: parameter names per prior group (one group: a scalar prior).
    ``chunk_size``: inducing inputs per block while the factors are formed.
    """

    def __init__(
        self,
        model: nn.Module,
        subset: ParameterSubset,
        z: Tensor,
        rows: Tensor | None,
        groups: Sequence[Sequence[str]],
        chunk_size: int = 256,
    ) -> None:
        first = dict(model.named_parameters())[subset.names[0]]
        unit = {n: torch.ones((), dtype=first.dtype, device=first.device) for n in subset.names}
        self.plan = _KernelPlan(model, subset, unit, "auto", None)
        self.subset = subset
        self.group_of = {name: g for g, names in enumerate(groups) for name in names}
        self.num_groups = len(groups)
        z = z.detach()
        c = self.plan.outputs_of(z)
        self.num_outputs = c
        keep = torch.arange(z.shape[0] * c, device=z.device) if rows is None else rows
        self.num_values = int(keep.shape[0])
        # per traced module: (a (D, D_in), delta (D, D_out)); per other tensor: J (D, numel)
        layer_parts: dict[str, list[tuple[Tensor, Tensor]]] = {}
        dense_parts: dict[str, list[Tensor]] = {}
        self._params: dict[str, list[tuple[str, str]]] = {}
        self.device = z.device
        for sl in chunk_slices(z.shape[0], chunk_size):
            local = keep[(keep >= sl.start * c) & (keep < sl.stop * c)] - sl.start * c
            fz = self.plan.factors(z[sl])
            for module, (a, delta, params) in fz.linear.items():
                self._params[module] = params
                flat = delta.reshape(-1, delta.shape[-1])  # (B C, D_out), row b C + c
                part = (a.index_select(0, local // c), flat.index_select(0, local))
                layer_parts.setdefault(module, []).append(part)
            for name, jac in fz.jac.items():
                dense_parts.setdefault(name, []).append(
                    jac.reshape(-1, jac.shape[-1]).index_select(0, local)
                )
        self.layers = {
            m: (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
            for m, parts in layer_parts.items()
        }
        self.dense = {n: torch.cat(parts) for n, parts in dense_parts.items()}

    def _dense_z(self, name: str) -> Tensor:
        """Jacobian columns (D, numel) at the kept inducing values of tensor ``name``."""
        if name in self.dense:
            return self.dense[name]
        module = self.plan.module_of[name]
        a, delta = self.layers[module]
        kind = dict((n, k) for k, n in self._params[module])[name]
        return (delta[:, :, None] * a[:, None, :]).flatten(1) if kind == "weight" else delta

    def batch(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Unit-prior components of K_{Z x} (G, D, B, C) and of the per-sample blocks
        k(x_n, x_n) (G, B, C, C) at a minibatch ``x (B, ...)``; constants (no graph)."""
        with torch.no_grad():
            fx = self.plan.factors(x)
            b, c, d = x.shape[0], self.num_outputs, self.num_values
            dtype, device = self.plan.dtype, x.device
            cross = torch.zeros(self.num_groups, d, b, c, dtype=dtype, device=device)
            diag = torch.zeros(self.num_groups, b, c, c, dtype=dtype, device=device)
            done: set[str] = set()
            for module, (a_z, d_z) in self.layers.items():
                if module not in fx.linear:
                    continue
                a_x, d_x, params = fx.linear[module]
                dd = torch.einsum("ki,bci->kbc", d_z, d_x)
                ddx = torch.einsum("bci,bdi->bcd", d_x, d_x)
                for kind, name in params:
                    g = self.group_of[name]
                    if kind == "weight":
                        cross[g] += dd * (a_z @ a_x.T)[:, :, None]
                        diag[g] += ddx * a_x.square().sum(-1)[:, None, None]
                    else:
                        cross[g] += dd
                        diag[g] += ddx
                    done.add(name)
            for name in self.subset.names:
                if name in done:
                    continue
                j_x = _dense_x(fx, self.plan, name)  # (B, C, numel)
                g = self.group_of[name]
                cross[g] += torch.einsum("kp,bcp->kbc", self._dense_z(name), j_x)
                diag[g] += torch.einsum("bcp,bdp->bcd", j_x, j_x)
            return cross, diag

    def gram(self) -> Tensor:
        """Unit-prior components of K_ZZ (G, D, D) at the kept inducing values."""
        with torch.no_grad():
            d = self.num_values
            out = torch.zeros(self.num_groups, d, d, dtype=self.plan.dtype, device=self.device)
            done: set[str] = set()
            for module, (a, delta) in self.layers.items():
                dd = delta @ delta.T
                for kind, name in self._params[module]:
                    out[self.group_of[name]] += dd * (a @ a.T) if kind == "weight" else dd
                    done.add(name)
            for name in self.subset.names:
                if name not in done:
                    j = self._dense_z(name)
                    out[self.group_of[name]] += j @ j.T
            return out


def _dense_x(fx: _Factors, plan: _KernelPlan, name: str) -> Tensor:
    """Jacobian columns (B, C, numel) of tensor ``name`` at a minibatch."""
    return fx.dense(name, plan.module_of.get(name))
