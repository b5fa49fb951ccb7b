"""Transformer-XL (relative attention, recurrence memory, adaptive softmax) and TRAMS memory selection:
exact-equality checks from reference/transformer_xl_trams.md section 3.7; tiny sizes, fp64 where exactness
matters ("exact" = equal to 1e-12 in fp64: the paths differ only in matmul shapes / memory layout)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from longseq.models.adaptive_softmax import AdaptiveLogSoftmax
from longseq.models.trams import TramsSpec, kept_indices, key_scores, query_weights, reformulated_keys
from longseq.models.transformer_xl import (
    MemorySpec,
    RelMultiHeadAttention,
    TransformerXL,
    attention_mask,
    rel_shift,
    sinusoid_embedding,
)
from longseq.tasks.xl_lm import IGNORE_INDEX, StreamSegments

VOCAB, D_MODEL, HEADS, D_HEAD = 23, 16, 2, 8


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny_xl(pre_lnorm: bool = False, cutoffs=(), seed: int = 0) -> TransformerXL:
    torch.manual_seed(seed)
    model = TransformerXL(VOCAB, n_layers=2, d_model=D_MODEL, n_heads=HEADS, d_inner=32, d_head=D_HEAD,
                          dropout=0.0, pre_lnorm=pre_lnorm, cutoffs=cutoffs, init_std=0.3)
    return model.double().eval()


def run_stream(model: TransformerXL, tokens: torch.Tensor, seg: int, spec: MemorySpec,
               stats: dict | None = None) -> torch.Tensor:
    """Segment-by-segment hidden states over ``tokens (B, T)`` with carried memory -> ``(B, T, d)``."""
    mems, out = None, []
    for start in range(0, tokens.shape[1], seg):
        hidden, mems = model(tokens[:, start : start + seg], mems, spec, stats)
        out.append(hidden)
    return torch.cat(out, dim=1)


def exact(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------- adaptive softmax


@pytest.mark.parametrize("cutoffs", [(), (5,), (5, 12)])
def test_adaptive_softmax_normalizes_and_nll_matches(cutoffs):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(VOCAB, D_MODEL).double()
    out = AdaptiveLogSoftmax(VOCAB, D_MODEL, cutoffs, emb.weight).double()
    torch.nn.init.normal_(out.bias)
    if cutoffs:
        torch.nn.init.normal_(out.cluster_weight)
    hidden = torch.randn(40, D_MODEL, dtype=torch.float64)
    logp = out.log_prob(hidden)
    assert logp.shape == (40, VOCAB)
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(40, dtype=torch.float64), rtol=0, atol=1e-12)
    targets = torch.randint(0, VOCAB, (40,))
    targets[:VOCAB] = torch.arange(VOCAB)  # every cluster hit
    targets[-1] = IGNORE_INDEX
    nll = out.nll(hidden, targets)
    expected = -logp.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    exact(nll[:-1], expected[:-1])
    assert nll[-1] == 0
    assert out.weight is emb.weight  # tied


def test_adaptive_softmax_rejects_bad_cutoffs():
    with pytest.raises(ValueError, match="model.cutoffs"):
        AdaptiveLogSoftmax(VOCAB, D_MODEL, (12, 5))
    with pytest.raises(ValueError, match="model.cutoffs"):
        AdaptiveLogSoftmax(VOCAB, D_MODEL, (5, VOCAB))


# ------------------------------------------------------------------------------------ relative attention


def test_rel_shift_equals_distance_gather():
    torch.manual_seed(0)
    B, H, Q, K = 2, 3, 5, 9
    raw = torch.randn(B, H, Q, K, dtype=torch.float64)  # column c: the term for distance K-1-c
    shifted = rel_shift(raw)
    for i in range(Q):
        for j in range(K - Q + i + 1):  # visible keys; the rest is masked
            distance = (K - Q + i) - j
            assert shifted[:, :, i, j].equal(raw[:, :, i, K - 1 - distance])


def test_sinusoid_table_is_sin_half_then_cos_half():
    table = sinusoid_embedding(torch.tensor([0.0, 3.0]), 8)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    exact(table[1], torch.cat([(3 * inv_freq).sin(), (3 * inv_freq).cos()]))
    exact(table[0], torch.tensor([0.0] * 4 + [1.0] * 4, dtype=torch.float64))


def test_attention_mask_causal_and_same_length():
    mask = attention_mask(3, 7, mem_len=4, same_length=False)
    assert (~mask[:, :4]).all() and mask[0, 5:].all() and not mask[2].any()
    same = attention_mask(3, 7, mem_len=4, same_length=True)
    assert ((~same).sum(-1) == 4).all()  # memory full: every query sees exactly mem_len keys
    assert same[0, 0] and same[1, :2].all() and not same[1, 2:6].any()


def brute_force_layer(layer: RelMultiHeadAttention, x, mem, u, v, keep, compressed: bool,
                      clamp_len: int = -1) -> torch.Tensor:
    """The attention layer computed from explicit per-pair distances: keys outside ``keep (B, H, K)`` are
    hidden; ``compressed`` counts positions over the kept keys only, else true positions."""
    q, k, val = layer.project(x, mem)
    B, H, Q, D = q.shape
    K = k.shape[2]
    if compressed:
        key_pos = keep.long().cumsum(-1) - 1
        query_pos = keep.sum(-1, keepdim=True) - Q + torch.arange(Q)
    else:
        key_pos = torch.arange(K).expand(B, H, K)
        query_pos = (K - Q + torch.arange(Q)).expand(B, H, Q)
    distance = query_pos[..., :, None] - key_pos[..., None, :]  # (B, H, Q, K)
    clamped = distance.clamp(min=0)
    if clamp_len > 0:
        clamped = clamped.clamp(max=clamp_len)
    table = sinusoid_embedding(clamped.reshape(-1), x.shape[-1]).view(B, H, Q, K, -1)
    r = layer.pos_proj(table).view(B, H, Q, K, H, D).diagonal(dim1=1, dim2=4).permute(0, 4, 1, 2, 3)
    positional = torch.einsum("bhqd,bhqkd->bhqk", q + v[:, None], r)
    content = (q + u[:, None]) @ k.transpose(-1, -2)
    hidden = ~keep[:, :, None, :] | (distance < 0)
    probs = torch.softmax(((content + positional) * layer.scale).masked_fill(hidden, float("-inf")), -1)
    y = layer.out((probs @ val).transpose(1, 2).reshape(B, Q, -1))
    return layer.norm(x + y)


def random_layer_inputs(B=2, Q=4, M=10, seed=0):
    torch.manual_seed(seed)
    layer = RelMultiHeadAttention(D_MODEL, HEADS, D_HEAD, 0.0, 0.0, pre_lnorm=False).double().eval()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(B, Q, D_MODEL, dtype=torch.float64)
    mem = torch.randn(B, M, D_MODEL, dtype=torch.float64)
    u, v = torch.randn(2, HEADS, D_HEAD, dtype=torch.float64)
    return layer, x, mem, u, v


def layer_pos_emb(K: int, clamp_len: int = -1) -> torch.Tensor:
    distances = torch.arange(K - 1, -1, -1.0)
    if clamp_len > 0:
        distances = distances.clamp(max=clamp_len)
    return sinusoid_embedding(distances, D_MODEL)


@pytest.mark.parametrize("clamp_len", [-1, 6])
def test_relative_attention_matches_brute_force(clamp_len):
    layer, x, mem, u, v = random_layer_inputs()
    K = mem.shape[1] + x.shape[1]
    out = layer(x, mem, layer_pos_emb(K, clamp_len), u, v, MemorySpec(mem.shape[1], clamp_len=clamp_len))
    keep = torch.ones(2, HEADS, K, dtype=torch.bool)
    expected = brute_force_layer(layer, x, mem, u, v, keep, False, clamp_len)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------------------------- TRAMS


def test_reformulated_content_score_equals_qk():
    layer, x, mem, u, v = random_layer_inputs()
    q, k, _ = layer.project(x, mem)
    w_q = query_weights(layer.qkv.weight, HEADS, D_HEAD)
    k_prime = reformulated_keys(k, w_q)  # (B, H, K, d)
    torch.testing.assert_close(torch.einsum("bqd,bhkd->bhqk", x, k_prime), q @ k.transpose(-1, -2),
                               rtol=1e-12, atol=1e-10)
    # the scores never build K' but equal the formulas on it
    code = k_prime.norm(dim=-1) * k_prime.sum(-1).abs()
    cosine = torch.nn.functional.cosine_similarity(k_prime, torch.ones_like(k_prime), dim=-1)
    paper = cosine * k_prime.norm(dim=-1)
    torch.testing.assert_close(key_scores(k, w_q, "code"), code, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(key_scores(k, w_q, "paper"), paper, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("positions", ["compressed", "original"])
@pytest.mark.parametrize("score", ["code", "paper"])
def test_trams_layer_matches_brute_force_and_selects_per_head_and_row(positions, score):
    layer, x, mem, u, v = random_layer_inputs(B=3, M=12)
    B, Q, M = x.shape[0], x.shape[1], mem.shape[1]
    K, recent, topk = M + Q, 3, 4
    spec = MemorySpec(M, trams=TramsSpec(recent, topk, score, positions))
    stats = {"selected": []}
    out = layer(x, mem, layer_pos_emb(K), u, v, spec, stats)
    (index,) = stats["selected"]
    n_candidates = M - recent
    chosen = index[..., :topk]
    assert index.shape == (B, HEADS, topk + recent + Q)
    assert (chosen.diff(dim=-1) > 0).all() and (chosen >= 0).all() and (chosen < n_candidates).all()
    assert index[..., topk:].equal(torch.arange(n_candidates, K).expand(B, HEADS, -1))
    # independent per (row, head): each picks the top of its own scores
    _, k, _ = layer.project(x, mem)
    scores = key_scores(k[:, :, :n_candidates], query_weights(layer.qkv.weight, HEADS, D_HEAD), score)
    for b in range(B):
        for h in range(HEADS):
            expected = sorted(scores[b, h].topk(topk).indices.tolist())
            assert chosen[b, h].tolist() == expected
    assert len({tuple(chosen[b, h].tolist()) for b in range(B) for h in range(HEADS)}) > 1
    # a row alone selects what it selected inside the batch
    alone = {"selected": []}
    layer(x[1:2], mem[1:2], layer_pos_emb(K), u, v, spec, alone)
    assert alone["selected"][0].equal(index[1:2])
    keep = torch.zeros(B, HEADS, K, dtype=torch.bool).scatter(2, index, True)
    expected_out = brute_force_layer(layer, x, mem, u, v, keep, compressed=positions == "compressed")
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-10)


@pytest.mark.parametrize("mem_init", ["empty", "zeros"])
@pytest.mark.parametrize("positions", ["compressed", "original"])
def test_trams_recent_only_equals_xl_with_m(mem_init, positions):
    model = tiny_xl()
    tokens = torch.randint(0, VOCAB, (2, 40))
    m, pool = 6, 16
    xl = run_stream(model, tokens, 4, MemorySpec(m, mem_init))
    recent_only = TramsSpec(m, 0, positions=positions)
    trams = run_stream(model, tokens, 4, MemorySpec(pool, mem_init, trams=recent_only))
    exact(trams, xl)


@pytest.mark.parametrize("mem_init", ["empty", "zeros"])
def test_trams_selecting_every_candidate_equals_xl_with_pool(mem_init):
    model = tiny_xl()
    tokens = torch.randint(0, VOCAB, (2, 40))
    pool, recent = 16, 5
    stats = {"selected": []}
    xl = run_stream(model, tokens, 4, MemorySpec(pool, mem_init))
    select_all = TramsSpec(recent, pool - recent)
    trams = run_stream(model, tokens, 4, MemorySpec(pool, mem_init, trams=select_all), stats)
    assert stats["selected"], "the selection path never ran"
    exact(trams, xl)


def test_trams_selection_changes_the_output_and_keeps_the_pool_fifo():
    model = tiny_xl()
    tokens = torch.randint(0, VOCAB, (2, 40))
    spec = MemorySpec(16, trams=TramsSpec(4, 3))
    mems = None
    for start in range(0, 40, 4):
        hidden, new = model(tokens[:, start : start + 4], mems, spec)
        inputs = [model.drop(model.token_embedding(tokens[:, start : start + 4]) * D_MODEL ** 0.5)]
        if mems is not None:  # the pool is the last 16 layer inputs, whatever was selected
            exact(new[0], torch.cat([mems[0], inputs[0]], 1)[:, -16:])
        mems = new
    assert mems[0].shape == (2, 16, D_MODEL)
    plain = run_stream(model, tokens, 4, MemorySpec(16))
    assert not torch.allclose(run_stream(model, tokens, 4, spec), plain)


def test_kept_indices_topk_zero_keeps_the_recent_block():
    scores = torch.randn(2, 3, 5)
    exact(kept_indices(scores, 0, 9).double(), torch.arange(5, 9).expand(2, 3, 4).double())


# ----------------------------------------------------------------------------------- recurrence, streams


@pytest.mark.parametrize("pre_lnorm", [False, True])
def test_recurrence_with_full_memory_equals_one_long_segment(pre_lnorm):
    """Segments with memory covering all the past give exactly the single long-sequence computation."""
    model = tiny_xl(pre_lnorm)
    tokens = torch.randint(0, VOCAB, (2, 24))
    whole, _ = model(tokens, None, MemorySpec(0))
    exact(run_stream(model, tokens, 5, MemorySpec(24)), whole)
    # a shorter memory changes the result
    assert not torch.allclose(run_stream(model, tokens, 5, MemorySpec(4)), whole)


def test_memory_gradients_stop_at_the_segment_boundary():
    model = tiny_xl().train()
    tokens = torch.randint(0, VOCAB, (1, 8))
    _, mems = model(tokens[:, :4], None, MemorySpec(4))
    assert all(not m.requires_grad for m in mems)


def stream_eval(model, stream: np.ndarray, n_streams: int, seg: int, spec: MemorySpec,
                protocol: str = "xl_next_token"):
    """Summed NLL and scored-token count of a streaming evaluation (what XLLanguageModel does)."""
    mems, total, count = None, torch.zeros((), dtype=torch.float64), 0
    for inputs, targets in StreamSegments(stream, n_streams, seg, loss_protocol=protocol):
        hidden, mems = model(inputs, mems, spec)
        total = total + model.nll(hidden, targets).sum()
        count += int((targets >= 0).sum())
    return total, count


def test_streaming_eval_bsz1_equals_single_stream_and_parallel_streams_are_independent():
    model = tiny_xl(cutoffs=(5, 12))
    stream = np.random.default_rng(0).integers(0, VOCAB, 61).astype(np.uint8)
    # bsz = 1 with memory over the whole past: one long forward over the stream
    total, count = stream_eval(model, stream, 1, 7, MemorySpec(64))
    tokens = torch.from_numpy(stream.astype(np.int64))[None]
    hidden, _ = model(tokens[:, :-1], None, MemorySpec(0))
    assert count == len(stream) - 1
    torch.testing.assert_close(total, model.nll(hidden, tokens[:, 1:]).sum(), rtol=1e-12, atol=1e-10)
    # bsz = 3 parallel streams == each stream evaluated alone
    spec = MemorySpec(8, same_length=True, clamp_len=6)
    total3, count3 = stream_eval(model, stream, 3, 7, spec)
    rows = stream[: len(stream) // 3 * 3].reshape(3, -1)
    alone = [stream_eval(model, row, 1, 7, spec) for row in rows]
    assert count3 == sum(c for _, c in alone) == 3 * (rows.shape[1] - 1)
    torch.testing.assert_close(total3, sum(t for t, _ in alone), rtol=1e-12, atol=1e-10)


def test_stream_segments_cover_every_target_once_and_hf_protocol_drops_segment_ends():
    stream = np.arange(50, dtype=np.int64) % 251
    segments = list(StreamSegments(stream, 2, 6))
    assert len(segments) == len(StreamSegments(stream, 2, 6))
    targets = torch.cat([t for _, t in segments], dim=1)
    assert targets.tolist() == [list(range(1, 25)), list(range(26, 50))]
    assert all(i[:, 1:].equal(t[:, :-1]) for i, t in segments)
    hf = list(StreamSegments(stream, 2, 6, loss_protocol="hf_in_segment_shift"))
    assert all((t[:, -1] == IGNORE_INDEX).all() and (t[:, :-1] >= 0).all() for _, t in hf)
    shard = list(StreamSegments(stream, 2, 6, first=1, rows=1))
    assert torch.cat([t for _, t in shard], 1).tolist() == [list(range(26, 50))]


# --------------------------------------------------------------------------------------- Lightning task


def test_xl_task_trains_and_evaluates_xl_and_trams(make_cfg, tmp_path):
    from conftest import compose_config

    from longseq.runner import evaluate, train

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(("def f(x):\n    return x + 1\n" * 200).encode())
    cfg = make_cfg(["task=enwik8", "model=transformer_xl", f"task.data.path={corpus}", "trainer=cpu",
                    "model.tgt_len=8", "memory.mem_len=8", "task.batch_size=4", "task.data.eval_batch_size=2",
                    "trainer.limit_val_batches=3", "trainer.limit_test_batches=3", "memory.selection=trams",
                    "memory.pool=16", "memory.recent_keep=4", "memory.topk=4", "memory.eval_mem_len=8"])
    metrics = train(cfg)
    for key in ("test/bpc", "test/trams_bpc", "test/mem_mass", "test/trams_mem_mass", "val/bpc_best"):
        assert math.isfinite(metrics[key]), key
    assert 0 < metrics["test/mem_mass"] < 1 and metrics["test/tokens"] == 3 * 2 * 8
    assert cfg.task.module._target_ == "longseq.tasks.xl_lm.XLLanguageModel"
    ecfg = compose_config([f"ckpt_path={metrics['ckpt_path']}", "trainer=cpu", "trainer.limit_test_batches=2",
                           "trainer.enable_progress_bar=false"], tmp_path / "eval", config_name="eval")
    again = evaluate(ecfg)
    assert math.isfinite(again["test/trams_bpc"]) and again["test/tokens"] == 2 * 2 * 8


def test_xl_task_rejects_other_attentions_and_image_tasks(make_cfg):
    from longseq.runner import build_module

    with pytest.raises(ValueError, match="attention=full"):
        build_module(make_cfg(["task=enwik8", "model=transformer_xl", "attention=local"]))
    with pytest.raises(ValueError, match="memory.selection"):
        build_module(make_cfg(["task=enwik8", "model=transformer_xl", "memory.selection=nope"]))


@pytest.mark.parametrize("key", ["n_layers", "d_model", "n_heads", "d_inner"])
def test_model_sizes_below_one_are_rejected_naming_the_key(key):
    from longseq.utils.errors import ConfigError

    sizes = dict(vocab_size=10, n_layers=1, d_model=8, n_heads=2, d_inner=16)
    sizes[key] = 0
    with pytest.raises(ConfigError, match=rf"model\.{key}: must be an integer >= 1, got 0"):
        TransformerXL(**sizes)
