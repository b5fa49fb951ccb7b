"""The recall study's tables and figures, from its finished jobs (``longseq.report.recall_study`` writes them).

Every table and figure carries its floor and its controls (conf/recall/plan.yaml):

- the **guessing floor** of each setting (``longseq.data.recall.guess_floor``: MQAR 1/D, the needle 1/K), a row of
  every table and a dashed line in every figure;
- the **controls**: the positive ones (``full`` and ``local_long``, a window longer than every gap) must reach
  ``controls.pass``, and on MQAR the short-window ``local_short`` (a window covering a stated share of the questions)
  must answer the questions inside its window and stay at the floor beyond its reach; a setting whose controls fail
  is **not trained** and its cells hold no number;
- beside each arm's accuracy its **structural column** (``longseq.report.recall_structure``): the share of questions
  whose answer is alone in a region the arm can use (it could answer by pointing at the region) / the share it reads
  directly, from the generated examples and the arm's own partition or selection rule;
- per arm, where its answers come from (``in_example`` / ``in_example_acc``), the steps trained, the learning-rate
  search per arm and setting, accuracy by the question's distance to its key (MQAR) or the needle's depth, and
  validation accuracy against steps for every run;
- the changes made after jobs had run (plan.yaml ``post_hoc_changes``).

Cells are ``mean ± h (n)`` (h: the half-width of the 95 % Student-t interval over seeds) where the seeds agree (their
range is at most plan.yaml's ``seeds_disagree``); where they disagree the cell gives every seed's value with their
median and range, not an interval (a bimodal set has no meaningful mean).
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from longseq.report.runs import RunRecord, learning_curves, load_run
from longseq.report.table import markdown_table

ARM_KEY = "recall_arm"  # set by every conf/recall/arm/<name>.yaml
NOT_TRAINED = "not trained"
SHORT_NAMES = {"task.seq_len": "L", "task.num_pairs": "D", "task.num_needles": "K"}
RECIPE = "recipe"  # the column that tells this study's runs ("") from the runs read beside them
BESIDE = "issue 33"  # the recipe of the runs read beside (plan.yaml ``beside``)
# Setting keys a run of an older study may lack: the generator's defaults (what it ran)
SETTING_DEFAULTS = {"task.placement": "start", "task.filler": "unused_keys"}


def t_interval(values: pd.Series) -> float:
    """Half-width of the 95 % Student-t interval of the mean (NaN for fewer than two values)."""
    from scipy.stats import t

    n = values.count()
    return float(t.ppf(0.975, n - 1) * values.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan


def cell(mean: float, half: float, n: int, digits: int = 3) -> str:
    if n < 2 or math.isnan(half):
        return f"{mean:.{digits}f} (1)"
    return f"{mean:.{digits}f} ± {half:.{digits}f} ({n})"


def seeds_cell(values: pd.Series, seeds: pd.Series, disagree: float, digits: int = 3) -> str:
    """One arm at one setting over its seeds: ``mean ± h (n)`` where the seeds agree (range <= ``disagree``), else
    ``median m, range a–b; seed s: v, ...`` (every seed's value, in seed order)."""
    n = values.count()
    if n < 2 or float(values.max() - values.min()) <= disagree:
        return cell(float(values.mean()), t_interval(values), int(n), digits)
    per_seed = ", ".join(f"seed {s}: {v:.{digits}f}" for s, v in sorted(zip(seeds, values)))
    return (f"median {values.median():.{digits}f}, range {values.min():.{digits}f}–{values.max():.{digits}f} "
            f"(seeds disagree; {per_seed})")


def run_floor(run: RunRecord) -> float:
    """The guessing floor of the run's own task (the generator built from its resolved config)."""
    from omegaconf import OmegaConf

    from longseq.data.recall import GENERATORS, guess_floor

    module = OmegaConf.to_container(run.config.task.module, resolve=True)
    return guess_floor(GENERATORS[module["name"]](**module["generator"]))


def completed_runs_below(folder: Path) -> list[RunRecord]:
    """The completed runs in the job directories directly below ``folder`` (a study's stage folder)."""
    if not folder.is_dir():
        return []
    runs = [load_run(p) for p in sorted(folder.iterdir()) if (p / "metrics.json").is_file()]
    return [run for run in runs if run.status == "completed"]


@dataclass
class StudyRuns:
    """The completed runs of a study as one frame: a row per run with its arm, setting keys, seed, floor and test
    metrics; ``settings`` are the keys whose combinations are the table's columns (``RECIPE`` last)."""

    frame: pd.DataFrame
    runs: dict[str, RunRecord]
    settings: list[str]

    @classmethod
    def load(cls, runs: list[RunRecord], settings: list[str], beside: list[RunRecord] = ()) -> StudyRuns:
        """``runs`` of this study and, tagged with ``RECIPE`` = ``BESIDE``, the runs of an earlier study read
        beside them; a setting key a run lacks takes ``SETTING_DEFAULTS``'s value."""
        rows = []
        for run, recipe in [*((r, "") for r in runs), *((r, BESIDE) for r in beside)]:
            if run.status != "completed" or "test/acc" not in run.metrics:
                continue
            row = {"run": str(run.path), "arm": run.value(ARM_KEY) or run.value("attention"),
                   "seed": int(run.value("seed") or 0), "floor": run_floor(run), RECIPE: recipe,
                   **{key: run.value(key) or SETTING_DEFAULTS.get(key, "") for key in settings}}
            row.update({k: float(v) for k, v in run.metrics.items() if k.startswith(("test/", "val/acc_best"))
                        and isinstance(v, (int, float))})
            curve = learning_curves(run, "val/acc")
            row["steps"] = int(curve["step"].max()) + 1 if len(curve) else 0  # where early stopping or the cap ended
            rows.append(row)
        frame = pd.DataFrame(rows)
        every = [*runs, *beside]
        return cls(frame=frame, runs={str(r.path): r for r in every}, settings=[*settings, RECIPE])

    @classmethod
    def from_directories(cls, directories: list[Path], settings: list[str], beside: list[Path] = ()) -> StudyRuns:
        """This study's job directories and the stage folders of an earlier study (``beside``, if present)."""
        return cls.load([load_run(d) for d in directories], settings,
                        [run for folder in beside for run in completed_runs_below(folder)])

    def setting_label(self, values: tuple) -> str:
        names = SHORT_NAMES
        parts = []
        for key, value in zip(self.settings, values):
            if key == "task.power_a":
                parts.append("uniform gaps" if float(value) == 1.0 else f"power law a = {value}")
            elif key == "task.placement":
                parts.append(str(value))
            elif key == "task.filler":
                parts.append("vocab fillers" if value == "vocab" else "key fillers")
            elif key == RECIPE:
                if value:
                    parts.append(f"{value}'s recipe")
            else:
                parts.append(f"{names.get(key, key)} = {value}")
        return ", ".join(parts)

    def groups(self) -> list[tuple]:
        if self.frame.empty:
            return []
        return sorted({tuple(r) for r in self.frame[self.settings].itertuples(index=False)},
                      key=lambda t: tuple((0, float(v), "") if _is_number(v) else (1, 0.0, str(v)) for v in t))

    def part(self, setting: tuple, arm: str | None = None) -> pd.DataFrame:
        """The runs of one setting (and arm)."""
        mask = setting_mask(self.frame, self.settings, setting)
        if arm is not None:
            mask &= self.frame["arm"] == arm
        return self.frame[mask]

    def floor(self, setting: tuple) -> float:
        return float(self.part(setting)["floor"].iloc[0])

    def subset(self, keys: list[str], values: tuple) -> StudyRuns:
        """The runs whose ``keys`` hold ``values`` (one table of the report: one length and pair count)."""
        return StudyRuns(self.frame[setting_mask(self.frame, keys, values)], self.runs, self.settings)


def setting_mask(table: pd.DataFrame, keys: list[str], setting: tuple) -> pd.Series:
    """Rows of ``table`` whose ``keys`` hold the values of ``setting``."""
    mask = pd.Series(True, index=table.index)
    for key, value in zip(keys, setting):
        mask &= table[key].astype(str) == str(value)
    return mask


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


# ----------------------------------------------------------------------------------------------------
# Controls


@dataclass
class ControlVerdict:
    trained: bool
    lines: list[str]


def bucket_counts(run: RunRecord, kind: str) -> pd.DataFrame:
    """``<run>/recall/test_by_<kind>.csv``: bucket, acc, questions (empty when the run wrote none)."""
    path = run.path / "recall" / f"test_by_{kind}.csv"
    if not path.is_file():
        return pd.DataFrame(columns=[kind, "acc", "questions"])
    return pd.read_csv(path, dtype={kind: str})


def distance_range(name: str) -> tuple[int, int]:
    """``"16-31"`` -> (16, 31); ``"1"`` -> (1, 1)."""
    lo, _, hi = str(name).partition("-")
    return int(lo), int(hi or lo)


def reach_accuracy(runs: list[RunRecord], window: int, reach: int) -> tuple[float, float, float]:
    """Pooled accuracy of ``runs`` on the questions whose key is inside ``window`` (distance < window) and on those
    beyond ``reach`` (distance > reach), from their per-distance test tables, and the share of questions inside."""
    inside, beyond, total = [0.0, 0], [0.0, 0], 0
    for run in runs:
        for row in bucket_counts(run, "distance").itertuples(index=False):
            lo, hi = distance_range(row.distance)
            total += row.questions
            target = inside if hi < window else beyond if lo > reach else None
            if target is not None:
                target[0] += row.acc * row.questions
                target[1] += row.questions
    share = inside[1] / total if total else math.nan
    return (inside[0] / inside[1] if inside[1] else math.nan, beyond[0] / beyond[1] if beyond[1] else math.nan, share)


def judge_controls(study: StudyRuns, setting: tuple, controls: dict, breakdown: str) -> ControlVerdict:
    """Whether a setting's controls passed (plan.yaml's ``controls``), with one line per control."""
    lines, trained = [], True
    for arm in controls["positive"]:
        part = study.part(setting, arm)
        if part.empty:
            lines.append(f"{arm}: not run")
            trained = False
            continue
        mean = part["test/acc"].mean()
        ok = mean >= controls["pass"]
        trained &= bool(ok)
        lines.append(f"{arm} {mean:.3f} {'≥' if ok else '<'} {controls['pass']}")
    short = controls.get("short")
    part = study.part(setting, short) if short else pd.DataFrame()
    if short and breakdown == "distance":
        if part.empty:
            lines.append(f"{short}: not run")
            trained = False
        else:
            runs = [study.runs[r] for r in part["run"]]
            config = runs[0].config
            window = int(config.attention.window)
            reach = 2 * (window + int(config.model.short_conv or 0))
            inside, beyond, share = reach_accuracy(runs, window, reach)
            floor = study.floor(setting)
            ok_in = not math.isnan(inside) and inside >= controls["inside"]
            ok_out = not math.isnan(beyond) and beyond <= floor + controls["margin"]
            trained &= ok_in and ok_out
            far = (f"beyond {reach} tokens {beyond:.3f} {'≤' if ok_out else '>'} floor + {controls['margin']}"
                   if not math.isnan(beyond) else f"no question beyond {reach} tokens: its limit is not checked")
            lines.append(f"{short} (window {window}, {share:.2f} of the questions inside): inside {inside:.3f} "
                         f"{'≥' if ok_in else '<'} {controls['inside']}, {far}")
    elif short and not part.empty:
        lines.append(f"{short} {part['test/acc'].mean():.3f} (reported, not judged: no distance breakdown)")
    return ControlVerdict(trained=trained, lines=lines)


# ----------------------------------------------------------------------------------------------------
# Tables


def summary(study: StudyRuns, metric: str = "test/acc") -> pd.DataFrame:
    """Mean, 95 % t half-width, n, median, min and max of ``metric`` per (setting, arm), with the setting's floor and
    the seeds (in order)."""
    columns = [*study.settings, "arm", "mean", "half", "n", "median", "min", "max", "floor", "seeds"]
    if study.frame.empty or metric not in study.frame:
        return pd.DataFrame(columns=columns)
    grouped = study.frame.groupby([*study.settings, "arm"], sort=False)
    table = grouped[metric].agg(mean="mean", half=t_interval, n="count", median="median", min="min",
                                max="max").reset_index()
    table["floor"] = grouped["floor"].first().values
    table["seeds"] = grouped["seed"].agg(lambda s: ",".join(map(str, sorted(s)))).values
    return table


def arm_grid(study: StudyRuns, arm_order: list[str], columns: list[tuple[str, Any]],
             footer: list[list[str]]) -> str:
    """Markdown: a row per arm (``arm_order`` first), a column per ``(title, cell_of)`` (``cell_of(arm) -> str``),
    then the ``footer`` rows (a label and one cell per column)."""
    present = set(study.frame["arm"])
    arms = [a for a in arm_order if a in present] + sorted(present - set(arm_order))
    rows = [[arm, *(cell_of(arm) for _, cell_of in columns)] for arm in arms] + footer
    return markdown_table(pd.DataFrame(rows, columns=["arm", *(title for title, _ in columns)]))


def untrained_settings(study: StudyRuns, controls: dict, breakdown: str) -> frozenset:
    """The settings whose controls fail (``judge_controls``): reported as not trained, in tables and figures."""
    return frozenset(s for s in study.groups() if not judge_controls(study, s, controls, breakdown).trained)


def main_table(study: StudyRuns, controls: dict, breakdown: str, arm_order: list[str],
               structures: dict[tuple, str] | None = None, disagree: float = math.inf) -> str:
    """Test accuracy per arm and setting (``seeds_cell``) and, beside it where ``structures`` has it, the structural
    column (``(arm, setting) -> "alone / direct"``); then the floor row and the controls row. A setting whose controls
    fail holds "not trained"."""
    settings = study.groups()
    verdicts = {s: judge_controls(study, s, controls, breakdown) for s in settings}
    structures = structures or {}

    def accuracy(setting: tuple):
        def cell_of(arm: str) -> str:
            part = study.part(setting, arm)
            if part.empty:
                return ""
            if not verdicts[setting].trained:
                return NOT_TRAINED
            return seeds_cell(part["test/acc"].reset_index(drop=True), part["seed"].reset_index(drop=True), disagree)
        return cell_of

    def structure(setting: tuple):
        return lambda arm: structures.get((arm, setting), "") if not study.part(setting, arm).empty else ""

    columns, footer_floor, footer_controls = [], ["guessing floor"], ["controls"]
    for setting in settings:
        label = study.setting_label(setting)
        columns.append((label, accuracy(setting)))
        footer_floor.append(f"{study.floor(setting):.3f}")
        verdict = verdicts[setting]
        footer_controls.append(("pass: " if verdict.trained else "FAIL: ") + "; ".join(verdict.lines))
        if structures:
            columns.append(("alone / direct", structure(setting)))
            footer_floor.append("")
            footer_controls.append("")
    return arm_grid(study, arm_order, columns, [footer_floor, footer_controls])


def answers_table(study: StudyRuns, arm_order: list[str]) -> str:
    """Per arm and setting, the share of answers that are one of the example's candidates and their precision
    (``in_example`` / ``in_example_acc``, means over seeds), beside the floor."""
    if "test/in_example" not in study.frame:
        return "(no run recorded test/in_example)"
    share, precision = summary(study, "test/in_example"), summary(study, "test/in_example_acc")

    def column(setting: tuple):
        def cell_of(arm: str) -> str:
            s, p = (lookup(t, study.settings, arm, setting) for t in (share, precision))
            return "" if s is None else f"{s['mean']:.2f} / {p['mean']:.3f}"
        return study.setting_label(setting), cell_of

    footer = [["guessing floor (precision)", *(f"{study.floor(s):.3f}" for s in study.groups())]]
    return arm_grid(study, arm_order, [column(s) for s in study.groups()], footer)


def lookup(table: pd.DataFrame, keys: list[str], arm: str, setting: tuple) -> pd.Series | None:
    """The row of ``table`` (a ``summary``) for one arm and setting, or None."""
    match = table[(table["arm"] == arm) & setting_mask(table, keys, setting)]
    return None if match.empty else match.iloc[0]


def steps_table(study: StudyRuns, arm_order: list[str]) -> str:
    """Per arm and setting, the steps trained (mean over seeds; each seed's where they differ by more than one
    validation): where early stopping, or the cap, ended the runs."""
    def column(setting: tuple):
        def cell_of(arm: str) -> str:
            part = study.part(setting, arm).sort_values("seed")
            if part.empty:
                return ""
            steps = part["steps"].tolist()
            return f"{sum(steps) / len(steps):.0f}" + ("" if max(steps) - min(steps) <= 200 else
                                                       f" ({', '.join(map(str, steps))})")
        return study.setting_label(setting), cell_of

    return arm_grid(study, arm_order, [column(s) for s in study.groups()], [])


def rate_search_table(table: dict[tuple, dict], keys: list[str], arm_order: list[str]) -> str:
    """Markdown: per arm and searched setting, every rate's val/acc_best (seed 1), the chosen one in bold."""
    if not table:
        return "(no search has ended yet)"
    settings = sorted({setting for _, setting in table}, key=lambda s: tuple(float(v) for v in s))
    arms = [a for a in arm_order if any(a == arm for arm, _ in table)] + sorted(
        {arm for arm, _ in table} - set(arm_order))
    names = SHORT_NAMES

    def cell(arm: str, setting: tuple) -> str:
        entry = table.get((arm, setting))
        if entry is None:
            return ""
        return ", ".join((f"**{lr}: {acc:.3f}**" if lr == entry["lr"] else f"{lr}: {acc:.3f}")
                         for lr, (acc, _) in entry["results"].items())

    rows = [[arm, *(cell(arm, s) for s in settings)] for arm in arms]
    titles = [", ".join(f"{names.get(k, k)} = {v}" for k, v in zip(keys, s)) for s in settings]
    return markdown_table(pd.DataFrame(rows, columns=["arm", *titles]))


def breakdown_frame(study: StudyRuns, kind: str) -> pd.DataFrame:
    """Per setting, arm and bucket: pooled test accuracy over seeds (questions weighted) and the question count."""
    rows = []
    for row in study.frame.to_dict("records"):
        for b in bucket_counts(study.runs[row["run"]], kind).to_dict("records"):
            rows.append({**{k: row[k] for k in study.settings}, "arm": row["arm"], "bucket": str(b[kind]),
                         "correct": b["acc"] * b["questions"], "questions": b["questions"], "floor": row["floor"]})
    if not rows:
        return pd.DataFrame(columns=[*study.settings, "arm", "bucket", "acc", "questions", "floor"])
    frame = pd.DataFrame(rows)
    pooled = frame.groupby([*study.settings, "arm", "bucket"], sort=False).agg(
        correct=("correct", "sum"), questions=("questions", "sum"), floor=("floor", "first")).reset_index()
    pooled["acc"] = pooled["correct"] / pooled["questions"]
    return pooled.drop(columns="correct")


def curves_frame(study: StudyRuns) -> pd.DataFrame:
    """Validation accuracy against steps for every run: setting keys, arm, seed, step, val/acc."""
    parts = []
    for row in study.frame.to_dict("records"):
        curve = learning_curves(study.runs[row["run"]], "val/acc")
        if len(curve):
            parts.append(curve.assign(arm=row["arm"], seed=row["seed"], floor=row["floor"],
                                      **{k: row[k] for k in study.settings}))
    if not parts:
        return pd.DataFrame(columns=[*study.settings, "arm", "seed", "step", "val/acc", "floor"])
    return pd.concat(parts, ignore_index=True)[[*study.settings, "arm", "seed", "step", "val/acc", "floor"]]


def structure_cells(study: StudyRuns, cache: Path | None = None) -> dict[tuple, str]:
    """``(arm, setting) -> "alone / direct"`` for every arm and setting of ``study``, from the configuration of one of
    its runs (``recall_structure.structure_of_config``); kept in ``cache`` (a CSV) between reports."""
    from longseq.report.recall_structure import structure_of_config

    known: dict[str, str] = {}
    if cache is not None and cache.is_file():
        known = dict(pd.read_csv(cache, dtype=str, keep_default_na=False)[["key", "cell"]].itertuples(index=False))
    cells = {}
    for setting in study.groups():
        for arm, part in study.part(setting).groupby("arm"):
            key = f"{arm}|{'|'.join(map(str, setting))}"
            if key not in known:
                known[key] = structure_of_config(study.runs[part["run"].iloc[0]].config).cell()
            cells[arm, setting] = known[key]
    if cache is not None:
        pd.DataFrame(sorted(known.items()), columns=["key", "cell"]).to_csv(cache, index=False)
    return cells


def post_hoc_section(changes: list[str]) -> str:
    """The changes made after jobs had run (plan.yaml ``post_hoc_changes``), one per line, or that there were none."""
    if not changes:
        return ("None recorded. A change to the plan, a rule or a setting after its jobs have run goes to "
                "`post_hoc_changes` in conf/recall/plan.yaml with the runs it affected, and is listed here.")
    return "\n".join(f"{i}. {change}" for i, change in enumerate(changes, start=1))


def write_study_report(task: str, root: Path, study: StudyRuns, plan: dict, arms: list[str], table: dict[tuple, dict],
                       keys: list[str], not_done: list, figures: Path | None) -> None:
    """``<root>/report.md`` (a table per length and pair count, with the structural column, the floor and the
    controls; where the answers come from; the steps; the rate search; the post-hoc changes), ``accuracy.csv``,
    ``structure.csv``, ``by_<breakdown>.csv``, ``curves.csv`` and the figures."""
    spec = plan["tasks"][task]
    kind = spec["breakdown"]
    disagree = plan.get("seeds_disagree", math.inf)
    structures = structure_cells(study, root / "structure.csv")
    groups = sorted({tuple(r) for r in study.frame[keys].itertuples(index=False)},
                    key=lambda t: tuple(float(v) for v in t))
    sections = [f"# Recall study: {task}\n",
                "Test accuracy per arm and setting: mean ± the half-width of the 95 % t interval (seeds) where the "
                f"seeds agree within {disagree}, else every seed with the median and range. Beside it, **alone / direct**: "
                "the share of questions whose answer is the only answer token in a region the arm can use (it could "
                "answer by pointing at the region), and the share it reads directly (longseq.report.recall_structure; "
                "NA: the arm has no regions, or no geometry at all). The guessing floor and the controls of every "
                "setting (conf/recall/plan.yaml) below the arms; a setting whose controls fail is not trained. "
                f"Columns marked with {BESIDE}'s recipe are its runs (one rate for every setting, patience from the "
                "first validation, caps of 2,000 / 2,500 steps), read beside this study's.\n"]
    for values in groups:
        part = study.subset(keys, values)
        title = ", ".join(f"{SHORT_NAMES.get(k, k)} = {v}" for k, v in zip(keys, values))
        sections += [f"\n## {title}\n", main_table(part, plan["controls"], kind, arms, structures, disagree)]
    sections += ["\n## Where the answers come from\n",
                 "Share of answers that are one of the example's candidates / accuracy among those (means over "
                 "seeds). With fillers from the whole vocabulary a value in the example need not be a pair's.\n",
                 answers_table(study, arms),
                 "\n## Steps trained\n",
                 "Mean over seeds (each seed's where they differ): where early stopping (a solved run from "
                 "trainer.min_steps on, a plateau from its patience_from) or the cap ended the runs.\n",
                 steps_table(study, arms),
                 "\n## Learning rate per arm and setting\n",
                 "Best validation accuracy of each searched rate on seed 1 (bold: the rate chosen, whose run is the "
                 f"seed-1 result; rates within {plan['lr_tolerance']} of the best tie, broken by the lower validation "
                 "loss). " + "".join(f"{a} takes {b}'s rate. " for a, b in plan.get("lr_from", {}).items()) + "\n",
                 rate_search_table(table, keys, arms),
                 "\n## Changes made after jobs had run\n",
                 post_hoc_section(plan.get("post_hoc_changes", {}).get(task, []))]
    if not_done:
        sections.append(f"\nNot completed: {len(not_done)} job(s) "
                        f"(python -m longseq.report.recall_study {task} --status).")
    (root / "report.md").write_text("\n".join(sections) + "\n")
    summary(study).to_csv(root / "accuracy.csv", index=False)
    breakdown, curves = breakdown_frame(study, kind), curves_frame(study)
    breakdown.to_csv(root / f"by_{kind}.csv", index=False)
    curves.to_csv(root / "curves.csv", index=False)
    untrained = untrained_settings(study, plan["controls"], kind)
    drawn = [draw_accuracy(study, root / "accuracy.png", untrained),
             draw_breakdown(study, breakdown, kind, root / f"by_{kind}.png", untrained),
             draw_curves(study, curves, root / "curves.png", untrained)]
    for path in filter(None, drawn):
        if figures is not None:
            figures.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, figures / f"recall_{task}_{path.name}")
    print(f"wrote {root / 'report.md'} and its CSV files and figures")


