"""Type-II maximum likelihood: the one routine that tunes every family's hyperparameters.

Every posterior family exposes its log evidence log Z(delta, sigma) as a function of the prior
precision delta (K values: a scalar, one per parameter group, or one per parameter) and, for a
Gaussian likelihood, a scalar noise sigma. :func:`tune_hyperparameters` maximises it over the
log-hyperparameters x = (log delta_1..K, log sigma), from one of two sources:

* a closed form: an object with ``evidence(log_prior (K,), log_sigma | None)`` returning
  ``(log Z, d log Z / d log delta (K,), d log Z / d log sigma)`` in float64
  (:class:`gaussify.spectral.Spectrum`: O(P) per call, no autograd);
* an autograd objective: a callable ``(prior, sigma) -> log Z`` (scalar tensor, differentiable
  in both), e.g. a family's ``log_marginal_likelihood``; every call is wrapped into the same
  float64 ``x -> (log Z, gradient)`` form.

Scale-aware start. The noise starts at the residual RMS sqrt(SSE / (N C)) when the caller
passes it (``noise_start``): the maximiser of the Gaussian log-likelihood alone, from which the
evidence optimum differs by the effective number of parameters (sigma^2 = SSE / (N C - gamma)
for a linear model at its MAP). The prior starts at the best of the given value and a tied
log-grid delta_1 = ... = delta_K around the weights' own scale P / ||theta - m0||^2 (the
maximiser of the prior term alone; ``prior_centre``), +-8 decades for a float64 model and +-4
below (where a float32 curvature's evidence is not resolved far from that scale), every half
decade on a closed form and every decade on an autograd objective (one call = one
factorisation), evaluated at the noise start. The result is then independent of the start.

Optimiser. ``"lbfgs"`` (default): ``scipy.optimize.minimize(method="L-BFGS-B")`` on -log Z; a
box of +-10 decades (+-6 below float64) around the centre is enforced by a penalty rather than
passed to scipy, because with a bound on every variable its first trial is a full gradient step
(as long as the gradient: tens of e-folds, out of the region where the evidence can be
evaluated at all). Quasi-Newton steps with a line search
converge in tens of iterations where Adam at a fixed step needs thousands (100 Adam steps from
1e4 stop two orders of magnitude off); the line search stops resolving progress once the
change of log Z falls below its rounding, so a few quasi-Newton steps with L-BFGS's inverse
Hessian H then polish the result on the gradient alone. ``"adam"``: ``torch.optim.Adam``'s
update (betas (0.9, 0.999), eps 1e-8, step ``lr``) on the same objective, for users who want the
online behaviour; both end with the same convergence test.

Convergence test: ``max_i |d log Z / d x_i| <= max(grad_tol, rel_tol max(1, |log Z|))``
(nats per unit of log-hyperparameter; the relative term, at least sqrt(eps) of the objective's
dtype, is the rounding level of a gradient of a sum of O(|log Z|) terms), or, for L-BFGS, a
quasi-Newton distance to the stationary point ``max |H g| <= x_tol`` (1e-3: every
hyperparameter within 0.1%). A run that ends by its step budget, a stalled line search far from
the optimum, or a hyperparameter at its box (the evidence still increasing) is not converged:
the result says so (``converged=False``, ``message``) and a
:class:`gaussify.warnings.ConvergenceWarning` is emitted. The argument checks
(:func:`gaussify.validation.check_count`, :func:`check_positive`, :func:`check_grid`) raise
``ValueError`` naming the argument.

Progress (``progress=True``, the library's convention: a ``tqdm.auto`` bar on stderr, off by
default): the evidence evaluations are counted on one bar (``<caller>: evidence``, unit
"eval"); a long factorisation before them (a full GGN's ``eigvalsh`` / ``eigh``, which cannot
report its own progress) is shown as one stage by :func:`progress_stage`, whose elapsed time
is refreshed once a second while the factorisation runs.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import torch
from scipy import optimize as scipy_optimize
from torch import Tensor

from gaussify.validation import check_count
from gaussify.warnings import ConvergenceWarning

__all__ = [
    "ClosedFormEvidence",
    "ConvergenceWarning",
    "TuningResult",
    "check_choice",
    "check_count",
    "check_grid",
    "check_positive",
    "check_tuning_arguments",
    "decomposition_stage",
    "grid_search",
    "maximize",
    "prior_from_weights",
    "progress_stage",
    "residual_rms",
    "tune_hyperparameters",
]

Optimizer = Literal["lbfgs", "adam"]
OPTIMIZERS: tuple[str, ...] = ("lbfgs", "adam")
#: half-width (decades) of the tied start grid and of the box around the prior centre, for a
#: float64 model and for lower precision (where the evidence of a float32 curvature stops
#: being resolved beyond about 10^+-6 around the weights' scale)
START_DECADES = {True: 8.0, False: 4.0}
BOUND_DECADES = {True: 10.0, False: 6.0}
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
#: what an evidence raises where it cannot be evaluated (a failed factorisation at an extreme
#: hyperparameter, a non-finite value): such a point counts as infeasible (log Z = -inf)
_EVAL_ERRORS = (FloatingPointError, ValueError, torch.linalg.LinAlgError, np.linalg.LinAlgError)


class ClosedFormEvidence(Protocol):
    """Log evidence and its gradient in the log-hyperparameters, float64 (see module doc)."""

    def evidence(
        self, log_prior: np.ndarray, log_sigma: float | None = None
    ) -> tuple[float, np.ndarray, float]: ...


AutogradEvidence = Callable[[Tensor, Any], Tensor]


@dataclass(frozen=True)
class TuningResult:
    """Outcome of one tuning run.

    ``prior_precision`` and ``sigma_noise`` (None when the noise was not tuned) are the values
    set on the posterior; ``value`` the log evidence there; ``converged`` whether the
    convergence test of :mod:`gaussify.tuning` passed; ``steps`` optimiser iterations (grid:
    points scored); ``evaluations`` objective calls (start grid included); ``grad_norm`` the
    max-norm of d log Z / d log-hyperparameters at the result (nan for a grid search);
    ``optimizer`` "lbfgs", "adam" or "grid"; ``message`` why it stopped.
    """

    prior_precision: Tensor
    sigma_noise: Tensor | None
    value: float
    converged: bool
    steps: int
    evaluations: int
    grad_norm: float
    optimizer: str
    message: str


# ------------------------------------------------------------------ argument checks
def check_positive(value: object, name: str) -> float:
    """``value`` as a finite float > 0 (a bool, nan, inf or value <= 0 raises ValueError)."""
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(float(value))
        or float(value) <= 0
    ):
        raise ValueError(f"{name}: expected a finite number > 0, got {value!r}")
    return float(value)


def check_grid(grid: object, name: str = "grid") -> Tensor:
    """``grid`` (a 1-D tensor or sequence of prior precisions) as a float64 tensor; empty,
    multi-dimensional, non-numeric, non-finite or non-positive values raise ValueError."""
    if isinstance(grid, Tensor):
        values = grid.detach().to(device="cpu", dtype=torch.float64)
    elif isinstance(grid, Sequence | np.ndarray) and not isinstance(grid, str | bytes):
        try:
            values = torch.as_tensor(np.asarray(grid, dtype=np.float64))
        except (TypeError, ValueError):
            raise ValueError(
                f"{name}: expected a 1-D sequence of positive numbers, got {grid!r}"
            ) from None
    else:
        raise ValueError(
            f"{name}: expected a 1-D tensor or sequence of positive numbers, "
            f"got {type(grid).__name__}"
        )
    if values.ndim != 1:
        raise ValueError(
            f"{name}: expected a 1-D tensor or sequence, got shape {tuple(values.shape)}"
        )
    if values.numel() == 0:
        raise ValueError(f"{name}: needs at least one value, got an empty grid")
    bad = ~(torch.isfinite(values) & (values > 0))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"{name}: values must be finite and > 0, got {float(values[i])!r} at index {i}"
        )
    return values


def check_choice(value: object, name: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {list(allowed)}, got {value!r}")


# ------------------------------------------------------------------ objectives in x = log-hyper
class _Objective:
    """x (K [+1],) float64 -> (log Z, d log Z / dx) for either source, counting calls."""

    def __init__(
        self,
        evidence: ClosedFormEvidence | AutogradEvidence,
        prior_init: Tensor,
        sigma_init: Tensor | None,
        tune_noise: bool,
    ) -> None:
        self.closed_form = hasattr(evidence, "evidence")
        self.evidence = evidence
        self.prior_shape = prior_init.shape
        self.k = max(prior_init.numel(), 1)
        self.tune_noise = tune_noise
        self.dtype = prior_init.dtype if prior_init.is_floating_point() else torch.float64
        self.device = prior_init.device
        self.sigma_init = sigma_init
        self.calls = 0
        self.on_call: Callable[[], object] | None = None  # progress hook, once per call
        self.last_error: Exception | None = None
        eps = 2.2e-16 if self.closed_form else float(torch.finfo(self.dtype).eps)
        self.precision = math.sqrt(eps)  # relative accuracy of a gradient from a float objective

    def __call__(self, x: np.ndarray, grad: bool = True) -> tuple[float, np.ndarray]:
        self.calls += 1
        if self.on_call is not None:
            self.on_call()
        k = self.k
        if self.closed_form:
            log_sigma = float(x[k]) if self.tune_noise else None
            value, g_prior, g_sigma = self.evidence.evidence(x[:k], log_sigma)  # type: ignore[union-attr]
            g = np.append(g_prior, g_sigma) if self.tune_noise else np.asarray(g_prior)
            return float(value), np.asarray(g, dtype=np.float64)
        t = torch.tensor(x, dtype=self.dtype, device=self.device, requires_grad=grad)
        prior = t[:k].reshape(self.prior_shape).exp()
        sigma = t[k].exp() if self.tune_noise else self.sigma_init  # None: the objective's own
        with torch.set_grad_enabled(grad):
            value = self.evidence(prior, sigma)  # type: ignore[operator]
            if not grad:
                return float(value.detach()), np.zeros(x.shape[0])
            (g,) = torch.autograd.grad(value, t)
        return float(value.detach()), g.detach().to("cpu", torch.float64).numpy()

    def value(self, x: np.ndarray) -> float:
        """log Z at x, -inf where the objective fails (an infeasible start)."""
        try:
            out = self(x, grad=False)[0]
        except _EVAL_ERRORS as error:
            self.last_error = error
            return -math.inf
        return out if math.isfinite(out) else -math.inf


@dataclass
class _Optimum:
    x: np.ndarray
    value: float
    grad: np.ndarray
    steps: int
    converged: bool
    message: str


def maximize(
    objective: Callable[[np.ndarray], tuple[float, np.ndarray]],
    x0: np.ndarray,
    bounds: Sequence[tuple[float, float]],
    *,
    max_steps: int,
    optimizer: Optimizer = "lbfgs",
    lr: float = 0.1,
    grad_tol: float = 1e-7,
    rel_tol: float = 1e-6,
    x_tol: float = 1e-3,
    precision: float = 1.5e-8,
    fixed_steps: bool = False,
) -> _Optimum:
    """Maximise ``objective`` (x -> (value, gradient)) from ``x0`` within ``bounds`` with the
    convergence test of the module doc; at most ``max_steps`` iterations (Adam with
    ``fixed_steps``: exactly that many, without the early stop)."""
    lo = np.array([b[0] for b in bounds])
    hi = np.array([b[1] for b in bounds])
    if optimizer == "lbfgs":
        last: dict[str, Any] = {}
        best = [float(objective(x0)[0])]

        def neg(x: np.ndarray) -> tuple[float, np.ndarray]:
            # Outside the box, or where the evidence cannot be evaluated, a value above every
            # one seen makes the line search step back (scipy's L-BFGS-B gets no bounds: with
            # bounds on every variable its first trial is a full gradient step, which from a
            # steep start leaves the region where the evidence can be evaluated at all).
            penalty = -best[0] + 1e6 * (1.0 + abs(best[0]))
            if np.any(x < lo) or np.any(x > hi):
                return penalty, np.zeros_like(x)
            try:
                value, grad = objective(x)
            except _EVAL_ERRORS:
                return penalty, np.zeros_like(x)
            if not math.isfinite(value) or not np.all(np.isfinite(grad)):
                return penalty, np.zeros_like(x)
            last["x"], last["value"], last["grad"] = x.copy(), value, grad
            best[0] = max(best[0], value)
            return -value, -grad

        res = scipy_optimize.minimize(
            neg,
            x0,
            jac=True,
            method="L-BFGS-B",
            options={
                "maxiter": max_steps,
                "maxfun": 4 * max_steps + 20,
                "ftol": 0.0,
                # run to the accuracy the objective resolves; the test below judges
                "gtol": 1e-3 * grad_tol,
                "maxls": 40,
            },
        )
        x = np.asarray(res.x, dtype=np.float64)
        if "x" in last and np.array_equal(last["x"], x):
            value, grad = float(last["value"]), np.asarray(last["grad"])
        else:
            value, grad = objective(x)
        x, value, grad = _polish(neg, x, value, grad, res.hess_inv)
        message = str(res.message)
        steps = int(res.nit)
        # distance to the stationary point by L-BFGS's curvature model: |H g| in log units
        newton_step = float(np.max(np.abs(res.hess_inv @ grad))) if grad.size else 0.0
    elif optimizer == "adam":
        beta1, beta2 = ADAM_BETAS
        x = np.array(x0, dtype=np.float64)
        m, v = np.zeros_like(x), np.zeros_like(x)
        value, grad = objective(x)
        newton_step = math.inf
        steps, message = 0, "ITERATIONS"
        for t in range(1, max_steps + 1):
            if not fixed_steps and _grad_ok(grad, value, grad_tol, max(rel_tol, precision)):
                message = "CONVERGENCE: GRADIENT TEST PASSED"
                break
            g = -grad
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
            step = lr / (1 - beta1**t)
            x_new = np.clip(
                x - step * m / (np.sqrt(v) / math.sqrt(1 - beta2**t) + ADAM_EPS), lo, hi
            )
            try:
                new_value, new_grad = objective(x_new)
            except _EVAL_ERRORS as error:
                message = f"the evidence could not be evaluated: {error}"
                break
            if not math.isfinite(new_value):
                message = "the evidence is not finite at the next step"
                break
            x, value, grad, steps = x_new, new_value, new_grad, t
    else:
        check_choice(optimizer, "optimizer", OPTIMIZERS)
        raise AssertionError  # unreachable
    tolerance = max(grad_tol, max(rel_tol, precision) * max(1.0, abs(value)))
    converged = _grad_ok(grad, value, grad_tol, max(rel_tol, precision))
    if converged:
        message = f"converged: max |d log Z / d log hyper| <= {tolerance:.3g}"
    elif math.isfinite(value) and newton_step <= x_tol:
        # the line search stopped resolving progress (rounding of log Z) this close to the
        # stationary point of the curvature model: every hyperparameter within exp(x_tol)
        converged = True
        message = f"converged: quasi-Newton distance to the optimum {newton_step:.2g} <= {x_tol:g}"
    elif "ITERATIONS" in message or "EVALUATIONS" in message:
        message = f"step budget of {max_steps} exhausted"
    elif "ABNORMAL" in message or "REDUCTION" in message:
        message = "line search stalled (no increase of log Z resolved) away from a stationary point"
    if not converged and math.isfinite(value) and _coordinate_maximum(objective, x, value, x_tol):
        # e.g. where the evidence switches the non-MAP correction off (gaussify.evidence): a
        # maximum at a kink, where no gradient vanishes
        converged = True
        message = f"converged: no change of a hyperparameter by exp(+-{x_tol:g}) increases log Z"
    at_bound = ((x <= lo + 1.0) & (grad < 0)) | ((x >= hi - 1.0) & (grad > 0))
    if bool(at_bound.any()):
        converged = False
        message = (
            f"hyperparameter {int(np.flatnonzero(at_bound)[0])} at its bound "
            f"exp({x[at_bound][0]:.4g}) with the evidence still increasing"
        )
    if not math.isfinite(value):
        converged = False
    return _Optimum(x, float(value), grad, steps, converged, message)


def _polish(
    neg: Callable[[np.ndarray], tuple[float, np.ndarray]],
    x: np.ndarray,
    value: float,
    grad: np.ndarray,
    hess_inv: Any,
    steps: int = 4,
) -> tuple[np.ndarray, float, np.ndarray]:
    """Quasi-Newton steps x - H (-g) with L-BFGS's inverse Hessian H, kept while they shrink
    the gradient: the line search judges steps by log Z, which stops resolving progress when
    the change falls below its rounding (~1e-16 |log Z|); the gradient resolves further."""
    for _ in range(steps):
        if not np.all(np.isfinite(grad)) or not np.any(grad):
            break
        trial = x + np.asarray(hess_inv @ grad, dtype=np.float64)
        f_neg, g_neg = neg(trial)
        new_value, new_grad = -f_neg, -g_neg
        tolerance = 1e-12 * max(1.0, abs(value))
        if not new_value >= value - tolerance or not np.max(np.abs(new_grad)) < np.max(
            np.abs(grad)
        ):
            break
        x, value, grad = trial, new_value, new_grad
    return x, value, grad


def _coordinate_maximum(
    objective: Callable[[np.ndarray], tuple[float, np.ndarray]],
    x: np.ndarray,
    value: float,
    step: float,
    max_size: int = 64,
) -> bool:
    """Whether moving any one of (at most ``max_size``) log-hyperparameters by +-``step``
    fails to increase log Z beyond its rounding: a maximum (to ``step``) that the gradient
    test cannot see because the evidence has a kink there."""
    if x.size > max_size:
        return False
    tolerance = 1e-12 * max(1.0, abs(value))
    for i in range(x.size):
        for sign in (1.0, -1.0):
            trial = x.copy()
            trial[i] += sign * step
            try:
                trial_value = objective(trial)[0]
            except _EVAL_ERRORS:
                continue
            if math.isfinite(trial_value) and trial_value > value + tolerance:
                return False
    return True


def _grad_ok(grad: np.ndarray, value: float, grad_tol: float, rel_tol: float) -> bool:
    """max |g| <= max(grad_tol, rel_tol max(1, |log Z|))."""
    floor = rel_tol * max(1.0, abs(value)) if math.isfinite(value) else 0.0
    return bool(np.all(np.isfinite(grad))) and float(np.max(np.abs(grad))) <= max(grad_tol, floor)


# ------------------------------------------------------------------ the shared routine
def tune_hyperparameters(
    evidence: ClosedFormEvidence | AutogradEvidence,
    prior_init: Tensor,
    sigma_init: Tensor | None,
    *,
    tune_noise: bool,
    n_steps: int = 100,
    lr: float = 0.1,
    optimizer: Optimizer = "lbfgs",
    grad_tol: float = 1e-7,
    rel_tol: float = 1e-6,
    noise_start: float | None = None,
    start_grid: bool = True,
    prior_centre: float | None = None,
    fixed_steps: bool = False,
    caller: str = "optimize_prior",
    progress: bool = False,
) -> TuningResult:
    """Maximise the log evidence over log prior precision (shape of ``prior_init``) and, with
    ``tune_noise``, log noise (scalar ``sigma_init``), as the module doc describes; at most
    ``n_steps`` optimiser iterations. ``noise_start`` is the data-scale start of the noise
    (the residual RMS); ``prior_centre`` the centre of the start grid and box of the prior
    (e.g. P / ||theta - m0||^2, the prior that maximises the prior term alone; default 1);
    ``start_grid=False`` starts from the given values only. ``fixed_steps=True`` runs exactly
    ``n_steps`` Adam steps (``lr``) from the given values, without the start grid, the early
    stop or the warning (laplace-torch's marglik tuning, for :mod:`gaussify.compat`); the
    result still says whether the end point passes the convergence test. Otherwise warns with
    :class:`ConvergenceWarning` (naming ``caller``) when the run is not converged.
    ``progress=True`` counts the evidence evaluations on a ``tqdm`` bar."""
    if not isinstance(progress, bool):
        raise TypeError(f"progress: expected True or False, got {progress!r}")
    n_steps = check_count(n_steps, "n_steps")
    lr = check_positive(lr, "lr")
    grad_tol = check_positive(grad_tol, "grad_tol")
    rel_tol = check_positive(rel_tol, "rel_tol")
    check_choice(optimizer, "optimizer", OPTIMIZERS)
    if fixed_steps:
        optimizer, start_grid, noise_start = "adam", False, None
    if tune_noise and (sigma_init is None or sigma_init.numel() != 1):
        raise ValueError("sigma_noise: only a scalar noise can be tuned")
    prior64 = prior_init.detach().to("cpu", torch.float64).reshape(-1)
    if prior64.numel() == 0 or not bool((torch.isfinite(prior64) & (prior64 > 0)).all()):
        raise ValueError("prior_precision: the start must be finite and > 0")
    objective = _Objective(evidence, prior_init.detach(), sigma_init, tune_noise)
    bar = _evaluation_bar(caller, progress)
    if bar is not None:
        objective.on_call = bar.update
    try:
        result = _tune(
            objective,
            prior64,
            sigma_init,
            tune_noise,
            n_steps,
            lr,
            optimizer,
            grad_tol,
            rel_tol,
            noise_start,
            start_grid,
            prior_centre,
            fixed_steps,
            caller,
            prior_init,
        )
    finally:
        if bar is not None:
            bar.close()
    return result


def _tune(
    objective: _Objective,
    prior64: Tensor,
    sigma_init: Tensor | None,
    tune_noise: bool,
    n_steps: int,
    lr: float,
    optimizer: Optimizer,
    grad_tol: float,
    rel_tol: float,
    noise_start: float | None,
    start_grid: bool,
    prior_centre: float | None,
    fixed_steps: bool,
    caller: str,
    prior_init: Tensor,
) -> TuningResult:
    """The body of :func:`tune_hyperparameters` after the argument checks."""
    k = objective.k
    x_user = np.log(prior64.numpy())
    starts = [x_user]
    centre_sigma = None
    if tune_noise:
        assert sigma_init is not None
        log_sigma0 = math.log(check_positive(float(sigma_init.reshape(())), "sigma_noise"))
        starts = [np.append(x_user, log_sigma0)]
        if noise_start is not None and math.isfinite(noise_start) and noise_start > 0:
            centre_sigma = math.log(noise_start)
            starts.append(np.append(x_user, centre_sigma))
        else:
            centre_sigma = log_sigma0
    double = prior_init.dtype == torch.float64 or not prior_init.is_floating_point()
    log_centre = 0.0
    if prior_centre is not None and math.isfinite(prior_centre) and prior_centre > 0:
        log_centre = math.log(prior_centre)
    if start_grid:
        step = 0.5 if objective.closed_form else 1.0
        half = START_DECADES[double]
        for log10 in np.arange(-half, half + step / 2, step):
            x = np.full(k, log_centre + log10 * math.log(10.0))
            starts.append(np.append(x, centre_sigma) if tune_noise else x)
    values = [objective.value(x) for x in starts]
    best = int(np.argmax(values))
    if not math.isfinite(values[best]):
        raise FloatingPointError(
            f"{caller}: the log evidence is not finite at any start; check the fit and the "
            "hyperparameters"
        ) from objective.last_error
    x0 = starts[best]
    width = BOUND_DECADES[double] * math.log(10.0)
    bounds = [
        (min(log_centre, float(x0[:k].min())) - width, max(log_centre, float(x0[:k].max())) + width)
    ] * k
    if tune_noise:
        assert centre_sigma is not None
        bounds.append((min(centre_sigma, x0[k]) - width, max(centre_sigma, x0[k]) + width))
    opt = maximize(
        objective,
        x0,
        bounds,
        max_steps=n_steps,
        optimizer=optimizer,
        lr=lr,
        grad_tol=grad_tol,
        rel_tol=rel_tol,
        precision=objective.precision,
        fixed_steps=fixed_steps,
    )
    dtype = prior_init.dtype if prior_init.is_floating_point() else torch.float64
    prior = torch.as_tensor(np.exp(opt.x[:k]), dtype=dtype, device=prior_init.device)
    sigma = None
    if tune_noise:
        assert sigma_init is not None
        sigma = torch.as_tensor(
            math.exp(opt.x[k]), dtype=sigma_init.dtype, device=sigma_init.device
        ).reshape(sigma_init.shape)
    grad_norm = float(np.max(np.abs(opt.grad))) if opt.grad.size else 0.0
    result = TuningResult(
        prior_precision=prior.reshape(prior_init.shape),
        sigma_noise=sigma,
        value=opt.value,
        converged=opt.converged,
        steps=opt.steps,
        evaluations=objective.calls,
        grad_norm=grad_norm,
        optimizer=optimizer,
        message=opt.message,
    )
    if not result.converged and not fixed_steps:
        warnings.warn(
            f"{caller}: hyperparameter tuning did not converge after {result.steps} "
            f"{optimizer} steps (max |d log Z / d log hyper| = {grad_norm:.3g}, log Z = "
            f"{result.value:.6g}; {result.message}); raise n_steps or check the result's "
            "tuning_result",
            ConvergenceWarning,
            stacklevel=4,
        )
    return result


def _evaluation_bar(caller: str, enabled: bool) -> Any:
    """A ``tqdm`` bar counting evidence evaluations, or None when progress is off."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(desc=f"{caller}: evidence", unit="eval")


def decomposition_stage(
    curvature: object, vectors: bool, enabled: bool, caller: str = "Laplace.optimize_prior"
) -> contextlib.AbstractContextManager[None]:
    """A :func:`progress_stage` around a closed-form evidence's set-up when ``curvature``
    (duck-typed: ``pending_decomposition(vectors) -> name | None``, ``num_params``) will run a
    factorisation for it (eigenvectors needed: ``vectors``); a no-op otherwise."""
    pending = getattr(curvature, "pending_decomposition", None)
    name = pending(vectors) if enabled and pending is not None else None
    size = getattr(curvature, "num_params", "?")
    return progress_stage(
        f"{caller}: {name} of the {size} x {size} curvature", enabled and name is not None
    )


@contextlib.contextmanager
def progress_stage(desc: str, enabled: bool, *, refresh_s: float = 1.0) -> Iterator[None]:
    """Show one long step (e.g. a dense eigendecomposition that cannot report its own
    progress) as a one-step ``tqdm`` bar named ``desc``, completed when the block ends; a
    daemon thread refreshes its elapsed time every ``refresh_s`` seconds meanwhile (the
    LAPACK call releases the GIL). Does nothing when ``enabled`` is False."""
    if not enabled:
        yield
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=1, desc=desc, unit="stage")
    done = threading.Event()

    def tick() -> None:
        while not done.wait(refresh_s):
            bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True)
    start = time.perf_counter()
    ticker.start()
    try:
        yield
        bar.update(1)
    finally:
        done.set()
        ticker.join()
        bar.set_postfix_str(f"{time.perf_counter() - start:.1f} s", refresh=True)
        bar.close()


