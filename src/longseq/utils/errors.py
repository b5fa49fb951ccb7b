"""The project's user-facing error types: each names what the user must fix.

``train.py`` / ``eval.py`` print them as one line, ``error: <where>: <message>`` (the full traceback
with ``HYDRA_FULL_ERROR=1``). Both subclass ``ValueError`` so callers that catch configuration mistakes
as ``ValueError`` keep working.
"""

from __future__ import annotations

from pathlib import Path


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
