"""Autoregressive image density: next-sub-pixel prediction, metric bits/dim."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import MinMetric

from longseq.tasks.base import SequenceTask
from longseq.tasks.metrics import BitsPerDim
from longseq.tasks.sampling import autoregress, check_sampling, pick_next


class DensityTask(SequenceTask):
    """Causal model of ``p(x_t | x_<t)`` over ``num_levels`` sub-pixel values.

    The input is the image shifted right by one with a start token (id ``num_levels``) in front, so the
    embedding has ``num_levels + 1`` entries and the head ``num_levels`` outputs.
    Logs ``train/loss``, ``train/bpd``, ``val/bpd``, ``val/bpd_best``, ``test/bpd``.
    """

    requires_causal = True

    def __init__(self, model: dict, attention: dict, optimizer: dict, scheduler: dict | None,
                 num_levels: int, image_shape: tuple[int, int, int]) -> None:
        image_shape = tuple(int(s) for s in image_shape)
        h, w, c = image_shape
        super().__init__(model, attention, optimizer, scheduler, vocab_size=num_levels + 1,
                         seq_len=h * w * c, out_dim=num_levels, image_shape=image_shape)
        self.num_levels, self.image_shape = num_levels, image_shape
        self.start_token = num_levels
        self.train_bpd, self.val_bpd, self.test_bpd = BitsPerDim(), BitsPerDim(), BitsPerDim()
        self.val_bpd_best = MinMetric()

    def shifted_input(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L) targets -> (B, L) inputs ``[start, x_0, ..., x_{L-2}]``."""
        start = torch.full_like(x[:, :1], self.start_token)
        return torch.cat([start, x[:, :-1]], dim=1)

    def nll_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Summed NLL (nats) of a (B, L) batch of sub-pixel tokens."""
        logits = self.net(self.shifted_input(x))
        return F.cross_entropy(logits.reshape(-1, self.num_levels).float(), x.reshape(-1), reduction="sum")

    def training_step(self, batch, batch_idx):
        (x,) = batch
        nll = self.nll_sum(x)
        loss = nll / x.numel()
        self.train_bpd(nll, x.numel())
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/bpd", self.train_bpd, on_step=True, on_epoch=False, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        (x,) = batch
        self.val_bpd.update(self.nll_sum(x), x.numel())

    def on_validation_epoch_end(self) -> None:
        bpd = self.val_bpd.compute()
        self.val_bpd.reset()
        if self.trainer.sanity_checking:
            return
        self.val_bpd_best(bpd)
        self.log("val/bpd", bpd, prog_bar=True, sync_dist=False)  # already reduced across ranks
        self.log("val/bpd_best", self.val_bpd_best.compute(), prog_bar=True)

    def test_step(self, batch, batch_idx):
        (x,) = batch
        self.test_bpd.update(self.nll_sum(x), x.numel())
        self.log("test/bpd", self.test_bpd, on_step=False, on_epoch=True)

    @torch.no_grad()
    def sample(self, n: int, temperature: float = 1.0, generator: torch.Generator | None = None, *,
               prefix: torch.Tensor | None = None, cache: bool = True, progress: bool = False) -> torch.Tensor:
        """Batched autoregressive generation -> (n, H, W, C) uint8 images of levels in [0, num_levels).

        ``prefix`` (n, P) levels of the first P sub-pixels (raster order) are kept and the rest completed
        (image completion). ``cache``: incremental decoding through the backbone's decoding state (falls
        back to recomputing the sequence, with a warning, when the attention has none); ``progress``: a
        progress bar with tokens/s. Dropout is off while sampling. See ``longseq.tasks.sampling``.
        """
        check_sampling(temperature)
        start = torch.full((n, 1), self.start_token, dtype=torch.long, device=self.device)
        inputs = start if prefix is None else torch.cat([start, prefix.to(self.device, torch.long)], dim=1)
        given = inputs.shape[1] - 1
        if not 0 <= given < self.net.seq_len:
            raise ValueError(f"a prefix of {given} sub-pixels leaves nothing to sample (an image has {self.net.seq_len})")
        new = autoregress(self.net, inputs, self.net.seq_len - given,
                          lambda logits: pick_next(logits, temperature, generator=generator), cache=cache,
                          progress=progress, description=f"sampling {n} image(s)")
        x = new if prefix is None else torch.cat([inputs[:, 1:], new], dim=1)
        return x.view(n, *self.image_shape).to(torch.uint8)
