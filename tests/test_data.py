"""gaussify.data: every bundled data set loads offline with its documented shape and split.

The expected shapes are those of the offline-data survey (shared/research/datasets.md) and
the data sets' original descriptions, written down here independently of the registry.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.util
import socket
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

import gaussify.data as gd
from gaussify.data import raw as raw_mod
from gaussify.data.dataset import Dataset
from gaussify.data.registry import REGISTRY
from gaussify.data.splits import apportion, check_fractions, stratified_split
from gaussify.data.synthetic import valla_toy, waveform, waveform_base

# name: (n, d, num_classes or None for regression)
EXPECTED = {
    "boston": (506, 13, None),
    "concrete": (1030, 8, None),
    "wine_red": (1599, 11, None),
    "yacht": (308, 6, None),
    "power": (9568, 4, None),
    "protein": (45730, 9, None),
    "airline": (40000, 8, None),
    "diabetes": (442, 10, None),
    "valla_toy": (300, 1, None),
    "australian": (690, 14, 2),
    "breast_cancer": (569, 30, 2),
    "ionosphere": (351, 34, 2),
    "glass": (214, 9, 6),
    "vehicle": (846, 18, 4),
    "waveform": (5000, 21, 3),
    "digits": (1797, 64, 10),
    "satellite": (6435, 36, 6),
    "magic": (19020, 10, 2),
    "letter": (20000, 16, 26),
    "wine": (178, 13, 3),
    "iris": (150, 4, 3),
    "mnist": (10000, 784, 10),
    "fashion_mnist": (12000, 784, 10),
    "fashion_mnist_full": (70000, 784, 10),
    "banana": (5300, 2, 2),
    "two_moons": (1000, 2, 2),
}
IMAGES = {"mnist", "fashion_mnist", "fashion_mnist_full"}
VBLL_UCI = {"boston", "concrete", "wine_red", "yacht", "power", "protein"}
IMMER_TABLE1 = {
    "australian",
    "breast_cancer",
    "ionosphere",
    "glass",
    "vehicle",
    "waveform",
    "digits",
    "satellite",
}
LOADABLE = [name for name in sorted(EXPECTED) if name != "fashion_mnist_full"]


@cache
def loaded(name: str, seed: int = 0) -> Dataset:
    """Each (name, seed) is loaded once per test session (big sets included)."""
    return gd.load(name, seed=seed)


def raw_arrays(name: str, seed: int = 0) -> raw_mod.RawData:
    spec = REGISTRY[name]
    if spec.file is not None:
        return raw_mod.read_npz(spec.file)
    return spec.reader(seed if spec.data_seed is None else spec.data_seed)


def sizes_for(n: int, fractions: tuple[float, float, float]) -> tuple[int, int, int]:
    n_val, n_test = round(fractions[1] * n), round(fractions[2] * n)
    return n - n_val - n_test, n_val, n_test


# ------------------------------------------------------------------------------ listing


def test_list_is_sorted_complete_and_matches_registry() -> None:
    names = gd.list()
    assert names == sorted(names) == sorted(REGISTRY)
    assert set(names) == set(EXPECTED)
    assert len([n for n in names if n != "fashion_mnist_full"]) >= 18
    assert gd.list(task="regression") == sorted(n for n, e in EXPECTED.items() if e[2] is None)
    assert set(gd.list(available_only=True)) >= set(LOADABLE)
    assert gd.list is gd.list_datasets
    assert list(range(2)) == [0, 1]  # the builtin is not shadowed here


def test_unknown_name_error_names_every_dataset() -> None:
    with pytest.raises(ValueError, match="nope") as err:
        gd.load("nope")
    for name in gd.list():
        assert name in str(err.value)


# ------------------------------------------------------------------- every data set


@pytest.mark.parametrize("name", LOADABLE)
def test_dataset_shape_metadata_and_split(name: str) -> None:
    n, d, num_classes = EXPECTED[name]
    ds = loaded(name)
    spec = gd.info(name)
    assert (ds.name, ds.n, ds.d, ds.num_classes) == (name, n, d, num_classes)
    assert ds.task == ("regression" if num_classes is None else "classification")
    assert ds.source and ds.licence and ds.description and ds.split
    assert ds.synthetic == (name in {"banana", "two_moons", "valla_toy", "waveform"})

    # parts: disjoint by row index and together every row once
    idx = [ds.idx_train.numpy(), ds.idx_val.numpy(), ds.idx_test.numpy()]
    everything = np.concatenate(idx)
    assert len(everything) == n and np.array_equal(np.sort(everything), np.arange(n))
    assert ds.sizes == tuple(len(i) for i in idx)
    for part, i in zip(("train", "val", "test"), idx, strict=True):
        x, y = ds.tensors(part)
        assert x.shape[0] == y.shape[0] == len(i)

    # split sizes follow the protocol
    protocol = spec.protocol
    if protocol.kind == "random":
        assert ds.sizes == sizes_for(n, protocol.fractions)
    if name in VBLL_UCI:
        assert protocol.fractions == (0.72, 0.18, 0.10) and not protocol.stratify
    if name in IMMER_TABLE1:
        assert protocol.fractions == (0.70, 0.15, 0.15) and protocol.stratify
    if protocol.kind == "original_test":
        raw = raw_arrays(name)
        assert np.array_equal(np.sort(idx[2]), np.flatnonzero(raw.is_test))
    if protocol.kind == "ordered":  # contiguous blocks in row order: train, val, test
        n_train, n_val, _ = sizes_for(n, protocol.fractions)
        assert np.array_equal(np.concatenate(idx), np.arange(n))
        assert ds.sizes[:2] == (n_train, n_val)

    # features
    if name in IMAGES:
        assert ds.x_train.shape[1:] == (1, 28, 28) == ds.input_shape
        assert float(ds.x_train.min()) >= 0.0 and float(ds.x_train.max()) <= 1.0
        assert ds.x_mean is None
    else:
        assert ds.x_train.shape[1:] == (d,)
        check_standardised(ds)

    # targets
    if num_classes is None:
        assert ds.y_train.shape == (len(idx[0]), 1) and ds.y_train.dtype == torch.float32
        y = ds.y_train.double()
        assert abs(float(y.mean())) < 1e-5 and abs(float(y.std(unbiased=False)) - 1) < 1e-5
    else:
        assert ds.y_train.dtype == torch.int64 and ds.y_train.ndim == 1
        assert len(ds.label_names) == num_classes
        all_labels = torch.cat([ds.y_train, ds.y_val, ds.y_test])
        assert set(all_labels.tolist()) == set(range(num_classes))
        if protocol.stratify:
            check_stratified(ds)


def check_standardised(ds: Dataset) -> None:
    """Train features have mean 0 and std 1 per column (constant columns become 0), and
    every part equals its raw rows standardised with the train statistics."""
    x = ds.x_train.double()
    mean, std = x.mean(0), x.std(0, unbiased=False)
    assert torch.allclose(mean, torch.zeros_like(mean), atol=1e-5)
    constant = std < 1e-6
    assert torch.allclose(std[~constant], torch.ones_like(std[~constant]), atol=1e-4)
    assert torch.all(x[:, constant] == 0)
    raw = raw_arrays(ds.name, ds.seed)
    for part in ("train", "val", "test"):
        rows = raw.x[getattr(ds, f"idx_{part}").numpy()].astype(np.float64)
        expected = (rows - ds.x_mean.double().numpy()) / ds.x_std.double().numpy()
        assert np.allclose(getattr(ds, f"x_{part}").double().numpy(), expected, atol=1e-5)


def check_stratified(ds: Dataset) -> None:
    """Each class's count in each part is within 1 (val, test) or 2 (train) of its share."""
    labels = torch.cat([ds.y_train, ds.y_val, ds.y_test]).numpy()
    totals = np.bincount(labels, minlength=ds.num_classes)
    for part, tol in (("train", 2), ("val", 1), ("test", 1)):
        y = getattr(ds, f"y_{part}").numpy()
        share = totals * len(y) / len(labels)
        assert np.all(np.abs(np.bincount(y, minlength=ds.num_classes) - share) < tol), part


