"""Config conveniences run before a job: warnings, tag enforcement, config tree (short on the console, full in
the run dir), resolvers, and the type check of the ``trainer.*`` keys."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Sequence

import rich.syntax
import rich.tree
from omegaconf import DictConfig, ListConfig, OmegaConf
from rich.console import Console

from longseq.utils.errors import ConfigError

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
POSITIVE = {"num_nodes", "accumulate_grad_batches", "log_every_n_steps", "check_val_every_n_epoch"}


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
    """Raise ``ConfigError('trainer.<key>', ...)`` for a trainer key Lightning does not take, or a value of the
    wrong type or sign."""
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
            ok = (isinstance(value, types) and not (key in POSITIVE and value < 1)
                  and not (key == "gradient_clip_val" and value < 0))
        if not ok:
            raise ConfigError(f"trainer.{key}", f"expected {expected}, got {value!r}")
    devices = trainer.get("devices")
    if devices is not None and not isinstance(devices, (int, str, list, ListConfig)):
        raise ConfigError("trainer.devices", f"expected an integer, 'auto' or a list of device ids, got {devices!r}")


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


def check_batch_sizes(cfg: DictConfig, datamodule: Any, world_size: int) -> None:
    """The global batch sizes divide over ``world_size`` processes (and gradient accumulation), checked in the
    launching process: a ``ddp_spawn`` fit would otherwise start its workers first and fail in each of them.
    The rule itself is ``longseq.data.batching.per_device_batch_size`` (the datamodules apply it again in
    ``setup``); the message names the key the user typed (``task.batch_size``, not ``task.data.batch_size``)."""
    from longseq.data.batching import per_device_batch_size
    from longseq.utils.errors import user_key

    batch = getattr(datamodule, "batch_size", None)
    if not isinstance(batch, int):
        return
    accumulate = int(getattr(datamodule, "accumulate_grad_batches", 1) or 1)
    per_device_batch_size(batch, world_size, accumulate, key=user_key(cfg, "task.data.batch_size"))
    eval_batch = getattr(datamodule, "eval_batch_size", None)
    if isinstance(eval_batch, int):
        per_device_batch_size(eval_batch, world_size, 1, key=user_key(cfg, "task.data.eval_batch_size"))


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


def check_composition(argv: list[str], config_dir: Path, config_name: str = "train") -> None:
    """Compose the command's config once before Hydra does, so a bad override (unknown key or option, an ambiguous
    or unparsable value) prints the one ``error: <key>: <message>`` line and exits 1 like every other error.

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
        compose_for_check(config_dir, name, overrides)
    except Exception as exc:  # noqa: BLE001 - only composition errors are reported here; the run reports the rest
        error = composition_error(exc, overrides, lambda kept: compose_for_check(config_dir, name, kept))
        if error is not None:
            report_and_exit(error)
