"""What ``train.py`` and ``eval.py`` do, importable and testable: build objects from config, run, report.

Entry points stay thin (lightning-hydra-template style): they compose the config and call ``train``
or ``evaluate``. Both return a dict of final metrics.
"""

from __future__ import annotations

import csv
import logging
import math
import re
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.errors import InstantiationException
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf
from torchmetrics import Metric

from longseq.attention.ops.dispatch import attention_backends, backend_summary
from longseq.callbacks.nonfinite import resume_advice
from longseq.callbacks.progress import console_callbacks
from longseq.report.outcome import records_run_outcome
from longseq.utils.build import build_datamodule, build_module
from longseq.utils.checkpoint import AtomicCheckpointIO, checkpoint_step, read_checkpoint
from longseq.utils.config import (
    check_batch_sizes,
    check_run_config,
    check_seed,
    check_trainer_types,
    ensure_csv_logger,
    register_resolvers,
    trainer_arguments,
)
from longseq.utils.console import quiet_lightning
from longseq.utils.errors import ConfigError, NonFiniteError
from longseq.utils.resume import continue_loggers, resuming_in_place
from longseq.utils.rundir import RESOLVED_CONFIG

log = logging.getLogger(__name__)

def instantiate_group(group: DictConfig | None) -> list[Any]:
    """Instantiate every ``_target_`` entry of a callbacks/logger group (None or empty -> [])."""
    if not group:
        return []
    return [hydra.utils.instantiate(node) for node in group.values() if node and "_target_" in node]


def build_trainer(cfg: DictConfig, callbacks: list, loggers: list[Logger]) -> L.Trainer:
    """The Trainer of ``cfg.trainer`` (types checked first), with atomic checkpoint writes, the step bar and the
    model summary."""
    check_trainer_types(cfg.trainer)
    quiet_lightning()
    callbacks = console_callbacks(cfg.trainer, callbacks)  # the step bar and the compact model summary
    extra = {}
    if cfg.trainer.get("accelerator") == "tpu":  # Lightning's XLA accelerator, on XLA's CPU device where no TPU is
        from longseq.utils.xla import tpu_accelerator

        extra["accelerator"] = tpu_accelerator()
    elif "plugins" not in cfg.trainer:
        extra["plugins"] = [AtomicCheckpointIO()]
    try:
        return hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False, **extra)
    except InstantiationException as exc:
        if isinstance(exc.__cause__, (MisconfigurationException, ValueError, TypeError)):
            raise trainer_error(exc.__cause__) from exc  # a setting Lightning refuses (fsdp on the CPU ...)
        raise


