"""The posterior predictives behind the columns of Immer, Korzepa & Bauer (2021), Table 1.

Each function fits one column's posterior for one split and prior precision delta (or, for
Bayes by backprop, the whole delta grid at once) and returns the predictive probabilities on
``x_eval`` (validation rows, then test rows). The protocol, the selection of delta and the
records are :mod:`gaussify.experiments.uci_classification`'s; ``cfg`` is its ``Config``
(``num_samples``, ``glm_link``, ``refine_kwargs``, ``vi_*``, ``bbb_*``, ``width``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gaussify.last_layer.bbb import MeanFieldGrid
from gaussify.weight_space import Laplace
from gaussify.weight_space.glm_vi import GLMVI
from gaussify.weight_space.glm_vi_cached import CachedGLMVI

__all__ = ["bbb_probs", "diag_laplace_probs", "glm_vi_probs", "laplace_probs", "mlp"]


def mlp(d_in: int, num_classes: int, width: int = 50) -> nn.Module:
    """The Table 1 network: one hidden layer of ``width`` tanh units, ``num_classes`` logits."""
    return nn.Sequential(nn.Linear(d_in, width), nn.Tanh(), nn.Linear(width, num_classes))


def glm_vi_probs(
    model: nn.Module,
    structure: str,
    delta: float,
    data: tuple[Tensor, Tensor],
    x_eval: Tensor,
    cfg: Any,
    gen: int,
) -> Tensor:
    """GLM VI at theta*: q_0 = GLM Laplace, ``vi_steps`` full-batch NGVI steps of size
    ``vi_lr`` (``vi_lr_diag`` for the diagonal structure when set; thesis eq. 4.2-4.3 in the
    GLM), then the GLM predictive with the Monte Carlo link. The full
    structure steps with :class:`~gaussify.weight_space.glm_vi_cached.CachedGLMVI` (J*
    computed once; each step equals a ``GLMVI`` step up to round-off); the diagonal one keeps
    ``GLMVI``, whose steps are cheap, so that its recorded results stay bit-identical (at
    delta = 0.01 its float32 trajectory amplifies round-off differences)."""
    engine = CachedGLMVI if structure == "full" else GLMVI
    lr = cfg.vi_lr_diag if structure == "diag" and cfg.vi_lr_diag is not None else cfg.vi_lr
    vi = engine(
        model,
        "classification",
        structure,  # type: ignore[arg-type]
        prior_precision=delta,
        lr=lr,
        num_samples=cfg.vi_samples,
        antithetic=cfg.vi_samples % 2 == 0,
        seed=gen,
    )
    vi.init_laplace(data)
    for _ in range(cfg.vi_steps):
        vi.step(data)
    pred = vi.predict(
        x_eval,
        link=cfg.glm_link,  # type: ignore[arg-type]
        num_samples=cfg.num_samples,
        generator=torch.Generator().manual_seed(gen),
    )
    return _probs(pred.probs)


def laplace_probs(
    model: nn.Module,
    delta: float,
    data: tuple[Tensor, Tensor],
    x_eval: Tensor,
    cfg: Any,
    gen: int,
    probs: dict[str, Any],
) -> None:
    """BNN Laplace, GLM Laplace and GLM refine predictives of the full-GGN Laplace posterior
    at theta* (written into ``probs``; ``probs["refine_shift"]`` is ||mu - theta*||)."""
    x_tr, y_tr = data
    # One prior per fit: a Cholesky factor is cheaper than the eigendecomposition cache,
    # and float32 eigh can fail to converge on the near-singular GGN of a collapsed net.
    la = Laplace(model, "classification", structure="full", prior_precision=delta, eig_cache=False)
    la.fit((x_tr, y_tr))

    def predict(method: str) -> Tensor:
        link = {} if method == "nn" else {"link": cfg.glm_link}
        gen_ = torch.Generator().manual_seed(gen)
        pred = la.predict(
            x_eval, method=method, num_samples=cfg.num_samples, generator=gen_, **link
        )  # type: ignore[call-overload]
        return _probs(pred.probs)

    probs["bnn_laplace"] = predict("nn")
    probs["glm_laplace"] = predict("glm")
    if hasattr(la, "refine") and "glm_refine" in cfg.methods:
        la.refine((x_tr, y_tr), **cfg.refine_kwargs)
        probs["refine_shift"] = float((la.mean - la.theta_star).norm())
        probs["glm_refine"] = predict("glm")


def diag_laplace_probs(
    model: nn.Module,
    delta: float,
    data: tuple[Tensor, Tensor],
    x_eval: Tensor,
    cfg: Any,
    gen: int,
) -> Tensor:
    """GLM predictive of the diagonal-GGN Laplace posterior at theta* after the GLM mode
    refinement (``Laplace.refine``: quasi-Newton steps with the diagonal precision), the
    paper's "GLM Lapl diag" (App. B.3 refines the GLM mode of both Laplace columns)."""
    la = Laplace(model, "classification", structure="diag", prior_precision=delta)
    la.fit(data)
    la.refine(data, **cfg.refine_kwargs)
    pred = la.predict(
        x_eval,
        method="glm",
        link=cfg.glm_link,  # type: ignore[arg-type]
        num_samples=cfg.num_samples,
        generator=torch.Generator().manual_seed(gen),
    )
    return _probs(pred.probs)


def bbb_probs(
    deltas: Sequence[float],
    data: tuple[Tensor, Tensor],
    x_eval: Tensor,
    num_classes: int,
    cfg: Any,
    split: int,
) -> Tensor:
    """Bayes by backprop (:class:`~gaussify.last_layer.bbb.MeanFieldGrid`) for every delta
    of the grid at once, means started at the MAP's initialisation; ``bbb_epochs`` full-batch
    Adam steps at ``bbb_lr`` (cosine-decayed), one local-reparameterisation draw per step;
    predictive probabilities of ``num_samples`` draws, (len(deltas), N_eval, C)."""
    torch.manual_seed(split)
    model = mlp(data[0].shape[1], num_classes, cfg.width)
    grid = MeanFieldGrid(model, deltas, "classification", init_std=cfg.bbb_init_std)
    grid.fit(data, epochs=cfg.bbb_epochs, lr=cfg.bbb_lr, seed=split, cosine=True)
    torch.manual_seed(10_000 + split)
    return grid.predict_probs(x_eval, cfg.num_samples)


def _probs(p: Tensor | None) -> Tensor:
    assert p is not None
    return p.detach()
