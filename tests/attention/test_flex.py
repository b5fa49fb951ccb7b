"""The FlexAttention backend (``ops.flex``) against the attention contract, parametrized over the registry.

Every variant (and direction) whose ``flex_unsupported_reason`` is None is tested, so a new layout is covered by
adding it; ``IMPLEMENTED`` pins the layouts written so far, so support cannot silently vanish. On CPU flex runs
eagerly (exact, forward only), hence ``no_grad``.
"""

from __future__ import annotations

import math

import pytest
import torch
from devices import requires_cuda
from helpers import CASES, build, random_qkv

from longseq.attention import AttentionConfigError
from longseq.attention.ops import flex
from longseq.attention.ops.flex import (
    build_block_mask,
    flex_attention_forward,
    flex_partition,
    flex_tiles_visited,
    flex_unsupported_reason,
    plans_of,
    tiles_of,
)
from longseq.attention.ops.partition import Partition

L, BLOCK = 32, 4  # forward checks: 8 segments / grid rows
MASK_L, MASK_BLOCK = 64, 8  # create_mask against the partition's dense support

IMPLEMENTED = {"combiner_fixed", "combiner_logsparse", "combiner_axial", "combiner_axial_vertical",
               "combiner_axial_horizontal", "combiner_mixture", "fixed", "axial", "local", "longformer", "strided",
               "logsparse", "bigbird", "random", "routing", "combiner_routing"}


def supported(cases, seq_len, block_size):
    return [(name, causal) for name, causal in cases
            if flex_unsupported_reason(build(name, causal, seq_len=seq_len, block_size=block_size)) is None]


FLEX_CASES = supported(CASES, L, BLOCK)


def test_supported_variants_include_every_layout_written():
    assert IMPLEMENTED <= {name for name, _ in FLEX_CASES}
    assert "full" not in {name for name, _ in FLEX_CASES}  # full stays on SDPA


def pads(batch: int = 2) -> dict[str, torch.Tensor | None]:
    """No padding, or one padded batch: document 0 with a padded head (queries whose every direct key and usable
    region is padding, so the fallback to unpadded direct keys runs), document 1 with a padded tail."""
    padded = torch.zeros(batch, L, dtype=torch.bool)
    padded[0, : BLOCK + 2] = True
    padded[1, L - 11 :] = True
    return {"none": None, "padded": padded}


PADDED_CASES = [(name, causal, padding) for name, causal in FLEX_CASES for padding in pads()
                if padding == "none" or build(name, causal, seq_len=L, block_size=BLOCK).supports_padding_mask]


@pytest.mark.parametrize("name,causal,padding", PADDED_CASES)
def test_flex_forward_equals_attention_matrix_and_forward(name, causal, padding):
    attn = build(name, causal, seq_len=L, block_size=BLOCK).eval()
    pad = pads()[padding]
    kwargs = {} if pad is None else {"key_padding_mask": pad}
    with torch.no_grad():
        q, k, v = random_qkv(L=L, dtype=torch.float32, seed=1)
        out = flex_attention_forward(attn, q, k, v, pad)
        torch.testing.assert_close(out, attn.attention_matrix(q, k, v, **kwargs) @ v, atol=1e-5, rtol=0)
        # the module's own forward in fp64 (its fp32 padding channel of -1e4 costs ~1e-4 on fallback rows)
        q, k, v = random_qkv(L=L, dtype=torch.float64, seed=2)
        torch.testing.assert_close(flex_attention_forward(attn, q, k, v, pad), attn(q, k, v, **kwargs),
                                   atol=1e-9, rtol=0)


def regions_match(flex_part: Partition, part: Partition) -> None:
    """Every flex summary is exactly one of the partition's regions (members, anchor and family: row-major axial
    summarizes one row from every column), and each query uses the same regions."""
    same = (flex_part.members.unsqueeze(1) == part.members.unsqueeze(0)).all(-1)  # (R_flex, R)
    same &= flex_part.anchor.unsqueeze(1) == part.anchor.unsqueeze(0)
    same &= flex_part.family.unsqueeze(1) == part.family.unsqueeze(0)  # mixture: one cell can be V and H
    assert (same.sum(-1) == 1).all(), "a flex summary pools a set that is not one of the partition's regions"
    used = (flex_part.usable.double() @ same.double()) > 0  # (L, R) in the partition's region order
    assert torch.equal(used, part.usable)
    # one summary per region and query: a joint softmax must not count a region twice
    assert ((flex_part.usable.double() @ same.double()) <= 1).all()


# layouts read from the geometry alone (``routing``'s masks read the batch's clusters: tested below)
MASK_CASES = [(name, causal) for name, causal in supported(CASES, MASK_L, MASK_BLOCK) if name not in flex.DATA_LAYOUTS]


