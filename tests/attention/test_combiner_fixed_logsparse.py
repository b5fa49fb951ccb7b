"""Combiner-Fixed and Combiner-Logsparse: partitions, the attention contract, summaries, gradients."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from helpers import (
    assert_causal_perturbation,
    assert_clean_partition,
    assert_combiner_key_padding,
    assert_no_future,
    assert_output_matches_matrix,
    assert_padded_gradients,
    assert_region_rank_one,
    assert_rows_sum_to_one,
    assert_support,
    dense_masked_attention,
    matrix_from_forward,
    padding_patterns,
    random_qkv,
)

from longseq.attention import AttentionConfigError, build_attention
from longseq.attention.combiner.summary import SUMMARY_KINDS
from longseq.attention.ops.geometry import num_log_levels
from longseq.attention.ops.log_levels import summarized_blocks

CONF = Path(__file__).resolve().parents[2] / "conf" / "attention"


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors gain nothing from threads, and on a shared 2-core box thread handoffs dominate."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

# (variant, L, block_size) — edges: m = 1, m = L (one segment), L = 1, L = 2^k + 1 for logsparse
# (40, 2): 20 segments, more than SUMMARY_CHUNKS, so the causal summary chunks hold several segments each
FIXED_SIZES = [(16, 4), (16, 1), (16, 16), (12, 3), (1, 1), (6, 2), (40, 2)]
LOGSPARSE_SIZES = [1, 2, 3, 9, 12, 16, 17, 31]
CASES = [("combiner_fixed", L, m) for L, m in FIXED_SIZES] + [("combiner_logsparse", L, None) for L in LOGSPARSE_SIZES]


def build(name, causal, block_size=None, summary="max", head_dim=8):
    kw = {"block_size": block_size} if name == "combiner_fixed" else {}
    return build_attention(name, causal=causal, summary=summary, head_dim=head_dim, **kw).double().eval()


def allowed_keys(L, causal):
    full = torch.ones(L, L, dtype=torch.bool)
    return full.tril() if causal else full


def sets_of(attn, L, query):
    """(direct keys, sorted list of region key-sets) that ``query`` uses, as plain Python sets."""
    part = attn.partition(L)
    direct, regions, region_allowed = part.direct, part.members, part.usable
    direct_keys = set(direct[query].nonzero().flatten().tolist())
    used = [frozenset(regions[r].nonzero().flatten().tolist()) for r in region_allowed[query].nonzero().flatten()]
    return direct_keys, sorted(used, key=min)


def span(a, b):
    return frozenset(range(a, b))


# -- hand-enumerated partitions (L = 16) --------------------------------------------------------------

HAND = [
    # Combiner-Fixed, m = 4: segments {0..3}, {4..7}, {8..11}, {12..15}
    ("combiner_fixed", True, 16, 0, {0}, []),
    ("combiner_fixed", True, 16, 6, {4, 5, 6}, [span(0, 4)]),
    ("combiner_fixed", True, 16, 15, {12, 13, 14, 15}, [span(0, 4), span(4, 8), span(8, 12)]),
    ("combiner_fixed", False, 16, 0, {0, 1, 2, 3}, [span(4, 8), span(8, 12), span(12, 16)]),
    ("combiner_fixed", False, 16, 6, {4, 5, 6, 7}, [span(0, 4), span(8, 12), span(12, 16)]),
    # Combiner-Logsparse causal: self, raw previous token when p is odd, Fenwick blocks of [0, p)
    ("combiner_logsparse", True, 16, 0, {0}, []),
    ("combiner_logsparse", True, 16, 6, {6}, [span(0, 4), span(4, 6)]),  # 110b
    ("combiner_logsparse", True, 16, 8, {8}, [span(0, 8)]),  # 1000b
    ("combiner_logsparse", True, 16, 13, {12, 13}, [span(0, 8), span(8, 12)]),  # 1101b
    ("combiner_logsparse", True, 16, 15, {14, 15}, [span(0, 8), span(8, 12), span(12, 14)]),  # 1111b
    # bidirectional: the future (p, 16) is the mirror image (tiling of the reversed sequence)
    ("combiner_logsparse", False, 16, 0, {0, 1}, [span(2, 4), span(4, 8), span(8, 16)]),
    ("combiner_logsparse", False, 16, 7, {6, 7}, [span(0, 4), span(4, 6), span(8, 16)]),
    ("combiner_logsparse", False, 16, 13, {12, 13}, [span(0, 8), span(8, 12), span(14, 16)]),
    # L = 2^k + 1: the official code loses the top level here (the last query would see only itself)
    ("combiner_logsparse", True, 9, 8, {8}, [span(0, 8)]),
    ("combiner_logsparse", True, 17, 16, {16}, [span(0, 16)]),
    ("combiner_logsparse", False, 9, 0, {0}, [span(1, 9)]),
    # non power of two: mirrored future blocks are aligned to the end of the sequence
    # (p = 2: mirrored position 9 = 1001b -> raw next token 3 and the block {4..11})
    ("combiner_logsparse", False, 12, 2, {2, 3}, [span(0, 2), span(4, 12)]),
]


@pytest.mark.parametrize("name,causal,L,query,direct,regions", HAND)
def test_partition_matches_hand_enumeration(name, causal, L, query, direct, regions):
    attn = build(name, causal, block_size=4 if name == "combiner_fixed" else None)
    got_direct, got_regions = sets_of(attn, L, query)
    assert got_direct == direct
    assert got_regions == sorted(regions, key=min)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name,L,m", CASES + [("combiner_logsparse", L, None) for L in (5, 33, 48, 64)])
def test_partition_is_clean(name, L, m, causal):
    """Direct keys plus the allowed regions cover every allowed key exactly once; no empty region."""
    part = build(name, causal, m).partition(L)
    assert_clean_partition(part.direct, part.members, part.usable, causal=causal)


# -- the attention contract ------------------------------------------------------------------------


@pytest.mark.parametrize("summary", SUMMARY_KINDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name,L,m", CASES)
def test_contract(name, L, m, causal, summary):
    attn = build(name, causal, m, summary=summary)
    q, k, v = random_qkv(B=2, H=2, L=L, D=8, seed=L)
    P = attn.attention_matrix(q, k, v)
    assert P.shape == (2, 2, L, L)
    assert_rows_sum_to_one(P)
    if causal and L > 1:
        assert_no_future(P)
    assert_support(P, allowed_keys(L, causal))  # full support: every allowed key gets weight > 0
    assert_output_matches_matrix(attn, q, k, v)
    # the weights the fast path applies (one-hot values) equal the independently built matrix
    torch.testing.assert_close(matrix_from_forward(attn, q, k), P, atol=1e-10, rtol=0)


@pytest.mark.parametrize("summary", ["max", "deepsets_mean"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name,L,m", [("combiner_fixed", 16, 4), ("combiner_fixed", 12, 2), ("combiner_logsparse", 16, None), ("combiner_logsparse", 13, None)])
def test_region_weights_are_rank_one(name, L, m, causal, summary):
    """§3.3: inside a region every query's weights are its summary weight times the same p(j|R)."""
    attn = build(name, causal, m, summary=summary)
    q, k, _ = random_qkv(B=1, H=2, L=L, D=8, seed=3)
    part = attn.partition(L)
    P_fast = matrix_from_forward(attn, q, k)
    regions, region_allowed = part.members, part.usable
    assert_region_rank_one(P_fast, regions, region_allowed)
    # and the rank is not trivially one: different queries give a region different total weight
    used = region_allowed.sum(0) > 1
    r = int(used.nonzero()[0])
    users = region_allowed[:, r].nonzero().flatten()
    totals = P_fast[0, 0][users][:, regions[r]].sum(-1)
    assert totals.std() > 0