AIRLINE_SHA256 = "039d12b918338779f8fc1a51affa0070257aacc7e34017b076d1f5333eb17f7d"
AIRLINE_FEATURES = [
    "month",
    "day_of_month",
    "day_of_week",
    "plane_age",
    "air_time",
    "distance",
    "arr_time",
    "dep_time",
]


def test_airline_file_features_in_time_order_and_temporal_split() -> None:
    """The nycflights13 stand-in for the VaLLA paper's Airline set (Sec. 5.2): the file's
    digest, shape and feature order (the paper's 8), rows in time order, and the authors'
    split (first 0.75 train, next 0.125 validation, last 0.125 test), which no seed moves."""
    import datetime

    path = raw_mod.FILES_DIR / "airline.npz"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == AIRLINE_SHA256
    with np.load(path, allow_pickle=False) as npz:
        assert npz["feature_names"].tolist() == AIRLINE_FEATURES
        x, y = npz["x"].astype(np.float64), npz["y"].astype(np.float64)
    assert x.shape == (40000, 8) and y.shape == (40000,)
    # the first flight of 2013 by schedule: UA 1545 EWR-IAH on Tuesday 1 January, 05:15
    # scheduled, left 05:17 (317 min), arrived 08:30 (510 min), 227 min in the air, 1400
    # miles, 11 min late, plane N14228 built in 1999 (age 14)
    assert x[0].tolist() == [1, 1, 2, 14, 227, 1400, 510, 317] and y[0] == 11
    month, day, dow = x[:, 0].astype(int), x[:, 1].astype(int), x[:, 2].astype(int)
    date = month * 100 + day
    assert np.all(np.diff(date) >= 0) and date[0] == 101 and date[-1] == 227  # time order
    weekday = {d: datetime.date(2013, d // 100, d % 100).isoweekday() for d in set(date)}
    assert np.array_equal(dow, [weekday[d] for d in date])
    assert x[:, 3].min() >= 0 and x[:, 4].min() > 0 and x[:, 5].min() > x[:, 4].min()
    assert np.all((x[:, 6:] >= 1) & (x[:, 6:] <= 1440)) and np.all(x[:, 6:] % 1 == 0)
    assert np.all(y % 1 == 0) and (y.min(), y.max()) == (-70, 1272)  # minutes
    a, b = gd.load("airline", seed=0), gd.load("airline", seed=4, max_train=5000)
    assert a.sizes == (30000, 5000, 5000) and "time" in a.split
    assert np.array_equal(a.idx_train.numpy(), np.arange(30000))
    assert np.array_equal(a.idx_val.numpy(), np.arange(30000, 35000))
    assert np.array_equal(a.idx_test.numpy(), np.arange(35000, 40000))
    assert torch.equal(a.idx_test, b.idx_test) and torch.equal(a.idx_val, b.idx_val)
    assert b.sizes == (5000, 5000, 5000) and int(b.idx_train.max()) < 30000
    assert np.allclose(a.unstandardize_y(a.y_test).squeeze(1).double().numpy(), y[35000:])


def test_ordered_split_blocks_and_unknown_protocol_kind_is_refused(tmp_path: Path) -> None:
    from gaussify.data import registry as reg
    from gaussify.data.splits import ordered_split

    train, val, test = ordered_split(10, (0.5, 0.25, 0.25))
    assert [p.tolist() for p in (train, val, test)] == [[0, 1, 2, 3, 4, 5], [6, 7], [8, 9]]
    with pytest.raises(ValueError, match=r"kind 'temporal'.*'ordered'"):
        reg._protocol({"kind": "temporal"}, {})


def test_regression_targets_unstandardise_to_raw() -> None:
    ds = loaded("concrete")
    raw = raw_arrays("concrete")
    back = ds.unstandardize_y(ds.y_test).squeeze(1).double().numpy()
    assert np.allclose(back, raw.y[ds.idx_test.numpy()], atol=1e-3)
    with pytest.raises(ValueError, match="classification"):
        loaded("iris").unstandardize_y(torch.zeros(3))


@pytest.mark.parametrize("name", ["breast_cancer", "waveform", "boston"])
def test_parts_share_no_row(name: str) -> None:
    """Disjointness by content too, on sets without duplicate rows (before standardising)."""
    ds = gd.load(name, seed=4, standardize=False)
    assert ds.x_mean is None and ds.standardized is False

    def hashes(x: torch.Tensor) -> set[bytes]:
        return {hashlib.sha1(row.tobytes()).digest() for row in x.numpy()}

    train, val, test = hashes(ds.x_train), hashes(ds.x_val), hashes(ds.x_test)
    assert len(train) + len(val) + len(test) == ds.n
    assert not (train & val or train & test or val & test)


# ------------------------------------------------------------------------ seeds / splits


@pytest.mark.parametrize("name", ["boston", "glass", "waveform", "fashion_mnist", "magic"])
def test_seeds_reproducible_and_different(name: str) -> None:
    a, b, c = gd.load(name, seed=1), gd.load(name, seed=1), gd.load(name, seed=2)
    for part in ("train", "val", "test"):
        assert torch.equal(getattr(a, f"x_{part}"), getattr(b, f"x_{part}"))
        assert torch.equal(getattr(a, f"y_{part}"), getattr(b, f"y_{part}"))
    assert not torch.equal(a.idx_train, c.idx_train)
    assert a.seed == 1 and c.seed == 2


def test_valla_toy_matches_authors_code_and_varies_noise_with_seed() -> None:
    x = np.linspace(-2.0, 2.0, 300)
    y = np.sin(4 * x) + np.random.default_rng(seed=0).standard_normal(x.shape) * 0.1
    raw = valla_toy(0)
    assert np.allclose(raw.x[:, 0], x) and np.allclose(raw.y, y, atol=1e-6)
    ds = gd.load("valla_toy", standardize=False)
    xt = ds.x_train[:, 0]
    assert torch.all(((xt > -1) & (xt < -0.5)) | ((xt > 0.5) & (xt < 1)))
    assert torch.all(ds.x_val.abs() < 0.5) and torch.all(ds.x_test.abs() > 1)
    other = gd.load("valla_toy", seed=1, standardize=False)
    assert torch.equal(ds.idx_train, other.idx_train)
    assert not torch.equal(ds.y_train, other.y_train)


def test_split_override_and_max_train() -> None:
    ds = gd.load("boston", seed=3, split=(0.5, 0.25, 0.25))
    assert ds.sizes == (254, 126, 126)  # 126.5 rounds half to even
    images = gd.load("fashion_mnist", split=[0.8, 0.1, 0.1], flatten=True)
    assert images.sizes == (9600, 1200, 1200) and images.x_train.shape == (9600, 784)
    check_stratified(images)
    full = loaded("protein")
    small = gd.load("protein", max_train=1000)
    assert small.sizes == (1000, *full.sizes[1:])
    assert torch.equal(small.idx_val, full.idx_val) and torch.equal(small.idx_test, full.idx_test)
    assert set(small.idx_train.tolist()) <= set(full.idx_train.tolist())
    assert abs(float(small.y_train.double().std(unbiased=False)) - 1) < 1e-5
    clf = gd.load("letter", max_train=260)
    pool = np.bincount(loaded("letter").y_train.numpy(), minlength=26)
    share = pool * 260 / pool.sum()
    assert np.all(np.abs(np.bincount(clf.y_train.numpy(), minlength=26) - share) < 1)
    assert gd.load("iris", max_train=10_000).sizes == loaded("iris").sizes


def test_dtype_and_loader() -> None:
    ds = gd.load("wine", dtype=torch.float64)
    assert ds.x_train.dtype == torch.float64 and ds.y_train.dtype == torch.int64
    first = [y for _, y in ds.loader("train", batch_size=32, seed=5)]
    again = [y for _, y in ds.loader("train", batch_size=32, seed=5)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert sorted(torch.cat(first).tolist()) == sorted(ds.y_train.tolist())
    val = torch.cat([y for _, y in ds.loader("val", batch_size=7)])
    assert torch.equal(val, ds.y_val)  # not shuffled
    loaders = gd.loaders(ds, batch_size=16)
    assert [len(loader.dataset) for loader in loaders] == list(ds.sizes)
    with pytest.raises(ValueError, match="part"):
        ds.loader("validation")
    with pytest.raises(ValueError, match="batch_size"):
        ds.loader("train", batch_size=0)
    assert "wine" in repr(ds)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"split": (0.5, 0.5, 0.5)}, "split"),
        ({"split": (0.7, 0.3)}, "split"),
        ({"split": (1.2, -0.1, -0.1)}, "split"),
        ({"split": (0.0, 0.5, 0.5)}, "split"),
        ({"split": (float("nan"), 0.5, 0.5)}, "split"),
        ({"split": "0.7,0.15,0.15"}, "split"),
        ({"split": ("a", "b", "c")}, "split"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"standardize": "yes"}, "standardize"),
        ({"flatten": 1}, "flatten"),
        ({"max_train": 0}, "max_train"),
        ({"max_train": -5}, "max_train"),
        ({"max_train": 2.5}, "max_train"),
        ({"dtype": torch.int64}, "dtype"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=f"^{argument}"):
        gd.load("iris", **kwargs)


