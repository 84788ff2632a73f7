"""Every public entry point x every bad-input class (issue 16, point 4).

A table-driven walker: each entry builds a tiny fitted object and calls one entry point on an
input made bad in one way (NaN, Inf, width, dtype, label range, empty, single-pass, counts,
sizes). It asserts the exact error class and a message naming the argument and the problem
("x: row 3 contains NaN"); classes that do not apply to an entry are in its ``skip``.
:func:`test_every_posterior_class_is_walked` fails when a public posterior class has no entry.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import gaussify as gs
from gaussify import validation
from gaussify.approx_likelihoods import GPClassifier
from gaussify.function_space import explain, ntk
from gaussify.last_layer import (
    GVBLLMAP,
    VBLLBNN,
    ActiveLearner,
    ADFLastLayer,
    ExactLastLayer,
    GBLLRegression,
    SGDLastLayer,
    VBLLDiscriminative,
    VBLLGenerative,
    VBLLHeteroscedasticDiscriminative,
    VBLLHeteroscedasticRegression,
    VBLLRegression,
    extract_features,
    fit_posthoc,
    to_mean_field,
)
from gaussify.last_layer.base import VBLLHead
from gaussify.last_layer.vbll_discriminative import VBLLStudentTDiscriminative
from gaussify.last_layer.vbll_regression import VBLLStudentTRegression
from gaussify.marglik import marglik_training
from gaussify.memory_guard import AllocationError, max_bytes
from gaussify.weight_space.reward import BradleyTerry, predict_reward, preference_pairs

DTYPE = torch.float64
N, D, C = 12, 3, 2


X = torch.randn(N, D, generator=torch.Generator().manual_seed(0), dtype=DTYPE)
Y_CLS = torch.tensor([0, 1] * (N // 2))
Y_REG = X[:, :1].sin()
CLS = (X, Y_CLS)


def mlp(out: int = C) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 5), nn.Tanh(), nn.Linear(5, out)).to(DTYPE)


# ---------------------------------------------------------------------- fitted objects
def laplace() -> gs.Laplace:
    return gs.Laplace(mlp(), structure="diag").fit((X, Y_CLS))


def functional_laplace() -> gs.FunctionalLaplace:
    return gs.FunctionalLaplace(mlp(), "classification").fit((X, Y_CLS))


def ella() -> gs.ELLA:
    return gs.ELLA(mlp(), "classification", num_landmarks=4).fit((X, Y_CLS))


def sampled_lla() -> gs.SampledLLA:
    return gs.SampledLLA(mlp(), "classification", num_samples=3, solver="solve").fit((X, Y_CLS))


def valla(**kw: Any) -> gs.VaLLA:
    kw.setdefault("epochs", 1)
    return gs.VaLLA(mlp(), "classification", num_inducing=3, **kw)


def valla_fitted() -> gs.VaLLA:
    return valla().fit((X, Y_CLS), method="closed_form")


def ngvi(cls: type = gs.VOGGN, **kw: Any) -> Any:
    return cls(mlp(), "classification", structure="diag", **kw)


def ngvi_fitted(cls: type = gs.VOGGN) -> Any:
    return ngvi(cls).fit((X, Y_CLS), epochs=1, monitor=False)


def gp() -> GPClassifier:
    model = GPClassifier()
    model.fit(X, Y_CLS, num_classes=C, optimize=False)
    return model


def reward_laplace() -> gs.Laplace:
    torch.manual_seed(0)
    pairs = preference_pairs(X[:6], X[6:])
    model = BradleyTerry(mlp(1))
    return gs.Laplace(model, "binary", structure="diag").fit((pairs, Y_CLS[:6].double()))


def bnn() -> VBLLBNN:
    torch.manual_seed(0)
    features = to_mean_field(nn.Sequential(nn.Linear(D, D)).to(DTYPE))
    return VBLLBNN(features, head(VBLLRegression), 1.0)


HEADS: dict[type, str] = {
    VBLLRegression: "regression",
    VBLLHeteroscedasticRegression: "regression",
    VBLLStudentTRegression: "regression",
    VBLLDiscriminative: "classification",
    VBLLGenerative: "classification",
    VBLLHeteroscedasticDiscriminative: "classification",
    VBLLStudentTDiscriminative: "classification",
    GBLLRegression: "regression",
}


def head(cls: type) -> VBLLHead:
    torch.manual_seed(0)
    out = 1 if HEADS[cls] == "regression" else C
    return cls(D, out, 1.0 / N).to(DTYPE)


# ---------------------------------------------------------------------- the entry points
@dataclass(frozen=True)
class Entry:
    """``call(arg)`` runs the entry point on ``arg``: data (an ``(x, y)`` tuple, a loader or a
    generator) for kind "data", a tensor pair for "pair", inputs for "x", a number for
    "count"; the name's first word is the public class or function it covers. ``skip``:
    classes that do not apply; ``inp``: the inputs' name in messages; ``owner``: the name
    the single-pass refusal gives (None: one pass suffices and a generator is accepted)."""

    name: str
    call: Callable[[Any], Any]
    kind: str
    task: str = "classification"
    inp: str = "x"
    owner: str | None = None
    skip: frozenset[str] = field(default_factory=frozenset)
    arg: str = ""
    target: str = "y"


NO_MODEL = frozenset({"dtype"})  # inputs of fixed features: the layer casts them
DATA_ENTRIES = [
    Entry("Laplace.fit", lambda d: gs.Laplace(mlp(), structure="diag").fit(d), "data"),
    Entry(
        "Laplace.fit(kron, last_layer)",
        lambda d: gs.Laplace(mlp(), subset="last_layer").fit(d),
        "data",
    ),
    Entry(
        "Laplace.fit(regression, full)",
        lambda d: gs.Laplace(mlp(1), "regression", structure="full").fit(d),
        "data",
        task="regression",
    ),
    Entry(
        "Laplace.refine", lambda d: laplace().refine(d, max_iter=1), "data", owner="Laplace.refine"
    ),
    Entry(
        "Laplace.optimize_prior", lambda d: gs.Laplace(mlp()).optimize_prior(d, n_steps=1), "data"
    ),
    Entry(
        "FunctionalLaplace.fit",
        lambda d: gs.FunctionalLaplace(mlp()).fit(d),
        "data",
    ),
    Entry(
        "FunctionalLaplace.fit(regression)",
        lambda d: gs.FunctionalLaplace(mlp(1), "regression").fit(d),
        "data",
        task="regression",
    ),
    Entry(
        "ELLA.fit",
        lambda d: gs.ELLA(mlp(), num_landmarks=3).fit(d),
        "data",
        owner="ELLA.fit",
    ),
    Entry(
        "ELLA.fit(given landmarks)",
        lambda d: gs.ELLA(mlp(), landmarks=X[:3]).fit(d),
        "data",
    ),
    Entry(
        "ELLA.fit(regression)",
        lambda d: gs.ELLA(mlp(1), "regression", num_landmarks=3, landmarks=X[:3]).fit(d),
        "data",
        task="regression",
    ),
    Entry(
        "SampledLLA.fit",
        lambda d: gs.SampledLLA(mlp(), num_samples=2, epochs=1).fit(d),
        "data",
        owner="SampledLLA.fit",
    ),
    Entry(
        "SampledLLA.fit(solve)",
        lambda d: gs.SampledLLA(mlp(), num_samples=2, solver="solve").fit(d),
        "data",
    ),
    Entry("SampledLLA.objective", lambda d: sampled_lla().objective(d), "data"),
    Entry("VaLLA.fit", lambda d: valla().fit(d), "data", owner="VaLLA.fit"),
    Entry(
        "VaLLA.fit(regression)",
        lambda d: gs.VaLLA(mlp(1), "regression", num_inducing=3, epochs=1).fit(d),
        "data",
        task="regression",
        owner="VaLLA.fit",
    ),
    Entry(
        "VaLLA.fit(val_data)",
        lambda d: valla().fit((X, Y_CLS), d),
        "data",
        owner="VaLLA.fit \\(val_data\\)",
        skip=frozenset({"empty_loader"}),
    ),
    Entry("VaLLA.initialize", lambda d: valla().initialize(d), "data", owner="VaLLA.initialize"),
    Entry(
        "VaLLA.set_optimal_covariance", lambda d: valla_fitted().set_optimal_covariance(d), "data"
    ),
    Entry("VaLLA.objective", lambda d: valla_fitted().objective(d), "data"),
    Entry("VaLLA.validation_nll", lambda d: valla_fitted().validation_nll(d), "data"),
    *[
        Entry(
            f"{cls.__name__}.fit",
            lambda d, cls=cls: ngvi(cls).fit(d, epochs=1, monitor=False),
            "data",
            owner=f"{cls.__name__}.fit",
        )
        for cls in (gs.VOGGN, gs.OGGN, gs.LGVA, gs.GLMVI)
    ],
    Entry("VOGGN.elbo", lambda d: ngvi_fitted().elbo(d, 2), "data"),
    Entry("GLMVI.init_laplace", lambda d: ngvi(gs.GLMVI).init_laplace(d), "data"),
    Entry("train_map", lambda d: gs.train_map(mlp(), d, epochs=1), "data", owner="train_map"),
    Entry(
        "train_map(regression)",
        lambda d: gs.train_map(mlp(1), d, "regression", epochs=1),
        "data",
        task="regression",
        owner="train_map",
    ),
    Entry(
        "marglik_training",
        lambda d: marglik_training(mlp(), d, epochs=1, burnin=0, n_hypersteps=1),
        "data",
        owner="marglik_training",
    ),
    Entry(
        "extract_features",
        lambda d: extract_features(mlp(), d),
        "data",
        task="none",
        skip=frozenset({"label_range", "target_width"}),
    ),
    Entry(
        "ExactLastLayer.fit",
        lambda d: ExactLastLayer(D, C).fit(d),
        "data",
        inp="phi",
        skip=NO_MODEL,
    ),
    Entry(
        "ADFLastLayer.fit",
        lambda d: ADFLastLayer(D, C, num_samples=4).fit(d),
        "data",
        inp="phi",
        skip=NO_MODEL,
    ),
    Entry(
        "SGDLastLayer.fit",
        lambda d: SGDLastLayer(D, C).fit(d),
        "data",
        inp="phi",
        skip=NO_MODEL,
    ),
    # entry points that take the tensors themselves (no loaders, no generators)
    Entry(
        "GPClassifier.fit",
        lambda d: GPClassifier().fit(d[0], d[1], num_classes=C, optimize=False),
        "pair",
        skip=NO_MODEL | {"width"},
    ),
    Entry(
        "fit_posthoc",
        lambda d: fit_posthoc(head(VBLLDiscriminative), d[0], d[1], max_iter=1),
        "pair",
        inp="phi",
        skip=NO_MODEL,
    ),
    Entry(
        "fit_posthoc(regression)",
        lambda d: fit_posthoc(head(VBLLRegression), d[0], d[1], max_iter=1),
        "pair",
        task="regression",
        inp="phi",
        skip=NO_MODEL | {"target_width"},  # the head names its own target layout
    ),
    Entry("VaLLA.step", lambda d: valla_fitted().step(d[0], d[1]), "pair", skip=frozenset()),
    Entry(
        "explain(train_x, train_y)",
        lambda d: explain(mlp(), X[:2], d[0], d[1]),
        "pair",
        inp="train_x",
        target="train_y",
    ),
    Entry(
        "GVBLLMAP.fit",
        lambda d: GVBLLMAP(D, C).to(DTYPE).fit(d[0], d[1]),
        "pair",
        inp="phi",
        skip=NO_MODEL,
    ),
    *[
        Entry(
            f"{cls.__name__}(phi).train_loss",
            lambda d, cls=cls: head(cls)(d[0]).train_loss(d[1]),
            "pair",
            task=task,
            inp="phi",
            # a head is called on each training batch: an empty one is the caller's business
            skip=NO_MODEL | {"empty", "target_width"},
        )
        for cls, task in HEADS.items()
    ],
    Entry(
        "GBLLRegression.fit_posterior",
        lambda d: head(GBLLRegression).fit_posterior(d[0], d[1]),
        "pair",
        task="regression",
        inp="phi",
        skip=NO_MODEL | {"empty", "target_width"},
    ),
]


def _pred(obj_fn: Callable[[], Any], attr: str, /, **kw: Any) -> Callable[[Any], Any]:
    return lambda x: getattr(obj_fn(), attr)(x, **kw)


X_ENTRIES = [
    Entry("Laplace.predict", _pred(laplace, "predict"), "x"),
    Entry("Laplace.predict(nn)", _pred(laplace, "predict", method="nn", num_samples=3), "x"),
    Entry("Laplace.predict(joint)", _pred(laplace, "predict", joint=True), "x"),
    Entry("Laplace.function_samples", _pred(laplace, "function_samples", num_samples=2), "x"),
    Entry("FunctionalLaplace.predict", _pred(functional_laplace, "predict"), "x"),
    Entry(
        "FunctionalLaplace.functional_covariance",
        _pred(functional_laplace, "functional_covariance"),
        "x",
    ),
    Entry("ELLA.predict", _pred(ella, "predict"), "x"),
    Entry("ELLA.features", _pred(ella, "features"), "x"),
    Entry("ELLA.functional_covariance", _pred(ella, "functional_covariance"), "x"),
    Entry("SampledLLA.predict", _pred(sampled_lla, "predict"), "x"),
    Entry("SampledLLA.predict_samples", _pred(sampled_lla, "predict_samples"), "x"),
    Entry("VaLLA.predict", _pred(valla_fitted, "predict"), "x"),
    *[
        Entry(f"{cls.__name__}.predict", _pred(lambda cls=cls: ngvi_fitted(cls), "predict"), "x")
        for cls in (gs.VOGGN, gs.OGGN, gs.LGVA, gs.GLMVI)
    ],
    Entry("ntk", lambda x: ntk(mlp(), x), "x", inp="x1"),
    Entry("ntk(x1, x2)", lambda x: ntk(mlp(), X, x), "x", inp="x2"),
    Entry("explain(x_star)", lambda x: explain(mlp(), x, X, Y_CLS), "x", inp="x_star"),
    Entry(
        "ELLA.fit(landmarks)",
        lambda x: gs.ELLA(mlp(), landmarks=x).fit((X, Y_CLS)),
        "x",
        inp="landmarks",
        skip=frozenset({"not_tensor"}),  # a non-tensor names the landmark methods instead
    ),
    Entry(
        "ActiveLearner(phi_pool)",
        lambda x: ActiveLearner(ExactLastLayer(D, C), x, Y_CLS[: len(x)], [0]),
        "x",
        inp="phi_pool",
        skip=NO_MODEL,
    ),
    Entry("predict_reward", lambda x: predict_reward(reward_laplace(), x), "x"),
    Entry("GPClassifier.predict", _pred(gp, "predict"), "x", skip=NO_MODEL),
    *[
        Entry(
            f"{c.__name__}.predict",
            _pred(lambda c=c: c(D, C).fit(CLS), "predict"),
            "x",
            inp="phi",
            skip=NO_MODEL,
        )
        for c in (ExactLastLayer, ADFLastLayer, SGDLastLayer)
    ],
    *[
        Entry(
            f"{cls.__name__}.forward",
            lambda x, cls=cls: head(cls)(x).predictive,
            "x",
            inp="phi",
            skip=NO_MODEL | {"empty"},
        )
        for cls in HEADS
    ],
]


def _counts(*rows: tuple[str, Callable[[Any], Any]]) -> list[Entry]:
    """Count entries from ("Name.method:argument", call(value)) rows."""
    return [Entry(key.split(":")[0], call, "count", arg=key.split(":")[1]) for key, call in rows]


COUNT_ENTRIES = _counts(
    ("Laplace.fit:batch_size", lambda v: gs.Laplace(mlp()).fit(CLS, batch_size=v)),
    ("Laplace.predict:num_samples", lambda v: laplace().predict(X, num_samples=v)),
    ("Laplace.predict:chunk_size", lambda v: laplace().predict(X, chunk_size=v)),
    ("Laplace.sample:num_samples", lambda v: laplace().sample(v)),
    ("Laplace.function_samples:num_samples", lambda v: laplace().function_samples(X, v)),
    (
        "FunctionalLaplace.predict:num_samples",
        lambda v: functional_laplace().predict(X, num_samples=v),
    ),
    ("ELLA:num_landmarks", lambda v: gs.ELLA(mlp(), num_landmarks=v)),
    ("ELLA:chunk_size", lambda v: gs.ELLA(mlp(), chunk_size=v)),
    ("FunctionalLaplace:chunk_size", lambda v: gs.FunctionalLaplace(mlp(), chunk_size=v)),
    ("FunctionalLaplace:num_data_subset", lambda v: gs.FunctionalLaplace(mlp(), num_data_subset=v)),
    ("ntk:chunk_size", lambda v: ntk(mlp(), X, chunk_size=v)),
    ("VaLLA:num_inducing", lambda v: gs.VaLLA(mlp(), num_inducing=v)),
    ("GPClassifier.fit:max_iter", lambda v: GPClassifier().fit(X, Y_CLS, max_iter=v)),
    ("ELLA.predict:num_samples", lambda v: ella().predict(X, num_samples=v)),
    ("SampledLLA:num_samples", lambda v: gs.SampledLLA(mlp(), num_samples=v)),
    ("SampledLLA:batch_size", lambda v: gs.SampledLLA(mlp(), batch_size=v)),
    ("SampledLLA.sample:num_samples", lambda v: sampled_lla().sample(v)),
    ("SampledLLA.predict:num_samples", lambda v: sampled_lla().predict(X, num_samples=v)),
    ("SampledLLA.predict:chunk_size", lambda v: sampled_lla().predict(X, chunk_size=v)),
    ("VaLLA:epochs", lambda v: valla(epochs=v)),
    ("VaLLA:batch_size", lambda v: valla(batch_size=v)),
    ("VaLLA:mc_samples", lambda v: valla(mc_samples=v)),
    ("VaLLA.fit:eval_every", lambda v: valla().fit(CLS, eval_every=v)),
    ("VaLLA.predict:num_samples", lambda v: valla_fitted().predict(X, num_samples=v)),
    ("VaLLA.predict:chunk_size", lambda v: valla_fitted().predict(X, chunk_size=v)),
    ("VaLLA.sample:num_samples", lambda v: valla_fitted().sample(v)),
    ("VOGGN:num_samples", lambda v: ngvi(num_samples=v)),
    ("VOGGN.fit:epochs", lambda v: ngvi().fit(CLS, epochs=v)),
    ("VOGGN.fit:batch_size", lambda v: ngvi().fit(CLS, batch_size=v)),
    ("VOGGN.sample:num_samples", lambda v: ngvi_fitted().sample(v)),
    ("VOGGN.predict:num_samples", lambda v: ngvi_fitted().predict(X, num_samples=v)),
    ("VOGGN.predict:chunk_size", lambda v: ngvi_fitted().predict(X, chunk_size=v)),
    ("VOGGN.elbo:num_samples", lambda v: ngvi_fitted().elbo(CLS, v)),
    ("VOGGN.step:num_data", lambda v: ngvi().step(CLS, num_data=v)),
    ("train_map:epochs", lambda v: gs.train_map(mlp(), CLS, epochs=v)),
    ("train_map:batch_size", lambda v: gs.train_map(mlp(), CLS, batch_size=v)),
    ("marglik_training:epochs", lambda v: marglik_training(mlp(), CLS, epochs=v)),
    ("predict_reward:chunk_size", lambda v: predict_reward(reward_laplace(), X, chunk_size=v)),
    ("GPClassifier.predict:num_samples", lambda v: gp().predict(X, num_samples=v)),
    ("GPClassifier.predict:chunk_size", lambda v: gp().predict(X, chunk_size=v)),
    ("ExactLastLayer.fit:batch_size", lambda v: ExactLastLayer(D, C).fit(CLS, batch_size=v)),
    ("ADFLastLayer:num_samples", lambda v: ADFLastLayer(D, C, num_samples=v)),
    ("SGDLastLayer:steps", lambda v: SGDLastLayer(D, C, steps=v)),
    ("VBLLDiscriminative:num_samples", lambda v: VBLLDiscriminative(D, C, 1.0, num_samples=v)),
    ("VBLLRegression:in_features", lambda v: VBLLRegression(v, 1, 1.0)),
    ("VBLLBNN.forward:num_samples", lambda v: bnn()(X, num_samples=v)),
    ("fit_posthoc:max_iter", lambda v: fit_posthoc(head(VBLLRegression), X, Y_REG, max_iter=v)),
)

# Size guards before huge allocations (issue 16, point 4; gaussify.memory_guard): under a
# 1 kB limit every quadratic object of these tiny problems is "huge". Each case is (name,
# setup building what the call needs, the call); test_size_guards asserts AllocationError
# naming the object's size and the alternatives.
SIZE_GUARD_CASES: list[tuple[str, Callable[[], Any], Callable[[Any], Any]]] = [
    ("Laplace.fit(full)", lambda: gs.Laplace(mlp(), structure="full"), lambda la: la.fit(CLS)),
    ("Laplace.posterior_covariance", laplace, lambda la: la.posterior_covariance),
    ("Laplace.predict(joint)", laplace, lambda la: la.predict(X, joint=True)),
    ("FunctionalLaplace.fit", lambda: gs.FunctionalLaplace(mlp()), lambda fl: fl.fit(CLS)),
    ("ELLA.fit", lambda: gs.ELLA(mlp(), num_landmarks=6), lambda e: e.fit(CLS)),
    ("VaLLA.fit", lambda: gs.VaLLA(mlp(), num_inducing=6), lambda v: v.fit(CLS)),
    ("GPClassifier.fit", GPClassifier, lambda g: g.fit(X, Y_CLS, optimize=False)),
]

# Public classes with fit / predict that are not posteriors over data inputs.
EXEMPT = {
    "NaturalGradientVI": "abstract base of VOGGN / OGGN / LGVA / GLMVI (walked through those)",
    "VBLLHead": "abstract base of the VBLL heads (each concrete head is walked)",
    "GaussianApproxLoss": "a training loss on network outputs f (checked by the likelihoods)",
}


# ---------------------------------------------------------------------- bad inputs
def _with(t: Tensor, row: int, value: float) -> Tensor:
    t = t.clone().to(DTYPE) if not t.is_floating_point() else t.clone()
    t.view(t.shape[0], -1)[row, -1] = value
    return t


def _gen(x: Tensor, y: Tensor) -> Iterator[tuple[Tensor, Tensor]]:
    return ((x[i : i + 4], y[i : i + 4]) for i in range(0, x.shape[0], 4))


def _y(entry: Entry) -> Tensor:
    return Y_REG if entry.task == "regression" else Y_CLS


def _labels_float(entry: Entry) -> Tensor:
    return Y_REG.clone() if entry.task == "regression" else Y_CLS.to(DTYPE)


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[Entry], Any]
    error: type[Exception] | None
    pattern: Callable[[Entry], str]
    needs_loader: bool = False
    tasks: tuple[str, ...] = ("classification", "regression", "none")


DATA_CASES = [
    Case(
        "nan_x",
        lambda e: (_with(X, 3, float("nan")), _y(e)),
        ValueError,
        lambda e: rf"^{e.inp}: row 3 contains NaN$",
    ),
    Case(
        "inf_x",
        lambda e: (_with(X, 5, float("-inf")), _y(e)),
        ValueError,
        lambda e: rf"^{e.inp}: row 5 contains inf$",
    ),
    Case(
        "nan_x_loader",  # row numbers count across batches
        lambda e: DataLoader(TensorDataset(_with(X, 6, float("nan")), _y(e)), batch_size=4),
        ValueError,
        lambda e: rf"^{e.inp}: row 6 contains NaN$",
        needs_loader=True,
    ),
    Case(
        "nan_y",
        lambda e: (X, _with(_labels_float(e), 2, float("nan"))),
        ValueError,
        lambda e: rf"^{e.target}: row 2 contains NaN$",
    ),
    Case(
        "inf_y",
        lambda e: (X, _with(_labels_float(e), 0, float("inf"))),
        ValueError,
        lambda e: rf"^{e.target}: row 0 contains inf$",
    ),
    Case(
        "width",
        lambda e: (X[:, :2], _y(e)),
        ValueError,
        lambda e: rf"^{e.inp}: expected .*\b{D}\b.*got",
    ),
    Case(
        "dtype",
        lambda e: (X.float(), _y(e)),
        TypeError,
        lambda e: (
            rf"^{e.inp}: dtype torch.float32 does not match the model's parameters "
            r"\(torch.float64\)$"
        ),
    ),
    Case(
        "label_range",
        lambda e: (X, torch.where(torch.arange(N) == 4, C, Y_CLS)),
        ValueError,
        lambda e: rf"^{e.target}: labels must be in \[0, {C}\), got range \[0, {C}\]$",
        tasks=("classification",),
    ),
    Case(
        "target_width",
        lambda e: (X, Y_REG.expand(N, 3)),
        ValueError,
        lambda e: rf"^{e.target}: expected 1 target value\(s\) per row",
        tasks=("regression",),
    ),
    Case(
        "empty",
        lambda e: (X[:0], _y(e)[:0]),
        ValueError,
        lambda e: (
            r"^data: contains no examples$"
            if e.kind == "data"
            else rf"^{e.inp}: contains no examples$"
        ),
    ),
    Case(
        "empty_loader",
        lambda e: DataLoader(TensorDataset(X[:0], _y(e)[:0]), batch_size=4),
        ValueError,
        lambda e: r"^data: contains no examples$",
        needs_loader=True,
    ),
    Case(
        "empty_generator",
        lambda e: _gen(X[:0], _y(e)[:0]),
        ValueError,
        lambda e: (
            r"^data: contains no examples$" if e.owner is None else r"^data: a single-pass iterator"
        ),
        needs_loader=True,
    ),
    Case(
        "generator",
        lambda e: _gen(X, _y(e)),
        TypeError,
        lambda e: (
            rf"^data: a single-pass iterator \(generator\) cannot be used by {e.owner}, "
            r"which makes several passes; pass a list, a DataLoader or a \(x, y\) tuple$"
        ),
        needs_loader=True,
    ),
]

X_CASES = [
    Case(
        "nan_x",
        lambda e: _with(X, 3, float("nan")),
        ValueError,
        lambda e: rf"^{e.inp}: row 3 contains NaN$",
    ),
    Case(
        "inf_x",
        lambda e: _with(X, 0, float("inf")),
        ValueError,
        lambda e: rf"^{e.inp}: row 0 contains inf$",
    ),
    Case("width", lambda e: X[:, :2], ValueError, lambda e: rf"^{e.inp}: expected .*\b{D}\b.*got"),
    Case(
        "dtype",
        lambda e: X.float(),
        TypeError,
        lambda e: (
            rf"^{e.inp}: dtype torch.float32 does not match the model's parameters "
            r"\(torch.float64\)$"
        ),
    ),
    Case("empty", lambda e: X[:0], ValueError, lambda e: rf"^{e.inp}: contains no examples$"),
    Case("not_tensor", lambda e: X.tolist(), TypeError, lambda e: rf"^{e.inp}: expected a"),
]

COUNT_VALUES = [0, -1, 2.5, True]


@pytest.fixture(scope="module", autouse=True)
def _warm_up() -> None:
    """One-off imports (torch.func's transforms, scikit-learn's k-means) paid once here, so
    that the per-test durations show the tests' own cost."""
    laplace()
    valla_fitted()


