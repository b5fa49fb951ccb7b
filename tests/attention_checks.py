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
    assert P[..., future].abs().max().item() == 0.0, "causal attention puts weight on the future"


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
