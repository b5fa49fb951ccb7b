"""``python -m longseq.bench.gpu [dry=true] [key=value ...]`` (``make gpu-check``; Hydra, conf/gpu_check.yaml): verify
a CUDA machine in one command and write one markdown report.

1. Correctness: every registered attention on every ``attention.backend`` (``backends``) in each dtype, forward and
   backward, against the ``explicit`` backend in fp64 on the same device, inputs and parameters (rounded to the dtype
   first, so only the computation differs), and the forward against ``attention_matrix @ v`` where the matrix is
   exact. The loss is ``sum(out * g)`` with a fixed ``g``; the gradients of q, k, v and the parameters come from
   autograd through whatever the backend runs (on CUDA the flex path's are FlexAttention's own backward). A backend
   that refuses a variant or a call (``AttentionConfigError``, e.g. no flex layout) is recorded as ``n/a`` with the
   reason; on CPU the flex backend is checked forward only (FlexAttention has no CPU backward).
2. The Fig. 3 benchmark: the bench's cells (``bench.cell.measure_cell``, ``bench.specs.build_spec``) per shape,
   ratios to ``full`` (SDPA: FlashAttention on CUDA), peak memory (``torch.cuda.max_memory_allocated`` above the
   inputs), and the crossover length from which each variant stays faster than full.
3. Training: a few optimizer steps of the backbone on the CIFAR-10 density geometry with synthetic tokens under
   ``torch.autocast(bf16)`` (what Lightning's ``precision=bf16-mixed`` does): tokens/s, peak memory, MFU.
4. DDP: the same steps under ``DistributedDataParallel`` over every visible GPU when there are >= 2 (nccl), one
   process per GPU; gradients must agree across ranks (parameters equal after the steps).
5. ``<out_dir>/<timestamp>/report.md`` (device, versions, every figure), ``results.json``, ``config.yaml``.

``dry=true`` runs every stage on CPU at tiny sizes (``presets.dry``; DDP as gloo processes), so the pipeline is
exercised by the fast suite. Exit status 1 when a correctness check or DDP fails.
"""

from __future__ import annotations

import dataclasses
import json
import math
import socket
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from longseq.bench import cell as cells
from longseq.bench import report
from longseq.bench.specs import build_spec, select_attentions

# Peak dense bf16 tensor FLOP/s of known devices (vendor data sheets, no sparsity), matched against
# ``torch.cuda.get_device_name`` in order (the first substring found wins); an unknown device gets no MFU.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
)

LOW_PRECISION = (torch.float16, torch.bfloat16)
PASSED = ("pass", "pass*", "n/a")  # pass*: a pattern_from_data variant judged by its own attention_matrix
SECTIONS = ("## Device", "## Correctness", "## Fig. 3 benchmark", "## Training", "## DDP")


# -- what to check --------------------------------------------------------------------------------------------
def backends() -> tuple[str, ...]:
    """The backends to check: every ``attention.backend`` value but ``auto``, from the one dispatch module
    (``ops.dispatch.BACKENDS``); ``explicit`` alone where that module does not exist."""
    try:
        from longseq.attention.ops.dispatch import BACKENDS
    except ImportError:
        return ("explicit",)
    return tuple(b for b in BACKENDS if b != "auto")


def peak_flops(device_name: str | None) -> float | None:
    """Peak dense bf16 FLOP/s of the named device (``PEAK_BF16_FLOPS``), None when unknown (CPU included)."""
    for key, flops in PEAK_BF16_FLOPS:
        if device_name and key in device_name:
            return flops
    return None


def resolve_device(cfg: DictConfig) -> str:
    device = str(cfg.device)
    if device == "auto":
        device = "cpu" if cfg.dry else "cuda"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("device=cuda but torch.cuda.is_available() is False: run on a CUDA machine, or dry=true "
                         "(the whole pipeline on CPU at tiny sizes)")
    return device


