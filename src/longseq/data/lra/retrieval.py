"""LRA Retrieval (ACL Anthology Network): do two papers cite each other? 2 classes, a pair of byte documents.

Released format (``<root>/tsv_data/new_aan_pairs.{train,eval,test}.tsv``): no header, tab-separated columns
``label id1 id2 text1 text2``. The text columns hold the repr of a Python bytes string (``b'...'``); LRA
byte-tokenizes that string as written. Here a ``b'...'``/``b"..."`` literal is decoded back to its bytes
(``ast.literal_eval``) and anything else taken as UTF-8 text; each document is truncated to ``max_length``
bytes (ids byte + 1, 0 = pad). Batches are ``(tokens_1, tokens_2, labels)``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np

from longseq.data.lra.common import BYTE_VOCAB_SIZE, Examples, LraDataModule, encode_bytes
from longseq.data.validation import check_file_not_empty
from longseq.utils.errors import DataError

SPLIT_FILES = {"train": "new_aan_pairs.train.tsv", "val": "new_aan_pairs.eval.tsv", "test": "new_aan_pairs.test.tsv"}


def document_bytes(field: str) -> bytes:
    """The bytes of a text column: a ``b'...'`` literal decoded, otherwise the UTF-8 text."""
    field = field.strip()
    if len(field) >= 3 and field[0] == "b" and field[1] in "'\"" and field[-1] == field[1]:
        try:
            value = ast.literal_eval(field)
            if isinstance(value, bytes):
                return value
        except (ValueError, SyntaxError):
            pass  # not a clean literal: fall back to the raw text
    return field.encode("utf-8")


def read_split(path: Path, max_length: int) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """(first documents, second documents, labels) of one released TSV; a malformed row is a ``DataError``
    naming its line."""
    check_file_not_empty(path, "AAN retrieval TSV")
    first, second, labels = [], [], []
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for line_no, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line:
                continue
            cols = line.split("\t")
            if len(cols) != 5:
                raise DataError(path, f"expected 5 tab-separated columns (label id1 id2 text1 text2), got {len(cols)}",
                                line=line_no)
            try:
                label = float(cols[0])
            except ValueError:
                label = -1.0
            if label not in (0.0, 1.0):
                raise DataError(path, f"the label column must be 0 or 1, got {cols[0]!r}", line=line_no)
            labels.append(int(label))
            first.append(encode_bytes(document_bytes(cols[3]), max_length))
            second.append(encode_bytes(document_bytes(cols[4]), max_length))
    return first, second, np.array(labels, dtype=np.int64)


class LraRetrievalDataModule(LraDataModule):
    """AAN document pairs from ``<root>/tsv_data/``; each document padded/truncated to ``max_length``."""

    num_classes = 2
    vocab_size = BYTE_VOCAB_SIZE
    title = "AAN retrieval"

    def split_source(self, split: str) -> Path:
        return self.root / "tsv_data" / SPLIT_FILES[split]

    def load_split(self, split: str) -> Examples:
        first, second, labels = read_split(self.split_file(split), self.max_length)
        return Examples([first, second], labels)


