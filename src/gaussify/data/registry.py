"""Name -> specification of every bundled data set: where its rows come from, its task and
shape, the split protocol of the paper that uses it, its source and its licence.

The specifications are data: one record per data set in ``registry.json`` (next to this
module, read once at import), with the split protocols shared by several data sets named in its
``"protocols"`` table. Adding a data set is one record there (plus, for a vendored one, a
builder in ``scripts/build_datasets.py``, a row in ``SOURCES.md`` and its digest in
``files/SHA256SUMS``, which the script writes); a data set generated at load time names its
reader as ``"module.function"`` of :mod:`gaussify.data.synthetic` or :mod:`gaussify.data.raw`.
Nothing here reads data; the digests come from ``SHA256SUMS``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gaussify.data import raw, synthetic
from gaussify.data.raw import RawData, recorded_sha256

__all__ = ["REGISTRY", "DatasetSpec", "SplitProtocol", "Task"]

Task = Literal["regression", "classification"]


@dataclass(frozen=True)
class SplitProtocol:
    """How a data set is split by default.

    ``kind="random"``: all rows split at random into ``fractions`` = (train, val, test),
    stratified by label when ``stratify``. ``kind="original_test"``: the original test set is
    the test part and the original training rows are split (train, val) by ``fractions[:2]``
    (``fractions[2]`` is 0). ``kind="ordered"``: the rows are in time order and split into
    contiguous blocks, the first ``fractions[0]`` train, the next ``fractions[1]`` validation,
    the last ``fractions[2]`` test (a temporal split: the seed does not move it).
    ``kind="fixed"``: the data set defines its parts itself.
    ``reference`` names the paper and section the protocol comes from, if any.
    """

    kind: Literal["random", "original_test", "ordered", "fixed"]
    fractions: tuple[float, float, float] = (0.7, 0.15, 0.15)
    stratify: bool = False
    reference: str = ""


@dataclass(frozen=True)
class DatasetSpec:
    """Everything known about a data set before loading it.

    ``n`` rows and ``d`` features per row (784 for 28x28 images, whose ``image_shape`` is
    (1, 28, 28)); ``num_classes`` is None for regression. Rows come from the vendored file
    ``file`` (checked against ``sha256``, from ``files/SHA256SUMS``, when it is read) or from
    ``reader(seed)``; a reader with a ``data_seed`` always gets that seed (the data are fixed
    and only the split varies), otherwise it gets the split seed. ``installed`` is set for data
    sets read from files a system package provides: it tells whether they are there (the
    others always are).
    """

    name: str
    task: Task
    n: int
    d: int
    num_classes: int | None
    protocol: SplitProtocol
    source: str
    original: str
    licence: str
    description: str
    file: str | None = None
    sha256: str | None = None
    reader: Callable[[int], RawData] | None = None
    data_seed: int | None = None
    synthetic: bool = False
    image_shape: tuple[int, ...] | None = None
    installed: Callable[[], bool] | None = None


#: the split kinds :class:`SplitProtocol` knows
_KINDS: tuple[str, ...] = ("random", "original_test", "ordered", "fixed")
#: where ``"reader"`` / ``"installed"`` names in ``registry.json`` are looked up
_MODULES: dict[str, Any] = {"synthetic": synthetic, "raw": raw}
_TABLE = Path(__file__).with_name("registry.json")


def _function(ref: str) -> Callable[..., Any]:
    """The function ``"module.name"`` of :data:`_MODULES` (a record's reader or check)."""
    module, _, name = ref.partition(".")
    found = getattr(_MODULES.get(module), name, None) if name else None
    if not callable(found):
        raise ValueError(f"{ref!r} is not a function of gaussify.data.{{{', '.join(_MODULES)}}}")
    return found


def _protocol(value: str | dict[str, Any], named: dict[str, SplitProtocol]) -> SplitProtocol:
    """A record's protocol: the name of a shared one or the fields of its own."""
    if isinstance(value, str):
        if value not in named:
            raise ValueError(f"unknown protocol {value!r}; the table names {sorted(named)}")
        return named[value]
    fields = dict(value)
    if fields.get("kind") not in _KINDS:
        raise ValueError(f"protocol kind {fields.get('kind')!r} is not one of {_KINDS}")
    if "fractions" in fields:
        fields["fractions"] = tuple(fields["fractions"])
    return SplitProtocol(**fields)


def _spec(record: dict[str, Any], named: dict[str, SplitProtocol]) -> DatasetSpec:
    """One record of ``registry.json`` as a :class:`DatasetSpec` (the digest of its file from
    ``SHA256SUMS``)."""
    try:
        return _build(record, named)
    except (ValueError, TypeError, KeyError) as exc:
        name = record.get("name", "?")
        raise ValueError(f"registry.json: data set {name!r}: {exc}") from None


def _build(record: dict[str, Any], named: dict[str, SplitProtocol]) -> DatasetSpec:
    kw = dict(record, protocol=_protocol(record["protocol"], named))
    for key in ("reader", "installed"):
        if key in kw:
            kw[key] = _function(kw[key])
    if "image_shape" in kw:
        kw["image_shape"] = tuple(kw["image_shape"])
    if "file" in kw:
        kw["sha256"] = recorded_sha256().get(kw["file"])
    return DatasetSpec(**kw)


def _load_table(path: Path = _TABLE) -> tuple[DatasetSpec, ...]:
    """Every record of the table at ``path``, in its order; a record that does not describe a
    data set is refused naming it and what is wrong."""
    table = json.loads(path.read_text())
    named = {k: _protocol(v, {}) for k, v in table["protocols"].items()}
    return tuple(_spec(record, named) for record in table["datasets"])


_SPECS: tuple[DatasetSpec, ...] = _load_table()

REGISTRY: dict[str, DatasetSpec] = {spec.name: spec for spec in _SPECS}
