"""Language-modeling data: each corpus split is one contiguous token stream cut into windows.

A split is a 1-D token array (an ``.npy`` file memory-mapped from ``data/<task>/``, or the raw byte file
itself for enwik8/text8). Batches are ``(inputs, targets)`` LongTensors of shape ``(B, seq_len)`` with
``targets[t] = stream[start + t + 1]``:

- training: non-overlapping windows of ``seq_len + 1`` tokens at stride ``seq_len``, shuffled;
- evaluation: the targets ``stream[1:]`` tiled by consecutive windows, so every token of the split except
  the first (which has no context) is scored exactly once, i.e. ``len(split) - 1`` tokens; the last window
  is padded and its padded targets are ``IGNORE_INDEX`` (padding keeps every window at ``seq_len``, the
  length every block-structured attention was built for; causal attention keeps real positions blind to
  the padding after them).

Byte corpora (enwik8, text8) download their standard zip with urllib; the Hugging Face corpora
(WikiText-103, Wiki-40B, C4) go through ``datasets``. Without network every download fails within seconds
with a message saying which file or folder to place where.
"""

from __future__ import annotations

import math
import os
import socket
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from longseq.data.batching import device_batches
from longseq.data.validation import MIN_EVAL_TOKENS, check_file_not_empty, check_split_size
from longseq.utils.errors import DataError

SPLITS = ("train", "val", "test")
HF_SPLIT_NAMES = {"train": "train", "val": "validation", "test": "test"}
IGNORE_INDEX = -100  # target value of padded positions (F.cross_entropy's default ignore_index)
DOWNLOAD_TIMEOUT_S = 10.0
HF_HUB_HOST = "huggingface.co"


def split_bounds(n_tokens: int, eval_fraction: float = 0.05, source: str | Path = "<token stream>"
                 ) -> dict[str, tuple[int, int]]:
    """``[start, stop)`` of train / val / test in a stream of ``n_tokens``: the last ``2 x eval_fraction`` is
    held out, val first then test (enwik8's 90M / 5M / 5M for 100M bytes, proportional for any other size).
    A stream too short for three parts of at least 2 tokens is a ``DataError`` naming ``source``."""
    n_eval = int(round(n_tokens * eval_fraction))
    n_train = n_tokens - 2 * n_eval
    if n_eval < 2 or n_train < 2:
        raise DataError(source, f"{n_tokens:,} tokens are too few for a {1 - 2 * eval_fraction:.0%}/"
                                f"{eval_fraction:.0%}/{eval_fraction:.0%} train/val/test split (each part needs at "
                                "least 2 tokens)")
    return {"train": (0, n_train), "val": (n_train, n_train + n_eval), "test": (n_train + n_eval, n_tokens)}


def load_token_cache(path: Path) -> np.ndarray:
    """Memory-map a ``.npy`` token cache the project wrote; a damaged one is a ``DataError`` saying to delete it
    (the next run rebuilds it from the source dataset)."""
    check_file_not_empty(path, "token cache")
    try:
        return np.load(path, mmap_mode="r")
    except (ValueError, EOFError, OSError) as err:
        raise DataError(path, f"is not a readable .npy token cache ({type(err).__name__}: {err}): delete it and run "
                              "again to rebuild it") from None


