"""The op-level benchmark: CLI end to end on tiny lengths, output schema, statuses, config handling.

Timings themselves are not asserted (the machine is shared); the tests check that every registered
attention is measured, that the files are written with the documented schema, and that failures become
statuses instead of crashes.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from longseq.bench.__main__ import apply_preset
from longseq.bench.cell import CellSpec, measure_cell, run_isolated
from longseq.bench.specs import (
    CONF_DIR,
    GENERIC_NAMES,
    build_spec,
    parse_label,
    quick_names,
    registered_names,
    select_attentions,
    synthetic_block_size,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
REQUIRED_COLUMNS = ["attention", "length", "mode", "ms", "peak_mem_mb", "ratio_to_full"]


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def only_run_dir(out_dir: Path) -> Path:
    runs = [p for p in out_dir.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


@pytest.mark.slow  # ~20 s: every attention through the CLI; the fast set runs the long preset at small lengths
def test_cli_quick_preset_covers_every_registered_attention(tmp_path: Path) -> None:
    # isolate=false keeps this fast with many variants registered; the isolated path is tested below.
    command = [sys.executable, "-m", "longseq.bench", "preset=quick", "attentions=all", "lengths=[64,128]",
               "warmup=1", "repeats=1", "threads=1", "isolate=false", "device=cpu", f"out_dir={tmp_path}",
               "tiles.lengths=[128]", "tiles.tile=16"]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = only_run_dir(tmp_path)

    rows = read_rows(run_dir / "results.csv")
    assert list(rows[0])[:6] == REQUIRED_COLUMNS
    expected = set(registered_names())
    assert expected and not expected & GENERIC_NAMES
    assert {r["attention"] for r in rows} == expected
    # every attention x length x mode cell is present exactly once
    cells = [(r["attention"], int(r["length"]), r["mode"]) for r in rows]
    assert len(cells) == len(set(cells)) == len(expected) * 2 * 2
    assert {r["status"] for r in rows} <= {"ok", "over_budget", "oom", "error", "skipped"}
    for row in rows:
        if row["status"] == "ok":
            assert float(row["ms"]) > 0 and float(row["peak_mem_mb"]) >= 0
    full = [r for r in rows if r["attention"] == "full"]
    assert all(r["status"] == "ok" and math.isclose(float(r["ratio_to_full"]), 1.0) for r in full)
    for row in rows:
        if row["status"] == "ok":
            assert float(row["ratio_to_full"]) > 0

    assert (run_dir / "plot.png").stat().st_size > 10_000
    env = json.loads((run_dir / "env.json").read_text())
    assert {"torch", "torch_threads", "cpu", "gpu", "peak_memory_method"} <= set(env)
    assert env["torch_threads"] == 1
    # the markdown table is printed to the console and saved
    assert "| attention | causal | L=64 | L=128 |" in done.stdout
    assert (run_dir / "results.md").read_text().count("| full |") == 3

    # the hardware-independent column: flex tiles visited / causal full's at tiles.lengths, blank without a layout
    tiles = {(r["attention"], int(r["length"])): r["flex_tiles"] for r in rows if r["mode"] == "fwd"}
    assert tiles[("full", 128)] == "" and tiles[("full", 64)] == ""
    assert 0 < float(tiles[("combiner_fixed", 128)]) < 1 and tiles[("combiner_fixed", 64)] == ""
    tile_rows = read_rows(run_dir / "tiles.csv")
    assert {r["attention"] for r in tile_rows} == expected
    # the backward's longest loop ÷ causal full's: a fraction where the layout keeps query tiles apart
    loops = {r["attention"]: r["flex_longest_loop"] for r in tile_rows}
    assert loops["full"] == "" and 0 < float(loops["combiner_fixed"]) <= 1
    # what one training layer keeps for its backward ÷ its output's: the flex calls' share and the rest
    kept = {r["attention"]: (r["flex_kept"], r["flex_kept_by_calls"]) for r in tile_rows}
    assert kept["full"] == ("", "") and 2 < float(kept["combiner_fixed"][1]) <= float(kept["combiner_fixed"][0])
    assert "flex tiles visited" in done.stdout


@pytest.mark.slow  # a process per cell
def test_isolated_cell_measures_time_and_peak_rss() -> None:
    spec = build_spec("full", 512, causal=True, n_heads=2, head_dim=16)
    cell = CellSpec(attention="full", length=512, mode="fwd_bwd", kwargs=spec.kwargs, batch=1, heads=2,
                    head_dim=16, dtype="float32", device="cpu", warmup=1, repeats=2, budget_s=60, threads=1)
    result = run_isolated(cell)
    assert result.status == "ok", result.note
    assert result.ms > 0 and result.ms_min <= result.ms <= result.ms_max
    # q, k, v, grad_out of (1, 2, 512, 16) float32 = 4 x 64 KiB; their gradients alone add 192 KiB
    assert math.isclose(result.input_mem_mb, 0.25)
    assert 0.1 < result.peak_mem_mb < 100


@pytest.mark.slow  # ~16 s of isolated cells
def test_heap_allocator_cell_reuses_freed_memory() -> None:
    """``allocator=heap`` (in the cell's own process): the cell runs, and a second pass over tensors of more than
    32 MiB faults in almost no fresh pages, where glibc's default maps each one afresh."""
    spec = build_spec("full", 512, causal=True, n_heads=2, head_dim=16)
    cell = CellSpec(attention="full", length=512, mode="fwd_bwd", kwargs=spec.kwargs, batch=1, heads=2,
                    head_dim=16, dtype="float32", device="cpu", warmup=1, repeats=2, budget_s=60, threads=1,
                    allocator="heap")
    assert run_isolated(cell).status == "ok"
    probe = ("import resource, torch\n"
             "from longseq.bench.cell import keep_freed_memory\n"
             "if HEAP: assert keep_freed_memory()\n"
             "def faults():\n"
             "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
             "    for _ in range(4): torch.ones(40 * 2**20 // 4).sum()\n"
             "    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before\n"
             "faults(); print(faults())\n")
    pages = {heap: int(subprocess.run([sys.executable, "-c", f"HEAP = {heap}\n" + probe], capture_output=True,
                                      text=True, check=True).stdout) for heap in (False, True)}
    assert pages[False] > 4 * 9000 and pages[True] < 1000, pages  # 40 MiB = 10240 pages of 4 KiB


@pytest.mark.slow  # a CLI run
def test_unknown_allocator_is_refused_naming_the_key(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "longseq.bench", "allocator=jemalloc", f"out_dir={tmp_path}"],
                          capture_output=True, text=True)
    assert done.returncode == 1 and "allocator: 'jemalloc' unknown; valid: ['glibc', 'heap']" in done.stderr


