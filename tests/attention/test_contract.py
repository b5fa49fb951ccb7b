"""The attention contract, parametrized over every registered name (xformers-style registry tests).

Each variant is built exactly as training builds it: from ``conf/attention/<name>.yaml`` resolved against
a small task geometry. Variant-specific properties (exact sparse support, Combiner full support, partitions)
live in the per-family test files; this file guarantees that nothing registered escapes the contract.
"""

from __future__ import annotations

import pytest
import torch
from conftest import fast_variants_first
from helpers import (
    CASES,
    L,
    build,
    check_block_size_validation,
    check_contract,
    random_qkv,
    takes_block_size,
)

from longseq.attention import ATTENTION_REGISTRY
from longseq.attention.ops.geometry import BlockGrid
from longseq.runner import train

CAUSAL_NAMES = [name for name in sorted(ATTENTION_REGISTRY) if ATTENTION_REGISTRY[name].cls.supports_causal]


@pytest.mark.parametrize("name,causal", CASES)
def test_contract(name, causal):
    check_contract(name, causal)


@pytest.mark.parametrize("name,causal", CASES)
def test_gradients_reach_inputs(name, causal):
    attn = build(name, causal).train()
    q, k, v = random_qkv(B=1, H=2, L=L, D=8, dtype=torch.float32, requires_grad=True)
    attn(q, k, v).square().sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0


@pytest.mark.parametrize("name", fast_variants_first(CAUSAL_NAMES))
def test_trains_three_steps_on_digits(name, make_cfg):
    """``python train.py task=digits attention=<name> trainer.max_steps=3``, in process (``conftest.FAST_VARIANTS`` in
    the fast suite, every other variant in the slow one; every variant's forward and backward are in the contract
    above). Without the end-of-training sample grid: it took 3 of a run's 8 s, and every attention's decoding is
    checked in test_decoding.py."""
    metrics = train(make_cfg([f"attention={name}", "trainer.max_steps=3", "test=false",
                              "callbacks.samples.n_samples=0"]))
    assert 0 < metrics["val/bpd"] < 10


@pytest.mark.parametrize("name,causal", CASES)
def test_accepts_the_backbones_strided_layout(name, causal):
    """The backbone hands q, k, v as a transposed (B, L, H, D) view; results must not depend on strides."""
    attn = build(name, causal).double().eval()
    q, k, v = random_qkv(B=2, H=2, L=L, D=8)
    strided = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    assert not strided[0].is_contiguous()
    torch.testing.assert_close(attn(*strided), attn(q, k, v), atol=1e-12, rtol=0)


@pytest.mark.parametrize("name,causal", CASES)
def test_accepts_sdpa_outputs_in_cudas_layout(name, causal, monkeypatch):
    """CUDA's SDPA kernels return (B, L, H, D)-strided outputs (a ``.view`` of them failed on an H200); with SDPA
    made to do that here, every explicit path gives the same result."""
    attn = build(name, causal, backend="explicit").double().eval()
    q, k, v = random_qkv(B=2, H=2, L=L, D=8)
    expected = attn(q, k, v)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def cuda_strided_sdpa(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2) if out.dim() == 4 and out.shape[1] > 1 else out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", cuda_strided_sdpa)
    torch.testing.assert_close(attn(q, k, v), expected, atol=1e-12, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", CAUSAL_NAMES)
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


@pytest.mark.parametrize("name", [n for n in sorted(ATTENTION_REGISTRY) if takes_block_size(n)])
def test_block_size_is_validated_the_same_way_everywhere(name):
    """Every variant with an ``attention.block_size`` (by its constructor keywords, not its name) rejects 4.7, 4.0,
    0, -8, True, "8" and a non-divisor of the length, naming the key and the valid values (``helpers``)."""
    check_block_size_validation(name)


def test_block_size_variants_include_every_grid_family():
    """The selection above is not vacuous: grid variants of the sparse, Combiner and efficient families and the
    clustering ones take a block size."""
    families = {ATTENTION_REGISTRY[n].cls.family for n in ATTENTION_REGISTRY if takes_block_size(n)}
    assert {"sparse", "combiner", "efficient"} <= families
    assert any(not issubclass(ATTENTION_REGISTRY[n].cls, BlockGrid) for n in ATTENTION_REGISTRY if takes_block_size(n))