@pytest.mark.parametrize("name,causal", MASK_CASES)
def test_create_mask_of_every_mask_mod_equals_the_partition(name, causal):
    attn = build(name, causal, seq_len=MASK_L, block_size=MASK_BLOCK)
    part = attn.partition(MASK_L)
    heads = part.direct.shape[0] if part.direct.dim() == 3 else 1  # bigbird: per-head patterns
    for head in range(heads):
        flex_part = flex_partition(attn, MASK_L, head)
        direct = part.direct[head] if heads > 1 else part.direct
        assert torch.equal(flex_part.direct, direct)
        if heads == 1:
            assert torch.equal(flex_part.allowed(), part.allowed())
            regions_match(flex_part, part)


@pytest.mark.parametrize("name,causal", MASK_CASES)
def test_block_masks_chunked_builder_and_tiles_visited(name, causal, monkeypatch):
    """The CPU builder for long sequences (chunks of query tiles, broadcast index grids) classifies every tile as
    ``create_block_mask`` does; a sparse pattern's calls never visit more tiles than its dense support touches in
    sequence order (the issue's target for the patterns)."""
    attn = build(name, causal, seq_len=MASK_L, block_size=MASK_BLOCK)
    tile = 8
    for plan in plans_of(attn, MASK_L, "cpu", tile):
        mask_mod, kv_len = plan.mask_mod(MASK_L), plan.kv_len(MASK_L)
        reference = build_block_mask(mask_mod, 1, plan.heads, MASK_L, kv_len, "cpu", tile)
        monkeypatch.setattr(flex, "MASK_CHUNK_CELLS", 2 * tile * kv_len)  # two query tiles a chunk
        chunked = build_block_mask(mask_mod, 1, plan.heads, MASK_L, kv_len, "cpu", tile)
        monkeypatch.undo()
        assert torch.equal(chunked.to_dense(), reference.to_dense())
        assert tiles_of(chunked) == tiles_of(reference)

    ratio = flex_tiles_visited(attn, MASK_L, tile=tile)
    assert ratio > 0
    if attn.family == "sparse":  # Combiner summaries add key tiles; their targets are checked at L = 4096 (slow)
        allowed = attn.partition(MASK_L).direct.reshape(-1, MASK_L, MASK_L)
        n = MASK_L // tile
        touched = allowed.view(-1, n, tile, n, tile).any(4).any(2).sum((1, 2)).double().mean()
        assert ratio <= touched / (n * (n + 1) / 2) + 1e-9


@pytest.mark.slow
@pytest.mark.parametrize("name,target", [("combiner_fixed", 0.125), ("combiner_logsparse", 0.27), ("axial", 0.125),
                                         ("combiner_axial", 0.18), ("combiner_axial_vertical", 0.24),
                                         ("combiner_axial_horizontal", 0.24), ("combiner_mixture", 0.42)])
def test_tiles_visited_meet_the_issue_targets(name, target):
    """Issue 22's targets at L = 4096, m = 64, 128 x 128 tiles (0.12 quoted to two digits: 64 / 528 = 0.1212)."""
    attn = build(name, True, seq_len=4096, block_size=64)
    assert flex_tiles_visited(attn, 4096) <= target


def test_unsupported_variants_say_why_and_forward_refuses():
    full = build("full", True)
    assert "SDPA" in flex_unsupported_reason(full)
    performer = build("performer", True)
    assert flex_unsupported_reason(performer)
    q, k, v = random_qkv(L=16)
    with pytest.raises(AttentionConfigError, match="attention.backend"):
        flex_attention_forward(full, q, k, v)


def test_flex_refuses_weight_dropout_in_training():
    attn = build("combiner_fixed", True, seq_len=L, block_size=BLOCK, dropout=0.1).train()
    q, k, v = random_qkv(L=L)
    with pytest.raises(AttentionConfigError, match="attention.dropout"):
        flex_attention_forward(attn, q, k, v)


def test_block_masks_are_cached_per_length_and_padding():
    attn = build("combiner_fixed", True, seq_len=L, block_size=BLOCK).eval()
    q, k, v = random_qkv(L=L, dtype=torch.float32)
    with torch.no_grad():
        flex_attention_forward(attn, q, k, v)
        cache = flex._cache(attn)
        masks = {key for key in cache if key[0] == "mask"}
        flex_attention_forward(attn, q, k, v)
        assert {key for key in cache if key[0] == "mask"} == masks  # reused, not rebuilt
        pad = pads()["padded"]
        flex_attention_forward(attn, q, k, v, pad)
        flex_attention_forward(attn, q, k, v, pad)
        assert len(cache["padded"]) == 1  # one entry per padding signature
    assert math.isclose(flex.causal_full_tiles(256, 128), 3.0)  # 2 x 2 query x key tiles, causal: 3


@pytest.mark.parametrize("causal", [True, False])
def test_mixture_plans_average_is_two_softmaxes_averaged(causal):
    """``combiner_mixture plans=average``: one group of calls per partition plan, each its own softmax, averaged."""
    attn = build("combiner_mixture", causal, seq_len=L, block_size=BLOCK, plans="average").eval()
    assert flex_unsupported_reason(attn) is None
    assert {plan.group for plan in plans_of(attn, L, "cpu", 16)} == {0, 1}
    pad = pads()["padded"]
    with torch.no_grad():
        q, k, v = random_qkv(L=L, dtype=torch.float32, seed=3)
        for kwargs in ({}, {"key_padding_mask": pad}):
            out = flex_attention_forward(attn, q, k, v, kwargs.get("key_padding_mask"))
            torch.testing.assert_close(out, attn.attention_matrix(q, k, v, **kwargs) @ v, atol=1e-5, rtol=0)