def test_list_rejects_unknown_task() -> None:
    with pytest.raises(ValueError, match="task"):
        gd.list(task="clustering")


# ---------------------------------------------------------------------- pure functions


def test_apportion_and_stratified_split() -> None:
    assert apportion(np.array([5, 3, 2]), 5).tolist() == [3, 1, 1]
    assert apportion(np.array([1, 1, 8]), 10).tolist() == [1, 1, 8]
    capped = apportion(np.array([10, 10]), 6, cap=np.array([1, 10]))
    assert capped.tolist() == [1, 5]
    with pytest.raises(ValueError):
        apportion(np.array([2, 2]), 5)
    labels = np.repeat([0, 1, 2], [50, 30, 7])
    train, val, test = stratified_split(labels, (0.6, 0.2, 0.2), np.random.default_rng(0))
    assert (len(train), len(val), len(test)) == sizes_for(87, (0.6, 0.2, 0.2))
    assert np.array_equal(np.sort(np.concatenate([train, val, test])), np.arange(87))
    assert check_fractions([0.8, 0.2, 0]) == (0.8, 0.2, 0.0)


def test_waveform_is_breimans_generator() -> None:
    h = waveform_base()
    # UCI waveform.c: wave 1 = j for j=1..6, 12-j for j=7..11; wave 2 shifted by 8; wave 3 by 4
    h1 = np.zeros(21)
    h1[1:7], h1[7:12] = np.arange(1, 7), 12 - np.arange(7, 12)
    assert np.array_equal(h[0], h1)
    assert np.array_equal(h[1], np.roll(h1, 8)) and np.array_equal(h[2], np.roll(h1, 4))
    data = waveform(seed=1, n=30000)
    pairs = [(0, 1), (0, 2), (1, 2)]
    for c, (a, b) in enumerate(pairs):
        x = data.x[data.y == c].astype(np.float64)
        assert abs(len(x) / 30000 - 1 / 3) < 0.02
        # E[x] = (h_a + h_b)/2; Var[x_j] = 1 + (h_a - h_b)_j^2 / 12 for u ~ U(0, 1)
        assert np.allclose(x.mean(0), (h[a] + h[b]) / 2, atol=0.1)
        assert np.allclose(x.var(0), 1 + (h[a] - h[b]) ** 2 / 12, rtol=0.1)


