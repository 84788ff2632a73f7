"""Static device rules over the library (issue 17): every fit and predict keeps its tensors on
the model's device, so a new tensor constructor without ``device=`` or a new host copy / sync
in the library must be justified here, or it fails this test (which runs on a CPU-only
machine, where the device bugs themselves cannot show).

Checked: calls ``torch.<constructor>(...)`` (``zeros``, ``eye``, ``tensor``, ``as_tensor``,
``randn``, ...) without a ``device=`` keyword (or ``**kwargs`` carrying it), unless moved in the
same expression (inside ``.to(...)``, ``nn.Parameter(...)`` or ``register_buffer(...)``: module
state moves with ``Module.to``); and every ``.cpu()``, ``.item()``, ``.numpy()``, ``.tolist()``.
Each allowed occurrence is listed below by (function, call) with how many times it occurs and
why it is needed; the count catches a second occurrence added to an allowed function.
Not checked statically: ``float(t)`` / ``bool(t)`` / ``if t:`` on tensors (no types in the
AST); the per-step finiteness checks of the training loops are such syncs, kept on purpose
(a NaN loss is reported at the step it appears, before the optimiser writes it into the
weights).

Out of scope (not fit / predict paths of the families): ``experiments/`` and ``data/`` (CPU
reproduction scripts and dataset files), ``compat/`` (the laplace-torch / vbll front ends,
which delegate fitting and prediction to the families checked here), ``plots.py``,
``demo.py``, ``cli.py``, ``cli_args.py``.
"""

from __future__ import annotations

import argparse
import ast
import collections
from pathlib import Path

import pytest
import torch

from gaussify.cli_args import add_device_argument, device_argument

SRC = Path(__file__).resolve().parents[1] / "src" / "gaussify"
EXCLUDED = ("experiments/", "compat/", "data/", "plots.py", "demo.py", "cli.py", "cli_args.py")

#: tensor constructors that allocate on the default (host) device unless given ``device=``
CONSTRUCTORS = frozenset(
    {
        "arange",
        "as_tensor",
        "empty",
        "eye",
        "full",
        "linspace",
        "logspace",
        "normal",
        "ones",
        "rand",
        "randint",
        "randn",
        "randperm",
        "tensor",
        "tril_indices",
        "triu_indices",
        "zeros",
    }
)
#: calls that copy to the host or wait for the device
HOST_CALLS = frozenset({"cpu", "item", "numpy", "tolist"})
#: calls whose argument is moved with the module or to a device (a constructor inside one is fine)
_MOVES = frozenset({"to", "register_buffer", "Parameter"})


def _called_name(call):
    fn = call.func
    return fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""


def scan(path, rel):
    tree = ast.parse(path.read_text())
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    found = []

    def qualname(node):
        names = []
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
        return ".".join(reversed(names)) or "<module>"

    def moved(node):
        while node in parents and not isinstance(parents[node], ast.stmt):
            node = parents[node]
            if isinstance(node, ast.Call) and _called_name(node) in _MOVES:
                return True
        return False

    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        fn = node.func
        if isinstance(fn.value, ast.Name) and fn.value.id == "torch" and fn.attr in CONSTRUCTORS:
            keywords = {k.arg for k in node.keywords}
            if "device" in keywords or None in keywords or moved(node):
                continue
            found.append((rel, qualname(node), f"torch.{fn.attr}", node.lineno))
        elif fn.attr in HOST_CALLS and not node.args and not node.keywords:
            found.append((rel, qualname(node), f".{fn.attr}()", node.lineno))
    return found


