"""Sampled linearised Laplace: posterior samples by sample-then-optimise (Antorán et al. 2023).

The linearised Laplace posterior at theta* is N(theta*, A^-1) with A = G + P0, G the GGN
sum_n J_n^T Lambda_n J_n and P0 the (diagonal) prior precision (Immer thesis eq. 3.11). A
sample of it is the minimiser of a randomised least-squares objective (Antorán et al. 2023,
"sample-then-optimise"; Papandreou & Yuille 2010): for sample s,

    delta_s = argmin_d  1/2 sum_n ||L_n^T J_n d - z_{n,s}||^2 + 1/2 (d - d0_s)^T P0 (d - d0_s),

with Lambda_n = L_n L_n^T (the likelihood's ``hessian_sqrt`` at f(x_n; theta*)), z_{n,s} ~ N(0, I_C)
and d0_s ~ N(0, P0^-1). The minimiser is delta_s = A^-1 (sum_n J_n^T L_n z_{n,s} + P0 d0_s), whose
covariance is A^-1 (G + P0) A^-1 = A^-1; theta_s = theta* + delta_s. The factor form keeps the
softmax likelihood, whose Lambda is singular, exact: no Lambda^-1 noise is ever drawn.

The noise enters only through the linear term b_s = sum_n J_n^T L_n z_{n,s}, which is accumulated
in one pass over the data (S vector-Jacobian products per batch, vectorised with
``torch.func.vmap``); minibatch optimisation then only estimates the quadratic term
(N / B) sum_{n in B} ||L_n^T J_n d||^2, so the randomisation is exact whatever the batches (any
DataLoader works, no per-example noise is stored). All S samples are optimised at once: one
``vmap`` of ``torch.func.jvp`` and one of ``torch.func.vjp`` per step, never an (N, C, P)
Jacobian. ``solver="solve"`` instead forms A (P x P) and solves exactly, for small P and tests.

Predictions push the samples through the linearised network, f(x; theta*) + J(x) delta_s
(GLM sampling, thesis eq. 3.15), into :func:`gaussify.predictive.predictive_from_samples`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from gaussify import state as st
from gaussify.batches import Batches, as_batches
from gaussify.curvature.jacobian import check_eval_mode, chunk_slices, jacobians, model_outputs
from gaussify.curvature.subset import ParameterSubset, check_prior, expand_prior, select_parameters
from gaussify.function_space.pathwise import batched_jvp, batched_vjp
from gaussify.likelihoods import Likelihood, check_sigma_noise, get_likelihood
from gaussify.memory_guard import check_allocation
from gaussify.model_checks import in_eval_mode, warn_if_squashed_output
from gaussify.posterior import DeclaredCapabilities
from gaussify.predictive import (
    LinkName,
    Predictive,
    noise_variance,
    posterior_predictive,
    predictive_from_samples,
)
from gaussify.state import copy_state, identity, transactional
from gaussify.validation import check_count, check_data, check_inputs

__all__ = [
    "SampledLLA",
    "batched_jvp",
    "batched_vjp",
    "randomised_minimiser",
]

Solver = Literal["sgd", "cg", "solve"]
Optimizer = Literal["sgd", "adam"]
Route = Literal["auto", "jacobian", "jvp"]


def randomised_minimiser(
    jac: Tensor, factor: Tensor, z: Tensor, delta0: Tensor, prior: Tensor
) -> Tensor:
    """Closed-form minimisers of the randomised objectives, (S, P).

    ``jac (N, C, P)``, ``factor (N, C, C)`` (L_n with L_n L_n^T = Lambda_n), ``z (S, N, C)``,
    ``delta0 (S, P)`` and the diagonal prior precision ``prior (P,)``:
    argmin_d 1/2 sum_n ||L_n^T J_n d - z_n||^2 + 1/2 (d - d0)^T P0 (d - d0)
    = A^-1 (sum_n J_n^T L_n z_n + P0 d0) with A = sum_n J_n^T L_n L_n^T J_n + P0.
    """
    rows = torch.einsum("nck,ncp->nkp", factor, jac).reshape(-1, jac.shape[-1])
    precision = rows.T @ rows + torch.diag(prior)
    rhs = z.reshape(z.shape[0], -1) @ rows + prior * delta0
    chol = torch.linalg.cholesky(precision)
    return torch.cholesky_solve(rhs.T, chol).T


class _BatchGGN:
    """Products with one batch's GGN, sum_{n in B} J_n^T L_n L_n^T J_n v_s, for v (S, P).

    Small batches (B C P within ``budget`` elements) form the batch Jacobian once and use two
    matrix products; larger ones use the vmapped jvp / vjp (no Jacobian exists)."""

    def __init__(
        self,
        model: nn.Module,
        subset: ParameterSubset,
        likelihood: Likelihood,
        x: Tensor,
        route: Route,
        budget: int,
        factor: Tensor | None = None,
        jac: Tensor | None = None,
    ) -> None:
        self.model, self.subset, self.x = model, subset, x
        if factor is None:
            factor = likelihood.hessian_sqrt(model_outputs(model, x))
        self.factor = factor
        n, c = self.factor.shape[:2]
        use_jac = route == "jacobian" or (route == "auto" and n * c * subset.num_params <= budget)
        if jac is None and use_jac:
            jac = jacobians(model, x, subset)
        self.jac = None if jac is None else jac.reshape(n * c, -1)

    def pullback(self, u: Tensor) -> Tensor:
        """sum_n J_n^T u_{s,n} for u (S, B, C): (S, P)."""
        if self.jac is not None:
            return u.reshape(u.shape[0], -1) @ self.jac
        return batched_vjp(self.model, self.x, self.subset, u)

    def noise(self, z: Tensor) -> Tensor:
        """sum_n J_n^T L_n z_{s,n} for z (S, B, C): (S, P)."""
        return self.pullback(torch.einsum("nck,snk->snc", self.factor, z))

    def __call__(self, v: Tensor) -> tuple[Tensor, Tensor]:
        """(G_B v (S, P), L^T J v (S, B, C))."""
        if self.jac is not None:
            jv = (v @ self.jac.T).reshape(v.shape[0], *self.factor.shape[:2])
        else:
            jv = batched_jvp(self.model, self.x, self.subset, v)
        w = torch.einsum("nck,snc->snk", self.factor, jv)
        return self.pullback(torch.einsum("nck,snk->snc", self.factor, w)), w


class SampledLLA(DeclaredCapabilities):
    """Linearised Laplace posterior represented by S weight samples (sample-then-optimise).

    ``likelihood``: "regression", "classification", "binary" or a likelihood object.
    ``prior_precision``: scalar, one value per parameter tensor, or one per parameter (P,).
    ``num_samples``: S, optimised together. ``subset``: "all", "last_layer" or names.
    ``solver``:

    * ``"sgd"`` (default; Antorán et al. 2023): minibatch optimisation of the S objectives,
      ``epochs`` passes with batch size ``batch_size``. ``optimizer="sgd"`` is heavy-ball
      momentum whose step and momentum, when ``lr`` / ``momentum`` are None, are set from the
      condition number: L from power iteration on a few batch GGNs (times N / B) plus the
      largest prior precision, mu the smallest prior precision (a lower bound on A's spectrum);
      full batch: lr = 4 / (sqrt L + sqrt mu)^2, momentum = ((sqrt k - 1) / (sqrt k + 1))^2
      with k = L / mu (the optimal heavy-ball constants); minibatches, whose curvatures vary:
      lr = 1 / L and momentum min(that, 0.9). Minibatch SGD converges slowly on
      ill-conditioned problems (the known cost of the method); prefer "cg" when full passes
      are affordable.
      ``optimizer="adam"`` needs ``lr``. ``schedule="cosine"`` decays the step to 0, which
      removes the minibatch noise at the end.
    * ``"cg"``: conjugate gradients on A d = c for all S systems at once, one pass over the
      data per iteration (at most ``epochs`` iterations, relative residual ``tol``); matrix-free.
    * ``"solve"``: form A (P x P) and solve exactly; small P and tests.

    ``route``: how batch GGN products are formed: "jacobian" (batch Jacobian, two matrix
    products), "jvp" (vmapped jvp / vjp, no Jacobian), "auto" (Jacobian when B C P <=
    ``jacobian_budget`` elements). With tuple data whose whole Jacobian N C P fits the budget
    (and route != "jvp") it is computed once and every pass indexes it. ``seed`` seeds the
    randomisation (d0, then z batch by batch) and the minibatch order.

    After :meth:`fit`, ``samples`` (S, P) holds delta_s = theta_s - theta*, ``theta_star`` the
    linearisation point; :meth:`sample` returns theta_s.
    """

    unsupported: ClassVar[dict[str, str]] = {
        "log_marginal_likelihood": "the posterior is held as S samples, which give no log det "
        "of the posterior precision; use Laplace (structure 'full' / 'kron' / 'lowrank') or "
        "FunctionalLaplace for the evidence",
    }

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood = "classification",
        prior_precision: float | Tensor = 1.0,
        sigma_noise: float | Tensor = 1.0,
        num_samples: int = 64,
        subset: str | list[str] = "all",
        *,
        solver: Solver = "sgd",
        epochs: int = 100,
        lr: float | None = None,
        momentum: float | None = None,
        batch_size: int = 256,
        optimizer: Optimizer = "sgd",
        schedule: Literal["cosine", "constant"] = "cosine",
        tol: float = 1e-10,
        route: Route = "auto",
        jacobian_budget: int = 2**22,
        seed: int = 0,
    ) -> None:
        num_samples = check_count(num_samples, "num_samples")
        _check_choice("solver", solver, ("sgd", "cg", "solve"))
        _check_choice("optimizer", optimizer, ("sgd", "adam"))
        _check_choice("schedule", schedule, ("cosine", "constant"))
        _check_choice("route", route, ("auto", "jacobian", "jvp"))
        epochs = check_count(epochs, "epochs", minimum=0)
        if lr is not None and not lr > 0:
            raise ValueError(f"lr: must be > 0 or None (automatic), got {lr}")
        if optimizer == "adam" and lr is None:
            raise ValueError("lr: optimizer='adam' needs a learning rate")
        if momentum is not None and not 0 <= momentum < 1:
            raise ValueError(f"momentum: must be in [0, 1) or None (automatic), got {momentum}")
        batch_size = check_count(batch_size, "batch_size")
        self.model = model
        self.likelihood = get_likelihood(likelihood, sigma_noise=sigma_noise)
        self.task = self.likelihood.task
        warn_if_squashed_output(model, self.task)
        if self.task == "heteroscedastic":
            raise ValueError("likelihood: heteroscedastic outputs are not supported by SampledLLA")
        self.subset: ParameterSubset = select_parameters(model, subset)
        first = next(model.parameters())
        prior = torch.as_tensor(prior_precision, dtype=first.dtype, device=first.device)
        self.prior_precision = check_prior(prior).clone()
        expand_prior(self.prior_precision, self.subset)  # raises on a wrong granularity
        sigma = check_sigma_noise(sigma_noise, self.task, first.dtype, first.device)
        self.sigma_noise = sigma.clone()
        self.num_samples = num_samples
        self.solver: Solver = solver
        self.epochs, self.batch_size = epochs, batch_size
        self.lr, self.momentum = lr, momentum
        self.optimizer: Optimizer = optimizer
        self.schedule = schedule
        self.tol = float(tol)
        self.route: Route = route
        self.jacobian_budget = int(jacobian_budget)
        self.seed = seed
        self.samples: Tensor | None = None
        self.history: list[float] = []

    # ------------------------------------------------------------------ fitting
    def _prior_vec(self) -> Tensor:
        return expand_prior(self.prior_precision, self.subset).to(self.theta_star.dtype)

    def _batch(self, x: Tensor) -> _BatchGGN:
        return _BatchGGN(
            self.model, self.subset, self.likelihood, x, self.route, self.jacobian_budget
        )

    def _prepare_cache(self, data: Batches) -> None:
        """For tuple data whose whole Jacobian (N, C, P) fits ``jacobian_budget`` (and
        route != "jvp"), compute it and the factors L_n once; every pass then indexes them."""
        self._cache: tuple[Tensor, Tensor, Tensor] | None = None
        if not isinstance(data, tuple) or self.route == "jvp":
            return
        x = data[0]
        f = model_outputs(self.model, x)
        if x.shape[0] * f.shape[1] * self.subset.num_params > self.jacobian_budget:
            return
        self._cache = (x, self.likelihood.hessian_sqrt(f), jacobians(self.model, x, self.subset))

    def _iter_batches(
        self, data: Batches, shuffle: bool = False, gen: torch.Generator | None = None
    ) -> Iterator[_BatchGGN]:
        """Batch GGN operators over ``data`` (cached Jacobians when available; the same
        batch order as :func:`gaussify.batches.as_batches` either way)."""
        if self._cache is None:
            for x, _ in as_batches(data, self.batch_size, shuffle=shuffle, generator=gen):
                yield self._batch(x)
            return
        x, factor, jac = self._cache
        n = x.shape[0]
        order = torch.randperm(n, generator=gen) if shuffle else torch.arange(n)
        for start in range(0, n, self.batch_size):
            idx = order[start : start + self.batch_size]
            yield _BatchGGN(
                self.model,
                self.subset,
                self.likelihood,
                x[idx],
                self.route,
                self.jacobian_budget,
                factor=factor[idx],
                jac=jac[idx],
            )

    @transactional
    @in_eval_mode
    def fit(self, data: Batches, *, progress: bool = False) -> SampledLLA:
        """Draw the randomisation and optimise the S randomised objectives over ``data``.

        Random draws (from a generator seeded with ``seed``): d0 (S, P) = eps / sqrt(P0) first,
        then z (S, B, C) for each batch of ``data`` in iteration order (tuple data: unshuffled
        batches of ``batch_size``). The model is put in eval mode.
        """
        data = check_data(
            data,
            model=self.model,
            task=self.task,
            owner="SampledLLA.fit",
            multi_pass=self.solver != "solve",
        )
        self.model.eval()
        check_eval_mode(self.model)
        self.theta_star = self.subset.flatten(self.subset.params(self.model)).clone()
        dtype = self.theta_star.dtype
        prior = self._prior_vec()
        gen = torch.Generator().manual_seed(self.seed)
        s, p = self.num_samples, self.subset.num_params
        if self.solver == "solve":
            check_allocation(
                p * p,
                dtype,
                f"solver='solve': the P x P GGN (P = {p:,})",
                "solver='sgd' or 'cg', or a smaller subset",
                device=self.theta_star.device,
            )
        # draws from the (host) generator, then moved: the same samples on every device
        device = self.theta_star.device
        self.delta0 = torch.randn(s, p, generator=gen, dtype=dtype).to(device) / prior.sqrt()
        linear = torch.zeros(s, p, dtype=dtype, device=device)
        gram = torch.zeros(p, p, dtype=dtype, device=device) if self.solver == "solve" else None
        num_data = 0
        self._prepare_cache(data)
        for batch in self._iter_batches(data):
            z = torch.randn(s, *batch.factor.shape[:2], generator=gen, dtype=dtype).to(device)
            linear += batch.noise(z)
            if gram is not None:
                jac = batch.jac
                if jac is None:
                    jac = jacobians(self.model, batch.x, self.subset).reshape(-1, p)
                rows = torch.einsum(
                    "nck,ncp->nkp", batch.factor, jac.reshape(*batch.factor.shape[:2], p)
                ).reshape(-1, p)
                gram += rows.T @ rows
            num_data += batch.x.shape[0]
        if num_data == 0:
            raise ValueError("data: contains no examples")
        self.num_data = num_data
        # c_s = b_s + P0 d0_s: each optimum solves A d = c_s
        self.linear_term = linear + prior * self.delta0
        if gram is not None:
            chol = torch.linalg.cholesky(gram + torch.diag(prior))
            self.samples = torch.cholesky_solve(self.linear_term.T, chol).T
        elif self.solver == "cg":
            self.samples = self._conjugate_gradients(data, prior, progress)
        else:
            self.samples = self._optimise(data, prior, gen, progress)
        return self

    def _full_product(self, data: Batches, v: Tensor, prior: Tensor) -> Tensor:
        """A v = (G + P0) v over all of ``data``, (S, P)."""
        out = prior * v
        for batch in self._iter_batches(data):
            out = out + batch(v)[0]
        return out

    def _conjugate_gradients(self, data: Batches, prior: Tensor, progress: bool) -> Tensor:
        """S independent CG runs on A d = c_s, vectorised (each its own step sizes), started
        at d0; one pass over the data per iteration."""
        d = self.delta0.clone()
        r = self.linear_term - self._full_product(data, d, prior)
        direction = r.clone()
        rs = r.square().sum(-1)
        target = self.tol * self.linear_term.norm(dim=-1)
        iters = range(self.epochs)
        if progress:
            from tqdm.auto import tqdm

            iters = tqdm(iters, desc="SampledLLA (cg)", unit="pass")
        self.history = []
        for _ in iters:
            if bool((rs.sqrt() <= target).all()):
                break
            a_dir = self._full_product(data, direction, prior)
            curv = (direction * a_dir).sum(-1)
            # converged systems keep a zero direction; guard their 0 / 0
            alpha = torch.where(curv > 0, rs / curv.clamp_min(torch.finfo(d.dtype).tiny), 0.0)
            d = d + alpha[:, None] * direction
            r = r - alpha[:, None] * a_dir
            rs_new = r.square().sum(-1)
            beta = torch.where(rs > 0, rs_new / rs.clamp_min(torch.finfo(d.dtype).tiny), 0.0)
            direction = r + beta[:, None] * direction
            rs = rs_new
            self.history.append(float((rs.sqrt() / self.linear_term.norm(dim=-1)).max()))
        return d

    def _curvature_bound(self, data: Batches, prior: Tensor, gen: torch.Generator) -> float:
        """Largest eigenvalue of (N / B) G_B + P0 over up to four batches (power iteration),
        with a 25% margin: the L of the step-size rule."""
        top = 0.0
        for i, batch in enumerate(self._iter_batches(data, shuffle=True, gen=gen)):
            if i == 4:
                break
            x = batch.x
            v = torch.randn(1, self.subset.num_params, generator=gen, dtype=prior.dtype)
            v = v.to(prior.device)
            lam = 0.0
            for _ in range(30):
                v = v / v.norm()
                gv = batch(v)[0] * (self.num_data / x.shape[0])
                lam = float((v * gv).sum())
                v = gv
            top = max(top, lam)
        return 1.25 * top + float(prior.max())

    def _optimise(
        self, data: Batches, prior: Tensor, gen: torch.Generator, progress: bool
    ) -> Tensor:
        """Minibatch optimisation of all S objectives at once, started at d0 (the optimum in
        every direction the data do not constrain). Gradients are formed by hand,
        (N / B) G_B d + P0 d - c, so no autograd graph over the model exists."""
        delta = self.delta0.clone().requires_grad_(True)
        if self._cache is not None or isinstance(data, tuple):
            steps_per_epoch = math.ceil(self.num_data / self.batch_size)
        else:
            steps_per_epoch = sum(1 for _ in as_batches(data))
        opt: torch.optim.Optimizer
        if self.optimizer == "adam":
            assert self.lr is not None
            opt = torch.optim.Adam([delta], lr=self.lr)
        else:
            lr, momentum = self.lr, self.momentum
            if lr is None or momentum is None:
                big, small = self._curvature_bound(data, prior, gen), float(prior.min())
                root = math.sqrt(big / small)
                if steps_per_epoch == 1:  # full batch: the optimal heavy-ball constants
                    auto_lr = 4.0 / (math.sqrt(big) + math.sqrt(small)) ** 2
                    auto_momentum = ((root - 1) / (root + 1)) ** 2
                else:  # batch curvatures vary: a safe step and at most 0.9 momentum
                    auto_lr, auto_momentum = 1.0 / big, min(((root - 1) / (root + 1)) ** 2, 0.9)
                lr = auto_lr if lr is None else lr
                momentum = auto_momentum if momentum is None else momentum
            self.lr_used, self.momentum_used = lr, momentum
            opt = torch.optim.SGD([delta], lr=lr, momentum=momentum)
        sched = (
            torch.optim.lr_scheduler.CosineAnnealingLR(
                opt, T_max=max(1, self.epochs * steps_per_epoch)
            )
            if self.schedule == "cosine"
            else None
        )
        epochs = range(self.epochs)
        if progress:
            from tqdm.auto import tqdm

            epochs = tqdm(epochs, desc="SampledLLA", unit="epoch")
        self.history = []
        for _ in epochs:
            loss_sum = 0.0
            for batch in self._iter_batches(data, shuffle=True, gen=gen):
                d = delta.detach()
                scale = self.num_data / batch.x.shape[0]
                product, w = batch(d)
                delta.grad = scale * product + prior * d - self.linear_term
                opt.step()
                if sched is not None:
                    sched.step()
                loss_sum += float(0.5 * scale * w.square().sum() / self.num_samples)
            self.history.append(loss_sum)
        return delta.detach()

    def _require_fit(self) -> Tensor:
        if self.samples is None:
            raise RuntimeError("SampledLLA: call fit(data) before predicting or sampling")
        return self.samples

    @transactional
    def optimize_prior(
        self, data: Batches | None = None, *, n_steps: int = 20, tol: float = 1e-3
    ) -> SampledLLA:
        """Type-II maximum likelihood of the prior precision by the sample-based EM of
        Antorán et al. (2023) (MacKay's fixed point). The Laplace evidence's derivative in a
        prior alpha_g shared by a group g of P_g weights vanishes where
        alpha_g = gamma_g / ||theta*_g||^2, gamma_g = P_g - alpha_g tr_g(A^-1) the effective
        number of parameters; the fitted samples delta_s ~ N(0, A^-1) estimate
        tr_g(A^-1) = E ||delta_{s,g}||^2 by their mean. Each update is followed by a new
        :meth:`fit` (the samples at the new prior) on ``data``, for at most ``n_steps`` updates or
        until no group's alpha moves by more than ``tol`` (relative). The stationary point is
        the Laplace-GGN evidence's without the non-MAP correction; the evidence itself is not
        computed (samples give no log det A). Groups: the prior's granularity (a scalar, or
        one value per parameter tensor; a per-weight prior is refused: one sample-based
        estimate per weight is noise)."""
        if data is None:
            raise ValueError(
                "data: SampledLLA.optimize_prior refits the samples after every update; pass "
                "the training data"
            )
        n_steps = check_count(n_steps, "n_steps")
        if not math.isfinite(tol) or tol < 0:
            raise ValueError(f"tol: expected a finite number >= 0, got {tol!r}")
        names, p = len(self.subset.names), self.subset.num_params
        k = self.prior_precision.numel()
        if self.prior_precision.ndim > 0 and not (k == names and k != p) and k != 1:
            raise ValueError(
                "prior_precision: the EM update needs a scalar or one value per parameter "
                f"tensor ({names}), got {k} values"
            )
        if self.samples is None:
            self.fit(data)
        device = self.theta_star.device
        counts = torch.tensor(list(self.subset.counts), device=device)
        group = (
            torch.arange(len(counts), device=device).repeat_interleave(counts)
            if self.prior_precision.ndim > 0 and k == names
            else torch.zeros(p, dtype=torch.long, device=device)
        )
        size = torch.bincount(group).to(self.theta_star.dtype)
        for _ in range(n_steps):
            samples = self._require_fit()
            alpha = self.prior_precision.reshape(-1).to(self.theta_star.dtype)
            trace = torch.zeros_like(size).index_add_(0, group, samples.square().mean(0))
            norm = torch.zeros_like(size).index_add_(0, group, self.theta_star.square())
            gamma = (size - alpha * trace).clamp(min=1e-3 * size, max=size)
            new = gamma / norm.clamp_min(torch.finfo(norm.dtype).tiny)
            change = float(((new - alpha).abs() / alpha).max())
            self.prior_precision = new.reshape(self.prior_precision.shape).to(
                self.prior_precision.dtype
            )
            self.fit(data)
            if change <= tol:
                break
        return self

    # ------------------------------------------------------------------ posterior
    def sample(
        self, num_samples: int | None = None, generator: torch.Generator | None = None
    ) -> Tensor:
        """Weight samples theta* + delta_s, (S, P): the first ``num_samples`` of the S fitted
        samples, or, with ``generator``, ``num_samples`` of them chosen at random without
        replacement (each fitted sample is an independent exact draw of q, so any subset is
        too; new draws need a new :meth:`fit`, which optimises them)."""
        samples = self._require_fit()
        n = samples.shape[0] if num_samples is None else check_count(num_samples, "num_samples")
        if n < 1 or n > samples.shape[0]:
            raise ValueError(
                f"num_samples: must be in [1, {samples.shape[0]}] (the fitted samples), got {n}"
            )
        if generator is None:
            return self.theta_star + samples[:n]
        chosen = torch.randperm(samples.shape[0], generator=generator)[:n]
        return self.theta_star + samples[chosen]

    @in_eval_mode
    def objective(self, data: Batches) -> Tensor:
        """Each sample's randomised objective up to its constant (1/2 ||z||^2 + 1/2 d0^T P0
        d0), (S,): 1/2 d^T A d - d^T c. Its excess over the exact minimiser's value is the
        optimisation error 1/2 (d - d_opt)^T A (d - d_opt)."""
        samples = self._require_fit()
        data = check_data(data, model=self.model, task=self.task, owner="SampledLLA.objective")
        self._prepare_cache(data)  # the Jacobians of these data, not those of the fit
        return 0.5 * (samples * self._full_product(data, samples, self._prior_vec())).sum(-1) - (
            samples * self.linear_term
        ).sum(-1)

    # ------------------------------------------------------------------ prediction
    @in_eval_mode
    def predict_samples(self, x: Tensor, *, chunk_size: int = 256) -> Tensor:
        """Linearised function samples f(x; theta*) + J(x) delta_s, (S, N, C)."""
        samples = self._require_fit()
        check_inputs(x, self.model)
        chunk_size = check_count(chunk_size, "chunk_size")
        out = []
        for sl in chunk_slices(x.shape[0], chunk_size):
            f = model_outputs(self.model, x[sl])
            if self.route == "jvp" or (
                self.route == "auto"
                and f.shape[0] * f.shape[1] * samples.shape[1] > self.jacobian_budget
            ):
                out.append(f + batched_jvp(self.model, x[sl], self.subset, samples))
            else:
                jac = jacobians(self.model, x[sl], self.subset)
                out.append(f + torch.einsum("ncp,sp->snc", jac, samples))
        return torch.cat(out, dim=1)

    @in_eval_mode
    def predict(
        self,
        x: Tensor,
        link: LinkName = "mc",
        *,
        num_samples: int = 100,
        generator: torch.Generator | None = None,
        chunk_size: int = 256,
    ) -> Predictive:
        """Predictive at ``x (N, ...)``.

        ``link="mc"`` (default): the sample-based predictive (probabilities averaged over the S
        linearised samples; regression adds the noise). ``"probit"`` / ``"bridge"``: a Gaussian
        N(f(x; theta*), (1/S) sum_s J delta_s (J delta_s)^T, the sample covariance around the
        known mean 0) through that link (``num_samples`` / ``generator`` go to it).
        """
        self._require_fit()
        check_inputs(x, self.model)
        num_samples = check_count(num_samples, "num_samples")
        noise_var = noise_variance(self.task, self.sigma_noise)
        f_samples = self.predict_samples(x, chunk_size=chunk_size)
        if link == "mc":
            return predictive_from_samples(f_samples, self.task, noise_var=noise_var)
        f_mean = model_outputs(self.model, x)
        dev = f_samples - f_mean
        f_cov = torch.einsum("snc,snd->ncd", dev, dev) / dev.shape[0]
        return posterior_predictive(
            f_mean, f_cov, self.task, self.sigma_noise, link, num_samples, generator
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values (loadable with ``torch.load(..., weights_only=True)``),
        with the identity of the posterior (task, subset, fingerprint of the other weights)."""
        samples = self._require_fit()
        return copy_state(
            {
                **identity(self.task, self.subset.names, self.model),
                "samples": samples,
                "theta_star": self.theta_star,
                "delta0": self.delta0,
                "linear_term": self.linear_term,
                "prior_precision": self.prior_precision,
                "sigma_noise": self.sigma_noise,
                "num_data": self.num_data,
                "seed": self.seed,
            }
        )

    @transactional
    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Restore a state from :meth:`state_dict` into a SampledLLA over the same model: the
        whole state is validated first (:mod:`gaussify.state`), theta* and the other weights
        against the model (a mismatch raises; ``strict=False`` warns); a failed load
        changes nothing."""
        dt = self.prior_precision.dtype
        schema = {
            **st.identity_schema(self.task, self.subset.names),
            "samples": st.TensorSpec(("S", "P"), dt),
            "theta_star": st.TensorSpec(("P",), dt),
            "delta0": st.TensorSpec(("S", "P"), dt),
            "linear_term": st.TensorSpec(("S", "P"), dt),
            "prior_precision": st.TensorSpec(None, dt, positive=True),
            "sigma_noise": st.TensorSpec(None, dt, positive=True),
            "num_data": st.Integer(1),
            "seed": st.Integer(0),
        }
        valid = st.validate_posterior_state(
            state,
            schema,
            owner="SampledLLA",
            task=self.task,
            model=self.model,
            subset=self.subset,
            strict=strict,
        )
        prior = check_prior(valid["prior_precision"].clone())
        expand_prior(prior, self.subset)  # the granularity fits this subset
        self.samples, self.theta_star = valid["samples"].clone(), valid["theta_star"].clone()
        self.delta0, self.linear_term = valid["delta0"].clone(), valid["linear_term"].clone()
        self.prior_precision, self.sigma_noise = prior, valid["sigma_noise"].clone()
        self.num_data, self.seed = valid["num_data"], valid["seed"]
        self.num_samples = int(self.samples.shape[0])
        if self.task == "regression":
            self.likelihood = get_likelihood("regression", sigma_noise=self.sigma_noise)


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {value!r}")