# ---------------------------------------------------------------------- files / offline


def test_vendored_files_match_recorded_checksums_and_size() -> None:
    folder = Path(gd.__file__).parent / "files"
    files = {spec.file: spec.sha256 for spec in REGISTRY.values() if spec.file}
    assert {p.name for p in folder.glob("*.npz")} == set(files)
    for filename, sha in files.items():
        assert hashlib.sha256((folder / filename).read_bytes()).hexdigest() == sha, filename
    assert sum(p.stat().st_size for p in folder.glob("*.npz")) < 12 * 2**20
    sources = (Path(gd.__file__).parent / "SOURCES.md").read_text()
    for name in REGISTRY:
        assert f"| {name} |" in sources, name


def test_loading_never_touches_the_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    raw_mod.read_npz.cache_clear()  # make the loads below read their files again
    for name in ["boston", "letter", "mnist", "fashion_mnist", "two_moons", "waveform"]:
        assert gd.load(name, seed=7).n == EXPECTED[name][0]


# ------------------------------------------------------------- integrity of the files


def test_sha256sums_lists_every_vendored_file_and_the_build_script_rewrites_it(
    tmp_path: Path,
) -> None:
    folder = raw_mod.FILES_DIR
    sums = raw_mod.recorded_sha256()
    assert set(sums) == {p.name for p in folder.glob("*.npz")}
    assert all(REGISTRY[n].sha256 == sums[REGISTRY[n].file] for n in REGISTRY if REGISTRY[n].file)
    spec = importlib.util.spec_from_file_location(
        "build_datasets", Path(__file__).parents[1] / "scripts" / "build_datasets.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for name in ("iris.npz", "wine.npz"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    written = script.write_sums(tmp_path).read_text().splitlines()
    assert written == [f"{sums[n]}  {n}" for n in ("iris.npz", "wine.npz")]


def copy_of_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *names: str) -> Path:
    """A copy of the vendored ``names`` in ``tmp_path``, which the loader now reads."""
    for name in names:
        (tmp_path / name).write_bytes((raw_mod.FILES_DIR / name).read_bytes())
    monkeypatch.setattr(raw_mod, "FILES_DIR", tmp_path)
    return tmp_path


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "missing"])
def test_corrupted_bundled_file_is_refused_naming_dataset_and_file(
    damage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = copy_of_files(tmp_path, monkeypatch, "iris.npz") / "iris.npz"
    assert gd.load("iris").n == 150  # the intact copy loads
    data = bytearray(path.read_bytes())
    if damage == "flip":  # one bit in the middle of the compressed x: np.load would not notice
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[: len(data) - 100]))
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        path.unlink()
    raw_mod.read_npz.cache_clear()
    what = "is missing" if damage == "missing" else "is corrupted or truncated"
    with pytest.raises(gd.CorruptDataError, match=rf"^iris: bundled file .*iris\.npz {what}"):
        gd.load("iris")
    with pytest.raises(ValueError, match="iris"):  # a ValueError for whoever catches those
        gd.load("iris", seed=3)


