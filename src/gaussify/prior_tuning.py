"""Type-II maximum likelihood of a fitted posterior's hyperparameters: the plumbing of
``optimize_prior`` that Laplace, FunctionalLaplace and ELLA share.

Each family maximises its own log evidence log p(D | P0, sigma) over the prior precision P0
(and, for a scalar-noise regression likelihood, sigma) with the one optimiser of
:func:`gaussify.tuning.tune_hyperparameters`. What is the same everywhere lives here: the
argument checks done before anything is touched (:func:`tuning_options`), which noise is
tunable (:func:`noise_to_tune`), the hyperparameters an evidence is evaluated at
(:func:`hyperparameters_or_current`), the optimiser call (:func:`maximise_evidence`) and
the public method itself (:class:`EvidenceTuning`: one signature, one order of checks; the
families supply their evidence through three small hooks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

import torch
from torch import Tensor

from gaussify.batches import Batches
from gaussify.state import transactional
from gaussify.tuning import (
    AutogradEvidence,
    ClosedFormEvidence,
    Optimizer,
    TuningResult,
    check_choice,
    check_tuning_arguments,
    grid_search,
    tune_hyperparameters,
)

__all__ = [
    "EvidenceProblem",
    "EvidenceTuning",
    "TuningOptions",
    "hyperparameters_or_current",
    "maximise_evidence",
    "noise_to_tune",
    "tuning_options",
]


@dataclass(frozen=True)
class TuningOptions:
    """The checked options of an ``optimize_prior`` call: ``method`` "gradient" or "grid",
    at most ``n_steps`` iterations of ``optimizer`` (Adam step ``lr``), the ``grid`` of the
    grid search (None: the default), ``fixed_steps`` (exactly ``n_steps`` Adam steps)."""

    method: str
    n_steps: int
    lr: float
    grid: Tensor | None
    optimizer: Optimizer
    fixed_steps: bool


def tuning_options(
    method: str,
    n_steps: int,
    lr: float,
    grid: Tensor | Sequence[float] | None,
    optimizer: Optimizer,
    fixed_steps: bool,
) -> TuningOptions:
    """Check the options (:func:`gaussify.tuning.check_tuning_arguments`) before anything
    is fitted or changed."""
    n_steps, lr, grid_t = check_tuning_arguments(method, n_steps, lr, grid, optimizer)
    return TuningOptions(method, n_steps, lr, grid_t, optimizer, bool(fixed_steps))


def noise_to_tune(tune_noise: bool | None, task: str, sigma_noise: Tensor) -> bool:
    """Whether to tune the noise: by default exactly for a regression likelihood with one
    (scalar) noise; asking for it with another likelihood raises ``ValueError``."""
    if tune_noise is None:
        return task == "regression" and sigma_noise.ndim == 0
    if tune_noise and task != "regression":
        raise ValueError("tune_noise: only a regression likelihood has noise to tune")
    return bool(tune_noise)


def hyperparameters_or_current(
    owner: Any,
    prior_precision: Tensor | float | None,
    sigma_noise: Tensor | float | None,
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> tuple[Tensor, Tensor]:
    """(P0, sigma) at which to evaluate ``owner``'s evidence: the given values as ``dtype``
    tensors on ``device`` (default: the current prior's), keeping their graph so that the
    evidence is differentiable in them; else ``owner.prior_precision`` / ``owner.sigma_noise``."""
    prior, sigma = owner.prior_precision, owner.sigma_noise
    where = {"dtype": dtype, "device": prior.device if device is None else device}
    if prior_precision is not None:
        prior = torch.as_tensor(prior_precision, **where)
    if sigma_noise is not None:
        sigma = torch.as_tensor(sigma_noise, **where)
    return prior, sigma


def maximise_evidence(
    evidence: ClosedFormEvidence | AutogradEvidence,
    start: Tensor,
    sigma_noise: Tensor,
    options: TuningOptions,
    *,
    tune_noise: bool,
    prior_centre: float | None,
    noise_start: float | None,
    caller: str,
    progress: bool = False,
) -> TuningResult:
    """Maximise ``evidence`` over log P0 (from ``start``; the granularity is its shape) and,
    with ``tune_noise``, log sigma, by :func:`gaussify.tuning.tune_hyperparameters` with
    ``options``; ``prior_centre`` / ``noise_start`` are the data-scale starts; ``progress``
    counts the evidence evaluations on a ``tqdm`` bar."""
    return tune_hyperparameters(
        evidence,
        start,
        sigma_noise,
        tune_noise=tune_noise,
        n_steps=options.n_steps,
        lr=options.lr,
        optimizer=options.optimizer,
        prior_centre=prior_centre,
        fixed_steps=options.fixed_steps,
        noise_start=noise_start,
        caller=caller,
        progress=progress,
    )


@dataclass(frozen=True)
class EvidenceProblem:
    """What a family hands :meth:`EvidenceTuning.optimize_prior` for the gradient route: its
    log evidence (closed form or autograd) and the start ``start`` of P0 (the granularity is
    its shape), with the data-scale starts ``prior_centre`` and ``noise_start``."""

    evidence: ClosedFormEvidence | AutogradEvidence
    start: Tensor
    prior_centre: float | None
    noise_start: float | None


TunedT = TypeVar("TunedT", bound="EvidenceTuning")


class EvidenceTuning:
    """``optimize_prior`` of the families with a log evidence (Laplace, FunctionalLaplace,
    ELLA). A family declares its :attr:`prior_granularities` and supplies ``fit``,
    ``_require_fit`` and the hooks :meth:`_is_fitted`, :meth:`_grid_evidence`,
    :meth:`_evidence_problem` and :meth:`_set_tuned`; the checks, their order and the
    optimiser call are the same for all."""

    #: the values ``granularity`` may take (the first is the default's meaning: one scalar)
    prior_granularities: ClassVar[tuple[str, ...]] = ("scalar",)
    task: str
    sigma_noise: Tensor
    tuning_result: TuningResult | None
    _fitted: bool
    fit: Callable[..., Any]
    _require_fit: Callable[[], None]

    @transactional
    def optimize_prior(
        self: TunedT,
        data: Batches | None = None,
        *,
        method: Literal["gradient", "grid"] = "gradient",
        granularity: Literal["scalar", "layer", "diag"] = "scalar",
        tune_noise: bool | None = None,
        n_steps: int = 100,
        lr: float = 0.1,
        grid: Tensor | Sequence[float] | None = None,
        optimizer: Optimizer = "lbfgs",
        fixed_steps: bool = False,
        progress: bool = False,
    ) -> TunedT:
        """Type-II maximum likelihood of the prior precision P0 (and, for a scalar-noise
        regression likelihood, the noise sigma): maximise the family's log evidence
        log p(D | P0, sigma) by :func:`gaussify.tuning.tune_hyperparameters` (scale-aware
        start, at most ``n_steps`` iterations of ``optimizer``, "lbfgs" or "adam" with step
        ``lr``, a convergence test and a :class:`gaussify.warnings.ConvergenceWarning` when
        unconverged; ``fixed_steps=True``: exactly ``n_steps`` Adam steps from the current
        value, laplace-torch's tuning). ``granularity``: one P0 ("scalar"), one per parameter
        tensor ("layer") or one per parameter ("diag"), as the family allows
        (:attr:`prior_granularities`: Laplace all three, FunctionalLaplace "scalar" and
        "layer", ELLA "scalar"). ``tune_noise``: default True exactly for a regression
        likelihood with one noise. ``method="grid"``: the best scalar prior on ``grid`` (1-D,
        default 10^-4 .. 10^4, 41 points). The evidence: Laplace's weight-space one (a closed
        form from the curvature's eigenvalues where they diagonalise the prior, O(P) per call;
        else autograd through the dense evidence), FunctionalLaplace's function-space GP
        evidence, ELLA's Nystrom evidence. ``data`` is fitted first when the posterior is not
        fitted yet. ``progress=True`` shows the stages on ``tqdm`` bars: Laplace's factorisation
        of the curvature (e.g. a full GGN's ``eigvalsh``, or ``eigh`` when the non-MAP
        correction needs eigenvectors) and the evidence evaluations. The outcome is kept in
        :attr:`tuning_result`; on an error nothing changes."""
        options = tuning_options(method, n_steps, lr, grid, optimizer, fixed_steps)
        check_choice(granularity, "granularity", self.prior_granularities)
        if data is not None and not self._is_fitted():
            self.fit(data)
        self._require_fit()
        tune_noise = noise_to_tune(tune_noise, self.task, self.sigma_noise)
        if options.method == "grid":
            evidence, dtype = self._grid_evidence(progress)
            result = grid_search(evidence, options.grid, dtype)
        else:
            problem = self._evidence_problem(granularity, tune_noise, progress)
            result = maximise_evidence(
                problem.evidence,
                problem.start,
                self.sigma_noise,
                options,
                tune_noise=tune_noise,
                prior_centre=problem.prior_centre,
                noise_start=problem.noise_start,
                caller=f"{type(self).__name__}.optimize_prior",
                progress=progress,
            )
        self._set_tuned(result, granularity)
        self.tuning_result = result
        return self

    def _is_fitted(self) -> bool:
        return self._fitted

    def _grid_evidence(
        self, progress: bool
    ) -> tuple[ClosedFormEvidence | Callable[[Tensor], Tensor], torch.dtype]:
        """The scalar-prior evidence P0 -> log Z searched on the grid, and its dtype
        (``progress``: show a long set-up as a stage)."""
        raise NotImplementedError

    def _evidence_problem(
        self, granularity: str, tune_noise: bool, progress: bool
    ) -> EvidenceProblem:
        raise NotImplementedError

    def _set_tuned(self, result: TuningResult, granularity: str) -> None:
        """Write the tuned P0 (and sigma) into the posterior."""
        raise NotImplementedError
