"""Causal language modeling over token streams: bits per character (enwik8, text8) or perplexity.

Both numbers come from one summed NLL: ``nll = sum / scored tokens`` (nats), ``bpc = nll / ln 2``,
``ppl = exp(nll)``. Padded targets (``IGNORE_INDEX``) are never scored; the count of scored tokens is
logged next to the metric (``val/tokens``, ``test/tokens``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torchmetrics import MinMetric, SumMetric

from longseq.data.text import IGNORE_INDEX
from longseq.tasks.base import SequenceTask
from longseq.tasks.metrics import MeanNLL
from longseq.tasks.sampling import autoregress, check_sampling, pick_next

METRICS = ("bpc", "ppl")


def from_nll(nll: torch.Tensor, metric: str) -> torch.Tensor:
    """Mean NLL in nats -> bits per character/byte (``bpc``) or perplexity (``ppl``)."""
    return nll / math.log(2.0) if metric == "bpc" else torch.exp(nll)


class TokenLossTask(SequenceTask):
    """Shared by causal LM and MLM: cross-entropy over non-ignored targets, split metrics, best-so-far.

    Batches are ``(inputs, targets)`` of shape ``(B, L)``; subclasses set ``metric`` (``bpc`` / ``ppl``).
    Logs ``train/loss``, ``val/<metric>``, ``val/<metric>_best``, ``val/nll``, ``val/tokens`` and the same
    under ``test/``.
    """

    def __init__(self, model: dict, attention: dict, optimizer: dict, scheduler: dict | None,
                 vocab_size: int, seq_len: int, metric: str) -> None:
        if metric not in METRICS:
            raise ValueError(f"task.module.metric={metric!r} is not valid; choose one of {METRICS}")
        super().__init__(model, attention, optimizer, scheduler, vocab_size=vocab_size,
                         seq_len=seq_len)
        self.metric, self.vocab_size = metric, vocab_size
        self.nll = torch.nn.ModuleDict({split: MeanNLL() for split in ("val", "test")})
        self.tokens = torch.nn.ModuleDict({split: SumMetric() for split in ("val", "test")})
        self.best = MinMetric()

    def nll_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed NLL (nats) over the scored targets, and their count."""
        logits = self.net(inputs)
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                              ignore_index=IGNORE_INDEX, reduction="sum")
        return nll, (targets != IGNORE_INDEX).sum()

    def training_step(self, batch, batch_idx):
        nll, count = self.nll_sum(*batch)
        loss = nll / count.clamp(min=1)
        self.log("train/loss", loss, prog_bar=True)
        self.log(f"train/{self.metric}", from_nll(loss.detach(), self.metric), prog_bar=True)
        return loss

    def evaluation_step(self, split: str, batch) -> None:
        nll, count = self.nll_sum(*batch)
        self.nll[split].update(nll, count)
        self.tokens[split].update(count)

    def log_split(self, split: str) -> torch.Tensor:
        """Log ``<split>/<metric>``, ``<split>/nll``, ``<split>/tokens`` (already reduced over ranks)."""
        nll, tokens = self.nll[split].compute(), self.tokens[split].compute()
        self.nll[split].reset()
        self.tokens[split].reset()
        value = from_nll(nll, self.metric)
        self.log(f"{split}/{self.metric}", value, prog_bar=True, sync_dist=False)
        self.log(f"{split}/nll", nll, sync_dist=False)
        self.log(f"{split}/tokens", tokens.float(), sync_dist=False)
        return value

    def validation_step(self, batch, batch_idx):
        self.evaluation_step("val", batch)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            self.nll["val"].reset()
            self.tokens["val"].reset()
            return
        self.best(self.log_split("val"))
        self.log(f"val/{self.metric}_best", self.best.compute(), prog_bar=True)

    def test_step(self, batch, batch_idx):
        self.evaluation_step("test", batch)

    def on_test_epoch_end(self) -> None:
        self.log_split("test")


class CausalLMTask(TokenLossTask):
    """Next-token prediction with causal attention; ``targets`` are the inputs shifted by one (see
    ``longseq.data.text``). ``metric``: ``bpc`` (bytes / characters) or ``ppl`` (words, pieces)."""

    requires_causal = True

    def __init__(self, model: dict, attention: dict, optimizer: dict, scheduler: dict | None,
                 vocab_size: int, seq_len: int, metric: str = "ppl") -> None:
        super().__init__(model, attention, optimizer, scheduler, vocab_size, seq_len, metric)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, n_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None, cache: bool = True, progress: bool = False) -> torch.Tensor:
        """Continue ``prompt`` (B, P) token ids (P >= 1) by ``n_tokens`` sampled tokens -> (B, n_tokens).

        Incremental decoding through the backbone's state (``cache``; recompute when the attention has none);
        past ``task.seq_len`` the context slides (see ``longseq.tasks.sampling.autoregress``).
        """
        check_sampling(temperature, top_k)
        return autoregress(self.net, prompt.to(self.device), n_tokens,
                           lambda logits: pick_next(logits, temperature, top_k, generator), cache=cache,
                           progress=progress, description=f"generating {n_tokens} tokens")
