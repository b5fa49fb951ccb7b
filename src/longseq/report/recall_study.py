"""``python -m longseq.report.recall_study mqar|needle`` — run the recall study job by job, resumably, then
write its table and figure.

The jobs are the products of the experiments' ``hydra.sweeper.params`` (the one home of the sweep; the same
configs ``python train.py -m experiment=recall/<name>`` runs as a plain multirun):

- ``mqar``: ``recall/mqar_lr`` (the per-attention learning-rate search), then ``recall/mqar`` (L = 256, 3 seeds)
  and ``recall/mqar_long`` (L = 1,024), each job with the learning rate its attention won in the search;
- ``needle``: ``recall/needle``, with the learning rates of the MQAR search when its ``lr_table.yaml`` exists
  (``--lr-table``, default ``logs/recall_mqar/study/lr_table.yaml``), else the table of ``conf/recall/study.yaml``.

Each job is one ``train.py`` run in ``<root>/<stage>/<job name>`` (``hydra.run.dir``), so a stopped study goes
on where it stopped: a job whose ``metrics.json`` says ``completed`` is skipped, a job that never finished (no
``metrics.json``, interrupted, or stopped by Ctrl-C) is removed and run again, and a job that failed on its own
is left as it is (``--retry-failed`` runs it again). ``--status`` lists done / failed / left per stage without
running anything. ``--jobs 2`` runs two jobs at a time, each with ``cores / jobs`` threads.

At the end (and with ``--report`` alone) the completed jobs are aggregated by ``longseq.report`` (mean ± std over
seeds of ``test/acc`` by attention, length and pairs; failed and unfinished jobs listed) into
``<root>/report.md`` / ``report.csv`` (the needle also ``report_by_depth.csv``), and the figure — test accuracy
against D (MQAR) or against the needle's depth, one panel per L, one line per attention — is drawn to
``<root>/recall_<task>.png`` (``--figure`` copies it, e.g. into ``docs/``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from longseq.report.outcome import COMPLETED, FAILED, METRICS_FILE

PROJECT_ROOT = Path(__file__).resolve().parents[3]  # train.py and conf/ live here
STAGES = {"mqar": ["recall/mqar_lr", "recall/mqar", "recall/mqar_long", "recall/mqar_seeds"], "needle": ["recall/needle"]}
LR_STAGE = "recall/mqar_lr"
LR_KEY = "optimizer.lr"
GROUP_BY = {"mqar": ["attention", "task.seq_len", "task.num_pairs"], "needle": ["attention", "task.seq_len"]}
# Errors that mean "stopped from outside", not "this configuration fails": such a job is run again. Lightning
# turns Ctrl-C during fit into sys.exit(1) ("SystemExit: 1"); SIGTERM is "SystemExit: 143" (status interrupted).
STOPPED = ("KeyboardInterrupt", "SystemExit: 1", "SystemExit: 130", "SystemExit: 143")


@dataclass
class Job:
    stage: str
    overrides: list[str]
    directory: Path
    extra: list[str] = field(default_factory=list)  # overrides decided at run time (the searched lr)

    @property
    def name(self) -> str:
        return self.directory.name

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


def sweep_params(experiment: str) -> dict[str, list[str]]:
    """``hydra.sweeper.params`` of ``experiment=<experiment>``, each as its list of values."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from longseq.utils.config import register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(PROJECT_ROOT / "conf")):
            cfg = compose(config_name="train", overrides=[f"experiment={experiment}"], return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()
    return {str(k): [v.strip() for v in str(v).split(",")] for k, v in cfg.hydra.sweeper.params.items()}


def job_name(pairs: list[tuple[str, str]]) -> str:
    return ",".join(f"{k}={v}" for k, v in pairs)


def stage_jobs(stage: str, root: Path) -> list[Job]:
    """The jobs of one stage: the product of its sweep parameters, in the sweep's order."""
    params = sweep_params(stage)
    keys = list(params)
    jobs = []
    for values in itertools.product(*(params[k] for k in keys)):
        pairs = list(zip(keys, values))
        jobs.append(Job(stage, [f"{k}={v}" for k, v in pairs], root / stage.split("/")[-1] / job_name(pairs)))
    return jobs


def pick_lrs(jobs: list[Job]) -> dict[str, float]:
    """Per attention, the searched lr with the best ``val/acc_best`` (ties: the lower ``val/loss``)."""
    best: dict[str, tuple[float, float, float]] = {}
    for job in jobs:
        if job.status() != COMPLETED:
            continue
        values = dict(o.split("=", 1) for o in job.overrides)
        metrics = job.metrics()
        acc, loss = float(metrics.get("val/acc_best", math.nan)), float(metrics.get("val/loss", math.inf))
        if math.isnan(acc):
            continue
        key = (acc, -loss)
        attention, lr = values["attention"], float(values[LR_KEY])
        if attention not in best or key > best[attention][:2]:
            best[attention] = (acc, -loss, lr)
    return {attention: lr for attention, (_, _, lr) in best.items()}


def selected(job: Job, only: str) -> bool:
    """Whether ``job`` is among ``--only``'s entries: a bare name is an attention, ``key=value`` any swept setting;
    a job is kept when, for every key the entries name, its value is one of those listed."""
    wanted: dict[str, set[str]] = {}
    for entry in (e.strip() for e in only.split(",") if e.strip()):
        key, value = entry.split("=", 1) if "=" in entry else ("attention", entry)
        wanted.setdefault(key.strip(), set()).add(value.strip())
    values = dict(o.split("=", 1) for o in job.overrides)
    return all(values.get(key) in allowed for key, allowed in wanted.items())


def run_job(job: Job, threads: int, log_dir: Path, overrides: list[str]) -> str:
    """Run one job as ``train.py`` in its own directory (a leftover of an unfinished attempt is removed first)."""
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
        code = subprocess.run(command, cwd=PROJECT_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    status = job.status() if code == 0 or job.directory.exists() else FAILED
    print(f"[{time.strftime('%H:%M:%S')}] {job.stage} {job.name}: {status} ({time.time() - start:.0f} s)", flush=True)
    return status


def run_stage(jobs: list[Job], n_parallel: int, retry_failed: bool, log_dir: Path, overrides: list[str]) -> None:
    todo = [j for j in jobs if j.status() != COMPLETED and (retry_failed or j.status() != FAILED)]
    if not todo:
        return
    threads = max(1, (os.cpu_count() or 1) // n_parallel)
    print(f"{jobs[0].stage}: {len(todo)} of {len(jobs)} job(s) to run, {n_parallel} at a time", flush=True)
    with ThreadPoolExecutor(max_workers=n_parallel) as pool:
        list(pool.map(lambda j: run_job(j, threads, log_dir, overrides), todo))


def print_status(stages: dict[str, list[Job]]) -> int:
    """One line per stage: how many jobs are completed / failed / left; the failed ones by name. Returns the
    number of jobs not completed."""
    left = 0
    for stage, jobs in stages.items():
        counts: dict[str, int] = {}
        for job in jobs:
            counts[job.status()] = counts.get(job.status(), 0) + 1
        left += len(jobs) - counts.get(COMPLETED, 0)
        print(f"{stage}: {len(jobs)} jobs: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
        for job in jobs:
            if job.status() == FAILED:
                print(f"  failed: {job.directory}")
    return left


def lr_table_for(task: str, root: Path, stages: dict[str, list[Job]], mqar_table: Path) -> dict[str, float]:
    """The searched learning rates: this study's search (MQAR), or the MQAR study's ``lr_table.yaml`` (needle;
    empty when it does not exist: the jobs then use ``recall_lr`` of ``conf/recall/study.yaml``)."""
    if LR_STAGE in stages:
        table = pick_lrs(stages[LR_STAGE])
        if table:
            (root / "lr_table.yaml").write_text(
                "# per-attention lr chosen by recall/mqar_lr (best val/acc_best, ties: lower val/loss); paste into\n"
                "# recall_lr in conf/recall/study.yaml so that plain -m runs use it too\n"
                + yaml.safe_dump({"recall_lr": table}, sort_keys=False))
        return table
    if mqar_table.is_file():
        return dict(yaml.safe_load(mqar_table.read_text())["recall_lr"])
    return {}


def write_report(task: str, root: Path, stages: dict[str, list[Job]], figure: Path | None) -> None:
    from longseq.report.runs import load_run
    from longseq.report.table import aggregate

    main = [job for stage, jobs in stages.items() if stage != LR_STAGE for job in jobs]
    runs = [load_run(job.directory) for job in main if job.directory.exists()]
    if not runs:
        print("no job has started yet: nothing to report")
        return
    report = aggregate(runs, metric="test/acc", by=GROUP_BY[task], mode="max")
    report.print(root=root)
    report.table.to_csv(root / "report.csv", index=False)
    not_started = [job for job in main if not job.directory.exists()]
    text = report.markdown(root=root)
    if task == "mqar":  # one row per attention, one column per (L, D): the headline view
        text = wide_table(report.table) + "\n\n" + text
    if not_started:
        text += f"\nNot started: {len(not_started)} job(s) (python -m longseq.report.recall_study {task}).\n"
    (root / "report.md").write_text(text)
    table = report.table
    if task == "needle":  # the needle's figure is accuracy by depth: one aggregate per depth bucket
        table = by_bucket(runs, "test/acc_depth/", GROUP_BY[task], "depth")
        table.to_csv(root / "report_by_depth.csv", index=False)
    path = draw_figure(task, table, root / f"recall_{task}.png")
    if path is not None and figure is not None:
        figure.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, figure)
    print(f"wrote {root / 'report.md'}, {root / 'report.csv'}" + (f", {path}" if path else ""))


def wide_table(table) -> str:
    """Markdown: one row per attention (best mean first), one column per (L, D), cells ``mean ± std (n)`` of
    ``longseq.report``'s aggregate (``mean`` alone for one seed)."""
    import pandas as pd

    from longseq.report.table import markdown_table

    table = table.assign(L=table["task.seq_len"].astype(int), D=table["task.num_pairs"].astype(int))
    columns = sorted({(L, D) for L, D in zip(table["L"], table["D"])})
    order = table.groupby("attention")["mean"].mean().sort_values(ascending=False).index
    rows = []
    for attention in order:
        cells = {(r.L, r.D): (f"{r.mean:.3f}" if r.n < 2 else f"{r.mean:.3f} ± {r.std:.3f} ({r.n})")
                 for r in table[table["attention"] == attention].itertuples()}
        rows.append([attention, *(cells.get(c, "") for c in columns)])
    return markdown_table(pd.DataFrame(rows, columns=["attention", *(f"L = {L}, D = {D}" for L, D in columns)]))


def by_bucket(runs: list, prefix: str, by: list[str], column: str):
    """``longseq.report``'s mean ± std over seeds of every ``<prefix><bucket>`` metric, stacked with a
    ``column`` naming the bucket (e.g. the needle's depth)."""
    import pandas as pd

    from longseq.report.table import aggregate

    keys = sorted({k for run in runs for k in run.metrics if k.startswith(prefix)})
    parts = [aggregate(runs, metric=k, by=by, mode="max").table.assign(**{column: k[len(prefix):]}) for k in keys]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=[*by, column, "mean", "std"])


def draw_figure(task: str, table, path: Path) -> Path | None:
    """MQAR: test accuracy against D, one panel per L, one line per attention (error bars: std over seeds).
    Needle: accuracy against the needle's depth, one panel per L, one line per attention (``by_bucket``'s
    table). None when the table is empty."""
    if not len(table):
        return None
    import matplotlib.pyplot as plt

    from longseq.bench.report import curve_styles

    table = table.copy()
    table["L"] = table["task.seq_len"].astype(int)
    lengths = sorted(table["L"].unique())
    styles = curve_styles(sorted(table["attention"].unique()), ["test"])  # the bench plot's: a hue per family
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths), 4.2), squeeze=False, sharey=True)
    for ax, length in zip(axes[0], lengths):
        part = table[table["L"] == length]
        x = "task.num_pairs" if task == "mqar" else "depth"
        part = part.assign(x=part[x].astype(float))
        for attention, rows in part.groupby("attention", sort=True):
            rows = rows.sort_values("x")
            ax.errorbar(rows["x"], rows["mean"], yerr=rows["std"].fillna(0), label=attention, capsize=2,
                        **styles[attention, "test"])
        if task == "mqar":
            ax.set_xscale("log", base=2)
        ax.set_xlabel("key-value pairs D" if task == "mqar" else "needle depth (fraction of the haystack)")
        ax.set_title(f"{task}, L = {length}")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy (question positions)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m longseq.report.recall_study",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=sorted(STAGES))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides added to every job (smoke runs: "
                                                     "trainer.max_steps=5; use another --root for them)")
    parser.add_argument("--root", type=Path, help="study folder (default logs/recall_<task>/study)")
    parser.add_argument("--jobs", type=int, default=1, help="jobs at a time (2 on the 2-core machine)")
    parser.add_argument("--status", action="store_true", help="list done / failed / left and exit")
    parser.add_argument("--report", action="store_true", help="only write the table and figure of what is done")
    parser.add_argument("--retry-failed", action="store_true", help="run failed jobs again")
    parser.add_argument("--figure", type=Path, help="also copy the figure here (e.g. docs/recall_mqar.png)")
    parser.add_argument("--lr-table", type=Path, default=PROJECT_ROOT / "logs" / "recall_mqar" / "study" / "lr_table.yaml",
                        help="needle: the MQAR search's table (default: the MQAR study's default root)")
    parser.add_argument("--only", help="comma-separated attentions and/or key=value settings to run, e.g. "
                                       "full,local or task.seq_len=256 (default: every job of the sweep)")
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = (args.root or PROJECT_ROOT / "logs" / f"recall_{args.task}" / "study").resolve()
    root.mkdir(parents=True, exist_ok=True)
    stages = {stage: stage_jobs(stage, root) for stage in STAGES[args.task]}
    if not (args.status or args.report):
        lock = hold_study_lock(root)  # noqa: F841 - held until the process exits
    if args.only:
        stages = {s: [j for j in jobs if selected(j, args.only)] for s, jobs in stages.items()}
    if args.status:
        left = print_status(stages)
        print(f"{left} job(s) left; run: python -m longseq.report.recall_study {args.task}")
        return 0
    if not args.report:
        for stage, jobs in stages.items():
            if stage != LR_STAGE:
                table = lr_table_for(args.task, root, stages, args.lr_table)
                for job in jobs:
                    attention = dict(o.split("=", 1) for o in job.overrides)["attention"]
                    job.extra = [f"{LR_KEY}={table[attention]}"] if attention in table else []
            run_stage(jobs, args.jobs, args.retry_failed, root / "console" / stage.split("/")[-1], args.overrides)
        print_status(stages)
    write_report(args.task, root, stages, args.figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
