"""The sweep: attentions x lengths x modes -> results.csv, plot.png, env.json and console tables."""

from __future__ import annotations

import datetime as dt
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from longseq.bench import cell as cells
from longseq.bench import report
from longseq.bench.specs import CONF_DIR, build_spec, select_attentions

REPO_ROOT = CONF_DIR.parent
MODES = ("fwd", "fwd_bwd")


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("device=cuda requested but torch.cuda.is_available() is False; use device=cpu")
    return device


def output_directory(out_dir: str) -> Path:
    """``<out_dir>/<timestamp>/`` with a relative ``out_dir`` taken from the repository root."""
    base = Path(out_dir).expanduser()
    if not base.is_absolute():
        base = REPO_ROOT / base
    stamp = dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    path, suffix = base / stamp, 1
    while path.exists():
        path, suffix = base / f"{stamp}_{suffix}", suffix + 1
    path.mkdir(parents=True)
    return path


def validate(cfg: DictConfig) -> None:
    modes = list(cfg.mode) if not isinstance(cfg.mode, str) else [cfg.mode]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"mode: unknown {unknown}; valid: {list(MODES)}")
    if cfg.dtype not in cells.DTYPES:
        raise SystemExit(f"dtype: '{cfg.dtype}' unknown; valid: {sorted(cells.DTYPES)}")
    if cfg.repeats < 1 or cfg.budget_s <= 0:
        raise SystemExit("repeats must be >= 1 (>= 5 for quoted numbers) and budget_s > 0")
    if cfg.unsupported_causal not in ("fallback", "skip"):
        raise SystemExit("unsupported_causal: valid values are fallback, skip")
    if cfg.allocator not in cells.ALLOCATORS:
        raise SystemExit(f"allocator: '{cfg.allocator}' unknown; valid: {list(cells.ALLOCATORS)}")


BUSY_CORES = 0.25  # CPU used by other processes (in cores) above which timings are not trustworthy


def other_cpu_load(seconds: float = 1.0) -> float:
    """Cores kept busy by other processes while this one sleeps ``seconds`` (from /proc/stat; 0.0 elsewhere)."""
    def busy_total() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields) - idle, sum(fields)

    if not Path("/proc/stat").is_file():
        return 0.0
    busy0, total0 = busy_total()
    time.sleep(seconds)
    busy1, total1 = busy_total()
    return (busy1 - busy0) / max(1, total1 - total0) * (os.cpu_count() or 1)


def warn_if_busy(console: Console, load: float, when: str) -> None:
    """Print a warning when other processes used the CPU: the timings of this run are then not comparable."""
    if load > BUSY_CORES:
        # soft_wrap: one line that the terminal folds, never rich's hard breaks at 80 columns in a piped log
        console.print(f"[bold red]warning[/bold red]: other processes kept {load:.2f} of {os.cpu_count()} cores busy "
                      f"{when}; timings and ratios from this run are not reliable (rerun on a quiet machine)",
                      soft_wrap=True)


