"""The curvature protocol and what every Gauss-Newton structure shares.

A :class:`Curvature` accumulates, batch by batch, a positive semi-definite matrix G over the
parameters of a subset: the generalised Gauss-Newton sum_n J_n^T Lambda_n J_n (thesis eq. 2.24;
the precision term of eq. 3.11) or the empirical Fisher sum_n g_n g_n^T with per-sample gradients
g_n = J_n^T r_n (eq. 2.23). Its :meth:`Curvature.posterior` returns the Laplace-GGN posterior
precision A = scale * G + diag(prior) (eq. 3.11 with Sigma_0^{-1} = diag(prior); ``scale`` is
e.g. 1 / sigma^2 for a Gaussian likelihood fitted with unit noise, or a tempering factor) as a
:class:`PosteriorPrecision`, which answers log det A, samples from N(0, A^{-1}), solves and
output-space covariances J A^{-1} J^T. Both are differentiable with respect to the prior
precision and the scale, which is what marginal-likelihood tuning needs (eq. 3.18).

Every structure (full, diag, low-rank, Kronecker) implements the same two protocols; the
shared batch loop for the Jacobian-based structures lives in :class:`GaussNewtonCurvature`.

All three curvature flavours are one formula, sum_n J_n^T L_n L_n^T J_n, with a per-sample
factor L_n (C x K) of the middle matrix:

* GGN: L_n = Lambda_n^{1/2} (``likelihood.hessian_sqrt``), K = C;
* empirical Fisher: L_n = r_n (the residual at the observed label), K = 1;
* Monte Carlo GGN: L_n = [r_n(y~_1), ..., r_n(y~_S)] / sqrt(S) with y~_s ~ p(y | f_n), K = S,
  unbiased because E[r r^T] = Lambda for these exponential-family likelihoods.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from gaussify.curvature import generic_jacobian as gj
from gaussify.curvature.batched_backward import linear_chain
from gaussify.curvature.chain_diag import GradientSink
from gaussify.curvature.generic_jacobian import SubsetLike, check_eval_mode, resolve_subset
from gaussify.curvature.lastlayer import (
    OutputLinear,
    find_output_linear,
    forward_with_features,
    lastlayer_diag,
    lastlayer_products,
)
from gaussify.curvature.per_sample import per_sample_vjp, squared_vjp_sum
from gaussify.curvature.sqrt_factor import SqrtFactor, sqrt_factor
from gaussify.curvature.subset import ParameterSubset, check_prior
from gaussify.deferred_checks import check_finite, check_finite_values, deferring
from gaussify.likelihoods import (
    Bernoulli,
    Categorical,
    Gaussian,
    HeteroscedasticGaussian,
    Likelihood,
    all_finite,
    get_likelihood,
)
from gaussify.state import validate_state

__all__ = [
    "Curvature",
    "GaussNewtonCurvature",
    "LastLayerPrecision",
    "PosteriorPrecision",
    "Structure",
    "as_hyperparameter",
    "check_batch",
    "check_diagonal",
    "check_offset",
    "cholesky_psd",
    "draw_labels",
    "middle_diag",
    "middle_factor",
    "summed_hessian",
]

Structure = Literal["full", "diag", "lowrank", "kron"]


@runtime_checkable
class PosteriorPrecision(Protocol):
    """A = scale * G + diag(prior) and its inverse Sigma = A^{-1} (thesis eq. 3.11)."""

    num_params: int

    def logdet(self) -> Tensor:
        """log det A, differentiable with respect to the prior precision and the scale."""
        ...

    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """(n, P) draws from N(0, Sigma)."""
        ...

    def functional_cov(self, jac: Tensor) -> Tensor:
        """jac (N, C, P) -> J Sigma J^T (N, C, C)."""
        ...

    def functional_var(self, jac: Tensor) -> Tensor:
        """jac (N, C, P) -> diag(J Sigma J^T) (N, C)."""
        ...

    def solve(self, v: Tensor) -> Tensor:
        """Sigma v for v (..., P)."""
        ...

    def precision_dense(self) -> Tensor:
        """A as a dense (P, P) matrix."""
        ...

    def covariance_dense(self) -> Tensor:
        """Sigma as a dense (P, P) matrix."""
        ...

    def covariance_diag(self) -> Tensor:
        """diag(Sigma), shape (P,)."""
        ...


@runtime_checkable
class LastLayerPrecision(Protocol):
    """A posterior precision that also answers the GLM predictive of a final ``nn.Linear``
    subset from its input features alone (J_n = I_C ⊗ [phi_n, 1]^T, thesis eqs. 2.22 and
    3.15), never forming the (N, C, P) Jacobian. Every built-in structure implements it; a
    user structure without it gets the generic Jacobian path."""

    def functional_cov_lastlayer(self, phi: Tensor, layer: OutputLinear) -> Tensor:
        """phi (N, D) -> J Sigma J^T (N, C, C) for the output layer ``layer``."""
        ...

    def functional_var_lastlayer(self, phi: Tensor, layer: OutputLinear) -> Tensor:
        """phi (N, D) -> diag(J Sigma J^T) (N, C)."""
        ...


@runtime_checkable
class Curvature(Protocol):
    """A curvature structure accumulated over batches (GGN eq. 2.24 or empirical Fisher).

    Optional: an attribute ``last_outputs`` = (f, phi or None) of the latest ``update``'s
    batch, kept when the attribute ``keep_outputs`` is set (see
    :class:`GaussNewtonCurvature`); ``Laplace.fit`` sets it and then skips its own forward
    pass on the last-layer path. Structures without it cost one extra forward per batch.
    ``update`` should be transactional: a batch that raises leaves the state unchanged.
    """

    structure: ClassVar[str]
    subset: ParameterSubset
    num_data: int

    def update(self, model: nn.Module, x: Tensor, y: Tensor) -> None:
        """Add one batch: sum over the batch of J^T Lambda J (GGN) or g g^T (EF)."""
        ...

    def posterior(
        self, prior_precision: Tensor | float, scale: Tensor | float = 1.0
    ) -> PosteriorPrecision:
        """scale * G + diag(expand_prior(prior_precision)) as a :class:`PosteriorPrecision`."""
        ...

    def state_dict(self) -> dict[str, Tensor]: ...

    def load_state_dict(self, state: dict[str, Tensor]) -> None: ...


# --------------------------------------------------------------------------- pure functions


def draw_labels(
    likelihood: Likelihood, f: Tensor, num_samples: int, generator: torch.Generator | None
) -> Tensor:
    """Draws y~_s ~ p(y | f_n), shape (S, N, ...) (labels (S, N) for a softmax), from one
    ``likelihood.sample`` call on the outputs repeated S times."""
    n = f.shape[0]
    repeated = f.unsqueeze(0).expand(num_samples, *f.shape).reshape(num_samples * n, -1)
    draws = likelihood.sample(repeated, generator=generator)
    return draws.reshape(num_samples, n, *draws.shape[1:])


def middle_factor(
    likelihood: Likelihood, f: Tensor, y: Tensor | None, *, ef: bool, draws: Tensor | None
) -> Tensor:
    """Per-sample factor L (N, C, K) of the middle matrix M_n = L_n L_n^T.

    GGN: Lambda_n^{1/2} (thesis eq. 2.24); empirical Fisher (``ef``): the residual r_n at the
    observed y (eq. 2.23), K = 1; Monte Carlo (``draws`` (S, N, ...)): residuals at sampled
    labels scaled by 1/sqrt(S), an unbiased estimate of Lambda_n.
    """
    if ef:
        if y is None:
            raise ValueError("y: the empirical Fisher needs targets")
        return likelihood.residual(f, y).unsqueeze(-1)
    if draws is not None:
        s, n = draws.shape[:2]
        repeated = f.unsqueeze(0).expand(s, *f.shape).reshape(s * n, -1)
        res = likelihood.residual(repeated, draws.reshape(s * n, *draws.shape[2:]))
        return res.reshape(s, n, -1).permute(1, 2, 0) / math.sqrt(s)
    return likelihood.hessian_sqrt(f)


def middle_diag(
    likelihood: Likelihood, f: Tensor, y: Tensor | None, *, ef: bool, draws: Tensor | None
) -> Tensor:
    """diag(M_n), shape (N, C), for the same three cases as :func:`middle_factor` (without
    forming C x C blocks: ``hessian_diag`` for the exact GGN)."""
    if ef or draws is not None:
        return middle_factor(likelihood, f, y, ef=ef, draws=draws).square().sum(-1)
    return likelihood.hessian_diag(f)


#: Likelihoods whose Lambda_n is diagonal (``hessian`` is ``diag_embed(hessian_diag)``).
_DIAGONAL_HESSIAN = (Gaussian, Bernoulli, HeteroscedasticGaussian)


def summed_hessian(likelihood: Likelihood, f: Tensor, out: Tensor | None = None) -> Tensor:
    """sum_n Lambda_n, shape (C, C), without an (N, C, C) intermediate where the likelihood's
    structure allows: softmax diag(sum_n p_n) - P^T P (Lambda_n = diag(p_n) - p_n p_n^T),
    diag(sum_n hessian_diag) for the built-in diagonal ones; any other likelihood sums
    ``hessian`` over chunks of samples (each at most the Jacobian chunk budget). With ``out``
    (C, C) the sum is added to it in place (no C x C temporary).

    This is the B factor of an output layer's KFAC block (its pre-activation gradients are
    the columns of L_n themselves, so sum_n L_n L_n^T needs no backward pass)."""
    n, c = f.shape
    if out is None:
        out = f.new_zeros(c, c)
    if type(likelihood) is Categorical:
        p = likelihood.inverse_link(f).to(out.dtype)
        out.diagonal().add_(p.sum(0))
        return out.addmm_(p.T, p, alpha=-1)
    if type(likelihood) in _DIAGONAL_HESSIAN:
        out.diagonal().add_(likelihood.hessian_diag(f).sum(0).to(out.dtype))
        return out
    for sl in gj.chunk_slices(n, gj.auto_chunk_size(n, 4 * c * c)):
        out += likelihood.hessian(f[sl]).sum(0).to(out.dtype)
    return out


def as_hyperparameter(value: Tensor | float, name: str, like: Tensor) -> Tensor:
    """``value`` as a tensor with ``like``'s dtype and device, checked finite and > 0, keeping
    its autograd graph (marginal-likelihood tuning differentiates through it)."""
    if not isinstance(value, Tensor):
        # Python numbers straight to the target dtype (0.3 via float32 would be off by 1e-8).
        value = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if name == "prior_precision":
        tensor = check_prior(value)
    else:
        tensor = torch.as_tensor(value)
        if tensor.numel() != 1:
            raise ValueError(f"{name}: expected a scalar, got shape {tuple(tensor.shape)}")
        if not torch.isfinite(tensor).all() or (tensor <= 0).any():
            raise ValueError(f"{name}: must be finite and > 0, got {tensor}")
        tensor = tensor.reshape(())
    return tensor.to(dtype=like.dtype, device=like.device)


def check_batch(model: nn.Module, x: Tensor, y: Tensor) -> None:
    """The checks of one curvature batch: ``model`` in eval mode, ``x`` and ``y`` tensors
    with the same (non-zero) number of rows."""
    check_eval_mode(model)
    if not isinstance(x, Tensor) or not isinstance(y, Tensor):
        raise TypeError("x, y: expected tensors")
    if x.shape[0] == 0:
        raise ValueError("x: got an empty batch")
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"y: batch size {y.shape[0]} does not match x's {x.shape[0]}")


def check_offset(offset: Tensor | None, num_samples: int) -> Tensor | None:
    """Validate an output offset (N, C) for ``update`` (GLM refinement evaluates Lambda at the
    linearised outputs f + offset while keeping the Jacobians of the current weights)."""
    if offset is None:
        return None
    if not isinstance(offset, Tensor) or offset.ndim != 2 or offset.shape[0] != num_samples:
        shape = tuple(offset.shape) if isinstance(offset, Tensor) else type(offset).__name__
        raise ValueError(f"offset: expected shape (N, C) with N = {num_samples}, got {shape}")
    check_finite(offset, "offset: contains NaN or inf")
    return offset.detach()


def cholesky_psd(matrix: Tensor, what: str = "posterior precision") -> Tensor:
    """Lower Cholesky factor of a symmetric matrix that should be positive definite.

    If the factorisation fails, a diagonal jitter (at most 1e-6 of the mean diagonal) is added
    once with a warning naming it; if that fails too, a ``ValueError`` says the matrix is not
    positive definite.
    """
    factor, info = torch.linalg.cholesky_ex(matrix)
    if int(info) == 0:
        return factor
    diag = matrix.detach().diagonal()
    base = float(diag.abs().mean()) if diag.numel() else 1.0
    eye = torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)
    for rel in (1e-12, 1e-9, 1e-6):
        jitter = rel * base
        factor, info = torch.linalg.cholesky_ex(matrix + jitter * eye)
        if int(info) == 0:
            warnings.warn(
                f"{what} is not numerically positive definite; added jitter {jitter:.3g} "
                f"({rel:g} x mean diagonal) to its diagonal before the Cholesky factorisation",
                RuntimeWarning,
                stacklevel=3,
            )
            return factor
    min_eig = float(torch.linalg.eigvalsh(matrix.detach()).min())
    raise ValueError(
        f"{what} is not positive definite (smallest eigenvalue {min_eig:.3g}, Cholesky failed "
        f"even with jitter {1e-6 * base:.3g}); check that prior_precision and scale are > 0 "
        "and that the curvature is positive semi-definite"
    )


def _max_abs(t: Tensor) -> float:
    """max |t| from one min/max reduction (no |t| copy); NaN if t has a NaN."""
    if t.numel() == 0:
        return 0.0
    lo, hi = torch.aminmax(t.detach())
    return max(-float(lo), float(hi)) if not bool(torch.isnan(lo)) else math.nan


def _cannot_overflow(bound: float, out: Tensor) -> bool:
    """Whether out + T stays finite for any T with |entries| <= ``bound``: kept below 1/4 of
    the dtype's largest number (False for a NaN bound)."""
    return bound + _max_abs(out) < 0.25 * torch.finfo(out.dtype).max


