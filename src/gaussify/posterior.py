"""The posterior protocol every family of gaussify implements.

A posterior family approximates p(theta | D) (or p(f | D)) for a network (or features) by a
Gaussian q and answers the same seven questions. :class:`Posterior` states them; the
conformance suite ``tests/test_posterior_conformance.py`` checks every family against it
(refusal before ``fit``, shapes and dtypes, determinism under a seed, bit-identical state
round trips, finite evidence, tuning that does not lower the evidence).

* ``fit(data, **options) -> self``: condition q on ``data`` (a DataLoader or an ``(x, y)``
  pair): Laplace accumulates G = sum_n J_n^T Lambda_n J_n at theta* and sets
  q = N(theta*, (G / T + P0)^-1); the variational families maximise an ELBO
  E_q[log p(D | theta)] - KL(q || p); the exact / streaming last layers update the
  conjugate posterior of the output layer's weights batch by batch.
* ``predict(x, **options) -> Predictive``: the posterior predictive p(y* | x*, D) =
  int p(y* | f) q(f | x*) df through the family's pushforward of q to the outputs (the
  linearised network, q(f*) = N(f(x*; theta*) + J* (mu - theta*), J* Sigma J*^T), a GP or
  network samples) and a link approximation for classification.
* ``sample(num_samples, generator) -> Tensor``: draws theta_s ~ q(theta), (S, P) in the
  family's flattening order; the same ``generator`` state gives the same draws.
* ``log_marginal_likelihood() -> Tensor``: the family's estimate of log p(D | hyperparameters)
  (Laplace: log p(D | theta*) + log p(theta*) + P/2 log 2 pi - 1/2 log det A, thesis
  eq. 3.17), a scalar, differentiable in the hyperparameters where the family allows.
* ``optimize_prior(data=None, **options) -> self``: type-II maximum likelihood,
  argmax_{P0 (, sigma)} log p(D | P0, sigma); the evidence does not decrease.
* ``state_dict() -> dict`` / ``load_state_dict(state, *, strict=True)``: tensors and plain
  values that restore the fitted posterior bit for bit into a fresh object over the same
  model; a load is validated as a whole first (:mod:`gaussify.state`).

Where a method makes no mathematical sense for a family (a VI family optimises an ELBO, not
the evidence; a GP has no weights to sample), the family lists it in its class attribute
``unsupported`` (method -> why, and what to use instead) and derives from
:class:`DeclaredCapabilities`, which supplies that method as one raising
``NotImplementedError`` with the reason: a stated gap, never a silent one.
:func:`capabilities` lists what a posterior supports.

Heads that are *trained* with the network rather than fitted after it (the VBLL heads, an
``nn.Module`` whose ``train_loss`` is part of the training objective) implement the smaller
:class:`TrainedPosterior`: ``predict``, ``sample``, ``train_loss`` and the module's
``state_dict`` / ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, Protocol, runtime_checkable

import torch
from torch import Tensor

if TYPE_CHECKING:
    from gaussify.predictive import Predictive

__all__ = [
    "METHODS",
    "DeclaredCapabilities",
    "Posterior",
    "TrainedPosterior",
    "capabilities",
    "unsupported",
]

#: the methods of :class:`Posterior`, in the order of the module docstring
METHODS = (
    "fit",
    "predict",
    "sample",
    "log_marginal_likelihood",
    "optimize_prior",
    "state_dict",
    "load_state_dict",
)


@runtime_checkable
class Posterior(Protocol):
    """A Gaussian posterior family: fit / predict / sample / evidence / tuning / state.

    Families differ in their options (keyword arguments after the first argument), not in
    these meanings; see the module docstring for the math of each method."""

    def fit(self, data: Any, /, *args: Any, **options: Any) -> Any:
        """Condition on ``data`` (DataLoader or ``(x, y)``); returns the posterior."""
        ...

    def predict(self, x: Tensor, /, *args: Any, **options: Any) -> Predictive:
        """Posterior predictive at inputs (or features) ``x (N, ...)``."""
        ...

    def sample(self, num_samples: int = ..., generator: torch.Generator | None = ...) -> Tensor:
        """``num_samples`` draws theta_s ~ q(theta), (S, P)."""
        ...

    def log_marginal_likelihood(self, *args: Any, **options: Any) -> Tensor:
        """log p(D | hyperparameters) as the family estimates it, a scalar."""
        ...

    def optimize_prior(self, data: Any = ..., /, *args: Any, **options: Any) -> Any:
        """Type-II maximum likelihood of the prior (and noise); returns the posterior."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values that restore the fitted posterior."""
        ...

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> Any:
        """Restore a :meth:`state_dict` (validated as a whole first)."""
        ...


@runtime_checkable
class TrainedPosterior(Protocol):
    """A posterior trained jointly with the network (a VBLL head): no ``fit`` after training,
    no evidence to tune (its ELBO is the training loss)."""

    def predict(self, x: Tensor, /) -> Predictive:
        """Posterior predictive at features ``x (N, D)``."""
        ...

    def sample(self, num_samples: int = ..., generator: torch.Generator | None = ...) -> Tensor:
        """Draws of the last layer's weights W_s ~ q(W)."""
        ...

    def train_loss(self, x: Tensor, y: Tensor, /) -> Tensor:
        """Negative regularised ELBO per example: the loss to train the head with."""
        ...

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The head's parameters (``nn.Module.state_dict``)."""
        ...

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Restore the head's parameters (validated as a whole first)."""
        ...


def unsupported(owner: str, method: str, reason: str) -> NoReturn:
    """Raise the ``NotImplementedError`` of a method that makes no sense for ``owner``."""
    raise NotImplementedError(f"{owner}.{method}: not supported: {reason}")


class DeclaredCapabilities:
    """Base of the families that cannot answer every method of :class:`Posterior`.

    A subclass lists those methods in ``unsupported`` (method name -> why it makes no
    mathematical sense and what to use instead); each gets an implementation that raises
    ``NotImplementedError("<Class>.<method>: not supported: <reason>")``. A listed method that
    the class also defines, or a name outside :data:`METHODS`, is an error at class creation.
    """

    unsupported: ClassVar[Mapping[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for method, reason in cls.__dict__.get("unsupported", {}).items():
            if method not in METHODS:
                raise TypeError(f"{cls.__name__}.unsupported: {method!r} is not in {METHODS}")
            if method in cls.__dict__:
                raise TypeError(
                    f"{cls.__name__}.unsupported: {method!r} is declared unsupported but defined"
                )
            setattr(cls, method, _refusal(cls.__name__, method, reason))


def _refusal(owner: str, method: str, reason: str) -> Any:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        unsupported(type(self).__name__, method, reason)  # the subclass the user holds

    refuse.__name__ = method
    refuse.__qualname__ = f"{owner}.{method}"
    refuse.__doc__ = f"Not supported: {reason}"
    refuse.unsupported_reason = reason  # type: ignore[attr-defined]
    return refuse


def capabilities(posterior: Any) -> frozenset[str]:
    """The methods of :data:`METHODS` that ``posterior`` (an object or class) answers."""
    cls = posterior if isinstance(posterior, type) else type(posterior)
    return frozenset(
        m for m in METHODS if hasattr(cls, m) and not hasattr(getattr(cls, m), "unsupported_reason")
    )
