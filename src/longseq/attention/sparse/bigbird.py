"""BigBird (Zaheer et al. 2020) block-sparse attention, ITC form: window, global and seeded random blocks."""

from __future__ import annotations

import torch

from longseq.attention.base import AttentionConfigError, check_int_knob
from longseq.attention.ops.flex.calls import FlexCall
from longseq.attention.ops.geometry import BlockGrid
from longseq.attention.registry import register_attention
from longseq.attention.sparse.base import SparseAttention


@register_attention("bigbird")
class BigBirdAttention(BlockGrid, SparseAttention):
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
        super().__init__(causal=causal, block_size=block_size, **base)
        self.global_blocks = check_int_knob(global_blocks, "attention.global_blocks", minimum=0)
        self.random_blocks = check_int_knob(random_blocks, "attention.random_blocks", minimum=0)
        self.seed = int(seed)
        self._random_host = None  # the host copy of ``random_table``: tables are built from it, never a device read
        if self.seq_len:
            self._random_host = self.draw_random_blocks(self.grid(self.seq_len).n_rows)
            self.register_buffer("random_table", self._random_host.clone())

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "random_table" in state_dict:
            self._random_host = state_dict[prefix + "random_table"].detach().to("cpu", copy=True)

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
        table = self._random_host
        if table is not None and table.shape[1] == n:
            return table
        return self.draw_random_blocks(n)

    def flex_calls(self, length: int, device: torch.device) -> list[FlexCall]:
        grid = self.grid(length)
        n, size = grid.n_rows, grid.n_cols
        a, c = torch.arange(n).view(n, 1), torch.arange(n).view(1, n)
        glob = self.global_block_ids(n)
        allowed = ((a - c).abs() <= 1) | torch.isin(a, glob) | torch.isin(c, glob)  # (n, n) block table
        rand = self.random_blocks_for(n).cpu()  # (H', n, r)
        hit = (rand.unsqueeze(-1) == torch.arange(n).view(1, 1, 1, n)).any(2)
        blocks = (allowed | hit).to(device)  # (H', n, n): query block a may attend key block c
        heads = blocks.shape[0]

        def direct(b, h, q, kv):
            return blocks[h if heads > 1 else 0, q // size, kv // size]

        return [FlexCall(direct, heads=heads)]

    def pattern(self, length: int) -> torch.Tensor:
        n = self.grid(length).n_rows
        a, c = torch.arange(n).view(n, 1), torch.arange(n).view(1, n)
        glob = self.global_block_ids(n)
        allowed = ((a - c).abs() <= 1) | torch.isin(a, glob) | torch.isin(c, glob)  # (n, n)
        rand = self.random_blocks_for(n).cpu()  # (H, n, r)
        hit = (rand.unsqueeze(-1) == torch.arange(n).view(1, 1, 1, n)).any(2)  # (H, n, n)
        blocks = allowed | hit
        return blocks.repeat_interleave(self.block_size, 1).repeat_interleave(self.block_size, 2)

    def forward(self, q, k, v):
        B, H, L, D = q.shape
        grid = self.grid(L)
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
