"""Shared LightningModule plumbing: building the backbone, optimizer and schedule from config."""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any

import hydra
import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from longseq.models.transformer import Transformer
from longseq.utils.compiling import COMPILE_MODES, compile_options, new_step
from longseq.utils.errors import ConfigError

log = logging.getLogger(__name__)

# Arguments of the callables behind optimizer._target_ / scheduler._target_ (and of the backbone) that the task
# passes itself.
OPTIMIZER_SUPPLIED = ("params",)
SCHEDULER_SUPPLIED = ("optimizer", "total_steps")
BACKBONE_SUPPLIED = ("vocab_size", "seq_len", "attention", "image_shape", "out_dim")


def _number(key: str, value: Any, low: float, low_inclusive: bool, high: float = math.inf,
            high_inclusive: bool = False) -> float:
    """``value`` as a float when it is a finite real number in the given range, else a ``ConfigError`` for ``key``."""
    ok_type = isinstance(value, (int, float)) and not isinstance(value, bool)
    in_range = ok_type and math.isfinite(value) and (value >= low if low_inclusive else value > low) and (
        value <= high if high_inclusive else value < high)
    if not in_range:
        lo, hi = ("[" if low_inclusive else "(") + f"{low:g}", f"{high:g}" + ("]" if high_inclusive else ")")
        raise ConfigError(key, f"must be a finite number in {lo}, {hi}, got {value!r}")
    return float(value)


def _check_arguments(group: str, spec: dict, supplied: tuple[str, ...]) -> None:
    """``<group>._target_`` imports, and every other key of ``spec`` is one of its arguments."""
    target = spec.get("_target_")
    try:
        fn = hydra.utils.get_object(str(target))
    except Exception as err:
        raise ConfigError(f"{group}._target_", f"cannot import {target!r} ({type(err).__name__})") from None
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: nothing more to check
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    valid = [name for name in parameters if name not in supplied]
    for key in spec:
        if not key.startswith("_") and key not in valid:
            raise ConfigError(f"{group}.{key}", f"is not an argument of {target}; valid: {valid}")


def check_backbone_keys(model: dict) -> None:
    """Every ``model.<key>`` is an argument of the backbone (``+model.bogus=1`` would otherwise fail inside
    ``Transformer.__init__`` without naming the key)."""
    import difflib

    valid = [name for name in inspect.signature(Transformer).parameters if name not in BACKBONE_SUPPLIED]
    for key in model:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f" (did you mean model.{close[0]}?)" if close else ""
            raise ConfigError(f"model.{key}", f"is not an argument of the backbone "
                                              f"({Transformer.__module__}.Transformer){hint}; valid: {', '.join(valid)}")


