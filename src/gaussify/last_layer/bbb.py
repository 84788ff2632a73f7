"""Bayes by backprop: mean-field Gaussian VI over all weights (Blundell et al. 2015).

q(theta) = N(m, diag(s^2)) with s = softplus(rho), prior p(theta) = N(0, delta^-1 I). Training
minimises the negative ELBO per example,

    L(m, rho) = (1/N) [ KL(q || p) - (N/B) (1/S) sum_s sum_b log p(y_b | f(x_b; theta_s)) ],

    KL(q || p) = 1/2 sum_i [ delta (s_i^2 + m_i^2) - 1 - log(delta s_i^2) ],

with reparameterised draws theta_s = m + s * eps_s, so that the gradients in (m, rho) are
unbiased. The draws use the local reparameterisation trick (Kingma et al. 2015): for a linear
layer the pre-activations z = W a + b are Gaussian given the layer's input a, with mean
m_W a + m_b and variance s_W^2 a^2 + s_b^2 (elementwise squares), so one independent z per
example is drawn instead of one weight matrix per batch. For one input this is the same
distribution of the network's outputs as theta ~ q (the rows of a weight matrix are
independent under q), so the predictive E_q[p(y | x, theta)] of each input is estimated with
it too.

:class:`MeanFieldGrid` holds G such networks of one architecture, one per prior precision
delta_g (the grid a validation set selects from), as stacked parameters (G, ...): one step
evaluates all G networks with ``torch.func.vmap`` and Adam, being elementwise, updates each
exactly as if it were trained alone on its own loss. The layers are
:class:`LocalReparamLinear`, a :class:`~gaussify.last_layer.MeanFieldLinear` (its
parameterisation) with the local-reparameterisation forward.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vmap

from gaussify.last_layer.bnn import MeanFieldLinear, to_mean_field
from gaussify.likelihoods import Likelihood, get_likelihood
from gaussify.validation import check_count

__all__ = ["LocalReparamLinear", "MeanFieldGrid"]


class LocalReparamLinear(MeanFieldLinear):
    """A :class:`~gaussify.last_layer.MeanFieldLinear` whose sampling forward draws the
    pre-activations, z ~ N(m_W x + m_b, s_W^2 x^2 + s_b^2) independently per row (local
    reparameterisation trick); ``sample=False`` uses the means."""

    def forward(self, x: Tensor) -> Tensor:
        mean = F.linear(x, self.weight_mean, self.bias_mean)
        if not self.sample:
            return mean
        var = F.linear(x.square(), F.softplus(self.weight_rho).square())
        if self.bias_rho is not None:
            var = var + F.softplus(self.bias_rho).square()
        return mean + var.sqrt() * torch.randn_like(mean)


def _check_priors(prior_precisions: Sequence[float]) -> list[float]:
    values = list(prior_precisions)
    if not values:
        raise ValueError("prior_precisions: expected at least one value")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise TypeError(f"prior_precisions: expected numbers, got {type(v).__name__}")
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"prior_precisions: every value must be finite and > 0, got {v!r}")
    return [float(v) for v in values]


class MeanFieldGrid:
    """G Bayes-by-backprop networks (module docstring), one per ``prior_precisions[g]``.

    ``model``: the architecture; its ``nn.Linear`` layers become mean-field layers with means
    at ``model``'s weights (the same start for every g) and standard deviations ``init_std``.
    Parameters of other layers are point estimates without a KL term. ``likelihood``:
    "classification", "regression", ... or a likelihood object.
    """

    def __init__(
        self,
        model: nn.Module,
        prior_precisions: Sequence[float],
        likelihood: str | Likelihood = "classification",
        *,
        init_std: float = 1e-3,
        sigma_noise: float = 1.0,
    ) -> None:
        self.prior_precisions = _check_priors(prior_precisions)
        self.likelihood = (
            get_likelihood(likelihood, sigma_noise=sigma_noise)
            if isinstance(likelihood, str)
            else likelihood
        )
        self.base = to_mean_field(model, 1.0, init_std, layer=LocalReparamLinear)
        g = len(self.prior_precisions)
        self.params: dict[str, Tensor] = {
            name: p.detach().unsqueeze(0).repeat(g, *([1] * p.ndim)).requires_grad_(True)
            for name, p in self.base.named_parameters()
        }
        #: (mean name, rho name) of every mean-field tensor
        self.pairs = [
            (name, name[: -len("_mean")] + "_rho")
            for name in self.params
            if name.endswith("_mean") and name[: -len("_mean")] + "_rho" in self.params
        ]
        p0 = self.params[next(iter(self.params))]
        self._delta = torch.tensor(self.prior_precisions, dtype=p0.dtype, device=p0.device)

    def kl(self) -> Tensor:
        """KL(q_g || N(0, delta_g^-1 I)) of every network, (G,) (module docstring)."""
        total = torch.zeros_like(self._delta)
        for mean_name, rho_name in self.pairs:
            mean, rho = self.params[mean_name], self.params[rho_name]
            delta = self._delta.reshape(-1, *([1] * (mean.ndim - 1)))
            var = F.softplus(rho).square()
            term = delta * (var + mean.square()) - 1.0 - (delta * var).log()
            total = total + 0.5 * term.flatten(1).sum(1)
        return total

    def _outputs(self, x: Tensor) -> Tensor:
        """One local-reparameterisation draw of every network's outputs, (G, N, C)."""

        def run(params: dict[str, Tensor]) -> Tensor:
            return functional_call(self.base, params, (x,))

        return vmap(run, randomness="different")(self.params)

    def loss(
        self, x: Tensor, y: Tensor, num_data: int | None = None, num_samples: int = 1
    ) -> Tensor:
        """The negative ELBO per example of each network on the batch ``(x, y)`` of a data set
        of ``num_data`` examples (default: the batch is the data set), with ``num_samples``
        draws S; (G,)."""
        num_samples = check_count(num_samples, "num_samples")
        n = check_count(num_data, "num_data") if num_data is not None else int(x.shape[0])
        total = torch.zeros_like(self._delta)
        for _ in range(num_samples):
            f = self._outputs(x)
            y_all = y.repeat(f.shape[0], *([1] * (y.ndim - 1)))
            log_lik = self.likelihood.log_prob(f.flatten(0, 1), y_all)
            total = total + log_lik.view(f.shape[0], -1).sum(1)
        expected = total / num_samples * (n / x.shape[0])
        return (self.kl() - expected) / n

    def fit(
        self,
        data: tuple[Tensor, Tensor],
        epochs: int = 5000,
        lr: float = 1e-3,
        num_samples: int = 1,
        seed: int | None = 0,
        cosine: bool = False,
    ) -> Tensor:
        """Full-batch Adam on :meth:`loss` for ``epochs`` steps of size ``lr`` (Immer et al.
        2021, App. B.3: 5000 steps at 1e-3), cosine-decayed to 0 with ``cosine``. Adam acts
        elementwise, so each network follows its own Adam trajectory. Returns the loss
        history (epochs, G); raises ``FloatingPointError`` if a loss is not finite."""
        epochs = check_count(epochs, "epochs")
        if isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0:
            raise ValueError(f"lr: must be a number > 0, got {lr!r}")
        x, y = data
        if seed is not None:
            torch.manual_seed(seed)
        opt = torch.optim.Adam(list(self.params.values()), lr=lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs) if cosine else None
        history = []
        for step in range(epochs):
            opt.zero_grad(set_to_none=True)
            losses = self.loss(x, y, num_samples=num_samples)
            if not bool(torch.isfinite(losses).all()):
                raise FloatingPointError(f"MeanFieldGrid.fit: a loss is not finite at step {step}")
            losses.sum().backward()
            opt.step()
            if sched is not None:
                sched.step()
            history.append(losses.detach())
        return torch.stack(history)

    @torch.no_grad()
    def predict_probs(self, x: Tensor, num_samples: int = 1000) -> Tensor:
        """Monte Carlo predictive E_q[softmax f(x; theta)] of every network over
        ``num_samples`` draws, (G, N, C)."""
        num_samples = check_count(num_samples, "num_samples")
        total = torch.zeros((), dtype=x.dtype, device=x.device)
        for _ in range(num_samples):
            total = total + torch.softmax(self._outputs(x), dim=-1)
        return total / num_samples

    def network(self, index: int) -> nn.Module:
        """Network ``index`` as a module of :class:`LocalReparamLinear` layers with its
        prior (``prior_std = delta^-1/2``): its ``kl()`` and forward are those of row g."""
        net = copy.deepcopy(self.base)
        with torch.no_grad():
            for name, p in net.named_parameters():
                p.copy_(self.params[name][index])
        for m in net.modules():
            if isinstance(m, MeanFieldLinear):
                m.prior_std = self.prior_precisions[index] ** -0.5
        return net
