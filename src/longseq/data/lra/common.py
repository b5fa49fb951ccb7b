"""Shared plumbing of the LRA datamodules: in-memory examples, padding collate, global-batch arithmetic."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import lightning as L
import numpy as np
import torch
from torch.utils.data import Dataset

from longseq.data.batching import SplitLoaders, device_batches

PAD_ID = 0  # LRA pads with token id 0; byte and symbol vocabularies start at 1
SPLITS = ("train", "val", "test")


def encode_bytes(text: str | bytes, max_length: int) -> np.ndarray:
    """UTF-8 bytes of ``text`` as ids ``byte + 1`` (0 is padding), truncated to ``max_length``."""
    raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(raw[:max_length], dtype=np.uint8).astype(np.int16) + 1


BYTE_VOCAB_SIZE = 257  # PAD + 256 byte values


class Examples(Dataset):
    """Classification examples held in memory: ``fields`` are lists of 1-D int arrays (one or two documents
    per example, any length up to ``max_length``) and ``labels`` an int array."""

    def __init__(self, fields: Sequence[Sequence[np.ndarray]], labels: np.ndarray) -> None:
        if any(len(f) != len(labels) for f in fields):
            raise ValueError("every field needs one entry per label")
        self.fields, self.labels = [list(f) for f in fields], np.asarray(labels, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple:
        return (*(f[i] for f in self.fields), int(self.labels[i]))


class PadCollate:
    """Stack a batch, padding every document to the FIXED ``max_length`` with ``PAD_ID``.

    A fixed length by default because block-structured attentions are built for one length. With
    ``pad_to_longest`` the batch is padded only to its longest document (rounded up to a multiple of
    ``multiple``), which is much cheaper for length-agnostic attentions (``full``) on short data.
    Returns ``(tokens (B, length) long, ..., labels (B,) long)``.
    """

    def __init__(self, max_length: int, pad_to_longest: bool = False, multiple: int = 1) -> None:
        self.max_length, self.pad_to_longest, self.multiple = max_length, pad_to_longest, max(1, multiple)

    def length(self, docs: tuple) -> int:
        if not self.pad_to_longest:
            return self.max_length
        longest = max(min(len(d), self.max_length) for column in docs for d in column)
        return min(self.max_length, -(-max(1, longest) // self.multiple) * self.multiple)

    def __call__(self, batch: list[tuple]) -> tuple[torch.Tensor, ...]:
        *docs, labels = zip(*batch)
        length = self.length(docs)
        out = []
        for column in docs:
            tokens = torch.full((len(column), length), PAD_ID, dtype=torch.long)
            for row, doc in enumerate(column):
                n = min(len(doc), length)
                tokens[row, :n] = torch.as_tensor(np.asarray(doc[:n], dtype=np.int64))
            out.append(tokens)
        return (*out, torch.tensor(labels, dtype=torch.long))


class LraDataModule(SplitLoaders, L.LightningDataModule):
    """Base class: subclasses implement ``load_split(split) -> Examples`` (split = train / val / test).

    Args:
        root: folder laid out like the LRA release (``<root>/listops-1000/``, ``<root>/tsv_data/``, ...).
        max_length: tokens per document after truncation; batches are padded to exactly this length.
        batch_size: GLOBAL batch size, divided over devices and gradient accumulation in ``setup``.
        accumulate_grad_batches: the trainer's accumulation (for the per-device batch).
        num_workers: DataLoader workers.
        seed: seed of anything the datamodule draws itself.
        eval_batch_size: global batch for validation/test (defaults to ``batch_size``).
        limit: keep at most this many examples per split (smoke runs); ``None`` keeps all.
        pad_to_longest: pad each batch to its longest document (a multiple of ``pad_multiple``) instead of
            ``max_length``; only for attentions that accept any length (e.g. ``full``).
        pad_multiple: see ``pad_to_longest``.
    """

    num_classes: int = 2
    vocab_size: int = BYTE_VOCAB_SIZE

    def __init__(self, root: str = "data/lra", max_length: int = 1024, batch_size: int = 32,
                 accumulate_grad_batches: int = 1, num_workers: int = 0, seed: int = 0,
                 eval_batch_size: int | None = None, limit: int | None = None, pad_to_longest: bool = False,
                 pad_multiple: int = 1) -> None:
        super().__init__()
        self.root = Path(root).expanduser()
        self.max_length = int(max_length)
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.accumulate_grad_batches = accumulate_grad_batches
        self.num_workers = num_workers
        self.seed = seed
        self.limit = limit
        self.pad_to_longest, self.pad_multiple = pad_to_longest, pad_multiple
        self.datasets: dict[str, Examples] = {}

    def load_split(self, split: str) -> Examples:
        raise NotImplementedError

    def missing(self, path: Path, what: str) -> FileNotFoundError:
        """The error raised when a released file is absent: says where it goes and how to generate it."""
        return FileNotFoundError(
            f"{what} not found at {path}. Place the LRA release there (lra_release/ from "
            "https://storage.googleapis.com/long-range-arena/lra_release.gz, so that task.data.root holds "
            "listops-1000/, tsv_data/, pathfinder32/), set task.data.root=<that folder>, or generate a local "
            "(non-released) copy: make data-lra / python -m longseq.data.lra.prepare --root <folder>"
        )

    title = "LRA"  # the dataset's name in the message of a missing file

    def check_data(self) -> None:
        """Every split's released file is on disk, else the ``missing`` error (the pre-flight calls this before the
        run directory exists)."""
        for split in SPLITS:
            self.split_file(split)

    def split_file(self, split: str) -> Path:
        """``split_source(split)`` when it exists, else the ``missing`` error naming it."""
        path = self.split_source(split)
        if not path.exists():
            raise self.missing(path, f"{self.title} {split} split")
        return path

    def setup(self, stage: str | None = None) -> None:
        self.world_size, _, self.device_batch, self.device_eval_batch = device_batches(
            self.trainer, self.batch_size, self.eval_batch_size, self.accumulate_grad_batches
        )
        for split in SPLITS:
            if split not in self.datasets:
                examples = self.load_split(split)
                if self.limit is not None and len(examples) > self.limit:
                    examples = Examples([f[: self.limit] for f in examples.fields], examples.labels[: self.limit])
                self.datasets[split] = examples  # sizes are checked when the loaders are built (SplitLoaders)

    def collate_fn(self) -> PadCollate:
        return PadCollate(self.max_length, self.pad_to_longest, self.pad_multiple)
