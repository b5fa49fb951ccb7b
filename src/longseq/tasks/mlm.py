"""Masked language modeling (C4, BERT masking): a bidirectional encoder, perplexity over masked positions.

Batches are ``(inputs, targets)`` of shape ``(B, L)`` from ``longseq.data.c4``: ``inputs`` carry the
``<mask>`` / random / kept replacements, ``targets`` the original ids at the chosen (15 %) positions and
``IGNORE_INDEX`` elsewhere, so the loss, ``val/ppl`` and ``val/tokens`` count masked positions only.
"""

from __future__ import annotations

from longseq.tasks.lm import TokenLossTask


class MaskedLMTask(TokenLossTask):
    """Encoder with bidirectional attention (``attention.causal=false``); metric perplexity per masked piece."""

    requires_causal = False

    def __init__(self, model: dict, attention: dict, optimizer: dict, scheduler: dict | None,
                 vocab_size: int, seq_len: int, metric: str = "ppl") -> None:
        super().__init__(model, attention, optimizer, scheduler, vocab_size, seq_len, metric)
