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


STUDY_ARMS = {"full", "local_long", "local_short", "fixed", "axial", "combiner_fixed", "combiner_axial",
              "combiner_mixture", "combiner_select", "moba", "nsa", "linear", "combiner_fixed_full",
              "full_combiner_fixed", "combiner_fixed_full_rezero", "full_combiner_fixed_rezero"}
HYBRIDS = {"combiner_fixed_full": (["combiner_fixed", "full"], False),
           "full_combiner_fixed": (["full", "combiner_fixed"], False),
           "combiner_fixed_full_rezero": (["combiner_fixed", "full"], True),
           "full_combiner_fixed_rezero": (["full", "combiner_fixed"], True)}


@pytest.mark.slow  # ~25 s: every arm's model at both lengths; the plan's tests compose the stages
def test_every_arm_composes_and_builds_at_both_lengths(tmp_path):
    """Each arm of conf/recall/arm builds the study's model at L = 256 and 1,024 with the pairs scattered: its
    attention, the controls' windows (the short one covering recall_short_share of the questions), the hybrids' layers
    in both orders with and without ReZero; every arm is in both scattered grids."""
    from longseq.data.recall import MqarGenerator, covering_window

    assert set(arms()) == STUDY_ARMS
    for stage in ("recall/mqar_scattered", "recall/mqar_scattered_long"):
        assert set(study.sweep_params(stage)["recall/arm"]) == STUDY_ARMS
    for stage in ("recall/mqar", "recall/mqar_long", "recall/mqar_uniform", "recall/needle", "recall/needle_long"):
        assert set(study.sweep_params(stage)["recall/arm"]) < STUDY_ARMS
    for experiment, length in (("recall/mqar_scattered", 256), ("recall/mqar_scattered_long", 1024)):
        for arm in arms():
            cfg = compose_config([f"experiment={experiment}", f"recall/arm={arm}"], tmp_path, fast=False)
            assert cfg.recall_arm == arm and cfg.task.seq_len == length and cfg.task.data.seed == cfg.seed
            assert (cfg.task.placement, cfg.task.filler) == ("scattered", "vocab")
            net = build_module(cfg).net
            if arm in HYBRIDS:
                layers, gain = HYBRIDS[arm]
                assert net.layer_names == layers and all((b.gain is not None) == gain for b in net.blocks)
            else:
                assert net.layer_names == [cfg.attention.name] * 2 and net.blocks[0].gain is None
                assert cfg.attention.name == arm.removesuffix("_long").removesuffix("_short")
            if arm.startswith("local"):
                window = net.blocks[0].attn.attention.window
                generator = MqarGenerator(**OmegaConf.to_container(cfg.task.module.generator, resolve=True))
                assert window == (length if arm == "local_long" else covering_window(generator, cfg.recall_short_share))
            # the short control trains to the cap; every other arm may stop early from min_steps on
            assert (cfg.trainer.min_steps == cfg.trainer.max_steps) == (arm == "local_short")
    start = compose_config(["experiment=recall/mqar", "recall/arm=local_short"], tmp_path, fast=False)
    assert build_module(start).net.blocks[0].attn.attention.window == 16  # issue 33's window at the start, D = 8


