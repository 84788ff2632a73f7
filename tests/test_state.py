"""Saved state and transactional fits of every posterior family (issue 16, point 3).

One table of families; for each: a ``torch.save`` / ``torch.load(weights_only=True)`` round
trip that reproduces the predictions exactly, every class of corrupted state refused with a
ValueError naming the key while the receiving object stays bit-identical, and a fit that
raises part-way (a loader that fails at its k-th batch, a NaN batch) that leaves the object
and its network exactly as they were."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import gaussify as gs
from gaussify.approx_likelihoods.gp_classification import GPClassifier
from gaussify.last_layer import VBLLDiscriminative
from gaussify.last_layer.adf import ADFLastLayer
from gaussify.last_layer.exact import ExactLastLayer
from gaussify.state import (
    StateError,
    StateWarning,
    TensorSpec,
    transaction,
    validate_state,
)

DT = torch.float64
N, D, C = 16, 3, 2


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, 5), nn.Tanh(), nn.Linear(5, C)).to(DT).eval()


def _data(seed: int = 0, task: str = "classification") -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, dtype=DT)
    if task == "regression":
        return x, torch.randn(N, C, generator=g, dtype=DT)
    return x, torch.randint(0, C, (N,), generator=g)


XT = torch.randn(5, D, generator=torch.Generator().manual_seed(9), dtype=DT)


@dataclass
class Family:
    build: Callable[[nn.Module | None, str], Any]
    fit: Callable[[Any, Any], Any]
    output: Callable[[Any], Tensor]
    key: str  # a tensor entry of the state to corrupt
    uses_model: bool = True
    has_task: bool = True
    carries_weights: bool = False  # the state holds (and load writes) all the weights


def _predict(obj: Any) -> Tensor:
    pred = obj.predict(XT)
    return torch.cat([pred.f_mean.flatten(), pred.f_cov.flatten()])


def _laplace(structure: str, **kw: Any) -> Callable[[nn.Module | None, str], Any]:
    return lambda m, task: gs.Laplace(m, task, structure, prior_precision=0.5, **kw)


def _laplace_out(la: Any) -> Tensor:
    return torch.cat([la.log_marginal_likelihood().reshape(1), _predict(la)])


def _fit(obj: Any, data: Any) -> Any:
    return obj.fit(data)


def _fit_small_batches(obj: Any, data: Any) -> Any:
    return obj.fit(data, batch_size=8)


FAMILIES: dict[str, Family] = {
    "laplace-full": Family(_laplace("full"), _fit_small_batches, _laplace_out, "mean"),
    "laplace-diag": Family(_laplace("diag"), _fit_small_batches, _laplace_out, "grad"),
    "laplace-kron": Family(_laplace("kron"), _fit_small_batches, _laplace_out, "theta_star"),
    "laplace-lowrank": Family(
        _laplace("lowrank", rank=3), _fit_small_batches, _laplace_out, "mean"
    ),
    "laplace-lastlayer": Family(
        _laplace("full", subset="last_layer"), _fit_small_batches, _laplace_out, "mean"
    ),
    "ogg": Family(
        lambda m, t: gs.OGGN(m, t, "diag", prior_precision=0.5, lr=0.5),
        lambda o, d: o.fit(d, batch_size=8, monitor=False),
        _predict,
        "mean",
        carries_weights=True,
    ),
    "glmvi": Family(
        lambda m, t: gs.GLMVI(m, t, "full", prior_precision=0.5, lr=0.5),
        lambda o, d: o.fit(d, batch_size=8, monitor=False),
        _predict,
        "theta_lin",
        carries_weights=True,
    ),
    "functional": Family(
        lambda m, t: gs.FunctionalLaplace(m, t, prior_precision=0.5),
        _fit_small_batches,
        lambda o: torch.cat([o.log_marginal_likelihood().reshape(1), _predict(o)]),
        "f",
    ),
    "ella": Family(
        lambda m, t: gs.ELLA(m, t, num_landmarks=6, prior_precision=0.5),
        _fit_small_batches,
        lambda o: torch.cat([o.log_marginal_likelihood().reshape(1), _predict(o)]),
        "projection",
    ),
    "sampled": Family(
        lambda m, t: gs.SampledLLA(
            m, t, prior_precision=0.5, num_samples=4, solver="solve", batch_size=8
        ),
        _fit,
        lambda o: o.samples,
        "samples",
    ),
    "valla": Family(
        lambda m, t: gs.VaLLA(
            m, t, num_inducing=None, inducing_points=_data(5)[0][:3], epochs=2, batch_size=8
        ),
        _fit,
        _predict,
        "chol_raw",
    ),
    "exact": Family(
        lambda m, t: ExactLastLayer(D, C),
        lambda o, d: o.fit(d, batch_size=8),
        lambda o: torch.cat([o.log_marginal_likelihood().reshape(1), o.mean.flatten()]),
        "cov",
        uses_model=False,
    ),
    "exact-information": Family(
        lambda m, t: ExactLastLayer(D, C, streaming=False),
        lambda o, d: o.fit(d, batch_size=8),
        lambda o: torch.cat([o.log_marginal_likelihood().reshape(1), o.mean.flatten()]),
        "precision",
        uses_model=False,
    ),
    "adf": Family(
        lambda m, t: ADFLastLayer(D, C, num_samples=8, generator=torch.Generator().manual_seed(0)),
        lambda o, d: o.fit(d, batch_size=8),
        lambda o: torch.cat([o.mean.flatten(), o.covariance.flatten()]),
        "covariance",
        uses_model=False,
    ),
}


def _fitted(name: str, *, seed: int = 0, data_seed: int = 0, task: str = "classification"):
    fam = FAMILIES[name]
    model = _model(seed) if fam.uses_model else None
    obj = fam.build(model, task)
    fam.fit(obj, _data(data_seed, task))
    return obj


def _tensors(obj: Any) -> dict[str, Tensor]:
    """Every tensor reachable from the object's state_dict (nested dicts flattened)."""
    out: dict[str, Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Tensor):
            out[prefix] = value.detach().clone()
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, int | float | str):
            out[prefix] = torch.tensor(0.0) if isinstance(value, str) else torch.tensor(value)

    walk("", obj.state_dict())
    model = getattr(obj, "model", None)
    if model is not None:
        for k, v in model.state_dict().items():
            out[f"model.{k}"] = v.clone()
    return out


