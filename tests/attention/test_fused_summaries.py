"""The fused region summaries (``ops.flex.regions.summary_kv``, issue #43): a call's summaries and KV in one Triton
kernel forward and two backward on CUDA, tested on the CPU three ways, each against an independent reference:

- the regions a variant declares (``FlexCall.regions``) are exactly the sets its call summarizes (``FlexCall.members``
  and ``anchors``, which the partition tests tie to ``attention_matrix``);
- the layer computed with the fused operation (its CPU kernel: the plain-torch reference) equals
  ``attention_matrix @ v``, and its q, k, v gradients equal those of the dense reference (fp64);
- the Triton kernels themselves, run by Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, a subprocess:
  tests/summary_kernels_check.py), equal the reference forward and backward (fp64), and compile for sm90.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from helpers import build, random_qkv
from test_flex import dense_flex

from longseq.attention.ops.flex import engine
from longseq.attention.ops.flex.regions import fused_everywhere

L, BLOCK = 32, 4
# (name, causal, knobs): every variant that declares regions, each region kind (pools, prefixes, halves, a row
# without the query's column, anchored rows)
FUSED = [("combiner_fixed", True, {}), ("combiner_fixed", False, {"summary": "mean"}),
         ("combiner_logsparse", True, {}), ("combiner_logsparse", False, {"summary": "mean"}),
         ("combiner_axial", True, {}), ("combiner_axial", False, {"row_summary": "none"}),
         ("combiner_axial_vertical", True, {}), ("combiner_axial_vertical", False, {}),
         ("combiner_axial_horizontal", True, {}), ("combiner_axial_horizontal", False, {"horizontal_regions": "split"}),
         ("combiner_mixture", True, {}), ("combiner_mixture", False, {"plans": "average", "summary": "mean"})]
IDS = [f"{name}-{'causal' if causal else 'bidirectional'}-{'-'.join(map(str, knobs.values())) or 'default'}"
       for name, causal, knobs in FUSED]


def fused_layer(name, causal, knobs):
    attn = build(name, causal, seq_len=L, block_size=BLOCK, backend="flex", **knobs).double().eval()
    return attn, [call for call in attn.flex_calls(L, torch.device("cpu")) if call.regions is not None]


@pytest.mark.parametrize("name,causal,knobs", FUSED, ids=IDS)
def test_the_regions_are_the_sets_the_call_summarizes(name, causal, knobs):
    attn, calls = fused_layer(name, causal, knobs)
    assert calls, f"{name} declares no regions"
    for call in calls:
        members = call.regions.members(L)
        anchors = call.regions.anchor.long()
        if call.summary_order is not None:  # regions in flex_summaries' rows, members in KV order
            members, anchors = members[call.summary_order], anchors[call.summary_order]
        torch.testing.assert_close(members, call.members())
        if call.anchors is not None:
            torch.testing.assert_close(anchors, call.anchors().long())
        else:
            assert (anchors == -1).all()


@pytest.mark.parametrize("name,causal,knobs", FUSED, ids=IDS)
def test_the_fused_layer_and_its_gradients_equal_the_reference(name, causal, knobs, monkeypatch):
    """Values and the gradients of q, k, v and of the layer's own parameters (``combiner_axial``'s learned summary
    keys, mapped by ``longseq::summary_key_map``) against the dense reference (fp64)."""
    from longseq.attention.combiner import key_map

    monkeypatch.setattr(engine, "flex_call", dense_flex)
    attn, _ = fused_layer(name, causal, knobs)
    used = []
    run, run_map = engine.summary_kv, key_map.summary_key_map
    monkeypatch.setattr(engine, "summary_kv", lambda *args: used.append("kv") or run(*args))
    monkeypatch.setattr(key_map, "summary_key_map", lambda *args: used.append("key_map") or run_map(*args))
    q, k, v = random_qkv(L=L, seed=3, requires_grad=True)
    inputs = (q, k, v, *attn.parameters())
    upstream = torch.randn_like(q)
    with fused_everywhere():
        out = engine.flex_forward(attn, q, k, v)
    grads = torch.autograd.grad(out, inputs, upstream)
    reference = attn.attention_matrix(q, k, v) @ v
    torch.testing.assert_close(out, reference, atol=1e-12, rtol=0)
    for got, want in zip(grads, torch.autograd.grad(reference, inputs, upstream), strict=True):
        torch.testing.assert_close(got, want, atol=1e-11, rtol=0)
    assert "kv" in used
    assert ("key_map" in used) == (getattr(attn, "row_summary", None) == "proj")


@pytest.mark.parametrize("name", ["combiner_fixed", "combiner_logsparse"])
def test_layers_that_pool_differently_never_share_a_layout(name, monkeypatch):
    """The fused summaries' tables hold the pooling, so a layer pooling by mean built after one pooling by max (same
    geometry, one process) gets a layout of its own and its own result (they once shared the first one's)."""
    from longseq.attention.ops.flex import block_masks

    monkeypatch.setattr(block_masks, "_REGISTRY", {})
    monkeypatch.setattr(engine, "flex_call", dense_flex)
    q, k, v = random_qkv(L=L, seed=5)
    for summary in ("max", "mean"):
        attn, _ = fused_layer(name, False, {"summary": summary})
        with fused_everywhere():
            out = engine.flex_forward(attn, q, k, v)
        torch.testing.assert_close(out, attn.attention_matrix(q, k, v) @ v, atol=1e-12, rtol=0)
    assert len(block_masks._REGISTRY) == 2


KERNEL_CASES = ["combiner_fixed:causal:max:copies", "key_map", "combiner_fixed:bidirectional:mean",
                "combiner_logsparse:causal:max", "combiner_mixture:bidirectional:max",
                "combiner_axial_horizontal:causal:max", "combiner_axial:causal:max",
                "combiner_axial:bidirectional:max:row_summary=none"]


# the interpreter runs a kernel's programs one by one (about 35 s a case here): the fast suite checks the case with the
# most paths (max pools, copies of the summaries, prefixes) and combiner_axial's key map (8 s), the slow suite the rest
KERNEL_GROUPS = [KERNEL_CASES[:2], pytest.param(KERNEL_CASES[2:], marks=pytest.mark.slow)]


@pytest.mark.parametrize("cases", KERNEL_GROUPS)
def test_the_triton_kernels_equal_the_reference_in_the_interpreter(cases):
    """Each case's calls with regions: the forward's KV and the backward's q, k, v gradients of the kernels, run by
    Triton's interpreter, against the plain-torch reference and its autograd (fp64): max and mean pools, anchors,
    prefixes, halves, the log-sparse blocks, copies of the summaries, heads-last KV; and ``combiner_axial``'s learned
    summary keys (``combiner.key_map``): the mapped keys, the values passed through, the six gradients."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "summary_kernels_check.py"), *cases],
                          capture_output=True, text=True, env=env, timeout=900)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(cases), done.stderr[-3000:]
    for row in rows:
        assert row["calls"] >= 1, row
        assert max(value for key, value in row.items() if key not in ("case", "calls")) < 1e-12, row


def sm90_signature(kernel, pointer: str, consts: dict) -> dict[str, str]:
    """Triton's signature of ``kernel`` for one compilation: data pointers of ``pointer`` type, tables and argmaxes
    int32, per-region scratch fp32, the scale fp32, every other scalar int32."""
    int_pointers = ("start", "stride", "count", "skip", "anchor", "slot_source", "dst", "key_slot", "indptr", "indices",
                    "q_arg_out", "k_arg_out", "q_arg_in", "k_arg_in")
    scratch = ("q_bar_out", "dq_bar_out", "dk_bar_out", "dv_bar_out", "lse_out", "delta_out", "q_bar_in", "dq_bar_in",
               "dk_bar_in", "dv_bar_in", "lse_in", "delta_in")
    data = ("q", "k", "v", "k_out", "v_out", "dk_kv", "dv_kv", "dq_out", "dk_out", "dv_out")
    kinds = {**dict.fromkeys(int_pointers, "*i32"), **dict.fromkeys(scratch, "*fp32"), **dict.fromkeys(data, pointer),
             "scale": "fp32"}
    return {arg: "constexpr" if arg in consts else kinds.get(arg, "i32") for arg in inspect.signature(kernel.fn).parameters}


SM90_SHARED = 232448  # bytes of shared memory a block may take on an H100 / H200 (227 KB, opted in)


def compile_for_sm90(kernel, signature: dict, consts: dict, num_warps: int = 4, num_stages: int = 3):
    """``kernel`` compiled to an sm90 cubin on this CPU; its shared memory checked against what a block may take (a
    kernel over it compiles, then fails at its launch on the GPU: "out of resources")."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=kernel, signature=signature, constexprs=consts)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    assert compiled.asm["cubin"]
    assert compiled.metadata.shared <= SM90_SHARED, (kernel.fn.__name__, compiled.metadata.shared)
    return compiled


@pytest.mark.parametrize("pool", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_the_kernels_compile_for_sm90(pool):
    """The interpreter does not type-check what the compiler does (a loop-carried value changing dtype compiles
    nowhere): each kernel compiles to an sm90 cubin on this CPU within a block's shared memory (bf16, D 64; max pools
    in the fast suite)."""
    import triton.language as tl

    from longseq.attention.ops.flex import summary_kernels

    common = dict(D=64, DV=64, BLOCK_D=64, BLOCK_DV=64, POOL=pool, ACC=tl.float32)
    for kernel, extra in ((summary_kernels.summary_kv_forward, {"BLOCK_M": 64, "BLOCK_J": 64}),
                          (summary_kernels.summary_kv_backward_regions, {"BLOCK_M": 64}),
                          (summary_kernels.summary_kv_backward_positions, {"BLOCK_T": 32})):
        consts = {**common, **extra}
        compile_for_sm90(kernel, sm90_signature(kernel, "*bf16", consts), consts)


# W 512 (H 8, D 64) and the widest the kernels take: about 20 s of ptxas each here; the fast suite compiles a narrower
# row (the same code, typed the same)
@pytest.mark.parametrize("width", [128, pytest.param(512, marks=pytest.mark.slow),
                                   pytest.param(1024, marks=pytest.mark.slow)])
def test_the_key_map_kernels_compile_for_sm90(width):
    """``combiner_axial``'s learned summary keys (``combiner.key_map_kernels``) compile to sm90 cubins on this CPU as
    a bf16 layer runs them (bf16 rows; fp32 parameters, partial sums and epsilon; the launchers' tile, warps and
    stages), within a block's shared memory."""
    import triton.language as tl

    from longseq.attention.combiner import key_map, key_map_kernels

    fp32 = ("w_in", "gamma", "beta", "w_out", "dgamma_part", "dbeta_part", "dw_in", "dw_out", "dgamma", "dbeta")
    rows = ("x", "r", "keys_out", "values_out", "dk", "dv", "dx_out", "dr_out", "n_out", "dh_out", "n", "dh")
    kinds = {**dict.fromkeys(fp32, "*fp32"), **dict.fromkeys(rows, "*bf16"), "eps": "fp32"}
    common = dict(BLOCK_T=key_map.BLOCK_T, BLOCK_K=key_map.BLOCK_K, ACC=tl.float32)
    row_tile = key_map._row_tile(width)
    launch = dict(num_warps=row_tile.pop("num_warps"), num_stages=row_tile.pop("num_stages"))
    assert key_map.supports(width)
    for kernel, extra, options in ((key_map_kernels.key_map_forward, row_tile, launch),
                                   (key_map_kernels.key_map_backward_rows, row_tile, launch),
                                   (key_map_kernels.key_map_backward_weights, {}, {})):
        consts = {**common, **extra}
        signature = {arg: "constexpr" if arg in consts else kinds.get(arg, "i32")
                     for arg in inspect.signature(kernel.fn).parameters}
        compile_for_sm90(kernel, signature, consts, **options)
