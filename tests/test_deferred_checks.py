"""A fit's per-batch checks are made on the device and tested once (issue 17: no host syncs
inside the fit loops): the number of host syncs of a fit does not grow with its batches, a
failed check still raises its ValueError, now naming the batch, and the values equal the
per-batch ``update`` loop's."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import gaussify as gs
import gaussify.deferred_checks as deferred_checks_module
from gaussify.curvature import make_curvature
from gaussify.curvature.fitting import fit_curvature
from gaussify.deferred_checks import (
    check,
    check_finite,
    check_finite_values,
    check_range,
    deferred_checks,
    deferring,
    deferring_on,
)
from gaussify.host_syncs import HostSyncs

DT = torch.float64


def _mlp(c: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, c)).to(DT).eval()


def _cnn(c: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return (
        nn.Sequential(
            nn.Conv2d(1, 2, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(8, c),
        )
        .to(DT)
        .eval()
    )


def _data(model: str, rows: int, c: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (rows, 3) if model == "mlp" else (rows, 1, 4, 4)
    return torch.randn(*shape, generator=g, dtype=DT), torch.randint(0, c, (rows,), generator=g)


def _syncs(fn) -> int:  # type: ignore[no-untyped-def]
    with HostSyncs() as mode:
        fn()
    return mode.count


def _as_on_an_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks added for the GPU (the full GGN's, the generic Jacobian's, the traced KFAC
    predictive's) defer on accelerators only (``deferring_on``: on the CPU a host read is
    cheap and the records fragmented the heap); here the CPU is made to take the
    accelerators' route, which is the one these tests are about."""
    monkeypatch.setattr(deferred_checks_module, "DEFER_ON_CPU", True)


def test_deferring_on_accelerators_only() -> None:
    """``deferring_on``: inside a scope on an accelerator, not on the CPU, never outside."""
    with deferred_checks():
        assert deferring_on(torch.device("cuda"))
        assert not deferring_on(torch.device("cpu"))
    assert not deferring_on(torch.device("cuda"))


# ---------------------------------------------------------------------- the sync count


def _fit_syncs_over_2_and_8_batches(model_name: str, fit) -> list[int]:  # type: ignore[no-untyped-def]
    """The host reads of ``fit(model, x, y)`` (batches of 4) on 8 and on 32 rows."""
    c = 4 if model_name == "mlp" else 3
    build = _mlp if model_name == "mlp" else _cnn
    counts = []
    for batches in (2, 8):
        model = build(c)
        x, y = _data(model_name, 4 * batches, c)
        counts.append(_syncs(lambda: fit(model, x, y)))  # noqa: B023
    return counts


@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
@pytest.mark.parametrize("ef", [False, True])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_curvature_fit_host_syncs_do_not_grow_with_the_batches(
    monkeypatch: pytest.MonkeyPatch, model_name: str, structure: str, ef: bool, subset: str
) -> None:
    """A fit of 2 and of 8 batches reads the device the same number of times (one test of
    all the batches' checks at the end), where the per-batch checks read it several times per
    batch (the outputs' and labels' checks, the diagonal's finiteness and overflow tests; the
    full GGN's products and, on the last layer, its features, middles and sum: main read the
    device twice per batch there; on an accelerator, ``_as_on_an_accelerator``)."""
    _as_on_an_accelerator(monkeypatch)

    def fit(model: nn.Module, x: Tensor, y: Tensor) -> None:
        loader = DataLoader(TensorDataset(x, y), batch_size=4)
        curv = make_curvature(structure, model, "classification", subset, ef=ef)
        fit_curvature(curv, model, loader)

    counts = _fit_syncs_over_2_and_8_batches(model_name, fit)
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_monte_carlo_fit_host_syncs_do_not_grow_with_the_batches(
    model_name: str, structure: str
) -> None:
    """The Monte Carlo GGN's sampled labels read nothing per batch: the outputs' finiteness
    is a deferred check and the categorical draw (the exponential race, torch.multinomial's
    own) has no validity read (main read the device once per batch there)."""

    def fit(model: nn.Module, x: Tensor, y: Tensor) -> None:
        curv = make_curvature(
            structure, model, "classification", mc_samples=1, generator=torch.Generator()
        )
        fit_curvature(curv, model, (x, y), 4)

    counts = _fit_syncs_over_2_and_8_batches(model_name, fit)
    assert counts[0] == counts[1], counts


