"""The lean install: the core works without matplotlib and scikit-learn (the ``plots`` and
``experiments`` extras), and a feature that needs one says which pip command installs it."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

BLOCKED = ("matplotlib", "sklearn")
PLOTS = 'pip install "gaussify[plots]"'
EXPERIMENTS = 'pip install "gaussify[experiments]"'


@pytest.fixture
def lean() -> Iterator[ModuleType]:
    """A fresh ``import gaussify`` in an interpreter where matplotlib and scikit-learn cannot
    be imported (``None`` in ``sys.modules``: ``import`` raises ``ModuleNotFoundError``,
    ``importlib.util.find_spec`` answers None, as when they are not installed); gaussify's,
    matplotlib's and scikit-learn's modules are put back afterwards, so the other tests keep
    theirs."""
    saved = dict(sys.modules)
    for name in list(sys.modules):
        if name.split(".")[0] in ("gaussify", *BLOCKED):
            del sys.modules[name]
    for name in BLOCKED:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield importlib.import_module("gaussify")
    finally:
        for name in list(sys.modules):  # torch's own lazily imported modules stay
            if name.split(".")[0] in ("gaussify", *BLOCKED):
                del sys.modules[name]
        sys.modules.update(
            {k: v for k, v in saved.items() if k.split(".")[0] in ("gaussify", *BLOCKED)}
        )


def test_fit_and_predict_need_neither_matplotlib_nor_sklearn(
    lean: ModuleType,
) -> None:
    gs = lean
    ds = gs.data.load("iris", seed=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    gs.train_map(model, (ds.x_train, ds.y_train), "classification", 1.0, epochs=2, seed=0)
    la = gs.Laplace(model, "classification", structure="kron").fit((ds.x_train, ds.y_train))
    probs = la.predict(ds.x_test, method="glm", link="probit").probs
    ella = gs.ELLA(model, "classification", num_landmarks=10).fit((ds.x_train, ds.y_train))
    probs_ella = ella.predict(ds.x_test).probs
    for p in (probs, probs_ella):
        assert torch.allclose(p.sum(-1), torch.ones(len(p)), atol=1e-5)
    gs.metrics.classification_metrics(probs, ds.y_test)
    # nothing of either was loaded (the only entries are the blocking Nones)
    assert [n for n in sys.modules if n.split(".")[0] in BLOCKED] == list(BLOCKED)


def test_a_missing_extra_is_one_line_naming_the_pip_command(
    lean: ModuleType,
) -> None:
    gs = lean
    from gaussify.extras import MissingExtraError

    with pytest.raises(MissingExtraError) as info:
        importlib.import_module("gaussify.plots")
    assert (
        str(info.value)
        == f"gaussify.plots (figures) needs matplotlib, which is not installed: {PLOTS}"
    )
    assert isinstance(info.value, ImportError)
    ds = gs.data.load("iris", seed=0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    ella = gs.ELLA(model, "classification", num_landmarks=5, landmarks="kmeans")
    with pytest.raises(MissingExtraError) as info:
        ella.fit((ds.x_train, ds.y_train))
    assert str(info.value) == (
        f'ELLA landmarks="kmeans" needs scikit-learn, which is not installed: {EXPERIMENTS}'
    )
    with pytest.raises(MissingExtraError, match=r"the two_moons data set needs scikit-learn"):
        gs.data.load("two_moons")


def test_demo_without_matplotlib_refuses_in_one_line_before_any_work(
    lean: ModuleType,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cli = importlib.import_module("gaussify.cli")
    monkeypatch.setattr(cli, "train_map", lambda *a, **k: pytest.fail("trained"))
    assert cli.main(["demo", "--dataset", "iris", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"gaussify: error: gaussify.plots (figures) needs matplotlib, which is not installed: "
        f"{PLOTS}"
    ]
    # an experiment's --figure is refused the same way, before it runs
    code = cli.main(["experiment", "marglik_selection", "--figure", str(tmp_path / "f.png")])
    assert code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"gaussify: error: --figure needs matplotlib, which is not installed: {PLOTS}"
    )
