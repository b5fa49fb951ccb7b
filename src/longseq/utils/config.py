"""Config conveniences run before a job: warnings, tag enforcement, config tree (short on the console, full in
the run dir), resolvers, and the type check of the ``trainer.*`` keys."""

from __future__ import annotations

import logging
import math
import typing
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import rich.syntax
import rich.tree
from omegaconf import DictConfig, ListConfig, OmegaConf
from rich.console import Console

from longseq.utils.checkpoint import check_model
from longseq.utils.errors import ConfigError, name_user_key, names_what_to_fix

log = logging.getLogger(__name__)

PRINT_ORDER = ("task", "attention", "model", "optimizer", "scheduler", "trainer", "callbacks", "logger", "paths", "extras")


def register_resolvers() -> None:
    """OmegaConf resolvers used by the configs (idempotent)."""
    if not OmegaConf.has_resolver("eval"):
        OmegaConf.register_new_resolver("eval", eval)  # arithmetic in YAML, e.g. ${eval:'${a} // 2'}
    if not OmegaConf.has_resolver("run_suffix"):  # unique run/sweep dir names (conf/hydra/default.yaml)
        from longseq.utils.rundir import run_suffix

        OmegaConf.register_new_resolver("run_suffix", run_suffix, use_cache=True)
    if not OmegaConf.has_resolver("attention_presets"):  # model.attention_presets: the hybrid plan's presets
        from longseq.models.layer_plan import attention_presets

        OmegaConf.register_new_resolver("attention_presets", attention_presets)
    if not OmegaConf.has_resolver("recall_window"):  # the recall study's short window (conf/recall/arm/local_short)
        from longseq.data.recall import recall_window

        OmegaConf.register_new_resolver("recall_window", recall_window)


def print_config_tree(cfg: DictConfig, save_to: Path | None = None, order: Sequence[str] = PRINT_ORDER,
                      show: bool = True) -> None:
    """Print the resolved config as a rich tree (groups in ``order`` first) and optionally save it."""
    tree = rich.tree.Tree("CONFIG", style="dim", guide_style="dim")
    fields = [f for f in order if f in cfg] + [f for f in cfg if f not in order]
    for field in fields:
        branch = tree.add(str(field), style="bold")
        node = cfg[field]
        text = OmegaConf.to_yaml(node, resolve=True) if isinstance(node, DictConfig) else str(node)
        branch.add(rich.syntax.Syntax(text, "yaml"))
    if show:
        Console().print(tree)
    if save_to is not None:
        with open(save_to, "w") as f:
            Console(file=f, width=120).print(tree)


def config_summary(choices: dict[str, Any], overrides: Sequence[str], saved: Path | None = None) -> str:
    """One or two lines for the console: the chosen config groups and the command-line overrides.

    Nested groups (``callbacks/samples``, which an image task adds itself) follow from the top-level choices."""
    groups = " ".join(f"{k}={v}" for k, v in choices.items()
                      if v is not None and "/" not in k and not k.startswith("hydra")
                      and k not in ("paths", "extras", "local"))
    lines = [f"config: {groups}"]
    if overrides:
        lines.append(f"overrides: {' '.join(overrides)}")
    if saved is not None:
        lines[-1] += f"  (full tree: {saved})"
    return "\n".join(lines)


def extras(cfg: DictConfig, output_dir: Path | None = None, multirun: bool = False,
           choices: dict[str, Any] | None = None, overrides: Sequence[str] = ()) -> None:
    """Apply ``cfg.extras``: ignore warnings, enforce tags in multiruns, save the config tree and print it.

    ``extras.print_config``: ``short`` (default) prints the group choices and overrides in two lines, ``full``
    (or true) the whole rich tree, false nothing; the full tree is saved to ``<run>/config_tree.log`` always.
    """
    opts = cfg.get("extras") or {}
    if opts.get("ignore_warnings"):
        warnings.filterwarnings("ignore")
    if opts.get("enforce_tags") and multirun and not cfg.get("tags"):
        raise ConfigError("tags", "must be set for a multirun (tags=[...]), or set extras.enforce_tags=false")
    if output_dir is not None and cfg.get("tags") is not None:
        (output_dir / "tags.log").write_text("\n".join(map(str, cfg.tags)) + "\n")
    mode = opts.get("print_config", "short")
    mode = "full" if mode is True else "off" if mode in (False, None) else str(mode)
    if mode not in ("short", "full", "off"):
        raise ConfigError("extras.print_config", f"{mode!r} is not valid; choose short, full or false")
    saved = output_dir / "config_tree.log" if output_dir else None
    print_config_tree(cfg, save_to=saved, show=mode == "full")
    if mode == "short":
        print(config_summary(choices or {}, overrides, saved))


