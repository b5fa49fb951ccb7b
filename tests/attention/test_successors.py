"""The 2025 successors (issue 24): ``moba``, ``combiner_select``, ``nsa``, and their limits.

The registry-wide files (contract, padding, decoding, autocast) cover every variant's contract; this file checks
what each one is: the limits (k = 0, k covering every block, window = L) equal the variants they reduce to, and
the selection is the documented rule, on tiny fp64 inputs.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_output_matches_matrix, build, dense_masked_attention, random_qkv

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


def test_gathered_attention_in_chunks_equals_one_pass(monkeypatch):
    """Query chunks recomputed in backward give the one-pass output and gradients."""
    attn = build("moba", True, seq_len=L32, block_size=M, top_k=2).double().train()
    q, k, v = random_qkv(B=1, H=2, L=L32, requires_grad=True)
    attn(q, k, v).square().sum().backward()
    expected = [x.grad.clone() for x in (q, k, v)]
    out = attn(q, k, v)
    for x in (q, k, v):
        x.grad = None
    monkeypatch.setattr(block_select, "CHUNK_ELEMENTS", 200)  # a few query rows per chunk
    chunked = attn(q, k, v)
    chunked.square().sum().backward()
    torch.testing.assert_close(chunked, out, atol=1e-12, rtol=0)
    for x, grad in zip((q, k, v), expected):
        torch.testing.assert_close(x.grad, grad, atol=1e-12, rtol=0)