def test_first_warmup_over_budget_is_a_status_and_stops_longer_lengths(tmp_path: Path) -> None:
    from longseq.bench.run import run_benchmark

    cfg = OmegaConf.load(CONF_DIR / "bench.yaml")
    cfg.merge_with({"attentions": ["full"], "lengths": [64, 128], "mode": ["fwd"], "budget_s": 1e-9,
                    "isolate": False, "device": "cpu", "throughput": False, "plot": False,
                    "out_dir": str(tmp_path)})
    rows = read_rows(run_benchmark(cfg) / "results.csv")
    assert [r["status"] for r in rows] == ["over_budget", "over_budget"]
    assert "budget_s" in rows[0]["note"] and rows[1]["note"] == "not run: over_budget at L=64"
    assert rows[0]["ms"] == "" and rows[0]["ratio_to_full"] == ""


def test_build_errors_are_recorded_not_raised() -> None:
    spec = CellSpec(attention="full", length=64, mode="fwd", kwargs={"causal": True, "no_such_knob": 1},
                    batch=1, heads=1, head_dim=8, dtype="float32", device="cpu", warmup=1, repeats=1, budget_s=10)
    result = measure_cell(spec)
    assert result.status == "error" and "attention.no_such_knob" in result.note


def test_specs_resolve_yaml_against_synthetic_task_geometry() -> None:
    assert [synthetic_block_size(n) for n in (64, 256, 1024, 2048, 4096, 8192, 16384)] == [8, 16, 32, 64, 64, 128, 128]
    full = build_spec("full", 1024, causal=True, n_heads=4, head_dim=32)
    assert full.kwargs == {"causal": True, "seq_len": 1024, "n_heads": 4, "head_dim": 32, "dropout": 0.0}
    for name in registered_names():
        spec = build_spec(name, 256, causal=True, n_heads=2, head_dim=8)
        assert not spec.skip_reason, (name, spec.skip_reason)
        yaml_path = CONF_DIR / "attention" / f"{name}.yaml"
        text = yaml_path.read_text() if yaml_path.exists() else ""
        if "block_size: ${task.block_size}" in text:
            assert spec.block_size == 16  # resolved for L=256
        assert spec.kwargs["causal"] == spec.causal
    assert build_spec("no_such_attention", 64, causal=True, n_heads=1, head_dim=8).skip_reason


