"""The linearised kernel at VaLLA's inducing inputs (the covariance side of the decoupled GP).

k(x, x') = J(x) P0^-1 J(x')^T (C x C blocks) with P0 the diagonal prior precision, given as
one value, one per parameter tensor (a group each) or one per parameter. K_ZZ and K_{Z x} are
formed from Jacobians ("jacobian" route: the (M C, P) Jacobian at Z cached while Z is fixed)
or by :func:`gaussify.function_space.ntk.ntk` ("ntk" route: per layer, no P-sized rows). While
Z is fixed, K_ZZ is cached as one unit-prior Gram matrix per prior group, so a step with a
learned prior costs no pass over Z: K_ZZ = sum_g G_g / delta_g. On the "ntk" route the
per-layer factors of the kept inducing values are cached too
(:class:`gaussify.function_space.valla_factors.InducingFactors`), so a step forms only its
minibatch's factors, once for K_{Z x} and k(x, x), and K_{Z x} = sum_g K_g / delta_g from
unit-prior components (a per-parameter prior takes the uncached route). Inducing inputs start
at K-means centres of the training inputs.

The inducing outputs are either all C outputs at every inducing input (M C of them) or, as in
the authors' code for classification, one output per inducing input: pairs (z_m, c_m) whose
value is f_{c_m}(z_m), so that K_ZZ[m, m'] = k(z_m, z_m')[c_m, c_m'] and K_{Z x}[m] =
k(z_m, x)[c_m, :] -- M inducing values, O(M^3) per step instead of O((M C)^3). Both are row
selections of the all-outputs kernels (``_rows``: the kept rows m C + c_m, or None for all),
so with every pair (z_m, c) present the two designs are the same GP.

:class:`InducingKernel` is a mixin of :class:`gaussify.function_space.valla.VaLLA`: it reads
the posterior's ``model``, ``subset``, ``log_prior``, ``kernel``, ``inducing_points``,
``learn_inducing``, ``kmeans_points`` and ``seed``.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from gaussify.batches import Batches, as_batches
from gaussify.curvature.jacobian import jacobians
from gaussify.curvature.subset import ParameterSubset, expand_prior
from gaussify.function_space.ntk import ntk, ntk_diag
from gaussify.function_space.valla_factors import InducingFactors

__all__ = ["InducingKernel"]


class InducingKernel:
    """K_ZZ, K_{Z x} and k(x, x) of the linearised network for a VaLLA posterior (a mixin)."""

    model: nn.Module
    subset: ParameterSubset
    log_prior: Tensor
    kernel: str
    inducing_points: Tensor
    learn_inducing: bool
    kmeans_points: int
    seed: int
    _jz_cache: Tensor
    _zz_grams: list[Tensor] | None
    _z_factors: InducingFactors | None
    _warned_jitter: bool
    _rows: Tensor | None

    def _keep(self, k: Tensor, cols: bool = False) -> Tensor:
        """The rows (and with ``cols`` the columns) of an all-outputs kernel (M C, ...) that
        belong to the inducing outputs (all of them when ``_rows`` is None)."""
        rows = getattr(self, "_rows", None)
        if rows is None:
            return k
        k = k.index_select(0, rows)
        return k.index_select(1, rows) if cols else k

    def _prior_vec(self) -> Tensor:
        return expand_prior(self.log_prior.exp(), self.subset)

    def _groups(self) -> list[slice] | None:
        """Parameter slices sharing one prior value (scalar: one; per tensor: one each), or
        None for a per-parameter prior (then kernels weight every column)."""
        numel = self.log_prior.numel()
        if numel == 1:
            return [slice(0, self.subset.num_params)]
        if numel == len(self.subset.names) and numel != self.subset.num_params:
            out, start = [], 0
            for n in self.subset.numels:
                out.append(slice(start, start + n))
                start += n
            return out
        return None

    def _group_inv(self) -> Tensor:
        """1 / prior per group (G,), or per parameter (P,) when ``_groups`` is None."""
        prior = self.log_prior.exp()
        return (1.0 / prior).reshape(-1)

    def _group_names(self) -> list[list[str]] | None:
        """The groups of :meth:`_groups` as parameter names (for ``ntk_components``)."""
        groups = self._groups()
        if groups is None:
            return None
        if len(groups) == 1:
            return [list(self.subset.names)]
        return [[name] for name in self.subset.names]

    def _kernel(self, ja: Tensor, jb: Tensor) -> Tensor:
        """J_a P0^-1 J_b^T for flattened Jacobians ja (A, P), jb (B, P): (A, B)."""
        groups, inv = self._groups(), self._group_inv()
        if groups is None:
            return (ja * inv) @ jb.T
        out = (ja[:, groups[0]] @ jb[:, groups[0]].T) * inv[0]
        for i, g in enumerate(groups[1:], start=1):
            out = out + (ja[:, g] @ jb[:, g].T) * inv[i]
        return out

    def _kernel_diag_blocks(self, jac: Tensor) -> Tensor:
        """Per-sample blocks J_n P0^-1 J_n^T for jac (B, C, P): (B, C, C)."""
        groups, inv = self._groups(), self._group_inv()
        if groups is None:
            return torch.einsum("bcp,bdp->bcd", jac * inv, jac)
        out = torch.einsum("bcp,bdp->bcd", jac[..., groups[0]], jac[..., groups[0]]) * inv[0]
        for i, g in enumerate(groups[1:], start=1):
            out = out + torch.einsum("bcp,bdp->bcd", jac[..., g], jac[..., g]) * inv[i]
        return out

    def _jz(self) -> Tensor:
        """Jacobians at Z (MC, P) (jacobian route): cached while Z is fixed, recomputed with
        gradients to Z when it is learned."""
        if not self.learn_inducing:
            return self._jz_cache
        jz = jacobians(self.model, self.inducing_points, self.subset)
        return self._keep(jz.reshape(-1, jz.shape[-1]))

    def _kzz(self) -> Tensor:
        """K_ZZ (MC, MC); from cached unit-prior components (one per prior group) while Z is
        fixed, so a step with a learned prior costs no pass over Z."""
        grams = self._zz_grams
        if grams is not None:
            inv = self._group_inv()
            out = grams[0] * inv[0]
            for i in range(1, len(grams)):
                out = out + grams[i] * inv[i]
            return out
        if self.kernel == "ntk":
            m = self.inducing_points
            k = ntk(self.model, m, None, self.subset, self.log_prior.exp())
            return self._keep(k.reshape(k.shape[0] * k.shape[1], -1), cols=True)
        jz = self._jz()
        return self._kernel(jz, jz)

    def _batch_kernels(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(K_{Z x} (MC, BC), the per-sample prior blocks k(x_n, x_n) (B, C, C))."""
        factors = getattr(self, "_z_factors", None)
        if self.kernel == "ntk" and factors is not None:
            cross, diag = factors.batch(x)
            inv = self._group_inv()
            k_zx = torch.einsum("g,gkbc->kbc", inv, cross)
            return k_zx.reshape(k_zx.shape[0], -1), torch.einsum("g,gbcd->bcd", inv, diag)
        if self.kernel == "ntk":
            prior = self.log_prior.exp()
            k_zx = ntk(self.model, self.inducing_points.detach(), x, self.subset, prior)
            k_xx = ntk_diag(self.model, x, self.subset, prior)
            return self._keep(k_zx.reshape(k_zx.shape[0] * k_zx.shape[1], -1)), k_xx
        jac = jacobians(self.model, x, self.subset)
        b, c, p = jac.shape
        return self._kernel(self._jz(), jac.reshape(b * c, p)), self._kernel_diag_blocks(jac)

    def _cholesky(self, k: Tensor) -> Tensor:
        """Cholesky factor of K_ZZ, adding jitter (warned once) when it is singular (e.g. more
        inducing outputs M C than parameters P, or duplicated inducing inputs)."""
        chol, info = torch.linalg.cholesky_ex(k)
        if not bool(info.any()):
            return chol
        eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
        scale = float(k.diagonal().mean().detach().abs()) or 1.0
        for power in range(-10, -1):
            jitter = scale * 10.0**power
            chol, info = torch.linalg.cholesky_ex(k + jitter * eye)
            if not bool(info.any()):
                if not self._warned_jitter:
                    warnings.warn(
                        f"K_ZZ: not positive definite (M C = {k.shape[0]} inducing outputs, "
                        f"P = {self.subset.num_params} parameters); added jitter {jitter:.1e}",
                        stacklevel=3,
                    )
                    self._warned_jitter = True
                return chol
        raise ValueError("K_ZZ: not positive definite even with jitter; use fewer inducing points")

    def _training_sample(self, data: Batches, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        """Up to ``kmeans_points`` training (inputs, targets): a random subset of a tensor pair,
        the first batches of a loader."""
        if isinstance(data, tuple):
            x, y = data[0], data[1]
            if x.shape[0] > self.kmeans_points:
                keep = torch.randperm(x.shape[0], generator=gen)[: self.kmeans_points]
                x, y = x[keep], y[keep]
            return x, y
        xs, ys, count = [], [], 0
        for x, y in as_batches(data):
            xs.append(x)
            ys.append(y)
            count += x.shape[0]
            if count >= self.kmeans_points:
                break
        return torch.cat(xs)[: self.kmeans_points], torch.cat(ys)[: self.kmeans_points]

    def _inducing_rows(
        self, spec: str | Tensor, z: Tensor, sample: tuple[Tensor, Tensor], c: int
    ) -> Tensor | None:
        """The class c_m of each inducing input as kept rows m C + c_m of the all-outputs
        kernel, or None for all outputs. ``spec``: "all"; "cycle" (c_m = m mod C, the authors'
        default); "label" (the label of the training input nearest to z_m: for inducing inputs
        drawn from the training set, their own labels, as in the authors' experiments); or a
        tensor (M,) of classes in [0, C). With one output every design is "all"."""
        m = z.shape[0]
        if isinstance(spec, Tensor):
            if spec.shape != (m,) or spec.dtype.is_floating_point or spec.dtype == torch.bool:
                raise ValueError(
                    f"inducing_classes: expected an integer tensor of shape ({m},), one class "
                    f"per inducing point, got {spec.dtype} {tuple(spec.shape)}"
                )
            if bool(((spec < 0) | (spec >= c)).any()):
                raise ValueError(f"inducing_classes: classes must lie in [0, {c}), got {spec}")
            classes = spec.to(device=z.device, dtype=torch.long)
        elif spec == "all" or c == 1:
            return None
        elif spec == "cycle":
            classes = torch.arange(m, device=z.device) % c
        else:  # "label"
            x, y = sample
            flat = x.reshape(x.shape[0], -1).double()
            dist = torch.cdist(z.detach().reshape(m, -1).double(), flat)
            classes = y.reshape(-1).long()[dist.argmin(1).to(y.device)].to(z.device)
        return torch.arange(m, device=z.device) * c + classes

    def _kmeans(self, x: Tensor, m: int) -> Tensor:
        """M K-means centres of the (flattened) inputs (scikit-learn, seeded), shaped like x."""
        from gaussify.extras import require

        KMeans = require("sklearn.cluster", "VaLLA's K-means inducing points").KMeans
        flat = x.detach().reshape(x.shape[0], -1).cpu().double().numpy()
        km = KMeans(n_clusters=m, n_init=1, random_state=self.seed).fit(flat)
        centres = torch.as_tensor(km.cluster_centers_, dtype=x.dtype, device=x.device)
        return centres.reshape(m, *x.shape[1:])

    def _refresh_cache(self) -> None:
        """Cache what depends on Z alone: Jacobians at Z (jacobian route), the per-layer
        factors of the kept inducing values ("ntk" route) and the unit-prior K_ZZ components
        of each prior group (both routes), unless Z is learned."""
        z = self.inducing_points.detach()
        names = self._group_names()
        self._zz_grams = None
        self._z_factors = None
        if self.kernel == "jacobian":
            jz = jacobians(self.model, z, self.subset)
            self._jz_cache = self._keep(jz.reshape(-1, jz.shape[-1]))
            groups = self._groups()
            if groups is not None and not self.learn_inducing:
                self._zz_grams = [self._jz_cache[:, g] @ self._jz_cache[:, g].T for g in groups]
        elif names is not None:
            self._z_factors = InducingFactors(self.model, self.subset, z, self._rows, names)
            self._zz_grams = list(self._z_factors.gram())
