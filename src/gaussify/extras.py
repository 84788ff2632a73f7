"""Optional dependencies (the package's extras): one clear error when one is missing.

The core (``torch``, ``numpy``, ``scipy``, ``tqdm``) is always installed; matplotlib is the
``plots`` extra and scikit-learn the ``experiments`` extra (``all`` installs both). Code that
needs one calls :func:`require` where it is used, so ``import gaussify`` and the fit / predict
of every family work without them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtraError", "require"]

#: importable module -> (the name pip installs it by, the extra of ``pyproject.toml`` holding it)
EXTRAS: dict[str, tuple[str, str]] = {
    "matplotlib": ("matplotlib", "plots"),
    "sklearn": ("scikit-learn", "experiments"),
}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the pip command."""


def require(module: str, what: str) -> ModuleType:
    """Import and return ``module`` (a key of :data:`EXTRAS`, or one of its submodules); if it
    is missing, raise :class:`MissingExtraError` with one line, e.g.
    ``"gaussify.plots needs matplotlib, which is not installed: pip install "gaussify[plots]""``.
    ``what`` names the feature that needs it."""
    package, extra = EXTRAS[module.split(".")[0]]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f'{what} needs {package}, which is not installed: pip install "gaussify[{extra}]"'
        ) from exc
