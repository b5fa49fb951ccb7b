"""Sequence classification (Long Range Arena): a bidirectional encoder, pooled, then an MLP head.

Inputs are token batches from ``longseq.data.lra`` (``PAD_ID`` = 0 pads variable-length documents). Pooling:

- ``cls``: a learned CLS token (id ``vocab_size``, an extra embedding row) is prepended and its final state
  classifies, so the model length ``seq_len`` is the document length + 1;
- ``mean``: the average of the final states of the real (non-padded) positions.

With ``padded=True`` the encoder gets ``key_padding_mask = tokens == PAD_ID`` (True = pad), so the attention
must declare ``supports_padding_mask``; others are rejected when the module is built. Image-like tasks
(``padded=False``) keep pixel value 0 as an ordinary token (LRA's ``token > 0`` mask, which hides black
pixels, is not reproduced).

Retrieval (``dual=True``) encodes both documents with the same (shared-weight) encoder, pools them to
``u, v`` and classifies ``[u, v, u*v, u-v]`` (LRA's ``interaction='NLI'``) with Dense-ReLU-Dense-ReLU-Dense.
Logs ``train/loss``, ``train/acc``, ``val/acc``, ``val/acc_best``, ``test/acc`` (torchmetrics accuracy).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics import MaxMetric
from torchmetrics.classification import MulticlassAccuracy

from longseq.data.lra.common import PAD_ID
from longseq.tasks.base import SequenceTask, to_dict
from longseq.utils.errors import ConfigError

POOLINGS = ("cls", "mean")


class ClassificationTask(SequenceTask):
    """LRA classifier on the shared backbone (``attention.causal=false``).

    Args (beyond ``SequenceTask``'s model / attention / optimizer / scheduler):
        vocab_size: data vocabulary including ``PAD_ID`` (the CLS id is ``vocab_size``).
        seq_len: encoder length per document (the document length, + 1 with ``cls`` pooling).
        num_classes: output classes.
        pooling: ``cls`` or ``mean``.
        padded: documents are padded: pass the key padding mask (needs ``supports_padding_mask``).
        dual: two documents per example (retrieval), shared encoder, ``[u, v, u*v, u-v]`` interaction.
        mlp_dim: hidden width of the head (default ``model.mlp_ratio * model.d_model``, LRA's ``mlp_dim``).
        name: task name, for error messages.
    """

    requires_causal = False

    def __init__(self, model: dict, attention: dict, optimizer: dict, scheduler: dict | None, vocab_size: int,
                 seq_len: int, num_classes: int, pooling: str = "mean", padded: bool = False, dual: bool = False,
                 mlp_dim: int | None = None, name: str = "lra") -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"task.pooling={pooling!r} is not valid; choose one of {POOLINGS}")
        model = dict(to_dict(model))
        if model.get("pos_emb") == "image":  # row/column/channel tables fit neither a CLS slot nor text
            raise ConfigError("model.pos_emb", f"image does not fit task={name} (a classifier over a 1-D sequence); "
                                               "choose learned, sinusoidal or none (task.pos_emb sets the default)")
        super().__init__(model, attention, optimizer, scheduler, vocab_size=vocab_size + 1, seq_len=seq_len, out_dim=1)
        self.net.head = nn.Identity()  # the classifier below replaces the per-token output layer
        self.pooling, self.padded, self.dual = pooling, padded, dual
        self.cls_id, self.num_classes = vocab_size, num_classes
        if padded:
            for block in self.net.blocks:
                block.attn.attention.check_padding_support(task=f"task={name}")
        d_model = model["d_model"]
        hidden = mlp_dim or int(model.get("mlp_ratio", 4) * d_model)
        if dual:
            self.classifier = nn.Sequential(nn.Linear(4 * d_model, hidden), nn.ReLU(), nn.Linear(hidden, hidden // 2),
                                            nn.ReLU(), nn.Linear(hidden // 2, num_classes))
        else:
            self.classifier = nn.Sequential(nn.Linear(d_model, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
        self.train_acc, self.val_acc, self.test_acc = (MulticlassAccuracy(num_classes, average="micro") for _ in range(3))
        self.val_acc_best = MaxMetric()

    def encode(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, L) document tokens -> (B, d_model) pooled representation."""
        if self.pooling == "cls":
            tokens = torch.cat([torch.full_like(tokens[:, :1], self.cls_id), tokens], dim=1)
        pad = tokens == PAD_ID if self.padded else None
        states = self.net.features(tokens, key_padding_mask=pad)  # (B, L, d_model)
        if self.pooling == "cls":
            return states[:, 0]
        if pad is None:
            return states.mean(1)
        keep = (~pad).unsqueeze(-1).to(states.dtype)
        return (states * keep).sum(1) / keep.sum(1).clamp(min=1.0)

    def forward(self, *documents: torch.Tensor) -> torch.Tensor:
        """One (B, L) batch (or two for retrieval) -> (B, num_classes) logits."""
        if not self.dual:
            (tokens,) = documents
            return self.classifier(self.encode(tokens))
        first, second = documents
        u, v = self.encode(torch.cat([first, second])).chunk(2)  # one pass through the shared encoder
        return self.classifier(torch.cat([u, v, u * v, u - v], dim=-1))

    def step(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        *documents, labels = batch
        logits = self(*documents)
        return F.cross_entropy(logits.float(), labels), logits, labels

    def training_step(self, batch, batch_idx):
        loss, logits, labels = self.step(batch)
        self.train_acc(logits, labels)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=False, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, logits, labels = self.step(batch)
        self.val_acc.update(logits, labels)
        self.log("val/loss", loss, on_step=False, on_epoch=True)

    def on_validation_epoch_end(self) -> None:
        acc = self.val_acc.compute()
        self.val_acc.reset()
        if self.trainer.sanity_checking:
            return
        self.val_acc_best(acc)
        self.log("val/acc", acc, prog_bar=True, sync_dist=False)  # already reduced across ranks
        self.log("val/acc_best", self.val_acc_best.compute(), prog_bar=True)

    def test_step(self, batch, batch_idx):
        loss, logits, labels = self.step(batch)
        self.test_acc.update(logits, labels)
        self.log("test/loss", loss, on_step=False, on_epoch=True)
        self.log("test/acc", self.test_acc, on_step=False, on_epoch=True)


# ----------------------------------------------------------------------------------------------------
# LRA learning-rate schedules (``scheduler._target_`` in conf/experiment/lra*/)


def warmup_rsqrt(optimizer: Optimizer, total_steps: int, warmup_steps: int = 1000) -> LambdaLR:
    """LRA's ``constant * linear_warmup * rsqrt_decay``, normalised to 1 at the end of warm-up:
    ``min(1, step / W) * sqrt(W / max(step, W))``; set ``optimizer.lr`` to the peak (base / sqrt(W))."""
    w = max(1, warmup_steps)
    return LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / w) * math.sqrt(w / max(step + 1, w)))


def warmup_linear_decay(optimizer: Optimizer, total_steps: int, warmup_steps: int = 0) -> LambdaLR:
    """Linear warm-up, then linear decay to 0 at ``total_steps`` (the Nystromformer/xformers LRA protocol)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return LambdaLR(optimizer, factor)
