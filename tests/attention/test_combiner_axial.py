"""Combiner axial family: combiner_axial (row-major), combiner_axial_vertical, combiner_axial_horizontal,
combiner_mixture — contract, exact partitions, rank-1 region structure, causality, gradients, configs."""

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
    random_qkv,
)
from omegaconf import OmegaConf

from longseq.attention import AttentionConfigError, build_attention
from longseq.attention.registry import ATTENTION_REGISTRY, accepted_kwargs

NAMES = ["combiner_axial", "combiner_axial_vertical", "combiner_axial_horizontal", "combiner_mixture"]
H, D = 2, 8

# (name, extra knobs): every variant with its defaults plus each non-default option.
CONFIGS = [(name, {}) for name in NAMES] + [
    ("combiner_axial", {"row_summary": "none"}),
    ("combiner_axial", {"row_summary": "wsum"}),
    ("combiner_axial_vertical", {"summary": "mean"}),
    ("combiner_axial_vertical", {"summary": "deepsets_max"}),
    ("combiner_axial_horizontal", {"summary": "mean"}),
    ("combiner_axial_horizontal", {"summary": "deepsets_mean"}),
    ("combiner_axial_horizontal", {"horizontal_regions": "split"}),
    ("combiner_mixture", {"summary": "mean"}),
    ("combiner_mixture", {"summary": "deepsets_max"}),
    ("combiner_mixture", {"plans": "average"}),
]
# (L, m) including a single column (m = 1), a single row (m = L, n = 1) and non-square grids.
SHAPES = [(16, 4), (12, 3), (12, 1), (12, 12), (8, 2), (6, 3), (1, 1)]


def make(name, causal, block_size, **extra):
    torch.manual_seed(0)
    return build_attention(name, causal=causal, block_size=block_size, n_heads=H, head_dim=D, **extra).double().eval()


def config_id(cfg):
    name, extra = cfg
    return name + "".join(f"-{k}={v}" for k, v in extra.items())


# -- the contract ---------------------------------------------------------------------------------
# every variant on every grid shape; every non-default option on one non-square grid
CONTRACT_CASES = [(cfg, L, m) for cfg in CONFIGS[: len(NAMES)] for L, m in SHAPES] + [
    (cfg, 12, 3) for cfg in CONFIGS[len(NAMES) :]
]