# ----------------------------------------------------------------------------------------------------
# Figures


def _panels(study: StudyRuns, n: int, height: float = 3.6):
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    columns = min(n, 4)
    rows = math.ceil(n / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, height * rows), squeeze=False, sharey=True)
    return fig, [ax for line in axes for ax in line]


def _styles(arms: list[str]) -> dict[str, dict]:
    from longseq.bench.report import curve_styles

    styles = curve_styles(sorted(arms), ["test"])
    return {arm: styles[arm, "test"] for arm in arms}


def floor_line(ax, floor: float) -> None:
    ax.axhline(floor, color="black", linestyle="--", linewidth=1, label="guessing floor")


def _finish(fig, axes, used: int, path: Path, ylabel: str) -> Path:
    for ax in axes[used:]:
        ax.set_visible(False)
    axes[0].set_ylabel(ylabel)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def draw_panels(study: StudyRuns, path: Path, ylabel: str, draw, untrained: frozenset = frozenset()) -> Path | None:
    """One panel per setting, ``draw(ax, setting)`` filling it; each panel gets the setting's floor (dashed), its
    title and a 0-1 accuracy axis. The panels of ``untrained`` settings (controls failed) say so in red: what they
    show is not a result."""
    settings = study.groups()
    if not settings:
        return None
    fig, axes = _panels(study, len(settings))
    for ax, setting in zip(axes, settings):
        draw(ax, setting)
        floor_line(ax, study.floor(setting))
        title = study.setting_label(setting)
        if setting in untrained:
            title += f"\n{NOT_TRAINED.upper()}: its controls fail"
        ax.set_title(title, fontsize=8, color="tab:red" if setting in untrained else "black")
        ax.set_ylim(0, 1.02)
    return _finish(fig, axes, len(settings), path, ylabel)


