"""The runner the experiments share: the pieces every ``run``/``main`` pair used to rebuild.

* the command line: :func:`cli` builds the parser from a table of options (plus ``--output``,
  ``--figure``, ``--progress``), checks the outputs before any work, passes the parsed
  options to ``run`` by name and prints / writes the report (:mod:`._report`);
* the protocol: :func:`choose_datasets` (a default set, ``--quick``'s smaller one, checked
  names and tasks), :func:`seed_list` (a count or explicit seeds), :func:`torch_threads`
  (``--threads``: torch's intra-op threads for the run, restored after), :func:`grid` (the
  one method loop: each data set x seed, with a progress bar);
* the aggregation: :func:`mean_se` (mean and standard error ``std(ddof=1) / sqrt(n)`` over
  seeds / splits) and :func:`fmt` (``mean ± se`` as printed in every table);
* the paper values: :func:`paper_table`, read from ``paper_tables.json`` next to this module;
* small shared pieces: :data:`IMAGE_DATASETS` and their :data:`OOD_PARTNER`,
  :func:`tanh_mlp` (the seeded float64 tanh network of the regression experiments),
  :func:`train_map_eval` (its MAP training, Adam at 1e-3 under a unit prior),
  :func:`group_records` (records by data set, in first-seen order), :func:`check_known`
  (unknown names in an option, with the experiment's message), :func:`result_fields` (the
  fields every results dataclass has), :func:`summary_rows` (one row per data set and
  method: each metric's mean and standard error over the seeds).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from gaussify import data as gdata
from gaussify.experiments._report import (
    add_output_arguments,
    add_progress_argument,
    check_outputs,
    experiment_parser,
    progress_bar,
    report,
)
from gaussify.training import train_map

__all__ = [
    "IMAGE_DATASETS",
    "OOD_PARTNER",
    "check_known",
    "choose_datasets",
    "cli",
    "fmt",
    "grid",
    "group_records",
    "mean_se",
    "paper_table",
    "result_fields",
    "seed_list",
    "summary_rows",
    "tanh_mlp",
    "torch_threads",
    "train_map_eval",
]

#: the shipped image sets of the image experiments, and the OOD set each is scored against
IMAGE_DATASETS: tuple[str, ...] = ("mnist", "fashion_mnist")
OOD_PARTNER: dict[str, str] = {"mnist": "fashion_mnist", "fashion_mnist": "mnist"}

_T = TypeVar("_T")
_UNSET: Any = object()


def fmt(mean: float | None, se: float | None, digits: int = 3) -> str:
    """``"mean ± se"`` with ``digits`` decimals; ``"mean"`` when ``se`` is missing or not
    finite; ``"–"`` when there is no mean."""
    if mean is None:
        return "–"
    if se is None or not math.isfinite(se):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {se:.{digits}f}"


def mean_se(values: Iterable[float], single: Any = math.nan) -> tuple[Any, Any]:
    """Mean and standard error ``std(ddof=1) / sqrt(n)`` of ``values`` in float64;
    ``(None, None)`` when there are none, and ``single`` as the standard error of one value
    (nan, None or 0.0, as each experiment's JSON records it)."""
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return None, None
    if arr.size < 2:
        return float(arr.mean()), single
    return float(arr.mean()), float(arr.std(ddof=1) / math.sqrt(arr.size))


def choose_datasets(
    datasets: Sequence[str] | None,
    default: Sequence[str],
    quick_default: Sequence[str] | None = None,
    *,
    quick: bool = False,
    task: str | None = None,
    wrong_task: str = "{} are not {} data sets",
) -> list[str]:
    """The data sets of a run: ``datasets`` (each shipped, of ``task`` when given; else a
    ``ValueError`` naming them) or the shipped ones of ``default`` (``quick_default`` with
    ``quick``)."""
    available = set(gdata.list())
    if datasets is None:
        chosen = quick_default if quick and quick_default is not None else default
        return [d for d in chosen if d in available]
    chosen = list(datasets)
    unknown = [d for d in chosen if d not in available]
    if unknown:
        raise ValueError(f"datasets: unknown {unknown}; available: {sorted(available)}")
    wrong = [d for d in chosen if task is not None and gdata.info(d).task != task]
    if wrong:
        raise ValueError("datasets: " + wrong_task.format(wrong, task))
    return chosen


def seed_list(
    seeds: int | Sequence[int], quick_count: int, *, quick: bool = False, name: str = ""
) -> list[int]:
    """Seeds ``0 .. seeds - 1`` (``0 .. quick_count - 1`` with ``quick``) or the explicit
    ``seeds``; a count below 1 is refused naming ``name`` when given."""
    if not isinstance(seeds, int):
        return [int(s) for s in seeds]
    if name and seeds <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {seeds}")
    return list(range(quick_count if quick else seeds))


@contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """Set torch's intra-op thread count inside the block (None: keep it) and restore the
    previous count afterwards, also on error."""
    before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def grid(
    datasets: Sequence[str],
    seeds: Sequence[int],
    fit: Callable[[str, int], _T],
    *,
    progress: bool = False,
    desc: str = "",
    unit: str = "run",
) -> list[_T]:
    """The method loop: ``fit(dataset, seed)`` for each data set (outer) and seed (inner), in
    order, with a progress bar over the ``len(datasets) * len(seeds)`` runs when
    ``progress``; returns the results in that order."""
    bar = progress_bar(progress, len(datasets) * len(seeds), desc, unit)
    out = []
    try:
        for name in datasets:
            for seed in seeds:
                out.append(fit(name, seed))
                bar.update()
    finally:
        bar.close()
    return out


@cache
def _paper_tables() -> dict[str, Any]:
    return json.loads(Path(__file__).with_name("paper_tables.json").read_text())


def paper_table(name: str) -> dict[str, Any]:
    """The published table ``name`` of ``paper_tables.json`` (its ``"_about"`` note
    dropped; ``"_rows"`` names the rows where a table has them)."""
    return {k: v for k, v in _paper_tables()[name].items() if k != "_about"}


def cli(
    argv: Sequence[str] | None,
    name: str,
    description: str,
    options: Sequence[tuple[str, dict[str, Any]]],
    run: Callable[..., Any],
    *,
    title: str | Callable[[Any], str] | None = None,
    plot: Callable[[Any, Path], Path] | None = None,
    figure_help: str | None = None,
    pass_figure: bool = False,
    progress: bool = True,
    rename: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> int:
    """``main`` of an experiment: the parser ``gaussify experiment <name>`` with ``options``
    (``(flag, add_argument keywords)`` in help order), then ``--output`` (and ``--figure``
    when ``figure_help``) and ``--progress``; the outputs are checked before any work; each
    option goes to ``run`` under its destination name (``rename`` maps a destination to
    another keyword; ``extra`` adds fixed keywords; ``pass_figure``: ``run`` draws the
    figure itself and gets ``figure=``), and the result is reported
    (:func:`~gaussify.experiments._report.report`: ``title``, or ``title(result)``, the table,
    notes, runtime, figure, JSON)."""
    parser = experiment_parser(name, description)
    dests = [parser.add_argument(flag, **kw).dest for flag, kw in options]
    if figure_help is None:
        parser.add_argument("--output", type=Path, default=None, help="write the results as JSON")
    else:
        add_output_arguments(parser, figure_help)
    if progress:
        add_progress_argument(parser)
        dests.append("progress")
    args = parser.parse_args(argv)
    check_outputs(args)
    rename = rename or {}
    kwargs = {rename.get(d, d): getattr(args, d) for d in dests}
    if pass_figure:
        kwargs["figure"] = args.figure
    result = run(**kwargs, **(extra or {}))
    heading = title(result) if callable(title) else title
    return report(result, args, title=heading, plot=plot)


def tanh_mlp(d_in: int, d_out: int, width: int, depth: int, seed: int) -> nn.Sequential:
    """``d_in``-``width``-...-``d_out`` MLP with ``depth`` tanh hidden layers (0: one linear
    layer), float64, initialised after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    d = d_in
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.Tanh()]
        d = width
    layers.append(nn.Linear(d, d_out))
    return nn.Sequential(*layers).double()


def check_known(values: Iterable[str], known: Iterable[str], message: str) -> None:
    """``ValueError(message.format(bad=[...]))`` listing the ``values`` not in ``known``."""
    allowed = set(known)
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ValueError(message.format(bad=bad))


def train_map_eval(
    model: nn.Module, data: tuple[Any, Any], task: str, cfg: dict[str, Any], batch_size: int
) -> None:
    """MAP-train ``model`` on ``data`` (:func:`gaussify.train_map`: unit prior precision, Adam
    at lr 1e-3, ``cfg["epochs"]`` epochs seeded by ``cfg["seed"]``) and put it in eval mode."""
    train_map(
        model,
        data,
        task,
        prior_precision=1.0,
        epochs=cfg["epochs"],
        lr=1e-3,
        batch_size=batch_size,
        seed=cfg["seed"],
    )
    model.eval()


def group_records(
    records: Iterable[dict[str, Any]], key: str = "dataset"
) -> dict[Any, list[dict[str, Any]]]:
    """The ``records`` grouped by their ``key`` value, groups in first-seen order."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for rec in records:
        groups.setdefault(rec[key], []).append(rec)
    return groups


def result_fields(
    cfg: Any,
    rows: list[dict[str, Any]],
    records: list[dict[str, Any]],
    notes: list[str],
    start: float,
) -> dict[str, Any]:
    """The fields every results dataclass has: ``config`` (the dataclass ``cfg``'s fields
    and the torch version), ``rows``, ``records``, ``notes`` and ``runtime_s`` since the
    ``time.perf_counter()`` value ``start``."""
    return {
        "config": {**cfg.__dict__, "torch": torch.__version__},
        "rows": rows,
        "records": records,
        "notes": notes,
        "runtime_s": time.perf_counter() - start,
    }


def summary_rows(
    records: list[dict[str, Any]],
    datasets: Sequence[str],
    methods: Sequence[str],
    labels: dict[str, str],
    keys: Sequence[str],
    *,
    sort_key: str | None = None,
) -> list[dict[str, Any]]:
    """One row per data set and method that has records (in the order of ``datasets`` and
    ``methods``): ``dataset``, ``method``, ``label``, ``num_seeds`` and, for each of ``keys``
    that some of its records have, ``{key}_mean`` / ``{key}_se`` by :func:`mean_se` (None for
    one record) over the records, taken in the order of ``sort_key`` where given."""
    rows = []
    for name in datasets:
        for method in methods:
            sel = [r for r in records if r["dataset"] == name and r["method"] == method]
            if sort_key is not None:
                sel.sort(key=lambda r: r[sort_key])
            if not sel:
                continue
            row: dict[str, Any] = {
                "dataset": name,
                "method": method,
                "label": labels[method],
                "num_seeds": len(sel),
            }
            for key in keys:
                vals = [r[key] for r in sel if key in r]
                if vals:
                    row[f"{key}_mean"], row[f"{key}_se"] = mean_se(vals, single=None)
            rows.append(row)
    return rows
