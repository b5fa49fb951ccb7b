"""Sampling speed: cached (incremental decoding) against recompute, and the per-step time of one layer.

``python -m longseq.bench sample=true`` (``conf/bench.yaml`` ``sampling:``) writes two tables to the run's
output folder:

- ``sampling.csv`` (``SAMPLING_COLUMNS``): tokens/s of sampling with the decoding state and by recompute
  (a full-length forward per token), and their ratio, on the CIFAR-10 density geometry by default
  (L = 3072, 2 layers, d = 128, 4 heads, batch 16, block 32). Both go through the sampling loop itself
  (``longseq.tasks.sampling.autoregress``); recompute is a rate, so it is timed over the first
  ``recompute_positions`` tokens only. An attention without a decoding state gets no cached figure (note).
- ``decode_steps.csv`` (``STEP_COLUMNS``): milliseconds of one attention layer's ``step`` at several
  positions (fractions of L) for each ``step_lengths`` L, batch ``batch``, H = ``n_heads``,
  D = ``d_model / n_heads``: how the cost of a cached step grows with the position (O(t) for ``full``,
  O(m + n) for the sqrt(L) Combiner factorizations). The state is filled by ``prefill`` up to the position.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch

from longseq.bench.specs import build_spec

SAMPLING_COLUMNS = ["attention", "length", "cached_tokens_per_s", "recompute_tokens_per_s", "speedup",
                    "cached_positions", "recompute_positions", "batch", "n_layers", "d_model", "block_size",
                    "status", "note"]
STEP_COLUMNS = ["attention", "length", "position", "step_ms", "batch", "heads", "head_dim", "block_size", "status",
                "note"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _error_row(row: dict[str, Any], error: Exception) -> dict[str, Any]:
    status = "oom" if "out of memory" in str(error).lower() else "error"
    return {**row, "status": status, "note": f"{type(error).__name__}: {error}".splitlines()[0][:300]}


def sampling_rate(net: Any, start: torch.Tensor, n_new: int, cache: bool, generator: torch.Generator) -> float:
    """Tokens/s of sampling ``n_new`` tokens per sequence after ``start`` (B, 1) through the sampling loop."""
    from longseq.tasks.sampling import autoregress, pick_next

    _sync(start.device)
    began = time.perf_counter()
    autoregress(net, start, n_new, lambda logits: pick_next(logits, 1.0, generator=generator), cache=cache)
    _sync(start.device)
    return start.shape[0] * n_new / (time.perf_counter() - began)


def random_qkv(batch: int, heads: int, count: int, head_dim: int, generator: torch.Generator) -> list[torch.Tensor]:
    """q, k, v (B, H, count, D) standard normal."""
    return [torch.randn(batch, heads, count, head_dim, generator=generator, device=generator.device)
            for _ in range(3)]


def measure_sampling(names: list[str], cfg: Any, device: str) -> list[dict[str, Any]]:
    """One ``SAMPLING_COLUMNS`` row per attention: cached and recompute sampling tokens/s and the speedup."""
    from longseq.attention import DecodingNotSupported
    from longseq.models.transformer import Transformer

    torch_device = torch.device(device)
    length, batch = int(cfg.seq_len), int(cfg.batch)
    cached_positions = length if cfg.cached_positions is None else min(length, int(cfg.cached_positions))
    recompute_positions = min(length, int(cfg.recompute_positions))
    head_dim = int(cfg.d_model) // int(cfg.n_heads)
    rows = []
    for name in names:
        row: dict[str, Any] = {"attention": name, "length": length, "batch": batch, "n_layers": cfg.n_layers,
                               "d_model": cfg.d_model, "block_size": cfg.block_size, "status": "ok", "note": "",
                               "cached_positions": cached_positions, "recompute_positions": recompute_positions}
        spec = build_spec(name, length, causal=True, n_heads=int(cfg.n_heads), head_dim=head_dim,
                          block_size=cfg.block_size, unsupported_causal="skip")
        if spec.skip_reason:
            rows.append({**row, "status": "skipped", "note": spec.skip_reason})
            continue
        try:
            torch.manual_seed(0)
            net = Transformer(vocab_size=int(cfg.vocab_size) + 1, seq_len=length, n_layers=int(cfg.n_layers),
                              d_model=int(cfg.d_model), n_heads=int(cfg.n_heads), attention=spec.backbone_attention(),
                              out_dim=int(cfg.vocab_size)).to(torch_device).eval()
            start = torch.full((batch, 1), int(cfg.vocab_size), dtype=torch.long, device=torch_device)
            generator = torch.Generator(device=torch_device).manual_seed(0)
            try:
                net.new_decoding_state(batch)
                cached = sampling_rate(net, start, cached_positions, True, generator)
            except DecodingNotSupported:
                cached, row["note"] = math.nan, "no decoding state (supports_decoding=False): sampling recomputes"
            recompute = sampling_rate(net, start, recompute_positions, False, generator)
        except Exception as error:
            rows.append(_error_row(row, error))
            continue
        rows.append({**row, "cached_tokens_per_s": cached, "recompute_tokens_per_s": recompute,
                     "speedup": cached / recompute})
    return rows


def measure_decode_steps(names: list[str], cfg: Any, device: str) -> list[dict[str, Any]]:
    """``STEP_COLUMNS`` rows: median ms of one layer's ``attention.step`` at positions ``step_fractions`` x L."""
    from longseq.attention import DecodingNotSupported, build_attention

    torch_device = torch.device(device)
    batch, heads = int(cfg.batch), int(cfg.n_heads)
    head_dim = int(cfg.d_model) // heads
    repeats = max(1, int(cfg.step_repeats))
    rows = []
    for name in names:
        for length in (int(n) for n in cfg.step_lengths):
            row: dict[str, Any] = {"attention": name, "length": length, "batch": batch, "heads": heads,
                                   "head_dim": head_dim, "status": "ok", "note": ""}
            spec = build_spec(name, length, causal=True, n_heads=heads, head_dim=head_dim,
                              block_size=cfg.step_block_size, unsupported_causal="skip")
            row["block_size"] = spec.block_size
            if spec.skip_reason:
                rows.append({**row, "status": "skipped", "note": spec.skip_reason})
                continue
            try:
                attention = build_attention(spec.registry_name, **spec.kwargs).to(torch_device).eval()
                generator = torch.Generator(device=torch_device).manual_seed(0)

                for fraction in cfg.step_fractions:
                    # the timed steps end at round(fraction x L): positions [end - repeats, end)
                    position = max(1, min(length, round(float(fraction) * length)) - repeats)
                    with torch.no_grad():
                        state = attention.new_state(batch, length, device=torch_device, dtype=torch.float32)
                        attention.prefill(state, *random_qkv(batch, heads, position, head_dim, generator))
                        times = []
                        for _ in range(repeats):
                            step_inputs = random_qkv(batch, heads, 1, head_dim, generator)
                            _sync(torch_device)
                            began = time.perf_counter()
                            attention.step(state, *step_inputs)
                            _sync(torch_device)
                            times.append(time.perf_counter() - began)
                    rows.append({**row, "position": position, "step_ms": statistics.median(times) * 1e3})
            except DecodingNotSupported:
                rows.append({**row, "status": "skipped", "note": "no decoding state (supports_decoding=False)"})
            except Exception as error:
                rows.append(_error_row(row, error))
    return rows


def sampling_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: tokens/s cached and recompute, speedup, per attention."""
    lines = ["| attention | L | cached tokens/s | recompute tokens/s | speedup |", "|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['attention']} | {r['length']} | {r['status']}: {r['note']} | | |")
            continue
        cached = r["cached_tokens_per_s"]
        cached_text, speedup = ("no decoding state", "") if math.isnan(cached) else (f"{cached:,.0f}",
                                                                                     f"{r['speedup']:.1f}x")
        lines.append(f"| {r['attention']} | {r['length']} | {cached_text} | {r['recompute_tokens_per_s']:,.0f} | "
                     f"{speedup} |")
    return "\n".join(lines)


def steps_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per-step ms of one layer by position, one row per (attention, L)."""
    lines = ["| attention | L | position: step ms |", "|---|---|---|"]
    grouped: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        grouped.setdefault((r["attention"], r["length"]), []).append(r)
    for (name, length), group in grouped.items():
        cells = ", ".join(f"{r['position']}: {r['step_ms']:.3f}" if r["status"] == "ok" else
                          f"{r['status']}: {r['note']}" for r in group)
        lines.append(f"| {name} | {length} | {cells} |")
    return "\n".join(lines)