# ---------------------------------------------------------------------------- allow-list
HOST_OPT = (
    "host by design: a scipy/numpy optimiser or solver runs on the host (L-BFGS in tuning, "
    "ARPACK eigsh, k-means); one transfer per evaluation, not per batch"
)
SPECTRAL = (
    "host by design: the closed-form evidence (spectral.py) is float64 numpy, built once per "
    "tuning run"
)
COUNT = (
    "a bookkeeping count or flag in a saved state / result (host integer by contract of the "
    "state schemas)"
)
INDEX = (
    "parameter-index bookkeeping (names, offsets, groups) on the host; indexing a device tensor"
    " with host indices is allowed"
)
ORDER = (
    "an order of examples from a host generator (the same order on every device); indexing a "
    "device tensor with host indices is allowed"
)
SCALAR = (
    "a 0-dim value: PyTorch combines a CPU scalar tensor with operands on any device (result on"
    " theirs)"
)
MESSAGE = "only inside the message of an error being raised"
HOST_DRAW = (
    "drawn from the host generator (the same draws on every device) and moved to the device on "
    "the next line"
)
NODEVICE = (
    "state of a feature-space model built from sizes and a dtype (no model to take a device "
    "from) on the host; its update methods run on the host (follow-up: a device argument, as "
    "ExactLastLayer has)"
)
INPUT = (
    "a conversion of a user-given number/array to a tensor; the caller moves it (checked by the"
    " dtype/device guards)"
)
DISTRIBUTED = (
    "collective bookkeeping of the gloo / host backend (status flags and counts), once per "
    "reduction"
)
GUARD = "element size of a dtype for the memory guard (no data)"
FINGERPRINT = "a model fingerprint kept on the host for saved states (one transfer per save/load)"
KRON = (
    "Kronecker factors / block indices in curvature/kron.py (owned by h22-kfac; factors are "
    "created with **dd from the model, block indices are host indices)"
)
ACTIVE = "active learning pool bookkeeping (host indices of a pool)"
INPUT_CHECK = "conversion of a user-given argument inside its check"
GRID = "a grid of scalar hyperparameter values on the host, each read as a Python float"
MODULE_INIT = (
    "the initial value of an nn.Module parameter, set at construction (moved by Module.to)"
)

