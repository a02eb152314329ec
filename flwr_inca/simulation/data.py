"""MNIST for the simulator, the CLI and the Flower example (one implementation).

Sources, in order of preference:

1. a local directory with the four original MNIST IDX files (``*-idx?-ubyte.gz``), given as an
   argument or in the ``FLWR_INCA_MNIST_DIR`` environment variable;
2. MNIST from Hugging Face (``ylecun/mnist``) through ``flwr-datasets``' ``datasets`` dependency
   (needs ``pip install flwr-datasets`` and network);
3. scikit-learn's bundled 8x8 digits (offline fallback, announced on stderr).

Images are standardized with MNIST's mean and std (0.1307, 0.3081) and flattened to float32 rows.
"""

from __future__ import annotations

import gzip
import os
import struct
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

__all__ = ["Dataset", "MNIST_ENV", "load_mnist", "read_idx"]

MNIST_ENV = "FLWR_INCA_MNIST_DIR"
_IDX_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


@dataclass(frozen=True)
class Dataset:
    """A classification data set: standardized float32 features (N, features), int64 labels (N,)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    name: str

    @property
    def features(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def read_idx(path: Path) -> np.ndarray:
    """An MNIST IDX file (gzipped): labels (N,) int64 or images (N, rows * cols) uint8."""
    with gzip.open(path, "rb") as fh:
        data = fh.read()
    magic, count = struct.unpack_from(">II", data)
    if magic == 2049:
        return np.frombuffer(data, dtype=np.uint8, offset=8).astype(np.int64)
    if magic == 2051:
        rows, cols = struct.unpack_from(">II", data, 8)
        return np.frombuffer(data, dtype=np.uint8, offset=16).reshape(count, rows * cols)
    raise ValueError(f"{path}: not an MNIST IDX file (magic {magic})")


def _standardize(x: np.ndarray) -> np.ndarray:
    return ((x.astype(np.float32) / 255.0) - 0.1307) / 0.3081


def _from_idx(directory: Path) -> Dataset:
    files = {k: directory / f"{k}.gz" for k in _IDX_FILES}
    missing = [str(p) for p in files.values() if not p.exists()]
    if missing:
        raise FileNotFoundError(f"MNIST IDX files missing: {', '.join(missing)}")
    return Dataset(
        _standardize(read_idx(files["train-images-idx3-ubyte"])),
        read_idx(files["train-labels-idx1-ubyte"]),
        _standardize(read_idx(files["t10k-images-idx3-ubyte"])),
        read_idx(files["t10k-labels-idx1-ubyte"]),
        f"MNIST ({directory})",
    )


def _from_hub() -> Dataset:
    from datasets import load_dataset  # flwr-datasets' dependency; needs network

    ds = load_dataset("ylecun/mnist")

    def arrays(split):
        x = np.stack([np.asarray(im, dtype=np.uint8).reshape(-1) for im in split["image"]])
        return _standardize(x), np.asarray(split["label"], dtype=np.int64)

    xtr, ytr = arrays(ds["train"])
    xte, yte = arrays(ds["test"])
    return Dataset(xtr, ytr, xte, yte, "MNIST (Hugging Face ylecun/mnist)")


def _from_sklearn() -> Dataset:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = ((digits.data / 16.0) - 0.5).astype(np.float32) / 0.5
    y = digits.target.astype(np.int64)
    perm = np.random.default_rng(0).permutation(len(y))
    x, y = x[perm], y[perm]
    cut = int(0.8 * len(y))
    return Dataset(x[:cut], y[:cut], x[cut:], y[cut:], "scikit-learn digits (8x8)")


@lru_cache(maxsize=4)
def load_mnist(data_dir: str = "", *, who: str = "flwr-inca") -> Dataset:
    """MNIST (cached per process); see the module docstring for the order of sources.

    ``data_dir`` (or ``$FLWR_INCA_MNIST_DIR``) must hold the IDX files: a directory given but
    incomplete is an error, never a silent fallback. ``who`` prefixes the fallback notice.
    """
    directory = str(data_dir) if data_dir else os.environ.get(MNIST_ENV, "")
    if directory:
        return _from_idx(Path(directory))
    try:
        return _from_hub()
    except Exception as exc:  # offline, or flwr-datasets not installed
        print(
            f"[{who}] no MNIST directory given (data-dir / {MNIST_ENV}) and the Hugging Face "
            f"download failed ({type(exc).__name__}: {str(exc)[:120]}); falling back to "
            "scikit-learn's 8x8 digits",
            file=sys.stderr,
        )
        return _from_sklearn()
