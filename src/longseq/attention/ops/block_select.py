"""Query-dependent block selection (``moba``, ``nsa``, ``combiner_select``): rank blocks per query, keep the best,
attend the kept keys at full resolution; never an ``L x L`` tensor.

- ``top_blocks``: the one selection rule: the ``k`` highest scores per query, ties to the lower block index
  (a stable sort, so ``forward``, the dense ``attention_matrix`` and decoding pick the same blocks), blocks
  scored -inf never kept;
- the parts of one softmax, computed apart: ``block_attention`` (each query against its own block, or the block
  ``shift`` before it: a ``Part`` of the rows from ``start`` on), ``sink_attention`` (the first keys) and
  ``grouped_attention`` (each query against the members of the groups it chose: the (query, group) pairs sorted by
  group into tiles of queries sharing one group, small matrix products, no per-query copy of the keys; its tile
  rows are ``Pairs``); ``merge_parts`` joins parts by their log-sum-exps (``lse_factors``) in one ``weighted_sum``
  pass (``safe_softmax`` keeps empty rows NaN-free), and a variant with several softmaxes (``nsa``'s gated
  branches) weighs all of their parts in one ``weighted_sum``;
- ``block_table`` / ``gathered_attention``: a per-query key table, for decoding steps (a few queries);
- ``scoring``: selection scores are computed in fp32 (fp64 stays fp64) with autocast off, so a bf16 run picks the
  blocks an fp32 run picks;
- ``ops.cpu.flash_lse`` (``FlashLse``): where the dispatch chose ``cpu_flash`` (the variants declare ``CPU_FLASH``:
  CPU, fp32/fp64, no dropout, eager, key padding, heads in groups under glibc's fresh-mmap size) the
  products run as fused CPU flash calls on q, k, v padded once per forward (``FlashInputs``; the blocks are views,
  the tiles gathers), whose log-sum-exp stays differentiable, so the parts still merge exactly; elsewhere the
  explicit masked softmax. Speed: docs/performance.md, "The 2025 successors on CPU" (``make bench``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch

from longseq.attention.ops.amp import autocast_function, has_autocast
from longseq.attention.ops.cpu.flash_lse import FlashInputs, flash_lse
from longseq.attention.ops.cpu.memory import FRESH_MAP_BYTES
from longseq.attention.ops.dispatch import CpuFlash, static_shapes_on
from longseq.attention.ops.masks import NEG_INF

# What the fused tiles handle (the ``cpu_flash`` of moba, nsa and combiner_select): key padding (per-tile masks);
# not weight dropout, not bf16/fp16 (``FlashLse`` computes in fp32/fp64), not while torch.compile traces.
# head_group_rows: nsa's tile gathers and their gradients hold ~2.5 rows per query and head at L = 16384; in groups
# of 2 of 8 heads (every temporary under 32 MiB) fwd + bwd took 0.80 (nsa), 0.63 (moba) and 0.66 (combiner_select)
# of all heads at once, page faults 0.39-0.54 M -> 0.02-0.06 M; groups of 4 or 1 were slower than 2
CPU_FLASH = CpuFlash(key_padding=True, half_precision=False, compiles=False, head_group_rows=3.0)
# The ``host_reads`` of the variants that tile (query, group) pairs (``grouped_attention``); their static-shape form
# (the ``xla`` backend) pads the tiles to a count the shapes fix
TILED_PAIRS = "tiles its (query, block) pairs with nonzero and a tile count read by int (grouped_attention)"


def flash_inputs(attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qs: torch.Tensor,
                 key_padding_mask: torch.Tensor | None) -> FlashInputs | None:
    """The inputs of one call's fused path, padded once (``FlashInputs``) where the dispatch chose ``cpu_flash`` for
    ``attention`` on unscaled ``q``, k, v; None: the explicit path."""
    if attention.backend_for(q, k, v, key_padding_mask) != "cpu_flash":
        return None
    return FlashInputs.of(qs, k, v)


# Selection scores ``(T, C)`` in fp32 per head are scored in chunks of query rows under this many bytes: on CPU under
# glibc's fresh-mmap size (at L = 16384 a group of two of nsa's heads scored 32 MiB at once: two fresh maps per
# call); on a GPU a bound on the transient memory (moba's scores at L = 65,536, H 8: 0.5 GB in one piece)
SCORE_CHUNK_BYTES = {"cpu": FRESH_MAP_BYTES // 4, "cuda": 1 << 27}


def by_query_chunks(choose, T: int, row_bytes: int, device: torch.device, *rows) -> tuple[torch.Tensor, torch.Tensor]:
    """``choose(*rows)`` -> ``(blocks, ok)`` ``(B, H, T, k)`` over chunks of the T query rows whose scores (``row_bytes``
    a row) stay under ``SCORE_CHUNK_BYTES``; ``rows`` are sliced along axis -2 where they have T rows (others, e.g.
    ``(B, 1, 1, n)``, pass whole; 1-D ``(T,)`` positions are sliced too). Rows are independent, so the choice is the
    same in one piece."""
    budget = SCORE_CHUNK_BYTES.get(torch.device(device).type, SCORE_CHUNK_BYTES["cuda"])
    size = max(1, budget // max(row_bytes, 1))
    if size >= T:
        return choose(*rows)
    def rows_of(x, a):
        if isinstance(x, torch.Tensor) and x.dim() == 1 and x.shape[0] == T:  # per-row positions
            return x[a : a + size]
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-2] == T:
            return x[..., a : a + size, :]
        return x

    picks = [choose(*(rows_of(x, a) for x in rows)) for a in range(0, T, size)]
    return torch.cat([p[0] for p in picks], -2), torch.cat([p[1] for p in picks], -2)


def top_blocks(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best blocks per row of ``scores`` ``(..., n)`` (-inf = may not be chosen).

    Returns ``(idx, ok)`` ``(..., min(k, n))``: block indices by decreasing score, ties to the lower index, and
    whether the block may be used (a finite score; rows with fewer than k choosable blocks keep the rest False).
    """
    k = min(int(k), scores.shape[-1])
    key = _order_key(scores) if 0 < k <= ARGMAX_ROUNDS else None
    if key is None:
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    else:  # k rounds of argmax (the first maximum: the lower index on ties), each pick then ranked below every key
        lowest = torch.iinfo(key.dtype).min
        picks = []
        for _ in range(k):
            pick = key.argmax(-1, keepdim=True)
            picks.append(pick)
            key.scatter_(-1, pick, lowest)
        order = torch.cat(picks, -1)
    return order, scores.gather(-1, order) > NEG_INF


