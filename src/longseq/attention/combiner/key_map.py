"""``combiner_axial``'s learned summary keys (``row_summary=proj``) as one operation, ``longseq::summary_key_map``.

The map (``reference_key_map``) takes each summary value ``x`` and its row-mate's key ``r``, flattened over heads
(width ``W = H * D``): ``k = LayerNorm(x W_in^T + r) W_out^T``. Written as two ``F.linear`` and a ``layer_norm``, inductor
compiles it, with its backward and the recomputation that keeps the layer's saved bytes down, into 13 launches at
L 4,096 (two GEMMs forward, four backward, two recomputed, the norm's kernels): on a GPU host, where a launch costs
about 40 µs, more than the rest of the layer (``longseq.bench.launches``). As a ``torch.library.triton_op`` it is one
Triton launch forward and two backward (``combiner.key_map_kernels``), and the values pass through it: the operation
returns them (copied by the forward's kernel) so that their gradient from the flex call and the map's own are summed
inside the backward's kernel, not in a launch of their own, and it keeps for the backward only the row-mates' keys
and the values it returned (which the flex call keeps anyway): ``h`` and the norm are recomputed.

On the CPU the operation runs ``reference_key_map`` with autograd's backward (tests, the launch count's stand-in).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

BLOCK_T = 32  # rows (KV slots) a program maps
BLOCK_K = 32  # features a product's chunk covers (a tile of the weight gradients is BLOCK_K x BLOCK_K)
MAX_WIDTH = 1024  # H * D the row programs hold in registers and shared memory (wider: the map stays plain torch)
_REGISTERED: dict[str, bool | None] = {"ok": None}


def reference_key_map(x: torch.Tensor, r: torch.Tensor, w_in: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                      w_out: torch.Tensor, eps: float, dropout: float = 0.0) -> torch.Tensor:
    """Summary keys ``(..., W)`` from summary values ``x`` and row-mates' keys ``r`` ``(..., W)``, in their dtype (the
    parameters cast, so bf16 inputs work with fp32 parameters outside autocast too); ``dropout`` on the first product
    (training only: the caller passes 0 otherwise)."""
    hidden = F.dropout(F.linear(x, w_in.to(x.dtype)), dropout, dropout > 0) + r
    hidden = F.layer_norm(hidden, hidden.shape[-1:], gamma.to(hidden.dtype), beta.to(hidden.dtype), eps)
    return F.linear(hidden, w_out.to(hidden.dtype))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, KV, D)`` -> ``(B * KV, H * D)``: a view of the heads-last KV (a copy of any other layout)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1] * x.shape[-1])


def _heads_last_like(x: torch.Tensor) -> torch.Tensor:
    """An uninitialized ``(B, H, KV, D)`` view of ``(B, KV, H, D)`` storage, the layout ``summary_kv`` writes."""
    B, H, KV, D = x.shape
    return x.new_empty(B, KV, H, D).transpose(1, 2)


def _acc(x: torch.Tensor):
    import triton.language as tl

    return tl.float64 if x.dtype == torch.float64 else tl.float32


def _row_tile(width: int) -> dict:
    """The row programs' tile: the whole width (a power of two, at least 16: ``tl.dot``'s least), their warps and
    pipeline stages. The ``(BLOCK_T, BLOCK_W)`` fp32 rows stay in registers: at W 512 that is 16 K values, which 4
    warps spill (the sm90 cubin is twice the size of 8 warps'). Triton's default 3 stages with 64-feature chunks asked
    292 KB of shared memory at W 512, more than an H100 gives a block (227 KB): 2 stages of 32 take 98 KB there and
    196 KB at ``MAX_WIDTH`` (tests/attention/test_fused_summaries.py compiles both for sm90 and checks)."""
    import triton

    block_w = max(16, triton.next_power_of_2(width))
    return dict(BLOCK_W=block_w, num_warps=8 if block_w >= 256 else 4, num_stages=2)


def supports(width: int) -> bool:
    """Whether the kernels take rows of ``width = H * D`` features (``MAX_WIDTH``)."""
    return width <= MAX_WIDTH


def launch_forward(keys, values, w_in, gamma, beta, w_out, eps: float):
    """The forward kernel: ``(mapped keys, values copied)``, both ``(B, H, KV, D)`` heads-last."""
    import triton
    from torch.library import wrap_triton

    from longseq.attention.combiner import key_map_kernels as kernels

    keys_out, values_out = _heads_last_like(keys), _heads_last_like(values)
    x, r, k_rows, v_rows = _rows(values), _rows(keys), _rows(keys_out), _rows(values_out)
    T, W = x.shape
    wrap_triton(kernels.key_map_forward)[(triton.cdiv(T, BLOCK_T),)](
        x, r, w_in, gamma, beta, w_out, k_rows, v_rows, T, W, eps, x.stride(0), r.stride(0), *w_in.stride(),
        v_rows.stride(0), k_rows.stride(0), BLOCK_T=BLOCK_T, BLOCK_K=BLOCK_K, ACC=_acc(x), **_row_tile(W))
    return keys_out, values_out


def launch_backward(keys, values, w_in, gamma, beta, w_out, d_keys, d_values, eps: float):
    """The backward's two kernels: gradients of ``(keys, values, w_in, gamma, beta, w_out)``; ``values`` are the ones
    the forward returned, ``d_values`` their gradient (added to the map's)."""
    import triton
    from torch.library import wrap_triton

    from longseq.attention.combiner import key_map_kernels as kernels

    x, r, dk, dv = _rows(values), _rows(keys), _rows(d_keys), _rows(d_values)
    T, W = x.shape
    parts = triton.cdiv(T, BLOCK_T)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    d_keys_in, d_values_in = _heads_last_like(keys), _heads_last_like(values)
    dr, dx = _rows(d_keys_in), _rows(d_values_in)
    normalized, dh = x.new_empty(T, W), x.new_empty(T, W)
    dgamma_part, dbeta_part = (x.new_empty(parts, W, dtype=acc) for _ in range(2))
    meta = dict(BLOCK_T=BLOCK_T, BLOCK_K=BLOCK_K, ACC=_acc(x))
    wrap_triton(kernels.key_map_backward_rows)[(parts,)](
        x, r, w_in, gamma, beta, w_out, dk, dv, dx, dr, normalized, dh, dgamma_part, dbeta_part, T, W, eps,
        x.stride(0), r.stride(0), *w_in.stride(), dk.stride(0), dv.stride(0), dx.stride(0), dr.stride(0),
        **_row_tile(W), **meta)
    dw_in, dw_out = torch.empty_like(w_in), torch.empty_like(w_out)
    dgamma, dbeta = torch.empty_like(gamma), torch.empty_like(beta)
    tiles = triton.cdiv(W, BLOCK_K)
    wrap_triton(kernels.key_map_backward_weights)[(tiles * tiles, 3)](
        x, dk, normalized, dh, dgamma_part, dbeta_part, dw_in, dw_out, dgamma, dbeta, T, W, parts,
        x.stride(0), dk.stride(0), *w_in.stride(), **meta)
    return d_keys_in, d_values_in, dw_in, dgamma, dbeta, dw_out


def _reference_op(keys, values, w_in, gamma, beta, w_out, eps):
    H = keys.shape[1]
    mapped = reference_key_map(_rows(values), _rows(keys), w_in, gamma, beta, w_out, eps)
    B, _, KV, D = keys.shape
    return mapped.view(B, KV, H, D).transpose(1, 2)


def register() -> bool:
    """Register the operation once per process (False where Triton is missing: the layer maps its keys in plain torch).
    Called when the layer's flex layout is built, outside any traced step."""
    if _REGISTERED["ok"] is None:
        _REGISTERED["ok"] = importlib.util.find_spec("triton") is not None
        if _REGISTERED["ok"]:
            _define()
    return bool(_REGISTERED["ok"])


def registered() -> bool:
    return bool(_REGISTERED["ok"])


def summary_key_map(keys: torch.Tensor, values: torch.Tensor, w_in: torch.Tensor, gamma: torch.Tensor,
                    beta: torch.Tensor, w_out: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mapped keys, values)`` ``(B, H, KV, D)`` of the column call's KV (row-mates' keys, summary values), as the
    flex call takes them. Differentiable in all six tensors; one kernel forward and two backward on CUDA."""
    return torch.ops.longseq.summary_key_map(keys, values, w_in, gamma, beta, w_out, float(eps))


def _define() -> None:
    from torch.library import triton_op

    @triton_op("longseq::summary_key_map", mutates_args={})
    def key_map(keys: torch.Tensor, values: torch.Tensor, w_in: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
                w_out: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return launch_forward(keys, values, w_in, gamma, beta, w_out, eps)

    @triton_op("longseq::summary_key_map_backward", mutates_args={})
    def key_map_backward(keys: torch.Tensor, values: torch.Tensor, w_in: torch.Tensor, gamma: torch.Tensor,
                         beta: torch.Tensor, w_out: torch.Tensor, d_keys: torch.Tensor, d_values: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                              torch.Tensor]:
        return launch_backward(keys, values, w_in, gamma, beta, w_out, d_keys, d_values, eps)

    @key_map.register_kernel("cpu")
    def _(keys, values, w_in, gamma, beta, w_out, eps):
        with torch.no_grad():
            mapped = _reference_op(keys, values, w_in, gamma, beta, w_out, eps)
        copied = _heads_last_like(values)
        copied.copy_(values)
        return mapped.transpose(1, 2).contiguous().transpose(1, 2), copied

    @key_map_backward.register_kernel("cpu")
    def _(keys, values, w_in, gamma, beta, w_out, d_keys, d_values, eps):
        # torch.func's vjp: an operation's kernel runs below autograd, where torch.autograd.grad sees no graph
        _, vjp = torch.func.vjp(lambda *t: _reference_op(*t, eps), keys, values, w_in, gamma, beta, w_out)
        d_keys_in, d_values_in, *rest = vjp(d_keys)
        return (d_keys_in, d_values_in + d_values, *rest)

    def setup_context(ctx, inputs, output):
        keys, _, w_in, gamma, beta, w_out, eps = inputs
        ctx.save_for_backward(keys, output[1], w_in, gamma, beta, w_out)  # the returned values: the flex call keeps them
        ctx.eps = eps

    def backward(ctx, d_keys, d_values):
        return (*key_map_backward(*ctx.saved_tensors, d_keys, d_values, ctx.eps), None)

    key_map.register_autograd(backward, setup_context=setup_context)
