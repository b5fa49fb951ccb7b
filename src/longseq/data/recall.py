"""Synthetic recall tasks generated on the fly from a seed: MQAR, needle retrieval, selective copying.

Every example is ``(inputs (L,), labels (L,), buckets (L,))`` int64 tensors. ``labels[t]`` is the token the
causal model must predict at position ``t`` (the LM convention: it only sees ``inputs[:t + 1]``); every
position that is not a question holds ``IGNORE_INDEX`` (-100), so loss and accuracy count questions only.
``buckets[t]`` is the breakdown bucket of the question at ``t`` (-1 elsewhere); ``bucket_names()`` names them.
Answers come from a generator's ``answer_ids``; the ones that occur in an example are its candidates, and picking
one of them at random is the guessing floor (``guess_floor``) every table of the recall study shows.

Example ``i`` of a split is drawn from its own generator, ``SeedSequence(seed, spawn_key=(split, i))``: an
example does not depend on the batch size, the dataset size or the order it is read in, and the three splits
are disjoint streams of the same seed (``SPLIT_KEYS``). Nothing is downloaded or stored.

- **MQAR** (Zoology, Arora et al. 2023, ``zoology/data/associative_recall.py::multiquery_ar``): keys from
  ``[1, V/2)``, values from ``[V/2, V)``, ``D`` distinct keys (and distinct values) per example; the first
  ``2 D`` tokens are the pairs ``k_0 v_0 k_1 v_1 ...``; the query region after them has ``(L - 2 D) // 2``
  even slots, and key ``j`` is asked again in slot ``g_j`` (position ``2 D + 2 g_j``), the ``g_j`` drawn
  without replacement with ``P(g) ~ a (g + 1) ** (a - 1)`` (Zoology's ``power_a``; 0.01 favours short gaps);
  the label there is ``v_j``. Fillers differ from Zoology's ``random_non_queries`` (uniform over the whole
  vocabulary, so a filler can repeat a key or a value of the example): here they are drawn from the keys
  that are NOT among the example's pairs, so each key is asked exactly once and each answer occurs exactly
  once before its question; and the drawn slots go to the pairs in a random order (Zoology gives the first draw,
  most often the earliest slot, to the first pair: a model could then answer the first question with the first
  value without reading its key). Breakdown: the question's distance to its key in power-of-two buckets.
- **Needle** (RULER's multi-key, multi-query needle, byte level): ``K`` needles ``" <key>:<digit>."`` with distinct
  random keys and distinct digits at jittered depths of a repeated haystack, then ``Q`` questions
  ``" <key>:<digit>"``, each asking one of the needles; the label is the digit. Every needle's depth follows the
  same law and the asked needle is drawn uniformly, so without its key a model cannot tell which needle is asked
  (``guess_floor``: 1/K). Test examples put the needles at held-out depths. Breakdown: the asked needle's depth
  (``repeat`` for a needle asked again).
- **Selective copy** (Mamba, Gu & Dao 2023): ``K`` data tokens at random positions of a noise sequence, a
  separator, then the data tokens again, in order, as labels. Breakdown: the position in the copied output.
"""

from __future__ import annotations

from typing import Any, Sequence

import lightning as L
import numpy as np
import torch
from torch.utils.data import Dataset

from longseq.data.batching import SplitLoaders, device_batches
from longseq.data.text import IGNORE_INDEX
from longseq.utils.errors import ConfigError

SPLITS = ("train", "val", "test")
SPLIT_KEYS = {"train": 0, "val": 1, "test": 2}  # spawn-key prefix: the three splits never share a stream


def example_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The generator of example ``index`` of ``split``: independent of batch size, dataset size and order."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(SPLIT_KEYS[split], index)))