# trainer.<key> -> (accepted Python types, description for the message). Hydra passes the strings users typed
# straight to Lightning, whose errors (a TypeError about '<') do not name the key.
INT, NUM, BOOL = (int,), (int, float), (bool,)
TRAINER_TYPES: dict[str, tuple[tuple[type, ...], bool, str]] = {
    # key: (types, None allowed, what is expected)
    "max_steps": (INT, False, "an integer number of optimizer steps (-1: no limit)"),
    "min_steps": (INT, True, "an integer number of optimizer steps"),
    "max_epochs": (INT, True, "an integer number of epochs (-1: no limit)"),
    "min_epochs": (INT, True, "an integer number of epochs"),
    "num_nodes": (INT, False, "a positive integer"),
    "accumulate_grad_batches": (INT, False, "a positive integer"),
    "log_every_n_steps": (INT, False, "a positive integer"),
    "check_val_every_n_epoch": (INT, True, "a positive integer or null"),
    "num_sanity_val_steps": (INT, True, "an integer (-1: all batches)"),
    "gradient_clip_val": (NUM, True, "a number >= 0 or null"),
    "val_check_interval": (NUM, True, "a fraction of an epoch (float) or a number of batches (int), or null"),
    "limit_train_batches": (NUM, True, "a fraction (float) or a number of batches (int), or null"),
    "limit_val_batches": (NUM, True, "a fraction (float) or a number of batches (int), or null"),
    "limit_test_batches": (NUM, True, "a fraction (float) or a number of batches (int), or null"),
    "overfit_batches": (NUM, True, "a fraction (float) or a number of batches (int)"),
    "fast_dev_run": ((bool, int), False, "true, false or a number of batches"),
    "enable_progress_bar": (BOOL, False, "true or false"),
    "enable_model_summary": (BOOL, False, "true or false"),
    "detect_anomaly": (BOOL, False, "true or false"),
}
# The smallest value Lightning accepts, where it has one (-1: no limit).
MINIMUM = {"num_nodes": 1, "accumulate_grad_batches": 1, "log_every_n_steps": 1, "check_val_every_n_epoch": 1,
           "max_steps": -1, "max_epochs": -1, "min_steps": 0, "min_epochs": 0, "gradient_clip_val": 0}


TRAINER_TARGETS = ("lightning.pytorch.Trainer", "lightning.pytorch.trainer.trainer.Trainer", "lightning.Trainer",
                   "pytorch_lightning.Trainer")


def trainer_arguments() -> set[str]:
    """The keyword arguments of ``lightning.pytorch.Trainer`` (what ``trainer.<key>`` may name)."""
    import inspect

    from lightning.pytorch import Trainer

    return {name for name in inspect.signature(Trainer.__init__).parameters if name != "self"}


def check_trainer_keys(trainer: DictConfig | dict) -> None:
    """Raise ``ConfigError('trainer.<key>', ...)`` for a key Lightning's Trainer does not take (``+trainer.bogus=1``);
    Lightning would say only ``Trainer.__init__() got an unexpected keyword argument``."""
    import difflib

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


def check_trainer_types(trainer: DictConfig | dict) -> None:
    """Raise ``ConfigError('trainer.<key>', ...)`` for a trainer key Lightning does not take, a value of the wrong
    type or below its minimum, a precision or device count Lightning rejects, or an accelerator this machine lacks."""
    check_trainer_keys(trainer)
    for key, (types, nullable, expected) in TRAINER_TYPES.items():
        if key not in trainer:
            continue
        value = trainer[key]
        if value is None:
            ok = nullable
        elif isinstance(value, bool):  # bool is an int subclass: accept it only where a bool is meant
            ok = bool in types
        else:
            ok = isinstance(value, types) and value >= MINIMUM.get(key, -math.inf)
        if not ok:
            raise ConfigError(f"trainer.{key}", f"expected {expected}, got {value!r}")
    check_devices(trainer.get("devices"))
    check_precision(trainer.get("precision"))
    check_accelerator(trainer.get("accelerator"))


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


def check_precision(precision: Any) -> None:
    """``trainer.precision``: one of the values Lightning accepts (its own list)."""
    from lightning.fabric.connector import _PRECISION_INPUT_STR, _convert_precision_to_unified_args

    if precision is None:
        return
    try:
        _convert_precision_to_unified_args(precision)
    except (ValueError, TypeError):
        raise ConfigError("trainer.precision", f"{precision!r} is not a precision Lightning knows; valid: "
                                               f"{', '.join(typing.get_args(_PRECISION_INPUT_STR))}") from None


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


