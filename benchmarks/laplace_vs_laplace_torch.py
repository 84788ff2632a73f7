"""Side-by-side benchmark: gaussify's weight-space Laplace vs laplace-torch.

    python benchmarks/laplace_vs_laplace_torch.py --fits [--quick] [--threads 1] [--device cpu]
    python benchmarks/laplace_vs_laplace_torch.py [--quick] [--threads 2] [--repeats 3]

``--fits`` is issue 17's done-when benchmark: the curvature fits alone (diag and kron of all
weights, exact GGN / empirical Fisher / Monte Carlo, and diag / kron / full of the last layer)
on an MLP 64-100-100-C and a CNN with max-pooling on 8 x 8 digits, batch 32 and 256, C = 2, 10,
100, against each laplace-torch backend (Curvlinops, its default, BackPack, ASDL) at its
defaults, "best" the fastest per case, with agreement in float64, both sides' peak memory
against the memory rule and the measured floors. Its case table, worker and report are
``curvature_fits.py``'s (imported here, not repeated); it writes
``benchmarks/results/laplace_vs_laplace_torch_fits.json``. Without ``--fits``, the pipeline:

One run trains the MAP models once (an MLP 64-50-10 (tanh) on ``digits`` and a small CNN on
``mnist``), then, per case (structure full / diag / kron x subset all / last_layer), runs every
configuration (gaussify, and laplace-torch with each of its GGN backends) in a fresh
subprocess on the same weights and data:

* fit time (constructor + ``fit`` over the same DataLoader),
* prior-tuning time (gaussify ``optimize_prior(method="gradient", n_steps=100, lr=0.1,
  fixed_steps=True)`` vs
  laplace-torch ``optimize_prior_precision(pred_type="glm", method="marglik", n_steps=100,
  lr=0.1)``, both Adam on the log of a scalar prior from the MAP prior: the same 100 steps on
  both sides, not gaussify's default, which tunes to convergence (closed form / L-BFGS)),
* predict time (GLM predictive with the probit link on the test set),
* peak memory: the RSS high-water mark (``VmHWM`` in ``/proc/self/status``, reset through
  ``/proc/self/clear_refs`` just before the first repeat) minus the RSS then, one subprocess per
  configuration, so it counts what torch allocates on the CPU (tracemalloc does not see those
  allocations). ``getrusage().ru_maxrss`` is the same high-water mark but cannot be reset, and a
  child started by ``subprocess`` (vfork + exec) inherits the parent's peak in it,
* the log marginal likelihood at the MAP prior and the test NLL after tuning.

Fit, tuning and predict run back to back on a fresh object and are all timed, so whatever one
step caches for the next (gaussify's eigenvalues for closed-form tuning, a factorisation for the
predictive) is on the clock; the evidence at the MAP prior and the predictive at the MAP prior
(for the agreement check, the same prior on both sides) are computed afterwards, untimed.

Each timing is the median of ``--repeats`` runs (fit, tune, predict from scratch each time),
after one untimed warm-up pipeline on one batch; a pipeline whose first run takes longer than
``SLOW_RUN_S`` is not repeated. laplace-torch's
prior tuning only touches the fitted curvature (the same dense / diagonal / Kronecker matrix for
every backend), so it is timed once per case, with the default backend. "best" is the fastest
backend per quantity. Agreement (max relative differences of the curvature, the log marginal
likelihood, the tuned prior and the predictive) uses laplace-torch's conventions on gaussify's
side: ``correction=False`` (no non-MAP term) and ``kron_bias="separate"`` (W and b as separate
Kronecker blocks). The issue's own ratios (fit time over one gradient epoch, full fit over one
``J^T Lambda J``-sized matmul) are measured in the parent process with interleaved repeats.

Writes ``benchmarks/results/laplace_vs_laplace_torch.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

try:
    import gaussify as gs
except ModuleNotFoundError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import gaussify as gs

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "laplace_vs_laplace_torch.json"
FITS_OUT = ROOT / "benchmarks" / "results" / "laplace_vs_laplace_torch_fits.json"
BACKENDS = ("CurvlinopsGGN", "BackPackGGN", "AsdlGGN")
DEFAULT_BACKEND = "CurvlinopsGGN"
STRUCTURES = ("full", "diag", "kron")
SUBSETS = ("all", "last_layer")
MAP_PRIOR = 1.0
N_STEPS = 100
LR = 0.1
SLOW_RUN_S = 20.0
PROBE_STEPS = 10  # laplace-torch full: time this many tuning steps first ...
MAX_PRIOR_S = 60.0  # ... and extrapolate to N_STEPS when that projects beyond this
AGREE_RTOL = 1e-4
MEMORY_LIMIT_GIB = 8  # address-space cap per worker: an allocation fails instead of the OOM killer
NUM_CLASSES = 10
T = TypeVar("T")
# Configurations not run, with the reason (recorded in the JSON).
SKIPPED = {
    "cnn/full/all": {
        "CurvlinopsGGN": "laplace-torch's default backend forms the dense GGN of the CNN "
        "(P = 1898) as `GGNLinearOperator @ torch.eye(P)` over 63 batches of 32, and its GLM "
        "predictive uses torch.func Jacobians of whole batches; one fit + tune + predict had not "
        "finished after 6 min on this machine, so the case uses BackPackGGN and AsdlGGN only "
        "(BackPackGGN tunes the prior)",
    }
}


# ----------------------------------------------------------------------------- models and data


def build_model(name: str) -> nn.Module:
    """The MLP 64-50-10 (tanh) for digits, or a small CNN for 28x28 MNIST images."""
    if name == "mlp":
        return nn.Sequential(nn.Linear(64, 50), nn.Tanh(), nn.Linear(50, NUM_CLASSES))
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 8, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 26 -> 13
            nn.Conv2d(8, 16, 3),
            nn.ReLU(),
            nn.MaxPool2d(4),  # 11 -> 2
            nn.Flatten(),
            nn.Linear(64, NUM_CLASSES),
        )
    raise ValueError(f"model: expected 'mlp' or 'cnn', got {name!r}")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    dataset: str
    max_train: int | None
    epochs: int
    lr: float
    batch_size: int  # fit and predict batches, the same for both libraries
    max_test: int | None  # test points for the predictive (None: all)


MODEL_SPECS = {
    "mlp": ModelSpec("mlp", "digits", None, 100, 1e-2, 256, None),
    # laplace-torch's torch.func Jacobians (CurvlinopsGGN and AsdlGGN diag/full fits and every
    # GLM predictive) hold B * C backward passes over the whole batch of B: O(B^2) memory,
    # about 14 GB for this CNN at B = 256 (and time O(B) per point: 150 s for 1500 test
    # points at B = 64), so the CNN uses B = 32 for both libraries and 250 test points.
    "cnn": ModelSpec("cnn", "mnist", 2000, 30, 1e-2, 32, 250),
}


def prepare_model(spec: ModelSpec, workdir: Path, epochs: int) -> dict[str, Any]:
    """Train the MAP model (seeded) and save weights and data for the worker processes."""
    ds = gs.data.load(spec.dataset, seed=0, max_train=spec.max_train)
    torch.manual_seed(0)
    model = build_model(spec.name)
    start = time.perf_counter()
    gs.train_map(
        model,
        (ds.x_train, ds.y_train),
        "classification",
        prior_precision=MAP_PRIOR,
        epochs=epochs,
        lr=spec.lr,
        seed=0,
    )
    train_s = time.perf_counter() - start
    model.eval()
    x_test, y_test = ds.x_test[: spec.max_test], ds.y_test[: spec.max_test]
    with torch.no_grad():
        map_probs = torch.softmax(model(x_test), -1)
    bundle = {
        "state_dict": model.state_dict(),
        "x_train": ds.x_train,
        "y_train": ds.y_train,
        "x_test": ds.x_test[: spec.max_test],
        "y_test": ds.y_test[: spec.max_test],
    }
    torch.save(bundle, workdir / f"{spec.name}.pt")
    return {
        "dataset": spec.dataset,
        "n_train": int(ds.x_train.shape[0]),
        "n_test": int(x_test.shape[0]),
        "batch_size": spec.batch_size,
        "num_params": sum(p.numel() for p in model.parameters()),
        "map_epochs": epochs,
        "map_train_s": train_s,
        "map_test_nll": gs.metrics.nll(map_probs, y_test),
        "map_test_acc": gs.metrics.accuracy(map_probs, y_test),
    }


def load_bundle(workdir: Path, name: str) -> tuple[nn.Module, dict[str, Tensor]]:
    bundle = torch.load(workdir / f"{name}.pt", weights_only=True)
    model = build_model(name)
    model.load_state_dict(bundle.pop("state_dict"))
    return model.eval(), bundle


def make_loader(data: dict[str, Tensor], batch_size: int) -> DataLoader:
    dataset = TensorDataset(data["x_train"], data["y_train"])
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


# ----------------------------------------------------------------------------- jobs


@dataclass(frozen=True)
class Case:
    model: str
    structure: str
    subset: str

    @property
    def name(self) -> str:
        return f"{self.model}/{self.structure}/{self.subset}"


@dataclass(frozen=True)
class Job:
    case: Case
    library: str  # "gaussify" | "laplace-torch"
    backend: str  # "" for gaussify
    tune_prior: bool
    repeats: int
    threads: int
    workdir: str

    @property
    def label(self) -> str:
        return self.backend or self.library

    @property
    def artifact(self) -> Path:
        stem = self.case.name.replace("/", "_")
        return Path(self.workdir) / f"{stem}_{self.label}.pt"


class Runner(Protocol):
    """What one pipeline run needs from either library."""

    def fit(self, loader: DataLoader) -> None: ...

    def log_marglik(self, prior: float) -> float: ...

    def tune_prior(self, n_steps: int) -> float: ...

    def set_prior(self, prior: float) -> None: ...

    def predict(self, x: Tensor) -> Tensor: ...

    def curvature(self) -> Tensor: ...


class GaussifyRunner:
    """gaussify with laplace-torch's conventions (no non-MAP correction, separate W/b blocks)."""

    def __init__(self, model: nn.Module, case: Case, batch_size: int) -> None:
        options: dict[str, Any] = {"kron_bias": "separate"} if case.structure == "kron" else {}
        self.la = gs.Laplace(
            model,
            "classification",
            case.structure,  # type: ignore[arg-type]
            case.subset,
            prior_precision=MAP_PRIOR,
            correction=False,
            **options,
        )
        self.structure = case.structure
        self.batch_size = batch_size

    def fit(self, loader: DataLoader) -> None:
        self.la.fit(loader)

    def log_marglik(self, prior: float) -> float:
        """From the closed form tuning left behind (the eigenvalues it computed), which is
        how gaussify evaluates the evidence over priors; the dense route would factorise A
        (for full, an ``eigh`` at the second evaluation: 26 s at P = 3760). The closed form
        equals the dense evidence to 1e-10 (tests/test_spectral_tuning.py)."""
        spectrum = self.la.spectrum("scalar")
        if spectrum is not None:
            return spectrum.evidence(np.log([prior]))[0]
        with torch.no_grad():
            return float(self.la.log_marginal_likelihood(prior))

    def tune_prior(self, n_steps: int) -> float:
        # exactly n_steps Adam steps from the current prior: laplace-torch's tuning (the
        # default optimize_prior runs L-BFGS to convergence instead)
        self.la.optimize_prior(method="gradient", n_steps=n_steps, lr=LR, fixed_steps=True)
        return float(self.la.prior_precision)

    def set_prior(self, prior: float) -> None:
        self.la.prior_precision = torch.tensor(prior, dtype=self.la.mean.dtype)
        self.la._posterior = None  # the cached factorisation belongs to the old prior

    def predict(self, x: Tensor) -> Tensor:
        pred = self.la.predict(x, method="glm", link="probit", chunk_size=self.batch_size)
        probs = pred.probs
        assert probs is not None
        return probs

    def curvature(self) -> Tensor:
        """G (dense P x P, or its diagonal for structure="diag")."""
        curv = self.la._curvature
        if self.structure == "full":
            return curv.ggn.clone()
        if self.structure == "diag":
            return curv.ggn_diag.clone()
        prior = torch.tensor(MAP_PRIOR, dtype=self.la.mean.dtype)
        with torch.no_grad():
            dense = self.la.posterior_at(prior, self.la.sigma_noise).precision_dense()
        dense = dense - MAP_PRIOR * torch.eye(dense.shape[0], dtype=dense.dtype)
        return dense.diagonal().clone() if self.structure == "diag" else dense


