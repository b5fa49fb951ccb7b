"""Sparse attention baselines: each query attends to a fixed subset of keys (its pattern).

Every class exposes ``pattern(L)`` — a ``(L, L)`` bool mask (True = may attend; ``(H, L, L)`` for
BigBird, whose random blocks differ per head) built by index arithmetic — and ``attention_matrix``, the
masked softmax over that pattern (dense, for tests and figures). ``forward`` never builds an ``L x L``
tensor; it uses one of three shapes of computation, all with ONE softmax per query over its keys:

- block layouts + SDPA on 4-D tensors (blocks folded into the head axis): ``local``, ``longformer``,
  ``fixed``, ``bigbird``;
- two layouts of one grid (row-wise and column-wise logits from batched matmuls, concatenated for one
  softmax): ``axial``, ``strided``;
- an index table ``(L, K)`` of each query's keys (repeats masked so each key counts once), gathered
  to ``(B*H, L, K, D)`` and fed to SDPA with one query per head slot: ``random``;
- per-level broadcasts over power-of-two block pairs, no gather (``log_levels``): ``logsparse``.

Every row of every mask keeps at least one key (self, or a padded position's own slot), so no softmax
row is empty. Batched-matmul outputs go through ``_ContiguousGrad`` because CPU ``bmm`` backward on
strided or zero-stride gradients is tens of times slower.

Geometry: positions are row-major on an ``n x m`` grid with ``m = block_size`` columns
(``geometry.Grid``), as in the Combiner counterparts (``combiner_fixed``, ``combiner_axial``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longseq.attention.base import Attention, AttentionConfigError
from longseq.attention.ops.amp import autocast_function
from longseq.attention.ops.decoding import PartitionDecoder
from longseq.attention.ops.geometry import Grid, check_block_size, logsparse_keys, num_log_levels
from longseq.attention.ops.joint_softmax import (
    LogitGroup,
    causal_row_column_flash,
    flash_row_column_applies,
    joint_groups_attention,
)
from longseq.attention.ops.log_levels import LevelMix, LevelScores
from longseq.attention.ops.masks import NEG_INF, causal_mask
from longseq.attention.ops.padding import append_padding_channel
from longseq.attention.ops.partition import Partition
from longseq.attention.registry import register_attention


def check_positive(value: int, key: str, minimum: int = 1) -> int:
    """Validate an integer knob, naming its config key."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise AttentionConfigError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def dedupe_index_table(idx: torch.Tensor, valid: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row of an index table and invalidate repeated keys, so each key counts once.

    ``idx`` (L, K) long key positions, ``valid`` (L, K) bool -> the same shapes, rows sorted, invalid
    entries pointing at key 0 (any in-range index; they are masked).
    """
    keyed = torch.where(valid, idx, torch.full_like(idx, length))  # invalid sorts last
    keyed, _ = keyed.sort(dim=1)
    repeat = torch.zeros_like(valid)
    repeat[:, 1:] = keyed[:, 1:] == keyed[:, :-1]
    valid = (keyed < length) & ~repeat
    return torch.where(valid, keyed, torch.zeros_like(keyed)), valid


def pattern_from_index_table(idx: torch.Tensor, valid: torch.Tensor, length: int) -> torch.Tensor:
    """(L, K) index table -> (L, L) bool pattern (small L only)."""
    allowed = torch.zeros(length, length, dtype=torch.bool, device=idx.device)
    rows = torch.arange(length, device=idx.device).unsqueeze(1).expand_as(idx)
    allowed[rows[valid], idx[valid]] = True
    return allowed


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
            self._cache[key] = build()
        return self._cache[key]

    def partition(self, length: int, device: torch.device | None = None) -> Partition:
        """The pattern as a ``Partition`` with no regions (BigBird: per-head ``(H, L, L)`` direct sets)."""
        return Partition.direct_only(self.pattern(length).to(device))

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, L, L): softmax over the pattern (dense; small L only), from ``partition``; under key padding
        each document's ``Partition.without_padding`` (``ops.padding``'s rule)."""
        part, qs = self.partition(q.shape[-2], q.device), self.scale(q)
        if key_padding_mask is None:
            return part.effective_matrix(qs, k, None, None)
        pads = key_padding_mask.to(device=q.device, dtype=torch.bool)
        return torch.cat([part.without_padding(pad).effective_matrix(qs[b : b + 1], k[b : b + 1], None, None)
                          for b, pad in enumerate(pads)])

    # -- incremental decoding: a KV cache read through the pattern's index table (``PartitionDecoder``) ----
    def decoding_partition(self, length: int, device=None) -> Partition:
        return self.partition(length, device)

    # Key padding (LRA): every variant here is one softmax of q.k / sqrt(D) over its pattern, so an extra
    # channel that subtracts a large constant from padded keys' logits (``append_padding_channel``) is exact
    # and needs no change to the index arithmetic. ``__init_subclass__`` gives each subclass's ``forward``
    # the ``key_padding_mask`` keyword this way.
    supports_padding_mask = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__:
            cls.forward = _with_key_padding(cls.__dict__["forward"])

    def sdpa(self, q, k, v, mask=None) -> torch.Tensor:
        """SDPA on already-scaled ``q`` with this module's dropout; ``mask`` bool (True = may attend)."""
        p = self.dropout if self.training else 0.0
        if mask is not None and mask.dim() < 4:  # a 3-D mask sends CPU SDPA to the slow math path
            mask = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
        return _ContiguousGrad.apply(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=1.0))


