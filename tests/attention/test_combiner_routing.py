"""Combiner-Learnable (``combiner_routing``) and the online k-means module it shares with ``routing``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    assert_causal_perturbation,
    assert_combiner_key_padding,
    assert_no_future,
    assert_output_matches_matrix,
    assert_padded_gradients,
    assert_rows_sum_to_one,
    assert_support,
    padding_patterns,
    random_qkv,
)

import longseq.attention.ops.clustering as clustering_module
from longseq.attention import AttentionConfigError, build_attention
from longseq.attention.ops.clustering import OnlineKMeans, balanced_assignment
from longseq.attention.ops.geometry import cluster_order

# (L, n_clusters, block_size): K = 1 and K = L edges, K dividing / not dividing block_size, default block
GEOMETRIES = [(16, 4, 4), (16, 4, 8), (32, 8, 4), (24, 4, 6), (16, 1, 4), (16, 16, 16), (32, 4, None), (64, 8, 8)]


def make(causal, K, block, summary="max", H=2, D=8, **kw):
    attn = build_attention(
        "combiner_routing", causal=causal, n_clusters=K, block_size=block, summary=summary, n_heads=H, head_dim=D, **kw
    )
    return attn.double().eval()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("L,K,block", GEOMETRIES)
def test_contract(causal, L, K, block):
    attn = make(causal, K, block)
    q, k, v = random_qkv(L=L)
    P = attn.attention_matrix(q, k, v)
    assert_rows_sum_to_one(P)
    allowed = torch.ones(L, L, dtype=torch.bool)
    if causal:
        assert_no_future(P)
        allowed = allowed.tril()
    assert_support(P, allowed)  # full support: every allowed key gets positive weight
    assert_output_matches_matrix(attn, q, k, v)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("summary", ["mean", "deepsets_max", "deepsets_mean"])
def test_other_summaries(causal, summary):
    torch.manual_seed(0)
    attn = make(causal, 4, 8, summary=summary)
    q, k, v = random_qkv(L=32)
    P = attn.attention_matrix(q, k, v)
    assert_rows_sum_to_one(P)
    allowed = torch.ones(32, 32, dtype=torch.bool)
    assert_support(P, allowed.tril() if causal else allowed)
    assert_output_matches_matrix(attn, q, k, v)
    assert attn.has_parameters == summary.startswith("deepsets")


def test_extremes_equal_full_attention():
    """K = 1 (one cluster) and, bidirectionally, K = L (singleton summaries) are plain full attention."""
    q, k, v = random_qkv(L=16)
    for causal, K, block in [(True, 1, 4), (False, 1, 4), (False, 16, 4), (True, 16, 16)]:
        P = make(causal, K, block).attention_matrix(q, k, v)
        full = build_attention("full", causal=causal).attention_matrix(q, k, v)
        torch.testing.assert_close(P, full, atol=1e-12, rtol=0)


@pytest.mark.parametrize("L,K,block", [(16, 4, 4), (32, 8, 4), (64, 8, 8), (32, 4, None)])
def test_causal_perturbation(L, K, block):
    attn = make(True, K, block)
    q, k, v = random_qkv(L=L, seed=1)
    for t in (1, L // 3, L // 2, L - 1):
        assert_causal_perturbation(attn, q, k, v, t)


def test_clustering_is_causal_safe():
    """Perturbing position t changes the balanced key clusters inside t's segment (so the test is not
    vacuous) yet no earlier output, and never an earlier query's route or an earlier segment's clusters."""
    L, K, block = 32, 4, 8
    attn = make(True, K, block)
    q, k, v = random_qkv(L=L, seed=2)
    key_clusters, routes = attn.assign(k)
    out = attn(q, k, v)
    mates_changed = 0
    g = torch.Generator().manual_seed(3)
    for t in range(L):
        k2, v2, q2 = k.clone(), v.clone(), q.clone()
        for x in (q2, k2, v2):
            x[..., t, :] = torch.randn(x[..., t, :].shape, generator=g, dtype=x.dtype) * 3
        key2, routes2 = attn.assign(k2)
        seg_start = t - t % block
        assert torch.equal(key2[..., :seg_start], key_clusters[..., :seg_start])
        assert torch.equal(routes2[..., :t], routes[..., :t])
        mates_changed += int(not torch.equal(key2[..., seg_start:t], key_clusters[..., seg_start:t]))
        torch.testing.assert_close(attn(q2, k2, v2)[..., :t, :], out[..., :t, :], atol=0, rtol=0)
    assert mates_changed > 0


def test_routed_and_overflow_queries_both_occur():
    """The random test inputs exercise both query kinds (own cluster direct / own cluster summarized)."""
    attn = make(True, 4, 4)
    _, k, _ = random_qkv(L=16)
    _, routes = attn.assign(k)
    routed = cluster_order(routes, 4)[1] < 4
    assert routed.any() and (~routed).any()


def test_hand_checked_partition_causal():
    # L = 16, K = 2, block 4: segments {0-3}, {4-7}, {8-11}, {12-15}; S = 8 slots per centroid
    attn = make(True, 2, 4)
    key_clusters = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 0, 0, 1, 1, 1, 1, 0, 0])
    routes = torch.tensor([0] * 10 + [1] * 6)  # queries 8, 9 overflow centroid 0 (capacity 8)
    direct, regions = attn.partition(key_clusters, routes)

    def members(mask):
        return set(torch.nonzero(mask).flatten().tolist())

    # query 2 (segment 0): own segment up to self, no regions
    assert members(direct[2]) == {0, 1, 2} and not regions[2].any()
    # query 6 (segment 1, routed to 0): own segment past + cluster 0 of segment 0; cluster 1 summarized
    assert members(direct[6]) == {4, 5, 6, 0, 3}
    assert not regions[6, 0].any() and members(regions[6, 1]) == {1, 2}
    # query 9 (segment 2, overflow): own segment past; both clusters summarized
    assert members(direct[9]) == {8, 9}
    assert members(regions[9, 0]) == {0, 3, 5, 6} and members(regions[9, 1]) == {1, 2, 4, 7}
    # query 13 (segment 3, routed to 1): cluster 1 of segments 0-2 direct, cluster 0 summarized
    assert members(direct[13]) == {12, 13, 1, 2, 4, 7, 10, 11}
    assert not regions[13, 1].any() and members(regions[13, 0]) == {0, 3, 5, 6, 8, 9}
    # every query: direct and regions partition [0, i]
    cover = direct.long() + regions.long().sum(-2)
    assert torch.equal(cover, torch.ones(16, 16, dtype=torch.long).tril())


def test_hand_checked_partition_bidirectional():
    attn = make(False, 4, None)
    key_clusters = torch.arange(16) % 4  # cluster c = {c, c+4, c+8, c+12}
    direct, regions = attn.partition(key_clusters)
    assert set(torch.nonzero(direct[5]).flatten().tolist()) == {1, 5, 9, 13}
    assert not regions[5, 1].any()
    assert set(torch.nonzero(regions[5, 2]).flatten().tolist()) == {2, 6, 10, 14}
    cover = direct.long() + regions.long().sum(-2)
    assert torch.equal(cover, torch.ones(16, 16, dtype=torch.long))


@pytest.mark.parametrize("causal", [True, False])
def test_gradients(causal):
    attn = make(causal, 4, 8, summary="deepsets_max")
    q, k, v = random_qkv(L=32, requires_grad=True)
    attn(q, k, v).square().sum().backward()
    for x in (q, k, v, attn.summary.phi_query.weight, attn.summary.phi_key.weight):
        assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck(causal):
    attn = make(causal, 2, 4, H=1, D=4)
    q, k, v = random_qkv(B=1, H=1, L=8, D=4, requires_grad=True, seed=4)
    assert torch.autograd.gradcheck(attn, (q, k, v), eps=1e-6, atol=1e-6, fast_mode=True)


# -- the fused CPU flash path (unpadded, dropout-free forward) -----------------------------------------


def output_and_grads(attn, q, k, v):
    """forward and the gradients of ``sum(out * w)`` (a fixed random w) over q, k, v and the parameters (zero
    when unused: with one cluster or one segment no summary is computed)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    attn.zero_grad(set_to_none=True)
    out = attn(*leaves)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype))
    return out.detach(), [x.grad for x in leaves] + [torch.zeros_like(p) if p.grad is None else p.grad.clone()
                                                     for p in attn.parameters()]


