"""Variational linearised Laplace (VaLLA; Ortega, Santana & Hernández-Lobato 2024).

The linearised Laplace model is a GP (Immer thesis Thm 3.2, eq. 3.13): prior mean
m(x) = f(x; theta*) - J(x) theta* and kernel k(x, x') = J(x) P0^-1 J(x')^T (C x C blocks), P0 the
diagonal prior precision. VaLLA approximates its posterior with a *decoupled* sparse GP (Cheng &
Boots 2017; VaLLA eq. 13-17): the mean basis is anchored so that the predictive mean is the
network output f(x; theta*) exactly (Prop. 1), and only the covariance uses M inducing inputs Z,
whose D inducing values u carry q(u) = N(., S_u): all outputs f(Z) (D = M C), or, for
classification by default (the authors' code), pairs u_m = f_{c_m}(z_m) (D = M, O(M^3)):

    mean(x)     = f(x; theta*)
    Sigma(x, x') = k(x, x') - k_xZ K_ZZ^-1 (K_ZZ - S_u) K_ZZ^-1 k_Zx'.          (VaLLA eq. 17)

S_u is parameterised whitened, S_u = L_K S_v L_K^T with L_K = chol(K_ZZ) and S_v = L_v L_v^T
(L_v lower triangular, learned), so S_u follows the prior scale while it is learned.

In weight space this is q(theta) = N(theta*, Sigma_theta) with Sigma_theta = P0^-1 -
P0^-1 J_Z^T K_ZZ^-1 (K_ZZ - S_u) K_ZZ^-1 J_Z P0^-1, and the KL divergence to the prior N(0, P0^-1)
splits into the covariance part and the RKHS norm of the anchored mean (VaLLA eq. 15):

    KL = KL(N(0, S_u) || N(0, K_ZZ)) + 1/2 theta*^T P0 theta*
       = 1/2 [tr S_v - D - log det S_v] + 1/2 theta*^T P0 theta*.

The objective is VaLLA eq. (20)-(21), the alpha-divergence energy (Li & Gal 2017) on a minibatch
B of the N training points,

    L_alpha = (N / |B|) sum_{n in B} (1/alpha) log E_q[p(y_n | f_n)^alpha] - KL_u
              [- 1/2 theta*^T P0 theta*],

where the paper (and the authors' code) holds the mean parameters of eq. (15) fixed and keeps
only the covariance part KL_u = KL(q(u) || p(u)) (default, ``mean_kl=False``). The mean term
does not depend on q(u) or Z but pulls a learned prior towards small precisions: on 2000 MNIST
images (784-100-100-10 MLP, M = 20, 10 epochs, early stopping) the learned prior went from 1 to
7.2 with it (early-stopped after 4 epochs, test NLL 0.520, MAP 0.398) and to 63.7 without it
(test NLL 0.396, Brier 0.170 against the MAP's 0.174). ``mean_kl=True`` adds it, which makes
the alpha = 0 objective a bound on the evidence of the linearised GP (below).

with the paper's alpha = 1 by default (the data term is then the predictive log-likelihood
log E_q[p(y_n | f_n)], which lets the prior precision be learned, Sec. 3.3) and alpha -> 0 giving
the evidence lower bound E_q[log p(y_n | f_n)] - KL (VaLLA eq. 14; with ``mean_kl=True`` a
lower bound on the log evidence of the linearised GP that is tight at the optimum when Z = X).
The expectation is in closed form for a Gaussian likelihood (any alpha); for softmax / sigmoid
it is the probit approximation (alpha = 1) or Monte Carlo. A step needs Jacobians of the
minibatch and of Z only (cached while Z is fixed), so its cost does not depend on N. Early
stopping on a validation split (App. C) keeps the learned prior from over-fitting. q(u) is
optimised by natural-gradient steps by default (Salimbeni et al. 2018; the paper uses Adam,
available as ``optimizer="adam"``), and
Prop. 2's closed-form optimum (Titsias 2009) is available for a Gaussian likelihood.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from gaussify import state as st
from gaussify.batches import Batches, as_batches, num_examples
from gaussify.curvature.jacobian import check_eval_mode, chunk_slices, model_outputs
from gaussify.curvature.subset import check_prior, expand_prior, select_parameters
from gaussify.function_space.pathwise import batched_jvp, batched_vjp
from gaussify.function_space.valla_kernel import InducingKernel
from gaussify.function_space.valla_objective import (
    decoupled_kl,
    gaussian_expected_log_lik,
    mc_expected_log_lik,
    probit_log_lik,
    whitened_kl,
)
from gaussify.likelihoods import Gaussian, Likelihood, check_sigma_noise, get_likelihood
from gaussify.memory_guard import check_allocation
from gaussify.model_checks import in_eval_mode, warn_if_squashed_output
from gaussify.posterior import DeclaredCapabilities
from gaussify.predictive import LinkName, Predictive, predictive_from_gaussian
from gaussify.state import transactional
from gaussify.validation import check_count, check_data, check_inputs, check_targets

__all__ = [
    "VaLLA",
    "decoupled_kl",
    "gaussian_expected_log_lik",
    "whitened_kl",
]

Expectation = Literal["auto", "closed_form", "probit", "mc"]
Method = Literal["sgd", "closed_form"]
Init = Literal["prior", "closed_form"]
KernelRoute = Literal["jacobian", "ntk"]
InducingClasses = Literal["auto", "all", "cycle", "label"]


# ---------------------------------------------------------------------- pure functions
# ---------------------------------------------------------------------- the posterior
class VaLLA(InducingKernel, DeclaredCapabilities):
    """Variational linearised Laplace: a decoupled sparse GP with the linearised network's
    kernel J P0^-1 J^T, predictive mean f(x; theta*) and M inducing inputs for the covariance.

    ``likelihood``: "regression", "classification", "binary" or a likelihood object.
    ``num_inducing``: M (K-means centres of the training inputs), or None with
    ``inducing_points (M, ...)`` given. ``inducing_classes``: which outputs are inducing
    values: "all" (all C outputs at each input, M C values, O((M C)^3)); one class per input,
    pairs (z_m, c_m) with value f_{c_m}(z_m) (M values, O(M^3); the authors' design): "label"
    (the label of the training input nearest z_m), "cycle" (m mod C) or a tensor (M,);
    "auto": "label" for multi-class classification, else "all". ``prior_precision``: scalar,
    per parameter tensor or per parameter; its granularity is kept when learned (``learn_prior``).
    ``sigma_noise``: Gaussian noise (learned with ``learn_noise``). ``alpha``: the divergence
    parameter of eq. (20) (1: the paper; 0: the ELBO). ``mean_kl``: add the anchored mean's
    1/2 theta*^T P0 theta* to the KL (off: the paper's objective). ``learn_inducing``: move Z
    by gradient (then Jacobians at Z are recomputed, with gradients, every step). ``kernel``:
    how the kernel J P0^-1 J^T is formed: "jacobian" (Jacobians of the batch and of Z, the latter
    cached while Z is fixed: memory M C P) or "ntk" (:func:`gaussify.function_space.ntk.ntk`,
    per-layer for plain linear layers, no P-sized Jacobian rows; Z cannot be learned).
    ``expectation``: "closed_form" (Gaussian), "probit" (alpha = 1, softmax / sigmoid), "mc"
    (``mc_samples`` reparameterised samples), "auto" picks the first that applies.
    Optimisation over minibatches of ``batch_size`` for ``epochs`` passes or ``max_steps``
    steps, whichever is first: ``optimizer="natural"`` (default) takes natural-gradient steps
    of size ``ng_lr`` on q(u) and Adam steps at ``lr`` on the inducing inputs (when learned);
    ``"adam"`` (the paper's choice) uses Adam at ``lr`` on the Cholesky factor of S_v too,
    which converges slowly when K_ZZ is ill-conditioned. The learned log prior precision and
    log noise take Adam steps at ``hyper_lr``: they live on a log scale and must often move
    by orders of magnitude from the MAP's prior, and Adam moves a parameter by about its step
    size per step (at 1e-2, a few hundred cosine-decayed steps change the prior by at most a
    factor of a few). ``schedule="cosine"`` decays every step size to 0 over the run.
    ``seed`` seeds K-means, batch order and Monte Carlo draws.

    Reference: Ortega, Santana, Hernández-Lobato, "Variational Linearized Laplace
    Approximation for Bayesian Deep Learning", ICML 2024.
    """

    unsupported: ClassVar[dict[str, str]] = {
        "log_marginal_likelihood": "VaLLA maximises the objective of eq. (20) (alpha = 1: a "
        "log predictive likelihood; alpha = 0: an ELBO, a lower bound), neither is the "
        "evidence; use Laplace or FunctionalLaplace for log p(D)",
        "optimize_prior": "VaLLA learns the prior precision and noise inside fit (learn_prior, "
        "learn_noise) jointly with q(u); call fit",
    }

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood = "classification",
        num_inducing: int | None = 100,
        prior_precision: float | Tensor = 1.0,
        sigma_noise: float | Tensor = 1.0,
        subset: str | list[str] = "all",
        *,
        alpha: float = 1.0,
        mean_kl: bool = False,
        inducing_points: Tensor | None = None,
        inducing_classes: InducingClasses | Tensor = "auto",
        learn_inducing: bool = False,
        learn_prior: bool = True,
        learn_noise: bool = False,
        expectation: Expectation = "auto",
        kernel: KernelRoute = "jacobian",
        mc_samples: int = 16,
        epochs: int = 10,
        max_steps: int | None = None,
        lr: float = 1e-2,
        hyper_lr: float = 0.1,
        optimizer: Literal["natural", "adam"] = "natural",
        ng_lr: float = 0.1,
        schedule: Literal["cosine", "constant"] = "cosine",
        batch_size: int = 256,
        kmeans_points: int = 10_000,
        seed: int = 0,
    ) -> None:
        if num_inducing is None and inducing_points is None:
            raise ValueError("num_inducing: give the number of inducing points or inducing_points")
        if num_inducing is not None:
            num_inducing = check_count(num_inducing, "num_inducing")
        if (
            num_inducing is not None
            and inducing_points is not None
            and inducing_points.shape[0] != num_inducing
        ):
            raise ValueError(
                f"num_inducing: {num_inducing} does not match the {inducing_points.shape[0]} "
                "inducing_points given"
            )
        if not 0 <= alpha <= 1:
            raise ValueError(f"alpha: must be in [0, 1] (0 is the ELBO), got {alpha}")
        if expectation not in ("auto", "closed_form", "probit", "mc"):
            raise ValueError(
                "expectation: expected 'auto', 'closed_form', 'probit' or 'mc', "
                f"got {expectation!r}"
            )
        epochs = check_count(epochs, "epochs")
        batch_size = check_count(batch_size, "batch_size")
        if max_steps is not None:
            max_steps = check_count(max_steps, "max_steps")
        mc_samples = check_count(mc_samples, "mc_samples")
        if not lr > 0:
            raise ValueError(f"lr: must be > 0, got {lr}")
        if not hyper_lr > 0:
            raise ValueError(f"hyper_lr: must be > 0, got {hyper_lr}")
        self.hyper_lr = float(hyper_lr)
        if optimizer not in ("natural", "adam"):
            raise ValueError(f"optimizer: expected 'natural' or 'adam', got {optimizer!r}")
        if not 0 < ng_lr <= 1:
            raise ValueError(f"ng_lr: the natural-gradient step must be in (0, 1], got {ng_lr}")
        self.optimizer, self.ng_lr = optimizer, float(ng_lr)
        if schedule not in ("cosine", "constant"):
            raise ValueError(f"schedule: expected 'cosine' or 'constant', got {schedule!r}")
        self.schedule = schedule
        self.model = model
        self.likelihood = get_likelihood(likelihood, sigma_noise=sigma_noise)
        self.task = self.likelihood.task
        warn_if_squashed_output(model, self.task)
        if self.task == "heteroscedastic":
            raise ValueError("likelihood: heteroscedastic outputs are not supported by VaLLA")
        if learn_noise and self.task != "regression":
            raise ValueError("learn_noise: only a regression likelihood has noise to learn")
        self.expectation = self._resolve_expectation(expectation, alpha)
        if kernel not in ("jacobian", "ntk"):
            raise ValueError(f"kernel: expected 'jacobian' or 'ntk', got {kernel!r}")
        if kernel == "ntk" and learn_inducing:
            raise ValueError(
                "learn_inducing: the 'ntk' kernel route gives no gradients with respect to the "
                "inducing inputs; use kernel='jacobian' to learn them"
            )
        self.kernel = kernel
        self.subset = select_parameters(model, subset)
        first = next(model.parameters())
        dtype, device = first.dtype, first.device
        prior = check_prior(torch.as_tensor(prior_precision, dtype=dtype, device=device)).clone()
        expand_prior(prior, self.subset)  # raises on a wrong granularity
        self.log_prior = prior.log().requires_grad_(learn_prior)
        sigma = check_sigma_noise(sigma_noise, self.task, dtype, device).clone()
        self.log_sigma = sigma.log().requires_grad_(learn_noise)
        self.learn_prior, self.learn_noise = learn_prior, learn_noise
        self.num_inducing = num_inducing if inducing_points is None else inducing_points.shape[0]
        self._given_inducing = inducing_points
        if not isinstance(inducing_classes, Tensor) and inducing_classes not in (
            "auto", "all", "cycle", "label",
        ):  # fmt: skip
            raise ValueError(
                "inducing_classes: expected 'auto', 'all', 'cycle', 'label' or a tensor of "
                f"classes, got {inducing_classes!r}"
            )
        self._classes_spec = inducing_classes
        self._rows: Tensor | None = None
        self.learn_inducing = learn_inducing
        self.alpha = float(alpha)
        if not isinstance(mean_kl, bool):
            raise TypeError(f"mean_kl: expected True or False, got {mean_kl!r}")
        self.mean_kl = mean_kl
        self.mc_samples = mc_samples
        self.epochs, self.max_steps, self.lr, self.batch_size = epochs, max_steps, lr, batch_size
        self.kmeans_points = kmeans_points
        self.seed = seed
        self.history: dict[str, list[float]] = {"objective": [], "val_nll": []}
        self._warned_jitter = False
        self._initialised = False

    def _resolve_expectation(self, expectation: Expectation, alpha: float) -> str:
        regression = self.task == "regression"
        if expectation == "auto":
            if regression:
                return "closed_form"
            return "probit" if alpha == 1 else "mc"
        if expectation == "closed_form" and not (
            regression and isinstance(self.likelihood, Gaussian)
        ):
            raise ValueError("expectation: 'closed_form' needs a Gaussian (regression) likelihood")
        if expectation == "probit" and (regression or alpha != 1):
            raise ValueError(
                "expectation: 'probit' approximates log E[softmax/sigmoid] and needs alpha = 1 "
                "and a classification or binary likelihood"
            )
        return expectation

    # ------------------------------------------------------------------ hyperparameters
    @property
    def prior_precision(self) -> Tensor:
        """The (learned) prior precision, in the granularity it was given."""
        return self.log_prior.detach().exp()

    @property
    def sigma_noise(self) -> Tensor:
        return self.log_sigma.detach().exp()

    @property
    def chol_v(self) -> Tensor:
        """L_v (MC, MC): lower triangular with a positive (exponentiated) diagonal."""
        raw = self.chol_raw
        return torch.tril(raw, -1) + torch.diag_embed(raw.diagonal().exp())

    # ------------------------------------------------------------------ set-up
    def _check_data(self, data: Batches, owner: str, multi_pass: bool = False) -> Batches:
        return check_data(
            data, model=self.model, task=self.task, owner=owner, multi_pass=multi_pass
        )

    @transactional
    @in_eval_mode
    def initialize(self, data: Batches) -> VaLLA:
        """Set theta*, N, the inducing inputs (K-means, or the given ones), the cached
        Jacobians at Z and q(u) = prior (S_v = I). Called by :meth:`fit`."""
        data = self._check_data(data, "VaLLA.initialize", multi_pass=True)
        self.model.eval()
        check_eval_mode(self.model)
        gen = torch.Generator().manual_seed(self.seed)
        self._gen = gen
        self.num_data = num_examples(data)
        if self.num_data == 0:
            raise ValueError("data: contains no examples")
        self.theta_star = self.subset.flatten(self.subset.params(self.model)).clone()
        sample = self._training_sample(data, gen)
        if self._given_inducing is not None:
            z = self._given_inducing.detach().clone()
        else:
            assert self.num_inducing is not None
            if self.num_inducing > self.num_data:
                raise ValueError(
                    f"num_inducing: M = {self.num_inducing} exceeds the number of training "
                    f"points N = {self.num_data}"
                )
            z = self._kmeans(sample[0], self.num_inducing)
        self.inducing_points = z.requires_grad_(self.learn_inducing)
        self.num_outputs = model_outputs(self.model, z[:1]).shape[1]
        spec = self._classes_spec
        if isinstance(spec, str) and spec == "auto":
            spec = "label" if self.task == "classification" else "all"
        self._rows = self._inducing_rows(spec, z, sample, self.num_outputs)
        mc = z.shape[0] * self.num_outputs if self._rows is None else z.shape[0]
        check_allocation(
            mc * mc
            + (z.shape[0] * self.num_outputs * self.subset.num_params)
            * (self.kernel == "jacobian"),
            self.theta_star.dtype,
            f"VaLLA: the (M C)^2 inducing covariance and the (M C, P) Jacobian at the inducing "
            f"points (M C = {mc:,}, P = {self.subset.num_params:,})",
            "fewer inducing points (num_inducing), or kernel='ntk'",
            device=self.theta_star.device,
        )
        self.chol_raw = torch.zeros(
            mc, mc, dtype=self.theta_star.dtype, device=self.theta_star.device, requires_grad=True
        )
        self._refresh_cache()
        self._optimizer = self._make_optimizer()
        self._step_count = 0
        self._total_steps: int | None = None
        self._initialised = True
        return self

    # ------------------------------------------------------------------ the model
    def _require_init(self) -> None:
        if not self._initialised:
            raise RuntimeError("VaLLA: call fit(data) (or initialize(data)) first")

    def _cov_blocks(self, x: Tensor, chol_k: Tensor, chol_v: Tensor) -> Tensor:
        """Sigma(x_n, x_n) (B, C, C) at inputs x (VaLLA eq. 17, whitened):
        k(x_n, x_n) - a_n^T a_n + a_n^T S_v a_n with a_n = L_K^-1 K_{Z x_n}."""
        k_zx, k_xx = self._batch_kernels(x)
        b, c = k_xx.shape[:2]
        a = torch.linalg.solve_triangular(chol_k, k_zx, upper=False)
        w = chol_v.T @ a
        a3, w3 = a.reshape(-1, b, c), w.reshape(-1, b, c)
        return k_xx - torch.einsum("mbc,mbd->bcd", a3, a3) + torch.einsum("mbc,mbd->bcd", w3, w3)

    def _data_term(self, f: Tensor, cov: Tensor, y: Tensor) -> Tensor:
        """(1/alpha) log E_q[p(y_n | f_n)^alpha] per sample, (B,)."""
        if self.expectation == "closed_form":
            noise = self.log_sigma.exp().square()
            noise = noise.expand(f.shape[-1]) if noise.ndim == 0 else noise
            y = y.reshape(f.shape).to(f.dtype)
            return gaussian_expected_log_lik(y, f, cov, noise, self.alpha)
        if self.expectation == "probit":
            return probit_log_lik(self.task, y, f, cov)
        likelihood = self.likelihood
        if self.task == "regression":
            likelihood = get_likelihood("regression", sigma_noise=self.log_sigma.exp())
        return mc_expected_log_lik(
            likelihood, y, f, cov, self.alpha, self.mc_samples, getattr(self, "_gen", None)
        )

    def _objective_kl(self, chol_v: Tensor) -> Tensor:
        """The KL of the objective: KL(q(u) || p(u)), plus 1/2 theta*^T P0 theta* when
        ``mean_kl`` (then the KL of the weight-space Gaussians, eq. 15)."""
        if self.mean_kl:
            return decoupled_kl(chol_v, self.theta_star, self._prior_vec())
        return whitened_kl(chol_v)

    def kl(self) -> Tensor:
        """The KL term of the objective at the current variational parameters: KL(q(u) || p(u))
        (the paper's), or KL(q(theta) || p(theta)) of eq. 15 with ``mean_kl=True``."""
        self._require_init()
        return self._objective_kl(self.chol_v)

    @in_eval_mode
    def batch_objective(
        self, x: Tensor, y: Tensor, *, scale: float | None = None, chol_v: Tensor | None = None
    ) -> Tensor:
        """(N / B) sum_{n in B} (1/alpha) log E_q[p(y_n|f_n)^alpha] - KL on one batch (eq. 21);
        ``scale`` overrides N / B, ``chol_v`` the current L_v. Differentiable in the
        variational and hyperparameters."""
        self._require_init()
        chol_v = self.chol_v if chol_v is None else chol_v
        with torch.no_grad():
            f = model_outputs(self.model, x)
        chol_k = self._cholesky(self._kzz())
        cov = self._cov_blocks(x, chol_k, chol_v)
        data = self._data_term(f, cov, y).sum()
        factor = self.num_data / x.shape[0] if scale is None else scale
        kl = self._objective_kl(chol_v)
        return factor * data - kl

    @in_eval_mode
    def objective(self, data: Batches, *, batch_size: int = 256) -> Tensor:
        """The full-data objective sum_n (1/alpha) log E_q[p(y_n|f_n)^alpha] - KL (eq. 20;
        with alpha = 0 the ELBO, eq. 14). No gradients."""
        self._require_init()
        data = self._check_data(data, "VaLLA.objective")
        total = torch.zeros((), dtype=self.theta_star.dtype, device=self.theta_star.device)
        with torch.no_grad():
            for x, y in as_batches(data, batch_size=batch_size):
                total = total + self.batch_objective(x, y, scale=1.0) + self.kl()
            return total - self.kl()

    # ------------------------------------------------------------------ fitting
    def _decay(self) -> float:
        """Cosine factor of the step sizes over a :meth:`fit` run (1 outside one)."""
        total = getattr(self, "_total_steps", None)
        if self.schedule != "cosine" or not total:
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * min(self._step_count, total) / total))

    @in_eval_mode
    def step(self, x: Tensor, y: Tensor) -> float:
        """One optimisation step on the batch (x, y); returns the batch objective / N.

        ``optimizer="natural"``: q(u) takes a natural-gradient step (Salimbeni et al. 2018)
        while the learned hyperparameters / inducing inputs take an Adam step on the same
        gradient. With the mean of q(v) fixed at 0, the natural parameter is -S_v^-1 / 2 and
        the expectation parameter S_v, so the step is S_v^-1 <- S_v^-1 - 2 rho dL/dS_v; for a
        Gaussian likelihood with alpha = 0 and rho = 1 on the full data it lands on the optimum
        (:meth:`set_optimal_covariance`). ``optimizer="adam"``: Adam on the Cholesky factor.
        """
        self._require_init()
        check_inputs(x, self.model)
        check_targets(y, self.task, self.num_outputs, name="y", num_rows=x.shape[0])
        decay = self._decay()
        if self._optimizer is not None:
            for group in self._optimizer.param_groups:
                group["lr"] = group["initial_lr"] * decay
            self._optimizer.zero_grad()
        if self.optimizer == "adam":
            loss = -self.batch_objective(x, y) / self.num_data
            loss.backward()
        else:
            with torch.no_grad():
                chol_old = self.chol_v
                s_v = (chol_old @ chol_old.T).requires_grad_(True)
            chol = torch.linalg.cholesky(s_v)
            loss = -self.batch_objective(x, y, chol_v=chol) / self.num_data
            loss.backward()
            assert s_v.grad is not None
            grad = -self.num_data * 0.5 * (s_v.grad + s_v.grad.T)  # dL/dS_v of the objective
            self._natural_step(chol_old.detach(), grad, self.ng_lr * decay)
        if self._optimizer is not None:
            self._optimizer.step()
        self._step_count += 1
        return -float(loss.detach())

    def _natural_step(self, chol_old: Tensor, grad: Tensor, rho: float) -> None:
        """S_v^-1 <- S_v^-1 - 2 rho grad, halving rho until the new precision is positive
        definite (a non-conjugate likelihood's gradient need not keep it so for large rho)."""
        with torch.no_grad():
            prec_old = torch.cholesky_inverse(chol_old)
            for _ in range(20):
                chol_p, info = torch.linalg.cholesky_ex(prec_old - 2 * rho * grad)
                if not bool(info.any()):
                    break
                rho /= 2
            else:
                return
            chol_v, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(chol_p))
            if bool(info.any()):
                return
            self.chol_raw.copy_(torch.tril(chol_v, -1) + torch.diag_embed(chol_v.diagonal().log()))

    @transactional(clone=("chol_raw",))
    @in_eval_mode
    def set_optimal_covariance(self, data: Batches, *, batch_size: int = 256) -> VaLLA:
        """Closed-form q(u) for fixed Z and hyperparameters (VaLLA Prop. 2 / Titsias 2009):
        S_v = (I + sum_n A_n Lambda_n A_n^T)^-1, A_n = L_K^-1 K_{Z n}, Lambda_n the likelihood's
        Hessian at f(x_n; theta*). For a Gaussian likelihood and alpha = 0 this is the exact
        optimum of the ELBO (equal to the exact LLA posterior when Z = X); for other
        likelihoods it is the sparse Laplace-GGN covariance, a good starting point. One pass
        over the data, O(N M^2 C^2)."""
        self._require_init()
        data = self._check_data(data, "VaLLA.set_optimal_covariance")
        with torch.no_grad():
            chol_k = self._cholesky(self._kzz())
            prec = torch.eye(chol_k.shape[0], dtype=chol_k.dtype, device=chol_k.device)
            likelihood = self.likelihood
            if self.task == "regression":
                likelihood = get_likelihood("regression", sigma_noise=self.log_sigma.exp())
            for x, _ in as_batches(data, batch_size=batch_size):
                k_zx, k_xx = self._batch_kernels(x)
                b, c = k_xx.shape[:2]
                a = torch.linalg.solve_triangular(chol_k, k_zx, upper=False).reshape(-1, b, c)
                sqrt = likelihood.hessian_sqrt(model_outputs(self.model, x))  # (B, C, C)
                rows = torch.einsum("mbc,bck->bkm", a, sqrt).reshape(-1, a.shape[0])
                prec += rows.T @ rows
            # S_v = prec^-1 (M C x M C, small), then its lower Cholesky factor
            chol_v = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(prec)))
            raw = torch.tril(chol_v, -1) + torch.diag_embed(chol_v.diagonal().log())
            self.chol_raw.copy_(raw)
        return self

    def _batches_forever(self, data: Batches) -> Iterator[tuple[Tensor, Tensor]]:
        batches = as_batches(data, batch_size=self.batch_size, shuffle=True, generator=self._gen)
        while True:
            yield from batches

    def validation_nll(self, data: Batches, *, batch_size: int = 256) -> float:
        """Mean negative predictive log-likelihood on ``data`` (the early-stopping score)."""
        data = self._check_data(data, "VaLLA.validation_nll")
        total, count = 0.0, 0
        with torch.no_grad():
            for x, y in as_batches(data, batch_size=batch_size):
                total -= float(self.predict(x).log_prob(y).sum())
                count += x.shape[0]
        return total / max(count, 1)

    @transactional(clone=("log_prior", "log_sigma", "inducing_points", "chol_raw"))
    @in_eval_mode
    def fit(
        self,
        train_data: Batches,
        val_data: Batches | None = None,
        *,
        patience: int | None = None,
        eval_every: int | None = None,
        method: Method = "sgd",
        init: Init = "prior",
        progress: bool = False,
    ) -> VaLLA:
        """Fit q(u) (and the hyperparameters / inducing inputs that are learned).

        ``method="sgd"``: Adam on minibatches of ``train_data``; ``init="closed_form"`` starts
        from :meth:`set_optimal_covariance`. ``val_data``: scored (mean predictive NLL) every
        ``eval_every`` steps (default once per epoch); with ``patience`` training stops after
        that many evaluations without improvement and the best state is restored (VaLLA
        App. C). ``method="closed_form"``: only :meth:`set_optimal_covariance`.
        """
        if patience is not None and val_data is None:
            raise ValueError("val_data: early stopping (patience) needs validation data")
        if patience is not None:
            patience = check_count(patience, "patience")
        if method not in ("sgd", "closed_form"):
            raise ValueError(f"method: expected 'sgd' or 'closed_form', got {method!r}")
        if init not in ("prior", "closed_form"):
            raise ValueError(f"init: expected 'prior' or 'closed_form', got {init!r}")
        if eval_every is not None:
            eval_every = check_count(eval_every, "eval_every")
        train_data = self._check_data(train_data, "VaLLA.fit", multi_pass=True)
        if val_data is not None:
            val_data = self._check_data(val_data, "VaLLA.fit (val_data)", multi_pass=True)
        self.initialize(train_data)
        if method == "closed_form" or init == "closed_form":
            self.set_optimal_covariance(train_data, batch_size=self.batch_size)
        if method == "closed_form":
            return self
        steps_per_epoch = math.ceil(self.num_data / self.batch_size)
        total = self.epochs * steps_per_epoch
        if self.max_steps is not None:
            total = min(total, self.max_steps)
        self._total_steps, self._step_count = total, 0
        every = eval_every or steps_per_epoch
        best, best_state, bad = math.inf, None, 0
        iterator = self._batches_forever(train_data)
        steps = range(total)
        if progress:
            from tqdm.auto import tqdm

            steps = tqdm(steps, desc="VaLLA", unit="step")
        self.history = {"objective": [], "val_nll": []}
        for i in steps:
            x, y = next(iterator)
            self.history["objective"].append(self.step(x, y))
            if val_data is not None and ((i + 1) % every == 0 or i + 1 == total):
                score = self.validation_nll(val_data)
                self.history["val_nll"].append(score)
                if score < best:
                    best, bad = score, 0
                    best_state = copy.deepcopy(self._variational_state())
                else:
                    bad += 1
                    if patience is not None and bad >= patience:
                        break
        if patience is not None and best_state is not None:
            self._load_variational_state(best_state)
        return self

    def _make_optimizer(self) -> torch.optim.Adam | None:
        """Adam over the learned leaves: log prior and log noise at ``hyper_lr``; Z and (with
        ``optimizer="adam"``) L_v at ``lr``. None when nothing is learned by Adam."""
        hyper = [t for t in (self.log_prior, self.log_sigma) if t.requires_grad]
        rest = [self.inducing_points] if self.inducing_points.requires_grad else []
        if self.optimizer == "adam":
            rest.append(self.chol_raw)
        groups = [
            {"params": leaves, "lr": lr, "initial_lr": lr}
            for leaves, lr in ((hyper, self.hyper_lr), (rest, self.lr))
            if leaves
        ]
        return torch.optim.Adam(groups) if groups else None

    def _variational_state(self) -> dict[str, Tensor]:
        return {
            "chol_raw": self.chol_raw.detach().clone(),
            "log_prior": self.log_prior.detach().clone(),
            "log_sigma": self.log_sigma.detach().clone(),
            "inducing_points": self.inducing_points.detach().clone(),
        }

    def _load_variational_state(self, state: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for name, value in state.items():
                getattr(self, name).copy_(value)
        self._refresh_cache()

    # ------------------------------------------------------------------ prediction
    @in_eval_mode
    def predict(
        self,
        x: Tensor,
        link: LinkName = "probit",
        *,
        num_samples: int = 100,
        generator: torch.Generator | None = None,
        chunk_size: int = 256,
    ) -> Predictive:
        """Predictive at ``x (N, ...)``: N(f(x; theta*), Sigma(x, x)) (eq. 17) through the
        likelihood (regression adds the noise; classification uses ``link``)."""
        self._require_init()
        check_inputs(x, self.model)
        num_samples = check_count(num_samples, "num_samples")
        chunk_size = check_count(chunk_size, "chunk_size")
        with torch.no_grad():
            chol_k = self._cholesky(self._kzz())
            chol_v = self.chol_v
            means, covs = [], []
            for sl in chunk_slices(x.shape[0], chunk_size):
                means.append(model_outputs(self.model, x[sl]))
                covs.append(self._cov_blocks(x[sl], chol_k, chol_v))
        noise = self.sigma_noise.square().reshape(-1) if self.task == "regression" else None
        mean, cov = torch.cat(means), torch.cat(covs)
        kwargs = {"noise_var": noise, "num_samples": num_samples, "generator": generator}
        return predictive_from_gaussian(mean, cov, self.task, link=link, **kwargs)

    @property
    def inducing_classes(self) -> Tensor | None:
        """The class c_m of each inducing input (M,) when the inducing values are pairs
        f_{c_m}(z_m); None when they are all C outputs at every inducing input."""
        self._require_init()
        return None if self._rows is None else self._rows % self.num_outputs

    @property
    def inducing_covariance(self) -> Tensor:
        """S_u = L_K S_v L_K^T (D, D), the covariance of q(u) at the D inducing outputs (M C,
        or M for inducing pairs)."""
        self._require_init()
        with torch.no_grad():
            chol_k = self._cholesky(self._kzz())
            factor = chol_k @ self.chol_v
            return factor @ factor.T

    @property
    @in_eval_mode
    def kernel_zz(self) -> Tensor:
        """K_ZZ (D, D), the prior covariance of the D inducing outputs (M C, or M pairs)."""
        self._require_init()
        with torch.no_grad():
            return self._kzz()

    @in_eval_mode
    def sample(self, num_samples: int = 100, generator: torch.Generator | None = None) -> Tensor:
        """Weight samples from q(theta) = N(theta*, Sigma_theta), (S, P), by pathwise
        conditioning: theta = theta* + e - P0^-1 J_Z^T K_ZZ^-1 (J_Z e - u), e ~ N(0, P0^-1),
        u ~ N(0, S_u); its covariance is P0^-1 - P0^-1 J_Z^T K^-1 (K - S_u) K^-1 J_Z P0^-1."""
        self._require_init()
        num_samples = check_count(num_samples, "num_samples")
        with torch.no_grad():
            z = self.inducing_points.detach()
            prior = self._prior_vec()
            chol_k = self._cholesky(self._kzz())
            dtype = self.theta_star.dtype
            # drawn where the generator lives (the host by default), then moved
            e = torch.randn(num_samples, prior.shape[0], generator=generator, dtype=dtype)
            e = e.to(prior.device) / prior.sqrt()
            xi = torch.randn(num_samples, chol_k.shape[0], generator=generator, dtype=dtype)
            xi = xi.to(chol_k.device)
            u = xi @ (chol_k @ self.chol_v).T
            # J_Z e and J_Z^T w by jvp / vjp: no (MC, P) Jacobian is needed
            jz_e = batched_jvp(self.model, z, self.subset, e).reshape(num_samples, -1)
            if self._rows is not None:  # inducing pairs: f_{c_m}(z_m) only
                jz_e = jz_e.index_select(1, self._rows)
            sol = torch.cholesky_solve((jz_e - u).T, chol_k).T  # (S, D)
            if self._rows is not None:
                full = sol.new_zeros(num_samples, z.shape[0] * self.num_outputs)
                sol = full.index_copy(1, self._rows, sol)
            back = batched_vjp(
                self.model, z, self.subset, sol.reshape(num_samples, *z.shape[:1], -1)
            )
            return self.theta_star + e - back / prior

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The variational and hyperparameters plus theta*, N and the identity of the
        posterior (task, subset, fingerprint of the network's other weights); plain tensors
        and numbers, loadable with ``torch.load(..., weights_only=True)``. The network itself
        is not included (save it separately)."""
        self._require_init()
        state: dict[str, Any] = {k: v for k, v in self._variational_state().items()}
        if self._rows is not None:
            state["inducing_classes"] = self._rows % self.num_outputs
        state.update(
            st.identity(self.task, self.subset.names, self.model),
            theta_star=self.theta_star,
            num_data=self.num_data,
            alpha=self.alpha,
        )
        return st.copy_state(state)

    @transactional
    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Restore a state from :meth:`state_dict` into a VaLLA over the same model: the whole
        state is validated first (:mod:`gaussify.state`), theta* and the other weights
        against the model (a mismatch raises; ``strict=False`` warns); a failed load
        changes nothing."""
        dt = self.log_prior.dtype
        schema = {
            **st.identity_schema(self.task, self.subset.names),
            "chol_raw": st.TensorSpec(("K", "K"), dt),
            "log_prior": st.TensorSpec(tuple(self.log_prior.shape), dt),
            "log_sigma": st.TensorSpec(tuple(self.log_sigma.shape), dt),
            "inducing_points": st.TensorSpec(("M", ...), "float"),
            "theta_star": st.TensorSpec(("P",), dt),
            "num_data": st.Integer(1),
            "alpha": st.Number(positive=False),
            "inducing_classes": st.Maybe(st.TensorSpec(("M",), "int")),
        }
        valid = st.validate_posterior_state(
            state,
            schema,
            owner="VaLLA",
            task=self.task,
            model=self.model,
            subset=self.subset,
            strict=strict,
        )
        z = valid["inducing_points"]
        classes = valid.get("inducing_classes")
        if classes is not None and valid["chol_raw"].shape[0] != z.shape[0]:
            raise st.StateError(
                "VaLLA.load_state_dict: invalid state: 'chol_raw': one row per inducing pair "
                f"expected ({z.shape[0]}), got {valid['chol_raw'].shape[0]}"
            )
        if valid["chol_raw"].shape[0] % z.shape[0]:
            raise st.StateError(
                "VaLLA.load_state_dict: invalid state: 'chol_raw': expected a multiple of the "
                f"{z.shape[0]} inducing points rows, got {valid['chol_raw'].shape[0]}"
            )
        self.theta_star = valid["theta_star"].clone()
        self.num_data = valid["num_data"]
        self.alpha = valid["alpha"]
        self.inducing_points = z.clone().requires_grad_(self.learn_inducing)
        if classes is None:
            self.num_outputs = valid["chol_raw"].shape[0] // z.shape[0]
            self._rows = None
        else:
            self.num_outputs = model_outputs(self.model, z[:1].to(self.theta_star)).shape[1]
            if bool(((classes < 0) | (classes >= self.num_outputs)).any()):
                raise st.StateError(
                    "VaLLA.load_state_dict: invalid state: 'inducing_classes': classes must "
                    f"lie in [0, {self.num_outputs})"
                )
            rows = torch.arange(z.shape[0], device=z.device) * self.num_outputs
            self._rows = rows + classes.to(device=z.device, dtype=torch.long)
        self.chol_raw = valid["chol_raw"].clone().requires_grad_(True)
        self.log_prior = valid["log_prior"].clone().requires_grad_(self.learn_prior)
        self.log_sigma = valid["log_sigma"].clone().requires_grad_(self.learn_noise)
        self._gen = torch.Generator().manual_seed(self.seed)
        self._initialised = True
        self._refresh_cache()
        self._optimizer = self._make_optimizer()
        self._step_count, self._total_steps = 0, None
