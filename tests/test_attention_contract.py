"""The attention contract, parametrized over every registered name (xformers-style registry tests).

Each variant is built exactly as training builds it: from ``conf/attention/<name>.yaml`` resolved against
a small task geometry. Variant-specific properties (exact sparse support, Combiner full support, partitions)
live in the per-family test files; this file guarantees that nothing registered escapes the contract.
"""

from __future__ import annotations

import pytest
import torch
from attention_checks import assert_no_future, assert_rows_sum_to_one, random_qkv
from conftest import CONF
from omegaconf import OmegaConf

from longseq.attention import ATTENTION_REGISTRY, AttentionConfigError, build_attention
from longseq.attention.registry import accepted_kwargs
from longseq.runner import train

L, BLOCK = 16, 4


def build(name: str, causal: bool, seq_len: int | None = L, n_heads: int = 2, head_dim: int = 8, **overrides):
    """The attention ``name`` built from its YAML with a (seq_len, block 4, 4 clusters) task geometry;
    ``overrides`` replace resolved knobs (``seq_len=None``: built without a known length)."""
    spec = OmegaConf.load(CONF / "attention" / f"{name}.yaml")
    task = {"causal": causal, "seq_len": seq_len or L, "block_size": BLOCK, "n_clusters": 4}
    root = OmegaConf.create({"task": task, "attention": spec, "partition": {"name": "fixed", "block_size": BLOCK}})
    kwargs = OmegaConf.to_container(root.attention, resolve=True)
    kwargs.update(overrides, causal=causal)
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
    if attn.normalized_rows:
        assert_rows_sum_to_one(P, atol=1e-8)
    if attn.matrix_is_exact:
        torch.testing.assert_close(out, P @ v, atol=1e-8, rtol=1e-6)
    if causal:
        assert_no_future(P)
    assert attn.normalized_rows or attn.name in NOT_NORMALIZED, "only known operators may skip row sums"
    assert attn.matrix_is_exact or attn.name in NOT_EXACT


# Methods whose explicit matrix is an exact linear operator but not a softmax (rows need not sum to 1),
# and FNet, whose hidden-axis DFT makes the output not one (L, L) matrix times v (its own tests cover it).
NOT_NORMALIZED = {"linformer", "nystrom", "fnet"}
NOT_EXACT = {"fnet"}


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


@pytest.mark.parametrize("name,causal", CASES)
def test_accepts_the_backbones_strided_layout(name, causal):
    """The backbone hands q, k, v as a transposed (B, L, H, D) view; results must not depend on strides."""
    attn = build(name, causal).double().eval()
    q, k, v = random_qkv(B=2, H=2, L=L, D=8)
    strided = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    assert not strided[0].is_contiguous()
    torch.testing.assert_close(attn(*strided), attn(q, k, v), atol=1e-12, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(n for n in ATTENTION_REGISTRY if ATTENTION_REGISTRY[n].cls.supports_causal))
def test_train_cli_three_steps(name, tmp_path):
    """The literal acceptance command: ``python train.py task=digits attention=<name> trainer.max_steps=3``."""
    import subprocess
    import sys

    from conftest import ROOT

    out = subprocess.run(
        [sys.executable, "train.py", "task=digits", f"attention={name}", "trainer.max_steps=3",
         "extras.print_config=false", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "test/bpd" in out.stdout


CLUSTERED = {"routing", "combiner_routing"}  # segments of lcm(block_size, n_clusters)
BLOCK_SIZE_NAMES = sorted(n for n in ATTENTION_REGISTRY if "block_size" in accepted_kwargs(ATTENTION_REGISTRY[n].cls))


def block_size_error(name: str, block_size, seq_len: int | None) -> str:
    with pytest.raises(AttentionConfigError, match="attention.block_size") as raised:
        build(name, modes(name)[0], seq_len=seq_len, block_size=block_size)
    return str(raised.value)


def test_block_size_is_validated_the_same_way_everywhere():
    """One validation (``geometry.check_block_size``) for every variant with a block size: non-integers are
    rejected, never floored; zero, negatives and booleans too; the message names the key and the valid values."""
    assert {"fixed", "axial", "strided", "combiner_fixed", "combiner_axial", "combiner_mixture",
            "combiner_axial_vertical", "combiner_axial_horizontal", "combiner_routing"} <= set(BLOCK_SIZE_NAMES)
    for bad in (4.7, 4.0, 0, -4, True, "4"):
        for seq_len, valid in ((L, "valid values: [1, 2, 4, 8, 16]"), (None, "valid values: positive integers")):
            messages = {name: block_size_error(name, bad, seq_len) for name in BLOCK_SIZE_NAMES}
            for name, message in messages.items():
                assert message.startswith(f"attention.block_size={bad!r} is not a positive integer"), name
            # grid variants (the block size divides L) word for word alike; the clustering ones tile L with
            # lcm(block_size, n_clusters), so their hint does not list divisors of L
            grid = {m for n, m in messages.items() if n not in CLUSTERED}
            assert len(grid) == 1 and valid in grid.pop(), messages


@pytest.mark.parametrize("name", BLOCK_SIZE_NAMES)
def test_block_size_that_does_not_divide_the_length_is_rejected(name):
    message = block_size_error(name, 5, L)
    assert "[1, 2, 4, 8, 16]" in message
    attn = build(name, modes(name)[0], seq_len=None, block_size=5)  # length unknown: checked on the first call
    with pytest.raises(AttentionConfigError, match=r"attention\.block_size.*\[1, 2, 4, 8, 16\]"):
        attn(*random_qkv(B=1, H=2, L=L, D=8))