@pytest.mark.parametrize("L,K,block", GEOMETRIES)
@pytest.mark.parametrize("name,summary", [("routing", None), ("combiner_routing", "max"),
                                          ("combiner_routing", "mean"), ("combiner_routing", "deepsets_max")])
def test_flash_path_matches_explicit_path(name, summary, L, K, block):
    """Causal fp64: the fused flash forward and its hand-written backward equal the explicit logits path
    (outputs and every gradient), in every geometry (one cluster, one segment, several members per segment)."""
    torch.manual_seed(0)
    extra = {} if summary is None else {"summary": summary}
    attn = build_attention(name, causal=True, n_clusters=K, block_size=block, n_heads=2, head_dim=8, **extra)
    attn = attn.double().eval()  # the centroids stay put between the two runs
    q, k, v = random_qkv(L=L, seed=L + K)
    flash = output_and_grads(attn, q, k, v)
    attn.backend = "explicit"
    explicit = output_and_grads(attn, q, k, v)
    torch.testing.assert_close(flash[0], explicit[0], atol=1e-12, rtol=0)
    for a, b in zip(flash[1], explicit[1]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name,L,K,block", [("routing", 16, 2, 4), ("combiner_routing", 16, 2, 4),
                                            ("combiner_routing", 12, 3, 3), ("combiner_routing", 16, 4, 4)])