#: (function qualname, call) -> (occurrences allowed, reason)
ALLOWED: dict[tuple[str, str], tuple[int, str]] = {
    # approx_likelihoods/closed_forms.py
    ("gaussian_approx", "torch.as_tensor"): (1, INPUT),
    ("dirichlet_logit_prior", "torch.tensor"): (1, INPUT),
    # approx_likelihoods/gp_classification.py
    ("GPClassifier.optimize", ".numpy()"): (1, HOST_OPT),
    ("GPClassifier.optimize.objective", ".numpy()"): (1, HOST_OPT),
    ("GPClassifier.predict", "torch.randn"): (1, HOST_DRAW),
    ("GPClassifier.set_data", "torch.full"): (2, NODEVICE),
    # approx_likelihoods/numerical.py
    ("_float", "torch.as_tensor"): (1, INPUT),
    ("variational_reparam", "torch.as_tensor"): (1, INPUT),
    # approx_likelihoods/tuning.py
    ("tune_alpha_eps.objective", "torch.tensor"): (1, HOST_OPT),
    # batches.py
    ("_TensorBatches.__iter__", "torch.arange"): (1, ORDER),
    ("_TensorBatches.__iter__", "torch.randperm"): (1, ORDER),
    ("_TensorLoaderBatches.__iter__", "torch.empty"): (
        1,
        "the DataLoader iterator's base-seed draw, replicated on its (host) generator so the "
        "random streams advance as the loader's own iteration; never read",
    ),
    # curvature/base.py
    ("as_hyperparameter", "torch.as_tensor"): (1, INPUT),
    # host_heap.py
    ("keep_freed_memory", "torch.empty"): (
        1,
        "an untouched host block freed at once, only for a CPU pass: it sets the C heap's "
        "thresholds (glibc), not data",
    ),
    # curvature/diag.py
    ("DiagGGN.state_dict", "torch.tensor"): (1, COUNT),
    # curvature/full.py
    ("FullGGN.state_dict", "torch.tensor"): (1, COUNT),
    # curvature/kron.py
    ("block_index", "torch.arange"): (2, KRON),  # curvature/kron_modules.py
    ("KronGGN.state_dict", "torch.tensor"): (1, COUNT),
    # curvature/lowrank.py
    ("LowRankGGN.state_dict", "torch.tensor"): (1, COUNT),
    ("top_eigenpairs", ".cpu()"): (1, HOST_OPT),
    ("top_eigenpairs", ".numpy()"): (1, HOST_OPT),
    ("top_eigenpairs.mv", ".numpy()"): (1, HOST_OPT),
    # curvature/subset.py
    ("ParameterSubset.counts", ".cpu()"): (1, INDEX),
    ("ParameterSubset.counts", "torch.tensor"): (1, INDEX),
    ("_as_tensor64", "torch.as_tensor"): (1, INDEX),
    ("_subnetwork", ".cpu()"): (2, INDEX),
    ("_subnetwork", ".tolist()"): (1, INDEX),
    ("_subnetwork", "torch.tensor"): (1, INDEX),
    ("_subnetwork", "torch.zeros"): (2, INDEX),
    # distributed.py
    ("_exchange_status", ".cpu()"): (1, DISTRIBUTED),
    ("all_gather_cat", ".cpu()"): (1, DISTRIBUTED),
    ("all_reduce_sum", ".item()"): (1, DISTRIBUTED),
    ("all_reduce_sum", "torch.tensor"): (2, DISTRIBUTED),
    ("broadcast", ".tolist()"): (1, DISTRIBUTED),
    # evidence.py
    ("finite_evidence", ".item()"): (1, MESSAGE),
    ("log_likelihood_supremum", "torch.zeros"): (1, SCALAR),
    ("optimize_hyperparameters", "torch.as_tensor"): (1, INPUT),
    # function_space/ella.py
    ("ELLA._factor", "torch.ones"): (1, SCALAR),
    ("select_landmarks", ".numpy()"): (1, HOST_OPT),
    ("select_landmarks", "torch.as_tensor"): (1, ORDER),
    ("select_landmarks", "torch.randperm"): (1, ORDER),
    ("select_landmarks", "torch.tensor"): (1, ORDER),
    ("select_landmarks", "torch.zeros"): (1, ORDER),
    # function_space/gp.py
    ("FunctionalLaplace.fit", "torch.randperm"): (1, ORDER),
    # function_space/ntk.py
    ("ntk_components", "torch.ones"): (1, SCALAR),
    # function_space/sampled_lla.py
    ("SampledLLA._curvature_bound", "torch.randn"): (1, HOST_DRAW),
    ("SampledLLA._iter_batches", "torch.arange"): (1, ORDER),
    ("SampledLLA._iter_batches", "torch.randperm"): (1, ORDER),
    # function_space/valla_kernel.py
    ("InducingKernel._training_sample", "torch.randperm"): (1, HOST_OPT),
    ("InducingKernel._kmeans", ".cpu()"): (1, HOST_OPT),
    ("InducingKernel._kmeans", ".numpy()"): (1, HOST_OPT),
    # last_layer/base.py, vbll_*.py: initial values of head parameters
    ("VBLLHead.random_rows", "torch.randn"): (1, MODULE_INIT),
    ("VBLLGenerative.__init__", "torch.randn"): (1, MODULE_INIT),
    ("VBLLHeteroscedasticDiscriminative.__init__", "torch.zeros"): (1, MODULE_INIT),
    ("VBLLHeteroscedasticRegression.__init__", "torch.zeros"): (1, MODULE_INIT),
    # weight_space/laplace_evidence.py
    ("prior_groups", "torch.arange"): (2, INDEX),
    ("prior_groups", "torch.tensor"): (1, INDEX),
    ("prior_groups", "torch.zeros"): (1, INDEX),
    ("SampledLLA.sample", "torch.randperm"): (1, ORDER),
    # function_space/valla.py
    ("VaLLA.sample", "torch.randn"): (2, HOST_DRAW),
    # last_layer/active.py
    ("ActiveLearner.__init__", ".tolist()"): (1, ACTIVE),
    ("ActiveLearner.__init__", "torch.as_tensor"): (1, ACTIVE),
    ("ActiveLearner.__init__", "torch.ones"): (1, ACTIVE),
    ("ActiveLearner.step", "torch.randint"): (1, ACTIVE),
    ("active_learning", "torch.randperm"): (1, ORDER),
    # last_layer/adf.py
    ("ADFLastLayer._update_point", "torch.randn"): (1, NODEVICE),
    ("ADFLastLayer.reset", "torch.eye"): (1, NODEVICE),
    ("ADFLastLayer.reset", "torch.zeros"): (1, NODEVICE),
    ("ADFLastLayer.update", ".tolist()"): (1, NODEVICE),
    ("SGDLastLayer.reset", "torch.zeros"): (1, NODEVICE),
    # last_layer/gbll.py
    ("GBLLRegression._checked_hyperparameters", ".tolist()"): (1, MESSAGE),
    ("GBLLRegression.set_hyperparameters", ".tolist()"): (1, MESSAGE),
    ("GBLLRegression.set_hyperparameters", "torch.as_tensor"): (1, INPUT),
    # last_layer/exact.py
    ("ExactLastLayer.optimize_prior", "torch.logspace"): (1, GRID),
    ("ExactLastLayer.optimize_prior", "torch.tensor"): (1, GRID),
    ("ExactLastLayer.elbo", "torch.randn"): (1, HOST_DRAW),
    # likelihoods.py
    ("Gaussian.__init__", "torch.as_tensor"): (1, INPUT),
    ("check_sigma_noise", ".tolist()"): (1, MESSAGE),
    # marglik.py
    ("marglik_training", ".item()"): (1, MESSAGE),
    # memory_guard.py
    ("check_allocation", "torch.empty"): (1, GUARD),
    # spectral.py
    ("build_spectrum", ".cpu()"): (2, SPECTRAL),
    ("build_spectrum", ".numpy()"): (2, SPECTRAL),
    ("build_spectrum.np64", ".numpy()"): (1, SPECTRAL),
    # state.py
    ("_fingerprint_scale", "torch.tensor"): (1, FINGERPRINT),
    ("model_fingerprint", ".cpu()"): (1, FINGERPRINT),
    ("model_fingerprint", "torch.zeros"): (1, FINGERPRINT),
    # training.py
    ("train_map", ".item()"): (2, MESSAGE),
    # tuning.py
    ("_Objective.__call__", ".numpy()"): (1, HOST_OPT),
    ("_tune", ".numpy()"): (1, HOST_OPT),
    ("check_grid", "torch.as_tensor"): (1, HOST_OPT),
    ("check_positive", ".item()"): (1, INPUT_CHECK),
    ("grid_search", ".cpu()"): (1, HOST_OPT),
    ("grid_search", ".numpy()"): (1, HOST_OPT),
    # weight_space/ngvi.py
    ("NaturalGradientVI.load_state_dict", "torch.as_tensor"): (1, COUNT),
    ("NaturalGradientVI.state_dict", "torch.tensor"): (1, COUNT),
    # weight_space/ngvi_math.py
    ("blend_curvature", "torch.tensor"): (1, COUNT),
    ("initial_curvature_state", "torch.tensor"): (4, COUNT),
    # weight_space/subnetwork.py
    ("by_name", "torch.arange"): (1, INDEX),
    ("by_name", "torch.tensor"): (1, INDEX),
    ("largest", ".cpu()"): (1, INDEX),
    ("random", "torch.randperm"): (1, INDEX),
}


