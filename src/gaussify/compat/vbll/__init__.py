"""vbll's layers under vbll's names: ``from gaussify.compat import vbll`` replaces
``import vbll``.

Each class takes vbll's constructor arguments with vbll's meaning (``prior_scale`` is divided by
the feature width as vbll does: by ``in_features`` in ``Regression`` / ``HetRegression`` /
``HetClassification``, by ``in_features / 2`` in ``tRegression`` / ``DiscClassification``, not at
all in ``GenClassification``; gaussify's own heads in :mod:`gaussify.last_layer` take the paper's
prior variance instead), registers vbll's parameter names (``W_mean``, ``W_logdiag``,
``W_offdiag``, ``noise_logdiag``, ``noise_log_dof``, ``M_mean``, ``mu_mean``, ``alpha``, ...), so a
vbll ``state_dict`` loads with ``load_state_dict``, and its ``forward`` returns a
:class:`VBLLReturn` with ``.predictive`` (a torch distribution), ``.train_loss_fn(y)``,
``.val_loss_fn(y)`` and ``.ood_scores``, equal to vbll's for the same parameters and random
draws (tests/test_compat_vbll.py). Modules mirror vbll's: :mod:`.layers` (``regression``,
``classification``) and :mod:`.rows` (q(W) for vbll's parameterizations).
"""

from gaussify.compat.vbll import layers
from gaussify.compat.vbll.layers import *  # noqa: F403 (vbll's top-level names are its layers)

__all__ = [*layers.__all__, "layers"]
