"""Incremental decoding (issue #16, attention level), parametrized over the registry by ``supports_decoding``.

Every causal variant that claims a decoding state reproduces ``forward`` position by position (teacher
forcing) and after a prefill, in fp64 on a non-trivial grid (L = 64, m = 8); every other causal variant,
and every variant built bidirectional, refuses with ``DecodingNotSupported`` naming itself and the fallback.
"""

from __future__ import annotations

import pytest
import torch
from helpers import build, check_decoding, random_qkv

from longseq.attention import ATTENTION_REGISTRY, AttentionConfigError, DecodingNotSupported

L, BLOCK = 64, 8


def claims_decoding(name: str) -> bool:
    cls = ATTENTION_REGISTRY[name].cls
    return cls.supports_decoding and cls.supports_causal


DECODERS = sorted(n for n in ATTENTION_REGISTRY if claims_decoding(n))
REFUSERS = sorted(n for n in ATTENTION_REGISTRY if ATTENTION_REGISTRY[n].cls.supports_causal and not claims_decoding(n))
# Knob settings with their own decoding path (summary kinds, plans), decoded too.
VARIANTS = [(name, {}) for name in DECODERS] + [
    (name, knobs) for name, knobs in [
        ("combiner_axial", {"row_summary": "none"}), ("combiner_axial", {"row_summary": "wsum"}),
        ("combiner_fixed", {"summary": "mean"}), ("combiner_fixed", {"summary": "deepsets_max"}),
        ("combiner_logsparse", {"summary": "deepsets_mean"}), ("combiner_mixture", {"plans": "average"}),
        ("combiner_axial_horizontal", {"horizontal_regions": "split"}), ("combiner_axial_vertical", {"summary": "mean"}),
        ("combiner_routing", {"summary": "mean"}), ("combiner_routing", {"summary": "deepsets_max"}),
        ("combiner_routing", {"summary": "deepsets_mean"}), ("combiner_routing", {"n_clusters": 8}),
        ("combiner_routing", {"n_clusters": 2}), ("routing", {"n_clusters": 8}),
    ] if name in DECODERS
]


@pytest.mark.parametrize("name,knobs", VARIANTS, ids=[f"{n}-{k}" if k else n for n, k in VARIANTS])
def test_teacher_forced_steps_reproduce_forward(name, knobs):
    check_decoding(name, knobs, L=L, block_size=BLOCK)


@pytest.mark.parametrize("prefix", [1, 13, BLOCK * 3])
@pytest.mark.parametrize("name", DECODERS)
def test_prefill_then_steps_reproduce_forward(name, prefix):
    check_decoding(name, {}, prefix, L=L, block_size=BLOCK)


@pytest.mark.parametrize("name", DECODERS)
def test_decoding_past_max_len_is_refused(name):
    attn = build(name, True, seq_len=L, block_size=BLOCK).double().eval()
    q, k, v = random_qkv(B=1, H=2, L=L, D=8)
    state = attn.new_state(1, L, device=q.device, dtype=q.dtype)
    attn.prefill(state, q, k, v)
    with pytest.raises(ValueError, match="max_len"):
        attn.step(state, q[..., :1, :], k[..., :1, :], v[..., :1, :])


@pytest.mark.parametrize("name", REFUSERS)
def test_variants_without_a_state_refuse_naming_the_fallback(name):
    attn = build(name, True)
    with pytest.raises(DecodingNotSupported, match=rf"'{name}'.*recompute") as error:
        attn.new_state(2, 16, device="cpu", dtype=torch.float64)
    assert isinstance(error.value, AttentionConfigError)


@pytest.mark.parametrize("name", [n for n in DECODERS if ATTENTION_REGISTRY[n].cls.supports_bidirectional])
def test_bidirectional_builds_refuse(name):
    attn = build(name, False)
    with pytest.raises(DecodingNotSupported, match=rf"'{name}'.*bidirectional.*recompute"):
        attn.new_state(2, 16, device="cpu", dtype=torch.float64)


@pytest.mark.parametrize("name", ["routing", "combiner_routing"])
def test_clustered_decoding_replays_overflowing_routes_and_keeps_centroids(name):
    """k-means partitions: keys crowded near one centroid make most queries overflow their centroid's S slots
    (routed and overflowing queries both occur); steps still equal forward, and the centroids do not move."""
    attn = build(name, True, seq_len=L, block_size=BLOCK).double().eval()
    q, k, v = random_qkv(B=2, H=2, L=L, D=8, seed=3)
    k = k + 3.0 * attn.kmeans.centroids.double()[:, :1].unsqueeze(0)  # pull every key toward centroid 0
    centroids = attn.kmeans.centroids.clone()
    with torch.no_grad():
        key_clusters, routes = attn.assign(k)
        routed = attn.causal_direct_mask(key_clusters, routes)[2].squeeze(-1) < attn.n_clusters
        assert routed.any() and (~routed).sum() > L // 2, "the geometry must exercise overflow"
        expected = attn(q, k, v)
        state = attn.new_state(2, L, device=q.device, dtype=q.dtype)
        out = torch.cat([attn.prefill(state, q[..., :5, :], k[..., :5, :], v[..., :5, :])]
                        + [attn.step(state, q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :])
                           for t in range(5, L)], -2)
    torch.testing.assert_close(out, expected, atol=1e-9, rtol=0)
    assert torch.equal(attn.kmeans.centroids, centroids)