def _assert_same(before: dict[str, Tensor], after: dict[str, Tensor]) -> None:
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k


def _save_load(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# --------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("name", FAMILIES)
def test_round_trip_through_weights_only_load_reproduces_the_posterior(name: str) -> None:
    fam = FAMILIES[name]
    source = _fitted(name)
    expected = fam.output(source)
    state = _save_load(source.state_dict())
    if fam.has_task:
        assert state["task"] == "classification"
    target = fam.build(getattr(source, "model", None), "classification")
    target.load_state_dict(state)
    torch.testing.assert_close(fam.output(target), expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.uses_model])
def test_regression_round_trip_and_refusal_of_a_classification_state(name: str) -> None:
    fam = FAMILIES[name]
    source = _fitted(name, task="regression")
    fam.output(source)  # warm the caches (full: the eigendecomposition from the 2nd request)
    expected = fam.output(source)
    state = _save_load(source.state_dict())
    assert state["task"] == "regression"
    target = fam.build(source.model, "regression")
    target.load_state_dict(state)
    fam.output(target)
    torch.testing.assert_close(fam.output(target), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="'task': expected 'regression'"):
        target.load_state_dict(_fitted(name).state_dict())
    torch.testing.assert_close(fam.output(target), expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["laplace-kron", "laplace-full", "functional", "ella", "ogg"])
