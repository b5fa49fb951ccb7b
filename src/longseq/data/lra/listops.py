"""ListOps: nested MIN / MAX / MED / SM (sum mod 10) expressions over digits, 10 classes.

Released format (``<root>/listops-1000/basic_{train,val,test}.tsv``): a ``Source\\tTarget`` header, then one
expression per row written as left-nested parenthesised pairs, e.g. ``( ( ( [MIN 8 ) 6 ) ] )``, and its value.
LRA's input pipeline maps ``]`` to ``X`` and deletes the parentheses, giving ``[MIN 8 6 X``; ``tokenize``
does the same, and the vocabulary is the 15 symbols (digits, 4 operators, ``X``) after ``PAD``, plus ``UNK``.

The generator re-implements LRA's ``data/listops.py`` (reference §1.4): a tree sampler with leaf
probability 0.25 below the maximum depth, 2..max_args children, the root at depth 1, kept when
``min_length < length < max_length`` (strict), deduplicated. It is seeded and writes the released format,
but it is NOT the released split (that depends on LRA's unseeded ``random`` state).
"""

from __future__ import annotations

import csv
import random
from pathlib import Path
from typing import Union

import numpy as np

from longseq.data.lra.common import Examples, LraDataModule
from longseq.data.validation import check_file_not_empty
from longseq.utils.errors import DataError

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
CLOSE = "]"
VALUE_P = 0.25  # at depth < max_depth a node is an operator with probability 0.25 (r <= VALUE_P), else a leaf
SYMBOLS = tuple(str(d) for d in range(10)) + OPERATORS + ("X",)
VOCAB = {s: i + 1 for i, s in enumerate(SYMBOLS)}  # 0 is PAD_ID
UNK_ID = len(SYMBOLS) + 1
VOCAB_SIZE = len(SYMBOLS) + 2  # PAD + 15 symbols + UNK
NUM_CLASSES = 10  # expression values 0..9
SPLIT_FILES = {"train": "basic_train.tsv", "val": "basic_val.tsv", "test": "basic_test.tsv"}

Tree = Union[int, tuple[str, list["Tree"]]]  # a digit leaf, or (operator, children)


# ----------------------------------------------------------------------------------------------------
# Expressions


def evaluate(tree: Tree) -> int:
    """Value 0..9 of an expression: MIN, MAX, MED = int(numpy-style median; an even count truncates the mean
    of the two middle values), SM = sum mod 10."""
    if isinstance(tree, int):
        return tree
    op, children = tree
    args = sorted(evaluate(c) for c in children)
    if op == "[MIN":
        return args[0]
    if op == "[MAX":
        return args[-1]
    if op == "[MED":
        mid = len(args) // 2
        return args[mid] if len(args) % 2 else int((args[mid - 1] + args[mid]) / 2)
    if op == "[SM":
        return sum(args) % 10
    raise ValueError(f"unknown ListOps operator {op!r}; valid: {OPERATORS}")


def sample_tree(rng: random.Random, max_depth: int, max_args: int, depth: int = 1) -> tuple[Tree, int]:
    """(tree, length): LRA's sampler; length counts operator, digit and closing tokens."""
    r = rng.random() if depth < max_depth else 1.0
    if r > VALUE_P:
        return rng.randint(0, 9), 1
    n_args = rng.randint(2, max_args)
    children, length = [], 2  # the operator token and its closing bracket
    for _ in range(n_args):
        child, child_length = sample_tree(rng, max_depth, max_args, depth + 1)
        children.append(child)
        length += child_length
    return (rng.choice(OPERATORS), children), length


def to_source(tree: Tree) -> str:
    """The released Source text: each argument and the closing ``]`` appended as a parenthesised pair."""
    if isinstance(tree, int):
        return str(tree)
    op, children = tree
    text = op
    for part in [*(to_source(c) for c in children), CLOSE]:
        text = f"( {text} {part} )"
    return text


def tokenize(source: str) -> list[str]:
    """LRA's preprocessing: ``]`` -> ``X``, parentheses removed, whitespace split."""
    return source.replace("]", "X").replace("(", " ").replace(")", " ").split()


