"""Checkpoint files: atomic writes, a readable check of ``ckpt_path``, and a match against the composed model.

One home for "is this checkpoint usable?": ``train.py`` (before the run directory exists), ``runner.train``
and ``eval.py`` all call ``check_model`` / ``read_checkpoint`` / ``check_model_matches``; ``resolve_ckpt_path``
turns a directory given as ``ckpt_path`` into its checkpoint.
"""

from __future__ import annotations

import logging
import os
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from omegaconf import DictConfig, OmegaConf

from longseq.utils.build import build_module
from longseq.utils.errors import ConfigError, names_what_to_fix
from longseq.utils.rundir import RESOLVED_CONFIG

log = logging.getLogger(__name__)

OVERRIDES_FILE = Path(".hydra") / "overrides.yaml"


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` into ``<file>.tmp`` next to the target, fsync, then ``os.replace``.

    A kill -9 or a full disk mid-write leaves the previous checkpoint intact (Lightning's own transaction
    writes to the system temp dir and moves across filesystems, which is a copy, not a rename).
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO does not take storage_options")
        save_atomically(checkpoint, Path(path))


def save_atomically(obj: Any, path: Path) -> None:
    """Write ``obj`` with ``torch.save`` so that ``path`` is either the old file or the complete new one.

    A failed write raises its ``OSError`` (a full disk: errno 28), also where torch's zip writer reports it as a
    ``RuntimeError`` (``unexpected pos ...``) with the ``OSError`` only as its context."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            try:
                torch.save(obj, f)
            except RuntimeError as error:
                cause = os_error_behind(error)
                if cause is None:
                    raise
                raise cause from error
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def os_error_behind(error: BaseException) -> OSError | None:
    """The ``OSError`` among ``error``'s causes and contexts (the file write that made it fail), or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def run_dir_of(ckpt_path: str | Path) -> Path | None:
    """The run directory of ``<run>/checkpoints/<file>.ckpt`` (it holds ``.hydra/``), else None."""
    path = Path(ckpt_path).resolve()
    run = path.parent.parent
    if path.parent.name == "checkpoints" and (run / ".hydra").is_dir():
        return run
    return None


def run_directory(ckpt_path: str | Path, run_dir: str | Path | None = None) -> Path:
    """The training run a checkpoint belongs to: ``run_dir`` when given, else the checkpoint's grandparent."""
    return Path(run_dir) if run_dir else Path(ckpt_path).resolve().parent.parent


def load_run_config(ckpt_path: str | Path, run_dir: str | Path | None = None) -> DictConfig:
    """The resolved config a checkpoint was trained with (``<run>/config_resolved.yaml``), or a ``ConfigError``
    saying the checkpoint is not inside a training run directory."""
    ckpt_path = Path(ckpt_path)
    run_dir = run_directory(ckpt_path, run_dir)
    path = run_dir / RESOLVED_CONFIG
    if not path.is_file():
        raise ConfigError("run_dir", f"{path} not found: {ckpt_path} is not inside a training run directory "
                                     f"(<run>/checkpoints/); pass run_dir=<the run directory that holds {RESOLVED_CONFIG}>")
    return OmegaConf.load(path)


def checkpoint_step(path: str | Path) -> int:
    """The ``global_step`` saved in a checkpoint (-1 when it cannot be read): which of two files is newer."""
    try:
        return int(read_checkpoint(path).get("global_step", -1))
    except (ConfigError, TypeError, ValueError):
        return -1


def newest_checkpoint(directory: str | Path, names: tuple[str, ...] = ("last.ckpt", "interrupted.ckpt")) -> Path | None:
    """The file among ``names`` in ``directory`` with the highest saved step (the first of equals), or None."""
    found = [Path(directory) / name for name in names if (Path(directory) / name).is_file()]
    if not found:
        return None
    steps = [checkpoint_step(p) for p in found]
    return found[steps.index(max(steps))]


def holdings(directory: Path) -> str:
    """``it holds [...]: pass one of them`` (the ``.ckpt`` files under ``directory``), or that it holds none."""
    found = sorted(str(p.relative_to(directory)) for p in directory.rglob("*.ckpt"))
    return f"it holds {found}: pass one of them" if found else "it holds no .ckpt file"


def resolve_ckpt_path(ckpt_path: str | Path, key: str = "ckpt_path", resume: bool = False,
                      announce: bool = True) -> Path:
    """``ckpt_path`` itself when it is not a directory, else the checkpoint it stands for, announced on stderr.

    A run directory or its ``checkpoints/`` resolves to ``best.ckpt`` then ``last.ckpt`` (evaluation), or with
    ``resume`` to the newest of ``last.ckpt`` / ``interrupted.ckpt`` (by saved step), then ``best.ckpt``. A
    directory without them raises ``ConfigError(key, ...)`` listing the ``.ckpt`` files it holds.
    """
    path = Path(ckpt_path)
    if not path.is_dir():
        return path
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if resume:
        chosen = newest_checkpoint(folder) or newest_checkpoint(folder, ("best.ckpt",))
        why = "the newest of last.ckpt / interrupted.ckpt" if chosen and chosen.name != "best.ckpt" else "best.ckpt"
    else:
        chosen = next((folder / n for n in ("best.ckpt", "last.ckpt") if (folder / n).is_file()), None)
        why = "best.ckpt" if chosen and chosen.name == "best.ckpt" else "no best.ckpt"
    if chosen is None:
        wanted = "last.ckpt, interrupted.ckpt or best.ckpt" if resume else "best.ckpt or last.ckpt"
        raise ConfigError(key, f"{path} is a directory without {wanted} (in it or in its checkpoints/); "
                               f"{holdings(path)}")
    if announce:
        print(f"{key}: {path} is a directory: using {chosen} ({why})", file=sys.stderr)
    return chosen


def read_checkpoint(ckpt_path: str | Path, key: str = "ckpt_path") -> dict[str, Any]:
    """Load a Lightning checkpoint on CPU (memory-mapped), or raise ``ConfigError(key, ...)`` naming the file.

    Catches what a truncated or foreign file raises (``PytorchStreamReader failed``, ``EOFError``, unpickling
    errors) and says which file is broken and what to use instead.
    """
    path = Path(ckpt_path)
    if path.is_dir():  # train.py and eval.py resolve directories first (resolve_ckpt_path); other callers land here
        raise ConfigError(key, f"{path} is a directory, not a checkpoint file; {holdings(path)}")
    if not path.is_file():
        hint = ""
        if path.parent.is_dir():
            found = sorted(p.name for p in path.parent.glob("*.ckpt"))
            hint = f"; {path.parent} holds {found}" if found else f"; {path.parent} holds no .ckpt file"
        raise ConfigError(key, f"{path} does not exist{hint}")
    try:
        mmap = zipfile.is_zipfile(path)  # mmap needs the zip format; anything else fails below with its reason
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - every reader failure means the same thing to the user
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(key, f"{path} cannot be read as a checkpoint (truncated or not a checkpoint: {reason}); "
                               "use another file from its checkpoints/ directory (last.ckpt, best.ckpt)") from exc
    if not isinstance(state, dict) or "state_dict" not in state:
        raise ConfigError(key, f"{path} is not a Lightning checkpoint (no 'state_dict' entry)")
    return state


def check_model_matches(state: dict[str, Any], model: torch.nn.Module, ckpt_path: str | Path,
                        key: str = "ckpt_path", limit: int = 6) -> None:
    """Raise ``ConfigError`` naming the differing parameter keys when ``state`` cannot load into ``model``.

    ``model`` may live on the meta device (only names and shapes are compared). The message points at the
    producing run's ``.hydra/overrides.yaml``, which lists the overrides the checkpoint was trained with.
    """
    saved = {k: tuple(v.shape) for k, v in state["state_dict"].items() if hasattr(v, "shape")}
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    reshaped = sorted(k for k in set(saved) & set(expected) if saved[k] != expected[k])
    if not (missing or unexpected or reshaped):
        return

    def some(keys: list[str]) -> str:
        return ", ".join(keys[:limit]) + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")

    parts = []
    if missing:
        parts.append(f"missing in the checkpoint: {some(missing)}")
    if unexpected:
        parts.append(f"not in the composed model: {some(unexpected)}")
    if reshaped:
        parts.append("shape differs: " + ", ".join(f"{k} {saved[k]} vs {expected[k]}" for k in reshaped[:limit]))
    run = run_dir_of(ckpt_path)
    where = (f"; it was trained with the overrides in {run / OVERRIDES_FILE} (train.py replays them): drop the "
             "model/attention/task overrides that differ" if run
             else "; pass the model/attention/task overrides it was trained with")
    raise ConfigError(key, f"{ckpt_path} does not match the composed model ({'; '.join(parts)}){where}")


def check_model(cfg: DictConfig, key: str = "ckpt_path") -> None:
    """The composed model builds (on the meta device: no memory), so the attention's, the backbone's and the
    optimizer's settings are checked before anything is written; with ``cfg.ckpt_path``, that file exists, loads and
    fits the model.

    Raises ``ConfigError`` naming the file and, on a mismatch, the differing parameter keys and the producing run's
    ``.hydra/overrides.yaml``; a build error that names its key passes through. A module that cannot be built without
    its data (or on the meta device) is left to the run. Nothing is written; ``train.py`` calls it before Hydra makes
    a run dir.
    """
    path = cfg.get(key)
    state = read_checkpoint(path, key) if path else None
    try:
        with torch.device("meta"):
            module = build_module(cfg)
    except Exception as exc:  # noqa: BLE001 - sorted below: the user's settings now, the rest in the run
        if names_what_to_fix(exc):
            raise
        log.debug(f"the model does not build on the meta device ({exc}); the run builds it ({key} checked there)")
        return
    if state is not None:
        check_model_matches(state, module, path, key)
