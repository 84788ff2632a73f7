"""GP classification as heteroscedastic GP regression (Bui, Sec. 4.2 and App. B; Milios et al.
2018).

The Gaussian pseudo-likelihoods of :mod:`gaussify.approx_likelihoods.pseudo_targets` turn a
C-class problem into C independent GP regressions: latent function ``f_c ~ GP(m_c, k_c)`` per
class (one per logit), observed through ``y~_nc ~ N(f_c(x_n), v~_nc)`` with the pseudo-targets
``y~`` and their variances ``v~`` as *fixed* heteroscedastic noise. Everything is then exact:

* kernel: ``k_c(x, x') = s_c exp(-0.5 sum_d (x_d - x'_d)^2 / l_cd^2)`` (RBF; one lengthscale or
  one per input dimension with ``ard=True``);
* mean: a constant offset ``m_c`` per class. The off-class pseudo-targets sit near
  ``log alpha_eps`` (about -5 for ``alpha_eps = 0.01``), far from zero, so a zero-mean prior
  would spend its variance on the offset. ``m_c`` is profiled out: for fixed kernel
  hyperparameters the log marginal likelihood is maximised by the generalised least-squares
  estimate ``m_c = 1^T A_c^-1 y~_c / 1^T A_c^-1 1`` with ``A_c = K_c + diag(v~_c)``, so the
  optimum over ``(s, l, m)`` is the optimum of the profiled objective over ``(s, l)``;
* log marginal likelihood per class (Rasmussen & Williams eq. 2.30 with fixed noise)
  ``log p(y~_c) = -0.5 r^T A_c^-1 r - sum_i log L_ii - N/2 log 2 pi``, ``r = y~_c - m_c``,
  ``A_c = L L^T``; the total is the sum over classes;
* hyperparameters ``log s`` and ``log l`` by maximising the total with the shared L-BFGS of
  :mod:`gaussify.tuning` (gradients through ``torch.linalg`` Cholesky factors);
  ``hyperparameters="per_class"`` gives every class its own ``(s_c, l_c)`` (the classes then
  decouple, as in gpytorch's batch model), ``"shared"`` one pair for all classes (as in Fig. 3);
* latent predictive ``mu_c(x) = m_c + k_c(x)^T A_c^-1 r``,
  ``var_c(x) = s_c - k_c(x)^T A_c^-1 k_c(x)``;
* class probabilities ``E[softmax(f)]`` over the independent latent Gaussians by Monte Carlo
  (the paper's "sample psi ... and warp them through the softmax", Sec. 3.2), or the
  probit / Laplace-bridge approximations of :mod:`gaussify.predictive`, or the softmax of the
  predictive mean (the paper's point-estimate alternative).

In the logit basis (binary, :class:`~gaussify.approx_likelihoods.BetaGaussian`) there is one
latent function and the inverse link is the sigmoid.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from torch import Tensor

from gaussify.approx_likelihoods.pseudo_targets import (
    Basis,
    BetaGaussian,
    DirichletGaussian,
    Method,
    check_labels,
    pseudo_likelihood,
)
from gaussify.memory_guard import check_allocation
from gaussify.posterior import DeclaredCapabilities
from gaussify.predictive import Predictive, laplace_bridge, probit
from gaussify.state import (
    Choice,
    Flag,
    Integer,
    StateError,
    TensorSpec,
    copy_state,
    transactional,
    validate_state,
)
from gaussify.tuning import BOUND_DECADES, maximize
from gaussify.validation import check_count, check_finite
from gaussify.warnings import CollapsedSignalWarning, ConvergenceWarning

__all__ = [
    "FLAT_RELATIVE_VARIANCE",
    "GP_LINKS",
    "GPClassifier",
    "GPFitResult",
    "heteroscedastic_cholesky",
    "heteroscedastic_lml",
    "latent_predictive",
    "rbf_kernel",
]

Hyperparameters = Literal["per_class", "shared"]
MeanMode = Literal["constant", "zero"]
GPLink = Literal["mc", "probit", "bridge", "mean"]
GP_LINKS: tuple[str, ...] = ("mc", "probit", "bridge", "mean")
_LOG_2PI = math.log(2.0 * math.pi)
#: A latent function is *flat* when its fitted signal variance is below this fraction of the
#: variance of its pseudo-targets: the evidence is then maximised by the constant mean.
FLAT_RELATIVE_VARIANCE = 1e-6


# ------------------------------------------------------------------------ pure functions


def rbf_kernel(x1: Tensor, x2: Tensor, lengthscale: Tensor, variance: Tensor) -> Tensor:
    """Exponentiated-quadratic kernel for a batch of H hyperparameter sets.

    ``k_h(x, x') = variance_h exp(-0.5 ||(x - x') / lengthscale_h||^2)`` for ``x1 (N, D)``,
    ``x2 (M, D)``, ``lengthscale (H, D)`` (ARD) or ``(H, 1)``, ``variance (H,)``; returns
    ``(H, N, M)``. Differentiable in both hyperparameters.
    """
    z1 = x1.unsqueeze(0) / lengthscale.unsqueeze(-2)  # (H, N, D)
    z2 = x2.unsqueeze(0) / lengthscale.unsqueeze(-2)  # (H, M, D)
    sq = (
        z1.square().sum(-1).unsqueeze(-1)
        + z2.square().sum(-1).unsqueeze(-2)
        - 2.0 * z1 @ z2.transpose(-1, -2)
    )
    return variance.reshape(-1, 1, 1) * torch.exp(-0.5 * sq.clamp_min(0.0))


def heteroscedastic_cholesky(
    kernel: Tensor, noise: Tensor, what: str = "K + diag(noise)"
) -> Tensor:
    """Lower Cholesky factors of ``A_c = K_c + diag(noise_c)`` for ``kernel (C, N, N)`` (or
    ``(1, N, N)``, shared) and ``noise (C, N)``.

    ``noise > 0`` makes every ``A_c`` positive definite in exact arithmetic. If a factorisation
    still fails (round-off with a huge signal variance or a tiny noise), a diagonal jitter of
    ``1e-10 .. 1e-4`` times the mean diagonal is added with a ``RuntimeWarning`` that names it;
    if that fails too a ``ValueError`` is raised.
    """
    eye = torch.eye(kernel.shape[-1], dtype=kernel.dtype, device=kernel.device)
    matrix = kernel + torch.diag_embed(noise)
    chol, info = torch.linalg.cholesky_ex(matrix)
    if not bool((info > 0).any()):
        return chol
    base = float(matrix.detach().diagonal(dim1=-2, dim2=-1).mean())
    for rel in (1e-10, 1e-8, 1e-6, 1e-4):
        jitter = rel * base
        chol, info = torch.linalg.cholesky_ex(matrix + jitter * eye)
        if not bool((info > 0).any()):
            warnings.warn(
                f"{what}: not numerically positive definite; added jitter {jitter:.3g} "
                f"({rel:g} x mean diagonal) before the Cholesky factorisation",
                RuntimeWarning,
                stacklevel=2,
            )
            return chol
    raise ValueError(
        f"{what}: not positive definite even with jitter {1e-4 * base:.3g}; the kernel "
        "hyperparameters are degenerate (NaN, or a variance far above the noise)"
    )


def _lml_terms(chol: Tensor, targets: Tensor, mean: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    n = targets.shape[-1]
    if mean is None:
        ones = torch.ones_like(targets)
        sol = torch.cholesky_solve(torch.stack([targets, ones], dim=-1), chol)  # (C, N, 2)
        mean = sol[..., 0].sum(-1) / sol[..., 1].sum(-1)
        weights = sol[..., 0] - mean.unsqueeze(-1) * sol[..., 1]
    else:
        resid = targets - mean.unsqueeze(-1)
        weights = torch.cholesky_solve(resid.unsqueeze(-1), chol).squeeze(-1)
    quad = ((targets - mean.unsqueeze(-1)) * weights).sum(-1)
    logdet = 2.0 * torch.log(chol.diagonal(dim1=-2, dim2=-1)).sum(-1)
    return -0.5 * (quad + logdet + n * _LOG_2PI), mean, weights


class _HeteroscedasticLML(torch.autograd.Function):
    """``log N(y_c; m_c 1, K_c + diag(v_c))`` per class with the analytic gradient
    ``d lml / d A = 0.5 (w w^T - A^-1)``, ``d lml / d y = -w`` (``w = A^-1 (y - m)``).

    With the profiled mean the same formulas hold: ``d lml / d m = 1^T w = 0`` at the
    maximiser, so its dependence on ``A`` and ``y`` drops out (envelope theorem). One
    ``cholesky_inverse`` replaces the backward of the Cholesky factorisation (about half the
    work of differentiating through ``torch.linalg.cholesky``).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        kernel: Tensor,
        noise: Tensor,
        targets: Tensor,
        mean: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        chol = heteroscedastic_cholesky(kernel, noise)
        lml, m, weights = _lml_terms(chol, targets, mean)
        ctx.save_for_backward(chol, weights)
        ctx.mark_non_differentiable(m, weights, chol)
        return lml, m, weights, chol

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, g_lml: Tensor, *_: Tensor
    ) -> tuple[Tensor | None, ...]:
        chol, weights = ctx.saved_tensors  # type: ignore[attr-defined]
        g = g_lml.reshape(-1, 1, 1)
        g_kernel = None
        g_noise = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:  # type: ignore[attr-defined]
            g_a = (
                0.5
                * g
                * (weights.unsqueeze(-1) * weights.unsqueeze(-2) - torch.cholesky_inverse(chol))
            )
            g_kernel = g_a if ctx.needs_input_grad[0] else None  # type: ignore[attr-defined]
            g_noise = g_a.diagonal(dim1=-2, dim2=-1) if ctx.needs_input_grad[1] else None  # type: ignore[attr-defined]
        g_targets = -g_lml.unsqueeze(-1) * weights if ctx.needs_input_grad[2] else None  # type: ignore[attr-defined]
        return g_kernel, g_noise, g_targets, None


