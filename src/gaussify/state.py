"""Saved state and transactions: one mechanism below every posterior family.

Two promises, kept the same way by Laplace, FunctionalLaplace, ELLA, Sampled-LLA, VaLLA, the
NGVI family, the exact and ADF last layers and GPClassifier:

* **A load is validated, then atomic.** Each family describes its ``state_dict`` with a
  declarative *schema*: a dict key -> kind (:class:`TensorSpec` with a shape rule over named
  sizes, a dtype rule and finiteness; :class:`Choice`; :class:`Integer` >= a minimum;
  :class:`Number` > 0; :class:`Flag`; :class:`Names`; :class:`Nested` for a sub-state such as
  the curvature's). :func:`validate_state` checks the whole state against it -- missing and
  unknown keys, types, shapes (named sizes such as ``"N"`` must agree across keys), dtypes,
  NaN/inf, the task and structure the state was saved for -- and raises one
  :class:`StateError` (a ``ValueError``) naming every offending key and what was expected,
  before the object is touched. The assignment then runs inside a :func:`transaction`, so
  even a failure past validation leaves the object as it was.
* **The state belongs to the network it was saved from.** A posterior is only meaningful at
  the weights it was fitted at: ``theta_star`` (the expansion point) is compared with the
  model's current weights by :func:`check_weights`, and the weights outside the posterior's
  subset (a last-layer posterior's frozen body) by a per-tensor fingerprint
  (:func:`model_fingerprint`, :func:`check_fingerprint`). A mismatch beyond a relative
  tolerance of ``WEIGHT_RTOL`` raises by default; ``strict=False`` downgrades it to a
  :class:`StateWarning` (predictions then silently mix the saved posterior with other
  weights, which is why it is not the default).

Backward compatibility: states saved before the identity keys existed (``task``,
``model_fingerprint``) still load; their schemas mark these keys optional, the fingerprint
check is skipped and a :class:`StateWarning` says the task could not be verified.

**A fit is a transaction.** :func:`transactional` wraps a mutating method (``fit``,
``update``, ``refine``, ``optimize_prior``, ``load_state_dict``, ...): it snapshots the
object's attributes (containers copied, tensors by reference -- the families rebind their
statistics instead of mutating them in place, except the tensors named in ``clone``), the
states of the ``torch.Generator`` attributes and, with ``model=True``, the network's
parameters; if the method raises (a NaN batch, a generator that fails midway, a keyboard
interrupt), everything is put back before the exception propagates. This generalises what
``Laplace.fit`` did by hand (new statistics in a new object that replaces the old one only
at the end).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor, nn

__all__ = [
    "WEIGHT_RTOL",
    "Choice",
    "Flag",
    "Integer",
    "Maybe",
    "NameGroups",
    "Names",
    "Nested",
    "Number",
    "StateError",
    "StateWarning",
    "SubsetView",
    "TensorSpec",
    "check_fingerprint",
    "check_network",
    "check_weights",
    "copy_state",
    "identity",
    "identity_schema",
    "model_fingerprint",
    "require_task",
    "transaction",
    "transactional",
    "validate_module_state",
    "validate_own_state",
    "validate_posterior_state",
    "validate_state",
]

#: Relative tolerance of the saved-weights checks (float32 round-off of a save/load cycle is 0).
WEIGHT_RTOL = 1e-5


class StateError(ValueError, TypeError):
    """A state that cannot be loaded (wrong keys, task, structure, shapes, dtypes, values, or
    saved for other weights). A ``ValueError`` (and a ``TypeError`` for a state that is not a
    dict at all)."""


class StateWarning(UserWarning):
    """A state loaded although it could not be fully verified (``strict=False``, or a state
    saved by an older version without identity keys)."""


class _Problem(Exception):
    """One key's complaint, collected by :func:`validate_state`."""


