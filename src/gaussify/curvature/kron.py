"""Kronecker-factored GGN (KFAC) curvature: ``structure="kron"``.

For a layer with (bias-augmented) input ``a`` and pre-activation ``s = W a``, the GGN block
(Immer thesis eq. 2.24, ``sum_n J_n^T Lambda_n J_n``) is approximated by one Kronecker product
(Martens & Grosse 2015; Botev et al. 2017)::

    G_l  ~=  (B_l kron A_l) / M_l,   A_l = sum a a^T,   B_l = sum g g^T,

where ``g = (ds/df)^T v`` is an output vector ``v`` backpropagated to the pre-activation. The
output vectors are

* exact KFAC (default): the C columns of ``L_n`` with ``Lambda_n = L_n L_n^T`` (one backward
  pass per column), so ``sum_c g g^T = J_s^T Lambda J_s``;
* Monte-Carlo KFAC (``mc_samples=S``): residuals ``d log p(y_s | f) / df`` at sampled targets
  ``y_s ~ p(y | f)``, scaled by ``1/sqrt(S)`` (unbiased because ``E[r r^T] = Lambda``);
* empirical Fisher (``ef=True``): the residual at the observed target.

``M_l`` is the number of "samples" that entered ``A_l`` (the laplace-torch convention
``(sum A) kron (sum B) / N``), which makes KFAC exact for a single linear layer with one
output, and, for one data point, on every layer's diagonal block (with ``kron_bias="joint"``).
Between layers the approximation is block-diagonal. Layers with weight sharing
(``nn.Conv2d`` over its ``T`` spatial locations, ``nn.Linear`` applied to ``(N, T, in)``
inputs) follow Eschenhagen et al. (2023):

* ``kfac_approx="expand"``: every location is a sample: ``A = sum_{n,t} a a^T``,
  ``B = sum_{n,t} g g^T``, ``M = N T``;
* ``kfac_approx="reduce"``: per data point, inputs are *averaged* and output gradients
  *summed* over locations first: ``A = sum_n abar abar^T``, ``B = sum_n gsum gsum^T``,
  ``M = N``.

Both coincide with plain KFAC when ``T = 1``.

**Ordering.** A layer's block is laid out as a matrix ``(out, d)``: the first columns are the
weight reshaped ``(out, in)`` (row-major, which is ``W.flatten()``; for Conv2d
``in = C_in * kh * kw`` in ``F.unfold`` order), the last column is the bias. A vector over the
block is that matrix flattened row-major, and ``B kron A`` acts as ``V -> B V A``. A
permutation maps it to the subset's flattened order (``model.named_parameters()``: all of W,
then b), so every vector and matrix the posterior returns is in subset order.

**Bias.** ``kron_bias="joint"`` (default) gives W and b one block ``B kron A`` with ``A`` over
``[a, 1]``, keeping the W-b cross terms (exact for a single linear layer with one output).
``kron_bias="separate"`` uses two blocks, ``B kron A[:-1, :-1] / M`` and ``B * A[-1, -1] / M``,
dropping the cross terms, as laplace-torch's backends do (use it to compare numbers with
laplace-torch). A subset that holds only a layer's bias is supported: its block is
``B * A[-1, -1] / M`` (exact for Linear).

The posterior algebra lives in :mod:`gaussify.curvature.kron_posterior`, the per-module
adapters in :mod:`gaussify.curvature.kron_modules`, the traced GLM predictive in
:mod:`gaussify.curvature.kron_predictive`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from gaussify.curvature.base import check_batch, check_offset, summed_hessian
from gaussify.curvature.chain_diag import GradientSink
from gaussify.curvature.jacobian import SubsetLike, resolve_subset
from gaussify.curvature.kron_exact import EXACT_FULL_MAX, ExactBlocks
from gaussify.curvature.kron_gradient import fold_gradient
from gaussify.curvature.kron_grams import (
    KFACApprox,
    chain_capture,
    chain_input_budget,
    chain_output_grams,
    gram,
)
from gaussify.curvature.kron_mha import capture_attention
from gaussify.curvature.kron_modules import (
    _build_layers,
    _columns,
    _display,
    _Layer,
    _subset_offsets,
    add_input_factor,
    block_index,
    output_grads,
)
from gaussify.curvature.kron_posterior import (
    KronPosteriorPrecision,
    _Block,
    kron_block_eigh,
)
from gaussify.curvature.kron_predictive import traced_predictive
from gaussify.curvature.layer_traces import _graph_uses
from gaussify.curvature.sqrt_factor import sqrt_factor
from gaussify.curvature.subset import (
    check_prior,
    expand_prior,
    require_whole_tensors,
)
from gaussify.likelihoods import Likelihood, get_likelihood
from gaussify.memory_guard import check_allocation
from gaussify.state import (
    Integer,
    TensorSpec,
    validate_state,
)

__all__ = ["KronGGN", "KronPosteriorPrecision", "kron_block_eigh", "traced_predictive"]

KronBias = Literal["joint", "separate"]


def _as_tensor(value: Tensor | float, like: Tensor) -> Tensor:
    if isinstance(value, Tensor):
        return value.to(dtype=like.dtype, device=like.device)
    return torch.tensor(value, dtype=like.dtype, device=like.device)


def _traced(ly: _Layer | None, names: list[str]) -> tuple[str | None, tuple[str, ...]]:
    """(module, columns) of a block for the traced predictive: only a plain layer's block
    (not an exact block, an Embedding's transposed one or an attention's projection)."""
    if ly is None or ly.part or ly.transposed:
        return None, ()
    return ly.path, _columns(ly, names)


def _rotate(m: Tensor, q_out: Tensor, q_in: Tensor | None) -> Tensor:
    """``Q_out^T m Q_in`` in float64 (``Q_in = None``: the identity)."""
    m = q_out.to(torch.float64).T @ m
    return m if q_in is None else m @ q_in.to(torch.float64)


@dataclass(frozen=True)
class _Basis:
    """What every posterior of one fit shares (built once per fit, reused by every
    :meth:`KronGGN.posterior` call, e.g. each step of prior tuning): per block its subset
    positions ``index (out, d)`` and Kronecker eigenvectors; over all blocks (block order)
    the products of the factors' eigenvalues ``prod = l_b l_a^T / M`` flattened (P,), the
    position in ``subset.names`` of the tensor whose prior sets each entry's eigenvalue shift
    (a joint block's weight), and the checked permutation ``(perm, inv_perm)``. A posterior
    step is then ``eig = scale * prod + prior[tensor]``: O(P), no factorisation."""

    specs: list[tuple[_Layer | None, str, list[str]]]
    index: list[Tensor]
    q_out: list[Tensor]
    q_in: list[Tensor | None]
    shapes: list[tuple[int, int]]
    prod: Tensor
    prior_of: Tensor
    permutation: tuple[Tensor, Tensor]


# ----------------------------------------------------------------------------- curvature


class KronGGN:
    """KFAC approximation of the GGN (or Fisher / empirical Fisher) over a parameter subset.

    ``update(model, x, y)`` adds one batch (sums over data, never means); ``posterior`` turns
    the factors into a :class:`KronPosteriorPrecision`. See the module docstring for the
    factors, normalisation, ordering and bias conventions. Memory is bounded by one batch of
    layer inputs and pre-activation gradients; no per-sample parameter Jacobians are formed.

    ``subset``: "all", "last_layer", names, or a ParameterSubset. ``nn.Linear`` (any leading
    sequence dimensions), ``nn.Conv1d/2d/3d`` (groups=1), ``nn.Embedding`` (diagonal A) and
    ``nn.MultiheadAttention``'s projections get Kronecker blocks
    (:mod:`gaussify.curvature.kron_modules`); every other parameter an exact GGN block, full
    up to ``exact_full_max`` entries (default 1024), diagonal above
    (:mod:`gaussify.curvature.kron_exact`), so no model is refused.
    ``kfac_approx``: weight-sharing variant ("expand" | "reduce"); ``kron_bias``: "joint" |
    "separate" (module docstring); ``chunk_size``: samples per forward/backward chunk inside
    ``update`` (None = the whole batch). Exact KFAC costs C backward passes per chunk, MC KFAC
    ``mc_samples``, EF one.

    The factors are data: they are computed at the likelihood's current Lambda without a graph.
    To tune a Gaussian noise, fit with ``sigma_noise=1`` and pass ``scale=1/sigma^2`` to
    :meth:`posterior` (laplace-torch's ``_H_factor``).
    """

    structure: ClassVar[str] = "kron"

    def __init__(
        self,
        model: nn.Module,
        likelihood: Likelihood | str,
        subset: SubsetLike = "all",
        *,
        ef: bool = False,
        mc_samples: int = 0,
        kfac_approx: KFACApprox = "expand",
        generator: torch.Generator | None = None,
        chunk_size: int | None = None,
        kron_bias: KronBias = "joint",
        exact_full_max: int = EXACT_FULL_MAX,
        **kw: Any,
    ) -> None:
        if kw:
            raise TypeError(f"KronGGN: unexpected keyword argument(s) {sorted(kw)}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(ef, bool):
            raise TypeError(f"ef: expected a bool, got {type(ef).__name__}")
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ValueError(f"chunk_size: expected a positive integer or None, got {chunk_size!r}")
        if kfac_approx not in ("expand", "reduce"):
            raise ValueError(f"kfac_approx: expected 'expand' or 'reduce', got {kfac_approx!r}")
        if kron_bias not in ("joint", "separate"):
            raise ValueError(f"kron_bias: expected 'joint' or 'separate', got {kron_bias!r}")
        if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 0:
            raise ValueError(f"mc_samples: expected an int >= 0, got {mc_samples!r}")
        if (
            isinstance(exact_full_max, bool)
            or not isinstance(exact_full_max, int)
            or (exact_full_max < 0)
        ):
            raise ValueError(f"exact_full_max: expected an int >= 0, got {exact_full_max!r}")
        if ef and mc_samples:
            raise ValueError(
                "ef=True uses the observed targets; it cannot be combined with mc_samples > 0"
            )
        self.likelihood = get_likelihood(likelihood)
        self.subset = subset = resolve_subset(model, subset, subnetwork=True)
        require_whole_tensors(subset, "structure 'kron' (Kronecker factors are per layer)")
        self.ef = ef
        self.chunk_size = chunk_size
        self.mc_samples = mc_samples
        self.kfac_approx: KFACApprox = kfac_approx
        self.kron_bias: KronBias = kron_bias
        self.generator = generator
        self.num_data = 0
        self._layers, exact = _build_layers(model, subset)
        self._offsets = _subset_offsets(subset)
        params = subset.params(model)
        ref = next(iter(params.values()))
        dd = {"dtype": ref.dtype, "device": ref.device}
        numels = [params[n].numel() for n in exact]
        full = [k for k in numels if k <= exact_full_max]

        def big_side(ly: _Layer) -> int:
            return max(ly.a_dim, ly.out_features)

        big = max(self._layers, key=big_side, default=None)
        check_allocation(
            sum(
                (ly.a_dim if ly.diagonal else ly.a_dim**2) + ly.out_features**2
                for ly in self._layers
            )
            + sum(k * k for k in full)
            + sum(numels),
            ref.dtype,
            "structure='kron': the Kronecker factors"
            + ("" if big is None else f" (largest: {big.name!r}, side {big_side(big):,})"),
            "structure='diag' or 'lowrank', or a subset without that layer",
            device=ref.device,
        )
        self._a = {
            ly.name: torch.zeros((ly.a_dim,) if ly.diagonal else (ly.a_dim, ly.a_dim), **dd)
            for ly in self._layers
        }
        self._b = {
            ly.name: torch.zeros(ly.out_features, ly.out_features, **dd) for ly in self._layers
        }
        # Sample counts in float64: N * T can pass float32's exact-integer range.
        self._m = {
            ly.name: torch.zeros((), dtype=torch.float64, device=ref.device) for ly in self._layers
        }
        self._exact_full_max = exact_full_max
        self._exact = ExactBlocks(model, exact, numels, exact_full_max, ref.dtype, ref.device)
        self._dtype = ref.dtype
        self._eig_cache: dict[tuple[str, str], tuple[Tensor, Tensor]] = {}
        self._basis_cache: _Basis | None = None
        self._final_only = False  # every layer is the output layer: forward without graph
        self._kept: tuple[Tensor, Tensor | None] | None = None
        #: (f + offset (N, C), output-layer features phi (N, D)) of the latest ``update``
        #: when the subset is the output layer alone (one chunk), (f, None) where the fit's
        #: gradient was folded (``gradient_sink``), else None: lets ``Laplace.fit`` skip its
        #: own forward pass
        self.last_outputs: tuple[Tensor, Tensor | None] | None = None
        #: keep ``last_outputs`` at all (``Laplace.fit`` asks for them; a bare curvature fit
        #: does not, so it holds no batch-sized tensors between updates)
        self.keep_outputs = False
        #: set by ``Laplace.fit`` per batch: J^T r summed in the B factors' passes where the
        #: chain route allows (:mod:`gaussify.curvature.kron_gradient`), ``added`` then set
        self.gradient_sink: GradientSink | None = None

    # -- accumulation
    def _output_vectors(self, f: Tensor, y: Tensor) -> Tensor:
        """``(K, N, C)`` vectors whose backprop gives the B-factor samples (see module doc)."""
        if self.ef:
            return self.likelihood.residual(f, y).unsqueeze(0)
        if self.mc_samples:
            # All S draws in one call: f repeated S times, sample-major.
            f_rep = f.repeat(self.mc_samples, 1)
            r = self.likelihood.residual(f_rep, self.likelihood.sample(f_rep, self.generator))
            return r.reshape(self.mc_samples, *f.shape) * self.mc_samples**-0.5
        return self.likelihood.hessian_sqrt(f).permute(2, 0, 1)  # columns of L_n

    def _rows_vectors(self, f: Tensor, y: Tensor) -> Callable[[slice], Tensor]:
        """rows -> the exact output vectors (K, B, C) of those samples."""
        return lambda rows: self._output_vectors(f[rows], y[rows])

    def update(self, model: nn.Module, x: Tensor, y: Tensor, offset: Tensor | None = None) -> None:
        """Add the factors of one batch ``x (N, ...)``, ``y`` (sums over the batch), in chunks
        of ``chunk_size`` samples if one was given (that bounds the activation memory).
        ``offset (N, C)``, if given, is added to the outputs where Lambda (or the residual) is
        evaluated: the curvature of the network linearised here, at f + offset."""
        check_batch(model, x, y)
        modules = {ly.path: model.get_submodule(ly.path) for ly in self._layers}
        offset = check_offset(offset, x.shape[0])
        step = self.chunk_size or x.shape[0]
        self.last_outputs = self._kept = None
        # the fit's gradient folded only into a whole batch's passes at the outputs themselves
        sink = self.gradient_sink if offset is None and step >= x.shape[0] else None
        for start in range(0, x.shape[0], step):
            sl = slice(start, start + step)
            part = None if offset is None else offset[sl]
            self._update_chunk(model, modules, x[sl], y[sl], part, sink)
        if step >= x.shape[0]:
            self.last_outputs = self._kept
        self._kept = None  # handed over: the caller's references alone keep them alive
        self._invalidate()

    def _invalidate(self) -> None:
        """Forget the eigendecompositions and the posterior basis (the factors changed)."""
        self._eig_cache.clear()
        self._basis_cache = None

    def _update_chunk(
        self,
        model: nn.Module,
        modules: dict[str, nn.Module],
        x: Tensor,
        y: Tensor,
        offset: Tensor | None,
        sink: GradientSink | None = None,
    ) -> None:
        # an nn.Sequential of supported modules: one forward pass without a graph, and the K
        # output vectors go back together (kron_grams.chain_output_grams)
        chained = chain_capture(model, list(modules), x) if self._layers else None
        if chained is not None:
            run, captured = chained
            f = run.output
        else:
            f, captured = self._hooked_forward(model, modules, x)
        bad = self._not_kronecker(model, f, captured, chained is None)
        if bad:
            path, why = bad
            if self.num_data:
                raise ValueError(
                    f"kron: module {_display(path)} ({type(modules[path]).__name__}) {why} in "
                    "this batch but not in the earlier ones; KFAC's blocks are fixed at the "
                    "first batch"
                )
            warnings.warn(
                f"kron: module {_display(path)} ({type(modules[path]).__name__}) {why}, so "
                "its parameters have no Kronecker form; they get exact GGN blocks",
                stacklevel=4,
            )
            self._demote(model, path)
            modules = {ly.path: model.get_submodule(ly.path) for ly in self._layers}
            self._update_chunk(model, modules, x, y, offset, sink)
            return
        if not isinstance(f, Tensor) or f.ndim != 2:
            shape = tuple(f.shape) if isinstance(f, Tensor) else type(f).__name__
            raise ValueError(f"kron: the model must return outputs f of shape (N, C), got {shape}")
        outs = [captured[ly.name][0][1] for ly in self._layers]
        if self._final_only and any(o is not f for o in outs):
            self._final_only = False  # cannot happen for one model; redo with a graph
            self._update_chunk(model, modules, x, y, offset, sink)
            return
        for ly, o in zip(self._layers, outs, strict=True):
            if chained is None and o is not f and not o.requires_grad:
                raise ValueError(
                    f"kron: the output of module {_display(ly.name)} does not require grad; "
                    "are its parameters frozen or is the model run under torch.no_grad()?"
                )

        with torch.no_grad():
            at = f.detach() if offset is None else f.detach() + offset.to(f.dtype)
            # A layer whose output is the model output has pre-activation gradients equal to
            # the output vectors themselves: its B is sum_k v_k^T v_k = sum_n L_n L_n^T, with
            # no backward pass, and for the exact GGN sum_n Lambda_n without forming the
            # (N, C, C) factor L (which is 1 GB for a 1000-class batch of 256 in float32).
            final = [ly for ly, o in zip(self._layers, outs, strict=True) if o is f]
            inner = [(ly, o) for ly, o in zip(self._layers, outs, strict=True) if o is not f]
            self._final_only = not inner
            if self.keep_outputs and len(final) == 1 == len(self._layers):
                # the output layer alone: keep (f, its input features) for Laplace.fit,
                # which then needs no forward pass of its own (GaussNewtonCurvature's
                # ``last_outputs``)
                phi = captured[final[0].name][0][0]
                self._kept = (at, phi) if phi.ndim == 2 else None
            exact = not self.ef and not self.mc_samples
            # exact on the chain route: the (K, B, C) vectors per chunk of samples, not all N
            rowwise = exact and chained is not None
            wanted = (inner and not rowwise) or not exact or bool(self._exact.names)
            vecs = self._output_vectors(at, y) if wanted else None
            for ly in final:
                # The output layer's B is summed in float64 whatever the model's dtype: a
                # softmax's sum_n Lambda_n has the exact null direction 1 (every Lambda_n 1 = 0;
                # the residuals sum to 0 too), which float32 sums over N samples turn into an
                # eigenvalue of order N * eps that the posterior multiplies by lambda(A) / M.
                # C x C numbers, so the cost is nil.
                b = self._b[ly.name]
                if b.dtype != torch.float64:
                    self._b[ly.name] = b = b.to(torch.float64)
                if vecs is None or exact:
                    summed_hessian(self.likelihood, at.to(torch.float64), out=b)
                else:
                    gram(vecs.transpose(0, 1).to(torch.float64), "expand", "sum", out=b)
            num = 0 if vecs is None or not inner or chained is not None else vecs.shape[0]
            if chained is not None and inner:
                storage = sum(t.numel() for t in (*self._a.values(), *self._b.values()))
                source = vecs if vecs is not None else sqrt_factor(self.likelihood, at)
                source = self._rows_vectors(at, y) if source is None else source
                paths = [ly.path for ly, _ in inner]
                run = chained[0]
                folded = None
                if not self._exact.names:  # every parameter in a layer: J^T r from the passes
                    layers = [ly for ly, _ in inner]
                    folded = fold_gradient(sink, model, self.subset, run, layers, at, self.ef)
                added = chain_output_grams(
                    model, run, paths, source, self.kfac_approx, self._b, None, storage,
                    None if folded is None else folded.chain,
                )  # fmt: skip
                if folded is not None and added:
                    assert sink is not None
                    for ly in final:
                        folded.add_final(modules[ly.path], ly, captured[ly.name][0][0])
                    folded.finish(sink, self.subset)
                    self._kept = (at, None)  # the outputs, for Laplace.fit's log-likelihood
            for k in range(num):
                assert vecs is not None
                # One backward pass per output vector keeps memory at one batch of
                # pre-activation gradients (a vmap'd pass would hold all K at once).
                grads = torch.autograd.grad(
                    f,
                    [o for _, o in inner],
                    grad_outputs=vecs[k],
                    retain_graph=k < num - 1,
                    allow_unused=True,
                    materialize_grads=True,
                )
                for (ly, _), g in zip(inner, grads, strict=True):
                    g = output_grads(ly, modules[ly.path], g)
                    gram(g, self._approx(ly), "sum", out=self._b[ly.name])
            budget = None
            if chained is not None:  # the patches' chunks from the memory rule's budget
                storage = sum(t.numel() for t in (*self._a.values(), *self._b.values()))
                budget = chain_input_budget(model, chained[0], storage)
            for ly in self._layers:
                inp = captured[ly.name][0][0]
                if self._approx(ly) == "reduce" and inp.shape[0] != f.shape[0]:
                    raise ValueError(
                        f"kfac_approx='reduce' averages each data point's locations, but the "
                        f"input of module {_display(ly.path)} has shape {tuple(inp.shape)}, "
                        f"whose first dimension is not the {f.shape[0]} data points (e.g. a "
                        "sequence-first layer); use kfac_approx='expand', which sums over all "
                        "rows and does not depend on their order"
                    )
                self._m[ly.name] += add_input_factor(
                    ly, modules[ly.path], inp, self.kfac_approx, self._a[ly.name], budget
                )
        if vecs is not None and self._exact.names:
            self._exact.update(model, x, vecs)
        self.num_data += int(f.shape[0])

    def _not_kronecker(
        self, model: nn.Module, f: Tensor, captured: dict[str, list], hooked: bool
    ) -> tuple[str, str] | None:
        """(module path, reason) of the first layer that is not a single linear map in this
        forward pass: called other than once (a module reused, or bypassed), or (hooked
        route, first batch) a parameter that enters the graph of f more than once (a weight
        tied to another module's)."""
        for ly in self._layers:
            calls = len(captured[ly.name])
            if calls != 1:
                return ly.path, f"was called {calls} times in one forward pass"
        if not hooked or self.num_data or not isinstance(f, Tensor) or f.grad_fn is None:
            return None
        uses = _graph_uses(f)
        for ly in self._layers:
            if ly.part:  # the packed in-projection is sliced once per part by design
                continue
            for name in (ly.weight, ly.bias):
                if name is not None and uses.get(id(model.get_parameter(name)), 0) > 1:
                    return ly.path, f"shares its parameter {name!r} with another use"
        return None

    def _demote(self, model: nn.Module, path: str) -> None:
        """Move every block of module ``path`` to exact blocks (before any data was added)."""
        gone = [ly for ly in self._layers if ly.path == path]
        names = set(self._exact.names)
        for ly in gone:
            names |= {n for n in (ly.weight, ly.bias) if n}
            for store in (self._a, self._b, self._m):
                store.pop(ly.name)
        self._layers = [ly for ly in self._layers if ly.path != path]
        ordered = [n for n in self.subset.names if n in names]
        params = self.subset.params(model)
        ref = params[ordered[0]]
        self._exact = ExactBlocks(
            model,
            ordered,
            [params[n].numel() for n in ordered],
            self._exact_full_max,
            ref.dtype,
            ref.device,
        )
        self._invalidate()

    def _approx(self, ly: _Layer) -> KFACApprox:
        """The layer's weight-sharing variant: an Embedding always expands (module doc)."""
        return "expand" if ly.diagonal else self.kfac_approx

    def _hooked_forward(
        self, model: nn.Module, modules: dict[str, nn.Module], x: Tensor
    ) -> tuple[Tensor, dict[str, list[tuple[Tensor, Tensor]]]]:
        """f and {path: [(input, output) of each call]} from a forward pass with hooks, with a
        graph unless every layer's output is the model output (learned on the first chunk)."""
        captured: dict[str, list[tuple[Tensor, Tensor]]] = {ly.name: [] for ly in self._layers}

        def make_hook(path: str):
            def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
                captured[path].append((inputs[0].detach(), output))

            return hook

        def record(path: str, part: str, inp: Tensor, out: Tensor) -> None:
            key = f"{path}:{part}"
            if key in captured:
                captured[key].append((inp.detach(), out))

        hooked = {ly.path for ly in self._layers if not ly.part}
        # every attention owning a block (its in-projection, or out_proj, which only the
        # functional forward calls as a module)
        paths = {ly.path for ly in self._layers}
        attention = {
            p: m
            for p, m in model.named_modules()
            if isinstance(m, nn.MultiheadAttention)
            and (p in paths or (f"{p}.out_proj" if p else "out_proj") in paths)
        }
        handles = [modules[p].register_forward_hook(make_hook(p)) for p in hooked]
        try:
            with torch.set_grad_enabled(not self._final_only), capture_attention(attention, record):
                f = model(x)
        finally:
            for h in handles:
                h.remove()
        return f, captured

    # -- factors
    def kron_factors(self) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
        """``{module path: (A, B, M)}``: the summed factors and normaliser, G ~= B kron A / M.

        ``A`` is over the layer's block input: ``[a, 1]`` (weight and bias in the subset),
        ``a`` (weight only) or ``[1]`` (bias only). The tensors are the live accumulators:
        do not modify them in place. The B of a layer whose output is the model output is
        float64 whatever the model's dtype (see :meth:`update`)."""
        return {
            ly.name: (self._a[ly.name], self._b[ly.name], self._m[ly.name]) for ly in self._layers
        }

    def exact_blocks(self) -> dict[str, Tensor]:
        """``{parameter name: exact GGN block}``, ``(k, k)`` or its diagonal ``(k,)``, of the
        parameters without a Kronecker form (:mod:`gaussify.curvature.kron_exact`)."""
        return dict(self._exact.g)

    def _eigh(self, path: str, which: str) -> tuple[Tensor, Tensor]:
        key = (path, which)
        if key not in self._eig_cache:
            if which == "B":
                mat = self._b[path]
            elif which == "A" and self._a[path].ndim == 1:  # diagonal A: identity eigenbasis
                a_diag = self._a[path].clamp_min(0).to(self._dtype)
                self._eig_cache[key] = (a_diag, None)
                return self._eig_cache[key]
            elif which == "A":
                mat = self._a[path]
            elif which == "A_weight":
                mat = self._a[path][:-1, :-1]
            else:  # "A_bias"
                mat = self._a[path][-1:, -1:]
            vals, vecs = kron_block_eigh(mat)  # decomposed in float64, returned in mat.dtype
            self._eig_cache[key] = (vals.to(self._dtype), vecs.to(self._dtype))
        return self._eig_cache[key]

    def _basis(self) -> _Basis:
        """The posterior basis of the current factors (built once per fit, see :class:`_Basis`)."""
        if self._basis_cache is not None:
            return self._basis_cache
        specs = self._block_specs()
        position = {name: i for i, name in enumerate(self.subset.names)}
        index, q_out, q_in, shapes, prods, prior_of = [], [], [], [], [], []
        device = self._exact_device()
        for ly, which, names in specs:
            if ly is None:  # an exact block: one output row, B = [1], M = 1
                lam_a, q_a = self._exact.eigh(names[0])
                lam_a, q_a = lam_a.to(self._dtype), None if q_a is None else q_a.to(self._dtype)
                q_b = torch.ones(1, 1, dtype=self._dtype, device=device)
                prod = lam_a.unsqueeze(0)
                off = self._offsets[names[0]]
                index.append(off + torch.arange(prod.shape[1], device=device).unsqueeze(0))
            else:
                lam_b, q_b = self._eigh(ly.name, "B")
                lam_a, q_a = self._eigh(ly.name, which)
                m = self._m[ly.name].clamp_min(1.0).to(lam_a.dtype)
                prod = torch.outer(lam_b, lam_a / m)
                index.append(block_index(ly, names, self._offsets, device))
            q_out.append(q_b)
            q_in.append(q_a)
            shapes.append((prod.shape[0], prod.shape[1]))
            prods.append(prod.reshape(-1))
            prior_of.append(torch.full((prod.numel(),), position[names[0]], device=prod.device))
        perm = torch.cat([i.reshape(-1) for i in index])
        if perm.numel() != self.subset.num_params or not torch.equal(
            torch.sort(perm).values, torch.arange(self.subset.num_params, device=perm.device)
        ):
            raise ValueError("kron: the Kronecker blocks do not cover the parameters exactly once")
        self._basis_cache = _Basis(
            specs,
            index,
            q_out,
            q_in,
            shapes,
            torch.cat(prods),
            torch.cat(prior_of),
            (perm, torch.argsort(perm)),
        )
        return self._basis_cache

    def _exact_device(self) -> torch.device:
        return next(iter((*self._b.values(), *self._exact.g.values()))).device

    def _block_specs(self) -> list[tuple[_Layer | None, str, list[str]]]:
        """``(layer, which A, parameter names)`` for each Kronecker block, in layer order,
        then ``(None, "exact", [name])`` for each exact block."""
        specs: list[tuple[_Layer | None, str, list[str]]] = []
        for ly in self._layers:
            if ly.weight and ly.bias and self.kron_bias == "separate":
                specs.append((ly, "A_weight", [ly.weight]))
                specs.append((ly, "A_bias", [ly.bias]))
            else:
                specs.append((ly, "A", [n for n in (ly.weight, ly.bias) if n]))
        specs += [(None, "exact", [name]) for name in self._exact.names]
        return specs

    def _tensor_priors(self, prior: Tensor) -> dict[str, Tensor] | Tensor:
        """The prior as one scalar, or one scalar per parameter tensor of the subset."""
        names = self.subset.names
        if prior.numel() == 1:
            return prior.reshape(())
        if prior.ndim == 1 and prior.numel() == len(names):
            return dict(zip(names, prior.unbind(0), strict=True))
        if prior.ndim == 1 and prior.numel() == self.subset.num_params:
            out = {}
            for name, vals in zip(names, prior.split(list(self.subset.numels)), strict=True):
                first = vals[0].detach()
                if ((vals.detach() - first).abs() > 1e-6 * first.abs()).any():
                    raise ValueError(
                        "kron supports scalar or per-layer prior precision: the per-parameter "
                        f"prior precision is not constant over parameter {name!r}; pass one "
                        "value per parameter tensor, or use structure='diag' or 'full' for an "
                        "arbitrary diagonal prior"
                    )
                # Only the sum of the tied entries' gradients is meaningful; the mean keeps
                # them tied under a gradient step.
                out[name] = vals.mean()
            return out
        expand_prior(prior, self.subset)  # raises the standard shape error
        raise ValueError(f"prior_precision: unsupported shape {tuple(prior.shape)}")

    def posterior(
        self, prior_precision: Tensor | float, scale: Tensor | float = 1.0
    ) -> KronPosteriorPrecision:
        """``A = scale * G + diag(prior)``, the prior added to the Kronecker eigenvalues
        (differentiable wrt ``prior_precision`` and ``scale``).

        ``prior_precision``: a scalar, one value per parameter tensor of the subset (weight
        and bias may differ, also within a joint block), or (P,) values that are constant
        within each parameter tensor.
        """
        ref = torch.empty((), dtype=self._dtype, device=self._exact_device())  # model's dtype
        # Python floats go straight to the factors' dtype (as_tensor would round them to
        # float32 first); tensors are cast differentiably.
        prior = check_prior(_as_tensor(prior_precision, ref))
        scale_t = _as_tensor(scale, ref)
        if scale_t.numel() != 1 or not torch.isfinite(scale_t).all() or (scale_t < 0).any():
            raise ValueError(f"scale: expected a finite scalar >= 0, got {scale}")
        scale_t = scale_t.reshape(())
        priors = self._tensor_priors(prior)
        basis = self._basis()
        shifts: list[Tensor | None] = [None] * len(basis.specs)
        if isinstance(priors, Tensor):
            eig_flat = scale_t * basis.prod + priors
        else:
            per_tensor = torch.stack([priors[name] for name in self.subset.names])
            eig_flat = scale_t * basis.prod + per_tensor[basis.prior_of]
            for i, (_, _, names) in enumerate(basis.specs):
                if len(names) == 2:  # joint weight + bias: the bias gets a rank-one shift
                    shifts[i] = priors[names[1]] - priors[names[0]]
        eigs = torch.split(eig_flat, [a * b for a, b in basis.shapes])
        blocks = [
            _Block(index, q_b, q_a, eig.view(shape), shift, *_traced(ly, names))
            for index, q_b, q_a, eig, shape, shift, (ly, _, names) in zip(
                basis.index,
                basis.q_out,
                basis.q_in,
                eigs,
                basis.shapes,
                shifts,
                basis.specs,
                strict=True,
            )
        ]
        return KronPosteriorPrecision(
            blocks, self.subset.num_params, permutation=basis.permutation, eig_flat=eig_flat
        )

    def spectrum(
        self, groups: Tensor, vectors: list[Tensor]
    ) -> tuple[Tensor, Tensor, list[Tensor]] | None:
        """(eigenvalues (P,), prior group per eigenvector (P,), [V^T v for v in vectors]) in
        block order, for closed-form prior tuning (:mod:`gaussify.spectral`): the eigenvalues
        of block ``B kron A / M`` are the products ``l_b l_a / M`` and its eigenvectors
        ``Q_b kron Q_a``, so ``V^T v`` is ``Q_b^T V_mat Q_a`` per block. None when a block holds
        parameters of different prior groups ``groups`` (P,) (a joint weight+bias block under
        a per-tensor prior: its bias shift does not commute with the block's eigenvectors)."""
        basis = self._basis()
        block_groups = []
        for index in basis.index:
            g = groups.to(index.device)[index]
            if bool((g != g.reshape(-1)[0]).any()):
                return None
            block_groups.append(g.reshape(-1))
        projections = []
        for v in vectors:
            v64 = v.to(torch.float64)
            parts = [
                _rotate(v64[index], q_b, q_a).reshape(-1)
                for index, q_b, q_a in zip(basis.index, basis.q_out, basis.q_in, strict=True)
            ]
            projections.append(torch.cat(parts))
        return basis.prod.to(torch.float64), torch.cat(block_groups), projections

    # -- serialisation
    def state_dict(self) -> dict[str, Tensor]:
        """Factors ``A.<path>``, ``B.<path>``, normalisers ``M.<path>`` and ``num_data``."""
        state: dict[str, Tensor] = {"num_data": torch.tensor(self.num_data)}
        for ly in self._layers:
            state[f"A.{ly.name}"] = self._a[ly.name].clone()
            state[f"B.{ly.name}"] = self._b[ly.name].clone()
            state[f"M.{ly.name}"] = self._m[ly.name].clone()
        state.update(self._exact.state())
        return state

    def state_schema(self) -> dict[str, Any]:
        """Declarative schema of :meth:`state_dict` (:mod:`gaussify.state`): per layer the
        factors in the model's dtype (B also float64: the output layer keeps it so)."""
        schema: dict[str, Any] = {"num_data": Integer()}
        wide = (self._dtype, torch.float64)
        for ly in self._layers:
            schema[f"A.{ly.name}"] = TensorSpec(tuple(self._a[ly.name].shape), self._dtype)
            schema[f"B.{ly.name}"] = TensorSpec(tuple(self._b[ly.name].shape), wide)
            schema[f"M.{ly.name}"] = TensorSpec((), torch.float64, nonnegative=True)
        schema.update(self._exact.schema())
        return schema

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        # the whole state is checked before any factor is replaced
        valid = validate_state(state, self.state_schema(), owner="KronGGN")
        for ly in self._layers:
            for prefix, store in (("A", self._a), ("B", self._b), ("M", self._m)):
                value = valid[f"{prefix}.{ly.name}"]
                store[ly.name] = value.to(device=store[ly.name].device).clone()
        self._exact.load(valid)
        self.num_data = valid["num_data"]
        self._invalidate()
