"""C4 (English) for masked language modeling with BERT masking.

Source: the Hugging Face ``allenai/c4`` dataset, config ``en`` (columns ``text``, ``timestamp``, ``url``),
read in streaming mode (the training split is 365M documents: it is tokenized on the fly, never cached).
Tokenizer: a unigram SentencePiece model of ``vocab_size`` pieces trained by the project on the first
``spm_train_docs`` training documents (``<data_dir>/c4/spm<V>.model``); ids 0..3 = pad, unk, ``<s>``
(CLS), ``</s>`` (SEP), id 4 = ``<mask>``, id 5 = the newline piece.

Examples (``seq_len`` ids): ``<s> A </s> [B </s>] <pad>...`` with at most two segments, each a document
or a chunk of one (a document longer than the room left continues in the next example). BERT masking:
every non-special position is chosen with probability ``mask_prob`` (15 %); a chosen position becomes
``<mask>`` (80 %), a random piece (10 %) or stays (10 %); targets are the original ids at chosen positions
and ``IGNORE_INDEX`` elsewhere. Validation / test = the first ``val_docs`` / the next ``test_docs``
documents of C4's validation split, packed once and cached as ``(N, seq_len)`` arrays; their masks are
drawn from a generator seeded by (``seed``, example index), so every evaluation scores the same positions.
An offline machine reads a ``save_to_disk`` copy from ``<data_dir>/c4/hf/``.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Iterable, Iterator

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from longseq.data.batching import device_batches
from longseq.data.text import (
    BOS_ID,
    EOS_ID,
    IGNORE_INDEX,
    PAD_ID,
    EvalShardSampler,
    check_hf_source,
    load_hf_split,
    load_sentencepiece,
    load_token_cache,
    stream_dtype,
    train_sentencepiece,
)
from longseq.data.validation import MIN_EVAL_EXAMPLES, check_split_size
from longseq.utils.errors import ConfigError, DataError

MASK_PIECE = "<mask>"
MASK_ID = 4           # the first control symbol after pad/unk/bos/eos
FIRST_NORMAL_ID = 5   # ids below this are special: never masked, never drawn as random replacements


def pack_segments(docs: Iterable[list[int]], seq_len: int, max_segments: int = 2) -> Iterator[np.ndarray]:
    """Token lists of documents -> ``(seq_len,)`` examples ``<s> A </s> [B </s>] <pad>...``.

    Documents are consumed in order and never dropped: a document that does not fit continues in the
    next example, so an example holds at most ``max_segments`` segments (whole documents or chunks).
    """
    if seq_len < 3:
        raise ConfigError("task.seq_len", f"{seq_len} is too short for <s> x </s> (at least 3)")
    example, segments = [BOS_ID], 0

    def padded() -> np.ndarray:
        out = np.full(seq_len, PAD_ID, dtype=np.int64)
        out[: len(example)] = example
        return out

    for doc in docs:
        pos = 0
        while pos < len(doc):
            room = seq_len - len(example) - 1  # one slot for the segment's </s>
            if segments == max_segments or room < 1:
                yield padded()
                example, segments = [BOS_ID], 0
                continue
            piece = list(doc[pos : pos + room])
            example += piece + [EOS_ID]
            segments += 1
            pos += len(piece)
    if segments:
        yield padded()


def bert_mask(tokens: np.ndarray, rng: np.random.Generator, vocab_size: int, mask_prob: float = 0.15
              ) -> tuple[np.ndarray, np.ndarray]:
    """BERT masking of one ``(L,)`` example -> ``(inputs, targets)``, both ``(L,)`` int64.

    Each non-special position is chosen with probability ``mask_prob``; chosen positions become
    ``MASK_ID`` (80 %), a uniform random normal piece in ``[FIRST_NORMAL_ID, vocab_size)`` (10 %) or keep
    their id (10 %). ``targets`` holds the original id at chosen positions, ``IGNORE_INDEX`` elsewhere.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    chosen = (tokens >= FIRST_NORMAL_ID) & (rng.random(tokens.shape) < mask_prob)
    action = rng.random(tokens.shape)
    inputs = tokens.copy()
    inputs[chosen & (action < 0.8)] = MASK_ID
    randomized = chosen & (action >= 0.8) & (action < 0.9)
    inputs[randomized] = rng.integers(FIRST_NORMAL_ID, vocab_size, int(randomized.sum()))
    targets = np.where(chosen, tokens, IGNORE_INDEX)
    return inputs, targets


