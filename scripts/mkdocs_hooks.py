"""mkdocs hooks of the docs site (``hooks:`` in mkdocs.yml).

The docstrings use Sphinx roles (``:class:`~gaussify.Predictive```); mkdocstrings renders them
as the role's name followed by inline code. ``on_page_content`` drops the role's name and the
``~`` (Sphinx's "show the last component"), leaving the code span.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|obj|exc):<code>(~)?([^<]*)</code>")


def _plain(match: re.Match[str]) -> str:
    target = match.group(2)
    if match.group(1):
        target = target.rsplit(".", 1)[-1]
    return f"<code>{target}</code>"


def strip_sphinx_roles(html: str) -> str:
    """``html`` with every ``:role:<code>[~]a.b.c</code>`` replaced by its code span."""
    return _ROLE.sub(_plain, html)


def on_page_content(html: str, **kwargs: Any) -> str:
    return strip_sphinx_roles(html)
