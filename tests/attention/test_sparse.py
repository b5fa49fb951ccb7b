"""Sparse attention family: patterns against per-definition masks, forward against dense masked attention.

The reference masks below are written straight from each definition with explicit loops over (i, j),
independently of the index arithmetic in ``longseq.attention.sparse``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    assert_causal_perturbation,
    assert_no_future,
    assert_output_matches_matrix,
    assert_rows_sum_to_one,
    assert_support,
    dense_masked_attention,
    random_qkv,
)
from omegaconf import OmegaConf

from longseq.attention import AttentionConfigError, build_attention
from longseq.attention.registry import ATTENTION_REGISTRY, accepted_kwargs

NAMES = ["local", "strided", "fixed", "logsparse", "axial", "longformer", "bigbird", "random"]
CONF = Path(__file__).resolve().parents[2] / "conf" / "attention"


# -- per-definition masks ------------------------------------------------------------------------
def mask_from(L, allowed) -> torch.Tensor:
    return torch.tensor([[bool(allowed(i, j)) for j in range(L)] for i in range(L)])


def local_mask(L, causal, window):
    if causal:
        return mask_from(L, lambda i, j: 0 <= i - j <= window - 1)
    return mask_from(L, lambda i, j: abs(i - j) <= window // 2)


def longformer_mask(L, causal, window, dilation=1, global_tokens=0):
    def allowed(i, j):
        d = i - j
        if i < global_tokens or j < global_tokens:
            return True
        if causal:
            return d >= 0 and d % dilation == 0 and d // dilation <= window - 1
        return abs(d) % dilation == 0 and abs(d) // dilation <= window // 2

    return mask_from(L, allowed)


def strided_mask(L, causal, block_size):
    l = block_size
    if causal:
        return mask_from(L, lambda i, j: j <= i and (i - j < l or (i - j) % l == 0))
    return mask_from(L, lambda i, j: abs(i - j) < l or abs(i - j) % l == 0)


def fixed_mask(L, causal, block_size, summary_cells=1):
    m, c = block_size, summary_cells

    def allowed(i, j):
        ok = i // m == j // m or j % m >= m - c
        return ok and j <= i if causal else ok

    return mask_from(L, allowed)


def axial_mask(L, causal, block_size):
    m = block_size

    def allowed(i, j):
        ok = i // m == j // m or i % m == j % m
        return ok and j <= i if causal else ok

    return mask_from(L, allowed)


def logsparse_keys_by_definition(p):
    """Combiner §4.2: self and, per set bit t of p, the sum of p's bits >= t, minus one (0-based)."""
    keys = {p}
    for t in range(p.bit_length()):
        if p >> t & 1:
            keys.add(sum(2**s for s in range(t, p.bit_length()) if p >> s & 1) - 1)
    return keys


def logsparse_mask(L, causal):
    if causal:
        return mask_from(L, lambda i, j: j in logsparse_keys_by_definition(i))
    return mask_from(
        L,
        lambda i, j: j in logsparse_keys_by_definition(i) or (L - 1 - j) in logsparse_keys_by_definition(L - 1 - i),
    )


