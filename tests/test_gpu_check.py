"""``python -m longseq.bench.gpu`` (make gpu-check): the dry run on CPU (every stage at tiny sizes, so the pipeline
cannot rot), its pieces (crossover, peak FLOP/s table, a failing check is reported), and the real run on CUDA."""

from __future__ import annotations

import json
import math
import os
import signal
import time

import pytest
import torch
from conftest import compose_config
from devices import requires_cuda, requires_multi_gpu
from hydra.core.global_hydra import GlobalHydra

from longseq.bench import gpu
from longseq.bench.__main__ import prepare_check


def gpu_check_config(tmp_path, overrides: list[str]):
    overrides = [f"out_dir={tmp_path}", *overrides]
    try:
        cfg = compose_config(overrides, config_name="gpu_check", fast=False)
    finally:
        GlobalHydra.instance().clear()
    return prepare_check(cfg, overrides)


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
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 and r["graphs_in_timed_steps"] == 0
               for r in results["training"])
    calibration = {r["what"]: r for r in results["calibration"]}
    assert len(calibration) == 6 and all(r["status"] in ("ok", "skipped") for r in calibration.values())
    for r in calibration.values():  # what ran has its figures; what did not says why
        assert r["host_us"] > 0 and r["wall_us"] >= r["host_us"] if r["status"] == "ok" else r["note"]
        assert f"| {r['what']} | {r['calls']} | {r['launches_per_call']} |" in text
    assert results["ddp"]["status"] in ("pass", "skipped")
    for r in results["profile"]:  # where the host's time goes: the largest events first, within the step's total
        assert r["status"] == "ok" and 0 < len(r["host_top"]) <= gpu.TOP_EVENTS
        per_event = [us for _, us, calls in r["host_top"]]
        assert per_event == sorted(per_event, reverse=True) and sum(per_event) <= r["host_ms"] * 1e3 + 1e-6
        assert (f"| {r['attention']} | {r['length']} | {r['compile']} | {r['host_ms']:.3f} | "
                f"`{r['host_top'][0][0][:60]}`") in text
        assert (r["kernels"] != []) == (r["kernels_per_step"] > 0)  # every kernel counted is listed by name
        assert r["graph_ms"] > 0 or r["graph_note"]  # replayed in a CUDA graph, or why not


def test_dry_run_passes_and_writes_the_report(tmp_path):
    cfg = gpu_check_config(tmp_path, ["dry=true"])
    assert cfg.device == "cpu" and cfg.fig3.lengths == [32, 64]  # the dry preset applied
    out, ok = gpu.run_gpu_check(cfg)
    assert out.parent == tmp_path
    assert_complete(out, ok, cfg)
    results, text = read_results(out)
    assert results["ddp"]["status"] == "pass" and results["ddp"]["param_spread"] == 0.0
    assert "MFU omitted" in text  # no peak FLOP/s for a CPU
    # on CPU: the launches and the trivial function timed, eager and compiled; what needs CUDA graphs says so
    calibration = {r["what"]: r for r in results["calibration"]}
    assert [r["status"] for r in results["calibration"]] == ["ok", "skipped", "ok", "ok", "ok", "skipped"]
    assert calibration["1-element add, eager launches"]["launches_per_call"] == cfg.calibration.launches
    assert all(math.isnan(r["gpu_us"]) for r in results["calibration"])  # no CUDA events on a CPU
    assert "CUDA graphs need a CUDA device (here: cpu)" in calibration[
        "1-element add, the same launches replayed in one CUDA graph"]["note"]
    assert "inductor on a CUDA device only (here: cpu, backend aot_eager)" in calibration[
        "(x * w).sum() forward + backward, compiled reduce-overhead"]["note"]
    for r in results["profile"]:  # the graph-replay column says why it is empty; the layer as called is timed
        assert r["graph_note"] == "skipped: CUDA graphs need a CUDA device (here: cpu)" and math.isnan(r["graph_ms"])
        assert (f"| {r['attention']} | {r['length']} | none | {r['wall_ms']:.3f} | {r['ratio_to_full']:.2f} |  |  |  "
                f"|  | {r['graph_note']} |") in text
        assert f"| {r['attention']} | {r['length']} | none | 0 | 0 | 0 | none (no CUDA device) |" in text
    assert [r["ratio_to_full"] for r in results["profile"] if r["attention"] == "full"] == [1.0]
    whole_step = text.split("### The whole-step graph against full")[1]
    for r in results["training"]:
        ratio = r["tokens_per_s"] / results["training"][0]["tokens_per_s"]
        assert f"| {r['attention']} | {r['seq_len']} | {r['tokens_per_s']:,.0f} ({ratio:.2f}) | none ({ratio:.2f}) |" \
            in whole_step
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


