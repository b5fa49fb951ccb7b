"""Combiner-Axial, row-major (``combiner_axial``; Ren et al. 2021 §4, official ``axial_rowmajor``).

Grid view: ``L = n * m`` positions on ``n`` rows of ``m = block_size`` columns, ``p = r * m + c``.
Query ``(r, c)`` attends

- directly to its own row: columns ``c' <= c`` when causal (self included), the whole row otherwise;
- to one summary per other row ``r'`` (``r' < r`` when causal, ``r' != r`` otherwise), *seen from
  its own column*: the summary value is the plain unmasked row attention of the row-mate query
  ``q(r', c)`` over row ``r'``, ``v̄(r', c) = Σ_c' P_row(r', c)[c'] v(r', c')``.

One softmax runs over ``[direct logits ; summary logits]`` (width ``m + n``), so row ``r'`` gives
key ``(r', c')`` the effective weight ``w(i, r') * P_row(r', c)[c']``: every allowed key gets
positive weight at ``O(L (n + m))`` cost.

The summary key ``k̄(r', c)`` is chosen by ``row_summary``:

- ``proj`` (default; the official learned key): ``Linear(H*D -> H*D)`` of the flattened ``v̄``, plus
  a residual, ``LayerNorm`` (eps 1e-6 as Flax's), ``Linear(H*D -> H*D)`` back to heads (no biases, as in
  JAX). The official residual is the layer input ``x(r', c)``; the attention contract only sees ``q, k, v``,
  so the row-mate's raw key ``k(r', c)`` (flattened over heads) stands in for it — a documented
  deviation. Needs ``n_heads`` and ``head_dim``.
- ``none``: the raw key ``k(r', c)`` of the row-mate (TF option).
- ``wsum``: ``Σ_c' P_row(r', c)[c'] k(r', c')``, the row keys averaged with the same row weights (TF).

Fast path (no weight dropout): ``v̄`` is one fused SDPA call with rows folded into the head axis;
the joint softmax never builds the ``(m + n)``-wide logits. On CPU, causal, it is two flash calls
(own row; column layout for the summaries) merged exactly by their log-sum-exps
(``_CausalRowColumnFlash``); otherwise ``_RowColumnJointAttention`` keeps both logit blocks in the
layout their batched matmul produces and normalizes them with one shared max and sum. Training with
weight dropout uses the explicit concatenated softmax.

This module also holds what the whole axial family shares: ``RegionPartition`` (the explicit
direct set and regions, for tests and figures) and ``effective_matrix`` (the dense reference that
``attention_matrix`` uses; it is built from the partition, independently of the fast path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from longseq.attention.amp import autocast_function
from longseq.attention.base import Attention, AttentionConfigError
from longseq.attention.geometry import Grid, check_block_size
from longseq.attention.registry import register_attention
from longseq.attention.summary import padded_partition

ROW_SUMMARIES = ("proj", "none", "wsum")
FLAX_LAYER_NORM_EPS = 1e-6  # flax.linen.LayerNorm's default epsilon (the official layer); torch's is 1e-5
NEG_INF = float("-inf")


# ------------------------------------------------------------------------------------------------
# Shared by the axial family: explicit partitions and the dense effective matrix.
# ------------------------------------------------------------------------------------------------
@dataclass
class RegionPartition:
    """The partition a Combiner variant applies, as dense index sets (small L, tests and figures).

    Attributes:
        direct: ``(L, L)`` bool, query i attends key j directly.
        members: ``(R, L)`` bool, the positions each (non-empty) region summarizes.
        usable: ``(L, R)`` bool, query i may use region R (one joint-softmax logit).
        family: ``(R,)`` long, which factorization a region belongs to (0 = rows or vertical,
            1 = horizontal); within one family regions used by a query are disjoint.
        anchor: ``(R,)`` long, the position whose own query summarizes the region (row-major),
            or -1 for pooled regions (max/mean/DeepSets of the region's queries).
    """

    direct: torch.Tensor
    members: torch.Tensor
    usable: torch.Tensor
    family: torch.Tensor
    anchor: torch.Tensor

    def allowed(self, family: int | None = None) -> torch.Tensor:
        """(L, L) bool: keys reached directly or through a usable region (of ``family`` if given)."""
        usable = self.usable if family is None else self.usable & (self.family == family)
        return self.direct | ((usable.double() @ self.members.double()) > 0)

    def without_padding(self, pad: torch.Tensor) -> RegionPartition:
        """This partition for one document with key padding ``pad`` ``(L,)`` bool (True = pad).

        ``summary.padded_partition``'s rule (padded keys out of the direct set and the regions, regions
        without a real key unusable, empty rows fall back to their unpadded direct keys). A region summarized
        by a position's own query (``anchor``) whose anchor is padding is summarized by its first real
        member's query instead, so no padded content enters a summary and every real key stays reachable.
        Regions left empty are dropped.
        """
        anchor = self.anchor
        on_pad = (anchor >= 0) & pad[anchor.clamp(min=0)]  # (R,); -1 = pooled region
        first_real = (self.members & ~pad).int().argmax(-1)  # (R,) first real member (any if none: dropped)
        anchor = torch.where(on_pad, first_real, anchor)
        direct, members, usable = padded_partition(self.direct, self.members, self.usable, pad)
        return RegionPartition.from_candidates(direct, members, usable, self.family, anchor)

    @classmethod
    def from_candidates(cls, direct, members, usable, family, anchor) -> RegionPartition:
        """Drop the empty candidate regions (e.g. "rows above row 0") and keep the rest."""
        keep = members.any(-1)
        return cls(direct, members[keep], usable[:, keep], family[keep], anchor[keep])


def grid_coordinates(grid: Grid, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(L,) row and column of every position, for building partitions by broadcasting."""
    return grid.rows(device), grid.cols(device)