def _data_params() -> list[Any]:
    params = []
    for entry in DATA_ENTRIES:
        for case in DATA_CASES:
            if case.name in entry.skip or entry.task not in case.tasks:
                continue
            if case.needs_loader and entry.kind != "data":
                continue
            params.append(pytest.param(entry, case, id=f"{entry.name}-{case.name}"))
    return params


@pytest.mark.parametrize(("entry", "case"), _data_params())
def test_data_entry_points(entry: Entry, case: Case) -> None:
    arg = case.make(entry)
    if case.name == "generator" and entry.owner is None:
        entry.call(arg)  # one pass suffices: a generator is accepted
        return
    assert case.error is not None
    with pytest.raises(case.error, match=case.pattern(entry)):
        entry.call(arg)


@pytest.mark.parametrize(
    ("entry", "case"),
    [
        pytest.param(e, c, id=f"{e.name}-{c.name}")
        for e in X_ENTRIES
        for c in X_CASES
        if c.name not in e.skip
    ],
)
def test_input_entry_points(entry: Entry, case: Case) -> None:
    assert case.error is not None
    with pytest.raises(case.error, match=case.pattern(entry)):
        entry.call(case.make(entry))


@pytest.mark.parametrize(
    ("entry", "value"),
    [pytest.param(e, v, id=f"{e.name}-{e.arg}={v!r}") for e in COUNT_ENTRIES for v in COUNT_VALUES],
)
def test_count_arguments(entry: Entry, value: Any) -> None:
    """0 and -1 are out of range (ValueError); 2.5 and True are not integers (TypeError, also
    a ValueError for callers that catch that)."""
    error = ValueError if isinstance(value, int) and not isinstance(value, bool) else TypeError
    message = rf"^{entry.arg}: expected an integer >= 1, got {re.escape(repr(value))}$"
    with pytest.raises(error, match=message):
        entry.call(value)