def _sum_cannot_overflow(
    phi: Tensor, slices: list[slice], middle: Callable[[slice], Tensor], out: Tensor
) -> bool:
    """Whether out + [sum_n m_n ⊗ phi_n^2, sum_n m_n] (m_n = ``middle`` rows, in the given
    row chunks) is finite for sure: every term is finite and |entry| <= max|out| +
    N max|m| max(phi^2, 1), which is kept below 1/4 of the dtype's largest number (as is
    max phi^2, formed in the dtype)."""
    total = 0.0
    for sl in slices:
        bound = _max_abs(middle(sl))
        if not math.isfinite(bound):
            return False
        total += (sl.stop - sl.start) * bound
    top = _max_abs(phi)
    if not top < math.sqrt(0.25 * torch.finfo(out.dtype).max):  # phi^2 representable, not NaN
        return False
    return _cannot_overflow(total * max(top * top, 1.0), out)


def check_diagonal(diag: Tensor, subset: ParameterSubset, model: nn.Module) -> None:
    """Record (:func:`gaussify.deferred_checks.check`) that the accumulated diagonal
    ``diag`` (P,) is finite, from the largest entry of each parameter tensor (one
    ``_foreach_max``: a GGN diagonal is >= 0, so NaN or +inf reach the maximum, and a sum
    that became NaN or infinite stays so), naming the first tensor that is not, as the
    per-batch checks do. Used by :meth:`GaussNewtonCurvature._diag_batch` inside a fit's deferred
    scope, where a batch is added without those checks (diag, and low-rank's diagonal)."""
    if subset.indices is not None or not diag.numel():  # a subnetwork: one test
        check_finite(diag, "x: the batch gives a NaN or infinite curvature")
        return
    maxima = torch._foreach_max(list(torch.split(diag, list(subset.numels))))

    def message(i: int, value: Tensor) -> str:
        return gj.nonfinite_jacobian_message(subset, model, i, gj.value_kind(value))

    check_finite_values(maxima, message)


