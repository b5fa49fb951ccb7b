"""The recall study (issue 33): its arms and stages compose, the driver plans, orders, resumes and budgets its jobs,
the learning-rate search and its rule, and the report's floor, controls ("not trained"), answer sources,
breakdowns and curves, on run directories written the way train.py writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import CONF, compose_config
from omegaconf import OmegaConf

from longseq.report import recall_report as rr
from longseq.report import recall_study as study
from longseq.report.runs import load_run
from longseq.runner import build_module

PLAN = study.load_plan()


def arms() -> list[str]:
    return sorted(p.stem for p in (CONF / "recall" / "arm").glob("*.yaml"))


# ----------------------------------------------------------------------------------------------------
# Configs


def test_every_arm_composes_and_builds_at_both_lengths(tmp_path):
    """Each arm of conf/recall/arm builds the study's model at L = 256 (recall/mqar) and 1,024 (recall/mqar_long):
    its attention, the controls' windows, the hybrid's layers; every arm is in both MQAR grids."""
    expected = {"full", "local_long", "local_short", "fixed", "axial", "combiner_fixed", "combiner_axial",
                "combiner_mixture", "combiner_select", "moba", "nsa", "linear", "combiner_fixed_full"}
    assert set(arms()) == expected
    for stage in ("recall/mqar", "recall/mqar_long"):
        assert set(study.sweep_params(stage)["recall/arm"]) == expected
    for stage in ("recall/mqar_uniform", "recall/needle", "recall/mqar_lr"):
        assert set(study.sweep_params(stage)["recall/arm"]) < expected
    for experiment, length in (("recall/mqar", 256), ("recall/mqar_long", 1024)):
        for arm in arms():
            cfg = compose_config([f"experiment={experiment}", f"recall/arm={arm}"], tmp_path, fast=False)
            assert cfg.recall_arm == arm and cfg.task.seq_len == length and cfg.task.data.seed == cfg.seed
            net = build_module(cfg).net
            layers = net.layer_names
            if arm == "combiner_fixed_full":
                assert layers == ["combiner_fixed", "full"]
            else:
                assert layers == [cfg.attention.name] * 2
                assert cfg.attention.name == arm.removesuffix("_long").removesuffix("_short")
            if arm.startswith("local"):
                window = net.blocks[0].attn.attention.window
                assert window == (length if arm == "local_long" else cfg.task.block_size)
            # the short control trains to the cap; every other arm may stop early from min_steps on
            assert (cfg.trainer.min_steps == cfg.trainer.max_steps) == (arm == "local_short")
    wide = compose_config(["experiment=recall/mqar", "recall/arm=local_short", "task.num_pairs=32"], tmp_path,
                          fast=False)
    assert build_module(wide).net.blocks[0].attn.attention.window == 32  # the pair count, above block_size (16)


def test_the_study_trains_to_a_plateau_and_seeds_the_data(tmp_path):
    """Early stopping on val/acc (patience, threshold) under a step cap with a floor of min_steps, for MQAR and the
    needle alike; the data seed follows the seed; the learning rate comes from recall_lr (the rule otherwise)."""
    mqar = compose_config(["experiment=recall/mqar", "seed=2"], tmp_path, fast=False)
    needle = compose_config(["experiment=recall/needle"], tmp_path, fast=False)
    for cfg in (mqar, needle):
        stop = cfg.callbacks.early_stopping
        assert (stop.monitor, stop.mode) == ("val/acc", "max")
        assert stop._target_ == "lightning.pytorch.callbacks.EarlyStopping"
        assert 0 < cfg.trainer.min_steps < cfg.trainer.max_steps
        assert cfg.trainer.val_check_interval == cfg.recall_val_every
        assert cfg.task.data.num_train >= cfg.trainer.max_steps * cfg.task.batch_size  # no example seen twice
    assert mqar.task.data.seed == 2 and mqar.optimizer.lr == mqar.recall_lr.rule
    searched = compose_config(["experiment=recall/mqar", "+recall_lr.full=0.01"], tmp_path, fast=False)
    assert searched.optimizer.lr == 0.01
    for key in ("model", "optimizer", "scheduler", "recall_lr", "callbacks"):
        assert mqar[key] == needle[key]


def test_early_stopping_ends_a_run_at_its_threshold_not_at_the_cap(make_cfg, tmp_path):
    """A threshold every accuracy exceeds stops the run at its first validation past min_steps (not at the first
    validation: min_steps holds it; not at the cap: the whole run is one epoch, and Lightning's default min_epochs=1
    would keep it going, hence trainer.min_epochs=0)."""
    from longseq.runner import train

    cfg = make_cfg(["experiment=recall/mqar", "task.seq_len=64", "task.num_pairs=4", "task.vocab_size=128",
                    "task.data.num_val=16", "task.data.num_test=16", "model.d_model=16", "model.n_heads=1",
                    "recall_val_every=2", "trainer.min_steps=4", "trainer.max_steps=40",
                    "callbacks.early_stopping.stopping_threshold=-1.0"])
    train(cfg)
    import torch

    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 4


# ----------------------------------------------------------------------------------------------------
# The driver


def test_jobs_run_in_priority_order_and_directory_names_hold_no_slash(tmp_path):
    controls = [*PLAN["controls"]["positive"], PLAN["controls"]["short"]]
    jobs = study.stage_jobs("recall/mqar", tmp_path, controls)
    params = study.sweep_params("recall/mqar")
    assert len(jobs) == len(set(j.directory for j in jobs)) == len(params["recall/arm"]) * len(
        params["task.num_pairs"]) * len(params["task.power_a"]) * len(params["seed"])
    assert all("/" not in j.name and j.directory.parent == tmp_path / "mqar" for j in jobs)
    seeds = [int(j.values["seed"]) for j in jobs]
    assert seeds == sorted(seeds)  # every setting's seed 1 before any seed 2
    first = [j.arm for j in jobs[:len(params["recall/arm"])]]
    assert first[:3] == controls and sorted(first) == sorted(params["recall/arm"])  # controls lead each setting


def record(job: study.Job, status: str, acc: float | None = None, loss: float | None = None,
           error: str | None = None) -> None:
    job.directory.mkdir(parents=True)
    metrics = {} if acc is None else {"val/acc_best": acc, "val/loss": loss}
    (job.directory / "metrics.json").write_text(json.dumps({"status": status, "metrics": metrics, "error": error}))


def test_status_lr_pick_and_the_rule(tmp_path, capsys):
    """A completed job is skipped, a stopped one re-run, a failed one kept; per arm the rule's rate wins where it is
    within the tolerance of the best val/acc_best, else the best (ties: the lower val/loss); the rule holds only when
    its rate is within the tolerance of every searched arm's best."""
    jobs = study.stage_jobs("recall/mqar_lr", tmp_path)
    assert len(jobs) == 4 * 4 and {j.values["optimizer.lr"] for j in jobs} == {"3e-4", "1e-3", "3e-3", "1e-2"}
    by = {(j.arm, j.values["optimizer.lr"]): j for j in jobs}
    record(by["full", "1e-3"], "completed", 0.99, 0.05)
    record(by["full", "3e-3"], "completed", 0.99, 0.03)  # the same accuracy, a lower loss
    record(by["full", "1e-2"], "completed", 0.40, 0.01)
    record(by["fixed", "3e-4"], "failed", error="ValueError: diverged")
    record(by["fixed", "1e-3"], "failed", error="SystemExit: 1")  # Ctrl-C during fit, as Lightning reports it
    record(by["fixed", "3e-3"], "completed", 0.10, 4.0)
    record(by["fixed", "1e-2"], "completed", 0.20, 3.0)
    assert study.pick_lrs(jobs, 5e-3, 0.0) == {"full": 3e-3, "fixed": 1e-2}  # the best; ties: the lower loss
    record(by["full", "3e-4"], "completed", 0.995, 0.02)
    assert study.pick_lrs(jobs, 3e-3, 0.02) == {"full": 3e-3, "fixed": 1e-2}  # 0.99 at the rule: within 0.02
    assert study.pick_lrs(jobs, 3e-3, 0.0)["full"] == 3e-4
    assert study.search_rule(jobs) == 3e-3
    assert [by["fixed", lr].status() for lr in ("3e-4", "1e-3", "3e-3")] == ["failed", "stopped", "completed"]
    holds, lines = study.rule_verdict(jobs, 3e-3, 0.02)
    assert not holds and any("fixed" in line and "does not hold" in line for line in lines)
    assert study.rule_verdict(jobs, 3e-3, 0.2)[0]
    assert study.print_status({"recall/mqar_lr": jobs}) == 16 - 6
    assert "failed: " in capsys.readouterr().out


