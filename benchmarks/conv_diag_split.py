"""Where the CNN diagonal GGN fits below 1.5 x BackPack spend their time (issue 17), and whether
a cheaper formulation of the convolutions' per-sample weight-gradient squares pays.

    python benchmarks/conv_diag_split.py [--cases cnn/32/10/diag/ggn cnn/32/100/diag/ggn]
        [--threads 2] [--repeats 5] [--device cpu] [--out FILE]

Part 1, the fit taken apart, in ONE process (``--repeats`` rounds interleaved, medians):
gaussify's fit (``curvature_fits.gaussify_fit``), the same with every convolution's
reduction by the dense im2col products (``fit_dense_reductions``: the pooled squares of
``curvature/pooled_conv.py`` off, main's reduction), the fit with the convolutions' weight
reductions replaced by zeros (the per-sample weight gradients sum_t delta_t a_t^T of every
vector, squared and summed), the same without their im2col patches too, and laplace-torch's
BackPack and ASDL fits. ``best / fit without
the weight reductions`` is the most any formulation of those reductions could reach; the
rest is the forward pass, the batched backward passes in the memory rule's chunks and the
per-chunk work around them.

Part 2, per chunk, at the fit's own chunk shape (its plan: samples per chunk and vectors per
pass, from the memory rule) on a chunk of the first batch: the squared sums of the second
convolution (followed by ReLU and a 2 x 2 max-pooling) by ``dense_groups`` (main's: im2col
products for groups of vectors), ``dense_one_group`` (all vectors in one product),
``gram_pool`` (``curvature/pooled_conv.py``, the fit's where it pays: delta is non-zero only
at the W = T / 4 maxima, so sum_k G_k[o, f]^2 = sum_{w,w'} M_o[w, w'] P_o[w, f] P_o[w', f]
with M_o = sum_k h_{k,o} h_{k,o}^T over the gradients h at the maxima and P_o the patches
gathered at channel o's maxima: O W^2 (K + F) multiply-adds instead of K O T F, no K-fold
weight gradients) and ``direct_gather`` (G_k[o] = h_{k,o} P_o per vector, K O W F). Each is
timed (median of 200), checked against the dense sums in float64, and its elements alive
per sample compared with the chain's per-sample peak of the memory rule
(``batched_backward.backward_peak``): a formulation above it would shrink the rule's chunks.

Writes ``benchmarks/results/conv_diag_split.json`` with the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import curvature_fits as cf  # noqa: E402  (imports gaussify, from src if not installed)

from gaussify.curvature import chain_diag  # noqa: E402
from gaussify.curvature.batched_backward import (  # noqa: E402
    backward_chunk,
    backward_peak,
    chain_forward,
    conv_reduction_peak,
    module_chain,
)
from gaussify.curvature.patches import conv2d_patches  # noqa: E402
from gaussify.curvature.pooled_conv import pooled_squared_grads  # noqa: E402
from gaussify.curvature.sqrt_factor import sqrt_factor  # noqa: E402
from gaussify.likelihoods import Categorical  # noqa: E402

CASES = ("cnn/32/10/diag/ggn", "cnn/32/100/diag/ggn")


def _median(fn: Callable[[], Any], repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        cf._sync()
        start = time.perf_counter()
        fn()
        cf._sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def split(name: str, repeats: int, device: str) -> dict[str, Any]:
    """Part 1: the fit with and without the convolutions' weight reductions, vs laplace-torch."""
    m, b, c, s, fl = name.split("/")
    case = cf._case(m, int(b), int(c), s, fl, "all")
    x, y = cf.load_data(m, int(c), torch.float32, device)
    loader = DataLoader(TensorDataset(x, y), batch_size=int(b))
    model = cf.build_model(m, int(c)).to(device).eval()
    real = (
        chain_diag._conv_squared_grads,
        chain_diag.pooled_squared_grads,
        chain_diag.conv2d_patches,
    )

    def zeros(conv: nn.Conv2d, p: Tensor | None, d: Tensor) -> Tensor:
        return d.new_zeros(conv.out_channels, conv.weight[0].numel())

    def pooled_zeros(p: Tensor | None, d: Tensor, idx: Tensor) -> Tensor:
        return zeros(model[2], p, d)  # the pooled convolution: the second

    def dense_only(run: Any, wanted: Any, k: int, structured: Any) -> dict[int, int]:
        return {}

    def variant(reduce: Any, pooled: Any, unfold: Any, plan: Any = None) -> Callable[[], Any]:
        def fit() -> Any:
            chain_diag._conv_squared_grads = reduce
            chain_diag.pooled_squared_grads = pooled
            chain_diag.conv2d_patches = unfold
            convs = chain_diag._pooled_convs
            chain_diag._pooled_convs = plan or convs
            try:
                return cf.gaussify_fit(case, model, loader)
            finally:
                (
                    chain_diag._conv_squared_grads,
                    chain_diag.pooled_squared_grads,
                    chain_diag.conv2d_patches,
                ) = real
                chain_diag._pooled_convs = convs

        return fit

    sides: dict[str, Callable[[], Any]] = {
        "fit": variant(*real),
        "fit_dense_reductions": variant(*real, plan=dense_only),
        "fit_without_weight_reductions": variant(zeros, pooled_zeros, real[2]),
        "fit_without_weight_reductions_or_patches": variant(
            zeros, pooled_zeros, lambda conv, a: None
        ),
    }
    for backend in ("BackPackGGN", "AsdlGGN"):  # each on its own model (BackPack's hooks)
        own = cf.build_model(m, int(c)).to(device).eval()
        sides[backend] = lambda bk=backend, mdl=own: cf.backend_fit(case, bk, mdl, loader)
    for fn in sides.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(repeats):
        for key, fn in sides.items():
            cf._sync()
            start = time.perf_counter()
            fn()
            cf._sync()
            times[key].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = min(("BackPackGGN", "AsdlGGN"), key=lambda k: med[k])
    ratios = {f"best_over_{k}": med[best] / med[k] for k in sides if k.startswith("fit")}
    return {"median_s": med, "runs_s": times, "best_backend": best, **ratios}


