"""Config conveniences run before a job: warnings, tag enforcement, rich config tree, resolvers."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Sequence

import rich.syntax
import rich.tree
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

log = logging.getLogger(__name__)

PRINT_ORDER = ("task", "attention", "model", "optimizer", "scheduler", "trainer", "callbacks", "logger", "paths", "extras")


def register_resolvers() -> None:
    """OmegaConf resolvers used by the configs (idempotent)."""
    if not OmegaConf.has_resolver("eval"):
        OmegaConf.register_new_resolver("eval", eval)  # arithmetic in YAML, e.g. ${eval:'${a} // 2'}


def print_config_tree(cfg: DictConfig, save_to: Path | None = None, order: Sequence[str] = PRINT_ORDER) -> None:
    """Print the resolved config as a rich tree (groups in ``order`` first) and optionally save it."""
    tree = rich.tree.Tree("CONFIG", style="dim", guide_style="dim")
    fields = [f for f in order if f in cfg] + [f for f in cfg if f not in order]
    for field in fields:
        branch = tree.add(str(field), style="bold")
        node = cfg[field]
        text = OmegaConf.to_yaml(node, resolve=True) if isinstance(node, DictConfig) else str(node)
        branch.add(rich.syntax.Syntax(text, "yaml"))
    Console().print(tree)
    if save_to is not None:
        with open(save_to, "w") as f:
            Console(file=f, width=120).print(tree)


def extras(cfg: DictConfig, output_dir: Path | None = None, multirun: bool = False) -> None:
    """Apply ``cfg.extras``: ignore warnings, enforce tags in multiruns, print and save the config tree."""
    opts = cfg.get("extras") or {}
    if opts.get("ignore_warnings"):
        warnings.filterwarnings("ignore")
    if opts.get("enforce_tags") and multirun and not cfg.get("tags"):
        raise ValueError("tags=[...] must be set for a multirun (or extras.enforce_tags=false)")
    if output_dir is not None and cfg.get("tags") is not None:
        (output_dir / "tags.log").write_text("\n".join(map(str, cfg.tags)) + "\n")
    if opts.get("print_config"):
        print_config_tree(cfg, save_to=output_dir / "config_tree.log" if output_dir else None)
