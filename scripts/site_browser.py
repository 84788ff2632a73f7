"""The built docs site in a real browser: serve a built ``site/`` from a local http.server,
render pages in headless chromium (Debian's ``chromium``), record every request the pages make,
and check the internal links of the HTML.

Used by ``scripts/make_docs.py`` (the screenshots under ``docs/figures/site/``) and by
``tests/test_docs_site.py`` (every page renders without a missing image, stylesheet or script,
and every internal link and anchor resolves).
"""

from __future__ import annotations

import contextlib
import functools
import html.parser
import http.server
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urldefrag, urljoin, urlparse

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
)


def chromium() -> str | None:
    """The chromium executable on PATH, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def build_site(out: Path, strict: bool = True) -> float:
    """``mkdocs build [--strict]`` of the repository's mkdocs.yml into ``out``; seconds taken."""
    import time

    start = time.perf_counter()
    cmd = ["mkdocs", "build", "-q", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # no upgrade banner in the output
    subprocess.run([*cmd, "--strict"] if strict else cmd, check=True, cwd=ROOT, env=env)
    return time.perf_counter() - start


@dataclass
class Server:
    """A local http.server over a built site; ``requests`` holds (status, path) of each GET."""

    url: str
    requests: list[tuple[int, str]] = field(default_factory=list)


@contextlib.contextmanager
def serve(site: Path) -> Iterator[Server]:
    """Serve ``site`` on 127.0.0.1 (a free port) in a thread for the ``with`` block."""
    server_state = Server(url="")

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            server_state.requests.append((int(getattr(code, "value", code)), self.path))

        def log_message(self, format: str, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=str(site))
    )
    server_state.url = f"http://127.0.0.1:{httpd.server_address[1]}/"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield server_state
    finally:
        httpd.shutdown()
        httpd.server_close()


def render(url: str, *, screenshot: Path | None = None, size: tuple[int, int] = (1280, 900)) -> str:
    """Render ``url`` in headless chromium (fresh profile) and return the DOM after scripts ran;
    with ``screenshot``, write a PNG of the window instead (and return "")."""
    exe = chromium()
    if exe is None:
        raise FileNotFoundError("chromium not found: apt-get install -y chromium")
    with tempfile.TemporaryDirectory(prefix="gaussify-chromium-") as profile:
        cmd = [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=5000"]
        if screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            cmd += [f"--window-size={size[0]},{size[1]}", f"--screenshot={screenshot}", url]
        else:
            cmd += ["--dump-dom", url]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


_REFERENCES = {("a", "href"), ("img", "src"), ("link", "href"), ("script", "src")}


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[str, str]] = []  # (tag attribute, value)
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "id":
                self.ids.add(value)
            elif (tag, name) in _REFERENCES:
                self.refs.append((f"{tag}.{name}", value))


def pages(site: Path) -> list[Path]:
    """Every HTML page of a built site except the 404 page."""
    return sorted(p for p in site.rglob("*.html") if p.name != "404.html")


def _target(site: Path, page: Path, ref: str) -> tuple[Path | None, str]:
    """The file an internal reference points at (None for an external one) and its anchor."""
    base = "http://site/" + page.relative_to(site).as_posix()
    absolute, anchor = urldefrag(urljoin(base, ref))
    parsed = urlparse(absolute)
    if parsed.netloc != "site":
        return None, ""
    path = site / unquote(parsed.path).lstrip("/")
    if path.is_dir() or absolute.endswith("/"):
        path = path / "index.html"
    return path, anchor


def broken_links(site: Path) -> list[str]:
    """``page: tag.attr -> ref (why)`` for every internal link, image, stylesheet or script of
    the built HTML whose file is missing, or whose ``#anchor`` is not an id on the target."""
    parsed: dict[Path, _Links] = {}

    def parse(path: Path) -> _Links:
        if path not in parsed:
            parser = _Links()
            parser.feed(path.read_text(encoding="utf-8"))
            parsed[path] = parser
        return parsed[path]

    problems = []
    for page in pages(site):
        for kind, ref in parse(page).refs:
            if ref.startswith(("mailto:", "javascript:", "data:")):
                continue
            target, anchor = _target(site, page, ref)
            if target is None:
                continue
            where = f"{page.relative_to(site)}: {kind} -> {ref}"
            if not target.is_file():
                problems.append(f"{where} (missing file)")
            elif anchor and target.suffix == ".html" and anchor not in parse(target).ids:
                problems.append(f"{where} (no id {anchor!r})")
    return problems
