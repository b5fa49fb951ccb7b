"""Key padding (LRA) across the whole Combiner family, parametrized over every registered ``combiner_*`` name.

The contract (base.py, issue #8): a padded key gets zero weight from every real query, is left out of every
summary (pooled query/key and the inner softmax), a region without a real key is masked, and passing an
all-False mask changes nothing. Variant-specific partitions under padding are checked in the family files.
"""

from __future__ import annotations

import pytest
import torch
from attention_checks import assert_no_future, assert_rows_sum_to_one, random_qkv
from test_attention_contract import build, modes

from longseq.attention import ATTENTION_REGISTRY

L = 16  # 4 x 4 grid (block 4)
COMBINERS = sorted(name for name in ATTENTION_REGISTRY if name.startswith("combiner_"))
CASES = [(name, causal) for name in COMBINERS for causal in modes(name)]


def padding_masks() -> torch.Tensor:
    """(3, L) bool, True = pad: a ragged tail, a whole-row tail, and a padded stretch inside the document."""
    pad = torch.zeros(3, L, dtype=torch.bool)
    pad[0, 9:] = True  # row 2 half padded, row 3 entirely padded
    pad[1, 12:] = True  # the last row padded (row-aligned)
    pad[2, 5:7] = True
    return pad


@pytest.mark.parametrize("name,causal", CASES)
def test_combiner_key_padding(name, causal):
    torch.manual_seed(0)
    attn = build(name, causal).double().eval()
    assert attn.supports_padding_mask, f"{name} must accept key_padding_mask (LRA)"
    pad = padding_masks()
    q, k, v = random_qkv(B=3, H=2, L=L, D=8)
    P = attn.attention_matrix(q, k, v, key_padding_mask=pad)
    assert P.shape == (3, 2, L, L)
    assert_rows_sum_to_one(P, atol=1e-10)
    if causal:
        assert_no_future(P)
    real_query = ~pad[:, None, :, None]  # (B, 1, L, 1)
    padded_key = pad[:, None, None, :]  # (B, 1, 1, L)
    assert (P.masked_fill(~(real_query & padded_key), 0) == 0).all(), "a real query puts weight on a padded key"
    out = attn(q, k, v, key_padding_mask=pad)
    torch.testing.assert_close(out, P @ v, atol=1e-10, rtol=0)

    # Padded keys' contents cannot reach a real query, directly or through a summary.
    k2, v2 = k.clone(), v.clone()
    k2[pad[:, None, :].expand_as(k[..., 0])] += 3.0
    v2[pad[:, None, :].expand_as(v[..., 0])] -= 5.0
    moved = attn(q, k2, v2, key_padding_mask=pad)
    real = ~pad[:, None, :].expand_as(out[..., 0])
    torch.testing.assert_close(moved[real], out[real], atol=1e-10, rtol=0)

    # An all-False mask is no mask.
    none = torch.zeros_like(pad)
    torch.testing.assert_close(attn(q, k, v, key_padding_mask=none), attn(q, k, v), atol=1e-10, rtol=0)
    torch.testing.assert_close(attn.attention_matrix(q, k, v, key_padding_mask=none), attn.attention_matrix(q, k, v),
                               atol=1e-10, rtol=0)

    # Combiner keeps full support over the real document: every real key is reached by every real query that
    # may see it (bidirectional: all of them; causal: the real past), whatever the padding pattern.
    for doc in range(len(pad)):
        reach = P[doc][..., ~pad[doc]][:, ~pad[doc]]  # (H, real queries, real keys)
        allowed = torch.ones(reach.shape[-2:], dtype=torch.bool)
        if causal:
            allowed = allowed.tril()
        assert (reach[:, allowed] > 0).all(), f"document {doc}: a real key lost its weight under padding"


@pytest.mark.parametrize("name,causal", CASES)
def test_combiner_key_padding_gradients_stay_finite(name, causal):
    torch.manual_seed(0)
    attn = build(name, causal).double().train()
    pad = padding_masks()
    q, k, v = random_qkv(B=3, H=2, L=L, D=8, requires_grad=True)
    out = attn(q, k, v, key_padding_mask=pad)
    out.masked_fill(pad[:, None, :, None], 0).sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    # nothing flows into padded keys or values from real outputs
    assert (k.grad[pad[:, None, :].expand_as(k[..., 0])] == 0).all()
    assert (v.grad[pad[:, None, :].expand_as(v[..., 0])] == 0).all()


@pytest.mark.parametrize("row_summary", ["proj", "none", "wsum"])
@pytest.mark.parametrize("causal", [False, True])
def test_combiner_axial_padded_row_mates_are_replaced_by_the_rows_first_real_position(row_summary, causal):
    """Row-major regions are summarized by the row-mate's own query; a padded row-mate is replaced."""
    attn = build("combiner_axial", causal).double().eval()
    attn.row_summary = row_summary
    pad = padding_masks()
    q, k, v = random_qkv(B=3, H=2, L=L, D=8)
    P = attn.attention_matrix(q, k, v, key_padding_mask=pad)
    torch.testing.assert_close(attn(q, k, v, key_padding_mask=pad), P @ v, atol=1e-10, rtol=0)
    # document 0: row 2 = positions 8..11 keeps one real key (8), so position 8 summarizes row 2 for every column
    part = attn.partition(L).without_padding(pad[0])
    row2 = part.members[:, 8]
    assert part.members[row2].sum(-1).tolist() == [1] * int(row2.sum()) and set(part.anchor[row2].tolist()) == {8}
    if not causal:  # queries in every column of rows 0, 1 reach key 8 through a summary anchored at 8
        assert (P[0][:, :8, 8] > 0).all()