# --------------------------------------------------------------------------- kinds
@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor entry. ``shape``: entries are an exact size (int), a named size (str, bound
    by its first use and required equal everywhere else in the state) or None (any); a final
    ``...`` allows any trailing dimensions; None: any shape. ``dtype``: a dtype, a tuple of
    dtypes, ``"float"`` (any floating dtype), ``"int"`` (any integer dtype) or None.
    ``finite``: refuse NaN/inf; ``positive`` / ``nonnegative``: the values' sign."""

    shape: tuple[Any, ...] | None = None
    dtype: torch.dtype | tuple[torch.dtype, ...] | str | None = "float"
    finite: bool = True
    positive: bool = False
    nonnegative: bool = False

    def check(self, value: Any, dims: dict[str, int]) -> Tensor:
        if not isinstance(value, Tensor):
            raise _Problem(f"expected a tensor, got {type(value).__name__}")
        self._check_dtype(value)
        if self.shape is not None:
            self._check_shape(value, dims)
        floating = value.is_floating_point() or value.is_complex()
        if floating and self.finite and not bool(torch.isfinite(value).all()):
            raise _Problem("contains NaN or inf")
        if self.positive and not bool((value > 0).all()):
            raise _Problem("expected values > 0")
        if self.nonnegative and not bool((value >= 0).all()):
            raise _Problem("expected values >= 0")
        return value.detach()

    def _check_dtype(self, value: Tensor) -> None:
        rule = self.dtype
        if rule is None:
            return
        if rule == "float":
            ok, want = value.is_floating_point(), "a floating-point dtype"
        elif rule == "int":
            ok = not value.is_floating_point() and not value.is_complex()
            ok = ok and value.dtype != torch.bool
            want = "an integer dtype"
        else:
            allowed = rule if isinstance(rule, tuple) else (rule,)
            ok = value.dtype in allowed
            want = " or ".join(str(d) for d in allowed)
        if not ok:
            raise _Problem(f"expected dtype {want}, got {value.dtype}")

    def _check_shape(self, value: Tensor, dims: dict[str, int]) -> None:
        assert self.shape is not None
        spec = list(self.shape)
        trailing = bool(spec) and spec[-1] is Ellipsis
        if trailing:
            spec = spec[:-1]
        shape = tuple(value.shape)
        if len(shape) < len(spec) or (not trailing and len(shape) != len(spec)):
            raise _Problem(f"expected shape {_show_shape(self.shape, dims)}, got {shape}")
        bound: dict[str, int] = {}
        for want, got in zip(spec, shape, strict=False):
            if isinstance(want, str):
                known = dims.get(want, bound.get(want))
                if known is None:
                    bound[want] = got
                elif known != got:
                    raise _Problem(f"expected shape {_show_shape(self.shape, dims)}, got {shape}")
            elif want is not None and want != got:
                raise _Problem(f"expected shape {_show_shape(self.shape, dims)}, got {shape}")
        dims.update(bound)


def _show_shape(shape: Sequence[Any], dims: Mapping[str, int]) -> str:
    parts = []
    for d in shape:
        if d is Ellipsis:
            parts.append("...")
        elif isinstance(d, str):
            parts.append(str(dims[d]) if d in dims else d)
        else:
            parts.append("any" if d is None else str(d))
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


@dataclasses.dataclass(frozen=True)
class Choice:
    """A plain value out of ``values`` (e.g. the task or structure the state must match);
    ``what`` explains it in the message."""

    values: tuple[Any, ...]
    what: str = ""

    def check(self, value: Any, dims: dict[str, int]) -> Any:
        if isinstance(value, Tensor) or value not in self.values:
            want = repr(self.values[0]) if len(self.values) == 1 else f"one of {self.values}"
            hint = f" ({self.what})" if self.what else ""
            raise _Problem(f"expected {want}{hint}, got {value!r}")
        return value


@dataclasses.dataclass(frozen=True)
class Integer:
    """A count: a Python int (or 0-dim integer tensor) >= ``minimum``; with ``dim`` the value
    also binds (or must equal) that named size."""

    minimum: int = 0
    dim: str | None = None

    def check(self, value: Any, dims: dict[str, int]) -> int:
        if isinstance(value, Tensor) and value.ndim == 0 and not value.is_floating_point():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Problem(f"expected an integer >= {self.minimum}, got {value!r}")
        if value < self.minimum:
            raise _Problem(f"expected an integer >= {self.minimum}, got {value}")
        if self.dim is not None:
            if self.dim in dims and dims[self.dim] != value:
                raise _Problem(f"expected {dims[self.dim]} (the size {self.dim}), got {value}")
            dims[self.dim] = value
        return value