def test_only_selects_arms_and_swept_settings(tmp_path):
    jobs = study.stage_jobs("recall/needle", tmp_path)
    kept = [j for j in jobs if study.selected(j, "full,local_short,task.seq_len=256,seed=1")]
    assert {(j.arm, j.values["task.seq_len"], j.values["seed"]) for j in kept} == {
        ("full", "256", "1"), ("local_short", "256", "1")}
    lr_jobs = study.stage_jobs("recall/mqar_lr", tmp_path)
    assert not [j for j in lr_jobs if study.selected(j, "full,optimizer.lr=skip")]  # a value no job has
    assert len([j for j in jobs if study.selected(j, "full,optimizer.lr=skip")]) == len(
        study.sweep_params("recall/needle")["seed"]) * len(study.sweep_params("recall/needle")["task.seq_len"])


def test_the_budget_stops_new_jobs_and_adds_up_across_runs_of_the_driver(tmp_path):
    spent = study.Budget(tmp_path, hours=1.0)
    spent.before = 3600.0  # as if an hour had gone by in earlier runs
    spent.save()
    again = study.Budget(tmp_path, hours=1.0)
    assert again.spent_s() >= 3600.0 and again.left_s() <= 0
    job = study.stage_jobs("recall/mqar_lr", tmp_path)[0]
    assert study.run_job(job, 1, tmp_path / "console", [], again) == "over budget" and not job.directory.exists()


