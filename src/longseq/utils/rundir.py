"""Run directories that never collide: a per-process name suffix and a lock held while a run writes there.

- ``${run_suffix:}`` (``conf/hydra/default.yaml``) makes generated names unique: two runs started in the same
  second (a shell loop, two array jobs on different nodes) get ``<date>_<time>_<suffix>`` with different suffixes.
- ``RunDirLock`` (a Hydra callback, ``hydra.callbacks.run_dir_lock``) takes ``<dir>/.lock`` before Hydra writes
  anything there: the run dir of a single run (``hydra.run.dir``), the sweep dir of a multirun
  (``hydra.sweep.dir``) and each job's own dir. A second live run on the same directory exits with
  ``error: hydra.run.dir: <dir> is in use by ... (pid N on <host>)`` and leaves the first untouched.

The lock is an ``flock`` on ``.lock`` (released by the kernel when its process dies, so kill -9 cannot leave
a directory locked forever); the file names the holder (pid, host, start time). A lock file left by a dead
process is taken over with a warning (the next attempt of a preempted job does exactly this). Only global
rank 0 locks: the other ranks of a DDP job (Lightning re-launches ``train.py`` with the same ``hydra.run.dir``)
share their rank 0's directory.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import fcntl
import json
import logging
import os
import secrets
import socket
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import OmegaConf

from longseq.utils.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
RESOLVED_CONFIG = "config_resolved.yaml"  # the run's resolved config: eval.py and resumes rebuild the run from it
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")
_SUFFIX: str | None = None
_HELD: dict[Path, int] = {}  # directory -> file descriptor holding its flock (this process)
_CREATED: dict[Path, Path] = {}  # run directory this process created -> the topmost folder it created for it


def run_suffix() -> str:
    """The ``${run_suffix:}`` of generated run and sweep dir names: a 6-hex-digit token drawn once per process.

    Random rather than the pid: containers on different nodes of a cluster often run jobs under the same pid.
    The processes of one distributed launch that each compose their own config share one name instead:
    ``srun`` tasks of one SLURM step (``<job id>-<step id>``) and ``torchrun`` workers (its run id).
    """
    global _SUFFIX
    if _SUFFIX is None:
        env = os.environ
        if int(env.get("SLURM_NTASKS") or 1) > 1 and env.get("SLURM_STEP_ID") and env.get("SLURM_JOB_ID"):
            _SUFFIX = f"{env['SLURM_JOB_ID']}-{env['SLURM_STEP_ID']}"
        elif env.get("TORCHELASTIC_RUN_ID") not in (None, "", "none"):
            _SUFFIX = "".join(c for c in env["TORCHELASTIC_RUN_ID"] if c.isalnum() or c in "-_")[:16]
        else:
            _SUFFIX = secrets.token_hex(3)
    return _SUFFIX


def rank_zero() -> bool:
    """False in the non-zero ranks of a distributed job (they write into their rank 0's run directory)."""
    return all(os.environ.get(name, "0") in ("", "0") for name in RANK_VARIABLES)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def read_holder(directory: str | Path) -> dict[str, Any] | None:
    """What ``<directory>/.lock`` says about its holder (pid, host, started), or None (no lock or empty)."""
    try:
        text = (Path(directory) / LOCK_FILE).read_text()
        holder = json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def describe(holder: dict[str, Any]) -> str:
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"


def live_holder(directory: str | Path) -> dict[str, Any] | None:
    """The holder of ``directory``'s lock when it is another live process, else None (no lock, stale, ours)."""
    directory = Path(directory).resolve()
    if directory in _HELD:
        return None
    path = directory / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return read_holder(directory) or {"pid": "?", "host": "?", "started": "?"}
        except OSError:  # no flock on this filesystem: judge by the pid (same host only)
            holder = read_holder(directory)
            same_host = holder and holder.get("host") == socket.gethostname()
            return holder if holder and (not same_host or pid_alive(int(holder.get("pid", 0)))) else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def acquire(directory: str | Path, key: str = "hydra.run.dir", record_creation: bool = False) -> Path:
    """Lock ``directory`` (created if missing) for this process, or raise ``ConfigError(key, ...)`` naming it.

    Re-entrant within a process. A lock file whose holder is gone (a killed or preempted earlier attempt) is
    taken over with a warning. Released by :func:`release` or at exit. ``record_creation``: remember that this
    process created ``directory`` (and which of its parents), so a run refused before it trained can remove it
    again (:func:`discard_created`).
    """
    directory = Path(directory).resolve()
    if directory in _HELD:
        return directory
    path = directory / LOCK_FILE
    created = [p for p in (directory, *directory.parents) if not p.exists()]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if created and record_creation:
            _CREATED[directory] = created[-1]
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o644))
    except OSError as exc:  # a read-only or full log folder: nothing was created, so say where to write instead
        where = f": {exc.filename}" if exc.filename and Path(exc.filename) != directory else ""
        raise ConfigError(key, f"cannot create the run directory {directory} ({exc.strerror or exc}{where}); choose "
                               f"a writable {key}") from None
    for _ in range(5):  # the file may be unlinked by its releasing holder between open and flock: retry
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = read_holder(directory) or {"pid": "?", "host": "?", "started": "?"}
            raise ConfigError(key, f"{directory} is in use by another live run ({describe(holder)}); wait for it, "
                                   f"stop it, or pass another {key}") from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                os.close(fd)
                raise
            holder = live_holder(directory)  # no flock here: the pid check stands in for it
            if holder:
                os.close(fd)
                raise ConfigError(key, f"{directory} is in use by another live run ({describe(holder)}); wait for "
                                       f"it, stop it, or pass another {key}") from None
        try:
            same_file = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same_file = False
        if not same_file:
            os.close(fd)
            continue
        break
    else:  # pragma: no cover - five releases racing this acquire
        raise ConfigError(key, f"{directory}: could not take {path} (it keeps being replaced)")
    previous = read_holder(directory)
    if previous and (previous.get("pid"), previous.get("host")) != (os.getpid(), socket.gethostname()):
        log.warning(f"{key}: taking over the stale lock of {directory} ({describe(previous)}: no longer running)")
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now().isoformat(timespec="seconds")}
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        if os.environ.get(name):
            record[name.lower()] = os.environ[name]
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    _HELD[directory] = fd
    return directory