class MaskedExamples(Dataset):
    """Packed evaluation examples ``(N, L)`` with a fixed mask per example (seeded by ``(seed, index)``)."""

    def __init__(self, examples: np.ndarray, vocab_size: int, mask_prob: float, seed: int) -> None:
        self.examples, self.vocab_size, self.mask_prob, self.seed = examples, vocab_size, mask_prob, seed

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, i])
        inputs, targets = bert_mask(self.examples[i], rng, self.vocab_size, self.mask_prob)
        return torch.from_numpy(inputs), torch.from_numpy(targets)


class MaskedDocumentStream(IterableDataset):
    """Training examples from a (shuffled, streamed) document source: tokenize, pack, mask on the fly.

    Documents are split over DDP ranks x DataLoader workers with ``split_dataset_by_node``; each
    (rank, worker, pass) has its own masking generator.
    """

    def __init__(self, source: dict[str, Any], spm_path: Path, seq_len: int, vocab_size: int, mask_prob: float,
                 seed: int, shuffle_buffer: int, rank: int = 0, world_size: int = 1) -> None:
        self.source, self.spm_path = source, spm_path
        self.seq_len, self.vocab_size, self.mask_prob = seq_len, vocab_size, mask_prob
        self.seed, self.shuffle_buffer = seed, shuffle_buffer
        self.rank, self.world_size = rank, world_size
        self.passes = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        from datasets.distributed import split_dataset_by_node

        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info else (0, 1)
        docs = load_hf_split(**self.source, split="train", streaming=True)
        if self.shuffle_buffer > 1:
            docs = docs.shuffle(seed=self.seed + self.passes, buffer_size=self.shuffle_buffer)
        docs = split_dataset_by_node(docs, rank=self.rank * n_workers + worker, world_size=self.world_size * n_workers)
        rng = np.random.default_rng([self.seed, self.passes, self.rank, worker])
        self.passes += 1
        sp = load_sentencepiece(self.spm_path)
        for example in pack_segments((sp.encode(doc["text"]) for doc in docs), self.seq_len):
            inputs, targets = bert_mask(example, rng, self.vocab_size, self.mask_prob)
            yield torch.from_numpy(inputs), torch.from_numpy(targets)


