"""What ``train.py`` and ``eval.py`` do, importable and testable: build objects from config, run, report.

Entry points stay thin (lightning-hydra-template style): they compose the config and call ``train``
or ``evaluate``. Both return a dict of final metrics.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import math
from pathlib import Path
from typing import Any, Iterator

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
from longseq.callbacks.resume import ResumedOptimization
from longseq.preflight.evaluate import EVAL_MODES, EVAL_SPLITS, check_eval_config, check_eval_mode  # noqa: F401
from longseq.preflight.train import check_train_config
from longseq.preflight.trainer import trainer_error
from longseq.report.outcome import METRICS_FILE, records_run_outcome
from longseq.utils.build import build_datamodule, build_module
from longseq.utils.checkpoint import (  # noqa: F401 - load_run_config / run_directory: the notebooks import them here
    AtomicCheckpointIO,
    checkpoint_step,
    load_run_config,
    read_checkpoint,
    run_directory,
)
from longseq.utils.config import ensure_csv_logger, register_resolvers
from longseq.utils.console import quiet_lightning
from longseq.utils.errors import NonFiniteError, names_what_to_fix
from longseq.utils.resume import continue_loggers, resuming_in_place
from longseq.utils.rundir import RESOLVED_CONFIG, discard_created, rank_zero
from longseq.utils.xla import trainer_accelerator

log = logging.getLogger(__name__)

def instantiate_group(group: DictConfig | None) -> list[Any]:
    """Instantiate every ``_target_`` entry of a callbacks/logger group (None or empty -> [])."""
    if not group:
        return []
    return [hydra.utils.instantiate(node) for node in group.values() if node and "_target_" in node]


def build_trainer(cfg: DictConfig, callbacks: list, loggers: list[Logger]) -> L.Trainer:
    """The Trainer of ``cfg.trainer`` (checked before the run: ``preflight``), with atomic checkpoint writes, the
    step bar and the model summary."""
    quiet_lightning()
    callbacks = console_callbacks(cfg.trainer, callbacks)  # the step bar and the compact model summary
    extra = trainer_accelerator(cfg.trainer)  # Lightning's XLA accelerator, on XLA's CPU device where no TPU is
    if not extra and "plugins" not in cfg.trainer:
        extra["plugins"] = [AtomicCheckpointIO()]
    try:
        return hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False, **extra)
    except InstantiationException as exc:
        if isinstance(exc.__cause__, (MisconfigurationException, ValueError, TypeError)):
            raise trainer_error(exc.__cause__) from exc  # a setting Lightning refuses (fsdp on the CPU ...)
        raise


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
def train(cfg: DictConfig, checked: bool = False) -> dict[str, float]:
    """Fit (optionally resuming ``cfg.ckpt_path``) then test the best checkpoint; returns final metrics.

    Everything the run writes goes under ``cfg.paths.output_dir`` (the Hydra run directory). The config passes
    ``preflight.train.check_train_config`` before anything is written (``checked``: ``train.py`` checked it before
    Hydra made the run directory; the other ranks of a DDP job share their rank 0's check). A refusal that only the
    run can find (a data split too small for the batch ...) removes the run directory this process made for it, if
    nothing was trained (``utils.rundir.discard_created``).
    """
    register_resolvers()
    if not checked and rank_zero():
        check_train_config(cfg)
    output_dir = Path(cfg.paths.output_dir)
    try:
        return fit_and_test(cfg, output_dir)
    except Exception as exc:
        if refused_before_training(exc, cfg, getattr(exc, "trained_steps", 0)):
            discard_created(output_dir)
        raise


def refused_before_training(exc: BaseException, cfg: DictConfig, trained_steps: int) -> bool:
    """A refusal that names what to fix, raised by a fresh run before its first optimizer step: nothing to keep."""
    fresh = not cfg.get("ckpt_path")
    return fresh and trained_steps == 0 and names_what_to_fix(exc) and not isinstance(exc, NonFiniteError)


def fit_and_test(cfg: DictConfig, output_dir: Path) -> dict[str, float]:
    """``train``'s run: set up the run directory, fit, validate the final weights, test; an exception leaving it
    carries ``trained_steps`` (the optimizer steps taken)."""
    ensure_csv_logger(cfg)  # every run's curves in <run>/csv/metrics.csv (extras.csv_metrics)
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
    if cfg.get("ckpt_path"):
        callbacks.append(ResumedOptimization())  # the command's optimizer / schedule settings win over the restored
    loggers = instantiate_group(cfg.get("logger"))
    trainer = build_trainer(cfg, callbacks, loggers)
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
    except Exception as exc:
        exc.trained_steps = trainer.global_step  # type: ignore[attr-defined] - read by train (a refusal or a failure)
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
def evaluate(cfg: DictConfig, checked: bool = False) -> dict[str, float]:
    """Test ``cfg.ckpt_path`` on its own task (val or test split) with the run's saved config (``checked``: eval.py
    checked ``cfg`` before Hydra made the run directory). A refusal from inside removes the run directory this
    process made for it."""
    if not checked:
        check_eval_config(cfg)
    with refusal_discards(cfg):
        datamodule, module = load_checkpoint_run(cfg)
        loggers = instantiate_group(cfg.get("logger"))
        trainer = build_trainer(cfg, [], loggers)
        try:
            run = trainer.validate if cfg.get("split", "test") == "val" else trainer.test
            run(module, datamodule=datamodule, verbose=False)
            return {k: float(v) for k, v in trainer.callback_metrics.items()}
        finally:
            close_loggers()


@contextlib.contextmanager
def refusal_discards(cfg: DictConfig) -> Iterator[None]:
    """An error naming what to fix, raised inside: the eval run directory this process made goes (it holds nothing
    but its log); ``utils.rundir.discard_created`` leaves any other directory alone."""
    try:
        yield
    except Exception as exc:
        if names_what_to_fix(exc) and not isinstance(exc, NonFiniteError):
            discard_created(Path(cfg.paths.output_dir))
        raise


def sample(cfg: DictConfig, checked: bool = False) -> dict[str, str]:
    """``eval.py mode=sample``: generate from ``cfg.ckpt_path`` with the config of the run that produced it.

    Image tasks write ``samples.png``, ``samples.npz`` and ``completions.png``; LM tasks print their
    continuations of ``sample.prompt`` and save ``samples.txt`` (``longseq.tasks.sampling``). Everything goes to
    ``sample.out_dir`` (default ``<run>/samples/``; a relative path is inside ``<run>/``). Returns the written
    files by name. ``checked``: as for ``evaluate``.
    """
    if not checked:
        check_eval_config(cfg)
    with refusal_discards(cfg):
        return draw_samples(cfg)


def draw_samples(cfg: DictConfig) -> dict[str, str]:
    """``sample``'s work, on a checked config."""
    from longseq.tasks.sampling import (
        check_can_sample,
        sample_out_dir,
        write_image_samples,
        write_text_samples,
    )

    spec = cfg.sample
    out_dir = sample_out_dir(spec.get("out_dir"), run_directory(cfg.ckpt_path, cfg.get("run_dir")))
    device = "cuda" if torch.cuda.is_available() and cfg.trainer.get("accelerator") in ("auto", "gpu", "cuda") else "cpu"
    datamodule, module = load_checkpoint_run(cfg, map_location=device)
    module.eval()
    generator = torch.Generator(device=device).manual_seed(int(cfg.get("seed") or 0))
    check_can_sample(type(module))
    image_task = hasattr(module, "num_levels") and callable(getattr(module, "sample", None))
    out_dir.mkdir(parents=True, exist_ok=True)
    if image_task:
        if spec.get("top_k") is not None:
            log.warning(f"sample.top_k={spec.top_k} applies to LM tasks only; an image task samples among every level")
        return write_image_samples(module, datamodule, n=spec.n or 16, temperature=spec.temperature,
                                   cache=bool(spec.cache), out_dir=out_dir, generator=generator,
                                   completions=int(spec.completions), k=int(spec.k),
                                   prompt_fraction=spec.prompt_fraction)
    write_text_samples(module, datamodule, prompt=str(spec.prompt), n=spec.n or 1, tokens=spec.tokens,
                       temperature=spec.temperature, top_k=spec.top_k, cache=bool(spec.cache), out_dir=out_dir,
                       generator=generator)
    return {"samples.txt": str(out_dir / "samples.txt")}