def release(directory: str | Path) -> None:
    """Unlock ``directory`` (a no-op when this process does not hold it); the lock file is removed."""
    directory = Path(directory).resolve()
    fd = _HELD.pop(directory, None)
    if fd is None:
        return
    try:
        (directory / LOCK_FILE).unlink(missing_ok=True)
    finally:
        os.close(fd)  # closing releases the flock


def discard_created(directory: str | Path) -> bool:
    """Remove ``directory`` and the empty parents this process created for it (``acquire(record_creation=True)``):
    a run refused before it trained leaves no directory behind. A directory this process did not create (a resume in
    place, an existing ``hydra.run.dir``, a multirun job) is left alone. True when it was removed."""
    import shutil

    directory = Path(directory).resolve()
    top = _CREATED.pop(directory, None)
    if top is None:
        return False
    release(directory)
    shutil.rmtree(directory, ignore_errors=True)
    for parent in directory.parents:
        if not parent.is_relative_to(top):
            break
        try:
            parent.rmdir()  # only while empty: another run may have started below it meanwhile
        except OSError:
            break
    return not directory.exists()


@atexit.register
def _release_all() -> None:
    for directory in list(_HELD):
        release(directory)


def acquire_or_exit(directory: str | Path, key: str, record_creation: bool = False) -> None:
    """:func:`acquire`, reporting a busy directory as ``error: <key>: ...`` and exit 1 (Hydra callbacks turn
    exceptions into warnings, so the callback must exit itself)."""
    from longseq.utils.console import full_errors, report_and_exit

    try:
        acquire(directory, key, record_creation)
    except ConfigError as exc:
        if full_errors():
            raise SystemExit(str(exc)) from exc
        report_and_exit(exc)


def key_of(config: Any, key: str) -> str:
    """The key the user chose the directory ``key`` names by: ``paths.log_dir`` when Hydra generated it below that
    folder, else ``key`` itself (set by the command, e.g. an explicit ``hydra.run.dir`` or a resume in place)."""
    given = [str(o).partition("=")[0].lstrip("+~") for o in config.hydra.overrides.get("hydra", [])]
    try:
        log_dir = Path(str(config.paths.log_dir)).resolve()
        below = Path(str(OmegaConf.select(config, key))).resolve().is_relative_to(log_dir)
    except Exception:  # noqa: BLE001 - a config without paths.log_dir: the directory's own key
        below = False
    return "paths.log_dir" if below and key not in given else key


class RunDirLock(Callback):
    """Hydra callback (``hydra.callbacks.run_dir_lock``): lock the run / sweep / job directory before Hydra
    writes into it, release it when the run, job or sweep ends (or at exit)."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        if rank_zero():
            run_dir = str(config.hydra.run.dir)
            acquire_or_exit(run_dir, key_of(config, "hydra.run.dir"), record_creation=True)

    def on_run_end(self, config: Any, **kwargs: Any) -> None:
        release(str(config.hydra.run.dir))

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        if rank_zero():
            sweep_dir = str(config.hydra.sweep.dir)
            acquire_or_exit(sweep_dir, key_of(config, "hydra.sweep.dir"))

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        release(str(config.hydra.sweep.dir))

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        # A multirun job's own directory (<sweep>/<job>): a requeued attempt takes over its dead predecessor's.
        if rank_zero() and config.hydra.mode == RunMode.MULTIRUN:
            acquire_or_exit(config.hydra.runtime.output_dir, "hydra.sweep.dir")

    def on_job_end(self, config: Any, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:
            release(config.hydra.runtime.output_dir)
