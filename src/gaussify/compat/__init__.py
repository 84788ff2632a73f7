"""Drop-in compatibility layers: laplace-torch's and vbll's public APIs on gaussify.

``from gaussify.compat.laplace import Laplace`` replaces ``from laplace import Laplace``;
``from gaussify.compat import vbll`` replaces ``import vbll``. See docs/migrating.md.
"""

from gaussify.compat import laplace, vbll

__all__ = ["laplace", "vbll"]
