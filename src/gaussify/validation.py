"""Input validation at the public boundary, shared by every posterior family.

Every public entry point that takes data checks it here once, before any state is touched,
so that a bad input is named as what it is instead of surfacing later as a numerical failure
("network is not differentiable", "posterior covariance is not valid"):

* :func:`check_inputs` -- ``x`` is a tensor with at least one row, finite (the first bad
  row and whether it holds NaN or inf is named), of the model's floating dtype, and as wide
  as the model's first layer (``in_features`` / ``in_channels``) where that is determinable
  (a ``nn.Sequential`` starting with a linear or convolutional layer);
* :func:`check_targets` -- ``y`` finite; class labels integer-valued in ``[0, C)``; binary
  targets in ``{0, 1}``; regression targets with one value per output;
* :func:`check_count` -- integer counts (``num_samples``, ``chunk_size``, ``epochs``, ...):
  Python / numpy integers, not bool, at least a minimum;
* :func:`validated_batches` -- :func:`gaussify.batches.as_batches` with every batch
  checked as it is drawn (row numbers global across batches), empty data refused with
  "data: contains no examples", and single-pass iterables (generators, iterators) accepted
  where one pass suffices and refused up front where the caller makes several.

The checks are reductions (one min/max per tensor); the bad row is located only on failure.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from gaussify.batches import Batches, DictBatches, as_batches
from gaussify.deferred_checks import check_range

__all__ = [
    "ArgumentTypeError",
    "check_count",
    "check_data",
    "check_finite",
    "check_inputs",
    "check_targets",
    "first_layer_width",
    "is_single_pass",
    "output_width",
    "validated_batches",
]


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong kind (not a tensor, not an integer, wrong dtype).

    A ``TypeError`` by nature and a ``ValueError`` for callers that catch the library's
    usual error class (as ``numpy.AxisError`` is both a ``ValueError`` and an ``IndexError``).
    """