def test_the_study_trains_to_its_cap_unless_solved_and_seeds_the_data(tmp_path):
    """Early stopping on val/acc under a step cap: MQAR's arms stop when solved (from min_steps) and otherwise train to
    the cap (patience judged from the cap on), the needle keeps issue 33's plateau rule from step 1,500; the data seed
    follows the seed; the learning rate comes from recall_lr (the rule otherwise)."""
    mqar = compose_config(["experiment=recall/mqar_scattered", "seed=2"], tmp_path, fast=False)
    needle = compose_config(["experiment=recall/needle_long"], tmp_path, fast=False)
    for cfg in (mqar, needle):
        stop = cfg.callbacks.early_stopping
        assert (stop.monitor, stop.mode) == ("val/acc", "max")
        assert stop._target_ == "longseq.callbacks.early_stopping.PatienceFromMinSteps"
        assert 0 < cfg.trainer.min_steps < cfg.trainer.max_steps
        assert cfg.trainer.val_check_interval == cfg.recall_val_every
        assert cfg.task.data.num_train >= cfg.trainer.max_steps * cfg.task.batch_size  # no example seen twice
    assert mqar.callbacks.early_stopping.patience_from == mqar.trainer.max_steps == 4000
    assert needle.callbacks.early_stopping.patience_from == needle.trainer.min_steps == 1500
    assert mqar.task.data.seed == 2 and mqar.optimizer.lr == mqar.recall_lr.rule
    assert (needle.task.seq_len, needle.task.num_needles, needle.task.placement) == (1024, 34, "scattered")
    searched = compose_config(["experiment=recall/mqar", "+recall_lr.full=0.01"], tmp_path, fast=False)
    assert searched.optimizer.lr == 0.01
    short_needle = compose_config(["experiment=recall/needle"], tmp_path, fast=False)
    for key in ("model", "optimizer", "scheduler", "recall_lr"):
        assert mqar[key] == short_needle[key]
    mqar_stop, needle_stop = (dict(c.callbacks.early_stopping) for c in (mqar, short_needle))
    assert mqar_stop["patience_from"] != needle_stop["patience_from"]
    assert {**mqar_stop, "patience_from": None} == {**needle_stop, "patience_from": None}


def test_early_stopping_ends_a_run_at_its_threshold_not_at_the_cap(make_cfg, tmp_path):
    """A threshold every accuracy exceeds stops the run at its first validation at min_steps (not before: the rule
    judges from min_steps on; not at the cap: the whole run is one epoch, and Lightning's default min_epochs=1 would
    keep it going, hence trainer.min_epochs=0)."""
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

SEARCH = {"experiment": "recall/mqar_scattered", "only": "task.num_pairs=8", "search": [3e-4, 1e-3, 3e-3]}


def test_a_searched_stage_runs_every_rate_on_seed_1_and_the_rest_at_the_chosen_one(tmp_path):
    """Seed 1 of every arm but the controls that repeat full at each searched rate; the other seeds (and those
    controls) wait for the table; directory names carry the rate and no slash."""
    stage = study.stage_jobs(SEARCH, tmp_path, PLAN["one_seed"], PLAN["lr_from"])
    searched = STUDY_ARMS - set(PLAN["lr_from"])
    rates = ("3e-4", "1e-3", "3e-3")
    assert {(j.arm, j.lr) for j in stage.jobs if j.search} == {(a, r) for a in searched for r in rates}
    assert all(j.seed == 1 for j in stage.jobs if j.search)
    rest = [j for j in stage.jobs if not j.search]
    assert all(j.lr is None and j.status() == study.WAITING and j.directory is None for j in rest)
    assert sorted((j.arm, j.seed) for j in rest if j.arm in PLAN["lr_from"]) == [
        ("local_long", 1), ("local_short", 1), ("local_short", 2), ("local_short", 3)]
    assert len(rest) == 2 * len(searched) + 4 and {j.values["task.num_pairs"] for j in stage.jobs} == {"8"}
    names = [j.name for j in stage.jobs if j.search]
    assert len(set(names)) == len(names) and all("/" not in n and ",lr=" in n for n in names)
    ordered = study.control_first(rest, [*PLAN["controls"]["positive"], PLAN["controls"]["short"]])
    assert [(j.arm, j.seed) for j in ordered[:4]] == [("local_long", 1), ("local_short", 1), ("full", 2),
                                                      ("local_short", 2)]  # seed 1's full is a search job
    assert [j.seed for j in ordered] == sorted(j.seed for j in ordered)


def record(job: study.Job, status: str, acc: float | None = None, loss: float | None = None,
           error: str | None = None) -> None:
    job.directory.mkdir(parents=True)
    metrics = {} if acc is None else {"val/acc_best": acc, "val/loss": loss}
    (job.directory / "metrics.json").write_text(json.dumps({"status": status, "metrics": metrics, "error": error}))


