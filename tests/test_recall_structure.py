"""The recall study's structural column (issue 44): the share of asked pairs whose answer is alone in a region the
arm can use, computed from the generated examples and the arm's own partition or selection rule."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config

from longseq.attention import build_attention
from longseq.attention.ops.masks import full_mask
from longseq.attention.ops.partition import Partition
from longseq.data.recall import MqarGenerator, NeedleGenerator, RecallDataset
from longseq.report.recall_structure import (
    NO_GEOMETRY,
    NO_REGIONS,
    arm_geometry,
    structure,
    structure_of_config,
)


def examples(L: int = 256, D: int = 8, n: int = 100, **kw):
    gen = MqarGenerator(L + 256, L, D, **kw)
    return gen, RecallDataset(gen, n, 1, "test").drawn()


def layer(name: str, L: int = 256, **kw):
    return build_attention(name, causal=True, seq_len=L, n_heads=1, head_dim=16, **kw)


def share(name: str, L: int = 256, D: int = 8, m: int = 16, layers: int = 2, **kw):
    gen, drawn = examples(L, D, **kw)
    knobs = {} if name in ("full", "linear") else {"window": m} if name == "local" else {"block_size": m}
    return structure([layer(name, L, **knobs)] * layers, drawn, gen.answer_ids, L)


def test_combiner_mixture_points_with_the_pairs_at_the_start_and_not_when_they_are_scattered():
    """L = 256, D = 8: the 16 pair tokens fill row 0 of the 16 x 16 grid, so each column summary holds one value:
    1.00. Scattered, fewer columns hold a lone value; with fillers from the whole vocabulary (the study's layout) almost
    none. combiner_fixed's segment 0 holds every value: 0.00 (the issue's numbers)."""
    assert share("combiner_mixture").alone == 1.0
    assert share("combiner_mixture", placement="scattered").alone < 0.85
    assert share("combiner_mixture", placement="scattered", filler="vocab").alone < 0.1
    assert share("combiner_fixed").alone == 0.0
    assert 0.0 < share("combiner_mixture", D=32).alone < 0.06  # only the columns beside the query's: 2 / 64


def test_at_1024_tokens_the_pairs_fill_row_0_too():
    assert share("combiner_mixture", L=1024, D=16, m=32).alone == 1.0
    assert share("combiner_mixture", L=1024, D=16, m=32, placement="scattered", filler="vocab").alone < 0.1


def test_the_share_is_read_from_the_partition_it_is_given(monkeypatch):
    """The same examples and attention: a partition whose regions are single keys puts every answer alone (1.0), one
    whose only region is the whole past none (0.0); a grid of 8 columns instead of 16 puts two values in each column
    region at the start (only a half-row beside the query's column holds a lone one)."""
    gen, drawn = examples()
    attn = layer("combiner_mixture", block_size=16)
    L = 256
    causal = full_mask(L, True)
    eye = torch.eye(L, dtype=torch.bool)
    singles = Partition.from_candidates(eye, eye, causal & ~eye)  # region j = key j, usable by every later query
    whole = Partition.from_candidates(eye, torch.ones(1, L, dtype=torch.bool), torch.ones(L, 1, dtype=torch.bool))
    for part, expected in ((singles, 1.0), (whole, 0.0)):
        monkeypatch.setattr(attn, "partition", lambda length, device=None, part=part: part)
        assert structure([attn], drawn, gen.answer_ids, L).alone == expected
    assert structure([layer("combiner_mixture", block_size=8)], drawn, gen.answer_ids, L).alone < 0.2


def test_selection_arms_read_their_selection_rule():
    """nsa always reads block 0 (the forced first block), which holds every pair at D = 8: direct 1.00, not
    scattered; moba's blocks are its regions; the union of a partition's direct keys and usable regions is every
    earlier key (nothing is lost from the causal past)."""
    nsa = dict(compress_block=16, select_blocks=4, local_blocks=2, window=16)
    gen, drawn = examples()
    assert structure([layer("nsa", block_size=16, **nsa)], drawn, gen.answer_ids, 256).direct == 1.0
    gen, scattered = examples(placement="scattered", filler="vocab")
    assert structure([layer("nsa", block_size=16, **nsa)], scattered, gen.answer_ids, 256).direct < 0.3
    for name, knobs in (("nsa", dict(block_size=8, compress_block=8, select_blocks=4, window=8)),
                        ("moba", dict(block_size=8)), ("combiner_select", dict(block_size=8)),
                        ("combiner_mixture", dict(block_size=8))):
        part = arm_geometry(layer(name, 64, **knobs), 64)
        assert torch.equal(part.allowed(), full_mask(64, True)), name


def test_arms_without_regions_say_what_the_column_means():
    """full reads every key (direct 1.00, alone NA); a short window reads the keys inside it; linear has no geometry
    (both NA); a hybrid with a full layer reads every key directly."""
    full = share("full")
    assert (full.alone, full.direct, full.note) == (None, 1.0, NO_REGIONS)
    local = share("local")
    assert local.alone is None and 0.0 < local.direct < 0.5
    linear = share("linear")
    assert (linear.alone, linear.direct, linear.note) == (None, None, NO_GEOMETRY)
    assert linear.cell() == "NA / NA" and full.cell() == "NA / 1.00"
    gen, drawn = examples()
    hybrid = structure([layer("combiner_fixed", block_size=16), layer("full")], drawn, gen.answer_ids, 256)
    assert (hybrid.alone, hybrid.direct) == (0.0, 1.0)


def test_the_needle_counts_its_value_bytes():
    """Four needles in 16 regions of 16 bytes: each mostly alone in its segment for combiner_fixed; 34 needles at
    L = 1,024 crowd its 32 segments."""
    few = NeedleGenerator(seq_len=256)
    crowded = NeedleGenerator(seq_len=1024, num_needles=34, num_questions=16, placement="scattered")
    alone = []
    for gen, m in ((few, 16), (crowded, 32)):
        drawn = RecallDataset(gen, 60, 1, "test").drawn()
        alone.append(structure([layer("combiner_fixed", gen.seq_len, block_size=m)], drawn, gen.answer_ids,
                               gen.seq_len).alone)
    assert alone[0] > 0.8 and alone[1] < alone[0] - 0.3


@pytest.mark.parametrize("arm,alone", [("combiner_mixture", 1.0), ("full_combiner_fixed", 0.0)])
def test_the_column_of_a_study_arm_comes_from_its_config(arm, alone, tmp_path):
    """As the report computes it: the run's own config (its task's generator, every layer's attention)."""
    cfg = compose_config(["experiment=recall/mqar", f"recall/arm={arm}"], tmp_path, fast=False)
    found = structure_of_config(cfg, count=40)
    assert found.alone == alone and found.questions == 40 * 8
