"""Global-batch arithmetic and split loaders shared by the datamodules."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from torch.utils.data import DataLoader, Dataset

from longseq.data.validation import MIN_EVAL_EXAMPLES, check_split_size
from longseq.utils.errors import ConfigError


def per_device_batch_size(global_batch: int, world_size: int, accumulate: int = 1, key: str = "task.data.batch_size") -> int:
    """Per-device micro-batch so that ``micro * world_size * accumulate == global_batch``.

    Raises a ``ValueError`` naming ``key`` when the global batch does not divide evenly.
    """
    denom = world_size * accumulate
    if global_batch < 1 or global_batch % denom:
        raise ValueError(
            f"{key}={global_batch} (global batch) must be a positive multiple of devices x "
            f"accumulate_grad_batches = {world_size} x {accumulate} = {denom}"
        )
    return global_batch // denom


def check_loader_arguments(batch_size: Any, eval_batch_size: Any = None, num_workers: Any = 0, seed: Any = 0,
                           key: Callable[[str], str] = lambda name: f"task.data.{name}") -> None:
    """The arguments every datamodule takes for its loaders, checked before anything is read: the global
    ``batch_size`` an integer >= 1, ``eval_batch_size`` null or one, ``num_workers`` an integer >= 0 (the
    DataLoader's rule) and ``seed`` an integer >= 0 (NumPy's). ``key(name)`` is the key the user typed for
    ``task.data.<name>`` (``task.batch_size``: the task YAMLs interpolate it)."""

    def integer(value: Any, low: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= low

    if not integer(batch_size, 1):
        raise ConfigError(key("batch_size"), f"must be an integer >= 1 (the global batch), got {batch_size!r}")
    if eval_batch_size is not None and not integer(eval_batch_size, 1):
        raise ConfigError(key("eval_batch_size"), f"must be null (= the batch size) or an integer >= 1, got "
                                                  f"{eval_batch_size!r}")
    if not integer(num_workers, 0):
        raise ConfigError(key("num_workers"), f"must be an integer >= 0 (0: load in the main process), got "
                                              f"{num_workers!r}")
    if not integer(seed, 0):
        raise ConfigError(key("seed"), f"must be an integer >= 0, got {seed!r}")


def device_batches(trainer: Any, batch_size: int, eval_batch_size: int, accumulate: int) -> tuple[int, int, int, int]:
    """``(world_size, rank, device_batch, device_eval_batch)`` for a datamodule's ``setup``.

    Without a trainer (a datamodule used on its own) it is one process of rank 0. The train batch is split
    over devices and accumulation steps, the eval batch over devices only.
    """
    world_size = trainer.world_size if trainer is not None else 1
    rank = trainer.global_rank if trainer is not None else 0
    device_batch = per_device_batch_size(batch_size, world_size, accumulate)
    device_eval_batch = per_device_batch_size(eval_batch_size, world_size, 1, key="task.data.eval_batch_size")
    return world_size, rank, device_batch, device_eval_batch


class SplitLoaders:
    """Train / val / test loaders for a LightningDataModule holding one map-style dataset per split.

    Mix in before ``LightningDataModule``. The host sets ``datasets`` (split name -> Dataset), ``world_size``,
    ``device_batch``, ``device_eval_batch`` and ``num_workers``, and may override ``collate_fn`` and
    ``split_source`` (the file or folder named in data errors). Train batches are shuffled and drop the last
    partial batch; eval batches keep order and every example. Before a loader is built its split is checked:
    the training split must fill one batch, an evaluation split must hold an example (and warns below
    ``MIN_EVAL_EXAMPLES``).
    """

    datasets: dict[str, Dataset]
    world_size: int
    device_batch: int
    device_eval_batch: int
    num_workers: int

    def collate_fn(self) -> Callable | None:
        """Collate function of every loader; None: the DataLoader default."""
        return None

    def split_source(self, split: str) -> str | Path:
        """The file or folder ``split`` is read from (named in data errors)."""
        return getattr(self, "root", getattr(self, "data_dir", "<dataset>"))

    def check_split(self, split: str) -> None:
        """Training: one batch on every device (a last partial batch is dropped); evaluation: one example."""
        size = len(self.datasets[split])
        if split == "train":
            world = getattr(self, "world_size", 1)
            need = world * self.device_batch
            check_split_size(self.split_source(split), split, size, minimum=need, unit="examples",
                             needs=f"one training batch of {need} examples (task.batch_size over {world} device(s) "
                                   "and trainer.accumulate_grad_batches)",
                             hint="use a smaller task.batch_size or more data (task.data.limit?)")
        else:
            check_split_size(self.split_source(split), split, size, minimum=1, unit="examples", needs="one example",
                             warn_below=MIN_EVAL_EXAMPLES)

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        self.check_split(split)
        return DataLoader(
            self.datasets[split],
            batch_size=self.device_batch if split == "train" else self.device_eval_batch,
            shuffle=shuffle,
            drop_last=shuffle,
            collate_fn=self.collate_fn(),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)
