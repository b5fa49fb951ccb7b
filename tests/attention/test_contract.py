"""The attention contract, parametrized over every registered name (xformers-style registry tests).

Each variant is built exactly as training builds it: from ``conf/attention/<name>.yaml`` resolved against
a small task geometry. Variant-specific properties (exact sparse support, Combiner full support, partitions)
live in the per-family test files; this file guarantees that nothing registered escapes the contract.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CASES, L, build, check_contract, modes, random_qkv

from longseq.attention import ATTENTION_REGISTRY, AttentionConfigError
from longseq.attention.registry import accepted_kwargs
from longseq.runner import train


@pytest.mark.parametrize("name,causal", CASES)
def test_contract(name, causal):
    check_contract(name, causal)


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
