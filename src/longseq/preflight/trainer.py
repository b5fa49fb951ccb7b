"""The ``trainer.*`` keys and the callbacks, checked before a run: our types and ranges first (Lightning's own
messages do not name the key, and some accept a value they then ignore or swap), then Lightning itself, by building
the run's Trainer with its callbacks while nothing is written (``check_with_lightning``)."""

from __future__ import annotations

import contextlib
import difflib
import inspect
import logging
import math
import re
import typing
import warnings
from typing import Any, Iterator

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig, ListConfig

from longseq.utils.errors import ConfigError, names_what_to_fix

# trainer.<key> -> (accepted Python types, None allowed, what is expected). Hydra passes the strings users typed
# straight to Lightning, whose errors (a TypeError about '<') do not name the key.
INT, NUM, BOOL = (int,), (int, float), (bool,)
TRAINER_TYPES: dict[str, tuple[tuple[type, ...], bool, str]] = {
    "max_steps": (INT, False, "an integer number of optimizer steps (-1: no limit)"),
    "min_steps": (INT, True, "an integer number of optimizer steps"),
    "max_epochs": (INT, True, "an integer number of epochs (-1: no limit)"),
    "min_epochs": (INT, True, "an integer number of epochs"),
    "num_nodes": (INT, False, "a positive integer"),
    "accumulate_grad_batches": (INT, False, "a positive integer"),
    "log_every_n_steps": (INT, False, "a positive integer"),
    "check_val_every_n_epoch": (INT, True, "a positive integer or null"),
    "num_sanity_val_steps": (INT, True, "an integer >= 0 (-1: all batches)"),
    "gradient_clip_val": (NUM, True, "a number >= 0 or null"),
    "val_check_interval": (NUM, True, "a fraction of an epoch in (0, 1] (float) or a number of batches >= 1 (int), "
                                      "or null"),
    "limit_train_batches": (NUM, True, "a fraction in [0, 1] (float) or a number of batches >= 0 (int), or null"),
    "limit_val_batches": (NUM, True, "a fraction in [0, 1] (float) or a number of batches >= 0 (int), or null"),
    "limit_test_batches": (NUM, True, "a fraction in [0, 1] (float) or a number of batches >= 0 (int), or null"),
    "overfit_batches": (NUM, True, "a fraction in [0, 1] (float) or a number of batches >= 0 (int)"),
    "fast_dev_run": ((bool, int), False, "true, false or a number of batches"),
    "enable_progress_bar": (BOOL, False, "true or false"),
    "enable_model_summary": (BOOL, False, "true or false"),
    "detect_anomaly": (BOOL, False, "true or false"),
}
# The smallest value Lightning accepts, where it has one (-1: no limit). max_steps=0 would train nothing and test
# the untrained model: refused (check_training_length says what to use instead).
MINIMUM = {"num_nodes": 1, "accumulate_grad_batches": 1, "log_every_n_steps": 1, "check_val_every_n_epoch": 1,
           "max_steps": -1, "max_epochs": -1, "min_steps": 0, "min_epochs": 0, "gradient_clip_val": 0,
           "num_sanity_val_steps": -1, "limit_train_batches": 0, "limit_val_batches": 0, "limit_test_batches": 0,
           "overfit_batches": 0, "val_check_interval": 0}
# Keys whose fractions (floats) stop at 1 and whose zero is no interval at all.
FRACTION_AT_MOST_ONE = ("limit_train_batches", "limit_val_batches", "limit_test_batches", "overfit_batches",
                        "val_check_interval")

TRAINER_TARGETS = ("lightning.pytorch.Trainer", "lightning.pytorch.trainer.trainer.Trainer", "lightning.Trainer",
                   "pytorch_lightning.Trainer")


def trainer_arguments() -> set[str]:
    """The keyword arguments of ``lightning.pytorch.Trainer`` (what ``trainer.<key>`` may name)."""
    from lightning.pytorch import Trainer

    return {name for name in inspect.signature(Trainer.__init__).parameters if name != "self"}


def check_trainer_keys(trainer: DictConfig | dict) -> None:
    """Raise ``ConfigError('trainer.<key>', ...)`` for a key Lightning's Trainer does not take (``+trainer.bogus=1``);
    Lightning would say only ``Trainer.__init__() got an unexpected keyword argument``."""
    if str(trainer.get("_target_", TRAINER_TARGETS[0])) not in TRAINER_TARGETS:
        return  # a custom trainer class: its own signature decides
    valid = trainer_arguments()
    for key in trainer:
        if key == "_target_" or key in valid:
            continue
        close = difflib.get_close_matches(str(key), sorted(valid), n=1)
        hint = f" (did you mean trainer.{close[0]}?)" if close else ""
        raise ConfigError(f"trainer.{key}", f"is not an argument of lightning.pytorch.Trainer{hint}; valid keys: "
                                            f"{', '.join(sorted(valid))}")


