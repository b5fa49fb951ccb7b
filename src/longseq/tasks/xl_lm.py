"""Transformer-XL language modeling with carried memory, and TRAMS evaluation side by side.

Selected by ``model=transformer_xl`` (its config sets ``task.module._target_`` to ``XLLanguageModel``) on any
token-stream LM task: ``python train.py task=enwik8 model=transformer_xl`` or ``experiment=enwik8/xl_base``.

Data: the task's datamodule supplies the split streams (``datamodule.streams[split]``, 1-D token arrays);
this module replaces its window loaders by Transformer-XL's ordered iteration: the split is trimmed to a
multiple of ``bsz`` and cut into ``bsz`` contiguous streams, batches are consecutive time slices of all
streams, memory is carried from one slice to the next, and every token except the first of each stream is
scored exactly once (segment-boundary tokens are predicted from memory).

Evaluation runs one or two memory settings over the same batches, each with its own memory:
``xl`` (``memory.eval_mem_len``) and, with ``memory.selection=trams``, ``trams`` (pool ``memory.pool`` = M,
``memory.recent_keep`` + ``memory.topk`` = m keys per head). Logged: ``<split>/<metric>`` (xl),
``<split>/trams_<metric>``, the average attention probability the queries put on memory keys
(``<split>/mem_mass``, ``<split>/trams_mem_mass``), ``<split>/nll`` and ``<split>/tokens``; the test split also
prints them side by side in one table (the TRAMS paper's Table 1).

Pretrained models: ``task.module.init_from=hf:<dir>`` / ``kimiyoung:<state dict>`` imports a released
checkpoint (``longseq.models.xl_import``) with its vocabulary; the datamodule's token ids are then mapped to
the checkpoint's ids through the symbols (WikiText-103 words, enwik8 bytes as decimal strings).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Iterator

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset
from torchmetrics import MinMetric, SumMetric

from longseq.data.text import ByteCorpusDataModule
from longseq.models.trams import TramsSpec
from longseq.models.transformer_xl import MemorySpec, TransformerXL
from longseq.models.xl_import import import_checkpoint, model_ids, parse_init_from
from longseq.tasks.base import SequenceTask, to_dict
from longseq.tasks.lm import METRICS, from_nll
from longseq.tasks.metrics import MeanNLL
from longseq.utils.checkpoint import check_model_matches, read_checkpoint
from longseq.utils.errors import ConfigError

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
LOSS_PROTOCOLS = ("xl_next_token", "hf_in_segment_shift")
SELECTIONS = ("none", "trams")


def data_symbols(dm: Any) -> list[str]:
    """The symbol of every token id the datamodule emits: its word list, or the decimal byte values of a
    byte corpus (how Transformer-XL's enwik8 vocabulary spells bytes)."""
    if callable(getattr(dm, "vocabulary", None)):
        return dm.vocabulary()
    if isinstance(dm, ByteCorpusDataModule):
        return [str(b) for b in range(256)]
    raise ConfigError("task.module.init_from", "a checkpoint with its own vocabulary needs a task whose tokens "
                                               f"have symbols (wikitext103, enwik8, text8); {type(dm).__name__} "
                                               "has none")


class StreamSegments(IterableDataset):
    """Transformer-XL's ordered iterator over one split.

    The stream is trimmed to a multiple of ``n_streams`` and reshaped to ``(n_streams, n_step)`` (row b =
    the b-th contiguous chunk); this rank reads rows ``[first, first + rows)``. Yields ``(inputs, targets)``
    LongTensors ``(rows, <= tgt_len)``: ``inputs = data[:, i:i+n]``, ``targets = data[:, i+1:i+n+1]``, the
    last slice shorter. ``hf_in_segment_shift`` ignores the last target of every slice (the released TRAMS /
    HF protocol, which never predicts the first token of a segment).
    """

    def __init__(self, stream: np.ndarray, n_streams: int, tgt_len: int, first: int = 0,
                 rows: int | None = None, loss_protocol: str = "xl_next_token") -> None:
        if loss_protocol not in LOSS_PROTOCOLS:
            raise ValueError(f"memory.loss_protocol={loss_protocol!r} is not valid; "
                             f"choose one of {LOSS_PROTOCOLS}")
        self.n_step = len(stream) // n_streams
        if self.n_step < 2:
            raise ValueError(f"a split of {len(stream)} tokens is too short for {n_streams} streams")
        rows = n_streams if rows is None else rows
        self.data = stream[: self.n_step * n_streams].reshape(n_streams, self.n_step)[first : first + rows]
        self.tgt_len, self.loss_protocol = tgt_len, loss_protocol

    def __len__(self) -> int:
        return math.ceil((self.n_step - 1) / self.tgt_len)

    @property
    def n_scored(self) -> int:
        """Targets scored by one pass (``xl_next_token``): every token but the first of each stream."""
        return len(self.data) * (self.n_step - 1)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, self.n_step - 1, self.tgt_len):
            n = min(self.tgt_len, self.n_step - 1 - start)
            chunk = torch.from_numpy(np.asarray(self.data[:, start : start + n + 1], dtype=np.int64))
            inputs, targets = chunk[:, :-1], chunk[:, 1:].clone()
            if self.loss_protocol == "hf_in_segment_shift":
                targets[:, -1] = IGNORE_INDEX
            yield inputs, targets


