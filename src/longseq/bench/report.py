"""Benchmark outputs: environment record, results.csv, the Fig. 3-style plot and the markdown table."""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

# results.csv column order: the required six first, then the context of each row.
COLUMNS = [
    "attention", "length", "mode", "ms", "peak_mem_mb", "ratio_to_full",
    "status", "note", "causal", "block_size", "n_clusters", "batch", "heads", "head_dim", "dtype", "device",
    "repeats", "ms_min", "ms_max", "warmup_ms", "input_mem_mb",
    "flex_tiles",  # tiles the flex backend's block masks visit ÷ causal full's (bench.run.flex_tile_rows; no timing)
]


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (falls back to ``platform.processor()``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment(device: str, threads: int | None, memory_method: str, isolated: bool) -> dict[str, Any]:
    """What the numbers depend on: versions, threads, CPU/GPU names, memory method."""
    if threads:
        torch.set_num_threads(threads)
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "lightning": _version("lightning"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "peak_memory_method": (
            "torch.cuda.max_memory_allocated minus allocated after inputs"
            if device.startswith("cuda")
            else f"CPU RSS, {'fresh process per cell' if isolated else 'in-process (approximate)'}: {memory_method}"
        ),
        "git_commit": git_commit(),
    }
    return env


def _version(package: str) -> str | None:
    """Installed version without importing the package (importing lightning takes seconds)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The checked-out commit (read-only query), or None outside a repository / before the first commit."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parents[3])
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``ratio_to_full = ms / full ms`` at the same length, mode and compile mode (the GPU check's), measured in this
    run."""
    def key(r):
        return r["length"], r["mode"], r.get("compile", "none")

    full_ms = {key(r): r["ms"] for r in rows if r["attention"] == "full" and r["status"] == "ok"}
    for row in rows:
        reference = full_ms.get(key(row))
        ok = row["status"] == "ok" and reference and not math.isnan(row["ms"])
        row["ratio_to_full"] = row["ms"] / reference if ok else math.nan


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(row.get(k)) for k in COLUMNS})


def _csv_value(value: Any) -> Any:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return "" if value is None else value


def write_json(data: Any, path: Path) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


FAMILY_COLOURS = {"dense": "Greys", "sparse": "Blues", "combiner": "Reds", "efficient": "Greens", "other": "Purples"}
MARKERS = "osD^v<>pP*Xh"
LINESTYLES = ("-", "--", "-.", ":")
MODE_STYLES = {"fwd": "-", "fwd_bwd": "--"}


def family(label: str) -> str:
    """The registry family of a bench label (``combiner_axial:row_summary=none`` -> ``combiner``); ``other``
    for a name the registry does not hold."""
    from longseq.attention import ATTENTION_REGISTRY

    factory = ATTENTION_REGISTRY.get(label.split(":", 1)[0])
    return getattr(getattr(factory, "cls", None), "family", None) or "other"


def curve_styles(names: list[str], modes: list[str]) -> dict[tuple[str, str], dict[str, Any]]:
    """``(attention, mode) -> matplotlib line style``: one hue per family (its members in shades of it), and
    within a family a distinct marker each; the line style tells the mode apart when there are several, else
    it is one more per-member cue. So 26 attentions stay distinguishable in print and without colour."""
    from matplotlib import colormaps

    members: dict[str, list[str]] = {}
    for name in names:
        members.setdefault(family(name), []).append(name)
    styles = {}
    for fam, group in members.items():
        cmap = colormaps[FAMILY_COLOURS.get(fam, "Purples")]
        for index, name in enumerate(group):
            shade = 0.85 if len(group) == 1 else 0.95 - 0.55 * index / (len(group) - 1)  # dark to light
            for mode in modes:
                linestyle = (MODE_STYLES.get(mode, ":") if len(modes) > 1
                             else LINESTYLES[index % len(LINESTYLES)])
                styles[name, mode] = dict(color=cmap(shade), marker=MARKERS[index % len(MARKERS)],
                                          linestyle=linestyle, markersize=4.5, linewidth=1.4)
    return styles