class LaplaceTorchRunner:
    """laplace-torch with one of its GGN backends."""

    def __init__(self, model: nn.Module, case: Case, backend: str, batch_size: int) -> None:
        from laplace import Laplace
        from laplace import curvature as lt_curvature

        self.la: Any = Laplace(
            model,
            "classification",
            subset_of_weights=case.subset,
            hessian_structure=case.structure,
            prior_precision=MAP_PRIOR,
            backend=getattr(lt_curvature, backend),
        )
        self.structure = case.structure
        self.batch_size = batch_size

    def fit(self, loader: DataLoader) -> None:
        self.la.fit(loader)

    def log_marglik(self, prior: float) -> float:
        with torch.no_grad():
            value = self.la.log_marginal_likelihood(prior_precision=torch.tensor(prior))
        return float(value)

    def tune_prior(self, n_steps: int) -> float:
        self.la.optimize_prior_precision(
            pred_type="glm",
            method="marglik",
            n_steps=n_steps,
            lr=LR,
            init_prior_prec=MAP_PRIOR,
        )
        return float(self.la.prior_precision)

    def set_prior(self, prior: float) -> None:
        self.la.prior_precision = prior

    def predict(self, x: Tensor) -> Tensor:
        chunks = x.split(self.batch_size)
        return torch.cat([self.la(c, pred_type="glm", link_approx="probit") for c in chunks])

    def curvature(self) -> Tensor:
        if self.structure == "kron":
            return self.la.H_facs.to_matrix()
        return self.la.H.detach().clone()


