"""Every ```python block of the docs runs, so an example cannot rot.

Each page's blocks run in order in one namespace (a page reads as one script: later blocks may
use names from earlier ones), in a fresh temporary directory holding an empty
``docs/figures/`` (examples that save a figure write there, not into the repository), with
matplotlib's Agg backend. A block preceded by ``<!-- no-run: reason -->`` is skipped: only
signature summaries and before/after columns that are not Python carry it, and the reason is
required. Pages whose examples take more than a few seconds are marked slow (run them with
``pytest -m slow tests/test_docs_examples.py``); the default ones take well under 60 s together.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"

#: pages whose examples train networks for tens of seconds (measured on the shared 2-core box)
SLOW_PAGES = {
    "approx_likelihoods.md",
    "function_space.md",
    "laplace.md",
    "ngvi.md",
    "vbll.md",
}

_FENCE = re.compile(
    r"(?P<marker><!--\s*no-run:(?P<reason>[^>]*?)-->\s*\n)?^```python[^\n]*\n(?P<code>.*?)^```",
    flags=re.DOTALL | re.MULTILINE,
)


def python_blocks(text: str) -> list[tuple[str, str | None]]:
    """The ```python blocks of a Markdown page in order, as ``(code, no_run_reason)``.

    ``no_run_reason`` is the text of a ``<!-- no-run: reason -->`` comment on the line right
    before the fence (None without one); an empty reason is an error."""
    blocks = []
    for match in _FENCE.finditer(text):
        reason = match.group("reason")
        if match.group("marker") is not None:
            reason = reason.strip()
            if not reason:
                line = text.count("\n", 0, match.start()) + 1
                raise ValueError(f"line {line}: <!-- no-run: --> needs a reason")
        blocks.append((match.group("code"), reason))
    return blocks


def run_page(path: Path, workdir: Path) -> int:
    """Run the runnable blocks of ``path`` in order in one namespace inside ``workdir``;
    return how many ran. An exception propagates with the page and block in its traceback."""
    import matplotlib

    matplotlib.use("Agg")
    (workdir / "docs" / "figures").mkdir(parents=True, exist_ok=True)
    namespace: dict[str, object] = {"__name__": "__docs_example__"}
    cwd = Path.cwd()
    os.chdir(workdir)
    ran = 0
    try:
        for index, (code, reason) in enumerate(python_blocks(path.read_text())):
            if reason is None:
                exec(compile(code, f"{path.name} [python block {index + 1}]", "exec"), namespace)
                ran += 1
    finally:
        os.chdir(cwd)
        import matplotlib.pyplot as plt

        plt.close("all")
    return ran


def _pages() -> list:
    pages = []
    for path in sorted(DOCS.rglob("*.md")):
        if not python_blocks(path.read_text()):
            continue
        name = str(path.relative_to(DOCS))
        marks = [pytest.mark.slow] if name in SLOW_PAGES else []
        pages.append(pytest.param(path, id=name, marks=marks))
    return pages


@pytest.mark.parametrize("page", _pages())
def test_docs_page_examples_run(page: Path, tmp_path: Path) -> None:
    assert run_page(page, tmp_path) >= 1, f"{page.name}: every block is marked no-run"


def test_block_extraction_and_no_run_marker() -> None:
    text = (
        "intro\n\n```python\na = 1\n```\n\n<!-- no-run: a signature, not code -->\n"
        "```python\nf(x, *, y) -> z\n```\n\n```bash\necho no\n```\n```python\nb = a + 1\n```\n"
    )
    assert python_blocks(text) == [
        ("a = 1\n", None),
        ("f(x, *, y) -> z\n", "a signature, not code"),
        ("b = a + 1\n", None),
    ]
    with pytest.raises(ValueError, match=r"line 1: <!-- no-run: --> needs a reason"):
        python_blocks("<!-- no-run: -->\n```python\nx\n```\n")


def test_page_blocks_share_one_namespace_and_skip_no_run(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nfrom pathlib import Path\nx = 2\n```\n"
        "<!-- no-run: would fail -->\n```python\nraise RuntimeError\n```\n"
        "```python\nPath('docs/figures/out.txt').write_text(str(x * 21))\n```\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    assert run_page(page, work) == 2
    assert (work / "docs" / "figures" / "out.txt").read_text() == "42"
    page.write_text("```python\ny = undefined_name\n```\n")
    with pytest.raises(NameError, match="undefined_name"):
        run_page(page, work)


def test_every_example_page_is_collected_and_no_run_markers_stay_few() -> None:
    pages = {p.id for p in _pages()}
    assert {"getting-started.md", "laplace.md", "vbll.md", "migrating.md"} <= pages
    assert pages >= SLOW_PAGES, "a slow page lost its examples: update SLOW_PAGES"
    skipped = [
        (path.name, reason)
        for path in DOCS.rglob("*.md")
        for _, reason in python_blocks(path.read_text())
        if reason is not None
    ]
    # ngvi's signature summary and migrating's two before/after columns
    assert len(skipped) <= 3, skipped


def _api_directives() -> set[str]:
    """The ``::: target`` directives of the API pages (what mkdocstrings renders)."""
    found = set()
    for path in (DOCS / "api").glob("*.md"):
        found |= set(re.findall(r"^:::\s*(\S+)", path.read_text(), flags=re.MULTILINE))
    return found


def test_every_public_name_has_an_api_page() -> None:
    import inspect

    import gaussify

    directives = _api_directives()
    missing = []
    for name in gaussify.__all__:
        obj = getattr(gaussify, name)
        home = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", "")
        if f"gaussify.{name}" not in directives and home not in directives:
            missing.append(name)
    assert missing == [], f"public names without an API page (add a ::: directive): {missing}"
    # every directive names something importable, so a renamed object fails here, not in mkdocs
    for target in directives:
        module, _, attr = target.rpartition(".")
        try:
            obj = importlib.import_module(target)
        except ImportError:
            obj = getattr(importlib.import_module(module), attr, None)
        assert obj is not None, f"docs/api: ::: {target} does not exist"