def test_attention_labels_override_knobs(tmp_path: Path) -> None:
    from longseq.bench.run import run_benchmark

    assert parse_label("combiner_axial:row_summary=none:block_size=8") == ("combiner_axial",
                                                                           {"row_summary": "none", "block_size": 8})
    with pytest.raises(ValueError, match="name:key=value"):
        parse_label("combiner_axial:row_summary")
    spec = build_spec("combiner_axial:row_summary=none", 256, causal=True, n_heads=2, head_dim=8)
    assert spec.registry_name == "combiner_axial" and spec.kwargs["row_summary"] == "none"
    assert spec.kwargs["block_size"] == 16  # the YAML's geometry is kept
    bad = build_spec("combiner_axial:no_such_knob=1", 256, causal=True, n_heads=2, head_dim=8)
    assert "no_such_knob" in bad.skip_reason and "row_summary" in bad.skip_reason

    cfg = OmegaConf.load(CONF_DIR / "bench.yaml")
    cfg.merge_with({"attentions": ["full", "combiner_axial:row_summary=wsum"], "lengths": [64], "mode": ["fwd"],
                    "repeats": 1, "warmup": 1, "isolate": False, "device": "cpu", "throughput": False, "plot": False,
                    "tiles": {"lengths": [64]}, "out_dir": str(tmp_path)})
    rows = read_rows(run_benchmark(cfg) / "results.csv")
    assert [(r["attention"], r["status"]) for r in rows] == [("full", "ok"), ("combiner_axial:row_summary=wsum", "ok")]


def test_attention_selection() -> None:
    names = registered_names()
    assert names[0] == "full" and not set(names) & GENERIC_NAMES
    assert select_attentions(None) == select_attentions("all") == names
    assert select_attentions(["fixed"])[0] == "full"  # ratios need full in the same run
    quick = quick_names()
    assert quick[0] == "full" and set(quick) <= set(names) and len(quick) <= 8


@pytest.mark.parametrize(
    "overrides, expected_lengths, expected_repeats",
    [(["preset=quick"], [256, 1024], 5), (["preset=quick", "lengths=[64]"], [64], 5),
     (["preset=quick", "repeats=9"], [256, 1024], 9)],
)
def test_preset_keeps_command_line_overrides(overrides: list[str], expected_lengths: list[int],
                                             expected_repeats: int) -> None:
    cfg = OmegaConf.load(CONF_DIR / "bench.yaml")
    cfg.merge_with(OmegaConf.from_dotlist(overrides))
    apply_preset(cfg, overrides)
    assert list(cfg.lengths) == expected_lengths and cfg.repeats == expected_repeats
    assert cfg.attentions == "quick" and cfg.throughput is False


def test_training_throughput_lightning_vs_bare_loop(tmp_path: Path) -> None:
    from longseq.bench.run import run_benchmark

    cfg = OmegaConf.load(CONF_DIR / "bench.yaml")
    cfg.merge_with({"attentions": ["full"], "lengths": [64], "mode": ["fwd"], "isolate": False, "device": "cpu",
                    "plot": False, "out_dir": str(tmp_path), "throughput": True,
                    "train_step": {"seq_len": 64, "block_size": 8, "batch": 2, "n_layers": 1, "d_model": 32,
                                   "n_heads": 2, "warmup": 1, "steps": 2, "rounds": 1}})
    run_dir = run_benchmark(cfg)
    (row,) = read_rows(run_dir / "throughput.csv")
    assert row["attention"] == "full" and row["status"] == "ok", row["note"]
    assert float(row["tokens_per_s_lightning"]) > 0 and float(row["tokens_per_s_bare"]) > 0
    overhead = float(row["lightning_overhead"])
    assert math.isclose(overhead, float(row["lightning_ms"]) / float(row["bare_ms"]), rel_tol=1e-4)
    assert "tokens/s (Lightning)" in (run_dir / "results.md").read_text()