def make_runner(job: Job, model: nn.Module) -> Runner:
    batch_size = MODEL_SPECS[job.case.model].batch_size
    if job.library == "gaussify":
        return GaussifyRunner(model, job.case, batch_size)
    return LaplaceTorchRunner(model, job.case, job.backend, batch_size)


# ----------------------------------------------------------------------------- worker


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def current_rss_bytes() -> int:
    return _proc_status_kib("VmRSS") * 1024


def reset_peak_rss() -> None:
    """Reset this process's RSS high-water mark (Linux >= 4.0: ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    """VmHWM, the RSS high-water mark of this process's address space: the quantity behind
    ``getrusage().ru_maxrss`` but without the parent's peak that ru_maxrss inherits through
    vfork + exec, and resettable."""
    return _proc_status_kib("VmHWM") * 1024


@dataclass
class RunOutput:
    runner: Runner
    fit_s: float
    prior_s: float | None
    predict_s: float
    lml_map: float
    prior: float
    probs: Tensor
    prior_steps: int  # tuning steps actually run (< N_STEPS: prior_s extrapolated)
    probs_map: Tensor | None = None  # predictive at the MAP prior (agreement check)


def run_once(
    job: Job,
    model: nn.Module,
    data: dict[str, Tensor],
    loader: DataLoader,
    tuned: float | None,
    check: bool = False,
) -> RunOutput:
    """Fit, prior tuning (or set the tuned value), predict; all timed back to back from a
    fresh object, so nothing that one step caches (a factorisation, eigenvalues) is computed
    off the clock. Untimed, afterwards: the evidence at the MAP prior and, with ``check``,
    the predictive at the MAP prior (the agreement check, at the same prior for both)."""
    fit_s, runner = timed(lambda: _fit(job, model, loader))
    prior_s: float | None = None
    prior, steps = MAP_PRIOR, 0
    if job.tune_prior and tuned is None:
        prior_s, prior, steps = tune(job, runner)
    elif tuned is not None:
        runner.set_prior(tuned)
        prior, steps = tuned, N_STEPS
    predict_s, probs = timed(lambda: runner.predict(data["x_test"]))
    lml_map = runner.log_marglik(MAP_PRIOR)
    runner.set_prior(MAP_PRIOR)
    probs_map = runner.predict(data["x_test"]).detach() if check else None
    out = RunOutput(runner, fit_s, prior_s, predict_s, lml_map, prior, probs.detach(), steps)
    out.probs_map = probs_map
    return out


def tune(job: Job, runner: Runner) -> tuple[float, float, int]:
    """(seconds for N_STEPS, tuned prior, steps run). laplace-torch's full posterior costs a
    dense P x P log-determinant (and its backward) per step, the same every step, so when
    PROBE_STEPS of them project beyond MAX_PRIOR_S the time is extrapolated linearly."""
    if job.library == "laplace-torch" and job.case.structure == "full":
        probe_s, prior = timed(lambda: runner.tune_prior(PROBE_STEPS))
        if probe_s * N_STEPS / PROBE_STEPS > MAX_PRIOR_S:
            return probe_s * N_STEPS / PROBE_STEPS, prior, PROBE_STEPS
        runner.set_prior(MAP_PRIOR)
    seconds, prior = timed(lambda: runner.tune_prior(N_STEPS))
    return seconds, prior, N_STEPS


def _fit(job: Job, model: nn.Module, loader: DataLoader) -> Runner:
    runner = make_runner(job, model)
    runner.fit(loader)
    return runner


def preload(job: Job) -> None:
    """Import what the pipeline imports lazily, so the memory measurement excludes it."""
    if job.library == "gaussify":
        from gaussify.curvature import get_curvature_class

        get_curvature_class(job.case.structure)
    else:
        import laplace.curvature  # noqa: F401


def warm_up(job: Job, model: nn.Module, data: dict[str, Tensor], batch_size: int) -> None:
    """One untimed pipeline on one batch, so that one-time costs (lazy imports, torch.func
    tracing, backend hooks, thread pools) stay out of the first timed and measured run."""
    small = {k: v[:batch_size] for k, v in data.items()}
    runner = make_runner(job, model)
    runner.fit(make_loader(small, batch_size))
    runner.log_marglik(MAP_PRIOR)
    if job.tune_prior:
        runner.tune_prior(1)
    runner.predict(small["x_test"][:8])


def worker(job: Job) -> dict[str, Any]:
    """Run one configuration of one case; times in seconds, memory in MiB."""
    limit = MEMORY_LIMIT_GIB * 2**30
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    torch.set_num_threads(job.threads)
    warnings.filterwarnings("ignore")
    model, data = load_bundle(Path(job.workdir), job.case.model)
    device = os.environ.get("GAUSSIFY_BENCHMARK_DEVICE", "cpu")  # --device, via the parent
    model, data = model.to(device), {k: v.to(device) for k, v in data.items()}
    batch_size = MODEL_SPECS[job.case.model].batch_size
    loader = make_loader(data, batch_size)
    preload(job)
    warm_up(job, model, data, batch_size)
    times: dict[str, list[float]] = {"fit": [], "prior": [], "predict": []}
    reset_peak_rss()
    base_rss = current_rss_bytes()
    first = run_once(job, model, data, loader, None)
    peak_mib = (peak_rss_bytes() - base_rss) / 2**20
    runs = [first]
    slow = first.fit_s + (first.prior_s or 0.0) + first.predict_s > SLOW_RUN_S
    repeat_prior = first.prior_s is not None and first.prior_s < SLOW_RUN_S
    for i in range(1, 1 if slow else job.repeats):
        last_run = i == job.repeats - 1
        tuned = None if repeat_prior else first.prior
        runs.append(run_once(job, model, data, loader, tuned, check=last_run))
    if len(runs) == 1:  # the predictive at the MAP prior for the agreement check
        first.runner.set_prior(MAP_PRIOR)
        first.probs_map = first.runner.predict(data["x_test"]).detach()
    for run in runs:
        times["fit"].append(run.fit_s)
        times["predict"].append(run.predict_s)
        if run.prior_s is not None:
            times["prior"].append(run.prior_s)
    last = runs[-1]
    artifact = {
        "curvature": last.runner.curvature(),
        "probs": last.probs,
        "probs_map": last.probs_map,
    }
    if job.library == "gaussify":
        artifact["probs_map_f64"] = float64_oracle(job, model, data)
    torch.save(artifact, job.artifact)
    y_test = data["y_test"]
    tuned = job.tune_prior and first.prior_steps == N_STEPS
    return {
        "times": times,
        "peak_rss_mib": peak_mib,
        "lml_map": last.lml_map,
        "prior": last.prior if tuned else None,
        "prior_steps_timed": first.prior_steps if job.tune_prior else None,
        "test_nll": gs.metrics.nll(last.probs, y_test) if tuned else None,
        "test_acc": gs.metrics.accuracy(last.probs, y_test) if tuned else None,
    }


def float64_oracle(job: Job, model: nn.Module, data: dict[str, Tensor]) -> Tensor:
    """gaussify's GLM probit predictive at the MAP prior with the same (float32) weights and
    data cast to float64 (untimed): the reference that says which library's float32
    predictive is off when the two disagree."""
    data64 = {k: v.double() if v.is_floating_point() else v for k, v in data.items()}
    runner = make_runner(job, copy.deepcopy(model).double())
    runner.fit(make_loader(data64, MODEL_SPECS[job.case.model].batch_size))
    runner.set_prior(MAP_PRIOR)
    return runner.predict(data64["x_test"]).detach()


def spawn(job: Job, timeout_s: float) -> dict[str, Any]:
    """Run ``job`` in a fresh interpreter (so max RSS is its own); errors are recorded."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(asdict(job))]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout_s:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        return {"error": f"exit {proc.returncode}: {' '.join(tail)[:300]}"}
    return json.loads(lines[-1][len("RESULT ") :])


