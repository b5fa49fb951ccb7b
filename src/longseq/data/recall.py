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
  ``[1, V/2)``, values from ``[V/2, V)``, ``D`` distinct keys (and distinct values) per example, each pair
  ``k v`` on one two-token slot (``L / 2`` slots), each key asked again once later on an even position; the label
  there is its value. Where the pairs and questions sit is ``placement``:

  - ``start`` (Zoology's, the default): the pairs fill the first ``D`` slots; the query region after them has
    ``(L - 2 D) // 2`` slots, and key ``j`` is asked in slot ``g_j`` of it, the ``g_j`` drawn without replacement with
    ``P(g) ~ a (g + 1) ** (a - 1)`` (Zoology's ``power_a``; 0.01 favours short gaps);
  - ``scattered``: the pairs sit on ``D`` random slots of the first half of the sequence (its other slots are
    fillers) and the questions in the second half, at the same power-law gaps from its start: every question
    still comes after every pair, but a pair may sit anywhere before them (the pairs at the start made one pair a
    region of several Combiner partitions, so that a query-independent summary could point at it);
  - ``spread`` (pairs and questions interleaved over the whole sequence): ``2 D`` random slots, paired at random,
    the earlier of each couple holding a pair and the later a question, which asks a pair drawn uniformly among the
    pairs before it (with replacement: a key may be asked twice or not at all); the gaps come from the interleaving
    (``power_a`` must be 1), and the guessing floor is ``1 / (pairs before the question)`` on average.

  Fillers (``filler``): ``unused_keys`` (the default) draws them from the keys that are NOT among the example's
  pairs, so each key is asked exactly once and each answer occurs exactly once before its question; ``vocab``
  draws them uniformly from the whole vocabulary except the example's own keys, values included (Zoology's
  ``random_non_queries``, which also allows the example's keys: left out here so that a key still occurs once
  before its question and a question has one answer), so a value token no longer marks a pair. The drawn slots
  go to the pairs in a random order (Zoology gives the first draw, most often the earliest slot, to the first
  pair: a model could then answer the first question with the first value without reading its key). Breakdown:
  the question's distance to its key in power-of-two buckets.
- **Needle** (RULER's multi-key, multi-query needle, byte level): ``K`` needles ``" <key>:<value>."`` with distinct
  random keys and distinct one-byte values (digits; beyond 10 needles digits and the capitals the haystack does not
  use, up to 34) in a repeated haystack, and ``Q`` questions ``" <key>:<value>"``, each asking one of the needles;
  the label is the value. Every needle's position follows the same law and the asked needle is drawn uniformly, so
  without its key a model cannot tell which needle is asked (``guess_floor``: 1/K). ``placement``: ``start``
  (the default, the original task) puts the needles at jittered depths of a grid (held-out depths in the test
  split) and the questions at the end; ``scattered`` puts each needle at a uniform random depth, questions at the
  end; ``spread`` puts each question at a uniform random point after the needle it asks, interleaved with the
  needles. Breakdown: the asked needle's depth (its grid depth, or its quarter of the haystack; ``repeat`` for a
  needle asked again).
- **Selective copy** (Mamba, Gu & Dao 2023): ``K`` data tokens at random positions of a noise sequence, a
  separator, then the data tokens again, in order, as labels. Breakdown: the position in the copied output.
"""

from __future__ import annotations

import functools
import json
from typing import Any, NamedTuple, Sequence

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


class RecallExample(NamedTuple):
    """One generated example, each ``(L,)`` int64: ``inputs``, ``labels`` (``IGNORE_INDEX`` except at questions),
    ``buckets`` (-1 except at questions) and ``source``: at each question the position in ``inputs`` of the token
    that holds its answer (MQAR: the asked pair's value; the needle: the asked needle's value byte), -1 elsewhere.
    The datasets use the first three; ``source`` is what the recall study's structural column reads
    (``longseq.report.recall_structure``)."""

    inputs: np.ndarray
    labels: np.ndarray
    buckets: np.ndarray
    source: np.ndarray


PLACEMENTS = ("start", "scattered", "spread")  # task.placement: where the facts and the questions sit


def _choice(key: str, value: Any, valid: Sequence[str]) -> str:
    if value not in valid:
        raise ConfigError(key, f"{value!r} is not valid; choose one of {', '.join(valid)}")
    return value


class RecallGenerator:
    """Base of the three generators: validated sizes plus ``draw(rng, split) -> RecallExample``; ``example`` is its
    ``(inputs, labels, buckets)``.

    ``answer_ids`` are the tokens an answer is drawn from (MQAR's values, the needle's digits, the copied data
    tokens); those that occur in an example's inputs are its candidate answers."""

    bucket_kind = "bucket"  # what the breakdown is by (the metric key: <split>/acc_<kind>/<bucket>)
    answer_ids: np.ndarray

    def bucket_names(self) -> list[str]:
        raise NotImplementedError

    def draw(self, rng: np.random.Generator, split: str = "train") -> RecallExample:
        raise NotImplementedError

    def example(self, rng: np.random.Generator, split: str = "train") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return tuple(self.draw(rng, split)[:3])


MQAR_FILLERS = ("unused_keys", "vocab")  # task.filler


class MqarGenerator(RecallGenerator):
    """Zoology's multi-query associative recall (module docstring). Constraints (Zoology's): ``V > L``,
    ``4 D <= L``, ``L`` even, and ``power_a`` in (0, 1] (1 with ``placement=spread``)."""

    bucket_kind = "distance"

    def __init__(self, vocab_size: int, seq_len: int, num_pairs: int, power_a: float = 0.01,
                 placement: str = "start", filler: str = "unused_keys") -> None:
        self.vocab_size = _int("task.vocab_size", vocab_size, 4)
        self.seq_len = _int("task.seq_len", seq_len, 4)
        self.num_pairs = _int("task.num_pairs", num_pairs, 1)
        self.placement = _choice("task.placement", placement, PLACEMENTS)
        self.filler = _choice("task.filler", filler, MQAR_FILLERS)
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
        if self.placement == "spread" and power_a != 1:
            raise ConfigError("task.power_a", f"must be 1 with task.placement=spread (its gaps come from the random "
                                              f"interleaving of pairs and questions), got {power_a!r}")
        self.power_a = float(power_a)
        self.key_ids = np.arange(1, self.vocab_size // 2)
        self.value_ids = np.arange(self.vocab_size // 2, self.vocab_size)
        if len(self.key_ids) < self.num_pairs + 1:  # the fillers need at least one key outside the pairs
            raise ConfigError("task.vocab_size", f"must give more than num_pairs={num_pairs} keys in [1, V/2), got "
                                                 f"vocab_size={vocab_size}")
        slots = self.seq_len // 2
        # start: the pairs' slots, then the query slots; scattered: the first half's slots hold the pairs (4 D <= L
        # gives both halves at least D slots); spread: every slot
        self.context = {"start": self.num_pairs, "scattered": slots // 2, "spread": slots}[self.placement]
        self.space = slots - self.context  # query slots after the context (start: (L - 2 D) // 2)
        self.gap_p = gap_probabilities(self.space, self.power_a) if self.space else None

    def bucket_names(self) -> list[str]:
        return power_of_two_buckets(self.seq_len)

    @property
    def answer_ids(self) -> np.ndarray:
        return self.value_ids

    def draw(self, rng: np.random.Generator, split: str = "train") -> RecallExample:
        D, L = self.num_pairs, self.seq_len
        chosen = rng.choice(len(self.key_ids), size=D, replace=False)
        keys = self.key_ids[chosen]
        values = rng.choice(self.value_ids, size=D, replace=False)
        if self.placement == "spread":
            pair_slot, question_slot, asked = self.interleave(rng)
        else:  # the random draws in start's order (the original generator's: start reproduces its examples)
            pair_slot = np.arange(D) if self.placement == "start" else None
            gaps = rng.choice(self.space, size=D, replace=False, p=self.gap_p)
            asked = rng.permutation(D)  # the pair each drawn slot asks: the question order says nothing about the pair
            question_slot = self.context + gaps
        inputs = self.fillers(rng, chosen, keys)
        if pair_slot is None:  # scattered: after the fillers, so start's draws stay the original's
            pair_slot = rng.choice(self.context, size=D, replace=False)
        key_at = 2 * pair_slot
        inputs[key_at], inputs[key_at + 1] = keys, values
        where = 2 * question_slot
        inputs[where] = keys[asked]
        labels = np.full(L, IGNORE_INDEX, dtype=np.int64)
        labels[where] = values[asked]
        buckets = np.full(L, -1, dtype=np.int64)
        buckets[where] = distance_bucket(where - key_at[asked])
        source = np.full(L, -1, dtype=np.int64)
        source[where] = key_at[asked] + 1
        return RecallExample(inputs.astype(np.int64), labels, buckets, source)

    def interleave(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``spread``: ``2 D`` random slots, paired at random into couples whose earlier slot holds a pair and the later
        a question (so every question has a pair before it); each question asks a pair drawn uniformly among the pairs
        before it, with replacement (a pair may be asked twice or not at all: which pairs were asked says nothing
        about the next question, and the latest pair is no likelier than the others). Returns the pairs' slots, the
        questions' slots (both sorted) and the pair each question asks."""
        D = self.num_pairs
        slots = np.sort(rng.choice(self.context, size=2 * D, replace=False))
        is_pair = np.zeros(2 * D, dtype=bool)
        is_pair[rng.permutation(2 * D).reshape(D, 2).min(axis=1)] = True
        pair_slot, question_slot = slots[is_pair], slots[~is_pair]
        before = np.searchsorted(pair_slot, question_slot)  # pairs before each question (>= 1)
        return pair_slot, question_slot, rng.integers(0, before)

    def key_blind_floor(self, count: int = 2000) -> float:
        """The accuracy of a model that picks, without the question's key, one of the pairs it may be asking: every
        pair at the start or scattered (``1 / D``); with ``spread`` the pairs before the question, ``1 / (pairs before
        it)`` averaged over the questions of ``count`` examples (its own random stream, seed 0)."""
        if self.placement != "spread":
            return 1.0 / self.num_pairs
        rng = np.random.default_rng(np.random.SeedSequence(0, spawn_key=(len(SPLIT_KEYS),)))
        shares = [1.0 / np.searchsorted(pair_slot, question_slot)
                  for pair_slot, question_slot, _ in (self.interleave(rng) for _ in range(count))]
        return float(np.mean(shares))

    def fillers(self, rng: np.random.Generator, chosen: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """``(L,)`` filler tokens (``filler``): keys absent from this example (never a value, never one of its D keys),
        or any token but the example's keys (values included)."""
        if self.filler == "unused_keys":
            unused = np.ones(len(self.key_ids), dtype=bool)
            unused[chosen] = False
            pool = self.key_ids[unused]
        else:
            pool = np.setdiff1d(np.arange(self.vocab_size), keys, assume_unique=True)
        return pool[rng.integers(0, len(pool), size=self.seq_len)]


def gap_probabilities(space: int, power_a: float) -> np.ndarray:
    """Zoology's gap law over the ``space`` query slots: ``P(g) ~ a (g + 1) ** (a - 1)``, g = 0 .. space - 1."""
    p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
    return p / p.sum()


HAYSTACK = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
DIGITS = np.arange(ord("0"), ord("9") + 1)
# Values of more than 10 needles: the digits, then the capitals the haystack never shows (so a value byte in an example
# is always a needle's or a question's).
NEEDLE_VALUES = np.concatenate([DIGITS, [c for c in range(ord("A"), ord("Z") + 1) if chr(c) not in HAYSTACK]])
QUARTERS = ("0-0.25", "0.25-0.5", "0.5-0.75", "0.75-1")  # the depth buckets of scattered and spread needles
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
    ``K`` needles ``" <key>:<value>."`` and the ``Q`` questions ``" <key>:<value>"`` inserted; the label at the byte
    before each question's value is that value. Each question asks a needle drawn uniformly (with replacement); the
    keys are distinct, the values distinct (``values``: the digits for up to 10 needles, else ``NEEDLE_VALUES``).
    Where they sit (``placement``): ``start`` (the original task): a needle's depth is a depth of ``depths``
    (``test_depths`` in the test split: depths never seen in training) plus a uniform jitter of up to ``jitter``,
    clipped to [0, 1]; it enters the haystack after ``round(depth x F)`` filler bytes; the questions follow the
    haystack. ``scattered``: every depth uniform in [0, 1], in every split; the questions at the end. ``spread``:
    depths as ``scattered``, and each question after ``round(u x F)`` filler bytes, ``u`` uniform between its needle's
    depth and 1, so questions and needles interleave. In every layout a needle's position follows the same law for
    every needle, so the asked needle's position, depth and value say nothing without its key. A question that asks
    a needle again is bucketed ``repeat``, not by depth: its answer also sits in the earlier question.
    """

    bucket_kind = "depth"

    def __init__(self, seq_len: int, depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
                 test_depths: Sequence[float] = (0.125, 0.375, 0.625, 0.875), jitter: float = 0.05,
                 num_needles: int = 4, num_questions: int = 4, key_len: int = 6, vocab_size: int = 256,
                 placement: str = "start") -> None:
        self.seq_len = _int("task.seq_len", seq_len, 1)
        self.key_len = _int("task.key_len", key_len, 1)
        self.num_needles = _int("task.num_needles", num_needles, 1)
        self.num_questions = _int("task.num_questions", num_questions, 1)
        self.placement = _choice("task.placement", placement, PLACEMENTS)
        if self.num_needles > len(NEEDLE_VALUES):
            raise ConfigError("task.num_needles", f"must be <= {len(NEEDLE_VALUES)}: each needle carries its own "
                                                  f"value byte (digits, then capitals), got {num_needles}")
        self.values = DIGITS if self.num_needles <= len(DIGITS) else NEEDLE_VALUES
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

    @property
    def answer_ids(self) -> np.ndarray:
        return self.values

    # No space after the colon: the short conv then sees two key letters beside the digit, so one attention layer can
    # match the question's key (with ": " it saw one, and `full` sat at the 1/K floor for 600 steps in the pilot).
    @staticmethod
    def needle(key: str, digit: str) -> str:
        return f" {key}:{digit}."

    @staticmethod
    def question(key: str, digit: str) -> str:
        return f" {key}:{digit}"

    def bucket_names(self) -> list[str]:
        depths = [f"{d:g}" for d in self.depth_names] if self.placement == "start" else list(QUARTERS)
        return depths + [REPEAT]

    def draw(self, rng: np.random.Generator, split: str = "train") -> RecallExample:
        K, Q, L, F = self.num_needles, self.num_questions, self.seq_len, self.filler
        keys: set[bytes] = set()
        while len(keys) < K:
            keys.add(bytes(rng.integers(ord("a"), ord("z") + 1, size=self.key_len).astype(np.uint8)))
        names = sorted(keys)
        rng.shuffle(names)  # the set's order would follow the bytes
        values = rng.choice(self.values, size=K, replace=False)
        if self.placement == "start":
            grid = self.test_depths if split == "test" else self.depths
            base = rng.integers(len(grid), size=K)
            depth = np.clip(np.asarray(grid)[base] + rng.uniform(-self.jitter, self.jitter, size=K), 0.0, 1.0)
            bucket = np.searchsorted(self.depth_names, np.asarray(grid)[base])
        else:
            depth = rng.uniform(0.0, 1.0, size=K)
            bucket = np.minimum((depth * len(QUARTERS)).astype(np.int64), len(QUARTERS) - 1)
        offset = np.rint(depth * F).astype(np.int64)
        phase = int(rng.integers(len(HAYSTACK)))  # the haystack's phase varies: no position memorizes it
        asked = rng.integers(K, size=Q)
        if self.placement == "spread":
            asked_at = np.rint(rng.uniform(depth[asked], 1.0) * F).astype(np.int64)
        else:
            asked_at = np.full(Q, F, dtype=np.int64)  # after the haystack, in the order asked
        pieces = [self.needle(names[i].decode(), chr(values[i])) for i in range(K)]
        pieces += [self.question(names[i].decode(), chr(values[i])) for i in asked]
        string, starts = insert_pieces(self.haystack[phase:phase + F], np.concatenate([offset, asked_at]),
                                       np.r_[np.zeros(K, np.int64), np.ones(Q, np.int64)], pieces)
        inputs = string[:-1].copy()  # (L,)
        value_at = 1 + self.key_len + 1  # " key:" before the value byte
        answers = starts[K:] + value_at  # each question's value byte in the string
        labels = np.full(L, IGNORE_INDEX, dtype=np.int64)
        labels[answers - 1] = string[answers]
        buckets = np.full(L, -1, dtype=np.int64)
        first = np.array([i not in asked[:q] for q, i in enumerate(asked)])
        buckets[answers - 1] = np.where(first, bucket[asked], len(self.bucket_names()) - 1)
        source = np.full(L, -1, dtype=np.int64)
        source[answers - 1] = starts[asked] + value_at
        return RecallExample(inputs, labels, buckets, source)


def insert_pieces(hay: np.ndarray, offsets: np.ndarray, kinds: np.ndarray,
                  pieces: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``hay`` with each piece inserted after ``offsets[e]`` of its bytes (ties: lower ``kinds`` first, then the
    pieces' order) -> (the int64 string, each piece's start in it). One concatenation; a loop over pieces only."""
    order = np.lexsort((np.arange(len(pieces)), kinds, offsets))
    parts, at = [], 0
    for e in order:
        parts += [hay[at:offsets[e]], np.frombuffer(pieces[e].encode(), np.uint8)]
        at = offsets[e]
    parts.append(hay[at:])
    lengths = np.array([len(pieces[e]) for e in order], dtype=np.int64)
    starts = np.empty(len(pieces), dtype=np.int64)
    starts[order] = offsets[order] + np.cumsum(lengths) - lengths
    return np.concatenate(parts).astype(np.int64), starts


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

    def draw(self, rng: np.random.Generator, split: str = "train") -> RecallExample:
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
        source = np.full(L, -1, dtype=np.int64)
        source[body:] = where
        return RecallExample(inputs, labels, buckets, source)


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

    def drawn(self, count: int | None = None) -> RecallExample:
        """The first ``count`` (default all) examples as one ``RecallExample`` of (N, L) arrays, sources included."""
        rows = [self.generator.draw(example_rng(self.seed, self.split, i), self.split)
                for i in range(self.size if count is None else min(count, self.size))]
        return RecallExample(*(np.stack(column) for column in zip(*rows)))


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

    def __init__(self, vocab_size: int, seq_len: int, num_pairs: int, power_a: float = 0.01, placement: str = "start",
                 filler: str = "unused_keys", **kwargs: Any) -> None:
        self.args = dict(vocab_size=vocab_size, seq_len=seq_len, num_pairs=num_pairs, power_a=power_a,
                         placement=placement, filler=filler)
        super().__init__(**kwargs)

    def make_generator(self) -> MqarGenerator:
        return MqarGenerator(**self.args)


class NeedleDataModule(RecallDataModule):
    """``task=needle``: byte-level needles matched by their key, among distractors (``NeedleGenerator``)."""

    def __init__(self, seq_len: int, depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
                 test_depths: Sequence[float] = (0.125, 0.375, 0.625, 0.875), jitter: float = 0.05,
                 num_needles: int = 4, num_questions: int = 4, key_len: int = 6, vocab_size: int = 256,
                 placement: str = "start", **kwargs: Any) -> None:
        self.args = dict(seq_len=seq_len, depths=depths, test_depths=test_depths, jitter=jitter,
                         num_needles=num_needles, num_questions=num_questions, key_len=key_len, vocab_size=vocab_size,
                         placement=placement)
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


def distances(generator: RecallGenerator, count: int = 2000, seed: int = 0, split: str = "train") -> np.ndarray:
    """Every question's distance to the token just before its answer (``source`` - 1: MQAR's key, the needle's colon
    after its key) over the first ``count`` examples of ``split``: the distances a short window must cover."""
    drawn = RecallDataset(generator, count, seed, split).drawn()
    rows, where = np.nonzero(drawn.source >= 0)
    return where - (drawn.source[rows, where] - 1)


def covering_window(generator: RecallGenerator, share: float, count: int = 2000) -> int:
    """The smallest power of two ``w`` such that at least ``share`` of the questions have their key closer than ``w``
    tokens (distance < w): the short control's window (``local_short``), so that it can learn from a stated share of
    the questions whatever the placement (a power of two: the per-distance buckets split exactly at it)."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ConfigError("recall_short_share", f"must be a fraction in (0, 1], got {share!r}")
    found = np.sort(distances(generator, count))
    needed = found[min(len(found) - 1, int(np.ceil(share * len(found))) - 1)]  # this many within distance <= needed
    return 1 << int(needed).bit_length()  # the smallest power of two above it


@functools.lru_cache(maxsize=64)
def _cached_window(name: str, arguments: str, share: float) -> int:
    return covering_window(GENERATORS[name](**json.loads(arguments)), share)


def recall_window(module: Any, share: float) -> int:
    """The ``recall_window`` resolver (``${recall_window:${task.module},${recall_short_share}}``): ``covering_window``
    of the task's own generator (``task.module``: its name and arguments), computed once per task and share."""
    from omegaconf import OmegaConf

    module = OmegaConf.to_container(module, resolve=True) if OmegaConf.is_config(module) else dict(module)
    return _cached_window(module["name"], json.dumps(module["generator"], sort_keys=True), float(share))


def chance_accuracy(generator: RecallGenerator) -> float:
    """Accuracy of the best guess that ignores the context: one of the ``answer_ids`` at random (MQAR ``2 / V``,
    the needle ``1/10``, selective copy ``1 / (V - 1 - num_noise)``)."""
    return 1.0 / len(generator.answer_ids)


def guess_floor(generator: RecallGenerator) -> float:
    """Accuracy of a model that answers with one of the example's candidates at random without reading the
    question's key: MQAR ``1 / D`` (its values), the needle ``1 / K`` (its needles' digits); selective copy has no
    such guess (its answers are the marked tokens in order): its chance. MQAR with ``placement=spread``: only the
    pairs before the question are candidates (``MqarGenerator.key_blind_floor``)."""
    if isinstance(generator, MqarGenerator):
        return generator.key_blind_floor()
    if isinstance(generator, NeedleGenerator):
        return 1.0 / generator.num_needles
    return chance_accuracy(generator)
