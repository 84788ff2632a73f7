"""Issue 19: the Laplace evidence of thesis Fig. 5.2 with the exact Hessian instead of the GGN,
at a few (delta, sigma^2) pairs of ``gaussify.experiments.marglik_regression``.

At a MAP theta* of the gap toy (the experiment's network, training and seed), the Laplace
evidence is

    log Z = log p(D | theta*) - delta/2 ||theta*||^2 + P/2 log delta - 1/2 log det(H + delta I)

with H the curvature of -log p(D | theta) at theta*: the GGN J^T J / sigma^2 (what the
experiment uses, thesis eq. 3.17-3.18) or the exact Hessian (``torch.func.hessian`` of the
flat-parameter objective, float64). The GGN value is checked against
``Laplace.log_marginal_likelihood`` (same formula, library code) before the Hessian one is
formed. Both are given without and with the library's non-MAP correction
1/2 b^T (H + delta I)^-1 b (b the log joint's gradient at theta*; it vanishes at a converged
MAP); where H + delta I is not positive definite the Hessian evidence is undefined and its
smallest eigenvalue is recorded instead. Writes
``benchmarks/results/marglik_hessian_evidence.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.func import functional_call, hessian

from gaussify.cli_args import add_device_argument
from gaussify.experiments import marglik_regression as exp
from gaussify.experiments._gap_toy import gap_toy

ROOT = Path(__file__).resolve().parents[1]


def evidences(
    delta: float, sigma2: float, width: int, depth: int, epochs: int, lr: float, seed: int
) -> dict[str, Any]:
    """GGN and exact-Hessian Laplace evidence at the MAP of one pair."""
    toy = gap_toy(0)
    norms: list[float] = []
    state = exp.train_maps(toy, [(delta, sigma2)], width, depth, epochs, lr, seed, norms)[0]
    model, la = exp.fit_point(toy, delta, sigma2, state, width, depth)
    names = [k for k, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    n_params = theta.numel()

    def unflat(v: torch.Tensor) -> dict[str, torch.Tensor]:
        out, i = {}, 0
        for name, shape in zip(names, shapes, strict=True):
            k = math.prod(shape)
            out[name] = v[i : i + k].reshape(shape)
            i += k
        return out

    def nll(v: torch.Tensor) -> torch.Tensor:
        f = functional_call(model, unflat(v), (toy.x_train,))
        n = len(toy.y_train)
        return ((toy.y_train - f) ** 2).sum() / (2 * sigma2) + 0.5 * n * math.log(
            2 * math.pi * sigma2
        )

    start = time.perf_counter()
    data_nll = float(nll(theta))
    base = -data_nll - 0.5 * delta * float(theta @ theta) + 0.5 * n_params * math.log(delta)
    eye = torch.eye(n_params, dtype=theta.dtype)
    jac = torch.func.jacrev(lambda v: functional_call(model, unflat(v), (toy.x_train,)))(theta)
    jac = jac.reshape(-1, n_params)
    ggn = jac.T @ jac / sigma2
    grad = -torch.func.grad(nll)(theta) - delta * theta  # gradient of the log joint

    def value(curv: torch.Tensor) -> tuple[float, float]:
        """(evidence without, with the non-MAP correction 1/2 b^T A^-1 b)."""
        a = curv + delta * eye
        plain = base - 0.5 * float(torch.linalg.slogdet(a)[1])
        return plain, plain + 0.5 * float(grad @ torch.linalg.solve(a, grad))

    ggn_plain, ggn_corrected = value(ggn)
    library = float(la.log_marginal_likelihood())
    hess = hessian(nll)(theta)
    hess = 0.5 * (hess + hess.T)
    eig_min = float(torch.linalg.eigvalsh(hess + delta * eye)[0])
    hess_plain = hess_corrected = None
    if eig_min > 0:
        hess_plain, hess_corrected = value(hess)
    return {
        "delta": delta,
        "sigma2": sigma2,
        "map_grad_norm": norms[0],
        "log_evidence_library": library,
        "log_evidence_ggn": ggn_plain,
        "log_evidence_ggn_corrected": ggn_corrected,
        "log_evidence_hessian": hess_plain,
        "log_evidence_hessian_corrected": hess_corrected,
        "min_eig_hessian_plus_prior": eig_min,
        "runtime_s": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=float, nargs="+", required=True, help="d1 s1 d2 s2 ...")
    parser.add_argument("--width", type=int, default=25)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    add_device_argument(parser)
    parser.add_argument(
        "--output", type=Path, default=ROOT / "benchmarks/results/marglik_hessian_evidence.json"
    )
    args = parser.parse_args()
    if args.device.type != "cpu":
        parser.error(f"--device {args.device}: the experiment's data and MAP run on the host")
    torch.set_num_threads(1)
    rows = []
    for d, s2 in zip(args.pairs[0::2], args.pairs[1::2], strict=True):
        rows.append(evidences(d, s2, args.width, args.depth, args.epochs, args.lr, args.seed))
        print(rows[-1], flush=True)
        out = {"benchmark": "marglik_hessian_evidence", "about": __doc__, "config": vars(args)
               | {"output": str(args.output)}, "rows": rows,
               "load_average": list(os.getloadavg())}  # fmt: skip
        args.output.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
