"""Tiny datasets written in each dataset's real on-disk format, shared by the data, task and training tests.

Every writer puts known content where the real loader expects the released files (CIFAR-10's torchvision
pickle batches, ImageNet 64x64's npz / pickle batches, the LRA TSVs and Pathfinder PNG + metadata folders, the
enwik8 / text8 zip archives, an IMDB ``save_to_disk`` copy), so the tests can check exact contents.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image


def random_images(n: int, side: int, seed: int) -> np.ndarray:
    """(n, side, side, 3) uint8 HWC images with every value distinct enough to catch a transpose."""
    return np.random.default_rng(seed).integers(0, 256, size=(n, side, side, 3), dtype=np.uint8)



def hwc_to_planar_rows(images: np.ndarray) -> np.ndarray:
    """(N, H, W, 3) -> (N, 3*H*W): R plane, G plane, B plane, as both releases store them."""
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2)).reshape(len(images), -1)



CIFAR_PER_BATCH, CIFAR_TEST = 4, 6  # 5 x 4 = 20 training images



def write_cifar10_fixture(data_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """cifar10/cifar-10-batches-py/ with data_batch_1..5, test_batch, batches.meta; returns (train, test)."""
    folder = data_dir / "cifar10" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    train, test = random_images(5 * CIFAR_PER_BATCH, 32, seed=1), random_images(CIFAR_TEST, 32, seed=2)

    def dump(name: str, images: np.ndarray, label: str) -> None:
        entry = {
            "batch_label": label,
            "labels": [i % 10 for i in range(len(images))],
            "data": hwc_to_planar_rows(images),
            "filenames": [f"img_{i}.png" for i in range(len(images))],
        }
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f, protocol=2)

    for b in range(5):
        images = train[b * CIFAR_PER_BATCH : (b + 1) * CIFAR_PER_BATCH]
        dump(f"data_batch_{b + 1}", images, f"training batch {b + 1} of 5")
    dump("test_batch", test, "testing batch 1 of 1")
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class_{i}" for i in range(10)], "num_vis": 3072}, f, protocol=2)
    return train, test



IMAGENET_BATCH_SIZES, IMAGENET_TEST = (5, 6), 4



def write_imagenet64_fixture(data_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """imagenet64/ with train_data_batch_1.npz, train_data_batch_2 (pickle edition, no suffix) and
    val_data.npz; returns (all train images in order, test images)."""
    folder = data_dir / "imagenet64"
    folder.mkdir(parents=True)
    batches = [random_images(n, 64, seed=10 + i) for i, n in enumerate(IMAGENET_BATCH_SIZES)]
    test = random_images(IMAGENET_TEST, 64, seed=20)

    def entry(images: np.ndarray, with_mean: bool) -> dict:
        rows = hwc_to_planar_rows(images)
        fields = {"data": rows, "labels": list(range(1, len(images) + 1))}  # labels are 1-based
        if with_mean:
            fields["mean"] = rows.mean(axis=0)
        return fields

    np.savez(folder / "train_data_batch_1.npz", **entry(batches[0], with_mean=True))
    with open(folder / "train_data_batch_2", "wb") as f:
        pickle.dump(entry(batches[1], with_mean=True), f)
    np.savez(folder / "val_data.npz", **entry(test, with_mean=False))
    return np.concatenate(batches), test



LISTOPS_ROWS = [  # (Source as released, Target)
    ("( ( ( [MIN 8 ) 6 ) ] )", 6),
    ("( ( ( ( [MIN 8 ) 2 ) ( ( ( [MIN 8 ) 6 ) ] ) ) ] )", 2),
    ("( ( ( ( ( [MED 1 ) 7 ) 4 ) 9 ) ] )", 5),  # sorted 1 4 7 9: mean of 4 and 7 = 5.5 -> 5
    ("( ( ( ( [SM 7 ) 8 ) 9 ) ] )", 4),  # 24 mod 10
    ("( ( ( [MAX 3 ) ( ( ( ( [MED 0 ) 2 ) 9 ) ] ) ) ] )", 3),  # MED(0, 2, 9) = 2
    ("( ( ( ( [SM ( ( ( [MAX 9 ) 1 ) ] ) ) 5 ) 0 ) ] )", 4),  # 9 + 5 + 0 = 14
    ("7", 7),
    ("( ( ( [MED 3 ) 4 ) ] )", 3),  # 3.5 -> 3
]



def write_listops_fixture(root: Path) -> None:
    folder = root / "listops-1000"
    folder.mkdir(parents=True)
    for split in ("train", "val", "test"):
        with open(folder / f"basic_{split}.tsv", "w", newline="") as f:
            f.write("Source\tTarget\n")
            for source, target in LISTOPS_ROWS:
                f.write(f"{source}\t{target}\n")



AAN_LINES = [
    "1\tid/a\tid/b\tb'Attention is all you need.'\tb\"We cite \\xe2\\x80\\x9cattention\\xe2\\x80\\x9d here.\\n\"",
    "0\tid/c\tid/d\tb'Unrelated paper about parsing.'\tb'Graph neural networks'",
    "1.0\tid/e\tid/f\tplain text one\tplain text two",
    "0\tid/g\tid/h\tb'short'\tb'also short'",
]



def write_aan_fixture(root: Path) -> None:
    folder = root / "tsv_data"
    folder.mkdir(parents=True)
    for name in ("train", "eval", "test"):
        (folder / f"new_aan_pairs.{name}.tsv").write_text("\n".join(AAN_LINES) + "\n")



def write_imdb_fixture(root: Path) -> None:
    """A ``DatasetDict.save_to_disk`` copy at ``<root>/imdb`` (how an offline machine provides IMDB)."""
    import datasets

    def split(n: int) -> datasets.Dataset:
        texts = [("A wonderful film! " if i % 2 else "Dull and slow. ") * (i + 1) for i in range(n)]
        return datasets.Dataset.from_dict({"text": texts, "label": [i % 2 for i in range(n)]})

    datasets.DatasetDict({"train": split(6), "test": split(4)}).save_to_disk(str(root / "imdb"))



def write_pathfinder_fixture(root: Path, resolution: int, difficulty: str, n_files: int = 2, per_file: int = 5) -> list[int]:
    """Random images + text metadata in the released layout; returns the labels in file order."""
    folder = root / f"pathfinder{resolution}" / difficulty
    rng = np.random.default_rng(resolution)
    labels = []
    (folder / "metadata").mkdir(parents=True)
    for k in range(n_files):
        (folder / "imgs" / str(k)).mkdir(parents=True)
        lines = []
        for i in range(per_file):
            label = int(rng.integers(0, 2))
            Image.fromarray(rng.integers(0, 256, (resolution, resolution), dtype=np.uint8)).save(
                folder / "imgs" / str(k) / f"sample_{i}.png")
            lines.append(f"imgs/{k} sample_{i}.png {i} {label} 1.0 14 4 2 0.5 1 1")
            labels.append(label)
        (folder / "metadata" / f"{k}.npy").write_text("\n".join(lines) + "\n")
    return labels



WORDS = ("the of and to in a is was for on as with by he at from his an were are which this be or has had first "
         "one their its new after who they have her she two been other when there all during into school time may "
         "years more most only over city some world would where later up such used many can state about national "
         "out known university united then made").split()



def english_like(n_words: int, seed: int = 0) -> list[str]:
    """Sentences of common words (deterministic), enough structure for a tokenizer to learn pieces."""
    rng = np.random.default_rng(seed)
    words = rng.choice(WORDS, size=n_words, p=np.linspace(2, 1, len(WORDS)) / np.linspace(2, 1, len(WORDS)).sum())
    return [" ".join(words[i : i + 12]).capitalize() + "." for i in range(0, n_words, 12)]



def write_byte_zip(data_dir: Path, name: str, payload: bytes) -> Path:
    """``<data_dir>/<name>/<name>.zip`` holding one member ``<name>`` (the release layout of enwik8 / text8)."""
    root = data_dir / name
    root.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(root / f"{name}.zip", "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(name, payload)
    return root / f"{name}.zip"



def enwik8_payload(n_bytes: int = 20_000) -> bytes:
    body = "\n".join(f"  <page><title>{s[:20]}</title><text>{s} &amp; [[link]]</text></page>" for s in english_like(4000))
    return ("<mediawiki>\n" + body).encode()[:n_bytes]



def text8_payload(n_chars: int = 20_000) -> bytes:
    return " ".join(english_like(4000)).lower().replace(".", "").encode()[:n_chars]