def test_each_file_is_hashed_once_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy_of_files(tmp_path, monkeypatch, "wine.npz")
    before = raw_mod._digest.cache_info()
    for seed in range(3):
        raw_mod.read_npz.cache_clear()  # even when the arrays are read again
        gd.load("wine", seed=seed)
    after = raw_mod._digest.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 2)


def write_npz_recorded(
    folder: Path, monkeypatch: pytest.MonkeyPatch, name: str, **arrays: np.ndarray
) -> None:
    """Write ``folder/name`` and record its digest, so that only the array checks can fail."""
    np.savez(folder / name, **arrays)
    sums = {**raw_mod.recorded_sha256(), name: raw_mod.sha256_of(folder / name)}
    monkeypatch.setattr(raw_mod, "recorded_sha256", lambda: sums)
    monkeypatch.setattr(raw_mod, "FILES_DIR", folder)
    raw_mod.read_npz.cache_clear()


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("x_nan", r"x: row 7 contains NaN"),
        ("x_inf", r"x: row 7 contains Inf"),
        ("label_high", r"y: row 7 has label 3, expected an integer in 0\.\.2 \(num_classes=3\)"),
        ("label_negative", r"y: row 7 has label -1, expected an integer in 0\.\.2"),
        ("label_fraction", r"y: row 7 has label 1\.5, expected an integer in 0\.\.2"),
    ],
)
def test_file_with_nan_features_or_labels_out_of_range_is_refused(
    bad: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    iris = raw_mod.read_npz("iris.npz")
    x, y = np.array(iris.x), np.array(iris.y)
    if bad == "x_nan":
        x[7, 2] = np.nan
    elif bad == "x_inf":
        x[7, 0] = -np.inf
    elif bad == "label_fraction":
        y = y.astype(np.float32)
        y[7] = 1.5
    else:
        y = y.astype(np.int64)
        y[7] = 3 if bad == "label_high" else -1
    write_npz_recorded(
        tmp_path, monkeypatch, "iris.npz", x=x, y=y, label_names=np.asarray(iris.label_names)
    )
    with pytest.raises(gd.CorruptDataError, match=rf"^iris: {message}.* \(file .*iris\.npz\)"):
        gd.load("iris")


def test_regression_targets_and_generated_data_are_checked_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    yacht = raw_mod.read_npz("yacht.npz")
    y = np.array(yacht.y)
    y[300] = np.inf
    write_npz_recorded(tmp_path, monkeypatch, "yacht.npz", x=np.array(yacht.x), y=y)
    with pytest.raises(gd.CorruptDataError, match=r"^yacht: y: row 300 contains Inf \(file "):
        gd.load("yacht")

    spec = REGISTRY["two_moons"]
    good = spec.reader

    def wrong_labels(seed: int) -> raw_mod.RawData:
        data = good(seed)
        return raw_mod.RawData(data.x, np.where(np.arange(len(data.y)) == 4, 2, data.y))

    monkeypatch.setitem(REGISTRY, "two_moons", dataclasses.replace(spec, reader=wrong_labels))
    with pytest.raises(gd.CorruptDataError, match=r"^two_moons: y: row 4 has label 2.*reader"):
        gd.load("two_moons")


# ------------------------------------------------------------------ fashion_mnist_full


def test_fashion_full_absent_gives_apt_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(raw_mod.FASHION_MNIST_ENV, str(tmp_path))
    assert not gd.is_available("fashion_mnist_full")
    assert "fashion_mnist_full" in gd.list()
    assert "fashion_mnist_full" not in gd.list(available_only=True)
    with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        gd.load("fashion_mnist_full")


def write_idx(path: Path, array: np.ndarray, header: int) -> None:
    with gzip.open(path, "wb") as fh:
        fh.write(bytes(header) + array.astype(np.uint8).tobytes())


def test_fashion_full_reader_on_tiny_idx_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 6), ("t10k", 3)):
        write_idx(
            tmp_path / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)), 16
        )
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10, 8)
    monkeypatch.setenv(raw_mod.FASHION_MNIST_ENV, str(tmp_path))
    assert gd.is_available("fashion_mnist_full")
    data = raw_mod.read_fashion_mnist_full()
    assert data.x.shape == (9, 28, 28) and data.is_test.tolist() == [False] * 6 + [True] * 3
    assert data.y.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    with pytest.raises(RuntimeError, match="n=70000"):
        gd.load("fashion_mnist_full")  # a tiny copy is not the real data set