def effective_matrix(
    q: torch.Tensor,
    k: torch.Tensor,
    direct: torch.Tensor,
    members: torch.Tensor,
    usable: torch.Tensor,
    summary_q: torch.Tensor,
    summary_k: torch.Tensor,
) -> torch.Tensor:
    """Dense effective weights of one joint softmax over direct keys and region summaries.

    Args:
        q: scaled queries ``(B, H, L, D)``; k: keys ``(B, H, L, D)``.
        direct ``(L, L)``, members ``(R, L)``, usable ``(L, R)``: the partition (bool).
        summary_q, summary_k: ``(B, H, R, D)`` each region's summary query and key.
    Returns:
        ``(B, H, L, L)``: ``w_direct + Σ_R w(i, R) p(j | R)`` with ``p(j | R)`` the region's own
        softmax of ``summary_q · k_j`` over its members.
    """
    inner = (summary_q @ k.transpose(-1, -2)).masked_fill(~members, NEG_INF).softmax(-1)  # (B,H,R,L)
    direct_logits = (q @ k.transpose(-1, -2)).masked_fill(~direct, NEG_INF)
    region_logits = (q @ summary_k.transpose(-1, -2)).masked_fill(~usable, NEG_INF)
    weights = torch.cat([direct_logits, region_logits], -1).softmax(-1)
    L = q.shape[-2]
    return weights[..., :L] + weights[..., L:] @ inner


def to_grid(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """(B, H, L, D) -> row layout (B, H, n, m, D) (a view)."""
    return x.unflatten(-2, (grid.n_rows, grid.n_cols))


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, ..., D) -> (B, ..., H*D): the per-position vector the official proj acts on."""
    return x.movedim(1, -2).flatten(-2)


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, ..., H*D) -> (B, H, ..., D), inverse of ``merge_heads``."""
    return x.unflatten(-1, (n_heads, -1)).movedim(-2, 1)