def trainer_error(exc: BaseException) -> ConfigError:
    """Lightning's refusal of a Trainer setting as a ``ConfigError`` naming the ``trainer.<key>`` its message names
    first (``trainer`` when it names none), for the settings no check of ``check_trainer_types`` covers."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    found = [(match.start(), name) for name in trainer_arguments()
             if (match := re.search(rf"(?<![\w.])`?{name}\b", message, flags=re.IGNORECASE))]
    return ConfigError(f"trainer.{min(found)[1]}" if found else "trainer", message)


def close_loggers() -> None:
    """Finish the W&B run if one is open, so each multirun job gets its own run."""
    try:
        import wandb
    except ImportError:  # pragma: no cover - wandb is a dependency
        return
    if wandb.run is not None:
        wandb.finish()


def metric_value(metrics: dict[str, Any], name: str | None, trained: bool = True) -> float | None:
    """The metric a sweeper optimizes; NaN-safe (an Optuna trial must not crash the sweep).

    A run that did not train (``train=false``: evaluation only) may not have logged the validation metric;
    it then returns None instead of failing a run that succeeded.
    """
    if not name:
        return None
    if name not in metrics:
        if not trained:
            log.info(f"optimized_metric={name} was not computed (train=false); returning no value")
            return None
        raise KeyError(f"optimized_metric={name!r} was not logged; available: {sorted(metrics)}")
    value = float(metrics[name])
    return value if math.isfinite(value) else float("inf")


@records_run_outcome  # writes <run>/metrics.json (final metrics + completed/failed) for longseq.report
def train(cfg: DictConfig) -> dict[str, float]:
    """Fit (optionally resuming ``cfg.ckpt_path``) then test the best checkpoint; returns final metrics.

    Everything the run writes goes under ``cfg.paths.output_dir`` (the Hydra run directory). ``ckpt_path``
    and the trainer keys are checked before anything is written.
    """
    register_resolvers()
    check_run_config(cfg)
    ensure_csv_logger(cfg)  # every run's curves in <run>/csv/metrics.csv (extras.csv_metrics)
    output_dir = Path(cfg.paths.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if resuming_in_place(cfg):
        log.info(f"resuming in place: {output_dir} from {cfg.ckpt_path}")
        continue_loggers(cfg, output_dir)
    # Resolved copy of the config next to the checkpoints: eval.py rebuilds the run from it.
    (output_dir / RESOLVED_CONFIG).write_text(OmegaConf.to_yaml(cfg, resolve=True))
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = build_datamodule(cfg)
    module = build_module(cfg)
    callbacks = instantiate_group(cfg.get("callbacks"))
    loggers = instantiate_group(cfg.get("logger"))
    trainer = build_trainer(cfg, callbacks, loggers)
    check_batch_sizes(cfg, trainer.world_size)  # as Lightning counts the devices, before a spawned fit starts
    trained = bool(cfg.get("train", True))
    try:
        for logger in loggers:
            logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
            if isinstance(logger, WandbLogger):  # log_hyperparams is rank-zero only: other DDP ranks have no W&B run
                logger.log_hyperparams({"output_dir": str(output_dir)})
        if trained:
            trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        evaluator = evaluation_trainer(cfg, trainer, loggers)
        if trained:
            metrics.update(validate_final_weights(cfg, trainer, evaluator, module, datamodule))
        if cfg.get("test", True):
            ckpt = test_checkpoint(cfg, trainer, trained)
            reset_metrics(module)
            evaluator.test(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=False, verbose=False)
            metrics.update({k: float(v) for k, v in evaluator.callback_metrics.items()})
            if ckpt:
                metrics["ckpt_path"] = ckpt  # type: ignore[assignment]
        record_attention_backends(module, loggers, metrics)
        return metrics
    except NonFiniteError as exc:
        exc.kept = resume_advice(output_dir / "checkpoints")  # its loss and max |w|; warns if already diverging
        raise
    except SIGTERMException:
        # Preempted: InterruptedCheckpoint has written checkpoints/interrupted.ckpt; resume from it.
        saved = output_dir / "checkpoints" / "interrupted.ckpt"
        log.warning(f"SIGTERM received: saved {saved}; exiting with 143" if saved.exists()
                    else "SIGTERM received before the first step: nothing saved; exiting with 143")
        raise SystemExit(143) from None
    finally:
        close_loggers()


def record_attention_backends(module: L.LightningModule, loggers: list[Logger], metrics: dict) -> None:
    """Record which backend (``attention.backend``, ``ops.dispatch``) each attention layer ran on: one line in
    ``metrics`` (``attention/backend``, so in ``metrics.json``) and the per-layer dict in every logger's config."""
    summary = backend_summary(module)
    if summary is None:  # nothing ran in this process (e.g. a spawned fit without a final evaluation)
        return
    metrics["attention/backend"] = summary
    for logger in loggers:
        logger.log_hyperparams({"attention_backend": attention_backends(module)})


def reset_metrics(module: L.LightningModule) -> None:
    """Clear every torchmetrics state of ``module`` before an evaluation.

    After a spawned fit (``ddp_cpu``) the main process's copy of the module holds the metric states that came
    back with rank 0's weights; evaluating on top of them mixes old batches into the new number.
    """
    for child in module.modules():
        if isinstance(child, Metric):
            child.reset()


def evaluation_trainer(cfg: DictConfig, trainer: L.Trainer, loggers: list[Logger]) -> L.Trainer:
    """The trainer that computes the reported final metrics: ``trainer`` itself, or one device after a spawned fit.

    A ``DistributedSampler`` pads an evaluation split to a multiple of the world size (repeating examples),
    so a metric computed over 2 spawned processes can differ from ``eval.py``'s single-process number. When
    fit ran in spawned workers (``ddp_spawn``: the main process is idle and holds rank 0's weights), the final
    validation and test run here on one device instead, over every example exactly once. Script-launched DDP
    (``trainer=ddp`` on GPUs, every rank runs this code) keeps its distributed evaluation.
    """
    launcher = getattr(trainer.strategy, "launcher", None)
    spawned = trainer.world_size > 1 and type(launcher).__name__ == "_MultiProcessingLauncher"
    if not spawned:
        return trainer
    log.info("final evaluation on one device (fit ran in spawned processes), so every example counts once")
    single = {"devices": 1, "num_nodes": 1, "strategy": "auto"}
    if "sync_batchnorm" in cfg.trainer:
        single["sync_batchnorm"] = False
    node = OmegaConf.merge(OmegaConf.to_container(cfg.trainer, resolve=True), single)
    for logger in loggers:
        if isinstance(logger, CSVLogger):
            append_to_rank_zero_csv(logger)
    evaluator = build_trainer(OmegaConf.create({"trainer": node}), [], loggers)
    # Lightning logs evaluation metrics at the trainer's count of optimizer steps, which a fresh trainer starts at 0;
    # the final rows belong at the step the spawned fit ended (the one saved in last.ckpt).
    last = last_checkpoint(trainer)
    evaluator.fit_loop.epoch_loop._batches_that_stepped = max(0, checkpoint_step(last)) if last else 0
    return evaluator