def fresh_compiles(device: str) -> None:
    """On CUDA, forget earlier compiled kernels (``torch.compiler.reset``) before the next attention, so each
    variant's figures are its own: compiled frames from other variants neither count against dynamo's recompile
    limit nor lengthen its guard checks."""
    if device.startswith("cuda"):
        torch.compiler.reset()


def _names(requested: Any) -> list[str]:
    return select_attentions(OmegaConf.to_object(requested) if OmegaConf.is_config(requested) else requested)


def _accepts_backend(name: str) -> bool:
    from longseq.attention import ATTENTION_REGISTRY
    from longseq.attention.registry import accepted_kwargs

    return "backend" in accepted_kwargs(ATTENTION_REGISTRY[name].cls)  # type: ignore[attr-defined]


def _build(registry_name: str, kwargs: dict[str, Any], backend: str, device: str, dtype: torch.dtype, seed: int):
    """The attention on ``backend`` (the knob is left out where the variant has no such constructor argument: it then
    runs its one path, explicit), seeded so every build has the same parameters and random features."""
    from longseq.attention import build_attention

    if _accepts_backend(registry_name):
        kwargs = {**kwargs, "backend": backend}
    elif backend != "explicit":
        from longseq.attention import AttentionConfigError

        raise AttentionConfigError(f"attention '{registry_name}' has no attention.backend knob")
    torch.manual_seed(seed)
    return build_attention(registry_name, **kwargs).to(device=device, dtype=dtype).eval()


