"""Likelihoods p(y | f) over network outputs f (N, C).

Every likelihood exposes the quantities the Gauss-Newton family needs (Immer thesis, Sec. 2.3):

* ``log_prob(f, y) -> (N,)``: log p(y_n | f_n), summed over the C outputs of one sample.
* ``residual(f, y) -> (N, C)``: r = d log p / d f (the "residual" of the GLM view, thesis eq. 3.3).
* ``hessian(f) -> (N, C, C)``: Lambda = -d^2 log p / d f^2, the GGN's middle factor
  (J^T Lambda J, thesis eq. 2.24). It does not depend on y for these exponential-family
  likelihoods in their natural parameterisation.
* ``hessian_diag(f) -> (N, C)``: the diagonal of Lambda, cheap.
* ``hessian_sqrt(f) -> (N, C, C)``: a factor L with Lambda = L L^T, so that a GGN is
  (J^T L)(J^T L)^T without forming Lambda (used by Kronecker and low-rank curvature).
* ``inverse_link(f)``: E[y | f] (identity, softmax or sigmoid).
* ``sample(f, generator=None)``: y ~ p(y | f).

Users may plug in their own object with the same methods (see :class:`Likelihood`).
"""

from __future__ import annotations

import math
from typing import Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

from gaussify import draws
from gaussify.deferred_checks import check, check_finite, check_range, deferring

__all__ = [
    "Bernoulli",
    "Categorical",
    "Gaussian",
    "HeteroscedasticGaussian",
    "Likelihood",
    "LikelihoodName",
    "all_finite",
    "check_sigma_noise",
    "get_likelihood",
]

LikelihoodName = Literal[
    "regression",
    "gaussian",
    "classification",
    "categorical",
    "binary",
    "bernoulli",
    "heteroscedastic",
]


@runtime_checkable
class Likelihood(Protocol):
    """What the rest of the library needs from a likelihood over outputs f (N, C)."""

    task: str

    def log_prob(self, f: Tensor, y: Tensor) -> Tensor: ...

    def residual(self, f: Tensor, y: Tensor) -> Tensor: ...

    def hessian(self, f: Tensor) -> Tensor: ...

    def hessian_diag(self, f: Tensor) -> Tensor: ...

    def hessian_sqrt(self, f: Tensor) -> Tensor: ...

    def inverse_link(self, f: Tensor) -> Tensor: ...

    def sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor: ...