def append_to_rank_zero_csv(logger: CSVLogger) -> None:
    """Let this process's CSV logger append to the ``metrics.csv`` that spawned rank 0 wrote.

    Its writer was made before the fit and has seen none of the ranks' columns; Lightning rewrites the file with
    the writer's own header when a new column appears, which fails on the ranks' rows (and truncated the file).
    Knowing the header on disk, the writer keeps every training row and widens the header instead.
    """
    writer = logger.experiment
    path = Path(writer.metrics_file_path)
    if not path.is_file():
        return
    with path.open(newline="") as f:
        header = next(csv.reader(f), [])
    writer.metrics_keys = sorted(set(writer.metrics_keys) | set(header))


def validate_final_weights(cfg: DictConfig, trainer: L.Trainer, evaluator: L.Trainer, module: L.LightningModule,
                           datamodule: L.LightningDataModule) -> dict[str, float]:
    """Validate the final weights when ``trainer.max_steps`` ended fit before any validation; returns the metrics.

    Runs from the saved ``last.ckpt`` when there is one, so the weights validated are exactly the ones on disk
    (``eval.py ckpt_path=<run>/checkpoints/last.ckpt split=val`` reports the same number).
    """
    monitor = cfg.task.get("monitor")
    if not monitor or monitor in trainer.callback_metrics or trainer.interrupted or trainer.fast_dev_run:
        return {}
    log.info(f"no validation ran during fit (trainer.max_steps ended it first): validating the final weights for {monitor}")
    reset_metrics(module)
    evaluator.validate(module, datamodule=datamodule, ckpt_path=last_checkpoint(trainer), verbose=False,
                       weights_only=False)
    return {k: float(v) for k, v in evaluator.callback_metrics.items()}


