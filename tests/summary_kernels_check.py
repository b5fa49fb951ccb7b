"""The fused summaries' Triton kernels against their plain-torch reference, on the CPU: run as a script with
``TRITON_INTERPRET=1`` (the interpreter must be chosen before Triton compiles anything, so in a process of its own),
it prints one JSON line per case with the largest differences of the KV and of the q, k, v gradients (fp64)::

    TRITON_INTERPRET=1 python tests/summary_kernels_check.py combiner_fixed:causal:max:copies ...

A case is ``name:causal|bidirectional:pool[:copies][:knob=value]``; ``copies`` lays the summaries out twice (the
copies' slots, as a long sequence has them)."""

from __future__ import annotations

import json
import sys

import torch

L, B, H, D, BLOCK = 64, 2, 2, 8, 8


def check(case: str) -> dict:
    from longseq.attention import ATTENTION_REGISTRY, build_attention
    from longseq.attention.ops.flex import summary_launch
    from longseq.attention.ops.flex.block_masks import summary_copies_every
    from longseq.attention.ops.flex.calls import tile_size, whole_tiles
    from longseq.attention.ops.flex.regions import REDUCES, FusedKV, reference_summary_kv
    from longseq.attention.registry import accepted_kwargs

    name, direction, pool, *rest = case.split(":")
    knobs = dict(item.split("=") for item in rest if "=" in item)
    accepted = accepted_kwargs(ATTENTION_REGISTRY[name].cls)
    if "summary" in accepted:
        knobs["summary"] = pool
    if "block_size" in accepted:
        knobs["block_size"] = BLOCK
    attn = build_attention(name, causal=direction == "causal", seq_len=L, n_heads=H, head_dim=D, **knobs)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=generator, dtype=torch.float64) for _ in range(3))
    scale = D ** -0.5
    worst = {"kv": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0, "calls": 0}
    with summary_copies_every(L // 2 if "copies" in rest else None):
        for call in attn.flex_calls(L, torch.device("cpu")):
            if call.regions is None:
                continue
            fused = FusedKV.of(call, L, whole_tiles(call.kv_len(L), tile_size(L)))
            r = fused.regions
            tables = (r.start, r.stride, r.count, r.skip, r.anchor)
            pool_number = REDUCES.index(r.reduce)
            got = summary_launch.launch_forward(q, k, v, *tables, fused.slot_source, fused.dst, scale, pool_number,
                                                r.max_count, r.heads_last)
            inputs = [x.clone().requires_grad_() for x in (q, k, v)]
            want = reference_summary_kv(*inputs, fused, scale)
            upstream = [torch.randn(x.shape, generator=generator, dtype=x.dtype) for x in want]
            want_grads = torch.autograd.grad(want, inputs, upstream)
            got_grads = summary_launch.launch_backward(q, k, v, *tables, fused.dst, fused.key_slot, fused.indptr,
                                                       fused.indices, *upstream, scale, pool_number, r.max_count)
            worst["kv"] = max(worst["kv"], *((a - b).abs().max().item() for a, b in zip(got, want)))
            for key, a, b in zip(("dq", "dk", "dv"), got_grads, want_grads):
                worst[key] = max(worst[key], (a - b).abs().max().item())
            worst["calls"] += 1
    return {"case": case, **worst}


if __name__ == "__main__":
    for case in sys.argv[1:]:
        print(json.dumps(check(case)), flush=True)