def test_float32_round_trip_and_a_float64_state_is_refused(name: str) -> None:
    fam = FAMILIES[name]
    model = _model(0).float()
    source = fam.build(model, "classification")
    x, y = _data(0)
    fam.fit(source, (x.float(), y))
    global XT
    xt, XT = XT, XT.float()
    try:
        expected = fam.output(source)
        target = fam.build(model, "classification")
        target.load_state_dict(_save_load(source.state_dict()))
        torch.testing.assert_close(fam.output(target), expected, rtol=0, atol=0)
    finally:
        XT = xt
    wide = _fitted(name).state_dict()  # the same network in float64
    with pytest.raises(ValueError, match=r"expected dtype torch\.float32, got torch\.float64"):
        target.load_state_dict(wide)


@pytest.mark.parametrize("name", FAMILIES)
def test_editing_a_saved_state_in_place_never_edits_the_posterior(name: str) -> None:
    fam = FAMILIES[name]
    obj = _fitted(name)
    fam.output(obj)
    before, out_before = _tensors(obj), fam.output(obj)

    def spoil(value: Any) -> None:
        if isinstance(value, Tensor) and value.is_floating_point():
            value.fill_(float("nan"))
        elif isinstance(value, dict):
            for v in value.values():
                spoil(v)

    spoil(obj.state_dict())
    _assert_same(before, _tensors(obj))
    torch.testing.assert_close(fam.output(obj), out_before, rtol=0, atol=0)


# --------------------------------------------------------------------------- corruptions
def _corrupt(kind: str, state: dict[str, Any], key: str) -> tuple[dict[str, Any], str]:
    """(corrupted state, the key the error must name)."""
    state = dict(state)
    value = state[key]
    if kind == "missing":
        del state[key]
    elif kind == "extra":
        state["surplus"] = torch.zeros(1)
        key = "surplus"
    elif kind == "foo":
        return {"foo": 1}, "foo"
    elif kind == "task":
        state["task"] = "regression"
        key = "task"
    elif kind == "shape":
        state[key] = torch.cat([value.reshape(-1), value.reshape(-1)[:1]])
    elif kind == "dtype":
        state[key] = value.to(torch.int64)
    elif kind == "nan":
        value = value.clone()
        value.view(-1)[0] = float("nan")
        state[key] = value
    return state, key


CORRUPTIONS = ["missing", "extra", "foo", "task", "shape", "dtype", "nan"]


@pytest.mark.parametrize("kind", CORRUPTIONS)
@pytest.mark.parametrize("name", FAMILIES)
def test_a_corrupted_state_is_refused_naming_the_key_and_changes_nothing(
    name: str, kind: str
) -> None:
    fam = FAMILIES[name]
    source = _fitted(name)
    # the receiving object: fitted to other data over the same network
    target = fam.build(getattr(source, "model", None), "classification")
    fam.fit(target, _data(1))
    fam.output(target)  # warm the caches (e.g. the eigendecomposition after two requests)
    before, out_before = _tensors(target), fam.output(target)
    bad, key = _corrupt(kind, _save_load(source.state_dict()), fam.key)
    with pytest.raises(ValueError, match=repr(key)):
        target.load_state_dict(bad)
    _assert_same(before, _tensors(target))
    torch.testing.assert_close(fam.output(target), out_before, rtol=0, atol=0)


@pytest.mark.parametrize(
    "name", [n for n, f in FAMILIES.items() if f.uses_model and not f.carries_weights]
)
def test_a_state_from_other_weights_is_refused_and_strict_false_warns(name: str) -> None:
    fam = FAMILIES[name]
    source = _fitted(name, seed=0)
    state = _save_load(source.state_dict())
    target = _fitted(name, seed=1, data_seed=1)  # same architecture, other weights
    fam.output(target)
    before, out_before = _tensors(target), fam.output(target)
    with pytest.raises(ValueError, match=r"other weights|differs from"):
        target.load_state_dict(state)
    _assert_same(before, _tensors(target))
    torch.testing.assert_close(fam.output(target), out_before, rtol=0, atol=0)
    with pytest.warns(StateWarning):
        target.load_state_dict(state, strict=False)


