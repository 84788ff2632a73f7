"""The wheel: it holds the bundled data sets and, installed into a fresh virtual environment
with the ``plots`` extra, runs ``gaussify demo``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_holds_the_datasets_and_runs_the_demo_in_a_fresh_venv(tmp_path: Path) -> None:
    """About a minute: ``python -m build`` (isolated, from the package index), a venv that
    reuses this interpreter's torch (``--system-site-packages``), ``pip install
    "<wheel>[plots]"``, then the demo on iris with the venv's console script."""
    source = tmp_path / "source"  # build from a copy: the checkout gets no build/ or egg-info
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git", "build", "dist", "*.egg-info", "__pycache__", ".venv", "gaussify-demo"
        ),
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(source)],
        check=True,
        env=env,
        capture_output=True,
    )
    (wheel,) = dist.glob("gaussify-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    files = ROOT / "src" / "gaussify" / "data" / "files"
    bundled = sorted(p.name for p in files.iterdir() if p.suffix == ".npz")
    assert len(bundled) >= 18
    for name in [*bundled, "SHA256SUMS"]:
        assert f"gaussify/data/files/{name}" in names
    assert "gaussify/data/SOURCES.md" in names

    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, env=env
    )
    python, gaussify = venv / "bin" / "python", venv / "bin" / "gaussify"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", f"{wheel}[plots]"],
        check=True,
        env=env,
        capture_output=True,
    )
    where = subprocess.run(
        [str(python), "-c", "import gaussify; print(gaussify.__file__)"],
        check=True,
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout.strip()
    assert Path(where).is_relative_to(venv)  # the wheel's copy, not the checkout's
    out = tmp_path / "demo"
    run = subprocess.run(
        [str(gaussify), "demo", "--dataset", "iris", "--epochs", "3", "--out", str(out)],
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["dataset"] == "iris" and set(report["ood"]) >= {"map", "laplace-kron"}
