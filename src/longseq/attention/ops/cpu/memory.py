"""Sizing the temporaries of the long-sequence CPU kernels for glibc's allocator (part of the CPU engine).

glibc's malloc serves a block of 32 MiB or more with a fresh ``mmap`` (its largest dynamic mmap threshold), so
such a block page-faults on every call: 14-25 ms per 32 MiB measured on this project's CPU, against about 1 ms
for a recycled buffer of the same size. The kernels that touch (L, D)-sized tensors per head therefore run their
heads in groups whose temporaries stay under a budget below that threshold (each kernel keeps its measured
budget). Caching allocators (CUDA) reuse memory anyway, so elsewhere all heads run at once.
"""

from __future__ import annotations

import torch

FRESH_MAP_BYTES = 32 * 2**20  # glibc's largest mmap threshold on 64-bit


def heads_per_group(n_heads: int, bytes_per_head: int, budget: int) -> int:
    """The most heads (at least one, at most ``n_heads``) whose temporaries of ``bytes_per_head`` bytes each fit
    in ``budget`` bytes together."""
    return max(1, min(n_heads, budget // max(1, bytes_per_head)))


def heads_in_group(shape: torch.Size, value_width: int, element_size: int, rows_per_query: float) -> int:
    """Heads per group for a path whose largest temporaries hold ``rows_per_query`` rows of width
    ``max(D, Dv) + 1`` per query and head, for q of ``shape`` ``(B, H, L, D)``: every temporary then stays below
    ``FRESH_MAP_BYTES``."""
    B, H, L, D = shape
    per_head = B * L * (max(D, value_width) + 1) * element_size * rows_per_query
    return heads_per_group(H, int(per_head), FRESH_MAP_BYTES)