@requires_cuda
@pytest.mark.parametrize("name,causal", FLEX_CASES)
def test_compiled_flex_on_cuda_forward_and_gradients(name, causal):
    """On CUDA the compiled kernel (block skipping, forward and backward): output and q, k, v gradients against
    the dense reference ``attention_matrix @ v`` (fp32, ratio-free tolerance of a fused kernel)."""
    # D = 16: the compiled kernels' narrowest width (dispatch.FLEX_MIN_WIDTH)
    attn = build(name, causal, seq_len=L, block_size=BLOCK, head_dim=16).eval().cuda()
    q, k, v = (x.cuda().requires_grad_() for x in random_qkv(L=L, D=16, dtype=torch.float32, seed=4))
    grad = torch.randn_like(q)
    out = flex_attention_forward(attn, q, k, v)
    flex_grads = torch.autograd.grad(out, (q, k, v), grad)
    ref = attn.attention_matrix(q, k, v) @ v
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
    for got, want in zip(flex_grads, ref_grads):
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_the_compiled_flex_frame_keeps_a_recompile_per_layout_and_length():
    """dynamo's default limit (8 recompiles) sent later layouts to eager, dense masks on an H200: making the compiled
    function raises it to ``FLEX_RECOMPILE_LIMIT`` (never lowers a higher one)."""
    import torch._dynamo

    for before, after in ((8, flex.FLEX_RECOMPILE_LIMIT), (500, 500)):
        with torch._dynamo.config.patch(recompile_limit=before):  # restored on exit
            flex._compiled.cache_clear()
            flex._compiled(flex_attention_forward)
            assert torch._dynamo.config.recompile_limit == after >= 64
    flex._compiled.cache_clear()


@pytest.mark.parametrize("causal", [True, False])
def test_routing_mask_reads_the_batch_clusters(causal):
    """``routing``'s mask (per batch and head, from this batch's k-means clusters) is the dense reference's
    ``allowed(key_clusters, query_routes)``; its tiles are data dependent (NaN)."""
    attn = build("routing", causal, seq_len=L, block_size=BLOCK).eval()
    q, k, v = random_qkv(L=L, dtype=torch.float32, seed=5)
    (plan,) = flex.DATA_LAYOUTS["routing"](attn, q, k, v)
    mask = flex.create_mask(plan.mask_mod(L), 2, plan.heads, L, L, "cpu")
    assert torch.equal(mask, attn.allowed(*attn.assign(k)))
    assert math.isnan(flex_tiles_visited(attn, L))


@pytest.mark.parametrize("name,knobs", [
    ("combiner_fixed", {"summary": "deepsets_mean"}), ("combiner_logsparse", {"summary": "mean"}),
    ("combiner_axial_vertical", {"summary": "deepsets_max"}), ("combiner_mixture", {"summary": "mean"}),
    ("combiner_axial_horizontal", {"summary": "mean", "horizontal_regions": "split"}),
    ("combiner_axial", {"row_summary": "wsum"}), ("combiner_axial", {"row_summary": "none"}),
])
def test_flex_summaries_follow_the_variants_knobs(name, knobs):
    """Summaries are the variant's own (pooling kind, DeepSets maps, row-summary key), padded or not (fp64)."""
    attn = build(name, True, seq_len=L, block_size=BLOCK, **knobs).eval().double()
    q, k, v = random_qkv(L=L, seed=6)
    with torch.no_grad():
        for pad in (None, pads()["padded"]):
            kwargs = {} if pad is None else {"key_padding_mask": pad}
            torch.testing.assert_close(flex_attention_forward(attn, q, k, v, pad),
                                       attn.attention_matrix(q, k, v, **kwargs) @ v, atol=1e-9, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_combiner_routing_mask_reads_the_batch_clusters(causal):
    """``combiner_routing``: direct keys and usable cluster summaries per batch and head are the dense partition's
    for this batch's clusters (causal: R(c, g) only for the query's own segment g)."""
    attn = build("combiner_routing", causal, seq_len=L, block_size=BLOCK).eval()
    q, k, v = random_qkv(L=L, dtype=torch.float32, seed=7)
    (plan,) = flex.DATA_LAYOUTS["combiner_routing"](attn, q, k, v)
    mask = flex.create_mask(plan.mask_mod(L), 2, plan.heads, L, plan.kv_len(L), "cpu")
    clusters, routes = attn.assign(k)
    direct, regions = attn.partition(clusters, routes)
    used = mask[..., L:].unflatten(-1, (-1, attn.n_clusters)).any(-2)  # (B, H, L, K): over the segments g
    assert torch.equal(mask[..., :L], direct) and torch.equal(used, regions.any(-1))