def headline_metrics(metrics: dict[str, Any], monitor: str | None) -> dict[str, float]:
    """The final metrics worth a console line: the task's monitored metric on validation (its last and best value)
    and on test, its variants (``test/trams_bpc`` beside ``test/bpc``), and the loss of each split; every other
    metric (a recall task's per-bucket accuracies ...) stays in ``<run>/metrics.json``. Without a monitor: every
    val/ and test/ metric."""
    numbers = {k: v for k, v in metrics.items() if k.startswith(("test/", "val/")) and isinstance(v, float)}
    if not monitor:
        return dict(sorted(numbers.items()))
    name = monitor.split("/", 1)[-1]

    def headline(key: str) -> bool:
        leaf = key.split("/", 1)[1]
        return leaf in (name, f"{name}_best", "loss") or leaf.endswith(f"_{name}")

    order = {"val": 0, "test": 1}
    return dict(sorted(((k, v) for k, v in numbers.items() if headline(k)),
                       key=lambda kv: (kv[0].split("/", 1)[1] == "loss", order[kv[0].split("/", 1)[0]], kv[0])))


def results_line(metrics: dict[str, Any], monitor: str | None, output_dir: Path) -> str:
    """``results: val/acc=0.9912, val/acc_best=0.9950, test/acc=0.9901 (all 31 metrics: <run>/metrics.json)``."""
    shown = headline_metrics(metrics, monitor)
    total = sum(1 for k in metrics if k.startswith(("test/", "val/")))
    more = f" (all {total} metrics: {output_dir / METRICS_FILE})" if total > len(shown) else ""
    return "results: " + ", ".join(f"{k}={v:.4f}" for k, v in shown.items()) + more


def set_float32_precision() -> None:
    """Allow TF32 matmuls on Ampere+ GPUs (no effect on CPU)."""
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")
