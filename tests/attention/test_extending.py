""""Add an attention = one file + one YAML, zero edits elsewhere" (docs/extending.md), kept true by a test.

A throwaway padded variant, a throwaway Combiner partition (on the block grid, through ``BlockGrid``) and a
throwaway sparse pattern are registered from a temporary module with their YAMLs in a temporary config folder;
the registry gives each its family, and the registry-wide checks (contract, key padding over
``supports_padding_mask``, decoding over ``supports_decoding``, ``block_size`` validation over the constructor
keywords) select and pass them without any edit to the package or the tests.
"""

from __future__ import annotations

import importlib
import sys

import helpers
import pytest
import torch

from longseq.attention import ATTENTION_REGISTRY

MODULE = '''
import torch

from longseq.attention.base import Attention
from longseq.attention.combiner.summary import PooledCombiner, RegionSummary
from longseq.attention.dense.full import FullAttention
from longseq.attention.ops.geometry import BlockGrid
from longseq.attention.ops.partition import Partition
from longseq.attention.registry import register_attention
from longseq.attention.sparse.base import SparseAttention


@register_attention("throwaway_padded")
class ThrowawayPadded(FullAttention):
    """Full attention under another name: a padded variant that inherits the rule and a KV cache."""


@register_attention("throwaway_sparse")
class ThrowawaySparse(SparseAttention):
    """Self and the two previous positions: a pattern, nothing else."""

    def pattern(self, length):
        d = torch.arange(length)[:, None] - torch.arange(length)[None, :]
        return (d >= 0) & (d < 3) if self.causal else d.abs() < 3

    def forward(self, q, k, v):
        allowed = self.pattern(q.shape[-2]).to(q.device)
        return self.sdpa(self.scale(q), k, v, allowed)


@register_attention("throwaway_combiner")
class ThrowawayCombiner(BlockGrid, PooledCombiner, Attention):
    """Combiner on the block grid: own block direct, every earlier (causal) / other block through its mean
    summary. ``BlockGrid`` owns ``block_size``: its validation, the length rule and ``grid(L)``."""

    supports_padding_mask = True

    def __init__(self, **knobs):
        super().__init__(**knobs)
        self.summary = RegionSummary("mean")

    def partition(self, length, device=None):
        grid = self.grid(length)
        pos, block = torch.arange(length, device=device), grid.rows(device)
        same = block[:, None] == block[None, :]
        direct = same & (pos[:, None] >= pos[None, :]) if self.causal else same
        regions = torch.arange(grid.n_rows, device=device)[:, None] == block[None, :]
        others = torch.arange(grid.n_rows, device=device)[None, :]
        usable = others < block[:, None] if self.causal else others != block[:, None]
        return Partition.from_candidates(direct, regions, usable)

    def forward(self, q, k, v, key_padding_mask=None):
        return self.attention_matrix(q, k, v, key_padding_mask=key_padding_mask) @ v
'''
NAMES = {"throwaway_padded": "dense", "throwaway_sparse": "sparse", "throwaway_combiner": "combiner"}
YAMLS = {name: f"name: {name}\n" for name in NAMES} | {
    "throwaway_combiner": "name: throwaway_combiner\nblock_size: ${task.block_size}\n"}


@pytest.fixture
def throwaway(tmp_path, monkeypatch):
    """Register the three throwaway variants from ``tmp_path``; unregister them afterwards."""
    (tmp_path / "throwaway_variants.py").write_text(MODULE)
    conf = tmp_path / "conf" / "attention"
    conf.mkdir(parents=True)
    for name, yaml in YAMLS.items():
        (conf / f"{name}.yaml").write_text(yaml)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(helpers, "CONF", tmp_path / "conf")
    try:
        importlib.import_module("throwaway_variants")
        yield
    finally:
        for name in NAMES:
            ATTENTION_REGISTRY.pop(name, None)
        sys.modules.pop("throwaway_variants", None)


def test_a_new_variant_of_each_kind_is_picked_up_by_the_registry_wide_checks(throwaway):
    for name, family in NAMES.items():
        assert ATTENTION_REGISTRY[name].cls.family == family  # inherited from the family it subclasses
        for causal in (True, False):
            assert (name, causal) in helpers.cases()
            assert (name, causal) in helpers.cases("supports_padding_mask")
            assert (name, causal) in helpers.cases("supports_decoding")
            helpers.check_contract(name, causal)
            helpers.check_key_padding(name, causal)
        helpers.check_decoding(name, prefix=5)
    # the grid one gets the one block_size validation by subclassing BlockGrid, and the registry-wide check
    assert [n for n in NAMES if helpers.takes_block_size(n)] == ["throwaway_combiner"]
    helpers.check_block_size_validation("throwaway_combiner")
    # the Combiner one really is one: every earlier key reached (full support), beyond its direct pair
    attn = helpers.build("throwaway_combiner", True).double()
    P = attn.attention_matrix(*helpers.random_qkv(B=1, H=1, L=helpers.L, D=8))
    assert (P[..., torch.ones(helpers.L, helpers.L, dtype=torch.bool).tril()] > 0).all()


def test_a_variant_outside_the_family_folders_must_declare_a_family(tmp_path, monkeypatch):
    (tmp_path / "familyless.py").write_text(
        "from longseq.attention.base import Attention\n"
        "from longseq.attention.registry import register_attention\n"
        "@register_attention('familyless')\nclass Familyless(Attention):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="'familyless'.*has no family"):
        importlib.import_module("familyless")
    assert "familyless" not in ATTENTION_REGISTRY
    sys.modules.pop("familyless", None)