# ``top_blocks`` with k up to this many: k argmax rounds over integer keys (the stable sort's first k exactly, without
# its O(n log n) sort of every row: the sort was ~10 % of moba's fwd+bwd at L = 16384)
ARGMAX_ROUNDS = 8


def _order_key(scores: torch.Tensor) -> torch.Tensor | None:
    """Integer keys ordered as the float ``scores`` (fp32 / fp64; None otherwise): the IEEE bits, negatives
    mirrored; -0.0 first made +0.0 so equal floats get equal keys. -inf keeps a key above the integer minimum."""
    if scores.dtype not in (torch.float32, torch.float64):
        return None
    itype = torch.int32 if scores.dtype == torch.float32 else torch.int64
    bits = (scores + 0.0).view(itype)
    # a negative key's value bits flipped (x ^ iinfo.max) as ~x + iinfo.min: XLA (torch_xla 2.9) failed to lower
    # int32 shifts and iinfo(int32).max (its Python integers pass through a float, where 2^31 - 1 rounds to 2^31)
    return torch.where(bits < 0, bits.bitwise_not().add_(torch.iinfo(itype).min), bits)


@contextlib.contextmanager
def scoring(x: torch.Tensor):
    """Autocast off on ``x``'s device for the selection scores (cast the inputs with ``score_dtype``); nothing to
    turn off where autocast does not exist (the meta device)."""
    if not has_autocast(x.device.type):
        yield
        return
    with torch.autocast(x.device.type, enabled=False):
        yield


