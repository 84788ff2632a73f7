"""Gaussian pseudo-targets for class labels (Bui, Sec. 3.2 and 3.3).

A label is turned into Gaussian "observations" of the logits:

* log basis, softmax (Sec. 3.2): the one-hot count ``c`` and a Dirichlet prior ``Dir(alpha_eps)``
  give the posterior ``Dir(alpha_eps + c)``, built from independent
  ``omega_k ~ Gamma(alpha_eps + c_k, 1)``; a Gaussian approximation of ``log omega_k`` is the
  pseudo-likelihood ``N(f_k; m_k, v_k)`` of logit k (:class:`DirichletGaussian`);
* logit basis, sigmoid (Sec. 3.3): a Beta prior ``Beta(alpha_eps, beta_eps)`` on the positive
  class probability gives ``Beta(alpha_eps + y, beta_eps + 1 - y)``, and a Gaussian
  approximation of its logit is ``N(f; m, v)`` for the single logit (:class:`BetaGaussian`);
* ``gauss``: regression on the one-hot label (or, for one binary logit, the -1/+1 label) with a
  fixed noise variance.

The approximations themselves are the pure functions of
:mod:`gaussify.approx_likelihoods.closed_forms`; these classes only hold the hyperparameters,
validate the labels and gather per-label values (two distinct ones per class).
"""

from __future__ import annotations

import math
from typing import Literal, TypeAlias

import torch
from torch import Tensor

from gaussify.approx_likelihoods.closed_forms import APPROXIMATIONS
from gaussify.validation import check_finite

__all__ = [
    "METHODS",
    "SUPPORTED_BASES",
    "Basis",
    "BetaGaussian",
    "DirichletGaussian",
    "Method",
    "PseudoLikelihood",
    "check_labels",
    "pseudo_likelihood",
]

Method = Literal["laplace", "variational", "moment", "moment-ori", "gauss"]
Basis = Literal["log", "logit"]
METHODS: tuple[str, ...] = ("laplace", "variational", "moment", "moment-ori", "gauss")
SUPPORTED_BASES: dict[str, tuple[str, ...]] = {
    "laplace": ("log", "logit"),
    "variational": ("log", "logit"),
    "moment": ("log", "logit"),
    "moment-ori": ("log",),  # a log-normal in the original basis; no logit-basis analogue
    "gauss": ("log", "logit"),
}
Scalar: TypeAlias = "float | Tensor"


def _check_method_basis(method: str, basis: str) -> None:
    if method not in SUPPORTED_BASES:
        raise ValueError(f"method: expected one of {list(METHODS)}, got {method!r}")
    if basis not in ("log", "logit"):
        raise ValueError(f"basis: expected 'log' or 'logit', got {basis!r}")
    if basis not in SUPPORTED_BASES[method]:
        raise ValueError(
            f"basis: method {method!r} supports {list(SUPPORTED_BASES[method])}, got {basis!r}"
        )


def _check_positive(value: Scalar, name: str) -> Scalar:
    """A positive finite float, or a floating tensor of them (kept for autograd)."""
    if isinstance(value, Tensor):
        if not value.is_floating_point():
            value = value.to(torch.get_default_dtype())
        bad = (value <= 0) | ~torch.isfinite(value)
        if bool(bad.any()):
            raise ValueError(f"{name}: must be positive and finite, got {value.detach()}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a positive float or tensor, got {type(value).__name__}")
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name}: must be positive and finite, got {value}")
    return float(value)


def check_labels(y: Tensor, num_classes: int, name: str = "y") -> Tensor:
    """Integer labels in ``[0, num_classes)`` of any shape, returned as int64."""
    if not isinstance(y, Tensor):
        raise TypeError(f"{name}: expected an integer tensor of labels, got {type(y).__name__}")
    if y.is_floating_point() and y.ndim > 0:
        check_finite(y, name)  # a NaN / inf label is named as such, with its row
    if y.is_floating_point() or y.is_complex():
        raise TypeError(f"{name}: expected integer class labels, got dtype {y.dtype}")
    y = y.long()
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise ValueError(
            f"{name}: labels must be in [0, {num_classes}), got range "
            f"[{int(y.min())}, {int(y.max())}]"
        )
    return y


def _as_float_tensor(value: Scalar, dtype: torch.dtype, device: torch.device | None) -> Tensor:
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=dtype)
    return torch.tensor(value, dtype=dtype, device=device)