def test_flash_path_gradcheck(name, L, K, block):
    """The fused path's autograd functions (``_ClusterSlotsFlash``, ``_PermuteRows``, the pools' running max) against
    finite differences, with routed, overflow, segment-0 and several-members-per-segment queries."""
    attn = build_attention(name, causal=True, n_clusters=K, block_size=block, n_heads=1, head_dim=4).double().eval()
    q, k, v = random_qkv(B=1, H=1, L=L, D=4, requires_grad=True, seed=5)
    # fast mode (random projections of the Jacobian): the full one took 26 s for one case on the loaded 2-core machine
    assert torch.autograd.gradcheck(attn, (q, k, v), eps=1e-6, atol=1e-6, fast_mode=True)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", ["routing", "combiner_routing"])
def test_head_groups_match_one_group(name, causal, monkeypatch):
    """Heads run in groups (``TEMPORARY_BYTES``): one head per group gives the same outputs, gradients and, in
    training, the same centroid update as all heads at once (padded too for combiner_routing)."""
    def run():
        attn = build_attention(name, causal=causal, n_clusters=4, block_size=8, n_heads=3, head_dim=8).double().train()
        q, k, v = random_qkv(B=2, H=3, L=32, seed=7)
        out, grads = output_and_grads(attn, q, k, v)
        results = [out, *grads, attn.kmeans.centroids.clone()]
        if name == "combiner_routing":
            pad = padding_patterns(32, seed=8)[:2]
            q, k, v = random_qkv(B=2, H=3, L=32, seed=9)
            results.append(attn(q, k, v, key_padding_mask=pad))
        return attn.head_group(q), results

    groups, together = run()
    monkeypatch.setattr(clustering_module, "TEMPORARY_BYTES", 1)
    one, apart = run()
    assert groups == 3 and one == 1
    for a, b in zip(together, apart):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


# -- the k-means module -------------------------------------------------------------------------


def test_balanced_assignment_is_balanced_partition():
    scores = torch.randn(3, 5, 48, 6, generator=torch.Generator().manual_seed(0))
    ids = balanced_assignment(scores)
    assert ids.shape == (3, 5, 48) and ids.min() >= 0 and ids.max() < 6
    counts = F.one_hot(ids, 6).sum(-2)
    assert (counts == 8).all()