class C4MLMDataModule(L.LightningDataModule):
    """C4-en masked LM: ``(inputs, targets)`` batches of shape ``(B, seq_len)``, metric perplexity over masked positions.

    Args:
        data_dir, seq_len, vocab_size, batch_size (GLOBAL), accumulate_grad_batches, eval_batch_size,
            num_workers, seed: as for the causal-LM datamodules.
        mask_prob: BERT's 15 %.
        spm_train_docs: training documents SentencePiece is trained on.
        val_docs / test_docs: documents of C4's validation split used for val / test (disjoint, in order).
        shuffle_buffer: streaming shuffle buffer of the training documents (1 = no shuffling).
    """

    name = "c4"
    hub_name, hub_config = "allenai/c4", "en"

    def __init__(self, data_dir: str = "data", seq_len: int = 512, vocab_size: int = 32_000, batch_size: int = 16,
                 accumulate_grad_batches: int = 1, eval_batch_size: int | None = None, num_workers: int = 0,
                 seed: int = 0, mask_prob: float = 0.15, spm_train_docs: int = 200_000, val_docs: int = 10_000,
                 test_docs: int = 10_000, shuffle_buffer: int = 10_000) -> None:
        super().__init__()
        self.data_dir = Path(data_dir)
        self.seq_len, self.vocab_size = int(seq_len), int(vocab_size)
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.accumulate_grad_batches, self.num_workers, self.seed = accumulate_grad_batches, num_workers, seed
        self.mask_prob, self.spm_train_docs = mask_prob, spm_train_docs
        self.val_docs, self.test_docs, self.shuffle_buffer = val_docs, test_docs, shuffle_buffer
        self.examples: dict[str, np.ndarray] = {}

    @property
    def root(self) -> Path:
        return self.data_dir / self.name

    @property
    def spm_path(self) -> Path:
        return self.root / f"spm{self.vocab_size}.model"

    @property
    def source(self) -> dict[str, Any]:
        return {"saved_dir": self.root / "hf", "hub_name": self.hub_name, "hub_config": self.hub_config,
                "cache_dir": self.root / "hf_cache"}

    def eval_cache(self, split: str) -> Path:
        docs = self.val_docs if split == "val" else self.test_docs
        return self.root / f"spm{self.vocab_size}" / f"{split}_L{self.seq_len}_docs{docs}.npy"

    def check_data(self) -> None:
        """C4 can be read (``text.check_hf_source``): its training documents are streamed at every run."""
        check_hf_source(**self.source)

    def prepare_data(self) -> None:
        """Train SentencePiece on the first training documents, pack the val / test documents (each once)."""
        if not self.spm_path.is_file():
            docs = load_hf_split(**self.source, split="train", streaming=True)
            texts = (doc["text"] for doc in itertools.islice(docs, self.spm_train_docs))
            lines = (line for text in texts for line in text.split("\n") if line.strip())
            train_sentencepiece(lines, self.spm_path, self.vocab_size, control_symbols=(MASK_PIECE,))
        sp = load_sentencepiece(self.spm_path)
        if sp.piece_to_id(MASK_PIECE) != MASK_ID:
            raise DataError(self.spm_path, f"maps {MASK_PIECE} to {sp.piece_to_id(MASK_PIECE)}, expected {MASK_ID}")
        for split, skip, take in (("val", 0, self.val_docs), ("test", self.val_docs, self.test_docs)):
            path = self.eval_cache(split)
            if path.is_file():
                continue
            docs = load_hf_split(**self.source, split="val", streaming=True)
            texts = (doc["text"] for doc in itertools.islice(docs, skip, skip + take))
            examples = list(pack_segments(map(sp.encode, texts), self.seq_len))
            check_split_size(self.source["saved_dir"], split, len(examples), minimum=1, unit="examples",
                             needs=f"one packed example (C4 validation documents [{skip}, {skip + take}))",
                             hint=f"raise task.data.{split}_docs")
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp.npy")
            np.save(tmp, np.stack(examples).astype(stream_dtype(self.vocab_size)))
            tmp.rename(path)

    def setup(self, stage: str | None = None) -> None:
        self.world_size, self.rank, self.device_batch, self.device_eval_batch = device_batches(
            self.trainer, self.batch_size, self.eval_batch_size, self.accumulate_grad_batches
        )
        self.prepare_data()
        self.pieces = load_sentencepiece(self.spm_path).get_piece_size()
        if self.pieces > self.vocab_size:
            raise DataError(self.spm_path, f"has {self.pieces} pieces > task.vocab_size={self.vocab_size}")
        for split in ("val", "test"):
            if split in self.examples:
                continue
            self.examples[split] = load_token_cache(self.eval_cache(split))
            check_split_size(self.eval_cache(split), split, len(self.examples[split]), minimum=1, unit="examples",
                             needs="one packed example", warn_below=MIN_EVAL_EXAMPLES)

    def train_dataloader(self) -> DataLoader:
        stream = MaskedDocumentStream(self.source, self.spm_path, self.seq_len, self.pieces, self.mask_prob,
                                      self.seed, self.shuffle_buffer, self.rank, self.world_size)
        return DataLoader(stream, batch_size=self.device_batch, num_workers=self.num_workers, drop_last=True)

    def eval_dataloader(self, split: str) -> DataLoader:
        data = MaskedExamples(self.examples[split], self.pieces, self.mask_prob, self.seed + (split == "test"))
        sampler = EvalShardSampler(data, self.world_size, self.rank) if self.world_size > 1 else None
        return DataLoader(data, batch_size=self.device_eval_batch, sampler=sampler, shuffle=False,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return self.eval_dataloader("val")

    def test_dataloader(self) -> DataLoader:
        return self.eval_dataloader("test")