# ------------------------------------------------------------------------------------------------
# Row-major Combiner-Axial.
# ------------------------------------------------------------------------------------------------
@autocast_function
class _RowColumnJointAttention(torch.autograd.Function):
    """Exact joint softmax over own-row keys (row layout) and per-column summaries (column layout).

    Forward and backward are written out so that no ``(..., m + n)`` concatenation, split or
    transposed logit copy is ever made: both logit blocks stay in the layout their batched matmul
    produces, share one max and one normaliser (``w = exp(s - M) / Z``, ``M`` the max over both
    blocks, ``Z`` the sum over both) and are exponentiated in place. Every bmm operand is contiguous
    or a plain last-two-axes transpose, which CPU BLAS consumes without copies.

    Inputs: ``q_row, k_row, v_row`` ``(B, H, n, m, D)`` (q scaled); ``q_col, sk_col, sv_col``
    ``(B, H, m, n, D)`` (query, summary key and summary value of row r' seen from column c);
    ``direct_blocked`` ``(m, m)`` or None and ``summary_blocked`` ``(n, n)`` bool, True = masked.
    Output ``(B, H, n, m, D)``.
    """

    @staticmethod
    def forward(ctx, q_row, k_row, v_row, q_col, sk_col, sv_col, direct_blocked, summary_blocked):
        direct = q_row @ k_row.transpose(-1, -2)  # (B,H,n,m[c],m[c'])
        if direct_blocked is not None:
            direct.masked_fill_(direct_blocked, NEG_INF)
        summary = q_col @ sk_col.transpose(-1, -2)  # (B,H,m[c],n[r],n[r'])
        summary.masked_fill_(summary_blocked, NEG_INF)
        # Shared max: own-row direct keys always include self, so it is finite for every query.
        top = torch.maximum(direct.amax(-1), summary.amax(-1).transpose(-1, -2))  # (B,H,n,m)
        direct.sub_(top.unsqueeze(-1)).exp_()
        summary.sub_(top.transpose(-1, -2).unsqueeze(-1)).exp_()
        inv_total = (direct.sum(-1) + summary.sum(-1).transpose(-1, -2)).reciprocal_()  # (B,H,n,m)
        direct.mul_(inv_total.unsqueeze(-1))
        summary.mul_(inv_total.transpose(-1, -2).unsqueeze(-1))
        out = direct @ v_row
        out.add_((summary @ sv_col).transpose(2, 3))
        ctx.save_for_backward(q_row, k_row, v_row, q_col, sk_col, sv_col, direct, summary, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q_row, k_row, v_row, q_col, sk_col, sv_col, direct, summary, out = ctx.saved_tensors
        grad_row = grad_out.contiguous()  # (B,H,n,m,D); zero-stride grads would push bmm off BLAS
        grad_col = grad_row.transpose(2, 3).contiguous()  # (B,H,m,n,D)
        # Softmax backward on the joint weights: dS = W * (dW - <dO, out>).
        row_dot = (grad_row * out).sum(-1)  # (B,H,n,m)
        grad_v_row = direct.transpose(-1, -2) @ grad_row
        grad_sv_col = summary.transpose(-1, -2) @ grad_col
        grad_direct = (grad_row @ v_row.transpose(-1, -2)).sub_(row_dot.unsqueeze(-1)).mul_(direct)
        grad_summary = (grad_col @ sv_col.transpose(-1, -2)).sub_(row_dot.transpose(-1, -2).unsqueeze(-1)).mul_(summary)
        grad_q_row = grad_direct @ k_row
        grad_q_col = grad_summary @ sk_col
        grad_k_row = grad_direct.transpose(-1, -2) @ q_row
        grad_sk_col = grad_summary.transpose(-1, -2) @ q_col
        return grad_q_row, grad_k_row, grad_v_row, grad_q_col, grad_sk_col, grad_sv_col, None, None


@autocast_function
class _CausalRowColumnFlash(torch.autograd.Function):
    """Causal joint softmax from two fused CPU flash-attention calls merged by their log-sum-exps.

    Own-row keys (causal inside the row) and the summaries of strictly earlier rows seen from the
    query's column are two causal attentions: rows folded into heads ``(BH, n, m, D)``, and columns
    folded into heads ``(BH, m, n - 1, D)`` with queries of rows ``1..n-1`` against summaries of rows
    ``0..n-2`` (row r may use r' < r, i.e. ``r' <= r - 1``: plain ``is_causal``). The two parts are
    merged exactly by their log-sum-exps; the backward calls the flash backward of each part with the
    JOINT output and log-sum-exp, which is exactly the joint softmax's gradient restricted to that
    part. CPU only (the ``_for_cpu`` kernels return the log-sum-exp that public SDPA hides).

    Inputs: ``q_row, k_row, v_row`` ``(BH, n, m, D)`` (q unscaled, ``scale`` = 1/sqrt(D));
    ``q_col`` ``(BH, m, n - 1, D)`` (queries of rows >= 1); ``sk_col, sv_col`` ``(BH, m, n - 1, D)``
    (summaries of rows <= n - 2). Output ``(BH, n, m, D)``.
    """

    @staticmethod
    def forward(ctx, q_row, k_row, v_row, q_col, sk_col, sv_col, scale):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out_direct, lse_direct = flash(q_row, k_row, v_row, 0.0, True, scale=scale)  # lse (BH, n, m)
        out_summary, lse_summary = flash(q_col, sk_col, sv_col, 0.0, True, scale=scale)  # lse (BH, m, n-1)
        lse_summary = lse_summary.transpose(1, 2)  # (BH, n-1[r>=1], m)
        lse = lse_direct.clone()
        lse[:, 1:] = torch.logaddexp(lse_direct[:, 1:], lse_summary)
        out = out_direct.mul_((lse_direct - lse).exp_().unsqueeze(-1))
        out[:, 1:] += out_summary.transpose(1, 2) * (lse_summary - lse[:, 1:]).exp_().unsqueeze(-1)
        ctx.save_for_backward(q_row, k_row, v_row, q_col, sk_col, sv_col, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q_row, k_row, v_row, q_col, sk_col, sv_col, out, lse = ctx.saved_tensors
        flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad_out = grad_out.contiguous()
        grads_row = flash_backward(grad_out, q_row, k_row, v_row, out, lse, 0.0, True, scale=ctx.scale)
        in_columns = [x[:, 1:].transpose(1, 2).contiguous() for x in (grad_out, out, lse.unsqueeze(-1))]
        grads_col = flash_backward(
            in_columns[0], q_col, sk_col, sv_col, in_columns[1], in_columns[2].squeeze(-1), 0.0, True, scale=ctx.scale
        )
        return (*grads_row, *grads_col, None)


def flash_row_column_applies(qr: torch.Tensor, vr: torch.Tensor) -> bool:
    """Whether ``causal_row_column_flash`` can run: CPU kernels, at least two rows, and one head size for
    q, k and v (tests probe with v = identity)."""
    return qr.device.type == "cpu" and qr.shape[2] > 1 and vr.shape[-1] == qr.shape[-1]


def causal_row_column_flash(qr, kr, vr, column_k, column_v) -> torch.Tensor:
    """One causal softmax per query ``(r, c)`` over its own row (``c' <= c``) and, from its own column, the
    entries ``(r', c)`` of ``column_k, column_v`` for every earlier row ``r' < r``.

    Row layouts ``(B, H, n, m, D)`` in and out, q NOT scaled. Row-major Combiner passes the row summaries
    as the column entries, sparse ``axial`` the raw keys and values. Two fused flash calls
    (``_CausalRowColumnFlash``); see ``flash_row_column_applies`` for when it runs.
    """
    B, H, n, m, D = qr.shape
    rows4 = [x.reshape(B * H, n, m, D) for x in (qr, kr, vr)]
    q_col, k_col, v_col = (  # (B*H, m, n-1, D): queries of rows >= 1, column entries of rows <= n-2
        x[:, :, rows].transpose(2, 3).reshape(B * H, m, n - 1, D)  # one copy into column layout
        for x, rows in ((qr, slice(1, None)), (column_k, slice(None, -1)), (column_v, slice(None, -1)))
    )
    out = _CausalRowColumnFlash.apply(*rows4, q_col, k_col, v_col, 1.0 / math.sqrt(D))
    return out.view(B, H, n, m, D)


# ------------------------------------------------------------------------------------------------
@register_attention("combiner_axial")
class CombinerAxialRowMajor(Attention):
    """Row-major Combiner-Axial (see module docstring); cost ``O(L (n + m) D)``, memory ``O(L (n + m))``.

    Args:
        block_size: m, the row length (columns); must divide L.
        row_summary: ``proj`` (learned, default), ``none`` or ``wsum`` — how a row summary's key is made.
    """

    def __init__(self, *, causal: bool, block_size: int, row_summary: str = "proj", **common) -> None:
        self.block_size = check_block_size(block_size, common.get("seq_len"))
        super().__init__(causal=causal, **common)
        if row_summary not in ROW_SUMMARIES:
            raise AttentionConfigError(
                f"attention.row_summary={row_summary!r} is not valid; choose one of {ROW_SUMMARIES}"
            )
        self.row_summary = row_summary
        self.has_parameters = row_summary == "proj"
        if row_summary == "proj":
            if self.n_heads is None or self.head_dim is None:
                raise AttentionConfigError(
                    "attention.row_summary=proj learns a summary key map and needs n_heads and head_dim "
                    "(the model passes them); use attention.row_summary=none or wsum otherwise"
                )
            width = self.n_heads * self.head_dim
            self.summary_in = nn.Linear(width, width, bias=False)
            self.summary_norm = nn.LayerNorm(width, eps=FLAX_LAYER_NORM_EPS)
            self.summary_out = nn.Linear(width, width, bias=False)

    def requires_len_multiple_of(self) -> int:
        return self.block_size

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block_size={self.block_size}, row_summary={self.row_summary}"

    def summary_keys(self, vbar: torch.Tensor, k_mate: torch.Tensor, k_wsum: torch.Tensor | None) -> torch.Tensor:
        """Summary keys ``(B, H, ..., D)`` from summary values, the row-mates' keys and the wsum keys."""
        if self.row_summary == "none":
            return k_mate
        if self.row_summary == "wsum":
            return k_wsum
        H = vbar.shape[1]
        if H * vbar.shape[-1] != self.summary_in.in_features:
            raise AttentionConfigError(
                f"attention '{self.name}' was built for n_heads*head_dim={self.summary_in.in_features}, "
                f"got H={H}, D={vbar.shape[-1]}"
            )
        # The learned maps run in the inputs' dtype (parameters cast, as in linformer / synthesizer), so bf16
        # q, k, v work with fp32 parameters outside autocast too (e.g. attention_matrix on captured tensors).
        x = merge_heads(vbar)
        hidden = F.linear(x, self.summary_in.weight.to(x.dtype))
        hidden = F.dropout(hidden, self.dropout, self.training)
        # Official residual is the layer input x(r', c); only q, k, v reach us, so k(r', c) stands in.
        hidden = hidden + merge_heads(k_mate)
        norm = self.summary_norm
        hidden = F.layer_norm(hidden, norm.normalized_shape, norm.weight.to(hidden.dtype), norm.bias.to(hidden.dtype),
                              norm.eps)
        return split_heads(F.linear(hidden, self.summary_out.weight.to(hidden.dtype)), H)

    # Key padding (LRA): padded keys get no direct weight and are left out of every row summary's inner
    # softmax. A row's summary for column c is made by its row-mate (r', c); where that row-mate is padding,
    # the row's first real position makes it instead (its query and key stand in), so padded contents never
    # enter a summary and every real key stays reachable (full support). A row without a real key is
    # masked; a padded query with nothing left falls back to its unpadded direct keys.
    supports_padding_mask = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, L, D) unscaled -> (B, H, L, D); ``key_padding_mask`` (B, L) bool, True = padded key."""
        L = q.shape[-2]
        self.check_length(L)
        grid = Grid.of(L, self.block_size)
        n, m = grid.n_rows, grid.n_cols
        if key_padding_mask is None and not (self.training and self.dropout > 0):
            return self.forward_fused(to_grid(q, grid), to_grid(k, grid), to_grid(v, grid)).flatten(2, 3)
        qr, kr, vr = to_grid(self.scale(q), grid), to_grid(k, grid), to_grid(v, grid)  # (B,H,n,m,D)
        joint_mask = self.joint_mask(n, m, q.device)  # (n, m, m + n), True = masked
        row_logits = qr @ kr.transpose(-1, -2)  # (B,H,n,m[c],m[c'])
        inner_logits = row_logits  # unmasked: an earlier row is entirely in the past
        if key_padding_mask is not None:
            pad = key_padding_mask.to(device=q.device, dtype=torch.bool).view(-1, 1, n, 1, m)  # (B,1,n,1,m)
            empty_row = pad.all(-1, keepdim=True)  # its regions are masked below; any finite inner row will do
            inner_logits = row_logits.masked_fill(pad & ~empty_row, NEG_INF)
            direct_only = joint_mask.clone()
            direct_only[..., m:] = True
            unusable_row = empty_row.view(-1, 1, 1, 1, n).expand(-1, 1, n, m, n)  # (B,1,n[r],m[c],n[r'])
            joint_mask = joint_mask | torch.cat([pad.expand(-1, 1, n, m, m), unusable_row], -1)
            joint_mask = torch.where(joint_mask.all(-1, keepdim=True), direct_only, joint_mask)
        row_probs = inner_logits.softmax(-1)
        summary_v = row_probs @ vr  # (B,H,n[r'],m[c],D)
        k_wsum = row_probs @ kr if self.row_summary == "wsum" else None
        summary_k = self.summary_keys(summary_v, kr, k_wsum)
        if key_padding_mask is not None:  # a padded row-mate's summary is made by the row's first real position
            real = ~pad.view(-1, n, m)
            cols = torch.arange(m, device=q.device)
            anchor = torch.where(real, cols, real.int().argmax(-1, keepdim=True))  # (B, n, m[c]) -> column
            summary_v, summary_k = (x.gather(3, anchor[:, None, :, :, None].expand_as(x)) for x in (summary_v, summary_k))

        # Column layout: query (r, c) meets summary (r', c) of its own column c. Batched matmuls get
        # contiguous operands: strided batches make CPU bmm copy matrix by matrix.
        q_col = qr.transpose(2, 3).contiguous()
        summary_logits = q_col @ summary_k.transpose(2, 3).contiguous().transpose(-1, -2)  # (B,H,m,n,n)
        logits = torch.cat([row_logits, summary_logits.transpose(2, 3)], -1)  # (B,H,n,m,m+n)
        logits.masked_fill_(joint_mask, NEG_INF)  # in place: cat's backward does not need its output
        weights = self.weight_dropout(logits.softmax(-1))
        direct_w, summary_w = weights.split([m, n], -1)
        out = direct_w @ vr
        summary_out = summary_w.transpose(2, 3).contiguous() @ summary_v.transpose(2, 3).contiguous()
        return (out + summary_out.transpose(2, 3)).flatten(2, 3)

    def forward_fused(self, qr: torch.Tensor, kr: torch.Tensor, vr: torch.Tensor) -> torch.Tensor:
        """Dropout-free fast path on row layouts ``(B, H, n, m, D)`` (q NOT scaled) -> ``(B, H, n, m, D)``.

        The unmasked row attention that makes ``v̄`` is one fused SDPA call (rows folded into the
        head axis, 4-D). The joint softmax is ``_CausalRowColumnFlash`` on CPU when causal (two fused
        flash calls, the 1/sqrt(D) passed as their ``scale``), else ``_RowColumnJointAttention``
        (explicit weights, no concatenation). Neither builds the ``(..., m + n)`` logits.
        """
        B, H, n, m, D = qr.shape
        scale = 1.0 / math.sqrt(D)
        rows4 = [x.reshape(B * H, n, m, x.shape[-1]) for x in (qr, kr, vr)]
        summary_v = F.scaled_dot_product_attention(*rows4, scale=scale).view(B, H, n, m, -1)
        k_wsum = None
        if self.row_summary == "wsum":
            k_wsum = F.scaled_dot_product_attention(*rows4[:2], rows4[1], scale=scale).view(B, H, n, m, D)
        summary_k = self.summary_keys(summary_v, kr, k_wsum)
        if self.causal and flash_row_column_applies(qr, vr):
            return causal_row_column_flash(qr, kr, vr, summary_k, summary_v)
        qr = self.scale(qr)
        q_col, sk_col, sv_col = (x.transpose(2, 3).contiguous() for x in (qr, summary_k, summary_v))
        rows, cols = torch.arange(n, device=qr.device), torch.arange(m, device=qr.device)
        if self.causal:
            direct_blocked = cols[:, None] < cols[None, :]  # (m[c], m[c']): later own-row columns
            summary_blocked = rows[:, None] <= rows[None, :]  # (n[r], n[r']): rows not strictly earlier
        else:
            direct_blocked, summary_blocked = None, rows[:, None] == rows[None, :]
        return _RowColumnJointAttention.apply(qr, kr, vr, q_col, sk_col, sv_col, direct_blocked, summary_blocked)

    def joint_mask(self, n: int, m: int, device) -> torch.Tensor:
        """(n, m, m + n) bool, True = masked: later own-row columns (causal) and unusable rows."""
        rows, cols = torch.arange(n, device=device), torch.arange(m, device=device)
        later_col = cols[None, :, None] < cols[None, None, :]  # (1, m[c], m[c'])
        if not self.causal:
            later_col = torch.zeros_like(later_col)
        unusable_row = rows[:, None, None] <= rows[None, None, :] if self.causal else rows[:, None, None] == rows[None, None, :]
        return torch.cat([later_col.expand(n, m, m), unusable_row.expand(n, m, n)], -1)

    # -- explicit partition and dense reference ---------------------------------------------------
    def partition(self, L: int, device=None) -> RegionPartition:
        """Direct set and regions: region ``(r', c)`` = row r' summarized from column c (anchor (r', c))."""
        grid = Grid.of(L, self.block_size)
        rows, cols = grid_coordinates(grid, device)
        same_row = rows[:, None] == rows[None, :]
        direct = same_row & (cols[None, :] <= cols[:, None]) if self.causal else same_row
        members = same_row  # candidate region at anchor position a: the whole row of a
        earlier = rows[None, :] < rows[:, None] if self.causal else rows[None, :] != rows[:, None]
        usable = (cols[:, None] == cols[None, :]) & earlier  # (query i, anchor a)
        anchor = torch.arange(L, device=device)
        family = torch.zeros(L, dtype=torch.long, device=device)
        return RegionPartition.from_candidates(direct, members, usable, family, anchor)

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, H, L, L) dense effective weights, built from ``partition`` (not from ``forward``).

        With ``key_padding_mask`` each document gets ``partition(L).without_padding(pad)``: a loop over the
        batch on this small-L reference path only.
        """
        L = q.shape[-2]
        self.check_length(L)
        part = self.partition(L, q.device)
        if key_padding_mask is None:
            return self.partition_matrix(part, q, k, v)
        pads = key_padding_mask.to(device=q.device, dtype=torch.bool)
        return torch.cat([self.partition_matrix(part.without_padding(pad), q[b : b + 1], k[b : b + 1], v[b : b + 1])
                          for b, pad in enumerate(pads)])

    def partition_matrix(self, part: RegionPartition, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Dense weights ``(B, H, L, L)`` of one partition whose regions are rows summarized by their anchor's query."""
        qs = self.scale(q)
        summary_q = qs[..., part.anchor, :]
        inner = (summary_q @ k.transpose(-1, -2)).masked_fill(~part.members, NEG_INF).softmax(-1)
        summary_k = self.summary_keys(inner @ v, k[..., part.anchor, :], inner @ k)
        return effective_matrix(qs, k, part.direct, part.members, part.usable, summary_q, summary_k)