# -- 1. correctness --------------------------------------------------------------------------------------------
def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` in fp64 (0 when both are zero)."""
    exact = exact.double()
    scale = exact.norm().item()
    diff = (approx.double() - exact).norm().item()
    return diff / scale if scale > 0 else diff


def _forward_backward(attn, q, k, v, grad_out, seed: int, backward: bool) -> tuple[torch.Tensor, dict]:
    """Output and gradients (q, k, v, parameters) of ``sum(attn(q, k, v) * grad_out)``."""
    inputs = [x.detach().clone().requires_grad_(backward) for x in (q, k, v)]
    torch.manual_seed(seed)  # variants that draw during the call (hashing) draw the same numbers
    with torch.set_grad_enabled(backward):
        out = attn(*inputs)
    if not backward:
        return out.detach(), {}
    attn.zero_grad(set_to_none=True)
    (out * grad_out.to(out.dtype)).sum().backward()
    grads = {"q": inputs[0].grad, "k": inputs[1].grad, "v": inputs[2].grad,
             **{n: p.grad for n, p in attn.named_parameters()}}
    return out.detach(), {n: g for n, g in grads.items() if g is not None}


def check_correctness(cfg: DictConfig, device: str) -> list[dict[str, Any]]:
    """One row per (attention, dtype, backend): status pass / FAIL / n/a / error and the relative errors."""
    from longseq.attention import AttentionConfigError

    spec_cfg = cfg.correctness
    names = [n for n in _names(spec_cfg.attentions)]
    chosen = list(spec_cfg.backends) if spec_cfg.backends is not None else list(backends())
    L, B, H, D = int(spec_cfg.seq_len), int(spec_cfg.batch), int(spec_cfg.heads), int(spec_cfg.head_dim)
    rows = []
    for name in names:
        fresh_compiles(device)
        spec = build_spec(name, L, causal=bool(spec_cfg.causal), n_heads=H, head_dim=D,
                          block_size=spec_cfg.block_size)
        base = {"attention": name, "causal": spec.causal}
        if spec.skip_reason:
            rows.append({**base, "dtype": "-", "backend": "-", "status": "n/a", "note": spec.skip_reason})
            continue
        generator = torch.Generator().manual_seed(int(cfg.seed))
        q, k, v, grad_out = (torch.randn(B, H, L, D, generator=generator, dtype=torch.float64) for _ in range(4))
        for dtype_name in spec_cfg.dtypes:
            start, since = len(rows), time.perf_counter()
            dtype = cells.DTYPES[str(dtype_name)]
            tol = spec_cfg.tolerance[str(dtype_name)]
            # the inputs rounded to the dtype, so the reference and the candidate see the same numbers
            qd, kd, vd = (x.to(dtype).to(device) for x in (q, k, v))
            q64, k64, v64 = (x.double() for x in (qd, kd, vd))
            g64 = grad_out.to(device)
            try:
                reference = _build(spec.registry_name, spec.kwargs, "explicit", device, dtype, int(cfg.seed)).double()
                ref_out, ref_grads = _forward_backward(reference, q64, k64, v64, g64, int(cfg.seed), True)
                with torch.no_grad():  # an instance's flag: fnet's hidden-axis DFT is not one (L, L) matrix
                    matrix_out = reference.attention_matrix(q64, k64, v64) @ v64 if reference.matrix_is_exact else None
            except Exception as error:
                rows.append({**base, "dtype": str(dtype_name), "backend": "explicit (fp64 reference)",
                             "status": "error", "note": _error_text(error)})
                _progress(rows, start, since)
                continue
            for backend in chosen:
                row = {**base, "dtype": str(dtype_name), "backend": backend, "output_err": math.nan,
                       "matrix_err": math.nan, "grad_err": math.nan, "note": ""}
                try:
                    attn = _build(spec.registry_name, spec.kwargs, backend, device, dtype, int(cfg.seed))
                except AttentionConfigError as error:
                    rows.append({**row, "status": "n/a", "note": str(error)})
                    continue
                backward = True
                try:
                    try:
                        out, grads = _forward_backward(attn, qd, kd, vd, g64, int(cfg.seed), True)
                    except AttentionConfigError as error:  # e.g. flex on CPU: no backward, check the forward
                        backward = False
                        out, grads = _forward_backward(attn, qd, kd, vd, g64, int(cfg.seed), False)
                        row["note"] = f"forward only: {error}"
                except AttentionConfigError as error:
                    rows.append({**row, "status": "n/a", "note": str(error)})
                    continue
                except Exception as error:
                    rows.append({**row, "status": "error", "note": _error_text(error)})
                    continue
                row["output_err"] = relative_error(out, ref_out)
                if matrix_out is not None:
                    row["matrix_err"] = relative_error(out, matrix_out)
                if backward:
                    missing = sorted(set(ref_grads) - set(grads))
                    row["grad_err"] = max((relative_error(grads[n], ref_grads[n]) for n in ref_grads if n in grads),
                                          default=0.0)
                    if missing:
                        row["note"] = f"no gradient for {missing}"
                ok = row["output_err"] <= tol.output and (math.isnan(row["matrix_err"]) or row["matrix_err"] <= tol.output)
                ok = ok and (not backward or (row["grad_err"] <= tol.grad and not row["note"]))
                bad = [x for x in (out, *grads.values()) if not torch.isfinite(x).all()]
                status = "pass" if ok and not bad else "FAIL"
                if status == "FAIL" and not bad and attn.pattern_from_data and dtype in LOW_PRECISION:
                    status, row["note"] = _own_pattern_check(attn, qd, kd, vd, out, tol.output, int(cfg.seed))
                rows.append({**row, "status": status})
            _progress(rows, start, since)
    return rows


def _own_pattern_check(attn, q, k, v, out: torch.Tensor, tolerance: float, seed: int) -> tuple[str, str]:
    """A variant whose support is chosen from the data (``pattern_from_data``) may choose other blocks in bf16 than
    its fp64 reference: judge its forward by its own ``attention_matrix`` in the same dtype (the same choices)
    -> (``pass*`` or ``FAIL``, the note). Its gradients then have no reference of the same choices."""
    try:
        torch.manual_seed(seed)
        with torch.no_grad():
            own = attn.attention_matrix(q, k, v).double() @ v.double()
    except Exception as error:
        return "FAIL", f"pattern from data; its own attention_matrix failed: {_error_text(error)}"
    error = relative_error(out, own)
    note = f"pattern from data: fp64 chose other blocks; output vs its own {q.dtype} attention_matrix @ v: {error:.1e}"
    return ("pass*" if error <= tolerance else "FAIL"), note


def _progress(rows: list[dict[str, Any]], start: int, since: float) -> None:
    """One log line per correctness row added since ``start``, with the seconds its (attention, dtype) group took
    (compiles included), so a run stopped mid-stage still shows what it checked."""
    for r in rows[start:]:
        print(f"  {r['attention']} {r['dtype']} {r['backend']}: {r['status']} out {_fmt(r.get('output_err'), '.1e')} "
              f"grad {_fmt(r.get('grad_err'), '.1e')} ({time.perf_counter() - since:.1f} s) {r.get('note', '')[:100]}",
              flush=True)


def _error_text(error: BaseException) -> str:
    frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    where = f" (at {Path(frame.filename).name}:{frame.lineno})" if frame else ""
    return f"{type(error).__name__}: {error}".splitlines()[0][:300] + where


# -- 2. the Fig. 3 benchmark ----------------------------------------------------------------------------------
def run_fig3(cfg: DictConfig, device: str) -> list[list[dict[str, Any]]]:
    """One list of bench rows per shape (``fig3.shapes``), with ``ratio_to_full`` (the bench's cells and ratios)."""
    spec_cfg = cfg.fig3
    names = _names(spec_cfg.attentions)
    modes = [spec_cfg.mode] if isinstance(spec_cfg.mode, str) else list(spec_cfg.mode)
    tables = []
    for shape in spec_cfg.shapes:
        rows: list[dict[str, Any]] = []
        for name in names:
            fresh_compiles(device)
            stopped: dict[str, cells.CellResult] = {}
            for length in sorted(int(n) for n in spec_cfg.lengths):
                spec = build_spec(name, length, causal=bool(spec_cfg.causal), n_heads=int(shape.heads),
                                  head_dim=int(shape.head_dim), block_size=spec_cfg.block_size)
                for mode in modes:
                    row = {"attention": name, "length": length, "mode": mode, "causal": spec.causal,
                           "block_size": spec.block_size, "batch": int(shape.batch), "heads": int(shape.heads),
                           "head_dim": int(shape.head_dim), "dtype": str(spec_cfg.dtype), "device": device}
                    if spec.skip_reason:
                        result = cells.CellResult("skipped", note=spec.skip_reason)
                    elif mode in stopped:
                        result = stopped[mode]
                    else:
                        cell = cells.CellSpec(
                            attention=spec.registry_name, length=length, mode=mode, kwargs=spec.kwargs,
                            batch=int(shape.batch), heads=int(shape.heads), head_dim=int(shape.head_dim),
                            dtype=str(spec_cfg.dtype), device=device, warmup=int(spec_cfg.warmup),
                            repeats=int(spec_cfg.repeats), budget_s=float(spec_cfg.budget_s), seed=int(cfg.seed))
                        if device.startswith("cuda"):
                            # one untimed cell first: torch.compile of the flex kernels for this shape happens there,
                            # not in the timed cell's first iteration (which the budget judges)
                            cells.measure_cell(dataclasses.replace(cell, warmup=1, repeats=0, budget_s=math.inf))
                        result = cells.measure_cell(cell)
                        if result.status in ("oom", "over_budget"):
                            stopped[mode] = cells.CellResult(result.status, note=f"not run: {result.status} at L={length}")
                    row.update(result.as_dict())
                    rows.append(row)
                    if device.startswith("cuda"):
                        torch.cuda.empty_cache()
        report.add_ratios(rows)
        tables.append(rows)
    return tables


def crossover(rows: list[dict[str, Any]], name: str, mode: str) -> int | None:
    """The shortest measured length from which ``name`` is faster than full at every longer measured length (None:
    never, or nothing measured). A length where full did not run (oom) counts as faster when the variant ran."""
    cells_ = sorted((r for r in rows if r["attention"] == name and r["mode"] == mode), key=lambda r: r["length"])
    full = {r["length"]: r for r in rows if r["attention"] == "full" and r["mode"] == mode}
    answer = None
    for row in reversed(cells_):
        reference = full.get(row["length"])
        faster = row["status"] == "ok" and (
            (reference is not None and reference["status"] != "ok") or row.get("ratio_to_full", math.nan) < 1)
        if not faster:
            break
        answer = row["length"]
    return answer


# -- 3. training ---------------------------------------------------------------------------------------------
def _model(cfg: DictConfig, name: str, device: str) -> torch.nn.Module:
    from longseq.models.transformer import Transformer

    spec = build_spec(name, int(cfg.seq_len), causal=True, n_heads=int(cfg.n_heads),
                      head_dim=int(cfg.d_model) // int(cfg.n_heads), block_size=int(cfg.block_size))
    if spec.skip_reason:
        raise ValueError(spec.skip_reason)
    attention = {k: v for k, v in spec.kwargs.items() if k not in {"seq_len", "n_heads", "head_dim", "dropout"}}
    torch.manual_seed(0)
    return Transformer(vocab_size=int(cfg.vocab_size), seq_len=int(cfg.seq_len), n_layers=int(cfg.n_layers),
                       d_model=int(cfg.d_model), n_heads=int(cfg.n_heads), mlp_ratio=cfg.mlp_ratio, dropout=0.0,
                       attn_dropout=0.0, attention={"name": spec.registry_name, **attention}, pos_emb="learned",
                       image_shape=None).to(device)


def model_flops_per_token(model: torch.nn.Module, cfg: DictConfig) -> float:
    """Training FLOPs per token as nanoGPT / PaLM count them: ``6 N`` (N = parameters outside the embeddings) plus
    ``12 n_layers d_model L`` for dense attention's two products. The same count for every variant (the work of
    the model, not of its kernels), so MFU compares like throughput."""
    embedding = sum(p.numel() for n, p in model.named_parameters() if "emb" in n or "pos" in n)
    n = sum(p.numel() for p in model.parameters()) - embedding
    return 6.0 * n + 12.0 * int(cfg.n_layers) * int(cfg.d_model) * int(cfg.seq_len)


def _train_steps(model: torch.nn.Module, cfg: DictConfig, device: str, steps: int, warmup: int,
                 tokens: torch.Tensor) -> float:
    """Median seconds per AdamW step (next-token loss) under the configured precision."""
    from longseq.bench.throughput import next_token_loss

    if cfg.precision not in ("bf16-mixed", "32-true"):
        raise SystemExit(f"train.precision: '{cfg.precision}' unknown; valid: bf16-mixed, 32-true")
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(cfg.lr))
    model.train()
    device_type = torch.device(device).type
    times = []
    for step in range(warmup + steps):
        batch = tokens[step % tokens.shape[0]].to(device)
        cells._sync(torch.device(device))
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16-mixed"):
            loss = next_token_loss(model, batch)
        loss.backward()
        optimizer.step()
        cells._sync(torch.device(device))
        times.append(time.perf_counter() - start)
    if not math.isfinite(loss.item()):
        raise FloatingPointError(f"non-finite loss {loss.item()}")
    return statistics.median(times[warmup:] or times)


def run_training(cfg: DictConfig, device: str, flops: float | None) -> list[dict[str, Any]]:
    """One row per attention: tokens/s, peak memory (CUDA), MFU (where the device's peak is known)."""
    spec = cfg.train
    generator = torch.Generator().manual_seed(int(cfg.seed))
    steps, warmup = int(spec.steps), int(spec.warmup)
    tokens = torch.randint(0, int(spec.vocab_size), (steps + warmup, int(spec.batch), int(spec.seq_len)),
                           generator=generator)
    rows = []
    for name in _names(spec.attentions):
        row: dict[str, Any] = {"attention": name, "seq_len": int(spec.seq_len), "batch": int(spec.batch),
                               "status": "ok", "note": "", "tokens_per_s": math.nan, "peak_mem_mb": math.nan,
                               "mfu": math.nan}
        try:
            fresh_compiles(device)
            model = _model(spec, name, device)
            if spec.compile:  # as model.compile=true: the backbone through torch.compile (the warm-up steps compile)
                model.compile()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            step_s = _train_steps(model, spec, device, steps, warmup, tokens)
            row["tokens_per_s"] = int(spec.batch) * int(spec.seq_len) / step_s
            row["step_ms"] = step_s * 1e3
            if device.startswith("cuda"):
                row["peak_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
            if flops:
                row["mfu"] = model_flops_per_token(model, spec) * row["tokens_per_s"] / flops
            del model
        except Exception as error:
            row.update(status="oom" if cells.is_oom(error) else "error", note=_error_text(error))
        rows.append(row)
    return rows


# -- 4. DDP --------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, cfg_yaml: str, device_type: str, out_file: str) -> None:
    """One rank: a few DDP steps of ``ddp.attention``; rank 0 writes tokens/s and the parameter spread across ranks."""
    import torch.distributed as dist

    cfg = OmegaConf.create(cfg_yaml)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        device = f"cuda:{rank}" if device_type == "cuda" else "cpu"
        model = _model(cfg.train, str(cfg.ddp.attention), device)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if device_type == "cuda" else None)
        generator = torch.Generator().manual_seed(int(cfg.seed) + rank)  # each rank its own batches
        steps = int(cfg.ddp.steps)
        tokens = torch.randint(0, int(cfg.train.vocab_size), (steps + 1, int(cfg.train.batch), int(cfg.train.seq_len)),
                               generator=generator)
        step_s = _train_steps(ddp, cfg.train, device, steps, 1, tokens)
        # DDP averages gradients, so every rank must hold the same parameters after the steps
        flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
        low, high = flat.clone(), flat.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        spread = (high - low).abs().max().item()
        if rank == 0:
            Path(out_file).write_text(json.dumps({
                "world_size": world, "backend": dist.get_backend(), "attention": str(cfg.ddp.attention),
                "steps": steps, "step_ms": step_s * 1e3,
                "tokens_per_s": world * int(cfg.train.batch) * int(cfg.train.seq_len) / step_s,
                "param_spread": spread, "status": "pass" if spread == 0.0 else "FAIL"}))
    finally:
        dist.destroy_process_group()


def run_ddp(cfg: DictConfig, device: str, out: Path) -> dict[str, Any]:
    """DDP over every visible GPU (>= 2), or ``ddp.cpu_processes`` gloo processes on CPU; a status row otherwise."""
    import torch.multiprocessing as mp

    if device.startswith("cuda"):
        world, device_type = torch.cuda.device_count(), "cuda"
        if world < 2:
            return {"status": "skipped", "note": f"{world} GPU visible (DDP needs >= 2)"}
    else:
        world, device_type = int(cfg.ddp.cpu_processes), "cpu"
    out_file = out / "ddp.json"
    args = (world, _free_port(), OmegaConf.to_yaml(cfg), device_type, str(out_file))
    try:
        if world == 1:  # the same code in this process: no interpreter start-up (dry runs)
            _ddp_worker(0, *args)
        else:
            mp.spawn(_ddp_worker, args=args, nprocs=world, join=True)
        return json.loads(out_file.read_text())
    except Exception as error:
        return {"status": "error", "world_size": world, "note": _error_text(error)}


# -- 5. the report -------------------------------------------------------------------------------------------
def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return format(value, spec)


def correctness_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| attention | causal | dtype | backend | status | output err | vs attention_matrix | grad err | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['attention']} | {str(r['causal']).lower()} | {r['dtype']} | {r['backend']} | {r['status']} | "
                     f"{_fmt(r.get('output_err'), '.1e')} | {_fmt(r.get('matrix_err'), '.1e')} | "
                     f"{_fmt(r.get('grad_err'), '.1e')} | {r.get('note', '')} |")
    return "\n".join(lines)


def crossover_table(tables: list[list[dict[str, Any]]], shapes: list[dict[str, Any]], mode: str) -> str:
    names = list(dict.fromkeys(r["attention"] for rows in tables for r in rows if r["attention"] != "full"))
    heads = [f"B{s['batch']} H{s['heads']} D{s['head_dim']}" for s in shapes]
    lines = ["| attention | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for name in names:
        values = [crossover(rows, name, mode) for rows in tables]
        lines.append(f"| {name} | " + " | ".join("never" if v is None else f"L={v}" for v in values) + " |")
    return "\n".join(lines)


def training_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| attention | tokens/s | step ms | peak MB | MFU | status |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['attention']} | {_fmt(r.get('tokens_per_s'), ',.0f')} | {_fmt(r.get('step_ms'), '.1f')} | "
                     f"{_fmt(r.get('peak_mem_mb'), ',.0f')} | {_fmt(r.get('mfu'), '.1%')} | "
                     f"{r['status']}{(': ' + r['note']) if r.get('note') else ''} |")
    return "\n".join(lines)


def write_report(out: Path, cfg: DictConfig, env: dict[str, Any], correctness: list, fig3: list, training: list,
                 ddp: dict[str, Any], flops: float | None) -> str:
    shapes = OmegaConf.to_object(cfg.fig3.shapes)
    modes = [cfg.fig3.mode] if isinstance(cfg.fig3.mode, str) else list(cfg.fig3.mode)
    counts = {s: sum(r["status"] == s for r in correctness) for s in ("pass", "pass*", "FAIL", "error", "n/a")}
    lines = [f"# longseq gpu-check{' (dry: CPU, tiny sizes)' if cfg.dry else ''}", "",
             "## Device", ""]
    lines += [f"- {key}: {value}" for key, value in env.items()]
    lines += [f"- peak bf16 FLOP/s used for MFU: {_fmt(flops, '.3g') or 'unknown device: MFU omitted'}", "",
              "## Correctness", "",
              f"Every attention x backend x dtype against the explicit backend in fp64 on the same device "
              f"(L={cfg.correctness.seq_len}, B={cfg.correctness.batch}, H={cfg.correctness.heads}, "
              f"D={cfg.correctness.head_dim}); relative Frobenius errors of the output, of the output against "
              f"attention_matrix @ v, and the largest over the gradients. "
              f"Summary: {counts['pass']} pass, {counts['pass*']} pass*, {counts['FAIL']} FAIL, {counts['error']} error, "
              f"{counts['n/a']} n/a. pass*: a variant whose blocks are chosen from the data (pattern_from_data) chose "
              "others in this dtype than in fp64; its output matched its own attention_matrix @ v in this dtype "
              "(the gradients have no reference of the same choices).", "",
              correctness_table(correctness), "",
              "## Fig. 3 benchmark", "",
              f"{cfg.fig3.dtype}, causal={cfg.fig3.causal}, median of {cfg.fig3.repeats} after {cfg.fig3.warmup} "
              "warm-up; ms (ratio to full = SDPA) / peak MB above the inputs.", ""]
    for shape, rows in zip(shapes, fig3):
        for mode in modes:
            lines += [f"### {mode}, B={shape['batch']} H={shape['heads']} D={shape['head_dim']}", "",
                      report.markdown_table(rows, mode), ""]
    for mode in modes:
        lines += [f"### crossover ({mode}): shortest L from which the variant is faster than full", "",
                  crossover_table(fig3, shapes, mode), ""]
    t = cfg.train
    lines += ["## Training", "",
              f"{t.precision}{', torch.compile' if t.compile else ''}, L={t.seq_len} (CIFAR-10 geometry, synthetic tokens), batch {t.batch}, {t.n_layers} "
              f"layers d={t.d_model} H={t.n_heads}, AdamW; median of {t.steps} steps after {t.warmup}. MFU = model "
              "FLOPs (6 N + 12 n_layers d L per token) x tokens/s / peak FLOP/s.", "",
              training_table(training), "",
              "## DDP", ""]
    lines += [f"- {key}: {value}" for key, value in ddp.items()]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    report.write_json({"env": env, "correctness": correctness, "fig3": fig3, "training": training, "ddp": ddp},
                      out / "results.json")
    return text


def run_gpu_check(cfg: DictConfig) -> tuple[Path, bool]:
    """Every stage per ``cfg`` -> (output directory, whether every correctness check and DDP passed)."""
    from longseq.bench.run import output_directory

    device = resolve_device(cfg)
    out = output_directory(str(cfg.out_dir))
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    memory_method = "cuda" if device.startswith("cuda") else cells.cpu_memory_method()
    env = report.environment(device, None, memory_method, isolated=False)
    env["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    env["triton"] = report._version("triton")  # FlexAttention's kernels are generated Triton
    env["cudnn"] = torch.backends.cudnn.version() if torch.cuda.is_available() else None
    env["backends"] = ", ".join(backends())
    flops = peak_flops(env.get("gpu")) if device.startswith("cuda") else None
    print(f"gpu-check on {env['gpu'] or env['cpu']} ({device}) -> {out}", flush=True)
    stages: dict[str, float] = {}
    done: dict[str, Any] = {"correctness": [], "fig3": [], "training": [], "ddp": {"status": "not run yet"}}

    def stage(key: str, title: str, fn, *args) -> None:
        # the report is rewritten after every stage: a run stopped later (a time limit, a lost machine) keeps
        # what it measured
        print(f"{len(stages) + 1}/4 {title} ...", flush=True)
        start = time.perf_counter()
        done[key] = fn(*args)
        stages[title] = time.perf_counter() - start
        env["stage_seconds"] = ", ".join(f"{k} {v:.1f}" for k, v in stages.items())
        write_report(out, cfg, env, **done, flops=flops)

    stage("correctness", "correctness", check_correctness, cfg, device)
    stage("fig3", "Fig. 3 benchmark", run_fig3, cfg, device)
    stage("training", "training", run_training, cfg, device, flops)
    stage("ddp", "DDP", run_ddp, cfg, device, out)
    correctness, ddp = done["correctness"], done["ddp"]
    text = (out / "report.md").read_text()
    ok = all(r["status"] in PASSED for r in correctness) and ddp["status"] in ("pass", "skipped")
    print(text, flush=True)
    print(f"wrote {out}/report.md, results.json; {'all checks passed' if ok else 'SOME CHECKS FAILED'}", flush=True)
    return out, ok


def prepare(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """``dry=true`` selects ``presets.dry`` (keys set on the command line win), as ``make bench``'s presets."""
    from longseq.bench.__main__ import apply_preset

    if cfg.dry and cfg.preset is None:
        cfg.preset = "dry"
    apply_preset(cfg, overrides)
    return cfg


def main() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from longseq.bench.__main__ import CONFIG_DIR

    @hydra.main(config_path=CONFIG_DIR, config_name="gpu_check", version_base="1.3")
    def _main(cfg: DictConfig) -> None:
        _, ok = run_gpu_check(prepare(cfg, list(HydraConfig.get().overrides.task)))
        if not ok:
            raise SystemExit(1)

    _main()


if __name__ == "__main__":
    main()
