"""scikit-learn's bundled 8x8 digits (1797 images) as torch tensors with a fixed train/calibration/test split."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class DigitsData:
    """Images are (N, 1, 8, 8) float32 scaled to [0, 1]; labels int64."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    def calib_batches(self, n_batches: int = 8, batch_size: int = 64):
        """Calibration batches drawn from the training split (never the test split)."""
        n = min(len(self.x_train), n_batches * batch_size)
        return [self.x_train[i : i + batch_size] for i in range(0, n, batch_size)]


@lru_cache(maxsize=1)
def load_digits_data(test_fraction: float = 0.25, seed: int = 0) -> DigitsData:
    """Load and split the digits; deterministic for a given seed. Needs scikit-learn (bundled data, no network)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the digits example needs scikit-learn: pip install scikit-learn") from e
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = round(len(x) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return DigitsData(x[train].contiguous(), y[train].contiguous(), x[test].contiguous(), y[test].contiguous())
