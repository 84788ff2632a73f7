"""The code base stays ruff-clean (lint and format), as the house rules ask."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]])
def test_ruff(args: list[str]) -> None:
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed; `pip install -e .[test]` installs it")
    folders = [d for d in ("src", "tests", "benchmarks", "scripts") if (ROOT / d).is_dir()]
    result = subprocess.run(
        [ruff, *args, *folders],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
