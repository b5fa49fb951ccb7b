"""GPU kernel launches per attention layer, counted on a CPU: what inductor would launch on an sm90 GPU for one layer's
forward and backward on the flex backend, besides the flex calls themselves.

    python -m longseq.bench.launches                       # every Combiner variant with a flex layout, L 4,096
    python -m longseq.bench.launches combiner_fixed --length 16384 --json

On a GPU host a launch costs about 40 µs of Python and driver time (the H100 profile, docs/gpu_check_h100.md), so a
layer's time at the paper's lengths is mostly its launch count. Inductor is told to generate Triton code for an sm90
target from CPU tensors, and every kernel it generates (and every user-defined Triton kernel it launches, such as
``ops.flex.summary_kernels``) is replaced by a no-op at run time: the generated wrapper code is what a GPU would run
(same fusion, same launch list), only the values are garbage. Each flex call is an opaque operation of the right
shapes (``flex_stand_in``), so its kernels are not counted; the fused summaries run as on CUDA
(``ops.flex.regions.fused_everywhere``).

This module patches inductor and Triton for the whole process (``fake_sm90``): import it in a process of its own
(the test runs it as a subprocess). It holds every use of their private APIs in ``longseq.bench``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass

import torch

# The most launches one layer may make, forward + backward, besides the flex calls, at L 4,096, H 8, D 64, bf16
# (issue #43's budgets)
BUDGETS = {
    "combiner_fixed": 6,
    "combiner_logsparse": 12,
    "combiner_axial_vertical": 20,
    "combiner_axial_horizontal": 20,
    "combiner_mixture": 24,
    "combiner_axial": 14,  # its learned summary keys one launch forward, two backward
}
_LAUNCH = re.compile(r"^\s+(\w+)\.run\(", re.M)
_EXTERN = re.compile(r"(extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(")
_PATCHED = {"done": False}


@dataclass
class LayerLaunches:
    """What one layer launches, forward and backward: generated and user Triton kernels (by name) and extern calls
    (matmuls, SDPA, index_add ...), the flex calls left out."""

    label: str
    length: int
    forward: list[str]
    backward: list[str]
    forward_extern: list[str]
    backward_extern: list[str]

    @property
    def total(self) -> int:
        return len(self.forward) + len(self.backward) + len(self.forward_extern) + len(self.backward_extern)


def fake_sm90() -> None:
    """Make inductor generate (and never run) Triton code for an sm90 GPU from CPU tensors, for the whole process."""
    if _PATCHED["done"]:
        return
    import torch._dynamo.device_interface as device_interface
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    import torch.utils._triton as torch_triton
    import triton.compiler.compiler as triton_compiler
    import triton.runtime
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    inductor_config.cpu_backend = "triton"
    inductor_config.compile_threads = 1
    inductor_config.fx_graph_cache = False  # a cached graph would skip the code generation this reads
    functorch_config.enable_autograd_cache = False
    make_backend = triton_compiler.make_backend
    torch_triton.triton_backend = lambda: make_backend(target)
    # user-defined kernels: their launch options and the mutation analysis ask the device for a target
    triton_compiler.make_backend = lambda asked: make_backend(target if asked.backend == "cpu" else asked)
    device_interface.CpuInterface.raise_if_triton_unavailable = staticmethod(lambda device=None: None)

    class Sm90Driver:
        def get_current_target(self):
            return target

    triton.runtime.driver.set_active(Sm90Driver())

    import torch._inductor.async_compile as async_compile  # after the target is set

    class NoOpKernel:
        def __init__(self, name):
            self.name = name

        def run(self, *args, **kwargs):
            return None

        def __call__(self, *args, **kwargs):
            return None

        def __getattr__(self, item):
            return lambda *args, **kwargs: None

    async_compile.AsyncCompile.triton = lambda self, kernel_name, source_code, device_str="cuda": NoOpKernel(
        kernel_name)
    _PATCHED["done"] = True


@torch.library.custom_op("longseq_launches::flex_call", mutates_args=())
def flex_stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One flex call as an opaque operation: output ``(B, H, Lq, Dv)`` and lse ``(B, H, Lq)`` of zeros."""
    return q.new_zeros(*q.shape[:-1], v.shape[-1]), q.new_zeros(q.shape[:-1], dtype=torch.float32)