def _pool_after(chain: list[tuple[str, nn.Module]], i: int) -> int | None:
    """Position of a non-overlapping MaxPool2d reached from the conv at i through ReLUs."""
    j = i + 1
    while j < len(chain) and type(chain[j][1]) is nn.ReLU:
        j += 1
    pool = chain[j][1] if j < len(chain) else None
    return j if type(pool) is nn.MaxPool2d and pool.stride == pool.kernel_size else None


def _dense(conv: nn.Conv2d, p: Tensor, d: Tensor, step: int) -> Tensor:
    b, k, t = d.shape[0], d.shape[1], p.shape[-1]
    a = p.transpose(1, 2)
    total = None
    for k0 in range(0, k, step):
        part = d[:, k0 : k0 + step]
        kk = part.shape[1]
        sums = torch.bmm(part.reshape(b, kk * conv.out_channels, t), a)
        sums = sums.view(b, kk, conv.out_channels, -1).square_().sum((0, 1))
        total = sums if total is None else total.add_(sums)
    assert total is not None
    return total


def _direct_gather(p: Tensor, d: Tensor, idx: Tensor) -> Tensor:
    b, k, o = d.shape[:3]
    w, f, t = idx.shape[-1], p.shape[1], p.shape[-1]
    h = d.gather(-1, idx.unsqueeze(1).expand(b, k, o, w))
    offsets = torch.arange(b, device=idx.device).view(b, 1, 1) * t
    gathered = p.transpose(1, 2).reshape(b * t, f).index_select(0, (idx + offsets).reshape(-1))
    g = torch.bmm(h.permute(0, 2, 1, 3).reshape(b * o, k, w), gathered.view(b * o, w, f))
    return g.square_().view(b, o, k, f).sum((0, 2))


