"""Image-density datasets: images as sequences of sub-pixel tokens in raster order.

An image ``(H, W, C)`` becomes ``H * W * C`` tokens, channel-interleaved (``r, g, b`` of pixel 0,
then pixel 1, ...), each an integer level in ``[0, num_levels)``. Every datamodule here yields
``LongTensor`` batches of shape ``(B, L)``.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import TensorDataset

from longseq.data.batching import SplitLoaders, device_batches
from longseq.utils.errors import DataError


def images_to_tokens(images: np.ndarray) -> torch.Tensor:
    """(N, H, W, C) integer images -> (N, H*W*C) long tokens, channel-interleaved raster order."""
    if images.ndim != 4:
        raise ValueError(f"expected images of shape (N, H, W, C), got {images.shape}")
    return torch.from_numpy(np.ascontiguousarray(images).reshape(len(images), -1).astype(np.int64))


def tokens_to_images(tokens: torch.Tensor, image_shape: tuple[int, int, int]) -> torch.Tensor:
    """(N, L) tokens -> (N, H, W, C); inverse of ``images_to_tokens``."""
    return tokens.reshape(tokens.shape[0], *image_shape)


class ImageDensityDataModule(SplitLoaders, L.LightningDataModule):
    """Base class: subclasses implement ``load_split(split) -> (N, H, W, C) uint8/int array``.

    Args:
        data_dir: root data folder (``paths.data_dir``); each dataset uses a subfolder.
        batch_size: GLOBAL batch size; divided by world size (and accumulation) in ``setup``.
        accumulate_grad_batches: the trainer's accumulation, used to derive the per-device batch.
        num_workers: DataLoader workers.
        seed: seed of any split the datamodule draws itself.
        eval_batch_size: global batch size for validation/test (defaults to ``batch_size``).
    """

    image_shape: tuple[int, int, int] = (0, 0, 0)
    num_levels: int = 256
    splits = ("train", "val", "test")

    def __init__(
        self,
        data_dir: str = "data",
        batch_size: int = 64,
        accumulate_grad_batches: int = 1,
        num_workers: int = 0,
        seed: int = 0,
        eval_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        self.data_dir = Path(data_dir)
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.accumulate_grad_batches = accumulate_grad_batches
        self.num_workers = num_workers
        self.seed = seed
        self.datasets: dict[str, TensorDataset] = {}

    @property
    def seq_len(self) -> int:
        h, w, c = self.image_shape
        return h * w * c

    def load_split(self, split: str) -> np.ndarray:
        raise NotImplementedError

    def prepare_data(self) -> None:
        """Download (rank 0 only) when the dataset supports it; default: nothing to do."""

    def setup(self, stage: str | None = None) -> None:
        self.world_size, _, self.device_batch, self.device_eval_batch = device_batches(
            self.trainer, self.batch_size, self.eval_batch_size, self.accumulate_grad_batches
        )
        for split in self.splits:
            if split not in self.datasets:
                images = self.load_split(split)
                if images.shape[1:] != tuple(self.image_shape):
                    raise DataError(self.split_source(split), f"the {split} split has images of shape "
                                                              f"{images.shape[1:]}, expected {tuple(self.image_shape)}")
                self.datasets[split] = TensorDataset(images_to_tokens(images))


class DigitsDataModule(ImageDensityDataModule):
    """The 8x8 handwritten digits shipped inside scikit-learn (1,797 images, 17 grey levels 0..16).

    No download: the embedded default task. Split 1,437 / 180 / 180 with a fixed seeded permutation.
    """

    image_shape = (8, 8, 1)
    num_levels = 17

    def split_source(self, split: str) -> str:
        return "sklearn.datasets.load_digits"

    def load_split(self, split: str) -> np.ndarray:
        from sklearn.datasets import load_digits

        images = load_digits().images.astype(np.uint8)  # (1797, 8, 8), values 0..16
        order = np.random.default_rng(self.seed).permutation(len(images))
        n_val = n_test = 180
        parts = {
            "test": order[:n_test],
            "val": order[n_test : n_test + n_val],
            "train": order[n_test + n_val :],
        }
        return images[parts[split]][..., None]
