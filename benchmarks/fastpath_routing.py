"""Side-by-side benchmark: gaussify's routing around PyTorch's fused attention fast paths
(``gaussify.fastpath``, issue 22), interleaved in one run with the behaviour before.

    python benchmarks/fastpath_routing.py [--threads 1] [--repeats 3] [--device cpu]

Models: the issue's tiny transformer classifier (``nn.Embedding(50, 16)`` ->
``nn.TransformerEncoderLayer(16, 2, 32)`` in eval mode -> mean pool -> ``nn.Linear(16, 2)``,
P = 3,058) on 256 random token sequences of length 16, and a tanh MLP 20-20-20-3 (P = 903,
no attention: the routing's overhead alone). For each: one gradient epoch (the unit), and
fit + log evidence + GLM predictive on 64 points for ``Laplace`` diag / lowrank (rank 20)
(and full for the MLP; the transformer's full fit is dominated by a 3058 x 3058
eigendecomposition, not by routing) and ``FunctionalLaplace`` (128 points), in three modes:
"routed" (the library), "reverse_only" (``autodiff_safe`` a no-op: fast paths on,
forward-mode products by the reverse-mode fallback) and "before" (neither: the code before
issue 22); an error is recorded instead of a time. Each time is the median of ``--repeats``
after one warm-up; the machine's load average is recorded at the start and the end.
Writes ``benchmarks/results/fastpath_routing.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

import gaussify as gs
from gaussify import fastpath, model_checks
from gaussify.cli_args import add_device_argument, synchronize
from gaussify.curvature import generic_jacobian
from gaussify.function_space import sampled_lla

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "fastpath_routing.json"
MODES = ("routed", "reverse_only", "before")


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)).mean(1))


@contextlib.contextmanager
def _noop(*_args: Any, **_kwargs: Any) -> Iterator[None]:
    yield


@contextlib.contextmanager
def routing(mode: str) -> Iterator[None]:
    """One of :data:`MODES` (module docstring)."""
    with contextlib.ExitStack() as stack:
        if mode != "routed":
            stack.enter_context(mock.patch.object(fastpath, "autodiff_safe", _noop))
            stack.enter_context(mock.patch.object(model_checks, "autodiff_safe", _noop))
        if mode == "before":
            for module in (generic_jacobian, sampled_lla):
                stack.enter_context(
                    mock.patch.object(module, "forward_ad_unsupported", lambda _e: False)
                )
        yield


def once(fn: Callable[[], Any], device: torch.device) -> float | str:
    """Seconds for one call (CUDA work synchronised), or the error it raised (the behaviour
    before)."""
    synchronize(device)
    start = time.perf_counter()
    try:
        fn()
        synchronize(device)
    except Exception as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    return time.perf_counter() - start


def bench_case(
    name: str, model: nn.Module, x: torch.Tensor, classes: int, repeats: int, full: bool
) -> dict[str, Any]:
    """The runs of one model, each in every mode, one after the other (on ``x``'s device)."""
    device = x.device
    y = torch.randint(0, classes, (x.shape[0],)).to(device)

    def epoch() -> None:
        model.train()
        for i in range(0, x.shape[0], 32):
            loss = nn.functional.cross_entropy(model(x[i : i + 32]), y[i : i + 32])
            model.zero_grad()
            loss.backward()
        model.eval()

    def laplace(structure: str, **kw: Any) -> Callable[[], Any]:
        def run() -> Any:
            la = gs.Laplace(model, "classification", structure=structure, **kw)
            la.fit((x[:64], y[:64]))
            la.log_marginal_likelihood()
            return la.predict(x[:16])

        return run

    def functional() -> Any:
        fl = gs.FunctionalLaplace(model, "classification").fit((x[:128], y[:128]))
        return fl.predict(x[:16])

    runs: dict[str, Callable[[], Any]] = {"gradient_epoch": epoch}
    if full:
        runs["laplace_full"] = laplace("full")
    runs["laplace_diag"] = laplace("diag")
    runs["laplace_lowrank"] = laplace("lowrank", rank=20)
    runs["functional_laplace"] = functional
    row: dict[str, Any] = {"num_params": sum(p.numel() for p in model.parameters())}
    for key, fn in runs.items():
        with routing("routed"):
            fn()  # warm-up
        samples: dict[str, list[float | str]] = {mode: [] for mode in MODES}
        for _ in range(repeats):  # the modes interleaved, repeat by repeat
            for mode in MODES:
                with routing(mode):
                    samples[mode].append(once(fn, device))
        entry: dict[str, Any] = {}
        for mode, values in samples.items():
            errors = [v for v in values if isinstance(v, str)]
            entry[f"{mode}_s"] = errors[0] if errors else statistics.median(values)
        for mode in MODES[1:]:
            on, other = entry["routed_s"], entry[f"{mode}_s"]
            if isinstance(on, float) and isinstance(other, float):
                entry[f"routed_over_{mode}"] = on / other
        row[key] = entry
        shown = "  ".join(f"{k} {str(v)[:60]}" for k, v in entry.items())
        print(f"{name:16s} {key:18s} {shown}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    add_device_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    mlp = nn.Sequential(
        nn.Linear(20, 20), nn.Tanh(), nn.Linear(20, 20), nn.Tanh(), nn.Linear(20, 3)
    )
    cases = {
        "tiny_transformer": (TinyTransformer(), torch.randint(0, 50, (256, 16)), 2),
        "mlp": (mlp, torch.randn(256, 20), 3),
    }
    results: dict[str, Any] = {
        "load_average_start": os.getloadavg(),
        "threads": args.threads,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "device": str(args.device),
    }
    for name, (model, x, classes) in cases.items():
        model, x = model.to(args.device).eval(), x.to(args.device)
        results[name] = bench_case(name, model, x, classes, args.repeats, name == "mlp")
    results["load_average_end"] = os.getloadavg()
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
