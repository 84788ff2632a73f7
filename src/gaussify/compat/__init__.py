"""Drop-in compatibility layers: laplace-torch's and vbll's public APIs on gaussify's engines.

``from gaussify.compat.laplace import Laplace`` replaces ``from laplace import Laplace``;
``from gaussify.compat import vbll`` replaces ``import vbll``. See docs/migrating.md.
"""

from gaussify.compat import laplace

__all__ = ["laplace"]