def bucket_order(buckets, kind: str) -> list[str]:
    """Distances by their lower end, depths by value, the needle's ``repeat`` last."""
    def key(bucket: str) -> tuple:
        if kind == "distance":
            return (0, distance_range(bucket)[0])
        return (0, float(bucket)) if _is_number(bucket) else (1, 0.0)

    return sorted(set(buckets), key=key)


def draw_accuracy(study: StudyRuns, path: Path, untrained: frozenset = frozenset()) -> Path | None:
    """Test accuracy per arm (bars with 95 % t intervals), one panel per setting, the floor dashed; an ``untrained``
    setting's bars grey."""
    table = summary(study)

    def draw(ax, setting: tuple) -> None:
        part = table[setting_mask(table, study.settings, setting)].sort_values("mean", ascending=False)
        colour = "lightgrey" if setting in untrained else "tab:blue"
        ax.bar(range(len(part)), part["mean"], yerr=part["half"].fillna(0), color=colour, capsize=2)
        ax.set_xticks(range(len(part)), part["arm"], rotation=70, fontsize=7)

    return draw_panels(study, path, "test accuracy", draw, untrained)


def draw_breakdown(study: StudyRuns, frame: pd.DataFrame, kind: str, path: Path,
                   untrained: frozenset = frozenset()) -> Path | None:
    """Accuracy against the bucket (MQAR: question-to-key distance; needle: depth), one panel per setting, a line per
    arm, the floor dashed."""
    if frame.empty:
        return None
    styles = _styles(sorted(frame["arm"].unique()))

    def draw(ax, setting: tuple) -> None:
        part = frame[setting_mask(frame, study.settings, setting)]
        order = bucket_order(part["bucket"], kind)
        x = {b: i for i, b in enumerate(order)}
        for arm, rows in part.groupby("arm", sort=True):
            rows = rows.assign(x=rows["bucket"].map(x)).sort_values("x")
            ax.plot(rows["x"], rows["acc"], label=arm, **styles[arm])
        ax.set_xticks(range(len(order)), order, rotation=45, fontsize=7)
        ax.set_xlabel("question-to-key distance (tokens)" if kind == "distance" else "needle depth")

    return draw_panels(study, path, f"test accuracy by {kind}", draw, untrained)


def draw_curves(study: StudyRuns, curves: pd.DataFrame, path: Path, untrained: frozenset = frozenset()) -> Path | None:
    """Validation accuracy against steps, one panel per setting, a line per run (colour: arm), the floor dashed."""
    if curves.empty:
        return None
    styles = _styles(sorted(curves["arm"].unique()))

    def draw(ax, setting: tuple) -> None:
        part = curves[setting_mask(curves, study.settings, setting)]
        for (arm, seed), rows in part.groupby(["arm", "seed"], sort=True):
            style = {k: v for k, v in styles[arm].items() if k != "marker"}
            ax.plot(rows["step"], rows["val/acc"], label=arm if seed == part["seed"].min() else None, alpha=0.8,
                    **style)
        ax.set_xlabel("optimizer step")

    return draw_panels(study, path, "validation accuracy", draw, untrained)