def test_fashion_full_loads_when_installed_or_says_how_to_install() -> None:
    if not raw_mod.fashion_mnist_installed():
        with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
            gd.load("fashion_mnist_full")
        return
    ds = gd.load("fashion_mnist_full", flatten=True)
    assert (ds.n, ds.d, ds.num_classes) == EXPECTED["fashion_mnist_full"]
    assert ds.sizes == (50000, 10000, 10000) and ds.x_train.shape == (50000, 784)
    check_stratified(ds)


def test_missing_sums_file_refuses_every_vendored_file_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(raw_mod, "SUMS_FILE", tmp_path / "SHA256SUMS")
    raw_mod.recorded_sha256.cache_clear()
    raw_mod.read_npz.cache_clear()
    try:
        assert raw_mod.recorded_sha256() == {}
        missing = r"^glass: no SHA-256 recorded for glass\.npz .*\(the file is missing\)"
        with pytest.raises(gd.CorruptDataError, match=missing):
            gd.load("glass")
        assert gd.load("two_moons").n == 1000  # generated data need no file
    finally:
        raw_mod.recorded_sha256.cache_clear()
        raw_mod.read_npz.cache_clear()


def test_registry_is_read_from_its_data_table(tmp_path: Path) -> None:
    """The specifications are the records of ``registry.json``: one per data set, in order, and
    a record added to the table is a new data set (shared protocols by name, readers by
    ``module.function``); a record naming an unknown protocol or reader is refused naming the
    data set."""
    import json

    from gaussify.data import registry as reg

    table = json.loads(reg._TABLE.read_text())
    assert [r["name"] for r in table["datasets"]] == list(REGISTRY)
    record = {
        "name": "moons_copy",
        "task": "classification",
        "n": 1000,
        "d": 2,
        "num_classes": 2,
        "protocol": "immer_uci",
        "source": "s",
        "original": "o",
        "licence": "l",
        "description": "d",
        "reader": "synthetic.two_moons",
        "data_seed": 0,
    }
    table["datasets"].append(record)
    path = tmp_path / "registry.json"
    path.write_text(json.dumps(table))
    specs = reg._load_table(path)
    assert [s.name for s in specs[:-1]] == list(REGISTRY)
    assert specs[:-1] == tuple(REGISTRY.values())
    new = specs[-1]
    assert new.protocol is not None and new.protocol == REGISTRY["ionosphere"].protocol
    assert new.reader is REGISTRY["two_moons"].reader and new.sha256 is None
    for key, value, message in [
        ("protocol", "nope", "unknown protocol 'nope'"),
        ("reader", "synthetic.nope", "'synthetic.nope' is not a function"),
    ]:
        path.write_text(json.dumps({**table, "datasets": [{**record, key: value}]}))
        with pytest.raises(ValueError, match=f"data set 'moons_copy': {message}"):
            reg._load_table(path)