def stream_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds ids ``< vocab_size`` (halves the cache of 32k-piece corpora)."""
    return np.dtype(np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.int32)


class TrainWindows(Dataset):
    """Windows ``stream[i*L : i*L + L + 1]`` split into ``(inputs, targets)``, each ``(L,)`` long."""

    def __init__(self, stream: np.ndarray, seq_len: int) -> None:
        self.stream, self.seq_len = stream, seq_len
        self.n_windows = max(0, (len(stream) - 1) // seq_len)

    def __len__(self) -> int:
        return self.n_windows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.seq_len
        chunk = torch.from_numpy(np.asarray(self.stream[start : start + self.seq_len + 1], dtype=np.int64))
        return chunk[:-1], chunk[1:]


class EvalWindows(Dataset):
    """Scores every target ``stream[1:]`` exactly once: window ``i`` predicts ``stream[i*L + 1 : i*L + L + 1]``.

    The final window is right-padded (inputs with ``pad_id``, targets with ``IGNORE_INDEX``).
    ``n_scored == len(stream) - 1`` (the datamodule checks the split has at least 2 tokens).
    """

    def __init__(self, stream: np.ndarray, seq_len: int, pad_id: int = 0) -> None:
        self.stream, self.seq_len, self.pad_id = stream, seq_len, pad_id
        self.n_scored = max(0, len(stream) - 1)
        self.n_windows = math.ceil(self.n_scored / seq_len)

    def __len__(self) -> int:
        return self.n_windows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, L = i * self.seq_len, self.seq_len
        chunk = torch.from_numpy(np.asarray(self.stream[start : start + L + 1], dtype=np.int64))
        n = len(chunk) - 1
        inputs = torch.full((L,), self.pad_id, dtype=torch.long)
        targets = torch.full((L,), IGNORE_INDEX, dtype=torch.long)
        inputs[:n], targets[:n] = chunk[:-1], chunk[1:]
        return inputs, targets


class EvalShardSampler(DistributedSampler):
    """Rank ``r`` of ``w`` gets windows ``r, r + w, ...``: unlike ``DistributedSampler`` it never pads with
    repeated windows, so under DDP every token is still scored exactly once (the metrics sum across ranks)."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)

    def indices(self) -> range:
        return range(self.rank, len(self.dataset), self.num_replicas)

    def __iter__(self):
        return iter(self.indices())

    def __len__(self) -> int:
        return len(self.indices())