class XLLanguageModel(L.LightningModule):
    """Transformer-XL LM: trains with segment recurrence, evaluates XL (and TRAMS) with streaming memory.

    Args:
        model: ``conf/model/transformer_xl.yaml`` (sizes, dropout, pre_lnorm, same_length, clamp_len,
            tgt_len, cutoffs, tie_weight).
        attention: must be ``full`` and causal (the relative attention is built in).
        optimizer, scheduler: as for every task.
        memory: ``memory:`` of the same file (mem_len, mem_init, eval_* lengths, selection, TRAMS knobs).
        vocab_size, seq_len, metric: from the LM task (``seq_len`` is unused: segments are ``tgt_len``).
        num_levels, image_shape: accepted so ``model=transformer_xl`` composes with an image task, which
            then fails at setup (no token streams).
        init_from: weights loaded at construction (evaluate under other memory settings): a Lightning
            checkpoint of this project (``experiment=enwik8/xl_trams``), or a released Transformer-XL,
            ``hf:<dir>`` / ``kimiyoung:<state dict>`` (``experiment=wikitext103/trams_pretrained``).
    """

    def __init__(self, model: dict, attention: dict, optimizer: dict, scheduler: dict | None, memory: dict,
                 vocab_size: int | None = None, seq_len: int | None = None, metric: str = "bpc",
                 num_levels: int | None = None, image_shape: Any = None,
                 init_from: str | None = None) -> None:
        super().__init__()
        # logger=False: the runner logs the whole resolved config once; Lightning re-wrote every logger's hparams.yaml
        # at each stage (fit, validate, test: 0.15 s each on a 2-core CPU, a fifth of a tiny run)
        self.save_hyperparameters(logger=False)
        model, attention, memory = dict(to_dict(model)), dict(to_dict(attention)), dict(to_dict(memory))
        if attention.get("name") != "full" or not attention.get("causal", False):
            raise ValueError(f"model=transformer_xl has its own causal relative attention; attention="
                             f"{attention.get('name')} (causal={attention.get('causal')}) is not supported: "
                             "use attention=full with attention.causal=true")
        if metric not in METRICS:
            raise ValueError(f"task.module.metric={metric!r} is not valid; choose one of {METRICS}")
        vocab = model.pop("vocab_size", None) or vocab_size or num_levels  # model.vocab_size: a checkpoint's
        if not vocab:
            raise ValueError("model=transformer_xl needs task.module.vocab_size")
        self.metric, self.tgt_len = metric, int(model.pop("tgt_len"))
        same_length, clamp_len = bool(model.pop("same_length")), int(model.pop("clamp_len"))
        model.pop("_target_", None)
        self.net = TransformerXL(vocab_size=vocab, **model)
        self.eval_tgt_len = int(memory.get("eval_tgt_len") or self.tgt_len)
        self.loss_protocol = memory.get("loss_protocol", "xl_next_token")
        self.train_spec = MemorySpec(int(memory["mem_len"]), memory["mem_init"], same_length, clamp_len)
        eval_base = MemorySpec(int(memory["eval_mem_len"]), memory["mem_init"],
                               bool(memory["eval_same_length"]), int(memory["eval_clamp_len"]))
        self.eval_specs = {"xl": eval_base}
        selection = memory.get("selection", "none")
        if selection not in SELECTIONS:
            raise ValueError(f"memory.selection={selection!r} is not valid; choose one of {SELECTIONS}")
        if selection == "trams":
            trams = TramsSpec(int(memory["recent_keep"]), int(memory["topk"]), memory["score"],
                              memory["positions"])
            self.eval_specs["trams"] = eval_base.with_(mem_len=int(memory["pool"]), trams=trams)
        keys = [f"{split}_{name}" for split in ("val", "test") for name in self.eval_specs]
        self.nll = torch.nn.ModuleDict({key: MeanNLL() for key in keys})
        self.mass = torch.nn.ModuleDict({key: MeanNLL() for key in keys})  # attention mass on memory
        self.tokens = torch.nn.ModuleDict({s: SumMetric() for s in ("val", "test")})
        self.best = MinMetric()
        self.results: dict[str, dict[str, float]] = {}  # last logged split: evaluator -> metric, nll, mem_mass
        self.mems: dict[str, list[torch.Tensor] | None] = {}
        self.vocabulary: list[str] | None = None  # the imported checkpoint's symbols, by id
        self.model_streams: dict[str, np.ndarray] = {}
        if init_from and parse_init_from(init_from):
            self.vocabulary = import_checkpoint(init_from, self.net).vocabulary
        elif init_from:
            state = read_checkpoint(init_from, key="task.module.init_from")
            check_model_matches(state, self, init_from, key="task.module.init_from")
            self.load_state_dict(state["state_dict"])
            log.info(f"loaded weights from {init_from}")

    # ------------------------------------------------------------------------------------------ data

    def setup(self, stage: str) -> None:
        """Replace the datamodule's window loaders by ordered stream loaders over its token streams."""
        dm = self.trainer.datamodule if self.trainer is not None else None
        if dm is None or not hasattr(dm, "streams"):
            raise ValueError("model=transformer_xl trains on token streams (task=enwik8|text8|wikitext103|"
                             f"wiki40b); datamodule {type(dm).__name__} has none")

        def loader(split: str, global_streams: int, tgt_len: int) -> DataLoader:
            world, rank = getattr(dm, "world_size", 1), getattr(dm, "rank", 0)
            rows = global_streams // world
            protocol = "xl_next_token" if split == "train" else self.loss_protocol
            data = StreamSegments(self.model_stream(dm, split), rows * world, tgt_len, first=rank * rows,
                                  rows=rows, loss_protocol=protocol)
            return DataLoader(data, batch_size=None, num_workers=0)

        def train_dataloader() -> DataLoader:
            return loader("train", dm.batch_size // dm.accumulate_grad_batches, self.tgt_len)

        def val_dataloader() -> DataLoader:
            return loader("val", dm.eval_batch_size, self.eval_tgt_len)

        def test_dataloader() -> DataLoader:
            return loader("test", dm.eval_batch_size, self.eval_tgt_len)

        dm.train_dataloader, dm.val_dataloader = train_dataloader, val_dataloader
        dm.test_dataloader = test_dataloader

    def model_stream(self, dm: Any, split: str) -> np.ndarray:
        """The datamodule's split in the model's token ids (mapped through the symbols once per split when
        the weights came with their own vocabulary)."""
        if self.vocabulary is None:
            return dm.streams[split]
        if split not in self.model_streams:
            self.model_streams[split] = model_ids(dm.streams[split], data_symbols(dm), self.vocabulary,
                                                  f"{type(dm).__name__} split '{split}'")
        return self.model_streams[split]

    # -------------------------------------------------------------------------------------- training

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        mems = self.mems.get("train")
        if batch_idx == 0 or mems is None or mems[0].shape[0] != inputs.shape[0]:
            mems = None  # a new pass over the streams
        hidden, self.mems["train"] = self.net(inputs, mems, self.train_spec)
        nll = self.net.nll(hidden, targets)
        loss = nll.sum() / (targets >= 0).sum().clamp(min=1)
        self.log("train/loss", loss, prog_bar=True)
        self.log(f"train/{self.metric}", from_nll(loss.detach(), self.metric), prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        return SequenceTask.configure_optimizers(self)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log("train/lr", optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def score_segment(self, name: str, inputs: torch.Tensor, targets: torch.Tensor, first: bool) -> dict:
        """Run evaluator ``name`` on one slice with its carried memory -> nll sum, count, memory mass."""
        spec = self.eval_specs[name]
        mems = None if first else self.mems.get(name)
        stats: dict = {}
        hidden, self.mems[name] = self.net(inputs, mems, spec, stats)
        nll = self.net.nll(hidden, targets)
        return {"nll": nll.double().sum(), "count": (targets >= 0).sum(), "mass": stats["mem_mass"],
                "queries": stats["queries"]}

    def evaluation_step(self, split: str, batch, batch_idx: int) -> None:
        inputs, targets = batch
        for name in self.eval_specs:
            out = self.score_segment(name, inputs, targets, first=batch_idx == 0)
            self.nll[f"{split}_{name}"].update(out["nll"], out["count"])
            self.mass[f"{split}_{name}"].update(out["mass"], out["queries"])
            if name == "xl":
                self.tokens[split].update(out["count"])

    def log_split(self, split: str) -> torch.Tensor:
        primary = None
        self.results = {}
        for name in self.eval_specs:
            nll_metric, mass_metric = self.nll[f"{split}_{name}"], self.mass[f"{split}_{name}"]
            nll, mass = nll_metric.compute(), mass_metric.compute()
            nll_metric.reset()
            mass_metric.reset()
            prefix = f"{split}/" if name == "xl" else f"{split}/{name}_"
            value = from_nll(nll, self.metric)
            self.log(f"{prefix}{self.metric}", value, prog_bar=True)
            self.log(f"{prefix}nll", nll)
            self.log(f"{prefix}mem_mass", mass)
            self.results[name] = {self.metric: float(value), "nll": float(nll), "mem_mass": float(mass)}
            if name == "xl":
                primary = value
        self.log(f"{split}/tokens", self.tokens[split].compute().float())
        self.tokens[split].reset()
        return primary

    def validation_step(self, batch, batch_idx):
        self.evaluation_step("val", batch, batch_idx)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            for metric in (*self.nll.values(), *self.mass.values(), *self.tokens.values()):
                metric.reset()
            return
        self.best(self.log_split("val"))
        self.log(f"val/{self.metric}_best", self.best.compute(), prog_bar=True)

    def test_step(self, batch, batch_idx):
        self.evaluation_step("test", batch, batch_idx)

    def on_test_epoch_end(self) -> None:
        self.log_split("test")
        if self.trainer.is_global_zero:
            print_comparison(self.results, self.eval_specs, self.eval_tgt_len, self.metric)


    # ------------------------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, n_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None, progress: bool = False) -> torch.Tensor:
        """Continue ``prompt`` (B, P) model token ids by ``n_tokens`` sampled tokens -> (B, n_tokens).

        Generates through Transformer-XL's own memory (the evaluation setting ``memory.eval_mem_len``): the
        prompt is one segment, then every new token is a one-token segment attending to the carried memory,
        so the context is the last ``eval_mem_len`` tokens plus the current one. Dropout is off.
        """
        from longseq.models.transformer import eval_mode
        from longseq.tasks.sampling import check_sampling, pick_next, progress_bar

        check_sampling(temperature, top_k)
        spec = self.eval_specs["xl"]
        tokens = prompt.to(self.device)
        out = torch.empty(tokens.shape[0], n_tokens, dtype=torch.long, device=self.device)
        with eval_mode(self.net), progress_bar(progress) as bar:
            task = bar.add_task(f"generating {n_tokens} tokens (XL memory {spec.mem_len})", total=out.numel())
            mems = None
            for i in range(n_tokens):
                hidden, mems = self.net(tokens, mems, spec)
                out[:, i] = pick_next(self.net.output.log_prob(hidden[:, -1]), temperature, top_k, generator)
                tokens = out[:, i : i + 1]
                bar.advance(task, out.shape[0])
        return out


def memory_description(spec: MemorySpec, tgt_len: int) -> str:
    """``M`` / ``m`` / ``n`` of one evaluator, as the TRAMS paper names them."""
    if spec.trams is None:
        return f"XL memory {spec.mem_len}, n={tgt_len}"
    t = spec.trams
    return (f"pool M={spec.mem_len}, m={t.recent_keep + t.topk} ({t.recent_keep} newest + top-{t.topk} by "
            f"{t.score} score), n={tgt_len}")


def print_comparison(results: dict[str, dict[str, float]], specs: dict[str, MemorySpec], tgt_len: int,
                     metric: str) -> None:
    """XL and TRAMS side by side with the attention mass on memory (the TRAMS paper's Table 1)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="test: memory settings side by side")
    for column in ("evaluator", "memory", metric, "nll", "mem_mass"):
        table.add_column(column, justify="left" if column in ("evaluator", "memory") else "right")
    for name, values in results.items():
        table.add_row(name, memory_description(specs[name], tgt_len), f"{values[metric]:.4f}",
                      f"{values['nll']:.4f}", f"{values['mem_mass']:.4f}")
    Console().print(table)