@pytest.mark.slow  # ~25 s of worker processes; the dry run checks the warm-up's results
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


@pytest.mark.slow  # timed against an 8 s limit: a loaded machine (the suite's other worker) misses it
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
    rows = [*results["calibration"], *results["correctness"], *(r for table in results["fig3"] for r in table),
            *results["profile"], *results["training"], results["ddp"]]
    assert rows and all(r["status"] == gpu.TIME_LIMIT for r in rows) and len(results["calibration"]) == 6
    assert {r["attention"] for r in results["correctness"]} == {"full", "fixed"}
    assert f"{len(rows)} unit(s) of work not run: past time_limit_s=0" in text
    assert f"{len(rows)} unit(s) not run" in capsys.readouterr().out


def test_the_quick_preset_writes_its_report_within_a_short_lease(tmp_path):
    """Issue 43's questions within one lease: the calibration, every layout of the fused summaries checked, the layer
    targets profiled (as called and graph-replayed) at their lengths, training at 3,072 eager, compiled whole and as
    whole-step CUDA graphs, all with full beside them; no Fig. 3 (the profile times the same layers); the warm-up
    compiles each profiled layer and training row once: 25 units, as the docstring's estimate counts them."""
    cfg = gpu_check_config(tmp_path, ["preset=quick"])
    assert 0 < cfg.time_limit_s <= 270 and cfg.workers > 1
    assert cfg.calibration.backend == "inductor" and cfg.calibration.launches >= 1000
    assert set(gpu._names(cfg.correctness.attentions)) >= {
        "full", "combiner_fixed", "combiner_axial", "combiner_axial_vertical", "combiner_axial_horizontal",
        "combiner_logsparse", "combiner_mixture"}
    targets = {"full", "combiner_fixed", "combiner_axial"}
    assert {(L, name, "none") for L in (4096, 16384, 65536) for name in targets} == set(gpu.profile_units(cfg))
    assert {(name, 3072, mode) for name, _, _, mode in gpu.train_cases(cfg)} == {
        (name, 3072, mode) for name in targets for mode in ("none", "default", "reduce-overhead")}
    assert all(not gpu.fig3_cells(cfg, "cuda", gpu._names(cfg.fig3.attentions), shape) for shape in cfg.fig3.shapes)
    tasks = gpu.warm_up_tasks(cfg)
    assert [unit for kind, unit in tasks if kind == "profile"] == gpu.profile_units(cfg)
    assert not [unit for kind, unit in tasks if kind == "fig3"]
    assert len(tasks) == len(gpu._names(cfg.correctness.attentions)) + 9 + 9 == 25
    assert [kind for kind, _ in tasks] == sorted((kind for kind, _ in tasks),  # under the limit: the stages' order
                                                 key=["correctness", "profile", "fig3", "train"].index)


def test_the_report_says_when_fig3_has_no_cells(tmp_path):
    cfg = gpu_check_config(tmp_path, ["dry=true", "fig3.lengths=[]"])
    assert gpu.run_fig3(cfg, "cpu") == [[], []]
    text = gpu.write_report(tmp_path, cfg, {}, [], [], [[], []], [], [], {"status": "skipped"}, None)
    assert "## Fig. 3 benchmark\n\nNot run: no fig3.lengths or fig3.shapes" in text and "crossover" not in text
    assert all(section in text for section in gpu.SECTIONS)


