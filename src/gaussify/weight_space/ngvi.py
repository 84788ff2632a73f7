"""Natural-gradient variational inference with the GGN (Immer thesis Ch. 4, App. C).

One engine, :class:`NaturalGradientVI`, keeps q_t(theta) = N(mu_t, Lambda_t^-1) in natural
parameters (eq. 4.1) and takes the NGVI step of eq. 4.2-4.3 (derived in eq. C.8),

    Lambda_{t+1} = (1 - gamma) Lambda_t + gamma (P0 + N/B * (1/S) sum_s J_s^T Lambda(f_s) J_s)
    mu_{t+1}     = mu_t + gamma Lambda_{t+1}^-1 (N/B * (1/S) sum_s J_s^T r(y, f_s) - P0 mu_t),

(the mean form follows from eq. 4.2 with Lambda_{t+1} substituted; prior mean 0). The variants
differ only in where they sample and linearise (Table 4.1 / 4.2):

* :class:`VOGGN` (Sec. 4.2, eq. 4.7-4.8): S networks theta_s ~ q_t, each with its own output
  f(x; theta_s) and Jacobian J(x; theta_s);
* :class:`LGVA` (Sec. 4.3, eq. 4.9-4.10): one linearisation at mu_t; S samples of the linear
  model, f_s = f(x; mu_t) + J(x; mu_t)(theta_s - mu_t), J_s = J(x; mu_t);
* :class:`OGGN` (Sec. 4.4, eq. 4.11-4.12): the mean only, f_s = f(x; mu_t), J_s = J(x; mu_t);
* :class:`~gaussify.weight_space.glm_vi.GLMVI` (Immer et al. 2021): LGVA with the
  linearisation point fixed at theta* (the MAP).

The data term of Lambda lives in a curvature structure (``gaussify.curvature``): "full" and
"diag" are exact exponential moving averages of the (diagonal) GGN. "kron" keeps one
Kronecker product B_l kron A_l per layer and averages the two factors separately (noisy K-FAC,
Zhang et al. 2018): B_l <- (1-gamma) B_l + gamma N E[g g^T] and A_l a running mean of E[a a^T]
(see :func:`blend_curvature`). That replaces the average of the products by the product of the
averages, an approximation beyond KFAC itself; it is exact for gamma = 1, and with identical
batches it follows the exact ramp of the full structure. The prior precision is added afresh
at every step, which is exact because (1-gamma) P0 + gamma P0 = P0.

For "diag" and "kron" the mean step is capped at the exact line-search minimiser of the
step's GGN quadratic model (``safeguard``; :func:`~gaussify.weight_space.ngvi_math.mean_step_size`):
a structured Lambda under-estimates the curvature along correlated weights, and the plain step
gamma Lambda^-1 g diverges once gamma lambda_max(Lambda^-1 H) > 2. The pure functions (blend,
Lambda_0, KL, step size) live in :mod:`gaussify.weight_space.ngvi_math`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn
from torch.func import vmap

from gaussify.batches import Batches, as_batches, num_examples
from gaussify.curvature import make_curvature
from gaussify.curvature.jacobian import jacobians, jvp, jvp_with_outputs, vjp
from gaussify.curvature.subset import check_prior, expand_prior, select_parameters
from gaussify.fastpath import functional_call
from gaussify.likelihoods import Likelihood, check_sigma_noise, get_likelihood
from gaussify.model_checks import in_eval_mode, warn_if_squashed_output
from gaussify.posterior import DeclaredCapabilities
from gaussify.predictive import (
    LinkName,
    Predictive,
    noise_variance,
    posterior_predictive,
    predictive_from_samples,
)
from gaussify.state import (
    Choice,
    Integer,
    Maybe,
    Names,
    Nested,
    Number,
    TensorSpec,
    check_fingerprint,
    model_fingerprint,
    require_task,
    transactional,
    validate_state,
)
from gaussify.validation import check_count, check_data, check_inputs, check_targets
from gaussify.weight_space.dense_views import DenseViews
from gaussify.weight_space.ngvi_math import (
    STRUCTURES,
    Structure,
    blend_curvature,
    gaussian_kl,
    initial_curvature_state,
    mean_step_size,
    output_quadratic,
)

__all__ = [
    "LGVA",
    "OGGN",
    "STRUCTURES",
    "VOGGN",
    "NGVIHistory",
    "NaturalGradientVI",
    "blend_curvature",
    "gaussian_kl",
    "initial_curvature_state",
]


@dataclass
class NGVIHistory:
    """Convergence monitor: per-epoch ELBO estimates (common random numbers across epochs),
    the mean per-example log-likelihood seen by the steps, and whether ``tol`` stopped fit."""

    elbo: list[float] = field(default_factory=list)
    log_lik: list[float] = field(default_factory=list)
    converged: bool = False


# --------------------------------------------------------------------------- the engine


class NaturalGradientVI(DenseViews, DeclaredCapabilities):
    """Natural-gradient Gaussian VI with the GGN (thesis eq. 4.1-4.3); use a variant class.

    ``likelihood``: "classification", "regression", "binary" or a likelihood object;
    ``structure``: "full" | "diag" | "kron" (structure of Lambda); ``prior_precision``: scalar,
    per parameter tensor, or per parameter (P0 = diag); ``lr``: the step size gamma in (0, 1];
    ``num_samples``: S >= 1 Monte Carlo samples per step (OGGN uses the mean and ignores it);
    ``subset``: "all", "last_layer" or names; ``init_precision``: Lambda_0 = init * I (default
    the prior precision, i.e. q_0 has the prior's covariance; the thesis uses 10 for Sigma_0 =
    0.1 I); ``antithetic``: draw the S samples in pairs mu +- eps (S even), which makes their
    mean exactly mu; ``num_data``: N for :meth:`step` (fit sets it); ``seed``/``generator``:
    all sampling and shuffling. Extra keyword arguments go to the curvature (e.g.
    ``kfac_approx``, ``kron_bias``, ``mc_samples``). ``safeguard`` (default True): for "diag"
    and "kron", cap the mean step at the minimiser of the step's GGN quadratic model along
    the natural-gradient direction (:func:`~gaussify.weight_space.ngvi_math.mean_step_size`;
    a structured Lambda can under-estimate the curvature along that direction by orders of
    magnitude, and the plain step then diverges); never active for "full".

    The subset's parameters of ``model`` hold the mean mu_t after every step (VOGGN writes
    each theta_s in turn and restores mu); for GLM-VI they stay at theta*.
    """

    #: where the Jacobians are taken: each sample ("sample"), the mean ("mean") or theta* ("map")
    linearization: ClassVar[str] = "mean"
    #: whether S samples are drawn (False: the mean is the only evaluation point)
    sampling: ClassVar[bool] = True
    #: the predictive that matches the inference (thesis Sec. 4.6)
    default_method: ClassVar[str] = "glm"

    unsupported: ClassVar[dict[str, str]] = {
        "log_marginal_likelihood": "natural-gradient VI maximises the ELBO, a lower bound on "
        "log p(D), and has no evidence estimate of its own; use elbo(data), or Laplace for "
        "the Laplace evidence at the same weights",
        "optimize_prior": "q's precision is kept as the GGN sum plus the prior (eq. 4.3), so "
        "the prior cannot change without refitting; tune it with Laplace.optimize_prior or "
        "marglik_training before fit (as the NGVI experiments do)",
    }

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood = "classification",
        structure: Structure = "full",
        prior_precision: float | Tensor = 1.0,
        lr: float = 0.1,
        num_samples: int = 1,
        subset: str | list[str] = "all",
        sigma_noise: float | Tensor = 1.0,
        *,
        init_precision: float | None = None,
        antithetic: bool = False,
        num_data: int | None = None,
        seed: int | None = 0,
        generator: torch.Generator | None = None,
        safeguard: bool = True,
        **curvature_options: Any,
    ) -> None:
        if type(self) is NaturalGradientVI:
            raise TypeError("NaturalGradientVI: use VOGGN, LGVA, OGGN or GLMVI")
        if structure not in STRUCTURES:
            raise ValueError(f"structure: expected one of {STRUCTURES}, got {structure!r}")
        if isinstance(lr, bool) or not isinstance(lr, int | float) or not 0 < lr <= 1:
            raise ValueError(f"lr: the step size gamma must be in (0, 1], got {lr!r}")
        num_samples = check_count(num_samples, "num_samples")
        if antithetic and num_samples % 2:
            raise ValueError(f"num_samples: antithetic pairs need an even S, got {num_samples}")
        if init_precision is not None and not (
            math.isfinite(init_precision) and init_precision > 0
        ):
            raise ValueError(f"init_precision: must be finite and > 0, got {init_precision!r}")
        if num_data is not None:
            num_data = check_count(num_data, "num_data")
        self.model = model
        self.likelihood = get_likelihood(likelihood, sigma_noise=sigma_noise)
        self.task = self.likelihood.task
        warn_if_squashed_output(model, self.task)
        self.structure = structure
        self.subset = select_parameters(model, subset)
        self.lr = float(lr)
        self.num_samples = num_samples
        self.antithetic = antithetic
        self.safeguard = bool(safeguard) and structure != "full"
        #: the step size alpha of the last mean update (gamma unless the safeguard capped it)
        self.mean_step = self.lr
        self.num_data = num_data
        self.seed = seed
        self.generator = generator or torch.Generator().manual_seed(0 if seed is None else seed)
        self.curvature_options = curvature_options
        self._named = dict(model.named_parameters())
        self.mean = self.subset.flatten(self.subset.params(model)).clone()
        dtype = self.mean.dtype
        device = self.mean.device
        prior = torch.as_tensor(prior_precision, dtype=dtype, device=device)
        self.prior_precision = check_prior(prior).clone()
        self._prior_vec = expand_prior(self.prior_precision, self.subset).to(dtype)
        self.sigma_noise = check_sigma_noise(sigma_noise, self.task, dtype, device).clone()
        # theta_lin: the linearisation point of the GLM predictive (theta* for GLM-VI).
        self.theta_lin: Tensor | None = self.mean.clone() if self.linearization == "map" else None
        holder_options = dict(curvature_options)
        if structure == "full":
            holder_options.setdefault("eig_cache", False)  # one Cholesky per step, not eigh
        self._holder = make_curvature(
            structure, model, self.likelihood, self.subset, **holder_options
        )
        excess = {
            n: (init_precision - p if init_precision is not None else torch.zeros_like(p))
            for n, p in zip(
                self.subset.names, self._prior_vec.split(list(self.subset.numels)), strict=True
            )
        }
        self._state = initial_curvature_state(
            structure, self._holder.state_dict(), list(self.subset.names), excess
        )
        self._posterior: Any = None
        self.steps = 0
        self.history = NGVIHistory()

    # ------------------------------------------------------------------ posterior
    @property
    def posterior(self) -> Any:
        """The structured precision Lambda_t (logdet, solve, sample, functional_cov, ...)."""
        if self._posterior is None:
            # W.<path>: kron's running-mean weights, not part of the curvature's own state
            self._holder.load_state_dict(
                {k: v for k, v in self._state.items() if not k.startswith("W.")}
            )
            self._posterior = self._holder.posterior(self.prior_precision, 1.0)
        return self._posterior

    def sample(self, num_samples: int = 100, generator: torch.Generator | None = None) -> Tensor:
        """Weight samples from q_t, (S, P) in the subset's flattening order."""
        num_samples = check_count(num_samples, "num_samples")
        return self.mean + self.posterior.sample(num_samples, generator=generator or self.generator)

    def _draws(self) -> Tensor:
        """The evaluation points theta_s of one step, (S, P) (just mu for OGGN)."""
        if not self.sampling:
            return self.mean.unsqueeze(0)
        if not self.antithetic:
            return self.sample(self.num_samples)
        eps = self.posterior.sample(self.num_samples // 2, generator=self.generator)
        return self.mean + torch.cat([eps, -eps])

    def _write(self, theta: Tensor) -> None:
        with torch.no_grad():
            for name, value in self.subset.unflatten(theta).items():
                self._named[name].copy_(value)

    def _point(self) -> Tensor:
        """The linearisation point of the GLM: theta* (GLM-VI) or the mean."""
        return self.mean if self.theta_lin is None else self.theta_lin

    # ------------------------------------------------------------------ updates
    def _new_curvature(self) -> Any:
        return make_curvature(
            self.structure,
            self.model,
            self.likelihood,
            self.subset,
            generator=self.generator,
            **self.curvature_options,
        )

    def _estimate_sampled_networks(
        self, curvature: Any, x: Tensor, y: Tensor, thetas: Tensor
    ) -> tuple[Tensor, float]:
        """VOGGN (eq. 4.7-4.8): GGN and gradient at each theta_s, sums over s and the batch."""
        grad = torch.zeros_like(self.mean)
        log_lik = 0.0
        params = [self._named[n] for n in self.subset.names]
        try:
            for theta in thetas:
                self._write(theta)
                curvature.update(self.model, x, y)
                with torch.enable_grad():
                    value = self.likelihood.log_prob(self.model(x), y).sum()
                    grads = torch.autograd.grad(value, params)
                grad += torch.cat([g.reshape(-1) for g in grads])
                log_lik += float(value.detach())
        finally:
            self._write(self.mean)
        return grad, log_lik

    def _estimate_linearized(
        self, curvature: Any, x: Tensor, y: Tensor, thetas: Tensor
    ) -> tuple[Tensor, float, Tensor]:
        """LGVA / OGGN / GLM-VI (eq. 4.9-4.12): one linearisation at the model's current
        weights theta_lin; f_s = f(x; theta_lin) + J (theta_s - theta_lin), GGN with Lambda at
        f_s (the curvature's ``offset``) and gradient J^T sum_s r(y, f_s). Also returns the
        outputs f_s, (S, B, C)."""
        point = self._point()
        shifts = thetas - point
        if not bool(shifts.any()):  # OGGN: the mean is the linearisation point
            with torch.no_grad():
                f = self.model(x)
            curvature.update(self.model, x, y)
            residual = self.likelihood.residual(f, y)
            log_lik = float(self.likelihood.log_prob(f, y).sum())
            return vjp(self.model, x, self.subset, residual), log_lik, f.unsqueeze(0)
        offsets = []
        f = x
        for shift in shifts:
            f, offset = jvp_with_outputs(self.model, x, self.subset, shift)
            offsets.append(offset)
        f = f.detach()
        s = len(offsets)
        offset_all = torch.cat(offsets).detach()
        f_all = f.repeat(s, 1) + offset_all
        y_all = y.repeat(s, *([1] * (y.ndim - 1)))
        x_all = x.repeat(s, *([1] * (x.ndim - 1)))
        curvature.update(self.model, x_all, y_all, offset=offset_all)
        residual = self.likelihood.residual(f_all, y_all).reshape(s, *f.shape).sum(0)
        log_lik = float(self.likelihood.log_prob(f_all, y_all).sum())
        return vjp(self.model, x, self.subset, residual), log_lik, f_all.reshape(s, *f.shape)

    def _ggn_quadratic(
        self, x: Tensor, thetas: Tensor, outputs: Tensor | None, v: Tensor
    ) -> Tensor:
        """v^T (sum_s J_s^T Lambda(f_s) J_s) v over the batch, the data part of the step's GGN
        along v: one forward-mode product per evaluation point (VOGGN: each theta_s; else
        theta_lin, with the step's outputs ``outputs`` (S, B, C))."""
        if outputs is not None:
            jv = jvp(self.model, x, self.subset, v).detach()
            hess = self.likelihood.hessian(outputs.reshape(-1, outputs.shape[-1]))
            return output_quadratic(hess.reshape(*outputs.shape, -1), jv)
        total = torch.zeros((), dtype=v.dtype, device=v.device)
        try:
            for theta in thetas:
                self._write(theta)
                f, jv = jvp_with_outputs(self.model, x, self.subset, v)
                total = total + output_quadratic(self.likelihood.hessian(f.detach()), jv.detach())
        finally:
            self._write(self.mean)
        return total

    @transactional
    @in_eval_mode
    def step(self, batch: tuple[Tensor, Tensor], num_data: int | None = None) -> float:
        """One NGVI step (eq. 4.2-4.3) on a minibatch ``(x (B, ...), y)`` of a data set of
        ``num_data`` examples (default: the constructor's, else B, i.e. full batch). Returns
        the Monte Carlo estimate of the batch's mean log-likelihood under q_t."""
        x, y = batch
        check_inputs(x, self.model)
        check_targets(y, self.task, name="y", num_rows=x.shape[0])
        if num_data is not None:
            num_data = check_count(num_data, "num_data")
        n_total = num_data or self.num_data or int(x.shape[0])
        self.model.eval()
        thetas = self._draws()
        curvature = self._new_curvature()
        outputs: Tensor | None = None
        if self.linearization == "sample":
            grad, log_lik = self._estimate_sampled_networks(curvature, x, y, thetas)
        else:
            grad, log_lik, outputs = self._estimate_linearized(curvature, x, y, thetas)
        rows = len(thetas)
        self._state = blend_curvature(
            self.structure, self._state, curvature.state_dict(), self.lr, n_total
        )
        self._posterior = None
        # eq. 4.2 with Lambda_{t+1} substituted: mu + gamma Lambda_{t+1}^-1 (g - P0 mu).
        scale = n_total / (rows * x.shape[0])
        ascent = scale * grad - self._prior_vec * self.mean
        direction = self.posterior.solve(ascent)
        if not torch.isfinite(direction).all():
            raise FloatingPointError(
                f"{type(self).__name__}: the mean update is not finite at step {self.steps}; "
                "lower lr or raise prior_precision / init_precision"
            )
        self.mean_step = self.lr
        if self.safeguard:  # diag / kron: the step's GGN line search (ngvi_math.mean_step_size)
            curv = (self._prior_vec * direction.square()).sum()
            curv = curv + scale * self._ggn_quadratic(x, thetas, outputs, direction)
            self.mean_step = mean_step_size(self.lr, ascent @ direction, curv)
        self.mean = self.mean + self.mean_step * direction
        if self.theta_lin is None:
            self._write(self.mean)
        self.steps += 1
        return log_lik / (rows * x.shape[0])

    @transactional(model=True)
    @in_eval_mode
    def fit(
        self,
        data: Batches,
        epochs: int = 1,
        batch_size: int = 128,
        progress: bool = False,
        *,
        shuffle: bool = True,
        monitor: bool = True,
        elbo_samples: int = 10,
        tol: float | None = None,
    ) -> NaturalGradientVI:
        """``epochs`` passes of minibatch (doubly stochastic) NGVI steps over ``data`` (a
        DataLoader or an ``(x, y)`` pair, shuffled with the engine's generator). With
        ``monitor`` the ELBO is estimated after each epoch (``history.elbo``); with ``tol``
        fitting stops once it changes by less than ``tol`` per example."""
        epochs = check_count(epochs, "epochs")
        batch_size = check_count(batch_size, "batch_size")
        if monitor:
            elbo_samples = check_count(elbo_samples, "elbo_samples")
        data = check_data(
            data,
            model=self.model,
            task=self.task,
            owner=f"{type(self).__name__}.fit",
            multi_pass=True,
        )
        self.num_data = num_examples(data)
        batches = as_batches(data, batch_size, shuffle=shuffle, generator=self.generator)
        epoch_iter: Any = range(epochs)
        if progress:
            from tqdm.auto import tqdm

            epoch_iter = tqdm(epoch_iter, desc=f"{type(self).__name__} ({self.structure})")
        for _ in epoch_iter:
            total, count = 0.0, 0
            for x, y in batches:
                total += self.step((x, y), self.num_data) * x.shape[0]
                count += x.shape[0]
            self.history.log_lik.append(total / max(count, 1))
            if not monitor:
                continue
            self.history.elbo.append(float(self.elbo(data, elbo_samples, batch_size=batch_size)))
            if progress:
                epoch_iter.set_postfix(elbo=self.history.elbo[-1])
            elbo = self.history.elbo
            if tol is not None and len(elbo) > 1 and abs(elbo[-1] - elbo[-2]) < tol * count:
                self.history.converged = True
                break
        return self

    # ------------------------------------------------------------------ ELBO and prediction
    def _method(self, method: str | None) -> str:
        method = self.default_method if method is None else method
        if method not in ("glm", "nn"):
            raise ValueError(f"method: expected 'glm', 'nn' or None, got {method!r}")
        return method

    def _nn_outputs(self, x: Tensor, thetas: Tensor) -> Tensor:
        """Outputs of the networks with weights ``thetas (S, P)``, (S, N, C)."""

        def run(theta: dict[str, Tensor]) -> Tensor:
            return functional_call(self.model, theta, (x,), strict=False)

        with torch.no_grad():
            return vmap(run)(self.subset.unflatten(thetas))

    @in_eval_mode
    def elbo(
        self,
        data: Batches,
        num_samples: int = 10,
        *,
        method: Literal["glm", "nn"] | None = None,
        generator: torch.Generator | None = None,
        batch_size: int = 256,
    ) -> Tensor:
        """Monte Carlo ELBO E_q[log p(D | theta)] - KL(q || p) (thesis eq. 2.13-2.14).

        The likelihood is the network's (``method="nn"``, VOGGN's default) or that of the GLM
        linearised at the current point (``"glm"``: at mu for LGVA/OGGN, theta* for GLM-VI).
        Without a ``generator`` the draws come from a fixed seed, so successive estimates
        share random numbers and their differences reflect changes of q, not noise.
        """
        num_samples = check_count(num_samples, "num_samples")
        method = self._method(method)
        data = check_data(
            data, model=self.model, task=self.task, owner=f"{type(self).__name__}.elbo"
        )
        if generator is None:
            generator = torch.Generator().manual_seed(1 + (self.seed or 0))
        post = self.posterior
        thetas = self.mean + post.sample(num_samples, generator=generator)
        self.model.eval()
        total = torch.zeros((), dtype=self.mean.dtype, device=self.mean.device)
        for x, y in as_batches(data, batch_size):
            if method == "nn":
                f = self._nn_outputs(x, thetas)
                for fs in f:
                    total += self.likelihood.log_prob(fs, y).sum()
                continue
            for shift in thetas - self._point():
                f, offset = jvp_with_outputs(self.model, x, self.subset, shift)
                total += self.likelihood.log_prob((f + offset).detach(), y).sum()
        return total / num_samples - gaussian_kl(self.mean, post, self._prior_vec)

    @in_eval_mode
    def predict(
        self,
        x: Tensor,
        method: Literal["glm", "nn"] | None = None,
        link: LinkName = "probit",
        *,
        num_samples: int = 100,
        generator: torch.Generator | None = None,
        chunk_size: int = 256,
    ) -> Predictive:
        """Predictive at ``x (N, ...)``; ``method=None`` is the one matching the inference
        (thesis Sec. 4.6): NN sampling for VOGGN, the GLM predictive for LGVA, OGGN and
        GLM-VI. ``"glm"``: N(f(x; theta_lin) + J (mu - theta_lin), J Sigma J^T) with the
        ``link`` approximation; ``"nn"``: ``num_samples`` networks theta ~ q."""
        method = self._method(method)
        check_inputs(x, self.model)
        num_samples = check_count(num_samples, "num_samples")
        chunk_size = check_count(chunk_size, "chunk_size")
        noise_var = noise_variance(self.task, self.sigma_noise)
        self.model.eval()
        if method == "nn":
            thetas = self.sample(num_samples, generator)
            f = torch.cat([self._nn_outputs(xs, thetas) for xs in x.split(chunk_size)], dim=1)
            return predictive_from_samples(f, self.task, noise_var=noise_var)
        shift = self.mean - self._point()
        means, covs = [], []
        for xs in x.split(chunk_size):
            jac = jacobians(self.model, xs, self.subset)
            with torch.no_grad():
                means.append(self.model(xs) + jac @ shift)
            covs.append(self.posterior.functional_cov(jac))
        mean, cov = torch.cat(means), torch.cat(covs)
        return posterior_predictive(
            mean, cov, self.task, self.sigma_noise, link, num_samples, generator
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything to restore q_t (tensors and plain values: ``weights_only`` loadable),
        with its identity: variant, task, structure, subset and a fingerprint of the network's
        weights outside the subset (:func:`gaussify.state.model_fingerprint`)."""
        state: dict[str, Any] = {
            "variant": type(self).__name__,
            "task": self.task,
            "structure": self.structure,
            "subset": list(self.subset.names),
            "mean": self.mean.clone(),
            "prior_precision": self.prior_precision.clone(),
            "sigma_noise": self.sigma_noise.clone(),
            "lr": self.lr,
            "num_samples": self.num_samples,
            "num_data": self.num_data,
            "steps": self.steps,
            "curvature": {k: v.clone() for k, v in self._state.items()},
            "elbo": torch.tensor(self.history.elbo, dtype=torch.float64),
            "model_fingerprint": model_fingerprint(self.model, exclude=self.subset.names),
        }
        if self.theta_lin is not None:
            state["theta_lin"] = self.theta_lin.clone()
        return state

    def _state_schema(self) -> dict[str, Any]:
        dt = self.mean.dtype
        curvature = self._holder.state_schema()
        curvature.update(
            {f"W.{k[2:]}": TensorSpec((), "float") for k in curvature if k.startswith("A.")}
        )
        schema: dict[str, Any] = {
            "variant": Choice((type(self).__name__,), "the variant of this engine"),
            "task": Maybe(Choice((self.task,), "the task of this posterior")),
            "structure": Choice((self.structure,), "the structure of this posterior"),
            "subset": Names(tuple(self.subset.names)),
            "mean": TensorSpec(("P",), dt),
            "prior_precision": TensorSpec(None, dt, positive=True),
            "sigma_noise": TensorSpec(None, dt, positive=True),
            "lr": Number(),
            "num_samples": Integer(1),
            "num_data": Maybe(Integer(1), none=True),
            "steps": Integer(0),
            "curvature": Nested(curvature),
            "elbo": TensorSpec((None,), torch.float64, finite=False),
            "model_fingerprint": Maybe(TensorSpec((None, 3), None)),
        }
        if self.theta_lin is not None:
            schema["theta_lin"] = TensorSpec(("P",), dt)
        return schema

    @transactional(model=True)
    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Restore :meth:`state_dict` into an engine of the same variant over the same model;
        the model's subset parameters are set to mu (theta* for GLM-VI). The whole state is
        validated first (:mod:`gaussify.state`), including the network's weights outside the
        subset (a mismatch raises; ``strict=False`` warns); a failed load changes nothing."""
        valid = validate_state(
            state,
            self._state_schema(),
            owner=type(self).__name__,
            dims={"P": self.subset.num_params},
        )
        require_task(state, self.task, type(self).__name__)
        check_fingerprint(
            valid.get("model_fingerprint"),
            self.model,
            owner=type(self).__name__,
            exclude=self.subset.names,
            strict=strict,
        )
        prior = check_prior(valid["prior_precision"].clone())
        prior_vec = expand_prior(prior, self.subset).to(self.mean.dtype)  # checks granularity
        self.mean, self.prior_precision, self._prior_vec = valid["mean"].clone(), prior, prior_vec
        self.sigma_noise = valid["sigma_noise"].clone()
        if self.task == "regression":
            self.likelihood = get_likelihood("regression", sigma_noise=self.sigma_noise)
        self.lr, self.num_samples = valid["lr"], valid["num_samples"]
        self.num_data, self.steps = valid["num_data"], valid["steps"]
        self._state = {k: torch.as_tensor(v).clone() for k, v in state["curvature"].items()}
        self.history = NGVIHistory(elbo=[float(v) for v in valid["elbo"]])
        self.theta_lin = valid["theta_lin"].clone() if "theta_lin" in valid else None
        self._write(self._point())
        self._posterior = None


class VOGGN(NaturalGradientVI):
    """Variational online GGN (thesis Sec. 4.2, eq. 4.7-4.8; Khan et al. 2019): S networks
    theta_s ~ q_t, each linearised at itself (GGN and gradient at theta_s). Predicts by NN
    sampling (Sec. 4.6). Arguments: see :class:`NaturalGradientVI`."""

    linearization = "sample"
    sampling = True
    default_method = "nn"


class LGVA(NaturalGradientVI):
    """Linearised Gaussian variational approximation (thesis Sec. 4.3, eq. 4.9-4.10): one
    Jacobian at mu_t per step; S samples of the linear model, gradient
    J_mu^T r(y, f_mu + J_mu (theta_s - mu)) and GGN with Lambda at those outputs. Predicts
    with the GLM (Sec. 4.6). Arguments: see :class:`NaturalGradientVI`."""

    linearization = "mean"
    sampling = True
    default_method = "glm"


class OGGN(NaturalGradientVI):
    """Online GGN (thesis Sec. 4.4, eq. 4.11-4.12): gradient and GGN at the mean mu_t, no
    sampling (``num_samples`` is unused); with gamma = 1 at a stationary point it is the
    Laplace-GGN. Predicts with the GLM (Sec. 4.6). Arguments: see :class:`NaturalGradientVI`."""

    linearization = "mean"
    sampling = False
    default_method = "glm"