@pytest.mark.parametrize(
    ("setup", "call"), [pytest.param(s, c, id=n) for n, s, c in SIZE_GUARD_CASES]
)
def test_size_guards(setup: Callable[[], Any], call: Callable[[Any], Any]) -> None:
    obj = setup()
    named = r" needs [0-9.]+ [kMG]?B \(.*; use "  # its size, then the alternatives
    with max_bytes(1000), pytest.raises(AllocationError, match=named):
        call(obj)


def _public_posterior_classes() -> set[type]:
    found: set[type] = set()
    for module in (
        "gaussify",
        "gaussify.function_space",
        "gaussify.weight_space",
        "gaussify.last_layer",
        "gaussify.approx_likelihoods",
    ):
        mod = importlib.import_module(module)
        for name in getattr(mod, "__all__", []):
            obj = getattr(mod, name)
            if not inspect.isclass(obj) or not obj.__module__.startswith("gaussify"):
                continue
            head = issubclass(obj, VBLLHead) or obj is VBLLBNN
            if head or hasattr(obj, "fit") or hasattr(obj, "predict"):
                found.add(obj)
    return found


def test_every_posterior_class_is_walked() -> None:
    entries = DATA_ENTRIES + X_ENTRIES + COUNT_ENTRIES
    covered = {re.split(r"[.(]", e.name)[0] for e in entries}  # "ELLA.fit" covers ELLA
    missing = {c.__name__ for c in _public_posterior_classes()} - covered - set(EXEMPT)
    assert not missing, f"public posterior classes without bad-input entries: {sorted(missing)}"