def run_benchmark(cfg: DictConfig, console: Console | None = None) -> Path:
    """Run the whole sweep described by ``cfg`` (conf/bench.yaml) and return the output directory."""
    console = console or Console(highlight=False)
    validate(cfg)
    device = resolve_device(str(cfg.device))
    isolate = device == "cpu" if cfg.isolate == "auto" else bool(cfg.isolate)
    names = select_attentions(OmegaConf.to_object(cfg.attentions) if OmegaConf.is_config(cfg.attentions)
                              else cfg.attentions)
    lengths = sorted(int(n) for n in cfg.lengths)
    modes = [cfg.mode] if isinstance(cfg.mode, str) else list(cfg.mode)
    out = output_directory(str(cfg.out_dir))

    memory_method = cells.cpu_memory_method() if device == "cpu" else "cuda"
    env = report.environment(device, cfg.threads, memory_method, isolate)
    env["isolated_cells"] = isolate
    env["allocator"] = cfg.allocator
    env["other_cpu_load_before"] = round(other_cpu_load(), 2)
    report.write_json(env, out / "env.json")
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    console.rule("longseq.bench")
    for key, value in env.items():
        console.print(f"[bold]{key}[/bold]: {value}", soft_wrap=True)
    warn_if_busy(console, env["other_cpu_load_before"], "before the run")
    console.print(f"attentions ({len(names)}): {', '.join(names)}", soft_wrap=True)
    console.print(f"lengths: {lengths}  modes: {modes}  B={cfg.batch} H={cfg.heads} D={cfg.head_dim} "
                  f"dtype={cfg.dtype} causal={cfg.causal} repeats={cfg.repeats} budget_s={cfg.budget_s}", soft_wrap=True)

    rows: list[dict[str, Any]] = []
    for name in names:
        stopped: dict[str, tuple[str, str]] = {}  # mode -> (status, note) for the longer lengths
        for length in lengths:
            spec = build_spec(name, length, causal=bool(cfg.causal), n_heads=cfg.heads, head_dim=cfg.head_dim,
                              block_size=cfg.block_size, unsupported_causal=cfg.unsupported_causal)
            for mode in modes:
                row: dict[str, Any] = {
                    "attention": name, "length": length, "mode": mode, "causal": spec.causal,
                    "block_size": spec.block_size, "n_clusters": spec.n_clusters, "batch": cfg.batch,
                    "heads": cfg.heads, "head_dim": cfg.head_dim, "dtype": cfg.dtype, "device": device,
                    "repeats": cfg.repeats,
                }
                if spec.skip_reason:
                    result = cells.CellResult("skipped", note=spec.skip_reason)
                elif mode in stopped:
                    status, note = stopped[mode]
                    result = cells.CellResult(status, note=note)
                else:
                    cell_spec = cells.CellSpec(
                        attention=spec.registry_name, length=length, mode=mode, kwargs=spec.kwargs, batch=cfg.batch,
                        heads=cfg.heads, head_dim=cfg.head_dim, dtype=cfg.dtype, device=device,
                        warmup=cfg.warmup, repeats=cfg.repeats, budget_s=float(cfg.budget_s),
                        threads=cfg.threads, seed=cfg.seed, allocator=cfg.allocator,
                    )
                    result = cells.run_isolated(cell_spec) if isolate else cells.measure_cell(cell_spec)
                    if result.status in ("oom", "over_budget") and cfg.skip_longer_after_failure:
                        stopped[mode] = (result.status, f"not run: {result.status} at L={length}")
                    if spec.note and result.status == "ok":
                        result.note = spec.note
                row.update(result.as_dict())
                rows.append(row)
                console.print(f"  {name:28s} L={length:<6d} {mode:8s} {_progress_text(row)}",
                              markup=False, soft_wrap=True)

    after = other_cpu_load()
    env["other_cpu_load_after"] = round(after, 2)
    report.write_json(env, out / "env.json")
    warn_if_busy(console, after, "after the run")
    report.add_ratios(rows)
    tiles = cfg.get("tiles")
    tile_rows = flex_tile_rows(names, cfg, console) if tiles and tiles.lengths else []
    by_key = {(r["attention"], r["length"]): r["flex_tiles"] for r in tile_rows}
    for row in rows:
        row["flex_tiles"] = by_key.get((row["attention"], row["length"]), math.nan)
    report.write_csv(rows, out / "results.csv")
    if cfg.plot and rows:
        title = (f"longseq.bench on {env['gpu'] or env['cpu']} ({device}, {env['torch_threads']} threads, "
                 f"torch {env['torch']}): B={cfg.batch} H={cfg.heads} D={cfg.head_dim} {cfg.dtype}, "
                 f"causal={cfg.causal}")
        report.plot(rows, out / "plot.png", title)

    markdown = []
    for mode in modes if rows else []:  # lengths=[]: only the sampling / throughput measurements
        markdown.append(f"### {mode}: median ms/iter (ratio to full) / peak MB above inputs\n")
        markdown.append(report.markdown_table(rows, mode) + "\n")
    if tile_rows:
        _write_rows(tile_rows, TILE_COLUMNS, out / "tiles.csv")
        markdown.append(f"### flex tiles visited / the backward's longest loop (query tiles over one key tile), each ÷ "
                        f"causal full attention's ({tiles.tile} x {tiles.tile} tiles, from the BlockMasks) / bytes one "
                        "training layer keeps for its backward ÷ its output's (bf16; full's SDPA: about 1); hardware "
                        "independent\n")
        markdown.append(tiles_table(tile_rows) + "\n")
    if cfg.throughput:
        from longseq.bench.throughput import THROUGHPUT_COLUMNS, measure_throughput

        step = cfg.train_step
        requested = step.attentions
        step_names = names if requested is None else select_attentions(
            OmegaConf.to_object(requested) if OmegaConf.is_config(requested) else requested)
        console.print(f"training throughput ({len(step_names)} attentions, L={step.seq_len}, batch {step.batch}) ...")
        step_rows = measure_throughput(step_names, step, device)
        _write_rows(step_rows, THROUGHPUT_COLUMNS, out / "throughput.csv")
        markdown.append(f"### training step: tokens/s, L={step.seq_len}, batch {step.batch}, "
                        f"{step.n_layers} layers d={step.d_model}, AdamW\n")
        markdown.append(report.throughput_table(step_rows) + "\n")
    if cfg.get("sample"):
        markdown += run_sampling(cfg, device, console, out)
    text = "\n".join(markdown)
    (out / "results.md").write_text(text)
    console.rule("results")
    console.out(text, highlight=False)  # raw markdown, never wrapped, so it can be pasted
    console.print(f"wrote {out}/results.csv, plot.png, env.json, results.md")
    return out