def test_balanced_assignment_rule():
    # everyone prefers centroid 0 (capacity 2): the two most similar keep it, the rest take their next choice
    scores = torch.tensor([[0.9, 0.1], [0.5, 0.4], [0.95, 0.0], [0.3, 0.2]])
    assert balanced_assignment(scores).tolist() == [0, 1, 0, 1]
    # when the nearest centroids are already balanced the assignment is the nearest one
    scores = torch.eye(4).repeat(3, 1)
    assert torch.equal(balanced_assignment(scores), torch.arange(4).repeat(3))


def test_kmeans_groups_and_nearest():
    km = OnlineKMeans(4, n_heads=2, head_dim=8)
    x = torch.randn(2, 2, 32, 8)
    ids = km.balanced(x, group=8)
    assert (F.one_hot(ids.view(2, 2, 4, 8), 4).sum(-2) == 2).all()  # 2 per cluster in every group of 8
    assert torch.equal(km.nearest(x), km.scores(x).argmax(-1))
    torch.testing.assert_close(km.centroids.norm(dim=-1), torch.ones(2, 4))


def test_ema_update_moves_toward_assigned_means_in_training_only():
    km = OnlineKMeans(3, n_heads=2, head_dim=4, ema_decay=0.5)
    x = torch.randn(2, 2, 12, 4, generator=torch.Generator().manual_seed(0))
    ids = km.balanced(x)
    before = km.centroids.clone()
    km.eval()
    km.update(x, ids)
    assert torch.equal(km.centroids, before)
    km.train()
    km.update(x, ids)
    xn = F.normalize(x, dim=-1)
    for h in range(2):
        for c in range(3):
            mean = xn[:, h][ids[:, h] == c].mean(0)
            expected = F.normalize(0.5 * before[h, c] + 0.5 * mean, dim=0)
            torch.testing.assert_close(km.centroids[h, c], expected)
            assert F.cosine_similarity(km.centroids[h, c], mean, 0) > F.cosine_similarity(before[h, c], mean, 0)


def test_attention_updates_centroids_only_in_training():
    attn = make(True, 4, 8)
    q, k, v = random_qkv(L=32)
    before = attn.kmeans.centroids.clone()
    attn(q, k, v)
    assert torch.equal(attn.kmeans.centroids, before)
    attn.train()
    attn(q, k, v)
    assert not torch.allclose(attn.kmeans.centroids, before)


def test_seeded_init_and_checkpoint_round_trip():
    a = OnlineKMeans(4, n_heads=2, head_dim=8, seed=7)
    assert torch.equal(a.centroids, OnlineKMeans(4, n_heads=2, head_dim=8, seed=7).centroids)
    assert not torch.equal(a.centroids, OnlineKMeans(4, n_heads=2, head_dim=8, seed=8).centroids)
    lazy = OnlineKMeans(4, seed=7)  # shapes unknown until first use: same seeded values
    lazy.scores(torch.randn(1, 2, 4, 8))
    assert torch.equal(lazy.centroids, a.centroids)

    attn = build_attention("combiner_routing", causal=True, n_clusters=4, block_size=8, n_heads=2, head_dim=8)
    attn.train()
    attn(*random_qkv(L=32, dtype=torch.float32))  # move the centroids away from their init
    state = attn.state_dict()
    assert "kmeans.centroids" in state
    fresh = build_attention("combiner_routing", causal=True, n_clusters=4, block_size=8, n_heads=2, head_dim=8, seed=1)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.kmeans.centroids, attn.kmeans.centroids)
    lazy_attn = build_attention("combiner_routing", causal=True, n_clusters=4, block_size=8)
    lazy_attn.load_state_dict(state)
    assert torch.equal(lazy_attn.kmeans.centroids, attn.kmeans.centroids)


# -- configuration --------------------------------------------------------------------------------


def test_partition_family_and_default_block():
    attn = build_attention("combiner", partition={"name": "routing", "n_clusters": 8}, causal=True, seq_len=64)
    assert type(attn).__name__ == "CombinerRoutingAttention" and attn.segment_len(64) == 8
    assert_output_matches_matrix(attn.double(), *random_qkv(L=64))
    # the task geometry of cifar10 / imagenet64 (K larger than the block): segments of lcm(block, K)
    assert build_attention("combiner_routing", causal=True, n_clusters=96, block_size=32, seq_len=3072).segment_len(3072) == 96
    assert build_attention("combiner_routing", causal=True, n_clusters=96, block_size=128, seq_len=12288).segment_len(12288) == 384


