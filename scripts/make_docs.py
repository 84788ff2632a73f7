"""Make every figure of the docs site from one place: ``docs/figures/*.png`` and the site
screenshots under ``docs/figures/site/``. No figure of the docs is drawn by hand.

    python scripts/make_docs.py --list              # the builders and what each writes
    python scripts/make_docs.py                     # the quick builders (minutes on one core)
    python scripts/make_docs.py laplace vbll site   # only these
    python scripts/make_docs.py --all               # also the paper reproductions (an hour+)

Each builder is one command: the per-family ``scripts/make_*_docs.py`` (which also run their
page's example as written), the workflow examples in ``docs/examples/``, ``gaussify demo``
(its PNGs are copied to ``docs/figures/demo_<name>.png``), the experiments behind the
reproduction figures (``--all`` only: their protocols take tens of minutes), and ``site``: build
the site with ``mkdocs build --strict``, serve it locally and screenshot the home page and the
``Laplace`` API page in headless chromium (``scripts/site_browser.py``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "figures"
SITE_SHOTS = FIGURES / "site"
PY = sys.executable
RESULTS = ROOT / "benchmarks" / "results"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MPLBACKEND", "Agg")
    return env


def _run(*cmd: str | Path) -> None:
    print("  $", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT, env=_env())


def _experiment(name: str, figure: str, *extra: str) -> Callable[[], None]:
    return lambda: _run(
        PY, "-m", f"gaussify.experiments.{name}", *extra,
        "--output", RESULTS / f"experiments_{name}.json", "--figure", FIGURES / figure,
    )  # fmt: skip


def demo() -> None:
    """``gaussify demo`` in a scratch folder; its PNGs become ``docs/figures/demo_<name>.png``."""
    with tempfile.TemporaryDirectory(prefix="gaussify-demo-") as tmp:
        out = Path(tmp) / "demo"
        _run(PY, "-m", "gaussify.cli", "demo", "--out", out)
        for png in sorted(out.glob("*.png")):
            shutil.copyfile(png, FIGURES / f"demo_{png.name}")
            print(f"  wrote docs/figures/demo_{png.name}")


def site() -> None:
    """Build the site (strict), serve it and screenshot the home and the Laplace API pages."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("site_browser", ROOT / "scripts/site_browser.py")
    assert spec is not None and spec.loader is not None
    site_browser = importlib.util.module_from_spec(spec)
    sys.modules["site_browser"] = site_browser  # dataclasses look their module up there
    spec.loader.exec_module(site_browser)

    with tempfile.TemporaryDirectory(prefix="gaussify-site-") as tmp:
        built = Path(tmp) / "site"
        seconds = site_browser.build_site(built)
        print(f"  mkdocs build --strict: {seconds:.1f} s")
        with site_browser.serve(built) as server:
            for name, path in [("home.png", ""), ("api_laplace.png", "api/laplace/")]:
                site_browser.render(server.url + path, screenshot=SITE_SHOTS / name)
                print(f"  wrote {(SITE_SHOTS / name).relative_to(ROOT)}")


#: name -> (what it writes, builder, quick?)
BUILDERS: dict[str, tuple[str, Callable[[], None], bool]] = {
    "laplace": (
        "laplace_banana.png (runs laplace.md's example)",
        lambda: _run(PY, "scripts/make_laplace_docs.py", "--no-tables"),
        True,
    ),
    "function_space": (
        "function_space_banana.png (runs function_space.md's example)",
        lambda: _run(PY, "scripts/make_function_space_docs.py", "--no-tables"),
        True,
    ),
    "explain": (
        "function_space_explain.png",
        lambda: _run(PY, "scripts/make_explain_figure.py"),
        True,
    ),
    "ngvi": (
        "ngvi_regression.png, ngvi_banana.png and the ngvi.md table",
        lambda: _run(PY, "scripts/make_ngvi_docs.py"),
        True,
    ),
    "vbll": (
        "vbll_regression.png, vbll_generative.png (runs vbll.md's example)",
        lambda: _run(PY, "scripts/make_vbll_docs.py"),
        True,
    ),
    "approx": (
        "approx_densities.png, approx_pseudo_targets.png, approx_streaming.png",
        lambda: _run(PY, "scripts/make_approx_docs.py"),
        True,
    ),
    "workflows": (
        "workflow_{lora,subnetwork,bo,continual}.png (docs/examples/*.py)",
        lambda: [
            _run(PY, f"docs/examples/{name}.py")
            for name in (
                "lora_transformer",
                "subnetwork_inference",
                "bayesian_optimisation",
                "continual_learning",
            )
        ],
        True,
    ),
    "demo": ("demo_<name>.png from `gaussify demo`", demo, True),
    "reproductions": (
        "docs/reproductions.md (from benchmarks/paper_values.toml and the result JSONs)",
        lambda: _run(PY, "scripts/make_reproductions.py"),
        True,
    ),
    "site": ("site/home.png, site/api_laplace.png (mkdocs + chromium)", site, True),
    "marglik_selection": (
        "laplace_marglik_selection.png",
        _experiment("marglik_selection", "laplace_marglik_selection.png"),
        False,
    ),
    "approx_gp": (
        "approx_gp_landscape.png",
        _experiment("approx_gp_classification", "approx_gp_landscape.png"),
        False,
    ),
    "approx_training": (
        "approx_training_table.png",
        _experiment("approx_training", "approx_training_table.png"),
        False,
    ),
    "approx_streaming": (
        "approx_streaming_fig4.png",
        _experiment("approx_streaming", "approx_streaming_fig4.png"),
        False,
    ),
    "approx_active": (
        "approx_active.png",
        _experiment("approx_active", "approx_active.png"),
        False,
    ),
    "function_space_toy": (
        "function_space_toy.png",
        _experiment("function_space_toy", "function_space_toy.png"),
        False,
    ),
    "vbll_halfmoons": (
        "vbll_halfmoons.png",
        _experiment("vbll_classification", "vbll_halfmoons.png", "--seeds", "3"),
        False,
    ),
    "distributed": (
        "distributed_speedup.png (torchrun, several processes)",
        lambda: _run(PY, "benchmarks/distributed_fit.py"),
        False,
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="builders to run (default: the quick ones)")
    parser.add_argument("--all", action="store_true", help="every builder, reproductions too")
    parser.add_argument("--list", action="store_true", help="list the builders and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, (writes, _, quick) in BUILDERS.items():
            print(f"{name:20s} {'quick' if quick else 'long '}  {writes}")
        return 0
    unknown = [n for n in args.names if n not in BUILDERS]
    if unknown:
        parser.error(f"names: unknown builder(s) {unknown}; choose from {sorted(BUILDERS)}")
    names = args.names or [n for n, (_, _, quick) in BUILDERS.items() if quick or args.all]
    for name in names:
        start = time.perf_counter()
        print(f"[{name}] {BUILDERS[name][0]}", flush=True)
        BUILDERS[name][1]()
        print(f"[{name}] {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
