"""Synthetic recall (``task=mqar|needle|selective_copy``): a causal model scored on its question positions.

Batches are ``(inputs, labels, buckets)`` of shape ``(B, L)`` from ``longseq.data.recall``: labels are
``IGNORE_INDEX`` except at the questions, ``buckets`` the breakdown bucket of each question (-1 elsewhere).
Only the question positions go through the output layer (with V = 8,192 the full ``(B, L, V)`` logits would
cost more than the two-layer model), so loss and accuracy count questions only.

Logs ``train/loss``, ``train/acc``, ``val/loss``, ``val/acc``, ``val/acc_best``, ``test/loss``, ``test/acc``, the
breakdown ``<split>/acc_<kind>/<bucket>`` (``kind``: ``distance`` for MQAR, ``depth`` for the needle, ``index`` for
selective copy; a bucket without a question that epoch is not logged), and where the answers come from:
``<split>/in_example`` (the share of answers that are one of the example's candidates, e.g. MQAR's values) and
``<split>/in_example_acc`` (how many of those are right: 1/D for a model that guesses among the values). At the end
of every validation and of the test the breakdown is also written to ``<run>/recall/<split>_by_<kind>[_step<N>].csv``
and drawn to the matching ``.png``, which goes to every logger (TensorBoard image, W&B image, a copy in the
CSV logger's folder), like the attention maps.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from torchmetrics import MaxMetric, Metric

from longseq.data.recall import GENERATORS
from longseq.data.text import IGNORE_INDEX
from longseq.tasks.base import SequenceTask, to_dict
from longseq.utils.errors import ConfigError

log = logging.getLogger(__name__)


class BucketAccuracy(Metric):
    """Correct and total predictions per bucket, summed over batches and ranks (DDP-correct).

    ``update(correct (N,) bool, buckets (N,) long)``; ``compute()`` is the overall accuracy,
    ``per_bucket()`` the ``(n_buckets,)`` accuracies (NaN where a bucket had no question) and counts.
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, n_buckets: int) -> None:
        super().__init__()
        self.n_buckets = n_buckets
        self.add_state("correct", default=torch.zeros(n_buckets, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("total", default=torch.zeros(n_buckets, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, correct: torch.Tensor, buckets: torch.Tensor) -> None:
        buckets = buckets.clamp(0, self.n_buckets - 1)
        self.correct += torch.bincount(buckets[correct], minlength=self.n_buckets)
        self.total += torch.bincount(buckets, minlength=self.n_buckets)

    def compute(self) -> torch.Tensor:
        return self.correct.sum().float() / self.total.sum().clamp(min=1).float()

    def per_bucket(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(accuracies, counts), each (n_buckets,); accuracy NaN where the count is 0."""
        total = self.total.float()
        acc = torch.where(total > 0, self.correct.float() / total.clamp(min=1), torch.full_like(total, float("nan")))
        return acc, self.total.clone()


class InExampleAnswers(Metric):
    """Where the answers come from: ``update(in_example (N,) bool, correct (N,) bool)`` per question;
    ``compute()`` -> (share of answers that are one of the example's candidates, accuracy among those)."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        for name in ("total", "in_example", "correct_in_example"):
            self.add_state(name, default=torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, in_example: torch.Tensor, correct: torch.Tensor) -> None:
        self.total += in_example.numel()
        self.in_example += in_example.sum()
        self.correct_in_example += (in_example & correct).sum()

    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        share = self.in_example.float() / self.total.clamp(min=1).float()
        return share, self.correct_in_example.float() / self.in_example.clamp(min=1).float()


class RecallTask(SequenceTask):
    """A causal backbone trained and scored on the question positions of a recall task.

    Args (beyond ``SequenceTask``'s model / attention / optimizer / scheduler):
        name: ``mqar``, ``needle`` or ``selective_copy`` (a key of ``longseq.data.recall.GENERATORS``).
        generator: the generator's arguments (the same task keys the datamodule gets); they give the
            vocabulary, the length and the breakdown buckets, and are validated here too (naming the key).
    """

    requires_causal = True

    def __init__(self, model: dict, attention: dict, optimizer: dict, scheduler: dict | None, name: str,
                 generator: dict) -> None:
        if name not in GENERATORS:
            raise ConfigError("task.module.name", f"{name!r} is not a recall task; valid: {sorted(GENERATORS)}")
        made = GENERATORS[name](**to_dict(generator))
        super().__init__(model, attention, optimizer, scheduler, vocab_size=made.vocab_size, seq_len=made.seq_len)
        self.bucket_kind, self.bucket_names, self.task_name = made.bucket_kind, made.bucket_names(), name
        n = len(self.bucket_names)
        self.train_acc, self.val_acc, self.test_acc = BucketAccuracy(n), BucketAccuracy(n), BucketAccuracy(n)
        self.val_answers, self.test_answers = InExampleAnswers(), InExampleAnswers()
        self.val_acc_best = MaxMetric()
        is_answer = torch.zeros(made.vocab_size, dtype=torch.bool)
        is_answer[torch.as_tensor(made.answer_ids)] = True
        self.register_buffer("is_answer", is_answer, persistent=False)

    def accuracy(self, split: str) -> BucketAccuracy:
        return getattr(self, f"{split}_acc")

    def question_logits(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L) inputs and labels -> (Q, V) logits at the Q question positions, and the mask (B, L)."""
        asked = labels != IGNORE_INDEX
        return self.net.head(self.net.features(inputs)[asked]), asked

    def step(self, split: str, batch) -> torch.Tensor:
        """Loss over the batch's questions; their correctness goes into the split's ``BucketAccuracy``
        (training: through the metric's forward, so ``train/acc`` is the batch's accuracy)."""
        inputs, labels, buckets = batch
        logits, asked = self.question_logits(inputs, labels)
        targets = labels[asked]
        loss = F.cross_entropy(logits.float(), targets)
        predicted = logits.argmax(-1)
        correct, where = predicted == targets, buckets[asked]
        if split == "train":
            self.train_acc(correct, where)
        else:
            self.accuracy(split).update(correct, where)
            rows = asked.nonzero()[:, 0]  # the example of each question
            in_example = self.is_answer[predicted] & (inputs[rows] == predicted[:, None]).any(-1)
            getattr(self, f"{split}_answers").update(in_example, correct)
        return loss

    def training_step(self, batch, batch_idx):
        loss = self.step("train", batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=False, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.step("val", batch), on_step=False, on_epoch=True)

    def test_step(self, batch, batch_idx):
        self.log("test/loss", self.step("test", batch), on_step=False, on_epoch=True)

    def log_split(self, split: str) -> torch.Tensor:
        """Log ``<split>/acc`` and the breakdown (already reduced over ranks), write its table and figure."""
        metric = self.accuracy(split)
        acc = metric.compute()
        per_bucket, counts = metric.per_bucket()
        metric.reset()
        self.log(f"{split}/acc", acc, prog_bar=True, sync_dist=False)
        answers = getattr(self, f"{split}_answers")
        share, precision = answers.compute()
        answers.reset()
        self.log(f"{split}/in_example", share, sync_dist=False)
        self.log(f"{split}/in_example_acc", precision, sync_dist=False)
        for name, value, count in zip(self.bucket_names, per_bucket.tolist(), counts.tolist()):
            if count:
                self.log(f"{split}/acc_{self.bucket_kind}/{name}", value, sync_dist=False)
        if self.trainer.is_global_zero:
            self.write_breakdown(split, per_bucket.tolist(), counts.tolist())
        return acc

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            self.val_acc.reset()
            self.val_answers.reset()
            return
        self.val_acc_best(self.log_split("val"))
        self.log("val/acc_best", self.val_acc_best.compute(), prog_bar=True)

    def on_test_epoch_end(self) -> None:
        self.log_split("test")

    def write_breakdown(self, split: str, accuracies: list[float], counts: list[int]) -> Path | None:
        """``<run>/recall/<split>_by_<kind>[_step<N>].csv`` and ``.png``; the figure goes to every logger."""
        root = getattr(self.trainer, "default_root_dir", None)
        if root is None:
            return None
        folder = Path(root) / "recall"
        folder.mkdir(parents=True, exist_ok=True)
        step = self.trainer.global_step
        stem = f"{split}_by_{self.bucket_kind}" + ("" if split == "test" else f"_step{step}")
        rows = [(n, a, c) for n, a, c in zip(self.bucket_names, accuracies, counts) if c]
        with open(folder / f"{stem}.csv", "w") as f:
            f.write(f"{self.bucket_kind},acc,questions\n")
            f.writelines(f"{n},{a:.6f},{c}\n" for n, a, c in rows)
        try:
            pixels = self.draw_breakdown(folder / f"{stem}.png", rows, f"{self.task_name} {split} accuracy by "
                                                                       f"{self.bucket_kind} (step {step})")
        except Exception as error:  # a figure must never fail a run (a headless backend missing a font, ...)
            log.warning(f"recall breakdown figure not drawn: {error}")
            return folder / f"{stem}.csv"
        key = f"recall/{split}_by_{self.bucket_kind}"
        for logger in self.trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image(key=key, images=[pixels], step=step)
            elif isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image(key, pixels, step, dataformats="HWC")
            elif isinstance(logger, CSVLogger):
                target = Path(logger.log_dir) / "recall"
                target.mkdir(parents=True, exist_ok=True)
                for suffix in (".csv", ".png"):
                    (target / f"{stem}{suffix}").write_bytes((folder / f"{stem}{suffix}").read_bytes())
        return folder / f"{stem}.csv"

    def draw_breakdown(self, path: Path, rows: list[tuple[str, float, int]], title: str):
        """A bar chart of accuracy per bucket (question counts on the bars) saved to ``path``; its pixels."""
        import matplotlib.pyplot as plt

        from longseq.callbacks.attention_maps import figure_to_array

        fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(rows) + 2), 3.2))
        names = [r[0] for r in rows]
        bars = ax.bar(range(len(rows)), [r[1] for r in rows], color="tab:blue")
        for bar, (_, _, count) in zip(bars, rows):
            ax.annotate(str(count), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)), names, rotation=45 if len(rows) > 8 else 0, fontsize=8)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel(self.bucket_kind)
        ax.set_ylabel("accuracy")
        ax.set_title(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        pixels = figure_to_array(fig)
        plt.close(fig)
        return pixels
