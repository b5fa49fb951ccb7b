"""The FlexAttention backend (``ops.flex``) against the attention contract, parametrized over the registry.

Every variant (and direction) whose class has a flex layout (``flex_reason() is None``) is tested, so a new layout
is covered by writing it; ``IMPLEMENTED`` pins the layouts written so far, so support cannot silently vanish. On CPU
flex runs eagerly (exact, forward only), hence ``no_grad``; what a GPU step needs of the layer is checked here
without one: one graph (``torch._dynamo.explain`` of the whole layer), no host reads in a forward and backward (the
flex call itself replaced by a differentiable stand-in), block masks built once per geometry, and the bytes the
layer keeps for its backward.
"""

from __future__ import annotations

import functools
import math
import sys

import pytest
import torch
from conftest import fast_variants_first
from devices import requires_cuda
from helpers import CASES, build, modes, random_qkv
from host_reads import NoHostReads
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from longseq.attention import ATTENTION_REGISTRY, AttentionConfigError
from longseq.attention.ops.flex import (
    BUILDS,
    TILE,
    block_masks,
    build_block_mask,
    calls,
    engine,
    flex_forward,
    flex_kept_for_backward,
    flex_longest_loop,
    flex_partition,
    flex_tiles_visited,
    merge_by_lse,
    selection,
    static_layout,
    tile_size,
    tiles_of,
)
from longseq.attention.ops.flex.calls import whole_tiles
from longseq.attention.ops.flex.inspection import flex_calls_as_shapes
from longseq.attention.ops.partition import Partition

L, BLOCK = 32, 4  # forward checks: 8 segments / grid rows
MASK_L, MASK_BLOCK = 64, 8  # create_mask against the partition's dense support

IMPLEMENTED = {"combiner_fixed", "combiner_logsparse", "combiner_axial", "combiner_axial_vertical",
               "combiner_axial_horizontal", "combiner_mixture", "fixed", "axial", "local", "longformer", "strided",
               "logsparse", "bigbird", "random", "routing", "combiner_routing", "moba", "nsa", "combiner_select"}

FLEX_CASES = [(name, causal) for name, causal in CASES if ATTENTION_REGISTRY[name].cls.flex_reason() is None]
STATIC_CASES = [(name, causal) for name, causal in FLEX_CASES if not ATTENTION_REGISTRY[name].cls.flex_from_data]


def test_supported_variants_include_every_layout_written():
    assert IMPLEMENTED <= {name for name, _ in FLEX_CASES}
    assert "full" not in {name for name, _ in FLEX_CASES}  # full stays on SDPA


def pads(batch: int = 2) -> dict[str, torch.Tensor | None]:
    """No padding, or one padded batch: document 0 with a padded head (queries whose every direct key and usable
    region is padding, so the fallback to unpadded direct keys runs), document 1 with a padded tail."""
    padded = torch.zeros(batch, L, dtype=torch.bool)
    padded[0, : BLOCK + 2] = True
    padded[1, L - 11 :] = True
    return {"none": None, "padded": padded}


PADDED_CASES = [(name, causal, padding) for name, causal in FLEX_CASES for padding in pads()
                if padding == "none" or ATTENTION_REGISTRY[name].cls.supports_padding_mask]


def has_summaries(name: str, causal: bool) -> bool:
    """Whether a call of the variant's layout appends summaries after its keys (k-means layouts: the Combiner's)."""
    attn = build(name, causal, seq_len=L, block_size=BLOCK)
    if attn.flex_from_data:
        return attn.family == "combiner"
    return any(call.n_regions for call in attn.flex_calls(L, torch.device("cpu")))


COPIES = 4  # summary copies in the cases that lay them out once per query rows (``lay_out_summaries``)
COPIED_CASES = [(*case, copies) for case in PADDED_CASES
                for copies in ((1, COPIES) if has_summaries(*case[:2]) else (1,))]