def formulations(name: str, device: str) -> dict[str, Any]:
    """Part 2: the second convolution's squared sums per chunk, four ways."""
    m, b, c = name.split("/")[:3]
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.float64):
        x, _ = cf.load_data(m, int(c), dtype, device)
        model = cf.build_model(m, int(c)).to(device, dtype).eval()
        chain = module_chain(model)
        assert chain is not None
        run = chain_forward(chain, x[: int(b)])
        convs = [i for i, (_, mod) in enumerate(chain) if type(mod) is nn.Conv2d]
        wanted = {
            i: chain[i][0] for i in range(len(chain)) if type(chain[i][1]) in (nn.Conv2d, nn.Linear)
        }
        factor = sqrt_factor(Categorical(), run.output)
        assert factor is not None
        k = factor.num_vectors
        storage = sum(p.numel() for p in model.parameters())
        n = run.acts[0].shape[0]
        sums = sum(n * run.acts[q + 1][0].numel() for q in wanted if type(chain[q][1]) is nn.Linear)
        plan = chain_diag._cached_plan(  # the fit's plan (checks deferred)
            run, model, k, storage, wanted, False, sums, False, True, None, False
        )
        chunk, cols = plan[0], plan[1]
        i = convs[-1]
        j = _pool_after(chain, i)
        assert j is not None, "the second convolution is followed by ReLU and max-pooling"
        conv = chain[i][1]
        assert isinstance(conv, nn.Conv2d)
        rows = slice(0, chunk)
        ut = factor.rows(rows).columns(0, cols)
        d = next(dd for pos, dd in backward_chunk(run, ut, [i], rows) if pos == i)
        d5 = d  # (B, K, O, H, W)
        d = d.flatten(-2).view(d.shape[0], d.shape[1], conv.out_channels, -1)
        p = conv2d_patches(conv, run.acts[i][rows])
        idx4 = run.indices[j][rows]
        idx = idx4.flatten(-2)
        step = max(1, min(cols, (cols * d[0, 0].numel()) // conv.weight.numel()))
        ways = {
            "dense_groups": lambda: _dense(conv, p, d, step),  # noqa: B023
            "dense_one_group": lambda: _dense(conv, p, d, cols),  # noqa: B023
            "gram_pool": lambda: pooled_squared_grads(p, d5, idx4),  # noqa: B023
            "direct_gather": lambda: _direct_gather(p, d, idx),  # noqa: B023
        }
        ref = ways["dense_groups"]()
        o, t, f = conv.out_channels, p.shape[-1], p.shape[1]
        w = idx.shape[-1]
        per = {
            "dense_groups": conv_reduction_peak(conv, cols, o * t, run.acts[i][0].numel()),
            "dense_one_group": cols * o * t + f * t + cols * o * f,
            "gram_pool": cols * o * t + f * t + cols * o * w + 2 * o * w * f + o * w * w,
            "direct_gather": cols * o * t + f * t + cols * o * w + o * w * f + cols * o * f,
        }
        chain_peak = backward_peak(run, cols, set(convs) | {len(chain) - 1}, True)
        key = "float32" if dtype == torch.float32 else "float64"
        out[key] = {
            "samples_per_chunk": chunk,
            "vectors_per_pass": cols,
            "vector_group_dense": step,
            "chain_peak_per_sample": chain_peak,
            "ways": {
                way: {
                    "median_us": _median(fn, 200) * 1e6 if dtype == torch.float32 else None,
                    "max_rel_diff_vs_dense": float((fn() - ref).abs().max() / ref.abs().max()),
                    "elements_per_sample": per[way],
                    "within_chain_peak": per[way] <= chain_peak,
                }
                for way, fn in ways.items()
            },
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (models and data there)")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/conv_diag_split.json"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import warnings

    warnings.filterwarnings("ignore")
    load_start = list(os.getloadavg())
    rows = []
    for name in args.cases:
        row = {"case": name, "split": split(name, args.repeats, args.device)}
        row["chunk_formulations"] = formulations(name, args.device)
        rows.append(row)
        sp = row["split"]
        med = sp["median_s"]
        print(
            f"{name}: fit {med['fit']:.3f}s, without weight reductions "
            f"{med['fit_without_weight_reductions']:.3f}s, also without patches "
            f"{med['fit_without_weight_reductions_or_patches']:.3f}s, {sp['best_backend']} "
            f"{med[sp['best_backend']]:.3f}s; best / fit {sp['best_over_fit']:.2f}, best / "
            f"fit without reductions {sp['best_over_fit_without_weight_reductions']:.2f}",
            flush=True,
        )
        for way, r in row["chunk_formulations"]["float32"]["ways"].items():
            diff = row["chunk_formulations"]["float64"]["ways"][way]["max_rel_diff_vs_dense"]
            print(
                f"   {way:16s} {r['median_us']:8.1f} us per chunk, {r['elements_per_sample']:7d}"
                f" elements per sample (rule's chain peak "
                f"{row['chunk_formulations']['float32']['chain_peak_per_sample']}), "
                f"float64 diff {diff:.1e}",
                flush=True,
            )
        payload = {
            "benchmark": "conv_diag_split",
            "settings": {
                "threads": args.threads,
                "repeats": args.repeats,
                "device": args.device,
                "torch": torch.__version__,
                "load_average_start": load_start,
                "load_average_end": list(os.getloadavg()),
                "cpus": os.cpu_count(),
            },
            "results": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
