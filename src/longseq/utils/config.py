"""Config conveniences of a job: the resolvers, warnings, tag enforcement, the config tree (short on the console,
full in the run dir) and the CSV logger every run gets. The checks a config passes before a run live in
``longseq.preflight``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Sequence

import rich.syntax
import rich.tree
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from longseq.utils.errors import ConfigError

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


PRINT_MODES = ("short", "full", "off")


def print_mode(opts: Any) -> str:
    """``extras.print_config`` as one of ``PRINT_MODES`` (true: full, false / null: off), or a ``ConfigError``."""
    mode = (opts or {}).get("print_config", "short")
    mode = "full" if mode is True else "off" if mode in (False, None) else mode
    if mode not in PRINT_MODES:
        raise ConfigError("extras.print_config", f"{mode!r} is not valid; choose short, full or false")
    return mode


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
    mode = print_mode(opts)
    saved = output_dir / "config_tree.log" if output_dir else None
    print_config_tree(cfg, save_to=saved, show=mode == "full")
    if mode == "short":
        print(config_summary(choices or {}, overrides, saved))


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