@pytest.mark.parametrize("cfg,L,m", CONTRACT_CASES, ids=lambda x: config_id(x) if isinstance(x, tuple) else str(x))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_contract_full_support(cfg, L, m, causal):
    name, extra = cfg
    attn = make(name, causal, m, **extra)
    q, k, v = random_qkv(B=2, H=H, L=L, D=D, seed=L + m)
    P = attn.attention_matrix(q, k, v)
    assert P.shape == (2, H, L, L)
    assert_rows_sum_to_one(P, atol=1e-10)
    allowed = torch.ones(L, L, dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
        if L > 1:  # a single position has no future to check
            assert_no_future(P)
    assert_support(P, allowed)  # full attention support: every allowed key gets positive weight
    assert_output_matches_matrix(attn, q, k, v, atol=1e-10)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_degenerate_grids_reduce_to_full_attention(name, causal):
    """A single row (m = L) has no regions: every variant is then exactly full attention (one 1/sqrt(D))."""
    L = 12
    q, k, v = random_qkv(B=1, H=H, L=L, D=D)
    full = build_attention("full", causal=causal)
    expected = full.attention_matrix(q, k, v)
    attn = make(name, causal, L)
    torch.testing.assert_close(attn(q, k, v), expected @ v, atol=1e-12, rtol=0)
    torch.testing.assert_close(attn.attention_matrix(q, k, v), expected, atol=1e-12, rtol=0)
    # A single column (m = 1): the pooled family's direct part is the whole column, again full
    # attention; row-major with raw summary keys also degenerates to it (each region is one token).
    extra = {"row_summary": "none"} if name == "combiner_axial" else {}
    attn = make(name, causal, 1, **extra)
    torch.testing.assert_close(attn(q, k, v), expected @ v, atol=1e-12, rtol=0)


# -- hand-enumerated partitions for L = 16, m = 4 (grid positions r * 4 + c) ----------------------------
def query_view(part, i):
    """(direct set, {frozenset(region members)} usable by query i)."""
    direct = set(torch.nonzero(part.direct[i]).flatten().tolist())
    regions = {frozenset(torch.nonzero(part.members[R]).flatten().tolist()) for R in torch.nonzero(part.usable[i]).flatten().tolist()}
    return direct, regions


def regions(*sets):
    return {frozenset(s) for s in sets}


ROWS = [set(range(4 * r, 4 * r + 4)) for r in range(4)]
EXPECTED = {
    # query 9 = (r=2, c=1); query 15 = (3, 3); query 0 = (0, 0)
    ("combiner_axial", True): {
        9: ({8, 9}, regions(ROWS[0], ROWS[1])),
        15: (ROWS[3], regions(ROWS[0], ROWS[1], ROWS[2])),
        0: ({0}, set()),
    },
    ("combiner_axial", False): {
        9: (ROWS[2], regions(ROWS[0], ROWS[1], ROWS[3])),
        15: (ROWS[3], regions(ROWS[0], ROWS[1], ROWS[2])),
        0: (ROWS[0], regions(ROWS[1], ROWS[2], ROWS[3])),
    },
    ("combiner_axial_vertical", True): {
        9: ({1, 5, 8, 9}, regions({0, 4}, {2, 6}, {3, 7})),
        15: ({3, 7, 11, 12, 13, 14, 15}, regions({0, 4, 8}, {1, 5, 9}, {2, 6, 10})),
        0: ({0}, set()),
    },
    ("combiner_axial_vertical", False): {
        9: ({8, 9, 10, 11, 1, 5, 13}, regions({0, 4}, {2, 6}, {3, 7}, {12}, {14}, {15})),
        15: ({3, 7, 11, 12, 13, 14, 15}, regions({0, 4, 8}, {1, 5, 9}, {2, 6, 10})),
        0: ({0, 1, 2, 3, 4, 8, 12}, regions({5, 9, 13}, {6, 10, 14}, {7, 11, 15})),
    },
    ("combiner_axial_horizontal", True): {
        9: ({1, 5, 8, 9}, regions({0, 2, 3}, {4, 6, 7})),
        15: ({3, 7, 11, 12, 13, 14, 15}, regions({0, 1, 2}, {4, 5, 6}, {8, 9, 10})),
        4: ({0, 4}, regions({1, 2, 3})),
    },
    ("combiner_axial_horizontal", False): {
        9: ({8, 9, 10, 11, 1, 5, 13}, regions({0, 2, 3}, {4, 6, 7}, {12, 14, 15})),
        15: ({3, 7, 11, 12, 13, 14, 15}, regions({0, 1, 2}, {4, 5, 6}, {8, 9, 10})),
        0: ({0, 1, 2, 3, 4, 8, 12}, regions({5, 6, 7}, {9, 10, 11}, {13, 14, 15})),
    },
    ("combiner_mixture", True): {
        9: ({1, 5, 8, 9}, regions({0, 4}, {2, 6}, {3, 7}, {0}, {2, 3}, {4}, {6, 7})),
        15: ({3, 7, 11, 12, 13, 14, 15}, regions({0, 4, 8}, {1, 5, 9}, {2, 6, 10}, {0, 1, 2}, {4, 5, 6}, {8, 9, 10})),
        0: ({0}, set()),
    },
    ("combiner_mixture", False): {
        9: (
            {8, 9, 10, 11, 1, 5, 13},
            regions({0, 4}, {2, 6}, {3, 7}, {12}, {14}, {15}, {0}, {2, 3}, {4}, {6, 7}, {12}, {14, 15}),
        ),
        15: ({3, 7, 11, 12, 13, 14, 15}, regions({0, 4, 8}, {1, 5, 9}, {2, 6, 10}, {0, 1, 2}, {4, 5, 6}, {8, 9, 10})),
        0: ({0, 1, 2, 3, 4, 8, 12}, regions({5, 9, 13}, {6, 10, 14}, {7, 11, 15}, {5, 6, 7}, {9, 10, 11}, {13, 14, 15})),
    },
}


@pytest.mark.parametrize("name,causal", list(EXPECTED), ids=lambda x: str(x))
def test_partition_hand_enumerated(name, causal):
    part = make(name, causal, 4).partition(16)
    for i, (direct, regs) in EXPECTED[(name, causal)].items():
        assert query_view(part, i) == (direct, regs), f"query {i}"


def test_horizontal_split_and_rowmajor_anchor_hand_enumerated():
    part = make("combiner_axial_horizontal", True, 4, horizontal_regions="split").partition(16)
    assert query_view(part, 9) == ({1, 5, 8, 9}, regions({0}, {2, 3}, {4}, {6, 7}))
    # Row-major: query (2, 1) reads the summaries of rows 0 and 1 as seen from its column 1.
    part = make("combiner_axial", True, 4).partition(16)
    used = torch.nonzero(part.usable[9]).flatten()
    assert sorted(part.anchor[used].tolist()) == [1, 5]


PARTITION_CONFIGS = [(name, {}) for name in NAMES] + [("combiner_axial_horizontal", {"horizontal_regions": "split"})]


@pytest.mark.parametrize("cfg", PARTITION_CONFIGS, ids=config_id)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("L,m", SHAPES)
def test_partition_covers_allowed_keys_exactly_once_per_factorization(cfg, causal, L, m):
    name, extra = cfg
    part = make(name, causal, m, **extra).partition(L)
    allowed = torch.ones(L, L, dtype=torch.long)
    if causal:
        allowed = allowed.tril()
    assert part.members.any(-1).all(), "empty regions must not exist (they would be masked anyway)"
    assert (part.direct.diagonal()).all(), "self is attended directly"
    families = part.family.unique().tolist() or [0]
    for family in families:
        usable = (part.usable & (part.family == family)).long()
        # direct and the regions of one factorization are disjoint and cover every allowed key once
        coverage = part.direct.long() + usable @ part.members.long()
        assert torch.equal(coverage, allowed), f"family {family}"
    if name == "combiner_mixture":
        assert set(families) <= {0, 1}
        # the intended overlap: a key off the query's row and column sits in one vertical AND one horizontal region
        both = part.usable.long() @ part.members.long()
        rows, cols = torch.arange(L) // m, torch.arange(L) % m
        off_axes = (rows[:, None] != rows[None, :]) & (cols[:, None] != cols[None, :]) & allowed.bool()
        assert torch.equal(both[off_axes], torch.full_like(both[off_axes], 2))
        assert (both[~off_axes] == 0).all()


# -- rank-1 structure inside regions (paper §3.3) -------------------------------------------------------
def weights_from_forward(attn, q, k):
    """Effective weights through the FAST path: forward with v = identity returns P itself."""
    B, Hh, L, _ = q.shape
    eye = torch.eye(L, dtype=q.dtype).expand(B, Hh, L, L)
    return attn(q, k, eye)


@pytest.mark.parametrize(
    "cfg",
    [
        ("combiner_axial", {"row_summary": "none"}),
        ("combiner_axial", {"row_summary": "wsum"}),
        ("combiner_axial_vertical", {}),
        ("combiner_axial_vertical", {"summary": "mean"}),
        ("combiner_axial_horizontal", {}),
        ("combiner_axial_horizontal", {"horizontal_regions": "split"}),
    ],
    ids=config_id,
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_region_weights_are_rank_one(cfg, causal):
    """For every region R, all queries using it weight R's keys proportionally to one p(j | R)."""
    name, extra = cfg
    L, m = 16, 4
    attn = make(name, causal, m, **extra)
    q, k, _ = random_qkv(B=1, H=H, L=L, D=D, seed=3)
    P = weights_from_forward(attn, q, k)
    part = attn.partition(L)
    qs = q / D**0.5
    checked = 0
    for R in range(part.members.shape[0]):
        users, members = part.usable[:, R], part.members[R]
        if not users.any():
            continue
        block = P[..., users, :][..., members]  # (B, H, users, |R|)
        profile = block / block.sum(-1, keepdim=True)
        # the region's own softmax, recomputed here from its definition
        if part.anchor[R] >= 0:
            summary_q = qs[..., part.anchor[R], :]
        elif attn.summary_kind == "max":
            summary_q = qs[..., members, :].amax(-2)
        else:
            summary_q = qs[..., members, :].mean(-2)
        inner = (summary_q.unsqueeze(-2) @ k[..., members, :].transpose(-1, -2)).softmax(-1)
        torch.testing.assert_close(profile, inner.expand_as(profile), atol=1e-10, rtol=0)
        checked += 1
    assert checked > 10


def test_mixture_average_plans_is_mean_of_the_two_factorizations():
    q, k, v = random_qkv(B=1, H=H, L=16, D=D, seed=5)
    for causal in (True, False):
        mix = make("combiner_mixture", causal, 4, plans="average")
        vertical = make("combiner_axial_vertical", causal, 4)
        horizontal = make("combiner_axial_horizontal", causal, 4, horizontal_regions="split")
        torch.testing.assert_close(mix(q, k, v), (vertical(q, k, v) + horizontal(q, k, v)) / 2, atol=1e-12, rtol=0)


def test_mixture_joint_weights_match_official_layout():
    """Causal mixture == a literal [D1 | D2 | V | HL | HR] joint softmax written with Python loops (tiny L)."""
    L, m = 12, 3
    n = L // m
    q, k, v = random_qkv(B=1, H=1, L=L, D=D, seed=7)
    qs = q[0, 0] / D**0.5
    kk, vv = k[0, 0], v[0, 0]

    def summary(cells):
        idx = torch.tensor([r * m + c for r, c in cells])
        qbar, kbar = qs[idx].amax(0), kk[idx].amax(0)
        return kbar, (qbar @ kk[idx].T).softmax(-1) @ vv[idx]

    out = torch.zeros(L, D, dtype=q.dtype)
    for r in range(n):
        for c in range(m):
            keys, values = [], []
            for rr in range(r):  # D1: own column strictly above
                keys.append(kk[rr * m + c]), values.append(vv[rr * m + c])
            for cc in range(c + 1):  # D2: own row up to self
                keys.append(kk[r * m + cc]), values.append(vv[r * m + cc])
            if r > 0:
                for cc in range(m):  # V(c'), c' != c
                    if cc != c:
                        kb, vb = summary([(rr, cc) for rr in range(r)])
                        keys.append(kb), values.append(vb)
            for rr in range(r):  # HL(r'), HR(r')
                if c > 0:
                    kb, vb = summary([(rr, cc) for cc in range(c)])
                    keys.append(kb), values.append(vb)
                if c < m - 1:
                    kb, vb = summary([(rr, cc) for cc in range(c + 1, m)])
                    keys.append(kb), values.append(vb)
            w = (qs[r * m + c] @ torch.stack(keys).T).softmax(-1)
            out[r * m + c] = w @ torch.stack(values)
    attn = make("combiner_mixture", True, m)
    torch.testing.assert_close(attn(q, k, v)[0, 0], out, atol=1e-12, rtol=0)


# -- causality and gradients -------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", CONFIGS, ids=config_id)
def test_causal_perturbation(cfg):
    name, extra = cfg
    attn = make(name, True, 4, **extra)
    q, k, v = random_qkv(B=1, H=H, L=16, D=D, seed=11)
    for t in (0, 5, 10, 15):
        assert_causal_perturbation(attn, q, k, v, t)


GRADCHECK_CASES = [(cfg, causal) for cfg in CONFIGS[: len(NAMES)] for causal in (True, False)] + [
    (cfg, True) for cfg in CONFIGS[len(NAMES) :]
]


@pytest.mark.parametrize("cfg,causal", GRADCHECK_CASES, ids=lambda x: config_id(x) if isinstance(x, tuple) else str(x))
def test_gradcheck(cfg, causal):
    name, extra = cfg
    torch.manual_seed(0)
    attn = build_attention(name, causal=causal, block_size=2, n_heads=1, head_dim=4, **extra).double().eval()
    q, k, v = random_qkv(B=1, H=1, L=8, D=4, seed=13, requires_grad=True)
    assert torch.autograd.gradcheck(attn, (q, k, v), eps=1e-6, atol=1e-6, fast_mode=True)


POOLED_CONFIGS = [cfg for cfg in CONFIGS if cfg[0] != "combiner_axial"]


@pytest.mark.parametrize("cfg", POOLED_CONFIGS, ids=config_id)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_inference_path_equals_training_path(cfg, causal, padded, monkeypatch):
    """``no_grad`` takes the inference path of the joint softmax — without key padding the fused flash parts
    (``_GridFlash``) run with autograd off, so nothing is kept for backward; with padding
    ``_JointGroupsAttention`` divides the output by the normalizer once and keeps no weights — and equals the
    autograd path and ``attention_matrix @ v`` (fp64)."""
    import longseq.attention.ops.cpu.grid_flash as grid_flash
    import longseq.attention.ops.joint_softmax as joint

    name, extra = cfg
    L, m = 12, 3
    attn = make(name, causal, m, **extra)
    pad = padding_cases(L, m) if padded else None
    q, k, v = random_qkv(B=6, H=H, L=L, D=D, seed=21, requires_grad=True)
    calls = []  # per joint softmax: whether it builds what backward needs
    if padded:
        original = joint._JointGroupsAttention.forward

        def spy(ctx, layouts, masks, keep_weights, *tensors):
            calls.append(keep_weights)
            return original(ctx, layouts, masks, keep_weights, *tensors)

        monkeypatch.setattr(joint._JointGroupsAttention, "forward", staticmethod(spy))
    else:
        original = grid_flash._GridFlash.apply

        def spy(cls, *args):
            calls.append(torch.is_grad_enabled())
            return original(*args)

        monkeypatch.setattr(grid_flash._GridFlash, "apply", classmethod(spy))
    with torch.no_grad():
        inference = attn(q, k, v, key_padding_mask=pad)
    training = attn(q, k, v, key_padding_mask=pad)
    n_plans = 2 if extra.get("plans") == "average" else 1
    assert calls == [False] * n_plans + [True] * n_plans
    assert training.requires_grad and not inference.requires_grad
    torch.testing.assert_close(inference, training.detach(), atol=1e-12, rtol=0)
    P = attn.attention_matrix(q.detach(), k.detach(), v.detach(), key_padding_mask=pad)
    torch.testing.assert_close(inference, P @ v.detach(), atol=1e-10, rtol=0)


@pytest.mark.parametrize("blocked", [True, False])  # the CPU kernel and the one-cummax kernel of other devices
@pytest.mark.parametrize("length", [1, 7, 12, 16])  # prime (plain scan), non-square and square block layouts
def test_running_max_equals_cummax(length, blocked, monkeypatch):
    """``ops.running_max`` (the blocked scan behind ``summary.running_max`` on CPU, one ``cummax`` keeping a bool mask
    elsewhere) gives exactly ``cummax``'s values, ties and -inf included, along any axis, prefix or suffix
    (``reverse``), with or without autograd; its gradient is the one ``cummax``'s indices route (to the latest
    position attaining the max, in scan order)."""
    from longseq.attention.combiner.summary import running_max
    from longseq.attention.ops import running_max as kernels
    from longseq.attention.ops.running_max import running_maxes

    monkeypatch.setattr(kernels, "blocked_scan_applies", lambda x: blocked)

    g = torch.Generator().manual_seed(3)
    x = torch.randint(-3, 3, (2, length, 5, 4), generator=g).double()  # many ties
    x[0, :, 2] = float("-inf")
    upstream = torch.randn(x.shape, generator=g, dtype=x.dtype)
    for dim in range(-4, 4):
        for reverse in (False, True):
            def in_scan_order(t):  # the suffix scan is the prefix scan of the flipped axis
                return t.flip(dim) if reverse else t  # noqa: B023  (used inside this iteration only)

            expected = torch.cummax(in_scan_order(x), dim)
            with torch.no_grad():
                torch.testing.assert_close(running_max(x, dim, reverse), in_scan_order(expected.values), atol=0, rtol=0)
            leaf = x.clone().requires_grad_()
            running_max(leaf, dim, reverse).backward(upstream)
            routed = torch.zeros_like(x).scatter_add_(dim, expected.indices, in_scan_order(upstream))
            torch.testing.assert_close(leaf.grad, in_scan_order(routed), atol=1e-12, rtol=0)
    a, b = (torch.randn(2, length, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(lambda s, t: running_maxes((s, t), 1), (a, b))
    assert torch.autograd.gradcheck(lambda s, t: running_maxes((s, t), 1, reverse=True), (a, b))


def test_max_excluding_own_values_and_gradients():
    """``ops.running_max.maxes_excluding_own``: for each position the max of all the others (ties included), and
    a gradient that passes gradcheck."""
    from longseq.attention.ops.running_max import maxes_excluding_own

    g = torch.Generator().manual_seed(4)
    ties = torch.randint(-2, 2, (2, 3, 5, 4), generator=g).double()
    for dim in (1, 2, -1):
        T = ties.shape[dim]
        expected = torch.stack([torch.cat([ties.narrow(dim, 0, t), ties.narrow(dim, t + 1, T - t - 1)], dim).amax(dim)
                                for t in range(T)], dim)
        torch.testing.assert_close(maxes_excluding_own((ties,), dim)[0], expected, atol=0, rtol=0)
    a, b = (torch.randn(2, 5, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(lambda s, t: maxes_excluding_own((s, t), 1), (a, b))
    two = torch.randn(2, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)  # the shortest axis: swap
    assert torch.autograd.gradcheck(lambda s: maxes_excluding_own((s,), 1), (two,))


def test_grid_flash_parts_gradcheck():
    """``grid_flash_attention`` on a 3 x 4 grid (fp64): a causal row part, a column part on shifted windows, a masked
    row part on a column-stored operand, a masked column part on a column window — equals one explicit softmax
    over the same keys, and passes gradcheck."""
    from longseq.attention.ops.cpu.grid_flash import FlashPart, grid_flash_attention

    n, m, D = 3, 4, 4
    g = torch.Generator().manual_seed(6)
    q, k, v, sk, sv = (torch.randn(2, n, m, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(5))
    ck, cv = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (sk, sv))  # stored (BH, m, n, D)
    diagonal_m = torch.zeros(m, m, dtype=torch.float64).fill_diagonal_(float("-inf"))
    diagonal_n = torch.zeros(n, n, dtype=torch.float64).fill_diagonal_(float("-inf"))
    parts = [
        FlashPart("row", (0, n, 0, m), (0, n, 0, m), (0, 1, 2), causal=True),  # own row up to self
        FlashPart("col", (1, n, 0, m), (0, n - 1, 0, m), (0, 1, 2), causal=True),  # own column, earlier rows
        FlashPart("row", (1, n, 0, m), (0, n - 1, 0, m), (0, 5, 6), mask=diagonal_m),  # row r-1 of (ck, cv), c' != c
        FlashPart("col", (0, n, 1, m), (0, n, 0, m - 1), (0, 3, 4), mask=diagonal_n),  # column c-1 of (sk, sv), r' != r
    ]
    layouts = ["row"] * 5 + ["col"] * 2

    def run(*tensors):
        return grid_flash_attention(parts, list(tensors), layouts, D**-0.5)

    # the same joint softmax written out per query
    qs = q.detach() * D**-0.5
    expected = torch.zeros(2, n, m, D, dtype=torch.float64)
    for r in range(n):
        for c in range(m):
            keys = [k[:, r, :c + 1], k[:, :r, c], ck[:, [cc for cc in range(m) if cc != c], r - 1] if r else None,
                    sk[:, [rr for rr in range(n) if rr != r], c - 1] if c else None]
            values = [v[:, r, :c + 1], v[:, :r, c], cv[:, [cc for cc in range(m) if cc != c], r - 1] if r else None,
                      sv[:, [rr for rr in range(n) if rr != r], c - 1] if c else None]
            keys = torch.cat([x.detach() for x in keys if x is not None], 1)
            values = torch.cat([x.detach() for x in values if x is not None], 1)
            weights = (keys @ qs[:, r, c].unsqueeze(-1)).squeeze(-1).softmax(-1)
            expected[:, r, c] = (weights.unsqueeze(-1) * values).sum(1)
    torch.testing.assert_close(run(q, k, v, sk, sv, ck, cv), expected, atol=1e-12, rtol=0)
    # fast mode (random projections of the Jacobian): the full one over 7 inputs took 50 s on the loaded 2-core machine
    assert torch.autograd.gradcheck(run, (q, k, v, sk, sv, ck, cv), fast_mode=True)


@pytest.mark.parametrize("cfg", POOLED_CONFIGS, ids=config_id)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_fused_path_matches_explicit_path(cfg, causal):
    """The fused flash path (CPU, fp64 here) and the explicit joint softmax give the same outputs and gradients."""
    name, extra = cfg
    attn = make(name, causal, 4, **extra)
    q, k, v = random_qkv(B=2, H=H, L=24, D=D, seed=8, requires_grad=True)
    upstream = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(9))
    results = []
    for fused in (True, False):
        attn.backend = "cpu_flash" if fused else "explicit"
        out = attn(q, k, v)
        results.append((out, *torch.autograd.grad(out, (q, k, v), upstream)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_learned_summary_key_layer_norm_uses_flax_epsilon():
    """``row_summary=proj``: Linear -> + residual -> LayerNorm(eps=1e-6, flax.linen's default) -> Linear, written
    out by hand; torch's default eps 1e-5 gives a visibly different key on small-variance inputs."""
    attn = make("combiner_axial", True, 4)
    with torch.no_grad():
        attn.summary_norm.weight.normal_()
        attn.summary_norm.bias.normal_()
    g = torch.Generator().manual_seed(5)
    vbar, k_mate = (0.01 * torch.randn(2, H, 4, 4, D, generator=g, dtype=torch.float64) for _ in range(2))

    def by_hand(eps):
        flat = lambda x: x.movedim(1, -2).flatten(-2)  # noqa: E731  (B, H, ..., D) -> (B, ..., H*D)
        hidden = flat(vbar) @ attn.summary_in.weight.T + flat(k_mate)
        mean, var = hidden.mean(-1, keepdim=True), hidden.var(-1, unbiased=False, keepdim=True)
        normed = (hidden - mean) / torch.sqrt(var + eps) * attn.summary_norm.weight + attn.summary_norm.bias
        return (normed @ attn.summary_out.weight.T).unflatten(-1, (H, D)).movedim(-2, 1)

    keys = attn.summary_keys(vbar, k_mate, None).detach()
    assert attn.summary_norm.eps == 1e-6
    torch.testing.assert_close(keys, by_hand(1e-6).detach(), atol=1e-12, rtol=0)
    assert not torch.allclose(keys, by_hand(1e-5).detach(), atol=1e-4, rtol=0)


def test_learned_maps_receive_gradients():
    q, k, v = random_qkv(B=1, H=H, L=16, D=D, seed=2)
    for name, extra in [("combiner_axial", {}), ("combiner_mixture", {"summary": "deepsets_max"})]:
        attn = make(name, True, 4, **extra).train()
        assert attn.has_parameters
        attn(q, k, v).square().sum().backward()
        grads = [p.grad for p in attn.parameters()]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    for name in NAMES[1:]:
        assert not make(name, True, 4).has_parameters


def test_dropout_only_in_training():
    q, k, v = random_qkv(B=1, H=H, L=16, D=D, seed=4)
    for name in NAMES:
        attn = build_attention(name, causal=True, block_size=4, n_heads=H, head_dim=D, dropout=0.5).double()
        attn.train()
        torch.manual_seed(0)
        assert not torch.allclose(attn(q, k, v), attn(q, k, v))
        attn.eval()
        assert_output_matches_matrix(attn, q, k, v)


# -- configuration ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_block_size_must_tile_length(name):
    with pytest.raises(AttentionConfigError, match="attention.block_size"):
        build_attention(name, causal=True, block_size=5, seq_len=16, n_heads=H, head_dim=D)
    attn = build_attention(name, causal=True, block_size=5, n_heads=H, head_dim=D)
    q, k, v = random_qkv(B=1, H=H, L=16, D=D)
    with pytest.raises(AttentionConfigError, match="attention.block_size"):
        attn(q, k, v)
    with pytest.raises(AttentionConfigError, match="attention.block_size"):
        build_attention(name, causal=True, block_size=0)


def test_invalid_knobs_are_rejected():
    bad = [
        ("combiner_axial", {"row_summary": "max"}, "attention.row_summary"),
        ("combiner_mixture", {"summary": "sum"}, "attention.summary"),
        ("combiner_mixture", {"plans": "gated"}, "attention.plans"),
        ("combiner_axial_horizontal", {"horizontal_regions": "halves"}, "attention.horizontal_regions"),
        ("combiner_axial_vertical", {"plans": "average"}, "attention.plans"),  # knob of another variant
        ("combiner_axial_vertical", {"row_summary": "none"}, "attention.row_summary"),
    ]
    for name, extra, key in bad:
        with pytest.raises(AttentionConfigError, match=key):
            build_attention(name, causal=True, block_size=4, n_heads=H, head_dim=D, **extra)
    with pytest.raises(AttentionConfigError, match="n_heads"):
        build_attention("combiner_axial", causal=True, block_size=4)  # proj needs the head geometry
    with pytest.raises(AttentionConfigError, match="head_dim"):
        build_attention("combiner_mixture", causal=True, block_size=4, summary="deepsets_max")


@pytest.mark.parametrize(
    "partition,cls_name",
    [
        ("axial", "CombinerAxialRowMajor"),
        ("axial_vertical", "CombinerAxialVertical"),
        ("axial_horizontal", "CombinerAxialHorizontal"),
        ("mixture", "CombinerMixture"),
    ],
)
def test_reachable_through_combiner_partition(partition, cls_name):
    attn = build_attention("combiner", partition={"name": partition, "block_size": 4}, causal=True, n_heads=H, head_dim=D)
    assert type(attn).__name__ == cls_name and attn.block_size == 4


@pytest.mark.parametrize("name", NAMES)
def test_config_files(name):
    path = Path(__file__).resolve().parents[2] / "conf" / "attention" / f"{name}.yaml"
    cfg = OmegaConf.load(path)
    assert cfg.name == name and name in ATTENTION_REGISTRY
    assert "causal" not in cfg  # injected by the task (train.yaml), like seq_len
    assert str(OmegaConf.to_container(cfg)["block_size"]) == "${task.block_size}"
    keys = set(cfg) - {"name"}
    assert keys <= accepted_kwargs(ATTENTION_REGISTRY[name].cls)
    knobs = {key: cfg[key] for key in keys - {"causal", "block_size"}}
    attn = build_attention(name, causal=True, block_size=4, n_heads=H, head_dim=D, **knobs)
    assert attn.name == name


# -- key padding (LRA): pooled axial variants ------------------------------------------------------------
PADDED_NAMES = NAMES[1:]  # combiner_axial (row-major) is covered by its owner's tests
PADDED_CONFIGS = [cfg for cfg in CONFIGS if cfg[0] in PADDED_NAMES]


def pad_of(L, positions):
    pad = torch.zeros(L, dtype=torch.bool)
    pad[list(positions)] = True
    return pad


# (name, causal, extra, padded positions) -> {query: (direct set, usable regions)} for L = 16, m = 4
PADDED_EXPECTED = [
    # column 0 of rows 0-1 padded: V(0) empties for row 2; padded query 4 keeps its (real) regions, no direct key
    ("combiner_axial_vertical", True, {}, {0, 4, 6}, {
        9: ({1, 5, 8, 9}, regions({2}, {3, 7})),
        12: ({8, 12}, regions({1, 5, 9}, {2, 10}, {3, 7, 11})),
        4: (set(), regions({1}, {2}, {3})),
        0: ({0}, set()),  # nothing real at all: falls back to its unpadded direct keys
    }),
    # last row padded: its horizontal region is unusable; padded query 13 still reads real rows
    ("combiner_axial_horizontal", False, {}, {5, 12, 13, 14, 15}, {
        9: ({1, 8, 9, 10, 11}, regions({0, 2, 3}, {4, 6, 7})),
        13: ({1, 9}, regions({0, 2, 3}, {4, 6, 7}, {8, 10, 11})),
    }),
    # row 0 right of column 0 padded: HR(0) empties, V(2) / V(3) shrink
    ("combiner_mixture", True, {}, {1, 2, 3}, {
        9: ({5, 8, 9}, regions({0, 4}, {6}, {7}, {0}, {4}, {6, 7})),
        2: ({0}, set()),
    }),
]


@pytest.mark.parametrize(
    "name,causal,extra,padded,expected", PADDED_EXPECTED, ids=lambda x: str(x) if isinstance(x, str) else None
)
def test_padded_partition_hand_enumerated(name, causal, extra, padded, expected):
    part = make(name, causal, 4, **extra).partition(16).without_padding(pad_of(16, padded))
    for i, view in expected.items():
        assert query_view(part, i) == view, f"query {i}"


def padding_cases(L, m):
    """(P, L) bool masks (True = pad) that empty whole regions and prefixes on an n x m grid."""
    n = L // m
    masks = torch.zeros(6, L, dtype=torch.bool)
    masks[0, L // 2 + 1 :] = True  # ragged tail
    masks[1, (n - 1) * m :] = True  # the last row: its horizontal regions and every vertical suffix there empty
    masks[2, : m + 1] = True  # left padding: every prefix region starts empty
    masks[3, 0::m] = True  # the first column: its vertical regions are all empty
    masks[4] = True  # an empty document: every query falls back to its unpadded direct keys
    masks[5, 1:-1] = True  # only the first and the last position are real
    return masks


@pytest.mark.parametrize("cfg", PADDED_CONFIGS, ids=config_id)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("L,m", [(12, 3), (16, 4), (8, 2)])
def test_padded_forward_matches_matrix(cfg, causal, L, m):
    name, extra = cfg
    attn = make(name, causal, m, **extra)
    pad = padding_cases(L, m)
    B = pad.shape[0]
    q, k, v = random_qkv(B=B, H=H, L=L, D=D, seed=L + m)
    P = attn.attention_matrix(q, k, v, key_padding_mask=pad)
    assert_rows_sum_to_one(P, atol=1e-10)
    if causal:
        assert_no_future(P)
    out = attn(q, k, v, key_padding_mask=pad)
    torch.testing.assert_close(out, P @ v, atol=1e-10, rtol=0)
    real_query, padded_key = ~pad[:, None, :, None], pad[:, None, None, :]
    assert (P[(real_query & padded_key).expand_as(P)] == 0).all()
    # the empty document: every query sees exactly its unpadded direct keys
    direct = attn.partition(L).direct
    assert torch.equal(P[4] > 0, direct.expand_as(P[4]))
    none = torch.zeros_like(pad)
    torch.testing.assert_close(attn(q, k, v, key_padding_mask=none), attn(q, k, v), atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    "cfg",
    [
        ("combiner_axial_vertical", {}),
        ("combiner_axial_horizontal", {}),
        ("combiner_axial_horizontal", {"horizontal_regions": "split"}),
    ],
    ids=config_id,
)  # the mixture's two factorizations overlap, so its blocks are not one region's profile
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_padded_regions_pool_real_keys_only(cfg, causal):
    """Through the fast path, a region's weights on its real keys follow the softmax of the real-only pool."""
    L, m = 16, 4
    name, extra = cfg
    attn = make(name, causal, m, **extra)
    pad = pad_of(L, {2, 5, 10})
    q, k, _ = random_qkv(B=1, H=H, L=L, D=D, seed=3)
    eye = torch.eye(L, dtype=q.dtype).expand(1, H, L, L)
    P = attn(q, k, eye, key_padding_mask=pad[None])
    part = attn.partition(L).without_padding(pad)
    qs = q / D**0.5
    checked = 0
    for R in range(part.members.shape[0]):
        users, members = part.usable[:, R] & ~pad, part.members[R]
        if not users.any() or members.sum() < 2:
            continue
        block = P[..., users, :][..., members]
        profile = block / block.sum(-1, keepdim=True)
        inner = (qs[..., members, :].amax(-2, keepdim=True) @ k[..., members, :].transpose(-1, -2)).softmax(-1)
        torch.testing.assert_close(profile, inner.expand_as(profile), atol=1e-10, rtol=0)
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize("cfg", PADDED_CONFIGS, ids=config_id)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_padded_gradcheck(cfg, causal):
    name, extra = cfg
    torch.manual_seed(0)
    attn = build_attention(name, causal=causal, block_size=2, n_heads=1, head_dim=4, **extra).double().eval()
    q, k, v = random_qkv(B=2, H=1, L=8, D=4, seed=13, requires_grad=True)
    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[0, 5:] = True
    pad[1, 0::2] = True
    padded = lambda *x: attn(*x, key_padding_mask=pad)  # noqa: E731
    assert torch.autograd.gradcheck(padded, (q, k, v), eps=1e-6, atol=1e-6, fast_mode=True)


@pytest.mark.parametrize("name", PADDED_NAMES)
def test_padded_training_with_dropout_ignores_padded_contents(name):
    """The explicit (dropout) path applies the same padded masks: padded contents never reach a real query."""
    L, m = 16, 4
    attn = build_attention(name, causal=False, block_size=m, n_heads=H, head_dim=D, dropout=0.3).double().train()
    pad = padding_cases(L, m)
    q, k, v = random_qkv(B=pad.shape[0], H=H, L=L, D=D, seed=8)
    torch.manual_seed(1)
    out = attn(q, k, v, key_padding_mask=pad)
    k2, v2 = k.clone(), v.clone()
    k2[pad[:, None, :].expand_as(k[..., 0])] += 3.0
    v2[pad[:, None, :].expand_as(v[..., 0])] -= 5.0
    torch.manual_seed(1)
    moved = attn(q, k2, v2, key_padding_mask=pad)
    assert torch.isfinite(out).all()
    real = ~pad[:, None, :].expand_as(out[..., 0])
    torch.testing.assert_close(moved[real], out[real], atol=1e-10, rtol=0)
