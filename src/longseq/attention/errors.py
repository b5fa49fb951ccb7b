"""The attention package's errors and the knob checks that raise them: the lowest layer, imported by ``base``,
``registry``, ``ops/`` and every variant (so ``ops/`` never imports the contract it serves)."""

from __future__ import annotations

import numbers


class AttentionConfigError(ValueError):
    """An attention was asked for something it cannot do; the message names the key and valid values."""


class DecodingNotSupported(AttentionConfigError):
    """The variant (or its bidirectional build) has no incremental decoding state; sampling recomputes."""


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n`` (used in error messages listing valid block sizes)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_int_knob(value, key: str, minimum: int = 1) -> int:
    """The one validation of an integer knob (a window, a count, a number of iterations): an integer, not a bool,
    at least ``minimum``. Returns it as ``int``; raises ``AttentionConfigError`` naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise AttentionConfigError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return int(value)