def profiler_event(name: str, us: float, device: str = "cuda", activity: str | None = "kernel",
                   annotation: bool = False):
    """A ``torch.profiler`` event as the profiler makes them (``FunctionEvent``), lasting ``us`` µs."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    return FunctionEvent(id=0, name=name, thread=0, start_us=0, end_us=us, activity_type=activity,
                         device_type=DeviceType.CUDA if device == "cuda" else DeviceType.CPU,
                         is_user_annotation=annotation)


def test_the_kernels_of_a_step_leave_out_annotations_and_host_events():
    """``step_kernels`` over two steps' events: kernels by name, largest GPU time first, per step; copies and fills
    counted apart; the annotation ranges on the GPU's timeline (which enclose kernels already counted), host events
    and other GPU bookkeeping neither counted as kernels nor in the busy time. Events of a torch without
    ``activity_type`` are told by their names."""
    events = [profiler_event("triton_poi_fused_add_0", 10.0), profiler_event("triton_poi_fused_add_0", 10.0),
              profiler_event("flex_attention_backward", 60.0), profiler_event("flex_attention_backward", 60.0),
              profiler_event("gemm", 4.0), profiler_event("gemm", 4.0), profiler_event("gemm", 4.0),
              profiler_event("gemm", 4.0),
              profiler_event("Memcpy DtoD (Device -> Device)", 2.0, activity="gpu_memcpy"),
              profiler_event("Memset (Device)", 1.0, activity="gpu_memset"),
              profiler_event("## Call CompiledFxGraph ##", 500.0, activity="gpu_user_annotation", annotation=True),
              profiler_event("CompiledFunction", 400.0, activity="gpu_user_annotation"),
              profiler_event("cudaStreamSynchronize", 300.0, activity="cuda_sync"),
              profiler_event("aten::mm", 900.0, device="cpu", activity="cpu_op"),
              profiler_event("old torch kernel", 6.0, activity=None),
              profiler_event("Memcpy HtoD (Pageable -> Device)", 3.0, activity=None),
              profiler_event("Memset (Device)", 1.0, activity=None)]
    assert [gpu.gpu_activity(e) for e in events[-8:]] == ["fill", "annotation", "annotation", "other", None, "kernel",
                                                          "copy", "fill"]
    got = gpu.step_kernels(events, steps=2)
    assert got["kernels"] == [("flex_attention_backward", 60.0, 1.0), ("triton_poi_fused_add_0", 10.0, 1.0),
                              ("gemm", 8.0, 2.0), ("old torch kernel", 3.0, 0.5)]
    assert got["kernels_per_step"] == 4.5 and got["copies_per_step"] == 2.0
    assert got["annotations_per_step"] == 1.0 and got["other_gpu_per_step"] == 0.5
    assert got["gpu_busy_ms"] == pytest.approx((20 + 120 + 16 + 2 + 1 + 6 + 3 + 1) / 2 / 1e3)
    assert gpu.step_kernels(events[-4:-3], steps=1)["kernels"] == []  # host events only: no kernels


def test_the_kernels_table_lists_the_largest_first_and_says_how_many_more():
    kernels = [(f"triton_{i}|part", 100.0 - i, 1.0) for i in range(gpu.KERNELS_LISTED + 3)]
    row = {"attention": "combiner_fixed", "length": 4096, "compile": "none", "kernels": kernels,
           "kernels_per_step": 15.0, "copies_per_step": 2.0, "annotations_per_step": 4.0}
    table = gpu.kernels_table([row, {"attention": "full", "length": 4096, "compile": "none", "status": "error"}])
    (line,) = [line for line in table.splitlines() if line.startswith("| combiner_fixed")]
    assert line.startswith("| combiner_fixed | 4096 | none | 15 | 2 | 4 | `triton_0/part` 100.0 (1); `triton_1/part`")
    assert line.count("`triton_") == gpu.KERNELS_LISTED and line.endswith("; ... 3 more |")  # a '|' kept out of cells
    assert "| full |" not in table  # a layer that did not run has no kernels to list


def replay_by_calling(step, dev, warmup):
    """``gpu.cuda_graph_replay`` without a GPU: the step itself, warmed up as the capture would be."""
    for _ in range(warmup):
        step()
    return step


def test_the_layer_replayed_in_a_cuda_graph_fills_its_columns(tmp_path, monkeypatch):
    """The profile's graph path on CPU, the capture replaced by calling the step (``replay_by_calling``): each layer
    gets its replay time, its ratio to full's replay at the same length and the host's overhead (as called - replayed);
    a capture that fails and a module that replays graphs of its own (reduce-overhead) are said so, not timed."""
    cfg = gpu_check_config(tmp_path, ["dry=true", "profile.attentions=[full,combiner_fixed]", "profile.length=[16,32]"])
    with pytest.raises(gpu.NoCudaGraph, match="need a CUDA device"):  # the real capture, on a CPU
        gpu.cuda_graph_replay(lambda: None, torch.device("cpu"), 1)
    monkeypatch.setattr(gpu, "cuda_graph_replay", replay_by_calling)
    rows = gpu.run_profile(cfg, "cpu")
    by_key = {(r["attention"], r["length"]): r for r in rows}
    for r in rows:
        full = by_key[("full", r["length"])]
        assert r["status"] == "ok" and r["graph_ms"] > 0 and r["graph_note"] == ""
        assert r["graph_ratio_to_full"] == pytest.approx(r["graph_ms"] / full["graph_ms"])
        assert r["ratio_to_full"] == pytest.approx(r["wall_ms"] / full["wall_ms"])
        assert r["host_overhead_ms"] == pytest.approx(r["wall_ms"] - r["graph_ms"])
        assert r["host_share"] == pytest.approx(r["host_overhead_ms"] / r["wall_ms"])
    table = gpu.graph_table(rows)
    for r in rows:
        assert (f"| {r['attention']} | {r['length']} | none | {r['wall_ms']:.3f} | {r['ratio_to_full']:.2f} | "
                f"{r['graph_ms']:.3f} | {r['graph_ratio_to_full']:.2f} | {r['host_overhead_ms']:.3f} |") in table

    def broken_capture(step, dev, warmup):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(gpu, "cuda_graph_replay", broken_capture)
    failed = gpu.graph_timing(lambda: None, torch.device("cpu"), "none", 1, 1)
    assert math.isnan(failed["graph_ms"]) and failed["graph_note"].startswith(
        "capture failed: RuntimeError: operation not permitted when stream is capturing")
    own = gpu.graph_timing(lambda: None, torch.device("cpu"), "reduce-overhead", 1, 1)
    assert math.isnan(own["graph_ms"]) and own["graph_note"] == "n/a: reduce-overhead already replays CUDA graphs"


def test_profile_ratios_pair_each_layer_with_full_at_its_length_and_mode():
    def row(name, length, compile_mode, wall, graph=math.nan, status="ok"):
        return {"attention": name, "length": length, "compile": compile_mode, "status": status, "wall_ms": wall,
                "graph_ms": graph}

    rows = [row("full", 16, "none", 2.0, 1.0), row("a", 16, "none", 5.0, 0.5), row("full", 16, "default", 4.0),
            row("a", 16, "default", 2.0), row("a", 32, "none", 3.0, 1.0), row("b", 16, "none", 1.0, status="error")]
    gpu.add_profile_ratios(rows)
    assert (rows[1]["ratio_to_full"], rows[1]["graph_ratio_to_full"], rows[1]["host_overhead_ms"]) == (2.5, 0.5, 4.5)
    assert rows[3]["ratio_to_full"] == 0.5 and math.isnan(rows[3]["graph_ratio_to_full"])  # full has no graph there
    assert math.isnan(rows[4]["ratio_to_full"]) and math.isnan(rows[4]["graph_ratio_to_full"])  # no full at 32
    assert "ratio_to_full" not in rows[5]


def test_the_whole_step_table_compares_each_mode_with_full_in_the_same_mode():
    def row(name, mode, tokens, status="ok"):
        return {"attention": name, "seq_len": 3072, "compile": mode, "status": status, "tokens_per_s": tokens}

    rows = [row("full", "none", 1000.0), row("full", "default", 1250.0), row("full", "reduce-overhead", 2000.0),
            row("combiner_fixed", "none", 600.0), row("combiner_fixed", "default", 500.0),
            row("combiner_fixed", "reduce-overhead", 3000.0), row("combiner_axial", "none", 500.0),
            row("combiner_axial", "default", math.nan, "error"), row("combiner_axial", "reduce-overhead", 2500.0)]
    table = gpu.whole_step_table(rows)
    assert "| attention | L | none: tokens/s (ratio) | default: tokens/s (ratio) | reduce-overhead: tokens/s (ratio) |" \
        in table
    assert "| full | 3072 | 1,000 (1.00) | 1,250 (1.00) | 2,000 (1.00) | reduce-overhead (1.00) |" in table
    assert "| combiner_fixed | 3072 | 600 (0.60) | 500 (0.40) | 3,000 (1.50) | reduce-overhead (1.50) |" in table
    assert "| combiner_axial | 3072 | 500 (0.50) | error | 2,500 (1.25) | reduce-overhead (1.25) |" in table


def test_training_compiled_whole_counts_its_graphs(tmp_path, monkeypatch, capsys):
    """The training stage's compiled modes on CPU (dynamo and AOTAutograd with eager kernels standing in for inductor):
    each row says how many graphs its steps made and that the timed steps made none (no recompile), and the
    whole-step table puts every mode beside full's."""
    cfg = gpu_check_config(tmp_path, ["dry=true", "train.attentions=[full,combiner_axial]",
                                      "train.compile=[none,reduce-overhead]", "train.steps=2"])
    monkeypatch.setattr(gpu, "compile_module", lambda module, mode: module if mode == "none" else torch.compile(
        module, backend="aot_eager", dynamic=False))
    rows = gpu.run_training(cfg, "cpu", None)
    assert [(r["attention"], r["compile"]) for r in rows] == [
        (name, mode) for name in ("full", "combiner_axial") for mode in ("none", "reduce-overhead")]
    assert all(r["status"] == "ok" and r["graphs_in_timed_steps"] == 0 for r in rows), rows
    assert [r["graphs"] > 0 for r in rows] == [False, True, False, True]  # eager on CPU: no graph at all
    table = gpu.whole_step_table(rows)
    for name in ("full", "combiner_axial"):
        assert f"| {name} | 48 | " in table
    assert table.count("(1.00)") >= 3  # full against itself in both modes, and full's best


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
    # on the device every layer as called is also captured and replayed in a CUDA graph, and its kernels are listed
    assert all(r["graph_ms"] > 0 and r["kernels"] for r in results["profile"] if r["compile"] != "reduce-overhead")
    assert all(r["status"] == "ok" and r["gpu_us"] > 0 for r in results["calibration"])


@requires_multi_gpu
def test_ddp_over_every_gpu(tmp_path):
    cfg = gpu_check_config(tmp_path, ["device=cuda", "train.n_layers=1", "train.d_model=64", "train.n_heads=2",
                                      "train.geometries=[{seq_len:1024,block_size:32}]", "ddp.steps=2"])
    result = gpu.run_ddp(cfg, "cuda", tmp_path)
    assert result["status"] == "pass" and result["world_size"] >= 2 and result["backend"] == "nccl"
