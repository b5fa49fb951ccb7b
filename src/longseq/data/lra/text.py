"""LRA Text: IMDB sentiment on UTF-8 bytes (ids byte + 1, 0 = pad), 2 classes.

LRA loads ``imdb_reviews`` from TFDS and byte-encodes it; here IMDB comes through Hugging Face ``datasets``
(``stanfordnlp/imdb``, config ``plain_text``): a ``DatasetDict.save_to_disk`` copy at ``<root>/imdb/`` is read
first (how an offline machine gets it), else the Hub (cached in ``<root>/hf_cache``); with no network this
fails within seconds saying what to place where. As in LRA the 25k test reviews are also the validation
set (IMDB has no validation split).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from longseq.data.lra.common import BYTE_VOCAB_SIZE, Examples, LraDataModule, encode_bytes
from longseq.data.text import check_hf_source, load_hf_split
from longseq.utils.errors import DataError

HUB_NAME, HUB_CONFIG = "stanfordnlp/imdb", "plain_text"
HF_SPLITS = {"train": "train", "val": "test", "test": "test"}  # LRA validates on the test set


class LraTextDataModule(LraDataModule):
    """IMDB reviews as byte sequences truncated to ``max_length`` (LRA repo 1000, paper 4K)."""

    num_classes = 2
    vocab_size = BYTE_VOCAB_SIZE

    def split_source(self, split: str) -> Path:
        return self.root / "imdb" if (self.root / "imdb").is_dir() else self.root / "hf_cache"

    def check_data(self) -> None:
        """IMDB can be read: a saved copy, its cache (offline), or a reachable Hub (``text.check_hf_source``)."""
        check_hf_source(self.root / "imdb", HUB_NAME, HUB_CONFIG, self.root / "hf_cache")

    def load_split(self, split: str) -> Examples:
        rows = load_hf_split(self.root / "imdb", HUB_NAME, HUB_CONFIG, HF_SPLITS[split], self.root / "hf_cache")
        docs = [encode_bytes(text, self.max_length) for text in rows["text"]]
        labels = np.asarray(rows["label"], dtype=np.int64)
        if set(np.unique(labels)) - {0, 1}:
            raise DataError(self.split_source(split), f"IMDB {split}: labels must be 0/1, got "
                                                      f"{sorted(set(np.unique(labels).tolist()))}")
        return Examples([docs], labels)
