"""Raw arrays of a dataset, before any split or standardisation, read from local files only.

Three places data can come from, none of them the network:

- ``files/<name>.npz`` shipped inside the package (built by ``scripts/build_datasets.py``),
  each checked against its SHA-256 in ``files/SHA256SUMS`` before it is read (once per
  process and file): a corrupted or truncated file raises :class:`CorruptDataError`;
- a generator in :mod:`gaussify.data.synthetic`;
- files an installed system package put on disk (the full Fashion-MNIST from Debian's
  ``dataset-fashion-mnist``), read where they are and never fetched.
"""

from __future__ import annotations

import gzip
import hashlib
import os
from functools import cache, lru_cache
from importlib import resources
from pathlib import Path
from typing import NamedTuple

import numpy as np

__all__ = [
    "FASHION_MNIST_APT",
    "FASHION_MNIST_ENV",
    "FILES_DIR",
    "SUMS_FILE",
    "CorruptDataError",
    "RawData",
    "fashion_mnist_dir",
    "fashion_mnist_installed",
    "read_fashion_mnist_full",
    "read_idx",
    "read_npz",
    "recorded_sha256",
    "sha256_of",
    "verify_file",
]

#: where the vendored ``<name>.npz`` files are read from
FILES_DIR = Path(str(resources.files("gaussify.data").joinpath("files")))
#: the recorded digests of the vendored files, ``sha256sum`` format (``sha256sum -c`` checks it);
#: rewritten by ``python scripts/build_datasets.py --stage sums``
SUMS_FILE = Path(str(resources.files("gaussify.data").joinpath("files", "SHA256SUMS")))
REBUILD_HINT = "reinstall gaussify, or rebuild the file with scripts/build_datasets.py"

FASHION_MNIST_ENV = "GAUSSIFY_FASHION_MNIST_DIR"
FASHION_MNIST_DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_APT = "apt-get install -y dataset-fashion-mnist"
FASHION_MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
FASHION_MNIST_CLASSES = (
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
)


class CorruptDataError(ValueError, RuntimeError):
    """A bundled data file (or a generator's output) is not what the registry records: wrong
    SHA-256, wrong shape, non-finite values or labels outside ``0..num_classes-1``. The message
    names the data set and the file. A ``ValueError`` (and, as the shape check always was, a
    ``RuntimeError``)."""


class RawData(NamedTuple):
    """All rows of one dataset as stored.

    ``x`` is (N, d) float32 for tabular data or (N, 28, 28) uint8 for images; ``y`` is (N,)
    float32 (regression) or integer labels 0..C-1 (classification). ``is_test`` marks rows of
    an original test set; ``fixed_parts`` gives (train, val, test) row indices where the data
    set comes with a fixed split. Arrays are read-only (they may be shared through a cache).
    """

    x: np.ndarray
    y: np.ndarray
    label_names: tuple[str, ...] | None = None
    is_test: np.ndarray | None = None
    fixed_parts: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    a.flags.writeable = False
    return a


@lru_cache(maxsize=1)
def recorded_sha256() -> dict[str, str]:
    """``{filename: hex SHA-256}`` of every vendored file, read from :data:`SUMS_FILE` (empty
    when that file is missing: every read of a vendored file then fails, naming it)."""
    sums: dict[str, str] = {}
    if not SUMS_FILE.is_file():
        return sums
    for line in SUMS_FILE.read_text().splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            sums[name.lstrip("*")] = digest
    return sums


