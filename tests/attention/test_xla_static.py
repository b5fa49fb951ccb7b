"""Every attention on an XLA device without torch_xla: the backend the dispatch gives it there (``ops.dispatch``,
facts of an ``xla`` call) runs a training step with no read of a device tensor's values, on the meta device (it
takes the non-CPU branches and has no values to read), or the variant is refused naming why; the ``xla`` backend's
static-shape forms equal the explicit paths. What needs torch_xla itself (values on the XLA device against the CPU's,
compilations per step, ``train.py trainer=tpu``) runs in ``make xla-check``."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import CASES, L, build, random_qkv
from host_reads import NoDeviceReads

from longseq.attention import ATTENTION_REGISTRY
from longseq.attention.ops import dispatch

XLA_CALL = dispatch.Facts("xla", torch.float32, grad=True, value_width=8, head_dim=8)
STATIC_FORMS = [(name, causal) for name, causal in CASES if ATTENTION_REGISTRY[name].cls.xla_path]


@pytest.mark.parametrize("name,causal", CASES)
def test_the_xla_choice_trains_without_reading_a_device_tensor(name, causal):
    attn = build(name, causal)
    choice = dispatch.choose("auto", attn.dispatch_variant(), XLA_CALL)
    if choice.backend is None:  # refused on XLA: only for host reads without a static-shape form, said by name
        assert attn.host_reads and not attn.xla_path and f"attention '{name}'" in choice.refusal
        return
    assert choice.backend == "xla"
    step = build(name, causal, backend=choice.backend).to("meta").train()
    q, k, v = (torch.randn(2, 2, L, 8, device="meta", requires_grad=True) for _ in range(3))
    with NoDeviceReads():
        for _ in range(2):  # the second step too: what the first builds and caches is reused without a read
            step(q, k, v).sum().backward()
    assert step.backends_used == {"xla": "xla"}


def test_the_static_shape_forms_cover_the_block_selecting_variants():
    assert {name for name, _ in STATIC_FORMS} == {"moba", "nsa", "combiner_select"}


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name,causal", STATIC_FORMS)
def test_the_xla_backend_equals_explicit(name, causal, padded):
    """Forward and gradients of the static-shape form (tiles padded to a count the shapes fix) against the explicit
    path's exact tiling, fp64, with and without key padding."""
    reference = build(name, causal, seq_len=2 * L, backend="explicit").double().train()
    static = copy.deepcopy(reference)
    static.backend = "xla"
    mask = torch.zeros(2, 2 * L, dtype=torch.bool)
    mask[1, -7:] = True
    kwargs = {"key_padding_mask": mask} if padded else {}
    results = []
    for attn in (reference, static):
        q, k, v = random_qkv(L=2 * L, requires_grad=True)
        out = attn(q, k, v, **kwargs)
        out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
        results.append((out.detach(), [x.grad for x in (q, k, v)]))
    assert static.backends_used == {"xla": "xla"}
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-12, rtol=0)
    for got, want in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_performer_redraws_on_schedule_without_reading_its_counters():
    """The redraw schedule runs from host copies of ``calls`` / ``draws`` (a device read per step before), restored
    from a checkpoint's state dict."""
    attn = build("performer", True, redraw_interval=2).to("meta").train()
    q, k, v = (torch.randn(1, 2, L, 8, device="meta") for _ in range(3))
    with NoDeviceReads():
        for _ in range(5):
            attn(q, k, v)
    cpu = build("performer", True, redraw_interval=2).train()
    for _ in range(5):
        cpu(*random_qkv(L=L, dtype=torch.float32))
    restored = build("performer", True, redraw_interval=2).train()
    restored.load_state_dict(cpu.state_dict())
    for module in (cpu, restored):
        for _ in range(2):
            module(*random_qkv(L=L, dtype=torch.float32))
    assert int(cpu.draws) == int(restored.draws) == 3  # the seventh call redrew in both
    torch.testing.assert_close(restored.projection, cpu.projection, atol=0, rtol=0)


def test_bigbird_builds_its_tables_from_the_loaded_random_blocks():
    """Its tables come from a host copy of ``random_table`` (never a device read), which loading a state dict
    replaces: a module loaded with another seed's blocks computes what that module computes."""
    n = 8 * L  # 32 blocks of 4: random blocks beyond the window and the global ones
    a, b = (build("bigbird", False, seq_len=n, seed=seed).double() for seed in (1, 2))
    q, k, v = random_qkv(L=n)
    assert not torch.allclose(a(q, k, v), b(q, k, v))
    loaded = build("bigbird", False, seq_len=n, seed=1).double()
    loaded.load_state_dict(b.state_dict())
    torch.testing.assert_close(loaded(q, k, v), b(q, k, v), atol=1e-12, rtol=0)
