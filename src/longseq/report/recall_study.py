"""``python -m longseq.report.recall_study mqar|mqar_more|needle`` — run the recall study job by job, resumably,
within its wall-time budget, then write its tables and figures.

The plan is ``conf/recall/plan.yaml``: per task its stages (experiments whose ``hydra.sweeper.params`` are the jobs:
the one home of the sweep, the same configs ``python train.py -m experiment=recall/<name>`` runs as a plain multirun,
narrowed by the stage's ``only``), the rates each stage searches, the controls every setting must pass and the budget.

**A learning rate per arm and setting.** In a stage with ``search: [r1, r2, r3]`` each arm's first seed of every
setting runs at every rate (the search jobs); the rate with the best ``val/acc_best`` (rates within
``lr_tolerance`` of it: the lower ``val/loss``) is that arm's rate in that setting, its search run is the arm's seed-1
result, and its other seeds run at that rate. The controls that repeat another arm's computation take that arm's rate
(``lr_from``: ``local_long`` and ``local_short`` take ``full``'s). A stage without a search takes its rates from the
table (``<root>/lr_table.yaml``, then the tables of ``lr_tables``: another task's) for the same setting
(``lr_keys``). A job's rate is part of its directory name, so a job is found again after a restart.

**Order and budget.** Stage by stage, setting by setting (so that the budget cuts the last settings, never a setting's
seeds or controls): the setting's search jobs (the controls' first), then its other jobs (controls first, then by
seed). A setting where ``full`` reached ``controls.pass`` at none of its searched rates is not trained further (its
other jobs are skipped: nothing there could be read). No job starts once the task's ``budget_hours`` of driver wall
time (``<root>/budget.json``, summed over the driver's runs) are spent: a study cut short keeps what it finished.

**Resuming.** Each job is one ``train.py`` run in its own directory (``hydra.run.dir``). A job whose ``metrics.json``
says ``completed`` is skipped; one that never finished (no ``metrics.json``, interrupted, or stopped by Ctrl-C) is
removed and run again; one that failed on its own is left as it is (``--retry-failed`` runs it again). A killed driver
(SIGTERM) stops its jobs, and the next run goes on where it stopped.

``--plan`` prints the jobs and the estimated wall time per stage and in all (``estimate`` of plan.yaml) and the tasks
cut to keep the budget; ``--status`` what is done / failed / left and the time spent; ``--structure`` the structural
column of every arm at every setting of the plan, at the setting's placement and at ``start`` (no training:
``longseq.report.recall_structure``); ``--time-steps`` the seconds per training step of every arm at every
length it runs (the table of plan.yaml's ``estimate.step_s``, ``longseq.report.recall_steps``). At the end (and with
``--report`` alone) ``longseq.report.recall_report`` writes ``<root>/report.md``, its CSV files and figures
(``--figures DIR`` copies the figures, prefixed ``recall_<task>_``).
"""

from __future__ import annotations

import argparse
import functools
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from longseq.report.outcome import COMPLETED, FAILED, METRICS_FILE

PROJECT_ROOT = Path(__file__).resolve().parents[3]  # train.py and conf/ live here
PLAN_FILE = PROJECT_ROOT / "conf" / "recall" / "plan.yaml"
ARM_GROUP = "recall/arm"
LR_KEY = "optimizer.lr"
LR_TABLE = "lr_table.yaml"
JOB_SECONDS = "job_seconds.tsv"  # per stage folder: job name, wall seconds, status (one line per run of the job)
WAITING = "waiting for its rate"  # a job whose rate the search has not decided yet
# Errors that mean "stopped from outside", not "this configuration fails": such a job is run again. Lightning
# turns Ctrl-C during fit into sys.exit(1) ("SystemExit: 1"); SIGTERM is "SystemExit: 143" (status interrupted).
STOPPED = ("KeyboardInterrupt", "SystemExit: 1", "SystemExit: 130", "SystemExit: 143")


def load_plan(path: Path = PLAN_FILE) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def short_name(experiment: str) -> str:
    return experiment.split("/")[-1]


def rate_text(lr: float | str) -> str:
    """One spelling per rate (``3e-3``, ``0.003`` and ``3.0e-03`` are one rate): ``<mantissa>e<exponent>``."""
    mantissa, exponent = f"{float(lr):e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