def job_from_json(text: str) -> Job:
    raw = json.loads(text)
    return Job(**{**raw, "case": Case(**raw["case"])})


# ----------------------------------------------------------------------------- agreement


def rel_diff(a: Tensor, b: Tensor) -> float:
    """max |a - b| / max |b| (scale-free, robust to tiny entries)."""
    a64, b64 = a.double(), b.double()
    return float((a64 - b64).abs().max() / b64.abs().max().clamp_min(1e-300))


def scalar_rel(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return abs(a - b) / max(abs(b), 1e-300)


def agreement(gs_job: Job, ref_jobs: list[Job], outs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """gaussify vs each laplace-torch backend: curvature, log evidence at the MAP prior; vs the
    prior-tuning backend: tuned prior, test predictive."""
    if "error" in outs[gs_job.label]:
        return {}
    mine = torch.load(gs_job.artifact, weights_only=True)
    result: dict[str, Any] = {}
    for job in ref_jobs:
        ref_out = outs[job.label]
        if "error" in ref_out:
            continue
        ref = torch.load(job.artifact, weights_only=True)
        entry: dict[str, Any] = {
            "curvature": rel_diff(mine["curvature"], ref["curvature"]),
            "lml_map": scalar_rel(outs[gs_job.label]["lml_map"], ref_out["lml_map"]),
            # GLM probit predictive of both at the MAP prior: max |p_gs - p_lt|
            "probs_map_max_abs": float((mine["probs_map"] - ref["probs_map"]).abs().max()),
        }
        oracle = mine.get("probs_map_f64")
        if oracle is not None:  # each float32 predictive against the float64 one
            entry["float64_oracle"] = {
                "gaussify": float((mine["probs_map"].double() - oracle).abs().max()),
                "laplace_torch": float((ref["probs_map"].double() - oracle).abs().max()),
            }
        if job.tune_prior and ref_out["prior"] is not None:
            entry["tuned_prior"] = scalar_rel(outs[gs_job.label]["prior"], ref_out["prior"])
            entry["probs_max_abs"] = float((mine["probs"] - ref["probs"]).abs().max())
            entry["test_nll"] = scalar_rel(outs[gs_job.label]["test_nll"], ref_out["test_nll"])
        values = [v for k, v in entry.items() if v is not None and k != "float64_oracle"]
        entry["agree"] = bool(max(values) <= AGREE_RTOL)
        result[job.backend] = entry
    return result


# ----------------------------------------------------------------------------- cases


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def case_summary(case: Case, jobs: list[Job], outs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Medians per configuration, the default and best reference, ratios ref / gaussify."""
    configs: dict[str, Any] = {}
    for job in jobs:
        out = outs[job.label]
        if "error" in out:
            configs[job.label] = {"error": out["error"]}
            continue
        configs[job.label] = {
            "fit_s": median(out["times"]["fit"]),
            "prior_s": median(out["times"]["prior"]),
            "predict_s": median(out["times"]["predict"]),
            "n_runs": len(out["times"]["fit"]),
            "peak_rss_mib": out["peak_rss_mib"],
            "lml_map": out["lml_map"],
            "tuned_prior": out["prior"],
            "prior_steps_timed": out["prior_steps_timed"],
            "test_nll": out["test_nll"],
            "test_acc": out["test_acc"],
        }
    gs_job, ref_jobs = jobs[0], jobs[1:]
    summary: dict[str, Any] = {"case": asdict(case), "configs": configs}
    summary["reference"] = reference_views(configs, [j.backend for j in ref_jobs])
    summary["speedup"] = speedups(configs.get("gaussify", {}), summary["reference"])
    summary["agreement"] = agreement(gs_job, ref_jobs, outs)
    return summary


def reference_views(configs: dict[str, Any], backends: list[str]) -> dict[str, Any]:
    """laplace-torch at its default backend and the best backend per quantity; prior tuning
    (backend-independent) comes from the default backend's run."""
    ok = {b: configs[b] for b in backends if b in configs and "error" not in configs[b]}
    tuned = next((c for c in ok.values() if c["prior_s"] is not None), None)
    prior_s = tuned["prior_s"] if tuned else None
    steps = tuned["prior_steps_timed"] if tuned else None
    views: dict[str, Any] = {}
    if DEFAULT_BACKEND in ok:
        d = ok[DEFAULT_BACKEND]
        views["default"] = {
            "backend": DEFAULT_BACKEND,
            "fit_s": d["fit_s"],
            "prior_s": prior_s,
            "prior_steps_timed": steps,
            "predict_s": d["predict_s"],
            "peak_rss_mib": d["peak_rss_mib"],
        }
    if ok:
        fit_b = min(ok, key=lambda b: ok[b]["fit_s"])
        pred_b = min(ok, key=lambda b: ok[b]["predict_s"])
        views["best"] = {
            "fit_backend": fit_b,
            "fit_s": ok[fit_b]["fit_s"],
            "prior_s": prior_s,
            "prior_steps_timed": steps,
            "predict_backend": pred_b,
            "predict_s": ok[pred_b]["predict_s"],
            "peak_rss_mib": min(c["peak_rss_mib"] for c in ok.values()),
        }
    return views


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def speedups(mine: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """laplace-torch time / gaussify time (> 1: gaussify is faster)."""
    if not mine or "error" in mine:
        return {}
    out: dict[str, Any] = {}
    for view, ref in reference.items():
        fit_prior_ref = None if ref["prior_s"] is None else ref["fit_s"] + ref["prior_s"]
        fit_prior_mine = None if mine["prior_s"] is None else mine["fit_s"] + mine["prior_s"]
        out[view] = {
            "fit": _ratio(ref["fit_s"], mine["fit_s"]),
            "prior": _ratio(ref["prior_s"], mine["prior_s"]),
            "fit_plus_prior": _ratio(fit_prior_ref, fit_prior_mine),
            "predict": _ratio(ref["predict_s"], mine["predict_s"]),
        }
    return out


def build_cases(models: list[str], quick: bool) -> list[Case]:
    if quick:
        return [
            Case("mlp", "diag", "all"),
            Case("mlp", "kron", "all"),
            Case("mlp", "full", "last_layer"),
        ]
    return [Case(m, s, sub) for m in models for s in STRUCTURES for sub in SUBSETS]


def jobs_for(
    case: Case, backends: tuple[str, ...], args: argparse.Namespace, workdir: Path
) -> list[Job]:
    """gaussify, then each laplace-torch backend not skipped for the case; the default backend
    (or the first one run) also tunes the prior."""
    common = {"repeats": args.repeats, "threads": args.threads, "workdir": str(workdir)}
    jobs = [Job(case, "gaussify", "", True, **common)]
    run = [b for b in backends if b not in SKIPPED.get(case.name, {})]
    for backend in run:
        jobs.append(Job(case, "laplace-torch", backend, backend == run[0], **common))
    return jobs


def run_case(
    case: Case, backends: tuple[str, ...], args: argparse.Namespace, workdir: Path
) -> dict[str, Any]:
    jobs = jobs_for(case, backends, args, workdir)
    outs: dict[str, dict[str, Any]] = {}
    for job in jobs:
        start = time.perf_counter()
        outs[job.label] = spawn(job, args.timeout)
        status = outs[job.label].get("error", "ok")
        print(
            f"  {case.name:24s} {job.label:14s} {time.perf_counter() - start:6.1f} s  {status}",
            flush=True,
        )
    summary = case_summary(case, jobs, outs)
    summary["skipped"] = {b: why for b, why in SKIPPED.get(case.name, {}).items() if b in backends}
    return summary


# ----------------------------------------------------------------------------- issue ratios


def gradient_epoch(model: nn.Module, loader: DataLoader) -> None:
    """One pass of forward + backward of the summed NLL over the training batches."""
    for x, y in loader:
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()


def gaussify_fit(model: nn.Module, loader: DataLoader, structure: str, **options: Any) -> None:
    gs.Laplace(model, "classification", structure, "all", **options).fit(loader)  # type: ignore[arg-type]


def matmul_of_ggn_size(num_params: int, rows: int) -> Callable[[], Tensor]:
    """(P x NC) @ (NC x P): the single matmul a dense GGN J^T Lambda J costs at least."""
    a = torch.randn(num_params, rows)
    b = a.T.contiguous()
    return lambda: a @ b


def issue_ratios(name: str, workdir: Path, repeats: int) -> dict[str, Any]:
    """gaussify fit times over one gradient epoch and over one GGN-sized matmul (interleaved)."""
    warnings.filterwarnings("ignore")
    model, data = load_bundle(workdir, name)
    loader = make_loader(data, MODEL_SPECS[name].batch_size)
    num_params = sum(p.numel() for p in model.parameters())
    rows = int(data["x_train"].shape[0]) * NUM_CLASSES
    tasks: dict[str, Callable[[], Any]] = {
        "gradient_epoch": lambda: gradient_epoch(copy.deepcopy(model), loader),
        "diag_fit": lambda: gaussify_fit(model, loader, "diag"),
        "kron_fit_exact": lambda: gaussify_fit(model, loader, "kron"),
        "kron_fit_mc1": lambda: gaussify_fit(model, loader, "kron", mc_samples=1),
        "full_fit": lambda: gaussify_fit(model, loader, "full"),
        "ggn_matmul": matmul_of_ggn_size(num_params, rows),
    }
    samples: dict[str, list[float]] = {k: [] for k in tasks}
    for _ in range(repeats):
        for key, task in tasks.items():
            samples[key].append(timed(task)[0])
    med = {k: statistics.median(v) for k, v in samples.items()}
    epoch = med["gradient_epoch"]
    return {
        "num_params": num_params,
        "matmul_shape": [num_params, rows],
        "seconds": med,
        "diag_fit_over_epoch": med["diag_fit"] / epoch,
        "kron_exact_fit_over_epoch": med["kron_fit_exact"] / epoch,
        "kron_mc1_fit_over_epoch": med["kron_fit_mc1"] / epoch,
        "full_fit_over_matmul": med["full_fit"] / med["ggn_matmul"],
    }


# ----------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    name: str
    case: str
    value: float | None
    threshold: float
    higher_is_better: bool
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        if self.higher_is_better:
            return self.value >= self.threshold
        return self.value <= self.threshold


def speedup_targets(cases: list[dict[str, Any]]) -> list[Target]:
    """Issue: >= 10x for full (fit + prior), >= 20x diag fit, >= 2x kron (fit + prior), checked
    against laplace-torch's default backend and its best backend per quantity."""
    spec = {
        "full": ("fit_plus_prior", 10.0),
        "diag": ("fit", 20.0),
        "kron": ("fit_plus_prior", 2.0),
    }
    targets = []
    for case in cases:
        structure = case["case"]["structure"]
        key, threshold = spec[structure]
        name = f"{structure} {key.replace('_', ' ')} speedup"
        case_name = Case(**case["case"]).name
        for view, ratios in case["speedup"].items():
            targets.append(Target(f"{name} vs {view}", case_name, ratios.get(key), threshold, True))
    return targets


def prior_targets(cases: list[dict[str, Any]]) -> list[Target]:
    """Issue: prior tuning on a fitted full / kron posterior >= 10x faster than laplace-torch
    (its tuning touches only the fitted curvature, the same for every backend, so one
    number per case)."""
    targets = []
    for case in cases:
        if case["case"]["structure"] not in ("full", "kron"):
            continue
        view = case["speedup"].get("default") or case["speedup"].get("best") or {}
        name = f"{case['case']['structure']} prior tuning speedup"
        targets.append(Target(name, Case(**case["case"]).name, view.get("prior"), 10.0, True))
    return targets


def agreement_targets(cases: list[dict[str, Any]]) -> list[Target]:
    """Issue: where laplace-torch computes the same quantity (GGN, log marginal likelihood,
    GLM probit predictive) gaussify agrees to 1e-4 (curvature and evidence relative, the
    predictive probabilities at the same (MAP) prior absolute), against the default backend
    (the first one run where it is skipped). BackPackGGN's Conv2d KFAC uses another factor
    convention than CurvlinopsGGN, AsdlGGN and gaussify (see the README), so the worst
    backend would only measure that."""
    targets = []
    for case in cases:
        name = Case(**case["case"]).name
        agreement = case["agreement"]
        backend = DEFAULT_BACKEND if DEFAULT_BACKEND in agreement else next(iter(agreement), None)
        entry = agreement.get(backend, {}) if backend else {}
        oracle = entry.get("float64_oracle")
        for key, label in (
            ("curvature", "GGN rel. diff"),
            ("lml_map", "log marglik rel. diff"),
            ("probs_map_max_abs", "probit predictive max abs diff"),
        ):
            note = f"vs {backend}" if backend else ""
            if key == "probs_map_max_abs" and oracle:
                note += (
                    f"; vs float64: gaussify {oracle['gaussify']:.1e}, "
                    f"laplace-torch {oracle['laplace_torch']:.1e}"
                )
            targets.append(
                Target(f"agreement: {label}", name, entry.get(key), AGREE_RTOL, False, note)
            )
    return targets


def epoch_targets(ratios: dict[str, dict[str, Any]]) -> list[Target]:
    """Issue: diag fit <= 2C epochs, KFAC <= C (exact) / <= 3 (MC) epochs, full <= 1.3 matmul."""
    targets = []
    for name, r in ratios.items():
        case = f"{name}/all"
        targets += [
            Target(
                "diag fit / gradient epoch",
                case,
                r["diag_fit_over_epoch"],
                2.0 * NUM_CLASSES,
                False,
            ),
            Target(
                "kron exact fit / gradient epoch",
                case,
                r["kron_exact_fit_over_epoch"],
                float(NUM_CLASSES),
                False,
            ),
            Target("kron mc1 fit / gradient epoch", case, r["kron_mc1_fit_over_epoch"], 3.0, False),
            Target("full fit / GGN-sized matmul", case, r["full_fit_over_matmul"], 1.3, False),
        ]
    return targets


# ----------------------------------------------------------------------------- report


def thread_latency_ms(probe_size: int = 1000, calls: int = 21) -> float:
    """Median time of one small ``torch.exp``: about 0.005 ms on an idle machine; several ms
    when the intra-op threads wait for a CPU that other processes hold (oversubscription)."""
    x = torch.rand(probe_size)
    samples = sorted(timed(x.exp)[0] for _ in range(calls))
    return 1e3 * samples[calls // 2]


def machine_info(threads: int) -> dict[str, Any]:
    try:
        lt_version: str | None = version("laplace-torch")
    except PackageNotFoundError:
        lt_version = None
    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "laplace_torch": lt_version,
        "gaussify": gs.__version__,
        "torch_threads": threads,
        "small_op_latency_ms": thread_latency_ms(),
        "load_average": list(os.getloadavg()),
    }


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(cases: list[dict[str, Any]], targets: list[Target], ratios: dict[str, Any]) -> None:
    head = (
        f"{'case':22s} {'gs fit':>8s} {'lt fit':>8s} {'best':>8s} {'gs prior':>9s} "
        f"{'lt prior':>9s} {'gs pred':>8s} {'lt pred':>8s} {'x fit+pr':>9s} {'x best':>7s} "
        f"{'gs MiB':>7s} {'lt MiB':>7s} {'lml gs':>10s} {'lml lt':>10s} {'nll gs':>7s} "
        f"{'nll lt':>7s} {'agree':>8s}"
    )
    print("\nTimes in s (median); x = laplace-torch / gaussify (>1: gaussify faster)")
    print(head)
    print("-" * len(head))
    for case in cases:
        print(case_row(case))
    print("\nIssue ratios (gaussify, subset all)")
    for name, r in ratios.items():
        s = r["seconds"]
        print(
            f"  {name}: epoch {s['gradient_epoch']:.3f} s, diag {r['diag_fit_over_epoch']:.1f}x, "
            f"kron exact {r['kron_exact_fit_over_epoch']:.1f}x, kron mc1 "
            f"{r['kron_mc1_fit_over_epoch']:.1f}x epochs; full fit {s['full_fit']:.3f} s = "
            f"{r['full_fit_over_matmul']:.2f}x matmul {r['matmul_shape']} ({s['ggn_matmul']:.3f} s)"
        )
    print("\nTargets")
    for t in targets:
        flag = {True: "met", False: "MISSED", None: "n/a"}[t.met]
        cmp = ">=" if t.higher_is_better else "<="
        print(
            f"  {flag:6s} {t.case:22s} {t.name:38s} {fmt(t.value, '.3g'):>8s} {cmp} {t.threshold:g}"
            + (f"  ({t.note})" if t.note else "")
        )


def case_row(case: dict[str, Any]) -> str:
    configs = case["configs"]
    mine = configs.get("gaussify", {})
    ref = case["reference"].get("default", {})
    best = case["reference"].get("best", {})
    lt = configs.get(DEFAULT_BACKEND, {})
    sp = case["speedup"]
    agreements = case["agreement"]
    agree = agreements.get(DEFAULT_BACKEND) or next(iter(agreements.values()), {})
    worst = max((v for v in agree.values() if isinstance(v, float)), default=None)
    return (
        f"{Case(**case['case']).name:22s} {fmt(mine.get('fit_s')):>8s} {fmt(ref.get('fit_s')):>8s} "
        f"{fmt(best.get('fit_s')):>8s} {fmt(mine.get('prior_s')):>9s} "
        f"{fmt(ref.get('prior_s')):>9s} "
        f"{fmt(mine.get('predict_s')):>8s} {fmt(ref.get('predict_s')):>8s} "
        f"{fmt(sp.get('default', {}).get('fit_plus_prior'), '.2f'):>9s} "
        f"{fmt(sp.get('best', {}).get('fit_plus_prior'), '.2f'):>7s} "
        f"{fmt(mine.get('peak_rss_mib'), '.0f'):>7s} {fmt(lt.get('peak_rss_mib'), '.0f'):>7s} "
        f"{fmt(mine.get('lml_map'), '.2f'):>10s} {fmt(lt.get('lml_map'), '.2f'):>10s} "
        f"{fmt(mine.get('test_nll'), '.4f'):>7s} {fmt(lt.get('test_nll'), '.4f'):>7s} "
        f"{fmt(worst, '.1e'):>8s}"
    )


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="MLP only, 3 cases, 1 repeat (< 2 min)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--repeats", type=int, default=None, help="timing repeats (default 3)")
    parser.add_argument("--timeout", type=float, default=900.0, help="per-subprocess limit in s")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--fits", action="store_true", help="the curvature fits of issue 17 (curvature_fits.py)"
    )
    parser.add_argument("--device", default="cpu", help="torch device for models and data")
    parser.add_argument("--jobs", type=int, default=1, help="--fits: cases run at once")
    parser.add_argument(
        "--cases", nargs="+", metavar="NAME", help="--fits: only these cases (curvature_fits.py)"
    )
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = FITS_OUT if args.fits else DEFAULT_OUT
    if args.worker is None:  # a worker takes the parent's, from its environment
        os.environ["GAUSSIFY_BENCHMARK_DEVICE"] = args.device
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    return args


def check_reference() -> None:
    try:
        import laplace  # noqa: F401
    except ModuleNotFoundError:
        sys.exit(
            "laplace-torch is not installed: pip install --no-deps laplace-torch "
            "curvlinops-for-pytorch backpack-for-pytorch asdfghjkl==0.1a4 unfoldNd opt-einsum "
            "einops einconv torchmetrics lightning-utilities linear_operator"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        print("RESULT " + json.dumps(worker(job_from_json(args.worker))), flush=True)
        return
    check_reference()
    if args.fits:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import curvature_fits

        fits_argv = ["--threads", str(args.threads), "--repeats", str(args.repeats)]
        fits_argv += ["--device", args.device, "--out", str(args.out), "--jobs", str(args.jobs)]
        fits_argv += ["--cases", *args.cases] if args.cases else []
        curvature_fits.main(fits_argv + (["--quick"] if args.quick else []))
        return
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    models = ["mlp"] if args.quick else ["mlp", "cnn"]
    backends = (DEFAULT_BACKEND, "BackPackGGN") if args.quick else BACKENDS
    info = machine_info(args.threads)
    if info["small_op_latency_ms"] > 0.5:
        print(
            f"warning: a 1000-element torch.exp takes {info['small_op_latency_ms']:.1f} ms with "
            f"{args.threads} threads (the CPUs are oversubscribed); timings will measure the "
            "scheduler; consider --threads 1",
            flush=True,
        )
    with tempfile.TemporaryDirectory(prefix="lvlt-") as tmp:
        workdir = Path(tmp)
        setups = {}
        for m in models:
            spec = MODEL_SPECS[m]
            epochs = max(spec.epochs // 5, 5) if args.quick else spec.epochs
            setups[m] = prepare_model(spec, workdir, epochs)
            print(f"MAP {m}: {setups[m]}", flush=True)
        cases = [run_case(c, backends, args, workdir) for c in build_cases(models, args.quick)]
        ratios = {m: issue_ratios(m, workdir, args.repeats) for m in models}
    targets = (
        speedup_targets(cases)
        + prior_targets(cases)
        + epoch_targets(ratios)
        + agreement_targets(cases)
    )
    info["load_average_end"] = list(os.getloadavg())
    report = {
        "benchmark": "laplace_vs_laplace_torch",
        "quick": args.quick,
        "machine": info,
        "settings": {
            "map_prior_precision": MAP_PRIOR,
            "batch_size": {m: s.batch_size for m, s in MODEL_SPECS.items()},
            "prior_tuning": {"n_steps": N_STEPS, "lr": LR, "optimizer": "Adam on log prior"},
            "repeats": args.repeats,
            "slow_run_s": SLOW_RUN_S,
            "agreement_rtol": AGREE_RTOL,
            "memory": "peak RSS (VmHWM, reset via /proc/self/clear_refs) during the first run "
            "minus RSS before it, one subprocess per configuration, MiB",
            "gaussify_options": {"correction": False, "kron_bias": "separate (kron cases)"},
        },
        "models": setups,
        "cases": cases,
        "issue_ratios": ratios,
        "targets": [{**asdict(t), "met": t.met} for t in targets],
        "wall_s": time.perf_counter() - start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(cases, targets, ratios)
    print(f"\nwrote {args.out} in {report['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
