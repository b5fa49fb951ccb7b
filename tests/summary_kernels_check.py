"""The fused summaries' Triton kernels against their plain-torch reference, on the CPU: run as a script with
``TRITON_INTERPRET=1`` (the interpreter must be chosen before Triton compiles anything, so in a process of its own),
it prints one JSON line per case with the largest differences of the KV and of the q, k, v gradients (fp64)::

    TRITON_INTERPRET=1 python tests/summary_kernels_check.py combiner_fixed:causal:max:copies ...

A case is ``name:causal|bidirectional:pool[:copies][:knob=value]``; ``copies`` lays the summaries out twice (the
copies' slots, as a long sequence has them). The case ``key_map`` checks ``combiner_axial``'s learned summary keys
(``combiner.key_map``) the same way: the mapped keys and the six gradients (``values``: with their own gradient
added), at a width of two chunks that is not a power of two, over rows that do not fill the last program."""

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


def check_key_map() -> dict:
    from longseq.attention.combiner import key_map

    B, H, KV, D = 2, 3, 45, 24  # W 72: two chunks of 64 features; 90 rows: the last program's rows part empty
    generator = torch.Generator().manual_seed(0)

    def heads_last(shape, scale=1.0):
        return (scale * torch.randn(shape, generator=generator, dtype=torch.float64)).transpose(1, 2)

    keys, values = heads_last((B, KV, H, D)), heads_last((B, KV, H, D))
    W = H * D
    w_in, w_out = (torch.randn(W, W, generator=generator, dtype=torch.float64) / W ** 0.5 for _ in range(2))
    gamma = 1 + 0.1 * torch.randn(W, generator=generator, dtype=torch.float64)
    beta = 0.1 * torch.randn(W, generator=generator, dtype=torch.float64)
    eps = 1e-6
    mapped, copied = key_map.launch_forward(keys, values, w_in, gamma, beta, w_out, eps)
    inputs = [x.clone().requires_grad_() for x in (keys, values, w_in, gamma, beta, w_out)]
    want = key_map._reference_op(*inputs, eps)
    d_keys, d_values = heads_last((B, KV, H, D)), heads_last((B, KV, H, D))
    want_grads = list(torch.autograd.grad(want, inputs, d_keys))
    want_grads[1] = want_grads[1] + d_values
    got_grads = key_map.launch_backward(keys, copied, w_in, gamma, beta, w_out, d_keys, d_values, eps)
    return {"case": "key_map", "kv": max((mapped - want).abs().max().item(), (copied - values).abs().max().item()),
            "grads": max((a - b).abs().max().item() for a, b in zip(got_grads, want_grads, strict=True)),
            "calls": 1}


if __name__ == "__main__":
    for case in sys.argv[1:]:
        print(json.dumps(check_key_map() if case == "key_map" else check(case)), flush=True)