def _violations() -> list[str]:
    found: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(EXCLUDED):
            continue
        for file, qual, call, line in scan(path, rel):
            found[(qual, call)].append(f"{file}:{line} {qual}: {call}")
    out = []
    for key, places in sorted(found.items()):
        allowed = ALLOWED.get(key, (0, ""))[0]
        if len(places) > allowed:
            out.extend(places if allowed == 0 else [f"{p} (allowed {allowed})" for p in places])
    return out


def test_no_new_host_tensors_or_syncs_in_the_library() -> None:
    bad = _violations()
    assert not bad, (
        "tensors created without device= or host copies / syncs in the library; create them "
        "on the model's device (device=..., new_zeros, zeros_like) or, if the host is needed, "
        "add an entry with its reason to ALLOWED in tests/test_device_rules.py:\n" + "\n".join(bad)
    )


def test_every_allowance_has_a_reason() -> None:
    assert all(n >= 1 and len(reason) > 20 for n, reason in ALLOWED.values())


def test_the_scanner_catches_what_it_should(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import torch\n"
        "class M:\n"
        "    def fit(self, x):\n"
        "        a = torch.zeros(3, dtype=x.dtype)\n"  # flagged: no device
        "        b = torch.zeros(3, device=x.device)\n"
        "        c = torch.eye(3, **self.dd)\n"
        "        d = torch.randn(3, generator=None).to(x)\n"
        "        e = torch.nn.Parameter(torch.zeros(3))\n"
        "        for v in x:\n"
        "            total = v.sum().item()\n"  # flagged: host sync
        "        return a.cpu().numpy()\n"  # flagged twice
    )
    got = [(qual, call, line) for _, qual, call, line in scan(source, "m.py")]
    assert sorted(got) == [
        ("M.fit", ".cpu()", 11),
        ("M.fit", ".item()", 10),
        ("M.fit", ".numpy()", 11),
        ("M.fit", "torch.zeros", 4),
    ]


