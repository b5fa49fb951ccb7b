"""The 2025 successors (issue 24): ``moba``, ``combiner_select``, ``nsa``, and their limits.

The registry-wide files (contract, padding, decoding, autocast) cover every variant's contract; this file checks
what each one is: the limits (k = 0, k covering every block, window = L) equal the variants they reduce to, and
the selection is the documented rule, on tiny fp64 inputs.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_key_padding_outcomes,
    assert_output_matches_matrix,
    build,
    check_decoding,
    dense_masked_attention,
    padding_masks,
    random_qkv,
)

from longseq.attention import AttentionConfigError
from longseq.attention.ops import block_select
from longseq.attention.ops.masks import full_mask

L32, M = 32, 4  # 8 blocks of 4: selection has real choices


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# -- moba -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
def test_moba_top_k_covering_every_block_is_full_attention(causal):
    attn = build("moba", causal, seq_len=L32, block_size=M, top_k=L32 // M).double().eval()
    q, k, v = random_qkv(L=L32)
    expected = dense_masked_attention(q, k, v, full_mask(L32, causal))
    torch.testing.assert_close(attn(q, k, v), expected, atol=1e-10, rtol=0)
    assert_output_matches_matrix(attn, q, k, v)


@pytest.mark.parametrize("causal", [True, False])
def test_moba_top_k_zero_is_block_local_attention(causal):
    attn = build("moba", causal, seq_len=L32, block_size=M, top_k=0).double().eval()
    q, k, v = random_qkv(L=L32)
    block = torch.arange(L32) // M
    allowed = (block[:, None] == block[None, :]) & full_mask(L32, causal)
    torch.testing.assert_close(attn(q, k, v), dense_masked_attention(q, k, v, allowed), atol=1e-10, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_moba_keeps_the_blocks_whose_mean_key_scores_highest(causal):
    """Support = own block (causal: up to self) + exactly the top_k blocks by q . mean(k), chosen among the
    earlier (causal) or other blocks; forward applies exactly those weights."""
    top_k = 2
    attn = build("moba", causal, seq_len=L32, block_size=M, top_k=top_k).double().eval()
    q, k, v = random_qkv(B=1, H=2, L=L32)
    P = attn.attention_matrix(q, k, v)
    assert_output_matches_matrix(attn, q, k, v)
    means = k.view(1, 2, L32 // M, M, 8).mean(-2)
    for h in range(2):
        for i in range(L32):
            g = i // M
            scores = q[0, h, i] @ means[0, h].T
            candidates = [b for b in range(L32 // M) if (b < g if causal else b != g)]
            best = sorted(candidates, key=lambda b: -scores[b].item())[:top_k]
            expected = torch.zeros(L32, dtype=torch.bool)
            expected[g * M : (i + 1 if causal else (g + 1) * M)] = True
            for b in best:
                expected[b * M : (b + 1) * M] = True
            assert torch.equal(P[0, h, i] > 0, expected), (h, i)


@pytest.mark.parametrize("band", [None, (5, 0), (2, 3)])
def test_grouped_attention_equals_a_dense_softmax_over_the_chosen_groups(band):
    """Tiles of queries sharing a group (tile 3: groups chosen by up to 32 queries span several tiles) give one softmax
    over the chosen groups' real members within the band, outputs and gradients; a query with nothing allowed
    gets 0 and lse -inf without NaN."""
    B, H, T, D, G, Km = 2, 2, 12, 8, 5, 3
    g = torch.Generator().manual_seed(2)
    members = torch.randperm(G * Km, generator=g).view(G, Km)  # groups need not be contiguous
    member_ok = torch.rand(B, G, Km, generator=g) < 0.8
    chosen = torch.rand(B, H, T, G, generator=g).argsort(-1)[..., :2]  # two distinct groups, as top_blocks gives
    ok = torch.rand(B, H, T, 2, generator=g) < 0.8
    ok[0, 0, 0] = False  # nothing chosen
    q, k, v = random_qkv(B=B, H=H, L=G * Km, D=D, requires_grad=True)
    qs = q[:, :, :T]
    pairs = block_select.grouped_attention(qs, k, v, members, member_ok, chosen, ok, band, tile=3)
    out, lse, _ = block_select.merge_parts([pairs])
    allowed = torch.zeros(B, H, T, G * Km, dtype=torch.bool)
    for b, h, t, s in ok.nonzero().tolist():
        group = chosen[b, h, t, s]
        allowed[b, h, t, members[group][member_ok[b, group]]] = True
    if band is not None:
        offset = torch.arange(T).view(T, 1) - torch.arange(G * Km).view(1, -1)
        allowed &= (offset <= band[0]) & (offset >= -band[1])
    has = allowed.any(-1)
    logits = (qs @ k.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
    expected = torch.where(has.unsqueeze(-1), logits.softmax(-1).nan_to_num(0.0) @ v, torch.zeros(()))
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse[has], torch.logsumexp(logits, -1)[has], atol=1e-12, rtol=0)
    assert (lse[~has] == float("-inf")).all() and (~has).any()
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for grad, reference in zip(grads, expected_grads):
        assert torch.isfinite(grad).all()
        torch.testing.assert_close(grad, reference, atol=1e-12, rtol=0)


def test_merge_parts_of_row_ranges_and_pairs_is_one_softmax_over_their_keys():
    """Parts on row ranges (``Part.start``) and tile rows added into their queries (``Pairs``) merge into the one
    softmax over the union of their keys, outputs, log-sum-exps and gradients (``WeightedSum``'s own backward); a
    row that no part reaches gets 0 and lse -inf."""
    B, H, T, N, D = 1, 2, 6, 9, 4
    q, k, v = random_qkv(B=B, H=H, L=N, D=D, requires_grad=True)
    qs = q[:, :, :T]
    logits = qs @ k.transpose(-1, -2)

    def part(keys: slice, start: int) -> block_select.Part:
        x = logits[:, :, start:, keys]
        lse = torch.logsumexp(x, -1)
        return block_select.Part((x - lse.unsqueeze(-1)).exp() @ v[:, :, keys], lse, start)

    rows = torch.tensor([2, 4, 4, 7, 10])  # flat (h, t) queries of five tile rows; query 4 has two, one of them empty
    keys = torch.tensor([6, 7, 8, 6, 8])
    row_logits = logits.reshape(H * T, N)[rows, keys]
    row_lse = row_logits.masked_fill(torch.tensor([False, False, True, False, False]), float("-inf"))
    # each query has at most one used row here, so its log-sum-exp over its rows is their max
    total = torch.full((H * T,), float("-inf"), dtype=torch.float64).index_reduce(0, rows, row_lse, "amax")
    pairs = block_select.Pairs(v.reshape(H, N, D)[rows // T, keys], row_lse, rows, total.view(B, H, T))
    out, lse, start = block_select.merge_parts([part(slice(0, 3), 2), part(slice(3, 6), 3), pairs])

    allowed = torch.zeros(B, H, T, N, dtype=torch.bool)
    allowed[:, :, 2:, 0:3] = True
    allowed[:, :, 3:, 3:6] = True
    for r, key, used in zip(rows.tolist(), keys.tolist(), row_lse.isfinite().tolist()):
        allowed[0, r // T, r % T, key] |= used
    has = allowed.any(-1)
    masked = logits.masked_fill(~allowed, float("-inf"))
    expected = torch.where(has.unsqueeze(-1), masked.softmax(-1).nan_to_num(0.0) @ v, torch.zeros(()))
    assert start == 0 and (~has).any()
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse[has], torch.logsumexp(masked, -1)[has], atol=1e-12, rtol=0)
    assert (lse[~has] == float("-inf")).all()
    weight = torch.randn_like(out)
    grads = torch.autograd.grad((out * weight).sum() + lse[has].sum(), (q, k, v), retain_graph=True)
    expected_grads = torch.autograd.grad((expected * weight).sum() + torch.logsumexp(masked, -1)[has].sum(), (q, k, v))
    for grad, reference in zip(grads, expected_grads):
        torch.testing.assert_close(grad, reference, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_blocks_is_the_stable_sort_with_ties_infinities_and_signed_zeros(dtype):
    """Small k (argmax rounds) and large k (sort) both return the stable descending sort's first k: ties to the
    lower index, +inf (forced) first, -inf (unchoosable) last and not ok, -0.0 tied with +0.0."""
    g = torch.Generator().manual_seed(3)
    values = torch.tensor([float("-inf"), -1.0, -0.0, 0.0, 0.5, 1.0, float("inf")], dtype=dtype)
    scores = values[torch.randint(0, len(values), (4, 6, 11), generator=g)]
    for k in range(0, 13):
        expected = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., : min(k, 11)]
        idx, ok = block_select.top_blocks(scores, k)
        assert torch.equal(idx, expected)
        assert torch.equal(ok, scores.gather(-1, expected) > float("-inf"))


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", ["moba", "nsa", "nsa_one_block_window", "combiner_select"])
def test_fused_cpu_path_equals_the_explicit_path(name, causal, padded):
    """The fused CPU flash path of ``block_attention`` / ``grouped_attention`` (``FlashLse``: its log-sum-exp
    differentiable, so the parts merge exactly; ``attention.backend=cpu_flash``, which ``auto`` picks on CPU) gives
    the explicit masked-softmax path's outputs and gradients, with and without key padding."""
    knobs = {"nsa": {"compress_block": M, "window": 6, "select_blocks": 4},
             "nsa_one_block_window": {"compress_block": M, "window": M, "select_blocks": 4}}.get(name, {})
    attn = build(name.removesuffix("_one_block_window"), causal, seq_len=L32, block_size=M, **knobs).double().eval()
    q, k, v = random_qkv(B=3, L=L32, requires_grad=True)
    pad = padding_masks(L32) if padded else None
    grad = torch.randn(3, 2, L32, 8, dtype=torch.float64)

    def run(backend):
        attn.backend, attn.backends_used = backend, {}
        out = attn(q, k, v, key_padding_mask=pad)
        assert attn.backends_used.keys() == {backend}
        return (out, *torch.autograd.grad((out * grad).sum(), (q, k, v)))

    for got, expected in zip(run("cpu_flash"), run("explicit")):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)