KEYS = ["task.seq_len", "task.num_pairs"]


def test_the_rate_of_an_arm_and_setting_is_its_best_search_run(tmp_path):
    """The best val/acc_best; rates within the tolerance tie, the lower val/loss wins; an arm's rate is chosen only
    once its search has ended (a failed job is an end, a stopped one is run again); the chosen run is the seed-1 result
    and the other seeds (and full's controls) take its rate."""
    stage = study.stage_jobs(SEARCH, tmp_path, PLAN["one_seed"], PLAN["lr_from"])
    by = {(j.arm, j.lr): j for j in stage.jobs if j.search}
    record(by["full", "3e-4"], "completed", 0.990, 0.05)
    record(by["full", "1e-3"], "completed", 0.993, 0.03)  # within 0.005 of the best: the lowest loss wins
    record(by["full", "3e-3"], "completed", 0.994, 0.04)
    record(by["fixed", "3e-4"], "failed", error="ValueError: diverged")
    record(by["fixed", "1e-3"], "failed", error="SystemExit: 1")  # Ctrl-C during fit: run again, not an end
    record(by["fixed", "3e-3"], "completed", 0.20, 3.0)
    table = study.rate_table([stage], KEYS, PLAN["lr_tolerance"])
    setting = ("256", "8")
    assert table[("full", setting)]["lr"] == "1e-3" and ("fixed", setting) not in table
    assert [by["fixed", lr].status() for lr in ("3e-4", "1e-3", "3e-3")] == ["failed", "stopped", "completed"]
    by["fixed", "1e-3"].directory.joinpath("metrics.json").unlink()
    record_dir = by["fixed", "1e-3"].directory
    record_dir.rmdir()
    record(by["fixed", "1e-3"], "completed", 0.12, 3.5)
    table = study.rate_table([stage], KEYS, PLAN["lr_tolerance"])
    assert table[("fixed", setting)]["lr"] == "3e-3" and table[("fixed", setting)]["results"]["1e-3"] == [0.12, 3.5]
    assert study.pick_rate({"1e-3": (0.5, 1.0), "3e-3": (0.9, 2.0)}, 0.0) == "3e-3"
    study.assign_rates([stage], table, KEYS, PLAN["lr_from"], [])
    rates = {(j.arm, j.seed): j.lr for j in stage.jobs if not j.search}
    assert rates["full", 2] == "1e-3" and rates["local_short", 3] == "1e-3" and rates["fixed", 2] == "3e-3"
    assert rates["combiner_mixture", 2] is None  # its search has not run
    reported = study.reported_jobs([stage], table, KEYS)
    assert by["full", "1e-3"] in reported and by["full", "3e-3"] not in reported
    study.write_rate_table(tmp_path / study.LR_TABLE, table, KEYS)
    keys, rows = study.read_rate_table(tmp_path / study.LR_TABLE)
    assert keys == KEYS and {(r["arm"], r["lr"]) for r in rows} == {("full", "1e-3"), ("fixed", "3e-3")}


def test_a_stage_without_a_search_takes_the_table_of_its_setting(tmp_path):
    """The start-placement stage takes the scattered search's rates of the same L and D; the needle takes MQAR's
    of the same L from another task's table file."""
    table = {("full", ("256", "8")): {"lr": "1e-3"}, ("full", ("1024", "16")): {"lr": "3e-4"}}
    start = study.stage_jobs({"experiment": "recall/mqar", "only": "task.num_pairs=8,full,local_short"}, tmp_path,
                             PLAN["one_seed"], PLAN["lr_from"])
    study.assign_rates([start], table, KEYS, PLAN["lr_from"], [])
    assert {j.lr for j in start.jobs} == {"1e-3"} and len(start.jobs) == 6
    path = tmp_path / "mqar_table.yaml"
    study.write_rate_table(path, table, KEYS)
    needle = study.stage_jobs({"experiment": "recall/needle_long", "only": "full,local_long"}, tmp_path,
                              PLAN["one_seed"], PLAN["lr_from"])
    study.assign_rates([needle], {}, ["task.seq_len"], PLAN["lr_from"], [study.read_rate_table(path)])
    assert {j.lr for j in needle.jobs} == {"3e-4"} and len(needle.jobs) == 4  # local_long: one seed