def check_run_config(cfg: DictConfig) -> None:
    """Every check a train config passes or fails on its own, before anything is written: the trainer keys, the
    seed, the partition choice, the task's geometry and batch sizes, and the model (built on the meta device) with
    its ``ckpt_path``. ``train.py`` runs it before Hydra makes the run directory (``resume.preflight``);
    ``runner.train`` runs it again (multirun jobs, in-process runs)."""
    check_trainer_types(cfg.trainer)
    check_seed(cfg.get("seed"))
    check_partition_choice(cfg)
    check_task_geometry(cfg.task)
    check_batch_sizes(cfg, configured_world_size(cfg.trainer))
    check_model(cfg)


def check_before_run(cfg: DictConfig, check: Callable[[DictConfig], None]) -> None:
    """Run ``check(cfg)`` before the run directory exists. An error that names the key or file to fix is printed as
    the one ``error:`` line (exit 1), so a refused run leaves nothing behind; any other error is left to the run,
    which reports it with its context (its log holds the traceback)."""
    from longseq.utils.console import full_errors, report_and_exit

    try:
        check(cfg)
    except Exception as exc:  # noqa: BLE001 - sorted below: the user's mistakes now, the rest in the run
        if not names_what_to_fix(exc):
            log.debug(f"pre-run check: {type(exc).__name__}: {exc} (left to the run)")
            return
        if full_errors():
            raise
        report_and_exit(name_user_key(exc, cfg))


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


def check_batch_sizes(cfg: DictConfig, world_size: int | None) -> None:
    """The global batch sizes (``task.data.batch_size`` / ``eval_batch_size``) divide over ``world_size`` processes
    (and gradient accumulation), checked in the launching process: a ``ddp_spawn`` fit would otherwise start its
    workers first and fail in each of them. The rule itself is ``longseq.data.batching.per_device_batch_size`` (the
    datamodules apply it again in ``setup``); the message names the key the user typed (``task.batch_size``, not
    ``task.data.batch_size``). ``world_size`` None (not known before the Trainer exists): nothing to check."""
    from longseq.data.batching import per_device_batch_size
    from longseq.utils.errors import user_key

    data = cfg.task.get("data") or {}
    batch = data.get("batch_size")
    if world_size is None or not isinstance(batch, int):
        return
    accumulate = int(data.get("accumulate_grad_batches") or 1)
    per_device_batch_size(batch, world_size, accumulate, key=user_key(cfg, "task.data.batch_size"))
    eval_batch = data.get("eval_batch_size")
    if isinstance(eval_batch, int):
        per_device_batch_size(eval_batch, world_size, 1, key=user_key(cfg, "task.data.eval_batch_size"))


def configured_world_size(trainer: DictConfig) -> int | None:
    """The number of processes ``trainer.devices`` x ``num_nodes`` asks for, when the config alone says it (None for
    'auto', -1 or a device string: Lightning decides)."""
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes") or 1
    if isinstance(devices, (list, ListConfig)):
        devices = len(devices)
    return devices * nodes if isinstance(devices, int) and devices >= 1 and isinstance(nodes, int) else None


CSV_LOGGER = {"_target_": "lightning.pytorch.loggers.CSVLogger", "save_dir": "${paths.output_dir}", "name": "csv",
              "version": "", "flush_logs_every_n_steps": 10}  # as conf/logger/csv.yaml


def ensure_csv_logger(cfg: DictConfig) -> None:
    """Add ``logger.csv`` (``<run>/csv/metrics.csv``) when no CSV logger is configured and
    ``extras.csv_metrics`` is true (the default): every run keeps its curves in a file that
    ``longseq.report`` and ``notebooks/results.ipynb`` can read, whatever else it logs to (none, W&B,
    TensorBoard). Cheap: one buffered row per ``trainer.log_every_n_steps``."""
    from omegaconf import open_dict

    if not (cfg.get("extras") or {}).get("csv_metrics", True):
        return
    loggers = cfg.get("logger") or {}
    if any(str((node or {}).get("_target_", "")).endswith("CSVLogger") for node in loggers.values()):
        return
    with open_dict(cfg):
        if not cfg.get("logger"):
            cfg.logger = {}
        cfg.logger.csv = CSV_LOGGER