def score_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for the low-precision dtypes, the input's own dtype otherwise (fp64 stays exact)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def block_table(blocks: torch.Tensor, ok: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key positions of chosen blocks: ``blocks``, ``ok`` ``(..., K)`` -> ``(idx, valid)`` ``(..., K * m)``,
    block ``b`` covering positions ``[b m, (b + 1) m)``."""
    offsets = torch.arange(block_size, device=blocks.device)
    idx = (blocks.unsqueeze(-1) * block_size + offsets).flatten(-2)
    return idx, ok.unsqueeze(-1).expand(*ok.shape, block_size).flatten(-2)


def gather_keys(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, H, L, D)`` at the positions ``idx`` ``(B|1, H|1, T, W)`` -> ``(B, H, T, W, D)``."""
    B, H = x.shape[:2]
    if idx.shape[0] == 1 and idx.shape[1] == 1:  # one table for every head: one index_select
        T, W = idx.shape[-2:]
        flat = idx.reshape(-1)
        if (flat.numel() == x.shape[2] and not static_shapes_on()  # static: no read of the table's values
                and torch.equal(flat, torch.arange(flat.numel(), device=flat.device))):
            return x.reshape(B, H, T, W, x.shape[-1])  # every position once, in order (fixed's regions): a view
        return x.index_select(2, flat).view(B, H, T, W, x.shape[-1])
    b = torch.arange(B, device=x.device).view(B, 1, 1, 1)
    h = torch.arange(H, device=x.device).view(1, H, 1, 1)
    return x[b, h, idx]


def gathered_attention(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                       valid: torch.Tensor) -> torch.Tensor:
    """One softmax per query over the keys of its own table (decoding steps: a few queries over a cache).

    qs: scaled queries ``(B, H, T, D)``; k, v: ``(B, H, N, D)``; idx, valid: ``(B|1, H|1, T, W)`` key positions and
    which of them the query may attend (every row keeps one). Returns ``(B, H, T, Dv)``. Memory O(T W D): the
    whole-sequence paths use ``grouped_attention`` instead.
    """
    logits = (gather_keys(k, idx) @ qs.unsqueeze(-1)).squeeze(-1).masked_fill(~valid, NEG_INF)
    return (logits.softmax(-1).unsqueeze(-2) @ gather_keys(v, idx)).squeeze(-2)


# -- the tiled path: (query, chosen group) pairs sorted by group, tiles of queries against one group's keys -----------
PAIR_TILE = 128  # queries per tile: one (T, Km) @ (Km, D) product per tile (fused: 128 measured 0.77x the time of 32)
# the fused path's tile sizes and their flash cost per tile row, fwd + bwd with 128 keys (CPU kernel, measured:
# 353, 420, 549 ms per 2^18 rows): it takes the size whose padded rows cost least (few queries per group: smaller)
FLASH_TILE_COST = {128: 1.0, 64: 1.19, 32: 1.55}