def test_the_plan_adds_up_the_budget_of_every_stage(capsys, tmp_path):
    stages = {s: study.stage_jobs(s, tmp_path) for s in PLAN["tasks"]["mqar"]["stages"]}
    hours = study.print_plan("mqar", stages, PLAN)
    costs = PLAN["tasks"]["mqar"]["job_seconds"]
    low = sum(len(j) for j in stages.values()) * min(min(c.values()) for c in costs.values()) / 3600 / PLAN["jobs"]
    assert hours >= low > 0
    assert f"about {hours:.2f} h in all" in capsys.readouterr().out


def test_a_second_driver_on_the_same_study_is_refused(tmp_path):
    """Two drivers on one study would remove each other's live job directories: the second exits, naming it."""
    import subprocess
    import sys

    held = study.hold_study_lock(tmp_path)
    code = (f"from pathlib import Path; from longseq.report import recall_study as s; "
            f"s.hold_study_lock(Path({str(tmp_path)!r}))")
    try:
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert other.returncode != 0 and "another recall_study driver" in other.stderr and str(tmp_path) in other.stderr
    finally:
        held.close()
    study.hold_study_lock(tmp_path).close()  # free again once the first has ended


def test_the_needle_takes_the_mqar_search_table(tmp_path, monkeypatch):
    table = tmp_path / "lr_table.yaml"
    plan = {"tasks": {"needle": {"lr_table": str(table)}}}
    assert study.lr_table_for("needle", tmp_path, {}, plan) == {}  # no search yet: conf/recall/study.yaml's rates
    table.write_text("recall_lr:\n  full: 0.01\n  local_short: 0.003\n")
    assert study.lr_table_for("needle", tmp_path, {}, plan) == {"full": 0.01, "local_short": 0.003}


# ----------------------------------------------------------------------------------------------------
# The report, on run directories as train.py writes them


