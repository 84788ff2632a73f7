"""Scaling of the function-space linearised-Laplace methods with the number of training points.

    python benchmarks/function_space_scaling.py [--quick]

Data: the bundled ``protein`` regression set (CASP, 9 standardised features), the first N
training points for N = 1000, 2000, 4000, 8000, 16000 (``--quick``: 1000, 4000). Network: a
9-50-50-1 tanh MLP (P = 3051) trained once by Adam for 5 epochs on 16000 points (float64); every
method is then fitted post hoc at the same weights, prior precision 1 and noise 0.5:

* ``SampledLLA`` (sample-then-optimise): 16 samples, minibatch heavy-ball SGD for 10 epochs
  (batch 256). Cost grows linearly with N per epoch; 10 epochs do not converge the samples
  (``mean_var`` is far from the exact one), so read its row as the cost of 10 epochs.
* ``VaLLA``: M = 50 inducing points (K-means on at most 10k inputs), alpha = 1, learned prior,
  natural-gradient steps on q(u), a fixed budget of 100 steps of batch 256. Its *step* cost
  must not depend on N: one process holds a VaLLA for every N and times 5 steps of each,
  round after round (12 rounds), so machine load hits every N alike; ``valla_step_ms`` is the
  median per N and ``valla_step_ratio_largest_over_smallest_n`` their ratio (target about 1).
  ``fit_s`` includes the K-means initialisation, whose cost grows with N up to the 10k cap.
* ``ELLA`` (Deng et al. 2022, ``gaussify.function_space.ella``): 50 random landmarks, one pass.
* ``FunctionalLaplace`` (the exact GP view, ``gaussify.function_space.gp``): O(N^2) memory and
  O(N^3) time, so it runs only up to N = 4000 here (the (N, N) kernel at 16k is 2 GiB).

Each (method, N) runs in a fresh subprocess with one torch thread (this machine has 2 shared
cores; threads fighting for them made timings meaningless): ``fit_s`` is the fit's wall time,
``predict_s`` the predictive on 500 test points, ``mean_var`` its mean predictive variance
(noise 0.25 included; FunctionalLaplace's is the exact LLA value), ``peak_mib`` the peak
resident memory of the fit above the process's resident memory before it
(``/proc/self/clear_refs`` 5 and ``VmHWM``; the data and network are loaded before, so this is
the method's own working memory).

Writes ``benchmarks/results/function_space_scaling.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    import gaussify as gs
except ModuleNotFoundError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import gaussify as gs
from gaussify.cli_args import add_device_argument, synchronize

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "function_space_scaling.json"
SIZES = [1000, 2000, 4000, 8000, 16000]
QUICK_SIZES = [1000, 4000]
FL_MAX_N = 4000
PRIOR, SIGMA = 1.0, 0.5
EPOCHS = 10  # SampledLLA passes over the data
METHODS = ["sampled_lla", "valla", "ella", "functional_laplace"]


#: the environment variable that hands ``--device`` to the worker processes
DEVICE_VARIABLE = "GAUSSIFY_BENCHMARK_DEVICE"
DEVICE = os.environ.get(DEVICE_VARIABLE, "cpu")


def make_model() -> nn.Module:
    layers = [nn.Linear(9, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(), nn.Linear(50, 1)]
    return nn.Sequential(*layers)


def load_data(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    data = gs.data.load("protein", seed=0)
    x = data.x_train[:n].double().to(DEVICE)
    y = data.y_train[:n].double().reshape(-1, 1).to(DEVICE)
    return x, y, data.x_test[:500].double().to(DEVICE)


def train(path: Path) -> None:
    torch.manual_seed(0)
    x, y, _ = load_data(max(SIZES))
    model = make_model().double()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(5):
        perm = torch.randperm(x.shape[0])
        for start in range(0, x.shape[0], 256):
            idx = perm[start : start + 256]
            opt.zero_grad()
            nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
            opt.step()
    torch.save(model.state_dict(), path)


# ---------------------------------------------------------------------- worker side
def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _measured(fn: Any) -> tuple[Any, float, float]:
    """(result, seconds, peak MiB above the resident memory before the call)."""
    base = _status_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    start = time.perf_counter()
    out = fn()
    synchronize(torch.device(DEVICE))
    seconds = time.perf_counter() - start
    return out, seconds, (_status_kib("VmHWM") - base) / 1024


def _build(method: str, model: nn.Module) -> Any:
    from gaussify.function_space.sampled_lla import SampledLLA
    from gaussify.function_space.valla import VaLLA

    if method == "sampled_lla":
        return SampledLLA(model, "regression", PRIOR, SIGMA, num_samples=16, epochs=EPOCHS)
    if method == "valla":
        return VaLLA(
            model, "regression", num_inducing=50, prior_precision=PRIOR, sigma_noise=SIGMA,
            max_steps=100, epochs=1000,
        )  # fmt: skip
    if method == "ella":
        from gaussify.function_space.ella import ELLA

        return ELLA(model, "regression", num_landmarks=50, prior_precision=PRIOR, sigma_noise=SIGMA)
    from gaussify.function_space.gp import FunctionalLaplace

    return FunctionalLaplace(model, "regression", prior_precision=PRIOR, sigma_noise=SIGMA)


def worker(method: str, n: int, weights: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    model = make_model().double()
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.eval().to(DEVICE)
    x, y, xt = load_data(n)
    # warm up every code path on a tiny problem (lazy imports, vmap set-up, BLAS workspaces)
    warm = _build(method, model)
    if method == "valla":
        warm.num_inducing, warm.max_steps = 10, 2
    warm.fit((x[:300], y[:300]))
    warm.predict(xt[:10])
    post = _build(method, model)
    _, fit_s, peak = _measured(lambda: post.fit((x, y)))
    pred, predict_s, _ = _measured(lambda: post.predict(xt))
    out: dict[str, Any] = {
        "method": method,
        "n": n,
        "fit_s": fit_s,
        "predict_s": predict_s,
        "peak_mib": peak,
        "mean_var": float(pred.var.mean()),
    }
    if method == "valla":
        out["prior_precision"] = float(post.prior_precision)
    return out


def step_worker(sizes: list[int], weights: str, rounds: int = 12, per_round: int = 5) -> dict:
    """VaLLA step times for every N in one process, interleaved round by round (so that
    load on the shared machine hits every N alike): median ms per N."""
    from gaussify.function_space.valla import VaLLA

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    model = make_model().double()
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.eval().to(DEVICE)
    posts, data = {}, {}
    for n in sizes:
        x, y, _ = load_data(n)
        post = VaLLA(model, "regression", 50, PRIOR, SIGMA, batch_size=256).initialize((x, y))
        for _ in range(3):  # warm up
            idx = torch.randint(0, n, (256,))
            post.step(x[idx], y[idx])
        posts[n], data[n] = post, (x, y)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    gen = torch.Generator().manual_seed(0)
    for _ in range(rounds):
        for n in sizes:
            x, y = data[n]
            for _ in range(per_round):
                idx = torch.randint(0, n, (256,), generator=gen)
                start = time.perf_counter()
                posts[n].step(x[idx], y[idx])
                synchronize(torch.device(DEVICE))
                times[n].append(time.perf_counter() - start)
    return {str(n): 1000 * sorted(t)[len(t) // 2] for n, t in times.items()}


# ---------------------------------------------------------------------- driver
def available(method: str) -> bool:
    module = {"ella": "ella", "functional_laplace": "gp"}.get(method)
    if module is None:
        return True
    return (ROOT.parent / "src" / "gaussify" / "function_space" / f"{module}.py").exists()


def run(sizes: list[int], device: str = "cpu") -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "model.pt"
        train(weights)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        env[DEVICE_VARIABLE] = device  # the workers put the model and the data there
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT.parent / "src"), env.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep)
        for method in METHODS:
            if not available(method):
                notes.append(f"{method}: module not present in this checkout; skipped")
                continue
            for n in sizes:
                if method == "functional_laplace" and n > FL_MAX_N:
                    continue
                proc = subprocess.run(
                    [sys.executable, __file__, "--worker", method, str(n), str(weights)],
                    capture_output=True,
                    text=True,
                    env=env,
                )
                if proc.returncode != 0:
                    notes.append(f"{method} N={n}: failed: {proc.stderr.strip()[-300:]}")
                    print(notes[-1], file=sys.stderr)
                    continue
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(
                    f"{method:>20} N={n:6d}  fit {row['fit_s']:8.2f} s  "
                    f"predict {row['predict_s']:6.3f} s  peak {row['peak_mib']:8.1f} MiB",
                    flush=True,
                )
        proc = subprocess.run(
            [sys.executable, __file__, "--steps", ",".join(map(str, sizes)), str(weights)],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        step_ms = json.loads(proc.stdout.strip().splitlines()[-1])
        for n, ms in step_ms.items():
            print(f"{'valla step':>20} N={int(n):6d}  {ms:7.2f} ms (median, interleaved)")
    if "functional_laplace" in METHODS and available("functional_laplace"):
        notes.append(
            f"functional_laplace: run up to N = {FL_MAX_N} only (O(N^2) memory, O(N^3) time)"
        )
    summary: dict[str, Any] = {
        "valla_step_ms": step_ms,
        "valla_step_ratio_largest_over_smallest_n": step_ms[str(max(sizes))]
        / step_ms[str(min(sizes))],
    }
    for method in METHODS:
        runs = sorted((r for r in rows if r["method"] == method), key=lambda r: r["n"])
        if len(runs) >= 2:
            summary[f"{method}_fit_ratio"] = {
                "n": [runs[0]["n"], runs[-1]["n"]],
                "fit_s_ratio": runs[-1]["fit_s"] / runs[0]["fit_s"],
            }
    return {
        "benchmark": "function_space_scaling",
        "data": "protein (bundled), first N training points, float64",
        "model": "MLP 9-50-50-1 tanh (P = 3051)",
        "settings": {
            "prior_precision": PRIOR,
            "sigma_noise": SIGMA,
            "sampled_lla": f"16 samples, SGD (heavy ball, auto step), {EPOCHS} epochs, batch 256",
            "valla": "M = 50 (K-means), alpha = 1, learned prior, natural gradient, 100 steps "
            "of batch 256",
            "ella": "50 random landmarks",
            "functional_laplace": f"exact GP, N <= {FL_MAX_N}",
            "threads": 1,
        },
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "torch": torch.__version__,
        "device": device,
        "rows": rows,
        "summary": summary,
        "notes": notes,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--steps":
        print(json.dumps(step_worker([int(n) for n in sys.argv[2].split(",")], sys.argv[3])))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="N = 1000 and 4000 only")
    add_device_argument(parser)
    args = parser.parse_args()
    start = time.perf_counter()
    result = run(QUICK_SIZES if args.quick else SIZES, str(args.device))
    result["total_s"] = time.perf_counter() - start
    if not args.quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {RESULTS}")
    print(json.dumps(result["summary"], indent=2))
    print(f"total {result['total_s']:.0f} s")


if __name__ == "__main__":
    main()
