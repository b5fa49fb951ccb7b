"""``python -m longseq.bench.gpu`` (make gpu-check): the dry run on CPU (every stage at tiny sizes, so the pipeline
cannot rot), its pieces (crossover, peak FLOP/s table, a failing check is reported), and the real run on CUDA."""

from __future__ import annotations

import json
import math
import os
import signal
import time

import pytest
from conftest import compose_config
from devices import requires_cuda, requires_multi_gpu
from hydra.core.global_hydra import GlobalHydra

from longseq.bench import gpu


def gpu_check_config(tmp_path, overrides: list[str]):
    overrides = [f"out_dir={tmp_path}", *overrides]
    try:
        cfg = compose_config(overrides, config_name="gpu_check", fast=False)
    finally:
        GlobalHydra.instance().clear()
    return gpu.prepare(cfg, overrides)


def read_results(out):
    return json.loads((out / "results.json").read_text()), (out / "report.md").read_text()


def assert_complete(out, ok: bool, cfg) -> None:
    """The report has every section; every correctness check passed or does not apply (a reason given), every
    attention passed on at least the explicit backend, every backend of the dispatch was tried; the benchmark,
    training and DDP produced figures."""
    results, text = read_results(out)
    assert ok
    for section in gpu.SECTIONS:
        assert section in text
    rows = results["correctness"]
    assert rows and all(r["status"] in gpu.PASSED for r in rows), [r for r in rows if r["status"] != "pass"]
    assert all(r["note"] for r in rows if r["status"] == "n/a")
    names = {r["attention"] for r in rows}
    assert names == set(gpu._names(cfg.correctness.attentions))
    assert {r["attention"] for r in rows if r["backend"] == "explicit" and r["status"] == "pass"} == names
    assert {r["backend"] for r in rows} == set(gpu.backends())
    assert {r["dtype"] for r in rows} == set(cfg.correctness.dtypes)
    assert len(results["fig3"]) == len(cfg.fig3.shapes)
    for table in results["fig3"]:
        assert all(r["status"] == "ok" and r["ms"] > 0 for r in table)
        assert all(r["ratio_to_full"] == 1.0 for r in table if r["attention"] == "full")
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in results["training"])
    assert results["ddp"]["status"] in ("pass", "skipped")
    for r in results["profile"]:  # where the host's time goes: the largest events first, within the step's total
        assert r["status"] == "ok" and 0 < len(r["host_top"]) <= gpu.TOP_EVENTS
        per_event = [us for _, us, calls in r["host_top"]]
        assert per_event == sorted(per_event, reverse=True) and sum(per_event) <= r["host_ms"] * 1e3 + 1e-6
        assert (f"| {r['attention']} | {r['length']} | {r['compile']} | {r['host_ms']:.3f} | "
                f"`{r['host_top'][0][0][:60]}`") in text


def test_dry_run_passes_and_writes_the_report(tmp_path):
    cfg = gpu_check_config(tmp_path, ["dry=true"])
    assert cfg.device == "cpu" and cfg.fig3.lengths == [32, 64]  # the dry preset applied
    out, ok = gpu.run_gpu_check(cfg)
    assert out.parent == tmp_path
    assert_complete(out, ok, cfg)
    results, text = read_results(out)
    assert results["ddp"]["status"] == "pass" and results["ddp"]["param_spread"] == 0.0
    assert "MFU omitted" in text  # no peak FLOP/s for a CPU
    # on CPU the flex backend serves forward only: checked, and said so
    flex = [r for r in results["correctness"] if r["backend"] == "flex" and r["status"] == "pass"]
    if "flex" in gpu.backends():
        assert flex and all(r["note"].startswith("forward only") and math.isnan(r["grad_err"]) for r in flex)


