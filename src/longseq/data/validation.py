"""One home for the checks every datamodule runs on its files and splits.

- ``check_file_not_empty``: a zero-byte data file is reported by name (``np.memmap`` would say only
  ``cannot mmap an empty file``, ``pickle`` ``Ran out of input``).
- ``check_split_size``: a split too small to give what the loader needs (one training batch of windows,
  one scored token, one example) is a ``DataError`` naming the split, its size and what it needs; a split
  that works but is suspiciously small (an evaluation metric over a handful of tokens) logs a warning with
  its size once, on rank zero.

Token streams (LM) and example datasets (images, LRA) both go through ``check_split_size``; the
thresholds below are the project's definition of "suspiciously small".
"""

from __future__ import annotations

import logging
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only

from longseq.utils.errors import DataError

log = logging.getLogger(__name__)

# An evaluation split below these sizes still runs, but its metric is too noisy to compare runs by:
# 1,000 tokens of bpc / ppl (and never less than one full window), or 100 examples of accuracy / bits/dim
# (a standard error of about 5 accuracy points).
MIN_EVAL_TOKENS = 1_000
MIN_EVAL_EXAMPLES = 100


def check_file_not_empty(path: str | Path, what: str = "data file") -> Path:
    """``path`` (an existing file) or a ``DataError`` when it has zero bytes (an interrupted copy or download)."""
    path = Path(path)
    if path.is_file() and path.stat().st_size == 0:
        raise DataError(path, f"the {what} is empty (0 bytes): an interrupted download or copy? Replace it with "
                              "the complete file")
    return path


def check_split_size(source: str | Path, split: str, size: int, *, minimum: int, needs: str, unit: str = "tokens",
                     warn_below: int = 0, hint: str = "") -> None:
    """Validate the size of one split before its loader is built.

    Args:
        source: the file or folder the split was read from (named in the message).
        split: ``train`` / ``val`` / ``test``.
        size: what the split holds, in ``unit`` (tokens of a stream, or examples).
        minimum: the least ``size`` the loader can work with; below it a ``DataError`` is raised.
        needs: what ``minimum`` stands for, in words with the config keys behind it, e.g.
            ``"one batch of windows: 2 x task.seq_len (64) + 1 = 129 tokens"``.
        warn_below: below this size (and at least ``minimum``) a warning with the size is logged.
        hint: what the user can change, appended to the error.
    """
    if size < minimum:
        message = f"the {split} split has {size:,} {unit}, fewer than {needs}"
        raise DataError(source, f"{message}; {hint}" if hint else message)
    if size < warn_below:
        warn_small_split(source, split, size, unit, warn_below)


@rank_zero_only
def warn_small_split(source: str | Path, split: str, size: int, unit: str, warn_below: int) -> None:
    log.warning(f"{source}: the {split} split holds only {size:,} {unit} (fewer than {warn_below:,} {unit}); "
                "metrics on it are noisy and not comparable with the dataset's published numbers")
