"""The recall study's tables and figures, from its finished jobs (``longseq.report.recall_study`` writes them).

Every table and figure carries its floor and its controls (conf/recall/plan.yaml):

- the **guessing floor** of each setting (``longseq.data.recall.guess_floor``: MQAR 1/D, the needle 1/K), a column of
  every table and a dashed line in every figure;
- the **controls**: the positive ones (``full`` and ``local_long``, a window longer than every gap) must reach
  ``controls.pass``, and on MQAR the short-window ``local_short`` must answer the questions inside its window and stay
  at the floor beyond its reach; a setting whose controls fail is **not trained** and its cells hold no number;
- per arm, where its answers come from: the share that are one of the example's candidates (``in_example``) and how
  many of those are right (``in_example_acc``: 1/D for a model that only guesses among the values);
- accuracy by the question's distance to its key (MQAR) or the needle's depth, and validation accuracy against steps
  for every run.

Cells are ``mean ± h (n)``: the mean over seeds and the half-width of its 95 % Student-t interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from longseq.report.runs import RunRecord, learning_curves
from longseq.report.table import markdown_table

ARM_KEY = "recall_arm"  # set by every conf/recall/arm/<name>.yaml
NOT_TRAINED = "not trained"


def t_interval(values: pd.Series) -> float:
    """Half-width of the 95 % Student-t interval of the mean (NaN for fewer than two values)."""
    from scipy.stats import t

    n = values.count()
    return float(t.ppf(0.975, n - 1) * values.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan


def cell(mean: float, half: float, n: int, digits: int = 3) -> str:
    if n < 2 or math.isnan(half):
        return f"{mean:.{digits}f} (1)"
    return f"{mean:.{digits}f} ± {half:.{digits}f} ({n})"


def run_floor(run: RunRecord) -> float:
    """The guessing floor of the run's own task (the generator built from its resolved config)."""
    from omegaconf import OmegaConf

    from longseq.data.recall import GENERATORS, guess_floor

    module = OmegaConf.to_container(run.config.task.module, resolve=True)
    return guess_floor(GENERATORS[module["name"]](**module["generator"]))


@dataclass
class StudyRuns:
    """The completed runs of a study as one frame: a row per run with its arm, setting keys, seed, floor and test
    metrics; ``settings`` are the keys whose combinations are the table's columns."""

    frame: pd.DataFrame
    runs: dict[str, RunRecord]
    settings: list[str]

    @classmethod
    def load(cls, runs: list[RunRecord], settings: list[str]) -> StudyRuns:
        rows = []
        for run in runs:
            if run.status != "completed" or "test/acc" not in run.metrics:
                continue
            row = {"run": str(run.path), "arm": run.value(ARM_KEY) or run.value("attention"),
                   "seed": int(run.value("seed") or 0), "floor": run_floor(run),
                   **{key: run.value(key) for key in settings}}
            row.update({k: float(v) for k, v in run.metrics.items() if k.startswith(("test/", "val/acc_best"))
                        and isinstance(v, (int, float))})
            curve = learning_curves(run, "val/acc")
            row["steps"] = int(curve["step"].max()) + 1 if len(curve) else 0  # where early stopping or the cap ended
            rows.append(row)
        frame = pd.DataFrame(rows)
        return cls(frame=frame, runs={str(r.path): r for r in runs}, settings=settings)

    def setting_label(self, values: tuple) -> str:
        names = {"task.seq_len": "L", "task.num_pairs": "D", "task.power_a": "gaps", "task.num_needles": "K"}
        parts = []
        for key, value in zip(self.settings, values):
            if key == "task.power_a":
                parts.append("uniform gaps" if float(value) == 1.0 else f"power law a = {value}")
            else:
                parts.append(f"{names.get(key, key)} = {value}")
        return ", ".join(parts)

    def groups(self) -> list[tuple]:
        if self.frame.empty:
            return []
        return sorted({tuple(r) for r in self.frame[self.settings].itertuples(index=False)},
                      key=lambda t: tuple(float(v) if _is_number(v) else v for v in t))

    def part(self, setting: tuple, arm: str | None = None) -> pd.DataFrame:
        """The runs of one setting (and arm)."""
        mask = setting_mask(self.frame, self.settings, setting)
        if arm is not None:
            mask &= self.frame["arm"] == arm
        return self.frame[mask]

    def floor(self, setting: tuple) -> float:
        return float(self.part(setting)["floor"].iloc[0])


def setting_mask(table: pd.DataFrame, keys: list[str], setting: tuple) -> pd.Series:
    """Rows of ``table`` whose ``keys`` hold the values of ``setting``."""
    mask = pd.Series(True, index=table.index)
    for key, value in zip(keys, setting):
        mask &= table[key] == value
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


