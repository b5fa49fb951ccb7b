"""Mixed precision: every registered attention under ``torch.autocast`` (bf16 on CPU), the hand-written
autograd functions under autocast, and ``trainer.precision=bf16-mixed`` training.

Tolerances (bf16 keeps 8 mantissa bits, eps = 2^-8 ~ 0.004): relative Frobenius error to the fp32 result
``||x_bf16 - x_fp32|| / ||x_fp32||`` at most ``OUTPUT_RTOL`` for outputs and ``GRAD_RTOL`` for the
gradients of q, k, v and of the attention's parameters (loss ``sum(out^2)``; gradients pass through more
rounded products, and kernel / learned-logit methods such as ``nystrom`` and ``synthesizer`` reach ~0.14).
A dtype mix-up in a hand-written backward gives O(1) errors or raises.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch
from dataset_files import write_cifar10_fixture
from helpers import CASES, build, random_qkv

import longseq.attention
from longseq.attention import ATTENTION_REGISTRY
from longseq.attention.ops.cpu.grid_flash import FlashPart, grid_flash_attention
from longseq.attention.ops.joint_softmax import LogitGroup, joint_groups_attention
from longseq.attention.ops.prefix_sums import causal_kernel_attention
from longseq.runner import train

OUTPUT_RTOL = 0.02
GRAD_RTOL = 0.2


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx.float() - exact).norm() / exact.norm()).item()


def output_and_grads(attn, q, k, v, autocast: bool):
    """forward + backward of ``sum(out^2)``; returns (out, {name: grad}) over q, k, v and parameters."""
    for x in (q, k, v):
        x.grad = None
    attn.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = attn(q, k, v)
    out.float().square().sum().backward()
    grads = {"q": q.grad, "k": k.grad, "v": v.grad, **{n: p.grad for n, p in attn.named_parameters()}}
    return out, {n: g for n, g in grads.items() if g is not None}


@pytest.mark.parametrize("name,causal", CASES)
def test_bf16_autocast_matches_fp32(name, causal):
    """fp32 q, k, v inside ``torch.autocast("cpu", bfloat16)``: forward and backward run and stay close to fp32."""
    torch.manual_seed(0)
    attn = build(name, causal).eval()
    q, k, v = random_qkv(B=2, H=2, L=16, D=8, dtype=torch.float32, requires_grad=True)
    ref, ref_grads = output_and_grads(attn, q, k, v, autocast=False)
    out, grads = output_and_grads(attn, q, k, v, autocast=True)
    assert out.dtype in (torch.bfloat16, torch.float32) and torch.isfinite(out).all()
    assert relative_error(out, ref) <= OUTPUT_RTOL
    assert grads.keys() == ref_grads.keys() and "v" in grads
    for key, grad in grads.items():
        assert grad.dtype == ref_grads[key].dtype, f"gradient of {key} changed dtype"
        assert relative_error(grad, ref_grads[key]) <= GRAD_RTOL, f"gradient of {key}"


@pytest.mark.parametrize("name,causal", CASES)
def test_bf16_inputs_without_autocast(name, causal):
    """bf16 q, k, v handed to an fp32 module outside any autocast region (e.g. ``attention_matrix`` on tensors
    captured from a bf16-mixed forward): forward and ``attention_matrix`` run and stay close to fp32."""
    torch.manual_seed(0)
    attn = build(name, causal).eval()
    q, k, v = random_qkv(B=2, H=2, L=16, D=8, dtype=torch.float32)
    half = [x.bfloat16() for x in (q, k, v)]
    with torch.no_grad():
        out, matrix = attn(*half), attn.attention_matrix(*half)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all() and torch.isfinite(matrix).all()
        assert relative_error(out, attn(q, k, v)) <= OUTPUT_RTOL
        assert relative_error(matrix, attn.attention_matrix(q, k, v)) <= OUTPUT_RTOL


def custom_functions() -> list[type[torch.autograd.Function]]:
    """Every ``torch.autograd.Function`` defined in the attention package."""
    found = {}
    for info in pkgutil.walk_packages(longseq.attention.__path__, prefix="longseq.attention."):
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, torch.autograd.Function) and obj.__module__ == module.__name__:
                found[obj.__qualname__] = obj
    return list(found.values())


def test_every_custom_function_is_autocast_safe():
    functions = custom_functions()
    assert {"_GridFlash", "_JointGroupsAttention", "LevelScores"} <= {
        f.__name__ for f in functions
    }
    unsafe = [f.__name__ for f in functions if not getattr(f, "autocast_safe", False)]
    assert not unsafe, f"decorate with longseq.attention.ops.amp.autocast_function: {unsafe}"


def row_column_inputs(n=3, m=4, D=8, seed=0):
    """Inputs of the row-major Combiner joint functions: q/k/v rows (1, 2, n, m, D), column summaries (1, 2, m, n, D)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(1, 2, n, m, D, generator=g) for _ in range(3)]
    cols = [torch.randn(1, 2, m, n, D, generator=g) for _ in range(3)]
    return rows, cols


def joint_call(rows, cols):
    """The row-major Combiner's joint softmax: own row (row layout) + other rows' summaries (column layout)."""
    n = rows[0].shape[2]
    groups = [LogitGroup("row", rows[1], rows[2], None), LogitGroup("col", cols[1], cols[2], ~torch.eye(n, dtype=torch.bool))]
    return joint_groups_attention(groups, rows[0], cols[0])