def test_the_correctness_stage_checks_the_layout_long_sequences_get(tmp_path, monkeypatch):
    """``correctness.summary_copy_rows``: the flex layouts lay out their summaries once per that many queries while
    the stage runs (at L 16 and 4 rows: 4 copies), pass against the fp64 reference, and the rule and the layouts
    are restored afterwards."""
    from longseq.attention.ops.flex import block_masks, calls

    cfg = gpu_check_config(tmp_path, ["dry=true", "correctness.attentions=[combiner_fixed]",
                                      "correctness.dtypes=[float32]", "correctness.backends=[flex]"])
    seen = []
    summary_kv = calls.FlexCall.summary_kv
    monkeypatch.setattr(calls.FlexCall, "summary_kv",
                        lambda call, x, L: seen.append(call.summary_copies(L)[0]) or summary_kv(call, x, L))
    rule = calls.COPY_ROWS, calls.MIN_COPY_ROWS, calls.COPY_KEY_SHARE
    (row,) = [r for r in gpu.check_correctness(cfg, "cpu") if r["attention"] == "combiner_fixed"]  # full: always
    assert row["status"] == "pass" and set(seen) == {cfg.correctness.seq_len // cfg.correctness.summary_copy_rows}
    assert (calls.COPY_ROWS, calls.MIN_COPY_ROWS, calls.COPY_KEY_SHARE) == rule and not block_masks._REGISTRY


def test_a_wrong_result_is_reported_as_a_failure(tmp_path):
    """A tolerance nothing meets: every check that runs fails, so the command would exit 1."""
    cfg = gpu_check_config(tmp_path, ["dry=true", "correctness.attentions=[full]", "correctness.dtypes=[float32]",
                                      "correctness.tolerance.float32.output=0", "correctness.tolerance.float32.grad=0"])
    rows = gpu.check_correctness(cfg, "cpu")
    ran = [r for r in rows if r["status"] != "n/a"]
    assert ran and all(r["status"] == "FAIL" and r["output_err"] > 0 for r in ran)


def test_a_run_stopped_in_a_later_stage_keeps_the_earlier_stages_report(tmp_path, monkeypatch, capsys):
    """A fault in the training stage (as a lost machine or a time limit would stop it): report.md and results.json
    already hold the correctness rows and the benchmark, and say the later stages did not run."""
    cfg = gpu_check_config(tmp_path, ["dry=true", "correctness.attentions=[full,fixed]", "fig3.attentions=[full]"])

    def lost_machine(*args):
        raise RuntimeError("the machine went away")

    monkeypatch.setattr(gpu, "run_training", lost_machine)
    with pytest.raises(RuntimeError, match="went away"):
        gpu.run_gpu_check(cfg)
    (out,) = tmp_path.iterdir()
    results, text = read_results(out)
    assert {r["attention"] for r in results["correctness"]} == {"full", "fixed"} and results["fig3"][0]
    assert results["training"] == [] and results["ddp"] == {"status": "not run yet"}
    assert "correctness" in results["env"]["stage_seconds"] and "training" not in results["env"]["stage_seconds"]
    assert "fixed float32 explicit: pass" in capsys.readouterr().out  # each row was logged as it ran


def crash_in_fixed_correctness(cfg_yaml, device, kind, args, threads):
    """A warm-up unit as ``gpu._warm_task``, except that checking ``fixed`` kills its process, as a segfault in a
    compiler did on the H100 (2026-11-27: one dead worker broke the shared pool and every unit's rows were lost)."""
    if kind == "correctness" and args[0] == "fixed":
        os.kill(os.getpid(), signal.SIGSEGV)
    return gpu._warm_task(cfg_yaml, device, kind, args, threads)


def test_a_warm_up_unit_whose_process_dies_costs_only_itself(tmp_path, capsys):
    """The dead unit is logged with its signal and checked again in the caller's process; the other units' rows and
    compiles stand, and the dead one is not counted as compiled (so the timed stage compiles it untimed first)."""
    cfg = gpu_check_config(tmp_path, ["dry=true", "workers=2", "correctness.attentions=[full,fixed]",
                                      "correctness.dtypes=[float32]", "fig3.attentions=[full]",
                                      "fig3.shapes=[{batch: 1, heads: 2, head_dim: 8}]",
                                      "profile.attentions=[full]", "train.attentions=[full]"])
    rows, compiled = gpu.warm_up(cfg, "cpu", task=crash_in_fixed_correctness)
    assert [r["attention"] for r in rows] == sorted((r["attention"] for r in rows), key=["full", "fixed"].index)
    assert {r["attention"] for r in rows} == {"full", "fixed"} and all(r["status"] in gpu.PASSED for r in rows)
    assert compiled == {("correctness", ("full",)), ("fig3", ("full", 32)), ("fig3", ("full", 64)),
                        ("profile", (32, "full", "none")), ("train", ("full", 48, 4, "none"))}
    log = capsys.readouterr().out
    assert "warm-up correctness ('fixed',): worker killed by SIGSEGV" in log
    assert "fixed float32 explicit: pass" in log  # the rerun here


def hang_in_fixed_correctness(cfg_yaml, device, kind, args, threads):
    """A warm-up unit as ``gpu._warm_task``, except that checking ``fixed`` outlasts any lease (a compile that hangs)."""
    if kind == "correctness" and args[0] == "fixed":
        time.sleep(600)
    return gpu._warm_task(cfg_yaml, device, kind, args, threads)


def test_a_warm_up_unit_still_running_at_the_time_limit_is_stopped(tmp_path, capsys):
    """The hung unit's process is killed at the limit and its rows say time_limit (not checked again past the limit,
    not lost); the unit that finished in time keeps its rows."""
    cfg = gpu_check_config(tmp_path, ["dry=true", "workers=2", "correctness.attentions=[full,fixed]",
                                      "correctness.dtypes=[float32]", "fig3.attentions=[full]",
                                      "fig3.shapes=[{batch: 1, heads: 2, head_dim: 8}]",
                                      "profile.attentions=[full]", "train.geometries=[]", "time_limit_s=8"])
    assert gpu.warm_up_tasks(cfg)[:2] == [("correctness", ("full",)), ("correctness", ("fixed",))]  # stage order
    rows, compiled = gpu.warm_up(cfg, "cpu", task=hang_in_fixed_correctness, limit=gpu.TimeLimit(8.0))
    fixed = [r for r in rows if r["attention"] == "fixed"]
    assert fixed and all(r["status"] == gpu.TIME_LIMIT for r in fixed)
    assert [r["status"] for r in rows if r["attention"] == "full"] and all(
        r["status"] in gpu.PASSED for r in rows if r["attention"] == "full")
    assert ("correctness", ("fixed",)) not in compiled
    assert "warm-up correctness ('fixed',): stopped after 8 s: its time limit" in capsys.readouterr().out


def test_past_the_time_limit_every_stage_reports_what_it_left_out(tmp_path, capsys):
    """A limit already past at the start: no unit runs, each stage's rows say time_limit, the report says how many
    units were cut, and the check does not pass (nothing was verified)."""
    cfg = gpu_check_config(tmp_path, ["dry=true", "correctness.attentions=[full,fixed]", "fig3.attentions=[full]",
                                      "profile.attentions=[full]", "time_limit_s=0"])
    out, ok = gpu.run_gpu_check(cfg)
    assert not ok
    results, text = read_results(out)
    for section in gpu.SECTIONS:
        assert section in text
    rows = [*results["correctness"], *(r for table in results["fig3"] for r in table), *results["profile"],
            *results["training"], results["ddp"]]
    assert rows and all(r["status"] == gpu.TIME_LIMIT for r in rows)
    assert {r["attention"] for r in results["correctness"]} == {"full", "fixed"}
    assert f"{len(rows)} unit(s) of work not run: past time_limit_s=0" in text
    assert f"{len(rows)} unit(s) not run" in capsys.readouterr().out


def test_the_quick_preset_writes_its_report_within_a_short_lease(tmp_path):
    cfg = gpu_check_config(tmp_path, ["preset=quick"])
    assert 0 < cfg.time_limit_s <= 300 and cfg.workers > 1
    # the block-selecting layouts timed and profiled at their targets' lengths
    selecting = {"moba", "nsa", "combiner_select"}
    assert selecting <= set(cfg.fig3.attentions) and {16384, 65536} <= set(cfg.fig3.lengths)
    assert {(65536, name, "none") for name in selecting} <= set(gpu.profile_units(cfg))
    # a profiled layer whose graph a Fig. 3 unit compiles is not compiled again beside it in the warm-up
    warmed = [unit for kind, unit in gpu.warm_up_tasks(cfg) if kind == "profile"]
    assert warmed == [unit for unit in gpu.profile_units(cfg) if unit[1] not in cfg.fig3.attentions] == []
    # a Fig. 3 unit per (attention, length), so the 8 workers share the 24 compilations out evenly
    fig3_units = [unit for kind, unit in gpu.warm_up_tasks(cfg) if kind == "fig3"]
    assert len(fig3_units) == len(set(fig3_units)) == len(cfg.fig3.attentions) * len(cfg.fig3.lengths) == 24


def test_the_profile_runs_each_length_in_turn(tmp_path):
    """``profile.length`` as a list: one row per length, attention and mode, in that order, each measured at its
    own length and named so in both tables; the warm-up compiles the same units."""
    cfg = gpu_check_config(tmp_path, ["dry=true", "profile.attentions=[full,combiner_fixed]", "profile.length=[16,32]"])
    rows = gpu.run_profile(cfg, "cpu")
    assert [(r["length"], r["attention"]) for r in rows] == [(16, "full"), (16, "combiner_fixed"), (32, "full"),
                                                              (32, "combiner_fixed")]
    assert all(r["status"] == "ok" and r["host_ms"] > 0 for r in rows)
    assert [unit for kind, unit in gpu.warm_up_tasks(cfg) if kind == "profile"] == gpu.profile_units(cfg)  # not in fig3
    for table in (gpu.profile_table(rows), gpu.events_table(rows)):
        assert "| combiner_fixed | 16 | none |" in table and "| combiner_fixed | 32 | none |" in table


def test_a_run_whose_correctness_rows_are_missing_does_not_pass(tmp_path, monkeypatch):
    """No rows for a configured attention (a lost stage) is a failure, not an empty table read as all-passed."""
    cfg = gpu_check_config(tmp_path, ["dry=true", "correctness.attentions=[full]", "fig3.attentions=[full]",
                                      "profile.attentions=[full]", "train.geometries=[]", "ddp.cpu_processes=1"])
    monkeypatch.setattr(gpu, "check_correctness", lambda cfg, device, limit: [])
    _, ok = gpu.run_gpu_check(cfg)
    assert not ok


@pytest.mark.parametrize("name", ["moba", "routing"])
def test_a_data_chosen_pattern_is_judged_by_its_own_matrix_in_low_precision(name):
    """``pattern_from_data`` variants in bf16: the forward passes against the same dtype's attention_matrix (its
    own choices), and a wrong output still fails."""
    import torch

    from longseq.attention import build_attention

    geometry = {"n_clusters": 4} if name == "routing" else {"block_size": 8}
    attn = build_attention(name, causal=True, seq_len=64, n_heads=2, head_dim=16, **geometry)
    attn = attn.to(torch.bfloat16).eval()
    assert attn.pattern_from_data
    q, k, v = (torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(3))
    with torch.no_grad():
        out = attn(q, k, v)
    status, note = gpu._own_pattern_check(attn, q, k, v, out, 0.02, seed=0)
    assert status == "pass*" and "its own torch.bfloat16 attention_matrix" in note
    assert gpu._own_pattern_check(attn, q, k, v, out * 1.1, 0.02, seed=0)[0] == "FAIL"


def test_crossover_is_the_length_from_which_the_variant_stays_faster():
    def row(name, length, ms, status="ok"):
        return {"attention": name, "length": length, "mode": "fwd_bwd", "ms": ms, "status": status}

    full = [row("full", n, ms) for n, ms in ((256, 1.0), (1024, 4.0), (4096, 16.0), (16384, 64.0))]
    rows = full + [row("a", 256, 0.5), row("a", 1024, 5.0), row("a", 4096, 15.0), row("a", 16384, 30.0),
                   row("b", 256, 2.0), row("b", 1024, 8.0), row("b", 4096, 20.0), row("b", 16384, 70.0),
                   row("c", 256, 2.0), row("c", 1024, 3.0), row("c", 4096, 17.0), row("c", 16384, math.nan, "oom")]
    rows[3]["status"] = "oom"  # full at 16384 did not fit: a variant that ran there is faster
    from longseq.bench.report import add_ratios

    add_ratios(rows)
    assert gpu.crossover(rows, "a", "fwd_bwd") == 4096  # faster at 256 but not at 1024: the crossover is 4096
    assert gpu.crossover(rows, "b", "fwd_bwd") == 16384  # only where full ran out of memory
    assert gpu.crossover(rows, "c", "fwd_bwd") is None  # out of memory at the longest length


def test_peak_flops_table():
    assert gpu.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu.peak_flops("NVIDIA L40S") == 362e12  # not the L4's
    assert gpu.peak_flops("NVIDIA L4") == 121e12
    assert gpu.peak_flops("Some Future GPU") is None and gpu.peak_flops(None) is None


@pytest.mark.slow
def test_ddp_with_two_gloo_processes(tmp_path):
    """The spawned path (one process per rank) that a machine with >= 2 GPUs takes, on CPU with gloo."""
    cfg = gpu_check_config(tmp_path, ["dry=true", "ddp.cpu_processes=2"])
    result = gpu.run_ddp(cfg, "cpu", tmp_path)
    assert result["status"] == "pass" and result["world_size"] == 2 and result["param_spread"] == 0.0


@requires_cuda
def test_gpu_check_on_cuda(tmp_path):
    """The real command on the device at reduced sizes: every attention and backend in fp32 and bf16, forward and
    backward (flex gradients from FlexAttention's backward), the benchmark, bf16-mixed training with MFU."""
    cfg = gpu_check_config(tmp_path, ["device=cuda", "fig3.lengths=[256,1024]", "fig3.repeats=2",
                                      "train.n_layers=1", "train.d_model=64", "train.n_heads=2", "train.steps=2",
                                      "ddp.steps=1"])
    out, ok = gpu.run_gpu_check(cfg)
    assert_complete(out, ok, cfg)
    results, _ = read_results(out)
    flex = [r for r in results["correctness"] if r["backend"] == "flex" and r["status"] == "pass"]
    if "flex" in gpu.backends():
        assert flex and all(not math.isnan(r["grad_err"]) for r in flex)  # backward checked on the device
    assert all(r["peak_mem_mb"] > 0 for r in results["training"])


@requires_multi_gpu
def test_ddp_over_every_gpu(tmp_path):
    cfg = gpu_check_config(tmp_path, ["device=cuda", "train.n_layers=1", "train.d_model=64", "train.n_heads=2",
                                      "train.geometries=[{seq_len:1024,block_size:32}]", "ddp.steps=2"])
    result = gpu.run_ddp(cfg, "cuda", tmp_path)
    assert result["status"] == "pass" and result["world_size"] >= 2 and result["backend"] == "nccl"
