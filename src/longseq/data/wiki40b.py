"""Wiki-40B (English) at the SentencePiece level, as in the Combiner paper's LM experiments.

Source: the Hugging Face ``google/wiki40b`` dataset, config ``en`` (columns ``wikidata_id``, ``text``,
``version_id``); ``text`` is marked up with ``_START_ARTICLE_`` / ``_START_SECTION_`` /
``_START_PARAGRAPH_`` lines and ``_NEWLINE_`` inside paragraphs. Each article becomes plain text (title,
section titles and paragraphs on their own lines), is encoded with a unigram SentencePiece model of
``vocab_size`` pieces that the project trains on the training split (``<data_dir>/wiki40b/spm<V>.model``),
and ends with ``</s>`` (EOS); the articles of a split are concatenated into one stream cached as
``<data_dir>/wiki40b/spm<V>/{train,val,test}.npy``. Perplexity is per sentence piece.
An offline machine reads a ``save_to_disk`` copy from ``<data_dir>/wiki40b/hf/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from longseq.data.text import (
    EOS_ID,
    SPLITS,
    TokenStreamDataModule,
    check_hf_source,
    load_hf_split,
    load_sentencepiece,
    load_token_cache,
    stream_dtype,
    train_sentencepiece,
)

MARKERS = ("_START_ARTICLE_", "_START_SECTION_", "_START_PARAGRAPH_")


def wiki40b_to_text(marked: str) -> str:
    """A Wiki-40B article with its markers -> plain text: one line per title / section title / paragraph
    line (``_NEWLINE_`` is a line break inside a paragraph); marker lines and blank lines are dropped."""
    lines = []
    for line in marked.split("\n"):
        if line.strip() in MARKERS:
            continue
        lines.extend(part.strip() for part in line.split("_NEWLINE_"))
    return "\n".join(line for line in lines if line)


def article_texts(dataset: Any, batch_size: int = 1_000) -> Iterator[str]:
    """Plain text of every article of an HF split, in order."""
    for batch in dataset.iter(batch_size=batch_size):
        yield from (wiki40b_to_text(t) for t in batch["text"])


def article_lines(dataset: Any) -> Iterable[str]:
    """Every non-empty line of every article: the sentences SentencePiece is trained on."""
    for text in article_texts(dataset):
        yield from text.split("\n")


class Wiki40bDataModule(TokenStreamDataModule):
    """Wiki-40B-en causal LM over SentencePiece ids (metric: perplexity per piece).

    Args (beyond ``TokenStreamDataModule``'s; ``vocab_size`` is the SentencePiece vocabulary, 32k in the paper):
        spm_max_sentences: lines sampled from the training split to train SentencePiece.
    """

    name = "wiki40b"
    hub_name, hub_config = "google/wiki40b", "en"

    def __init__(self, *args: Any, spm_max_sentences: int = 5_000_000, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spm_max_sentences = spm_max_sentences

    @property
    def spm_path(self) -> Path:
        return self.root / f"spm{self.vocab_size}.model"

    @property
    def cache(self) -> Path:
        return self.root / f"spm{self.vocab_size}"

    def load(self, split: str) -> Any:
        return load_hf_split(self.root / "hf", self.hub_name, self.hub_config, split, self.root / "hf_cache")

    def check_data(self) -> None:
        """The token caches exist, or the dataset can be read to build them (``text.check_hf_source``)."""
        if not all((self.cache / f"{s}.npy").is_file() for s in SPLITS):
            check_hf_source(self.root / "hf", self.hub_name, self.hub_config, self.root / "hf_cache")

    def prepare_data(self) -> None:
        """Train SentencePiece on the training split (once), then encode the three splits (once)."""
        if all((self.cache / f"{s}.npy").is_file() for s in SPLITS):
            return
        if self.spm_path.is_file():
            sp = load_sentencepiece(self.spm_path)
        else:
            sp = train_sentencepiece(article_lines(self.load("train")), self.spm_path, self.vocab_size,
                                     max_sentences=self.spm_max_sentences)
        dtype = stream_dtype(self.vocab_size)
        self.cache.mkdir(parents=True, exist_ok=True)
        for split in SPLITS:
            parts = []
            for batch in self.load(split).iter(batch_size=1_000):
                pieces = sp.encode([wiki40b_to_text(t) for t in batch["text"]])
                parts.extend(np.asarray(ids + [EOS_ID], dtype=dtype) for ids in pieces)
            stream = np.concatenate(parts) if parts else np.zeros(0, dtype)
            tmp = self.cache / f"{split}.tmp.npy"
            np.save(tmp, stream)
            tmp.rename(self.cache / f"{split}.npy")  # a complete file or none

    def split_source(self, split: str) -> Path:
        return self.cache / f"{split}.npy"

    def load_split(self, split: str) -> np.ndarray:
        self.prepare_data()
        return load_token_cache(self.split_source(split))