@cache
def _digest(path: str, size: int, mtime_ns: int) -> str:
    del size, mtime_ns  # part of the cache key only: a replaced file is hashed again
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256_of(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of the file at ``path``, computed once per process for each (path, size,
    modification time)."""
    stat = os.stat(path)
    return _digest(os.fspath(path), stat.st_size, stat.st_mtime_ns)


def verify_file(path: Path, dataset: str) -> None:
    """Raise :class:`CorruptDataError` naming ``dataset`` and ``path`` unless the file's
    SHA-256 equals the one recorded for its name in :data:`SUMS_FILE`."""
    expected = recorded_sha256().get(path.name)
    if expected is None:
        raise CorruptDataError(
            f"{dataset}: no SHA-256 recorded for {path.name} in {SUMS_FILE}"
            f"{'' if SUMS_FILE.is_file() else ' (the file is missing)'}; {REBUILD_HINT} "
            "(`python scripts/build_datasets.py --stage sums` records the files as they are)"
        )
    if not path.is_file():
        raise CorruptDataError(f"{dataset}: bundled file {path} is missing; {REBUILD_HINT}")
    actual = sha256_of(path)
    if actual != expected:
        raise CorruptDataError(
            f"{dataset}: bundled file {path} is corrupted or truncated "
            f"({path.stat().st_size} bytes, SHA-256 {actual[:12]}... but {expected[:12]}... "
            f"recorded); {REBUILD_HINT}"
        )


def read_npz(filename: str, dataset: str | None = None) -> RawData:
    """Read the vendored ``FILES_DIR/<filename>`` (keys ``x``, ``y``, optional
    ``label_names``, ``is_test``) without unpickling anything, after checking its SHA-256
    (:func:`verify_file`; errors name ``dataset``, default the file's stem). Cached per path."""
    return _read_npz_at(str(FILES_DIR / filename), dataset or Path(filename).stem)


@lru_cache(maxsize=8)
def _read_npz_at(path: str, dataset: str) -> RawData:
    verify_file(Path(path), dataset)
    with np.load(path, allow_pickle=False) as npz:
        names = tuple(str(s) for s in npz["label_names"]) if "label_names" in npz else None
        is_test = _frozen(npz["is_test"].astype(bool)) if "is_test" in npz else None
        return RawData(_frozen(npz["x"]), _frozen(npz["y"]), names, is_test)


read_npz.cache_clear = _read_npz_at.cache_clear  # type: ignore[attr-defined]


def read_idx(path: str | os.PathLike[str], offset: int) -> np.ndarray:
    """Read a gzipped IDX file as a flat uint8 array, skipping its ``offset``-byte header
    (16 for images, 8 for labels)."""
    with gzip.open(path) as fh:
        return np.frombuffer(fh.read(), dtype=np.uint8, offset=offset)


def fashion_mnist_dir() -> Path:
    """Where the full Fashion-MNIST is looked for: ``$GAUSSIFY_FASHION_MNIST_DIR`` if set
    (e.g. a ``dpkg-deb -x`` of the Debian package), else Debian's install location."""
    return Path(os.environ.get(FASHION_MNIST_ENV) or FASHION_MNIST_DEFAULT_DIR)


def fashion_mnist_installed() -> bool:
    """True when all four Fashion-MNIST IDX files are present in :func:`fashion_mnist_dir`."""
    root = fashion_mnist_dir()
    return all((root / f).is_file() for f in FASHION_MNIST_FILES)


def read_fashion_mnist_full(seed: int = 0) -> RawData:
    """The full Fashion-MNIST (60,000 train + 10,000 test, 28x28 uint8) from Debian's
    ``dataset-fashion-mnist`` files; ``seed`` is unused (the data are fixed).

    Raises ``FileNotFoundError`` naming the apt command when the files are not installed.
    """
    del seed
    root = fashion_mnist_dir()
    if not fashion_mnist_installed():
        raise FileNotFoundError(
            f"fashion_mnist_full: the Fashion-MNIST files are not in {root}. Install them with "
            f"`{FASHION_MNIST_APT}` (Debian/Ubuntu, 30 MB, MIT licence), or point "
            f"${FASHION_MNIST_ENV} at a folder holding {', '.join(FASHION_MNIST_FILES)}. "
            "The vendored subset `fashion_mnist` needs no install."
        )
    return _read_fashion_cached(str(root))


@lru_cache(maxsize=1)
def _read_fashion_cached(root: str) -> RawData:
    xs, ys = [], []
    for prefix in ("train", "t10k"):
        xs.append(read_idx(Path(root, f"{prefix}-images-idx3-ubyte.gz"), 16).reshape(-1, 28, 28))
        ys.append(read_idx(Path(root, f"{prefix}-labels-idx1-ubyte.gz"), 8))
    if xs[0].shape[0] != ys[0].shape[0] or xs[1].shape[0] != ys[1].shape[0]:
        raise ValueError(f"fashion_mnist_full: image and label files in {root} disagree in length")
    is_test = np.repeat([False, True], [len(ys[0]), len(ys[1])])
    return RawData(
        _frozen(np.concatenate(xs)),
        _frozen(np.concatenate(ys)),
        FASHION_MNIST_CLASSES,
        _frozen(is_test),
    )