def heteroscedastic_lml(
    kernel: Tensor, noise: Tensor, targets: Tensor, mean: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Exact log marginal likelihood of C independent GP regressions with fixed noise.

    ``kernel (C, N, N)`` prior covariances, ``noise (C, N)`` the fixed noise variances,
    ``targets (C, N)``; ``mean (C,)`` the constant prior mean, or None to profile it out by its
    maximiser ``m_c = 1^T A_c^-1 y_c / 1^T A_c^-1 1`` (``A_c = K_c + diag(noise_c)``). Returns
    ``(lml (C,), mean (C,), weights (C, N), chol (C, N, N))`` with
    ``log p(y_c) = -0.5 r^T A_c^-1 r - sum_i log L_ii - N/2 log 2 pi``, ``r = y_c - m_c``,
    ``weights = A_c^-1 r`` and ``A_c = L L^T`` (:func:`heteroscedastic_cholesky`).
    Differentiable in ``kernel``, ``noise`` and ``targets`` (analytic backward; a given
    ``mean`` is treated as a constant).
    """
    if mean is not None:
        mean = mean.detach()
    return _HeteroscedasticLML.apply(kernel, noise, targets, mean)  # type: ignore[no-any-return]


def latent_predictive(
    k_cross: Tensor, k_diag: Tensor, chol: Tensor, weights: Tensor, mean: Tensor
) -> tuple[Tensor, Tensor]:
    """Latent GP predictive per class: ``mu = m + k_*^T A^-1 r``, ``var = k_** - k_*^T A^-1 k_*``.

    ``k_cross (C, N, M)`` train-test kernel, ``k_diag (C, M)`` prior variances at the test
    inputs, ``chol (C, N, N)``, ``weights (C, N) = A^-1 r``, ``mean (C,)``. Returns
    ``(mu (M, C), var (M, C))`` (the variance clamped at 0 against round-off).
    """
    mu = mean.unsqueeze(-1) + (k_cross * weights.unsqueeze(-1)).sum(-2)
    v = torch.linalg.solve_triangular(chol, k_cross, upper=False)
    var = (k_diag - v.square().sum(-2)).clamp_min(0.0)
    return mu.transpose(0, 1), var.transpose(0, 1)


# ------------------------------------------------------------------------- the model


@dataclass
class GPFitResult:
    """What :meth:`GPClassifier.fit` found: the total log marginal likelihood ``lml`` and its
    per-class terms, the number of objective evaluations and L-BFGS iterations, the final
    gradient norm of the (per-point) objective, the trace of ``-lml / (N C)``, and ``flat``:
    the latent functions whose fitted signal variance fell below
    :data:`FLAT_RELATIVE_VARIANCE` times the variance of their pseudo-targets (their posterior
    is the constant mean ``m_c``: :meth:`GPClassifier.flat_functions`)."""

    lml: float
    lml_per_class: list[float]
    evaluations: int
    iterations: int
    grad_norm: float
    converged: bool
    trace: list[float] = field(default_factory=list)
    flat: list[int] = field(default_factory=list)


def _check_x(x: object, name: str = "x", dim: int | None = None) -> Tensor:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor (N, D)")
    if x.ndim != 2:
        raise ValueError(f"{name}: expected shape (N, D) with N >= 1, got {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError(f"{name}: contains no examples")
    if dim is not None and x.shape[1] != dim:
        raise ValueError(f"{name}: expected {dim} features (as in training), got {x.shape[1]}")
    check_finite(x, name)  # names the first bad row and NaN / inf
    return x


def _positive(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a positive float, got {type(value).__name__}")
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name}: must be positive and finite, got {value}")
    return float(value)


class GPClassifier(DeclaredCapabilities):
    """Exact GP classification with a Gaussian likelihood approximation (Bui, Sec. 4.2).

    ``method``: ``moment-ori`` (Milios et al. 2018; gpytorch's
    ``DirichletClassificationLikelihood``) | ``moment`` | ``laplace`` | ``variational`` |
    ``gauss`` (label regression with noise ``noise``); ``basis``: ``"log"`` (softmax, C latent
    functions) or ``"logit"`` (sigmoid, binary, one latent function); ``alpha_eps`` (and
    ``beta_eps``) the pseudo-counts. Kernel: RBF with ``ard`` lengthscales per input dimension,
    ``hyperparameters="per_class"`` (each latent function its own lengthscale(s) and variance)
    or ``"shared"``; ``mean="constant"`` (per-class offset, profiled out) or ``"zero"``.
    ``lengthscale`` / ``variance``: initial values (default ``sqrt(D)`` and the variance of the
    pseudo-targets). Computations run in ``dtype`` (float64 by default).
    """

    unsupported: ClassVar[dict[str, str]] = {
        "sample": "a GP classifier is a posterior over latent functions, with no weights to "
        "sample; use predict(x, link='mc') (function samples at the inputs) or "
        "predict_latent(x) for the marginal moments",
    }

    def __init__(
        self,
        method: Method = "moment-ori",
        alpha_eps: float = 0.01,
        *,
        basis: Basis = "log",
        beta_eps: float | None = None,
        noise: float = 0.1,
        ard: bool = False,
        hyperparameters: Hyperparameters = "per_class",
        mean: MeanMode = "constant",
        lengthscale: float | None = None,
        variance: float | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        self.likelihood: DirichletGaussian | BetaGaussian = pseudo_likelihood(
            method, basis, alpha_eps, beta_eps=beta_eps, noise=noise
        )
        if hyperparameters not in ("per_class", "shared"):
            raise ValueError(
                f"hyperparameters: expected 'per_class' or 'shared', got {hyperparameters!r}"
            )
        if mean not in ("constant", "zero"):
            raise ValueError(f"mean: expected 'constant' or 'zero', got {mean!r}")
        if not isinstance(ard, bool):
            raise TypeError(f"ard: expected a bool, got {type(ard).__name__}")
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype: expected torch.float32 or torch.float64, got {dtype!r}")
        self.ard = ard
        self.hyperparameters = hyperparameters
        self.mean_mode = mean
        self.init_lengthscale = (
            None if lengthscale is None else _positive(lengthscale, "lengthscale")
        )
        self.init_variance = None if variance is None else _positive(variance, "variance")
        self.dtype = dtype
        self.num_classes: int | None = None
        self.log_lengthscale: Tensor | None = None  # (H, D or 1)
        self.log_variance: Tensor | None = None  # (H,)
        self.mean: Tensor | None = None  # (C,)
        self._x: Tensor | None = None
        self._targets: Tensor | None = None
        self._noise: Tensor | None = None
        self._chol: Tensor | None = None
        self._weights: Tensor | None = None
        self._y: Tensor | None = None

    # -- properties -----------------------------------------------------------------
    @property
    def method(self) -> str:
        return self.likelihood.method

    @property
    def basis(self) -> str:
        return self.likelihood.basis

    @property
    def num_outputs(self) -> int:
        """Number of latent functions (C in the log basis, 1 in the logit basis)."""
        if self.num_classes is None:
            raise RuntimeError("num_outputs: call fit(x, y) first")
        return self.likelihood.num_outputs(self.num_classes)

    @property
    def lengthscale(self) -> Tensor:
        """``(H, D)`` (ARD) or ``(H, 1)`` lengthscales; H = number of latent functions for
        ``per_class``, 1 for ``shared``."""
        return self._require(self.log_lengthscale, "lengthscale").exp()

    @property
    def variance(self) -> Tensor:
        """``(H,)`` signal variances."""
        return self._require(self.log_variance, "variance").exp()

    def _require(self, value: Tensor | None, what: str) -> Tensor:
        if value is None:
            raise RuntimeError(f"{what}: call fit(x, y) first")
        return value

    # -- data -----------------------------------------------------------------------
    def pseudo_targets(self, y: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
        """``(targets (C, N), noise (C, N))``: the pseudo-targets and their variances per
        latent function."""
        mean, var = self.likelihood.pseudo_targets(y, num_classes, dtype=self.dtype)
        return mean.reshape(y.shape[0], -1).T.contiguous(), var.reshape(
            y.shape[0], -1
        ).T.contiguous()

    @transactional
    def set_data(self, x: Tensor, y: Tensor, num_classes: int | None = None) -> GPClassifier:
        """Store the training data and the pseudo-targets, and initialise the hyperparameters
        (without optimising them). ``x (N, D)`` floating, ``y (N,)`` integer labels in
        ``[0, num_classes)`` (default ``max(y) + 1``, at least 2)."""
        x = _check_x(x)
        if not isinstance(y, Tensor):
            raise TypeError(f"y: expected an integer tensor of labels, got {type(y).__name__}")
        if y.ndim != 1 or y.shape[0] != x.shape[0]:
            raise ValueError(f"y: expected shape ({x.shape[0]},) to match x, got {tuple(y.shape)}")
        if x.shape[0] < 2:
            raise ValueError(f"x: needs at least 2 training points, got {x.shape[0]}")
        if num_classes is None:
            num_classes = (
                2 if self.basis == "logit" else max(int(check_labels(y, 2**62).max()) + 1, 2)
            )
        if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 2:
            raise ValueError(f"num_classes: must be an integer >= 2, got {num_classes!r}")
        y = check_labels(y, num_classes)
        latent, n = (num_classes if self.basis == "log" else 1), x.shape[0]
        check_allocation(
            latent * n * n,
            self.dtype,
            f"GPClassifier: the {latent} N x N kernel matrices and their Cholesky factors "
            f"(N = {n:,})",
            "a random subset of the training points, or ExactLastLayer / VBLL heads on features",
        )
        self.num_classes = num_classes
        self._x = x.to(self.dtype)
        self._targets, self._noise = self.pseudo_targets(y, num_classes)
        self._y = y
        outputs = self._targets.shape[0]
        heads = outputs if self.hyperparameters == "per_class" else 1
        dims = x.shape[1] if self.ard else 1
        ls0 = self.init_lengthscale or math.sqrt(x.shape[1])
        if self.init_variance is not None:
            var0 = torch.full((heads,), self.init_variance, dtype=self.dtype)
        else:
            spread = self._targets.var(-1).clamp_min(1e-2)
            var0 = spread if heads == outputs else spread.mean().reshape(1)
        self.log_lengthscale = torch.full((heads, dims), math.log(ls0), dtype=self.dtype)
        self.log_variance = var0.log().to(self.dtype)
        self._factorise()
        return self

    # -- the objective ----------------------------------------------------------------
    def train_kernel(
        self, log_lengthscale: Tensor | None = None, log_variance: Tensor | None = None
    ) -> Tensor:
        """Training kernel ``(H, N, N)`` at the given (default: current) log-hyperparameters."""
        x = self._require(self._x, "train_kernel")
        log_ls = self.log_lengthscale if log_lengthscale is None else log_lengthscale
        log_var = self.log_variance if log_variance is None else log_variance
        assert log_ls is not None and log_var is not None
        return rbf_kernel(x, x, log_ls.exp(), log_var.exp())

    def log_marginal_likelihood(
        self,
        log_lengthscale: Tensor | None = None,
        log_variance: Tensor | None = None,
        *,
        per_class: bool = False,
    ) -> Tensor:
        """Exact log marginal likelihood of the pseudo-targets, summed over the latent
        functions (``per_class=True``: the ``(C,)`` terms), at the given log-hyperparameters
        (default: the current ones); differentiable in them. With ``mean="constant"`` the
        offsets are profiled out (module docstring)."""
        kernel = self.train_kernel(log_lengthscale, log_variance)
        lml, _, _ = self._lml(kernel)
        return lml if per_class else lml.sum()

    def _lml(self, kernel: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        noise = self._require(self._noise, "log_marginal_likelihood")
        targets = self._require(self._targets, "log_marginal_likelihood")
        kernel = kernel.expand(noise.shape[0], -1, -1)
        mean = None if self.mean_mode == "constant" else torch.zeros_like(targets[:, 0])
        lml, m, weights, chol = heteroscedastic_lml(kernel, noise, targets, mean)
        self._last = (chol, m, weights)
        return lml, m, weights

    def _factorise(self) -> None:
        with torch.no_grad():
            self._lml(self.train_kernel())
        self._chol, self.mean, self._weights = (t.detach() for t in self._last)

    # -- fitting --------------------------------------------------------------------
    @transactional
    def fit(
        self,
        x: Tensor,
        y: Tensor,
        num_classes: int | None = None,
        *,
        optimize: bool = True,
        max_iter: int = 200,
        tolerance_grad: float = 1e-7,
    ) -> GPFitResult:
        """Set the data (:meth:`set_data`) and, with ``optimize``, maximise the log marginal
        likelihood over ``log lengthscale`` and ``log variance`` with the L-BFGS of
        :func:`gaussify.tuning.maximize` until the gradient of ``-lml / (N C)`` is below
        ``tolerance_grad`` (max-norm) or ``max_iter`` iterations (then a
        :class:`gaussify.warnings.ConvergenceWarning`). Returns a :class:`GPFitResult`."""
        self.set_data(x, y, num_classes)
        return self.optimize(max_iter=max_iter, tolerance_grad=tolerance_grad, enabled=optimize)

    @transactional
    def optimize(
        self, *, max_iter: int = 200, tolerance_grad: float = 1e-7, enabled: bool = True
    ) -> GPFitResult:
        """Maximise the log marginal likelihood from the current hyperparameters (warm start)
        with the shared optimiser of :mod:`gaussify.tuning` (L-BFGS on ``-lml / (N C)``, at
        most ``max_iter`` iterations, converged when the gradient max-norm is at most
        ``tolerance_grad`` (times max(1, |lml| / (N C))); a
        :class:`gaussify.warnings.ConvergenceWarning` otherwise); see :meth:`fit`."""
        max_iter = check_count(max_iter, "max_iter")
        _positive(tolerance_grad, "tolerance_grad")
        targets = self._require(self._targets, "optimize")
        scale = 1.0 / targets.numel()
        log_ls0 = self._require(self.log_lengthscale, "optimize")
        log_var0 = self._require(self.log_variance, "optimize")
        num_ls = log_ls0.numel()
        trace: list[float] = []

        def split(x: Tensor) -> tuple[Tensor, Tensor]:
            return x[:num_ls].reshape(log_ls0.shape), x[num_ls:]

        def objective(x: np.ndarray) -> tuple[float, np.ndarray]:
            t = torch.tensor(x, dtype=self.dtype, device=log_ls0.device, requires_grad=True)
            value = self.log_marginal_likelihood(*split(t)) * scale
            (grad,) = torch.autograd.grad(value, t)
            trace.append(-float(value.detach()))
            return float(value.detach()), grad.detach().to("cpu", torch.float64).numpy()

        x0 = torch.cat([log_ls0.flatten(), log_var0]).detach().to("cpu", torch.float64).numpy()
        x, iterations, converged = x0, 0, False
        if enabled:
            width = BOUND_DECADES[True] * math.log(10.0)
            opt = maximize(
                objective,
                x0,
                [(v - width, v + width) for v in x0],
                max_steps=max_iter,
                grad_tol=tolerance_grad,
                rel_tol=tolerance_grad,
            )
            x, iterations, converged = opt.x, opt.steps, opt.converged
            if not converged:
                warnings.warn(
                    f"GPClassifier.optimize: did not converge after {iterations} L-BFGS "
                    f"iterations (max |gradient| of -lml / (N C) = "
                    f"{float(np.max(np.abs(opt.grad))):.3g}; {opt.message}); raise max_iter",
                    ConvergenceWarning,
                    stacklevel=2,
                )
        evaluations = len(trace)
        final = torch.tensor(x, dtype=self.dtype, device=log_ls0.device, requires_grad=True)
        loss = -self.log_marginal_likelihood(*split(final)) * scale
        (grad,) = torch.autograd.grad(loss, final)
        grad_norm = float(grad.abs().max())
        log_ls, log_var = split(final.detach())
        self.log_lengthscale = log_ls.clone()
        self.log_variance = log_var.clone()
        self._factorise()
        per_class = self.log_marginal_likelihood(per_class=True).detach()
        flat = self.flat_functions()
        if enabled and flat:
            self._warn_flat(flat)
        return GPFitResult(
            lml=float(per_class.sum()),
            lml_per_class=[float(v) for v in per_class],
            evaluations=evaluations,
            iterations=iterations,
            grad_norm=grad_norm,
            converged=converged if enabled else grad_norm <= tolerance_grad,
            trace=trace[:evaluations],
            flat=flat,
        )

    def flat_functions(self) -> list[int]:
        """Indices of the latent functions whose signal variance ``s_c`` is below
        :data:`FLAT_RELATIVE_VARIANCE` times the variance of their pseudo-targets ``y~_c``.

        Such a function has the posterior mean ``m_c`` (the profiled constant) and variance
        ``s_c`` everywhere up to that fraction: its predictive ignores the inputs. This is what
        type-II maximum likelihood finds when the constant explains the pseudo-targets as
        noise, e.g. ``moment`` with ``alpha_eps`` well below 0.1: the off-class targets
        ``digamma(alpha_eps)`` deviate from the on-class ones by about ``1 / alpha_eps`` while
        their noise is ``trigamma(alpha_eps) ~ 1 / alpha_eps^2 + pi^2 / 6``, so each deviation
        is within one noise standard deviation."""
        targets = self._require(self._targets, "flat_functions")
        spread = targets.var(-1)
        var = self.variance.expand(targets.shape[0])
        return [int(c) for c in torch.nonzero(var < FLAT_RELATIVE_VARIANCE * spread).flatten()]

    def _warn_flat(self, flat: list[int]) -> None:
        targets = self._require(self._targets, "fit")
        noise = self._require(self._noise, "fit")
        c = flat[0]
        shown = ", ".join(str(i) for i in flat[:8]) + (", ..." if len(flat) > 8 else "")
        warnings.warn(
            f"GPClassifier.fit: the evidence is maximised by a constant latent function for "
            f"{len(flat)} of {targets.shape[0]} latent functions ({shown}): signal variance "
            f"{float(self.variance.expand(targets.shape[0])[c]):.3g} against a pseudo-target "
            f"variance of {float(targets[c].var()):.3g} (noise {float(noise[c].min()):.3g} to "
            f"{float(noise[c].max()):.3g}), so their predictive ignores the inputs. The "
            f"pseudo-noise of method {self.method!r} at alpha_eps={self.likelihood.alpha_eps} "
            "explains the labels; select alpha_eps on the training likelihood (larger values "
            "for 'moment' / 'laplace'), or use 'moment-ori' / 'variational'",
            CollapsedSignalWarning,
            stacklevel=4,
        )

    # -- prediction -----------------------------------------------------------------
    @torch.no_grad()
    def predict_latent(self, x: Tensor, chunk_size: int = 2048) -> tuple[Tensor, Tensor]:
        """Latent predictive ``(mean (M, C), var (M, C))`` at ``x (M, D)`` (module docstring),
        computed ``chunk_size`` test points at a time."""
        x_train = self._require(self._x, "predict")
        x = _check_x(x, dim=x_train.shape[1]).to(self.dtype)
        chunk_size = check_count(chunk_size, "chunk_size")
        assert self._chol is not None and self._weights is not None and self.mean is not None
        ls, var = self.lengthscale, self.variance
        outputs = self._chol.shape[0]
        means, variances = [], []
        for start in range(0, x.shape[0], chunk_size):
            xs = x[start : start + chunk_size]
            k_cross = rbf_kernel(x_train, xs, ls, var).expand(outputs, -1, -1)
            k_diag = var.reshape(-1, 1).expand(outputs, xs.shape[0])
            mu, v = latent_predictive(k_cross, k_diag, self._chol, self._weights, self.mean)
            means.append(mu)
            variances.append(v)
        return torch.cat(means), torch.cat(variances)

    def _probs(self, f: Tensor) -> Tensor:
        if self.basis == "logit":
            p = torch.sigmoid(f)
            return torch.cat([1 - p, p], dim=-1)
        return torch.softmax(f, dim=-1)

    @torch.no_grad()
    def predict(
        self,
        x: Tensor,
        *,
        link: GPLink = "mc",
        num_samples: int = 1000,
        generator: torch.Generator | None = None,
        chunk_size: int = 2048,
    ) -> Predictive:
        """Predictive at ``x (M, D)``: a :class:`~gaussify.predictive.Predictive` with the
        latent ``f_mean (M, C)``, the diagonal ``f_cov (M, C, C)`` and class probabilities
        ``probs (M, K)`` (K = 2 in the logit basis) by ``link``:

        * ``"mc"``: ``(1/S) sum_s softmax(f_s)``, ``f_s = mu + sqrt(var) eps_s`` with
          ``num_samples`` draws from ``generator`` (the paper's predictive);
        * ``"probit"``: ``softmax(mu / sqrt(1 + pi var / 8))``; ``"bridge"``: the Laplace bridge
          (log basis only); ``"mean"``: ``softmax(mu)`` (point estimate, no variance).
        """
        if link not in GP_LINKS:
            raise ValueError(f"link: expected one of {list(GP_LINKS)}, got {link!r}")
        num_samples = check_count(num_samples, "num_samples")
        if link == "bridge" and self.basis == "logit":
            raise ValueError("link: 'bridge' approximates softmax outputs; use 'probit' or 'mc'")
        mu, var = self.predict_latent(x, chunk_size)
        if link == "mc":
            probs = mu.new_zeros(mu.shape[0], self._probs(mu[:1]).shape[-1])
            std = var.sqrt()
            per = max(1, (2**22) // max(1, mu.numel()))  # samples per block: bounded memory
            for start in range(0, num_samples, per):
                s = min(per, num_samples - start)
                eps = torch.randn((s, *mu.shape), generator=generator, dtype=mu.dtype)
                eps = eps.to(mu.device)  # drawn where the generator lives, then moved
                probs += self._probs(mu + std * eps).sum(0)
            probs /= num_samples
        elif link == "probit":
            task = "binary" if self.basis == "logit" else "classification"
            probs = probit(mu, var, task)
            if self.basis == "logit":
                probs = torch.cat([1 - probs, probs], dim=-1)
        elif link == "bridge":
            probs = laplace_bridge(mu, var)
        else:
            probs = self._probs(mu)
        task = "binary" if self.basis == "logit" else "classification"
        return Predictive(task, mu, f_cov=torch.diag_embed(var), probs=probs)

    @transactional
    def optimize_prior(
        self,
        data: tuple[Tensor, Tensor] | None = None,
        *,
        max_iter: int = 200,
        tolerance_grad: float = 1e-7,
    ) -> GPClassifier:
        """Type-II maximum likelihood of the GP prior (the kernel's log lengthscales and log
        variances): :meth:`optimize` from the current values; ``data = (x, y)`` is set first
        (:meth:`set_data`, default starting hyperparameters) when the classifier has no data
        yet, as the other families fit first when not fitted. The evidence does not decrease
        from where it starts. Returns the classifier."""
        if data is not None and self._x is None:
            if not isinstance(data, tuple) or len(data) != 2:
                raise TypeError("data: expected an (x, y) pair of tensors or None")
            self.set_data(*data)
        self.optimize(max_iter=max_iter, tolerance_grad=tolerance_grad)
        return self

    def state_dict(self) -> dict[str, Any]:
        """The fitted classifier: its settings, the training data and the kernel
        hyperparameters (tensors and plain values; the factorisation is recomputed on load)."""
        self._require(self._x, "state_dict")
        return copy_state(
            {
                "method": self.method,
                "basis": self.basis,
                "hyperparameters": self.hyperparameters,
                "mean": self.mean_mode,
                "ard": self.ard,
                "num_classes": self.num_classes,
                "x": self._x,
                "y": self._y,
                "log_lengthscale": self.log_lengthscale,
                "log_variance": self.log_variance,
            }
        )

    @transactional
    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Restore :meth:`state_dict` into a classifier with the same settings (method,
        basis, hyperparameter sharing, mean, ARD); validated as a whole first
        (:mod:`gaussify.state`), a failed load changes nothing. ``strict`` is accepted for
        the posterior protocol: a GP holds no network weights to compare."""
        schema = {
            "method": Choice((self.method,), "the method of this classifier"),
            "basis": Choice((self.basis,), "the basis of this classifier"),
            "hyperparameters": Choice((self.hyperparameters,), "this classifier's sharing"),
            "mean": Choice((self.mean_mode,), "this classifier's mean"),
            "ard": Flag(self.ard, "this classifier's ARD setting"),
            "num_classes": Integer(2),
            "x": TensorSpec(("N", None), self.dtype),
            "y": TensorSpec(("N",), "int"),
            "log_lengthscale": TensorSpec(("H", None), self.dtype),
            "log_variance": TensorSpec(("H",), self.dtype),
        }
        valid = validate_state(state, schema, owner="GPClassifier")
        self.set_data(valid["x"].clone(), valid["y"].clone(), valid["num_classes"])
        assert self.log_lengthscale is not None and self.log_variance is not None
        if valid["log_lengthscale"].shape != self.log_lengthscale.shape or (
            valid["log_variance"].shape != self.log_variance.shape
        ):
            raise StateError(
                "GPClassifier.load_state_dict: invalid state: 'log_lengthscale' / "
                f"'log_variance': expected shapes {tuple(self.log_lengthscale.shape)} / "
                f"{tuple(self.log_variance.shape)} for these data and settings"
            )
        self.log_lengthscale = valid["log_lengthscale"].clone()
        self.log_variance = valid["log_variance"].clone()
        self._factorise()

    def predict_proba(self, x: Tensor, **kwargs: object) -> Tensor:
        """Class probabilities ``(M, K)``; keyword arguments as in :meth:`predict`."""
        probs = self.predict(x, **kwargs).probs  # type: ignore[arg-type]
        assert probs is not None
        return probs

    def __repr__(self) -> str:
        return (
            f"GPClassifier(method={self.method!r}, basis={self.basis!r}, "
            f"alpha_eps={self.likelihood.alpha_eps}, hyperparameters={self.hyperparameters!r}, "
            f"ard={self.ard}, mean={self.mean_mode!r})"
        )