# The figure's panels, in order: (group, title). A variant's group is its registry family, except that the variants
# built on query-dependent block selection (``ops/block_select.py``) get their own; dense ``full`` is the reference
# drawn in every panel.
PANELS = (("sparse", "sparse"), ("combiner", "Combiner"), ("efficient", "kernel / low-rank (efficient)"),
          ("block selection", "block selection"), ("other", "other"))
REFERENCE = "full"


def selects_blocks(label: str) -> bool:
    """True for a variant whose module is built on ``ops/block_select.py`` (query-dependent block selection: moba,
    nsa, combiner_select), whichever family folder it lives in."""
    import sys

    from longseq.attention import ATTENTION_REGISTRY

    cls = getattr(ATTENTION_REGISTRY.get(label.split(":", 1)[0]), "cls", None)
    module = sys.modules.get(getattr(cls, "__module__", ""))
    return module is not None and any(getattr(value, "__module__", None) == "longseq.attention.ops.block_select"
                                      for value in vars(module).values())


def panel_of(label: str) -> str:
    """The figure panel of a bench label: ``block selection`` or the variant's family."""
    return "block selection" if selects_blocks(label) else family(label)


def benchmark_figure(rows: list[dict[str, Any]], title: str, figure=None):
    """The Combiner paper's Fig. 3, one column of panels per family: time as the ratio to ``full`` at the same length
    and mode (top) and peak memory (bottom) against length, log-log; returns the figure.

    Columns: sparse, Combiner, kernel / low-rank, block selection (and ``other`` for names outside the registry),
    each drawn only when the rows hold one of its variants, with ``full`` in every panel as the reference (its ratio
    is 1) and its own legend below it. Rows share their y axis, so families compare across columns. Colours follow
    ``curve_styles`` (a hue per family, a marker per member, the line style per mode). Cells that did not run (oom,
    over budget, error), and times at a length where ``full`` did not run, are left out. ``figure``: draw into this
    one (the notebook passes ``plt.figure()`` to show it inline); default a new ``matplotlib.figure.Figure`` that no
    pyplot state holds. The one plotting function of ``make bench`` (``plot``), ``python -m longseq.bench.replot``
    and ``notebooks/benchmark.ipynb``.
    """
    from matplotlib.figure import Figure

    rows = [dict(r) for r in rows]
    add_ratios(rows)  # the one ratio rule: ms / full's ms at the same length and mode, in this run
    ok = [r for r in rows if r["status"] == "ok"]
    names = list(dict.fromkeys(r["attention"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    styles = curve_styles(names, modes)
    members = {group: [n for n in names if n != REFERENCE and panel_of(n) == group] for group, _ in PANELS}
    panels = [(group, heading) for group, heading in PANELS if members[group]]
    figure = figure if figure is not None else Figure()
    figure.set_size_inches(4.3 * max(1, len(panels)), 9.5)
    axes = figure.subplots(2, max(1, len(panels)), sharex=True, sharey="row", squeeze=False)

    def curve(name: str, mode: str) -> list[dict[str, Any]]:
        return sorted((r for r in ok if r["attention"] == name and r["mode"] == mode), key=lambda r: r["length"])

    for column, (group, heading) in enumerate(panels):
        time_axis, memory_axis = axes[0][column], axes[1][column]
        handles, labels = [], []
        for name in ([REFERENCE] if REFERENCE in names else []) + members[group]:
            for mode in modes:
                cells = curve(name, mode)
                timed = [(r["length"], r["ratio_to_full"]) for r in cells if not math.isnan(r["ratio_to_full"])]
                # zero growth (below the page granularity) cannot sit on a log axis
                memory = [(r["length"], max(float(r["peak_mem_mb"]), 1e-2)) for r in cells
                          if not math.isnan(float(r["peak_mem_mb"]))]
                style = dict(styles[name, mode], linewidth=2.2 if name == REFERENCE else 1.4)
                line = None
                if timed:
                    (line,) = time_axis.plot(*zip(*timed), **style)
                if memory:
                    (drawn,) = memory_axis.plot(*zip(*memory), **style)
                    line = line or drawn
                if line is not None:
                    handles.append(line)
                    labels.append((f"{name} (reference)" if name == REFERENCE else name)
                                  + (f", {mode}" if len(modes) > 1 else ""))
        time_axis.set_title(f"{heading} ({len(members[group])})", fontsize=10)
        memory_axis.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=7.5,
                           ncol=2 if len(handles) > 8 else 1, handlelength=3, frameon=False)
    for axis in axes.flat:
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.grid(True, which="both", alpha=0.3)
    for axis in axes[1]:
        axis.set_xlabel("sequence length L")
    axes[0][0].set_ylabel("time / full's time (median ms, same L)")
    axes[1][0].set_ylabel("peak memory above inputs (MB)")
    styles_note = "; solid fwd, dashed fwd_bwd" if len(modes) > 1 else ""
    figure.suptitle(f"{title}\nfull (the thick dark line) is the reference in every panel{styles_note}",
                    fontsize=10)
    figure.tight_layout()
    return figure


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """``benchmark_figure`` saved to ``path`` (PNG)."""
    benchmark_figure(rows, title).savefig(path, dpi=120, bbox_inches="tight")


def read_results(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``results.csv`` (``write_csv``'s columns), numbers as numbers (an empty cell is NaN)."""
    def number(text: str | None) -> float:
        return float(text) if text not in (None, "") else math.nan

    with Path(path).open(newline="") as handle:
        return [{**row, "length": int(row["length"]), "ms": number(row["ms"]),
                 "peak_mem_mb": number(row["peak_mem_mb"])} for row in csv.DictReader(handle)]


def markdown_table(rows: list[dict[str, Any]], mode: str) -> str:
    """One row per attention, one column per length: ``ms (ratio to full) / peak MB`` or the status."""
    lengths = sorted({r["length"] for r in rows if r["mode"] == mode})
    attentions = list(dict.fromkeys(r["attention"] for r in rows if r["mode"] == mode))
    by_key = {(r["attention"], r["length"]): r for r in rows if r["mode"] == mode}
    header = "| attention | causal | " + " | ".join(f"L={n}" for n in lengths) + " |"
    lines = [header, "|" + "---|" * (len(lengths) + 2)]
    notes: dict[str, set[str]] = {}
    for name in attentions:
        cells, causal = [], ""
        for n in lengths:
            row = by_key.get((name, n))
            if row is None:
                cells.append("")
                continue
            causal = str(row["causal"]).lower()
            if row.get("note"):
                notes.setdefault(name, set()).add(row["note"] if row["status"] == "ok" else f"L={n}: {row['note']}")
            cells.append(_format_cell(row))
        lines.append(f"| {name}{' †' if name in notes else ''} | {causal} | " + " | ".join(cells) + " |")
    if notes:
        lines.append("")
        lines += [f"- † {name}: {'; '.join(sorted(text))}" for name, text in notes.items()]
    return "\n".join(lines)


def _format_cell(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return row["status"]
    ratio = row.get("ratio_to_full", math.nan)
    ratio_text = "" if ratio is None or math.isnan(ratio) else f" ({ratio:.2f}x)"
    memory = row["peak_mem_mb"]
    memory_text = "" if math.isnan(memory) else f" / {memory:.1f} MB"
    return f"{row['ms']:.2f} ms{ratio_text}{memory_text}"


def throughput_table(rows: list[dict[str, Any]]) -> str:
    """Markdown for the training-throughput rows."""
    lines = ["| attention | tokens/s (Lightning) | tokens/s (bare loop) | Lightning / bare step time | status |",
             "|---|---|---|---|---|"]
    for r in rows:
        def fmt(value: Any, spec: str) -> str:
            return "" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)

        hybrid = len(set(str(r.get("layers") or "").split(","))) > 1  # train_step.layer_attention: say each layer's
        label = f"{r['attention']} (layers {r['layers']})" if hybrid else r["attention"]
        lines.append(f"| {label} | {fmt(r.get('tokens_per_s_lightning'), ',.0f')} | "
                     f"{fmt(r.get('tokens_per_s_bare'), ',.0f')} | {fmt(r.get('lightning_overhead'), '.3f')} | "
                     f"{r['status']}{(': ' + r['note']) if r.get('note') else ''} |")
    return "\n".join(lines)
