"""Image-density datamodules read tiny fixtures written in each dataset's real on-disk format.

Every fixture pixel is known, so the tests check the exact token layout: the token at position
``(row * W + col) * 3 + channel`` of image ``n`` is that image's pixel value.
"""

from __future__ import annotations

import pickle
import socket
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from dataset_files import write_cifar10_fixture, write_imagenet64_fixture

from longseq.data import imagenet64 as imagenet64_module
from longseq.data.cifar10 import Cifar10DataModule
from longseq.data.imagenet64 import ImageNet64DataModule, ImageTokenDataset
from longseq.data.images import DigitsDataModule


def assert_tokens_are_images(tokens: torch.Tensor, images: np.ndarray) -> None:
    """Tokens (N, H*W*3) are the images (N, H, W, 3) in channel-interleaved raster order."""
    n, h, w, c = images.shape
    assert tokens.shape == (n, h * w * c) and tokens.dtype == torch.long
    for image, row, col, channel in [(0, 0, 0, 0), (0, 0, 1, 2), (n - 1, h - 1, 0, 1), (n // 2, 3, w - 2, 2)]:
        assert tokens[image, (row * w + col) * c + channel] == images[image, row, col, channel]
    assert torch.equal(tokens, torch.from_numpy(images.reshape(n, -1).astype(np.int64)))


def first_batch(loader) -> torch.Tensor:
    (tokens,) = next(iter(loader))
    return tokens


# ---------------------------------------------------------------- CIFAR-10 (torchvision pickle batches)


def test_cifar10_reads_torchvision_batches(tmp_path):
    train, test = write_cifar10_fixture(tmp_path)
    dm = Cifar10DataModule(
        data_dir=str(tmp_path), batch_size=4, eval_batch_size=5, val_size=5, verify_checksums=False,
        download=False,
    )
    dm.prepare_data()
    dm.setup("fit")

    assert dm.seq_len == 3072 and dm.num_levels == 256
    assert {s: len(d) for s, d in dm.datasets.items()} == {"train": 15, "val": 5, "test": 6}
    # val is the tail of the training batches (last images of data_batch_5), train the rest in order
    assert_tokens_are_images(dm.datasets["train"].tensors[0], train[:15])
    assert_tokens_are_images(first_batch(dm.val_dataloader()), train[15:])
    assert_tokens_are_images(first_batch(dm.test_dataloader()), test[:5])

    tokens = first_batch(dm.train_dataloader())
    assert tokens.shape == (4, 3072) and tokens.dtype == torch.long
    assert 0 <= tokens.min() and tokens.max() < 256


def test_cifar10_limit_caps_every_split(tmp_path):
    write_cifar10_fixture(tmp_path)
    dm = Cifar10DataModule(data_dir=str(tmp_path), val_size=5, limit=3, verify_checksums=False, download=False)
    dm.setup()
    assert {s: len(d) for s, d in dm.datasets.items()} == {"train": 3, "val": 3, "test": 3}


def test_cifar10_checksums_reject_files_that_differ_from_the_release(tmp_path):
    write_cifar10_fixture(tmp_path)
    dm = Cifar10DataModule(data_dir=str(tmp_path), download=False)  # verify_checksums=True by default
    with pytest.raises(FileNotFoundError, match="md5"):
        dm.setup()


def test_cifar10_offline_download_fails_fast_naming_file_and_folder(tmp_path, monkeypatch):
    seen_timeouts = []

    def offline_download(url, download_root, filename=None, md5=None, **kwargs):
        seen_timeouts.append(socket.getdefaulttimeout())
        raise urllib.error.URLError(OSError("Temporary failure in name resolution"))

    monkeypatch.setattr("torchvision.datasets.cifar.download_and_extract_archive", offline_download)
    before = socket.getdefaulttimeout()
    dm = Cifar10DataModule(data_dir=str(tmp_path / "data"))
    with pytest.raises(FileNotFoundError) as info:
        dm.prepare_data()

    message = str(info.value)
    assert str(tmp_path / "data" / "cifar10" / "cifar-10-batches-py") in message
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in message
    assert f"extract it into {tmp_path / 'data' / 'cifar10'}/" in message
    assert "URLError" in message
    assert seen_timeouts == [10.0]  # urllib ran under the short timeout ...
    assert socket.getdefaulttimeout() == before  # ... and the global default was restored


def test_cifar10_without_download_names_the_archive(tmp_path):
    dm = Cifar10DataModule(data_dir=str(tmp_path), download=False)
    with pytest.raises(FileNotFoundError, match="cifar-10-python.tar.gz"):
        dm.setup()


# ---------------------------------------------------------------- ImageNet 64x64 (npz / pickle batches)


def imagenet64(data_dir: Path, **kwargs) -> ImageNet64DataModule:
    return ImageNet64DataModule(data_dir=str(data_dir), batch_size=2, train_batches=2, val_size=2, **kwargs)


def test_imagenet64_reads_npz_and_pickle_batches(tmp_path):
    train, test = write_imagenet64_fixture(tmp_path)
    dm = imagenet64(tmp_path)
    dm.prepare_data()
    dm.setup("fit")

    assert dm.seq_len == 12288 and dm.num_levels == 256
    assert {s: len(d) for s, d in dm.datasets.items()} == {"train": 9, "val": 2, "test": 4}
    def everything(split: str) -> torch.Tensor:
        return torch.stack([dm.datasets[split][i][0] for i in range(len(dm.datasets[split]))])

    # val is the tail of the last train batch; train is batch 1 then the head of batch 2
    assert_tokens_are_images(everything("train"), train[:9])
    assert_tokens_are_images(first_batch(dm.val_dataloader()), train[9:])
    assert_tokens_are_images(everything("test"), test)
    assert_tokens_are_images(first_batch(dm.test_dataloader()), test[:2])

    tokens = first_batch(dm.train_dataloader())
    assert tokens.shape == (2, 12288) and tokens.dtype == torch.long
    assert 0 <= tokens.min() and tokens.max() < 256
    assert dm.load_split("test").shape == (4, 64, 64, 3)


def test_imagenet64_cache_is_built_once_and_memory_mapped(tmp_path, monkeypatch):
    write_imagenet64_fixture(tmp_path)
    imagenet64(tmp_path).prepare_data()

    def must_not_reread(path):
        raise AssertionError(f"release file {path} re-read although the cache is current")

    monkeypatch.setattr(imagenet64_module, "read_release_rows", must_not_reread)
    dm = imagenet64(tmp_path, limit=3)
    dm.setup()
    assert {s: len(d) for s, d in dm.datasets.items()} == {"train": 3, "val": 2, "test": 3}
    assert isinstance(dm.load_split("train"), np.memmap)
    # workers receive the path, not the array
    clone = pickle.loads(pickle.dumps(dm.datasets["train"]))
    assert isinstance(clone, ImageTokenDataset) and clone._images is None
    assert torch.equal(clone[1][0], dm.datasets["train"][1][0])

    monkeypatch.undo()  # a different held-out size invalidates the cache and rebuilds it
    rebuilt = imagenet64(tmp_path)
    rebuilt.val_size = 3
    rebuilt.setup()
    assert {s: len(d) for s, d in rebuilt.datasets.items()} == {"train": 8, "val": 3, "test": 4}


def test_imagenet64_missing_files_are_named(tmp_path):
    write_imagenet64_fixture(tmp_path)
    (tmp_path / "imagenet64" / "val_data.npz").unlink()
    dm = ImageNet64DataModule(data_dir=str(tmp_path), train_batches=3)
    with pytest.raises(FileNotFoundError) as info:
        dm.prepare_data()
    message = str(info.value)
    assert f"in {tmp_path / 'imagenet64'}/" in message
    assert "train_data_batch_3.npz, val_data.npz" in message
    assert "train_data_batch_1" not in message and "train_data_batch_2.npz" not in message


# ---------------------------------------------------------------- digits (embedded in scikit-learn)


def test_digits_splits_are_fixed_disjoint_and_17_levels():
    dm = DigitsDataModule(batch_size=8)
    dm.setup()
    sizes = {s: len(d) for s, d in dm.datasets.items()}
    assert sizes == {"train": 1437, "val": 180, "test": 180}
    assert dm.num_levels == 17 and dm.seq_len == 64
    rows = {s: d.tensors[0] for s, d in dm.datasets.items()}
    assert all(r.dtype == torch.long and r.min() >= 0 and r.max() <= 16 for r in rows.values())
    # the 1,797 digit images are all distinct, so distinct rows over the union proves disjoint splits
    assert len(torch.unique(torch.cat(list(rows.values())), dim=0)) == 1797
    again = DigitsDataModule(batch_size=8)
    again.setup()
    assert torch.equal(again.datasets["val"].tensors[0], rows["val"])  # fixed split for a fixed seed
    assert first_batch(dm.train_dataloader()).shape == (8, 64)