# ---------------------------------------------------------------------- scalars
def check_count(value: Any, name: str, minimum: int = 1) -> int:
    """``value`` as a Python int ``>= minimum``; bools, floats (even 2.0) and strings are
    refused, naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value}")
    return value


# ---------------------------------------------------------------------- tensors
def _finite(t: Tensor) -> bool:
    """One min/max reduction: NaN propagates into both, +-inf reaches one of them."""
    if t.numel() == 0 or not (t.is_floating_point() or t.is_complex()):
        return True
    if t.is_complex():
        return bool(torch.isfinite(t).all())
    lo, hi = torch.aminmax(t.detach())
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_finite(t: Tensor, name: str, offset: int = 0) -> None:
    """Raise ``ValueError("{name}: row {i} contains NaN")`` (or ``inf``) for the first row of
    ``t`` that is not finite; ``offset`` is added to the row number (global rows when ``t``
    is one batch of a larger data set)."""
    if _finite(t):
        return
    rows = t.detach().reshape(t.shape[0], -1) if t.ndim > 0 else t.detach().reshape(1, 1)
    bad = ~torch.isfinite(rows).all(dim=1)
    row = int(bad.nonzero()[0, 0])
    kind = "NaN" if bool(torch.isnan(rows[row]).any()) else "inf"
    raise ValueError(f"{name}: row {row + offset} contains {kind}")


def _model_dtype(model: nn.Module | None) -> torch.dtype | None:
    if model is None:
        return None
    for p in model.parameters():
        return p.dtype
    return None


_TRANSPARENT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.Identity)
_CONVS = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}


def first_layer_width(model: nn.Module | None) -> tuple[str, int, int | None, bool] | None:
    """What the model's first layer expects, where it is determinable from the module tree:
    ``("in_features", width, None, flattened)`` for a first ``nn.Linear`` (``flattened``:
    an ``nn.Flatten()`` before it), ``("in_channels", channels, spatial_dims, False)`` for a
    first convolution, ``("num_embeddings", vocabulary, None, False)`` for a first
    ``nn.Embedding`` (token ids); None for any other model (a custom ``forward`` may apply
    its modules in any order, so nothing is assumed about it)."""
    flattened = False
    module = model
    while isinstance(module, nn.Sequential):
        children = list(module)
        nxt = None
        for child in children:
            if isinstance(child, _TRANSPARENT):
                continue
            if isinstance(child, nn.Flatten) and child.start_dim == 1 and child.end_dim == -1:
                flattened = True
                continue
            nxt = child
            break
        if nxt is None:
            return None
        module = nxt
    if isinstance(module, nn.modules.lazy.LazyModuleMixin):
        return None
    if type(module) is nn.Linear:
        return ("in_features", module.in_features, None, flattened)
    if type(module) is nn.Embedding and not flattened:
        return ("num_embeddings", module.num_embeddings, None, False)
    conv_dims = _CONVS.get(type(module))
    if conv_dims is not None and not flattened:
        return ("in_channels", module.in_channels, conv_dims, False)  # type: ignore[arg-type]
    return None


def output_width(model: nn.Module | None) -> int | None:
    """C, the number of outputs, where the model is an ``nn.Sequential`` ending in a plain
    ``nn.Linear`` (else None: the likelihood checks the targets against the outputs)."""
    module = model
    while isinstance(module, nn.Sequential) and len(module) > 0:
        module = module[-1]
    if type(module) is nn.Linear:
        return module.out_features
    return None


def check_inputs(
    x: Any,
    model: nn.Module | None = None,
    name: str = "x",
    *,
    offset: int = 0,
    allow_empty: bool = False,
) -> Tensor:
    """Validate inputs ``x (N, ...)`` for ``model``: a tensor with at least one dimension and
    (unless ``allow_empty``) one row; finite (first bad row named); a floating ``x`` in the
    model's parameter dtype; and as wide as the model's first layer where that is known
    (:func:`first_layer_width`). Integer inputs (token ids) are accepted unless the first
    layer is linear or convolutional; for a first ``nn.Embedding`` they must be integer ids
    in [0, num_embeddings). Returns ``x``."""
    if not isinstance(x, Tensor):
        raise ArgumentTypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.ndim == 0:
        raise ValueError(f"{name}: expected a tensor of shape (N, ...), got a scalar")
    if x.shape[0] == 0 and not allow_empty:
        raise ValueError(f"{name}: contains no examples")
    check_finite(x, name, offset)
    dtype = _model_dtype(model)
    layer = first_layer_width(model)
    if layer is not None and layer[0] == "num_embeddings":
        return _check_token_ids(x, name, layer[1], offset)
    mismatch = dtype is not None and dtype.is_floating_point and x.dtype != dtype
    if mismatch and (x.is_floating_point() or x.is_complex() or layer is not None):
        raise ArgumentTypeError(
            f"{name}: dtype {x.dtype} does not match the model's parameters ({dtype})"
        )
    if layer is not None:
        what, width, spatial, flattened = layer
        if what == "in_features":
            got = math.prod(x.shape[1:]) if flattened else (x.shape[-1] if x.ndim > 1 else 1)
            if x.ndim < 2:
                raise ValueError(
                    f"{name}: expected shape (N, {width}) for the first layer's in_features, "
                    f"got {tuple(x.shape)}"
                )
            if got != width:
                kind = "flattened features" if flattened else "features"
                raise ValueError(
                    f"{name}: expected {width} {kind} (the first layer's in_features), got {got}"
                )
        elif spatial is not None and x.ndim == spatial + 2 and x.shape[1] != width:
            raise ValueError(
                f"{name}: expected {width} channels (the first layer's in_channels), "
                f"got {x.shape[1]}"
            )
    return x


def _check_token_ids(x: Tensor, name: str, vocabulary: int, offset: int) -> Tensor:
    """Token ids for a first ``nn.Embedding``: an integer tensor with values in
    [0, vocabulary) (the first row outside named)."""
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise ArgumentTypeError(
            f"{name}: the model's first layer is an nn.Embedding, which takes integer token "
            f"ids, got dtype {x.dtype}"
        )
    bad = (x < 0) | (x >= vocabulary)
    if x.numel() and bool(bad.any()):
        row = int(bad.reshape(x.shape[0], -1).any(1).nonzero()[0, 0])
        value = int(x[row][bad[row]].reshape(-1)[0])
        raise ValueError(
            f"{name}: row {row + offset} holds token id {value}, outside [0, {vocabulary}) "
            "(the first nn.Embedding's num_embeddings)"
        )
    return x


def check_targets(
    y: Any,
    task: str | None = None,
    num_outputs: int | None = None,
    name: str = "y",
    *,
    offset: int = 0,
    num_rows: int | None = None,
) -> Tensor:
    """Validate targets ``y``: a tensor, finite (first bad row named); for
    ``task="classification"`` integer-valued labels in ``[0, num_outputs)`` (the upper bound
    when known); for ``"binary"`` values in {0, 1}; for ``"regression"`` one value per output
    when ``num_outputs`` is known. ``num_rows`` checks the row count against ``x``."""
    if not isinstance(y, Tensor):
        raise ArgumentTypeError(f"{name}: expected a torch.Tensor, got {type(y).__name__}")
    if y.ndim == 0:
        raise ValueError(f"{name}: expected a tensor of shape (N, ...), got a scalar")
    if num_rows is not None and y.shape[0] != num_rows:
        raise ValueError(f"{name}: has {y.shape[0]} rows but x has {num_rows}")
    check_finite(y, name, offset)
    if y.numel() == 0 or y.dtype == torch.bool:
        return y
    if task == "classification":
        if y.is_floating_point() and bool((y != y.round()).any()):
            row = int((y != y.round()).reshape(y.shape[0], -1).any(1).nonzero()[0, 0])
            raise ValueError(f"{name}: class labels must be integers, row {row + offset} is not")
        upper = num_outputs if num_outputs is not None else None
        bound = f"[0, {upper})" if upper is not None else "[0, C)"

        def message(lo: int, hi: int) -> str:
            return f"{name}: labels must be in {bound}, got range [{lo}, {hi}]"

        # inside a fit's deferred_checks scope recorded (no host sync), else tested now
        low, high = torch.aminmax(y)
        check_range(low, high, upper if upper is not None else 2**62, message)
    elif task == "binary":
        if bool(((y != 0) & (y != 1)).any()):
            raise ValueError(f"{name}: binary targets must be 0 or 1")
    elif task == "regression" and num_outputs is not None:
        per_row = y.numel() // y.shape[0]
        if per_row != num_outputs:
            raise ValueError(
                f"{name}: expected {num_outputs} target value(s) per row (the model's outputs), "
                f"got shape {tuple(y.shape)}"
            )
    return y


# ---------------------------------------------------------------------- data
def is_single_pass(data: Any) -> bool:
    """Whether ``data`` can be iterated only once: an iterator or generator (``iter(data)``
    is ``data``), also inside :class:`~gaussify.batches.DictBatches`. DataLoaders, lists and
    tuples start a new pass on every ``iter``."""
    if isinstance(data, DictBatches):
        data = data.loader
    return isinstance(data, Iterator)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class _CheckedBatches:
    """Iterate ``(x, y)`` batches of ``batches``, validating each as it is drawn."""

    def __init__(
        self,
        batches: Iterable[tuple[Tensor, Tensor]],
        model: nn.Module | None,
        task: str | None,
        num_outputs: int | None,
        single_pass: bool,
        owner: str,
        input_name: str,
    ) -> None:
        self.batches, self.model, self.task = batches, model, task
        self.num_outputs, self.single_pass, self.owner = num_outputs, single_pass, owner
        self.input_name = input_name
        self.dataset = getattr(batches, "dataset", None)
        self._passes = 0

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        if self.single_pass and self._passes > 0:
            raise ValueError(
                f"data: the single-pass iterator given to {self.owner} is already consumed; "
                "pass a list, a DataLoader or a (x, y) tuple"
            )
        self._passes += 1
        rows = 0
        for x, y in self.batches:
            check_inputs(x, self.model, self.input_name, offset=rows, allow_empty=True)
            check_targets(y, self.task, self.num_outputs, "y", offset=rows, num_rows=x.shape[0])
            rows += x.shape[0]
            yield x, y
        if rows == 0 and not _distributed():
            raise ValueError("data: contains no examples")


def check_data(
    data: Batches,
    *,
    model: nn.Module | None = None,
    task: str | None = None,
    owner: str = "fit",
    multi_pass: bool = False,
    num_outputs: int | None = None,
    input_name: str = "x",
) -> Batches:
    """Validate ``data`` at a public boundary and return it in a form that every consumer of
    :func:`gaussify.batches.as_batches` accepts as before: an ``(x, y)`` tuple is checked
    whole, once (:func:`check_inputs` against ``model``, :func:`check_targets` for
    ``task``) and returned as it is; a loader is wrapped so that every batch is checked as
    it is drawn (row numbers count across batches) and a pass that yields no rows raises
    "data: contains no examples". A single-pass iterable (generator) is refused up front
    when ``multi_pass`` (``owner``, e.g. "VaLLA.fit", names the caller in the message);
    otherwise it is accepted for one pass and a second pass raises instead of silently
    seeing no data. ``input_name`` names the inputs in messages ("phi" for features).
    ``num_outputs`` defaults to the width of the model's last
    ``nn.Linear`` where determinable (:func:`output_width`)."""
    if num_outputs is None:
        num_outputs = output_width(model)
    if isinstance(data, tuple):
        as_batches(data)  # the pair's own checks: two tensors with as many rows
        x, y = data
        if x.shape[0] == 0 and not _distributed():
            raise ValueError("data: contains no examples")
        check_inputs(x, model, input_name, allow_empty=True)
        check_targets(y, task, num_outputs, "y", num_rows=x.shape[0])
        return data
    if isinstance(data, _CheckedBatches):
        return data
    if not isinstance(data, Iterable):
        as_batches(data)  # raises the TypeError naming data
    single = is_single_pass(data)
    if single and multi_pass:
        raise ArgumentTypeError(
            f"data: a single-pass iterator (generator) cannot be used by {owner}, which makes "
            "several passes; pass a list, a DataLoader or a (x, y) tuple"
        )
    dataset = getattr(data, "dataset", None)
    sized = dataset is not None and hasattr(dataset, "__len__")
    if sized and len(dataset) == 0 and not _distributed():
        raise ValueError("data: contains no examples")
    return _CheckedBatches(as_batches(data), model, task, num_outputs, single, owner, input_name)


def validated_batches(
    data: Batches,
    batch_size: int = 256,
    shuffle: bool = False,
    generator: torch.Generator | None = None,
    **checks: Any,
) -> Iterable[tuple[Tensor, Tensor]]:
    """:func:`gaussify.batches.as_batches` over :func:`check_data`'s validated ``data``;
    ``checks`` are :func:`check_data`'s keywords (``model``, ``task``, ``owner``,
    ``multi_pass``, ``num_outputs``, ``input_name``)."""
    batch_size = check_count(batch_size, "batch_size")
    checked = check_data(data, **checks)
    if isinstance(checked, _CheckedBatches):
        return checked
    return as_batches(checked, batch_size, shuffle, generator)