def test_monte_carlo_fit_with_nan_outputs_raises_once_and_changes_nothing() -> None:
    """NaN outputs in batch 1 of a Monte Carlo fit: the draw does not fail on them, the
    deferred check raises the outputs' message naming the batch, the state is set back."""
    model = _mlp(4)
    x, y = _data("mlp", 12, 4)
    x[5] = float("nan")
    curv = make_curvature("diag", model, "classification", mc_samples=2)
    with pytest.raises(ValueError, match=r"NaN or inf.*\(batch 1 of the fit"):
        fit_curvature(curv, model, (x, y), 4)
    assert curv.num_data == 0 and not curv.ggn_diag.any()


@pytest.mark.parametrize("structure", ["diag", "kron"])
@pytest.mark.parametrize("task", ["classification", "regression"])
def test_laplace_fit_host_syncs_do_not_grow_with_the_batches(structure: str, task: str) -> None:
    """Laplace.fit's data pass (curvature, log-likelihood and its gradient per batch) reads
    the device a fixed number of times, whatever the number of batches."""
    c = 4 if task == "classification" else 2
    counts = []
    for batches in (2, 8):
        model = _mlp(c)
        g = torch.Generator().manual_seed(batches)
        x = torch.randn(4 * batches, 3, generator=g, dtype=DT)
        y = (
            torch.randint(0, c, (4 * batches,), generator=g)
            if task == "classification"
            else torch.randn(4 * batches, c, generator=g, dtype=DT)
        )
        la = gs.Laplace(model, task, structure)
        counts.append(_syncs(lambda: la.fit((x, y), batch_size=4)))  # noqa: B023
    assert counts[0] == counts[1], counts


def test_laplace_fit_over_a_loader_reads_the_device_at_most_once_per_batch() -> None:
    """Over a DataLoader each batch is validated as drawn: its labels' range is recorded
    (no read), only the inputs' finiteness test reads the device (its message names the
    global row, which needs the batch), so 6 more batches cost at most 6 more reads (the
    per-batch checks of main read it 10-20 times per batch)."""
    counts = []
    for batches in (2, 8):
        model = _mlp(4)
        x, y = _data("mlp", 4 * batches, 4, seed=batches)
        loader = DataLoader(TensorDataset(x, y), batch_size=4)
        la = gs.Laplace(model, "classification", "diag")
        counts.append(_syncs(lambda: la.fit(loader)))  # noqa: B023
    assert counts[1] - counts[0] <= 6, counts


# ---------------------------------------------------------------------- values and errors


@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
@pytest.mark.parametrize("ef", [False, True])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_deferred_fit_equals_the_checked_updates(
    model_name: str, structure: str, ef: bool, subset: str
) -> None:
    """fit_curvature (checks deferred; the diagonal and the full GGN added without their
    batch temporaries) gives the state of the per-batch checked ``update`` loop to round-off
    in float64 (chunk_size 3: several chunks per batch of 8)."""
    c = 4 if model_name == "mlp" else 3
    build = _mlp if model_name == "mlp" else _cnn
    model = build(c)
    x, y = _data(model_name, 24, c)
    ref = make_curvature(structure, model, "classification", subset, ef=ef, chunk_size=3)
    for start in range(0, 24, 8):
        ref.update(model, x[start : start + 8], y[start : start + 8])
    fitted = fit_curvature(
        make_curvature(structure, model, "classification", subset, ef=ef, chunk_size=3),
        model,
        (x, y),
        8,
    )
    expected = ref.state_dict()
    got = fitted.state_dict()
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-12, atol=1e-300, msg=key)


