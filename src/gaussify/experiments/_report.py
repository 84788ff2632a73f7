"""The command line the experiments share: the parser (one-line errors, checked numbers, see
:mod:`gaussify.cli_args`), ``--output`` / ``--figure`` / ``--progress`` options, the check of the
output paths before any work, the printed report (title, ``result.table()``, notes, runtime),
the JSON file, and the ``python -m gaussify.experiments.<name>`` entry point.

Outputs: ``--output``/``--figure`` name one file each (a folder for ``ngvi_predictive``'s
figures); a path that cannot be written is refused before the run, and an existing file is
replaced with a note saying so when the run starts (regenerating a committed result is what
these options are for)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from gaussify.cli_args import (
    ArgumentParser,
    UsageError,
    add_progress_argument,
    prepare_output_dir,
    prepare_output_file,
    run_reporting_errors,
)

__all__ = [
    "add_output_arguments",
    "add_progress_argument",
    "check_input_file",
    "check_outputs",
    "experiment_parser",
    "print_summary",
    "progress_bar",
    "report",
    "run_main",
    "write_json",
    "write_output",
]


def experiment_parser(name: str, description: str) -> ArgumentParser:
    """The parser of ``gaussify experiment <name>``: one-line errors (exit status 2)."""
    return ArgumentParser(prog=f"gaussify experiment {name}", description=description)


def check_outputs(
    args: argparse.Namespace, folders: dict[str, Sequence[str]] | None = None
) -> None:
    """Check ``args.output`` and ``args.figure`` (those the parser has) before any work:
    refuse a path that cannot be written, create its folder, note a file that will be
    replaced. ``folders`` maps an option that names a folder to the files written into it.
    ``--figure`` also needs matplotlib (the ``plots`` extra): refused in one line naming the
    pip command when it is missing."""
    folders = folders or {}
    if getattr(args, "figure", None) is not None:
        from gaussify.extras import require

        require("matplotlib", "--figure")
    for option in ("output", "figure"):
        value = getattr(args, option, None)
        if value is None:
            continue
        if option in folders:
            out = prepare_output_dir(value, f"--{option}", folders[option], force=True)
            for name in folders[option]:
                if (out / name).exists():
                    note = f"note: --{option} '{out / name}' exists and will be replaced"
                    print(note, file=sys.stderr)
        else:
            prepare_output_file(value, f"--{option}")


class _NoBar:
    """Stands in for a tqdm bar when progress is off: every call does nothing."""

    def update(self, n: int = 1) -> None:
        del n

    def set_postfix(self, **kwargs: Any) -> None:
        del kwargs

    def close(self) -> None:
        pass


def progress_bar(enabled: bool, total: int | None, desc: str, unit: str = "run") -> Any:
    """A tqdm bar on stderr over ``total`` units when ``enabled`` (``--progress``), else an
    object with the same ``update``/``set_postfix``/``close`` that does nothing."""
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit)


def check_input_file(path: Path | None, option: str) -> None:
    """Refuse ``path`` (an input such as ``--merge``) unless it is an existing file."""
    if path is not None and not path.is_file():
        raise UsageError(f"argument {option}: '{path}' is not an existing file")


def run_main(main: Callable[[list[str]], int], argv: Sequence[str] | None = None) -> NoReturn:
    """``python -m gaussify.experiments.<name>``: run ``main`` with the errors of the
    ``gaussify`` command (one line, exit status 2; ``--debug`` shows the traceback)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    rest = [a for a in args if a != "--debug"]
    raise SystemExit(run_reporting_errors(lambda: main(rest), debug=debug))


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


def write_output(args: argparse.Namespace, payload: dict[str, Any]) -> int:
    """Write ``payload`` to ``args.output`` (as JSON, saying where) when it was given; the
    command's exit status 0."""
    if args.output is not None:
        print(f"wrote {write_json(args.output, payload)}")
    return 0


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
    return write_output(args, result.to_dict())
