"""``AttentionMaps``: log each layer's attention weights for a fixed validation example to the dashboards.

During the first validation batch of a logged epoch, forward pre-hooks on every registered attention module
(``longseq.attention.base.Attention``; the model is not edited) keep the q, k, v ``(B, H, L, D)`` of one
example (``example_index``). At the end of training the final weights get their maps too (``final``), unless
the last validation already drew that step: the backbone (``pl_module.net``) is run once more on the same
example, kept from the first batch of the latest validation (the sanity check included). At validation end each layer's own ``attention_matrix(q, k, v)`` — the
effective normalized weights the layer applied, ``(1, H, L, L)`` — is drawn head-averaged and per head, cropped
to the first ``max_positions`` queries and keys when L is larger. Figures go to
``<dirpath>/attention_layer<i>_step<N>.png`` and to every logger: TensorBoard images, W&B ``wandb.Image``,
PNG files in a CSV logger's folder.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from longseq.attention.base import Attention
from longseq.models.transformer import check_positive_int, eval_mode

log = logging.getLogger(__name__)


def attention_modules(module: torch.nn.Module) -> list[tuple[str, Attention]]:
    """The registered attention modules of ``module`` in layer order, with their qualified names."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, Attention)]


def attention_figure(weights: torch.Tensor, title: str, max_positions: int):
    """A matplotlib figure: the head average then each head of ``weights`` (H, L, L), first ``max_positions``.

    Rows are queries, columns keys; a shared colour scale per panel row (0 = no weight, so the white-to-dark
    map shows the support: exactly zero entries are keys the pattern drops).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    weights = weights[:, :max_positions, :max_positions].float().cpu().numpy()
    panels = [("mean over heads", weights.mean(0))] + [(f"head {h}", w) for h, w in enumerate(weights)]
    fig, axes = plt.subplots(1, len(panels), figsize=(2.3 * len(panels), 2.6), squeeze=False)
    for ax, (name, panel) in zip(axes[0], panels):
        # Square-root scale: a softmax row puts most mass on a few keys; the root keeps small weights visible.
        ax.imshow(np.sqrt(panel), cmap="Greys", vmin=0.0, vmax=max(float(np.sqrt(panel).max()), 1e-12),
                  interpolation="nearest")
        ax.set_title(name, fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    axes[0][0].set_ylabel("query", fontsize=8)
    axes[0][0].set_xlabel("key", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def figure_to_array(fig) -> np.ndarray:
    """(H, W, 3) uint8 RGB pixels of a drawn matplotlib figure."""
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


class AttentionMaps(L.Callback):
    """Every ``every_n_epochs`` validation epochs and at the end of training, log per-layer attention maps of
    one validation example.

    Args:
        dirpath: folder for the PNG files (``<run>/attention_maps``).
        every_n_epochs: log at the end of every N-th validation epoch of fit (its own key: the maps are not
            tied to the task's sample grid).
        example_index: which row of the first validation batch to show (the same example every time).
        max_positions: crop to the first N queries and keys (a full L x L map is unreadable and O(L^2)).
        max_seq_len: do nothing when the captured sequence is longer (``attention_matrix`` is O(H L^2)
            memory); the config's 1024 logs maps for digits and the 1K LRA tasks, not for longer sequences.
        enabled: switch the callback off entirely (``callbacks.attention_maps.enabled=false``).
        final: also draw the final weights at the end of training (``every_n_epochs`` alone would leave the
            trained model without maps whenever training ends between two logged validations).
    """

    def __init__(self, dirpath: str, every_n_epochs: int = 1, example_index: int = 0, max_positions: int = 64,
                 max_seq_len: int = 1024, enabled: bool = True, final: bool = True) -> None:
        check_positive_int("callbacks.attention_maps.every_n_epochs", every_n_epochs)
        self.dirpath = Path(dirpath)
        self.every_n_epochs, self.example_index = every_n_epochs, example_index
        self.max_positions, self.max_seq_len, self.enabled, self.final = max_positions, max_seq_len, enabled, final
        self.captured: dict[str, tuple[Attention, tuple[torch.Tensor, ...], dict[str, Any]]] = {}
        self.handles: list[Any] = []
        self.written: list[Path] = []
        self.example: tuple[tuple, dict[str, Any]] | None = None  # the backbone's input for the chosen row
        self.last_step: int | None = None  # the step whose maps were drawn last

    def due(self, trainer: L.Trainer) -> bool:
        """Every N-th validation epoch of fit, and a stand-alone ``validate`` (the runner's final-weights check)
        of a step not drawn yet."""
        if not self.enabled or trainer.sanity_checking or trainer.fast_dev_run:
            return False
        if trainer.state.fn == "validate":
            return self.last_step != trainer.global_step
        return trainer.state.fn == "fit" and (trainer.current_epoch + 1) % self.every_n_epochs == 0

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if batch_idx != 0 or dataloader_idx != 0 or not trainer.is_global_zero or not self.enabled:
            return
        backbone = getattr(pl_module, "net", None)
        if self.final and trainer.state.fn == "fit" and isinstance(backbone, torch.nn.Module):
            self.handles.append(backbone.register_forward_pre_hook(self.example_hook, with_kwargs=True))
        if not self.due(trainer):
            return
        self.captured.clear()
        self.capture(pl_module)

    def capture(self, pl_module: torch.nn.Module) -> None:
        """Hook every attention module of ``pl_module`` to keep the chosen row's (q, k, v) of its next forward."""
        for name, attention in attention_modules(pl_module):
            self.handles.append(attention.register_forward_pre_hook(self.capture_hook(name), with_kwargs=True))

    def example_hook(self, backbone: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Keep the backbone's input for the chosen row, to replay it on the final weights at the end of training.

        Tensors with the batch's leading size are cut to that row; other values are kept as they are. An input
        nested in containers (a recurrent memory) is not replayable: nothing is kept.
        """
        values = list(args) + list(kwargs.values())
        if not values or not torch.is_tensor(values[0]) or any(isinstance(v, (list, tuple, dict)) for v in values):
            self.example = None
            return
        batch = values[0].shape[0]
        row = min(self.example_index, batch - 1)

        def cut(value: Any) -> Any:
            return value[row:row + 1].detach() if torch.is_tensor(value) and value.shape[:1] == (batch,) else value

        self.example = (tuple(cut(a) for a in args), {key: cut(value) for key, value in kwargs.items()})

    def capture_hook(self, name: str):
        def hook(attention: Attention, args: tuple, kwargs: dict) -> None:
            q, k, v = args[:3]
            row = min(self.example_index, q.shape[0] - 1)
            keep = {key: value[row:row + 1].detach() for key, value in kwargs.items() if torch.is_tensor(value)}
            self.captured[name] = (attention, tuple(t[row:row + 1].detach() for t in (q, k, v)), keep)

        return hook

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self.remove_hooks()

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    @rank_zero_only
    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.remove_hooks()
        if not self.captured or not self.due(trainer):
            return
        self.draw(trainer)

    @rank_zero_only
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The final weights' maps: the kept example through the backbone once more (no gradients, eval mode)."""
        self.remove_hooks()
        if not self.enabled or not self.final or trainer.fast_dev_run or self.last_step == trainer.global_step:
            return
        if self.example is None:
            log.info("attention maps of the final weights skipped: no validation example was seen during fit")
            return
        if any(kind in type(trainer.strategy).__name__ for kind in ("FSDP", "DeepSpeed")):
            # The backbone's parameters are sharded across ranks: rank 0 alone cannot run it.
            log.info("attention maps of the final weights skipped: sharded parameters (FSDP / DeepSpeed)")
            return
        args, kwargs = self.example
        self.captured.clear()
        self.capture(pl_module)
        try:
            with torch.no_grad(), eval_mode(pl_module):
                pl_module.net(*args, **kwargs)
        finally:
            self.remove_hooks()
        if self.captured:
            self.draw(trainer)

    def draw(self, trainer: L.Trainer) -> None:
        """Log the captured maps unless the sequence is longer than ``max_seq_len``; then forget them."""
        length = next(iter(self.captured.values()))[1][0].shape[-2]
        if length > self.max_seq_len:
            log.info(f"attention maps skipped: L = {length} > callbacks.attention_maps.max_seq_len={self.max_seq_len}")
        else:
            self.log_maps(trainer)
        self.captured.clear()

    @torch.no_grad()
    def log_maps(self, trainer: L.Trainer) -> list[Path]:
        """Draw and log one figure per layer; returns the PNG paths written under ``dirpath``."""
        import matplotlib.pyplot as plt

        step = self.last_step = trainer.global_step
        self.dirpath.mkdir(parents=True, exist_ok=True)
        paths = []
        for layer, (name, (attention, (q, k, v), kwargs)) in enumerate(self.captured.items()):
            weights = attention.attention_matrix(q, k, v, **kwargs)[0]  # (H, L, L)
            length = weights.shape[-1]
            crop = f", first {self.max_positions} of {length} positions" if length > self.max_positions else ""
            fig = attention_figure(weights, f"layer {layer} ({attention.name}), step {step}{crop}", self.max_positions)
            path = self.dirpath / f"attention_layer{layer}_step{step}.png"
            fig.savefig(path, dpi=100)
            pixels = figure_to_array(fig)
            plt.close(fig)
            key = f"attention_maps/layer{layer}"
            for logger in trainer.loggers:
                if isinstance(logger, WandbLogger):
                    logger.log_image(key=key, images=[pixels], step=step, caption=[f"{name}: {attention.name}"])
                elif isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_image(key, pixels, step, dataformats="HWC")
                elif isinstance(logger, CSVLogger):
                    target = Path(logger.log_dir) / "attention_maps"
                    target.mkdir(parents=True, exist_ok=True)
                    (target / path.name).write_bytes(path.read_bytes())
            paths.append(path)
        self.written += paths
        return paths
