"""Pure functions of natural-gradient VI (Immer thesis Ch. 4): the curvature blend of eq. 4.3,
the initial state Lambda_0, the Gaussian KL of the ELBO and the mean step-size safeguard.

They act on plain tensors and curvature state dicts (``gaussify.curvature``), so they are
tested on their own; :mod:`gaussify.weight_space.ngvi` composes them into the engine.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

__all__ = [
    "STRUCTURES",
    "Structure",
    "blend_curvature",
    "gaussian_kl",
    "initial_curvature_state",
    "mean_step_size",
    "output_quadratic",
]

Structure = Literal["full", "diag", "kron"]
STRUCTURES = ("full", "diag", "kron")


def blend_curvature(
    structure: str,
    state: dict[str, Tensor],
    batch: dict[str, Tensor],
    gamma: float,
    num_data: int,
) -> dict[str, Tensor]:
    """The data term of eq. 4.3: ``(1 - gamma) state + gamma * N * (per-example batch GGN)``.

    ``batch`` is the state of a curvature accumulated over ``batch["num_data"]`` rows (S
    samples times B examples), so N times its per-row mean is the unbiased minibatch estimate
    of the full-data GGN. For "kron" the factors of each layer are averaged separately: B as
    the moving average of N times the per-row output-gradient second moment, A as a weighted
    running mean of the input second moment (weight ``W.<path>``, which starts at 0 when q_0
    is the prior), so that with identical batches B kron A follows the exact ramp
    (1 - (1 - gamma)^t) G of the full structure; M = 1. Exact for gamma = 1.
    """
    rows = float(batch["num_data"])
    if rows <= 0:
        raise ValueError("batch: the curvature saw no data")
    out: dict[str, Tensor] = {"num_data": torch.tensor(num_data)}
    if structure in ("full", "diag"):
        key = "ggn" if structure == "full" else "ggn_diag"
        out[key] = (1 - gamma) * state[key] + (gamma * num_data / rows) * batch[key]
        return out
    if structure != "kron":
        raise ValueError(f"structure: expected one of {STRUCTURES}, got {structure!r}")
    for key, value in batch.items():
        kind, _, path = key.partition(".")
        if kind == "A":
            m = batch[f"M.{path}"].to(value.dtype).clamp_min(1.0)
            old = state[f"W.{path}"].to(value.dtype)
            weight = (1 - gamma) * old + gamma
            out[key] = ((1 - gamma) * old * state[key] + gamma * value / m) / weight
            out[f"W.{path}"] = weight
        elif kind in ("B", "G"):  # G: an exact block (kron_exact), a sum like B
            out[key] = (1 - gamma) * state[key] + (gamma * num_data / rows) * value
        elif kind == "M":
            out[key] = torch.ones_like(value)
    return out


def initial_curvature_state(
    structure: str, template: dict[str, Tensor], names: list[str], excess: dict[str, Tensor]
) -> dict[str, Tensor]:
    """The data term of Lambda_0 = diag(prior + excess) in a structure's state layout.

    ``template`` is an empty curvature's state (shapes), ``names`` the subset's parameter
    names, ``excess`` per parameter tensor (flattened values). For "kron", B = I and A is
    diagonal with the weight's excess on the input columns and the bias's on the last one, so
    B kron A = diag(excess) exactly; each tensor's excess must then be constant and >= 0
    (B = A = 0 where it is 0).
    """
    if structure == "full":
        flat = torch.cat([excess[n] for n in names])
        return {"ggn": torch.diag(flat).to(template["ggn"]), "num_data": torch.tensor(0)}
    if structure == "diag":
        flat = torch.cat([excess[n] for n in names])
        return {"ggn_diag": flat.to(template["ggn_diag"]), "num_data": torch.tensor(0)}
    state: dict[str, Tensor] = {"num_data": torch.tensor(0)}
    for key, value in template.items():
        kind, _, path = key.partition(".")
        if kind == "M":
            state[key] = torch.ones_like(value)
        if kind == "G":  # an exact block of one tensor: diag(excess) (or its diagonal)
            values = excess[path].to(value)
            state[key] = values if value.ndim == 1 else torch.diag(values)
        if kind != "A":
            continue
        if ":" in path or value.ndim == 1:
            raise ValueError(
                f"structure 'kron': the NGVI family does not support the Kronecker block "
                f"{path!r} (an attention projection or an embedding); use 'diag' or 'full'"
            )
        prefix = f"{path}." if path else ""
        weight, bias = prefix + "weight", prefix + "bias"
        widths = {bias: 1, weight: value.shape[0] - (1 if bias in excess else 0)}
        cols = []
        for name in (weight, bias):
            if name not in excess:
                continue
            values = excess[name]
            if (values - values[0]).abs().max() > 1e-12 * values.abs().max().clamp_min(1.0):
                raise ValueError(
                    "init_precision: structure 'kron' needs it constant over each parameter "
                    f"tensor, but it is not over {name!r}"
                )
            if values[0] < 0:
                raise ValueError(
                    "init_precision: structure 'kron' keeps Lambda_0 - P0 as Kronecker "
                    f"factors, so it must be >= the prior precision ({name!r} is below it)"
                )
            cols.append(values[0].expand(widths[name]))
        diag = torch.cat(cols).to(value)
        nonzero = bool(diag.any())
        b = template[f"B.{path}"]
        state[key] = torch.diag(diag)
        state[f"B.{path}"] = torch.eye(b.shape[0], dtype=b.dtype, device=b.device) * nonzero
        # weight of A's running mean: a nonzero Lambda_0 - P0 = I kron diag(excess) counts in
        # full; q_0 = prior has no data term, so the first batch's A is taken as it is
        state[f"W.{path}"] = torch.tensor(float(nonzero), dtype=torch.float64)
    return state


def gaussian_kl(mean: Tensor, posterior: Any, prior_vec: Tensor) -> Tensor:
    """KL(N(mu, Lambda^-1) || N(0, diag(prior)^-1)) for a structured ``posterior`` precision:
    1/2 [tr(P0 Sigma) + mu^T P0 mu - P + log det Lambda - log det P0] (thesis eq. 2.14),
    summed in float64 (tr(P0 Sigma) - P and the log-determinants cancel at large priors) and
    returned in ``mean``'s dtype."""
    wide = torch.float64
    prior = prior_vec.to(wide)
    trace = (prior * posterior.covariance_diag().to(wide)).sum()
    quad = (prior * mean.to(wide).square()).sum()
    logdet = getattr(posterior, "logdet_wide", posterior.logdet)().to(wide)
    kl = 0.5 * (trace + quad - mean.numel() + logdet - prior.log().sum())
    return kl.to(mean.dtype)