def fake_run(root: Path, arm: str, seed: int, acc: float, distance: dict[str, tuple[float, int]] | None = None,
             curve: tuple[float, ...] = (0.1, 0.5), L: int = 64, D: int = 4, window: int = 4,
             in_example: tuple[float, float] = (1.0, 0.5)) -> Path:
    """A completed MQAR run directory: resolved config, metrics.json, the per-distance test table, a CSV log."""
    run = root / f"{arm}_L{L}_D{D}_s{seed}"
    (run / "recall").mkdir(parents=True)
    (run / "csv").mkdir()
    config = {"recall_arm": arm, "seed": seed, "attention": {"name": arm.split("_")[0], "window": window},
              "model": {"short_conv": 4},
              "task": {"seq_len": L, "num_pairs": D, "power_a": 0.01,
                       "module": {"name": "mqar", "generator": {"vocab_size": L + 64, "seq_len": L, "num_pairs": D,
                                                                "power_a": 0.01}}}}
    (run / "config_resolved.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
    metrics = {"test/acc": acc, "val/acc_best": max(curve), "test/in_example": in_example[0],
               "test/in_example_acc": in_example[1]}
    (run / "metrics.json").write_text(json.dumps({"status": "completed", "metrics": metrics}))
    rows = ["distance,acc,questions", *(f"{k},{a},{n}" for k, (a, n) in (distance or {}).items())]
    (run / "recall" / "test_by_distance.csv").write_text("\n".join(rows) + "\n")
    lines = ["epoch,step,val/acc", *(f"0,{100 * (i + 1) - 1},{a}" for i, a in enumerate(curve))]
    (run / "csv" / "metrics.csv").write_text("\n".join(lines) + "\n")
    return run


def trained_setting(root: Path, L: int = 64, D: int = 4, full: float = 0.99, short_beyond: float = 0.2) -> None:
    for seed in (1, 2, 3):
        fake_run(root, "full", seed, full - 0.001 * seed, L=L, D=D)
        fake_run(root, "local_long", seed, 0.98, L=L, D=D)
        fake_run(root, "local_short", seed, 0.5, {"2-3": (0.97, 50), "32-63": (short_beyond, 40)}, L=L, D=D)
        fake_run(root, "combiner_fixed", seed, 0.2 + 0.01 * seed, L=L, D=D, in_example=(0.7, 0.25))


def load(root: Path) -> rr.StudyRuns:
    runs = [load_run(p) for p in sorted(root.iterdir())]
    return rr.StudyRuns.load(runs, ["task.seq_len", "task.num_pairs", "task.power_a"])


def test_the_table_carries_the_floor_and_the_controls_and_intervals(tmp_path):
    """A trained setting: cells are mean ± 95 % t half-width (seeds), the floor row is 1/D, the controls row says
    pass with each control's number, the answers table shows share / precision."""
    trained_setting(tmp_path)
    runs = load(tmp_path)
    table = rr.main_table(runs, PLAN["controls"], "distance", ["full", "local_long", "local_short", "combiner_fixed"])
    lines = table.splitlines()
    assert lines[0] == "| arm | L = 64, D = 4, power law a = 0.01 |"
    half = rr.t_interval(runs.part(("64", "4", "0.01"), "combiner_fixed")["test/acc"])
    assert abs(half - 4.303 * 0.01 / 3 ** 0.5) < 1e-3  # t(0.975, 2) x s / sqrt(n)
    assert f"| combiner_fixed | 0.220 ± {half:.3f} (3) |" in lines
    assert "| guessing floor | 0.250 |" in lines
    controls = next(line for line in lines if line.startswith("| controls"))
    assert "pass: full 0.988 ≥ 0.95; local_long 0.980 ≥ 0.95" in controls
    assert "local_short (window 4): inside 0.970 ≥ 0.9" in controls
    assert "beyond 16 tokens 0.200 ≤ floor + 0.05" in controls
    answers = rr.answers_table(runs, ["full", "combiner_fixed"])
    assert "| combiner_fixed | 0.70 / 0.250 |" in answers and "| guessing floor (precision) | 0.250 |" in answers


@pytest.mark.parametrize("broken", ["full", "short_beyond", "short_missing"])
def test_a_setting_whose_controls_fail_is_not_trained(tmp_path, broken):
    """full below the pass mark, or local_short answering beyond its reach (a leak), or no short control at all:
    no arm of that setting gets a number."""
    trained_setting(tmp_path, full=0.6 if broken == "full" else 0.99,
                    short_beyond=0.9 if broken == "short_beyond" else 0.2)
    if broken == "short_missing":
        for run in tmp_path.glob("local_short_*"):
            import shutil

            shutil.rmtree(run)
    table = rr.main_table(load(tmp_path), PLAN["controls"], "distance", ["full", "combiner_fixed"])
    assert "| combiner_fixed | not trained |" in table and "| controls | FAIL: " in table


def test_a_figure_panel_whose_controls_fail_says_not_trained(tmp_path, monkeypatch):
    """The figures show every setting, and the panel of one whose controls fail is titled as not trained."""
    trained_setting(tmp_path / "runs", L=64, D=4, full=0.6)
    trained_setting(tmp_path / "runs", L=128, D=8, short_beyond=0.1)
    runs = load(tmp_path / "runs")
    untrained = rr.untrained_settings(runs, PLAN["controls"], "distance")
    assert len(untrained) == 1 and len(runs.groups()) == 2
    titles = []
    finish = rr._finish
    monkeypatch.setattr(rr, "_finish", lambda fig, axes, used, path, ylabel: (
        titles.extend(ax.get_title() for ax in axes[:used]), finish(fig, axes, used, path, ylabel))[1])
    rr.draw_accuracy(runs, tmp_path / "a.png", untrained)
    (marked,) = [t for t in titles if "NOT TRAINED" in t]
    assert runs.setting_label(next(iter(untrained))) in marked


def test_breakdown_pools_questions_over_seeds_and_curves_keep_every_run(tmp_path):
    for seed, (a, n) in enumerate(((1.0, 10), (0.0, 30)), start=1):
        fake_run(tmp_path, "full", seed, 0.5, {"4-7": (a, n)}, curve=(0.1 * seed, 0.2 * seed, 0.3 * seed))
    runs = load(tmp_path)
    frame = rr.breakdown_frame(runs, "distance")
    row = frame.iloc[0]
    assert (row["bucket"], row["questions"], row["acc"], row["floor"]) == ("4-7", 40, 0.25, 0.25)
    curves = rr.curves_frame(runs)
    assert len(curves) == 6 and sorted(curves["seed"].unique()) == [1, 2] and curves["step"].max() == 299
    assert list(runs.frame["steps"]) == [300, 300]
    assert rr.bucket_order(["1", "repeat", "0.25", "0"], "depth") == ["0", "0.25", "1", "repeat"]
    assert rr.bucket_order(["16-31", "2-3", "4-7"], "distance") == ["2-3", "4-7", "16-31"]


def test_figures_have_a_panel_per_setting_and_the_floor(tmp_path):
    from PIL import Image

    trained_setting(tmp_path / "runs", L=64, D=4)
    trained_setting(tmp_path / "runs", L=128, D=8)
    runs = load(tmp_path / "runs")
    for name, path in (("accuracy", rr.draw_accuracy(runs, tmp_path / "a.png")),
                       ("distance", rr.draw_breakdown(runs, rr.breakdown_frame(runs, "distance"), "distance",
                                                      tmp_path / "b.png")),
                       ("curves", rr.draw_curves(runs, rr.curves_frame(runs), tmp_path / "c.png"))):
        width, height = Image.open(path).size
        assert width > 1.5 * height, name  # two settings side by side


@pytest.mark.slow
def test_the_driver_runs_a_tiny_study_end_to_end_and_resumes(tmp_path):
    """Two short jobs per stage through train.py, the report with its tables and figures; a second run of the
    driver skips what is done."""
    args = ["mqar", "--root", str(tmp_path), "--only", "full,local_long,local_short,seed=1,task.num_pairs=8,"
            "task.num_pairs=16,task.power_a=0.01,optimizer.lr=3e-3", "trainer.max_steps=6", "trainer.min_steps=2",
            "recall_val_every=3", "task.data.num_val=16", "task.data.num_test=16", "--figures", str(tmp_path / "docs")]
    assert study.main(args) == 0
    report = (tmp_path / "report.md").read_text()
    assert "guessing floor" in report and "| controls |" in report and "Learning-rate search" in report
    assert {p.name for p in (tmp_path / "docs").iterdir()} == {
        "recall_mqar_accuracy.png", "recall_mqar_by_distance.png", "recall_mqar_curves.png"}
    seconds = (tmp_path / "mqar" / study.JOB_SECONDS).read_text().splitlines()
    assert study.main(args) == 0  # resumed: nothing left to run
    assert (tmp_path / "mqar" / study.JOB_SECONDS).read_text().splitlines() == seconds


def test_sigterm_to_the_driver_stops_its_running_jobs():
    """A job left running after its driver was stopped would write into a directory the next driver removes."""
    import subprocess
    import sys

    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    study.LIVE_JOBS.add(job)
    try:
        with pytest.raises(SystemExit) as stop:
            study.stop_jobs(15, None)
        assert stop.value.code == 143 and job.wait(timeout=10) != 0
    finally:
        study.LIVE_JOBS.discard(job)
        job.kill()