def random_mask(L, causal, n_random, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(L, n_random, generator=g, dtype=torch.float64)
    allowed = torch.eye(L, dtype=torch.bool)
    for i in range(L):
        span = i + 1 if causal else L
        for r in range(n_random):
            allowed[i, min(int(u[i, r] * span), L - 1)] = True
    return allowed


def bigbird_mask(L, block_size, global_blocks, random_table):
    """Window + global blocks from the definition; random blocks from the module's stored draw."""
    b, n = block_size, L // block_size
    glob = set(range((global_blocks + 1) // 2)) | {n - 1 - s for s in range(global_blocks // 2)}
    heads = random_table.shape[0]
    allowed = torch.zeros(heads, L, L, dtype=torch.bool)
    for h in range(heads):
        for i in range(L):
            for j in range(L):
                a, c = i // b, j // b
                allowed[h, i, j] = abs(a - c) <= 1 or a in glob or c in glob or c in random_table[h, a].tolist()
    return allowed


def reference_mask(name, L, causal, kw, attn):
    if name == "local":
        return local_mask(L, causal, **kw)
    if name == "longformer":
        return longformer_mask(L, causal, **kw)
    if name == "strided":
        return strided_mask(L, causal, **kw)
    if name == "fixed":
        return fixed_mask(L, causal, **kw)
    if name == "axial":
        return axial_mask(L, causal, **kw)
    if name == "logsparse":
        return logsparse_mask(L, causal)
    if name == "random":
        return random_mask(L, causal, **kw)
    if name == "bigbird":
        table = attn.random_blocks_for(L // kw["block_size"])
        return bigbird_mask(L, kw["block_size"], kw["global_blocks"], table)
    raise KeyError(name)


# (name, L, kwargs, modes); edges: block 1, block = L, L = 1, lengths needing padding
CASES = [
    ("local", 16, dict(window=4), (True, False)),
    ("local", 13, dict(window=5), (True, False)),
    ("local", 16, dict(window=1), (True, False)),
    ("local", 16, dict(window=16), (True, False)),
    ("local", 1, dict(window=3), (True, False)),
    ("longformer", 16, dict(window=4, dilation=2), (True, False)),
    ("longformer", 14, dict(window=3, dilation=3), (True, False)),
    ("longformer", 13, dict(window=4, dilation=2, global_tokens=2), (False,)),
    ("longformer", 16, dict(window=2, global_tokens=1), (False,)),
    ("strided", 16, dict(block_size=4), (True, False)),
    ("strided", 24, dict(block_size=8), (True, False)),
    ("strided", 16, dict(block_size=1), (True, False)),
    ("strided", 16, dict(block_size=16), (True, False)),
    ("strided", 1, dict(block_size=1), (True, False)),
    ("fixed", 16, dict(block_size=4), (True, False)),
    ("fixed", 24, dict(block_size=8, summary_cells=3), (True, False)),
    ("fixed", 16, dict(block_size=1), (True, False)),
    ("fixed", 16, dict(block_size=16, summary_cells=2), (True, False)),
    ("fixed", 1, dict(block_size=1), (True, False)),
    ("axial", 16, dict(block_size=4), (True, False)),
    ("axial", 24, dict(block_size=8), (True, False)),
    ("axial", 16, dict(block_size=1), (True, False)),
    ("axial", 16, dict(block_size=16), (True, False)),
    ("axial", 1, dict(block_size=1), (True, False)),
    ("logsparse", 16, dict(), (True, False)),
    ("logsparse", 17, dict(), (True, False)),
    ("logsparse", 33, dict(), (True, False)),
    ("logsparse", 1, dict(), (True, False)),
    ("random", 16, dict(n_random=3), (True, False)),
    ("random", 13, dict(n_random=0), (True, False)),
    ("random", 1, dict(n_random=2), (True, False)),
    ("bigbird", 16, dict(block_size=2, global_blocks=2, random_blocks=1), (False,)),
    ("bigbird", 24, dict(block_size=3, global_blocks=1, random_blocks=3), (False,)),
    ("bigbird", 16, dict(block_size=1, global_blocks=0, random_blocks=2), (False,)),
    ("bigbird", 16, dict(block_size=16, global_blocks=2, random_blocks=3), (False,)),
]
PARAMS = [
    pytest.param(name, L, kw, causal, id=f"{name}-L{L}-{'-'.join(f'{k}{v}' for k, v in kw.items())}-{'causal' if causal else 'bidir'}")
    for name, L, kw, modes in CASES
    for causal in modes
]


def build(name, causal, kw, H=2, L=None):
    extra = dict(n_heads=H, seq_len=L) if name == "bigbird" else {}
    return build_attention(name, causal=causal, **kw, **extra)


def test_every_family_member_is_covered():
    assert {c[0] for c in CASES} == set(NAMES)


@pytest.mark.parametrize("name, L, kw, causal", PARAMS)
def test_pattern_and_weights_match_definition(name, L, kw, causal):
    attn = build(name, causal, kw, L=L)
    allowed = reference_mask(name, L, causal, kw, attn)
    assert torch.equal(attn.pattern(L).expand_as(allowed), allowed)
    q, k, v = random_qkv(L=L)
    P = attn.attention_matrix(q, k, v)
    assert_support(P, allowed)
    assert_rows_sum_to_one(P)
    if causal and L > 1:  # (assert_no_future cannot reduce an empty upper triangle)
        assert_no_future(P)


@pytest.mark.parametrize("name, L, kw, causal", PARAMS)
def test_forward_matches_dense_masked_attention(name, L, kw, causal):
    attn = build(name, causal, kw, L=L).eval()
    allowed = reference_mask(name, L, causal, kw, attn)
    q, k, v = random_qkv(L=L)
    torch.testing.assert_close(attn(q, k, v), dense_masked_attention(q, k, v, allowed), atol=1e-10, rtol=0)
    assert_output_matches_matrix(attn, q, k, v, atol=1e-10)
    q32, k32, v32 = random_qkv(L=L, dtype=torch.float32, seed=1)
    torch.testing.assert_close(attn(q32, k32, v32), dense_masked_attention(q32, k32, v32, allowed), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name, L, kw, causal", [p for p in PARAMS if p.values[3] and p.values[1] > 1])
def test_causal_perturbation(name, L, kw, causal):
    attn = build(name, causal, kw, L=L)
    q, k, v = random_qkv(L=L)
    for t in (1, L // 2, L - 1):
        assert_causal_perturbation(attn, q, k, v, t)


@pytest.mark.parametrize(
    "name, kw, causal",
    [
        ("local", dict(window=3), True),
        ("longformer", dict(window=3, dilation=2, global_tokens=1), False),
        ("strided", dict(block_size=2), True),
        ("fixed", dict(block_size=2, summary_cells=1), True),
        ("axial", dict(block_size=2), False),
        ("axial", dict(block_size=2), True),  # the two-flash-call path
        ("logsparse", dict(), True),
        ("random", dict(n_random=2), False),
        ("bigbird", dict(block_size=2, global_blocks=1, random_blocks=1), False),
    ],
)
def test_gradients(name, kw, causal):
    attn = build(name, causal, kw, L=8).eval()
    q, k, v = random_qkv(B=1, L=8, D=3, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: attn(a, b, c), (q, k, v), fast_mode=True)
    attn(q, k, v).square().sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("L", [11, 16])
def test_logsparse_level_products_gradcheck(L, causal):
    """The gather-free level products have a hand-written backward: check it on complete and cut-short pairs."""
    attn = build("logsparse", causal, {}, L=L).eval()
    q, k, v = random_qkv(B=1, L=L, D=3, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: attn(a, b, c), (q, k, v), fast_mode=True)


@pytest.mark.parametrize("name", NAMES)
def test_dropout_in_training_keeps_shape(name):
    kw = dict(local=dict(window=4), longformer=dict(window=4), bigbird=dict(block_size=4)).get(name, {})
    if name in ("strided", "fixed", "axial"):
        kw = dict(block_size=4)
    causal = name != "bigbird"
    attn = build_attention(name, causal=causal, dropout=0.5, **kw).train()
    q, k, v = random_qkv(L=16, dtype=torch.float32)
    out = attn(q, k, v)
    assert out.shape == q.shape and torch.isfinite(out).all()


# -- configuration errors ------------------------------------------------------------------------
def test_bigbird_rejects_causal():
    with pytest.raises(AttentionConfigError, match="cannot be causal"):
        build_attention("bigbird", causal=True, block_size=4)


def test_longformer_rejects_causal_global_tokens():
    with pytest.raises(AttentionConfigError, match="attention.global_tokens"):
        build_attention("longformer", causal=True, window=4, global_tokens=1)


@pytest.mark.parametrize(
    "name, kw, key",
    [
        ("local", dict(window=0), "attention.window"),
        ("local", dict(window=True), "attention.window"),  # a bool is no window (check_int_knob)
        ("random", dict(n_random=2.5), "attention.n_random"),
        ("longformer", dict(dilation=0), "attention.dilation"),
        ("fixed", dict(block_size=4, summary_cells=5), "attention.summary_cells"),
        ("random", dict(n_random=-1), "attention.n_random"),
        ("bigbird", dict(random_blocks=-1), "attention.random_blocks"),
    ],
)
def test_bad_knobs_name_their_key(name, kw, key):
    with pytest.raises(AttentionConfigError, match=key):
        build_attention(name, causal=False, **kw)


# -- seeded randomness ---------------------------------------------------------------------------
def test_bigbird_random_blocks_are_seeded_per_head_and_saved():
    kw = dict(causal=False, block_size=2, global_blocks=2, random_blocks=2, n_heads=4, seq_len=32)
    a, b = build_attention("bigbird", seed=7, **kw), build_attention("bigbird", seed=7, **kw)
    assert torch.equal(a.random_table, b.random_table)
    assert not torch.equal(a.random_table, build_attention("bigbird", seed=8, **kw).random_table)
    table = a.random_table  # (H, n, r)
    n = 16
    assert table.shape == (4, n, 2)
    assert any(not torch.equal(table[0], table[h]) for h in range(1, 4)), "random blocks should differ per head"
    for h in range(4):
        for blk in range(n):
            drawn = [c for c in table[h, blk].tolist() if c >= 0]
            assert len(set(drawn)) == len(drawn)
            assert all(abs(c - blk) > 1 and c not in (0, n - 1) for c in drawn)
    assert "random_table" in a.state_dict()
    c = build_attention("bigbird", seed=0, **kw)
    c.load_state_dict(a.state_dict())
    assert torch.equal(c.pattern(32), a.pattern(32))


def test_random_pattern_is_seeded_and_saved():
    a = build_attention("random", causal=True, n_random=3, seed=3, seq_len=32)
    assert torch.equal(a.pattern(32), build_attention("random", causal=True, n_random=3, seed=3).pattern(32))
    assert not torch.equal(a.pattern(32), build_attention("random", causal=True, n_random=3, seed=4).pattern(32))
    assert "random_keys" in a.state_dict()


def test_logsparse_example_row():
    attn = build_attention("logsparse", causal=True)
    assert attn.pattern(16)[13].nonzero().flatten().tolist() == [7, 11, 12, 13]


# -- registry and configs ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "partition, expected",
    [({"name": "fixed", "block_size": 4}, "fixed"), ({"name": "logsparse"}, "logsparse"), ({"name": "axial", "block_size": 4}, "axial")],
)
def test_generic_sparse_entry_resolves_partitions(partition, expected):
    attn = build_attention("sparse", partition=partition, causal=True)
    assert attn.name == expected
    direct = build_attention(expected, causal=True, **{k: v for k, v in partition.items() if k != "name"})
    q, k, v = random_qkv(L=16)
    torch.testing.assert_close(attn(q, k, v), direct(q, k, v), atol=0, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_config_file_matches_constructor(name):
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    assert cfg.name == name and name in ATTENTION_REGISTRY
    keys = set(cfg) - {"name"}
    assert keys <= accepted_kwargs(ATTENTION_REGISTRY[name].cls)
    resolved = OmegaConf.to_container(
        OmegaConf.merge({"task": {"causal": name != "bigbird", "block_size": 4}}, {"attention": cfg}), resolve=True
    )["attention"]
    resolved.pop("name")
    attn = build_attention(name, causal=name != "bigbird", **resolved)  # causal: injected by the task
    q, k, v = random_qkv(L=16, dtype=torch.float32)
    assert attn(q, k, v).shape == q.shape
