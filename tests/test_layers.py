"""The layers of ARCHITECTURE.md are executable: ``lint-imports`` checks the contracts of
``pyproject.toml`` (imports point down the layers only; no import cycles among the modules of
a package), every top-level module sits in a layer, and a planted upward import is caught."""

from __future__ import annotations

import os
import pkgutil
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "pyproject.toml"


def _lint_imports(src: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("import-linter is not installed; `pip install -e .[test]` installs it")
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run(
        [exe, "--config", str(CONFIG), "--cache-dir", str(cache)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _layers() -> list[str]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    contracts = tomllib.loads(CONFIG.read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    return layers


def test_contracts_kept(tmp_path: Path) -> None:
    result = _lint_imports(ROOT / "src", tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "gaussify layers: imports point down only KEPT" in out
    assert "no import cycles among the modules of a package KEPT" in out


def test_every_top_level_module_has_a_layer() -> None:
    placed = {name.strip() for layer in _layers() for name in layer.replace(":", "|").split("|")}
    modules = {m.name for m in pkgutil.iter_modules([str(ROOT / "src" / "gaussify")])}
    assert modules - placed == set(), "modules missing from the layers contract"
    assert placed - modules == set(), "layers naming modules that do not exist"


@pytest.mark.parametrize(
    ("module", "statement"),
    [
        # a bottom-layer module importing a family, lazily inside a function
        ("likelihoods.py", "\n\ndef _planted():\n    from gaussify.weight_space import Laplace\n"),
        # the cycle of issue 21: joint.py importing laplace.py back (type-checking only)
        (
            "weight_space/joint.py",
            "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from gaussify.weight_space.laplace import Laplace\n",
        ),
    ],
)
def test_planted_violation_is_caught(tmp_path: Path, module: str, statement: str) -> None:
    src = tmp_path / "src"
    shutil.copytree(
        ROOT / "src" / "gaussify",
        src / "gaussify",
        ignore=shutil.ignore_patterns("files", "__pycache__"),
    )
    with (src / "gaussify" / module).open("a") as fh:
        fh.write(statement)
    result = _lint_imports(src, tmp_path / "cache")
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "BROKEN" in out


def test_architecture_diagram_is_the_contract() -> None:
    """ARCHITECTURE.md's layer diagram lists the contract's layers, top to bottom, one a line."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    block = text.split("## Layers (enforced)", 1)[1].split("```", 2)[1]
    lines = [line for line in block.splitlines() if line.strip()]
    drawn = [" | ".join(part.strip() for part in line.split("  ")[0].split("|")) for line in lines]
    assert drawn == _layers()
