"""The one key-padding rule (``ops.padding``), parametrized over ``supports_padding_mask`` (not over names).

A padded key gets zero weight from every real query, is left out of every summary (pooled query/key and the
inner softmax), a region without a real key is masked, a query with no real key falls back to its unpadded
direct keys, and an all-False mask changes nothing. Variant-specific partitions under padding are checked in
the family files.
"""

from __future__ import annotations

import pytest
import torch
from helpers import L, assert_padded_gradients, build, cases, check_key_padding, padding_masks, random_qkv

PADDED = cases("supports_padding_mask")  # by capability, not by name: a new padded variant is tested here


@pytest.mark.parametrize("name,causal", PADDED)
def test_key_padding_rule(name, causal):
    check_key_padding(name, causal)


@pytest.mark.parametrize("name,causal", PADDED)
def test_key_padding_gradients_stay_finite(name, causal):
    torch.manual_seed(0)
    attn = build(name, causal).double().train()
    pad = padding_masks()
    q, k, v = random_qkv(B=3, H=2, L=L, D=8, requires_grad=True)
    assert_padded_gradients(attn, q, k, v, pad)


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