def test_status_counts_and_the_gate_on_full(tmp_path, capsys):
    """--status counts completed / failed / waiting jobs and names the failed; a setting where full reached the
    pass mark at none of its rates is not trained further."""
    stage = study.stage_jobs(SEARCH, tmp_path, PLAN["one_seed"], PLAN["lr_from"])
    full = [j for j in stage.jobs if j.search and j.arm == "full"]
    for job, acc in zip(full, (0.3, 0.5, 0.6)):
        record(job, "completed", acc, 1.0)
    assert study.full_failed_search(stage.jobs, "full", PLAN["controls"]["pass"])
    record([j for j in stage.jobs if j.search and j.arm == "nsa"][0], "failed", error="ValueError: x")
    assert study.print_status([stage]) == len(stage.jobs) - 3
    out = capsys.readouterr().out
    assert "failed: " in out and f"{sum(not j.search for j in stage.jobs)} {study.WAITING}" in out
    fresh = study.stage_jobs(SEARCH, tmp_path / "other", PLAN["one_seed"], PLAN["lr_from"])
    assert not study.full_failed_search(fresh.jobs, "full", PLAN["controls"]["pass"])  # not run yet: no verdict


def test_only_selects_arms_and_swept_settings(tmp_path):
    jobs = study.stage_jobs("recall/needle", tmp_path).jobs
    kept = [j for j in jobs if study.selected(j, "full,local_short,task.seq_len=256,seed=1")]
    assert {(j.arm, j.values["task.seq_len"], j.values["seed"]) for j in kept} == {
        ("full", "256", "1"), ("local_short", "256", "1")}
    lr_jobs = study.stage_jobs("recall/mqar_lr", tmp_path).jobs
    assert {j.lr for j in lr_jobs} == {"3e-4", "1e-3", "3e-3", "1e-2"}  # a stage that sweeps the rate itself


def test_the_budget_stops_new_jobs_and_adds_up_across_runs_of_the_driver(tmp_path):
    spent = study.Budget(tmp_path, hours=1.0)
    spent.before = 3600.0  # as if an hour had gone by in earlier runs
    spent.save()
    again = study.Budget(tmp_path, hours=1.0)
    assert again.spent_s() >= 3600.0 and again.left_s() <= 0
    job = next(j for j in study.stage_jobs(SEARCH, tmp_path).jobs if j.search)
    assert study.run_job(job, 1, tmp_path / "console", [], again) == "over budget" and not job.directory.exists()


def test_the_plan_prints_every_stage_and_says_when_it_exceeds_its_budget(capsys, tmp_path):
    """The stages run at the plan's estimates (each at least its jobs' start-up); the cut stages are listed with their
    reasons and estimates; the searched stages show their search jobs. Under a budget the stages run exceed, the plan
    says so with the factor; under one they fit, it says nothing of it."""
    stages = study.task_stages("mqar", tmp_path, PLAN)
    run, cut = study.print_plan("mqar", stages, PLAN)
    out = capsys.readouterr().out
    assert run > 0 and cut > 0
    kept = [s for s in stages if not s.cut]
    floor = sum(len(s.jobs) for s in kept) * PLAN["estimate"]["startup_s"] / 3600 / PLAN["jobs"]
    assert run > floor
    assert f"about {run:.2f} h at {PLAN['jobs']} at a time" in out and "cut: " in out
    for stage in stages:
        assert stage.experiment in out
    assert [s.experiment for s in kept] == ["recall/mqar_scattered"]
    assert all(s.search for s in kept) and len({j.arm for s in kept for j in s.jobs}) == len(STUDY_ARMS)

    def with_budget(hours: float) -> str:
        plan = dict(PLAN, tasks={**PLAN["tasks"], "mqar": dict(PLAN["tasks"]["mqar"], budget_hours=hours)})
        study.print_plan("mqar", stages, plan)
        return capsys.readouterr().out

    assert f"over budget: the stages run need about {run:.2f} h, 2.0 times the {run / 2} h" in with_budget(run / 2)
    assert "over budget" not in with_budget(2 * run)


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
    assert "local_short (window 4, 0.56 of the questions inside): inside 0.970 ≥ 0.9" in controls
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


