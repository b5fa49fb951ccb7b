"""The sparse family's base: a variant is its pattern, a fixed (or seeded) set of keys per query.

``SparseAttention`` turns a subclass's ``pattern(L)`` (an ``(L, L)`` bool mask, True = may attend; ``(H, L, L)``
when the pattern differs per head) into the dense reference ``attention_matrix`` and the incremental decoding of
causal builds (both through the pattern as a ``Partition`` without regions), gives every ``forward`` the
``key_padding_mask`` keyword, and offers the SDPA call and per-length caches the fast paths share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longseq.attention.base import Attention
from longseq.attention.ops.decoding import PartitionDecoder
from longseq.attention.ops.masks import cacheable
from longseq.attention.ops.padding import append_padding_channel
from longseq.attention.ops.partition import Partition
from longseq.attention.sparse.kernels import contiguous_grad


class SparseAttention(PartitionDecoder, Attention):
    """Shared parts: the pattern as a ``Partition`` (the dense reference ``attention_matrix``, incremental
    decoding of causal builds: a step attends its row of the pattern, O(K D) for K keys), per-length caches."""

    family = "sparse"  # also for subclasses defined outside the package

    def __init__(self, **base) -> None:
        super().__init__(**base)
        self._cache: dict = {}

    def pattern(self, length: int) -> torch.Tensor:
        """(L, L) bool, True where query i may attend to key j."""
        raise NotImplementedError

    def cached(self, name: str, length: int, device: torch.device, build):
        """Memoize ``build()`` (index tables, masks) per (name, length, device); not saved in checkpoints."""
        key = (name, length, str(device))
        if key not in self._cache:
            self._cache[key] = cacheable(build())
        return self._cache[key]

    def partition(self, length: int, device: torch.device | None = None) -> Partition:
        """The pattern as a ``Partition`` with no regions (BigBird: per-head ``(H, L, L)`` direct sets)."""
        return Partition.direct_only(self.pattern(length).to(device))

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, L, L): softmax over the pattern (dense; small L only), from ``partition``; under key padding
        each document's ``Partition.without_padding`` (``ops.padding``'s rule)."""
        return self.partition(q.shape[-2], q.device).direct_matrix(self.scale(q), k, key_padding_mask)

    # -- incremental decoding: a KV cache read through the pattern's index table (``PartitionDecoder``) ----
    def decoding_partition(self, length: int, device=None) -> Partition:
        return self.partition(length, device)

    # Key padding (LRA): every variant here is one softmax of q.k / sqrt(D) over its pattern, so an extra
    # channel that subtracts a large constant from padded keys' logits (``append_padding_channel``) is exact
    # and needs no change to the index arithmetic. ``__init_subclass__`` gives each subclass's ``forward``
    # the ``key_padding_mask`` keyword this way.
    supports_padding_mask = True

    def __init_subclass__(cls, **kwargs) -> None:
        if "forward" in cls.__dict__:  # wrapped before the dispatch point (``Attention``) wraps it: flex gets the mask
            cls.forward = _with_key_padding(cls.__dict__["forward"])
        super().__init_subclass__(**kwargs)

    def sdpa(self, q, k, v, mask=None) -> torch.Tensor:
        """SDPA on already-scaled ``q`` with this module's dropout; ``mask`` bool (True = may attend)."""
        p = self.dropout if self.training else 0.0
        if mask is not None and mask.dim() < 4:  # a 3-D mask sends CPU SDPA to the slow math path
            mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
        return contiguous_grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=1.0))


def _with_key_padding(forward):
    """Wrap ``forward(q, k, v)`` into ``forward(q, k, v, key_padding_mask=None)`` (see ``SparseAttention``)."""

    def padded_forward(self, q, k, v, key_padding_mask=None):
        if key_padding_mask is None:
            return forward(self, q, k, v)
        return forward(self, *append_padding_channel(q, k, v, key_padding_mask))[..., :-1]

    padded_forward.__doc__, padded_forward.__name__ = forward.__doc__, forward.__name__
    padded_forward.__wrapped__ = forward
    return padded_forward

