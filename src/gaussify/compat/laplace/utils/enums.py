"""laplace-torch's ``laplace.utils.enums`` (see :mod:`gaussify.compat.laplace.enums`)."""

from gaussify.compat.laplace.enums import *  # noqa: F403
from gaussify.compat.laplace.enums import __all__  # noqa: F401
