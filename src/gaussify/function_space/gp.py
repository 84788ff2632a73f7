"""Functional Laplace: the Laplace-GGN posterior as exact GP regression in function space.

The Laplace-GGN approximation at theta* is exact inference in a Gaussian process regression
model whose prior kernel is the linearised network's k(x, x') = J(x) S0 J(x')^T and whose
observation precision at x_n is the likelihood Hessian Lambda_n (Immer thesis Thm 3.2). With
the training kernel K (NC x NC, blocks k(x_n, x_m)) and Lambda_n = L_n L_n^T
(``likelihood.hessian_sqrt``), the predictive at x* is (thesis eq. 3.13)

    f* ~ N(f(x*; theta*), k** - k*n (K + Lambda^-1)^-1 k*n^T)
       = N(f(x*; theta*), k** - k*n L B^-1 L^T k*n^T),   B = I + L^T K L,

the second form being the same matrix without Lambda^-1: the softmax Hessian is singular (its
rows sum to zero), so only the ``Lambda^1/2 (I + Lambda^1/2 K Lambda^1/2)^-1 Lambda^1/2`` form
stays finite. The full C x C blocks are kept (no independent-outputs approximation), which is
what makes the result equal the weight-space GLM predictive J* (J^T Lambda J + P0)^-1 J*^T.

The log marginal likelihood is the GP-regression evidence (eq. 3.19) plus the correction
terms of Thm 3.3 (eq. 3.17). Written with the factor L it reads, for the prior mean offset
m = f_lin(X; 0) - f(X; theta*) = -J theta* of the linearised network, residuals r (N, C) and
v = r - Lambda m,

    log Z = log p(y | f*) + r^T m - 1/2 m^T Lambda m + 1/2 v^T K v
            - 1/2 (L^T K v)^T B^-1 (L^T K v) - 1/2 log det B,

which is the Gaussian integral log E_{u ~ N(m, K)} exp(r^T u - 1/2 u^T Lambda u) + log p(y | f*),
equal to the weight-space eq. 3.18 with the non-MAP correction (``gaussify.evidence``) at any
theta*; :func:`gp_log_evidence_pseudo_targets` is the literal eq. 3.19 + 3.17 form, valid when
Lambda is invertible (Gaussian, Bernoulli). Cost: O((NC)^3) time and O((NC)^2) memory, for N C
up to a few thousand; ``num_data_subset`` conditions on a random subset of the data beyond.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from gaussify import distributed
from gaussify import state as st
from gaussify.batches import Batches, as_batches
from gaussify.curvature.jacobian import chunk_slices, jvp, model_outputs
from gaussify.curvature.subset import ParameterSubset, check_prior, expand_prior, select_parameters
from gaussify.evidence import (
    EvidenceValue,
    apply_rule,
    finite_evidence,
    log_likelihood_supremum,
    warn_dropped_correction,
)
from gaussify.function_space.ntk import Route, ntk, ntk_components, ntk_diag, prior_scales
from gaussify.function_space.pathwise import pathwise_sample
from gaussify.likelihoods import Gaussian, Likelihood, check_sigma_noise, get_likelihood
from gaussify.memory_guard import check_allocation
from gaussify.model_checks import in_eval_mode, warn_if_squashed_output
from gaussify.predictive import LinkName, Predictive, posterior_predictive
from gaussify.prior_tuning import EvidenceProblem, EvidenceTuning, hyperparameters_or_current
from gaussify.state import copy_state, identity, transactional
from gaussify.tuning import TuningResult, prior_from_weights
from gaussify.validation import check_count, check_data, check_inputs

__all__ = [
    "FunctionalLaplace",
    "gp_cholesky",
    "gp_evidence",
    "gp_log_evidence",
    "gp_log_evidence_pseudo_targets",
    "gp_predictive_cov",
]

Granularity = Literal["scalar", "layer"]

#: Element budget of one (S, C, N, C) test-train kernel block in ``predict``.
PREDICT_BLOCK_ELEMENTS = 2**22


# ---------------------------------------------------------------------- pure functions
def _flat(kernel: Tensor) -> Tensor:
    n, c = kernel.shape[:2]
    return kernel.reshape(n * c, n * c)


def gp_cholesky(kernel: Tensor, lam_sqrt: Tensor) -> Tensor:
    """Lower Cholesky factor of B = I + L^T K L, (NC, NC), for the training kernel
    ``kernel (N, C, N, C)`` and the block-diagonal factor ``lam_sqrt (N, C, C)`` (L_n L_n^T =
    Lambda_n). B >= I, so it is positive definite even for a singular softmax Lambda."""
    n, c = lam_sqrt.shape[:2]
    ltkl = torch.einsum("nca,ncmd,mdb->namb", lam_sqrt, kernel, lam_sqrt).reshape(n * c, n * c)
    eye = torch.eye(n * c, dtype=kernel.dtype, device=kernel.device)
    b = eye + 0.5 * (ltkl + ltkl.T)
    chol, info = torch.linalg.cholesky_ex(b)
    if bool(info > 0):
        raise ValueError(
            "kernel: I + L^T K L is not positive definite; the kernel is not a valid covariance "
            "(NaN or negative prior precision?)"
        )
    return chol


#: Largest tolerated round-off bound of the float64 log evidence, in nats.
MAX_ROUND_OFF_NATS = 1.0


def check_round_off(v: Tensor, kv: Tensor, z: Tensor, chol: Tensor) -> None:
    """Refuse an evidence that float64 cannot resolve. The quadratic term v^T K v - ||z||^2
    subtracts two numbers of size ~ v^T K v, and the Cholesky factor of B = I + L^T K L resolves
    its eigenvalues near 1 only to eps ||B||; with a tiny prior precision and noise (K / sigma^2
    of order 1/eps) both errors reach whole nats and the value is round-off, which a tuner or a
    grid would then chase. The bound eps (|v|^T |K v| + ||z||^2 + NC max_i B_ii) is computed
    from quantities already at hand; above :data:`MAX_ROUND_OFF_NATS` a FloatingPointError
    names the cause (tuning treats it as an infeasible point)."""
    eps = torch.finfo(torch.float64).eps
    with torch.no_grad():  # a diagnostic: no graph, no grad-to-scalar warning
        bound = eps * (
            float((v * kv).abs().sum())
            + float(z.square().sum())
            + chol.shape[0] * float(chol.diagonal().square().max())
        )
    if bound > MAX_ROUND_OFF_NATS:
        raise FloatingPointError(
            f"log evidence: the kernel is too ill-conditioned for float64 at this prior "
            f"precision and noise (round-off bound {bound:.3g} nats > {MAX_ROUND_OFF_NATS}); "
            "use a larger prior_precision or sigma_noise"
        )


def gp_log_evidence(
    log_lik: Tensor, residual: Tensor, lam_sqrt: Tensor, prior_mean: Tensor, kernel: Tensor
) -> Tensor:
    """Laplace-GGN log marginal likelihood in function space (module docstring; thesis
    eq. 3.19 with the Thm 3.3 corrections in the Lambda^1/2 form).

    ``log_lik`` scalar log p(y | f(X; theta*)); ``residual (N, C)`` r = d log p / d f;
    ``lam_sqrt (N, C, C)`` L_n; ``prior_mean (N, C)`` m = -J theta* (the prior mean of the
    linearised network minus f(X; theta*)); ``kernel (N, C, N, C)``. Differentiable in every
    argument; evaluated in float64 and returned in ``log_lik``'s dtype (no rule: see
    :func:`gp_evidence`).
    """
    return gp_evidence(log_lik, residual, lam_sqrt, prior_mean, kernel).value.to(log_lik.dtype)


def gp_evidence(
    log_lik: Tensor,
    residual: Tensor,
    lam_sqrt: Tensor,
    prior_mean: Tensor,
    kernel: Tensor,
    *,
    supremum: Tensor | None = None,
    prior_quad: Tensor | None = None,
) -> EvidenceValue:
    """:func:`gp_log_evidence` in float64 (the small quantities cast: at a prior of 1e-8 the
    kernel is 1e8 times J J^T and 1/2 v^T K v cancels against the Cholesky term) with the rule
    of :mod:`gaussify.evidence`: with ``supremum`` (L_sup) and ``prior_quad`` (theta*^T P0
    theta*), where the Newton model's log-likelihood at the mode, L + r^T u - 1/2 u^T Lambda u
    with u = m + K a, a = (I + Lambda K)^-1 v = v - L B^-1 L^T K v, exceeds L_sup, the value
    is the evidence without the correction, L - 1/2 theta*^T P0 theta* - 1/2 log det B."""
    lik = log_lik.to(torch.float64)
    residual, lam_sqrt, prior_mean, kernel = (
        t.to(torch.float64) for t in (residual, lam_sqrt, prior_mean, kernel)
    )
    lam = lam_sqrt @ lam_sqrt.transpose(-1, -2)
    lam_m = torch.einsum("nij,nj->ni", lam, prior_mean)
    v = residual - lam_m
    kv = torch.einsum("ncmd,md->nc", kernel, v)
    w = torch.einsum("nca,nc->na", lam_sqrt, kv).reshape(-1, 1)
    chol = gp_cholesky(kernel, lam_sqrt)
    z = torch.linalg.solve_triangular(chol, w, upper=False)
    logdet = 2.0 * chol.diagonal().log().sum()
    quad = (v * kv).sum() - z.square().sum()
    linear = (residual * prior_mean).sum() - 0.5 * (prior_mean * lam_m).sum()
    value = lik + linear + 0.5 * quad - 0.5 * logdet
    check_round_off(v, kv, z, chol)
    if supremum is None or prior_quad is None:
        return EvidenceValue(value)
    b_inv_w = torch.linalg.solve_triangular(chol.T, z, upper=True).reshape(residual.shape)
    alpha = v - torch.einsum("nca,na->nc", lam_sqrt, b_inv_w)
    u = prior_mean + torch.einsum("ncmd,md->nc", kernel, alpha)
    gain = (residual * u).sum() - 0.5 * (u * torch.einsum("nij,nj->ni", lam, u)).sum()
    base = lik - 0.5 * prior_quad.to(torch.float64) - 0.5 * logdet
    return apply_rule(lik, gain, supremum, base, lambda: value)


def gp_log_evidence_pseudo_targets(
    log_lik: Tensor, residual: Tensor, lam: Tensor, prior_mean: Tensor, kernel: Tensor
) -> Tensor:
    """The literal thesis eq. 3.19 + eq. 3.17 for an invertible Lambda (Gaussian, Bernoulli):
    the GP regression evidence of the pseudo-targets r with mean Lambda m and kernel
    Lambda K Lambda + Lambda (Thm 3.2 in the residual parameterisation), plus the correction
    log p(y | f*) - log N(r | 0, Lambda). ``lam (N, C, C)``; the other arguments as in
    :func:`gp_log_evidence`, which equals this but stays finite for a singular Lambda."""
    n, c = residual.shape
    big_lam = torch.block_diag(*lam)
    cov = big_lam @ _flat(kernel) @ big_lam + big_lam
    mean = (big_lam @ prior_mean.reshape(-1, 1))[:, 0]
    zero = torch.zeros(n * c, dtype=residual.dtype, device=residual.device)
    gp = torch.distributions.MultivariateNormal(mean, covariance_matrix=0.5 * (cov + cov.T))
    pseudo = torch.distributions.MultivariateNormal(zero, covariance_matrix=big_lam)
    r = residual.reshape(-1)
    return gp.log_prob(r) + log_lik - pseudo.log_prob(r)


def gp_predictive_cov(k_test: Tensor, k_cross: Tensor, lam_sqrt: Tensor, chol: Tensor) -> Tensor:
    """Posterior function covariance at test inputs, (S, C, C) (thesis eq. 3.13):
    k** - k*n L B^-1 L^T k*n^T for ``k_test (S, C, C)`` (k(x*_s, x*_s)), ``k_cross (S, C, N, C)``
    and the factor ``chol`` of B from :func:`gp_cholesky`."""
    s, c = k_test.shape[:2]
    n = lam_sqrt.shape[0]
    v = torch.einsum("nda,scnd->nasc", lam_sqrt, k_cross).reshape(n * c, s * c)
    z = torch.linalg.solve_triangular(chol, v, upper=False).reshape(n * c, s, c)
    cov = k_test - torch.einsum("ksi,ksj->sij", z, z)
    return 0.5 * (cov + cov.transpose(-1, -2))


def _collect(data: Batches, batch_size: int) -> tuple[Tensor, Tensor]:
    xs, ys = [], []
    for x, y in as_batches(data, batch_size=batch_size):
        xs.append(x)
        ys.append(y)
    if not xs:
        raise ValueError("data: contains no examples")
    # the GP conditions on every point: gather the shards under torch.distributed
    return distributed.all_gather_cat(torch.cat(xs), torch.cat(ys))


# ---------------------------------------------------------------------- the posterior
class FunctionalLaplace(EvidenceTuning):
    """Laplace-GGN posterior of ``model`` as a Gaussian process over its outputs (thesis
    Thm 3.2, eq. 3.13, 3.17-3.19): same predictive and evidence as
    ``gs.Laplace(model, likelihood, "full")`` at the same theta*, at O((NC)^3) instead of
    O(P^3) cost.

    ``likelihood``: "classification", "regression", "binary" or a likelihood object.
    ``prior_precision``: scalar, one per parameter tensor of ``subset``, or one per parameter.
    ``subset``: "all", "last_layer" or a list of parameter/module names (the kernel covers
    these; the rest stay fixed). ``num_data_subset``: condition on this many training points
    drawn at random (with ``generator``) when the data has more (an approximation; the GP
    costs O((NC)^3)). ``max_kernel_size``: largest N C accepted without a subset.
    ``route``: kernel route (:func:`gaussify.function_space.ntk.ntk`).
    """

    prior_granularities = ("scalar", "layer")

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood = "classification",
        prior_precision: float | Tensor = 1.0,
        sigma_noise: float | Tensor = 1.0,
        subset: str | list[str] = "all",
        num_data_subset: int | None = None,
        *,
        generator: torch.Generator | None = None,
        chunk_size: int | None = None,
        max_kernel_size: int = 10_000,
        route: Route = "auto",
    ) -> None:
        if num_data_subset is not None:
            num_data_subset = check_count(num_data_subset, "num_data_subset")
        if chunk_size is not None:
            chunk_size = check_count(chunk_size, "chunk_size")
        self.model = model
        self.likelihood = get_likelihood(likelihood, sigma_noise=sigma_noise)
        self.task = self.likelihood.task
        warn_if_squashed_output(model, self.task)
        self.subset: ParameterSubset = select_parameters(model, subset)
        self.num_data_subset = num_data_subset
        self.generator = generator
        self.chunk_size = chunk_size
        self.max_kernel_size = int(max_kernel_size)
        self.route: Route = route
        dtype = next(model.parameters()).dtype
        self.prior_precision = self._validate_prior(prior_precision, dtype)
        device = next(model.parameters()).device
        self.sigma_noise = check_sigma_noise(sigma_noise, self.task, dtype, device).clone()
        #: outcome of the last optimize_prior (converged, steps, gradient, evidence)
        self.tuning_result: TuningResult | None = None
        self._fitted = False
        self._chol: Tensor | None = None

    def _validate_prior(self, prior: float | Tensor, dtype: torch.dtype) -> Tensor:
        device = next(self.model.parameters()).device
        prior_t = check_prior(torch.as_tensor(prior, dtype=dtype, device=device)).clone()
        expand_prior(prior_t, self.subset)  # raises on a wrong granularity
        return prior_t

    # ------------------------------------------------------------------ fitting
    @transactional
    @distributed.collective("FunctionalLaplace.fit")
    @in_eval_mode
    def fit(self, data: Batches, *, batch_size: int = 256) -> FunctionalLaplace:
        """Condition the GP on ``data`` (a DataLoader or an ``(x, y)`` pair) at the current
        weights theta*: store the inputs, outputs f(X; theta*), the prior mean offset
        -J theta* and the training kernel (per group of parameter tensors, so the prior
        precision can be changed and tuned without recomputing Jacobians)."""
        data = check_data(data, model=self.model, task=self.task, owner="FunctionalLaplace.fit")
        self.model.eval()
        x, y = _collect(data, batch_size)
        if self.num_data_subset is not None and x.shape[0] > self.num_data_subset:
            idx = torch.randperm(x.shape[0], generator=self.generator)[: self.num_data_subset]
            idx = idx.sort().values
            x, y = x[idx], y[idx]
        f = model_outputs(self.model, x, self.chunk_size)
        n, c = f.shape
        if n * c > self.max_kernel_size:
            gib = (n * c) ** 2 * f.element_size() / 2**30
            raise ValueError(
                f"data: N C = {n} x {c} = {n * c} exceeds max_kernel_size={self.max_kernel_size} "
                f"(the GP needs {gib:.1f} GiB per (NC)^2 matrix and O((NC)^3) time); pass "
                "num_data_subset to condition on a random subset, or raise max_kernel_size"
            )
        groups = 1 if self.prior_precision.ndim == 0 else len(self.subset.names)
        check_allocation(
            groups * (n * c) ** 2,
            f.dtype,
            f"FunctionalLaplace: the (N C)^2 training kernel (N C = {n * c:,}, {groups} "
            "prior group(s))",
            "num_data_subset (condition on a random subset), ELLA (Nystrom), VaLLA (inducing "
            "points), or Laplace with structure 'kron'/'diag'",
            device=f.device,
        )
        self.theta_star = self.subset.flatten(self.subset.params(self.model)).clone()
        self._x, self._y, self._f = x, y, f
        self._m = -jvp(self.model, x, self.subset, self.theta_star, self.chunk_size)
        self.num_data = n
        self._sigma_fit = self.sigma_noise.clone()
        self._groups: list[list[str]] | None = None
        self._components: Tensor | None = None
        self._direct: tuple[Tensor, Tensor] | None = None
        self._set_components(self.prior_precision)
        self._fitted = True
        self._chol = None
        return self

    def _require_fit(self) -> None:
        if not self._fitted:
            raise RuntimeError("FunctionalLaplace: call fit(data) before using the posterior")

    def _set_components(self, prior: Tensor) -> None:
        """Unit-prior kernel components for the groups of tensors on which ``prior`` is
        constant: one group for a scalar prior, one per tensor otherwise; nothing for a
        per-parameter prior (its kernel is computed directly when needed)."""
        scales = prior_scales(prior, self.subset)
        if any(s.ndim > 0 for s in scales.values()):
            return
        values = torch.stack([scales[n] for n in self.subset.names])
        if bool((values == values[0]).all()):
            self._use_groups([list(self.subset.names)])
        else:
            self._use_groups([[n] for n in self.subset.names])

    def _use_groups(self, groups: list[list[str]]) -> None:
        if self._groups == groups:
            return
        self._groups = groups
        self._components = ntk_components(
            self.model, self._x, None, self.subset, groups, self.chunk_size, route=self.route
        ).detach()

    @in_eval_mode
    def train_kernel(self, prior_precision: Tensor | float | None = None) -> Tensor:
        """The training kernel K (N, C, N, C) for a prior precision (default: the current
        one), differentiable in it."""
        self._require_fit()
        prior = self.prior_precision if prior_precision is None else prior_precision
        prior = torch.as_tensor(prior, dtype=self._f.dtype, device=self._f.device)
        scales = prior_scales(prior, self.subset)
        if any(s.ndim > 0 for s in scales.values()):
            cached = self._direct
            if cached is not None and not prior.requires_grad and torch.equal(cached[0], prior):
                return cached[1]
            kernel = ntk(
                self.model, self._x, None, self.subset, prior, self.chunk_size, route=self.route
            )
            if not prior.requires_grad:
                self._direct = (prior.detach().clone(), kernel)
            return kernel
        groups = self._groups
        if groups is None or any(
            len({float(scales[n].detach()) for n in group}) > 1 for group in groups
        ):
            # the prior varies inside a stored group: split the kernel per tensor once
            self._use_groups([[n] for n in self.subset.names])
            groups = self._groups
        assert groups is not None and self._components is not None
        weights = torch.stack([scales[group[0]] for group in groups])
        return torch.einsum("g,gncmd->ncmd", weights, self._components)

    # ------------------------------------------------------------------ hyperparameters
    def _likelihood_at(self, sigma_noise: Tensor) -> Likelihood:
        if self.task == "regression":
            return Gaussian(sigma_noise)
        return self.likelihood

    def _hyper(
        self, prior_precision: Tensor | float | None, sigma_noise: Tensor | float | None
    ) -> tuple[Tensor, Tensor]:
        return hyperparameters_or_current(
            self, prior_precision, sigma_noise, self._f.dtype, self._f.device
        )

    def log_marginal_likelihood(
        self,
        prior_precision: Tensor | float | None = None,
        sigma_noise: Tensor | float | None = None,
    ) -> Tensor:
        """Laplace-GGN log evidence in function space (eq. 3.19 with the Thm 3.3 correction,
        see :func:`gp_log_evidence`), differentiable in the hyperparameters; equal to
        ``gs.Laplace(..., "full").log_marginal_likelihood()`` at the same theta*."""
        self._require_fit()
        prior, sigma = self._hyper(prior_precision, sigma_noise)
        lik = self._likelihood_at(sigma)
        log_lik = lik.log_prob(self._f, self._y).sum()
        result = gp_evidence(
            log_lik,
            lik.residual(self._f, self._y),
            lik.hessian_sqrt(self._f),
            self._m,
            self.train_kernel(prior),
            supremum=log_likelihood_supremum(lik, self.num_data, self._f.shape[1], sigma),
            prior_quad=(expand_prior(prior, self.subset) * self.theta_star.square()).sum(),
        )
        if result.dropped:
            warn_dropped_correction(result, self, self._m)
        return finite_evidence(result.value.to(self._f.dtype))

    def _grid_evidence(self, progress: bool) -> tuple[Callable[[Tensor], Tensor], torch.dtype]:
        return self.log_marginal_likelihood, self._f.dtype

    def _evidence_problem(
        self, granularity: str, tune_noise: bool, progress: bool
    ) -> EvidenceProblem:
        dtype = self._f.dtype
        init = expand_prior(self.prior_precision, self.subset).to(dtype)
        if granularity == "scalar":
            start = init.mean().reshape(())
        else:
            start = torch.stack([c.mean() for c in torch.split(init, list(self.subset.numels))])
            self._use_groups([[n] for n in self.subset.names])
        noise_start = None
        if tune_noise:
            residual = self._y.reshape(self._f.shape).to(dtype) - self._f
            noise_start = float(residual.square().mean().sqrt())
        return EvidenceProblem(
            self.log_marginal_likelihood, start, prior_from_weights(self.theta_star), noise_start
        )

    def _set_tuned(self, result: TuningResult, granularity: str) -> None:
        self.prior_precision = result.prior_precision
        if result.sigma_noise is not None:
            self.sigma_noise = result.sigma_noise
            self.likelihood = get_likelihood("regression", sigma_noise=result.sigma_noise)
        self._chol = None

    optimize_prior_precision = EvidenceTuning.optimize_prior

    # ------------------------------------------------------------------ prediction
    @property
    def posterior_factor(self) -> Tensor:
        """Lower Cholesky factor of B = I + L^T K L (NC, NC) at the current hyperparameters."""
        self._require_fit()
        if self._chol is None:
            with torch.no_grad():
                lam_sqrt = self._likelihood_at(self.sigma_noise).hessian_sqrt(self._f)
                self._chol = gp_cholesky(self.train_kernel(), lam_sqrt)
        return self._chol

    @in_eval_mode
    def functional_covariance(self, x: Tensor) -> Tensor:
        """Posterior covariance of the outputs at each input, (N, C, C) (eq. 3.13)."""
        self._require_fit()
        check_inputs(x, self.model)
        chol = self.posterior_factor
        lam_sqrt = self._likelihood_at(self.sigma_noise).hessian_sqrt(self._f)
        n, c = self._f.shape
        block = max(1, PREDICT_BLOCK_ELEMENTS // (n * c * c))
        covs = []
        with torch.no_grad():
            for sl in chunk_slices(x.shape[0], block):
                xs = x[sl]
                k_cross = ntk(
                    self.model,
                    xs,
                    self._x,
                    self.subset,
                    self.prior_precision,
                    self.chunk_size,
                    route=self.route,
                )
                k_test = ntk_diag(
                    self.model,
                    xs,
                    self.subset,
                    self.prior_precision,
                    self.chunk_size,
                    route=self.route,
                )
                covs.append(gp_predictive_cov(k_test, k_cross, lam_sqrt, chol))
        return torch.cat(covs)

    @in_eval_mode
    def predict(
        self,
        x: Tensor,
        method: Literal["glm"] = "glm",
        link: LinkName = "probit",
        *,
        num_samples: int = 100,
        generator: torch.Generator | None = None,
    ) -> Predictive:
        """Predictive at inputs ``x (N, ...)``: N(f(x; theta*), GP posterior covariance) through
        the shared :class:`~gaussify.predictive.Predictive` (``link`` "probit", "bridge" or
        "mc" for classification; the noise is added for regression). Function space has only
        the GLM predictive, so ``method`` must be "glm"."""
        self._require_fit()
        check_inputs(x, self.model)
        num_samples = check_count(num_samples, "num_samples")
        if method != "glm":
            raise ValueError(
                f"method: function-space posteriors predict with 'glm', got {method!r}"
            )
        f_mean = model_outputs(self.model, x, self.chunk_size)
        f_cov = self.functional_covariance(x)
        return posterior_predictive(
            f_mean, f_cov, self.task, self.sigma_noise, link, num_samples, generator
        )

    @in_eval_mode
    def sample(self, num_samples: int = 100, generator: torch.Generator | None = None) -> Tensor:
        """Weight samples theta_s ~ N(theta*, (J^T Lambda J + P0)^-1), (S, P) in the subset's
        flattening order: the weight-space posterior whose pushforward is this GP (the same
        as ``Laplace(..., "full")``'s), drawn by pathwise conditioning on the training
        Jacobians (:func:`gaussify.function_space.pathwise.pathwise_sample`; the (NC, NC)
        factor :attr:`posterior_factor` and S Jacobian-vector products, no P x P matrix)."""
        self._require_fit()
        num_samples = check_count(num_samples, "num_samples")
        lam_sqrt = self._likelihood_at(self.sigma_noise).hessian_sqrt(self._f)
        prior = expand_prior(self.prior_precision, self.subset).to(self._f.dtype)
        return pathwise_sample(
            self.model,
            self._x,
            self.subset,
            self.theta_star,
            prior,
            lam_sqrt,
            self.posterior_factor,
            num_samples,
            generator,
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The fitted state with its identity (task, subset, fingerprint of the network's
        other weights); tensors and plain values, readable with ``weights_only=True``."""
        self._require_fit()
        state: dict[str, Any] = {
            **identity(self.task, self.subset.names, self.model),
            "prior_precision": self.prior_precision,
            "sigma_noise": self.sigma_noise,
            "theta_star": self.theta_star,
            "x": self._x,
            "y": self._y,
            "f": self._f,
            "m": self._m,
            "num_data": self.num_data,
        }
        if self._components is not None and self._groups is not None:
            state["groups"] = [list(g) for g in self._groups]
            state["components"] = self._components
        return copy_state(state)

    def _state_schema(self) -> dict[str, Any]:
        dt = self.prior_precision.dtype
        names = tuple(self.subset.names)
        return {
            **st.identity_schema(self.task, names),
            "prior_precision": st.TensorSpec(None, dt, positive=True),
            "sigma_noise": st.TensorSpec(None, dt, positive=True),
            "theta_star": st.TensorSpec(("P",), dt),
            "x": st.TensorSpec(("N", ...), None),
            "y": st.TensorSpec(("N", ...), None),
            "f": st.TensorSpec(("N", "C"), dt),
            "m": st.TensorSpec(("N", "C"), dt),
            "num_data": st.Integer(1, dim="N"),
            "groups": st.Maybe(st.NameGroups(names, dim="G")),
            "components": st.Maybe(st.TensorSpec(("G", "N", "C", "N", "C"), dt)),
        }

    @transactional
    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Restore a state from :meth:`state_dict` into a posterior over the same model: the
        whole state is validated first (:mod:`gaussify.state`), theta* and the other weights
        against the model (a mismatch raises; ``strict=False`` warns); a failed load
        changes nothing."""
        valid = st.validate_own_state(self, state, strict=strict)
        if ("groups" in valid) != ("components" in valid):
            raise st.StateError(
                "FunctionalLaplace.load_state_dict: invalid state: 'groups' and 'components' "
                "come together"
            )
        self.prior_precision = self._validate_prior(valid["prior_precision"], valid["f"].dtype)
        self.sigma_noise = valid["sigma_noise"].clone()
        self.theta_star = valid["theta_star"].clone()
        self._x, self._y = valid["x"].clone(), valid["y"].clone()
        self._f, self._m = valid["f"].clone(), valid["m"].clone()
        self.num_data = valid["num_data"]
        self._groups = valid.get("groups")
        components = valid.get("components")
        self._components = None if components is None else components.clone()
        self._direct = None
        self._sigma_fit = self.sigma_noise.clone()
        if self.task == "regression":
            self.likelihood = get_likelihood("regression", sigma_noise=self.sigma_noise)
        self._fitted = True
        self._chol = None