def lay_out_summaries(monkeypatch, copies: int, length: int = L) -> list[int]:
    """Calls lay out their summaries ``copies`` times, once per ``length / copies`` queries
    (``FlexCall.summary_copies``; a long sequence's layout at a test's length), in a registry of this test's own ->
    the copies of every call that appended summaries (filled as the layer runs)."""
    seen = []
    if copies > 1:
        monkeypatch.setattr(calls, "COPY_ROWS", length // copies)
        monkeypatch.setattr(calls, "MIN_COPY_ROWS", length // copies)
        monkeypatch.setattr(calls, "COPY_KEY_SHARE", float(copies * length))
        monkeypatch.setattr(block_masks, "_REGISTRY", {})
    summary_kv = calls.FlexCall.summary_kv

    def spy(call, x, length):
        seen.append(call.summary_copies(length)[0])
        return summary_kv(call, x, length)

    monkeypatch.setattr(calls.FlexCall, "summary_kv", spy)
    return seen


@pytest.mark.parametrize("name,causal,padding,copies", COPIED_CASES)
def test_flex_forward_equals_attention_matrix_and_forward(name, causal, padding, copies, monkeypatch):
    """Also with the summaries laid out once per query rows (``copies``), as long sequences have them."""
    seen = lay_out_summaries(monkeypatch, copies)
    attn = build(name, causal, seq_len=L, block_size=BLOCK).eval()
    pad = pads()[padding]
    kwargs = {} if pad is None else {"key_padding_mask": pad}
    with torch.no_grad():
        q, k, v = random_qkv(L=L, dtype=torch.float32, seed=1)
        out = flex_forward(attn, q, k, v, pad)
        torch.testing.assert_close(out, attn.attention_matrix(q, k, v, **kwargs) @ v, atol=1e-5, rtol=0)
        # the module's own forward in fp64 (its fp32 padding channel of -1e4 costs ~1e-4 on fallback rows)
        q, k, v = random_qkv(L=L, dtype=torch.float64, seed=2)
        torch.testing.assert_close(flex_forward(attn, q, k, v, pad), attn(q, k, v, **kwargs), atol=1e-9, rtol=0)
    assert copies == 1 or set(seen) == {copies}


def regions_match(flex_part: Partition, part: Partition) -> None:
    """Every flex summary is exactly one of the partition's regions (members, anchor and family: row-major axial
    summarizes one row from every column), and each query uses the same regions."""
    same = (flex_part.members.unsqueeze(1) == part.members.unsqueeze(0)).all(-1)  # (R_flex, R)
    same &= flex_part.anchor.unsqueeze(1) == part.anchor.unsqueeze(0)
    same &= flex_part.family.unsqueeze(1) == part.family.unsqueeze(0)  # mixture: one cell can be V and H
    assert (same.sum(-1) == 1).all(), "a flex summary pools a set that is not one of the partition's regions"
    used = (flex_part.usable.double() @ same.double()) > 0  # (L, R) in the partition's region order
    assert torch.equal(used, part.usable)
    # one summary per region and query: a joint softmax must not count a region twice
    assert ((flex_part.usable.double() @ same.double()) <= 1).all()


# layouts read from the geometry alone, against the variant's Partition (``routing``'s masks read the batch's clusters,
# the block-selecting variants' the batch's choices: tested below)
MASK_CASES = [(name, causal) for name, causal in STATIC_CASES if not ATTENTION_REGISTRY[name].cls.pattern_from_data]
MASK_COPIED_CASES = [(name, causal, copies) for name, causal in MASK_CASES
                     for copies in ((1, COPIES) if has_summaries(name, causal) else (1,))]


@pytest.mark.parametrize("name,causal,copies", MASK_COPIED_CASES)
def test_create_mask_of_every_mask_mod_equals_the_partition(name, causal, copies, monkeypatch):
    """Also with the summaries laid out once per query rows: each query uses every region it may, once."""
    lay_out_summaries(monkeypatch, copies, MASK_L)
    attn = build(name, causal, seq_len=MASK_L, block_size=MASK_BLOCK)
    laid_out = {call.summary_copies(MASK_L)[0] for call in attn.flex_calls(MASK_L, torch.device("cpu")) if call.n_regions}
    assert laid_out <= {copies} and (copies == 1 or laid_out)
    part = attn.partition(MASK_L)
    heads = part.direct.shape[0] if part.direct.dim() == 3 else 1  # bigbird: per-head patterns
    for head in range(heads):
        flex_part = flex_partition(attn, MASK_L, head)
        direct = part.direct[head] if heads > 1 else part.direct
        assert torch.equal(flex_part.direct, direct)
        if heads == 1:
            assert torch.equal(flex_part.allowed(), part.allowed())
            regions_match(flex_part, part)


@pytest.mark.parametrize("name,causal", MASK_CASES)
def test_block_masks_equal_create_block_mask_and_count_their_tiles(name, causal, monkeypatch):
    """The builder (the mask_mod on index grids, chunk by chunk of query tiles; two tiles a chunk here) classifies
    every tile as torch's ``create_block_mask``, over the KV padded to whole tiles; a sparse pattern's calls never
    visit more tiles than its dense support touches in sequence order (the issue's target for the patterns)."""
    attn = build(name, causal, seq_len=MASK_L, block_size=MASK_BLOCK)
    tile = 8
    monkeypatch.setitem(block_masks.MASK_CHUNK_CELLS, "cpu", 2 * tile * 3 * MASK_L)
    for call in attn.flex_calls(MASK_L, torch.device("cpu")):
        kv_len = whole_tiles(call.kv_len(MASK_L), tile)
        mine = build_block_mask(call.mask_mod(MASK_L), 1, call.heads, MASK_L, kv_len, "cpu", tile)
        torch_s = create_block_mask(call.mask_mod(MASK_L), 1, call.heads, MASK_L, kv_len, "cpu", BLOCK_SIZE=tile)
        assert torch.equal(mine.to_dense(), torch_s.to_dense())
        assert tiles_of(mine) == tiles_of(torch_s)

    ratio = flex_tiles_visited(attn, MASK_L, tile=tile)
    assert ratio > 0
    if attn.family == "sparse":  # Combiner summaries add key tiles; their targets are checked at L = 4096 (slow)
        allowed = attn.partition(MASK_L).direct.reshape(-1, MASK_L, MASK_L)
        n = MASK_L // tile
        touched = allowed.view(-1, n, tile, n, tile).any(4).any(2).sum((1, 2)).double().mean()
        assert ratio <= touched / (n * (n + 1) / 2) + 1e-9


@pytest.mark.slow
@pytest.mark.parametrize("name,target", [("combiner_fixed", 0.125), ("combiner_logsparse", 0.27), ("axial", 0.125),
                                         ("combiner_axial", 0.18), ("combiner_axial_vertical", 0.24),
                                         ("combiner_axial_horizontal", 0.24), ("combiner_mixture", 0.42)])
def test_tiles_visited_meet_the_issue_targets(name, target):
    """Issue 22's targets at L = 4096, m = 64, 128 x 128 tiles (0.12 quoted to two digits: 64 / 528 = 0.1212)."""
    attn = build(name, True, seq_len=4096, block_size=64)
    assert flex_tiles_visited(attn, 4096) <= target


def test_unsupported_variants_say_why_and_forward_refuses():
    full = build("full", True)
    assert "SDPA" in full.flex_reason()
    assert build("performer", True).flex_reason()
    q, k, v = random_qkv(L=16)
    with pytest.raises(AttentionConfigError, match="attention.backend"):
        flex_forward(full, q, k, v)


def test_flex_refuses_weight_dropout_in_training():
    attn = build("combiner_fixed", True, seq_len=L, block_size=BLOCK, dropout=0.1).train()
    q, k, v = random_qkv(L=L)
    with pytest.raises(AttentionConfigError, match="attention.dropout"):
        flex_forward(attn, q, k, v)


@pytest.mark.parametrize("causal", [True, False])
def test_mixture_plans_average_is_two_softmaxes_averaged(causal):
    """``combiner_mixture plans=average``: one group of calls per partition plan, each its own softmax, averaged."""
    attn = build("combiner_mixture", causal, seq_len=L, block_size=BLOCK, plans="average").eval()
    assert {call.group for call in attn.flex_calls(L, torch.device("cpu"))} == {0, 1}
    pad = pads()["padded"]
    with torch.no_grad():
        q, k, v = random_qkv(L=L, dtype=torch.float32, seed=3)
        for kwargs in ({}, {"key_padding_mask": pad}):
            out = flex_forward(attn, q, k, v, kwargs.get("key_padding_mask"))
            torch.testing.assert_close(out, attn.attention_matrix(q, k, v, **kwargs) @ v, atol=1e-5, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_routing_mask_reads_the_batch_clusters(causal):
    """``routing``'s mask (per batch and head, from this batch's k-means clusters) is the dense reference's
    ``allowed(key_clusters, query_routes)``; its tiles are data dependent (NaN)."""
    attn = build("routing", causal, seq_len=L, block_size=BLOCK).eval()
    q, k, v = random_qkv(L=L, dtype=torch.float32, seed=5)
    (call,) = attn.flex_data_calls(q, k, v, None)
    mask = create_mask(call.mask_mod(L), 2, call.heads, L, L, "cpu")
    assert torch.equal(mask, attn.allowed(*attn.assign(k)))
    assert math.isnan(flex_tiles_visited(attn, L))


@pytest.mark.parametrize("causal", [True, False])
def test_combiner_routing_mask_reads_the_batch_clusters(causal):
    """``combiner_routing``: direct keys and usable cluster summaries per batch and head are the dense partition's
    for this batch's clusters (causal: R(c, g) only for the query's own segment g)."""
    attn = build("combiner_routing", causal, seq_len=L, block_size=BLOCK).eval()
    q, k, v = random_qkv(L=L, dtype=torch.float32, seed=7)
    (call,) = attn.flex_data_calls(q, k, v, None)
    mask = create_mask(call.mask_mod(L), 2, call.heads, L, call.kv_len(L), "cpu")
    clusters, routes = attn.assign(k)
    direct, regions = attn.partition(clusters, routes)
    used = mask[..., L:].unflatten(-1, (-1, attn.n_clusters)).any(-2)  # (B, H, L, K): over the segments g
    assert torch.equal(mask[..., :L], direct) and torch.equal(used, regions.any(-1))


@pytest.mark.parametrize("name,knobs", [
    ("combiner_fixed", {"summary": "deepsets_mean"}), ("combiner_logsparse", {"summary": "mean"}),
    ("combiner_axial_vertical", {"summary": "deepsets_max"}), ("combiner_mixture", {"summary": "mean"}),
    ("combiner_axial_horizontal", {"summary": "mean", "horizontal_regions": "split"}),
    ("combiner_axial_horizontal", {"summary": "deepsets_max"}),
    ("combiner_axial", {"row_summary": "wsum"}), ("combiner_axial", {"row_summary": "none"}),
])
def test_flex_summaries_follow_the_variants_knobs(name, knobs):
    """Summaries are the variant's own (pooling kind, DeepSets maps, row-summary key), padded or not (fp64)."""
    attn = build(name, True, seq_len=L, block_size=BLOCK, **knobs).eval().double()
    q, k, v = random_qkv(L=L, seed=6)
    with torch.no_grad():
        for pad in (None, pads()["padded"]):
            kwargs = {} if pad is None else {"key_padding_mask": pad}
            torch.testing.assert_close(flex_forward(attn, q, k, v, pad),
                                       attn.attention_matrix(q, k, v, **kwargs) @ v, atol=1e-9, rtol=0)


# -- what a GPU step needs, checked on CPU -------------------------------------------------------------------
@pytest.fixture
def flex_stand_in():
    """Every flex call a differentiable stand-in of the right shapes (CPU FlexAttention has no backward), so the
    rest of the layer runs its backward."""
    with flex_calls_as_shapes():
        yield


# tracing costs seconds a case: the fast suite traces the first direction, unpadded, of conftest.FAST_VARIANTS, the
# slow suite every other case
TRACE_FAST = [(name, causal, padding) for name, causal, padding in PADDED_CASES
              if padding == "none" and causal == modes(name)[0]]
TRACE_CASES = fast_variants_first(TRACE_FAST) + [pytest.param(*case, marks=pytest.mark.slow) for case in PADDED_CASES
                                                 if case not in TRACE_FAST]
# the summaries laid out once per query rows (combiner_fixed's case in the fast suite)
TRACE_COPIED = [pytest.param(name, causal, padding, marks=() if name == "combiner_fixed" else pytest.mark.slow)
                for name, causal, padding in TRACE_FAST if has_summaries(name, causal)]


@pytest.mark.parametrize("name,causal,padding", TRACE_CASES)
def test_the_whole_layer_traces_as_one_graph(name, causal, padding):
    """``torch._dynamo.explain`` of the attention module on the flex backend (dispatch, summaries, every call, the
    merge, the padding fallback): one graph, no break (once the static layout exists, as after the first step)."""
    assert_one_graph(name, causal, padding)


@pytest.mark.parametrize("name,causal,padding", TRACE_COPIED)
def test_the_layer_with_copies_of_its_summaries_traces_as_one_graph(name, causal, padding, monkeypatch):
    lay_out_summaries(monkeypatch, COPIES)
    assert_one_graph(name, causal, padding)


def assert_one_graph(name: str, causal: bool, padding: str) -> None:
    import torch._dynamo

    attn = build(name, causal, seq_len=L, block_size=BLOCK, backend="flex").eval()
    pad = pads()[padding]
    kwargs = {} if pad is None else {"key_padding_mask": pad}
    q, k, v = random_qkv(L=L, dtype=torch.float32, seed=8)
    with torch.no_grad():
        attn(q, k, v, **kwargs)
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(attn)(q, k, v, **kwargs)
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0, [str(r.reason).splitlines()[0] for r in explanation.break_reasons]
    assert explanation.graph_count == 1


def dense_flex(q, k, v, block_mask, scale):
    """FlexAttention's math on CPU with autograd (its CPU kernel has none): the mask_mod on the whole (Q, KV) grid,
    one masked softmax of ``scale * q . k``; an empty row gives output 0 and lse -inf, as the kernel does."""
    B, H, Q, _ = q.shape
    index = functools.partial(torch.arange, device=q.device)
    allowed = block_mask.mask_mod(index(B).view(B, 1, 1, 1), index(H).view(1, H, 1, 1), index(Q).view(1, 1, Q, 1),
                                  index(k.shape[-2]).view(1, 1, 1, -1))
    scores = (scale * q @ k.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
    empty = ~allowed.any(-1)  # empty rows: a finite logsumexp, so no NaN reaches the gradients
    lse = torch.logsumexp(scores.masked_fill(empty.unsqueeze(-1), 0.0), -1)
    return (scores - lse.masked_fill(empty, 0.0).unsqueeze(-1)).exp() @ v, lse.masked_fill(empty, float("-inf"))


@pytest.mark.parametrize("name,causal,padding,copies", COPIED_CASES)
def test_the_layer_backward_equals_the_reference(name, causal, padding, copies, monkeypatch):
    """Gradients into q, k and v through everything the layer does around its flex calls (summaries, orders, merges,
    gathered selections, the padding fallback, the copies of the summaries), each flex call computed densely with
    autograd, against the gradients of ``attention_matrix @ v`` (fp64), with the kernels a GPU runs (one-scan
    running max, static k-means rounds). On a GPU the calls are FlexAttention's own backward (make gpu-check)."""
    from longseq.attention.ops import clustering, running_max

    seen = lay_out_summaries(monkeypatch, copies)
    monkeypatch.setattr(engine, "flex_call", dense_flex)
    monkeypatch.setattr(running_max, "blocked_scan_applies", lambda x: False)
    monkeypatch.setattr(clustering, "host_loop_applies", lambda scores: False)
    attn = build(name, causal, seq_len=L, block_size=BLOCK, backend="flex").double().eval()
    pad = pads()[padding]
    kwargs = {} if pad is None else {"key_padding_mask": pad}
    q, k, v = random_qkv(L=L, seed=14, requires_grad=True)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(15), dtype=q.dtype)
    grads = torch.autograd.grad((flex_forward(attn, q, k, v, pad) * upstream).sum(), (q, k, v))
    q2, k2, v2 = (x.detach().requires_grad_() for x in (q, k, v))
    reference = torch.autograd.grad(((attn.attention_matrix(q2, k2, v2, **kwargs) @ v2) * upstream).sum(), (q2, k2, v2))
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    assert copies == 1 or set(seen) == {copies}


@pytest.mark.parametrize("name,causal,padding", PADDED_CASES)
def test_a_training_step_reads_nothing_on_the_host(name, causal, padding, flex_stand_in, monkeypatch):
    """Forward and backward of the layer in training mode (summaries, clusters, masks, merge; the flex call a
    stand-in) under a check that fails on any host read of tensor values: on a GPU each would be a sync. The
    kernels are the ones a GPU runs (``running_max``'s single scan, the k-means rounds with static shapes)."""
    from longseq.attention.ops import clustering, running_max

    monkeypatch.setattr(running_max, "blocked_scan_applies", lambda x: False)
    monkeypatch.setattr(clustering, "host_loop_applies", lambda scores: False)
    attn = build(name, causal, seq_len=L, block_size=BLOCK, backend="flex").train()
    pad = pads()[padding]
    q, k, v = random_qkv(L=L, dtype=torch.float32, seed=9, requires_grad=True)
    flex_forward(attn, q, k, v, pad)  # the first step builds the static layout (an eager, outside-the-step build)
    with NoHostReads():
        out = flex_forward(attn, q, k, v, pad)
        (out * torch.randn_like(out)).sum().backward()
    assert q.grad is not None


TRAINING_TRACE = [pytest.param(name, causal, marks=() if name in {"combiner_fixed", "combiner_axial", "combiner_select"}
                                else pytest.mark.slow) for name, causal, padding in TRACE_FAST]


@pytest.mark.parametrize("name,causal", TRAINING_TRACE)
def test_a_training_step_compiles_as_one_graph_through_aot_autograd(name, causal, monkeypatch):
    """The layer with gradients as the GPU compiles it (``fullgraph=True``; AOT autograd traces the forward and the
    backward of every hand-written autograd Function, with the kernels a GPU runs; the flex calls a dense stand-in;
    evaluation mode keeps the k-means centroids still): outputs and gradients equal the eager layer's, and a second
    call runs the same graph. torch 2.11 failed here on CUDA where ``explain`` under no_grad passed (an untraceable
    builtin inside a Function's autocast wrapper); the k-means layouts once recompiled at every call (a traced
    counter of block-mask builds was a guard on its value)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from longseq.attention.ops import clustering, running_max

    monkeypatch.setattr(engine, "flex_call", dense_flex)
    monkeypatch.setattr(running_max, "blocked_scan_applies", lambda x: False)
    monkeypatch.setattr(clustering, "host_loop_applies", lambda scores: False)
    attn = build(name, causal, seq_len=L, block_size=BLOCK, backend="flex").eval()
    tile = tile_size(L)
    layout = None if attn.flex_from_data else static_layout(attn, L, torch.device("cpu"), tile,
                                                            per_batch=attn.flex_selects)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(engine.run_layer, fullgraph=True, dynamic=False, backend="aot_eager")
    results = []
    for run in (compiled, engine.run_layer, compiled):
        q, k, v = random_qkv(L=L, dtype=torch.float32, seed=16, requires_grad=True)
        out = run(attn, layout, q, k, v, None, tile)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
    for got, want in zip(*results[:2]):
        torch.testing.assert_close(got, want)


def compiled_backbone_steps(name: str, causal: bool, prepare: bool, monkeypatch, steps: int = 2, layers: int = 2,
                            autocast: bool = False, compiled_graphs: dict | None = None):
    """``model.compile=true`` as the task runs it, on CPU: a ``layers``-layer backbone on the flex backend (its calls a
    dense stand-in, so flex may run with gradients here; the fused summaries as on CUDA, ``fused_everywhere``), its
    layouts prepared first (``prepare``), compiled whole with ``fullgraph=True`` (dynamo and AOT autograd, as on a
    GPU, with eager kernels), ``steps`` training steps (under bf16 autocast with ``autocast``) -> the loss and gradients
    of each step (compiled, then eager), and the number of graphs dynamo compiled; ``compiled_graphs`` counts the
    forward and backward graphs AOT autograd made."""
    import torch._dynamo
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.utils import counters

    from longseq.attention.ops import dispatch
    from longseq.attention.ops.flex.regions import fused_everywhere
    from longseq.bench.specs import build_spec
    from longseq.models.transformer import Transformer

    monkeypatch.setattr(engine, "flex_call", dense_flex)
    allowed = dispatch.call_reason
    monkeypatch.setattr(dispatch, "call_reason", lambda backend, variant, facts:
                        None if backend == "flex" else allowed(backend, variant, facts))
    spec = build_spec(name, L, causal=causal, n_heads=2, head_dim=8, block_size=BLOCK)
    attention = {key: value for key, value in spec.kwargs.items() if key not in {"seq_len", "n_heads", "head_dim", "dropout"}}
    torch.manual_seed(0)
    model = Transformer(vocab_size=16, seq_len=L, n_layers=layers, d_model=16, n_heads=2, mlp_ratio=2, dropout=0.0,
                        attn_dropout=0.0, attention={"name": name, **attention, "backend": "flex"}, pos_emb="learned",
                        image_shape=None).eval()  # eval: the k-means centroids stay still, so steps compare
    monkeypatch.setattr(block_masks, "_REGISTRY", {})  # this test's layouts only, the registry restored after
    if prepare:
        cls = ATTENTION_REGISTRY[name].cls  # one layout per layer; none where the layout comes from the data
        assert model.prepare_flex_layouts("cpu") == (0 if cls.flex_from_data else layers)
    torch._dynamo.reset()
    counters.clear()
    made = {"forward": 0, "backward": 0} if compiled_graphs is None else compiled_graphs

    def counted(kind):
        def compiler(graph, example_inputs):
            made[kind] += 1
            return make_boxed_func(graph.forward)
        return compiler

    backend = aot_autograd(fw_compiler=counted("forward"), bw_compiler=counted("backward"))
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=backend)
    results = []
    # the fused summaries stay one operation running its CPU kernel: traced into, they are the Triton launches that only
    # a GPU runs (those kernels, for an sm90 target, are counted in test_launches)
    kept_whole = torch._functorch.config.patch(decompose_custom_triton_ops=False)
    for step in range(steps):
        tokens = torch.randint(0, 16, (2, L), generator=torch.Generator().manual_seed(step))
        for run in (compiled, model):
            model.zero_grad()
            with kept_whole, fused_everywhere(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                loss = run(tokens).float().square().mean()
            loss.backward()
            results.append((loss.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)))
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return results, graphs


# a static layout and a selecting one in the fast suite (seconds each); the k-means one (built in the graph) in the slow
BACKBONE_FAST = {"combiner_fixed", "combiner_select"}
BACKBONE_TRACE = [pytest.param(name, causal, marks=() if name in BACKBONE_FAST else pytest.mark.slow)
                  for name, causal, padding in TRACE_FAST]


@pytest.mark.parametrize("name,causal", BACKBONE_TRACE)
def test_a_compiled_backbone_is_one_graph_from_its_first_step(name, causal, monkeypatch):
    """``model.compile=true`` (``Transformer.prepare_flex_layouts`` first, as the task's start hooks call it): the whole
    backbone traces as one graph at the first step (``fullgraph=True`` raises at any break), is not compiled again
    at the second step, and gives the eager backbone's loss and gradients."""
    results, graphs = compiled_backbone_steps(name, causal, True, monkeypatch)
    assert graphs == 1  # compiled once: no recompile at step 2
    for compiled_step, eager_step in zip(results[::2], results[1::2]):
        for got, want in zip(compiled_step, eager_step):
            torch.testing.assert_close(got, want)


SIX_LAYERS = ["combiner_fixed", *(pytest.param(name, marks=pytest.mark.slow) for name in
                                  ("combiner_logsparse", "combiner_axial", "combiner_axial_vertical",
                                   "combiner_axial_horizontal", "combiner_mixture"))]


@pytest.mark.parametrize("name", SIX_LAYERS)
def test_six_layers_under_bf16_autocast_compile_to_one_forward_and_one_backward_graph(name, monkeypatch):
    """The training step's unit on a GPU (issue #43): a 6-layer backbone of a flex variant, its fused summaries included,
    under bf16 autocast is one forward and one backward graph for AOT autograd, made at the first step and never again
    over 4 steps; its losses and gradients are the eager backbone's under the same autocast."""
    graphs: dict = {"forward": 0, "backward": 0}
    results, dynamo_graphs = compiled_backbone_steps(name, True, True, monkeypatch, steps=4, layers=6, autocast=True,
                                                     compiled_graphs=graphs)
    assert dynamo_graphs == 1 and graphs == {"forward": 1, "backward": 1}
    for compiled_step, eager_step in zip(results[::2], results[1::2]):
        for got, want in zip(compiled_step, eager_step):
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_an_unprepared_compiled_backbone_breaks_its_graph_at_the_layout_build(monkeypatch):
    """Why the preparation exists: without it, the first trace reaches the block-mask build (kept eager), which
    ``fullgraph=True`` refuses (without fullgraph: a graph break, then a recompile at the next step)."""
    with pytest.raises(torch._dynamo.exc.Unsupported, match="torch.compiler.disable"):
        compiled_backbone_steps("combiner_fixed", True, False, monkeypatch, steps=1)


def test_the_check_catches_host_reads():
    x = torch.randn(4)
    for read in (lambda: x.sum().item(), lambda: bool(x[0] > 0), lambda: x[x > 0], lambda: torch.bincount(x.long().abs()),
                 lambda: x.cpu(), lambda: x.nonzero()):
        with pytest.raises(AssertionError, match="host"), NoHostReads():
            read()


def test_modules_that_differ_inside_a_wrapped_attention_get_their_own_layout(monkeypatch):
    """``combiner_select`` keeps its block size in its inner Combiner: two of them with other block sizes at one length
    used to share the first one's static layout (its masks), and the second one's forward was wrong."""
    monkeypatch.setattr(block_masks, "_REGISTRY", {})
    q, k, v = random_qkv(L=L, dtype=torch.float32, seed=18)
    with torch.no_grad():
        for block in (BLOCK, 2 * BLOCK):
            attn = build("combiner_select", True, seq_len=L, block_size=block).eval()
            torch.testing.assert_close(flex_forward(attn, q, k, v), attn.attention_matrix(q, k, v) @ v, atol=1e-5,
                                       rtol=0)
    assert len(block_masks._REGISTRY) == 2


def test_block_masks_are_built_once_per_geometry_for_every_layer_model_and_step():
    """Layers share one static layout per geometry, and so does a second model with another layer count; steps
    and padded batches rebuild nothing (a padded batch reuses the tiles with its own mask_mod)."""
    from longseq.models.transformer import Transformer

    def model(n_layers):
        return Transformer(vocab_size=11, seq_len=L, n_layers=n_layers, d_model=16, n_heads=2, dropout=0.0,
                           attn_dropout=0.0, attention={"name": "combiner_fixed", "causal": True, "block_size": BLOCK,
                                                        "backend": "flex"}, pos_emb="learned", image_shape=None).eval()

    block_masks.clear_registry()
    tokens = torch.randint(0, 11, (2, L))
    with torch.no_grad():
        before = BUILDS["block_masks"]
        model(3)(tokens)
        first = BUILDS["block_masks"] - before
        assert first == 1  # one call, one mask, for all three layers
        second = model(2)
        second(tokens)
        second(tokens)
        assert BUILDS["block_masks"] - before == first
        layers = [m for m in second.modules() if getattr(m, "name", None) == "combiner_fixed"]
        assert len({id(next(iter(layer.flex_layouts.values()))) for layer in layers}) == 1
        pad = pads()["padded"]
        layer = layers[0]
        q, k, v = random_qkv(L=L, D=8, dtype=torch.float32, seed=10)
        layer(q, k, v, key_padding_mask=pad)
        padded_builds = BUILDS["block_masks"]
        layer(q, k, v, key_padding_mask=~pad)  # another padding: the same tiles, another mask_mod
        assert BUILDS["block_masks"] == padded_builds


COMBINER_FLEX = sorted({name for name, _ in FLEX_CASES if ATTENTION_REGISTRY[name].cls.family == "combiner"})


# the layouts without a grid in the fast suite (seconds each); the axial family, log-sparse and mixture (20-50 s each
# at this length, all of a worker's memory for mixture) in the slow one
BYTES_FAST = {"combiner_fixed", "combiner_routing", "combiner_select"}


@pytest.mark.parametrize("name", [name if name in BYTES_FAST else pytest.param(name, marks=pytest.mark.slow)
                                  for name in COMBINER_FLEX])
def test_bytes_saved_for_backward_outside_the_flex_call(name):
    """The issue's memory proxy at L = 16,384 (D 64, bf16, causal): the bytes one layer keeps for its backward
    outside the flex calls (saved-tensor hooks; the calls a stand-in; parameters and the layer's q, k, v not
    counted), divided by L * D * element size per head, at most 20 (before: 15 / 58 / 140 / 213 for fixed /
    axial / logsparse / mixture). One head (every saved tensor holds heads side by side, so the ratio is the
    same for H = 8)."""
    L_long, H, D = 16384, 1, 64
    attn = build(name, True, seq_len=L_long, block_size=128, n_heads=H, head_dim=D, backend="flex")
    assert flex_kept_for_backward(attn, L_long, H, D).outside <= 20


def test_the_bytes_kept_for_backward_count_what_flexattention_keeps():
    """``combiner_fixed``'s one call keeps its keys and values over ``[keys ; summaries]`` padded to whole tiles, its
    output and its fp32 lse: 1 + 2 kv_len / L + 2 / D outputs' worth, from the layout (its queries are the layer's
    own q: the 1/sqrt(D) is applied in the call, not to a copy); the rest of the layer keeps little (its pooled
    summaries), and the whole counts a storage the two share once."""
    L_long, H, D = 1024, 2, 16
    attn = build("combiner_fixed", True, seq_len=L_long, block_size=32, n_heads=H, head_dim=D, backend="flex")
    kept = flex_kept_for_backward(attn, L_long, H, D)
    (kv_len,) = static_layout(attn, L_long, torch.device("cpu"), tile_size(L_long)).kv_lens
    assert kv_len > L_long
    assert kept.calls == pytest.approx(1 + 2 * kv_len / L_long + 2 / D)
    assert 0 < kept.outside < 0.5
    assert max(kept.calls, kept.outside) < kept.whole <= kept.calls + kept.outside
    assert engine.flex_call.__name__ == "flex_call"  # the real kernel is back


# what a layer may keep beyond its flex calls' own tensors, in outputs' worth at L = 2,048 (blocks of 32, H 2, D 64),
# each between the figure after the change that set it and the one before (in brackets)
KEPT_BEYOND_CALLS = {
    ("axial", False): 0.5,  # the merge weights each call's output in its own order: no reordered copy (1.16)
    ("moba", False): 2.0,  # the selectors weight their gathered rows before reading them back: no (L, k, D) copy (3.56)
    ("combiner_select", False): 2.5,  # (3.86)
    ("nsa", False): 4.0,  # (7.00)
    ("combiner_logsparse", False): 3.0,  # unpadded, amax pools: values kept, not int64 argmax indices (4.59)
    ("combiner_logsparse", True): 6.0,  # padded, max pools: amax would keep every level's masked copy (about 14)
    ("combiner_axial", False): 2.75,  # its learned summary keys recomputed in the backward (5.24), the merge (3.23)
}


@pytest.mark.parametrize("name,padded", sorted(KEPT_BEYOND_CALLS))
def test_a_layer_keeps_little_beyond_what_its_flex_calls_keep(name, padded):
    """The bytes a training layer keeps for its backward beyond its flex calls' q, k, v, outputs, lse and block masks
    (``flex_kept_for_backward``) stay under the ceilings the memory work of issues 31 and 32 reached: a change that
    kept a reordered, gathered or int64 copy again fails here."""
    attn = build(name, True, seq_len=2048, block_size=32, n_heads=2, head_dim=64, backend="flex")
    kept = flex_kept_for_backward(attn, 2048, 2, 64, padded=padded)
    assert kept.whole - kept.calls <= KEPT_BEYOND_CALLS[(name, padded)]


def test_the_merge_sends_no_nan_into_the_lse_gradients():
    """A query that no part reaches (every lse -inf: a padded query with no key left, a query without a chosen block)
    gets output 0 and lse -inf, and zero gradients into every part's lse and output. torch's logsumexp and logaddexp
    give NaN gradients for such a row even when the gradient coming in is zero, and FlexAttention would take that
    NaN as its lse gradient."""
    inf = float("inf")
    outs = [torch.randn(1, 1, 3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    lses = [torch.tensor([[[0.5, -inf, 1.0]]], dtype=torch.float64, requires_grad=True),
            torch.tensor([[[-inf, -inf, 2.0]]], dtype=torch.float64, requires_grad=True)]
    out, lse = merge_by_lse([(o, part, None) for o, part in zip(outs, lses)])
    assert torch.isneginf(lse[0, 0, 1]) and not out[0, 0, 1].any()
    torch.testing.assert_close(lse[0, 0, 2], torch.logaddexp(lses[0][0, 0, 2], lses[1][0, 0, 2]))
    (out.sum() + torch.where(torch.isneginf(lse), 0.0, lse).sum()).backward()
    for tensor in (*outs, *lses):
        assert torch.isfinite(tensor.grad).all()


def test_the_compiled_layer_frame_keeps_a_recompile_per_layout_and_length():
    """dynamo's default limit (8 recompiles) sent later layouts to eager, dense masks on an H200: making the compiled
    function raises it to ``FLEX_RECOMPILE_LIMIT`` (never lowers a higher one)."""
    import torch._dynamo

    for before, after in ((8, engine.FLEX_RECOMPILE_LIMIT), (500, 500)):
        with torch._dynamo.config.patch(recompile_limit=before):  # restored on exit
            engine._compiled.cache_clear()
            engine._compiled(engine.run_layer)
            assert torch._dynamo.config.recompile_limit == after >= 64
    engine._compiled.cache_clear()


def test_the_cpu_flex_reads_the_tile_tables_as_the_gpu_kernels_do():
    """The CPU forward every flex test compares (``ops.cpu.kernels.flex_reference``) visits only the tiles a block
    mask names: a tile its tables leave out drops its keys, a full tile skips the mask_mod, as on a GPU. Without
    this, a layout whose tables missed a tile would pass every CPU test and drop keys on the device."""
    from torch.nn.attention.flex_attention import BlockMask

    from longseq.attention.ops.cpu.kernels import flex_reference

    q, k, v = random_qkv(B=1, H=1, L=256, D=16, dtype=torch.float32, seed=15)
    partial, partial_tiles = torch.tensor([[[1, 0]]]), torch.tensor([[[[1, 0], [0, 1]]]])  # q tile 0: kv tile 1
    full, full_tiles = torch.tensor([[[0, 1]]]), torch.tensor([[[[0, 1], [0, 1]]]])  # q tile 1: kv tile 0, full

    def even_keys(b, h, q_, kv):
        return kv % 2 == 0

    mask = BlockMask.from_kv_blocks(*(x.int() for x in (partial, partial_tiles, full, full_tiles)), BLOCK_SIZE=128,
                                    mask_mod=even_keys, seq_lengths=(256, 256))
    out, lse = flex_reference(q, k, v, mask, 0.5)
    allowed = torch.zeros(256, 256, dtype=torch.bool)
    allowed[:128, 128::2] = True  # partial tile: the mask_mod's cells only
    allowed[128:, :128] = True  # full tile: every cell, the mask_mod not read
    logits = (0.5 * q @ k.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
    torch.testing.assert_close(out, logits.softmax(-1) @ v, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, logits.logsumexp(-1), atol=1e-5, rtol=0)


def test_static_layouts_pad_keys_to_whole_tiles():
    """Every call's KV is a whole number of tiles (its slots past the keys and summaries masked), so no kernel ever
    materializes a ragged last tile (combiner_logsparse at 65,536: KV 98,303 cost a dense Q x KV mask on an H200)."""
    attn = build("combiner_logsparse", True, seq_len=256, block_size=BLOCK)
    layout = static_layout(attn, 256, torch.device("cpu"), tile_size(256))
    (call,) = layout.calls
    assert call.kv_len(256) % layout.tile and layout.kv_lens[0] % layout.tile == 0
    dense = create_mask(call.mask_mod(256), 1, 1, 256, layout.kv_lens[0], "cpu")
    assert not dense[..., call.kv_len(256) :].any()


@pytest.mark.parametrize("name", ["combiner_fixed", *(pytest.param(name, marks=pytest.mark.slow)
                                                     for name in ("combiner_logsparse", "combiner_select", "nsa"))])
def test_no_summary_tile_makes_the_backward_loop_over_every_query_tile(name, monkeypatch):
    """FlexAttention's backward loops, for each key tile, over the query tiles that visit it. At L = 16,384 (m 128,
    the benchmark's geometry) every query used to visit the same 1 or 2 summary tiles: a serial loop over 127 or 128
    query tiles (``flex_longest_loop``; ``combiner_logsparse``: its tile of big blocks, whose coarse levels' users
    span the sequence). Laid out once per ``copy_rows(L)`` queries (``combiner_logsparse``: its big blocks only), no
    tile is visited by more than ``copy_rows(L) / TILE`` (32) query tiles, and every call visits as many tiles as
    before."""
    L_long, copy_rows = 16384, calls.copy_rows(16384)
    q_tiles = L_long // TILE

    def loop_and_tiles(rows: int) -> tuple[int, list[float]]:  # (longest loop in query tiles, tiles of each call)
        monkeypatch.setattr(calls, "COPY_ROWS", rows)
        monkeypatch.setattr(calls, "MIN_COPY_ROWS", rows)
        monkeypatch.setattr(block_masks, "_REGISTRY", {})
        attn = build(name, True, seq_len=L_long, block_size=128, n_heads=1, head_dim=64)
        layout = static_layout(attn, L_long, torch.device("cpu"), TILE)
        return round(flex_longest_loop(attn, L_long) * q_tiles), [tiles_of(mask) for mask in layout.masks]

    (before, tiles_before), (after, tiles_after) = loop_and_tiles(L_long), loop_and_tiles(copy_rows)
    assert before >= q_tiles - 1 and after <= copy_rows // TILE == 32
    assert tiles_after == tiles_before


@requires_cuda
@pytest.mark.parametrize("name,causal", FLEX_CASES)
def test_compiled_flex_on_cuda_forward_and_gradients(name, causal):
    """On CUDA the compiled layer (block skipping, forward and backward): output and q, k, v gradients against
    the dense reference ``attention_matrix @ v`` (fp32, ratio-free tolerance of a fused kernel)."""
    # D = 16: the compiled kernels' narrowest width (dispatch.FLEX_MIN_WIDTH)
    attn = build(name, causal, seq_len=L, block_size=BLOCK, head_dim=16).eval().cuda()
    q, k, v = (x.cuda().requires_grad_() for x in random_qkv(L=L, D=16, dtype=torch.float32, seed=4))
    grad = torch.randn_like(q)
    out = flex_forward(attn, q, k, v)
    flex_grads = torch.autograd.grad(out, (q, k, v), grad)
    ref = attn.attention_matrix(q, k, v) @ v
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
    for got, want in zip(flex_grads, ref_grads):
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


# -- query-dependent block selection on gathered queries (``ops.flex.selection``) ---------------------------------
SELECTING = ["moba", "nsa", "combiner_select"]


@pytest.mark.parametrize("length,block", [(384, 48), (512, 256), (320, 64)])
@pytest.mark.parametrize("name", SELECTING)
def test_chosen_blocks_on_gathered_queries_straddle_tiles(name, length, block):
    """Blocks that straddle two 128-key tiles (m = 48), span several (m = 256) or end in a short last tile
    (L = 320): every (query, block) pair's tile names the block's key tiles, so the flex forward is the dense
    reference's, padded or not."""
    attn = build(name, True, seq_len=length, block_size=block, head_dim=16).eval()
    pad = torch.zeros(2, length, dtype=torch.bool)
    pad[1, length - block - 5 :] = True
    with torch.no_grad():
        q, k, v = random_qkv(L=length, D=16, dtype=torch.float32, seed=12)
        for key_padding in (None, pad):
            kwargs = {} if key_padding is None else {"key_padding_mask": key_padding}
            torch.testing.assert_close(flex_forward(attn, q, k, v, key_padding),
                                       attn.attention_matrix(q, k, v, **kwargs) @ v, atol=1e-5, rtol=0)


# the knobs the bounds read (``nsa``: select_blocks, local_blocks; the others: top_k), their smallest and past every
# block included; a bound of 0 (every nsa pick forced; moba and combiner_select with one block) makes no call
BOUND_CASES = [("moba", {}), ("nsa", {}), ("combiner_select", {}),
               ("nsa", {"select_blocks": 3, "local_blocks": 2}), ("nsa", {"select_blocks": 2, "local_blocks": 1}),
               ("nsa", {"select_blocks": 6, "local_blocks": 1}), ("nsa", {"select_blocks": 9, "local_blocks": 3}),
               ("moba", {"top_k": 1}), ("moba", {"top_k": 3}), ("moba", {"top_k": 10}),
               ("combiner_select", {"top_k": 1}), ("combiner_select", {"top_k": 10}),
               ("moba", {"block_size": L}), ("combiner_select", {"block_size": L})]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name,knobs", BOUND_CASES)
def test_the_query_buffer_is_sized_by_the_pairs_the_rule_can_make(name, knobs, causal, monkeypatch):
    """The gathered call's buffer holds ``most_pairs`` pairs (``pair_bound``), not ``L x k``: unpadded, every batch
    makes exactly that many (the bound is tight: ``nsa``'s free picks, the others' ``min(k, blocks)``); under key
    padding at most that many (a pair past the bound would read another pair's row); the forward is the dense
    reference's."""
    if not ATTENTION_REGISTRY[name].cls.supports_bidirectional and not causal:
        pytest.skip("causal only")
    knobs = {"block_size": BLOCK, **knobs}
    attn = build(name, causal, seq_len=L, **knobs).eval()
    module = sys.modules[type(attn).__module__]
    seen = []

    def spy(q, k, v, chosen, ok, *args, most_pairs=None, **kwargs):
        seen.append((ok.sum((-2, -1)), most_pairs, chosen.shape[-2] * chosen.shape[-1]))
        return selection.selected_blocks(q, k, v, chosen, ok, *args, most_pairs=most_pairs, **kwargs)

    monkeypatch.setattr(module, "selected_blocks", spy)
    pad = torch.zeros(2, L, dtype=torch.bool)
    pad[0, : BLOCK + 3] = True  # block 0 padded: nsa's forced first block leaves its pick free
    pad[1, L - BLOCK - 5 :] = True
    q, k, v = random_qkv(L=L, dtype=torch.float32, seed=14)
    with torch.no_grad():
        for key_padding in (None, pad):
            kwargs = {} if key_padding is None else {"key_padding_mask": key_padding}
            torch.testing.assert_close(flex_forward(attn, q, k, v, key_padding),
                                       attn.attention_matrix(q, k, v, **kwargs) @ v, atol=1e-5, rtol=0)
    (unpadded, most, every), (padded, most_padded, _) = seen
    assert (unpadded == most).all() and most <= every
    assert (padded <= most_padded).all() and most_padded <= every
    if knobs == {"block_size": BLOCK} and (name == "nsa" or causal):  # the defaults: fewer rows than L x k
        assert most < every


@pytest.mark.parametrize("length,block", [(512, 32), (512, 128)])
@pytest.mark.parametrize("name", SELECTING)
def test_the_buffer_packs_blocks_under_a_tile_and_gives_bigger_ones_whole_tiles(name, length, block, monkeypatch):
    """Blocks under a tile: the pairs back to back (``most_pairs`` rounded up to a tile); a tile or more: each
    block's pairs from a tile's first row (a tile's padding per block, ``buffer_rows``). Either way the forward is
    the dense reference's, whose CPU flex reads the tables as the GPU does."""
    attn = build(name, True, seq_len=length, block_size=block, head_dim=16).eval()
    module = sys.modules[type(attn).__module__]
    rows = []

    def spy(q, k, v, chosen, ok, *args, most_pairs=None, **kwargs):
        out = selection.selected_blocks(q, k, v, chosen, ok, *args, most_pairs=most_pairs, **kwargs)
        rows.append(most_pairs)
        return out

    calls_seen = []  # query rows of each flex call
    flex_call = engine.flex_call

    def counted_call(q, k, v, mask, scale):
        calls_seen.append(q.shape[-2])
        return flex_call(q, k, v, mask, scale)

    monkeypatch.setattr(engine, "flex_call", counted_call)
    monkeypatch.setattr(module, "selected_blocks", spy)
    q, k, v = random_qkv(L=length, D=16, dtype=torch.float32, seed=17)
    with torch.no_grad():
        torch.testing.assert_close(flex_forward(attn, q, k, v), attn.attention_matrix(q, k, v) @ v, atol=1e-5, rtol=0)
    (most,) = rows
    expected = whole_tiles(most, TILE) if block < TILE else selection.buffer_rows(most, length // block, TILE)
    assert calls_seen[-1] == expected  # the gathered call runs last


@pytest.mark.parametrize("name", SELECTING)
def test_the_flex_path_scores_in_row_chunks_as_in_one_piece(name, monkeypatch):
    """The choice on the flex path is scored in chunks of query rows (``ops.block_select.by_query_chunks``, bounded
    by ``SCORE_CHUNK_BYTES``): chunks of a few rows give the output of one piece, bit for bit, padded or not."""
    from longseq.attention.ops import block_select

    attn = build(name, True, seq_len=L, block_size=BLOCK).eval()
    module = sys.modules[type(attn).__module__]
    scored = []  # rows of each top_blocks call (one per chunk)

    def counted(scores, k):
        scored.append(scores.shape[-2])
        return block_select.top_blocks(scores, k)

    monkeypatch.setattr(module, "top_blocks", counted)
    pad = torch.zeros(2, L, dtype=torch.bool)
    pad[1, L - BLOCK - 3 :] = True
    q, k, v = random_qkv(L=L, dtype=torch.float32, seed=16)
    with torch.no_grad():
        for key_padding in (None, pad):
            scored.clear()
            whole = flex_forward(attn, q, k, v, key_padding)
            assert scored == [L]
            scored.clear()
            with monkeypatch.context() as patch:
                patch.setitem(block_select.SCORE_CHUNK_BYTES, "cpu", 1)  # one query row a chunk
                chunked = flex_forward(attn, q, k, v, key_padding)
            assert scored == [1] * L
            assert torch.equal(whole, chunked)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", SELECTING)
def test_near_tie_selections_are_the_variants_own(name, causal):
    """Blocks whose scores tie exactly (repeated key blocks: equal means, equal summaries, equal importances): the
    flex path takes the blocks ``choose`` takes (ties to the lower index), which the dense reference takes too."""
    if not ATTENTION_REGISTRY[name].cls.supports_bidirectional and not causal:
        pytest.skip("causal only")
    attn = build(name, causal, seq_len=L, block_size=BLOCK).eval()
    q, k, v = random_qkv(L=L, dtype=torch.float32, seed=13)
    k = k.clone()
    k[..., BLOCK : 2 * BLOCK, :] = k[..., :BLOCK, :]  # blocks 0, 1 and 2 alike
    k[..., 2 * BLOCK : 3 * BLOCK, :] = k[..., :BLOCK, :]
    with torch.no_grad():
        torch.testing.assert_close(flex_forward(attn, q, k, v), attn.attention_matrix(q, k, v) @ v, atol=1e-5, rtol=0)


def test_combiner_select_other_partitions_say_why_they_have_no_flex_layout():
    attn = build("combiner_select", True, seq_len=L, block_size=BLOCK, partition="axial_vertical")
    assert "attention.partition=fixed" in attn.flex_config_reason()
    with pytest.raises(AttentionConfigError, match="attention.backend=flex"):
        build("combiner_select", True, seq_len=L, block_size=BLOCK, partition="axial_vertical", backend="flex")