def test_config_errors_name_the_key():
    with pytest.raises(AttentionConfigError, match="attention.n_clusters"):
        build_attention("combiner_routing", causal=False, n_clusters=5, seq_len=64)
    with pytest.raises(AttentionConfigError, match="attention.block_size"):
        build_attention("combiner_routing", causal=True, n_clusters=4, block_size=12, seq_len=64)
    with pytest.raises(AttentionConfigError, match="attention.summary"):
        build_attention("combiner_routing", causal=True, n_clusters=4, summary="sum")


# -- key padding (LRA) ----------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("L,K,block", GEOMETRIES)
def test_key_padding_contract(causal, L, K, block):
    """fp64, every geometry: forward == per-document ``padded_partition`` reference, no weight on padded keys,
    full support over the real keys, padded contents unreachable; ragged/left/interior/random/empty documents."""
    attn = make(causal, K, block)
    pad = padding_patterns(L, seed=L + K)
    q, k, v = random_qkv(B=pad.shape[0], L=L, seed=K)
    assert_combiner_key_padding(attn, q, k, v, pad, atol=1e-12)
    none = torch.zeros_like(pad)
    torch.testing.assert_close(attn(q, k, v, key_padding_mask=none), attn(q, k, v), atol=1e-12, rtol=0)
    torch.testing.assert_close(attn.attention_matrix(q, k, v, key_padding_mask=none), attn.attention_matrix(q, k, v),
                               atol=1e-12, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("summary", ["mean", "deepsets_max", "deepsets_mean"])
def test_key_padding_other_summaries(causal, summary):
    torch.manual_seed(0)
    attn = make(causal, 4, 8, summary=summary)
    pad = padding_patterns(32, seed=5)
    assert_combiner_key_padding(attn, *random_qkv(B=pad.shape[0], L=32, seed=6), pad, atol=1e-12)


def test_balanced_assignment_places_deferred_positions_last():
    # real position 0 takes centroid 1; the deferred 1..5 fill the room left (2, 1, 2) in position order
    scores = torch.tensor([[0.0, 1.0, 0.0]] + [[0.0, 0.0, 1.0]] * 5)
    deferred = torch.tensor([False] + [True] * 5)
    assert balanced_assignment(scores, deferred).tolist() == [1, 0, 0, 1, 2, 2]
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(2, 3, 24, 4, generator=g)
    deferred = torch.rand(2, 1, 24, generator=g) < 0.5
    ids = balanced_assignment(scores, deferred)
    assert (F.one_hot(ids, 4).sum(-2) == 6).all()
    # the deferred positions' scores decide nothing
    moved = torch.where(deferred.unsqueeze(-1), torch.randn(scores.shape, generator=g), scores)
    assert torch.equal(balanced_assignment(moved, deferred), ids)
    assert torch.equal(balanced_assignment(scores, torch.zeros_like(deferred)), balanced_assignment(scores))


def test_padded_queries_take_no_slot_and_clusters_ignore_padding():
    attn = make(True, 4, 4)
    q, k, v = random_qkv(B=1, L=32, seed=7)
    pad = torch.zeros(1, 32, dtype=torch.bool)
    pad[0, 3:9] = True
    key_clusters, routes = attn.assign(k, ~pad)
    assert (routes[..., pad[0]] == 4).all()  # route K: no centroid
    torch.testing.assert_close(routes[..., ~pad[0]], attn.kmeans.nearest(k)[..., ~pad[0]], atol=0, rtol=0)
    assert (F.one_hot(key_clusters.view(1, 2, 8, 4), 4).sum(-2) == 1).all()  # still balanced per segment
    k2 = k.clone()
    k2[..., pad[0], :] = torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(8), dtype=k.dtype)
    key2, routes2 = attn.assign(k2, ~pad)
    assert torch.equal(key2[..., ~pad[0]], key_clusters[..., ~pad[0]]) and torch.equal(routes2, routes)