def test_a_last_layer_state_is_refused_on_a_network_with_another_body() -> None:
    # theta* (the last layer) agrees; the frozen body differs: the fingerprint names it
    source = _fitted("laplace-lastlayer")
    other = _model(0)
    with torch.no_grad():
        other[0].weight.add_(0.1)
    target = gs.Laplace(other, "classification", "full", subset="last_layer")
    with pytest.raises(ValueError, match=r"'0\.weight' differs"):
        target.load_state_dict(source.state_dict())


def test_a_classification_state_does_not_load_into_a_regression_laplace() -> None:
    state = _fitted("laplace-kron").state_dict()
    target = _fitted("laplace-kron", task="regression")
    before = _tensors(target)
    with pytest.raises(ValueError, match="'task': expected 'regression'"):
        target.load_state_dict(state)
    _assert_same(before, _tensors(target))
    # an older state without 'task' is still told apart: a regression state has 'sse'
    del state["task"]
    with pytest.raises(ValueError, match=r"missing key \['sse'\]"):
        target.load_state_dict(state)


@pytest.mark.parametrize("name", ["laplace-kron", "ogg"])
def test_a_state_of_another_structure_is_refused(name: str) -> None:
    state = _fitted(name).state_dict()
    model = _model(0)
    if name == "ogg":
        target = gs.OGGN(model, "classification", "full")
    else:
        target = gs.Laplace(model, "classification", "diag")
    with pytest.raises(ValueError, match="'structure': expected"):
        target.load_state_dict(state)


def test_the_observed_failed_load_no_longer_changes_the_evidence() -> None:
    # issue 16: a load that raised after replacing the curvature moved the evidence
    la = _fitted("laplace-kron")
    other = _fitted("laplace-kron", data_seed=3).state_dict()
    other["sigma_fit"] = torch.tensor(float("nan"), dtype=DT)
    before = la.log_marginal_likelihood()
    with pytest.raises(ValueError, match="'sigma_fit': contains NaN"):
        la.load_state_dict(other)
    assert torch.equal(la.log_marginal_likelihood(), before)


def test_old_states_without_identity_keys_still_load_with_a_warning() -> None:
    la = _fitted("laplace-diag")
    state = la.state_dict()
    del state["task"], state["model_fingerprint"]
    again = gs.Laplace(la.model, "classification", "diag", prior_precision=0.5)
    with pytest.warns(StateWarning, match="no 'task' entry"):
        again.load_state_dict(state)
    torch.testing.assert_close(_laplace_out(again), _laplace_out(la), rtol=0, atol=0)


def test_a_wrong_dtype_of_the_right_kind_is_refused_too() -> None:
    la = _fitted("laplace-full")
    state = la.state_dict()
    state["mean"] = state["mean"].float()
    with pytest.raises(
        ValueError, match=r"'mean': expected dtype torch\.float64, got torch\.float32"
    ):
        la.load_state_dict(state)


def test_a_nested_curvature_entry_is_named_with_its_path() -> None:
    la = _fitted("laplace-full")
    state = la.state_dict()
    state["curvature"] = {**state["curvature"], "ggn": state["curvature"]["ggn"][:-1]}
    with pytest.raises(ValueError, match=r"'curvature\.ggn': expected shape"):
        la.load_state_dict(state)