def check_tuning_arguments(
    method: object, n_steps: object, lr: object, grid: object, optimizer: object
) -> tuple[int, float, Tensor | None]:
    """The checks every ``optimize_prior`` runs before touching anything: ``method`` "gradient"
    or "grid", ``n_steps`` a positive int, ``lr`` finite > 0, ``grid`` None or
    :func:`check_grid`, ``optimizer`` one of :data:`OPTIMIZERS`; returns (n_steps, lr, grid)."""
    check_choice(method, "method", ("gradient", "grid"))
    check_choice(optimizer, "optimizer", OPTIMIZERS)
    n_steps, lr = check_count(n_steps, "n_steps"), check_positive(lr, "lr")
    return n_steps, lr, None if grid is None else check_grid(grid)


def grid_search(
    evidence: ClosedFormEvidence | Callable[[Tensor], Tensor],
    grid: Tensor | None,
    dtype: torch.dtype,
    *,
    default: tuple[float, float, int] = (-4.0, 4.0, 41),
) -> TuningResult:
    """The scalar prior on ``grid`` (checked by :func:`check_grid`; None: ``logspace(*default)``)
    with the highest log evidence, from a closed form (``evidence.evidence``) or a callable
    ``prior -> log Z``. Values where the evidence fails or is not finite are skipped; all
    failing raises FloatingPointError."""
    values = (
        torch.logspace(*default[:2], default[2], dtype=torch.float64)
        if grid is None
        else check_grid(grid)
    ).to(dtype)
    scores = []
    for v in values:
        try:
            if hasattr(evidence, "evidence"):
                s = evidence.evidence(np.log(v.double().cpu().numpy()).reshape(1))[0]
            else:
                with torch.no_grad():
                    s = float(evidence(v))  # type: ignore[operator]
        except _EVAL_ERRORS:
            s = -math.inf
        scores.append(s if math.isfinite(s) else -math.inf)
    best = int(np.argmax(scores))
    if not math.isfinite(scores[best]):
        raise FloatingPointError("grid: the log evidence is not finite at any grid value")
    return TuningResult(
        prior_precision=values[best].clone(),
        sigma_noise=None,
        value=scores[best],
        converged=True,
        steps=len(scores),
        evaluations=len(scores),
        grad_norm=math.nan,
        optimizer="grid",
        message=f"best of {len(scores)} grid values",
    )


def prior_from_weights(theta: Tensor) -> float | None:
    """P / ||theta||^2 for ``theta (P,)`` = theta* - m0: the prior precision that maximises the
    prior term -delta ||theta||^2 / 2 + P log(delta) / 2 alone, the weights' own scale (None when
    theta is zero or not finite)."""
    norm = float(theta.detach().double().square().sum())
    return theta.numel() / norm if math.isfinite(norm) and norm > 0 else None


def residual_rms(sse: Tensor, num_data: int) -> float:
    """sqrt(SSE / (N C)) from the per-output sums of squared residuals ``sse (C,)``: the
    data-scale start of a Gaussian noise (see the module doc)."""
    return math.sqrt(float(sse.sum()) / max(num_data * sse.numel(), 1))