class RootNet(nn.Module):
    """f = W2 sqrt|W1 x| + b2: finite everywhere, its Jacobian in W1 NaN at x = 0."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4, bias=False)
        self.out = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.inp(x).abs().sqrt())


@pytest.mark.parametrize(
    ("fit", "structure"),
    [
        ("fit_curvature", "diag"),
        ("fit_curvature", "full"),
        ("Laplace.fit", "diag"),
        ("Laplace.fit", "lowrank"),
        ("Laplace.fit", "full"),
    ],
)
def test_a_failed_check_names_its_parameter_and_batch_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, fit: str, structure: str
) -> None:
    """A NaN Jacobian in the third batch (x = 0 in RootNet) raises the per-batch message
    naming the parameter, located after the fact and with the batch named; the curvature
    (fit_curvature: set back to its earlier state) or the Laplace (its old fit) is as it was
    (low rank: its diagonal is checked in the same place as the diagonal structure's)."""
    _as_on_an_accelerator(monkeypatch)
    torch.manual_seed(0)
    model = RootNet().to(DT).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, generator=g, dtype=DT) + 0.1
    y = torch.randint(0, 2, (16,), generator=g)
    x_bad = x.clone()
    x_bad[9] = 0.0  # batch 2 of 4-row batches
    expected = r"NaN Jacobian in parameter 'inp\.weight'.*\(batch 2 of the fit, counting from 0\)"
    if fit == "fit_curvature":
        curv = fit_curvature(make_curvature(structure, model, "classification"), model, (x, y), 4)
        before = {k: v.clone() for k, v in curv.state_dict().items() if isinstance(v, Tensor)}
        with pytest.raises(ValueError, match=expected):
            fit_curvature(curv, model, (x_bad, y), 4)
        after = curv.state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items()) and curv.num_data == 16
        fresh = make_curvature(structure, model, "classification")
        with pytest.raises(ValueError, match=expected):
            fit_curvature(fresh, model, (x_bad, y), 4)
        assert fresh.num_data == 0
        assert all(not v.any() for v in fresh.state_dict().values() if isinstance(v, Tensor))
    else:
        options = {"rank": 3} if structure == "lowrank" else {}
        la = gs.Laplace(model, "classification", structure, **options).fit((x, y), batch_size=4)
        precision = la.posterior_precision.clone()
        with pytest.raises(ValueError, match=expected):
            la.fit((x_bad, y), batch_size=4)
        assert torch.equal(la.posterior_precision, precision) and la.num_data == 16


def test_labels_out_of_range_are_named_with_their_batch() -> None:
    """The empirical Fisher reads the labels: one outside [0, C) in batch 1 raises the
    likelihood's message with the labels' range and the batch, the state set back."""
    model = _mlp(4)
    x, y = _data("mlp", 12, 4)
    y[5] = 9
    curv = make_curvature("kron", model, "classification", ef=True)
    with pytest.raises(
        ValueError,
        match=r"^y: labels must be in \[0, 4\), got range \[\d, 9\] \(batch 1 of the fit",
    ):
        fit_curvature(curv, model, (x, y), 4)
    assert curv.num_data == 0 and all(not v.any() for v in curv.state_dict().values())


# ---------------------------------------------------------------------- the mechanism


def test_outside_a_scope_checks_raise_at_once() -> None:
    assert not deferring()
    with pytest.raises(ValueError, match=r"^t: NaN$"):
        check_finite(torch.tensor([1.0, float("nan")]), "t: NaN")
    with pytest.raises(ValueError, match=r"^v 1: inf$"):
        check_finite_values([torch.tensor(1.0), torch.tensor(float("inf"))], "v {}: {}".format)
    with pytest.raises(ValueError, match=r"^range \[-1, 2\]$"):
        check_range(torch.tensor(-1), torch.tensor(2), 3, "range [{}, {}]".format)
    with pytest.raises(ValueError, match=r"^flag$"):
        check(torch.tensor(False), "flag")