def test_vbll_head_refuses_nan_and_bad_shapes_before_copying_anything() -> None:
    torch.manual_seed(0)
    head = VBLLDiscriminative(D, C, regularization_weight=0.1).to(DT)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    state = {k: v.clone() for k, v in head.state_dict().items()}
    first, last = next(iter(state)), list(state)[-1]
    state[first] = state[first] + 1.0  # would be copied first by torch
    state[last] = torch.full_like(state[last], float("nan"))
    with pytest.raises(ValueError, match=repr(last)):
        head.load_state_dict(state)
    for k, v in head.state_dict().items():
        assert torch.equal(v, before[k]), k
    # inside a larger model too (torch loads the head through its own loader)
    net = nn.Sequential(nn.Linear(D, D).to(DT), head)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    state[f"1.{last}"] = torch.full_like(state[f"1.{last}"], float("inf"))
    with pytest.raises(ValueError, match=repr(f"1.{last}")):
        net.load_state_dict(state)
    for k, v in head.state_dict().items():
        assert torch.equal(v, before[k]), k


# --------------------------------------------------------------------------- validate_state
def test_validate_state_reports_every_problem_at_once() -> None:
    schema = {"a": TensorSpec(("N", 2)), "b": TensorSpec(("N",))}
    with pytest.raises(StateError) as info:
        validate_state({"a": torch.zeros(3, 2), "b": torch.zeros(4), "c": 1}, schema, owner="Thing")
    message = str(info.value)
    assert message.startswith("Thing.load_state_dict: invalid state: ")
    assert "unknown key ['c']" in message
    assert "'b': expected shape (3,), got (4,)" in message
    with pytest.raises(TypeError, match="expected a dict"):
        validate_state([1, 2], schema, owner="Thing")


# --------------------------------------------------------------------------- transactions
class FailingLoader:
    """Re-iterable batches of 8 that raise at the ``fail_at``-th batch drawn (over all
    passes), or yield NaN inputs there with ``nan``."""

    def __init__(self, data: tuple[Tensor, Tensor], fail_at: int, nan: bool = False) -> None:
        self.x, self.y, self.fail_at, self.nan, self.drawn = *data, fail_at, nan, 0

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for start in range(0, N, 8):
            self.drawn += 1
            x = self.x[start : start + 8]
            if self.drawn == self.fail_at:
                if not self.nan:
                    raise RuntimeError("loader failed")
                x = torch.full_like(x, float("nan"))
            yield x, self.y[start : start + 8]


@pytest.mark.parametrize("fail_at", [2, 3])
@pytest.mark.parametrize("name", FAMILIES)
def test_a_fit_that_raises_midway_leaves_the_object_unchanged(name: str, fail_at: int) -> None:
    fam = FAMILIES[name]
    obj = _fitted(name)
    fam.output(obj)
    before, out_before = _tensors(obj), fam.output(obj)
    loader = FailingLoader(_data(2), fail_at)
    try:
        fam.fit(obj, loader)
    except RuntimeError as error:
        assert str(error) == "loader failed"
    else:  # one pass of two batches: the third is never drawn
        assert loader.drawn < fail_at
        return
    _assert_same(before, _tensors(obj))
    torch.testing.assert_close(fam.output(obj), out_before, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["laplace-kron", "laplace-diag", "exact", "adf"])
def test_a_nan_batch_in_the_middle_leaves_the_object_unchanged(name: str) -> None:
    fam = FAMILIES[name]
    obj = _fitted(name)
    before = _tensors(obj)
    with pytest.raises(ValueError):
        fam.fit(obj, FailingLoader(_data(2), 2, nan=True))
    _assert_same(before, _tensors(obj))


def test_an_incremental_laplace_fit_that_raises_keeps_the_earlier_sums() -> None:
    la = _fitted("laplace-kron")
    before = _tensors(la)
    with pytest.raises(RuntimeError):
        la.fit(FailingLoader(_data(1), 2), reset=False)
    _assert_same(before, _tensors(la))
    la.fit(_data(1), reset=False)  # and a successful one still adds up
    assert la.num_data == 2 * N


def test_a_failed_fit_restores_the_network_train_mode() -> None:
    la = _fitted("laplace-kron")
    la.model.train()
    with pytest.raises(RuntimeError):
        la.fit(FailingLoader(_data(1), 2))
    assert all(m.training for m in la.model.modules())


