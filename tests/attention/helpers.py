"""The one helpers module of the attention tests: how tests build a variant as training does, and reusable
assertions on the attention contract (DESIGN.md)."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from conftest import CONF
from omegaconf import OmegaConf

from longseq.attention import ATTENTION_REGISTRY, Attention, AttentionConfigError, build_attention
from longseq.attention.ops.geometry import BlockGrid
from longseq.attention.ops.partition import Partition
from longseq.attention.registry import accepted_kwargs

L, BLOCK = 16, 4


def build(name: str, causal: bool, seq_len: int | None = L, n_heads: int = 2, head_dim: int = 8,
          block_size: int = BLOCK, conf_dir=None, **overrides):
    """The attention ``name`` built from ``<conf_dir>/attention/<name>.yaml`` with a (seq_len, block_size,
    4 clusters) task geometry, the way training builds it (``causal`` injected by the task, like
    ``seq_len``); ``overrides`` replace resolved knobs (``seq_len=None``: built without a known length)."""
    spec = OmegaConf.load((conf_dir or CONF) / "attention" / f"{name}.yaml")
    task = {"causal": causal, "seq_len": seq_len or L, "block_size": block_size, "n_clusters": 4}
    root = OmegaConf.create({"task": task, "attention": spec,
                             "partition": {"name": "fixed", "block_size": block_size}})
    kwargs = OmegaConf.to_container(root.attention, resolve=True)
    kwargs.update(overrides, causal=causal)
    return build_attention(kwargs.pop("name"), seq_len=seq_len, n_heads=n_heads, head_dim=head_dim, **kwargs)


def modes(name: str) -> list[bool]:
    """The directions (causal True/False) variant ``name`` supports."""
    cls = ATTENTION_REGISTRY[name].cls
    return [c for c, ok in ((True, cls.supports_causal), (False, cls.supports_bidirectional)) if ok]


def cases(flag: str | None = None) -> list[tuple[str, bool]]:
    """(name, causal) for every registered variant and direction, optionally only those whose class sets ``flag``."""
    return [(name, causal) for name in sorted(ATTENTION_REGISTRY) for causal in modes(name)
            if flag is None or getattr(ATTENTION_REGISTRY[name].cls, flag)]


CASES = cases()


def random_qkv(B=2, H=2, L=16, D=8, dtype=torch.float64, seed=0, requires_grad=False):
    """Unscaled q, k, v of shape (B, H, L, D) from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g, dtype=dtype).requires_grad_(requires_grad) for _ in range(3)]


def assert_rows_sum_to_one(P: torch.Tensor, atol: float = 1e-10) -> None:
    torch.testing.assert_close(P.sum(-1), torch.ones_like(P[..., 0]), atol=atol, rtol=0)


def assert_no_future(P: torch.Tensor) -> None:
    L = P.shape[-1]
    future = torch.ones(L, L, dtype=torch.bool).triu(1)
    assert (P[..., future] == 0).all(), "causal attention puts weight on the future"


def assert_support(P: torch.Tensor, allowed: torch.Tensor) -> None:
    """Weights are positive exactly on ``allowed`` (L, L) and zero elsewhere."""
    allowed = allowed.to(torch.bool).expand_as(P)
    assert (P[allowed] > 0).all(), "an allowed key gets zero weight (support too small)"
    assert (P[~allowed] == 0).all(), "a disallowed key gets positive weight (support too large)"


def assert_output_matches_matrix(attn: Attention, q, k, v, atol: float = 1e-10) -> None:
    """``forward(q, k, v) == attention_matrix(q, k, v) @ v``."""
    attn.eval()
    out = attn(q, k, v)
    P = attn.attention_matrix(q, k, v)
    torch.testing.assert_close(out, P @ v, atol=atol, rtol=0)


def assert_causal_perturbation(attn: Attention, q, k, v, t: int) -> None:
    """Changing k, v (and q) at position t changes no output before t."""
    attn.eval()
    out = attn(q, k, v)
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[..., t, :] += 3.0
    out2 = attn(q2, k2, v2)
    torch.testing.assert_close(out[..., :t, :], out2[..., :t, :], atol=1e-12, rtol=0)
    assert not torch.allclose(out[..., t:, :], out2[..., t:, :]), "perturbation had no effect at all"