@dataclass
class Job:
    """One train.py run of a stage: its swept values (``pairs``: the arm, the setting keys, the seed) and its rate.

    ``lr`` is given for a search job and decided by the rate table for the others (None until then: no directory
    yet). The rate is part of the directory name, so the run is found again after a restart."""

    stage: str
    pairs: tuple[tuple[str, str], ...]
    folder: Path  # <root>/<stage's short name>
    lr: str | None = None
    search: bool = False

    @property
    def values(self) -> dict[str, str]:
        return dict(self.pairs)

    @property
    def arm(self) -> str:
        return self.values.get(ARM_GROUP, "")

    @property
    def seed(self) -> int:
        return int(self.values.get("seed", 0))

    @property
    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.pairs] + ([] if self.lr is None else [f"{LR_KEY}={self.lr}"])

    @property
    def name(self) -> str | None:
        if self.lr is None:
            return None
        return ",".join(f"{k.replace(ARM_GROUP, 'arm')}={v}" for k, v in self.pairs) + f",lr={self.lr}"  # no '/'

    @property
    def directory(self) -> Path | None:
        return None if self.lr is None else self.folder / self.name

    def setting(self, keys: list[str]) -> tuple[str, ...]:
        """The values of ``keys`` for this job: swept, else the stage's composed default."""
        values = self.values
        return tuple(values[k] if k in values else stage_default(self.stage, k) for k in keys)

    def status(self) -> str:
        """``completed``, ``failed``, ``stopped`` (interrupted from outside), ``unfinished``, ``not started`` or
        ``WAITING`` (no rate yet)."""
        if self.directory is None:
            return WAITING
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


@functools.cache
def sweep_params(experiment: str) -> dict[str, list[str]]:
    """``hydra.sweeper.params`` of ``experiment=<experiment>``, each as its list of values."""
    cfg = compose_stage(experiment)
    return {str(k): [v.strip() for v in str(v).split(",")] for k, v in cfg.hydra.sweeper.params.items()}


@functools.cache
def stage_default(experiment: str, key: str) -> str:
    """The value of ``key`` in the composed ``experiment`` (for setting keys the stage does not sweep)."""
    from omegaconf import OmegaConf

    return str(OmegaConf.select(compose_stage(experiment), key, default=""))


def selected(job: Job, only: str) -> bool:
    """Whether ``job`` is among ``only``'s entries: a bare name is an arm, ``key=value`` any swept setting; a job
    is kept when, for every key the entries name that its stage sweeps, its value is one of those listed."""
    wanted: dict[str, set[str]] = {}
    for entry in (e.strip() for e in only.split(",") if e.strip()):
        key, value = entry.split("=", 1) if "=" in entry else (ARM_GROUP, entry)
        wanted.setdefault(key.strip(), set()).add(value.strip())
    values = job.values
    return all(values[key] in allowed for key, allowed in wanted.items() if key in values)


@dataclass
class Stage:
    """One stage of a task's plan: an experiment, the subset of its sweep the plan runs (``only``), the rates its
    search tries (empty: rates from the table), its jobs, and why the budget cuts it (empty: it runs)."""

    experiment: str
    only: str
    search: list[str]
    jobs: list[Job]
    cut: str = ""  # why the budget leaves it out (plan.yaml); run only with --include-cut

    @property
    def name(self) -> str:
        return short_name(self.experiment)


def stage_jobs(spec: dict | str, root: Path, one_seed: list[str] = (), lr_from: dict[str, str] | None = None) -> Stage:
    """The jobs of one stage (``spec``: plan.yaml's ``{experiment, only, search}`` or an experiment name): the product
    of its sweep parameters narrowed by ``only``, the arms of ``one_seed`` at the first seed only; with a search, the
    first seed of every arm not in ``lr_from`` once per rate."""
    spec = {"experiment": spec} if isinstance(spec, str) else dict(spec)
    experiment, only = spec["experiment"], str(spec.get("only") or "")
    search = [rate_text(r) for r in spec.get("search") or []]
    params = sweep_params(experiment)
    keys = list(params)
    first_seed = params.get("seed", [None])[0]
    folder = root / short_name(experiment)
    jobs = []
    for values in itertools.product(*(params[k] for k in keys)):
        pairs = tuple(zip(keys, values))
        job = Job(experiment, pairs, folder)
        if only and not selected(job, only):
            continue
        if job.arm in one_seed and job.values.get("seed", first_seed) != first_seed:
            continue
        if search and job.arm not in (lr_from or {}) and job.values.get("seed", first_seed) == first_seed:
            jobs += [Job(experiment, pairs, folder, lr, search=True) for lr in search]
        else:
            fixed = job.values.get(LR_KEY)  # a stage that sweeps the rate itself (recall/mqar_lr)
            jobs.append(Job(experiment, tuple((k, v) for k, v in pairs if k != LR_KEY), folder,
                            None if fixed is None else rate_text(fixed)))
    return Stage(experiment, only, search, jobs, " ".join(str(spec.get("cut") or "").split()))