def test_seeds_that_disagree_are_shown_one_by_one_with_median_and_range(tmp_path):
    """linear at L = 1,024 in issue 33 (0.083, 0.831, 0.007): no t interval over a split set."""
    trained_setting(tmp_path)
    for seed, acc in ((1, 0.083), (2, 0.831), (3, 0.007)):
        fake_run(tmp_path, "linear", seed, acc)
    runs = load(tmp_path)
    table = rr.main_table(runs, PLAN["controls"], "distance", ["full", "linear"], disagree=PLAN["seeds_disagree"])
    assert ("| linear | median 0.083, range 0.007–0.831 (seeds disagree; seed 1: 0.083, seed 2: 0.831, seed 3: "
            "0.007) |") in table
    assert "| full | 0.988 ± " in table  # seeds that agree keep their interval


def test_the_structural_column_sits_beside_the_accuracy_and_the_earlier_study_beside_this_one(tmp_path):
    """Each setting's accuracy column is followed by its alone / direct column; runs of an earlier study (its folders,
    `beside`) are read as their own columns, labelled with its recipe and the placement they ran (start)."""
    trained_setting(tmp_path / "new", L=64, D=4)
    trained_setting(tmp_path / "old" / "mqar", L=64, D=4)
    settings = ["task.seq_len", "task.num_pairs", "task.placement"]
    runs = rr.StudyRuns.from_directories(sorted((tmp_path / "new").iterdir()), settings, [tmp_path / "old" / "mqar"])
    assert set(runs.frame[rr.RECIPE]) == {"", rr.BESIDE} and set(runs.frame["task.placement"]) == {"start"}
    structures = {("combiner_fixed", s): ("0.00 / 0.00" if s[-1] else "1.00 / 0.00") for s in runs.groups()}
    table = rr.main_table(runs, PLAN["controls"], "distance", ["full", "combiner_fixed"], structures)
    header = table.splitlines()[0]
    assert header == ("| arm | L = 64, D = 4, start | alone / direct | L = 64, D = 4, start, issue 33's recipe | "
                      "alone / direct |")
    assert "| combiner_fixed | 0.220 ± " in table and " | 1.00 / 0.00 | 0.220 ± " in table
    assert table.count("| guessing floor | 0.250 |  | 0.250 |") == 1


def test_the_rate_table_and_the_post_hoc_changes_are_reported(tmp_path):
    table = {("full", ("256", "8")): {"lr": "1e-3", "results": {"3e-4": [0.98, 0.1], "1e-3": [0.99, 0.05]}},
             ("nsa", ("1024", "16")): {"lr": "3e-4", "results": {"3e-4": [0.7, 1.0]}}}
    text = rr.rate_search_table(table, KEYS, ["full", "nsa"])
    assert text.splitlines()[0] == "| arm | L = 256, D = 8 | L = 1024, D = 16 |"
    assert "| full | 3e-4: 0.980, **1e-3: 0.990** |  |" in text and "| nsa |  | **3e-4: 0.700** |" in text
    assert "None recorded" in rr.post_hoc_section([])
    assert rr.post_hoc_section(["a", "b"]) == "1. a\n2. b"