# ---------------------------------------------------------------------- accepted inputs
def test_one_pass_generator_gives_the_tuple_fit() -> None:
    """Where one pass suffices a generator is accepted and gives the same posterior as the
    (x, y) tuple: Laplace (the GGN), GLM-VI's initial Laplace (its N and precision) and the
    exact last layer."""
    by_tuple = gs.Laplace(mlp(), structure="full").fit((X, Y_CLS), batch_size=4)
    by_gen = gs.Laplace(mlp(), structure="full").fit(_gen(X, Y_CLS))
    torch.testing.assert_close(by_gen.posterior_precision, by_tuple.posterior_precision)
    assert by_gen.num_data == N
    vi = ngvi(gs.GLMVI).init_laplace(_gen(X, Y_CLS))
    vi_ref = ngvi(gs.GLMVI).init_laplace((X, Y_CLS))
    assert vi.num_data == N
    torch.testing.assert_close(vi.posterior_precision, vi_ref.posterior_precision)
    torch.testing.assert_close(
        ExactLastLayer(D, C).fit(_gen(X, Y_CLS)).mean, ExactLastLayer(D, C).fit((X, Y_CLS)).mean
    )


def test_consumed_single_pass_iterator_is_not_silently_empty() -> None:
    """A second pass over a one-pass iterator raises instead of seeing no data."""
    checked = validation.validated_batches(_gen(X, Y_CLS), owner="test")
    assert sum(x.shape[0] for x, _ in checked) == N
    with pytest.raises(ValueError, match=r"^data: the single-pass iterator given to test is "):
        list(checked)


