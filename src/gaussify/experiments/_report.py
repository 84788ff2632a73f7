"""The command-line tail the experiments share: ``--output`` / ``--figure`` options, the printed
report (title, ``result.table()``, notes, runtime) and the JSON file."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["add_output_arguments", "print_summary", "report", "write_json"]


def add_output_arguments(
    parser: argparse.ArgumentParser, figure_help: str = "write the figure PNG"
) -> None:
    """Add ``--output`` (results JSON) and ``--figure`` (PNG) to ``parser``."""
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON")
    parser.add_argument("--figure", type=Path, default=None, help=figure_help)


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as indented JSON (trailing newline), creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def print_summary(result: Any, title: str | None = None) -> None:
    """Print ``title``, ``result.table()``, each of ``result.notes`` (if any) and the runtime."""
    if title is not None:
        print(title)
    print(result.table())
    for note in getattr(result, "notes", ()):
        print("note:", note)
    print(f"runtime {result.runtime_s:.1f} s")


def report(
    result: Any,
    args: argparse.Namespace,
    *,
    title: str | None = None,
    plot: Callable[[Any, Path], Path] | None = None,
) -> int:
    """:func:`print_summary`; then draw ``plot(result, args.figure)`` when both are given and
    write ``result.to_dict()`` to ``args.output`` when given. Returns the exit status 0."""
    print_summary(result, title)
    if plot is not None and args.figure is not None:
        print(f"wrote {plot(result, args.figure)}")
    if args.output is not None:
        print(f"wrote {write_json(args.output, result.to_dict())}")
    return 0