@dataclasses.dataclass(frozen=True)
class Number:
    """A finite real number (Python or 0-dim tensor), > 0 when ``positive``."""

    positive: bool = True

    def check(self, value: Any, dims: dict[str, int]) -> float:
        if isinstance(value, Tensor) and value.numel() == 1 and value.is_floating_point():
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _Problem(f"expected a number, got {type(value).__name__}")
        if not math.isfinite(value) or (self.positive and value <= 0):
            raise _Problem(
                f"expected a finite number{' > 0' if self.positive else ''}, got {value}"
            )
        return float(value)


@dataclasses.dataclass(frozen=True)
class Flag:
    """A bool, optionally required to equal ``expected`` (a setting of the receiving object)."""

    expected: bool | None = None
    what: str = ""

    def check(self, value: Any, dims: dict[str, int]) -> bool:
        if not isinstance(value, bool):
            raise _Problem(f"expected True or False, got {value!r}")
        if self.expected is not None and value != self.expected:
            hint = f" ({self.what})" if self.what else ""
            raise _Problem(f"expected {self.expected}{hint}, got {value}")
        return value


@dataclasses.dataclass(frozen=True)
class Names:
    """A list of strings equal to ``expected`` (e.g. the parameter tensors of the subset)."""

    expected: tuple[str, ...]
    what: str = "the parameter tensors this posterior covers"

    def check(self, value: Any, dims: dict[str, int]) -> list[str]:
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise _Problem(f"expected a list of names, got {type(value).__name__}")
        if tuple(value) != self.expected:
            raise _Problem(
                f"saved for {len(value)} tensors {list(value)}; expected {list(self.expected)} "
                f"({self.what})"
            )
        return list(value)


@dataclasses.dataclass(frozen=True)
class NameGroups:
    """A list of lists of names, each out of ``allowed`` (e.g. groups of parameter tensors);
    binds the named size ``dim`` to the number of groups."""

    allowed: tuple[str, ...]
    dim: str | None = None

    def check(self, value: Any, dims: dict[str, int]) -> list[list[str]]:
        ok = isinstance(value, list | tuple) and all(
            isinstance(g, list | tuple) and all(n in self.allowed for n in g) for g in value
        )
        if not ok:
            raise _Problem(f"expected a list of lists of parameter names out of {self.allowed}")
        if self.dim is not None:
            Integer(0, self.dim).check(len(value), dims)
        return [list(g) for g in value]


@dataclasses.dataclass(frozen=True)
class Nested:
    """A sub-state (a dict) with its own schema; its keys are reported as ``outer.inner``."""

    schema: Mapping[str, Any]

    def check(self, value: Any, dims: dict[str, int]) -> dict[str, Any]:
        raise AssertionError("validated by validate_state")  # pragma: no cover


@dataclasses.dataclass(frozen=True)
class Maybe:
    """An optional entry: the key may be absent (or, with ``none``, None)."""

    kind: Any
    none: bool = False


