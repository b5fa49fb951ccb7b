"""LRA Image: CIFAR-10 in greyscale, 1024 pixel tokens (0..255) in raster order, 10 classes.

The files and their reading are those of ``longseq.data.cifar10`` (torchvision's layout under
``<data_dir>/cifar10/``, md5-checked download, the same 45,000 / 5,000 / 10,000 split as LRA's
train[:90%] / train[90%:] / test). Greyscale = round(0.2989 R + 0.5870 G + 0.1140 B), the weights of
``tf.image.rgb_to_grayscale`` that LRA uses. Fixed length: no padding (LRA masks black pixels as padding
because its mask is ``token > 0``; that quirk is not reproduced).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from longseq.data.cifar10 import Cifar10DataModule
from longseq.data.lra.common import Examples, LraDataModule

GREY_WEIGHTS = np.array([0.2989, 0.5870, 0.1140])


def to_grey(images: np.ndarray) -> np.ndarray:
    """(N, H, W, 3) uint8 RGB -> (N, H, W) uint8 grey levels."""
    return np.clip(np.rint(images.astype(np.float64) @ GREY_WEIGHTS), 0, 255).astype(np.uint8)


class LraImageDataModule(LraDataModule):
    """CIFAR-10 greyscale as 1024-token sequences.

    Args (beyond ``LraDataModule``'s; ``root`` is unused, CIFAR-10 lives under ``data_dir``):
        data_dir: ``paths.data_dir``; the CIFAR-10 batches are read from ``<data_dir>/cifar10/``.
        download, verify_checksums, val_size: as for ``task=cifar10``.
    """

    num_classes = 10
    vocab_size = 256

    def __init__(self, *args, data_dir: str = "data", download: bool = True, verify_checksums: bool = True,
                 val_size: int = 5_000, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.data_dir = Path(data_dir)
        self.cifar = Cifar10DataModule(data_dir=str(data_dir), batch_size=1, download=download,
                                       verify_checksums=verify_checksums, val_size=val_size)

    def prepare_data(self) -> None:
        self.cifar.prepare_data()

    def check_data(self) -> None:
        """The CIFAR-10 batches are on disk (``task=cifar10``'s files; downloaded when allowed)."""
        self.cifar.check_data()

    def split_source(self, split: str) -> Path:
        return self.cifar.split_source(split)

    def load_split(self, split: str) -> Examples:
        images = self.cifar.load_split(split)  # (N, 32, 32, 3) uint8
        labels = self.cifar_labels(split)
        grey = to_grey(images).reshape(len(images), -1)
        return Examples([list(grey)], labels)

    def cifar_labels(self, split: str) -> np.ndarray:
        """Class ids aligned with ``Cifar10DataModule.load_split(split)`` (same reader, same cut)."""
        reader = self.cifar._reader(str(self.cifar.root), train=split != "test", download=False)
        labels = np.asarray(reader.targets, dtype=np.int64)
        if split != "test":
            n_train = len(labels) - self.cifar.val_size
            labels = labels[:n_train] if split == "train" else labels[n_train:]
        return labels