#: torch's random draws that take a ``generator=``
RANDOM_DRAWS = frozenset({"randn", "rand", "randint", "randperm", "normal", "multinomial",
                          "bernoulli", "randn_like", "rand_like"})  # fmt: skip


def seeded_device_draws(path: Path) -> list[str]:
    """``torch.<draw>(..., generator=..., device=...)``: torch refuses a CPU generator for a
    CUDA tensor, so a seeded draw onto a device goes through ``gaussify.draws``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        fn = node.func if isinstance(node, ast.Call) else None
        on_torch = isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name)
        if on_torch and fn.value.id == "torch" and fn.attr in RANDOM_DRAWS:
            keys = {k.arg for k in node.keywords}
            if {"generator", "device"} <= keys or (
                "generator" in keys and _called_name(node) in {"multinomial", "bernoulli"}
            ):
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_seeded_draws_onto_a_device_go_through_draws() -> None:
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if not rel.startswith(EXCLUDED) and rel != "draws.py":
            bad += seeded_device_draws(path)
    assert not bad, "use gaussify.draws for seeded draws onto a device:\n" + "\n".join(bad)


def test_the_draws_scanner_catches_what_it_should(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import torch\n"
        "a = torch.randn(3, generator=g, device=d)\n"  # flagged
        "b = torch.randn(3, generator=g).to(d)\n"
        "c = torch.randn(3, device=d)\n"
        "e = torch.multinomial(p, 1, generator=g)\n"  # flagged
    )
    assert seeded_device_draws(source) == ["m.py:2", "m.py:5"]


# ---------------------------------------------------------------------------- benchmarks
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _takes_device(tree: ast.Module) -> bool:
    """Whether a script's argument parser gets ``--device``: a call
    ``add_device_argument(parser)`` or ``parser.add_argument("--device", ...)``."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _called_name(node)
        if name == "add_device_argument":
            return True
        if name == "add_argument" and any(
            isinstance(a, ast.Constant) and a.value == "--device" for a in node.args
        ):
            return True
    return False


def test_every_benchmark_script_takes_device() -> None:
    scripts = sorted(BENCHMARKS.glob("*.py"))
    assert scripts
    missing = [p.name for p in scripts if not _takes_device(ast.parse(p.read_text()))]
    assert not missing, f"benchmarks without a --device argument: {missing}"


def test_device_argument_parses_and_refuses() -> None:
    parser = argparse.ArgumentParser()
    add_device_argument(parser)
    assert parser.parse_args([]).device == torch.device("cpu")
    assert parser.parse_args(["--device", "cpu"]).device == torch.device("cpu")
    with pytest.raises(argparse.ArgumentTypeError, match="not a torch device: 'gpu0'"):
        device_argument("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(
            argparse.ArgumentTypeError, match="'cuda': CUDA is not available on this machine"
        ):
            device_argument("cuda")
