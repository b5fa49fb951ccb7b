"""What a resuming command may change. A resume continues the same model on the same task: the backbone, the
attention and the task's geometry are fixed by the checkpoint (``FIXED_ON_RESUME``, refused naming the key before
anything runs); everything else may change, and the optimizer and schedule settings take effect from the resumed
step (``callbacks.resume.ResumedOptimization``). ``describe_changes`` says what changes, from which value."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Sequence

from omegaconf import DictConfig, OmegaConf

from longseq.report.outcome import COMPLETED, METRICS_FILE
from longseq.utils.config import ensure_csv_logger
from longseq.utils.errors import ConfigError, user_key

# Dotted prefixes of the keys a resume cannot change: the model's shape and function, and the task's geometry.
FIXED_ON_RESUME = ("model", "attention", "partition", "task.name", "task.seq_len", "task.causal", "task.vocab_size",
                   "task.image_shape", "task.num_levels", "task.block_size", "task.n_clusters", "task.max_length",
                   "task.pooling", "task.num_classes", "task.padded", "task.module")
# ... except these, which regularize or say how the same function is computed.
CHANGEABLE_ON_RESUME = ("model.dropout", "model.attn_dropout", "model.dropatt", "model.compile", "model.compile_mode",
                        "model.attention_presets", "attention.backend")
# Keys that differ between a run and its resume by design: the checkpoint, Hydra's own, the loggers' continuation.
NOT_COMPARED = ("hydra", "ckpt_path")
LOGGER_CONTINUATION = ("version", "id", "resume")


def flatten(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf of a plain container (lists are values, not walked)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from flatten(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, node


def compared(key: str) -> bool:
    root, _, rest = key.partition(".")
    if root in NOT_COMPARED:
        return False
    return not (root == "logger" and rest.rpartition(".")[2] in LOGGER_CONTINUATION)


def under(key: str, prefixes: Sequence[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def changes(saved: DictConfig, cfg: DictConfig) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, new value)`` for every leaf the new config sets differently from the run's resolved
    config (``<run>/config_resolved.yaml``); a key only one side has is ``None`` on the other. The CSV logger every
    run gets is added to the new side first, as the runner does."""
    new = OmegaConf.masked_copy(cfg, [k for k in cfg if k not in NOT_COMPARED])
    ensure_csv_logger(new)
    old = dict(flatten(OmegaConf.to_container(OmegaConf.masked_copy(saved, [k for k in saved if k not in NOT_COMPARED]),
                                              resolve=True)))
    now = dict(flatten(OmegaConf.to_container(new, resolve=True)))
    keys = [k for k in dict.fromkeys([*old, *now]) if compared(k)]
    return [(k, old.get(k), now.get(k)) for k in keys if old.get(k) != now.get(k)]


def fixed_change(found: list[tuple[str, Any, Any]], cfg: DictConfig,
                 given: Sequence[str] = ()) -> tuple[str, Any, Any] | None:
    """The change among ``found`` a resume cannot make, by the key the user typed (one the command names first)."""
    fixed = [(user_key(cfg, k), old, new) for k, old, new in found
             if under(k, FIXED_ON_RESUME) and not under(k, CHANGEABLE_ON_RESUME) and old is not None and new is not None]
    typed = {g.lstrip("+~").partition("=")[0] for g in given}
    return next((change for change in fixed if change[0] in typed), fixed[0] if fixed else None)


def check_resume_changes(saved: DictConfig, cfg: DictConfig, ckpt: str | Path,
                         given: Sequence[str] = ()) -> list[tuple[str, Any, Any]]:
    """Raise ``ConfigError(<key>, ...)`` when the command changes a key fixed by the checkpoint (``model.d_model``,
    ``attention``, ``task.seq_len`` ...); else return every change (``changes``)."""
    found = changes(saved, cfg)
    fixed = fixed_change(found, cfg, given)
    if fixed is not None:
        key, old, new = fixed
        raise ConfigError(key, f"cannot change when resuming: {ckpt} was trained with {key}={shown(old)} and this "
                               f"command gives {shown(new)}; a resume continues the same model on the same task. Drop "
                               "the override, or start a new run (without ckpt_path)")
    return found


def shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def describe_changes(found: list[tuple[str, Any, Any]]) -> str:
    """``optimizer.lr 0.003 -> 1e-05, trainer.max_steps 40 -> 80`` (optimizer and scheduler keys first)."""
    order = sorted(found, key=lambda c: (not under(c[0], ("optimizer", "scheduler")), ))
    return ", ".join(f"{key} {shown(old) if old is not None else '(unset)'} -> "
                     f"{shown(new) if new is not None else '(unset)'}" for key, old, new in order)


def completed_run(run: Path, step: int, cfg: DictConfig) -> bool:
    """True when ``run`` finished (``metrics.json`` says completed) and its checkpoint is at ``trainer.max_steps``
    already: resuming it would train nothing."""
    max_steps = cfg.trainer.get("max_steps")
    if not isinstance(max_steps, int) or max_steps < 1 or step < max_steps:
        return False
    try:
        record = json.loads((run / METRICS_FILE).read_text())
    except (OSError, ValueError):
        return False
    return record.get("status") == COMPLETED