def test_the_report_of_a_study_holds_every_section(tmp_path, monkeypatch):
    trained_setting(tmp_path / "runs", L=64, D=4)
    runs = load(tmp_path / "runs")
    monkeypatch.setattr(rr, "structure_cells", lambda study, cache=None: {})
    plan = dict(PLAN, post_hoc_changes={"mqar": ["the short control's window rule changed after seed 1 (runs ...)"]})
    rr.write_study_report("mqar", tmp_path, runs, plan, ["full", "combiner_fixed"], {}, ["task.seq_len",
                                                                                         "task.num_pairs"], [], None)
    report = (tmp_path / "report.md").read_text()
    for section in ("## L = 64, D = 4", "## Where the answers come from", "## Steps trained",
                    "## Learning rate per arm and setting", "## Changes made after jobs had run",
                    "1. the short control's window rule changed"):
        assert section in report
    assert {p.name for p in tmp_path.iterdir()} >= {"accuracy.csv", "curves.csv", "by_distance.csv", "accuracy.png"}


def test_time_steps_measures_each_arm_training_and_prints_the_plans_table(tmp_path, capsys, monkeypatch):
    """--time-steps builds every arm it is asked for at its stage's setting (the command's overrides on top), times
    its training steps, leaves the process's thread count as it was and prints plan.yaml's step_s rows."""
    import torch

    from longseq.report import recall_steps

    timed, real = [], recall_steps.step_seconds

    def spy(config, steps=20, warmup=5):
        threads = torch.get_num_threads()
        seconds = real(config, steps=2, warmup=1)
        timed.append((config.recall_arm, config.task.seq_len, seconds, torch.get_num_threads() == threads))
        return seconds

    monkeypatch.setattr(recall_steps, "step_seconds", spy)
    tiny = ["task.seq_len=64", "task.num_pairs=4", "task.vocab_size=128", "model.d_model=16"]
    assert study.main(["mqar", "--root", str(tmp_path), "--time-steps", "--only", "full,combiner_fixed,task.num_pairs=8",
                       *tiny]) == 0
    assert [(arm, length) for arm, length, _, _ in timed] == [("full", 64), ("combiner_fixed", 64)]
    assert all(seconds > 0 and kept for _, _, seconds, kept in timed)
    assert capsys.readouterr().out.endswith(
        f"step_s:\n  64: {{full: {round(timed[0][2], 3)}, combiner_fixed: {round(timed[1][2], 3)}}}\n")


@pytest.mark.slow
def test_the_driver_runs_a_tiny_study_end_to_end_and_resumes(tmp_path, capsys):
    """full's search (three rates of 6 steps) through train.py: full learns nothing in 6 steps, so the setting's
    controls are not run (the gate); the rate table, the report with its tables, structural column and figures; a
    second run of the driver runs nothing again."""
    args = ["mqar", "--root", str(tmp_path), "--only", "full,local_long,local_short,seed=1,task.num_pairs=8",
            "trainer.max_steps=6", "trainer.min_steps=2", "recall_val_every=3", "task.data.num_val=16",
            "task.data.num_test=16", "--figures", str(tmp_path / "docs")]
    assert study.main(args) == 0
    assert "full reached 0.95 at none of its searched rates; the setting's other jobs are skipped" in \
        capsys.readouterr().out
    report = (tmp_path / "report.md").read_text()
    assert "guessing floor" in report and "| controls | FAIL: " in report and "**" in report  # the chosen rate
    assert "alone / direct" in report and "NA / 1.00" in report  # full: no regions, every key direct
    assert {p.name for p in (tmp_path / "docs").iterdir()} == {
        "recall_mqar_accuracy.png", "recall_mqar_by_distance.png", "recall_mqar_curves.png"}
    keys, rows = study.read_rate_table(tmp_path / study.LR_TABLE)
    assert [r["arm"] for r in rows] == ["full"] and len(rows[0]["results"]) == 3
    seconds = (tmp_path / "mqar_scattered" / study.JOB_SECONDS).read_text().splitlines()
    assert len(seconds) == 3 and not list((tmp_path / "mqar_scattered").glob("arm=local_*"))
    assert study.main(args) == 0  # resumed: nothing left to run
    assert (tmp_path / "mqar_scattered" / study.JOB_SECONDS).read_text().splitlines() == seconds


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