def _int(key: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ConfigError(key, f"must be an integer >= {low}, got {value!r}")
    return int(value)


def power_of_two_buckets(limit: int) -> list[str]:
    """Names of distance buckets ``[2^b, 2^(b+1))`` covering 1 .. limit - 1: ``1``, ``2-3``, ``4-7``, ..."""
    names = []
    for b in range(max(1, (limit - 1).bit_length())):
        lo, hi = 2 ** b, 2 ** (b + 1) - 1
        names.append(str(lo) if lo == hi else f"{lo}-{hi}")
    return names


def distance_bucket(distance: np.ndarray) -> np.ndarray:
    """Bucket index ``floor(log2(distance))`` of distances >= 1."""
    return np.floor(np.log2(distance)).astype(np.int64)


# ----------------------------------------------------------------------------------------------------
# Generators: one example from one generator


class RecallGenerator:
    """Base of the three generators: validated sizes plus ``example(rng, split) -> (inputs, labels, buckets)``.

    ``answer_ids`` are the tokens an answer is drawn from (MQAR's values, the needle's digits, the copied data
    tokens); those that occur in an example's inputs are its candidate answers."""

    bucket_kind = "bucket"  # what the breakdown is by (the metric key: <split>/acc_<kind>/<bucket>)
    answer_ids: np.ndarray

    def bucket_names(self) -> list[str]:
        raise NotImplementedError

    def example(self, rng: np.random.Generator, split: str = "train") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        raise NotImplementedError


class MqarGenerator(RecallGenerator):
    """Zoology's multi-query associative recall (module docstring). Constraints (Zoology's): ``V > L``,
    ``4 D <= L``, ``L`` even, and ``power_a`` in (0, 1]."""

    bucket_kind = "distance"

    def __init__(self, vocab_size: int, seq_len: int, num_pairs: int, power_a: float = 0.01) -> None:
        self.vocab_size = _int("task.vocab_size", vocab_size, 4)
        self.seq_len = _int("task.seq_len", seq_len, 4)
        self.num_pairs = _int("task.num_pairs", num_pairs, 1)
        if self.vocab_size <= self.seq_len:
            raise ConfigError("task.vocab_size", f"must exceed task.seq_len (MQAR needs V > L), got "
                                                 f"vocab_size={vocab_size} <= seq_len={seq_len}")
        if 4 * self.num_pairs > self.seq_len:
            raise ConfigError("task.num_pairs", f"4 x num_pairs must be <= task.seq_len (the pairs and their "
                                                f"questions must fit), got 4 x {num_pairs} > {seq_len}")
        if self.seq_len % 2:
            raise ConfigError("task.seq_len", f"must be even for MQAR (questions sit on even slots), got {seq_len}")
        if isinstance(power_a, bool) or not isinstance(power_a, (int, float)) or not 0 < power_a <= 1:
            raise ConfigError("task.power_a", f"must be a number in (0, 1] (1 = uniform gaps), got {power_a!r}")
        self.power_a = float(power_a)
        self.key_ids = np.arange(1, self.vocab_size // 2)
        self.value_ids = np.arange(self.vocab_size // 2, self.vocab_size)
        if len(self.key_ids) < self.num_pairs + 1:  # the fillers need at least one key outside the pairs
            raise ConfigError("task.vocab_size", f"must give more than num_pairs={num_pairs} keys in [1, V/2), got "
                                                 f"vocab_size={vocab_size}")
        self.space = (self.seq_len - 2 * self.num_pairs) // 2  # query slots after the pairs
        self.gap_p = gap_probabilities(self.space, self.power_a)

    def bucket_names(self) -> list[str]:
        return power_of_two_buckets(self.seq_len)

    @property
    def answer_ids(self) -> np.ndarray:
        return self.value_ids

    def example(self, rng: np.random.Generator, split: str = "train") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        D, L = self.num_pairs, self.seq_len
        chosen = rng.choice(len(self.key_ids), size=D, replace=False)
        keys = self.key_ids[chosen]
        values = rng.choice(self.value_ids, size=D, replace=False)
        gaps = rng.choice(self.space, size=D, replace=False, p=self.gap_p)
        asked = rng.permutation(D)  # the pair each drawn slot asks: the question order says nothing about the pair
        # Fillers: keys absent from this example (never a value, never one of its D keys).
        unused = np.ones(len(self.key_ids), dtype=bool)
        unused[chosen] = False
        fillers = self.key_ids[unused]
        inputs = fillers[rng.integers(0, len(fillers), size=L)]
        inputs[0:2 * D:2], inputs[1:2 * D:2] = keys, values
        where = 2 * D + 2 * gaps
        inputs[where] = keys[asked]
        labels = np.full(L, IGNORE_INDEX, dtype=np.int64)
        labels[where] = values[asked]
        buckets = np.full(L, -1, dtype=np.int64)
        buckets[where] = distance_bucket(where - 2 * asked)
        return inputs.astype(np.int64), labels, buckets


def gap_probabilities(space: int, power_a: float) -> np.ndarray:
    """Zoology's gap law over the ``space`` query slots: ``P(g) ~ a (g + 1) ** (a - 1)``, g = 0 .. space - 1."""
    p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
    return p / p.sum()


HAYSTACK = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
DIGITS = np.arange(ord("0"), ord("9") + 1)
REPEAT = "repeat"  # the needle's bucket of a question that asks a needle already asked (answerable from that question)


def _fractions(key: str, values: Any) -> list[float]:
    """A non-empty list of fractions in [0, 1], else a ``ConfigError`` naming ``key``."""
    values = list(values) if isinstance(values, (list, tuple, Sequence)) and not isinstance(values, str) else None
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1 for v in values):
        raise ConfigError(key, f"must be a non-empty list of fractions in [0, 1], got {values!r}")
    return [float(v) for v in values]


class NeedleGenerator(RecallGenerator):
    """Byte-level needles that must be matched by their key (module docstring); tokens are byte values (256).

    Layout of the ``L + 1`` bytes (inputs ``s[:L]``, labels ``s[1:]``): a haystack of ``F`` filler bytes with the
    ``K`` needles ``" <key>:<digit>."`` inserted, then ``Q`` questions ``" <key>:<digit>"``; the label at the byte
    before each question's digit is that digit. A needle's depth is a depth of ``depths`` (``test_depths`` in the
    test split: depths never seen in training) plus a uniform jitter of up to ``jitter``, clipped to [0, 1]; it
    enters the haystack after ``round(depth x F)`` filler bytes. Every needle's depth follows that same law, the keys
    are distinct, the digits distinct, and each question asks a needle drawn uniformly (with replacement), so the
    asked needle's position, depth and digit say nothing without its key. A question that asks a needle again is
    bucketed ``repeat``, not by depth: its answer also sits in the earlier question, a few bytes back.
    """

    bucket_kind = "depth"
    answer_ids = DIGITS

    def __init__(self, seq_len: int, depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
                 test_depths: Sequence[float] = (0.125, 0.375, 0.625, 0.875), jitter: float = 0.05,
                 num_needles: int = 4, num_questions: int = 4, key_len: int = 6, vocab_size: int = 256) -> None:
        self.seq_len = _int("task.seq_len", seq_len, 1)
        self.key_len = _int("task.key_len", key_len, 1)
        self.num_needles = _int("task.num_needles", num_needles, 1)
        self.num_questions = _int("task.num_questions", num_questions, 1)
        if self.num_needles > len(DIGITS):
            raise ConfigError("task.num_needles", f"must be <= 10: each needle carries its own digit, "
                                                  f"got {num_needles}")
        if vocab_size != 256:
            raise ConfigError("task.vocab_size", f"the needle task is byte-level: must be 256, got {vocab_size!r}")
        self.vocab_size = 256
        self.depths, self.test_depths = _fractions("task.depths", depths), _fractions("task.test_depths", test_depths)
        if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or not 0 <= jitter <= 0.5:
            raise ConfigError("task.depth_jitter", f"must be a fraction in [0, 0.5], got {jitter!r}")
        self.jitter = float(jitter)
        self.needle_len = len(self.needle("k" * self.key_len, "0"))
        self.question_len = len(self.question("k" * self.key_len, "0"))
        self.filler = self.seq_len + 1 - self.num_needles * self.needle_len - self.num_questions * self.question_len
        if self.filler < 8:
            need = self.seq_len + 8 - self.filler
            raise ConfigError("task.seq_len", f"must be >= {need} for {num_needles} needles and {num_questions} "
                                              f"questions of key_len={key_len} plus 8 haystack bytes, got {seq_len}")
        self.haystack = np.frombuffer(HAYSTACK.encode() * (self.filler // len(HAYSTACK) + 2), dtype=np.uint8)
        self.depth_names = sorted({*self.depths, *self.test_depths})

    # No space after the colon: the short conv then sees two key letters beside the digit, so one attention layer can
    # match the question's key (with ": " it saw one, and `full` sat at the 1/K floor for 600 steps in the pilot).
    @staticmethod
    def needle(key: str, digit: str) -> str:
        return f" {key}:{digit}."

    @staticmethod
    def question(key: str, digit: str) -> str:
        return f" {key}:{digit}"

    def bucket_names(self) -> list[str]:
        return [f"{d:g}" for d in self.depth_names] + [REPEAT]

    def example(self, rng: np.random.Generator, split: str = "train") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        K, Q, L = self.num_needles, self.num_questions, self.seq_len
        keys: set[bytes] = set()
        while len(keys) < K:
            keys.add(bytes(rng.integers(ord("a"), ord("z") + 1, size=self.key_len).astype(np.uint8)))
        names = sorted(keys)
        rng.shuffle(names)  # the set's order would follow the bytes
        digits = rng.choice(DIGITS, size=K, replace=False)
        grid = self.test_depths if split == "test" else self.depths
        base = rng.integers(len(grid), size=K)
        depth = np.clip(np.asarray(grid)[base] + rng.uniform(-self.jitter, self.jitter, size=K), 0.0, 1.0)
        offset = np.rint(depth * self.filler).astype(np.int64)
        start = int(rng.integers(len(HAYSTACK)))  # the haystack's phase varies: no position memorizes it
        hay = self.haystack[start:start + self.filler]
        parts, at = [], 0
        for i in np.argsort(offset, kind="stable"):
            needle = self.needle(names[i].decode(), chr(digits[i]))
            parts += [hay[at:offset[i]], np.frombuffer(needle.encode(), np.uint8)]
            at = offset[i]
        parts.append(hay[at:])
        asked = rng.integers(K, size=Q)
        parts += [np.frombuffer(self.question(names[i].decode(), chr(digits[i])).encode(), np.uint8) for i in asked]
        string = np.concatenate(parts).astype(np.int64)  # (L + 1,)
        inputs = string[:-1].copy()
        answers = L - self.question_len * np.arange(Q)[::-1]  # the byte before each question's digit, in inputs
        labels = np.full(L, IGNORE_INDEX, dtype=np.int64)
        labels[answers - 1] = string[answers]
        buckets = np.full(L, -1, dtype=np.int64)
        first = np.array([i not in asked[:q] for q, i in enumerate(asked)])
        buckets[answers - 1] = np.where(first, np.searchsorted(self.depth_names, np.asarray(grid)[base[asked]]),
                                        len(self.depth_names))
        return inputs, labels, buckets


class SelectiveCopyGenerator(RecallGenerator):
    """Mamba's selective copying (module docstring). Token ids: ``0`` the separator, ``[1, 1 + num_noise)``
    noise, ``[1 + num_noise, V)`` data (the marked tokens). The ``K`` data tokens sit at random distinct
    positions of the first ``L - K`` tokens; after the separator the model writes them in order."""

    bucket_kind = "index"
    SEP = 0

    def __init__(self, vocab_size: int, seq_len: int, num_tokens: int, num_noise: int = 1) -> None:
        self.vocab_size = _int("task.vocab_size", vocab_size, 3)
        self.seq_len = _int("task.seq_len", seq_len, 2)
        self.num_tokens = _int("task.num_tokens", num_tokens, 1)
        self.num_noise = _int("task.num_noise", num_noise, 1)
        if 1 + self.num_noise >= self.vocab_size:
            raise ConfigError("task.num_noise", f"must leave data tokens: 1 + num_noise < task.vocab_size, got "
                                                f"num_noise={num_noise}, vocab_size={vocab_size}")
        if 2 * self.num_tokens + 1 > self.seq_len:
            raise ConfigError("task.num_tokens", f"2 x num_tokens + 1 must be <= task.seq_len (the marked tokens, "
                                                 f"the separator and the copy), got num_tokens={num_tokens}, "
                                                 f"seq_len={seq_len}")

    def bucket_names(self) -> list[str]:
        return [str(k + 1) for k in range(self.num_tokens)]

    @property
    def answer_ids(self) -> np.ndarray:
        return np.arange(1 + self.num_noise, self.vocab_size)

    def example(self, rng: np.random.Generator, split: str = "train") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        K, L = self.num_tokens, self.seq_len
        body = L - K  # noise + marked tokens; then SEP at L - K and the copy (string length L + 1)
        data = rng.integers(1 + self.num_noise, self.vocab_size, size=K)
        where = np.sort(rng.choice(body, size=K, replace=False))
        string = rng.integers(1, 1 + self.num_noise, size=L + 1)
        string[where] = data
        string[body] = self.SEP
        string[body + 1:] = data
        inputs = string[:-1].astype(np.int64)
        labels = np.full(L, IGNORE_INDEX, dtype=np.int64)
        labels[body:] = data  # position body (SEP) predicts data[0], body + k predicts data[k]
        buckets = np.full(L, -1, dtype=np.int64)
        buckets[body:] = np.arange(K)
        return inputs, labels, buckets


# ----------------------------------------------------------------------------------------------------
# Datasets and datamodules


class RecallDataset(Dataset):
    """``size`` examples of ``split``, each generated when read (``example_rng(seed, split, i)``)."""

    def __init__(self, generator: RecallGenerator, size: int, seed: int, split: str) -> None:
        self.generator, self.size, self.seed, self.split = generator, size, seed, split

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        rng = example_rng(self.seed, self.split, index)
        return tuple(torch.from_numpy(a) for a in self.generator.example(rng, self.split))

    def tensors(self, count: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first ``count`` (default all) examples stacked: (N, L) inputs, labels, buckets."""
        rows = [self[i] for i in range(self.size if count is None else min(count, self.size))]
        return tuple(torch.stack(column) for column in zip(*rows))


class RecallDataModule(SplitLoaders, L.LightningDataModule):
    """Train / val / test recall examples generated from ``seed`` (subclasses build the generator).

    Args:
        batch_size: GLOBAL batch size, divided over devices and gradient accumulation in ``setup``.
        num_train, num_val, num_test: examples per split (``task.data.num_*``).
        seed: the data seed (``task.data.seed``); the splits are disjoint streams of it.
    """

    def __init__(self, batch_size: int = 64, accumulate_grad_batches: int = 1, num_train: int = 20_000,
                 num_val: int = 500, num_test: int = 1_000, seed: int = 0, eval_batch_size: int | None = None,
                 num_workers: int = 0) -> None:
        super().__init__()
        self.sizes = {split: _int(f"task.data.num_{split}", n, 1)
                      for split, n in zip(SPLITS, (num_train, num_val, num_test))}
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.accumulate_grad_batches, self.num_workers = accumulate_grad_batches, num_workers
        self.seed = _int("task.data.seed", seed, 0)
        self.generator = self.make_generator()
        self.datasets = {split: RecallDataset(self.generator, self.sizes[split], self.seed, split) for split in SPLITS}

    def make_generator(self) -> RecallGenerator:
        raise NotImplementedError

    def split_source(self, split: str) -> str:
        return f"{type(self).__name__}(seed={self.seed}, split={split})"

    def setup(self, stage: str | None = None) -> None:
        self.world_size, _, self.device_batch, self.device_eval_batch = device_batches(
            self.trainer, self.batch_size, self.eval_batch_size, self.accumulate_grad_batches)


class MqarDataModule(RecallDataModule):
    """``task=mqar``: Zoology's multi-query associative recall (``MqarGenerator``)."""

    def __init__(self, vocab_size: int, seq_len: int, num_pairs: int, power_a: float = 0.01, **kwargs: Any) -> None:
        self.args = dict(vocab_size=vocab_size, seq_len=seq_len, num_pairs=num_pairs, power_a=power_a)
        super().__init__(**kwargs)

    def make_generator(self) -> MqarGenerator:
        return MqarGenerator(**self.args)


class NeedleDataModule(RecallDataModule):
    """``task=needle``: byte-level needles matched by their key, among distractors (``NeedleGenerator``)."""

    def __init__(self, seq_len: int, depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
                 test_depths: Sequence[float] = (0.125, 0.375, 0.625, 0.875), jitter: float = 0.05,
                 num_needles: int = 4, num_questions: int = 4, key_len: int = 6, vocab_size: int = 256,
                 **kwargs: Any) -> None:
        self.args = dict(seq_len=seq_len, depths=depths, test_depths=test_depths, jitter=jitter,
                         num_needles=num_needles, num_questions=num_questions, key_len=key_len, vocab_size=vocab_size)
        super().__init__(**kwargs)

    def make_generator(self) -> NeedleGenerator:
        return NeedleGenerator(**self.args)


class SelectiveCopyDataModule(RecallDataModule):
    """``task=selective_copy``: Mamba's selective copying (``SelectiveCopyGenerator``)."""

    def __init__(self, vocab_size: int, seq_len: int, num_tokens: int, num_noise: int = 1, **kwargs: Any) -> None:
        self.args = dict(vocab_size=vocab_size, seq_len=seq_len, num_tokens=num_tokens, num_noise=num_noise)
        super().__init__(**kwargs)

    def make_generator(self) -> SelectiveCopyGenerator:
        return SelectiveCopyGenerator(**self.args)


GENERATORS = {"mqar": MqarGenerator, "needle": NeedleGenerator, "selective_copy": SelectiveCopyGenerator}


def chance_accuracy(generator: RecallGenerator) -> float:
    """Accuracy of the best guess that ignores the context: one of the ``answer_ids`` at random (MQAR ``2 / V``,
    the needle ``1/10``, selective copy ``1 / (V - 1 - num_noise)``)."""
    return 1.0 / len(generator.answer_ids)


def guess_floor(generator: RecallGenerator) -> float:
    """Accuracy of a model that answers with one of the example's candidates at random without reading the
    question's key: MQAR ``1 / D`` (its values), the needle ``1 / K`` (its needles' digits); selective copy has no
    such guess (its answers are the marked tokens in order): its chance."""
    if isinstance(generator, MqarGenerator):
        return 1.0 / generator.num_pairs
    if isinstance(generator, NeedleGenerator):
        return 1.0 / generator.num_needles
    return chance_accuracy(generator)