class TokenStreamDataModule(L.LightningDataModule):
    """Base of the causal-LM datamodules: subclasses implement ``load_split(split) -> 1-D token array``
    (and ``prepare_data`` to download / tokenize once).

    Args:
        data_dir: root data folder (``paths.data_dir``); each corpus uses ``<data_dir>/<task>/``.
        seq_len: window length (``task.seq_len``).
        vocab_size: model vocabulary (``task.vocab_size``); every token id must be below it.
        batch_size: GLOBAL batch size; divided over devices and gradient accumulation.
        accumulate_grad_batches: the trainer's accumulation (for the per-device batch).
        eval_batch_size: GLOBAL batch size of validation / test (defaults to ``batch_size``).
        num_workers: DataLoader workers.
        seed: seed of anything the datamodule draws itself.
    """

    name = "text"

    def __init__(self, data_dir: str = "data", seq_len: int = 256, vocab_size: int = 256, batch_size: int = 16,
                 accumulate_grad_batches: int = 1, eval_batch_size: int | None = None, num_workers: int = 0,
                 seed: int = 0) -> None:
        super().__init__()
        self.data_dir = Path(data_dir)
        self.seq_len, self.vocab_size = int(seq_len), int(vocab_size)
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.accumulate_grad_batches = accumulate_grad_batches
        self.num_workers, self.seed = num_workers, seed
        self.streams: dict[str, np.ndarray] = {}

    @property
    def root(self) -> Path:
        return self.data_dir / self.name

    def load_split(self, split: str) -> np.ndarray:
        raise NotImplementedError

    def split_source(self, split: str) -> Path:
        """The file (or folder) ``split`` is read from, named in data errors."""
        return self.root

    def setup(self, stage: str | None = None) -> None:
        self.world_size, self.rank, self.device_batch, self.device_eval_batch = device_batches(
            self.trainer, self.batch_size, self.eval_batch_size, self.accumulate_grad_batches
        )
        for split in SPLITS:
            if split not in self.streams:
                stream = self.load_split(split)
                if len(stream) and int(stream.max()) >= self.vocab_size:
                    raise DataError(self.split_source(split), f"the {split} split has token id {int(stream.max())} "
                                    f">= task.vocab_size={self.vocab_size}")
                self.streams[split] = stream

    def check_train_split(self) -> None:
        """The training split must fill one batch of windows on every device (a last partial batch is dropped)."""
        windows = self.world_size * self.device_batch
        need = windows * self.seq_len + 1
        check_split_size(
            self.split_source("train"), "train", len(self.streams["train"]), minimum=need,
            needs=f"one training batch: {windows} window(s) of task.seq_len={self.seq_len} + 1 = {need:,} tokens "
                  f"(task.batch_size over {self.world_size} device(s) and trainer.accumulate_grad_batches)",
            hint="use a longer corpus, a smaller task.seq_len or a smaller task.batch_size")

    def check_eval_split(self, split: str) -> None:
        """An evaluation split needs one scored token; under one window or ``MIN_EVAL_TOKENS`` it is suspicious."""
        check_split_size(self.split_source(split), split, len(self.streams[split]), minimum=2,
                         needs="2 tokens (one scored target after the first token)",
                         warn_below=max(self.seq_len + 1, MIN_EVAL_TOKENS))

    def scored_tokens(self, split: str) -> int:
        """Number of targets an evaluation pass over ``split`` scores (``len(split) - 1``)."""
        return EvalWindows(self.streams[split], self.seq_len).n_scored

    def train_dataloader(self) -> DataLoader:
        self.check_train_split()
        return DataLoader(TrainWindows(self.streams["train"], self.seq_len), batch_size=self.device_batch,
                          shuffle=True, drop_last=True, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)

    def eval_dataloader(self, split: str) -> DataLoader:
        self.check_eval_split(split)
        windows = EvalWindows(self.streams[split], self.seq_len)
        sampler = EvalShardSampler(windows, self.world_size, self.rank) if self.world_size > 1 else None
        return DataLoader(windows, batch_size=self.device_eval_batch, sampler=sampler, shuffle=False,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        return self.eval_dataloader("val")

    def test_dataloader(self) -> DataLoader:
        return self.eval_dataloader("test")


# ----------------------------------------------------------------------------------------------------
# Byte / character corpora: enwik8, text8 (or any local file through task.data.path)


def offline_requested() -> bool:
    return any(os.environ.get(k, "").lower() in {"1", "true", "yes"} for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def download(url: str, destination: Path, timeout: float = DOWNLOAD_TIMEOUT_S) -> None:
    """Fetch ``url`` into ``destination`` (through a ``.part`` file, so a broken transfer leaves nothing)."""
    partial = destination.with_suffix(destination.suffix + ".part")
    destination.parent.mkdir(parents=True, exist_ok=True)
    with urllib.request.urlopen(url, timeout=timeout) as response, open(partial, "wb") as out:
        while chunk := response.read(1 << 20):
            out.write(chunk)
    partial.rename(destination)


class ByteCorpusDataModule(TokenStreamDataModule):
    """A 100M-byte Hutter-prize style corpus: the file's bytes, split 90% / 5% / 5% (train / val / test).

    Looks for ``<data_dir>/<name>/<member>`` (the raw file), else extracts it from
    ``<data_dir>/<name>/<member>.zip``, else downloads that zip from ``url``.

    Args (beyond ``TokenStreamDataModule``'s):
        path: any local byte file to use instead (same proportional 90/5/5 split; no size check).
        download: allow the download when the files are missing.
        verify_size: check that the standard file has its published size (``expected_bytes``).
        drop_newlines: drop byte 10 from every split after splitting (Transformer-XL's enwik8 convention,
            which is then bits per non-newline byte); the default scores every byte.
    """

    member = ""
    url = ""
    expected_bytes = 100_000_000

    def __init__(self, *args: Any, path: str | None = None, download: bool = True, verify_size: bool = True,
                 drop_newlines: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.path = Path(path).expanduser() if path else None
        self.download, self.verify_size, self.drop_newlines = download, verify_size, drop_newlines
        self.check_local_file()  # at construction: a bad task.data.path fails before any run set-up

    def check_local_file(self) -> None:
        """``task.data.path``, when set, must name an existing, non-empty file."""
        if self.path is None:
            return
        if not self.path.is_file():
            raise FileNotFoundError(f"task.data.path={self.path} does not exist")
        check_file_not_empty(self.path, "corpus file (task.data.path)")

    @property
    def raw_file(self) -> Path:
        return self.path if self.path is not None else self.root / self.member

    @property
    def archive(self) -> Path:
        return self.root / f"{self.member}.zip"

    def split_source(self, split: str) -> Path:
        return self.raw_file

    def missing_message(self, reason: str) -> str:
        return (f"{self.member} not found: {reason}. Download {self.url} and place it at {self.archive} (or its "
                f"extracted file at {self.root / self.member}), set task.data.data_dir to a folder holding "
                f"{self.name}/{self.member}.zip, or train on a local file with task.data.path=<file>.")

    def prepare_data(self) -> None:
        self.check_data()

    def check_data(self) -> None:
        """The raw byte file is on disk (extracted from its zip, which is downloaded first when allowed) and its size
        can be split (``corpus_size``); else an error saying what to place where. The pre-flight calls this before
        the run directory exists."""
        self.fetch()
        self.corpus_size()

    def corpus_size(self) -> int:
        """Bytes in the corpus file: not empty, of the standard size (``task.data.verify_size``; not for a
        ``task.data.path`` file) and enough for the train / val / test split (``split_bounds``)."""
        size = check_file_not_empty(self.raw_file, "corpus file").stat().st_size
        if self.path is None and self.verify_size and size != self.expected_bytes:
            raise DataError(self.raw_file, f"has {size} bytes, the standard {self.member} has "
                                           f"{self.expected_bytes} (task.data.verify_size=false accepts it)")
        split_bounds(size, source=self.raw_file)
        return size

    def fetch(self) -> None:
        """Make sure the raw byte file exists: extract the zip, downloading it first when allowed."""
        if self.path is not None:
            self.check_local_file()
            return
        if self.raw_file.is_file():
            return
        if not self.archive.is_file():
            if not self.download:
                raise FileNotFoundError(self.missing_message(f"no {self.archive} and task.data.download=false"))
            if offline_requested():
                raise FileNotFoundError(self.missing_message("offline mode (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE) is set"))
            try:
                download(self.url, self.archive)
            except Exception as err:  # URLError, timeout, HTTP error: tell the user what to place where
                # from None: the message carries the cause; a second traceback would add nothing.
                raise FileNotFoundError(self.missing_message(f"the download failed ({type(err).__name__}: {err})")) from None
        check_file_not_empty(self.archive, "zip archive")
        try:
            with zipfile.ZipFile(self.archive) as archive:
                if self.member not in archive.namelist():
                    raise FileNotFoundError(self.missing_message(f"{self.archive} has no member '{self.member}'"))
                archive.extract(self.member, self.root)
        except zipfile.BadZipFile as err:
            raise DataError(self.archive, f"is not a readable zip archive ({err}): delete it to download it again, "
                                          f"or place the extracted file at {self.root / self.member}") from None

    def encode(self, raw: np.ndarray) -> np.ndarray:
        """Bytes -> token ids (identity for byte-level corpora)."""
        return raw

    def load_split(self, split: str) -> np.ndarray:
        self.fetch()
        start, stop = split_bounds(self.corpus_size(), source=self.raw_file)[split]
        raw = np.memmap(self.raw_file, dtype=np.uint8, mode="r")
        part = raw[start:stop]
        if self.drop_newlines:
            part = part[part != ord("\n")]
        return self.encode(part)


class Enwik8DataModule(ByteCorpusDataModule):
    """enwik8: the first 10^8 bytes of an English Wikipedia XML dump, 256 byte values, metric bits per byte."""

    name = "enwik8"
    member = "enwik8"
    url = "http://mattmahoney.net/dc/enwik8.zip"


TEXT8_ALPHABET = " abcdefghijklmnopqrstuvwxyz"


class Text8DataModule(ByteCorpusDataModule):
    """text8: 10^8 characters of cleaned Wikipedia (lower-case a-z and space), 27 symbols: space = 0, a-z = 1..26."""

    name = "text8"
    member = "text8"
    url = "http://mattmahoney.net/dc/text8.zip"

    def encode(self, raw: np.ndarray) -> np.ndarray:
        table = np.full(256, 255, dtype=np.uint8)
        table[np.frombuffer(TEXT8_ALPHABET.encode(), dtype=np.uint8)] = np.arange(len(TEXT8_ALPHABET), dtype=np.uint8)
        ids = table[np.asarray(raw)]
        if (ids == 255).any():
            bad = sorted(set(np.asarray(raw)[ids == 255][:1000].tolist()))
            raise DataError(self.raw_file, f"task=text8 takes only lower-case a-z and space; the file has byte "
                                           f"values {bad[:10]}: use task=enwik8 for arbitrary bytes")
        return ids


# ----------------------------------------------------------------------------------------------------
# Hugging Face corpora


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers at all (``datasets`` itself retries for ~30 s before failing)."""
    try:
        socket.create_connection((HF_HUB_HOST, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_hf_split(saved_dir: Path, hub_name: str, hub_config: str, split: str, cache_dir: Path,
                  streaming: bool = False) -> Any:
    """One split (``train`` / ``val`` / ``test``, or the dataset's own split name) of a Hugging Face dataset.

    Reads ``saved_dir`` (a ``DatasetDict.save_to_disk`` folder) when it exists, which is also how an
    offline machine gets the data; else ``datasets.load_dataset(hub_name, hub_config)`` (cached in
    ``cache_dir``). Without network this fails at once with a message naming ``saved_dir``.
    """
    import datasets

    hf_split = HF_SPLIT_NAMES.get(split, split)  # our names (val) or the dataset's own (validation)
    if saved_dir.is_dir():
        saved = datasets.load_from_disk(str(saved_dir))
        if hf_split not in saved:
            raise FileNotFoundError(f"{saved_dir} has splits {list(saved)}, not '{hf_split}'")
        return saved[hf_split].to_iterable_dataset() if streaming else saved[hf_split]
    check_hf_source(saved_dir, hub_name, hub_config, cache_dir)
    try:
        return datasets.load_dataset(hub_name, hub_config, split=hf_split, streaming=streaming,
                                     cache_dir=str(cache_dir))
    except Exception as err:
        # from None: the message carries the cause; datasets' own traceback would bury the instructions.
        raise FileNotFoundError(f"{hub_name} ({hub_config}) could not be loaded ({type(err).__name__}: {err}); "
                                f"no saved copy at {saved_dir}. {hf_instructions(saved_dir, hub_name, hub_config)}"
                                ) from None


def hf_instructions(saved_dir: Path, hub_name: str, hub_config: str) -> str:
    """How to place a Hugging Face dataset at ``saved_dir`` from a machine with network."""
    return (f"On a machine with network run: python -c \"import datasets; datasets.load_dataset('{hub_name}', "
            f"'{hub_config}').save_to_disk('{saved_dir.name}')\" and copy the folder {saved_dir.name}/ to {saved_dir} "
            "(or set task.data.data_dir to a folder that holds it; with the Hugging Face cache already populated, "
            "set HF_DATASETS_OFFLINE=1).")


def check_hf_source(saved_dir: Path, hub_name: str, hub_config: str, cache_dir: Path) -> None:
    """A Hugging Face dataset can be read: a saved copy at ``saved_dir``, or in offline mode (``HF_DATASETS_OFFLINE``
    / ``HF_HUB_OFFLINE``) its cache in ``cache_dir``, or else a reachable Hub; otherwise a ``FileNotFoundError``
    saying how to place it (``datasets`` itself would retry for tens of seconds before failing)."""
    if saved_dir.is_dir():
        return
    how = hf_instructions(saved_dir, hub_name, hub_config)
    if offline_requested():
        if cache_dir.is_dir():
            return
        raise FileNotFoundError(f"{hub_name} ({hub_config}) not found: offline mode is set and there is neither a "
                                f"saved copy at {saved_dir} nor a cache at {cache_dir}. {how}")
    if not hub_reachable():
        raise FileNotFoundError(f"{hub_name} ({hub_config}) not found: no saved copy at {saved_dir} and the "
                                f"Hugging Face Hub ({HF_HUB_HOST}) is unreachable. {how}")


# ----------------------------------------------------------------------------------------------------
# SentencePiece (Wiki-40B, C4): ids 0..3 are pad, unk, bos, eos; then control symbols, then the newline piece


PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


def train_sentencepiece(sentences: Any, model_path: Path, vocab_size: int, control_symbols: tuple[str, ...] = (),
                        max_sentences: int = 5_000_000, seed_sentencepiece_size: int = 1_000_000) -> Any:
    """Train a unigram SentencePiece model on an iterator of sentences, save it to ``model_path`` and
    return the loaded processor.

    Newlines are a piece of their own and whitespace is kept as is, so decoding gives back the text
    (paragraph structure included) rather than a whitespace-normalized copy.

    At most ``max_sentences`` sentences are sampled (shuffled) from the iterator. The vocabulary is
    ``vocab_size`` pieces unless the text is too small to support that many (tiny fixtures), in which
    case it is smaller: the model's embedding only needs ``vocab_size >= pieces``.
    """
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size, model_type="unigram",
        character_coverage=0.9995, input_sentence_size=max_sentences, shuffle_input_sentence=True,
        seed_sentencepiece_size=seed_sentencepiece_size, pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID,
        eos_id=EOS_ID, control_symbols=list(control_symbols), user_defined_symbols=["\n"],
        remove_extra_whitespaces=False, hard_vocab_limit=False, num_threads=os.cpu_count() or 1,
        minloglevel=2,
    )
    model_path.parent.mkdir(parents=True, exist_ok=True)
    model_path.write_bytes(model.getvalue())
    return spm.SentencePieceProcessor(model_file=str(model_path))


def load_sentencepiece(model_path: Path) -> Any:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(model_path))
