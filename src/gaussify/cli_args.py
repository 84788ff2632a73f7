"""Argument checking shared by the ``gaussify`` command and every ``gaussify experiment``.

One convention for the whole command line:

- an error is one line on stderr, ``gaussify: error: <what>``, and exit status 2; no usage
  block, no traceback (``--debug`` re-raises library errors with their traceback; an
  unexpected exception, i.e. a bug, always keeps its traceback);
- numbers are checked while the arguments are parsed (:func:`positive_int`,
  :func:`positive_float`, ...), and output paths right after (:func:`prepare_output_dir`,
  :func:`prepare_output_file`), so a bad value stops the command before any data set is read
  or any network trained;
- outputs are never replaced silently: the demo refuses a folder that already holds its files
  unless ``--force``; an experiment's ``--output``/``--figure`` names one file, which is
  replaced with a note saying so (regenerating a committed result is what those are for);
- ``--progress/--no-progress`` (:func:`add_progress_argument`) switches the progress bars of
  every command.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import torch

__all__ = [
    "ArgumentParser",
    "UsageError",
    "add_device_argument",
    "add_progress_argument",
    "device_argument",
    "finite_float",
    "nonnegative_int",
    "one_line",
    "positive_float",
    "positive_int",
    "prepare_output_dir",
    "prepare_output_file",
    "run_reporting_errors",
    "synchronize",
]

PREFIX = "gaussify: error: "
#: exceptions that mean "the request cannot be served" rather than "gaussify has a bug": bad
#: values found by the library (ValueError, incl. CorruptDataError), files that cannot be read
#: or written (OSError), a missing optional dependency (ImportError)
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, ImportError)


class UsageError(ValueError):
    """A combination of arguments that is refused after parsing (an output folder that is a
    file, a regression data set for a classification command, ...)."""


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line, ``gaussify: error: <message>
    (see '<prog> --help')``, with exit status 2 (argparse's), instead of a usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PREFIX}{one_line(message)} (see '{self.prog} --help')\n")


def one_line(message: object) -> str:
    """``message`` as text on one line (runs of whitespace, newlines included, become one
    space)."""
    return " ".join(str(message).split())


# ------------------------------------------------------------------------- number types


def _number(text: str, kind: Callable[[str], float | int], what: str) -> float | int:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (widths, epochs, steps, counts)."""
    value = int(_number(text, int, "a positive integer"))
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0 (seeds)."""
    value = int(_number(text, int, "a non-negative integer"))
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (learning rates, prior precisions, variances)."""
    value = float(_number(text, float, "a finite number > 0"))
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def finite_float(text: str) -> float:
    """argparse type: any finite number (no nan, inf)."""
    return float(_number(text, float, "a finite number"))


def add_progress_argument(parser: argparse.ArgumentParser, default: bool = True) -> None:
    """Add ``--progress/--no-progress`` (progress bars on stderr; on by default)."""
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=default,
        help=f"show progress bars on stderr (default: {'on' if default else 'off'})",
    )


# ------------------------------------------------------------------------- output paths


def _creatable(path: Path, option: str, shown: Path | None = None) -> None:
    """Create the folder ``path`` (if missing) or raise :class:`UsageError` naming ``option``
    and ``shown`` (the path the user gave; default ``path``)."""
    shown = path if shown is None else shown
    ancestor = path
    while not ancestor.exists():
        if ancestor.parent == ancestor:
            break
        ancestor = ancestor.parent
    if ancestor.exists() and not ancestor.is_dir():
        raise UsageError(f"argument {option}: '{shown}' cannot be created, '{ancestor}' is a file")
    if ancestor.exists() and not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"argument {option}: no permission to write in '{ancestor}'")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(
            f"argument {option}: cannot create the folder '{path}' ({err.strerror})"
        ) from None


def prepare_output_dir(
    path: str | os.PathLike[str], option: str, produces: Sequence[str], force: bool = False
) -> Path:
    """Check and create the output folder ``path`` before any work is done.

    Refused (:class:`UsageError` naming ``option``): an existing file, a path below a file, a
    folder that cannot be created or written, and, unless ``force``, a folder that already
    holds any of the files in ``produces`` (say which, and that ``--force`` replaces them).
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UsageError(f"argument {option}: '{out}' is a file, not a folder")
    _creatable(out, option)
    if not os.access(out, os.W_OK | os.X_OK):
        raise UsageError(f"argument {option}: no permission to write in '{out}'")
    existing = [name for name in produces if (out / name).exists()]
    if existing and not force:
        raise UsageError(
            f"argument {option}: '{out}' already holds {' and '.join(existing)} from an "
            "earlier run; pass --force to replace them, or choose another folder"
        )
    return out


def prepare_output_file(
    path: str | os.PathLike[str] | None, option: str, *, stream: object = None
) -> Path | None:
    """Check the output file ``path`` (None: no output) before any work is done and create its
    folder. Refused (:class:`UsageError` naming ``option``): a folder, a path below a file, a
    folder that cannot be created or written. An existing file will be replaced: a note on
    ``stream`` (stderr) says so now, not after the run."""
    if path is None:
        return None
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"argument {option}: '{target}' is a folder; give a file name")
    _creatable(target.parent, option, target)
    if target.exists():
        if not os.access(target, os.W_OK):
            raise UsageError(f"argument {option}: '{target}' exists and is not writable")
        print(f"note: {option} '{target}' exists and will be replaced", file=stream or sys.stderr)
    return target


# ------------------------------------------------------------------------- error report


def _raised_inside_gaussify(err: BaseException) -> bool:
    tb = err.__traceback__
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None:
        return True
    package = str(Path(__file__).resolve().parent)
    return str(Path(last.tb_frame.f_code.co_filename).resolve()).startswith(package)


def run_reporting_errors(call: Callable[[], int], debug: bool = False) -> int:
    """Run ``call()`` and return its exit status; a refused request (:data:`USER_ERRORS`)
    becomes one line ``gaussify: error: ...`` on stderr and status 2 (an error raised outside
    gaussify, e.g. inside torch, adds a pointer to ``--debug``), an interrupt status 130.
    A closed output pipe ends the command quietly (status 1). With ``debug`` the exception
    propagates with its traceback. Other exceptions are bugs and propagate unchanged."""
    try:
        return int(call())
    except BrokenPipeError:  # the reader went away (`gaussify datasets | head`): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        if debug:
            raise
        print("gaussify: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as err:
        if debug:
            raise
        hint = "" if _raised_inside_gaussify(err) else " (--debug shows the traceback)"
        print(f"{PREFIX}{one_line(err)}{hint}", file=sys.stderr)
        return 2


def device_argument(text: str) -> torch.device:
    """``--device`` value: a torch device name ("cpu", "cuda", "cuda:1"), refused when it is not
    one or when CUDA is named on a machine without it."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available on this machine")
    return device


def add_device_argument(parser: argparse.ArgumentParser, default: str = "cpu") -> None:
    """``--device`` (default cpu): where a script puts its models and data."""
    parser.add_argument(
        "--device",
        type=device_argument,
        default=torch.device(default),
        help=f"torch device for the models and the data (default {default}; e.g. cuda, cuda:1)",
    )


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA runs asynchronously): call before reading
    a clock, so a timing covers the work and not only its launch. No-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