def test_checks_do_not_touch_valid_inputs() -> None:
    """Integer inputs (token ids) pass for models whose first layer is not linear; conv
    inputs are checked on their channels; a Flatten before the first Linear is honoured."""
    emb = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(8, 2)).to(DTYPE)
    assert validation.check_inputs(torch.randint(0, 10, (3, 2)), emb).shape == (3, 2)
    conv = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Flatten(), nn.Linear(8, 2))
    validation.check_inputs(torch.zeros(2, 3, 4, 4), conv)
    with pytest.raises(ValueError, match=r"^x: expected 3 channels \(the first layer's "):
        validation.check_inputs(torch.zeros(2, 1, 4, 4), conv)
    flat = nn.Sequential(nn.Flatten(), nn.Linear(12, 2))
    validation.check_inputs(torch.zeros(2, 3, 4), flat)
    with pytest.raises(ValueError, match=r"^x: expected 12 flattened features"):
        validation.check_inputs(torch.zeros(2, 3, 5), flat)
    assert validation.check_count(3, "n") == 3
    assert validation.check_count(np.int64(3), "n") == 3


def test_compat_laplace_fit_refuses_a_generator() -> None:
    """The laplace-torch layer reads its loader twice; a generator is refused up front, and
    its inputs reach the same boundary checks as the engines'."""
    from gaussify.compat.laplace import Laplace

    la = Laplace(mlp(), "classification", hessian_structure="diag")
    with pytest.raises(TypeError, match=r"^data: a single-pass iterator \(generator\) cannot "):
        la.fit(_gen(X, Y_CLS))
    with pytest.raises(ValueError, match=r"^x: row 5 contains inf$"):
        la.fit(DataLoader(TensorDataset(_with(X, 5, float("inf")), Y_CLS), batch_size=4))
