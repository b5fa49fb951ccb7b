"""GPU launches per layer, counted on the CPU (issue #43): each Combiner layer's forward + backward on the flex
backend, compiled for an sm90 target (``longseq.bench.launches``: inductor writes the Triton code a GPU would run, its
kernels are no-ops here), launches at most its budget of Triton kernels and extern calls besides the flex calls, at
L 4,096, H 8, D 64, bf16. Before the fused summaries (``ops.flex.regions``) these were 17, 108, 34, 91, 164 and 235.

The count patches inductor for its whole process, so it runs in a subprocess, once per suite: the fast suite counts
the default (``combiner_axial``) and ``combiner_fixed`` (one call with fused pooled regions): about 6 s of compilation
a layer after 12 s of imports; the slow suite the other four (``combiner_mixture``, whose two calls have pooled
regions, axial's two halves and logsparse, whose regions are fixed's kind).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from longseq.bench.launches import BUDGETS

FAST = ("combiner_axial", "combiner_fixed")
SLOW = tuple(label for label in BUDGETS if label not in FAST)


def count(labels: tuple[str, ...]) -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-m", "longseq.bench.launches", "--json", *labels], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=1200)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [row["label"] for row in rows] == list(labels), done.stderr[-3000:]
    return {row["label"]: row for row in rows}


@pytest.fixture(scope="module")
def counted() -> dict[str, dict]:
    return count(FAST)


@pytest.fixture(scope="module")
def counted_slow() -> dict[str, dict]:
    return count(SLOW)


@pytest.mark.parametrize("label", FAST)
def test_a_layer_launches_at_most_its_budget(counted, label):
    check_budget(counted[label])


@pytest.mark.slow
@pytest.mark.parametrize("label", SLOW)
def test_the_other_layers_launch_at_most_their_budgets(counted_slow, label):
    check_budget(counted_slow[label])


def test_the_fast_suites_layers_are_budgeted_ones():
    assert set(FAST) <= set(BUDGETS) and len(SLOW) == len(BUDGETS) - len(FAST)


def check_budget(row: dict) -> None:
    label = row["label"]
    listed = "; ".join(f"{part}: {row[part]}" for part in ("forward", "forward_extern", "backward", "backward_extern"))
    assert row["total"] <= BUDGETS[label], f"{label}: {row['total']} launches > {BUDGETS[label]} ({listed})"


@pytest.mark.parametrize("label,calls_with_regions",
                         [("combiner_fixed", 1), pytest.param("combiner_mixture", 2, marks=pytest.mark.slow)])
def test_the_fused_summaries_are_one_kernel_forward_and_two_backward(request, label, calls_with_regions):
    """Each call with pooled regions launches ``summary_kv_forward`` once and the backward's two passes once each:
    the pools, products, softmaxes, concatenations and padding are no longer separate kernels."""
    row = request.getfixturevalue("counted" if label in FAST else "counted_slow")[label]
    assert sum(name.startswith("summary_kv_forward") for name in row["forward"]) == calls_with_regions
    assert sum(name.startswith("summary_kv_backward") for name in row["backward"]) == 2 * calls_with_regions