def value_ok(key: str, value: Any, types: tuple[type, ...], nullable: bool) -> bool:
    """Whether ``trainer.<key>=value`` has an accepted type and lies in Lightning's range."""
    if value is None:
        return nullable
    if isinstance(value, bool):  # bool is an int subclass: accept it only where a bool is meant
        return bool in types
    if not isinstance(value, types) or not value >= MINIMUM.get(key, -math.inf):
        return False
    if key in FRACTION_AT_MOST_ONE and isinstance(value, float) and value > 1:
        return False
    return not (key == "val_check_interval" and value == 0)


def check_trainer_types(trainer: DictConfig | dict) -> None:
    """Raise ``ConfigError('trainer.<key>', ...)`` for a trainer key Lightning does not take, a value of the wrong
    type or outside its range, a precision or device count Lightning rejects, or an accelerator this machine lacks."""
    check_trainer_keys(trainer)
    for key, (types, nullable, expected) in TRAINER_TYPES.items():
        if key in trainer and not value_ok(key, trainer[key], types, nullable):
            raise ConfigError(f"trainer.{key}", f"expected {expected}, got {trainer[key]!r}")
    check_devices(trainer.get("devices"))
    check_precision(trainer.get("precision"))
    check_accelerator(trainer.get("accelerator"))


def check_training_length(cfg: DictConfig) -> None:
    """A training run must be allowed at least one optimizer step: ``trainer.max_steps=0`` (or ``max_epochs=0``)
    would fit nothing and then test the untrained model as if it were a result."""
    if not cfg.get("train", True):
        return
    for key in ("max_steps", "max_epochs"):
        if cfg.trainer.get(key) == 0:
            raise ConfigError(f"trainer.{key}", "0 trains nothing (the untrained model would be tested as if it were "
                                                f"a result); use trainer.{key} >= 1 (-1: no limit), or train=false to "
                                                "only test (with ckpt_path=<checkpoint>), or eval.py for a checkpoint")


def check_devices(devices: Any) -> None:
    """``trainer.devices``: a number of devices >= 1, -1 (all), 'auto', or device ids (a list or "0,1")."""
    if devices is None or devices == "auto" or devices == -1:
        return
    ids = list(devices) if isinstance(devices, (list, ListConfig)) else None
    if isinstance(devices, str):
        ids = [part.strip() for part in devices.split(",") if part.strip()]
        ok = bool(ids) and all(part.isdigit() for part in ids)
    elif ids is not None:
        ok = bool(ids) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
    else:
        ok = isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1
    if not ok:
        raise ConfigError("trainer.devices", f"expected a number of devices >= 1, -1 (all), 'auto' or a list of device "
                                             f"ids, got {devices!r}")


def lightning_precisions() -> tuple[str, ...]:
    """Every ``trainer.precision`` Lightning knows (its own list)."""
    from lightning.fabric.connector import _PRECISION_INPUT_STR

    return typing.get_args(_PRECISION_INPUT_STR)


def unified_precision(precision: Any) -> str:
    """``precision`` in Lightning's unified spelling (``16`` -> ``16-mixed``, ``bf16`` -> ``bf16-mixed``)."""
    from lightning.fabric.connector import _convert_precision_to_unified_args

    return str(_convert_precision_to_unified_args(precision))


def check_precision(precision: Any) -> None:
    """``trainer.precision``: one of the values Lightning accepts (its own list)."""
    if precision is None:
        return
    try:
        unified_precision(precision)
    except (ValueError, TypeError):
        raise ConfigError("trainer.precision", f"{precision!r} is not a precision Lightning knows; valid: "
                                               f"{', '.join(lightning_precisions())}") from None


def check_accelerator(accelerator: Any) -> None:
    """``trainer.accelerator``: 'auto', 'gpu' or one of Lightning's accelerators, and present on this machine
    (``trainer=gpu``, ``ddp`` and ``fsdp`` ask for a GPU and never fall back to the CPU silently)."""
    from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry

    if accelerator is None or accelerator == "auto" or isinstance(accelerator, Accelerator):
        return
    if accelerator == "tpu":  # torch_xla is not a dependency: say how to get it; XLA's CPU device counts
        from longseq.utils.xla import tpu_missing

        missing = tpu_missing()
        if missing is not None:
            raise ConfigError("trainer.accelerator", missing)
        return
    known = sorted(AcceleratorRegistry)
    asked = ("cuda", "mps") if accelerator == "gpu" else (accelerator,)
    if not any(name in known for name in asked):
        raise ConfigError("trainer.accelerator", f"{accelerator!r} is not an accelerator; valid: auto, gpu, "
                                                 f"{', '.join(known)}")
    if not any(AcceleratorRegistry[name]["accelerator"].is_available() for name in asked if name in known):
        present = [name for name in known if AcceleratorRegistry[name]["accelerator"].is_available()]
        raise ConfigError("trainer.accelerator", f"{accelerator!r} asks for a device this machine does not have "
                                                 f"(present: {', '.join(present)}); use trainer=cpu or "
                                                 "trainer=ddp_cpu, or trainer=default to let Lightning pick what "
                                                 "there is")