def test_a_scope_reads_once_and_raises_the_first_failure_in_recording_order() -> None:
    """Inside a scope nothing is read until its end (one read for all the records); the
    earliest failed record (a range failure in batch 1, before a NaN in batch 2) is raised;
    nested scopes join the outer one; an exception inside a scope propagates untested."""
    failure = r"^range \[0, 5\] \(batch 1 of the fit"
    with HostSyncs() as mode, pytest.raises(ValueError, match=failure), deferred_checks() as scope:
        for batch in range(3):
            scope.batch = batch
            with deferred_checks() as inner:  # joins
                assert inner is scope
                hi = torch.tensor(3 + 2 * batch)
                check_range(torch.tensor(0), hi, 5, "range [{}, {}]".format)
                bad = float("nan") if batch == 2 else 1.0
                check_finite(torch.tensor([bad]), "nan")
            assert mode.count == 0
    # one read for the test, then the failed records located (only on failure)
    assert mode.count >= 1
    with HostSyncs() as mode, deferred_checks():
        for _ in range(5):
            check(torch.tensor(True), "never")
            check_finite(torch.ones(3), "never")  # float32 and float64 values stack together
            check_finite(torch.ones(3, dtype=DT), "never")
            check_range(torch.tensor(0), torch.tensor(2), 3, "never {} {}".format)
    assert mode.count == 1
    with pytest.raises(KeyError), deferred_checks():
        check(torch.tensor(False), "not raised: the KeyError wins")
        raise KeyError("inner")
    assert not deferring()


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("accelerator", [False, True])
def test_a_full_ggn_whose_sum_overflows_is_refused_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch, subset: str, accelerator: bool
) -> None:
    """Finite products whose squares overflow float64 (inputs of 1e160): a lone ``update``
    refuses the batch with G unchanged (main added it and returned an infinite G), and a fit
    raises and sets G back: on the CPU at once, on an accelerator (checks deferred, the batch
    added directly) at the end with the batch named."""
    if accelerator:
        _as_on_an_accelerator(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2)).to(DT)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 3, generator=g, dtype=DT).abs()
    y = torch.randn(12, 2, generator=g, dtype=DT)
    x[6] = 1e160
    message = r"the sum overflowed"
    curv = make_curvature("full", model, "regression", subset)
    curv.update(model, x[:4], y[:4])
    before = curv.ggn.clone()
    with pytest.raises(ValueError, match=message):
        curv.update(model, x[4:8], y[4:8])
    assert torch.equal(curv.ggn, before) and torch.isfinite(curv.ggn).all()
    assert curv.num_data == 4
    named = r".*\(batch 1 of the fit" if accelerator else ""
    with pytest.raises(ValueError, match=message + named):
        fit_curvature(curv, model, (x, y), 4)
    assert torch.equal(curv.ggn, before) and curv.num_data == 4


@pytest.mark.parametrize("structure", ["diag", "kron", "full", "lowrank"])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_glm_predict_host_syncs_do_not_grow_with_the_chunks(
    monkeypatch: pytest.MonkeyPatch, structure: str, subset: str
) -> None:
    """The GLM predictive's per-chunk checks (the Jacobians' and the traced KFAC gradients'
    finiteness) are recorded and tested once: 2 and 16 chunks read the device equally often
    (main read it once per chunk on the Jacobian route and twice on the traced KFAC route;
    on an accelerator, ``_as_on_an_accelerator``)."""
    _as_on_an_accelerator(monkeypatch)
    model = _mlp(4)
    x, y = _data("mlp", 32, 4)
    options = {"rank": 3} if structure == "lowrank" else {}
    la = gs.Laplace(model, "classification", structure, subset=subset, **options)
    la.fit((x, y), batch_size=8)
    la.predict(x[:4], chunk_size=4)  # one-time work (the posterior's factors) done first
    counts = [_syncs(lambda: la.predict(x[:rows], chunk_size=4)) for rows in (8, 32)]  # noqa: B023
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("structure", ["diag", "kron"])
def test_glm_predict_names_a_nan_jacobian_found_after_the_fact(structure: str) -> None:
    """A NaN Jacobian in the predictive's second chunk (x = 0 in RootNet) still raises the
    message naming the parameter, now at the end of the chunks (kron: from the traced
    gradients, which main checked per chunk and then sent to the Jacobian route)."""
    torch.manual_seed(0)
    model = RootNet().to(DT).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, generator=g, dtype=DT) + 0.1
    y = torch.randint(0, 2, (16,), generator=g)
    la = gs.Laplace(model, "classification", structure).fit((x, y), batch_size=4)
    x_bad = x.clone()
    x_bad[5] = 0.0
    with pytest.raises(ValueError, match=r"^NaN Jacobian in parameter 'inp\.weight'"):
        la.predict(x_bad, chunk_size=4)
    assert torch.isfinite(la.predict(x, chunk_size=4).f_cov).all()
