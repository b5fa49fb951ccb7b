"""``check_train_config``: every check a ``train.py`` config passes or fails before anything is written.

The cheap checks of values come first (trainer keys, seed, printing, partition, geometry, loader arguments,
loggers), then what needs building: the model on the meta device (with ``ckpt_path``), the Trainer with its
callbacks (Lightning's own checks), the batch over Lightning's count of devices, and last the data files the
datamodule says it needs (which may download into ``paths.data_dir``, never into the run directory).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from longseq.data.batching import check_loader_arguments, per_device_batch_size
from longseq.preflight.trainer import (
    check_trainer_types,
    check_training_length,
    check_with_lightning,
    configured_world_size,
)
from longseq.utils.build import build_datamodule
from longseq.utils.checkpoint import check_model
from longseq.utils.config import print_mode
from longseq.utils.errors import ConfigError, user_key


def check_train_config(cfg: DictConfig, data: bool = True) -> None:
    """Raise the first error of ``cfg`` that names the key (or file) to fix, before the run directory exists.

    ``train.py`` runs it once, on the composed command, before Hydra makes the run directory
    (``preflight.command.preflight_train``); ``runner.train`` runs it for multirun jobs and in-process callers.
    ``data=False`` leaves the data files to the run (a config checked on another machine).
    """
    check_trainer_types(cfg.trainer)
    check_training_length(cfg)
    check_seed(cfg.get("seed"))
    print_mode(cfg.get("extras"))
    check_partition_choice(cfg)
    check_task_geometry(cfg.task)
    check_loader_config(cfg)
    check_loggers(cfg)
    check_model(cfg)
    check_batch_sizes(cfg, check_with_lightning(cfg))
    if data:
        check_data_files(cfg)


def check_seed(seed: Any) -> None:
    """``seed``: an integer Lightning can seed with (0 to 2**32 - 1), or null for an unseeded run."""
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ConfigError("seed", f"expected an integer from 0 to {2**32 - 1} (or null: unseeded), got {seed!r}")


def check_partition_choice(cfg: DictConfig) -> None:
    """``partition=<p>`` is read only by attentions whose config has an ``attention.partition`` key (``sparse``,
    ``combiner``, ``combiner_select``); with any other attention it would be ignored silently."""
    partition = cfg.get("partition")
    attention = cfg.get("attention") or {}
    if partition and "partition" not in attention:
        name = partition.get("name", "?") if isinstance(partition, DictConfig) else partition
        raise ConfigError("partition", f"attention={attention.get('name')} takes no partition, so partition={name} "
                                       "would be ignored; a partition is the geometry of attention=sparse, "
                                       f"attention=combiner and attention=combiner_select: drop partition={name} or "
                                       "choose one of those")


def check_task_geometry(task: DictConfig | dict) -> None:
    """Raise ``ConfigError('task.seq_len', ...)`` when ``task.seq_len`` disagrees with a task's fixed geometry.

    An image task's sequence is its pixels (``task.image_shape``: digits 8 x 8 x 1 = 64 tokens), and an LRA task
    with a fixed ``task.max_length`` (Image, Pathfinder) has ``max_length`` (+1 for ``pooling=cls``) positions:
    an overridden ``task.seq_len`` would otherwise be ignored by the data, or fail deep inside the model.
    """
    if not task or task.get("seq_len") is None:
        return
    seq_len, name = task.seq_len, task.get("name", "?")
    shape = task.get("image_shape")
    if shape is not None:
        tokens = 1
        for size in shape:
            tokens *= int(size)
        if seq_len != tokens:
            raise ConfigError("task.seq_len", f"{seq_len} does not fit task={name}: its images are "
                                              f"{' x '.join(map(str, shape))} = {tokens} tokens (a fixed geometry); "
                                              f"drop the override (or use task.seq_len={tokens})")
    elif task.get("max_length") is not None and task.get("pooling") is not None:
        tokens = int(task.max_length) + (task.pooling == "cls")
        if seq_len != tokens:
            raise ConfigError("task.seq_len", f"{seq_len} does not fit task={name}: its sequences are "
                                              f"task.max_length={task.max_length} tokens"
                                              f"{' + 1 (pooling=cls)' if task.pooling == 'cls' else ''} = {tokens}; "
                                              "set task.max_length where the task allows it, not task.seq_len")


def check_loader_config(cfg: DictConfig) -> None:
    """The loader arguments of ``task.data`` (``data.batching.check_loader_arguments``), named as the user types
    them (``task.batch_size``)."""
    data = cfg.task.get("data") or {}
    check_loader_arguments(data.get("batch_size", 1), data.get("eval_batch_size"), data.get("num_workers", 0),
                           data.get("seed", 0), key=lambda name: user_key(cfg, f"task.data.{name}"))


def check_batch_sizes(cfg: DictConfig, world_size: int | None) -> None:
    """The global batch sizes (``task.data.batch_size`` / ``eval_batch_size``) divide over ``world_size`` processes
    (and gradient accumulation), checked in the launching process: a ``ddp_spawn`` fit would otherwise start its
    workers first and fail in each of them. The rule itself is ``longseq.data.batching.per_device_batch_size`` (the
    datamodules apply it again in ``setup``); the message names the key the user typed (``task.batch_size``, not
    ``task.data.batch_size``). ``world_size`` None: taken from the config when it says it, else nothing to check."""
    world_size = world_size or configured_world_size(cfg.trainer)
    data = cfg.task.get("data") or {}
    batch = data.get("batch_size")
    if world_size is None or not isinstance(batch, int):
        return
    accumulate = int(data.get("accumulate_grad_batches") or 1)
    per_device_batch_size(batch, world_size, accumulate, key=user_key(cfg, "task.data.batch_size"))
    eval_batch = data.get("eval_batch_size")
    if isinstance(eval_batch, int):
        per_device_batch_size(eval_batch, world_size, 1, key=user_key(cfg, "task.data.eval_batch_size"))


WANDB_OFFLINE_MODES = ("offline", "dryrun", "disabled")


def check_loggers(cfg: DictConfig) -> None:
    """An online W&B logger needs credentials on this machine: without them ``wandb.init`` fails inside the run
    (``UsageError: No API key configured``). Checked without network (``wandb.login(prompt=False, verify=False)``)."""
    import os

    for name, node in (cfg.get("logger") or {}).items():
        if not node or not str(node.get("_target_", "")).endswith("WandbLogger"):
            continue
        if node.get("offline") or os.environ.get("WANDB_MODE", "").lower() in WANDB_OFFLINE_MODES:
            continue
        import wandb

        # W&B's process-wide setup caches the settings it first saw (mode, home, key). Torn down before the login, so
        # that it reads this process's environment now (after an earlier offline run in the process, a key set since
        # was not seen), and after it, so that a later offline run (a multirun's next job) does not try to log in.
        wandb.teardown()
        try:
            logged_in = wandb.login(prompt=False, verify=False)
        finally:
            wandb.teardown()
        if not logged_in:
            raise ConfigError(f"logger.{name}", "W&B has no API key on this machine: run `wandb login` (or set "
                                                f"WANDB_API_KEY), or log offline with logger.{name}.offline=true "
                                                "(sync later with `wandb sync <run>/wandb/offline-run-*`)")


def check_data_files(cfg: DictConfig) -> None:
    """The files the task's datamodule says it needs (its ``check_data()``: present, or downloaded into
    ``paths.data_dir`` when the task allows); a datamodule without ``check_data`` (digits, the recall tasks)
    generates or embeds its data."""
    datamodule = build_datamodule(cfg)
    check = getattr(datamodule, "check_data", None)
    if callable(check):
        check()