def composition_error(exc: Exception, overrides: Sequence[str], compose: Any = None) -> ConfigError | None:
    """A ``ConfigError`` naming the key for Hydra's composition failures (an unknown key or option, an ambiguous
    or unparsable override), which Hydra itself prints over several lines without the ``error: <key>:`` form.

    ``compose(overrides)`` (optional) composes without the failing override, to list the keys that do exist.
    None when the exception is not one of these.
    """
    import difflib
    import re

    text = str(exc)
    missing = re.search(r"Could not find '(?P<group>[\w/]+)/(?P<name>[^']+)'", text)
    if missing:
        options = [line.strip() for line in text.split("Available options in", 1)[-1].splitlines()[1:]
                   if line.startswith("\t") and "=" not in line]
        close = difflib.get_close_matches(missing["name"], options, n=1)
        hint = f" (did you mean {missing['group']}={close[0]}?)" if close else ""
        return ConfigError(missing["group"].replace("/", "."), f"no option '{missing['name']}'{hint}; available: "
                                                               f"{', '.join(options)}")
    unknown = re.search(r"Could not override '(?P<key>[\w.]+)'", text)
    if unknown:
        key = unknown["key"]
        parent, _, leaf = key.rpartition(".")
        known: list[str] = []
        if parent == "trainer":
            known = sorted(trainer_arguments())
        elif compose is not None:
            try:
                node = OmegaConf.select(compose([o for o in overrides if not o.startswith(f"{key}=")]), parent or "")
                known = sorted(str(k) for k in node if k != "hydra") if isinstance(node, DictConfig) else []
            except Exception:  # noqa: BLE001 - the hint is optional
                known = []
        close = difflib.get_close_matches(leaf, known, n=1)
        hint = f"did you mean {parent + '.' if parent else ''}{close[0]}? " if close else ""
        where = f"{parent} has " if parent else "the config has "
        listed = f"; {where}{', '.join(known)}" if known else ""
        value = next((o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")), "<value>")
        return ConfigError(key, f"not a key of this config ({hint}a new key needs +{key}={value}){listed}")
    ambiguous = re.search(r"Ambiguous value for argument '(?P<key>[^=']+)=(?P<value>[^']*)'", text)
    if ambiguous:
        key, value = ambiguous["key"], ambiguous["value"]
        return ConfigError(key.lstrip("+~"), f"{value} is ambiguous: a list is {key}=[{value}], a string "
                                             f"{key}='{value}', a sweep needs -m")
    parse = re.search(r"at input '(?P<input>[^']*)'", text)
    if type(exc).__name__ == "OverrideParseException":
        culprit = next((o for o in overrides if parse and parse["input"] and parse["input"] in o), None)
        key = culprit.split("=", 1)[0].lstrip("+~") if culprit else "overrides"
        return ConfigError(key, f"cannot parse {culprit or 'an override'!r} ({text.splitlines()[0]}; Hydra's override "
                                "grammar: https://hydra.cc/docs/advanced/override_grammar/basic/)")
    return None


def compose_for_check(config_dir: Path, config_name: str, overrides: list[str]):
    """The job config ``overrides`` compose to (Hydra's own keys left out), for checks before the run starts."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    job_overrides = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(config_dir)):
            cfg = compose(config_name=config_name, overrides=job_overrides, return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        return cfg
    finally:
        GlobalHydra.instance().clear()


def check_composition(argv: list[str], config_dir: Path, config_name: str = "train",
                      check: Callable[[DictConfig], None] | None = None) -> None:
    """Compose the command's config once before Hydra does, so a bad override (unknown key or option, an ambiguous
    or unparsable value) prints the one ``error: <key>: <message>`` line and exits 1 like every other error; then
    ``check`` the composed config (``check_before_run``), so a refused run leaves no run directory.

    Multiruns and ``--cfg`` / ``--help`` are left to Hydra; with ``HYDRA_FULL_ERROR=1`` Hydra reports it.
    """
    from hydra._internal.utils import get_args_parser

    from longseq.utils.console import full_errors, report_and_exit

    args, _ = get_args_parser().parse_known_args(argv[1:])
    if args.multirun or args.cfg or args.info or args.help or args.hydra_help or args.shell_completion or full_errors():
        return
    overrides = list(args.overrides or [])
    name = args.config_name or config_name
    try:
        cfg = compose_for_check(config_dir, name, overrides)
    except Exception as exc:  # noqa: BLE001 - only composition errors are reported here; the run reports the rest
        error = composition_error(exc, overrides, lambda kept: compose_for_check(config_dir, name, kept))
        if error is not None:
            report_and_exit(error)
        return
    if check is not None:
        check_before_run(cfg, check)
