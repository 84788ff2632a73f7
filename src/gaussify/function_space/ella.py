"""ELLA: the linearised Laplace GP with a Nystrom approximation of its kernel.

Deng et al. (2022, "Accelerated linearized Laplace approximation for Bayesian deep learning")
replace the kernel k(x, x') = J(x) S0 J(x')^T of the functional Laplace GP (Immer thesis
Thm 3.2) by its Nystrom approximation on M landmark inputs Z,

    k(x, x') ~= k(x, Z) K_ZZ^+ k(Z, x') = phi(x)^T phi(x'),   phi(x) = D^-1/2 U^T k(Z, x),

with K_ZZ = U D U^T (MC x MC) truncated to its R eigenvalues above a tolerance, so phi(x) is an
(R, C) feature map. The GP with kernel phi^T phi is the Bayesian GLM f(x) = f(x; theta*) +
phi(x)^T w, w ~ N(0, I_R), and its Laplace-GGN posterior has precision

    A = I_R + sum_n phi_n Lambda_n phi_n^T   (R x R, the full C x C Hessian blocks),

giving the predictive N(f(x*; theta*), phi*^T A^-1 phi*): one pass over the data to fit, and
a prediction cost independent of N (M kernel evaluations per test input). The log marginal
likelihood is the function-space Laplace evidence (``gp.gp_log_evidence``) with K replaced by
Phi^T Phi, which reduces to R-dimensional quantities (with s = sum_n phi_n v_n):

    log Z = log p(y | f*) + r^T m - 1/2 m^T Lambda m + 1/2 s^T A^-1 s - 1/2 log det A.

The Nystrom kernel is below the exact one (k - k~ is a Schur complement, PSD), so ELLA's
predictive variance never exceeds the exact GP's; with all N training points as landmarks the
training kernel is exact (same evidence), and the predictive is exact when the training
Jacobians span the parameters (N C >= P, full rank).

A scalar prior precision can be changed after fitting (phi scales by sqrt(delta_fit / delta));
for regression the sufficient statistics are stored per output so the noise can be tuned too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from gaussify import distributed
from gaussify import state as st
from gaussify.batches import Batches, as_batches, num_examples
from gaussify.curvature.jacobian import chunk_slices, jvp, model_outputs
from gaussify.curvature.subset import ParameterSubset, check_prior, expand_prior, select_parameters
from gaussify.evidence import (
    feature_log_evidence,
    finite_evidence,
    gaussian_log_likelihood,
    log_likelihood_supremum,
    warn_dropped_correction,
)
from gaussify.function_space.gp import PREDICT_BLOCK_ELEMENTS
from gaussify.function_space.ntk import Route, ntk
from gaussify.likelihoods import Gaussian, Likelihood, check_sigma_noise, get_likelihood
from gaussify.memory_guard import check_allocation
from gaussify.model_checks import in_eval_mode, warn_if_squashed_output
from gaussify.posterior import DeclaredCapabilities
from gaussify.predictive import LinkName, Predictive, posterior_predictive
from gaussify.prior_tuning import EvidenceProblem, EvidenceTuning, hyperparameters_or_current
from gaussify.state import copy_state, identity, transactional
from gaussify.tuning import TuningResult, prior_from_weights, residual_rms
from gaussify.validation import check_count, check_inputs, validated_batches

__all__ = ["ELLA", "nystrom_projection", "select_landmarks"]

LandmarkMethod = Literal["random", "kmeans"]
_METHODS = ("random", "kmeans")


def nystrom_projection(kernel_zz: Tensor, eig_tol: float | None = None) -> Tensor:
    """The map P = U_R D_R^-1/2 (MC, R) with phi(x) = P^T k(Z, x), from the landmark kernel
    ``kernel_zz (M, C, M, C)``; eigenvalues below ``eig_tol`` x the largest (default
    M C x machine epsilon, the numerical-rank tolerance) are dropped."""
    m, c = kernel_zz.shape[:2]
    flat = kernel_zz.reshape(m * c, m * c)
    evals, evecs = torch.linalg.eigh(0.5 * (flat + flat.T))
    tol = m * c * torch.finfo(flat.dtype).eps if eig_tol is None else eig_tol
    keep = evals > tol * evals.max().clamp_min(0)
    if not bool(keep.any()):
        raise ValueError("landmarks: the landmark kernel is zero; the features would be empty")
    return evecs[:, keep] / evals[keep].sqrt()


def select_landmarks(
    data: Batches,
    num_landmarks: int,
    method: LandmarkMethod = "random",
    seed: int = 0,
    batch_size: int = 256,
) -> Tensor:
    """M landmark inputs (M, ...) from the training inputs: ``"random"`` draws M distinct
    points (seeded); ``"kmeans"`` runs k-means (scikit-learn) on the flattened inputs and
    snaps each centre, in turn, to the nearest training input not taken yet, so landmarks
    are always real data points."""
    if method not in _METHODS:
        raise ValueError(f"landmarks: expected one of {_METHODS} or a tensor, got {method!r}")
    batches = as_batches(data, batch_size=batch_size)
    n = num_examples(batches)
    if num_landmarks > n:
        raise ValueError(
            f"num_landmarks: {num_landmarks} exceeds the number of training points N = {n}"
        )
    if method == "random":
        gen = torch.Generator().manual_seed(seed)
        chosen = torch.randperm(n, generator=gen)[:num_landmarks].sort().values
        rows, offset = [], 0
        for x, _ in batches:
            hit = chosen[(chosen >= offset) & (chosen < offset + x.shape[0])] - offset
            rows.append(x[hit])
            offset += x.shape[0]
        return torch.cat(rows)
    from gaussify.extras import require

    KMeans = require("sklearn.cluster", 'ELLA landmarks="kmeans"').KMeans
    x_all = torch.cat([x for x, _ in batches])
    flat = x_all.reshape(n, -1).double()
    centres = KMeans(n_clusters=num_landmarks, n_init=1, random_state=seed).fit(flat.numpy())
    dist = torch.cdist(torch.as_tensor(centres.cluster_centers_, dtype=flat.dtype), flat)
    taken = torch.zeros(n, dtype=torch.bool)
    idx = []
    for row in dist:
        j = int(row.masked_fill(taken, float("inf")).argmin())
        taken[j] = True
        idx.append(j)
    return x_all[torch.tensor(idx)]


class ELLA(EvidenceTuning, DeclaredCapabilities):
    """Nystrom-accelerated linearised Laplace (Deng et al. 2022) with the full C x C
    likelihood Hessian blocks.

    ``num_landmarks`` M (<= N), ``landmarks``: "random" | "kmeans" | a tensor of inputs
    (M, ...). ``prior_precision``: scalar, per parameter tensor or per parameter (only a
    scalar can be changed after fitting). ``seed`` seeds the landmark choice. ``eig_tol``:
    relative eigenvalue cut of the landmark kernel (:func:`nystrom_projection`).
    """

    unsupported: ClassVar[dict[str, str]] = {
        "sample": "ELLA's Gaussian is over the coefficients of its R Nystrom features of the "
        "kernel, not over the network's weights, so it has no weight samples; use "
        "predict(x, link='mc') for function-space samples, or FunctionalLaplace / Laplace / "
        "VaLLA.sample for weights",
    }

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood = "classification",
        num_landmarks: int = 100,
        landmarks: LandmarkMethod | Tensor = "random",
        prior_precision: float | Tensor = 1.0,
        sigma_noise: float | Tensor = 1.0,
        subset: str | list[str] = "all",
        seed: int = 0,
        *,
        eig_tol: float | None = None,
        chunk_size: int | None = None,
        route: Route = "auto",
    ) -> None:
        num_landmarks = check_count(num_landmarks, "num_landmarks")
        if chunk_size is not None:
            chunk_size = check_count(chunk_size, "chunk_size")
        if not isinstance(landmarks, Tensor) and landmarks not in _METHODS:
            raise ValueError(
                f"landmarks: expected one of {_METHODS} or a tensor of inputs, got {landmarks!r}"
            )
        self.model = model
        self.likelihood = get_likelihood(likelihood, sigma_noise=sigma_noise)
        self.task = self.likelihood.task
        warn_if_squashed_output(model, self.task)
        self.subset: ParameterSubset = select_parameters(model, subset)
        self.num_landmarks = num_landmarks
        self.landmarks = landmarks
        self.seed = seed
        self.eig_tol = eig_tol
        self.chunk_size = chunk_size
        self.route: Route = route
        first = next(model.parameters())
        dtype = first.dtype
        prior = torch.as_tensor(prior_precision, dtype=dtype, device=first.device)
        prior = check_prior(prior).clone()
        expand_prior(prior, self.subset)
        self.prior_precision = prior
        self.sigma_noise = check_sigma_noise(sigma_noise, self.task, dtype, first.device).clone()
        #: outcome of the last optimize_prior (converged, steps, gradient, evidence)
        self.tuning_result: TuningResult | None = None
        self._fitted = False
        self._chol: Tensor | None = None

    # ------------------------------------------------------------------ features
    def _kernel_to_landmarks(self, x: Tensor) -> Tensor:
        """k(Z, x) at the fitted prior, (MC, B, C)."""
        k = ntk(
            self.model,
            self._z,
            x,
            self.subset,
            self._prior_fit,
            self.chunk_size,
            route=self.route,
        )
        m, c = k.shape[:2]
        return k.reshape(m * c, x.shape[0], c)

    def _features(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            return torch.einsum("kr,kbc->brc", self._proj, self._kernel_to_landmarks(x))

    @in_eval_mode
    def features(self, x: Tensor) -> Tensor:
        """The Nystrom feature map phi(x) (N, R, C) at the fitted prior precision, with
        phi(x)^T phi(x') ~= k(x, x')."""
        self._require_fit()
        check_inputs(x, self.model)
        return self._features(x)

    @property
    def num_features(self) -> int:
        """R, the number of retained eigen-directions of the landmark kernel."""
        self._require_fit()
        return int(self._proj.shape[1])

    # ------------------------------------------------------------------ fitting
    @transactional
    @distributed.collective("ELLA.fit")
    @in_eval_mode
    def fit(self, data: Batches, *, batch_size: int = 256) -> ELLA:
        """Choose the landmarks, build the feature map, and accumulate the R x R posterior
        statistics in one pass over ``data`` at the current weights theta*."""
        batches = validated_batches(
            data,
            batch_size,
            model=self.model,
            task=self.task,
            owner="ELLA.fit",
            multi_pass=not isinstance(self.landmarks, Tensor),
        )
        self.model.eval()
        if isinstance(self.landmarks, Tensor):
            z = self.landmarks
            check_inputs(z, self.model, "landmarks")  # non-empty, finite, the model's width
        else:
            z = select_landmarks(batches, self.num_landmarks, self.landmarks, self.seed, batch_size)
        self._z = z = distributed.broadcast(z)  # rank 0's landmarks under torch.distributed
        self._prior_fit = self.prior_precision.clone()
        self.theta_star = self.subset.flatten(self.subset.params(self.model)).clone()
        mc = z.shape[0] * model_outputs(self.model, z[:1], self.chunk_size).shape[1]
        check_allocation(
            mc * mc,
            self.theta_star.dtype,
            f"ELLA: the (M C)^2 landmark kernel (M C = {mc:,})",
            "fewer landmarks (num_landmarks)",
            device=self.theta_star.device,
        )
        with torch.no_grad():
            k_zz = ntk(
                self.model, z, None, self.subset, self._prior_fit, self.chunk_size, route=self.route
            )
        self._proj = nystrom_projection(k_zz, self.eig_tol)
        r = self._proj.shape[1]
        regression = self.task == "regression"
        stats: dict[str, Tensor] = {}
        num_data = 0
        wide = torch.float64  # statistics summed in float64 (the evidence is evaluated in it)
        for x, y in batches:
            phi = self._features(x).to(wide)  # (B, R, C)
            f = model_outputs(self.model, x, self.chunk_size)
            m = -jvp(self.model, x, self.subset, self.theta_star, self.chunk_size).to(wide)
            if regression:
                e = y.reshape(f.shape).to(wide) - f.to(wide)
                part = {
                    "gram": torch.einsum("brc,bsc->crs", phi, phi),
                    "phi_e": torch.einsum("brc,bc->cr", phi, e),
                    "phi_m": torch.einsum("brc,bc->cr", phi, m),
                    "em": (e * m).sum(0),
                    "mm": m.square().sum(0),
                    "sse": e.square().sum(0),
                }
            else:
                lam_sqrt = self.likelihood.hessian_sqrt(f).to(wide)
                lam = lam_sqrt @ lam_sqrt.transpose(-1, -2)
                res = self.likelihood.residual(f, y).to(wide)
                lam_m = torch.einsum("bij,bj->bi", lam, m)
                pl = torch.einsum("brc,bca->rba", phi, lam_sqrt).reshape(r, -1)
                part = {
                    "gram": pl @ pl.T,
                    "s": torch.einsum("brc,bc->r", phi, res - lam_m),
                    "log_lik": self.likelihood.log_prob(f, y).sum().to(wide),
                    "rm": (res * m).sum(),
                    "mlm": (m * lam_m).sum(),
                }
            for key, value in part.items():
                stats[key] = value if key not in stats else stats[key] + value
            num_data += x.shape[0]
        stats = dict(zip(stats, distributed.all_reduce_sum(*stats.values()), strict=True))
        num_data = distributed.all_reduce_sum(num_data)
        if num_data == 0:
            raise ValueError("data: contains no examples")
        self._stats = {k: v.to(wide) for k, v in stats.items()}
        self.num_data = num_data
        self._fitted = True
        self._chol = None
        return self

    def _require_fit(self) -> None:
        if not self._fitted:
            raise RuntimeError("ELLA: call fit(data) before using the posterior")

    # ------------------------------------------------------------------ posterior algebra
    def _factor(self, prior: Tensor) -> Tensor:
        """c = delta_fit / delta: the kernel (and phi phi^T) scale for a new scalar prior."""
        if self._prior_fit.numel() != 1 or prior.numel() != 1:
            if prior.shape == self._prior_fit.shape and torch.equal(
                prior.detach(), self._prior_fit
            ):
                return torch.ones((), dtype=self._proj.dtype)
            raise ValueError(
                "prior_precision: ELLA can only change a scalar prior precision after fit "
                f"(fitted with shape {tuple(self._prior_fit.shape)}); refit with the new prior"
            )
        check_prior(prior.detach())
        return (self._prior_fit.reshape(()) / prior.reshape(())).to(self._proj.dtype)

    def _posterior_terms(self, prior: Tensor, sigma: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(A (R, R), s (R,), log p(y | f*) + r^T m - 1/2 m^T Lambda m) at the hyperparameters."""
        st = self._stats
        c = self._factor(prior)
        if self.task == "regression":
            w = (1.0 / sigma.square()).expand(st["sse"].shape).to(st["sse"].dtype)
            gram = torch.einsum("c,crs->rs", w, st["gram"])
            s = torch.einsum("c,cr->r", w, st["phi_e"] - st["phi_m"])
            log_lik = gaussian_log_likelihood(st["sse"], self.num_data, sigma)
            const = log_lik + (w * st["em"]).sum() - 0.5 * (w * st["mm"]).sum()
        else:
            gram, s = st["gram"], st["s"]
            const = st["log_lik"] + st["rm"] - 0.5 * st["mlm"]
        eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
        return eye + c * gram, c.sqrt() * s, const

    def log_marginal_likelihood(
        self,
        prior_precision: Tensor | float | None = None,
        sigma_noise: Tensor | float | None = None,
    ) -> Tensor:
        """Laplace-GGN log evidence with the Nystrom kernel (module docstring), differentiable
        in a scalar prior precision and the regression noise."""
        self._require_fit()
        dtype = self._proj.dtype
        prior, sigma = hyperparameters_or_current(
            self, prior_precision, sigma_noise, dtype, self._proj.device
        )
        a, s, const = self._posterior_terms(prior, sigma)
        st = self._stats
        outputs = int(st["sse"].numel()) if self.task == "regression" else 1
        if self.task == "regression":
            log_lik = gaussian_log_likelihood(st["sse"], self.num_data, sigma)
        else:
            log_lik = st["log_lik"]
        lik = self.likelihood if self.task != "regression" else Gaussian(sigma)
        result = feature_log_evidence(
            log_lik,
            const,
            a,
            s,
            supremum=log_likelihood_supremum(lik, self.num_data, outputs, sigma),
            prior_quad=(expand_prior(prior, self.subset) * self.theta_star.square()).sum(),
        )
        if result.dropped:
            warn_dropped_correction(result, self, self._stats)
        return finite_evidence(result.value.to(dtype))

    def _grid_evidence(self, progress: bool) -> tuple[Callable[[Tensor], Tensor], torch.dtype]:
        return self.log_marginal_likelihood, self._proj.dtype

    def _evidence_problem(
        self, granularity: str, tune_noise: bool, progress: bool
    ) -> EvidenceProblem:
        return EvidenceProblem(
            self.log_marginal_likelihood,
            self.prior_precision.reshape(()).to(self._proj.dtype),
            prior_from_weights(self.theta_star),
            residual_rms(self._stats["sse"], self.num_data) if tune_noise else None,
        )

    def _set_tuned(self, result: TuningResult, granularity: str) -> None:
        self.prior_precision = result.prior_precision
        if result.sigma_noise is not None:
            self.sigma_noise = result.sigma_noise
            self.likelihood = get_likelihood("regression", sigma_noise=result.sigma_noise)
        self._chol = None

    # ------------------------------------------------------------------ prediction
    def _posterior_chol(self) -> tuple[Tensor, Tensor]:
        if self._chol is None:
            with torch.no_grad():
                a, _, _ = self._posterior_terms(self.prior_precision, self.sigma_noise)
                # factorised in float64 (the statistics' dtype), kept in the model's dtype
                chol = torch.linalg.cholesky(0.5 * (a + a.T))
                self._chol = chol.to(self._proj.dtype)
        return self._chol, self._factor(self.prior_precision).detach()

    @in_eval_mode
    def functional_covariance(self, x: Tensor) -> Tensor:
        """Posterior covariance of the outputs at each input, c phi*^T A^-1 phi* (N, C, C)."""
        self._require_fit()
        check_inputs(x, self.model)
        chol, c = self._posterior_chol()
        m, r = self._z.shape[0], self.num_features
        per_input = max(1, m * r)
        covs = []
        for sl in chunk_slices(x.shape[0], max(1, PREDICT_BLOCK_ELEMENTS // per_input)):
            phi = self.features(x[sl])  # (B, R, C)
            b, _, k = phi.shape
            z = torch.linalg.solve_triangular(
                chol, phi.permute(1, 0, 2).reshape(r, b * k), upper=False
            ).reshape(r, b, k)
            cov = c * torch.einsum("rbi,rbj->bij", z, z)
            covs.append(0.5 * (cov + cov.transpose(-1, -2)))
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
        """Predictive N(f(x; theta*), c phi(x)^T A^-1 phi(x)) through the shared
        :class:`~gaussify.predictive.Predictive`; cost independent of the training set size."""
        self._require_fit()
        check_inputs(x, self.model)
        num_samples = check_count(num_samples, "num_samples")
        if method != "glm":
            raise ValueError(
                f"method: ELLA predicts with the linearised model 'glm', got {method!r}"
            )
        f_mean = model_outputs(self.model, x, self.chunk_size)
        return posterior_predictive(
            f_mean,
            self.functional_covariance(x),
            self.task,
            self.sigma_noise,
            link,
            num_samples,
            generator,
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The fitted state with its identity (task, subset, fingerprint of the network's
        other weights); tensors and plain values, readable with ``weights_only=True``."""
        self._require_fit()
        return copy_state(
            {
                **identity(self.task, self.subset.names, self.model),
                "landmarks": self._z,
                "projection": self._proj,
                "prior_fit": self._prior_fit,
                "prior_precision": self.prior_precision,
                "sigma_noise": self.sigma_noise,
                "theta_star": self.theta_star,
                "num_data": self.num_data,
                "stats": dict(self._stats),
            }
        )

    def _state_schema(self) -> dict[str, Any]:
        dt = self.prior_precision.dtype
        if self.task == "regression":
            stats = {"gram": ("C", "R", "R"), "phi_e": ("C", "R"), "phi_m": ("C", "R")}
            stats.update({k: ("C",) for k in ("em", "mm", "sse")})
        else:
            stats = {"gram": ("R", "R"), "s": ("R",), "log_lik": (), "rm": (), "mlm": ()}
        return {
            **st.identity_schema(self.task, self.subset.names),
            "landmarks": st.TensorSpec(("M", ...), None),
            "projection": st.TensorSpec((None, "R"), dt),
            "prior_fit": st.TensorSpec(None, dt, positive=True),
            "prior_precision": st.TensorSpec(None, dt, positive=True),
            "sigma_noise": st.TensorSpec(None, dt, positive=True),
            "theta_star": st.TensorSpec(("P",), dt),
            "num_data": st.Integer(1),
            # the statistics are summed in float64 (a state in the model's dtype loads too)
            "stats": st.Nested(
                {k: st.TensorSpec(s, (dt, torch.float64)) for k, s in stats.items()}
            ),
        }

    @transactional
    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Restore a state from :meth:`state_dict` into an ELLA over the same model: the
        whole state is validated first (:mod:`gaussify.state`), theta* and the other weights
        against the model (a mismatch raises; ``strict=False`` warns); a failed load
        changes nothing."""
        valid = st.validate_own_state(self, state, strict=strict)
        expand_prior(valid["prior_fit"], self.subset)  # the granularity fits this subset
        self._z, self._proj = valid["landmarks"].clone(), valid["projection"].clone()
        self._prior_fit = valid["prior_fit"].clone()
        self.prior_precision = check_prior(valid["prior_precision"].clone())
        self.sigma_noise = valid["sigma_noise"].clone()
        self.theta_star, self.num_data = valid["theta_star"].clone(), valid["num_data"]
        self._stats = {k: v.to(torch.float64).clone() for k, v in valid["stats"].items()}
        if self.task == "regression":
            self.likelihood = get_likelihood("regression", sigma_noise=self.sigma_noise)
        self._fitted = True
        self._chol = None
