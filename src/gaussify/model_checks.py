"""The user's model at the library's boundary: its train/eval mode and its output layer.

* :func:`eval_mode` / :func:`in_eval_mode`: curvature, Jacobians and predictives need the
  network in evaluation mode (dropout off, batch norm on its running statistics), but the
  model belongs to the user. Every module's ``training`` flag is recorded, the model is put
  in eval mode, and each flag is restored afterwards -- also when the body raises -- so a
  model in train mode with a frozen (eval) submodule comes back exactly so. Inside the block
  PyTorch's fused attention fast paths are off (:func:`gaussify.fastpath.autodiff_safe`), so
  every family's Jacobian, curvature and predictive passes work on transformers.
* :func:`warn_if_squashed_output`: the classification and binary likelihoods apply softmax /
  sigmoid to the model's outputs (logits). A model whose last module is already
  ``nn.Softmax`` / ``nn.LogSoftmax`` / ``nn.Sigmoid`` / ``nn.LogSigmoid`` hands them
  probabilities (or log-probabilities): the fit is of a different model and the predictive
  is squashed (a :class:`gaussify.warnings.SquashedOutputWarning`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from torch import nn

from gaussify.fastpath import autodiff_safe
from gaussify.warnings import SquashedOutputWarning

__all__ = ["eval_mode", "in_eval_mode", "last_module", "warn_if_squashed_output"]

F = TypeVar("F", bound=Callable[..., Any])

#: Modules that squash logits into probabilities (or log-probabilities).
SQUASHING = (nn.Softmax, nn.LogSoftmax, nn.Sigmoid, nn.LogSigmoid, nn.Softmin)


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Put ``model`` in eval mode inside the block; restore every submodule's own
    ``training`` flag on exit (also on an exception). PyTorch's fused attention fast paths
    are off inside the block (:func:`gaussify.fastpath.autodiff_safe`, warning once per model
    that holds one)."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with autodiff_safe(model):
            yield model
    finally:
        for module, training in flags:
            module.training = training


def in_eval_mode(function: F) -> F:
    """Decorator: ``function`` runs under :func:`eval_mode` of its network -- its first
    argument (or ``model=``) when that is an ``nn.Module``, else the ``model`` attribute of
    its first argument (a method of an object holding the network as ``self.model``)."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else kwargs.get("model")
        model = first if isinstance(first, nn.Module) else getattr(first, "model", None)
        if not isinstance(model, nn.Module):
            return function(*args, **kwargs)
        with eval_mode(model):
            return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


#: Modules that do not change the values of their input (skipped when looking for the last).
TRANSPARENT = (nn.Identity, nn.Flatten, nn.Unflatten, nn.Dropout, nn.AlphaDropout)


def last_module(model: nn.Module) -> nn.Module:
    """The last leaf module of ``model`` in registration order (for ``nn.Sequential``, the
    last layer applied), descending through containers and skipping trailing modules that
    leave values unchanged (identity, flatten, dropout)."""
    leaves = [m for m in model.modules() if next(m.children(), None) is None]
    while len(leaves) > 1 and isinstance(leaves[-1], TRANSPARENT):
        leaves.pop()
    return leaves[-1] if leaves else model


def warn_if_squashed_output(model: nn.Module, task: str, *, stacklevel: int = 3) -> None:
    """Warn (:class:`SquashedOutputWarning`) when a ``"classification"`` or ``"binary"``
    likelihood is given a model whose last module squashes its outputs (module docstring)."""
    if task not in ("classification", "binary") or not isinstance(model, nn.Module):
        return
    last = last_module(model)
    if not isinstance(last, SQUASHING):
        return
    link = "softmax" if task == "classification" else "sigmoid"
    warnings.warn(
        f"model: its last module is nn.{type(last).__name__}, but the {task!r} likelihood "
        f"applies the {link} itself to the model's outputs, which must be logits; the fit and "
        "the predictive then treat probabilities as logits and the predictive probabilities "
        f"are squashed towards uniform. Remove the final nn.{type(last).__name__}.",
        SquashedOutputWarning,
        stacklevel=stacklevel,
    )