def configured_world_size(trainer: DictConfig) -> int | None:
    """The number of processes ``trainer.devices`` x ``num_nodes`` asks for, when the config alone says it (None for
    'auto', -1 or a device string: Lightning decides)."""
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes") or 1
    if isinstance(devices, (list, ListConfig)):
        devices = len(devices)
    return devices * nodes if isinstance(devices, int) and devices >= 1 and isinstance(nodes, int) else None


def keyed_error(prefix: str, exc: BaseException, names: set[str] | list[str]) -> ConfigError:
    """Lightning's refusal ``exc`` as a ``ConfigError`` naming ``<prefix>.<argument>`` for the first of ``names`` its
    message mentions (``<prefix>`` alone when it mentions none)."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    found = [(match.start(), name) for name in names
             if (match := re.search(rf"(?<![\w.])`?{re.escape(name)}\b", message, flags=re.IGNORECASE))]
    return ConfigError(f"{prefix}.{min(found)[1]}" if found else prefix, message)


def trainer_error(exc: BaseException) -> ConfigError:
    """Lightning's refusal of a Trainer setting as a ``ConfigError`` naming the ``trainer.<key>`` its message names
    first (``trainer`` when it names none), for the settings no check of ``check_trainer_types`` covers."""
    return keyed_error("trainer", exc, trainer_arguments())


def instantiate_callbacks(group: DictConfig | None) -> list[Any]:
    """Every ``_target_`` entry of the ``callbacks`` group, built; a constructor's refusal names
    ``callbacks.<name>.<argument>`` (Lightning's ``ModelCheckpoint`` names only its argument)."""
    callbacks = []
    for name, node in (group or {}).items():
        if not node or "_target_" not in node:
            continue
        try:
            callbacks.append(hydra.utils.instantiate(node))
        except InstantiationException as exc:
            cause = exc.__cause__ or exc
            if names_what_to_fix(cause) and not isinstance(cause, TypeError):
                raise cause from None
            target = hydra.utils.get_object(str(node._target_))
            arguments = [p for p in inspect.signature(target).parameters if p not in ("self", "args", "kwargs")]
            raise keyed_error(f"callbacks.{name}", cause, [str(k) for k in node if not str(k).startswith("_")]
                              + arguments) from None
    return callbacks


@contextlib.contextmanager
def quiet_lightning_setup() -> Iterator[None]:
    """Lightning's set-up lines (``GPU available: ...``, tips) and warnings kept off the console while a Trainer is
    built only to be checked; the run builds its own and says them then."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def check_with_lightning(cfg: DictConfig) -> int:
    """Build the run's Trainer with its callbacks (no logger; nothing is written) so that Lightning's own checks
    run before the run directory exists, and refuse a ``trainer.precision`` Lightning would swap for another on this
    machine (``16-mixed`` on a CPU runs as ``bf16-mixed`` with only a warning). Returns the world size as Lightning
    counts it."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from longseq.utils.xla import trainer_accelerator

    with quiet_lightning_setup():
        callbacks = instantiate_callbacks(cfg.get("callbacks"))
        try:
            trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=False,
                                              **trainer_accelerator(cfg.trainer))
        except InstantiationException as exc:
            cause = exc.__cause__
            if isinstance(cause, ConfigError):
                raise cause from None
            if isinstance(cause, (MisconfigurationException, ValueError, TypeError)):
                raise trainer_error(cause) from None
            raise
    asked = cfg.trainer.get("precision")
    if asked is not None and unified_precision(asked) != str(trainer.precision):
        device = type(trainer.accelerator).__name__.replace("Accelerator", "").lower() or "device"
        usable = [p for p in lightning_precisions() if p != unified_precision(asked)
                  and (device == "cuda" or not p.startswith("transformer-engine"))
                  and not (device == "cpu" and p == "16-mixed")]
        raise ConfigError("trainer.precision", f"{asked!r} is not supported on this machine's {device}: Lightning "
                                               f"would run {trainer.precision!r} instead; valid here: "
                                               f"{', '.join(usable)}")
    return int(trainer.world_size)