# --------------------------------------------------------------------------- validation
def validate_state(
    state: Any,
    schema: Mapping[str, Any],
    *,
    owner: str = "Laplace",
    dims: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Check ``state`` against ``schema`` (key -> kind, see the module docstring) and return
    the validated entries (tensors detached; optional keys absent from the state absent
    from the result). ``dims``: named sizes known in advance (e.g. ``{"P": 1234}``).

    Raises :class:`StateError` listing every problem -- missing keys, unknown keys, and per
    key what was expected -- without touching anything."""
    if not isinstance(state, Mapping):
        raise StateError(
            f"{owner}.load_state_dict: state: expected a dict from {owner}.state_dict(), got "
            f"{type(state).__name__}"
        )
    problems: list[str] = []
    out = _validate(state, schema, dict(dims or {}), "", problems)
    if problems:
        raise StateError(f"{owner}.load_state_dict: invalid state: " + "; ".join(problems))
    return out


def _validate(
    state: Mapping[str, Any],
    schema: Mapping[str, Any],
    dims: dict[str, int],
    prefix: str,
    problems: list[str],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    missing = [
        prefix + k for k, kind in schema.items() if k not in state and not isinstance(kind, Maybe)
    ]
    unknown = [prefix + str(k) for k in state if k not in schema]
    if missing:
        problems.append(f"missing key{'s' if len(missing) > 1 else ''} {missing}")
    if unknown:
        problems.append(
            f"unknown key{'s' if len(unknown) > 1 else ''} {unknown} (expected the keys "
            f"{[prefix + k for k in schema]})"
        )
    for key, kind in schema.items():
        if key not in state:
            continue
        value = state[key]
        if isinstance(kind, Maybe):
            if value is None and kind.none:
                out[key] = None
                continue
            kind = kind.kind
        if isinstance(kind, Nested):
            if not isinstance(value, Mapping):
                problems.append(f"{prefix + key!r}: expected a dict, got {type(value).__name__}")
                continue
            out[key] = _validate(value, kind.schema, dims, f"{prefix}{key}.", problems)
            continue
        try:
            out[key] = kind.check(value, dims)
        except _Problem as problem:
            problems.append(f"{prefix + key!r}: {problem}")
    return out


def require_task(state: Mapping[str, Any], task: str, owner: str) -> None:
    """Warn when a state (saved before the ``task`` key existed) cannot show its task."""
    if isinstance(state, Mapping) and "task" not in state:
        warnings.warn(
            f"{owner}.load_state_dict: the state has no 'task' entry (saved by an older "
            f"gaussify), so it cannot be verified that it was saved for a {task!r} posterior",
            StateWarning,
            stacklevel=4,
        )


def copy_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A ``state_dict`` that shares no memory with the live object: tensors detached and
    cloned, nested dicts and lists copied (so editing a saved state never edits a posterior)."""

    def copy(value: Any) -> Any:
        if isinstance(value, Tensor):
            value = value.detach()
            if value.numel() > 1 and all(st == 0 for st in value.stride()):
                # a broadcast of one number stays one number (e.g. a scalar prior mean)
                return value.reshape(-1)[:1].clone().expand(value.shape)
            return value.clone()
        if isinstance(value, Mapping):
            return {k: copy(v) for k, v in value.items()}
        if isinstance(value, list):
            return [copy(v) for v in value]
        return value

    return {k: copy(v) for k, v in state.items()}


def identity(task: str, subset: Sequence[str], model: nn.Module | None) -> dict[str, Any]:
    """The identity entries a posterior's ``state_dict`` carries: its task, the parameter
    tensors it covers and a fingerprint of the network's other weights."""
    out: dict[str, Any] = {"task": task, "subset": list(subset)}
    if model is not None:
        out["model_fingerprint"] = model_fingerprint(model, exclude=subset)
    return out


def identity_schema(task: str, subset: Sequence[str]) -> dict[str, Any]:
    """Schema of :func:`identity` (``task`` and the fingerprint optional: older states)."""
    return {
        "task": Maybe(Choice((task,), "the task of this posterior")),
        "subset": Names(tuple(subset)),
        "model_fingerprint": Maybe(TensorSpec((None, 3), None)),
    }


def check_network(
    state: Mapping[str, Any],
    valid: Mapping[str, Any],
    *,
    owner: str,
    task: str,
    model: nn.Module,
    subset: Sequence[str],
    current: Tensor | None = None,
    strict: bool = True,
) -> None:
    """The checks of a validated state against the receiving model: the task (a warning for
    an older state without one), theta* against ``current`` (the subset's weights now) and the
    fingerprint of the other weights; see :func:`check_weights`."""
    require_task(state, task, owner)
    if current is not None and "theta_star" in valid:
        check_weights(valid["theta_star"], current, owner=owner, strict=strict)
    check_fingerprint(
        valid.get("model_fingerprint"), model, owner=owner, exclude=subset, strict=strict
    )


class SubsetView(Protocol):
    """What :func:`validate_posterior_state` reads of a ``ParameterSubset`` (structural, so
    this module stays below ``curvature``)."""

    names: Sequence[str]
    num_params: int

    def params(self, model: nn.Module) -> dict[str, Tensor]: ...

    def flatten(self, params: Mapping[str, Tensor]) -> Tensor: ...


def validate_posterior_state(
    state: Any,
    schema: Mapping[str, Any],
    *,
    owner: str,
    task: str,
    model: nn.Module,
    subset: SubsetView,
    strict: bool = True,
) -> dict[str, Any]:
    """The whole-state check of a posterior over ``subset`` of ``model``'s weights:
    :func:`validate_state` with the named size P = ``subset.num_params``, then
    :func:`check_network` against the subset's current weights. Returns the validated state;
    raises :class:`StateError` (or warns, ``strict=False``, for other weights)."""
    valid = validate_state(state, schema, owner=owner, dims={"P": subset.num_params})
    check_network(
        state,
        valid,
        owner=owner,
        task=task,
        model=model,
        subset=subset.names,
        current=subset.flatten(subset.params(model)),
        strict=strict,
    )
    return valid


def validate_own_state(posterior: Any, state: Any, *, strict: bool = True) -> dict[str, Any]:
    """:func:`validate_posterior_state` of ``state`` for ``posterior`` (a family with a
    ``_state_schema()``, ``task``, ``model`` and ``subset``), its class name as the owner
    named in the errors."""
    return validate_posterior_state(
        state,
        posterior._state_schema(),
        owner=type(posterior).__name__,
        task=posterior.task,
        model=posterior.model,
        subset=posterior.subset,
        strict=strict,
    )


def validate_module_state(
    module: nn.Module, state: Any, *, strict: bool = True, owner: str | None = None
) -> None:
    """Check an ``nn.Module`` state dict as a whole before torch copies it in (torch copies
    entry by entry and reports shape errors only after the others were overwritten): the
    keys (all of them when ``strict``), each tensor's shape, floating vs integer entries and
    NaN/inf in floating ones. Raises :class:`StateError`."""
    schema: dict[str, Any] = {}
    for key, value in module.state_dict().items():
        dtype = "float" if value.is_floating_point() else None
        spec = TensorSpec(tuple(value.shape), dtype)
        schema[key] = spec if strict else Maybe(spec)
    if not strict and isinstance(state, Mapping):
        state = {k: v for k, v in state.items() if k in schema}
    validate_state(state, schema, owner=owner or type(module).__name__)


# --------------------------------------------------------------------------- weights
def check_weights(
    saved: Tensor,
    current: Tensor,
    *,
    owner: str,
    key: str = "theta_star",
    strict: bool = True,
    rtol: float = WEIGHT_RTOL,
) -> None:
    """Compare the saved expansion point with the model's current weights (same flattening):
    ``max |saved - current| <= rtol * max(1, max |current|)``, in float64. On a mismatch raise
    :class:`StateError` (``strict``) or warn with :class:`StateWarning`."""
    a, b = saved.detach().to(torch.float64), current.detach().to(torch.float64)
    if a.shape != b.shape:
        _mismatch(
            f"{key!r}: saved for {a.numel()} weights, the model has {b.numel()}", owner, strict
        )
        return
    if a.numel() == 0:
        return
    diff = float((a - b).abs().max())
    if diff > rtol * max(1.0, float(b.abs().max())):
        _mismatch(
            f"{key!r}: the state was fitted at other weights than the model's current ones "
            f"(max |difference| {diff:.3g})",
            owner,
            strict,
        )


def model_fingerprint(model: nn.Module, exclude: Sequence[str] = ()) -> Tensor:
    """Per parameter tensor outside ``exclude`` (``named_parameters()`` order), float64
    ``[sum w, sum w^2, sum t_i w_i]`` with ``t_i`` evenly spaced in [1, 2]: (T, 3). Equal
    weights give equal rows; a changed, rescaled or permuted tensor changes a row."""
    rows = []
    skip = set(exclude)
    for name, p in model.named_parameters():
        if name in skip:
            continue
        w = p.detach().reshape(-1).to(torch.float64)
        t = torch.linspace(1.0, 2.0, w.numel(), dtype=torch.float64, device=w.device)
        rows.append(torch.stack([w.sum(), w.square().sum(), (t * w).sum()]).cpu())
    if not rows:
        return torch.zeros(0, 3, dtype=torch.float64)
    return torch.stack(rows)


def _fingerprint_scale(model: nn.Module, exclude: Sequence[str]) -> tuple[list[str], Tensor]:
    skip = set(exclude)
    names, scales = [], []
    for name, p in model.named_parameters():
        if name in skip:
            continue
        w = p.detach().reshape(-1).to(torch.float64)
        absum = float(w.abs().sum())
        scales.append([2 * absum, float(w.square().sum()), 2 * absum])
        names.append(name)
    return names, torch.tensor(scales, dtype=torch.float64).reshape(-1, 3)


def check_fingerprint(
    saved: Tensor | None,
    model: nn.Module,
    *,
    owner: str,
    exclude: Sequence[str] = (),
    strict: bool = True,
    rtol: float = WEIGHT_RTOL,
) -> None:
    """Compare a saved :func:`model_fingerprint` with the model's (skipped when ``saved`` is
    None: a state from before fingerprints); raise :class:`StateError` naming the first
    differing parameter tensor (``strict``) or warn."""
    if saved is None:
        return
    current = model_fingerprint(model, exclude)
    names, scale = _fingerprint_scale(model, exclude)
    if saved.shape != current.shape:
        _mismatch(
            f"'model_fingerprint': saved for a model with {saved.shape[0]} parameter tensors "
            f"outside the posterior, this model has {current.shape[0]}",
            owner,
            strict,
        )
        return
    bad = (saved.to(torch.float64) - current).abs() > rtol * scale.clamp_min(1.0)
    if bool(bad.any()):
        name = names[int(bad.any(1).nonzero()[0])]
        _mismatch(
            f"'model_fingerprint': the model's parameter {name!r} differs from the one the "
            "state was fitted with",
            owner,
            strict,
        )


def _mismatch(message: str, owner: str, strict: bool) -> None:
    advice = (
        "load the weights the posterior was fitted at into the model first "
        "(model.load_state_dict), or pass strict=False to load anyway"
    )
    if strict:
        raise StateError(f"{owner}.load_state_dict: {message}; {advice}")
    warnings.warn(
        f"{owner}.load_state_dict: {message}; predictions combine the saved posterior with the "
        "model's current weights",
        StateWarning,
        stacklevel=4,
    )


# --------------------------------------------------------------------------- transactions
def _copy_container(value: Any) -> Any:
    """Copy dicts, lists, sets and dataclass instances (recursively); anything else (tensors,
    objects) is kept by reference."""
    if type(value) is dict:
        return {k: _copy_container(v) for k, v in value.items()}
    if type(value) is list:
        return [_copy_container(v) for v in value]
    if type(value) is set:
        return set(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        copied = {
            f.name: _copy_container(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.init
        }
        return dataclasses.replace(value, **copied)
    return value


@contextmanager
def transaction(
    obj: Any, *, clone: Sequence[str] = (), model: nn.Module | None = None
) -> Iterator[None]:
    """Run a block that mutates ``obj``; if it raises, restore ``obj`` exactly: its attribute
    dict (containers copied, other values by reference), the tensors named in ``clone``
    (copied back in place, so optimisers holding them stay valid), the states of its
    ``torch.Generator`` attributes, the train/eval mode of its ``model`` attribute's modules
    and, when given, ``model``'s parameters and buffers."""
    attrs = vars(obj)
    saved = {k: _copy_container(v) for k, v in attrs.items()}
    generators = {k: v.get_state() for k, v in attrs.items() if isinstance(v, torch.Generator)}
    clones = {
        k: (attrs[k], attrs[k].detach().clone()) for k in clone if isinstance(attrs.get(k), Tensor)
    }
    weights = (
        []
        if model is None
        else [(t, t.detach().clone()) for t in [*model.parameters(), *model.buffers()]]
    )
    network = attrs.get("model")
    modes = [(m, m.training) for m in network.modules()] if isinstance(network, nn.Module) else []
    try:
        yield
    except BaseException:
        attrs.clear()
        attrs.update(saved)
        with torch.no_grad():
            for tensor, copy in clones.values():
                tensor.copy_(copy)
            for tensor, copy in weights:
                tensor.copy_(copy)
        for key, gen_state in generators.items():
            saved[key].set_state(gen_state)
        for module, training in modes:
            module.training = training
        raise


F = TypeVar("F", bound=Callable[..., Any])


def transactional(
    method: F | None = None, *, clone: Sequence[str] = (), model: bool = False
) -> Any:
    """Decorator: run the method inside :func:`transaction` on ``self`` (``model=True``: also
    restore ``self.model``'s weights, for families that write their mean into the network).
    Use as ``@transactional`` or ``@transactional(clone=("log_prior",), model=True)``."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            net = getattr(self, "model", None) if model else None
            with transaction(self, clone=clone, model=net):
                return fn(self, *args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate(method) if method is not None else decorate
