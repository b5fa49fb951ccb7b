"""A calm console: Lightning's tips and known-spurious warnings filtered, and one-line error summaries."""

from __future__ import annotations

import logging
import os
import sys
import traceback
import warnings

from hydra.errors import InstantiationException

from longseq.utils.errors import ConfigError, DataError, NonFiniteError, key_and_message

log = logging.getLogger(__name__)

# Messages that appear on every run and ask nothing of the user (advertising, deprecations inside libraries).
SPURIOUS_WARNINGS = (
    r".*isinstance\(treespec, LeafSpec\)",
    r".*does not have many workers which may be a bottleneck",
    r".*Checkpoint directory .* exists and is not empty",
    r".*callbacks used to create the checkpoint need to be provided",  # they are: same config
    r".*resuming from a checkpoint that ended before the epoch ended",  # documented: the epoch restarts
    r"It is recommended to use `self.log\(",  # metrics are torchmetrics objects: reduced as sums already
)
# The same, as message prefixes for PYTHONWARNINGS, which spawned DDP workers inherit (no commas allowed).
SPURIOUS_PREFIXES = ("`isinstance(treespec", "It is recommended to use `self.log(")


# Log lines (message prefixes) that tell the user nothing they did not ask for.
KNOWN_NOISE = (
    "💡",  # Lightning's tips (advertising)
    "You have turned on `Trainer(detect_anomaly=True)`",  # debug=default asks for it: its slow-down is documented
    "Trainer already configured with model summary callbacks",  # the runner's CompactModelSummary, on purpose
)
# Loggers quiet below WARNING: alembic names the 7 plugins it sets up whenever Optuna imports it (any sweep);
# under debug= (root level DEBUG) matplotlib logs every font it scores for a figure and fsspec every file it opens.
QUIET_LOGGERS = ("alembic", "matplotlib", "fsspec")


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(KNOWN_NOISE)


def quiet_loggers() -> None:
    """Raise ``QUIET_LOGGERS`` to WARNING. Called when this module is imported: ``train.py`` imports it before
    Hydra's sweeper imports Optuna (and with it alembic), and Hydra's logging config leaves these levels alone."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


quiet_loggers()


def quiet_lightning() -> None:
    """Drop Lightning's lines in ``KNOWN_NOISE`` and the warnings in ``SPURIOUS_WARNINGS`` (idempotent)."""
    quiet_loggers()
    for name in ("lightning.pytorch", "lightning.pytorch.utilities.rank_zero", "lightning.fabric"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropTips) for f in logger.filters):
            logger.addFilter(_DropTips())
    for pattern in SPURIOUS_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    inherited = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w]
    wanted = [f"ignore:{prefix}" for prefix in SPURIOUS_PREFIXES]
    os.environ["PYTHONWARNINGS"] = ",".join(dict.fromkeys(inherited + wanted))


def error_summary(exc: BaseException) -> str:
    """``error: <key or file[:line]>: <message>`` for the user's errors (a message naming a config key counts:
    ``errors.key_and_message``), ``error: <Type>: <message>`` otherwise."""
    # hydra.utils.instantiate wraps what a constructor raised (datamodules are built through it): report the cause.
    while isinstance(exc, InstantiationException) and exc.__cause__ is not None:
        exc = exc.__cause__
    if isinstance(exc, ConfigError):
        where, message = exc.key, exc.message
    elif isinstance(exc, DataError):
        where = f"{exc.path}:{exc.line}" if exc.line is not None else str(exc.path)
        message = exc.message
    elif isinstance(exc, NonFiniteError):
        where, message = exc.what, exc.message
    elif "Traceback (most recent call last)" in str(exc):
        # A spawned DDP worker's exception arrives as its formatted traceback: keep its last line.
        last = [line for line in str(exc).strip().splitlines() if line.strip()][-1]
        type_name, _, message = last.partition(": ")
        where = type_name
        head, sep, rest = message.partition(": ")
        if sep and head and " " not in head:  # the worker's own "<key or file or metric>: <message>" (ConfigError ...)
            where, message = head, rest
        elif (named := key_and_message(ValueError(message))) is not None:  # a message naming its config key
            where, message = named
    elif (named := key_and_message(exc)) is not None:  # AttentionConfigError, ValueError ... naming their key
        where, message = named
    else:
        where, message = type(exc).__name__, str(exc)
    message = " ".join(message.split()) or type(exc).__name__
    return f"error: {where}: {message}"


def full_errors() -> bool:
    """True with ``HYDRA_FULL_ERROR=1``: let exceptions propagate with their whole traceback."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def report_and_exit(exc: BaseException, code: int = 1) -> None:
    """Print the one-line summary (the traceback goes to the run's log file only) and exit with ``code``."""
    tb = "".join(traceback.format_exception(exc))
    for handler in logging.getLogger().handlers:  # the Hydra job's file handler keeps the traceback
        if isinstance(handler, logging.FileHandler):
            handler.emit(logging.LogRecord("longseq", logging.ERROR, __file__, 0, tb, None, None))
    print(error_summary(exc), file=sys.stderr)
    print("(full traceback: HYDRA_FULL_ERROR=1)", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)
