"""Exact Bayesian last layer under Gaussian pseudo-likelihoods (Bui, eq. 4 and Sec. 4.3).

On fixed features ``phi (N, D)`` (a frozen network body) the logits are ``f = W^T [phi, 1]``,
with independent priors ``w_k ~ N(0, I / delta)`` on the columns of ``W (D', K)``. Replacing
the softmax (or sigmoid) likelihood by the per-class Gaussians ``N(f_nk; m_nk, v_nk)`` of
:mod:`gaussify.approx_likelihoods` makes the posterior exact and Gaussian, one column at a time
(eq. 4): Bayesian linear regression with heteroscedastic noise ``v_nk``,

    Lambda_k = delta I + sum_n v_nk^-1 x_n x_n^T,    mu_k = Lambda_k^-1 sum_n v_nk^-1 m_nk x_n.

``streaming=True`` reaches it one batch (or point) at a time by rank-B Kalman updates in
covariance form, ``S = X Sigma X^T + V``, ``mu += Sigma X^T S^-1 (m - X mu)``,
``Sigma -= Sigma X^T S^-1 X Sigma``, and accumulates the log evidence by the chain rule,
``log p(m_1:T) = sum_t log N(m_t; X_t mu_{t-1}, S_t)``; ``streaming=False`` sums the
information ``(Lambda, eta)`` and solves once. Both are float64 and agree to round-off.

Predictions push the Gaussian to the logits, ``f_k ~ N(x^T mu_k, x^T Sigma_k x)`` (independent
over k), and through :func:`gaussify.predictive.predictive_from_gaussian` (probit or softmax of
samples). ``alpha_eps`` is chosen by the training likelihood over a grid (Sec. 4) or by the
variational bound of App. B, :meth:`ExactLastLayer.elbo`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from gaussify import distributed
from gaussify.approx_likelihoods import (
    DEFAULT_GRID,
    AlphaSelection,
    BetaGaussian,
    DirichletGaussian,
    expected_log_likelihood,
    pseudo_likelihood,
    select_alpha_eps,
    tune_alpha_eps,
)
from gaussify.approx_likelihoods.pseudo_targets import METHODS, Basis, Method, check_labels
from gaussify.batches import Batches
from gaussify.last_layer.columns import ColumnSampler
from gaussify.memory_guard import check_allocation
from gaussify.predictive import LinkName, Predictive, predictive_from_gaussian
from gaussify.state import (
    Choice,
    Flag,
    Integer,
    Maybe,
    Number,
    TensorSpec,
    copy_state,
    transactional,
    validate_state,
)
from gaussify.tuning import TuningResult, check_grid, grid_search
from gaussify.validation import check_finite, validated_batches

__all__ = ["ExactLastLayer", "augment", "check_features"]

_LOG_2PI = math.log(2 * math.pi)


def check_features(
    phi: Tensor, in_features: int, name: str = "phi", *, allow_empty: bool = True
) -> Tensor:
    """Validate features ``(N, in_features)``: a finite floating tensor (with at least one
    row unless ``allow_empty``)."""
    if not isinstance(phi, Tensor) or not phi.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor of shape (N, {in_features})")
    if phi.ndim != 2 or phi.shape[1] != in_features:
        raise ValueError(f"{name}: expected shape (N, {in_features}), got {tuple(phi.shape)}")
    if phi.shape[0] == 0 and not allow_empty:
        raise ValueError(f"{name}: contains no examples")
    check_finite(phi, name)  # names the first bad row and NaN / inf
    return phi


def augment(phi: Tensor, bias: bool, dtype: torch.dtype) -> Tensor:
    """``[phi, 1]`` (or ``phi``) in ``dtype``: the design matrix of the last layer."""
    x = phi.to(dtype)
    if bias:
        x = torch.cat([x, torch.ones_like(x[:, :1])], dim=-1)
    return x


class ExactLastLayer(ColumnSampler):
    """Exact Bayesian last layer with a Gaussian pseudo-likelihood per class (eq. 4).

    ``in_features`` D and ``num_classes`` C; ``method`` / ``basis`` / ``alpha_eps`` /
    ``beta_eps`` / ``noise`` choose the pseudo-likelihood (``basis="log"``: softmax, one output
    per class; ``basis="logit"``: binary, one output), or pass ``pseudo_likelihood`` directly.
    ``prior_precision`` delta of ``N(0, I/delta)`` on every column (bias included when
    ``bias``). ``streaming``: Kalman updates per batch (default) or one information-form solve.

    ``fit(data)`` starts afresh; ``update(phi, y)`` adds one batch to the current posterior.
    ``device`` (default cpu): where the posterior lives; features on another device raise.
    """

    def __init__(
        self, in_features: int, num_classes: int, *, method: Method = "variational",
        basis: Basis = "log", alpha_eps: float = 0.1, beta_eps: float | None = None,
        noise: float = 0.1, pseudo_likelihood: DirichletGaussian | BetaGaussian | None = None,
        prior_precision: float = 1.0, bias: bool = True, streaming: bool = True,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
    ) -> None:  # fmt: skip
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features < 1:
            raise ValueError(f"in_features: must be a positive integer, got {in_features!r}")
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes: must be an integer >= 2, got {num_classes!r}")
        if not prior_precision > 0 or not math.isfinite(prior_precision):
            raise ValueError(f"prior_precision: must be positive and finite, got {prior_precision}")
        if pseudo_likelihood is None:
            pseudo_likelihood = _make_pseudo_likelihood(method, basis, alpha_eps, beta_eps, noise)
        self.pseudo_likelihood = pseudo_likelihood
        self.num_outputs = pseudo_likelihood.num_outputs(num_classes)
        self.in_features, self.num_classes = in_features, num_classes
        self.prior_precision = float(prior_precision)
        self.bias, self.streaming, self.dtype = bias, streaming, dtype
        self.device = torch.device(device)
        #: outcome of the last optimize_prior (the grid, the evidence at the best value)
        self.tuning_result: TuningResult | None = None
        self.num_features = in_features + int(bias)
        d = self.num_features
        check_allocation(
            self.num_outputs * d * d,
            dtype,
            f"ExactLastLayer: {self.num_outputs} (D+1) x (D+1) covariances (D+1 = {d:,})",
            "fewer features (a projection of phi), or a VBLL head with a diagonal or low-rank "
            "covariance",
        )
        self.reset()

    # --- state ---------------------------------------------------------------------------

    @property
    def task(self) -> str:
        """``"classification"`` (softmax) or ``"binary"`` (sigmoid of the single output)."""
        return self.pseudo_likelihood.task

    def reset(self) -> ExactLastLayer:
        """Back to the prior ``N(0, I/delta)`` for every column."""
        d, k = self.num_features, self.num_outputs
        dd = {"dtype": self.dtype, "device": self.device}
        eye = torch.eye(d, **dd)
        self.num_data = 0
        self._log_evidence = torch.zeros((), **dd)
        if self.streaming:
            self._mean = torch.zeros(d, k, **dd)
            self._cov = eye.expand(k, d, d) / self.prior_precision
        else:
            self._precision = (self.prior_precision * eye).expand(k, d, d).clone()
            self._eta = torch.zeros(d, k, **dd)
            self._quad = torch.zeros(k, **dd)  # sum m^2 / v
            self._log_norm = torch.zeros(k, **dd)  # sum log(2 pi v)
            self._solved: tuple[Tensor, Tensor, Tensor] | None = None
        return self

    def _targets(self, y: Tensor, n: int) -> tuple[Tensor, Tensor]:
        if not isinstance(y, Tensor):
            raise TypeError(f"y: expected an integer tensor of {n} labels")
        y = check_labels(y.reshape(-1), self.num_classes)
        if y.shape[0] != n:
            raise ValueError(f"y: expected {n} labels to match phi, got {y.shape[0]}")
        mean, var = self.pseudo_likelihood.pseudo_targets(y, self.num_classes, dtype=self.dtype)
        mean, var = mean.to(self.device), var.to(self.device)
        return mean.reshape(n, self.num_outputs), var.reshape(n, self.num_outputs)

    def _features(self, phi: Tensor, allow_empty: bool = True) -> Tensor:
        """``[phi, 1]`` (or ``phi`` without a bias) in the layer's dtype, after the feature
        checks; features on another device than the layer's state are refused."""
        phi = check_features(phi, self.in_features, allow_empty=allow_empty)
        same = phi.device.type == self.device.type and (
            self.device.index is None or phi.device.index in (None, self.device.index)
        )
        if not same:
            raise ValueError(
                f"phi: is on {phi.device}, the layer's posterior is on {self.device}; create "
                f"the layer with device={str(phi.device)!r}"
            )
        return augment(phi, self.bias, self.dtype)

    @transactional
    def update(self, phi: Tensor, y: Tensor) -> ExactLastLayer:
        """Condition on one batch ``phi (B, D)``, ``y (B,)``: a rank-B Kalman update per
        column (``streaming=True``) or an information update (``streaming=False``)."""
        x = self._features(phi)
        m, v = self._targets(y, x.shape[0])
        if x.shape[0] == 0:
            return self
        self.num_data += x.shape[0]
        if self.streaming:
            self._kalman(x, m, v)
        else:
            w = 1.0 / v
            self._precision = self._precision + torch.einsum("bd,bk,be->kde", x, w, x)
            self._eta = self._eta + x.T @ (m * w)
            self._quad = self._quad + (m.square() * w).sum(0)
            self._log_norm = self._log_norm + torch.log(2 * math.pi * v).sum(0)
            self._solved = None
        return self

    def _kalman(self, x: Tensor, m: Tensor, v: Tensor) -> None:
        cov_xt = self._cov @ x.T  # (K, D', B)
        s = x @ cov_xt + torch.diag_embed(v.T)  # (K, B, B)
        chol = torch.linalg.cholesky(s)
        resid = (m - x @ self._mean).T.unsqueeze(-1)  # (K, B, 1)
        gain_t = torch.cholesky_solve(cov_xt.transpose(-1, -2), chol)  # S^-1 X Sigma, (K, B, D')
        self._mean = self._mean + (gain_t.transpose(-1, -2) @ resid).squeeze(-1).T
        cov = self._cov - cov_xt @ gain_t
        self._cov = 0.5 * (cov + cov.transpose(-1, -2))
        whitened = torch.linalg.solve_triangular(chol, resid, upper=False).squeeze(-1)
        logdet = 2 * torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum(-1)
        self._log_evidence = (
            self._log_evidence
            + (-0.5 * whitened.square().sum(-1) - 0.5 * logdet - 0.5 * x.shape[0] * _LOG_2PI).sum()
        )

    @transactional
    @distributed.collective("ExactLastLayer.fit")
    def fit(
        self, data: Batches, batch_size: int = 256, *, progress: bool = False
    ) -> ExactLastLayer:
        """Reset to the prior and condition on ``data`` (``(phi, y)`` tensors or a DataLoader of
        ``(phi, y)`` batches), one batch at a time."""
        batches = validated_batches(
            data, batch_size, task=self.task, owner="ExactLastLayer.fit", input_name="phi"
        )
        self.reset()
        if progress:
            from tqdm.auto import tqdm

            batches = tqdm(batches, desc="exact last layer")
        for phi, y in batches:
            self.update(phi, y)
        distributed.reduce_exact_last_layer(self)  # merge the shards' posteriors (if any)
        return self

    def _solve(self) -> tuple[Tensor, Tensor, Tensor]:
        if self._solved is None:
            chol = torch.linalg.cholesky(self._precision)
            mean = torch.cholesky_solve(self._eta.T.unsqueeze(-1), chol).squeeze(-1).T
            self._solved = (chol, mean, torch.cholesky_inverse(chol))
        return self._solved

    @property
    def mean(self) -> Tensor:
        """Posterior mean of ``W``, ``(D', K)`` (last row: the bias when ``bias``)."""
        return self._mean if self.streaming else self._solve()[1]

    @property
    def covariance(self) -> Tensor:
        """Posterior covariance of each column of ``W``, ``(K, D', D')``."""
        return self._cov if self.streaming else self._solve()[2]

    @property
    def precision(self) -> Tensor:
        """Posterior precision of each column, ``(K, D', D')``."""
        return self._precision if not self.streaming else torch.linalg.inv(self._cov)

    @transactional
    def optimize_prior(
        self,
        data: Batches | None = None,
        *,
        grid: Tensor | Sequence[float] | None = None,
        batch_size: int = 256,
    ) -> ExactLastLayer:
        """Type-II maximum likelihood of the prior precision delta: the value with the largest
        exact log evidence :meth:`log_marginal_likelihood` among ``grid`` (1-D, default
        10^-4 .. 10^4, 41 points) and the current delta, refitting on ``data`` for each (one
        conjugate pass each); the layer ends fitted at the best. The evidence never decreases.
        The outcome is kept in :attr:`tuning_result`."""
        if data is None:
            raise ValueError(
                "data: ExactLastLayer.optimize_prior refits the layer for each prior precision; "
                "pass the training data (a DataLoader or a (phi, y) pair)"
            )
        values = torch.logspace(-4, 4, 41, dtype=torch.float64)
        values = values if grid is None else check_grid(grid)
        values = torch.cat([values.to(torch.float64), torch.tensor([self.prior_precision])])

        def evidence(delta: Tensor) -> Tensor:
            self.prior_precision = float(delta)
            return self.fit(data, batch_size).log_marginal_likelihood()

        result = grid_search(evidence, values, self.dtype)
        self.prior_precision = float(result.prior_precision)
        self.fit(data, batch_size)
        self.tuning_result = result
        return self

    def log_marginal_likelihood(self) -> Tensor:
        """Log evidence of the pseudo-targets under the Gaussian model,
        ``sum_k log N(m_k; 0, X X^T / delta + V_k)`` (0-dim, float64)."""
        if self.streaming:
            return self._log_evidence.clone()
        chol, mean, _ = self._solve()
        d = self.num_features
        logdet = 2 * torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum(-1)
        per_class = (
            -0.5 * self._quad
            + 0.5 * (self._eta * mean).sum(0)
            - 0.5 * self._log_norm
            - 0.5 * logdet
            + 0.5 * d * math.log(self.prior_precision)
        )
        return per_class.sum()

    # --- prediction ------------------------------------------------------------------------

    def logit_distribution(self, phi: Tensor) -> tuple[Tensor, Tensor]:
        """Mean and variance ``(N, K)`` of the logits at features ``phi (N, D)``."""
        x = self._features(phi, allow_empty=False)
        f_var = torch.einsum("nd,kde,ne->nk", x, self.covariance, x)
        return x @ self.mean, f_var.clamp_min(0)

    def predict(
        self, phi: Tensor, link: LinkName = "probit", *, num_samples: int = 100,
        generator: torch.Generator | None = None,
    ) -> Predictive:  # fmt: skip
        """Predictive at ``phi (N, D)``: logits ``N(f_mean (N, K), diag f_var)`` and probs by
        ``link`` (``"probit"`` or ``"mc"``: softmax / sigmoid averaged over samples), in the
        dtype of ``phi``."""
        f_mean, f_var = self.logit_distribution(phi)
        pred = predictive_from_gaussian(
            f_mean,
            torch.diag_embed(f_var),
            self.task,
            link=link,
            num_samples=num_samples,
            generator=generator,
        )
        dtype = phi.dtype
        return Predictive(
            pred.task,
            pred.f_mean.to(dtype),
            f_cov=pred.f_cov.to(dtype) if pred.f_cov is not None else None,
            probs=pred.probs.to(dtype) if pred.probs is not None else None,
        )

    # --- alpha_eps ------------------------------------------------------------------------

    def elbo(
        self,
        phi: Tensor,
        y: Tensor,
        alpha_eps: Tensor | float | None = None,
        *,
        num_samples: int = 32,
        base_samples: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """The variational bound of App. B for the *exact* softmax (sigmoid) model, with the
        exact posterior of the pseudo-likelihood model as ``q``:
        ``-sum_k KL[q(w_k) || p(w_k)] + sum_n E_q[log p(y_n | f_n)]`` (0-dim, float64).

        The posterior is recomputed from ``(phi, y)`` in one solve, differentiably in
        ``alpha_eps`` (default: the current one). The data term is reparameterised Monte Carlo
        with ``base_samples (S, N, K)`` (drawn once from ``generator`` if not given).
        """
        x = self._features(phi, allow_empty=False)
        n, d, k = x.shape[0], self.num_features, self.num_outputs
        pl = self.pseudo_likelihood
        if alpha_eps is not None:
            pl = pl.replace(alpha_eps=alpha_eps)
        y = check_labels(y.reshape(-1), self.num_classes)
        m, v = pl.pseudo_targets(y, self.num_classes, dtype=self.dtype)
        m = m.reshape(n, k).to(device=self.device, dtype=self.dtype)
        v = v.reshape(n, k).to(device=self.device, dtype=self.dtype)
        w = 1.0 / v
        eye = torch.eye(d, dtype=self.dtype, device=self.device)
        precision = self.prior_precision * eye + torch.einsum("bd,bk,be->kde", x, w, x)
        chol = torch.linalg.cholesky(precision)
        mean = torch.cholesky_solve((x.T @ (m * w)).T.unsqueeze(-1), chol).squeeze(-1)  # (K, D')
        half = torch.linalg.solve_triangular(chol, x.T.expand(k, d, n), upper=False)
        f_var = half.square().sum(1).T  # x^T Lambda^-1 x, (N, K)
        f_mean = x @ mean.T
        inv_chol = torch.linalg.solve_triangular(chol, eye.expand(k, d, d), upper=False)
        delta = self.prior_precision
        logdet_cov = -2 * torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum(-1)
        kl = (
            0.5
            * (
                delta * inv_chol.square().sum((-1, -2))
                + delta * mean.square().sum(-1)
                - d
                - d * math.log(delta)
                - logdet_cov
            ).sum()
        )
        if base_samples is None:
            base_samples = torch.randn(num_samples, n, k, generator=generator, dtype=self.dtype)
            base_samples = base_samples.to(self.device)  # drawn on the generator's device
        return expected_log_likelihood(f_mean, f_var, y, self.task, base_samples) - kl

    def _with_alpha(self, alpha_eps: float) -> ExactLastLayer:
        return ExactLastLayer(
            self.in_features,
            self.num_classes,
            pseudo_likelihood=self.pseudo_likelihood.replace(alpha_eps=alpha_eps),
            prior_precision=self.prior_precision,
            bias=self.bias,
            streaming=self.streaming,
            dtype=self.dtype,
            device=self.device,
        )

    @transactional
    def tune_alpha_eps(
        self,
        phi: Tensor,
        y: Tensor,
        strategy: Literal["variational", "train_likelihood"] = "variational",
        *,
        grid: Sequence[float] = DEFAULT_GRID,
        steps: int = 100,
        lr: float = 0.05,
        num_samples: int = 32,
        generator: torch.Generator | None = None,
        link: LinkName = "probit",
    ) -> AlphaSelection:
        """Choose ``alpha_eps`` on ``(phi, y)``, set it, and refit on ``(phi, y)``.

        ``"train_likelihood"``: the grid value whose fitted model predicts the training labels
        best (Sec. 4; Milios et al. 2018). ``"variational"``: maximise :meth:`elbo` (App. B)
        with fixed base samples (common random numbers), starting from the current value.
        """
        if strategy == "train_likelihood":

            def fit_predict(alpha: float) -> Tensor:
                layer = self._with_alpha(alpha).fit((phi, y))
                probs = layer.predict(phi, link=link, generator=generator).probs
                assert probs is not None
                return probs

            result = select_alpha_eps(fit_predict, y.reshape(-1), grid)
        elif strategy == "variational":
            n = phi.shape[0]
            base = torch.randn(
                num_samples, n, self.num_outputs, generator=generator, dtype=self.dtype
            ).to(self.device)
            init = float(self.pseudo_likelihood.alpha_eps)
            result = tune_alpha_eps(
                lambda a: self.elbo(phi, y, a, base_samples=base), init, steps=steps, lr=lr
            )
        else:
            raise ValueError(
                f"strategy: expected 'variational' or 'train_likelihood', got {strategy!r}"
            )
        self.pseudo_likelihood = self.pseudo_likelihood.replace(alpha_eps=result.alpha_eps)
        self.fit((phi, y))
        return result

    # --- serialisation --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Hyperparameters and posterior state (plain values and tensors, so that
        ``torch.load(..., weights_only=True)`` reads it)."""
        pl = self.pseudo_likelihood
        state: dict[str, Any] = {
            "task": self.task,
            "method": pl.method,
            "basis": pl.basis,
            "alpha_eps": float(pl.alpha_eps),
            "beta_eps": float(pl.beta_eps) if isinstance(pl, BetaGaussian) else None,
            "noise": pl.noise,
            "prior_precision": self.prior_precision,
            "bias": self.bias,
            "streaming": self.streaming,
            "num_data": self.num_data,
            "log_evidence": self._log_evidence,
        }
        if self.streaming:
            state.update(mean=self._mean, cov=self._cov)
        else:
            state.update(
                precision=self._precision,
                eta=self._eta,
                quad=self._quad,
                log_norm=self._log_norm,
            )
        return copy_state(state)

    def _state_schema(self) -> dict[str, Any]:
        d, k, dt = self.num_features, self.num_outputs, self.dtype
        schema: dict[str, Any] = {
            "task": Maybe(Choice((self.task,), "the task of this layer")),
            "method": Choice(METHODS),
            "basis": Choice((self.pseudo_likelihood.basis,), "the basis of this layer"),
            "alpha_eps": Number(),
            "beta_eps": Maybe(Number(), none=True),
            "noise": Number(positive=False),
            "prior_precision": Number(),
            "bias": Flag(self.bias, "this layer's bias setting"),
            "streaming": Flag(self.streaming, "this layer's streaming setting"),
            "num_data": Integer(0),
            "log_evidence": TensorSpec((), dt),
        }
        if self.streaming:
            schema.update(mean=TensorSpec((d, k), dt), cov=TensorSpec((k, d, d), dt))
        else:
            schema.update(
                precision=TensorSpec((k, d, d), dt),
                eta=TensorSpec((d, k), dt),
                quad=TensorSpec((k,), dt),
                log_norm=TensorSpec((k,), dt),
            )
        return schema

    @transactional
    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Restore :meth:`state_dict` into a layer of the same shape and mode; the whole state
        is validated first (:mod:`gaussify.state`) and a failed load changes nothing.
        ``strict`` is accepted for the posterior protocol: a layer on features holds no
        network weights to compare, so the state is always checked in full."""
        valid = validate_state(state, self._state_schema(), owner="ExactLastLayer")
        self.pseudo_likelihood = _make_pseudo_likelihood(
            valid["method"], valid["basis"], valid["alpha_eps"], valid["beta_eps"], valid["noise"]
        )
        self.prior_precision = valid["prior_precision"]
        self.num_data = valid["num_data"]
        here = {k: v.clone().to(self.device) for k, v in valid.items() if isinstance(v, Tensor)}
        self._log_evidence = here["log_evidence"]
        if self.streaming:
            self._mean, self._cov = here["mean"], here["cov"]
        else:
            self._precision, self._eta = here["precision"], here["eta"]
            self._quad, self._log_norm = here["quad"], here["log_norm"]
            self._solved = None


def _make_pseudo_likelihood(
    method: str, basis: str, alpha_eps: float, beta_eps: float | None, noise: float
) -> DirichletGaussian | BetaGaussian:
    return pseudo_likelihood(method, basis, alpha_eps, beta_eps=beta_eps, noise=noise)  # type: ignore[arg-type]
