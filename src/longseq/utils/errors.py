"""The project's user-facing error types: each names what the user must fix.

``train.py`` / ``eval.py`` print them as one line, ``error: <where>: <message>`` (the full traceback
with ``HYDRA_FULL_ERROR=1``). Both subclass ``ValueError`` so callers that catch configuration mistakes
as ``ValueError`` keep working.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config value that cannot work; ``key`` is the dotted key the user typed (``optimizer.lr``)."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")


class DataError(ValueError):
    """A data file that cannot be read as its format says; ``line`` is 1-based when known."""

    def __init__(self, path: str | Path, message: str, line: int | None = None):
        self.path = Path(path)
        self.line = line
        self.message = message
        where = f"{self.path}:{line}" if line is not None else str(self.path)
        super().__init__(f"{where}: {message}")


class NonFiniteError(RuntimeError):
    """Training produced a NaN/Inf at optimizer step ``step``; ``what`` names it (``train/loss``,
    ``train/grad_norm`` or ``weights``).

    Raised by ``longseq.callbacks.nonfinite.NonFiniteGuard`` before the bad update is applied and by the
    checkpoint callback before non-finite weights would be written, so every checkpoint on disk is finite.
    ``kept`` (set by the runner) says which checkpoint the run can be resumed from.
    """

    def __init__(self, what: str, step: int, detail: str = ""):
        self.what, self.step, self.detail = what, step, detail
        self.kept = ""
        super().__init__(self.message)

    @property
    def message(self) -> str:
        text = f"not finite at step {self.step}" + (f" ({self.detail})" if self.detail else "")
        return text + (f"; {self.kept}" if self.kept else "")

    def __str__(self) -> str:
        return f"{self.what}: {self.message}"


# The top-level names of a train.py / eval.py config: a dotted key in a message starts with one of them.
CONFIG_ROOTS = ("task", "attention", "partition", "model", "optimizer", "scheduler", "trainer", "callbacks",
                "logger", "paths", "extras", "memory", "sample", "hydra", "ckpt_path", "run_dir", "seed", "tags",
                "split", "mode", "optimized_metric", "debug", "experiment", "hparams_search")
_ROOT = "|".join(CONFIG_ROOTS)
# ``attention.window must ...``, ``task.batch_size=7 (global ...)``, ``attention=sparse needs ...`` at the start.
_LEADING_KEY = re.compile(rf"^(?P<key>(?:{_ROOT})(?:\.\w+)*)(?:=(?P<value>\S+))?\s+(?P<rest>.*)$", re.S)
# ``attention 'full' does not accept attention.bogus, attention.x; ...``: the keys it lists.
_NOT_ACCEPTED = re.compile(r"^attention '\w+' does not accept (?P<keys>attention\.\w+(?:, attention\.\w+)*)")
# ``attention 'fnet' cannot be causal ...``: the choice ``attention=fnet`` itself.
_NAMED_ATTENTION = re.compile(r"^attention '(?P<name>\w+)' (?P<rest>.*)$", re.S)
# Anywhere in the message: the first ``root.key`` or ``root=`` (not inside a path or a longer word).
_ANY_KEY = re.compile(rf"(?<![\w./-])(?P<key>(?:{_ROOT})(?:\.\w+)+|(?:{_ROOT})(?==))")
# Exception types whose message is about the user's input (config values, files); a RuntimeError from deep
# inside torch is not, and keeps its type name.
USER_ERRORS = (ValueError, TypeError, LookupError, OSError)


def key_and_message(exc: BaseException) -> tuple[str, str] | None:
    """``(key, message)`` for an exception about a config value that does not carry its key as an attribute.

    The project's messages name the dotted key the user typed (``attention.window must be ...``,
    ``task.batch_size=3 (global batch) ...``); this reads it back so the console line is
    ``error: <key>: <message>`` whatever the exception type (``AttentionConfigError``, ``ValueError``,
    ``FileNotFoundError`` ...); an ``OSError`` with a file name is ``(path, reason)``. ``exc.config_key`` (set by ``name_user_key``) wins over the message. None when
    no key is named (the caller then prints the type name).
    """
    message = str(exc.args[0]) if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)
    forced = getattr(exc, "config_key", None)
    if type(exc).__module__.startswith("omegaconf") and getattr(exc, "full_key", None):  # MissingMandatoryValue ...
        return forced or str(exc.full_key), message.splitlines()[0] if message else type(exc).__name__
    if isinstance(exc, OSError) and exc.filename and exc.strerror and forced is None:
        return str(exc.filename), str(exc.strerror)  # the file form: ``error: <path>: <what failed>``
    if not isinstance(exc, USER_ERRORS) and forced is None:
        return None
    match = _NOT_ACCEPTED.match(message)
    if match:
        return forced or match["keys"], message
    match = _NAMED_ATTENTION.match(message)
    if match:
        return forced or "attention", f"'{match['name']}' {match['rest']}"
    match = _LEADING_KEY.match(message)
    if match:
        value = match["value"]
        rest = f"{value} {match['rest']}" if value is not None else match["rest"]
        return forced or match["key"], rest
    match = _ANY_KEY.search(message)
    if match or forced:
        return forced or match["key"], message
    return None


def names_what_to_fix(exc: BaseException) -> bool:
    """True when ``exc`` says which key or file the user must fix (what ``error_summary`` prints as its place)."""
    return isinstance(exc, (ConfigError, DataError)) or key_and_message(exc) is not None


def user_key(cfg: Any, key: str) -> str:
    """The key the user types for ``key``: follows plain interpolations (``task.data.batch_size`` is
    ``${task.batch_size}`` in the task YAMLs, so the user typed ``task.batch_size``)."""
    from omegaconf import OmegaConf

    seen = {key}
    while True:
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if node is None or not OmegaConf.is_config(node) or leaf not in node or not OmegaConf.is_interpolation(node, leaf):
            return key
        target = re.fullmatch(r"\$\{([\w.]+)\}", str(node._get_node(leaf)._value()))  # noqa: SLF001 - the raw text
        if target is None or target[1] in seen:
            return key
        key = target[1]
        seen.add(key)


def name_user_key(exc: BaseException, cfg: Any) -> BaseException:
    """Point ``exc`` at the key the user typed (``exc.config_key``) when its message names an interpolated one."""
    if isinstance(exc, (ConfigError, DataError, NonFiniteError)) or getattr(exc, "config_key", None):
        return exc
    found = key_and_message(exc)
    if found is not None and cfg is not None:
        typed = user_key(cfg, found[0])
        if typed != found[0]:
            try:
                exc.config_key = typed  # type: ignore[attr-defined]
            except AttributeError:  # pragma: no cover - exceptions with __slots__
                pass
    return exc