def check_optimization(optimizer: dict | None, scheduler: dict | None, required: bool = True) -> None:
    """Reject optimizer / scheduler settings that cannot train, naming the key, at module construction
    (torch would raise later, without the key, after the run has started): the targets must import and take
    the given keys; ``optimizer.lr`` must be finite and > 0, ``weight_decay``, ``eps``, ``momentum`` finite and
    >= 0 (``eps`` > 0), ``betas`` two numbers in [0, 1); ``scheduler.warmup_steps`` an integer >= 0,
    ``scheduler.min_lr_ratio`` in [0, 1]. An empty optimizer passes when not ``required`` (a module built only
    for evaluation or sampling)."""
    optimizer, scheduler = to_dict(optimizer) or {}, to_dict(scheduler) or {}
    if not optimizer and not required:
        return
    if not optimizer:
        raise ConfigError("optimizer", "is empty; choose one of conf/optimizer (optimizer=adamw)")
    _check_arguments("optimizer", optimizer, OPTIMIZER_SUPPLIED)
    if "lr" in optimizer:
        _number("optimizer.lr", optimizer["lr"], 0, False)
    for key in ("weight_decay", "momentum"):
        if key in optimizer:
            _number(f"optimizer.{key}", optimizer[key], 0, True)
    if "eps" in optimizer:
        _number("optimizer.eps", optimizer["eps"], 0, False)
    if "betas" in optimizer:
        betas = optimizer["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ConfigError("optimizer.betas", f"must be two numbers [beta1, beta2] in [0, 1), got {betas!r}")
        for i, beta in enumerate(betas):
            _number(f"optimizer.betas[{i}]", beta, 0, True, 1, False)
    if not scheduler:
        return
    _check_arguments("scheduler", scheduler, SCHEDULER_SUPPLIED)
    if "warmup_steps" in scheduler:
        steps = scheduler["warmup_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError("scheduler.warmup_steps", f"must be an integer >= 0, got {steps!r}")
    if "min_lr_ratio" in scheduler:
        _number("scheduler.min_lr_ratio", scheduler["min_lr_ratio"], 0, True, 1, True)


def warn_if_warmup_outlasts_run(scheduler: dict, total_steps: int, lr: float | None) -> None:
    """Warn when the run ends inside its warm-up (``trainer.max_steps=20`` with ``scheduler.warmup_steps=30``): the
    learning rate never reaches ``optimizer.lr``, which nothing else would say."""
    warmup = scheduler.get("warmup_steps") or 0
    if total_steps >= warmup:
        return
    fraction = total_steps / warmup  # the warm-up factor of the last step, (step + 1) / warmup_steps
    reached = (f" (the last step's learning rate is {lr * fraction:.3g}, {fraction:.0%} of optimizer.lr={lr:g})"
               if lr else "")
    log.warning(f"scheduler.warmup_steps={warmup} is longer than this run ({total_steps} optimizer steps): the "
                f"learning rate never finishes its warm-up{reached}; lower scheduler.warmup_steps or raise "
                "trainer.max_steps")


def to_dict(node: Any) -> Any:
    """Resolved plain container from an OmegaConf node (or the value itself)."""
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)
    return node


class SequenceTask(L.LightningModule):
    """Base of every task: owns the backbone built from ``model`` + ``attention`` and the optimizer.

    Subclasses define the loss, metrics and the causal requirement (``requires_causal``).
    """

    requires_causal: bool | None = None  # True: LM/density; False: encoders; None: either
    padded = False  # whether batches carry a key padding mask (LRA's classifier sets it; flex needs padded masks)

    def __init__(self, model: dict, attention: dict, optimizer: dict, scheduler: dict | None,
                 vocab_size: int, seq_len: int, out_dim: int | None = None,
                 image_shape: tuple[int, int, int] | None = None) -> None:
        super().__init__()
        # logger=False: the runner logs the whole resolved config once; Lightning re-wrote every logger's hparams.yaml
        # at each stage (fit, validate, test: 0.15 s each on a 2-core CPU, a fifth of a tiny run)
        self.save_hyperparameters(logger=False)
        model, attention = to_dict(model), to_dict(attention)
        if self.requires_causal is not None and bool(attention.get("causal", False)) != self.requires_causal:
            kind = "causal" if self.requires_causal else "bidirectional"
            raise ValueError(
                f"{type(self).__name__} needs {kind} attention but attention '{attention.get('name')}' has "
                f"attention.causal={attention.get('causal')}; set attention.causal={str(self.requires_causal).lower()} "
                "or pick an attention that supports it"
            )
        check_optimization(optimizer, scheduler, required=False)
        self.compile_backbone = model.get("compile", False)
        if not isinstance(self.compile_backbone, bool):
            raise ConfigError("model.compile", f"must be true or false, got {self.compile_backbone!r}")
        self.compile_mode = model.get("compile_mode", "default")
        if self.compile_mode not in COMPILE_MODES:
            raise ConfigError("model.compile_mode", f"{self.compile_mode!r} is not valid; choose one of {COMPILE_MODES}")
        model = {k: v for k, v in model.items() if k not in ("_target_", "compile", "compile_mode")}
        check_backbone_keys(model)
        self.net = Transformer(vocab_size=vocab_size, seq_len=seq_len, attention=attention,
                               image_shape=image_shape, out_dim=out_dim, **model)

    def configure_model(self) -> None:
        """``model.compile=true``: the backbone's forward through ``torch.compile`` (with ``model.compile_mode``), once,
        when the Trainer sets the module up (after subclasses replaced parts such as the classifier's head). In place
        (``nn.Module.compile``), so parameter names, checkpoints and the decoding methods stay those of the plain
        backbone."""
        if self.compile_backbone and self.net._compiled_call_impl is None:
            self.net.compile(**compile_options(self.compile_mode))

    def on_fit_start(self) -> None:
        self._prepare_compiled_backbone()

    def on_validation_start(self) -> None:
        self._prepare_compiled_backbone()

    def on_test_start(self) -> None:
        self._prepare_compiled_backbone()

    def on_predict_start(self) -> None:
        self._prepare_compiled_backbone()

    def _prepare_compiled_backbone(self) -> None:
        """``model.compile=true``: the layers' static flex layouts on the module's device before the first traced
        step (``Transformer.prepare_flex_layouts``: one graph, no recompile at the second step). Here, not in
        ``configure_model``: the Trainer moves the module to its device after that hook."""
        if self.compile_backbone:
            self.net.prepare_flex_layouts(self.device, padded=self.padded)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._new_graph_step()

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._new_graph_step()

    def _new_graph_step(self) -> None:
        """``model.compile_mode=reduce-overhead``: a new step for CUDA graph trees, so replays may reuse the previous
        step's output buffers (no "overwritten by a subsequent run" error between training and validation)."""
        if self.compile_backbone:
            new_step(self.compile_mode)

    def on_train_start(self) -> None:
        # A line in the run's log file marks that signal handlers are installed (used by the SIGTERM test).
        log.info(f"training started at step {self.global_step}")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log("train/lr", optimizer.param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        """AdamW-style optimizer with weight decay on matrices only, plus a per-step schedule."""
        check_optimization(self.hparams.optimizer, self.hparams.scheduler)  # XLLanguageModel reuses this method
        decay, no_decay = [], []
        for name, p in self.trainer.model.named_parameters():  # the wrapped model under FSDP
            if not p.requires_grad:
                continue
            (decay if p.dim() >= 2 and "token" not in name and "pos" not in name else no_decay).append(p)
        opt_cfg = dict(to_dict(self.hparams.optimizer))
        wd = opt_cfg.pop("weight_decay", 0.0)
        make_opt = hydra.utils.instantiate(opt_cfg)
        optimizer = make_opt([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}])
        if not self.hparams.scheduler:
            return optimizer
        make_sched = hydra.utils.instantiate(to_dict(self.hparams.scheduler))
        total_steps = int(self.trainer.estimated_stepping_batches)
        if self.trainer.is_global_zero and not self.trainer.fast_dev_run:
            warn_if_warmup_outlasts_run(to_dict(self.hparams.scheduler), total_steps, opt_cfg.get("lr"))
        scheduler = make_sched(optimizer, total_steps=total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