def all_finite(t: Tensor) -> bool:
    """Whether every entry of ``t`` is finite, from one min/max reduction: NaN propagates
    into both and +-inf reaches one of them, so no per-entry mask (a bool tensor and an |t|
    copy, as ``torch.isfinite(t).all()`` makes) is formed; that matters in the curvature
    loops, where ``t`` is P- or (batch x classes)-sized."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    lo, hi = torch.aminmax(t.detach())
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _check_f(f: Tensor, defer: bool = True) -> Tensor:
    """Validate network outputs: a finite floating tensor of shape (N, C). The finiteness
    test is recorded instead of made inside a fit's :func:`deferred_checks` scope (one host
    sync per fit); ``defer=False`` tests at once (where NaN outputs would make a later
    operation fail with a less clear error, e.g. sampling labels)."""
    if not isinstance(f, Tensor):
        raise TypeError(f"f: expected a torch.Tensor of shape (N, C), got {type(f).__name__}")
    if f.ndim != 2:
        raise ValueError(f"f: expected shape (N, C), got {tuple(f.shape)}")
    if not f.is_floating_point():
        raise ValueError(f"f: expected a floating-point tensor, got dtype {f.dtype}")
    if defer:
        check_finite(f, "f: network outputs contain NaN or inf")
    elif not all_finite(f):
        raise ValueError("f: network outputs contain NaN or inf")
    return f


def _check_batch(f: Tensor, y: Tensor) -> None:
    if not isinstance(y, Tensor):
        raise TypeError(f"y: expected a torch.Tensor, got {type(y).__name__}")
    if y.shape[0] != f.shape[0]:
        raise ValueError(f"y: batch size {y.shape[0]} does not match f's batch size {f.shape[0]}")


def _as_output_matrix(f: Tensor, y: Tensor, what: str) -> Tensor:
    """Targets with one value per output: (N, C); (N,) is accepted when C == 1."""
    _check_batch(f, y)
    if y.ndim == 1 and f.shape[1] == 1:
        y = y.unsqueeze(-1)
    if y.shape != f.shape:
        raise ValueError(
            f"y: {what} targets must have shape {tuple(f.shape)} (same as f), got {tuple(y.shape)}"
        )
    if y.is_floating_point():
        check(~torch.isnan(y).any(), "y: targets contain NaN")
    return y.to(f.dtype)


class Gaussian:
    """Gaussian likelihood y = f + eps, eps ~ N(0, diag(sigma^2)).

    ``sigma_noise`` is a scalar or a per-output tensor of shape (C,); it may be a tensor that
    requires grad (marginal-likelihood tuning differentiates through it).
    Lambda = diag(1 / sigma^2) (thesis eq. 2.25).
    """

    task = "regression"

    def __init__(self, sigma_noise: float | Tensor = 1.0) -> None:
        # Python numbers are kept in float64 so a float64 model sees the exact value.
        sigma = (
            sigma_noise
            if isinstance(sigma_noise, Tensor)
            else torch.as_tensor(sigma_noise, dtype=torch.float64)
        )
        self.sigma_noise = check_sigma_noise(sigma, "regression")

    def _sigma(self, f: Tensor) -> Tensor:
        sigma = self.sigma_noise.to(dtype=f.dtype, device=f.device)
        if sigma.ndim == 1 and sigma.shape[0] != f.shape[1]:
            raise ValueError(
                f"sigma_noise: has {sigma.shape[0]} entries but f has {f.shape[1]} outputs"
            )
        return sigma.expand(f.shape[1])

    def log_prob(self, f: Tensor, y: Tensor) -> Tensor:
        """log N(y | f, sigma^2) summed over outputs, shape (N,)."""
        f = _check_f(f)
        y = _as_output_matrix(f, y, "regression")
        sigma = self._sigma(f)
        z = (y - f) / sigma
        return (-0.5 * z.square() - sigma.log() - 0.5 * math.log(2 * math.pi)).sum(-1)

    def residual(self, f: Tensor, y: Tensor) -> Tensor:
        """(y - f) / sigma^2, shape (N, C)."""
        f = _check_f(f)
        y = _as_output_matrix(f, y, "regression")
        return (y - f) / self._sigma(f).square()

    def hessian_diag(self, f: Tensor) -> Tensor:
        f = _check_f(f)
        return (1.0 / self._sigma(f).square()).expand_as(f).clone()

    def hessian(self, f: Tensor) -> Tensor:
        return torch.diag_embed(self.hessian_diag(f))

    def hessian_sqrt(self, f: Tensor) -> Tensor:
        return torch.diag_embed(self.hessian_diag(f).sqrt())

    def inverse_link(self, f: Tensor) -> Tensor:
        return _check_f(f)

    def sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        f = _check_f(f)
        eps = draws.normal(f.shape, dtype=f.dtype, device=f.device, generator=generator)
        return f + self._sigma(f) * eps


class Categorical:
    """Softmax likelihood p(y = k | f) = softmax(f)_k for integer labels y (N,) in [0, C).

    Lambda = diag(p) - p p^T (thesis eq. 2.26), rank C-1, so it is singular; its factor
    L = diag(sqrt p) - p sqrt(p)^T satisfies L L^T = Lambda because sum(p) = 1.
    """

    task = "classification"

    def _labels(self, f: Tensor, y: Tensor) -> Tensor:
        """``y`` as int64 labels, checked integer-valued and in [0, C): on the device (no
        host sync) inside a fit's :func:`deferred_checks` scope, where the labels are then
        clamped into range so that the batch's remaining work runs until the scope raises."""
        _check_batch(f, y)
        if y.ndim != 1:
            raise ValueError(f"y: expected class labels of shape (N,), got {tuple(y.shape)}")
        if y.is_floating_point():
            check(~torch.isnan(y).any(), "y: labels contain NaN")
            check((y == y.round()).all(), "y: class labels must be integers")
        y = y.long()
        num_classes = f.shape[1]
        if not y.numel():
            return y
        lo, hi = torch.aminmax(y)

        def message(lo: int, hi: int) -> str:
            return f"y: labels must be in [0, {num_classes}), got range [{lo}, {hi}]"

        check_range(lo, hi, num_classes, message)
        return y.clamp(0, num_classes - 1) if deferring() else y

    def log_prob(self, f: Tensor, y: Tensor) -> Tensor:
        f = _check_f(f)
        y = self._labels(f, y)
        return torch.log_softmax(f, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)

    def residual(self, f: Tensor, y: Tensor) -> Tensor:
        """onehot(y) - softmax(f), shape (N, C)."""
        f = _check_f(f)
        y = self._labels(f, y)
        # one-hot by comparison: F.one_hot tests the label range on the host (two syncs)
        onehot = y.unsqueeze(-1) == torch.arange(f.shape[1], device=y.device)
        return onehot.to(f.dtype) - torch.softmax(f, dim=-1)

    def hessian(self, f: Tensor) -> Tensor:
        p = torch.softmax(_check_f(f), dim=-1)
        return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)

    def hessian_diag(self, f: Tensor) -> Tensor:
        p = torch.softmax(_check_f(f), dim=-1)
        return p - p.square()

    def hessian_sqrt(self, f: Tensor) -> Tensor:
        p = torch.softmax(_check_f(f), dim=-1)
        s = p.sqrt()
        # one (N, C, C) allocation: -p s^T, then + diag(s) in place
        out = torch.mul(p.unsqueeze(-1), s.unsqueeze(-2)).neg_()
        out.diagonal(dim1=-2, dim2=-1).add_(s)
        return out

    def inverse_link(self, f: Tensor) -> Tensor:
        return torch.softmax(_check_f(f), dim=-1)

    def sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        # a fit's draws read nothing: NaN outputs are reported by the deferred check (the
        # draw of a NaN row is some index, discarded with the failed fit)
        p = torch.softmax(_check_f(f), dim=-1)
        return draws.categorical(p, generator, validate=False)