def dense_masked_attention(q, k, v, allowed: torch.Tensor) -> torch.Tensor:
    """Reference softmax attention restricted to ``allowed`` (L, L) bool, with 1/sqrt(D) scaling."""
    logits = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    logits = logits.masked_fill(~allowed, float("-inf"))
    return logits.softmax(-1) @ v


def matrix_from_forward(attn: Attention, q, k) -> torch.Tensor:
    """The weights the FAST path applies: ``forward(q, k, I)`` with one-hot values ``(B, H, L, L)``.

    Valid for variants whose output is linear in v with weights independent of v (value width free).
    """
    attn.eval()
    B, H, L, _ = q.shape
    eye = torch.eye(L, dtype=q.dtype, device=q.device).expand(B, H, L, L)
    return attn(q, k, eye)


def assert_clean_partition(direct: torch.Tensor, regions: torch.Tensor, region_allowed: torch.Tensor, causal: bool) -> None:
    """Per query, direct keys and the members of its allowed regions cover the allowed keys exactly once.

    ``direct`` (L, L) bool, ``regions`` (R, L) bool membership, ``region_allowed`` (L, R) bool.
    """
    L = direct.shape[0]
    coverage = direct.to(torch.int64) + region_allowed.to(torch.int64) @ regions.to(torch.int64)  # (L, L)
    expected = torch.ones(L, L, dtype=torch.int64)
    if causal:
        expected = expected.tril()
    assert torch.equal(coverage, expected), "direct keys and regions do not cover the allowed keys exactly once"
    assert direct.diagonal().all(), "self must be attended directly"
    assert regions.any(-1).all(), "empty region in the partition"


def assert_region_rank_one(P: torch.Tensor, regions: torch.Tensor, region_allowed: torch.Tensor, atol: float = 1e-10) -> None:
    """Within a region, every query's weights are proportional to one inner distribution p(j|R).

    For each region R the block ``P[..., queries using R, members of R]`` is rank one: normalizing
    each row to sum 1 gives the same row for every query.
    """
    for r in range(regions.shape[0]):
        users = region_allowed[:, r].nonzero().flatten()
        if users.numel() == 0:
            continue
        block = P[..., users, :][..., regions[r]]  # (B, H, |users|, |R|)
        rows = block / block.sum(-1, keepdim=True)
        torch.testing.assert_close(rows, rows[..., :1, :].expand_as(rows), atol=atol, rtol=0)


