"""Post-hoc last layers on a frozen network (Harrison et al. 2024, App. C.6-C.7, F).

* :func:`extract_features` / :func:`fit_posthoc` -- fit any VBLL head on the features of a
  frozen (e.g. MAP-trained) network: the paper's "MAP" baseline, a Bayesian last layer fitted
  to fixed features (Snoek et al. 2015), here with the VBLL objective so every head and
  parameterization works. The features are computed once and the head is optimised alone.
* :func:`class_covariance_map` / :class:`GVBLLMAP` -- G-VBLL-MAP: per-class MAP noise
  covariances of fixed features under the inverse-Wishart prior (App. C.7, eq. 77) and the
  feature-density OOD score they give, normalised by the density under the feature prior.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from gaussify.batches import Batches, as_batches
from gaussify.last_layer.base import VBLLHead, check_labels, check_positive
from gaussify.last_layer.bounds import gaussian_log_prob
from gaussify.last_layer.covariance import Dense
from gaussify.last_layer.vbll_generative import VBLLGenerative
from gaussify.validation import check_count, check_finite, validated_batches

__all__ = ["GVBLLMAP", "class_covariance_map", "extract_features", "fit_posthoc"]


@torch.no_grad()
def extract_features(
    backbone: nn.Module, data: Batches, batch_size: int = 256
) -> tuple[Tensor, Tensor]:
    """Features ``phi (N, D)`` and targets ``y`` of all of ``data`` under ``backbone`` in eval
    mode, without gradients (restores the module's train/eval mode afterwards)."""
    batches = validated_batches(data, batch_size, model=backbone, owner="extract_features")
    was_training = backbone.training
    backbone.eval()
    try:
        phis, ys = [], []
        for x, y in batches:
            phis.append(backbone(x))
            ys.append(y)
    finally:
        backbone.train(was_training)
    return torch.cat(phis), torch.cat(ys)


def fit_posthoc(
    head: VBLLHead,
    phi: Tensor,
    y: Tensor,
    *,
    optimizer: Literal["lbfgs", "adam"] = "lbfgs",
    max_iter: int = 500,
    lr: float | None = None,
    batch_size: int | None = None,
    seed: int | None = None,
) -> list[float]:
    """Fit ``head`` on fixed features ``phi (N, D)`` and targets ``y`` by minimising its
    ``train_loss`` (only the head's parameters move); returns the loss history.

    ``"lbfgs"`` runs full-batch L-BFGS (strong Wolfe) for ``max_iter`` iterations (``lr``
    default 1); ``"adam"`` runs ``max_iter`` epochs of minibatches of ``batch_size`` (full
    batch when None; ``lr`` default 1e-2), shuffled with ``seed``. A generative head gets its
    Dirichlet class counts from ``y`` first. Pass ``regularization_weight = 1/N`` to the head
    for the ELBO.
    """
    if optimizer not in ("lbfgs", "adam"):
        raise ValueError(f"optimizer: expected 'lbfgs' or 'adam', got {optimizer!r}")
    max_iter = check_count(max_iter, "max_iter")
    if batch_size is not None:
        batch_size = check_count(batch_size, "batch_size")
    phi = head.check_features(phi.detach())
    if phi.shape[0] == 0:
        raise ValueError("phi: contains no examples")
    head.check_targets(y, phi.shape[0])
    if isinstance(head, VBLLGenerative):
        head.set_class_counts(y)
    params = [p for p in head.parameters() if p.requires_grad]
    history: list[float] = []
    if optimizer == "lbfgs":
        opt = torch.optim.LBFGS(
            params,
            lr=1.0 if lr is None else check_positive(lr, "lr"),
            max_iter=max_iter,
            history_size=20,
            line_search_fn="strong_wolfe",
        )

        def closure() -> Tensor:
            opt.zero_grad(set_to_none=True)
            loss = head.train_loss(phi, y)
            loss.backward()
            history.append(float(loss.detach()))
            return loss

        opt.step(closure)
        return history
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    batches = as_batches(
        (phi, y), batch_size=batch_size or phi.shape[0], shuffle=True, generator=generator
    )
    adam = torch.optim.Adam(params, lr=1e-2 if lr is None else check_positive(lr, "lr"))
    for _ in range(max_iter):
        total, seen = 0.0, 0
        for xb, yb in batches:
            adam.zero_grad(set_to_none=True)
            loss = head.train_loss(xb, yb)
            loss.backward()
            adam.step()
            total += float(loss.detach()) * xb.shape[0]
            seen += xb.shape[0]
        history.append(total / seen)
    return history


def class_covariance_map(
    phi: Tensor, y: Tensor, num_classes: int, dof: float, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-class empirical means and MAP noise covariances of fixed features (eq. 77):

    ``Sigma_k = (M + sum_{t: y_t = k} (phi_t - mu_k)(phi_t - mu_k)^T) / (T_k + nu + D + 1)``

    with ``mu_k`` the class mean of the features and ``M = scale * I``. Returns ``means (K,
    D)``, ``covs (K, D, D)`` and ``counts (K,)``. A class without examples keeps mean 0 and the
    prior mode ``M / (nu + D + 1)``. One pass over the data, O(N D^2).
    """
    y = check_labels(y, phi.shape[0], num_classes)
    dof, scale = check_positive(dof, "dof"), check_positive(scale, "scale")
    dim = phi.shape[-1]
    onehot = torch.nn.functional.one_hot(y, num_classes).to(phi)  # (N, K)
    counts = onehot.sum(0)
    means = (onehot.mT @ phi) / counts.clamp_min(1.0).unsqueeze(-1)
    centred = phi.unsqueeze(1) - means  # (N, K, D)
    scatter = torch.einsum("nk,nki,nkj->kij", onehot, centred, centred)
    eye = torch.eye(dim, dtype=phi.dtype, device=phi.device)
    covs = (scale * eye + scatter) / (counts + dof + dim + 1.0)[:, None, None]
    return means, covs, counts


class GVBLLMAP(nn.Module):
    """G-VBLL-MAP (App. C.7): class-wise Gaussian feature densities with MAP covariances,
    for OOD detection (the paper advises against predicting labels with them).

    ``log_density(phi) = LSE_k[log N(phi | mu_k, Sigma_k) + log p(y = k)]`` (eq. 74 with point
    estimates), and ``ood_score(phi) = -(log_density(phi) - log N(phi | 0, prior_cov))`` when a
    feature-prior covariance is given (the normalisation the paper takes from Ren et al.
    2019, 2021), else ``-log_density(phi)``. Build with :meth:`from_head` (prior ``N(0, S_0 +
    Sigma)`` of a trained G-VBLL head) or ``GVBLLMAP(...).fit(phi, y)``.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        dof: float = 1.0,
        wishart_scale: float = 1.0,
        dirichlet_prior: float = 1.0,
    ) -> None:
        super().__init__()
        self.in_features, self.num_classes = in_features, num_classes
        self.dof = check_positive(dof, "dof")
        self.wishart_scale = check_positive(wishart_scale, "wishart_scale")
        self.dirichlet_prior = check_positive(dirichlet_prior, "dirichlet_prior")
        self.register_buffer("means", torch.zeros(num_classes, in_features))
        self.register_buffer("scale_tril", torch.eye(in_features).repeat(num_classes, 1, 1))
        self.register_buffer("log_class_prior", torch.full((num_classes,), -math.log(num_classes)))
        self.register_buffer("prior_tril", torch.eye(in_features).unsqueeze(0))
        self.register_buffer("normalized", torch.tensor(False))

    @torch.no_grad()
    def fit(self, phi: Tensor, y: Tensor, prior_cov: Tensor | None = None) -> GVBLLMAP:
        """Estimate the class densities from features ``phi (N, D)`` and labels ``y (N,)``;
        ``prior_cov (D, D)`` is the feature-prior covariance used to normalise the score."""
        if phi.dim() != 2 or phi.shape[-1] != self.in_features:
            raise ValueError(
                f"phi: expected features of shape (N, {self.in_features}), got {tuple(phi.shape)}"
            )
        if phi.shape[0] == 0:
            raise ValueError("phi: contains no examples")
        check_finite(phi, "phi")
        means, covs, counts = class_covariance_map(
            phi, y, self.num_classes, self.dof, self.wishart_scale
        )
        alpha = counts + self.dirichlet_prior
        self.means = means
        self.scale_tril = torch.linalg.cholesky(covs)
        self.log_class_prior = alpha.log() - alpha.sum().log()
        self.normalized = torch.tensor(prior_cov is not None, device=phi.device)
        if prior_cov is not None:
            self.prior_tril = torch.linalg.cholesky(prior_cov.to(phi)).unsqueeze(0)
        return self

    @classmethod
    def from_head(cls, head: VBLLGenerative, phi: Tensor, y: Tensor) -> GVBLLMAP:
        """Calibrate on the features of a trained G-VBLL head with its inverse-Wishart and
        Dirichlet hyperparameters, normalising by its feature prior ``N(0, S_0 + Sigma)``."""
        model = cls(
            head.in_features, head.out_features, head.dof, head.wishart_scale, head.dirichlet_prior
        )
        model = model.to(phi)
        with torch.no_grad():
            sigma = head.noise_cov.covariance.to(phi)
            eye = torch.eye(head.in_features, dtype=phi.dtype, device=phi.device)
            return model.fit(phi.detach(), y, prior_cov=head.prior_scale * eye + sigma)

    def class_log_joint(self, phi: Tensor) -> Tensor:
        """``log N(phi | mu_k, Sigma_k) + log p(y = k)``, (N, K)."""
        residual = phi.unsqueeze(-2) - self.means
        return gaussian_log_prob(residual, Dense(self.scale_tril)) + self.log_class_prior

    def log_density(self, phi: Tensor) -> Tensor:
        """Feature log density, (N,)."""
        return torch.logsumexp(self.class_log_joint(phi), dim=-1)

    def ood_score(self, phi: Tensor) -> Tensor:
        """Higher = more out-of-distribution, (N,)."""
        score = -self.log_density(phi)
        if bool(self.normalized):
            score = score + gaussian_log_prob(phi.unsqueeze(-2), Dense(self.prior_tril))[..., 0]
        return score

    def probs(self, phi: Tensor) -> Tensor:
        """Class probabilities under the calibrated densities (over-confident, App. C.7)."""
        return self.class_log_joint(phi).softmax(-1)