def parse(tokens: list[str]) -> Tree:
    """Inverse of ``tokenize(to_source(tree))`` (for tests and inspection)."""
    pos = 0

    def node() -> Tree:
        nonlocal pos
        token = tokens[pos]
        pos += 1
        if token in OPERATORS:
            children = []
            while tokens[pos] != "X":
                children.append(node())
            pos += 1
            return token, children
        return int(token)

    tree = node()
    if pos != len(tokens):
        raise ValueError("trailing tokens after the expression")
    return tree


def encode(tokens: list[str]) -> np.ndarray:
    return np.array([VOCAB.get(t, UNK_ID) for t in tokens], dtype=np.int16)


def generate(n: int, seed: int = 0, max_depth: int = 10, max_args: int = 10, min_length: int = 500,
             max_length: int = 2000) -> list[tuple[str, int]]:
    """``n`` distinct (Source, Target) rows with ``min_length < tokens < max_length``, in draw order."""
    if max_length - min_length < 2:
        raise ValueError(f"no length fits {min_length} < length < {max_length}")
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[tuple[str, int]] = []
    while len(rows) < n:
        tree, length = sample_tree(rng, max_depth, max_args)
        if not min_length < length < max_length:
            continue
        source = to_source(tree)
        if source in seen:
            continue
        seen.add(source)
        rows.append((source, evaluate(tree)))
    return rows


def write_split(path: Path, rows: list[tuple[str, int]]) -> None:
    """A released-format TSV: ``Source\\tTarget`` header, tab-separated rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["Source", "Target"])
        writer.writerows(rows)


def write_dataset(root: Path, n_train: int = 96_000, n_val: int = 2_000, n_test: int = 2_000, seed: int = 0,
                  **generator_kwargs) -> Path:
    """Generate ``<root>/listops-1000/basic_{train,val,test}.tsv`` (one deduplicated pool, cut in order)."""
    rows = generate(n_train + n_val + n_test, seed=seed, **generator_kwargs)
    folder = Path(root) / "listops-1000"
    cuts = {"train": rows[:n_train], "val": rows[n_train:n_train + n_val], "test": rows[n_train + n_val:]}
    for split, part in cuts.items():
        write_split(folder / SPLIT_FILES[split], part)
    return folder


def read_split(path: Path) -> tuple[list[np.ndarray], np.ndarray]:
    """(token-id arrays, labels) of a released-format TSV; a malformed row is a ``DataError`` with its line."""
    check_file_not_empty(path, "ListOps TSV")
    docs, labels = [], []
    with open(path, newline="") as f:
        reader = csv.reader(f, delimiter="\t")
        header = next(reader, None)
        if header is None or [h.strip() for h in header] != ["Source", "Target"]:
            raise DataError(path, f"expected the header 'Source<TAB>Target', got {header}", line=1)
        for row in reader:
            if not row:
                continue
            line = reader.line_num
            if len(row) != 2:
                raise DataError(path, f"expected 2 tab-separated columns (Source, Target), got {len(row)}: "
                                      f"{row[:3]}", line=line)
            tokens = tokenize(row[0])
            if not tokens:
                raise DataError(path, "the Source column holds no expression", line=line)
            try:
                label = int(row[1])
            except ValueError:
                label = -1
            if not 0 <= label < NUM_CLASSES:
                raise DataError(path, f"the Target column must be a value 0..{NUM_CLASSES - 1}, got {row[1]!r}",
                                line=line)
            docs.append(encode(tokens))
            labels.append(label)
    return docs, np.array(labels, dtype=np.int64)


class LraListOpsDataModule(LraDataModule):
    """ListOps from ``<root>/listops-1000/basic_{train,val,test}.tsv``; 10 classes, vocabulary of 17."""

    num_classes = NUM_CLASSES
    vocab_size = VOCAB_SIZE
    title = "ListOps"

    def split_source(self, split: str) -> Path:
        return self.root / "listops-1000" / SPLIT_FILES[split]

    def load_split(self, split: str) -> Examples:
        docs, labels = read_split(self.split_file(split))
        return Examples([docs], labels)