def output_quadratic(hessian: Tensor, jv: Tensor) -> Tensor:
    """sum_n (J_n v)^T Lambda_n (J_n v) for output Hessians ``hessian`` (..., N, C, C) and
    Jacobian-vector products ``jv`` (N, C) (broadcast over leading sample dimensions): the data
    part v^T G v of the GGN quadratic form (thesis eq. 2.24) without forming G."""
    return torch.einsum("...nc,...ncd,...nd->", jv, hessian, jv)


def mean_step_size(gamma: float, slope: Tensor, curvature: Tensor) -> float:
    """Step size of the mean update mu + alpha d along the natural-gradient direction
    d = Lambda_{t+1}^-1 g: ``min(gamma, slope / curvature)`` with ``slope`` = g^T d and
    ``curvature`` = d^T H d, H = P0 + N/(B S) sum_s J_s^T Lambda(f_s) J_s the batch GGN of the
    step.

    slope / curvature is the exact minimiser along d of the step's local quadratic model
    q(alpha) = alpha g^T d - alpha^2/2 d^T H d, so the capped step never overshoots it. For a
    full Lambda_{t+1} = (1 - gamma) Lambda_t + gamma H >= gamma H (Loewner order), hence
    d^T H d <= d^T Lambda_{t+1} d / gamma = g^T d / gamma and the cap is never active: the step
    is eq. 4.2 unchanged. A diagonal or Kronecker Lambda can under-estimate the curvature
    along d by up to lambda_max(Lambda^-1 H) (hundreds for an MLP), where the plain step
    gamma d diverges once gamma * lambda_max > 2; the cap keeps each step a descent step of
    the GGN model. It is a positive scalar, so a fixed point (g = 0) is unchanged.
    """
    slope_f, curv_f = float(slope), float(curvature)
    if not (curv_f > 0 and slope_f > 0):
        return float(gamma)
    return float(min(gamma, slope_f / curv_f))