TILE_COLUMNS = ["attention", "length", "causal", "block_size", "tile", *cells.FLEX_FIGURES, "note"]
TABLE_FIGURES = {"flex_tiles": ".3f", "flex_longest_loop": ".3f", "flex_kept": ".1f"}  # per cell, in this order


def flex_tile_rows(names: list[str], cfg: DictConfig, console: Console) -> list[dict[str, Any]]:
    """The hardware-independent columns (``tiles``: lengths, tile): per attention and length, the tiles the flex
    backend's block masks visit and their backward's longest loop, each divided by causal full attention's, and what
    one training layer keeps for its backward in units of its output (``cells.flex_figures``; NaN with the reason
    where a variant has no flex layout). Geometry as in the sweep (``build_spec``)."""
    tiles = cfg.tiles
    console.print(f"flex tiles visited and bytes kept for backward (L={list(tiles.lengths)}, tile {tiles.tile}) ...")
    rows = []
    for name in names:
        for length in sorted(int(n) for n in tiles.lengths):
            spec = build_spec(name, length, causal=bool(cfg.causal), n_heads=cfg.heads, head_dim=cfg.head_dim,
                              block_size=cfg.block_size, unsupported_causal=cfg.unsupported_causal)
            figures = (cells.no_flex_figures(spec.skip_reason) if spec.skip_reason
                       else cells.flex_figures(spec.registry_name, length, spec.kwargs, int(tiles.tile)))
            rows.append({"attention": name, "length": length, "causal": spec.causal, "block_size": spec.block_size,
                         "tile": int(tiles.tile), **figures, "note": figures["note"] or spec.note})
    return rows


def tiles_table(rows: list[dict[str, Any]]) -> str:
    """One row per attention, one column per length: tiles visited ÷ causal full's / the backward's longest loop ÷
    causal full's / bytes kept for the backward ÷ the output's, each ``-`` where it does not apply."""
    lengths = sorted({r["length"] for r in rows})
    by_key = {(r["attention"], r["length"]): r for r in rows}
    lines = ["| attention | causal | " + " | ".join(f"L={n}" for n in lengths) + " |", "|" + "---|" * (len(lengths) + 2)]
    for name in dict.fromkeys(r["attention"] for r in rows):
        cells_ = [by_key[(name, n)] for n in lengths]
        values = [" / ".join("-" if math.isnan(r[key]) else format(r[key], spec) for key, spec in TABLE_FIGURES.items())
                  for r in cells_]
        lines.append(f"| {name} | {str(cells_[0]['causal']).lower()} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def run_sampling(cfg: DictConfig, device: str, console: Console, out: Path) -> list[str]:
    """``sample=true``: sampling tokens/s cached vs recompute (``sampling.csv``) and one layer's per-step time
    against position (``decode_steps.csv``), per ``cfg.sampling``; returns the markdown sections."""
    from longseq.bench import sampling

    spec = cfg.sampling
    names = select_attentions(OmegaConf.to_object(spec.attentions) if OmegaConf.is_config(spec.attentions)
                              else spec.attentions)
    console.print(f"sampling ({len(names)} attentions, L={spec.seq_len}, batch {spec.batch}) ...")
    rows = sampling.measure_sampling(names, spec, device)
    _write_rows(rows, sampling.SAMPLING_COLUMNS, out / "sampling.csv")
    console.print(f"per-step time of one layer (L={list(spec.step_lengths)}) ...")
    step_rows = sampling.measure_decode_steps(names, spec, device)
    _write_rows(step_rows, sampling.STEP_COLUMNS, out / "decode_steps.csv")
    console.print(f"wrote {out}/sampling.csv, decode_steps.csv")
    return [f"### sampling: tokens/s, L={spec.seq_len}, batch {spec.batch}, {spec.n_layers} layers d={spec.d_model}\n",
            sampling.sampling_table(rows) + "\n",
            f"### one layer's decoding step: ms by position, batch {spec.batch}, H={spec.n_heads}\n",
            sampling.steps_table(step_rows) + "\n"]


def _progress_text(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row['note']}"
    memory = "" if math.isnan(row["peak_mem_mb"]) else f"  peak {row['peak_mem_mb']:.1f} MB"
    return f"{row['ms']:9.2f} ms{memory}"


def _write_rows(rows: list[dict[str, Any]], columns: list[str], path: Path) -> None:
    import csv

    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: report._csv_value(row.get(k)) for k in columns})