def last_checkpoint(trainer: L.Trainer) -> str | None:
    """``last.ckpt`` of this run when it exists (found on disk: after a spawned fit the main process's callback
    does not know the path its worker wrote)."""
    cb = trainer.checkpoint_callback
    if cb is None:
        return None
    candidates = [getattr(cb, "last_model_path", None)]
    if getattr(cb, "dirpath", None):
        candidates.append(str(Path(cb.dirpath) / f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}"))
    return next((p for p in candidates if p and Path(p).is_file()), None)


def test_checkpoint(cfg: DictConfig, trainer: L.Trainer, trained: bool) -> str | None:
    """The checkpoint to test: best validation, else last; the current weights (None) when none was written.

    ``train=false`` tests ``ckpt_path`` if given, else the weights the module was built with (e.g. TRAMS
    evaluation of ``task.module.init_from``).
    """
    if not trained:
        return cfg.get("ckpt_path") or None
    if trainer.fast_dev_run:
        return None
    cb = trainer.checkpoint_callback
    if cb is None:
        log.info("no checkpoint callback (callbacks=none): testing the current weights")
        return None
    best = cb.best_model_path if cb.best_model_path and Path(cb.best_model_path).is_file() else None
    return best or last_checkpoint(trainer)


def run_directory(ckpt_path: str | Path, run_dir: str | Path | None = None) -> Path:
    """The training run a checkpoint belongs to: ``run_dir`` when given, else the checkpoint's grandparent."""
    return Path(run_dir) if run_dir else Path(ckpt_path).resolve().parent.parent


def load_run_config(ckpt_path: str | Path, run_dir: str | Path | None = None) -> DictConfig:
    """The resolved config a checkpoint was trained with (``<run>/config_resolved.yaml``)."""
    ckpt_path = Path(ckpt_path)
    run_dir = run_directory(ckpt_path, run_dir)
    path = run_dir / RESOLVED_CONFIG
    if not path.is_file():
        raise ConfigError("run_dir", f"{path} not found: {ckpt_path} is not inside a training run directory "
                                     f"(<run>/checkpoints/); pass run_dir=<the run directory that holds {RESOLVED_CONFIG}>")
    return OmegaConf.load(path)


def load_checkpoint_run(cfg: DictConfig, map_location: str = "cpu") -> tuple[L.LightningDataModule, L.LightningModule]:
    """The datamodule and the trained module of ``cfg.ckpt_path``, built from its run's saved config (eval.py)."""
    register_resolvers()
    read_checkpoint(cfg.ckpt_path)  # a missing or truncated file is named before the run dir is consulted
    run_cfg = load_run_config(cfg.ckpt_path, cfg.get("run_dir"))
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = hydra.utils.instantiate(run_cfg.task.data)
    module_cls = hydra.utils.get_class(run_cfg.task.module._target_)
    return datamodule, module_cls.load_from_checkpoint(cfg.ckpt_path, map_location=map_location, weights_only=False)


@records_run_outcome  # <eval run>/metrics.json: the metrics eval.py printed, and its status
def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Test ``cfg.ckpt_path`` on its own task (val or test split) with the run's saved config."""
    check_eval_config(cfg)
    datamodule, module = load_checkpoint_run(cfg)
    loggers = instantiate_group(cfg.get("logger"))
    trainer = build_trainer(cfg, [], loggers)
    try:
        run = trainer.validate if cfg.get("split", "test") == "val" else trainer.test
        run(module, datamodule=datamodule, verbose=False)
        return {k: float(v) for k, v in trainer.callback_metrics.items()}
    finally:
        close_loggers()


EVAL_MODES = ("evaluate", "sample")  # eval.py mode=
EVAL_SPLITS = ("test", "val")  # eval.py split=


def check_eval_mode(mode: Any) -> str:
    """``mode`` of ``eval.py`` when valid, else a ``ConfigError`` naming the key and the valid values."""
    if mode not in EVAL_MODES:
        raise ConfigError("mode", f"{mode!r} is not valid; choose one of {EVAL_MODES}")
    return mode


def check_eval_config(cfg: DictConfig) -> None:
    """Every check an ``eval.py`` config passes or fails on its own: ``ckpt_path`` given and present,
    ``mode`` and ``split`` valid, the seed and the trainer keys. ``eval.py`` runs it before Hydra makes its run
    directory; ``evaluate`` and ``sample`` run it again."""
    if OmegaConf.is_missing(cfg, "ckpt_path") or not cfg.get("ckpt_path"):
        raise ConfigError("ckpt_path", "is required: python eval.py ckpt_path=<run>/checkpoints/best.ckpt (a run "
                                       "directory stands for its best.ckpt, else last.ckpt)")
    if not Path(cfg.ckpt_path).exists():
        read_checkpoint(cfg.ckpt_path)  # names the missing file and what its folder holds
    check_eval_mode(cfg.get("mode", "evaluate"))
    if cfg.get("split", "test") not in EVAL_SPLITS:
        raise ConfigError("split", f"{cfg.split!r} is not valid; choose one of {EVAL_SPLITS}")
    check_seed(cfg.get("seed"))
    check_trainer_types(cfg.trainer)


def sample(cfg: DictConfig) -> dict[str, str]:
    """``eval.py mode=sample``: generate from ``cfg.ckpt_path`` with the config of the run that produced it.

    Image tasks write ``samples.png``, ``samples.npz`` and ``completions.png``; LM tasks print their
    continuations of ``sample.prompt`` and save ``samples.txt`` (``longseq.tasks.sampling``). Everything goes to
    ``sample.out_dir`` (default ``<run>/samples/``; a relative path is inside ``<run>/``). Returns the written
    files by name.
    """
    from longseq.models.transformer import check_positive_int
    from longseq.tasks.sampling import sample_out_dir, write_image_samples, write_text_samples

    check_eval_config(cfg)
    spec = cfg.sample
    for key in ("n", "k", "tokens"):
        if spec.get(key) is not None:
            check_positive_int(f"sample.{key}", spec[key])
    out_dir = sample_out_dir(spec.get("out_dir"), run_directory(cfg.ckpt_path, cfg.get("run_dir")))
    device = "cuda" if torch.cuda.is_available() and cfg.trainer.get("accelerator") in ("auto", "gpu", "cuda") else "cpu"
    datamodule, module = load_checkpoint_run(cfg, map_location=device)
    module.eval()
    generator = torch.Generator(device=device).manual_seed(int(cfg.get("seed") or 0))
    image_task = hasattr(module, "num_levels") and callable(getattr(module, "sample", None))
    if not image_task and not callable(getattr(module, "generate", None)):
        raise ConfigError("mode", f"sample needs an image density or a causal LM task; {type(module).__name__} "
                                  "(task.module._target_ of the run) cannot generate: use mode=evaluate")
    out_dir.mkdir(parents=True, exist_ok=True)
    if image_task:
        return write_image_samples(module, datamodule, n=spec.n or 16, temperature=spec.temperature,
                                   cache=bool(spec.cache), out_dir=out_dir, generator=generator,
                                   completions=int(spec.completions), k=int(spec.k),
                                   prompt_fraction=spec.prompt_fraction)
    write_text_samples(module, datamodule, prompt=str(spec.prompt), n=spec.n or 1, tokens=spec.tokens,
                       temperature=spec.temperature, top_k=spec.top_k, cache=bool(spec.cache), out_dir=out_dir,
                       generator=generator)
    return {"samples.txt": str(out_dir / "samples.txt")}


def set_float32_precision() -> None:
    """Allow TF32 matmuls on Ampere+ GPUs (no effect on CPU)."""
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")
