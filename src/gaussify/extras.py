"""Optional dependencies (the package's extras): one clear error when one is missing.

The core (``torch``, ``numpy``, ``scipy``, ``tqdm``) is always installed; matplotlib is the
``plots`` extra and scikit-learn the ``experiments`` extra. Code that needs one calls
:func:`require` at the point of use, so ``import gaussify`` and every fit / predict work
without them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtraError", "require"]

#: importable module -> the extra of ``pyproject.toml`` that installs it
EXTRAS: dict[str, str] = {"matplotlib": "plots", "sklearn": "experiments"}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the pip command."""


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import and return ``module``; if it is missing, raise :class:`MissingExtraError`:
    ``"<what> needs <module>, which is not installed: pip install \\"gaussify[<extra>]\\""``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f'{what} needs {module}, which is not installed: pip install "gaussify[{extra}]"'
        ) from exc
