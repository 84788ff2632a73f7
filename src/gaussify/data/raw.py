"""Raw arrays of a dataset, before any split or standardisation, read from local files only.

Three places data can come from, none of them the network:

- ``files/<name>.npz`` shipped inside the package (built by ``scripts/build_datasets.py``);
- a generator in :mod:`gaussify.data.synthetic`;
- files an installed system package put on disk (the full Fashion-MNIST from Debian's
  ``dataset-fashion-mnist``), read where they are and never fetched.
"""

from __future__ import annotations

import gzip
import os
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import NamedTuple

import numpy as np

__all__ = [
    "FASHION_MNIST_APT",
    "FASHION_MNIST_ENV",
    "RawData",
    "fashion_mnist_dir",
    "fashion_mnist_installed",
    "read_fashion_mnist_full",
    "read_idx",
    "read_npz",
]

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


@lru_cache(maxsize=8)
def read_npz(filename: str) -> RawData:
    """Read a vendored ``files/<filename>`` (keys ``x``, ``y``, optional ``label_names``,
    ``is_test``) without unpickling anything."""
    ref = resources.files("gaussify.data").joinpath("files", filename)
    with resources.as_file(ref) as path, np.load(path, allow_pickle=False) as npz:
        names = tuple(str(s) for s in npz["label_names"]) if "label_names" in npz else None
        is_test = _frozen(npz["is_test"].astype(bool)) if "is_test" in npz else None
        return RawData(_frozen(npz["x"]), _frozen(npz["y"]), names, is_test)


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
