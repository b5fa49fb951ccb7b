"""The attention contract, parametrized over every registered name (xformers-style registry tests).

Each variant is built exactly as training builds it: from ``conf/attention/<name>.yaml`` resolved against
a small task geometry. Variant-specific properties (exact sparse support, Combiner full support, partitions)
live in the per-family test files; this file guarantees that nothing registered escapes the contract.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from attention_checks import assert_no_future, assert_rows_sum_to_one, random_qkv
from conftest import CONF
from longseq.attention import ATTENTION_REGISTRY, build_attention
from longseq.runner import train

L, BLOCK = 16, 4


def build(name: str, causal: bool, seq_len: int = L, n_heads: int = 2, head_dim: int = 8):
    """The attention ``name`` built from its YAML with a (seq_len, block 4, 4 clusters) task geometry."""
    spec = OmegaConf.load(CONF / "attention" / f"{name}.yaml")
    task = {"causal": causal, "seq_len": seq_len, "block_size": BLOCK, "n_clusters": 4}
    root = OmegaConf.create({"task": task, "attention": spec, "partition": {"name": "fixed", "block_size": BLOCK}})
    kwargs = OmegaConf.to_container(root.attention, resolve=True)
    kwargs["causal"] = causal
    return build_attention(kwargs.pop("name"), seq_len=seq_len, n_heads=n_heads, head_dim=head_dim, **kwargs)


def modes(name: str) -> list[bool]:
    cls = ATTENTION_REGISTRY[name].cls
    return [c for c, ok in ((True, cls.supports_causal), (False, cls.supports_bidirectional)) if ok]


CASES = [(name, causal) for name in sorted(ATTENTION_REGISTRY) for causal in modes(name)]


@pytest.mark.parametrize("name,causal", CASES)
def test_contract(name, causal):
    torch.manual_seed(0)
    attn = build(name, causal).double().eval()
    q, k, v = random_qkv(B=2, H=2, L=L, D=8)
    out = attn(q, k, v)
    assert out.shape == q.shape and torch.isfinite(out).all()
    P = attn.attention_matrix(q, k, v)
    assert P.shape == (2, 2, L, L)
    if getattr(attn, "normalized", True):
        assert_rows_sum_to_one(P, atol=1e-8)
    if getattr(attn, "exact_matrix", True):
        torch.testing.assert_close(out, P @ v, atol=1e-8, rtol=1e-6)
    if causal:
        assert_no_future(P)


@pytest.mark.parametrize("name,causal", CASES)
def test_gradients_reach_inputs(name, causal):
    attn = build(name, causal).train()
    q, k, v = random_qkv(B=1, H=2, L=L, D=8, dtype=torch.float32, requires_grad=True)
    attn(q, k, v).square().sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0


@pytest.mark.parametrize("name", sorted(n for n in ATTENTION_REGISTRY if ATTENTION_REGISTRY[n].cls.supports_causal))
def test_trains_three_steps_on_digits(name, make_cfg):
    """``python train.py task=digits attention=<name> trainer.max_steps=3``, in process."""
    metrics = train(make_cfg([f"attention={name}", "trainer.max_steps=3", "test=false"]))
    assert 0 < metrics["val/bpd"] < 10