def task_stages(task: str, root: Path, plan: dict) -> list[Stage]:
    spec = plan["tasks"][task]
    return [stage_jobs(s, root, plan.get("one_seed", []), plan.get("lr_from", {})) for s in spec["stages"]]


# ----------------------------------------------------------------------------------------------------
# Learning rates


def search_results(jobs: list[Job], keys: list[str]) -> dict[tuple, dict[str, tuple[float, float]]]:
    """Per (arm, setting): rate -> (val/acc_best, val/loss) of the completed search jobs."""
    found: dict[tuple, dict[str, tuple[float, float]]] = {}
    for job in jobs:
        if not job.search or job.status() != COMPLETED:
            continue
        metrics = job.metrics()
        acc, loss = float(metrics.get("val/acc_best", math.nan)), float(metrics.get("val/loss", math.inf))
        if not math.isnan(acc):
            found.setdefault((job.arm, job.setting(keys)), {})[job.lr] = (acc, loss)
    return found


def pick_rate(results: dict[str, tuple[float, float]], tolerance: float) -> str:
    """The rate with the best val/acc_best; rates within ``tolerance`` of it are a tie, broken by the lower val/loss."""
    best = max(acc for acc, _ in results.values())
    tied = [lr for lr, (acc, _) in results.items() if best - acc <= tolerance]
    return min(tied, key=lambda lr: (results[lr][1], float(lr)))


def search_done(jobs: list[Job], arm: str, setting: tuple, keys: list[str]) -> bool:
    """Whether every search job of ``arm`` at ``setting`` has ended (completed or failed on its own)."""
    return all(j.status() in (COMPLETED, FAILED) for j in jobs
               if j.search and j.arm == arm and j.setting(keys) == setting)


def rate_table(stages: list[Stage], keys: list[str], tolerance: float) -> dict[tuple, dict]:
    """(arm, setting) -> ``{"lr": chosen rate, "results": {rate: [val/acc_best, val/loss]}}`` for every arm whose
    search has ended with at least one completed job."""
    jobs = [job for stage in stages for job in stage.jobs]
    table = {}
    for (arm, setting), results in search_results(jobs, keys).items():
        if search_done(jobs, arm, setting, keys):
            ordered = sorted(results.items(), key=lambda item: float(item[0]))
            table[arm, setting] = {"lr": pick_rate(results, tolerance), "results": {lr: list(v) for lr, v in ordered}}
    return table


def write_rate_table(path: Path, table: dict[tuple, dict], keys: list[str]) -> None:
    rows = [{"arm": arm, **dict(zip(keys, setting)), **entry} for (arm, setting), entry in table.items()]
    path.write_text("# per arm and setting: the rate its search on seed 1 chose (best val/acc_best; ties: lower "
                    "val/loss) and every searched rate's [val/acc_best, val/loss]\n"
                    + yaml.safe_dump({"keys": keys, "rates": rows}, sort_keys=False))


def read_rate_table(path: Path) -> tuple[list[str], list[dict]]:
    """``(keys, rows)`` of a table ``write_rate_table`` wrote ((``[]``, ``[]``) when there is none)."""
    if not path.is_file():
        return [], []
    data = yaml.safe_load(path.read_text()) or {}
    return list(data.get("keys") or []), list(data.get("rates") or [])


def lookup_rate(arm: str, setting: dict[str, str], table: dict[tuple, dict], keys: list[str],
                external: list[tuple[list[str], list[dict]]]) -> str | None:
    """The rate of ``arm`` at ``setting`` (its values of ``keys``): this task's table, else the first row of an
    external table (another task's) whose keys that ``setting`` has all match."""
    entry = table.get((arm, tuple(setting[k] for k in keys)))
    if entry is not None:
        return entry["lr"]
    for other_keys, rows in external:
        for row in rows:
            if row["arm"] == arm and all(str(row[k]) == str(setting[k]) for k in other_keys if k in setting):
                return rate_text(row["lr"])
    return None