class Bernoulli:
    """Independent sigmoid likelihoods per output (binary C = 1, or multi-label C > 1).

    Targets y (N, C) in {0, 1} ((N,) accepted for C = 1). Lambda = diag(p (1 - p)).
    """

    task = "binary"

    def _targets(self, f: Tensor, y: Tensor) -> Tensor:
        y = _as_output_matrix(f, y, "binary")
        check(((y == 0) | (y == 1)).all(), "y: binary targets must be 0 or 1")
        return y

    def log_prob(self, f: Tensor, y: Tensor) -> Tensor:
        f = _check_f(f)
        y = self._targets(f, y)
        # y f - log(1 + e^f), written with logsigmoid for stability at large |f|.
        logp = y * torch.nn.functional.logsigmoid(f) + (1 - y) * torch.nn.functional.logsigmoid(-f)
        return logp.sum(-1)

    def residual(self, f: Tensor, y: Tensor) -> Tensor:
        f = _check_f(f)
        return self._targets(f, y) - torch.sigmoid(f)

    def hessian_diag(self, f: Tensor) -> Tensor:
        p = torch.sigmoid(_check_f(f))
        return p * (1 - p)

    def hessian(self, f: Tensor) -> Tensor:
        return torch.diag_embed(self.hessian_diag(f))

    def hessian_sqrt(self, f: Tensor) -> Tensor:
        return torch.diag_embed(self.hessian_diag(f).sqrt())

    def inverse_link(self, f: Tensor) -> Tensor:
        return torch.sigmoid(_check_f(f))

    def sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return draws.bernoulli(torch.sigmoid(_check_f(f, defer=False)), generator)