# --------------------------------------------------------------------------- shared base class


class GaussNewtonCurvature:
    """State and batch loop shared by the Jacobian-based structures (full, diag, low-rank).

    Holds the likelihood, subset, flavour (GGN / empirical Fisher / Monte Carlo) and chunking;
    subclasses only say how to accumulate the per-chunk products (J_n^T L_n)^T of shape
    (B, K, P). When the subset is exactly the final ``nn.Linear`` the products come from its
    input features via the Kronecker identity (:mod:`gaussify.curvature.lastlayer`), otherwise
    from ``torch.func`` per-sample vector-Jacobian products.

    Arguments: ``likelihood`` a name or object (:func:`gaussify.likelihoods.get_likelihood`);
    ``subset`` "all", "last_layer", a list of module / parameter names, a subnetwork (mask or
    indices over individual weights, :mod:`gaussify.curvature.subset`) or a ParameterSubset;
    ``ef`` use the empirical Fisher instead of the GGN; ``mc_samples`` > 0 estimates Lambda from
    that many sampled labels per input (0 = exact); ``chunk_size`` samples per chunk (default:
    a fixed memory budget); ``generator`` seeds the label samples; ``last_layer_identity``
    enables the feature path for a final linear layer.
    """

    structure: ClassVar[str] = ""

    def __init__(
        self, model: nn.Module, likelihood: str | Likelihood, subset: SubsetLike = "all", *,
        ef: bool = False, mc_samples: int = 0, chunk_size: int | None = None,
        generator: torch.Generator | None = None, last_layer_identity: bool = True,
    ) -> None:  # fmt: skip
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        self.likelihood = get_likelihood(likelihood)
        self.subset = resolve_subset(model, subset, subnetwork=True)
        if not isinstance(ef, bool):
            raise TypeError(f"ef: expected a bool, got {type(ef).__name__}")
        if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 0:
            raise ValueError(f"mc_samples: expected an integer >= 0, got {mc_samples!r}")
        if ef and mc_samples:
            raise ValueError(
                "mc_samples: the empirical Fisher (ef=True) uses the observed labels; "
                "set mc_samples=0 or ef=False"
            )
        gj.auto_chunk_size(1, 1, chunk_size)  # validates
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator: expected a torch.Generator, got {type(generator)}")
        self.ef = ef
        self.mc_samples = mc_samples
        self.chunk_size = chunk_size
        self.generator = generator
        self._layer: OutputLinear | None = (
            find_output_linear(model, self.subset) if last_layer_identity else None
        )
        reference = dict(model.named_parameters())[self.subset.names[0]]
        self.dtype = reference.dtype
        self.device = reference.device
        self.num_data = 0
        #: (f (N, C), phi (N, D) or None) of the batch of the latest ``update`` where the
        #: structure ran a forward pass of its own (f includes the offset, i.e. the outputs
        #: where Lambda was evaluated), else None; lets a caller that also needs the outputs
        #: (``Laplace.fit``: log-likelihood and gradient) skip its own forward pass.
        self.last_outputs: tuple[Tensor, Tensor | None] | None = None
        #: keep ``last_outputs`` at all (``Laplace.fit`` asks for them; a bare curvature fit
        #: does not, so it holds no batch-sized tensors between updates)
        self.keep_outputs = False
        #: J^T r wanted with the next ``update`` (``Laplace.fit`` sets it per batch; the
        #: diagonal's batched route adds it in its own passes and sets ``added``)
        self.gradient_sink: GradientSink | None = None
        #: the batched route's chunk plans by shapes and settings, computed once per fit
        #: (:func:`gaussify.curvature.chain_diag.chain_squared_sums`)
        self._plans: dict[Any, Any] = {}

    @property
    def num_params(self) -> int:
        return self.subset.num_params

    def _storage_elements(self) -> int:
        """Elements of the accumulated curvature (P for a diagonal; overridden by structures
        that store more)."""
        return self.num_params

    def _chunk_budget(self) -> int:
        """Elements one chunk's intermediates may hold: half the curvature's own storage, so
        that a fit's peak memory stays within about twice that storage, clamped to
        [MIN_CHUNK_ELEMENTS, DEFAULT_CHUNK_ELEMENTS] (tiny curvatures do not loop over single
        samples; huge ones keep the fixed budget)."""
        half = self._storage_elements() // 2
        return min(gj.DEFAULT_CHUNK_ELEMENTS, max(gj.MIN_CHUNK_ELEMENTS, half))

    def _chunk(self, num_samples: int, per_sample: int) -> int:
        """Samples per chunk: ``chunk_size`` if given, else what fits :meth:`_chunk_budget`."""
        if self.chunk_size is not None:
            return self.chunk_size
        return max(1, min(num_samples, self._chunk_budget() // max(per_sample, 1)))

    # -- batch helpers -------------------------------------------------------------------

    def _check_batch(self, model: nn.Module, x: Tensor, y: Tensor) -> None:
        self.last_outputs = None
        check_batch(model, x, y)
        named = dict(model.named_parameters())
        for name, shape in zip(self.subset.names, self.subset.shapes, strict=True):
            if name not in named or named[name].shape != shape:
                raise ValueError(
                    f"model: parameter {name!r} of the subset is missing or changed shape; "
                    "use the model this curvature was built for"
                )

    def _forward(
        self, model: nn.Module, x: Tensor, offset: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Outputs f (N, C) (plus ``offset``, where Lambda is evaluated) and, on the last-layer
        path, the features phi (N, D)."""
        with torch.no_grad():
            f, phi = forward_with_features(model, x, self._layer)
        if not isinstance(f, Tensor) or f.ndim != 2:
            shape = tuple(f.shape) if isinstance(f, Tensor) else type(f).__name__
            raise ValueError(f"model: expected outputs of shape (N, C), got {shape}")
        check_finite(
            f,
            "x: the model's outputs are NaN or infinite for this batch (check the inputs); "
            "the accumulated curvature is unchanged",
        )
        f = f.detach() if offset is None else f.detach() + offset.to(f.dtype)
        phi = None if phi is None else phi.detach()
        if self.keep_outputs:
            self.last_outputs = (f, phi)
        return f, phi

    def _draw(self, f: Tensor) -> Tensor | None:
        """Sampled labels (S, N, ...) for the Monte Carlo GGN, drawn in chunks of rows whose
        temporaries (S copies of the outputs, the softmax, ...) hold at most
        MIN_CHUNK_ELEMENTS numbers; the chunking depends only on S and C, so every structure
        draws the same labels from the same generator."""
        if not self.mc_samples:
            return None
        n, c = f.shape
        rows = max(1, gj.MIN_CHUNK_ELEMENTS // (self.mc_samples * c))
        parts = [
            draw_labels(self.likelihood, f[sl], self.mc_samples, self.generator)
            for sl in gj.chunk_slices(n, rows)
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _factor(self, f: Tensor, y: Tensor, draws: Tensor | None) -> Tensor:
        return middle_factor(self.likelihood, f, y, ef=self.ef, draws=draws)

    def _factor_diag(self, f: Tensor, y: Tensor, draws: Tensor | None) -> Tensor:
        return middle_diag(self.likelihood, f, y, ef=self.ef, draws=draws)

    def _num_factors(self, num_outputs: int) -> int:
        if self.ef:
            return 1
        return self.mc_samples or num_outputs

    def _products(
        self,
        model: nn.Module,
        x: Tensor | None,
        y: Tensor,
        f: Tensor,
        phi: Tensor | None,
        draws: Tensor | None,
    ) -> Iterator[Tensor]:
        """Chunks of per-sample products (J_n^T L_n)^T, each (B, K, P) (``x`` is only needed
        off the last-layer feature path)."""
        n = f.shape[0]
        k = self._num_factors(f.shape[1])
        # a subnetwork's products are formed over its support tensors, then gathered
        chunk = self._chunk(n, k * self.subset.support.num_params)
        for sl in gj.chunk_slices(n, chunk):
            factor = self._factor(f[sl], y[sl], None if draws is None else draws[:, sl])
            if phi is not None and self._layer is not None:
                yield lastlayer_products(phi[sl], factor, self._layer)
            else:
                if x is None:
                    raise ValueError("x: inputs are needed off the last-layer feature path")
                yield per_sample_vjp(
                    model, x[sl], self.subset, factor.transpose(1, 2), chunk_size=chunk
                )

    def _lastlayer_diag(
        self, f: Tensor, phi: Tensor, y: Tensor, draws: Tensor | None, out: Tensor | None
    ) -> Tensor:
        """The batch's diagonal on the last-layer path, [sum_n diag(M_n) ⊗ phi_n^2,
        sum_n diag(M_n)] (:func:`lastlayer_diag`), added to ``out`` (P,) (or to a new (P,)
        vector when ``out`` is None), which is returned.

        diag(M_n) is formed in chunks of rows (the likelihood's (B, C) temporaries, softmax,
        its square, one-hot, ..., dominate a many-class batch), twice: a first pass only
        bounds it. When the features and diag(M_n) are finite and the bound
        rows * max|diag(M)| * max(phi^2, 1) + max|out| is far from the dtype's largest number,
        no entry of the sum can overflow, so the batch is added to ``out`` directly and no
        P-sized temporary exists (the curvature's own storage is then the only P-sized
        tensor). Otherwise it is summed into a temporary first and added only when complete
        and finite, so a failing batch leaves ``out`` unchanged."""
        assert self._layer is not None
        n, c = f.shape
        # about 8 (B, C) temporaries for sampled labels: one-hot, softmax, residual, square
        slices = list(gj.chunk_slices(n, self._chunk(n, 8 * c)))

        def middle(sl: slice) -> Tensor:
            return self._factor_diag(f[sl], y[sl], None if draws is None else draws[:, sl])

        check_finite(
            phi,
            "x: the batch gives a NaN or infinite curvature (features of the output layer "
            "not finite); the accumulated curvature is unchanged",
        )
        target = out
        if out is not None and deferring():
            pass  # added directly: the fit tests the sum once (check_diagonal), no bound
        elif target is None or not _sum_cannot_overflow(phi, slices, middle, target):
            target = torch.zeros(self.num_params, dtype=self.dtype, device=self.device)
        for sl in slices:
            lastlayer_diag(phi[sl], middle(sl), self._layer, out=target)
        if target is out:
            return out
        if not all_finite(target):
            raise ValueError(
                "x: the batch gives a NaN or infinite curvature (features of the output layer "
                "not finite); the accumulated curvature is unchanged"
            )
        return target if out is None else out.add_(target)

    def _diag_batch(
        self,
        model: nn.Module,
        x: Tensor,
        y: Tensor,
        offset: Tensor | None = None,
        out: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """(diag of the batch's G (P,), f (N, C), phi (N, D) or None, draws or None).

        On the last-layer path from features alone; otherwise per-layer for plain linear
        layers and per-sample ``torch.func`` products for everything else
        (:func:`gaussify.curvature.jacobian.squared_vjp_sum`). With ``out`` (P,) the batch's
        diagonal is added to it and ``out`` is returned. A batch that fails (NaN outputs or
        Jacobians) leaves ``out`` unchanged: off the last-layer path the batch is summed into
        a P-sized temporary first and added only once it is complete and finite; on it, it is
        added directly when it provably cannot overflow (:meth:`_lastlayer_diag`).
        """
        phi: Tensor | None = None
        if self._layer is not None:
            f, phi = self._forward(model, x, offset)
            if phi is not None:
                draws = self._draw(f)
                target = self._lastlayer_diag(f, phi, y, draws, out)
                if out is not None and deferring():  # the sum recorded, tested once per fit
                    check_diagonal(out, self.subset, model)
                return target, f, phi, draws
        # a chain of linear layers adds the batch to ``out`` only once it is complete and
        # finite (squared_vjp_sum's ``atomic``): no P-sized temporary. Inside a fit's
        # deferred_checks scope nothing is checked per batch here (the fit tests the sum,
        # check_diagonal): added directly, no temporary on any route.
        deferred = out is not None and deferring()
        atomic = out is not None and linear_chain(model)
        batch = (
            out
            if atomic or deferred
            else torch.zeros(self.num_params, dtype=self.dtype, device=self.device)
        )
        held: dict[str, Tensor | None] = {}

        def cotangents(f: Tensor) -> Tensor:
            if offset is not None:
                f = f + offset.to(f.dtype)
            held["draws"] = self._draw(f)
            return self._factor(f, y, held["draws"]).transpose(1, 2)

        def row_cotangents(f: Tensor, rows: slice) -> Tensor:
            # the same factor for a chunk of rows (exact GGN and EF: no sampled labels)
            if offset is not None:
                f = f + offset[rows].to(f.dtype)
            return self._factor(f, y[rows], None).transpose(1, 2)

        def factor(f: Tensor) -> SqrtFactor | None:
            # the exact GGN's Lambda^{1/2} as a structured factor (built-in likelihoods)
            if offset is not None:
                f = f + offset.to(f.dtype)
            return sqrt_factor(self.likelihood, f)

        # squared_vjp_sum raises (naming the parameter) when the sum is not finite
        batch, f = squared_vjp_sum(
            model,
            x,
            self.subset,
            cotangents,
            self.chunk_size,
            budget=self._chunk_budget(),
            out=batch,
            row_cotangents=None if self.mc_samples else row_cotangents,
            atomic=atomic,
            factor=None if self.mc_samples or self.ef else factor,
            checked=not deferred,
            # K = 1 (EF) or S (Monte Carlo) for sure; a likelihood's Lambda^1/2 may be C x K
            num_vectors=self._num_factors if self.ef or self.mc_samples else None,
            plans=self._plans,
            gradient=self._sink(offset),
        )
        f = f.detach() if offset is None else f.detach() + offset.to(f.dtype)
        if self.keep_outputs:
            self.last_outputs = (f, None)
        if out is not None and not atomic and not deferred:
            batch = out.add_(batch)
        if deferred and out is not None:  # the sum recorded, tested once per fit
            check_diagonal(out, self.subset, model)
        return batch, f, None, held.get("draws")

    def _sink(self, offset: Tensor | None) -> GradientSink | None:
        """The ``gradient_sink`` for this batch's passes (none with an offset: the fit's
        linearised outputs take their own gradient); marked ``shared`` for the empirical
        Fisher, whose one vector is the residual r at the observed y itself."""
        if self.gradient_sink is None or offset is not None:
            return None
        self.gradient_sink.shared = self.ef
        return self.gradient_sink

    def state_schema(self) -> dict[str, Any]:
        """The declarative schema of :meth:`state_dict` (:mod:`gaussify.state`)."""
        raise NotImplementedError

    def _validated_state(self, state: dict[str, Tensor]) -> dict[str, Any]:
        """``state`` checked against :meth:`state_schema` as a whole (keys, shapes, the
        curvature's dtype, finiteness) before anything is assigned; tensors on its device."""
        valid = validate_state(
            state, self.state_schema(), owner=type(self).__name__, dims={"P": self.num_params}
        )
        return {
            k: v.to(device=self.device) if isinstance(v, Tensor) else v for k, v in valid.items()
        }