class PseudoLikelihood:
    """Shared state of :class:`DirichletGaussian` and :class:`BetaGaussian`."""

    basis: str
    task: str
    distribution: str

    def __init__(self, method: str, basis: str, alpha_eps: Scalar, noise: float) -> None:
        _check_method_basis(method, basis)
        if basis != self.basis:
            other = "BetaGaussian" if self.basis == "log" else "DirichletGaussian"
            raise ValueError(
                f"basis: {type(self).__name__} works in the {self.basis!r} basis, got "
                f"{basis!r}; use {other} (or pseudo_likelihood(method, basis=...))"
            )
        self.method = method
        self.alpha_eps = _check_positive(alpha_eps, "alpha_eps")
        self.noise = float(_check_positive(noise, "noise"))
        self._cache: dict[tuple, tuple[Tensor, ...]] = {}

    def _values(self, dtype: torch.dtype, device: torch.device | None) -> tuple[Tensor, ...]:
        """(mean, var) for a negative and a positive label, each broadcastable to the output."""
        cacheable = not any(isinstance(v, Tensor) for v in self._hyper())
        key = (dtype, device)
        if cacheable and key in self._cache:
            return self._cache[key]
        # Computed in float64 (the Beta variational solver and the polygammas need the digits),
        # then cast; the cast is differentiable for tensor hyperparameters.
        out = tuple(v.to(dtype) for v in self._compute(torch.float64, device))
        if cacheable:
            self._cache[key] = out
        return out

    def _hyper(self) -> tuple[Scalar, ...]:
        return (self.alpha_eps,)

    def _compute(self, dtype: torch.dtype, device: torch.device | None) -> tuple[Tensor, ...]:
        raise NotImplementedError

    def _dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        for value in self._hyper():
            if isinstance(value, Tensor):
                return value.dtype
        return dtype or torch.get_default_dtype()

    def _gather(self, hot: Tensor, dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
        if self.method == "gauss":
            dt = dtype or torch.get_default_dtype()
            mean = hot.to(dt)
            if self.task == "binary":
                # one logit read through sigmoid(f) > 1/2, i.e. sign(f): regress on -1 / +1
                # so the least-squares decision boundary sits at f = 0 (0/1 targets put it at
                # f = 1/2 and misclassify)
                mean = 2.0 * mean - 1.0
            return mean, torch.full_like(mean, self.noise)
        mean_off, mean_on, var_off, var_on = self._values(self._dtype(dtype), hot.device)
        return torch.where(hot, mean_on, mean_off), torch.where(hot, var_on, var_off)

    def __repr__(self) -> str:
        hyper = ", ".join(f"{v}" for v in self._hyper())
        return f"{type(self).__name__}(method={self.method!r}, hyper=({hyper}))"


class DirichletGaussian(PseudoLikelihood):
    """Gaussian approximation of the softmax likelihood in the log basis (Sec. 3.2).

    ``method``: ``laplace`` | ``variational`` | ``moment`` | ``moment-ori`` | ``gauss``;
    ``alpha_eps``: Dirichlet pseudo-count (float, or a tensor broadcastable to ``(C,)`` that may
    require grad); ``noise``: the fixed variance of ``gauss``. For label ``y`` the logit ``f_k``
    gets ``N(m_k, v_k)`` from ``Gamma(alpha_eps + [k = y], 1)`` in the log basis.
    """

    basis = "log"
    task = "classification"
    distribution = "gamma"

    def __init__(
        self,
        method: Method = "moment",
        basis: Basis = "log",
        alpha_eps: Scalar = 0.1,
        noise: float = 0.1,
    ) -> None:
        super().__init__(method, basis, alpha_eps, noise)

    def num_outputs(self, num_classes: int) -> int:
        """Number of logits the model outputs for ``num_classes`` classes (C)."""
        return num_classes

    def _compute(self, dtype: torch.dtype, device: torch.device | None) -> tuple[Tensor, ...]:
        alpha = _as_float_tensor(self.alpha_eps, dtype, device)
        approx = APPROXIMATIONS[("gamma", self.method)]
        mean_off, var_off = approx(alpha, 1.0)
        mean_on, var_on = approx(alpha + 1.0, 1.0)
        return mean_off, mean_on, var_off, var_on

    def pseudo_targets(
        self, y: Tensor, num_classes: int, dtype: torch.dtype | None = None
    ) -> tuple[Tensor, Tensor]:
        """Pseudo-targets ``(mean (..., C), var (..., C))`` in logit space for labels
        ``y (...)``; the Gaussian log-likelihood ``sum_k log N(f_k; mean_k, var_k)`` replaces
        ``log softmax(f)_y`` (eq. 3-4)."""
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes: must be an integer >= 2, got {num_classes}")
        y = check_labels(y, num_classes)
        hot = torch.nn.functional.one_hot(y, num_classes).bool()
        return self._gather(hot, dtype)

    def inverse_link(self, f: Tensor) -> Tensor:
        """Class probabilities from logits (N, C): ``softmax(f)`` (Sec. 3.2)."""
        return torch.softmax(f, dim=-1)

    def replace(self, **changes: object) -> DirichletGaussian:
        """A copy with some of ``method``, ``alpha_eps``, ``noise`` changed."""
        kwargs: dict = {"method": self.method, "alpha_eps": self.alpha_eps, "noise": self.noise}
        kwargs.update(changes)
        return DirichletGaussian(**kwargs)


class BetaGaussian(PseudoLikelihood):
    """Gaussian approximation of the logistic (sigmoid) likelihood in the logit basis
    (Sec. 3.3): label ``y in {0, 1}`` gives ``Beta(alpha_eps + y, beta_eps + 1 - y)`` and its
    logit is approximated by ``N(m, v)`` for the single logit of the model.

    ``method``: ``laplace`` | ``variational`` (numerical, App. A.2) | ``moment`` | ``gauss``;
    ``beta_eps`` defaults to ``alpha_eps`` (the paper's choice, App. C.1.3).
    """

    basis = "logit"
    task = "binary"
    distribution = "beta"

    def __init__(
        self, method: Method = "moment", basis: Basis = "logit", alpha_eps: Scalar = 0.1,
        beta_eps: Scalar | None = None, noise: float = 0.1,
    ) -> None:  # fmt: skip
        super().__init__(method, basis, alpha_eps, noise)
        tied = beta_eps is None
        self.beta_eps = self.alpha_eps if tied else _check_positive(beta_eps, "beta_eps")
        self._tied = beta_eps is None

    def _hyper(self) -> tuple[Scalar, ...]:
        return (self.alpha_eps, self.beta_eps)

    def num_outputs(self, num_classes: int = 2) -> int:
        """One logit for the two classes."""
        if num_classes != 2:
            raise ValueError(f"num_classes: BetaGaussian is binary (2 classes), got {num_classes}")
        return 1

    def _compute(self, dtype: torch.dtype, device: torch.device | None) -> tuple[Tensor, ...]:
        a = _as_float_tensor(self.alpha_eps, dtype, device)
        b = _as_float_tensor(self.beta_eps, dtype, device)
        a, b = torch.broadcast_tensors(a, b)
        # Row 0: label 0 -> Beta(a, b + 1); row 1: label 1 -> Beta(a + 1, b).
        mean, var = APPROXIMATIONS[("beta", self.method)](
            torch.stack([a, a + 1.0]), torch.stack([b + 1.0, b])
        )
        return mean[0], mean[1], var[0], var[1]

    def pseudo_targets(
        self, y: Tensor, num_classes: int = 2, dtype: torch.dtype | None = None
    ) -> tuple[Tensor, Tensor]:
        """Pseudo-targets ``(mean (..., 1), var (..., 1))`` for the single logit, from labels
        ``y (...)`` or ``(..., 1)`` in {0, 1}."""
        self.num_outputs(num_classes)
        y = check_labels(y, 2)
        if y.ndim >= 2 and y.shape[-1] == 1:
            y = y.squeeze(-1)
        return self._gather(y.bool().unsqueeze(-1), dtype)

    def inverse_link(self, f: Tensor) -> Tensor:
        """Probability of the positive class from the logit: ``sigmoid(f)`` (Sec. 3.3)."""
        return torch.sigmoid(f)

    def replace(self, **changes: object) -> BetaGaussian:
        """A copy with some of ``method``, ``alpha_eps``, ``beta_eps``, ``noise`` changed
        (a tied ``beta_eps`` follows a new ``alpha_eps``)."""
        kwargs: dict = {"method": self.method, "alpha_eps": self.alpha_eps, "noise": self.noise}
        if not self._tied:
            kwargs["beta_eps"] = self.beta_eps
        kwargs.update(changes)
        return BetaGaussian(**kwargs)


def pseudo_likelihood(
    method: Method = "moment",
    basis: Basis = "log",
    alpha_eps: Scalar = 0.1,
    *,
    beta_eps: Scalar | None = None,
    noise: float = 0.1,
) -> DirichletGaussian | BetaGaussian:
    """The pseudo-likelihood for ``basis``: :class:`DirichletGaussian` (``"log"``, softmax) or
    :class:`BetaGaussian` (``"logit"``, sigmoid)."""
    _check_method_basis(method, basis)
    if basis == "log":
        if beta_eps is not None:
            raise ValueError("beta_eps: only used in the logit basis (Beta prior)")
        return DirichletGaussian(method, basis, alpha_eps, noise)
    return BetaGaussian(method, basis, alpha_eps, beta_eps, noise)
