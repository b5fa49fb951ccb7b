"""``python -m longseq.report.recall_study mqar|needle`` — run the recall study job by job, resumably, within its
wall-time budget, then write its tables and figures.

The plan is ``conf/recall/plan.yaml``: the stages of each task (experiments whose ``hydra.sweeper.params`` are the
jobs: the one home of the sweep, the same configs ``python train.py -m experiment=recall/<name>`` runs as a plain
multirun), the controls every setting must pass, the learning-rate rule and the budget:

- ``mqar``: ``recall/mqar_lr`` (the headline arms at four rates, trained to the final budget), then ``recall/mqar``
  (L = 256) and ``recall/mqar_long`` (L = 1,024), each job with its arm's searched rate (the rule's rate for the arms
  not searched);
- ``needle``: ``recall/needle``, with the MQAR search's rates (``lr_table.yaml``) when it exists.

Each job is one ``train.py`` run in ``<root>/<stage>/<job name>`` (``hydra.run.dir``), so a stopped study goes
on where it stopped: a job whose ``metrics.json`` says ``completed`` is skipped, a job that never finished (no
``metrics.json``, interrupted, or stopped by Ctrl-C) is removed and run again, and a job that failed on its own
is left as it is (``--retry-failed`` runs it again). Jobs run in priority order (the search; then per stage seed 1
of every setting before seeds 2 and 3, the controls of a setting before its other arms), and none starts once the
task's ``budget_hours`` of driver wall time (``<root>/budget.json``, summed over the driver's runs) are spent:
a study cut short keeps what it finished. ``--plan`` lists the jobs and the budget estimate, ``--status`` what is
done / failed / left and the time spent, ``--jobs 2`` runs two jobs at a time with ``cores / jobs`` threads each.

At the end (and with ``--report`` alone) ``longseq.report.recall_report`` writes ``<root>/report.md`` (the table
with the guessing floor and the controls of every setting, where the answers come from, the learning-rate search
and the rule), ``accuracy.csv``, ``by_<breakdown>.csv``, ``curves.csv`` and the figures ``accuracy.png``,
``by_<breakdown>.png``, ``curves.png`` (``--figures DIR`` copies them, prefixed ``recall_<task>_``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from longseq.report.outcome import COMPLETED, FAILED, METRICS_FILE

PROJECT_ROOT = Path(__file__).resolve().parents[3]  # train.py and conf/ live here
PLAN_FILE = PROJECT_ROOT / "conf" / "recall" / "plan.yaml"
ARM_GROUP = "recall/arm"
LR_KEY = "optimizer.lr"
JOB_SECONDS = "job_seconds.tsv"  # per stage folder: job name, wall seconds, status (one line per run of the job)
# Errors that mean "stopped from outside", not "this configuration fails": such a job is run again. Lightning
# turns Ctrl-C during fit into sys.exit(1) ("SystemExit: 1"); SIGTERM is "SystemExit: 143" (status interrupted).
STOPPED = ("KeyboardInterrupt", "SystemExit: 1", "SystemExit: 130", "SystemExit: 143")


def load_plan(path: Path = PLAN_FILE) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


@dataclass
class Job:
    stage: str
    overrides: list[str]
    directory: Path
    extra: list[str] = field(default_factory=list)  # overrides decided at run time (the searched lr)

    @property
    def name(self) -> str:
        return self.directory.name

    @property
    def values(self) -> dict[str, str]:
        return dict(o.split("=", 1) for o in self.overrides)

    @property
    def arm(self) -> str:
        return self.values.get(ARM_GROUP, "")

    def status(self) -> str:
        """``completed``, ``failed``, ``stopped`` (interrupted from outside), ``unfinished`` or ``not started``."""
        outcome = self.directory / METRICS_FILE
        if not outcome.is_file():
            return "unfinished" if self.directory.exists() else "not started"
        try:
            record = json.loads(outcome.read_text())
        except json.JSONDecodeError:
            return "unfinished"
        status, error = record.get("status", COMPLETED), str(record.get("error") or "")
        if status == FAILED and not (error.startswith("KeyboardInterrupt") or error in STOPPED):
            return FAILED
        return COMPLETED if status == COMPLETED else "stopped"

    def metrics(self) -> dict:
        return json.loads((self.directory / METRICS_FILE).read_text()).get("metrics", {})


def compose_stage(experiment: str, overrides: list[str] = ()):
    """The composed config of ``experiment=<experiment>`` (with Hydra's own node: its sweep parameters)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from longseq.utils.config import register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(PROJECT_ROOT / "conf")):
            return compose(config_name="train", overrides=[f"experiment={experiment}", *overrides],
                           return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def sweep_params(experiment: str) -> dict[str, list[str]]:
    """``hydra.sweeper.params`` of ``experiment=<experiment>``, each as its list of values."""
    cfg = compose_stage(experiment)
    return {str(k): [v.strip() for v in str(v).split(",")] for k, v in cfg.hydra.sweeper.params.items()}


def job_name(pairs: list[tuple[str, str]]) -> str:
    return ",".join(f"{k.replace(ARM_GROUP, 'arm')}={v}" for k, v in pairs)  # no '/' in a directory name


def priority(job: Job, arms: list[str], controls: list[str]) -> tuple:
    """Seed first, then the setting, then the controls before the other arms (in the sweep's order)."""
    values = job.values
    setting = tuple(v for k, v in values.items() if k not in (ARM_GROUP, "seed"))
    arm = job.arm
    return (int(values.get("seed", 0)), setting, (0, controls.index(arm)) if arm in controls else (1, arms.index(arm)))


def stage_jobs(stage: str, root: Path, controls: list[str] = (), one_seed: list[str] = ()) -> list[Job]:
    """The jobs of one stage: the product of its sweep parameters, in priority order; the arms of ``one_seed`` at
    the stage's first seed only."""
    params = sweep_params(stage)
    keys = list(params)
    first_seed = params.get("seed", [None])[0]
    jobs = []
    for values in itertools.product(*(params[k] for k in keys)):
        pairs = list(zip(keys, values))
        job = Job(stage, [f"{k}={v}" for k, v in pairs], root / stage.split("/")[-1] / job_name(pairs))
        if job.arm in one_seed and job.values.get("seed", first_seed) != first_seed:
            continue
        jobs.append(job)
    arms = params.get(ARM_GROUP, [])
    return sorted(jobs, key=lambda j: priority(j, arms, list(controls))) if arms else jobs


# ----------------------------------------------------------------------------------------------------
# Learning rates


def search_results(jobs: list[Job]) -> dict[str, dict[float, tuple[float, float]]]:
    """Per arm and searched rate: (val/acc_best, val/loss) of the completed search jobs."""
    found: dict[str, dict[float, tuple[float, float]]] = {}
    for job in jobs:
        if job.status() != COMPLETED:
            continue
        metrics = job.metrics()
        acc, loss = float(metrics.get("val/acc_best", math.nan)), float(metrics.get("val/loss", math.inf))
        if not math.isnan(acc):
            found.setdefault(job.arm, {})[float(job.values[LR_KEY])] = (acc, loss)
    return found


def pick_lrs(jobs: list[Job], rule: float, tolerance: float) -> dict[str, float]:
    """Per arm, the rule's rate where its ``val/acc_best`` is within ``tolerance`` of the arm's best (the search cannot
    tell them apart), else the searched lr with the best ``val/acc_best`` (ties: the lower ``val/loss``).

    Why the rule wins a tie: the search runs at L = 256 only. `full` took 1e-2 there by 0.001 (0.993 against 0.992
    at 3e-3), and at L = 1,024 that rate left it below the guessing floor for all 1,200 steps (validation accuracy
    0.001 to 0.002), where 3e-3 had learned the same setting by step 800 in the pilot."""
    table = {}
    for arm, rates in search_results(jobs).items():
        best = max(rates, key=lambda lr: (rates[lr][0], -rates[lr][1]))
        at_rule = rates.get(rule, (math.nan, math.nan))[0]
        table[arm] = rule if rates[best][0] - at_rule <= tolerance else best
    return table


def search_rule(jobs: list[Job]) -> float:
    """The rate the unsearched arms use (``recall_lr.rule`` of conf/recall/study.yaml, as the search stage composes)."""
    return float(compose_stage(jobs[0].stage).recall_lr.rule)


def rule_verdict(jobs: list[Job], rule: float, tolerance: float) -> tuple[bool, list[str]]:
    """Whether the rule's rate is within ``tolerance`` (val/acc_best) of every searched arm's best, line per arm."""
    holds, lines = True, []
    for arm, rates in search_results(jobs).items():
        best = max(acc for acc, _ in rates.values())
        at_rule = rates.get(rule, (math.nan, math.nan))[0]
        ok = not math.isnan(at_rule) and best - at_rule <= tolerance
        holds &= ok
        verdict = "" if ok else " (does not hold)"
        lines.append(f"{arm}: best {best:.3f}, at the rule's {rule:g} {at_rule:.3f}{verdict}")
    return holds and bool(lines), lines


def lr_table_for(task: str, root: Path, stages: dict[str, list[Job]], plan: dict) -> dict[str, float]:
    """The searched learning rates: this study's search (MQAR: written to ``<root>/lr_table.yaml``), or the MQAR
    study's table (needle; empty when it does not exist: the jobs then use ``conf/recall/study.yaml``'s rates)."""
    search = plan["tasks"][task].get("lr_search")
    if search in stages:
        table = pick_lrs(stages[search], search_rule(stages[search]), plan["lr_rule_tolerance"])
        if table:
            (root / "lr_table.yaml").write_text(
                f"# per-arm lr chosen by recall/mqar_lr (the rule's rate within {plan['lr_rule_tolerance']} of the "
                "best val/acc_best, else the best; ties: lower val/loss); paste into\n"
                "# recall_lr in conf/recall/study.yaml so that plain -m runs use it too\n"
                + yaml.safe_dump({"recall_lr": table}, sort_keys=False))
        return table
    path = PROJECT_ROOT / plan["tasks"][task].get("lr_table", "")
    if path.is_file() and path.suffix == ".yaml":
        return dict(yaml.safe_load(path.read_text())["recall_lr"])
    return {}


# ----------------------------------------------------------------------------------------------------
# Running, within the budget


LIVE_JOBS: set[subprocess.Popen] = set()


def stop_jobs(signum: int, frame: Any) -> None:
    """SIGTERM to the driver stops its running jobs too (each saves interrupted.ckpt and is run again next time);
    a job left running would write into a directory the next driver removes."""
    for process in list(LIVE_JOBS):
        process.terminate()
    raise SystemExit(128 + signum)


class Budget:
    """Driver wall time spent on a study, kept in ``<root>/budget.json`` across runs of the driver."""

    def __init__(self, root: Path, hours: float) -> None:
        self.path, self.limit_s = root / "budget.json", hours * 3600.0
        self.before = json.loads(self.path.read_text())["spent_s"] if self.path.is_file() else 0.0
        self.started = time.time()

    def spent_s(self) -> float:
        return self.before + time.time() - self.started

    def left_s(self) -> float:
        return self.limit_s - self.spent_s()

    def save(self) -> None:
        self.path.write_text(json.dumps({"spent_s": round(self.spent_s(), 1), "limit_s": self.limit_s}) + "\n")


def run_job(job: Job, threads: int, log_dir: Path, overrides: list[str], budget: Budget) -> str:
    """Run one job as ``train.py`` in its own directory (a leftover of an unfinished attempt is removed first)."""
    if budget.left_s() <= 0:
        return "over budget"
    if job.directory.exists():
        shutil.rmtree(job.directory)
    log_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "train.py", f"experiment={job.stage}", *job.overrides, *job.extra, *overrides,
               f"hydra.run.dir='{job.directory}'"]  # quoted: the job's name holds ',' and '='
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    start = time.time()
    with open(log_dir / f"{job.name}.txt", "w") as out:
        out.write(" ".join(command) + "\n")
        out.flush()
        process = subprocess.Popen(command, cwd=PROJECT_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        LIVE_JOBS.add(process)
        code = process.wait()
        LIVE_JOBS.discard(process)
    status = job.status() if code == 0 or job.directory.exists() else FAILED
    seconds = time.time() - start
    with open(job.directory.parent / JOB_SECONDS, "a") as times:  # the measured cost, for --status
        times.write(f"{job.name}\t{seconds:.1f}\t{status}\n")
    budget.save()
    print(f"[{time.strftime('%H:%M:%S')}] {job.stage} {job.name}: {status} ({seconds:.0f} s; "
          f"{budget.spent_s() / 3600:.2f} h of {budget.limit_s / 3600:g} h spent)", flush=True)
    return status


def run_stage(jobs: list[Job], n_parallel: int, retry_failed: bool, log_dir: Path, overrides: list[str],
              budget: Budget) -> None:
    todo = [j for j in jobs if j.status() != COMPLETED and (retry_failed or j.status() != FAILED)]
    if not todo:
        return
    threads = max(1, (os.cpu_count() or 1) // n_parallel)
    print(f"{jobs[0].stage}: {len(todo)} of {len(jobs)} job(s) to run, {n_parallel} at a time", flush=True)
    with ThreadPoolExecutor(max_workers=n_parallel) as pool:
        list(pool.map(lambda j: run_job(j, threads, log_dir, overrides, budget), todo))


def measured_seconds(stage_dir: Path) -> dict[str, float]:
    """Job name -> wall seconds of its last run, from ``<stage>/job_seconds.tsv``."""
    path = stage_dir / JOB_SECONDS
    if not path.is_file():
        return {}
    return {name: float(seconds) for name, seconds, *_ in (line.split("\t") for line in path.read_text().splitlines())}


def print_status(stages: dict[str, list[Job]], budget: Budget | None = None) -> int:
    """One line per stage: how many jobs are completed / failed / left and their measured wall time; the failed ones
    by name. Returns the number of jobs not completed."""
    left = 0
    for stage, jobs in stages.items():
        counts: dict[str, int] = {}
        for job in jobs:
            counts[job.status()] = counts.get(job.status(), 0) + 1
        left += len(jobs) - counts.get(COMPLETED, 0)
        seconds = measured_seconds(jobs[0].directory.parent) if jobs else {}
        took = [seconds[j.name] for j in jobs if j.name in seconds and j.status() == COMPLETED]
        median = sorted(took)[len(took) // 2] if took else 0.0
        timing = f"; {sum(took) / 3600:.2f} job-hours, median {median:.0f} s a job" if took else ""
        print(f"{stage}: {len(jobs)} jobs: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + timing)
        for job in jobs:
            if job.status() == FAILED:
                print(f"  failed: {job.directory}")
    if budget is not None:
        print(f"budget: {budget.spent_s() / 3600:.2f} h of {budget.limit_s / 3600:g} h spent")
    return left


def print_plan(task: str, stages: dict[str, list[Job]], plan: dict) -> float:
    """The jobs of every stage and the wall time they need at ``plan.yaml``'s per-job estimates (measured in the
    pilot) with ``jobs`` running at a time. Returns the estimated hours."""
    estimate = {int(length): costs for length, costs in plan["tasks"][task].get("job_seconds", {}).items()}
    total = 0.0
    for stage, jobs in stages.items():
        stage_length = int(compose_stage(stage).task.seq_len)
        seconds = 0.0
        for job in jobs:
            costs = estimate.get(int(job.values.get("task.seq_len", stage_length)), {})
            seconds += float(costs.get(job.arm, costs.get("default", math.nan)))
        hours = seconds / 3600 / plan["jobs"]
        total += hours
        print(f"{stage}: {len(jobs)} jobs, about {hours:.2f} h at {plan['jobs']} at a time")
    limit = plan["tasks"][task]["budget_hours"]
    print(f"{task}: about {total:.2f} h in all; the driver stops starting jobs after {limit} h")
    return total


# ----------------------------------------------------------------------------------------------------
# Report


def write_report(task: str, root: Path, stages: dict[str, list[Job]], plan: dict, figures: Path | None) -> None:
    from longseq.report import recall_report as rr
    from longseq.report.runs import load_run

    spec = plan["tasks"][task]
    search = spec.get("lr_search")
    main = [job for stage, jobs in stages.items() if stage != search for job in jobs]
    runs = [load_run(job.directory) for job in main if job.directory.exists()]
    study = rr.StudyRuns.load(runs, spec["settings"])
    if study.frame.empty:
        print("no job has completed yet: nothing to report")
        return
    arms = list(dict.fromkeys(job.arm for job in main))
    kind = spec["breakdown"]
    sections = [f"# Recall study: {task}\n",
                "Test accuracy, mean ± half-width of the 95 % t interval (seeds); the guessing floor and the controls "
                "of every setting (conf/recall/plan.yaml) below the arms; a setting whose controls fail is not "
                "trained.\n",
                rr.main_table(study, plan["controls"], kind, arms),
                "\n## Where the answers come from\n",
                "Share of answers that are one of the example's candidates / accuracy among those (means over "
                "seeds).\n",
                rr.answers_table(study, arms),
                "\n## Steps trained\n",
                "Mean over seeds: where early stopping (or the cap, conf/recall/study.yaml) ended the runs.\n",
                rr.steps_table(study, arms)]
    if search in stages:
        sections += ["\n## Learning-rate search\n", lr_search_table(stages[search], plan)]
    not_done = [job for job in main if job.status() != COMPLETED]
    if not_done:
        sections.append(f"\nNot completed: {len(not_done)} job(s) "
                        f"(python -m longseq.report.recall_study {task} --status).")
    (root / "report.md").write_text("\n".join(sections) + "\n")
    rr.summary(study).to_csv(root / "accuracy.csv", index=False)
    breakdown, curves = rr.breakdown_frame(study, kind), rr.curves_frame(study)
    breakdown.to_csv(root / f"by_{kind}.csv", index=False)
    curves.to_csv(root / "curves.csv", index=False)
    untrained = rr.untrained_settings(study, plan["controls"], kind)
    drawn = [rr.draw_accuracy(study, root / "accuracy.png", untrained),
             rr.draw_breakdown(study, breakdown, kind, root / f"by_{kind}.png", untrained),
             rr.draw_curves(study, curves, root / "curves.png", untrained)]
    for path in filter(None, drawn):
        if figures is not None:
            figures.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, figures / f"recall_{task}_{path.name}")
    print(f"wrote {root / 'report.md'} and its CSV files and figures")


def lr_search_table(jobs: list[Job], plan: dict) -> str:
    """Markdown: val/acc_best per searched arm and rate, and whether the rule holds."""
    import pandas as pd

    from longseq.report.table import markdown_table

    results = search_results(jobs)
    if not results:
        return "(no search job has completed)"
    rates = sorted({lr for r in results.values() for lr in r})
    rows = [[arm, *(f"{results[arm][lr][0]:.3f}" if lr in results[arm] else "" for lr in rates)] for arm in results]
    rule = search_rule(jobs)
    holds, lines = rule_verdict(jobs, rule, plan["lr_rule_tolerance"])
    text = markdown_table(pd.DataFrame(rows, columns=["arm", *(f"lr {lr:g}" for lr in rates)]))
    verdict = "holds" if holds else "does not hold"
    return (text + f"\n\nThe rule (lr {rule:g} for every arm not searched) {verdict} within "
            f"{plan['lr_rule_tolerance']} of each searched arm's best: " + "; ".join(lines) + ".")


def hold_study_lock(root: Path):
    """Lock ``<root>/.study.lock`` for this process (the kernel releases it when the process ends); a second
    driver on the same study exits naming the folder, since it would remove the directories of live jobs."""
    import fcntl

    handle = open(root / ".study.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        raise SystemExit(f"error: {root}: another recall_study driver runs this study ({handle.read().strip()}); "
                         "wait for it, or use --status / --report") from None
    handle.truncate(0)
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


def selected(job: Job, only: str) -> bool:
    """Whether ``job`` is among ``--only``'s entries: a bare name is an arm, ``key=value`` any swept setting; a job
    is kept when, for every key the entries name that its stage sweeps, its value is one of those listed."""
    wanted: dict[str, set[str]] = {}
    for entry in (e.strip() for e in only.split(",") if e.strip()):
        key, value = entry.split("=", 1) if "=" in entry else (ARM_GROUP, entry)
        wanted.setdefault(key.strip(), set()).add(value.strip())
    values = job.values
    return all(values[key] in allowed for key, allowed in wanted.items() if key in values)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m longseq.report.recall_study",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=sorted(load_plan()["tasks"]))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides added to every job (smoke runs: "
                                                     "trainer.max_steps=5; use another --root for them)")
    parser.add_argument("--root", type=Path, help="study folder (default logs/recall_<task>/study)")
    parser.add_argument("--jobs", type=int, help="jobs at a time (default: plan.yaml's, 2 on the 2-core machine)")
    parser.add_argument("--plan", action="store_true", help="list the stages, their jobs and the budget; exit")
    parser.add_argument("--status", action="store_true", help="list done / failed / left and the time spent; exit")
    parser.add_argument("--report", action="store_true", help="only write the tables and figures of what is done")
    parser.add_argument("--retry-failed", action="store_true", help="run failed jobs again")
    parser.add_argument("--budget-hours", type=float, help="override the task's budget_hours of plan.yaml")
    parser.add_argument("--figures", type=Path, help="also copy the figures here (e.g. docs/)")
    parser.add_argument("--only", help="comma-separated arms and/or key=value settings to run, e.g. "
                                       "full,local_long or task.seq_len=256 (default: every job of the sweep)")
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = load_plan()
    spec = plan["tasks"][args.task]
    root = (args.root or PROJECT_ROOT / "logs" / f"recall_{args.task}" / "study").resolve()
    root.mkdir(parents=True, exist_ok=True)
    controls = [*plan["controls"]["positive"], plan["controls"]["short"]]
    stages = {stage: stage_jobs(stage, root, controls, plan.get("one_seed", [])) for stage in spec["stages"]}
    if args.only:
        stages = {s: [j for j in jobs if selected(j, args.only)] for s, jobs in stages.items()}
    budget = Budget(root, args.budget_hours if args.budget_hours is not None else spec["budget_hours"])
    if args.plan:
        print_plan(args.task, stages, plan)
        return 0
    if args.status:
        left = print_status(stages, budget)
        print(f"{left} job(s) left; run: python -m longseq.report.recall_study {args.task}")
        return 0
    if not args.report:
        lock = hold_study_lock(root)  # noqa: F841 - held until the process exits
        signal.signal(signal.SIGTERM, stop_jobs)
        for stage, jobs in stages.items():
            if stage != spec.get("lr_search"):
                table = lr_table_for(args.task, root, stages, plan)
                for job in jobs:
                    job.extra = [f"{LR_KEY}={table[job.arm]}"] if job.arm in table else []
            run_stage(jobs, args.jobs or plan["jobs"], args.retry_failed, root / "console" / stage.split("/")[-1],
                      args.overrides, budget)
        budget.save()
        print_status(stages, budget)
    write_report(args.task, root, stages, plan, args.figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