# -- combiner_select -------------------------------------------------------------------------------------------
SELECT_CASES = [(p, c) for p in ("fixed", "axial_vertical", "axial_horizontal") for c in (True, False)]
PLAIN = {"fixed": "combiner_fixed", "axial_vertical": "combiner_axial_vertical",
         "axial_horizontal": "combiner_axial_horizontal"}


@pytest.mark.parametrize("partition,causal", SELECT_CASES)
def test_combiner_select_top_k_zero_is_the_plain_combiner(partition, causal):
    """k = 0: the plain variant's weights and output exactly, through ``forward`` and through the selection path."""
    attn = build("combiner_select", causal, seq_len=L32, block_size=M, partition=partition, top_k=0).double().eval()
    plain = build(PLAIN[partition], causal, seq_len=L32, block_size=M).double().eval()
    q, k, v = random_qkv(L=L32)
    torch.testing.assert_close(attn(q, k, v), plain(q, k, v), atol=0, rtol=0)
    torch.testing.assert_close(attn.selected_forward(q, k, v), plain(q, k, v), atol=1e-12, rtol=0)
    torch.testing.assert_close(attn.attention_matrix(q, k, v), plain.attention_matrix(q, k, v), atol=1e-12, rtol=0)


@pytest.mark.parametrize("partition,causal", SELECT_CASES)
def test_combiner_select_top_k_covering_every_region_is_full_attention(partition, causal):
    attn = build("combiner_select", causal, seq_len=L32, block_size=M, partition=partition, top_k=L32).double().eval()
    q, k, v = random_qkv(L=L32)
    expected = dense_masked_attention(q, k, v, full_mask(L32, causal))
    torch.testing.assert_close(attn(q, k, v), expected, atol=1e-10, rtol=0)
    torch.testing.assert_close(attn.attention_matrix(q, k, v) @ v, expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("partition,causal", SELECT_CASES)
def test_combiner_select_replaces_the_best_regions_and_keeps_full_support(partition, causal):
    """With real choices (top_k = 2 of up to 7 regions): forward == matrix, full support, and exactly the chosen
    regions lose the rank-one (query-independent) shape: a chosen region's weights are the query's own softmax."""
    attn = build("combiner_select", causal, seq_len=L32, block_size=M, partition=partition, top_k=2).double().eval()
    plain = build(PLAIN[partition], causal, seq_len=L32, block_size=M).double().eval()
    q, k, v = random_qkv(B=1, L=L32)
    assert_output_matches_matrix(attn, q, k, v)
    P, P0 = attn.attention_matrix(q, k, v), plain.attention_matrix(q, k, v)
    assert ((P > 0) == (P0 > 0)).all(), "selection changed the support"
    assert not torch.allclose(P, P0)
    part = attn.partition(L32)
    k_bar = attn.inner.summary.pool_region_keys(k, part.members)  # (1, H, R, D)
    scores = (attn.scale(q) @ k_bar.transpose(-1, -2)).masked_fill(~part.usable, float("-inf"))
    for h in range(2):
        for i in range(L32):
            usable = part.usable[i].nonzero().flatten().tolist()
            best = sorted(usable, key=lambda r: -scores[0, h, i, r].item())[:2]
            for r in best:  # inside a chosen region the weights follow exp(q . k_j)
                cols = part.members[r]
                expected = (attn.scale(q)[0, h, i] @ k[0, h, cols].T).softmax(-1) * P[0, h, i, cols].sum()
                torch.testing.assert_close(P[0, h, i, cols], expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("partition", ["axial_vertical", "axial_horizontal"])
def test_combiner_select_decodes_other_partitions(partition):
    check_decoding("combiner_select", {"partition": partition}, prefix=13, L=64, block_size=8)


@pytest.mark.parametrize("partition,causal", [("axial_vertical", True), ("axial_horizontal", False)])
def test_combiner_select_key_padding_on_other_partitions(partition, causal):
    attn = build("combiner_select", causal, partition=partition).double().eval()
    q, k, v = random_qkv(B=3, L=16)
    assert_key_padding_outcomes(attn, q, k, v, padding_masks(), full_support=True)


@pytest.mark.parametrize("overrides,expected", [
    ([], ("combiner_fixed", 8)),
    (["partition=axial_vertical"], ("combiner_axial_vertical", 8)),
    (["partition=axial_horizontal", "partition.block_size=4"], ("combiner_axial_horizontal", 4)),
    (["attention.partition=axial_vertical"], ("combiner_axial_vertical", 8)),
])
def test_combiner_select_composes_with_the_partition_group(make_cfg, overrides, expected):
    """``attention=combiner_select partition=<p>`` selects over that Combiner partition, as ``attention=combiner``."""
    from longseq.runner import build_module

    cfg = make_cfg(["attention=combiner_select", *overrides])
    inner = build_module(cfg).net.blocks[0].attn.attention.inner
    assert (inner.name, inner.block_size) == expected


def test_combiner_select_rejects_partitions_without_a_select_variant():
    with pytest.raises(AttentionConfigError, match=r"attention.partition='routing'.*valid: \['fixed'"):
        build("combiner_select", True, partition="routing")
    built = build("combiner_select", True, partition={"name": "axial_horizontal", "horizontal_regions": "split"})
    assert built.inner.name == "combiner_axial_horizontal" and built.inner.horizontal_regions == "split"


# -- nsa ------------------------------------------------------------------------------------------------------
NSA = {"seq_len": L32, "block_size": M, "compress_block": M, "compress_stride": M // 2, "select_blocks": 4,
       "local_blocks": 2, "window": M}


def nsa(causal: bool, **knobs):
    return build("nsa", causal, **{**NSA, **knobs}).double().eval()


@pytest.mark.parametrize("causal", [True, False])
def test_nsa_selecting_every_block_and_a_window_of_L_are_full_attention(causal):
    attn = nsa(causal, select_blocks=L32 // M, window=2 * L32)
    q, k, v = random_qkv(L=L32)
    _, _, p_sel, p_win = attn.branch_matrices(q, k)
    full = dense_masked_attention(q, k, torch.eye(L32, dtype=q.dtype).expand(2, 2, L32, L32), full_mask(L32, causal))
    torch.testing.assert_close(p_sel, full, atol=1e-12, rtol=0)
    torch.testing.assert_close(p_win, full, atol=1e-12, rtol=0)
    assert_output_matches_matrix(attn, q, k, v)


@pytest.mark.parametrize("knobs", [{}, {"compress": "mlp"}, {"gates": "sigmoid"}, {"compress_stride": 1},
                                   {"window": M}, {"window": M, "local_blocks": 3, "select_blocks": 5}],
                         ids=["mean", "mlp", "sigmoid", "stride1", "window_one_block", "three_local_blocks"])
@pytest.mark.parametrize("causal", [True, False])
def test_nsa_forward_applies_its_matrix_with_real_choices(causal, knobs):
    """8 selection blocks, n = 4 (first + 2 local + 1 chosen): ``forward == attention_matrix @ v`` for both
    compressions (the learned key map keeps the matrix exact) and both gate kinds; rows sum to one iff normalized."""
    attn = nsa(causal, **knobs)
    assert attn.matrix_is_exact
    q, k, v = random_qkv(L=L32)
    assert_output_matches_matrix(attn, q, k, v)
    rows = attn.attention_matrix(q, k, v).sum(-1)
    assert torch.allclose(rows, torch.ones_like(rows)) == (knobs.get("gates", "normalized") == "normalized")


@pytest.mark.parametrize("l,d,m", [(128, 64, 128), (32, 16, 64), (8, 8, 8), (12, 4, 8), (6, 3, 9), (6, 4, 8)])
def test_nsa_importance_is_the_product_with_the_overlap_matrix(l, d, m):
    """The strided sums of ``importance`` (the stride dividing both block lengths) and its fallback equal the
    compression probabilities times the dense (C, S) overlap matrix, with zero columns past C (the scoring pads)."""
    L = 8 * m
    attn = build("nsa", True, seq_len=L, block_size=m, compress_block=l, compress_stride=d, select_blocks=4, window=m)
    C, S = attn.n_compressed(L), L // m
    probs = torch.nn.functional.pad(torch.rand(2, 3, 5, C, dtype=torch.float64), (0, 3))
    expected = probs @ attn.overlap(C + 3, S, probs.device).double()
    torch.testing.assert_close(attn.importance(probs, S), expected, atol=0, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_nsa_scores_in_row_chunks_choose_the_same_blocks(causal, monkeypatch):
    """``choose`` scores the query rows in chunks under ``SCORE_CHUNK_BYTES`` (``ops.block_select``): the same blocks
    and flags as all rows at once (chunks of a few rows here), with and without padding's occupied blocks."""
    from longseq.attention.ops import block_select

    attn = nsa(causal)
    q, k, _ = random_qkv(B=2, L=L32)
    qs, k_c = attn.scale(q), attn.mean_pool(k, attn.n_compressed(L32))
    pos = torch.arange(L32)
    allowed = attn.compressed_allowed(pos, k_c.shape[-2]).view(1, 1, L32, -1)
    occupied = torch.rand(2, 1, 1, L32 // M, generator=torch.Generator().manual_seed(1)) > 0.3
    everywhere = torch.ones(1, 1, 1, k_c.shape[-2], dtype=torch.bool)  # one row broadcast over the queries
    for blocks, usable in ((None, allowed), (occupied, allowed), (None, everywhere)):
        whole = attn.choose(qs, k_c, usable, pos, L32 // M, blocks)
        monkeypatch.setitem(block_select.SCORE_CHUNK_BYTES, "cpu", 5 * 2 * 2 * (k_c.shape[-2] + 8) * 4)  # 5 rows
        chunked = attn.choose(qs, k_c, usable, pos, L32 // M, blocks)
        monkeypatch.undo()
        assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


def test_nsa_selection_keeps_the_first_the_local_and_the_most_important_blocks():
    """Causal: importance of block s = compression probabilities of the compression blocks overlapping it; the
    query keeps block 0, its own and the previous block, and the best remaining one."""
    attn = nsa(True)
    q, k, v = random_qkv(B=1, L=L32)
    _, p_cmp, p_sel, _ = attn.branch_matrices(q, k)
    qs = attn.scale(q)
    l, d = M, M // 2
    C = (L32 - l) // d + 1
    k_c = torch.stack([k[..., c * d : c * d + l, :].mean(-2) for c in range(C)], -2)  # (1, H, C, D)
    for h in range(2):
        for i in (13, 22, 31):
            usable = [c for c in range(C) if c * d + l - 1 <= i]
            probs = (qs[0, h, i] @ k_c[0, h, usable].T).softmax(-1)
            importance = torch.zeros(L32 // M, dtype=q.dtype)
            for p, c in zip(probs, usable):
                for s in range(L32 // M):
                    if c * d < (s + 1) * M and s * M < c * d + l:
                        importance[s] += p
            g = i // M
            free = [s for s in range(1, g - 1)]
            best = max(free, key=lambda s: importance[s].item())
            expected = torch.zeros(L32, dtype=torch.bool)
            for s in (0, g - 1, best):
                expected[s * M : (s + 1) * M] = True
            expected[g * M : i + 1] = True
            assert torch.equal(p_sel[0, h, i] > 0, expected), (h, i)
            # the compression branch spreads each pooled token's weight evenly over its block
            pooled = torch.zeros(L32, dtype=q.dtype)
            for p, c in zip(probs, usable):
                pooled[c * d : c * d + l] += p / l
            torch.testing.assert_close(p_cmp[0, h, i], pooled, atol=1e-12, rtol=0)


@pytest.mark.parametrize("knobs", [{"compress": "mlp"}, {"gates": "sigmoid", "compress_stride": 1}])
def test_nsa_decodes_its_other_knobs(knobs):
    check_decoding("nsa", {"compress_block": 8, "compress_stride": 4, "select_blocks": 4, "local_blocks": 2,
                           "window": 8, **knobs}, prefix=13, L=64, block_size=8)


@pytest.mark.parametrize("causal", [True, False])
def test_nsa_mlp_compression_under_key_padding(causal):
    attn = nsa(causal, seq_len=16, compress="mlp")
    q, k, v = random_qkv(B=3, L=16)
    assert_key_padding_outcomes(attn, q, k, v, padding_masks(), full_support=False)


def test_nsa_learned_parts_receive_gradients():
    attn = nsa(True, compress="mlp").train()
    q, k, v = random_qkv(B=1, L=L32, requires_grad=True)
    attn(q, k, v).square().sum().backward()
    for name, p in attn.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("knobs,message", [
    ({"select_blocks": 2}, r"attention.select_blocks=2 cannot hold .* choose at least 3"),
    ({"compress": "conv"}, r"attention.compress='conv' is not valid"),
    ({"compress_stride": 8}, r"attention.compress_stride=8 exceeds attention.compress_block=4"),
    ({"gates": "softmax"}, r"attention.gates='softmax' is not valid"),
])
def test_nsa_rejects_impossible_knobs_naming_them(knobs, message):
    with pytest.raises(AttentionConfigError, match=message):
        nsa(True, **knobs)


# -- rotary positions (model.pos_emb=rotary) ----------------------------------------------------------------------
def rotary_model(name: str, **knobs):
    """A one-layer fp64 transformer with rotary positions over attention ``name`` (its YAML on a 16-token task)."""
    from conftest import CONF
    from omegaconf import OmegaConf

    from longseq.models.transformer import Transformer

    task = {"causal": True, "seq_len": 16, "block_size": 4, "n_clusters": 4}
    root = OmegaConf.create({"task": task, "attention": OmegaConf.load(CONF / "attention" / f"{name}.yaml"),
                             "partition": {"name": "fixed", "block_size": 4}})
    spec = {**OmegaConf.to_container(root.attention, resolve=True), "causal": True, **knobs}
    return Transformer(vocab_size=11, seq_len=16, n_layers=1, d_model=16, n_heads=2, attention=spec,
                       pos_emb="rotary").double().eval()


def test_rotary_logits_depend_on_the_offset_only():
    from longseq.models.transformer import Rotary

    rotary = Rotary(8, 32).double()
    q, k = random_qkv(B=1, H=1, L=1, D=8)[:2]

    def dot(i, j):
        return (rotary(q.expand(1, 1, 32, 8))[..., i, :] * rotary(k.expand(1, 1, 32, 8))[..., j, :]).sum()
    torch.testing.assert_close(dot(9, 4), dot(25, 20), atol=1e-6, rtol=0)  # the angle tables are fp32
    assert not torch.allclose(dot(9, 4), dot(9, 5))


def causal_names() -> list[str]:
    from longseq.attention import ATTENTION_REGISTRY

    return sorted(n for n in ATTENTION_REGISTRY if ATTENTION_REGISTRY[n].cls.supports_causal)


@pytest.mark.parametrize("name", causal_names())
def test_rotary_composes_with_every_attention_and_rotates_q_and_k_before_it(name):
    model = rotary_model(name)
    seen = {}
    attn = model.blocks[0].attn
    attn.attention.register_forward_pre_hook(lambda module, args: seen.update(q=args[0], k=args[1]))
    tokens = torch.randint(0, 11, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens)
        plain = model.blocks[0].norm1(model.token(tokens))  # rotary adds nothing to the embeddings
        q, k, _ = attn.qkv(plain).view(2, 16, 3, 2, 8).permute(2, 0, 3, 1, 4)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(seen["q"], attn.rotary(q), atol=1e-12, rtol=0)
    torch.testing.assert_close(seen["k"], attn.rotary(k), atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", ["full", "moba", "nsa", "combiner_select", "combiner_fixed"])
def test_rotary_decoding_equals_forward(name):
    """Prefill + steps rotate each new position by its own index: logits equal ``forward``'s."""
    model = rotary_model(name)
    tokens = torch.randint(0, 11, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(tokens)
        state = model.new_decoding_state(2)
        out = [model.prefill(tokens[:, :5], state)] + [model.step(tokens[:, t], state)[:, None] for t in range(5, 16)]
    torch.testing.assert_close(torch.cat(out, 1), expected, atol=1e-9, rtol=0)


def test_rotary_needs_an_even_head_width():
    from longseq.models.transformer import Transformer
    from longseq.utils.errors import ConfigError

    with pytest.raises(ConfigError, match="model.pos_emb.*even head width"):
        Transformer(vocab_size=11, seq_len=16, n_layers=1, d_model=6, n_heads=2, attention={"name": "full", "causal": True},
                    pos_emb="rotary")
