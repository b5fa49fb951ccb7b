"""``SampleImages``: log a grid of model samples to every active logger and the run directory."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from torchvision.utils import make_grid, save_image

from longseq.models.transformer import check_positive_int
from longseq.utils.errors import ConfigError

log = logging.getLogger(__name__)

GRID_MIN_SIZE = 512  # pixels on the longer side of a saved / logged grid: 16 digits are 37 px wide unscaled


def upscale(grid: torch.Tensor, min_size: int = GRID_MIN_SIZE) -> torch.Tensor:
    """(C, H, W) -> (C, sH, sW): every pixel repeated ``s`` x ``s`` (nearest neighbour, so levels stay exact
    and nothing is smoothed), ``s`` the smallest integer that makes the longer side >= ``min_size``
    (``min_size=0``: unchanged)."""
    factor = max(1, -(-min_size // max(grid.shape[-2:])))
    return grid.repeat_interleave(factor, -2).repeat_interleave(factor, -1) if factor > 1 else grid


def image_grid(images: torch.Tensor, num_levels: int, min_size: int = GRID_MIN_SIZE) -> torch.Tensor:
    """(N, H, W, C) uint8 level images -> (3 or 1, H', W') float grid in [0, 1], upscaled to ``min_size``."""
    x = images.permute(0, 3, 1, 2).float() / max(1, num_levels - 1)
    return upscale(make_grid(x, nrow=int(len(images) ** 0.5) or 1, padding=1, pad_value=1.0), min_size)


class SampleImages(L.Callback):
    """Every ``every_n_epochs`` validation epochs and once at the end of training, sample ``n_samples``
    images and log the grid (``final=false`` drops the end-of-training grid).

    Files land in ``<dirpath>/samples_step<N>.png``; TensorBoard gets ``add_image``, W&B a
    ``wandb.Image`` (via ``log_image``), CSV runs keep the PNG files; the same grid everywhere, upscaled by an
    integer factor (nearest neighbour) until its longer side is at least ``min_size`` pixels. ``cache``: sample through the backbone's
    incremental-decoding state (attentions without one fall back to recompute, with one warning naming the
    variant); false recomputes the sequence for every token.

    Composed as ``callbacks.samples`` by the tasks that can sample images (``conf/callbacks/samples/images.yaml``
    in their defaults list); attached to a module without ``sample`` it refuses at setup instead of idling.
    """

    def __init__(self, dirpath: str, n_samples: int = 16, every_n_epochs: int = 1, temperature: float = 1.0,
                 seed: int = 0, final: bool = True, cache: bool = True, min_size: int = GRID_MIN_SIZE) -> None:
        check_positive_int("callbacks.samples.every_n_epochs", every_n_epochs)  # default: task.sample_every_n_epochs
        if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
            raise ConfigError("callbacks.samples.min_size", f"must be an integer >= 0 (pixels; 0 = no upscaling), "
                                                            f"got {min_size!r}")
        self.dirpath, self.min_size = Path(dirpath), min_size
        self.n_samples, self.every_n_epochs = n_samples, every_n_epochs
        self.temperature, self.seed, self.final, self.cache = temperature, seed, final, cache
        self.last_step: int | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not callable(getattr(pl_module, "sample", None)):
            raise ConfigError("callbacks.samples", f"{type(pl_module).__name__} cannot sample images (it has no "
                                                   "`sample`); the sample grid belongs to image density tasks, whose "
                                                   "task YAML adds it (`- /callbacks/samples: images`)")

    def active(self, trainer: L.Trainer, module: L.LightningModule) -> bool:
        if module.device.type == "xla":  # said once per run, instead of a crash at the end of training
            if not getattr(self, "_said_xla", False):
                self._said_xla = True
                log.warning("callbacks.samples: no sample grids on an XLA device (decoding token by token traces a "
                            "new graph per position, and XLA has no torch.Generator); sample the checkpoint with "
                            "eval.py mode=sample on CPU or GPU")
            return False
        return self.n_samples > 0 and not trainer.sanity_checking and not trainer.fast_dev_run

    @rank_zero_only
    def on_validation_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if not self.active(trainer, module) or trainer.state.fn != "fit":
            return
        if (trainer.current_epoch + 1) % self.every_n_epochs:
            return
        self.log_samples(trainer, module)

    @rank_zero_only
    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.final and self.active(trainer, module) and self.last_step != trainer.global_step:
            self.log_samples(trainer, module)

    def log_samples(self, trainer: L.Trainer, module: L.LightningModule) -> Path:
        gen = torch.Generator(device=module.device).manual_seed(self.seed)
        images = module.sample(self.n_samples, self.temperature, generator=gen, cache=self.cache)
        grid = image_grid(images.cpu(), module.num_levels, self.min_size)
        step = self.last_step = trainer.global_step
        self.dirpath.mkdir(parents=True, exist_ok=True)
        path = self.dirpath / f"samples_step{step}.png"
        save_image(grid, path)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image(key="samples", images=[grid], step=step)
            elif isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image("samples", grid, step)
            elif isinstance(logger, CSVLogger):
                save_image(grid, Path(logger.log_dir) / path.name)
        return path