def test_long_preset_composes_and_runs_at_small_lengths(tmp_path: Path) -> None:
    """``make bench ARGS="preset=long"``: the headline Combiner variants and full, fwd+bwd at 16k and 64k with
    B=1, H=8, D=64 (the issue's geometry). Composed through Hydra as the CLI does, resolved at 64k without
    building anything that large, and run end to end at tiny lengths (never at 64k in tests)."""
    from conftest import compose_config

    from longseq.bench.run import run_benchmark

    cfg = compose_config(["preset=long"], config_name="bench", fast=False)
    apply_preset(cfg, ["preset=long"])
    assert list(cfg.attentions) == ["full", "combiner_fixed", "combiner_axial", "combiner_logsparse"]
    assert list(cfg.lengths) == [16384, 65536] and list(cfg.mode) == ["fwd_bwd"]
    assert (cfg.heads, cfg.head_dim, cfg.batch, cfg.causal, cfg.throughput) == (8, 64, 1, True, False)
    for name in cfg.attentions:
        spec = build_spec(name, 65536, causal=True, n_heads=cfg.heads, head_dim=cfg.head_dim)
        assert not spec.skip_reason, (name, spec.skip_reason)
        if name in ("combiner_fixed", "combiner_axial"):
            assert spec.block_size == 256  # 2 ** round(log2(65536) / 2)

    overrides = ["preset=long", "lengths=[64,256]", "repeats=1", "isolate=false", "device=cpu", "plot=false",
                 "tiles.lengths=[256]", f"out_dir={tmp_path}"]  # tiles at 16384 took 5 of this test's 11 s
    cfg = OmegaConf.load(CONF_DIR / "bench.yaml")
    cfg.merge_with(OmegaConf.from_dotlist(overrides))
    apply_preset(cfg, overrides)
    rows = read_rows(run_benchmark(cfg) / "results.csv")
    assert [(r["attention"], int(r["length"]), r["mode"]) for r in rows] == [
        (name, length, "fwd_bwd") for name in cfg.attentions for length in (64, 256)
    ]
    assert all(r["status"] == "ok" and float(r["peak_mem_mb"]) >= 0 and r["heads"] == "8" for r in rows)


def test_sampling_measurement_writes_cached_and_recompute_rates(tmp_path: Path) -> None:
    """``sample=true`` (issue 16): sampling.csv with the issue's columns, one row per attention; a cached rate
    exactly for the attentions with a decoding state, and one layer's step time by position in
    decode_steps.csv. Tiny geometry (L = 64, block 8); the figures themselves are not asserted."""
    from longseq.attention.registry import ATTENTION_REGISTRY
    from longseq.bench.run import run_benchmark

    cfg = OmegaConf.load(CONF_DIR / "bench.yaml")
    assert cfg.sample is False and list(cfg.sampling.attentions) == [
        "full", "combiner_fixed", "combiner_axial", "combiner_logsparse", "fixed", "axial"]
    assert (cfg.sampling.seq_len, cfg.sampling.n_layers, cfg.sampling.d_model, cfg.sampling.n_heads,
            cfg.sampling.batch) == (3072, 2, 128, 4, 16)  # the CIFAR-10 geometry
    cfg.merge_with({"sample": True, "attentions": ["full"], "lengths": [], "throughput": False, "plot": False,
                    "isolate": False, "device": "cpu", "out_dir": str(tmp_path),
                    "sampling": {"attentions": ["full", "combiner_fixed"], "seq_len": 64, "block_size": 8,
                                 "batch": 2, "d_model": 16, "n_heads": 2, "recompute_positions": 3,
                                 "step_lengths": [64], "step_fractions": [0.5, 1.0], "step_repeats": 2}})
    run_dir = run_benchmark(cfg)
    rows = read_rows(run_dir / "sampling.csv")
    assert list(rows[0])[:5] == ["attention", "length", "cached_tokens_per_s", "recompute_tokens_per_s", "speedup"]
    assert [r["attention"] for r in rows] == ["full", "combiner_fixed"]
    for row in rows:
        assert row["status"] == "ok" and row["length"] == "64" and float(row["recompute_tokens_per_s"]) > 0
        decodes = getattr(ATTENTION_REGISTRY[row["attention"]].cls, "supports_decoding", False)
        if decodes:
            assert float(row["cached_tokens_per_s"]) > 0 and row["cached_positions"] == "64"
            assert math.isclose(float(row["speedup"]), float(row["cached_tokens_per_s"])
                                / float(row["recompute_tokens_per_s"]), rel_tol=1e-4)
        else:
            assert row["cached_tokens_per_s"] == "" and "no decoding state" in row["note"]
    steps = read_rows(run_dir / "decode_steps.csv")
    for name in ("full", "combiner_fixed"):
        mine = [r for r in steps if r["attention"] == name]
        if getattr(ATTENTION_REGISTRY[name].cls, "supports_decoding", False):
            assert [int(r["position"]) for r in mine] == [30, 62] and all(float(r["step_ms"]) > 0 for r in mine)
        else:
            assert [r["status"] for r in mine] == ["skipped"] and "no decoding state" in mine[0]["note"]
    assert "### sampling: tokens/s, L=64" in (run_dir / "results.md").read_text()
