"""Downsampled ImageNet 64x64 as 12,288-token sequences (64 x 64 x 3 sub-pixels, 256 levels).

Reads the official release (Chrabaszcz, Loshchilov & Hutter 2017) from ``<data_dir>/imagenet64/``:
``train_data_batch_1 .. train_data_batch_10`` and ``val_data``, each either ``.npz`` (the npz edition)
or without suffix (the pickle edition), holding ``data`` (N, 12288) uint8 with the R, G and B planes
one after another, ``labels`` (1-based, unused here) and, in train batches, ``mean``.
There is no automatic download: the release needs an image-net.org login.

Splits (fixed): train = all train batches except the last ``val_size`` (10,000) images of the last
batch; val = those held-out images; test = ``val_data``, the official 50,000-image validation set,
which is what the density-estimation literature reports as "test" bits/dim.

Memory: the train set is 15.7 GB as uint8 (126 GB as int64 tokens), so the release files are
converted once (``prepare_data``, one batch at a time) into raw HWC uint8 files under
``imagenet64/cache/`` that every process memory-maps; tokens are cast to int64 per example.
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from longseq.data.images import ImageDensityDataModule
from longseq.data.validation import check_file_not_empty
from longseq.utils.errors import ConfigError, DataError

RELEASE_PAGE = "https://image-net.org/download-images.php (Downsampled ImageNet, 64x64; login required)"
SIDE = 64
CONVERT_CHUNK = 8_192  # rows converted at a time, bounds the temporary HWC copy to ~100 MB


def find_release_file(folder: Path, stem: str) -> Path | None:
    """The release file ``stem.npz`` or ``stem`` (pickle edition) in ``folder``, or None."""
    for candidate in (folder / f"{stem}.npz", folder / stem):
        if candidate.is_file():
            return candidate
    return None


def read_release_rows(path: Path) -> np.ndarray:
    """(N, 12288) uint8 planar rows from one release file, npz or pickle (detected by content)."""
    check_file_not_empty(path, "ImageNet 64x64 release file")
    with open(path, "rb") as f:
        is_zip = f.read(2) == b"PK"
    try:
        if is_zip:
            with np.load(path) as archive:
                rows = archive["data"]
        else:
            with open(path, "rb") as f:
                rows = pickle.load(f, encoding="latin1")["data"]  # trusted local release file
    except (EOFError, OSError, ValueError, KeyError, TypeError, pickle.UnpicklingError, zipfile.BadZipFile) as err:
        raise DataError(path, f"cannot be read as an ImageNet 64x64 batch with a 'data' array ({type(err).__name__}: "
                              f"{err}): replace it with the release file") from None
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[1] != 3 * SIDE * SIDE:
        raise DataError(path, f"expected 'data' of shape (N, {3 * SIDE * SIDE}), got {rows.shape}")
    return rows.astype(np.uint8, copy=False)


def planar_rows_to_hwc(rows: np.ndarray, side: int = SIDE) -> np.ndarray:
    """(N, 3*side*side) rows with R, G, B planes -> (N, side, side, 3) HWC view (no copy)."""
    return rows.reshape(len(rows), 3, side, side).transpose(0, 2, 3, 1)


class ImageTokenDataset(Dataset):
    """Tokens from a raw (N, H, W, C) uint8 file, memory-mapped lazily in each process.

    ``dataset[i]`` is ``(tokens,)`` with tokens a (H*W*C,) LongTensor in channel-interleaved raster
    order, the same item layout as the base class's ``TensorDataset``. Only the path travels to
    DataLoader workers, never the array.
    """

    def __init__(self, path: Path, count: int, image_shape: tuple[int, int, int]) -> None:
        self.path, self.count, self.image_shape = Path(path), count, tuple(image_shape)
        self._images: np.ndarray | None = None

    @property
    def images(self) -> np.ndarray:
        if self._images is None:
            shape = (self.count, *self.image_shape)
            self._images = np.memmap(self.path, dtype=np.uint8, mode="r", shape=shape)
        return self._images

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        return (torch.from_numpy(self.images[index].reshape(-1).astype(np.int64)),)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_images": None}


class ImageNet64DataModule(ImageDensityDataModule):
    """Downsampled ImageNet 64x64 as channel-interleaved raster sequences of length 12,288.

    Args (beyond ``ImageDensityDataModule``'s):
        train_batches: how many ``train_data_batch_*`` files to use (the release has 10; fewer
            gives a partial train set, e.g. 1 for a quick run). All of them must be present.
        val_size: images at the end of the last train batch held out as validation.
        limit: optional cap on the number of images per split (smoke runs); ``None`` keeps all.
    """

    image_shape = (SIDE, SIDE, 3)
    num_levels = 256

    def __init__(
        self,
        *args,
        train_batches: int = 10,
        val_size: int = 10_000,
        limit: int | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.train_batches = train_batches
        self.val_size = val_size
        self.limit = limit

    @property
    def root(self) -> Path:
        return self.data_dir / "imagenet64"

    @property
    def cache_dir(self) -> Path:
        return self.root / "cache"

    def release_files(self) -> tuple[list[Path], Path]:
        """(train batch paths in order, test path); FileNotFoundError naming every missing file."""
        train_stems = [f"train_data_batch_{i}" for i in range(1, self.train_batches + 1)]
        found = {stem: find_release_file(self.root, stem) for stem in [*train_stems, "val_data"]}
        missing = [stem for stem, path in found.items() if path is None]
        if missing:
            names = ", ".join(f"{stem}.npz" for stem in missing)
            raise FileNotFoundError(
                f"ImageNet 64x64 files missing in {self.root}/: {names} (the pickle edition without the .npz "
                f"suffix is read too). Download the 64x64 train and val archives from {RELEASE_PAGE} and "
                f"unzip them into {self.root}/, or set task.data.data_dir to a folder that has imagenet64/."
            )
        return [found[stem] for stem in train_stems], found["val_data"]

    def _signature(self, train_paths: list[Path], test_path: Path) -> dict:
        """What the cache was built from; a mismatch (new files, other val_size) rebuilds it."""
        stat = lambda p: [p.name, p.stat().st_size, p.stat().st_mtime_ns]  # noqa: E731
        return {"sources": [stat(p) for p in [*train_paths, test_path]], "val_size": self.val_size}

    def _read_manifest(self) -> dict | None:
        path = self.cache_dir / "manifest.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def check_data(self) -> None:
        """The release files are on disk (``FileNotFoundError`` naming every missing one); the cache is built later,
        by ``prepare_data``."""
        self.release_files()

    def prepare_data(self) -> None:
        """Convert the release files into the memory-mappable HWC cache (once; rank 0 under Lightning)."""
        self._ensure_cache()

    def _ensure_cache(self) -> dict:
        train_paths, test_path = self.release_files()
        signature = self._signature(train_paths, test_path)
        manifest = self._read_manifest()
        if manifest is not None and manifest["signature"] == signature:
            return manifest

        self.cache_dir.mkdir(parents=True, exist_ok=True)
        counts = {"train": 0, "val": 0, "test": 0}
        outputs = {split: open(self.cache_dir / f"{split}.u8.tmp", "wb") for split in counts}

        def write(split: str, rows: np.ndarray) -> None:
            for start in range(0, len(rows), CONVERT_CHUNK):
                chunk = planar_rows_to_hwc(rows[start : start + CONVERT_CHUNK])
                np.ascontiguousarray(chunk).tofile(outputs[split])
            counts[split] += len(rows)

        try:
            for i, path in enumerate(train_paths):
                rows = read_release_rows(path)  # one batch (~1.5 GB) in memory at a time
                if i == len(train_paths) - 1:
                    if not 1 <= self.val_size < len(rows):
                        raise ConfigError(
                            "task.data.val_size", f"{self.val_size} must be in [1, {len(rows) - 1}]: the "
                            f"validation images are the tail of {path.name} ({len(rows)} images)"
                        )
                    write("train", rows[: len(rows) - self.val_size])
                    write("val", rows[len(rows) - self.val_size :])
                else:
                    write("train", rows)
                del rows
            write("test", read_release_rows(test_path))
        finally:
            for f in outputs.values():
                f.close()
        for split in counts:
            os.replace(self.cache_dir / f"{split}.u8.tmp", self.cache_dir / f"{split}.u8")
        manifest = {"signature": signature, "counts": counts}
        (self.cache_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
        return manifest

    def _split_dataset(self, split: str) -> ImageTokenDataset:
        count = self._ensure_cache()["counts"][split]
        if self.limit is not None:
            count = min(count, self.limit)  # the file is row-major, so a prefix is just a shorter map
        return ImageTokenDataset(self.cache_dir / f"{split}.u8", count, self.image_shape)

    def load_split(self, split: str) -> np.ndarray:
        """(N, 64, 64, 3) uint8 memory map of one split (read-only; nothing is loaded up front)."""
        return self._split_dataset(split).images

    def setup(self, stage: str | None = None) -> None:
        # Fill the datasets with memory-mapped token views before the base class would turn whole
        # splits into int64 tensors; it then only derives the per-device batch sizes.
        for split in self.splits:
            if split not in self.datasets:
                self.datasets[split] = self._split_dataset(split)
        super().setup(stage)