def assign_rates(stages: list[Stage], table: dict[tuple, dict], keys: list[str], lr_from: dict[str, str],
                 external: list[tuple[list[str], list[dict]]]) -> None:
    """Give every job that has no rate yet its arm's rate at its setting (``lr_from``: the rate of the arm it repeats)
    where the table knows it."""
    for stage in stages:
        for job in stage.jobs:
            if job.lr is None:
                setting = dict(zip(keys, job.setting(keys)))
                job.lr = lookup_rate(lr_from.get(job.arm, job.arm), setting, table, keys, external)


def external_tables(spec: dict) -> list[tuple[list[str], list[dict]]]:
    return [read_rate_table(PROJECT_ROOT / path) for path in spec.get("lr_tables", [])]


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
    command = [sys.executable, "train.py", f"experiment={job.stage}", *job.overrides, *overrides,
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
    job.folder.mkdir(parents=True, exist_ok=True)
    with open(job.folder / JOB_SECONDS, "a") as times:  # the measured cost, for --status
        times.write(f"{job.name}\t{seconds:.1f}\t{status}\n")
    budget.save()
    print(f"[{time.strftime('%H:%M:%S')}] {job.stage} {job.name}: {status} ({seconds:.0f} s; "
          f"{budget.spent_s() / 3600:.2f} h of {budget.limit_s / 3600:g} h spent)", flush=True)
    return status


def to_run(jobs: list[Job], retry_failed: bool) -> list[Job]:
    return [j for j in jobs if j.lr is not None and j.status() != COMPLETED and (retry_failed or j.status() != FAILED)]


def run_jobs(jobs: list[Job], n_parallel: int, log_dir: Path, overrides: list[str], budget: Budget) -> None:
    if not jobs:
        return
    threads = max(1, (os.cpu_count() or 1) // n_parallel)
    with ThreadPoolExecutor(max_workers=n_parallel) as pool:
        list(pool.map(lambda j: run_job(j, threads, log_dir, overrides, budget), jobs))


def settings_in_order(stage: Stage) -> list[tuple]:
    """The stage's settings (the values it sweeps besides the arm and the seed), in sweep order."""
    return list(dict.fromkeys(setting_of(job) for job in stage.jobs))


def setting_of(job: Job) -> tuple:
    return tuple((k, v) for k, v in job.pairs if k not in (ARM_GROUP, "seed"))


def control_first(jobs: list[Job], controls: list[str]) -> list[Job]:
    """Controls first (in ``controls``' order), then the others; by seed within each, in the sweep's order."""
    rank = {arm: i for i, arm in enumerate(controls)}
    return sorted(jobs, key=lambda j: (j.seed, (0, rank[j.arm]) if j.arm in rank else (1, 0)))


def full_failed_search(jobs: list[Job], control: str, mark: float) -> bool:
    """Whether ``control``'s search jobs have all ended and none reached ``mark`` (val/acc_best)."""
    searched = [j for j in jobs if j.search and j.arm == control]
    if not searched or any(j.status() not in (COMPLETED, FAILED) for j in searched):
        return False
    return not any(j.status() == COMPLETED and float(j.metrics().get("val/acc_best", 0.0)) >= mark for j in searched)


def run_task(task: str, root: Path, stages: list[Stage], plan: dict, n_parallel: int, retry_failed: bool,
             overrides: list[str], budget: Budget, include_cut: bool = False) -> None:
    """Every stage (the cut ones too with ``include_cut``), setting by setting: its search, then its other jobs at the
    chosen rates (module docstring). The rate table covers every stage's searches, run now or before."""
    spec = plan["tasks"][task]
    keys, tolerance, lr_from = spec["lr_keys"], plan["lr_tolerance"], plan.get("lr_from", {})
    controls = [*plan["controls"]["positive"], plan["controls"]["short"]]
    external = external_tables(spec)
    for stage in (s for s in stages if include_cut or not s.cut):
        for setting in settings_in_order(stage):
            jobs = [j for j in stage.jobs if setting_of(j) == setting]
            log_dir = root / "console" / stage.name
            run_jobs(to_run(control_first([j for j in jobs if j.search], controls), retry_failed), n_parallel,
                     log_dir, overrides, budget)
            table = rate_table(stages, keys, tolerance)
            write_rate_table(root / LR_TABLE, table, keys)
            positive = plan["controls"]["positive"][0]
            if full_failed_search(jobs, positive, plan["controls"]["pass"]):
                print(f"{stage.experiment} {dict(setting)}: {positive} reached {plan['controls']['pass']} at none of "
                      f"its searched rates; the setting's other jobs are skipped (nothing there could be read)")
                continue
            assign_rates(stages, table, keys, lr_from, external)
            rest = control_first([j for j in jobs if not j.search], controls)
            for job in rest:
                if job.lr is None:
                    print(f"{stage.experiment} {job.arm} seed {job.seed}: no rate (its search has no completed job); "
                          "not run", flush=True)
            run_jobs(to_run(rest, retry_failed), n_parallel, log_dir, overrides, budget)


def measured_seconds(stage_dir: Path) -> dict[str, float]:
    """Job name -> wall seconds of its last run, from ``<stage>/job_seconds.tsv``."""
    path = stage_dir / JOB_SECONDS
    if not path.is_file():
        return {}
    return {name: float(seconds) for name, seconds, *_ in (line.split("\t") for line in path.read_text().splitlines())}


def print_status(stages: list[Stage], budget: Budget | None = None) -> int:
    """One line per stage: how many jobs are completed / failed / left and their measured wall time; the failed ones
    by name. Returns the number of jobs not completed."""
    left = 0
    for stage in stages:
        if not stage.jobs:
            continue
        counts: dict[str, int] = {}
        for job in stage.jobs:
            counts[job.status()] = counts.get(job.status(), 0) + 1
        left += len(stage.jobs) - counts.get(COMPLETED, 0)
        seconds = measured_seconds(stage.jobs[0].folder) if stage.jobs else {}
        took = [seconds[j.name] for j in stage.jobs if j.name in seconds and j.status() == COMPLETED]
        median = sorted(took)[len(took) // 2] if took else 0.0
        timing = f"; {sum(took) / 3600:.2f} job-hours, median {median:.0f} s a job" if took else ""
        cut = " (cut: run with --include-cut)" if stage.cut else ""
        print(f"{stage.experiment}{cut}: {len(stage.jobs)} jobs: "
              + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + timing)
        for job in stage.jobs:
            if job.status() == FAILED:
                print(f"  failed: {job.directory}")
    if budget is not None:
        print(f"budget: {budget.spent_s() / 3600:.2f} h of {budget.limit_s / 3600:g} h spent")
    return left


# ----------------------------------------------------------------------------------------------------
# The plan's estimate


def job_seconds(task: str, arm: str, length: int, estimate: dict) -> float:
    """Estimated wall seconds of one job of ``task`` (plan.yaml ``estimate``): start-up + the task's expected steps x
    the arm's step time x the validation factor."""
    steps = estimate["steps"][task][length]
    step_s = estimate["step_s"][length]
    if arm not in step_s:
        raise KeyError(f"conf/recall/plan.yaml: estimate.step_s.{length} has no {arm!r}")
    return estimate["startup_s"] + steps.get(arm, steps["default"]) * step_s[arm] * estimate["validation"]


def stage_estimate(task: str, stage: Stage, plan: dict) -> tuple[int, int, float]:
    """(search jobs, other jobs, estimated hours at ``plan.jobs`` at a time) of one stage of ``task`` (plan.yaml
    ``estimate``)."""
    seconds = 0.0
    for job in stage.jobs:
        length = int(job.setting(["task.seq_len"])[0])
        seconds += job_seconds(task, job.arm, length, plan["estimate"])
    search = sum(j.search for j in stage.jobs)
    return search, len(stage.jobs) - search, seconds / 3600 / plan["jobs"]


def print_plan(task: str, stages: list[Stage], plan: dict) -> tuple[float, float]:
    """Per stage: the jobs (search / at the chosen rates), the estimated wall time and the running total, the stages
    the budget holds first, then the cut ones with their reasons; then the total against the budget. Returns the
    estimated hours of the stages run and of the cut ones."""
    totals = {False: 0.0, True: 0.0}
    for cut in (False, True):
        chosen = [s for s in stages if bool(s.cut) == cut]
        if cut and chosen:
            print("cut to keep the budget (python -m longseq.report.recall_study "
                  f"{task} --include-cut --budget-hours H runs them):")
        for stage in chosen:
            search, other, hours = stage_estimate(task, stage, plan)
            totals[cut] += hours
            settings = len(settings_in_order(stage))
            arms = len({j.arm for j in stage.jobs})
            only = f" [{stage.only}]" if stage.only else ""
            rates = f", {search} search jobs ({'/'.join(stage.search)}) and {other} at the chosen rates" \
                if stage.search else " at the searched rates"
            why = f"\n    cut: {stage.cut}" if cut else ""
            print(f"{'  ' if cut else ''}{stage.experiment}{only}: {arms} arms x {settings} setting(s): "
                  f"{search + other} jobs{rates}; about {hours:.2f} h (total {totals[cut]:.2f} h){why}")
    run = [s for s in stages if not s.cut]
    limit = plan["tasks"][task]["budget_hours"]
    print(f"{task}: {sum(len(s.jobs) for s in run)} jobs, about {totals[False]:.2f} h at {plan['jobs']} at a time "
          f"(budget {limit} h: the driver starts no job after it); cut: "
          f"{sum(len(s.jobs) for s in stages if s.cut)} jobs, about {totals[True]:.2f} h")
    if totals[False] > limit:
        print(f"over budget: the stages run need about {totals[False]:.2f} h, {totals[False] / limit:.1f} times the "
              f"{limit} h; the driver stops starting jobs when those are spent, so their last jobs are not run "
              "(--budget-hours sets another)")
    return totals[False], totals[True]


# ----------------------------------------------------------------------------------------------------
# Report


def reported_jobs(stages: list[Stage], table: dict[tuple, dict], keys: list[str]) -> list[Job]:
    """The jobs whose runs the tables report: every job not in a search, and each arm's search job at the rate chosen
    for its setting (its seed-1 result)."""
    chosen = []
    for stage in stages:
        for job in stage.jobs:
            entry = table.get((job.arm, job.setting(keys)))
            if not job.search or (entry is not None and entry["lr"] == job.lr):
                chosen.append(job)
    return chosen


def write_report(task: str, root: Path, stages: list[Stage], plan: dict, figures: Path | None) -> None:
    from longseq.report import recall_report as rr

    spec = plan["tasks"][task]
    keys = spec["lr_keys"]
    table = rate_table(stages, keys, plan["lr_tolerance"])
    assign_rates(stages, table, keys, plan.get("lr_from", {}), external_tables(spec))
    main = [job for job in reported_jobs(stages, table, keys) if job.directory is not None and job.directory.exists()]
    beside = [PROJECT_ROOT / path for path in spec.get("beside", [])]
    study = rr.StudyRuns.from_directories([job.directory for job in main], spec["settings"], beside)
    if study.frame.empty:
        print("no job has completed yet: nothing to report")
        return
    arms = list(dict.fromkeys(job.arm for stage in stages for job in stage.jobs))
    not_done = [job for stage in stages if not stage.cut for job in stage.jobs if job.status() != COMPLETED]
    rr.write_study_report(task, root, study, plan, arms, table, keys, not_done, figures)


def default_root(task: str, plan: dict) -> Path:
    """``logs/recall_<task>/<study>`` (``study`` of plan.yaml: each study its own folder, budget and rate table)."""
    return PROJECT_ROOT / "logs" / f"recall_{task}" / plan["study"]


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


def arms_by_setting(stages: list[Stage]):
    """(stage, setting, its arms in sweep order) for every setting of ``stages``."""
    for stage in stages:
        for setting in settings_in_order(stage):
            yield stage, setting, list(dict.fromkeys(j.arm for j in stage.jobs if setting_of(j) == setting))


def print_structure(task: str, stages: list[Stage], plan: dict, count: int) -> None:
    """The structural column of every arm at every setting of the task's stages, at the setting's placement and at
    ``start`` (``longseq.report.recall_structure``; no training)."""
    from longseq.report.recall_structure import structure_of_config

    for stage, setting, arms in arms_by_setting(stages):
        placement = dict(setting).get("task.placement", stage_default(stage.experiment, "task.placement"))
        variants = [(placement, [])] if placement == "start" else [
            (placement, []), ("start", ["task.placement=start", "task.filler=unused_keys"])]
        for label, extra in variants:
            cells = []
            for arm in arms:
                replaced = ("task.placement", "task.filler") if extra else ()
                overrides = [f"{k}={v}" for k, v in setting if k not in replaced]
                config = compose_stage(stage.experiment, [*overrides, f"{ARM_GROUP}={arm}", *extra])
                cells.append(f"{arm} {structure_of_config(config, count).cell()}")
            print(f"{stage.experiment} {dict(setting)} at {label}: alone / direct: " + "; ".join(cells), flush=True)


def print_step_times(stages: list[Stage], overrides: list[str], include_cut: bool) -> None:
    """Seconds per training step of every arm at every length of the stages run (the cut ones too with
    ``include_cut``), printed as plan.yaml's ``estimate.step_s`` rows; one arm at a time, on one thread."""
    from longseq.report.recall_steps import step_seconds

    times: dict[int, dict[str, float]] = {}
    for stage, setting, arms in arms_by_setting([s for s in stages if include_cut or not s.cut]):
        for arm in arms:
            config = compose_stage(stage.experiment, [*(f"{k}={v}" for k, v in setting), f"{ARM_GROUP}={arm}",
                                                      *overrides])
            row = times.setdefault(int(config.task.seq_len), {})
            if arm not in row:  # the step time of an arm at a length (the pair count barely changes it)
                row[arm] = round(step_seconds(config), 3)
                print(f"{stage.experiment} {arm} L = {config.task.seq_len}: {row[arm]} s a step", flush=True)
    print("step_s:\n" + "".join(f"  {length}: {{{', '.join(f'{a}: {s}' for a, s in row.items())}}}\n"
                                for length, row in times.items()), end="")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m longseq.report.recall_study",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=sorted(load_plan()["tasks"]))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides added to every job (smoke runs: "
                                                     "trainer.max_steps=5; use another --root for them)")
    parser.add_argument("--root", type=Path, help="study folder (default logs/recall_<task>/<plan.yaml's study>)")
    parser.add_argument("--jobs", type=int, help="jobs at a time (default: plan.yaml's, 2 on the 2-core machine)")
    parser.add_argument("--plan", action="store_true", help="list the stages, their jobs and the estimate; exit")
    parser.add_argument("--status", action="store_true", help="list done / failed / left and the time spent; exit")
    parser.add_argument("--structure", action="store_true", help="print every arm's structural column; exit")
    parser.add_argument("--time-steps", action="store_true", help="measure every arm's seconds a training step (the "
                                                                  "plan's estimate.step_s); exit")
    parser.add_argument("--report", action="store_true", help="only write the tables and figures of what is done")
    parser.add_argument("--retry-failed", action="store_true", help="run failed jobs again")
    parser.add_argument("--include-cut", action="store_true", help="also run the stages plan.yaml cuts (after the "
                                                                   "others; raise --budget-hours for them)")
    parser.add_argument("--budget-hours", type=float, help="override the task's budget_hours of plan.yaml")
    parser.add_argument("--figures", type=Path, help="also copy the figures here (e.g. docs/)")
    parser.add_argument("--only", help="comma-separated arms and/or key=value settings to run, e.g. "
                                       "full,local_long or task.num_pairs=8 (default: every job of the plan)")
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = load_plan()
    spec = plan["tasks"][args.task]
    root = (args.root or default_root(args.task, plan)).resolve()
    root.mkdir(parents=True, exist_ok=True)
    stages = task_stages(args.task, root, plan)
    if args.only:
        for stage in stages:
            stage.jobs = [j for j in stage.jobs if selected(j, args.only)]
    if args.plan:
        print_plan(args.task, stages, plan)
        return 0
    if args.structure:
        print_structure(args.task, stages, plan, count=500)
        return 0
    if args.time_steps:
        print_step_times(stages, args.overrides, args.include_cut)
        return 0
    budget = Budget(root, args.budget_hours if args.budget_hours is not None else spec["budget_hours"])
    keys = spec["lr_keys"]
    assign_rates(stages, rate_table(stages, keys, plan["lr_tolerance"]), keys, plan.get("lr_from", {}),
                 external_tables(spec))
    if args.status:
        left = print_status(stages, budget)
        print(f"{left} job(s) left; run: python -m longseq.report.recall_study {args.task}")
        return 0
    if not args.report:
        lock = hold_study_lock(root)  # noqa: F841 - held until the process exits
        signal.signal(signal.SIGTERM, stop_jobs)
        run_task(args.task, root, stages, plan, args.jobs or plan["jobs"], args.retry_failed, args.overrides, budget,
                 args.include_cut)
        budget.save()
        print_status(stages, budget)
    write_report(args.task, root, stages, plan, args.figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
