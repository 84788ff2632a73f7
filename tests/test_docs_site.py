"""The docs site builds (``mkdocs build --strict``) and renders in a real browser without a
missing image, stylesheet or script, and without a broken internal link or anchor.

The browser check is slow (one headless chromium per page); the link checker itself is tested
here on a small hand-made site in the default suite.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str) -> ModuleType:
    """Import ``scripts/<name>.py`` without putting scripts/ on sys.path."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


site_browser = _script("site_browser")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_broken_links_names_missing_files_and_anchors(tmp_path: Path) -> None:
    _write(
        tmp_path / "index.html",
        '<a href="guide/">ok</a><a href="guide/#setup">ok anchor</a>'
        '<a href="guide/#nope">bad anchor</a><a href="missing/">bad page</a>'
        '<img src="figures/a.png"><img src="figures/gone.png">'
        '<a href="https://example.org/x">external</a><a href="#top">self</a><p id="top"></p>',
    )
    _write(tmp_path / "guide" / "index.html", '<h2 id="setup">Setup</h2><a href="../">home</a>')
    _write(tmp_path / "figures" / "a.png", "png")
    _write(tmp_path / "404.html", '<a href="nowhere/">ignored</a>')
    assert site_browser.broken_links(tmp_path) == [
        "index.html: a.href -> guide/#nope (no id 'nope')",
        "index.html: a.href -> missing/ (missing file)",
        "index.html: img.src -> figures/gone.png (missing file)",
    ]


def test_served_site_records_missing_files(tmp_path: Path) -> None:
    import urllib.error
    import urllib.request

    _write(tmp_path / "index.html", "<p>hi</p>")
    with site_browser.serve(tmp_path) as server:
        assert urllib.request.urlopen(server.url).read() == b"<p>hi</p>"
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(server.url + "figures/gone.png")
    assert server.requests == [(200, "/"), (404, "/figures/gone.png")]


@pytest.mark.slow
def test_site_builds_strict_and_every_page_renders_in_chromium(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or shutil.which("mkdocs") is None:
        pytest.skip('mkdocs missing: pip install -e ".[docs]"')
    if site_browser.chromium() is None:
        pytest.skip("chromium missing: apt-get install -y chromium")
    site = tmp_path / "site"
    site_browser.build_site(site)  # raises on any strict-mode warning
    assert site_browser.broken_links(site) == []
    pages = site_browser.pages(site)
    names = {p.relative_to(site).as_posix() for p in pages}
    assert {"index.html", "api/laplace/index.html", "getting-started/index.html"} <= names
    with site_browser.serve(site) as server:
        for page in pages:
            folder = page.relative_to(site).parent.as_posix()
            url = server.url if folder == "." else f"{server.url}{folder}/"
            dom = site_browser.render(url)
            assert 'class="md-content"' in dom, f"{url}: not rendered"
            if folder == "api/laplace":
                assert "log_marginal_likelihood" in dom, "API page lost the generated members"
    missing = [(code, path) for code, path in server.requests if code >= 400]
    assert missing == [], f"the pages requested files the site does not have: {missing}"
    assert len(server.requests) > len(pages), "the browser fetched no images, CSS or scripts"


def test_hook_strips_sphinx_roles_to_code_spans() -> None:
    hooks = _script("mkdocs_hooks")
    html = (
        "see :class:<code>~gaussify.Predictive</code> and :func:<code>train_map</code>, "
        "not <code>:x:</code> or :meth:`raw`"
    )
    assert hooks.strip_sphinx_roles(html) == (
        "see <code>Predictive</code> and <code>train_map</code>, "
        "not <code>:x:</code> or :meth:`raw`"
    )
