"""Weight-space Laplace-GGN posterior (Immer thesis Sec. 3.4; Immer et al. 2021).

q(theta) = N(mu, A^-1) with A = G / T + P0: G the GGN sum_n J_n^T Lambda_n J_n (or the
empirical Fisher) at the expansion point theta* in one of the curvature structures (full,
diag, kron, lowrank), P0 the prior precision (scalar, per parameter tensor, or per parameter),
T a temperature. Predictions push the Gaussian through the linearised network (GLM
predictive, thesis eq. 3.15-3.16) or sample networks (NN predictive, eq. 3.14). The class only
holds state; the math lives in curvature/, predictive.py and evidence.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from gaussify import distributed
from gaussify.batches import Batches
from gaussify.curvature.jacobian import SubsetLike, resolve_subset
from gaussify.curvature.lastlayer import find_output_linear
from gaussify.curvature.subset import (
    ParameterSubset,
    check_prior,
    expand_prior,
    require_whole_tensors,
    select_parameters,
)
from gaussify.evidence import finite_evidence
from gaussify.likelihoods import Gaussian, Likelihood, all_finite, check_sigma_noise, get_likelihood
from gaussify.model_checks import in_eval_mode, warn_if_squashed_output
from gaussify.predictive import (
    LinkName,
    Predictive,
    noise_variance,
    posterior_predictive,
    predictive_from_samples,
)
from gaussify.prior_tuning import EvidenceProblem, EvidenceTuning, hyperparameters_or_current
from gaussify.spectral import Spectrum
from gaussify.state import transactional
from gaussify.tuning import (
    ClosedFormEvidence,
    TuningResult,
    decomposition_stage,
    prior_from_weights,
    residual_rms,
)
from gaussify.validation import check_count, check_inputs, validated_batches
from gaussify.weight_space.dense_views import DenseViews
from gaussify.weight_space.joint import function_samples, joint_predictive
from gaussify.weight_space.laplace_evidence import (
    fitted_log_evidence,
    fitted_spectrum,
    prior_groups,
)
from gaussify.weight_space.laplace_fields import Granularity
from gaussify.weight_space.laplace_fit import (
    accumulate,
    add_statistics,
    refine_mean,
    restore_statistics,
    statistics,
)
from gaussify.weight_space.laplace_predict import glm_moments, nn_samples
from gaussify.weight_space.laplace_state import laplace_state_dict, load_laplace_state

__all__ = ["Laplace"]

Structure = Literal["full", "diag", "kron", "lowrank"]
STRUCTURES = ("full", "diag", "kron", "lowrank")


class Laplace(EvidenceTuning, DenseViews):
    """Laplace-GGN posterior over the weights of ``model`` (or a subset of them).

    ``likelihood``: "classification", "regression", "binary" or a likelihood object.
    ``structure``: "full" | "diag" | "kron" | "lowrank" (curvature structure of G).
    ``subset``: "all", "last_layer", a list of parameter/module names, or a subnetwork of
    individual weights (subnetwork inference, Daxberger et al. 2021): a boolean mask or an
    integer tensor of indices into the vector of all trainable parameters in
    ``named_parameters()`` order, e.g. from :mod:`gaussify.weight_space.subnetwork`
    (structures "full", "diag", "lowrank"; the posterior covers the selected weights in that
    order and every other weight stays at its MAP value).
    ``prior_precision``: scalar, one per parameter tensor, or one per parameter.
    ``correction``: include the non-MAP correction of thesis Thm 3.3 in the evidence. The term
    1/2 b^T A^-1 b is the gain of the Newton step to the linearised model's posterior mean, so
    it is exact only when A is that model's exact precision (the full GGN). With an
    approximate A (diag, kron, lowrank, EF or Monte Carlo curvature) it can exceed the largest
    gain possible (for regression, the whole residual sum of squares) and grows without bound
    as the prior precision and noise shrink, so tuning runs off to ~1e-7. Default (None): on
    for the exact full GGN, off otherwise (as in Immer et al. 2021's KFAC evidence). Rule
    (:mod:`gaussify.evidence`), for every structure: where the Newton model's log-likelihood
    at its mode exceeds the likelihood's supremum (0 for class labels), the correction is
    dropped with an :class:`~gaussify.warnings.EvidenceWarning`, so class labels always get
    log Z <= 0 (far from a MAP, e.g. logits scaled x10, it gave +4420).
    ``prior_mean``: mean m0 of the Gaussian prior N(m0, P0^-1), a scalar or one value per
    parameter (e.g. the previous task's posterior mean in continual learning); default 0.
    Extra keyword arguments (``ef``, ``mc_samples``, ``rank``, ``kfac_approx``, ``chunk_size``)
    go to the curvature structure.

    When the subset is exactly the final ``nn.Linear`` whose output is the model output, the
    gradient, linearised outputs and GLM predictive use its input features phi alone
    (J_n = I_C ⊗ [phi_n, 1]^T, :mod:`gaussify.curvature.lastlayer`), so no (N, C, P) Jacobian
    or per-parameter intermediate is formed and thousands of classes fit.
    """

    prior_granularities = ("diag", "layer", "scalar")

    #: Use the last-layer feature path when it applies (a switch for tests and comparisons).
    _feature_path: bool = True

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood = "classification",
        structure: Structure = "kron",
        subset: SubsetLike = "all",
        prior_precision: float | Tensor = 1.0,
        sigma_noise: float | Tensor = 1.0,
        temperature: float = 1.0,
        *,
        correction: bool | None = None,
        generator: torch.Generator | None = None,
        prior_mean: float | Tensor = 0.0,
        **curvature_options: Any,
    ) -> None:
        if structure not in STRUCTURES:
            raise ValueError(f"structure: expected one of {STRUCTURES}, got {structure!r}")
        self._posterior: Any = None
        self._curvature: Any = None
        self.model = model
        self.likelihood = get_likelihood(likelihood, sigma_noise=sigma_noise)
        self.task = self.likelihood.task
        warn_if_squashed_output(model, self.task)
        self.structure = structure
        self.subset: ParameterSubset = resolve_subset(model, subset, subnetwork=True)
        if structure == "kron":
            require_whole_tensors(self.subset, "structure 'kron' (Kronecker factors are per layer)")
        self.temperature = temperature
        exact = (
            structure == "full"
            and not curvature_options.get("ef")
            and not curvature_options.get("mc_samples")
        )
        self.correction = exact if correction is None else bool(correction)
        self.generator = generator
        self.curvature_options = curvature_options
        self._dtype = next(model.parameters()).dtype
        self.prior_precision = prior_precision
        # set directly: a likelihood object passed in keeps its own noise
        self._sigma_noise = self._validate_sigma(sigma_noise)
        self._mean: Tensor | None = None  # until fit: the model's current weights (lazily)
        self.prior_mean = prior_mean
        self._output_layer = find_output_linear(model, self.subset)
        #: outcome of the last optimize_prior (converged, steps, gradient, evidence)
        self.tuning_result: TuningResult | None = None

    # ------------------------------------------------------------------ hyperparameters
    # Setting any of them drops the cached posterior precision (built lazily from them), so
    # predict / sample / posterior_* after a change use the new values.
    @property
    def _device(self) -> torch.device:
        """The model's device (where its first parameter lives): every tensor of the fit and
        the predictive is created there."""
        return next(self.model.parameters()).device

    @property
    def prior_precision(self) -> Tensor:
        """Prior precision P0: a scalar, one per parameter tensor, or one per parameter."""
        return self._prior_precision

    @prior_precision.setter
    def prior_precision(self, value: float | Tensor) -> None:
        self._prior_precision = self._validate_prior(value, self._dtype)
        self._posterior = None

    @property
    def mean(self) -> Tensor:
        """Posterior mean mu, (P,) in the subset's flattening order: theta* after ``fit``, the
        GLM mode after ``refine``; before any fit, the model's current weights."""
        if self._mean is None:
            return self.subset.flatten(self.subset.params(self.model))
        return self._mean

    @mean.setter
    def mean(self, value: Tensor) -> None:
        self._mean = value

    @property
    def prior_mean(self) -> Tensor:
        """Prior mean m0, (P,) in the subset's flattening order (a scalar m0 is a read-only
        broadcast view of one number, so it costs no P-sized vector)."""
        return self._prior_mean

    @prior_mean.setter
    def prior_mean(self, value: float | Tensor) -> None:
        m0 = torch.as_tensor(value, dtype=self._dtype, device=self._device).detach()
        p = self.subset.num_params
        if m0.ndim == 1 and m0.numel() > 1 and m0.stride(0) == 0:
            m0 = m0[0]  # a broadcast scalar (e.g. a saved scalar prior mean) stays one number
        if m0.shape not in ((), (p,)):
            raise ValueError(
                f"prior_mean: expected a scalar or a ({p},) vector, got shape {tuple(m0.shape)}"
            )
        if not all_finite(m0):
            raise ValueError("prior_mean: contains NaN or inf")
        self._prior_mean = m0.clone().expand(p)  # (P,); a scalar has one number behind it
        self._posterior = None

    @property
    def sigma_noise(self) -> Tensor:
        """Observation noise sigma of a regression likelihood (scalar or per output)."""
        return self._sigma_noise

    @sigma_noise.setter
    def sigma_noise(self, value: float | Tensor) -> None:
        self._sigma_noise = self._validate_sigma(value)
        if type(self.likelihood) is Gaussian:
            # keep the likelihood that later fits/refits use in step with the noise
            self.likelihood = Gaussian(self._sigma_noise)
        self._posterior = None

    @property
    def temperature(self) -> float:
        """Temperature T of the tempered posterior A = G / T + P0."""
        return self._temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        if isinstance(value, Tensor):
            value = float(value.detach())
        if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"temperature: must be a finite number > 0, got {value!r}")
        self._temperature = float(value)
        self._posterior = None

    def _validate_prior(self, prior: float | Tensor, dtype: torch.dtype) -> Tensor:
        prior_t = check_prior(torch.as_tensor(prior, dtype=dtype, device=self._device)).clone()
        expand_prior(prior_t, self.subset)  # raises on a wrong granularity
        return prior_t

    def _validate_sigma(self, sigma: float | Tensor) -> Tensor:
        return check_sigma_noise(sigma, self.task, self._dtype, self._device).clone()

    # ------------------------------------------------------------------ fitting

    @transactional
    @distributed.collective("Laplace.fit")
    @in_eval_mode
    def fit(
        self,
        data: Batches,
        *,
        batch_size: int = 256,
        progress: bool = False,
        reset: bool = True,
    ) -> Laplace:
        """Accumulate the curvature, log-likelihood and its gradient over ``data`` at the
        current weights theta* (the expansion point and posterior mean).

        ``reset=False`` adds ``data`` to what earlier fits accumulated instead of replacing
        it (incremental / online Laplace): G, the data count, the log-likelihood and its
        gradient are sums over examples, so fitting two halves at the same weights equals one
        fit on the whole. If the weights moved in between (continual learning), the old
        terms keep their old expansion point -- the online-Laplace approximation. Needs an
        additive structure ("full", "diag", "kron"; low-rank stores eigenpairs).
        """
        self.model.eval()
        theta_star = self.subset.flatten(self.subset.params(self.model))  # a new tensor
        previous = None if reset or self._curvature is None else self._statistics()
        if previous is not None and self.structure == "lowrank":
            raise ValueError(
                "reset: an incremental fit (reset=False) needs an additive structure "
                "('full', 'diag' or 'kron'); 'lowrank' stores eigenpairs"
            )
        # a fit that raises (e.g. NaN data) leaves the previous fit's state untouched: the
        # statistics go to a new curvature that replaces the old one only at the end
        batches = validated_batches(
            data, batch_size, model=self.model, task=self.task, owner="Laplace.fit"
        )
        self._accumulate(batches, None, progress)
        if previous is not None:
            self._add_statistics(previous)
        self.theta_star, self.mean = theta_star, theta_star.clone()
        return self

    def _add_statistics(self, previous: tuple[Any, ...]) -> None:
        """Add an earlier fit's sums (from :meth:`_statistics`) to the current ones."""
        add_statistics(self, previous)

    def _accumulate(self, batches: Any, shift: Tensor | None, progress: bool = False) -> None:
        """One pass over the data (:func:`gaussify.weight_space.laplace_fit.accumulate`)."""
        accumulate(self, batches, shift, progress)

    @transactional
    @distributed.collective("Laplace.refine")
    @in_eval_mode
    def refine(
        self,
        data: Batches,
        *,
        max_iter: int = 50,
        tol: float | None = None,
        batch_size: int = 256,
        progress: bool = False,
    ) -> Laplace:
        """GLM mean refinement (thesis eq. 3.12; Immer et al. 2021, "refine").

        Maximise the log joint of the network linearised at theta*,
        h(theta) = sum_n log p(y_n | f(x_n; theta*) + J_n (theta - theta*)) - 1/2 theta^T P0 theta,
        by Newton steps d = A^-1 b (b = grad h) with the structured posterior precision A
        (with an approximate structure such as kron or diag the steps are quasi-Newton and
        converge linearly). ``tol`` (default 10 eps of the parameters' dtype) sets the
        resolution: h is a sum over the data, so changes below ``tol * max(1, |h|)`` are
        round-off (float32 cannot resolve an absolute 1e-12).

        * While the predicted gain b^T A^-1 b / 2 (the Newton decrement) exceeds that
          resolution, the step is halved until h strictly increases; if no step length down
          to 1e-4 does, refinement stops.
        * Below it h cannot judge a step, but the local quadratic model is accurate: full
          steps are taken while the decrement keeps decreasing (a step that increases it is
          undone), so the mode is resolved to the parameters' precision, not only to the
          objective's (which would leave an error of order sqrt(eps)).
        * It stops when the step is below ``tol * max(1, max |theta|)`` in every coordinate,
          or after ``max_iter`` curvature passes.

        The posterior is then the one at the final mean: the GGN with Lambda evaluated at the
        linearised outputs. The linearisation point stays theta*; the posterior mean becomes
        the GLM mode mu. For a Gaussian likelihood one step is exact.
        """
        self._require_fit()
        refine_mean(
            self, data, max_iter=max_iter, tol=tol, batch_size=batch_size, progress=progress
        )
        return self

    def _statistics(self) -> tuple[Any, ...]:
        """What :meth:`_accumulate` sets (to undo a refinement step without a data pass)."""
        return statistics(self)

    def _restore_statistics(self, state: tuple[Any, ...]) -> None:
        restore_statistics(self, state)

    def _require_fit(self) -> None:
        if self._curvature is None:
            raise RuntimeError("Laplace: call fit(data) before using the posterior")

    # ------------------------------------------------------------------ posterior
    def _scale(self, sigma_noise: Tensor) -> Tensor:
        """Multiplier of the fitted G: 1/T, times sigma_fit^2 / sigma^2 for regression (the
        GGN of a Gaussian likelihood is proportional to 1/sigma^2)."""
        if self.task != "regression":
            mean = self.mean
            return torch.as_tensor(1.0 / self.temperature, dtype=mean.dtype, device=mean.device)
        ratio = self._sigma_fit.square() / sigma_noise.square()
        if ratio.ndim > 0 and not torch.allclose(ratio, ratio.reshape(-1)[0].expand_as(ratio)):
            raise ValueError(
                "sigma_noise: per-output noise can only change by a common factor after fit"
            )
        return ratio.reshape(-1)[0] / self.temperature

    def posterior_at(self, prior_precision: Tensor, sigma_noise: Tensor) -> Any:
        """The structured posterior precision A = scale * G + P0 for given hyperparameters."""
        self._require_fit()
        return self._curvature.posterior(prior_precision, scale=self._scale(sigma_noise))

    @property
    def posterior(self) -> Any:
        """The structured posterior precision (logdet, solve, sample, functional_cov, ...)."""
        if self._posterior is None:
            self._posterior = self.posterior_at(self.prior_precision, self.sigma_noise)
        return self._posterior

    def sample(
        self,
        num_samples: int = 100,
        generator: torch.Generator | None = None,
        *,
        full: bool = False,
    ) -> Tensor:
        """Weight samples from q(theta), (S, P) in the subset's flattening order.

        ``full=True``: (S, P_all) vectors of every trainable parameter in
        ``named_parameters()`` order (laplace-torch's ``parameters_to_vector`` layout), the
        entries outside the subset (or subnetwork) at the model's current (MAP) values.
        """
        num_samples = check_count(num_samples, "num_samples")
        draws = self.mean + self.posterior.sample(num_samples, generator=generator)
        if not full:
            return draws
        everything = select_parameters(self.model, "all")
        values = {
            n: v.expand(num_samples, *v.shape) for n, v in everything.params(self.model).items()
        }
        values.update(self.subset.unflatten(draws, base=self.subset.params(self.model)))
        return everything.flatten(values)

    # ------------------------------------------------------------------ evidence
    def log_marginal_likelihood(
        self,
        prior_precision: Tensor | float | None = None,
        sigma_noise: Tensor | float | None = None,
    ) -> Tensor:
        """Laplace log evidence (thesis eq. 3.17-3.18, see evidence.py), differentiable in the
        hyperparameters; defaults to the current ones. Evaluated in float64 (returned in the
        model's dtype) and merged per eigenvector where the structure has an eigenbasis for
        this prior (:meth:`spectrum`); with the correction, the rule of :mod:`gaussify.evidence`
        drops it, with an :class:`~gaussify.warnings.EvidenceWarning`, where its Newton model
        would exceed the likelihood's supremum (so class labels always give log Z <= 0)."""
        self._require_fit()
        dtype = self.mean.dtype
        prior, sigma = hyperparameters_or_current(
            self, prior_precision, sigma_noise, dtype, self.mean.device
        )
        result = fitted_log_evidence(self, prior, sigma)
        return finite_evidence(result.value).to(dtype)

    def _is_fitted(self) -> bool:
        return self._curvature is not None

    def _grid_evidence(
        self, progress: bool
    ) -> tuple[ClosedFormEvidence | Callable[[Tensor], Tensor], torch.dtype]:
        with decomposition_stage(self._curvature, self.correction, progress):
            closed = self.spectrum("scalar", tune_noise=False)
        return closed or self.log_marginal_likelihood, self.mean.dtype

    def _evidence_problem(
        self, granularity: str, tune_noise: bool, progress: bool
    ) -> EvidenceProblem:
        init = expand_prior(self.prior_precision, self.subset)
        if granularity == "scalar":
            start = init.mean().reshape(1)
        elif granularity == "layer":
            start = torch.stack([c.mean() for c in torch.split(init, list(self.subset.counts))])
        else:
            start = init.clone()
        with decomposition_stage(self._curvature, self.correction, progress):
            spec = self.spectrum(granularity, tune_noise=tune_noise)

        def evidence(prior: Tensor, sigma: Tensor) -> Tensor:
            prior = prior.squeeze(0) if granularity == "scalar" else prior
            return self.log_marginal_likelihood(prior, sigma)

        return EvidenceProblem(
            evidence if spec is None else spec,  # closed form: O(P) per call
            start.detach().to(self.mean.dtype),
            prior_from_weights(self.mean - self.prior_mean),
            None if self._sse is None else residual_rms(self._sse, self.num_data),
        )

    def _set_tuned(self, result: TuningResult, granularity: str) -> None:
        prior = result.prior_precision
        self.prior_precision = prior.squeeze(0) if granularity == "scalar" else prior
        if result.sigma_noise is not None:
            self.sigma_noise = result.sigma_noise.reshape(())

    optimize_prior_precision = EvidenceTuning.optimize_prior

    #: Tune the prior in closed form from the curvature's eigenvalues where the structure
    #: allows it (a switch for tests and comparisons with the autograd path).
    _spectral_tuning: bool = True

    def _prior_groups(self, granularity: Granularity) -> Tensor:
        """(P,) index of the prior value each parameter takes at ``granularity``."""
        return prior_groups(self, granularity)

    def spectrum(self, granularity: Granularity, *, tune_noise: bool = False) -> Spectrum | None:
        """The fitted evidence as a closed-form function of the prior at ``granularity`` (and,
        with ``tune_noise``, of a scalar regression noise), or None where the structure's
        eigenbasis does not diagonalise that prior
        (:func:`gaussify.weight_space.laplace_evidence.fitted_spectrum`)."""
        self._require_fit()
        return fitted_spectrum(self, granularity, tune_noise=tune_noise)

    # ------------------------------------------------------------------ prediction
    @in_eval_mode
    def predict(
        self,
        x: Tensor,
        method: Literal["glm", "nn"] = "glm",
        link: LinkName = "probit",
        *,
        num_samples: int = 100,
        generator: torch.Generator | None = None,
        chunk_size: int = 256,
        joint: bool = False,
        diagonal_output: bool = False,
    ) -> Predictive:
        """Predictive at inputs ``x (N, ...)``.

        ``method="glm"``: N(f(x; theta*) + J (mu - theta*), J Sigma J^T), with the link
        approximation ``link`` for classification; ``method="nn"``: ``num_samples`` networks
        with weights drawn from q(theta), sharing weight samples across inputs.
        ``joint=True`` adds the (N C, N C) covariance across all points and outputs
        (``Predictive.joint_cov``, see :mod:`gaussify.weight_space.joint`).
        ``diagonal_output=True`` computes only the C output variances per point (``f_cov``
        is then diagonal): C instead of C^2 numbers per point, for many-class models.
        Differentiable in ``x`` when ``x.requires_grad`` (input gradients of the predictive
        mean and variance, e.g. for Bayesian-optimisation acquisitions).
        """
        self._require_fit()
        check_inputs(x, self.model)
        num_samples = check_count(num_samples, "num_samples")
        chunk_size = check_count(chunk_size, "chunk_size")
        noise_var = noise_variance(self.task, self.sigma_noise)
        if joint:
            if method != "glm" or diagonal_output:
                raise ValueError("joint: needs method='glm' and diagonal_output=False")
            return joint_predictive(
                self, x, link=link, num_samples=num_samples, generator=generator
            )
        if method == "nn":
            return predictive_from_samples(
                self._nn_samples(x, num_samples, generator), self.task, noise_var=noise_var
            )
        if method != "glm":
            raise ValueError(f"method: expected 'glm' or 'nn', got {method!r}")
        mean, cov = glm_moments(self, x, chunk_size, diagonal_output)
        return posterior_predictive(
            mean, cov, self.task, self.sigma_noise, link, num_samples, generator
        )

    @in_eval_mode
    def function_samples(
        self,
        x: Tensor,
        num_samples: int = 100,
        *,
        method: Literal["glm", "nn"] = "glm",
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Latent function samples ``(S, N, C)`` at ``x`` that share their S weight draws
        across inputs (smooth sample paths); see
        :func:`gaussify.weight_space.joint.function_samples`."""
        self._require_fit()
        check_inputs(x, self.model)
        num_samples = check_count(num_samples, "num_samples")
        return function_samples(self, x, num_samples, method=method, generator=generator)

    def _nn_samples(self, x: Tensor, num_samples: int, generator: torch.Generator | None) -> Tensor:
        """Network outputs under sampled weights, (S, N, C)."""
        return nn_samples(self, x, num_samples, generator)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to restore the fitted posterior, with the task, structure,
        subset, theta* and a fingerprint of the network it belongs to (tensors and plain
        values: ``torch.load(..., weights_only=True)`` reads it)."""
        self._require_fit()
        return laplace_state_dict(self)

    @transactional
    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Restore a state from :meth:`state_dict` into a Laplace over the same model.

        The whole state is validated first (:mod:`gaussify.state`): keys, task, structure,
        subset, shapes, dtypes, NaN/inf, and the saved theta* and other weights against the
        model's current ones (a mismatch raises; ``strict=False`` warns instead). A failed
        load leaves the posterior as it was."""
        load_laplace_state(self, state, strict=strict)
