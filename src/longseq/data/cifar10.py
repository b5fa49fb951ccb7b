"""CIFAR-10 as 3,072-token sequences (32 x 32 x 3 sub-pixels, 256 levels) for density estimation.

Files live under ``<data_dir>/cifar10/`` in torchvision's layout (``cifar-10-batches-py/data_batch_1..5``,
``test_batch``, ``batches.meta``: Python pickles with ``b"data"`` of shape (N, 3072) uint8 in CHW planar
order). ``prepare_data`` downloads them through torchvision, which verifies the archive's and every
batch's md5; torchvision's reader also turns the planar rows into (N, 32, 32, 3) HWC images.

Splits (fixed, no randomness): train = the first 45,000 training images, val = the last 5,000
training images (the tail of ``data_batch_5``), test = ``test_batch`` (10,000).
"""

from __future__ import annotations

import pickle
import socket
from pathlib import Path

import numpy as np
from torchvision.datasets import CIFAR10
from torchvision.datasets.utils import check_integrity

from longseq.data.images import ImageDensityDataModule
from longseq.data.validation import check_file_not_empty
from longseq.utils.errors import ConfigError, DataError

CIFAR10_ARCHIVE_URL = CIFAR10.url
DOWNLOAD_TIMEOUT_S = 10.0


class _CIFAR10WithoutChecksums(CIFAR10):
    """torchvision's CIFAR-10 reader with the md5 comparison turned off (files must still exist).

    Only for local copies that are known to differ from the release bytes, e.g. the tiny test
    fixtures written in the real pickle format; selected by ``verify_checksums=False``.
    """

    train_list = [[name, None] for name, _ in CIFAR10.train_list]
    test_list = [[name, None] for name, _ in CIFAR10.test_list]
    meta = {**CIFAR10.meta, "md5": None}


class Cifar10DataModule(ImageDensityDataModule):
    """CIFAR-10 images as channel-interleaved raster sequences of length 3,072.

    Args (beyond ``ImageDensityDataModule``'s):
        download: let ``prepare_data`` fetch the archive when the batches are missing or corrupted.
        verify_checksums: compare the batch files with the release md5s (torchvision's list); turn
            off only for locally written copies such as test fixtures.
        val_size: number of images at the END of the training batches held out as validation.
        limit: optional cap on the number of images per split (smoke runs); ``None`` keeps all.
    """

    image_shape = (32, 32, 3)
    num_levels = 256

    def __init__(
        self,
        *args,
        download: bool = True,
        verify_checksums: bool = True,
        val_size: int = 5_000,
        limit: int | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.download = download
        self.verify_checksums = verify_checksums
        self.val_size = val_size
        self.limit = limit
        self._train_images: np.ndarray | None = None  # read once, shared by the train and val splits

    @property
    def root(self) -> Path:
        return self.data_dir / "cifar10"

    @property
    def _reader(self) -> type[CIFAR10]:
        return CIFAR10 if self.verify_checksums else _CIFAR10WithoutChecksums

    def _files_ok(self) -> bool:
        """All batch files and the metadata exist (and match the release md5s when verifying)."""
        reader, batches = self._reader, self.root / CIFAR10.base_folder
        expected = reader.train_list + reader.test_list + [[reader.meta["filename"], reader.meta["md5"]]]
        return all(check_integrity(batches / name, md5) for name, md5 in expected)

    def _missing_message(self, reason: str) -> str:
        batches = self.root / CIFAR10.base_folder
        return (
            f"CIFAR-10 not found under {batches} {reason}. Download {CIFAR10_ARCHIVE_URL} and extract it "
            f"into {self.root}/ (so that {batches / 'data_batch_1'} exists), or set task.data.data_dir "
            f"to a folder that has cifar10/{CIFAR10.base_folder}/."
        )

    def prepare_data(self) -> None:
        self.check_data()

    def check_data(self) -> None:
        """The batches are on disk: downloaded here (with the md5 check) when ``task.data.download`` allows, else a
        ``FileNotFoundError`` saying what to place where (the pre-flight calls this before the run directory
        exists)."""
        if self._files_ok():
            return
        if not self.download:
            reason = "(or its files differ from the release md5s) and download=False"
            raise FileNotFoundError(self._missing_message(reason))
        # Without a network urllib would hang for minutes; a short socket timeout makes it fail fast.
        previous_timeout = socket.getdefaulttimeout()
        socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._reader(str(self.root), train=True, download=True)
        except Exception as err:  # URLError, timeout, md5 mismatch after download: "place it by hand"
            # from None: the message carries the cause; a second traceback would add nothing.
            raise FileNotFoundError(
                self._missing_message(f"and could not be downloaded ({type(err).__name__}: {err})")
            ) from None
        finally:
            socket.setdefaulttimeout(previous_timeout)

    def split_source(self, split: str) -> Path:
        return self.root / CIFAR10.base_folder

    def _read(self, train: bool) -> np.ndarray:
        """(N, 32, 32, 3) uint8 HWC images of the training batches or the test batch."""
        self.prepare_data()
        reader = self._reader
        for name, _ in reader.train_list if train else reader.test_list:
            check_file_not_empty(self.split_source("train") / name, "CIFAR-10 batch")
        try:
            return reader(str(self.root), train=train, download=False).data
        except (EOFError, pickle.UnpicklingError, KeyError, ValueError) as err:  # a damaged pickle batch
            raise DataError(self.split_source("train"), f"the CIFAR-10 batches cannot be read ({type(err).__name__}: "
                                                        f"{err}); task.data.verify_checksums=true finds the damaged "
                                                        "file by its md5") from None

    def load_split(self, split: str) -> np.ndarray:
        if split == "test":
            images = self._read(train=False)
        else:
            if self._train_images is None:
                self._train_images = self._read(train=True)
            n_train = len(self._train_images) - self.val_size
            if n_train < 1 or self.val_size < 1:
                raise ConfigError(
                    "task.data.val_size", f"{self.val_size} must be in [1, {len(self._train_images) - 1}] "
                    f"(CIFAR-10 has {len(self._train_images)} training images)"
                )
            images = self._train_images[:n_train] if split == "train" else self._train_images[n_train:]
        return images[: self.limit] if self.limit is not None else images

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        self._train_images = None  # the token tensors now hold the data