class HeteroscedasticGaussian:
    """Gaussian with input-dependent noise: the network outputs f = [mu, s] (N, 2C) with
    mean mu (N, C) and log variance s = log sigma^2 (N, C); y (N, C).

    The negative Hessian of log p in (mu, s) depends on y and is not positive semi-definite,
    so ``hessian`` returns its expectation under p(y | f), the Fisher information
    Lambda = diag(1 / sigma^2, 1/2) (a Fisher-Gauss-Newton middle factor, as the GGN uses for
    any non-canonical parameterisation). ``residual`` is the exact gradient.
    """

    task = "heteroscedastic"

    @staticmethod
    def _split(f: Tensor) -> tuple[Tensor, Tensor]:
        f = _check_f(f)
        if f.shape[1] % 2:
            raise ValueError(
                f"f: heteroscedastic outputs are [mean, log variance] with an even number of "
                f"columns, got {f.shape[1]}"
            )
        c = f.shape[1] // 2
        return f[:, :c], f[:, c:]

    def _targets(self, f: Tensor, y: Tensor) -> Tensor:
        mean, _ = self._split(f)
        return _as_output_matrix(mean, y, "regression")

    def log_prob(self, f: Tensor, y: Tensor) -> Tensor:
        mean, log_var = self._split(f)
        y = self._targets(f, y)
        return (
            -0.5 * ((y - mean).square() * torch.exp(-log_var) + log_var + math.log(2 * math.pi))
        ).sum(-1)

    def residual(self, f: Tensor, y: Tensor) -> Tensor:
        """[(y - mu) / sigma^2, ((y - mu)^2 / sigma^2 - 1) / 2], shape (N, 2C)."""
        mean, log_var = self._split(f)
        y = self._targets(f, y)
        z2 = (y - mean).square() * torch.exp(-log_var)
        return torch.cat([(y - mean) * torch.exp(-log_var), 0.5 * (z2 - 1)], dim=-1)

    def hessian_diag(self, f: Tensor) -> Tensor:
        _, log_var = self._split(f)
        return torch.cat([torch.exp(-log_var), torch.full_like(log_var, 0.5)], dim=-1)

    def hessian(self, f: Tensor) -> Tensor:
        return torch.diag_embed(self.hessian_diag(f))

    def hessian_sqrt(self, f: Tensor) -> Tensor:
        return torch.diag_embed(self.hessian_diag(f).sqrt())

    def inverse_link(self, f: Tensor) -> Tensor:
        """The predictive mean mu (N, C)."""
        return self._split(f)[0]

    def sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        mean, log_var = self._split(f)
        eps = draws.normal(mean.shape, dtype=f.dtype, device=f.device, generator=generator)
        return mean + torch.exp(0.5 * log_var) * eps


_REGISTRY: dict[str, type] = {
    "regression": Gaussian,
    "gaussian": Gaussian,
    "classification": Categorical,
    "categorical": Categorical,
    "binary": Bernoulli,
    "bernoulli": Bernoulli,
    "heteroscedastic": HeteroscedasticGaussian,
}


def check_sigma_noise(
    sigma_noise: float | Tensor,
    task: str,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """``sigma_noise`` as a tensor (in ``dtype`` and on ``device`` if given): a scalar or one
    value per output (C,); a one-element (1,) tensor is the scalar it holds (so it broadcasts
    over any number of outputs). Every entry must be finite and > 0. Only a regression
    likelihood has observation noise: for any other ``task`` the noise would be ignored, so a
    value other than 1 raises instead."""
    sigma = torch.as_tensor(sigma_noise, dtype=dtype, device=device)
    if sigma.ndim > 1:
        raise ValueError(
            f"sigma_noise: expected a scalar or a (C,) tensor, got shape {tuple(sigma.shape)}"
        )
    if sigma.ndim == 1 and sigma.shape[0] == 1:
        sigma = sigma.reshape(())
    if not torch.isfinite(sigma.detach()).all() or (sigma.detach() <= 0).any():
        raise ValueError(f"sigma_noise: must be finite and > 0, got {sigma.detach()}")
    if task != "regression" and not bool((sigma.detach() == 1).all()):
        raise ValueError(
            f"sigma_noise: only a regression (Gaussian) likelihood has observation noise; a "
            f"{task!r} likelihood would ignore sigma_noise={sigma.detach().tolist()}, leave it "
            "at 1"
        )
    return sigma


def get_likelihood(likelihood: str | Likelihood, sigma_noise: float | Tensor = 1.0) -> Likelihood:
    """Resolve a likelihood name (laplace-torch's ``"regression"``/``"classification"`` work)
    or pass a likelihood object through unchanged. ``sigma_noise`` is checked against the
    likelihood's task (:func:`check_sigma_noise`: a value other than 1 for a likelihood
    without observation noise raises)."""
    if not isinstance(likelihood, str) and isinstance(likelihood, Likelihood):
        check_sigma_noise(sigma_noise, str(getattr(likelihood, "task", "")))
    if isinstance(likelihood, str):
        key = likelihood.lower()
        if key not in _REGISTRY:
            raise ValueError(
                f"likelihood: unknown name {likelihood!r}; choose one of {sorted(_REGISTRY)} "
                "or pass an object with log_prob/residual/hessian/inverse_link/sample"
            )
        cls = _REGISTRY[key]
        check_sigma_noise(sigma_noise, cls.task)
        return cls(sigma_noise) if cls is Gaussian else cls()
    if isinstance(likelihood, Likelihood):
        return likelihood
    raise TypeError(
        f"likelihood: expected a name in {sorted(_REGISTRY)} or a Likelihood object, "
        f"got {type(likelihood).__name__}"
    )