def test_fixed_follows_official_semantics_by_hand():
    """One query written out: direct causal keys + max-pooled summary of the earlier segment, one softmax."""
    L, m, D = 8, 4, 8
    q, k, v = (x[0, 0] for x in random_qkv(B=1, H=1, L=L, D=D, seed=7))
    attn = build("combiner_fixed", True, m)
    out = attn(*(x[None, None] for x in (q, k, v)))[0, 0]
    qs = q / math.sqrt(D)
    i = 6  # segment 1, offset 2: direct keys 4, 5, 6; region = segment 0
    k_bar = k[0:4].max(0).values
    q_bar = qs[0:4].max(0).values
    v_bar = torch.softmax(k[0:4] @ q_bar, 0) @ v[0:4]
    w = torch.softmax(torch.cat([k[4:7] @ qs[i], (k_bar @ qs[i]).reshape(1)]), 0)
    torch.testing.assert_close(out[i], w[:3] @ v[4:7] + w[3] * v_bar, atol=1e-12, rtol=0)


def test_logsparse_follows_official_semantics_by_hand():
    """Query 13 of L = 16: self, raw token 12, summaries of [8, 12) and [0, 8), one softmax."""
    L, D = 16, 8
    q, k, v = (x[0, 0] for x in random_qkv(B=1, H=1, L=L, D=D, seed=8))
    attn = build("combiner_logsparse", True)
    out = attn(*(x[None, None] for x in (q, k, v)))[0, 0]
    qs = q / math.sqrt(D)
    keys, values = [k[13], k[12]], [v[13], v[12]]
    for a, b in [(8, 12), (0, 8)]:
        q_bar = qs[a:b].max(0).values
        keys.append(k[a:b].max(0).values)
        values.append(torch.softmax(k[a:b] @ q_bar, 0) @ v[a:b])
    w = torch.softmax(torch.stack(keys) @ qs[13], 0)
    torch.testing.assert_close(out[13], w @ torch.stack(values), atol=1e-12, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_single_segment_is_full_attention(causal):
    """m = L: no regions at all (the empty summaries are masked, not uniform averages)."""
    q, k, v = random_qkv(L=12, seed=2)
    attn = build("combiner_fixed", causal, 12)
    torch.testing.assert_close(attn(q, k, v), dense_masked_attention(q, k, v, allowed_keys(12, causal)), atol=1e-12, rtol=0)


def test_first_segment_sees_no_summary():
    """Causal segment 0 has no earlier segment: its outputs are plain causal attention inside the segment."""
    q, k, v = random_qkv(L=16, seed=4)
    out = build("combiner_fixed", True, 4)(q, k, v)
    first = dense_masked_attention(q[..., :4, :], k[..., :4, :], v[..., :4, :], allowed_keys(4, True))
    torch.testing.assert_close(out[..., :4, :], first, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name,L,m", [("combiner_fixed", 16, 4), ("combiner_fixed", 16, 1), ("combiner_logsparse", 16, None), ("combiner_logsparse", 13, None)])
@pytest.mark.parametrize("t", [0, 5, 9])
def test_causal_perturbation(name, L, m, t):
    q, k, v = random_qkv(L=L, seed=5)
    assert_causal_perturbation(build(name, True, m), q, k, v, t)


@pytest.mark.parametrize("summary", ["max", "mean", "deepsets_max"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name,L,m", [("combiner_fixed", 6, 2), ("combiner_logsparse", 7, None)])
def test_gradcheck(name, L, m, causal, summary):
    attn = build(name, causal, m, summary=summary, head_dim=4)
    q, k, v = random_qkv(B=1, H=2, L=L, D=4, seed=6, requires_grad=True)
    assert torch.autograd.gradcheck(attn, (q, k, v), eps=1e-6, atol=1e-6, fast_mode=True)


@pytest.mark.parametrize("summary", ["max", "mean"])
@pytest.mark.parametrize("causal", [True, False])
def test_fixed_gradcheck_with_chunked_summaries(causal, summary):
    """20 segments: the fast path's causal summary chunks span several segments (a staircase mask inside each)."""
    attn = build("combiner_fixed", causal, 2, summary=summary, head_dim=4)
    n = 20
    q, k, v = random_qkv(B=1, H=1, L=2 * n, D=4, seed=15, requires_grad=True)
    chunks = attn.summary_plan(n, 2, q)
    assert [c.first for c in chunks] == sorted({c.first for c in chunks}) and chunks[-1].stop == n
    if causal:
        assert 1 < len(chunks) < n and all(c.usable == c.stop - 1 for c in chunks)
    assert torch.autograd.gradcheck(attn, (q, k, v), eps=1e-6, atol=1e-6, fast_mode=True)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name,L,m", [("combiner_fixed", 8, 2), ("combiner_logsparse", 7, None)])
def test_gradcheck_with_weight_dropout(name, L, m, causal):
    """Training with dropout on p(j|R): the same seed gives the same draws, so the hand-written backward through
    the dropped inner weights can be checked numerically."""
    kw = {"block_size": m} if m else {}
    attn = build_attention(name, causal=causal, dropout=0.3, **kw).double().train()
    q, k, v = random_qkv(B=1, H=2, L=L, D=4, seed=16, requires_grad=True)

    def seeded(q, k, v):
        torch.manual_seed(0)
        return attn(q, k, v)

    with torch.no_grad():
        dropped = seeded(q, k, v)
        torch.testing.assert_close(seeded(q, k, v), dropped, atol=0, rtol=0)
        assert not torch.allclose(dropped, attn.eval()(q, k, v))
    attn.train()
    assert torch.autograd.gradcheck(seeded, (q, k, v), eps=1e-6, atol=1e-6, fast_mode=True)


@pytest.mark.parametrize("L", [3, 9, 16, 17, 31])
def test_summarized_blocks_are_the_partition_regions(L):
    """``log_levels.summarized_blocks`` (the members the fast path pools) are exactly the causal partition's regions."""
    positions = torch.arange(L).view(1, L, 1)
    fast = {frozenset(block.flatten().tolist())
            for level in range(1, num_log_levels(L)) for block in summarized_blocks(positions, level)[0]}
    part = build("combiner_logsparse", True).partition(L)
    assert fast == {frozenset(r.nonzero().flatten().tolist()) for r in part.members}


@pytest.mark.parametrize("name,m", [("combiner_fixed", 4), ("combiner_logsparse", None)])
def test_deepsets_has_learned_maps_that_get_gradients(name, m):
    attn = build(name, True, m, summary="deepsets_max")
    assert attn.has_parameters and not build(name, True, m).has_parameters
    q, k, v = random_qkv(L=16, seed=9)
    attn(q, k, v).square().sum().backward()
    grads = [p.grad for p in attn.parameters()]
    assert len(grads) == 2 and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_dropout_only_in_training():
    attn = build_attention("combiner_fixed", causal=True, block_size=4, dropout=0.5).double()
    q, k, v = random_qkv(L=16, seed=10)
    attn.train()
    torch.manual_seed(0)
    noisy = attn(q, k, v)
    attn.eval()
    torch.testing.assert_close(attn(q, k, v), attn.attention_matrix(q, k, v) @ v, atol=1e-10, rtol=0)
    assert not torch.allclose(noisy, attn(q, k, v))


# -- configuration -----------------------------------------------------------------------------------


def test_block_size_must_tile_length():
    with pytest.raises(AttentionConfigError, match="attention.block_size"):
        build_attention("combiner_fixed", causal=True, block_size=5, seq_len=16)
    attn = build_attention("combiner_fixed", causal=True, block_size=5)
    q, k, v = random_qkv(L=16)
    with pytest.raises(AttentionConfigError, match="attention.block_size"):
        attn(q, k, v)
    with pytest.raises(AttentionConfigError, match="attention.block_size"):
        build_attention("combiner_fixed", causal=True, block_size=0)


def test_summary_kind_is_validated():
    with pytest.raises(AttentionConfigError, match="attention.summary"):
        build_attention("combiner_logsparse", causal=True, summary="median")
    with pytest.raises(AttentionConfigError, match="head_dim"):
        build_attention("combiner_fixed", causal=True, block_size=4, summary="deepsets_max")


def test_logsparse_takes_any_length_and_no_block_size():
    with pytest.raises(AttentionConfigError, match="attention.block_size"):
        build_attention("combiner_logsparse", causal=True, block_size=4)
    attn = build_attention("combiner_logsparse", causal=True, seq_len=37)
    assert attn(*random_qkv(L=37)).shape == (2, 2, 37, 8)


@pytest.mark.parametrize("partition,variant", [({"name": "fixed", "block_size": 4}, "combiner_fixed"), ({"name": "logsparse"}, "combiner_logsparse")])
def test_built_from_partition(partition, variant):
    attn = build_attention("combiner", partition=partition, causal=True, seq_len=16, n_heads=2, head_dim=8, dropout=0.0)
    assert attn.name == variant
    q, k, v = random_qkv(L=16)
    torch.testing.assert_close(attn(q, k, v), build(variant, True, partition.get("block_size"))(q, k, v))


@pytest.mark.parametrize("name", ["combiner_fixed", "combiner_logsparse"])
def test_config_file(name):
    cfg = yaml.safe_load((CONF / f"{name}.yaml").read_text())
    assert cfg["name"] == name and "causal" not in cfg and cfg["summary"] == "max"  # causal: from the task
    assert ("block_size" in cfg) == (name == "combiner_fixed")
    knobs = {k: (4 if k == "block_size" else v) for k, v in cfg.items() if k not in {"name", "causal"}}
    build_attention(name, causal=True, seq_len=16, **knobs)


def test_fixed_runs_the_fused_sdpa_kernel():
    """The joint softmax keeps 4-D SDPA inputs, so the fused CPU kernel (not the math path) runs, both ways."""
    from torch.profiler import ProfilerActivity, profile

    from longseq.attention.ops.cpu.kernels import FLASH_BACKWARD_OP, FLASH_OP

    attn = build_attention("combiner_fixed", causal=True, block_size=8)
    q, k, v = random_qkv(B=1, H=2, L=64, D=16, dtype=torch.float32, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        attn(q, k, v).sum().backward()
    ops = {event.key for event in prof.key_averages()}
    assert f"aten::{FLASH_OP}" in ops and f"aten::{FLASH_BACKWARD_OP}" in ops  # the CPU engine's private kernels
    assert "aten::_scaled_dot_product_attention_math" not in ops


# -- key padding (combiner_logsparse) ----------------------------------------------------------------


def padded_sets_of(attn, L, pad, query):
    """Like ``sets_of`` but for the padded partition of one document (``Partition.without_padding``)."""
    part = attn.partition(L).without_padding(pad)
    direct, regions, region_allowed = part.direct, part.members, part.usable
    direct_keys = set(direct[query].nonzero().flatten().tolist())
    used = [frozenset(regions[r].nonzero().flatten().tolist()) for r in region_allowed[query].nonzero().flatten()]
    return direct_keys, sorted(used, key=min)


def test_logsparse_padded_partition_by_hand():
    """L = 16, bidirectional, a 4-token document: blocks beyond it are masked, padded queries keep the real ones."""
    attn = build("combiner_logsparse", False)
    pad = torch.arange(16) >= 4
    assert padded_sets_of(attn, 16, pad, 0) == ({0, 1}, [span(2, 4)])  # [4, 8) and [8, 16) are all padding
    assert padded_sets_of(attn, 16, pad, 3) == ({2, 3}, [span(0, 2)])
    assert padded_sets_of(attn, 16, pad, 13) == (set(), [span(0, 4)])  # [0, 8) pools its real members only
    # causal, left padding: queries 0 and 1 have no real key at all and fall back to their unpadded direct keys
    attn = build("combiner_logsparse", True)
    pad = torch.arange(16) < 2
    assert padded_sets_of(attn, 16, pad, 0) == ({0}, [])
    assert padded_sets_of(attn, 16, pad, 1) == ({0, 1}, [])
    assert padded_sets_of(attn, 16, pad, 2) == ({2}, [])  # block [0, 2) is masked
    assert padded_sets_of(attn, 16, pad, 5) == ({4, 5}, [span(2, 4)])  # [0, 4) pools {2, 3}
    q, k, v = random_qkv(B=1, L=16, seed=11)
    out = attn(q, k, v, key_padding_mask=pad[None])
    torch.testing.assert_close(out[..., 2, :], v[..., 2, :], atol=1e-12, rtol=0)
    fallback = dense_masked_attention(q[..., :2, :], k[..., :2, :], v[..., :2, :], allowed_keys(2, True))
    torch.testing.assert_close(out[..., :2, :], fallback, atol=1e-12, rtol=0)


@pytest.mark.parametrize("summary", SUMMARY_KINDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("L", [1, 2, 5, 13, 16, 17])
def test_logsparse_key_padding_contract(L, causal, summary):
    """fp64: the padded fast path equals the per-document reference for every summary kind, ragged tails,
    left padding, empty documents and random holes (whole blocks and levels left without a real key)."""
    attn = build("combiner_logsparse", causal, summary=summary)
    pad = padding_patterns(L, seed=L)
    q, k, v = random_qkv(B=pad.shape[0], L=L, seed=L)
    assert_combiner_key_padding(attn, q, k, v, pad, atol=1e-12)
    # the matrix the fast path applies (identity values) is the reference matrix, entry by entry
    eye = torch.eye(L, dtype=q.dtype).expand(pad.shape[0], 2, L, L)
    torch.testing.assert_close(attn(q, k, eye, key_padding_mask=pad), attn.attention_matrix(q, k, v, key_padding_mask=pad),
                               atol=1e-12, rtol=0)
    # an all-False mask takes the padded path and still gives the unpadded result
    none = torch.zeros_like(pad)
    torch.testing.assert_close(attn(q, k, v, key_padding_mask=none), attn(q, k, v), atol=1e-12, rtol=0)


@pytest.mark.parametrize("summary", ["max", "mean"])
def test_logsparse_padded_tail_is_the_shorter_document(summary):
    """Causal: a padded tail changes no real query. Bidirectional, L = 16 padded to a real length of 8: the
    mirrored future blocks past 8 are masked whole, leaving exactly the L = 8 partition."""
    q, k, v = random_qkv(B=1, L=16, seed=12)
    pad = (torch.arange(16) >= 8)[None]
    for causal in (True, False):
        attn = build("combiner_logsparse", causal, summary=summary)
        short = attn(q[..., :8, :], k[..., :8, :], v[..., :8, :])
        torch.testing.assert_close(attn(q, k, v, key_padding_mask=pad)[..., :8, :], short, atol=1e-12, rtol=0)
    attn = build("combiner_logsparse", True, summary=summary)
    pad = (torch.arange(16) >= 11)[None]
    torch.testing.assert_close(attn(q, k, v, key_padding_mask=pad)[..., :11, :], attn(q, k, v)[..., :11, :],
                               atol=1e-12, rtol=0)


@pytest.mark.parametrize("summary", ["max", "mean", "deepsets_max"])
@pytest.mark.parametrize("causal", [True, False])
def test_logsparse_padded_gradients(causal, summary):
    """Training mode: finite gradients, none into padded keys/values from real outputs; gradcheck of the padded path."""
    attn = build("combiner_logsparse", causal, summary=summary).train()
    pad = padding_patterns(13, seed=3)
    q, k, v = random_qkv(B=pad.shape[0], L=13, seed=13, requires_grad=True)
    assert_padded_gradients(attn, q, k, v, pad)
    small = build("combiner_logsparse", causal, summary=summary, head_dim=4)
    q, k, v = random_qkv(B=2, H=1, L=7, D=4, seed=14, requires_grad=True)
    pad = torch.tensor([[False, True, False, False, True, True, False], [False] * 4 + [True] * 3])
    assert torch.autograd.gradcheck(lambda q, k, v: small(q, k, v, key_padding_mask=pad), (q, k, v), eps=1e-6,
                                    atol=1e-6, fast_mode=True)
