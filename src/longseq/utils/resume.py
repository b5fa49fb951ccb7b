"""Resume: one command resumes a run in place, replaying how it was trained.

- ``replay`` / ``saved_overrides`` (used by ``train.py``'s pre-flight, ``preflight.command.preflight_train``, before
  Hydra makes a run directory): the run's saved overrides with the command's own on top.
- ``resume_requeued`` (inside the job): a launcher job started again in a directory that already holds its own
  checkpoints (a SLURM requeue after preemption or time-out, a resubmitted job) resumes from the newest one.
- ``resuming_in_place`` / ``continue_loggers`` (``runner.train``): a run resumed in its own directory continues its
  loggers there (the same W&B run, a new CSV version, TensorBoard appending).

It sits below ``runner`` (which imports it) and imports nothing above ``longseq.utils``.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from longseq.utils.checkpoint import OVERRIDES_FILE, checkpoint_step, newest_checkpoint
from longseq.utils.rundir import RESOLVED_CONFIG

log = logging.getLogger(__name__)

NOT_REPLAYED = ("ckpt_path",)  # the new command names its own checkpoint
# W&B run directories: [offline-]run-<YYYYMMDD_HHMMSS>-<id>, plus "-<n>" when a resumed run starts in the same second.
WANDB_RUN_DIR = re.compile(r"^(?:offline-)?run-\d{8}_\d{6}-([a-z0-9]+)")


def override_value(overrides: list[str], key: str) -> str | None:
    """The value of the last ``key=value`` (or ``+key=value``) among Hydra command-line overrides."""
    value = None
    for item in overrides:
        name, sep, rest = item.partition("=")
        if sep and name.lstrip("+") == key:
            value = rest
    return value


def saved_overrides(run: Path) -> tuple[Path, list[str]]:
    """The overrides the run was last started with: the newest ``.hydra/resume-<time>/overrides.yaml`` (a
    resume records the full list it ran with), else ``.hydra/overrides.yaml``; ([] when there is none)."""
    records = sorted((run / ".hydra").glob("resume-*/overrides.yaml"))
    path = records[-1] if records else run / OVERRIDES_FILE
    if not path.is_file():
        return path, []
    return path, [str(o) for o in OmegaConf.load(path)]


def override_key(text: str) -> tuple[str, str | None]:
    """(key or group, package) of one override: what two overrides must share to set the same thing."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        (parsed,) = OverridesParser.create().parse_overrides([text])
        return parsed.key_or_group, parsed.package
    except Exception:  # noqa: BLE001 - an unparsable record still has a key before '='
        return text.partition("=")[0].lstrip("+~"), None


def replay(saved: list[str], given: list[str]) -> tuple[list[str], list[str], list[str]]:
    """``saved`` overrides with ``given`` on top -> (overrides to run with, replayed, changed).

    A saved override whose key the command sets again is replaced by the command's (``changed`` says
    ``new (was old)``); one that added a key (``+key=v``) keeps adding it (the new value is forced, ``++``).
    """
    given_keys = {override_key(g): g for g in given}
    saved_keys = {override_key(s): s for s in saved}
    kept = [s for s in saved if override_key(s) not in given_keys and override_key(s)[0] not in NOT_REPLAYED]
    result, changed = list(kept), []
    for g in given:
        old = saved_keys.get(override_key(g))
        if old is not None and old.startswith("+") and not g.startswith(("+", "~")):
            g = "++" + g
        if old is not None and old.lstrip("+") != g.lstrip("+") and override_key(g)[0] not in NOT_REPLAYED:
            changed.append(f"{g} (was {old})")
        elif old is None and override_key(g)[0] not in NOT_REPLAYED and not g.lstrip("+~").startswith("hydra"):
            changed.append(f"{g} (new)")
        result.append(g)
    return result, kept, changed


def same_job(saved: DictConfig, cfg: DictConfig) -> bool:
    """True when two resolved configs describe the same training (the checkpoint and loggers may differ:
    a resume sets ``ckpt_path`` and gives the loggers a continuation version)."""

    def plain(node: DictConfig) -> dict:
        data = OmegaConf.to_container(node, resolve=True)
        return {k: v for k, v in data.items() if k not in ("ckpt_path", "logger", "hydra")}

    return plain(saved) == plain(cfg)


def resume_requeued(cfg: DictConfig, output_dir: Path, multirun: bool) -> DictConfig:
    """Set ``cfg.ckpt_path`` to the newest checkpoint an earlier attempt of this same job left in ``output_dir``.

    Applies to launcher jobs (``-m``: a sweep job's directory belongs to that job alone) and to requeued SLURM
    jobs (``SLURM_RESTART_COUNT`` > 0), when no ``ckpt_path`` was given. The earlier attempt must have run the
    same config (its ``config_resolved.yaml``); otherwise its checkpoints are left alone with a warning and the
    job starts afresh. Returns ``cfg`` (changed in place).
    """
    requeued = int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0
    if cfg.get("ckpt_path") or not (multirun or requeued) or not cfg.get("train", True):
        return cfg
    ckpt = newest_checkpoint(output_dir / "checkpoints")
    if ckpt is None:
        return cfg
    record = output_dir / RESOLVED_CONFIG
    if not record.is_file() or not same_job(OmegaConf.load(record), cfg):
        log.warning(f"{output_dir} holds checkpoints of another configuration ({record} differs): not resuming them")
        return cfg
    with open_dict(cfg):
        cfg.ckpt_path = str(ckpt)
    message = f"requeued job: resuming in place from {ckpt} (step {checkpoint_step(ckpt)})"
    log.info(message)
    print(message, file=sys.stderr)
    return cfg


def resuming_in_place(cfg: DictConfig) -> bool:
    """True when ``cfg.ckpt_path`` lives in ``<output_dir>/checkpoints/`` (train.py points Hydra there)."""
    ckpt = cfg.get("ckpt_path")
    return bool(ckpt) and Path(ckpt).resolve().parent == (Path(cfg.paths.output_dir) / "checkpoints").resolve()


def continue_loggers(cfg: DictConfig, output_dir: Path) -> None:
    """Point the loggers of a run resumed in place at their earlier state, each by its own convention.

    W&B: the same run, resumed by id (read from ``<run>/wandb/``). CSV: Lightning's CSV logger truncates an
    existing ``metrics.csv``, so the continuation gets its own version ``csv/resume<N>/``. TensorBoard:
    appends a new event file to the same directory (its convention; nothing to do).
    """
    loggers = cfg.get("logger") or {}
    with open_dict(cfg):
        for name, node in loggers.items():
            target = str((node or {}).get("_target_", ""))
            if target.endswith("WandbLogger") and not node.get("id"):
                runs = sorted((output_dir / "wandb").glob("*run-*-*"), key=lambda p: p.stat().st_mtime)
                ids = [m.group(1) for m in map(WANDB_RUN_DIR.match, (p.name for p in runs)) if m]
                if ids:
                    node.id = ids[-1]
                    node.resume = "allow"
                    log.info(f"resuming W&B run {node.id}")
            elif target.endswith("CSVLogger"):
                version = str(node.get("version") or "")
                log_dir = Path(node.save_dir) / str(node.name) / version
                if (log_dir / "metrics.csv").exists():
                    resumed = f"resume{1 + sum(1 for _ in log_dir.glob('resume*'))}"
                    node.version = f"{version}/{resumed}" if version else resumed
                    log.info(f"{name} logger: the continuation logs to {log_dir / resumed}")
