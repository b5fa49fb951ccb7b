"""WikiText-103, word level, as in Transformer-XL: vocabulary counted on the training split only,
``<eos>`` (id 0) after every line (a blank line is a lone ``<eos>``), whitespace tokenization.

Source: the Hugging Face ``Salesforce/wikitext`` dataset (``wikitext-103-v1``: the tokenized release
with ``<unk>``; each row of its ``text`` column is one line of the original files). Tokenized once into
``<data_dir>/wikitext103/<config>/{train,val,test}.npy`` + ``vocab.txt`` (one word per line, id = line
number, most frequent first) and memory-mapped afterwards. An offline machine reads a
``save_to_disk`` copy from ``<data_dir>/wikitext103/hf/``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from longseq.data.text import (
    SPLITS,
    TokenStreamDataModule,
    check_hf_source,
    load_hf_split,
    load_token_cache,
    stream_dtype,
)
from longseq.utils.errors import ConfigError

EOS, UNK = "<eos>", "<unk>"


def build_vocab(lines: Iterable[str]) -> list[str]:
    """Words of ``lines`` by decreasing count (ties: first seen first), ``<eos>`` first; ``<unk>`` is
    appended when absent so that words unseen in training have an id."""
    counts = Counter()
    for line in lines:
        counts.update(line.split())
    words = [EOS] + [w for w, _ in counts.most_common() if w != EOS]
    if UNK not in counts:
        words.append(UNK)
    return words


def encode_lines(lines: Iterable[str], ids: dict[str, int], dtype: np.dtype) -> np.ndarray:
    """Each line -> its word ids then ``<eos>``; all lines concatenated into one stream."""
    unk = ids[UNK]
    out = [ids.get(w, unk) for line in lines for w in (*line.split(), EOS)]
    return np.asarray(out, dtype=dtype)


def text_batches(dataset: Any, batch_size: int = 10_000) -> Iterable[str]:
    """The ``text`` column of an HF dataset, streamed in batches (keeps memory flat on 1.8M-line splits)."""
    for batch in dataset.iter(batch_size=batch_size):
        yield from batch["text"]


class WikiText103DataModule(TokenStreamDataModule):
    """WikiText-103 word-level LM (metric: perplexity).

    Args (beyond ``TokenStreamDataModule``'s):
        hub_config: ``wikitext-103-v1`` (tokenized, with ``<unk>``; the standard) or ``wikitext-103-raw-v1``.
    """

    name = "wikitext103"
    hub_name = "Salesforce/wikitext"

    def __init__(self, *args: Any, hub_config: str = "wikitext-103-v1", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hub_config = hub_config

    @property
    def cache(self) -> Path:
        return self.root / self.hub_config

    def cached(self) -> bool:
        return (self.cache / "vocab.txt").is_file() and all((self.cache / f"{s}.npy").is_file() for s in SPLITS)

    def check_data(self) -> None:
        """The token caches exist, or the dataset can be read to build them (``text.check_hf_source``)."""
        if not self.cached():
            check_hf_source(self.root / "hf", self.hub_name, self.hub_config, self.root / "hf_cache")

    def prepare_data(self) -> None:
        """Tokenize the three splits once into ``.npy`` streams (rank 0)."""
        if self.cached():
            return
        load = lambda split: load_hf_split(self.root / "hf", self.hub_name, self.hub_config, split, self.root / "hf_cache")  # noqa: E731
        train = load("train")
        vocab = build_vocab(text_batches(train))
        if len(vocab) > self.vocab_size:
            raise ConfigError("task.vocab_size", f"the training split has {len(vocab)} word types (with <eos>, "
                              f"<unk>) but task.vocab_size={self.vocab_size}: set task.vocab_size={len(vocab)}")
        ids = {w: i for i, w in enumerate(vocab)}
        self.cache.mkdir(parents=True, exist_ok=True)
        dtype = stream_dtype(len(vocab))
        for split in SPLITS:
            data = train if split == "train" else load(split)
            # Encoded batch by batch: a Python list of 100M ids would need several GB.
            parts = [encode_lines(batch["text"], ids, dtype) for batch in data.iter(batch_size=10_000)]
            np.save(self.cache / f"{split}.npy", np.concatenate(parts) if parts else np.zeros(0, dtype))
        # Written last: its presence marks a complete cache.
        (self.cache / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")

    def vocabulary(self) -> list[str]:
        return (self.cache / "vocab.txt").read_text(encoding="utf-8").splitlines()

    def split_source(self, split: str) -> Path:
        return self.cache / f"{split}.npy"

    def load_split(self, split: str) -> np.ndarray:
        self.prepare_data()
        return load_token_cache(self.split_source(split))
