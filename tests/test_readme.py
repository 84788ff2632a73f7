"""The README's code: the quick start prints the same numbers on every run."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_block(section: str, language: str = "python") -> str:
    """The first ``language`` code block under the README heading ``## section``."""
    text = README.read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(rf"```{language}\n(.*?)```", body, re.S)
    assert match is not None, f"no {language} block under '## {section}'"
    return match.group(1)


def run_block(code: str) -> str:
    """Execute ``code`` in a fresh namespace and return what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
    return out.getvalue()


@pytest.mark.slow
def test_quick_start_prints_the_same_numbers_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The block as printed (about 10 s for the two runs on a loaded 2-core machine)."""
    monkeypatch.chdir(tmp_path)  # it saves la.pt into the working folder
    check_quick_start(readme_block("Quick start"), tmp_path)


def test_quick_start_with_two_epochs_prints_the_same_numbers_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same block with 2 MAP epochs instead of 60: the seeds are all it relies on."""
    monkeypatch.chdir(tmp_path)
    code = readme_block("Quick start")
    assert code.count("epochs=60") == 1
    check_quick_start(code.replace("epochs=60", "epochs=2"), tmp_path)


def check_quick_start(code: str, folder: Path) -> None:
    first = run_block(code)
    # the global generator is wherever the first run left it: only the block's own seeds count
    second = run_block(code)
    assert first == second
    lines = first.splitlines()
    assert len(lines) == 2 and lines[0].startswith("{'acc': ")
    assert float(lines[1]) < 0  # the log marginal likelihood
    assert (folder / "la.pt").is_file()


def test_readme_commands_install_what_they_run() -> None:
    """The demo draws figures (the plots extra); CI runs exactly the test command."""
    commands = re.findall(r"```bash\n(.*?)\n```", README.read_text(), re.S)
    demo = next(c for c in commands if "gaussify demo" in c)
    assert '-e ".[plots]"' in demo
    test = next(c for c in commands if "pytest" in c)
    assert '-e ".[test]"' in test
    ci = (README.parent / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == test