def flash_call(rows, cols):
    """The CPU engine's causal row/column merge (``_GridFlash``): own row (row layout) + the column entries of the
    earlier rows, given in column layout (the column queries are the row queries themselves)."""
    n, m, D = rows[0].shape[2:]
    BH = rows[0].shape[0] * rows[0].shape[1]
    rows4 = [x.reshape(BH, n, m, D) for x in rows]
    cols4 = [x.reshape(BH, m, n, D) for x in cols[1:]]
    parts = [FlashPart("row", (0, n, 0, m), (0, n, 0, m), (0, 1, 2), causal=True),
             FlashPart("col", (1, n, 0, m), (0, n - 1, 0, m), (0, 3, 4), causal=True)]
    return grid_flash_attention(parts, [*rows4, *cols4], ["row"] * 3 + ["col"] * 2, D**-0.5)


def causal_kernel_call(rows, cols):
    """Causal kernel attention, states carried across tiles: (1, 2, 12, 8) features and values, tiles of one chunk of 4."""
    fq, fk, v = (x.flatten(2, 3) for x in (rows[0], rows[1], cols[1].transpose(2, 3)))
    return causal_kernel_attention(fq.abs(), fk.abs(), v, chunk_size=4, tile_size=1)


@pytest.mark.parametrize("call", [joint_call, flash_call, causal_kernel_call],
                         ids=["joint", "causal_flash", "causal_kernel"])
@pytest.mark.parametrize("backward_in_autocast", [False, True])
def test_function_under_autocast_equals_plain_bf16(call, backward_in_autocast):
    """Mixed fp32/bf16 inputs inside autocast give exactly the all-bf16 result outside autocast, gradients
    included, even when ``backward()`` itself is called inside the autocast region."""
    rows, cols = row_column_inputs()
    cols[1] = cols[1].bfloat16()  # a summary key from an autocast Linear arrives in bf16 next to fp32 queries
    inputs = [x.clone().requires_grad_() for x in rows + cols]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = call(inputs[:3], inputs[3:])
        if backward_in_autocast:
            out.float().square().sum().backward()
    if not backward_in_autocast:
        out.float().square().sum().backward()
    plain = [x.detach().bfloat16().requires_grad_() for x in rows + cols]
    expected = call(plain[:3], plain[3:])
    expected.float().square().sum().backward()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    used = [i for i, x in enumerate(plain) if x.grad is not None]
    assert len(used) >= 3 and all(inputs[i].grad is not None for i in used)
    for i in used:
        original = (rows + cols)[i]
        assert inputs[i].grad.dtype == original.dtype  # autograd hands each input its own dtype back
        torch.testing.assert_close(inputs[i].grad, plain[i].grad.to(original.dtype), atol=0, rtol=0)


def test_function_outside_autocast_is_unchanged():
    """No autocast: fp64 stays fp64 (the exactness tests run this path)."""
    rows, cols = row_column_inputs()
    out = joint_call([x.double() for x in rows], [x.double() for x in cols])
    assert out.dtype == torch.float64


CAUSAL_NAMES = sorted(n for n in ATTENTION_REGISTRY if ATTENTION_REGISTRY[n].cls.supports_causal)


def bf16_mixed_run(name: str, make_cfg) -> dict:
    """``train.py task=digits attention=<name> trainer.precision=bf16-mixed trainer.max_steps=3`` in process."""
    return train(make_cfg([f"attention={name}", "trainer.accelerator=cpu", "trainer.precision=bf16-mixed",
                           "trainer.max_steps=3", "test=false"]))


def test_bf16_mixed_trains_on_cpu(make_cfg):
    metrics = bf16_mixed_run("combiner_axial", make_cfg)
    assert 0 < metrics["val/bpd"] < 10


@pytest.mark.slow
@pytest.mark.parametrize("name", CAUSAL_NAMES)
def test_bf16_mixed_trains_every_attention(name, make_cfg):
    metrics = bf16_mixed_run(name, make_cfg)
    assert 0 < metrics["val/bpd"] < 10


BIDIRECTIONAL_ONLY_NAMES = sorted(n for n in ATTENTION_REGISTRY if not ATTENTION_REGISTRY[n].cls.supports_causal)


@pytest.mark.slow
@pytest.mark.parametrize("name", BIDIRECTIONAL_ONLY_NAMES)
def test_bf16_mixed_trains_every_bidirectional_only_attention(name, make_cfg, tmp_path):
    """The attentions digits cannot run (no causal mode) train under bf16-mixed on LRA Image (L = 1024, a
    CIFAR-10 fixture in its real format)."""
    write_cifar10_fixture(tmp_path)
    metrics = train(make_cfg([
        "task=lra_image", f"paths.data_dir={tmp_path}", "task.data.download=false",
        "task.data.verify_checksums=false", "task.data.val_size=4", f"attention={name}",
        "trainer.accelerator=cpu", "trainer.precision=bf16-mixed", "trainer.max_steps=3",
        "trainer.limit_val_batches=1", "task.batch_size=2", "model.n_layers=1", "model.d_model=32",
        "model.n_heads=2", "test=false",
    ]))
    assert 0 < metrics["val/loss"] < 10 and 0 <= metrics["val/acc"] <= 1