def test_exact_last_layer_fit_that_raises_keeps_no_partial_posterior() -> None:
    # issue 16: a raising fit left a posterior over 20 of 60 points
    layer = ExactLastLayer(D, C)
    layer.fit(_data(0))
    evidence, count = layer.log_marginal_likelihood(), layer.num_data
    with pytest.raises(RuntimeError):
        layer.fit(FailingLoader(_data(1), 2))
    assert layer.num_data == count
    assert torch.equal(layer.log_marginal_likelihood(), evidence)


def test_ella_failed_fit_keeps_landmarks_and_statistics_together() -> None:
    ella = _fitted("ella")
    landmarks, stats = ella._z.clone(), {k: v.clone() for k, v in ella._stats.items()}
    with pytest.raises(RuntimeError):
        ella.fit(FailingLoader(_data(4), 2))
    assert torch.equal(ella._z, landmarks)
    for k, v in stats.items():
        assert torch.equal(ella._stats[k], v)


def test_laplace_refine_and_optimize_prior_are_transactions() -> None:
    la = _fitted("laplace-full")
    before = _tensors(la)
    with pytest.raises(RuntimeError):
        la.refine(FailingLoader(_data(0), 3))  # the second pass (first Newton step) fails
    _assert_same(before, _tensors(la))
    fresh = gs.Laplace(_model(0), "classification", "kron", prior_precision=0.5)
    with pytest.raises(RuntimeError):
        fresh.optimize_prior(FailingLoader(_data(0), 2), method="grid")
    with pytest.raises(RuntimeError, match="call fit"):
        fresh.state_dict()


def test_gp_classifier_fit_that_fails_in_optimize_restores_the_data(monkeypatch: Any) -> None:
    gp = GPClassifier()
    x, y = _data(0)
    gp.fit(x, y, max_iter=3)
    kept = (gp._x.clone(), gp.log_lengthscale.clone(), gp.mean.clone())

    def fail(**kwargs: Any) -> None:
        raise RuntimeError("optimiser failed")

    monkeypatch.setattr(gp, "optimize", fail)
    with pytest.raises(RuntimeError):
        gp.fit(_data(1)[0] * 3, _data(1)[1])
    assert torch.equal(gp._x, kept[0])
    assert torch.equal(gp.log_lengthscale, kept[1])
    assert torch.equal(gp.mean, kept[2])


def test_transaction_restores_attributes_containers_generators_and_weights() -> None:
    class Thing:
        pass

    thing = Thing()
    model = _model(0)
    thing.history = [1.0]  # type: ignore[attr-defined]
    thing.gen = torch.Generator().manual_seed(0)  # type: ignore[attr-defined]
    thing.leaf = torch.ones(2, requires_grad=True)  # type: ignore[attr-defined]
    leaf = thing.leaf  # type: ignore[attr-defined]
    draw = torch.rand(1, generator=torch.Generator().manual_seed(0))
    weights = [p.clone() for p in model.parameters()]
    with pytest.raises(KeyError), transaction(thing, clone=("leaf",), model=model):
        thing.history.append(2.0)  # type: ignore[attr-defined]
        thing.new = 1  # type: ignore[attr-defined]
        torch.rand(3, generator=thing.gen)  # type: ignore[attr-defined]
        with torch.no_grad():
            leaf.mul_(5)
            next(model.parameters()).zero_()
        raise KeyError("boom")
    assert thing.history == [1.0] and not hasattr(thing, "new")  # type: ignore[attr-defined]
    assert thing.leaf is leaf and torch.equal(leaf, torch.ones(2))  # type: ignore[attr-defined]
    assert torch.equal(torch.rand(1, generator=thing.gen), draw)  # type: ignore[attr-defined]
    for p, w in zip(model.parameters(), weights, strict=True):
        assert torch.equal(p, w)
