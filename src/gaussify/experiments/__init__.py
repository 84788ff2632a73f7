"""Reproductions of the papers' experiments: one module per table or figure.

Each module has ``run(...)`` returning a results table and ``main(argv) -> int`` for the
command line (``gaussify experiment <name> ...``); :func:`get` returns the module for a name
in :data:`EXPERIMENTS`. Modules are imported on first use, so ``python -m
gaussify.experiments.<name>`` runs cleanly.

* ``uci_classification``: Immer, Korzepa & Bauer (2021), Table 1 (App. B.3 protocol).
* ``marglik_selection``: Immer thesis Sec. 5.1 (Fig. 5.3), evidence vs prior and width.
* ``marglik_regression``: Immer thesis Sec. 5.1 (Fig. 5.2), evidence over prior precision and
  noise on the 1-D regression toy with a gap.
* ``vbll_uci``, ``vbll_classification``: Harrison et al. (VBLL), Table 2 and image sets.
* ``approx_training``, ``approx_streaming``, ``approx_active``: Bui, Tables 1/2/4, Fig. 4 and
  Fig. 5 (Gaussian likelihood approximations: training losses, streaming, active learning).
* ``ngvi_predictive``: Immer thesis Sec. 5.2, NN-sampling vs GLM predictive of Laplace-GGN,
  VOGGN, LGVA and OGGN on a 1-D regression toy and banana.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

EXPERIMENTS: tuple[str, ...] = (
    "uci_classification",
    "marglik_selection",
    "marglik_regression",
    "vbll_uci",
    "vbll_classification",
    "approx_training",
    "approx_streaming",
    "approx_active",
    "approx_gp_classification",
    "function_space_toy",
    "function_space_regression",
    "function_space_images",
    "ngvi_predictive",
)

__all__ = ["EXPERIMENTS", "get", "summaries"]


def get(name: str) -> ModuleType:
    """The experiment module called ``name`` (one of :data:`EXPERIMENTS`)."""
    if name not in EXPERIMENTS:
        raise ValueError(f"name: unknown experiment {name!r}; choose one of {EXPERIMENTS}")
    return importlib.import_module(f"{__name__}.{name}")


def summaries() -> dict[str, str]:
    """``{name: first paragraph of its module docstring}`` for every experiment, read from the
    source files without importing them (so listing them is instant)."""
    out = {}
    for name in EXPERIMENTS:
        spec = importlib.util.find_spec(f"{__name__}.{name}")
        doc = None
        if spec is not None and spec.origin is not None:
            doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text()))
        out[name] = " ".join((doc or "").split("\n\n")[0].split())
    return out


def __getattr__(name: str) -> ModuleType:
    if name in EXPERIMENTS:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
