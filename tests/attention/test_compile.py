"""Compile-clean: every registered attention's forward traces as ONE graph under ``torch.compile(fullgraph=True)``.

``backend="eager"`` runs dynamo's tracing only (no inductor code generation), so a graph break fails the test in
well under a second at these sizes. The inputs require grad and the module is in training mode, as under
``model.compile=true``: dynamo then traces the backward of every hand-written autograd Function as well. The compiled
module must give the eager module's output and gradients.

Fast suite: the variants of ``conftest.FAST_VARIANTS`` (one per mechanism) in their first direction (causal where
supported) on ``attention.backend=auto`` (what CPU training runs: the CPU engine where it applies, else explicit);
tracing costs up to seconds a case, so the other variants, the other direction, each backend that runs on CPU by
name, and the inference path (evaluation mode under ``no_grad``) are in the slow suite. FlexAttention is not
compiled here: on CPU it has no backward (tests/attention/test_flex.py covers it; on CUDA ``make gpu-check`` runs it).

``KNOWN_BREAKS`` lists, explicitly, the cases that still break the graph, each with its cause; the test checks that
each of them still does, so a fix fails the test until the entry is removed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import fast_variants_first
from helpers import CASES, build, modes, random_qkv

from longseq.attention import ATTENTION_REGISTRY

try:  # the one list of CPU backends: auto's CPU priority (ops.dispatch)
    from longseq.attention.ops import dispatch

    CPU_BACKENDS = tuple(dispatch.PRIORITY["cpu"])
except ImportError:  # before attention.backend existed: one path per variant
    dispatch, CPU_BACKENDS = None, ()

# (name, causal, backend) -> why dynamo cannot trace it yet. "auto" entries are the fast suite's cases (and the other
# direction's, slow); "cpu_flash" / "explicit" entries the backends named explicitly (slow suite).
DATA_DEPENDENT = {
    "bigbird": "unique() of the global block ids (BigBird.global_block_ids)",
    "combiner_select": "a data-dependent number of selected blocks (combiner/select.py)",
    "moba": "data-dependent tile counts of the chosen blocks (ops/block_select.py grouped_attention)",
    "nsa": "data-dependent tile counts of the chosen blocks (ops/block_select.py grouped_attention)",
}
KNOWN_BREAKS: dict[tuple[str, bool, str], str] = {
    ("bigbird", False, "auto"): DATA_DEPENDENT["bigbird"],
    ("bigbird", False, "explicit"): DATA_DEPENDENT["bigbird"],
    **{(name, causal, backend): DATA_DEPENDENT[name] for name in ("combiner_select", "moba", "nsa")
       for causal in (True, False) for backend in ("auto", "explicit")},
}


def runs_on(name: str, causal: bool, backend: str) -> bool:
    """Whether ``name`` has a ``backend`` path in this direction (the dispatch's own static rule)."""
    if backend in ("auto", "explicit"):
        return True
    cls = ATTENTION_REGISTRY[name].cls
    variant = dispatch.Variant(name, cls.family, causal, cls.cpu_flash, None)
    if backend == "cpu_flash" and cls.cpu_flash is not None and not cls.cpu_flash.compiles:
        return False  # eager only: the dispatch refuses it while torch.compile traces (tests/attention/test_dispatch.py)
    return dispatch.static_reason(backend, variant) is None


FAST = [(name, causal, "auto") for name, causal in CASES if causal == modes(name)[0]]
SLOW = [(name, causal, "auto") for name, causal in CASES if causal != modes(name)[0]] + [
    (name, causal, backend) for name, causal in CASES for backend in CPU_BACKENDS if runs_on(name, causal, backend)]


@pytest.fixture(autouse=True)
def fresh_dynamo(one_thread):
    torch._dynamo.reset()  # no cached graphs or recompile counts from the previous case
    yield
    torch._dynamo.reset()


def output_and_grads(module, q, k, v):
    torch.manual_seed(0)  # variants that draw during the call (hashing, feature redraws) draw the same numbers
    if not module.training:  # inference: no_grad, the path validation and sampling take
        with torch.no_grad():
            return module(q, k, v), []
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = module(*inputs)
    out.square().sum().backward()
    return out.detach(), [x.grad for x in inputs]


def check_compiles(name: str, causal: bool, backend: str, training: bool = True) -> None:
    kwargs = {} if backend == "auto" or dispatch is None else {"backend": backend}
    attn = build(name, causal, **kwargs).train(training)  # dropout is 0 in the YAMLs: training is deterministic
    q, k, v = random_qkv(B=1, H=2, L=16, D=8, dtype=torch.float32)
    eager = copy.deepcopy(attn)  # routing updates its centroids in training: each side gets the same start
    compiled = torch.compile(attn, fullgraph=True, backend="eager")
    known = KNOWN_BREAKS.get((name, causal, backend)) if training else DATA_DEPENDENT.get(name)
    if known is not None:
        output_and_grads(eager, q, k, v)  # eager runs: the failure below is the tracer's
        with pytest.raises(Exception) as raised:  # Unsupported / UserError / data-dependent guard, by cause
            output_and_grads(compiled, q, k, v)
        assert not isinstance(raised.value, AssertionError)
        return
    out, grads = output_and_grads(compiled, q, k, v)
    ref_out, ref_grads = output_and_grads(eager, q, k, v)
    torch.testing.assert_close(out, ref_out)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref)


@pytest.mark.parametrize("name,causal,backend", fast_variants_first(FAST))
def test_forward_compiles_without_graph_breaks(name, causal, backend):
    check_compiles(name, causal, backend)


@pytest.mark.slow
@pytest.mark.parametrize("name,causal,backend", SLOW)
def test_each_cpu_backend_compiles_without_graph_breaks(name, causal, backend):
    check_compiles(name, causal, backend)


@pytest.mark.slow
@pytest.mark.parametrize("name,causal,backend", FAST)
def test_inference_compiles_without_graph_breaks(name, causal, backend):
    """Evaluation mode under ``no_grad`` (validation, the sampling recompute path): the variants with data-dependent
    shapes (``DATA_DEPENDENT``) still break the graph, every other one traces as one."""
    check_compiles(name, causal, backend, training=False)


def test_known_breaks_name_real_cases():
    """Every entry of ``KNOWN_BREAKS`` is a registered variant in a direction it supports (a stale entry would
    silently stop being checked)."""
    cases = set(FAST) | set(SLOW)
    listed = {case for case in KNOWN_BREAKS if case[2] in ("auto", *CPU_BACKENDS)}
    assert listed <= cases, sorted(listed - cases)
