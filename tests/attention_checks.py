"""Reusable assertions on the attention contract (DESIGN.md), shared by every attention test file."""

from __future__ import annotations

import torch

from longseq.attention import Attention


def random_qkv(B=2, H=2, L=16, D=8, dtype=torch.float64, seed=0, requires_grad=False):
    """Unscaled q, k, v of shape (B, H, L, D) from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g, dtype=dtype).requires_grad_(requires_grad) for _ in range(3)]


def assert_rows_sum_to_one(P: torch.Tensor, atol: float = 1e-10) -> None:
    torch.testing.assert_close(P.sum(-1), torch.ones_like(P[..., 0]), atol=atol, rtol=0)


def assert_no_future(P: torch.Tensor) -> None:
    L = P.shape[-1]
    future = torch.ones(L, L, dtype=torch.bool).triu(1)
    assert (P[..., future] == 0).all(), "causal attention puts weight on the future"


def assert_support(P: torch.Tensor, allowed: torch.Tensor) -> None:
    """Weights are positive exactly on ``allowed`` (L, L) and zero elsewhere."""
    allowed = allowed.to(torch.bool).expand_as(P)
    assert (P[allowed] > 0).all(), "an allowed key gets zero weight (support too small)"
    assert (P[~allowed] == 0).all(), "a disallowed key gets positive weight (support too large)"


def assert_output_matches_matrix(attn: Attention, q, k, v, atol: float = 1e-10) -> None:
    """``forward(q, k, v) == attention_matrix(q, k, v) @ v``."""
    attn.eval()
    out = attn(q, k, v)
    P = attn.attention_matrix(q, k, v)
    torch.testing.assert_close(out, P @ v, atol=atol, rtol=0)


def assert_causal_perturbation(attn: Attention, q, k, v, t: int) -> None:
    """Changing k, v (and q) at position t changes no output before t."""
    attn.eval()
    out = attn(q, k, v)
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[..., t, :] += 3.0
    out2 = attn(q2, k2, v2)
    torch.testing.assert_close(out[..., :t, :], out2[..., :t, :], atol=1e-12, rtol=0)
    assert not torch.allclose(out[..., t:, :], out2[..., t:, :]), "perturbation had no effect at all"


def dense_masked_attention(q, k, v, allowed: torch.Tensor) -> torch.Tensor:
    """Reference softmax attention restricted to ``allowed`` (L, L) bool, with 1/sqrt(D) scaling."""
    logits = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    logits = logits.masked_fill(~allowed, float("-inf"))
    return logits.softmax(-1) @ v


def matrix_from_forward(attn: Attention, q, k) -> torch.Tensor:
    """The weights the FAST path applies: ``forward(q, k, I)`` with one-hot values ``(B, H, L, L)``.

    Valid for variants whose output is linear in v with weights independent of v (value width free).
    """
    attn.eval()
    B, H, L, _ = q.shape
    eye = torch.eye(L, dtype=q.dtype, device=q.device).expand(B, H, L, L)
    return attn(q, k, eye)


def assert_clean_partition(direct: torch.Tensor, regions: torch.Tensor, region_allowed: torch.Tensor, causal: bool) -> None:
    """Per query, direct keys and the members of its allowed regions cover the allowed keys exactly once.

    ``direct`` (L, L) bool, ``regions`` (R, L) bool membership, ``region_allowed`` (L, R) bool.
    """
    L = direct.shape[0]
    coverage = direct.to(torch.int64) + region_allowed.to(torch.int64) @ regions.to(torch.int64)  # (L, L)
    expected = torch.ones(L, L, dtype=torch.int64)
    if causal:
        expected = expected.tril()
    assert torch.equal(coverage, expected), "direct keys and regions do not cover the allowed keys exactly once"
    assert direct.diagonal().all(), "self must be attended directly"
    assert regions.any(-1).all(), "empty region in the partition"


def assert_region_rank_one(P: torch.Tensor, regions: torch.Tensor, region_allowed: torch.Tensor, atol: float = 1e-10) -> None:
    """Within a region, every query's weights are proportional to one inner distribution p(j|R).

    For each region R the block ``P[..., queries using R, members of R]`` is rank one: normalizing
    each row to sum 1 gives the same row for every query.
    """
    for r in range(regions.shape[0]):
        users = region_allowed[:, r].nonzero().flatten()
        if users.numel() == 0:
            continue
        block = P[..., users, :][..., regions[r]]  # (B, H, |users|, |R|)
        rows = block / block.sum(-1, keepdim=True)
        torch.testing.assert_close(rows, rows[..., :1, :].expand_as(rows), atol=atol, rtol=0)


def padding_patterns(L: int, seed: int = 0) -> torch.Tensor:
    """(6, L) bool key padding masks (True = pad): none, all, a ragged tail, a leading stretch (left
    padding), an interior stretch, and random positions."""
    g = torch.Generator().manual_seed(seed)
    pad = torch.zeros(6, L, dtype=torch.bool)
    pad[1] = True
    pad[2, (2 * L) // 3 + 1 :] = True
    pad[3, : L // 3] = True
    pad[4, L // 4 : L // 2] = True
    pad[5] = torch.rand(L, generator=g) < 0.4
    return pad


def assert_combiner_key_padding(attn: Attention, q, k, v, pad: torch.Tensor, atol: float = 1e-10) -> None:
    """A Combiner variant under key padding ``pad`` (B, L) bool, True = pad (eval mode, fp64).

    ``forward == attention_matrix @ v``, rows sum to one, no future when causal, no weight from a real query
    on a padded key, full support over the real keys a real query may see, and padded keys' contents
    (k and v) do not reach real queries' outputs.
    """
    attn.eval()
    B, L = pad.shape
    P = attn.attention_matrix(q, k, v, key_padding_mask=pad)
    out = attn(q, k, v, key_padding_mask=pad)
    torch.testing.assert_close(out, P @ v, atol=atol, rtol=0)
    assert_rows_sum_to_one(P, atol=atol)
    allowed = torch.ones(L, L, dtype=torch.bool)
    if attn.causal:
        assert_no_future(P)
        allowed = allowed.tril()
    real_query = ~pad[:, None, :, None]
    padded_key = pad[:, None, None, :]
    assert (P[(real_query & padded_key).expand_as(P)] == 0).all(), "a real query puts weight on a padded key"
    assert (P[(real_query & ~padded_key & allowed).expand_as(P)] > 0).all(), "a real key lost its weight"
    k2, v2 = k.clone(), v.clone()
    k2[pad[:, None, :].expand_as(k[..., 0])] += 3.0
    v2[pad[:, None, :].expand_as(v[..., 0])] -= 5.0
    real = ~pad[:, None, :].expand_as(out[..., 0])
    torch.testing.assert_close(attn(q, k2, v2, key_padding_mask=pad)[real], out[real], atol=atol, rtol=0)