def _with_key_padding(forward):
    """Wrap ``forward(q, k, v)`` into ``forward(q, k, v, key_padding_mask=None)`` (see ``SparseAttention``)."""

    def padded_forward(self, q, k, v, key_padding_mask=None):
        if key_padding_mask is None:
            return forward(self, q, k, v)
        return forward(self, *append_padding_channel(q, k, v, key_padding_mask))[..., :-1]

    padded_forward.__doc__, padded_forward.__name__ = forward.__doc__, forward.__name__
    padded_forward.__wrapped__ = forward
    return padded_forward


def attend_index_table(attn: SparseAttention, q, k, v, idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Attention of every query to the keys listed in its row of an index table.

    q, k, v (B, H, L, D); ``idx`` (L, K) long and ``valid`` (L, K) bool, duplicate-free (see
    ``dedupe_index_table``), every row with at least one valid key. Gathers K and V to
    ``(B*H, L, K, D)`` (memory ``O(L K D)``) and applies one softmax over each row's K candidates.
    """
    B, H, L, D = k.shape
    flat = idx.reshape(-1)  # index_select: its backward (index_add) is much cheaper than indexing's
    k_rows = k.index_select(2, flat).view(B * H, L, -1, D)  # (B*H, L, K, D)
    v_rows = v.index_select(2, flat).view(B * H, L, -1, D)
    # one query per "head" of a 4-D SDPA call: the fused kernel avoids (B, H, L, K, D) temporaries
    q_rows = attn.scale(q).reshape(B * H, L, 1, D)
    return attn.sdpa(q_rows, k_rows, v_rows, valid.view(1, L, 1, -1)).view(B, H, L, D)


def neighbour_blocks(x: torch.Tensor, back: int, ahead: int) -> torch.Tensor:
    """Concatenate every block with its ``back`` previous and ``ahead`` next blocks (zeros off the ends).

    x (..., n, b, D) -> (..., n, (back + 1 + ahead) * b, D), keys ordered by position.
    """
    n = x.shape[-3]
    padded = F.pad(x, (0, 0, 0, 0, back, ahead))
    return torch.cat([padded[..., s : s + n, :, :] for s in range(back + 1 + ahead)], dim=-2)


def shift_rows(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Row r of the result is row r - shift of ``x`` (B, H, n, m, D); zeros where that row does not exist."""
    if shift == 0:
        return x
    n = x.shape[2]
    if shift > 0:
        return F.pad(x, (0, 0, 0, 0, shift, 0))[:, :, :n]
    return F.pad(x, (0, 0, 0, 0, 0, -shift))[:, :, -shift:]


def joint_softmax(attn: SparseAttention, logit_parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """One softmax over the concatenation of logit parts (last axis); masked entries are -inf."""
    widths = [p.shape[-1] for p in logit_parts]
    weights = attn.weight_dropout(torch.cat(logit_parts, -1).softmax(-1))
    return [w.contiguous() for w in weights.split(widths, -1)]


@autocast_function
class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    Applied to batched-matmul outputs: CPU ``bmm`` backward on a transposed or zero-stride gradient
    (e.g. from ``out.sum().backward()``) leaves BLAS and runs tens of times slower.
    """

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` whose gradient reaches ``bmm`` in a contiguous layout."""
    return _ContiguousGrad.apply(a @ b)


def column_part(q_grid, k_grid, v_grid, mask: torch.Tensor):
    """Column-layout logits and the matching value map for an ``n x m`` grid.

    q_grid, k_grid, v_grid (B, H, n, m, D) (q already scaled); ``mask`` (n, n) bool over (query row, key
    row). Returns ``logits`` (B, H, n, m, n) — query (r, c) against key (r', c) — and ``apply(w)`` mapping
    weights of that shape to a (B, H, n, m, D) output. Transposed copies are made contiguous because
    CPU ``bmm`` on such strided views is orders of magnitude slower.
    """
    qc, kc, vc = (x.transpose(2, 3).contiguous() for x in (q_grid, k_grid, v_grid))  # (B, H, m, n, D)
    logits = matmul(qc, kc.transpose(-1, -2)).masked_fill(~mask, NEG_INF).transpose(2, 3).contiguous()

    def apply(weights: torch.Tensor) -> torch.Tensor:
        return matmul(weights.transpose(2, 3).contiguous(), vc).transpose(2, 3)

    return logits, apply


# ------------------------------------------------------------------------------------------------
@register_attention("local")
class LocalAttention(SparseAttention):
    """Sliding window of ``window`` keys; O(L w).

    Causal: query i attends to keys ``[i - window + 1, i]`` (``window`` keys including self).
    Bidirectional: keys with ``|i - j| <= window // 2``.
    ``longformer`` adds dilation and global tokens on top of this (same implementation).

    Any length works: queries are cut into blocks of ``b = max(reach, 1)`` positions, each attends to
    its own and neighbouring blocks through one 4-D SDPA call with a boolean band mask; the tail is
    padded and the padded keys masked.
    """

    def __init__(self, *, causal: bool, window: int = 8, **base) -> None:
        self.window = check_positive(window, "attention.window")
        super().__init__(causal=causal, **base)

    # band in units of the (dilated) step: offsets d = i - j with d in [-ahead, back]
    dilation = 1
    global_tokens = 0

    def band(self) -> tuple[int, int]:
        if self.causal:
            return self.window - 1, 0
        return self.window // 2, self.window // 2

    def pattern(self, length: int) -> torch.Tensor:
        i = torch.arange(length).unsqueeze(1)
        j = torch.arange(length).unsqueeze(0)
        d = i - j
        back, ahead = self.band()
        step = self.dilation
        allowed = (d % step == 0) & (d <= back * step) & (d >= -ahead * step)
        if self.global_tokens:
            allowed |= (i < self.global_tokens) | (j < self.global_tokens)
        return allowed

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, H, L, D = q.shape
        self.check_length(L)
        step = self.dilation
        back, ahead = self.band()
        b = max(back, ahead, 1)
        # Dilation: i - j divisible by step means same residue mod step, so each residue class is an
        # undilated window over its own subsequence; fold the classes into the head axis.
        sub_len = -(-L // step)
        n = -(-sub_len // b)
        total = n * b * step
        pad = total - L

        def blocks(x: torch.Tensor) -> torch.Tensor:  # (B, H, L, D) -> (B*H, step*n, b, D)
            x = F.pad(x, (0, 0, 0, pad)).reshape(B * H, n * b, step, D).transpose(1, 2)
            return x.reshape(B * H, step * n, b, D)

        qb, kb, vb = blocks(self.scale(q)), blocks(k), blocks(v)
        nb_back, nb_ahead = (1 if back else 0), (1 if ahead else 0)
        kw = neighbour_blocks(kb.view(B * H, step, n, b, D), nb_back, nb_ahead).flatten(1, 2)
        vw = neighbour_blocks(vb.view(B * H, step, n, b, D), nb_back, nb_ahead).flatten(1, 2)
        mask = self.cached("band", L, q.device, lambda: self.band_mask(L, b, n, q.device))
        if self.global_tokens:
            g = self.global_tokens
            kw = torch.cat([kw, k[:, :, :g].reshape(B * H, 1, g, D).expand(-1, step * n, -1, -1)], 2)
            vw = torch.cat([vw, v[:, :, :g].reshape(B * H, 1, g, D).expand(-1, step * n, -1, -1)], 2)
        out = self.sdpa(qb, kw, vw, mask)  # (B*H, step*n, b, D)
        out = out.view(B * H, step, n * b, D).transpose(1, 2).reshape(B, H, total, D)[:, :, :L]
        if self.global_tokens:  # global queries attend to every key
            g = self.global_tokens
            out = out.index_copy(2, torch.arange(g, device=q.device), self.sdpa(self.scale(q[:, :, :g]), k, v))
        return out

    def band_mask(self, length: int, b: int, n: int, device) -> torch.Tensor:
        """(step*n, b, keys) bool mask for the blocked layout of ``forward``, from original positions."""
        step = self.dilation
        back, ahead = self.band()
        nb_back, nb_ahead = (1 if back else 0), (1 if ahead else 0)
        res = torch.arange(step, device=device).view(step, 1, 1, 1)
        blk = torch.arange(n, device=device).view(1, n, 1, 1)
        qs = blk * b + torch.arange(b, device=device).view(1, 1, b, 1)  # sub-position of query
        ks = (blk - nb_back) * b + torch.arange((nb_back + 1 + nb_ahead) * b, device=device).view(1, 1, 1, -1)
        d = qs - ks
        i, j = qs * step + res, ks * step + res  # original positions
        allowed = (d <= back) & (d >= -ahead) & (ks >= 0) & ((j < length) | (i == j))
        if self.global_tokens:
            # every query sees the global keys through their own columns; their band copies are
            # dropped so that each key counts once
            g = self.global_tokens
            allowed = torch.cat([allowed & (j >= g), torch.ones(step, n, b, g, dtype=torch.bool, device=device)], -1)
        return allowed.reshape(step * n, b, -1)


@register_attention("longformer")
class LongformerAttention(LocalAttention):
    """Longformer: sliding window (``local``) with optional dilation and global tokens; O(L (w + g)).

    Query i attends to keys j with ``i - j = dilation * t``, ``t in [0, window - 1]`` (causal) or
    ``|t| <= window // 2`` (bidirectional). The first ``global_tokens`` positions (e.g. a CLS token)
    attend to every key and are attended by every query — bidirectional only, since they see the
    future. Any length works (padded and masked internally).
    """

    def __init__(self, *, causal: bool, window: int = 8, dilation: int = 1, global_tokens: int = 0, **base) -> None:
        self.dilation = check_positive(dilation, "attention.dilation")
        self.global_tokens = check_positive(global_tokens, "attention.global_tokens", minimum=0)
        if causal and self.global_tokens:
            raise AttentionConfigError(
                f"attention 'longformer': attention.global_tokens={global_tokens} needs bidirectional "
                "attention (global tokens attend to the future); set attention.global_tokens=0 for "
                "causal tasks (attention.causal=true)"
            )
        super().__init__(causal=causal, window=window, **base)

    def forward(self, q, k, v):
        if self.global_tokens > q.shape[-2]:
            raise AttentionConfigError(
                f"attention.global_tokens={self.global_tokens} exceeds the sequence length {q.shape[-2]}"
            )
        return super().forward(q, k, v)


# ------------------------------------------------------------------------------------------------
@register_attention("fixed")
class FixedAttention(SparseAttention):
    """Sparse Transformer "fixed" pattern on the ``n x m`` grid (m = ``block_size``); O(L (m + n c)).

    Query i attends to its own block (row) and to the last ``summary_cells`` (c) cells of every block.
    Causal: own block up to self plus the summary cells of earlier blocks. Bidirectional: whole own
    block plus the summary cells of every other block. The length must be a multiple of
    ``block_size`` (rejected otherwise). One 4-D SDPA call: per block, keys = [own block ; all n*c
    summary cells] with a boolean mask.
    """

    def __init__(self, *, causal: bool, block_size: int = 8, summary_cells: int = 1, **base) -> None:
        self.block_size = check_block_size(block_size, base.get("seq_len"))
        self.summary_cells = check_positive(summary_cells, "attention.summary_cells")
        if summary_cells > block_size:
            raise AttentionConfigError(
                f"attention.summary_cells={summary_cells} must be <= attention.block_size={block_size}"
            )
        super().__init__(causal=causal, **base)

    def requires_len_multiple_of(self) -> int:
        return self.block_size

    def pattern(self, length: int) -> torch.Tensor:
        grid = Grid.of(length, self.block_size)
        i, j = torch.arange(length).unsqueeze(1), torch.arange(length).unsqueeze(0)
        same_block = grid.rows().unsqueeze(1) == grid.rows().unsqueeze(0)
        summary = (grid.cols() >= grid.n_cols - self.summary_cells).unsqueeze(0)
        allowed = same_block | summary
        return allowed & (j <= i) if self.causal else allowed

    def block_mask(self, grid: Grid, device) -> torch.Tensor:
        """(n, m, m + n*c) bool: [own block ; summary cells of every block] for each block's queries."""
        n, m, c = grid.n_rows, grid.n_cols, self.summary_cells
        own = torch.ones(m, m, dtype=torch.bool, device=device)
        if self.causal:
            own = own.tril()
        rows = torch.arange(n, device=device)
        # own block's summary cells are already direct keys; causal adds only earlier blocks
        other = rows.view(1, n) < rows.view(n, 1) if self.causal else rows.view(1, n) != rows.view(n, 1)
        summary = other.repeat_interleave(c, 1).view(n, 1, n * c).expand(n, m, n * c)
        return torch.cat([own.expand(n, m, m), summary], -1)

    def forward(self, q, k, v):
        B, H, L, D = q.shape
        grid = Grid.of(L, self.block_size)
        n, m, c = grid.n_rows, grid.n_cols, self.summary_cells
        qb, kb, vb = (x.reshape(B * H, n, m, D) for x in (self.scale(q), k, v))
        k_sum = kb[:, :, m - c :].reshape(B * H, 1, n * c, D).expand(-1, n, -1, -1)
        v_sum = vb[:, :, m - c :].reshape(B * H, 1, n * c, D).expand(-1, n, -1, -1)
        mask = self.cached("block", L, q.device, lambda: self.block_mask(grid, q.device))
        out = self.sdpa(qb, torch.cat([kb, k_sum], 2), torch.cat([vb, v_sum], 2), mask)
        return out.reshape(B, H, L, D)


# ------------------------------------------------------------------------------------------------
@register_attention("axial")
class AxialAttention(SparseAttention):
    """Sparse axial pattern (Combiner §4.3): same row ∪ same column on the ``n x m`` grid; O(L (n + m)).

    m = ``block_size`` columns, row-major (p = r*m + c). Causal: intersected with j <= i (own row up to
    self, own column in earlier rows). Row logits (B, H, n, m, m) and column logits (B, H, m, n, n) come
    from batched matmuls in the two layouts and share one softmax per query; self is counted once (in
    the row part). The length must be a multiple of ``block_size`` (rejected otherwise).
    """

    def __init__(self, *, causal: bool, block_size: int = 8, **base) -> None:
        self.block_size = check_block_size(block_size, base.get("seq_len"))
        super().__init__(causal=causal, **base)

    def requires_len_multiple_of(self) -> int:
        return self.block_size

    def pattern(self, length: int) -> torch.Tensor:
        grid = Grid.of(length, self.block_size)
        r, c = grid.rows(), grid.cols()
        allowed = (r.unsqueeze(1) == r.unsqueeze(0)) | (c.unsqueeze(1) == c.unsqueeze(0))
        return allowed & causal_mask(length) if self.causal else allowed

    def forward(self, q, k, v):
        B, H, L, D = q.shape
        grid = Grid.of(L, self.block_size)
        n, m = grid.n_rows, grid.n_cols
        if self.causal and not (self.training and self.dropout > 0):
            qg, kg, vg = (x.reshape(B, H, n, m, x.shape[-1]) for x in (q, k, v))
            if flash_row_column_applies(qg, vg):  # own row + own column above: two fused flash calls
                return causal_row_column_flash(qg, kg, vg, kg, vg).reshape(B, H, L, D)
        qg, kg, vg = (x.reshape(B, H, n, m, D) for x in (self.scale(q), k, v))
        row_mask, col_mask = self.cached("masks", L, q.device, lambda: self.masks(n, m, q.device))
        row_logits = matmul(qg, kg.transpose(-1, -2)).masked_fill(~row_mask, NEG_INF)  # (B, H, n, m, m)
        col_logits, col_apply = column_part(qg, kg, vg, col_mask)  # (B, H, n, m, n)
        w_row, w_col = joint_softmax(self, [row_logits, col_logits])
        return (matmul(w_row, vg) + col_apply(w_col)).reshape(B, H, L, D)

    def masks(self, n: int, m: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Row mask (m, m) over (query col, key col); column mask (n, n) over (query row, key row), self excluded."""
        cols, rows = torch.arange(m, device=device), torch.arange(n, device=device)
        if self.causal:
            return cols.view(1, m) <= cols.view(m, 1), rows.view(1, n) < rows.view(n, 1)
        return torch.ones(m, m, dtype=torch.bool, device=device), rows.view(1, n) != rows.view(n, 1)


# ------------------------------------------------------------------------------------------------
@register_attention("strided")
class StridedAttention(SparseAttention):
    """Sparse Transformer "strided" pattern with stride l = ``block_size``; O(L (l + L / l)).

    Causal: the previous l positions including self (``0 <= i - j < l``) plus every l-th earlier
    position (``(i - j) % l == 0``). Bidirectional: ``|i - j| < l`` plus every position with
    ``(i - j) % l == 0``. On the ``n x l`` grid the second part is the query's column, so the forward
    is a band part (blocks of l queries against their neighbouring blocks) and a column part (other
    rows only, so no key is counted twice), joined in one softmax. The length must be a multiple of
    ``block_size`` (rejected otherwise).
    """

    def __init__(self, *, causal: bool, block_size: int = 8, **base) -> None:
        self.block_size = check_block_size(block_size, base.get("seq_len"))
        super().__init__(causal=causal, **base)

    def requires_len_multiple_of(self) -> int:
        return self.block_size

    def pattern(self, length: int) -> torch.Tensor:
        Grid.of(length, self.block_size)
        l = self.block_size
        d = torch.arange(length).unsqueeze(1) - torch.arange(length).unsqueeze(0)
        if self.causal:
            return (d >= 0) & ((d < l) | (d % l == 0))
        return (d.abs() < l) | (d % l == 0)

    def forward(self, q, k, v):
        B, H, L, D = q.shape
        grid = Grid.of(L, self.block_size)
        n, l = grid.n_rows, grid.n_cols
        qg, kg, vg = (x.reshape(B, H, n, l, D) for x in (self.scale(q), k, v))
        ahead = 0 if self.causal else 1
        band_mask, col_mask = self.cached("masks", L, q.device, lambda: self.masks(n, l, q.device))
        # the band of row r lies in rows r-1, r (and r+1): one (l x l) product per neighbour row,
        # shifted views of K and V instead of a concatenated (2l or 3l)-wide copy
        shifts = [1, 0] + ([-1] if ahead else [])
        k_rows, v_rows = [shift_rows(kg, s) for s in shifts], [shift_rows(vg, s) for s in shifts]
        if not (self.training and self.dropout > 0):
            # No (..., 2l + n) concatenation: each part keeps its layout, one shared max and sum.
            kc, vc = (x.transpose(2, 3) for x in (kg, vg))
            groups = [LogitGroup("row", kr, vr, mask) for kr, vr, mask in zip(k_rows, v_rows, band_mask.split(l, -1))]
            groups.append(LogitGroup("col", kc, vc, col_mask))
            return joint_groups_attention(groups, qg, qg.transpose(2, 3).contiguous()).reshape(B, H, L, D)
        band_logits = [
            matmul(qg, kr.transpose(-1, -2)).masked_fill(~mask, NEG_INF)
            for kr, mask in zip(k_rows, band_mask.split(l, -1))
        ]
        col_logits, col_apply = column_part(qg, kg, vg, col_mask)
        *w_band, w_col = joint_softmax(self, band_logits + [col_logits])
        out = col_apply(w_col)
        for w, vr in zip(w_band, v_rows):
            out = out + matmul(w, vr)
        return out.reshape(B, H, L, D)

    def masks(self, n: int, l: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Band mask (n, l, keys) from positions; column mask (n, n) over rows, own row excluded."""
        ahead = 0 if self.causal else 1
        blk = torch.arange(n, device=device).view(n, 1, 1)
        i = blk * l + torch.arange(l, device=device).view(1, l, 1)
        j = (blk - 1) * l + torch.arange((2 + ahead) * l, device=device).view(1, 1, -1)
        d = i - j
        band = (d < l) & (j >= 0) & (j < n * l) & ((d >= 0) if self.causal else (d > -l))
        rows = torch.arange(n, device=device)
        col = rows.view(1, n) < rows.view(n, 1) if self.causal else rows.view(1, n) != rows.view(n, 1)
        return band, col


# ------------------------------------------------------------------------------------------------
@register_attention("logsparse")
class LogSparseAttention(SparseAttention):
    """LogSparse pattern of the Combiner paper §4.2; O(L log L).

    Causal: position p attends to itself and, for every set bit l of p, to ``((p >> l) << l) - 1``
    (the last cell of each aligned power-of-two block that tiles [0, p), i.e. the blocks
    ``combiner_logsparse`` summarizes; ``geometry.logsparse_keys``). E.g. p = 13 attends to 13, 12, 11,
    7. Bidirectional: the causal set plus its mirror image (the causal pattern of the reversed
    sequence: j with ``L-1-j`` in the causal set of ``L-1-i``). Any length works. Forward never gathers:
    at level l the queries with bit l set are the odd blocks of 2^l-block pairs and share one key, so the
    logits ``(BH, 1 + levels, L)`` and the output are per-level broadcasts (``log_levels``; hand-written
    backward), one softmax over each query's ``1 + levels`` (bidirectional ``1 + 2 levels``) slots.
    """

    def __init__(self, *, causal: bool, **base) -> None:
        super().__init__(causal=causal, **base)

    def index_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(L, K) sorted key table without repeats, and its validity."""
        idx, valid = logsparse_keys(length)
        if not self.causal:  # mirror: row i of the reversed table, keys reflected
            mirrored = (length - 1 - idx).flip(0)[:, 1:]
            idx = torch.cat([idx, mirrored], 1)
            valid = torch.cat([valid, valid.flip(0)[:, 1:]], 1)
        return dedupe_index_table(idx, valid, length)

    def pattern(self, length: int) -> torch.Tensor:
        return pattern_from_index_table(*self.index_table(length), length)

    def forward(self, q, k, v):
        B, H, L, D = q.shape
        qs, kf, vf = self.scale(q).reshape(B * H, L, D), k.reshape(B * H, L, D), v.reshape(B * H, L, -1)
        logits = LevelScores.apply(qs, kf, True)  # (BH, 1 + levels, L): self, then one slot per level
        if self.causal:
            weights = self.weight_dropout(logits.softmax(1))
            return LevelMix.apply(weights, vf, True).view(B, H, L, -1)
        # the mirror image is the causal pattern of the reversed sequence (without self, counted once)
        mirrored = LevelScores.apply(qs.flip(1), kf.flip(1), False).flip(-1)
        weights = self.weight_dropout(torch.cat([logits, mirrored], 1).softmax(1))
        own = 1 + num_log_levels(L)
        out = LevelMix.apply(weights[:, :own], vf, True)
        out = out + LevelMix.apply(weights[:, own:].flip(-1), vf.flip(1), False).flip(1)
        return out.view(B, H, L, -1)


@register_attention("random")
class RandomAttention(SparseAttention):
    """Each query attends to itself plus ``n_random`` keys drawn uniformly (seeded); O(L R).

    Draws for query i are uniform over ``[0, i]`` (causal) or ``[0, L)`` (bidirectional), with
    replacement; repeats count once. The pattern is a deterministic function of (``seed``, L), shared
    by all heads; the table for ``seq_len`` is kept as a buffer (saved in checkpoints). Any length works.
    """

    def __init__(self, *, causal: bool, n_random: int = 8, seed: int = 0, **base) -> None:
        self.n_random = check_positive(n_random, "attention.n_random", minimum=0)
        self.seed = int(seed)
        super().__init__(causal=causal, **base)
        if self.seq_len:
            idx, valid = self.index_table(self.seq_len)
            self.register_buffer("random_keys", idx)
            self.register_buffer("random_valid", valid)

    def index_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if getattr(self, "random_keys", None) is not None and self.random_keys.shape[0] == length:
            return self.random_keys, self.random_valid
        g = torch.Generator().manual_seed(self.seed)
        u = torch.rand(length, self.n_random, generator=g, dtype=torch.float64)
        i = torch.arange(length).unsqueeze(1)
        span = i + 1 if self.causal else torch.full_like(i, length)
        draws = (u * span).long().clamp(max=length - 1)
        idx = torch.cat([i, draws], 1)
        return dedupe_index_table(idx, torch.ones_like(idx, dtype=torch.bool), length)

    def pattern(self, length: int) -> torch.Tensor:
        return pattern_from_index_table(*self.index_table(length), length)

    def forward(self, q, k, v):
        L = q.shape[-2]
        idx, valid = self.cached("idx", L, q.device, lambda: tuple(x.to(q.device) for x in self.index_table(L)))
        return attend_index_table(self, q, k, v, idx, valid)


# ------------------------------------------------------------------------------------------------
@register_attention("bigbird")
class BigBirdAttention(SparseAttention):
    """BigBird block-sparse attention (ITC form), bidirectional only; O(L b (3 + g + r)).

    The sequence is cut into blocks of ``block_size`` (b) positions (length must be a multiple; rejected
    otherwise). Query block a attends to key block c when ``|a - c| <= 1`` (window), when a or c is a
    global block (the first ``ceil(g/2)`` and last ``floor(g/2)`` blocks, g = ``global_blocks``; global
    blocks attend everywhere and are attended by all), or when c is one of a's ``random_blocks`` random
    blocks for that head. Random blocks are drawn per head and query block, without replacement,
    outside the window and the global blocks (fewer when not enough remain), from a generator seeded
    with ``seed``: a deterministic function of (seed, L, heads), stored as a buffer for ``seq_len``.
    ``pattern(L)`` is (H, L, L) (H = ``n_heads``, 1 when unknown: then all heads share the draw).
    """

    supports_causal = False

    def __init__(
        self, *, causal: bool, block_size: int = 8, global_blocks: int = 2, random_blocks: int = 3, seed: int = 0, **base
    ) -> None:
        self.block_size = check_block_size(block_size, base.get("seq_len"))
        self.global_blocks = check_positive(global_blocks, "attention.global_blocks", minimum=0)
        self.random_blocks = check_positive(random_blocks, "attention.random_blocks", minimum=0)
        self.seed = int(seed)
        super().__init__(causal=causal, **base)
        if self.seq_len:
            self.register_buffer("random_table", self.draw_random_blocks(self.seq_len // self.block_size))

    def requires_len_multiple_of(self) -> int:
        return self.block_size

    def global_block_ids(self, n: int) -> torch.Tensor:
        g = self.global_blocks
        ids = torch.cat([torch.arange((g + 1) // 2), n - 1 - torch.arange(g // 2)])
        return ids[(ids >= 0) & (ids < n)].unique()

    def fixed_blocks(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, 3 + g) window and global key blocks of each query block, and their validity (repeats off)."""
        a = torch.arange(n).unsqueeze(1)
        glob = self.global_block_ids(n)
        ids = torch.cat([a - 1, a, a + 1, glob.view(1, -1).expand(n, -1)], 1)
        valid = (ids >= 0) & (ids < n)
        repeat = (ids.unsqueeze(2) == ids.unsqueeze(1)).tril(-1).any(-1)
        valid &= ~repeat
        return ids.clamp(0, n - 1), valid

    def draw_random_blocks(self, n: int) -> torch.Tensor:
        """(H, n, r) random key blocks per head and query block; -1 where not enough blocks remain."""
        heads = self.n_heads or 1
        g = torch.Generator().manual_seed(self.seed)
        noise = torch.rand(heads, n, n, generator=g, dtype=torch.float64)
        a, c = torch.arange(n).view(n, 1), torch.arange(n).view(1, n)
        taken = ((a - c).abs() <= 1) | torch.isin(c, self.global_block_ids(n))
        noise = noise.masked_fill(taken, 2.0)  # taken blocks sort last
        r = min(self.random_blocks, n)
        score, ids = noise.topk(r, dim=-1, largest=False)
        return torch.where(score < 2.0, ids, torch.full_like(ids, -1))

    def random_blocks_for(self, n: int) -> torch.Tensor:
        table = getattr(self, "random_table", None)
        if table is not None and table.shape[1] == n:
            return table
        return self.draw_random_blocks(n)

    def pattern(self, length: int) -> torch.Tensor:
        n = Grid.of(length, self.block_size).n_rows
        a, c = torch.arange(n).view(n, 1), torch.arange(n).view(1, n)
        glob = self.global_block_ids(n)
        allowed = ((a - c).abs() <= 1) | torch.isin(a, glob) | torch.isin(c, glob)  # (n, n)
        rand = self.random_blocks_for(n).cpu()  # (H, n, r)
        hit = (rand.unsqueeze(-1) == torch.arange(n).view(1, 1, 1, n)).any(2)  # (H, n, n)
        blocks = allowed | hit
        return blocks.repeat_interleave(self.block_size, 1).repeat_interleave(self.block_size, 2)

    def forward(self, q, k, v):
        B, H, L, D = q.shape
        grid = Grid.of(L, self.block_size)
        n, b = grid.n_rows, grid.n_cols

        def tables():
            ids, valid = self.fixed_blocks(n)
            rand = self.random_blocks_for(n).cpu()  # (H', n, r)
            ids = torch.cat([ids.expand(rand.shape[0], -1, -1), rand.clamp(min=0)], -1)
            valid = torch.cat([valid, rand[0] >= 0], -1)  # validity of random blocks is head-independent
            mask = valid.repeat_interleave(b, -1).view(n, 1, -1).expand(n, b, -1).contiguous()
            glob_pos = (self.global_block_ids(n).view(-1, 1) * b + torch.arange(b)).flatten()
            return ids.to(q.device), mask.to(q.device), glob_pos.to(q.device)

        ids, mask, glob_pos = self.cached("tables", L, q.device, tables)
        if ids.shape[0] not in (1, H):
            raise AttentionConfigError(
                f"attention 'bigbird' drew random blocks for n_heads={ids.shape[0]} heads but got {H}"
            )
        kb, vb = k.reshape(B, H, n, b, D), v.reshape(B, H, n, b, D)
        if ids.shape[0] == H:
            heads = torch.arange(H, device=q.device).view(H, 1, 1)
            kw, vw = kb[:, heads, ids], vb[:, heads, ids]  # (B, H, n, Kb, b, D)
        else:
            kw, vw = kb[:, :, ids[0]], vb[:, :, ids[0]]
        kw, vw = kw.reshape(B * H, n, -1, D), vw.reshape(B * H, n, -1, D)
        qb = self.scale(q).reshape(B * H, n, b, D)
        out = self.sdpa(qb, kw, vw, mask).reshape(B, H, L, D)
        if glob_pos.numel():  # global query blocks attend to every key
            out = out.index_copy(2, glob_pos, self.sdpa(self.scale(q)[:, :, glob_pos], k, v))
        return out