@flex_stand_in.register_fake
def _(q, k, v):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("longseq_launches::flex_call_backward", mutates_args=())
def flex_stand_in_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


@flex_stand_in_backward.register_fake
def _(q, k, v, grad):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad, grad_lse):
    return flex_stand_in_backward(*ctx.saved_tensors, grad)


flex_stand_in.register_autograd(_backward, setup_context=_save)


def layer_launches(name: str, length: int = 4096, heads: int = 8, head_dim: int = 64, causal: bool = True,
                   **knobs) -> LayerLaunches:
    """Compile one ``name`` layer's forward and backward on the flex backend (bf16, B 1, static shapes, one graph)
    for the fake sm90 target and list its launches. ``knobs``: the variant's attention keys (``block_size`` defaults
    to 64 where the variant has one)."""
    from torch._inductor.utils import run_and_get_code

    from longseq.attention import ATTENTION_REGISTRY, build_attention
    from longseq.attention.ops.flex import engine
    from longseq.attention.ops.flex.block_masks import static_layout
    from longseq.attention.ops.flex.calls import tile_size
    from longseq.attention.ops.flex.regions import fused_everywhere
    from longseq.attention.registry import accepted_kwargs

    fake_sm90()
    if "block_size" in accepted_kwargs(ATTENTION_REGISTRY[name].cls) and "block_size" not in knobs:
        knobs["block_size"] = 64
    attn = build_attention(name, causal=causal, seq_len=length, n_heads=heads, head_dim=head_dim, backend="flex",
                           **knobs).to(torch.bfloat16).train()
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, head_dim, generator=generator).to(torch.bfloat16).requires_grad_()
               for _ in range(3))
    grad = torch.randn(1, heads, length, head_dim, generator=generator).to(torch.bfloat16)
    static_layout(attn, length, q.device, tile_size(length), per_batch=attn.flex_selects)  # built outside the graph
    real = engine.flex_call
    engine.flex_call = lambda q, k, v, mask, scale: flex_stand_in(q, k, v)
    try:
        with fused_everywhere():
            torch._dynamo.reset()
            compiled = torch.compile(lambda q, k, v: engine.flex_forward(attn, q, k, v), fullgraph=True,
                                     dynamic=False)

            def step():
                compiled(q, k, v).backward(grad)

            _, codes = run_and_get_code(step)
    finally:
        engine.flex_call = real
    launches, externs = [], []
    for code in codes:
        body = code[code.index("def call("):] if "def call(" in code else code
        launches.append(_LAUNCH.findall(body))
        externs.append([call for call in _EXTERN.findall(body) if "longseq_launches" not in call])
    launches += [[]] * (2 - len(launches))
    externs += [[]] * (2 - len(externs))
    label = name + "".join(f"[{key}={value}]" for key, value in knobs.items() if key != "block_size")
    return LayerLaunches(label, length, launches[0], launches[1], externs[0], externs[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="attentions (default: every budgeted layer, BUDGETS)")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    over = 0
    for name in args.names or list(BUDGETS):
        found = layer_launches(name, args.length)
        limit = BUDGETS.get(name) if args.length == 4096 else None
        over += limit is not None and found.total > limit
        if args.json:
            print(json.dumps({**asdict(found), "total": found.total, "budget": limit}), flush=True)
        else:
            print(f"{found.label:34s} L {args.length}: {found.total:3d} launches (budget {limit}): forward "
                  f"{len(found.forward)} + {len(found.forward_extern)} extern, backward {len(found.backward)} + "
                  f"{len(found.backward_extern)} extern", flush=True)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