def reach_accuracy(runs: list[RunRecord], window: int, reach: int) -> tuple[float, float]:
    """Pooled accuracy of ``runs`` on the questions whose key is inside ``window`` (distance < window) and on those
    beyond ``reach`` (distance > reach), from their per-distance test tables."""
    inside, beyond = [0.0, 0], [0.0, 0]
    for run in runs:
        for row in bucket_counts(run, "distance").itertuples(index=False):
            lo, hi = distance_range(row.distance)
            target = inside if hi < window else beyond if lo > reach else None
            if target is not None:
                target[0] += row.acc * row.questions
                target[1] += row.questions
    return (inside[0] / inside[1] if inside[1] else math.nan, beyond[0] / beyond[1] if beyond[1] else math.nan)


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
            inside, beyond = reach_accuracy(runs, window, reach)
            floor = study.floor(setting)
            ok_in = not math.isnan(inside) and inside >= controls["inside"]
            ok_out = not math.isnan(beyond) and beyond <= floor + controls["margin"]
            trained &= ok_in and ok_out
            lines.append(f"{short} (window {window}): inside {inside:.3f} {'≥' if ok_in else '<'} "
                         f"{controls['inside']}, beyond {reach} tokens {beyond:.3f} {'≤' if ok_out else '>'} "
                         f"floor + {controls['margin']}")
    elif short and not part.empty:
        lines.append(f"{short} {part['test/acc'].mean():.3f} (reported, not judged: no distance breakdown)")
    return ControlVerdict(trained=trained, lines=lines)


# ----------------------------------------------------------------------------------------------------
# Tables


def summary(study: StudyRuns, metric: str = "test/acc") -> pd.DataFrame:
    """Mean, 95 % t half-width and n of ``metric`` per (setting, arm), with the setting's floor."""
    if study.frame.empty or metric not in study.frame:
        return pd.DataFrame(columns=[*study.settings, "arm", "mean", "half", "n", "floor", "seeds"])
    grouped = study.frame.groupby([*study.settings, "arm"], sort=False)
    table = grouped[metric].agg(mean="mean", half=t_interval, n="count").reset_index()
    table["floor"] = grouped["floor"].first().values
    table["seeds"] = grouped["seed"].agg(lambda s: ",".join(map(str, sorted(s)))).values
    return table


def arm_grid(study: StudyRuns, arm_order: list[str], cell_of, footer: list[list[str]]) -> str:
    """Markdown: a row per arm (``arm_order`` first), a column per setting, ``cell_of(arm, setting) -> str``; then the
    ``footer`` rows (a label and one cell per setting)."""
    settings = study.groups()
    present = set(study.frame["arm"])
    arms = [a for a in arm_order if a in present] + sorted(present - set(arm_order))
    rows = [[arm, *(cell_of(arm, setting) for setting in settings)] for arm in arms] + footer
    return markdown_table(pd.DataFrame(rows, columns=["arm", *(study.setting_label(s) for s in settings)]))


def lookup(table: pd.DataFrame, keys: list[str], arm: str, setting: tuple) -> pd.Series | None:
    """The row of ``table`` (a ``summary``) for one arm and setting, or None."""
    match = table[(table["arm"] == arm) & setting_mask(table, keys, setting)]
    return None if match.empty else match.iloc[0]


def untrained_settings(study: StudyRuns, controls: dict, breakdown: str) -> frozenset:
    """The settings whose controls fail (``judge_controls``): reported as not trained, in tables and figures."""
    return frozenset(s for s in study.groups() if not judge_controls(study, s, controls, breakdown).trained)


def main_table(study: StudyRuns, controls: dict, breakdown: str, arm_order: list[str]) -> str:
    """Test accuracy, mean ± 95 % t half-width (seeds), a row per arm and a column per setting, then the floor row
    and the controls row; a setting whose controls fail holds "not trained"."""
    table = summary(study)
    settings = study.groups()
    verdicts = {s: judge_controls(study, s, controls, breakdown) for s in settings}

    def cell_of(arm: str, setting: tuple) -> str:
        row = lookup(table, study.settings, arm, setting)
        if row is None:
            return ""
        return cell(row["mean"], row["half"], int(row["n"])) if verdicts[setting].trained else NOT_TRAINED

    footer = [["guessing floor", *(f"{study.floor(s):.3f}" for s in settings)],
              ["controls", *(("pass: " if verdicts[s].trained else "FAIL: ") + "; ".join(verdicts[s].lines)
                             for s in settings)]]
    return arm_grid(study, arm_order, cell_of, footer)


def answers_table(study: StudyRuns, arm_order: list[str]) -> str:
    """Per arm and setting, the share of answers that are one of the example's candidates and their precision
    (``in_example`` / ``in_example_acc``, means over seeds), beside the floor."""
    if "test/in_example" not in study.frame:
        return "(no run recorded test/in_example)"
    share, precision = summary(study, "test/in_example"), summary(study, "test/in_example_acc")

    def cell_of(arm: str, setting: tuple) -> str:
        s, p = (lookup(t, study.settings, arm, setting) for t in (share, precision))
        return "" if s is None else f"{s['mean']:.2f} / {p['mean']:.3f}"

    footer = [["guessing floor (precision)", *(f"{study.floor(s):.3f}" for s in study.groups())]]
    return arm_grid(study, arm_order, cell_of, footer)


def steps_table(study: StudyRuns, arm_order: list[str]) -> str:
    """Per arm and setting, the steps trained (mean over seeds): where early stopping, or the cap, ended the runs."""
    steps = summary(study, "steps")

    def cell_of(arm: str, setting: tuple) -> str:
        row = lookup(steps, study.settings, arm, setting)
        return "" if row is None else f"{row['mean']:.0f}"

    return arm_grid(study, arm_order, cell_of, [])


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
