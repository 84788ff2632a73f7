"""A/B of the h17-small changes to the batched diagonal / KFAC fits, in one process.

For each case of ``curvature_fits.py`` (its models, data and fits), gaussify's fit with this
branch's code ("new") and with the changes switched off ("old": the code paths of main), run
interleaved in the same process, median of ``--repeats`` (wall and CPU time of the process),
values compared (max relative difference of diag(G) / the Kronecker factors). On a shared,
loaded machine the ratio old / new is what to read, not the levels: both sides see the same
load. The 1-minute load average is recorded at the start and the end.

Switches (each one off in "old"):

* ``sqrt_factor``: the exact GGN's Lambda^{1/2} as a structured factor (diag(s) - q s^T,
  :mod:`gaussify.curvature.sqrt_factor`): 2 C numbers per sample instead of C^2, the final
  linear layer's product in O(K d), and for softmax K = C - 1 vectors (a rank-(C - 1) root)
  instead of C;
* ``single_vector``: a convolution's diagonal for one vector per sample (K = 1) from one
  grouped ``convolution_backward`` (the samples as groups) instead of patches and products;
* ``conv_gram``: KFAC's input factor of a stride-1 convolution from shifted products
  (:mod:`gaussify.curvature.conv_gram`) instead of the im2col patches' product.

```bash
python benchmarks/h17_small_ab.py                     # the exact-GGN cases below 1.5x
python benchmarks/h17_small_ab.py --cases mlp/32/100/diag --repeats 7
```
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import curvature_fits as cf

import gaussify.curvature.base as cbase
import gaussify.curvature.batched_backward as cbb
import gaussify.curvature.chain_diag as cdiag
import gaussify.curvature.kron as ckron
import gaussify.curvature.kron_grams as cgrams
from gaussify.curvature.patches import conv2d_patches

OUT = Path(__file__).resolve().parent / "results" / "h17_small_ab.json"
CASES = (
    "mlp/32/100/diag",
    "mlp/32/100/kron",
    "mlp/256/2/diag",
    "mlp/256/10/diag",
    "mlp/256/2/kron",
    "mlp/256/10/kron",
    "mlp/32/10/diag",
    "cnn/32/2/diag",
    "cnn/32/2/kron",
    "cnn/256/2/diag",
    "cnn/32/10/diag",
    "cnn/32/10/kron",
    "cnn/32/100/diag",
    "cnn/32/100/kron",
    "cnn/256/2/kron",
    "cnn/256/10/diag",
    "cnn/256/10/diag/ef",
    "cnn/256/10/diag/mc",
    "cnn/256/10/kron",
    "cnn/256/10/kron/ef",
    "cnn/256/10/kron/mc",
)


@contextlib.contextmanager
def old_code() -> Iterator[None]:
    """Every h17-small switch off: the structured factor is never formed, the convolutions'
    input factors come from their patches."""
    saved = cbase.sqrt_factor, ckron.sqrt_factor, cgrams.shift_gram_applies
    single = cdiag._single_vector_squared_grads
    peak = cbb.conv_reduction_peak

    def none(likelihood: object, f: torch.Tensor) -> None:
        return None

    cbase.sqrt_factor = ckron.sqrt_factor = none
    cgrams.shift_gram_applies = lambda conv, inp: False
    cdiag._single_vector_squared_grads = lambda conv, a, d: cdiag._conv_squared_grads(
        conv, conv2d_patches(conv, a), d
    )

    def main_peak(conv: torch.nn.Conv2d, k: int, out: int, inp: int) -> int:
        if k > 1:
            return peak(conv, k, out, inp)
        # main's model for one vector: the gradient, the patches, one weight gradient
        patches = conv.weight[0].numel() * conv.groups * (out // conv.out_channels)
        return out + patches + conv.weight.numel()

    cbb.conv_reduction_peak = main_peak
    try:
        yield
    finally:
        cbase.sqrt_factor, ckron.sqrt_factor, cgrams.shift_gram_applies = saved
        cdiag._single_vector_squared_grads = single
        cbb.conv_reduction_peak = peak


def values(case: dict[str, Any], curv: Any) -> torch.Tensor:
    if case["structure"] == "diag":
        return curv.ggn_diag
    return torch.cat(
        [t.flatten() for d in (curv._a, curv._b) for t in d.values()]
        + [torch.tensor([float(m) for m in curv._m.values()])]
    )


def run_case(name: str, repeats: int, device: str = "cpu") -> dict[str, Any]:
    model, batch, c, structure, *rest = name.split("/")
    flavour = rest[0] if rest else "ggn"
    case = cf._case(model, int(batch), int(c), structure, flavour, "all")
    net = cf.build_model(model, int(c)).eval().to(device)
    x, y = cf.load_data(model, int(c), torch.float32, device)
    loader = DataLoader(TensorDataset(x, y), batch_size=int(batch))

    def fit() -> Any:
        return cf.gaussify_fit(case, net, loader)

    times: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
    for side in ("old", "new"):  # warm-up
        with old_code() if side == "old" else contextlib.nullcontext():
            fit()
    for _ in range(repeats):
        for side in ("old", "new"):
            with old_code() if side == "old" else contextlib.nullcontext():
                w0, c0 = time.perf_counter(), time.process_time()
                fit()
                times[side].append((time.perf_counter() - w0, time.process_time() - c0))
    # agreement in float64 on two batches
    net64 = cf.build_model(model, int(c)).eval().double().to(device)
    rows = slice(0, 2 * int(batch))
    loader64 = DataLoader(TensorDataset(x[rows].double(), y[rows]), int(batch))
    new = values(case, cf.gaussify_fit(case, net64, loader64))
    with old_code():
        old = values(case, cf.gaussify_fit(case, net64, loader64))
    # Monte Carlo: the draws differ between fits, no comparison
    diff = None if flavour == "mc" else float((new - old).abs().max() / old.abs().max())

    def med(side: str, j: int) -> float:
        return sorted(t[j] for t in times[side])[repeats // 2]

    row = {
        "case": name,
        "old_wall_s": med("old", 0),
        "new_wall_s": med("new", 0),
        "old_cpu_s": med("old", 1),
        "new_cpu_s": med("new", 1),
        "max_rel_diff_f64": diff,
    }
    row["speedup_wall"] = row["old_wall_s"] / row["new_wall_s"]
    row["speedup_cpu"] = row["old_cpu_s"] / row["new_cpu_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (times only on the CPU)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    rows = []
    for name in args.cases:
        row = run_case(name, args.repeats, args.device)
        rows.append(row)
        print(
            f"{name:18s} old {row['old_wall_s'] * 1e3:8.1f} ms  new {row['new_wall_s'] * 1e3:8.1f}"
            f" ms  x{row['speedup_wall']:.2f} wall  x{row['speedup_cpu']:.2f} cpu"
            f"  diff {row['max_rel_diff_f64']}",
            flush=True,
        )
    result = {
        "what": "h17-small A/B: this branch's fits vs the same code with its changes off "
        "(main's paths), one process, interleaved, median of repeats, 1 thread",
        "repeats": args.repeats,
        "load_1min_start": load_start[0],
        "load_1min_end": os.getloadavg()[0],
        "torch": torch.__version__,
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