def safe_softmax(logits: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax weights and log-sum-exp over the last axis restricted to ``allowed``; a row without an allowed entry
    gets zero weights and lse -inf (no NaN in forward or backward)."""
    has = allowed.any(-1, keepdim=True)
    logits = logits.masked_fill(~allowed, NEG_INF).masked_fill(~has, 0.0)
    lse = torch.logsumexp(logits, -1, keepdim=True)
    weights = (logits - lse).exp().masked_fill(~has, 0.0)
    return weights, lse.squeeze(-1).masked_fill(~has.squeeze(-1), NEG_INF)


class Part(NamedTuple):
    """One part of a joint softmax, computed apart: ``out`` ``(B, H, T - start, Dv)`` and ``lse`` ``(B, H, T -
    start)`` of the queries from row ``start`` on; the rows before it have an empty part (no key)."""

    out: torch.Tensor
    lse: torch.Tensor
    start: int = 0


class Pairs(NamedTuple):
    """The (query, group) pairs of ``grouped_attention`` as one part of a joint softmax: each tile row's ``out``
    ``(P, Dv)`` and ``lse`` ``(P,)`` (-inf: a padding row), the flat ``(b, h, t)`` index of its query ``query``
    ``(P,)``, and every query's log-sum-exp over its pairs ``total`` ``(B, H, T)`` (-inf: no pair)."""

    out: torch.Tensor
    lse: torch.Tensor
    query: torch.Tensor
    total: torch.Tensor


def lse_factors(parts: list) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each part's weight in the one softmax its parts make, ``exp(lse - total)``: ``(B, H, T - start)`` for a
    ``Part``, ``(P,)`` for ``Pairs``; and the joint log-sum-exp ``total`` ``(B, H, T)``, -inf (factors 0) where every
    part is empty. Small ``(B, H, T)`` tensors only; ``weighted_sum`` applies the factors."""
    lses = torch.stack([p.total if isinstance(p, Pairs) else pad_front(p.lse.unsqueeze(-1), p.start, NEG_INF)[..., 0]
                        for p in parts], -1)  # (B, H, T, P)
    has = lses.amax(-1) > NEG_INF
    total = torch.logsumexp(lses.masked_fill(~has.unsqueeze(-1), 0.0), -1).masked_fill(~has, 0.0)
    factors = [(p.lse - total.reshape(-1)[p.query]).exp() if isinstance(p, Pairs)
               else (p.lse - total[:, :, p.start:]).exp() for p in parts]
    return factors, total.masked_fill(~has, NEG_INF)


def merge_parts(parts: list) -> Part:
    """One softmax from parts computed apart (``Part``s, ``Pairs`` or ``(out, lse)`` pairs), joined by their
    log-sum-exps: ``Part(out (B, H, T, Dv), lse (B, H, T))``; a row where every part is empty gets out 0, lse -inf."""
    parts = [p if isinstance(p, (Part, Pairs)) else Part(*p) for p in parts]
    factors, total = lse_factors(parts)
    return Part(weighted_sum([(f, p) for f, p in zip(factors, parts)], total.shape), total)


def weighted_sum(terms: list, shape: tuple[int, int, int]) -> torch.Tensor:
    """``sum_i c_i o_i`` over terms ``(c_i, part_i)``: a ``Part``'s rows ``(c (B, H, T - start), out)`` land on rows
    ``start..T``, ``Pairs`` rows ``(c (P,), out (P, Dv))`` are added into their queries. Returns ``(B, H, T, Dv)``
    (``shape`` = ``(B, H, T)``), in the promoted dtype of the terms. One pass per term forward and backward
    (``WeightedSum``): the autograd sum of products took about 2x the time (its products and sums are separate
    passes)."""
    wheres = [p.query if isinstance(p, Pairs) else p.start for _, p in terms]
    tensors = [t for c, p in terms for t in (c, p.out)]
    return WeightedSum.apply(tuple(shape), wheres, *tensors)


@autocast_function
class WeightedSum(torch.autograd.Function):
    """``weighted_sum``'s one pass per term: forward ``out[rows] += c * o`` (``addcmul_`` / ``index_add_``), backward
    ``d o = c * g[rows]`` and ``d c = g[rows] . o`` (an ``einsum`` row dot product, 5x a multiply-and-sum here)."""

    @staticmethod
    def forward(ctx, shape, wheres, *tensors):
        coefs, outs = tensors[0::2], tensors[1::2]
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors])
        out = outs[0].new_zeros(*shape, outs[0].shape[-1], dtype=dtype)
        rows = out.view(-1, out.shape[-1])
        for c, o, where in zip(coefs, outs, wheres):
            if isinstance(where, int):
                out[:, :, where:].addcmul_(c.unsqueeze(-1).to(dtype), o.to(dtype))
            else:
                rows.index_add_(0, where, o.to(dtype) * c.unsqueeze(-1).to(dtype))
        ctx.wheres = wheres
        ctx.save_for_backward(*tensors)
        return out

    @staticmethod
    def backward(ctx, grad):
        tensors = ctx.saved_tensors
        grads = []
        for i, where in enumerate(ctx.wheres):
            c, o = tensors[2 * i], tensors[2 * i + 1]
            rows = grad.reshape(-1, grad.shape[-1])
            g = grad[:, :, where:] if isinstance(where, int) else rows.index_select(0, where)
            need_c, need_o = ctx.needs_input_grad[2 + 2 * i], ctx.needs_input_grad[3 + 2 * i]
            grads.append(torch.einsum("...d,...d->...", g, o.to(g.dtype)).to(c.dtype) if need_c else None)
            grads.append((g * c.unsqueeze(-1).to(g.dtype)).to(o.dtype) if need_o else None)
        return None, None, *grads


def block_attention(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int,
                    allowed: torch.Tensor, dropout: float = 0.0, flash: FlashInputs | None = None,
                    shift: int = 0) -> Part:
    """Each query against its own block of ``block_size`` keys (batched ``(m, m)`` products, no gather), or with
    ``shift`` s > 0 the query block g against key block g - s (the rows of blocks g < s: an empty part).
    ``allowed`` ``(B|1, 1, n, m, m)`` bool (with a shift: ``(1, 1, 1, m, m)``, one mask for every block pair);
    ``flash``: the padded inputs of the CPU engine's flash calls (the dispatch chose ``cpu_flash``), else the
    explicit masked softmax. Returns the ``Part`` of rows ``s m..L``: ``out (B, H, L - s m, Dv)``, ``lse``."""
    B, H, L, D = qs.shape
    n, m = L // block_size, block_size
    rows = max(n - shift, 0)
    if flash is not None:  # the blocks as one flash call on views of the padded inputs (``FlashInputs.blocks``)
        causal, mask = False, None
        one = allowed[0, 0, 0] if allowed.shape[0] == 1 and allowed.shape[2] == 1 else None
        if one is None and allowed.shape[0] == 1 and bool((allowed == allowed[:, :, :1]).all()):
            one = allowed[0, 0, 0]  # the same mask in every block (combiner_fixed's own segment): one (m, m) mask
        if one is not None:  # causal or none, if it is
            causal = bool(torch.equal(one, torch.ones_like(one).tril()))
            mask = None if causal or bool(one.all()) else one.view(1, 1, m, m)
        q_b, k_b, v_b = (flash.blocks(name, m, first, rows) for name, first in (("q", shift), ("k", 0), ("v", 0)))
        if one is None:  # a mask per block (no shift here): laid out as the blocks are
            mask = allowed.expand(B, H, n, m, m).reshape(*q_b.shape[:2], m, m)
        out, lse = flash_lse(q_b, k_b, v_b, mask, causal)
        return Part(out.reshape(B, H, rows * m, -1), lse.reshape(B, H, rows * m), shift * m)
    later = lambda x: x[:, :, shift * m :].reshape(B, H, rows, m, x.shape[-1])  # noqa: E731
    earlier = lambda x: x[:, :, : rows * m].reshape(B, H, rows, m, x.shape[-1])  # noqa: E731
    logits = later(qs) @ earlier(k).transpose(-1, -2)
    weights, lse = safe_softmax(logits, allowed)
    if dropout:
        weights = torch.nn.functional.dropout(weights, dropout)
    out = weights.to(v.dtype) @ earlier(v)
    return Part(out.reshape(B, H, rows * m, -1), lse.reshape(B, H, rows * m), shift * m)


def sink_attention(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, width: int, start: int,
                   dropout: float = 0.0, flash: FlashInputs | None = None) -> Part:
    """The queries from position ``start`` on against the first ``width`` keys (every one allowed): their ``Part``
    (the queries before ``start`` get an empty part)."""
    if flash is not None:
        return Part(*flash_lse(flash.q[:, :, start:], flash.k[:, :, :width], flash.v[:, :, :width], None), start)
    logits = qs[:, :, start:] @ k[:, :, :width].transpose(-1, -2)
    lse = torch.logsumexp(logits, -1)
    weights = (logits - lse.unsqueeze(-1)).exp()
    if dropout:
        weights = torch.nn.functional.dropout(weights, dropout)
    return Part(weights.to(v.dtype) @ v[:, :, :width], lse, start)


def pad_front(x: torch.Tensor, rows: int, value: float) -> torch.Tensor:
    """``x`` ``(B, H, T, D)`` with ``rows`` rows of ``value`` in front (``(B, H, rows + T, D)``)."""
    return torch.nn.functional.pad(x, (0, 0, rows, 0), value=value)


def grouped_attention(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, members: torch.Tensor,
                      member_ok: torch.Tensor, chosen: torch.Tensor, ok: torch.Tensor,
                      band: tuple[int, int] | None = None, positions: torch.Tensor | None = None, dropout: float = 0.0,
                      flash: FlashInputs | None = None, tile: int | None = None) -> Pairs:
    """Each query against the members of the groups it chose (blocks, regions), one softmax over all of them, without
    a per-query copy of the keys: the (query, group) pairs are sorted by group and cut into tiles of ``tile`` queries
    that share one group, so each tile is one ``(tile, Km) @ (Km, D)`` product (MoBA's varlen trick, padded).

    Args:
        qs: scaled queries ``(B, H, T, D)``; k, v: ``(B, H, N, D)``.
        members: ``(G, Km)`` key positions of every group; member_ok ``(B|1, G, Km)`` which are real members.
        chosen, ok: ``(B, H, T, S)`` the groups of each query and which of them are used.
        band: ``(back, ahead)``: keep only members j with ``p - back <= j <= p + ahead`` for the query's position p
            (``positions`` ``(T,)``, default ``arange(T)``); ``(T, 0)`` is causal, None no limit.
        flash: the padded inputs (q, k, v of this call) of the CPU engine's flash calls (the dispatch chose
            ``cpu_flash``): the tiles as flash calls; None: explicit.
        tile: queries per tile; None: ``PAIR_TILE``, or on the fused path the cheapest of ``FLASH_TILE_COST``.
    Returns the ``Pairs`` (``merge_parts([pairs])``: ``(out (B, H, T, Dv), lse (B, H, T))``); a query without any
    allowed key gets out 0, lse -inf.
    """
    B, H, T, D = qs.shape
    S = chosen.shape[-1]
    G, Km = members.shape
    Dv = v.shape[-1]
    device = qs.device
    static = static_shapes_on()  # the xla backend: every size below from the shapes alone, no host read
    if positions is None:
        positions = torch.arange(T, device=device)
    if S == 0 or (not static and not bool(ok.any())):  # no pair: an empty part of the joint softmax
        return Pairs(v.new_zeros(0, Dv), qs.new_zeros(0), torch.zeros(0, dtype=torch.long, device=device),
                     qs.new_full((B, H, T), NEG_INF))
    with torch.no_grad():  # the tiling: index arithmetic only
        bh = torch.arange(B * H, device=device).view(B, H, 1, 1)
        group = (bh * G + chosen).flatten()  # composite (head, group) id of every pair
        n_groups = B * H * G
        if static:  # every pair; the unused ones in one extra group past the last, whose tiles are dropped
            pair = torch.arange(group.numel(), device=device)
            group = torch.where(ok.flatten(), group, n_groups)
        else:
            pair = ok.flatten().nonzero().squeeze(-1)  # used pairs, as flat (b, h, t, s) indices
            group = group[pair]
        order = torch.argsort(group, stable=True)
        pair, group = pair[order], group[order]
        counts = torch.zeros(n_groups + 1, dtype=torch.long, device=device).index_add_(
            0, group, torch.ones_like(group))  # bincount's values with a size fixed by the shapes
        if tile is None:
            tile = PAIR_TILE if flash is None else min(
                FLASH_TILE_COST, key=lambda t: FLASH_TILE_COST[t] * t * int(((counts + t - 1) // t).sum()))
        tiles = ((counts + tile - 1) // tile)[:n_groups]  # the unused pairs' group gets none
        first_tile = tiles.cumsum(0) - tiles
        rank = torch.arange(pair.numel(), device=device) - (counts.cumsum(0) - counts)[group]
        # static: every group's tiles fit in P / tile + G tiles (a group wastes less than one); the rest stay padding
        n_tiles = -(-pair.numel() // tile) + n_groups if static else int(tiles.sum())
        used = group < n_groups
        group = group.clamp(max=n_groups - 1)
        tile_of = torch.where(used, first_tile[group] + rank // tile, n_tiles)  # unused: the dropped last row
        tile_pair = torch.full((n_tiles + 1, tile), -1, dtype=torch.long, device=device)
        tile_pair[tile_of, rank % tile] = torch.where(used, pair, -1)
        tile_pair = tile_pair[:n_tiles]
        tile_group = torch.zeros(n_tiles + 1, dtype=torch.long, device=device).scatter_(
            0, tile_of, group)[:n_tiles]  # (n_tiles,): the group of its pairs (0 for a padding tile)
        row_ok = tile_pair >= 0
        query = tile_pair.clamp(min=0) // S  # flat (b, h, t)
        head, g = tile_group // G, tile_group % G
        keys_at = members[g]  # (n_tiles, Km)
        key_rows = (head.unsqueeze(-1) * k.shape[-2] + keys_at).flatten()  # rows of k as (B H N, D)
        tile_ok = member_ok[(head // H) if member_ok.shape[0] > 1 else torch.zeros_like(head), g]  # (n_tiles, Km)

        def allowed_in(which: torch.Tensor | None) -> torch.Tensor:
            """``(tiles, tile, Km)`` bool of the tiles ``which`` (None: all): real row, real member, in the band."""
            pick = (lambda x: x) if which is None else (lambda x: x[which])  # noqa: E731
            allowed = pick(tile_ok).unsqueeze(1) & pick(row_ok).unsqueeze(-1)
            if band is not None:
                offset = positions[pick(query) % T].unsqueeze(-1) - pick(keys_at).unsqueeze(1)  # p - j
                allowed = allowed & (offset <= band[0]) & (offset >= -band[1])
            return allowed

        full = None  # flash: tiles whose real rows may attend every key run without a mask (a row of padding
        if flash is not None:  # attends every key there, its result is dropped below)
            full = tile_ok.all(-1)
            if band is not None:  # the band holds the tile when its nearest and farthest (p, j) pairs are in it
                p = positions[query % T]
                p_lo = p.masked_fill(~row_ok, torch.iinfo(p.dtype).max).amin(-1)
                p_hi = p.masked_fill(~row_ok, torch.iinfo(p.dtype).min).amax(-1)
                full &= (p_hi - keys_at.amin(-1) <= band[0]) & (p_lo - keys_at.amax(-1) >= -band[1])
    # index_select: its backward is an index_add (an advanced index's is a slow accumulating index_put)
    if flash is not None:  # the tiles as the batch of flash calls, gathered from the padded inputs (``FlashLse``)
        q_p, k_p, v_p = (x.reshape(-1, D + 1) for x in flash)
        key_rows = key_rows.view(n_tiles, Km)

        # groups that are the consecutive blocks of Km keys (moba, nsa, fixed regions): a tile's keys are one block
        blocks = members.numel() == k.shape[-2] and torch.equal(members.flatten(), torch.arange(G * Km, device=device))

        def flash_tiles(which: torch.Tensor | None, mask: torch.Tensor | None):
            pick = (lambda x: x) if which is None else (lambda x: x[which])  # noqa: E731
            rows_q = pick(query)
            n = rows_q.shape[0]
            if blocks:  # whole blocks copied, not rows: (B H G, Km, D + 1) views of the inputs
                tiles = pick(tile_group)
                keys = lambda x: x.reshape(B * H * G, Km, D + 1).index_select(0, tiles).view(  # noqa: E731
                    n, 1, Km, D + 1)
            else:
                rows_k = pick(key_rows).flatten()
                keys = lambda x: x.index_select(0, rows_k).view(n, 1, Km, D + 1)  # noqa: E731
            out, lse = flash_lse(q_p.index_select(0, rows_q.flatten()).view(n, 1, tile, D + 1), keys(k_p), keys(v_p),
                                 None if mask is None else mask.unsqueeze(1))
            return out.squeeze(1), lse.squeeze(1)

        if bool(full.all()):
            out_t, lse = flash_tiles(None, None)
        else:  # nsa's selection: only the own block's tiles are cut by the causal band
            split = [full.nonzero().squeeze(-1), (~full).nonzero().squeeze(-1)]
            with torch.no_grad():
                partial = allowed_in(split[1])
            parts = [flash_tiles(which, mask) for which, mask in zip(split, (None, partial)) if which.numel()]
            order = torch.cat(split)
            tile_pair, row_ok = tile_pair[order], row_ok[order]
            out_t, lse = (torch.cat(x) for x in zip(*parts))
    else:
        with torch.no_grad():
            allowed = allowed_in(None)
        q_t = qs.reshape(B * H * T, D).index_select(0, query.flatten()).view(n_tiles, tile, D)
        k_t = k.reshape(-1, D).index_select(0, key_rows).view(n_tiles, Km, D)
        v_t = v.reshape(-1, Dv).index_select(0, key_rows).view(n_tiles, Km, Dv)
        weights, lse = safe_softmax(q_t @ k_t.transpose(-1, -2), allowed)
        if dropout:
            weights = torch.nn.functional.dropout(weights, dropout)
        out_t = weights.to(v_t.dtype) @ v_t  # (n_tiles, tile, Dv)
    return pairs_of(out_t.reshape(-1, Dv), lse.masked_fill(~row_ok, NEG_INF).flatten(), tile_pair.flatten(),
                    (B, H, T, S))


def pairs_of(out: torch.Tensor, lse: torch.Tensor, pair: torch.Tensor, shape: tuple[int, int, int, int]) -> Pairs:
    """``Pairs`` of tile rows: ``out`` ``(P, Dv)``, ``lse`` ``(P,)``, ``pair`` ``(P,)`` their flat ``(b, h, t, s)``
    index in ``shape`` = ``(B, H, T, S)`` (-1: a padding row, its lse -inf); each query's log-sum-exp over its pairs
    from an ``(B H T, S)`` table of the rows' lses (no ``(B H T S, Dv)`` buffer of pair outputs: ``weighted_sum``
    adds the rows into their queries)."""
    B, H, T, S = shape
    n_pairs = B * H * T * S
    slot = pair.masked_fill(pair < 0, n_pairs)  # padding rows land in one extra slot, dropped
    lse_pairs = lse.new_full((n_pairs + 1,), NEG_INF).index_copy(0, slot, lse)[:n_pairs].view(B, H, T, S)
    has = lse_pairs.amax(-1) > NEG_INF
    total = torch.logsumexp(lse_pairs.masked_fill(~has.unsqueeze(-1), 0.0), -1).masked_fill(~has, NEG_INF)
    return Pairs(out, lse, slot.clamp(max=n_pairs - 1) // S, total)