def padding_patterns(L: int, seed: int = 0) -> torch.Tensor:
    """(6, L) bool key padding masks (True = pad): none, all, a ragged tail, a leading stretch (left
    padding), an interior stretch, and random positions."""
    g = torch.Generator().manual_seed(seed)
    pad = torch.zeros(6, L, dtype=torch.bool)
    pad[1] = True
    pad[2, (2 * L) // 3 + 1 :] = True
    pad[3, : L // 3] = True
    pad[4, L // 4 : L // 2] = True
    pad[5] = torch.rand(L, generator=g) < 0.4
    return pad


def assert_key_padding_outcomes(attn: Attention, q, k, v, pad: torch.Tensor, full_support: bool,
                                atol: float = 1e-10) -> None:
    """What key padding ``pad`` (B, L) bool, True = pad, must give any variant (eval mode, fp64).

    ``forward == attention_matrix @ v``, rows sum to one, no future when causal, no weight from a real query on a
    padded key, and padded keys' contents (k and v) do not reach real queries' outputs; with ``full_support``
    (Combiner), every real key a real query may see keeps a positive weight.
    """
    L = pad.shape[-1]
    P = attn.attention_matrix(q, k, v, key_padding_mask=pad)
    assert P.shape == (*q.shape[:-1], L)
    out = attn(q, k, v, key_padding_mask=pad)
    torch.testing.assert_close(out, P @ v, atol=atol, rtol=0)
    assert_rows_sum_to_one(P, atol=atol)
    allowed = torch.ones(L, L, dtype=torch.bool)
    if attn.causal:
        assert_no_future(P)
        allowed = allowed.tril()
    real_query = ~pad[:, None, :, None]
    padded_key = pad[:, None, None, :]
    assert (P[(real_query & padded_key).expand_as(P)] == 0).all(), "a real query puts weight on a padded key"
    if full_support:
        assert (P[(real_query & ~padded_key & allowed).expand_as(P)] > 0).all(), "a real key lost its weight"
    k2, v2 = k.clone(), v.clone()
    k2[pad[:, None, :].expand_as(k[..., 0])] += 3.0
    v2[pad[:, None, :].expand_as(v[..., 0])] -= 5.0
    real = ~pad[:, None, :].expand_as(out[..., 0])
    torch.testing.assert_close(attn(q, k2, v2, key_padding_mask=pad)[real], out[real], atol=atol, rtol=0)


def assert_combiner_key_padding(attn: Attention, q, k, v, pad: torch.Tensor, atol: float = 1e-10) -> None:
    """A Combiner variant under key padding ``pad``: ``assert_key_padding_outcomes`` with full support."""
    attn.eval()
    assert_key_padding_outcomes(attn, q, k, v, pad, full_support=True, atol=atol)


def assert_padded_gradients(attn: Attention, q, k, v, pad: torch.Tensor) -> None:
    """Backward of the real outputs under key padding ``pad`` (B, L): finite gradients into q, k, v (which must
    require grad), and nothing flows into padded keys or values."""
    attn(q, k, v, key_padding_mask=pad).masked_fill(pad[:, None, :, None], 0).sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    padded = pad[:, None, :].expand_as(k[..., 0])
    assert (k.grad[padded] == 0).all() and (v.grad[padded] == 0).all()


# Methods whose explicit matrix is an exact linear operator but not a softmax (rows need not sum to 1),
# and FNet, whose hidden-axis DFT makes the output not one (L, L) matrix times v (its own tests cover it).
NOT_NORMALIZED = {"linformer", "nystrom", "fnet"}
NOT_EXACT = {"fnet"}


def check_contract(name: str, causal: bool) -> None:
    """Shape, finiteness, rows sum to one, ``forward == attention_matrix @ v``, no future when causal."""
    torch.manual_seed(0)
    attn = build(name, causal).double().eval()
    q, k, v = random_qkv(B=2, H=2, L=L, D=8)
    out = attn(q, k, v)
    assert out.shape == q.shape and torch.isfinite(out).all()
    P = attn.attention_matrix(q, k, v)
    assert P.shape == (2, 2, L, L)
    if attn.normalized_rows:
        assert_rows_sum_to_one(P, atol=1e-8)
    if attn.matrix_is_exact:
        torch.testing.assert_close(out, P @ v, atol=1e-8, rtol=1e-6)
    if causal:
        assert_no_future(P)
    assert attn.normalized_rows or attn.name in NOT_NORMALIZED, "only known operators may skip row sums"
    assert attn.matrix_is_exact or attn.name in NOT_EXACT


BAD_BLOCK_SIZES = (4.7, 4.0, 0, -8, True, "8")  # never floored, never coerced


def takes_block_size(name: str) -> bool:
    """Whether variant ``name`` has an ``attention.block_size`` knob (a keyword of its constructors)."""
    return "block_size" in accepted_kwargs(ATTENTION_REGISTRY[name].cls)


def check_block_size_validation(name: str) -> None:
    """The one ``attention.block_size`` validation (``geometry.check_block_size``), for a variant that takes one.

    A non-integer (4.7, even 4.0), zero, a negative, a bool or a string is rejected at construction, with or
    without a known length; so is a block size that does not tile the length, at construction and, when the
    length was unknown, on the first call. Every message names ``attention.block_size`` and the valid values. A
    grid variant (``BlockGrid``) words them exactly alike; the clustering variants, whose optional block size
    only sets the granularity of lcm(block_size, n_clusters) segments, share the first message.
    """
    cls = ATTENTION_REGISTRY[name].cls
    causal = modes(name)[0]
    grid = issubclass(cls, BlockGrid)
    for bad in BAD_BLOCK_SIZES:
        for seq_len in (L, None):
            with pytest.raises(AttentionConfigError) as raised:
                build(name, causal, seq_len=seq_len, block_size=bad)
            valid = "[1, 2, 4, 8, 16]" if grid and seq_len else "positive integers dividing the sequence length"
            expected = f"attention.block_size={bad!r} is not a positive integer; valid values: "
            assert str(raised.value).startswith(expected), (name, bad, str(raised.value))
            if grid:
                assert str(raised.value) == expected + valid, (name, bad, str(raised.value))
    tile = "attention.block_size=5 does not tile sequence length 16; valid values: [1, 2, 4, 8, 16]"
    message = re.escape(tile) if grid else r"attention\.block_size.*\[1, 2, 4, 8, 16\]"
    with pytest.raises(AttentionConfigError, match=message):
        build(name, causal, seq_len=L, block_size=5)
    attn = build(name, causal, seq_len=None, block_size=5)  # length unknown: checked on the first call
    with pytest.raises(AttentionConfigError, match=message):
        attn(*random_qkv(B=1, H=2, L=L, D=8))
    if grid:
        assert attn.requires_len_multiple_of() == 5
    else:  # a block size that is not a grid's row length may be left out (None)
        signatures = [inspect.signature(k.__dict__["__init__"]).parameters for k in cls.__mro__ if "__init__" in k.__dict__]
        default = next(p["block_size"].default for p in signatures if "block_size" in p)
        assert default is None, f"attention '{name}' has a required block_size but is no BlockGrid (ops.geometry)"


def padding_masks(L: int = L) -> torch.Tensor:
    """(3, L) bool, True = pad: a ragged tail, a whole-row tail, and a padded stretch inside the document."""
    pad = torch.zeros(3, L, dtype=torch.bool)
    pad[0, 9:] = True  # row 2 half padded, row 3 entirely padded (block 4)
    pad[1, 12:] = True  # the last row padded (row-aligned)
    pad[2, 5:7] = True
    return pad


def check_key_padding(name: str, causal: bool) -> None:
    """The one key-padding rule (``ops.padding``), for any variant with ``supports_padding_mask`` (fp64, eval).

    Rows sum to one, no future when causal, zero weight from a real query on a padded key, ``forward ==
    attention_matrix @ v`` under padding, padded keys' contents cannot reach a real query, an all-False mask is
    no mask, a fully padded document falls back to the unpadded direct keys (where the variant exposes its
    ``partition(L)``), and Combiner variants keep full support over the real document.
    """
    torch.manual_seed(0)
    attn = build(name, causal).double().eval()
    assert attn.supports_padding_mask
    pad = padding_masks()
    q, k, v = random_qkv(B=3, H=2, L=L, D=8)
    # Combiner variants keep full support over the real document, whatever the padding
    assert_key_padding_outcomes(attn, q, k, v, pad, full_support=attn.family == "combiner")

    none = torch.zeros_like(pad)
    torch.testing.assert_close(attn(q, k, v, key_padding_mask=none), attn(q, k, v), atol=1e-10, rtol=0)
    torch.testing.assert_close(attn.attention_matrix(q, k, v, key_padding_mask=none), attn.attention_matrix(q, k, v),
                               atol=1e-10, rtol=0)

    # rule 3: a document with no real key at all gives every query its unpadded direct keys only
    try:
        part = attn.partition(L)
    except (TypeError, AttributeError):  # routing: its partition takes the clustering of the data, not L
        part = None
    if isinstance(part, Partition):
        everything = torch.ones(1, L, dtype=torch.bool)
        empty_doc = attn(q[:1], k[:1], v[:1], key_padding_mask=everything)
        direct_only = Partition.direct_only(part.direct).effective_matrix(attn.scale(q[:1]), k[:1], None, None)
        torch.testing.assert_close(empty_doc, direct_only @ v[:1], atol=1e-10, rtol=0)


def check_decoding(name: str, knobs: dict | None = None, prefix: int | None = None, L: int = 64,
                   block_size: int = 8) -> None:
    """Teacher-forced decoding (``prefix`` None: one step per position; else ``prefill(prefix)`` + steps)
    reproduces ``forward`` at every position, fp64, to 1e-9, on an L = 64, m = 8 grid."""
    torch.manual_seed(0)
    attn = build(name, True, seq_len=L, block_size=block_size, **(knobs or {})).double().eval()
    q, k, v = random_qkv(B=2, H=2, L=L, D=8, seed=1)
    with torch.no_grad():
        expected = attn(q, k, v)
        state = attn.new_state(2, L, device=q.device, dtype=q.dtype)
        start = prefix or 0
        outs = [attn.prefill(state, q[..., :start, :], k[..., :start, :], v[..., :start, :])] if start else []
        assert state.length == start
        outs += [attn.step(state, q[..., t : t + 1, :], k[..., t : t + 1, :], v[..., t : t + 1, :]) for t in range(start, L)]
    assert state.length == L
    torch.testing.assert_close(torch.cat(outs, -2), expected, atol=1e-9, rtol=0)
