"""Offline, real classification data for the examples: nothing is downloaded at run time.

Two sources, both installed offline (README, "Quick start"):

* Fashion-MNIST from the Debian package ``dataset-fashion-mnist`` (60,000 train / 10,000 test
  images of 28x28, flattened to 784 features), read from its IDX gzip files with numpy only.
* scikit-learn's bundled ``digits`` (1,797 images of 8x8, 64 features) with a fixed 80/20 split.

Every loader returns ``(x_train, y_train, x_test, y_test)`` as numpy arrays: float32 features
standardised per feature with the *training* mean and standard deviation, int64 labels.
"""

from __future__ import annotations

import gzip
import struct
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_FILES = {
    "x_train": "train-images-idx3-ubyte.gz",
    "y_train": "train-labels-idx1-ubyte.gz",
    "x_test": "t10k-images-idx3-ubyte.gz",
    "y_test": "t10k-labels-idx1-ubyte.gz",
}
DATASET_CHOICES = ("auto", "fashion_mnist", "digits")


class Split(NamedTuple):
    """A standardised train/test split: float32 features ``[N, F]`` and int64 labels ``[N]``."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def read_idx(path: str | Path) -> np.ndarray:
    """Read one gzip-compressed IDX file (the MNIST container format) into a uint8 array.

    Args:
        path: the ``*.gz`` file; its header gives the number of dimensions and their sizes.
    """
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = struct.unpack(">" + "I" * ndim, raw[4 : 4 + 4 * ndim])
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def standardise(x_train: np.ndarray, x_test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scale both arrays per feature with the training mean and std; constant features get std 1.

    Args:
        x_train: training features ``[N, F]``; the statistics come from here only.
        x_test: test features ``[M, F]``, scaled with the training statistics.
    """
    x_train = x_train.astype(np.float64)
    mean = x_train.mean(axis=0)
    std = x_train.std(axis=0)
    std[std < 1e-8] = 1.0
    scale = lambda x: ((x - mean) / std).astype(np.float32)  # noqa: E731
    return scale(x_train), scale(x_test.astype(np.float64))


def fashion_mnist_available(root: str | Path = FASHION_MNIST_ROOT) -> bool:
    """True when all four Fashion-MNIST IDX files exist under ``root``.

    Args:
        root: the folder holding the IDX gzip files.
    """
    return all((Path(root) / name).is_file() for name in FASHION_MNIST_FILES.values())


def load_fashion_mnist(root: str | Path = FASHION_MNIST_ROOT) -> Split:
    """Load Fashion-MNIST as flattened, standardised ``[N, 784]`` float32 features.

    Args:
        root: the folder holding the four IDX gzip files of the Debian package.

    Raises:
        FileNotFoundError: when a file is missing, saying how to install the package.
    """
    root = Path(root)
    missing = [name for name in FASHION_MNIST_FILES.values() if not (root / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"Fashion-MNIST files {missing} not found in {root}: install them offline with "
            "`apt-get install dataset-fashion-mnist`, or use dataset='digits'."
        )
    arrays = {key: read_idx(root / name) for key, name in FASHION_MNIST_FILES.items()}
    x_train = arrays["x_train"].reshape(len(arrays["x_train"]), -1)
    x_test = arrays["x_test"].reshape(len(arrays["x_test"]), -1)
    x_train, x_test = standardise(x_train, x_test)
    return Split(x_train, arrays["y_train"].astype(np.int64), x_test, arrays["y_test"].astype(np.int64))


def load_digits_split(seed: int = 0, test_fraction: float = 0.2) -> Split:
    """Load scikit-learn's bundled digits with a fixed, stratified train/test split.

    Args:
        seed: seed of the split; the same seed always gives the same split.
        test_fraction: share of the 1,797 samples held out for testing (0.2 gives 80/20).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    x_train, x_test = standardise(x_train, x_test)
    return Split(x_train, y_train.astype(np.int64), x_test, y_test.astype(np.int64))


def resolve_dataset(dataset: str, root: str | Path = FASHION_MNIST_ROOT) -> str:
    """Turn ``"auto"`` into ``"fashion_mnist"`` when its files exist, else ``"digits"``.

    Args:
        dataset: one of ``"auto"``, ``"fashion_mnist"``, ``"digits"``.
        root: where to look for the Fashion-MNIST files.
    """
    if dataset not in DATASET_CHOICES:
        raise ValueError(f"dataset={dataset!r} is unknown: choose one of {', '.join(DATASET_CHOICES)}.")
    if dataset == "auto":
        return "fashion_mnist" if fashion_mnist_available(root) else "digits"
    return dataset


class ClassificationDataModule(L.LightningDataModule):
    """Fashion-MNIST or digits as a LightningDataModule; validation and test use the test split.

    The arrays are loaded lazily on first use, so ``num_features``, ``num_classes`` and ``name``
    are available right after construction (the model needs ``num_features`` before ``fit``).

    Args:
        dataset: ``"auto"`` (Fashion-MNIST when its files exist, else digits),
            ``"fashion_mnist"`` or ``"digits"``.
        batch_size: samples per batch for every dataloader.
        limit_train: keep only the first ``limit_train`` training samples (quick runs);
            ``None`` keeps all of them.
        num_workers: DataLoader worker processes; 0 loads in the main process.
        seed: seed of the digits train/test split (Fashion-MNIST has a fixed split).
        root: folder of the Fashion-MNIST IDX files.
    """

    def __init__(
        self,
        dataset: str = "auto",
        batch_size: int = 128,
        limit_train: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        root: str = FASHION_MNIST_ROOT,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1.")
        if limit_train is not None and limit_train < 1:
            raise ValueError(f"limit_train={limit_train} must be at least 1, or None for all samples.")
        self.name = resolve_dataset(dataset, root)
        self.batch_size = batch_size
        self.limit_train = limit_train
        self.num_workers = num_workers
        self.seed = seed
        self.root = root
        self.train_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None

    @cached_property
    def split(self) -> Split:
        """The standardised arrays, loaded on first access and cut to ``limit_train``."""
        data = load_fashion_mnist(self.root) if self.name == "fashion_mnist" else load_digits_split(self.seed)
        if self.limit_train is not None:
            data = data._replace(x_train=data.x_train[: self.limit_train], y_train=data.y_train[: self.limit_train])
        return data

    @property
    def num_features(self) -> int:
        """Features per sample: 784 for Fashion-MNIST, 64 for digits."""
        return int(self.split.x_train.shape[1])

    @property
    def num_classes(self) -> int:
        """Number of classes (10 for both datasets)."""
        return int(max(self.split.y_train.max(), self.split.y_test.max()) + 1)

    @property
    def num_train(self) -> int:
        """Training samples after ``limit_train``."""
        return len(self.split.y_train)

    @property
    def num_test(self) -> int:
        """Test samples (used for validation and test)."""
        return len(self.split.y_test)

    def setup(self, stage: str | None = None) -> None:
        """Wrap the arrays as TensorDatasets.

        Args:
            stage: Lightning's stage name (``"fit"``, ``"validate"``, ...); every stage gets both sets.
        """
        if self.train_set is None:
            data = self.split
            self.train_set = TensorDataset(torch.from_numpy(data.x_train), torch.from_numpy(data.y_train))
            self.test_set = TensorDataset(torch.from_numpy(data.x_test), torch.from_numpy(data.y_test))

    def _loader(self, dataset: TensorDataset | None, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("Call setup() before asking for a dataloader.")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            drop_last=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches; the last batch may be smaller."""
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Test split, in order."""
        return self._loader(self.test_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """Test split, in order."""
        return self._loader(self.test_set, shuffle=False)