def test_causal_padding_leaves_earlier_segments_alone():
    """Causal: queries in the segments before the first padded key give their unpadded outputs."""
    attn = make(True, 4, 8)
    q, k, v = random_qkv(L=32, seed=9)
    pad = (torch.arange(32) >= 21).expand(2, 32)  # first pad in segment 2 = [16, 24)
    torch.testing.assert_close(attn(q, k, v, key_padding_mask=pad)[..., :16, :], attn(q, k, v)[..., :16, :],
                               atol=1e-12, rtol=0)


def test_hand_checked_padded_output_bidirectional():
    """L = 8, K = 2, a 5-token document: every real query written out from its clusters' real members."""
    attn = make(False, 2, None, H=1)
    q, k, v = random_qkv(B=1, H=1, L=8, seed=10)
    pad = (torch.arange(8) >= 5)[None]
    clusters = attn.assign(k, ~pad)[0][0, 0]
    assert (F.one_hot(clusters, 2).sum(0) == 4).all()
    out = attn(q, k, v, key_padding_mask=pad)[0, 0]
    qs, k, v = q[0, 0] / 8**0.5, k[0, 0], v[0, 0]
    real = ~pad[0]
    for i in range(5):
        own, other = (clusters == clusters[i]) & real, (clusters != clusters[i]) & real
        keys, values = [k[own]], [v[own]]
        if other.any():
            q_bar = qs[other].max(0).values
            keys.append(k[other].max(0).values[None])
            values.append((torch.softmax(k[other] @ q_bar, 0) @ v[other])[None])
        w = torch.softmax(torch.cat(keys) @ qs[i], 0)
        torch.testing.assert_close(out[i], w @ torch.cat(values), atol=1e-12, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_padded_keys_do_not_move_centroids(causal):
    """Training: the EMA step averages real keys only, whatever the padded keys hold."""
    q, k, v = random_qkv(L=32, seed=11)
    pad = torch.zeros(2, 32, dtype=torch.bool)
    pad[0, 20:] = True
    pad[1, :5] = True
    k2 = k.clone()
    k2[pad[:, None, :].expand_as(k[..., 0])] = 7.0
    a, b = make(causal, 4, 8).train(), make(causal, 4, 8).train()
    before = a.kmeans.centroids.clone()
    a(q, k, v, key_padding_mask=pad)
    b(q, k2, v, key_padding_mask=pad)
    assert not torch.allclose(a.kmeans.centroids, before)
    torch.testing.assert_close(a.kmeans.centroids, b.kmeans.centroids, atol=0, rtol=0)
    # = one EMA step toward each cluster's mean over real members
    clusters = make(causal, 4, 8).assign(k, ~pad)[0]
    km = OnlineKMeans(4, n_heads=2, head_dim=8).double().train()
    km.update(k, clusters, (~pad).unsqueeze(1))
    torch.testing.assert_close(a.kmeans.centroids, km.centroids)


@pytest.mark.parametrize("causal", [True, False])
def test_padded_gradients(causal):
    attn = make(causal, 4, 8, summary="deepsets_mean").train()
    pad = padding_patterns(32, seed=12)
    q, k, v = random_qkv(B=pad.shape[0], L=32, seed=12, requires_grad=True)
    assert_padded_gradients(attn, q, k, v, pad)
    small = make(causal, 2, 4, H=1, D=4)
    q, k, v = random_qkv(B=1, H=1, L=8, D=4, requires_grad=True, seed=13)
    mask = torch.tensor([[False, False, True, False, False, True, True, True]])
    assert torch.autograd.gradcheck(lambda q, k, v: small(q, k, v, key_padding_mask=mask), (q, k, v), eps=1e-6,
                                    atol=1e-6, fast_mode=True)


def test_routing_baseline_rejects_a_padding_mask():
    attn = build_attention("routing", causal=False, n_clusters=4)
    q, k, v = random_qkv(L=16)
    with pytest.raises(AttentionConfigError, match="key_padding_mask"):
        attn(q, k, v, key_padding_mask=torch.zeros(2, 16, dtype=torch.bool))
