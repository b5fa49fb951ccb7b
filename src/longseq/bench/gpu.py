"""``python -m longseq.bench.gpu [dry=true] [key=value ...]`` (``make gpu-check``; Hydra, conf/gpu_check.yaml): verify
a CUDA machine in one command and write one markdown report.

0. Calibration (``calibrate``): what one launch and one compiled call cost on this host, so a reader can turn the
   kernel counts below into host time: back-to-back launches of a 1-element add (host µs per launch; the same
   launches replayed in one CUDA graph: the GPU's own cost per kernel), and a trivial ``(x * w).sum()`` forward and
   backward, eager and through ``torch.compile`` (the fixed floor of a compiled call: guards, AOTAutograd's wrappers,
   ``AccumulateGrad``), also with ``reduce-overhead``.
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
3. Where the time goes, per layer (``profile``): wall time of a fwd + bwd step as the module is called, against the
   same step captured once in a CUDA graph and replayed (``cuda_graph_replay``: the GPU's time with no host in the
   way; their difference is the host's overhead), each with its ratio to full; the time the GPU is busy and the
   kernels it runs per step (``torch.profiler``; ``step_kernels`` keeps kernels, copies and fills and leaves out the
   annotation ranges drawn on the GPU's timeline), listed by name; host syncs per step
   (``torch.cuda.set_sync_debug_mode``), block masks built per step (``ops.flex.BUILDS``), peak memory, and the
   host's time by profiler event (``largest_events``); at each ``profile.length``, as the module is called and
   compiled whole (``profile.compile``).
4. Training: a few optimizer steps of the backbone on the image density geometries (CIFAR-10's 3,072 and
   ImageNet-64's 12,288 tokens) with synthetic tokens under ``torch.autocast(bf16)`` (what Lightning's
   ``precision=bf16-mixed`` does), eager and ``torch.compile``d whole (``train.compile``: ``default`` is
   ``model.compile=true``, the flex layers inlined into one graph; ``reduce-overhead`` replays that graph's forward
   and backward as CUDA graphs): tokens/s, its ratio to full in the same mode, the graphs dynamo compiled (and any
   during the timed steps: a recompile), peak memory, MFU.
5. DDP: the same steps under ``DistributedDataParallel`` over every visible GPU when there are >= 2 (nccl), one
   process per GPU; gradients must agree across ranks (parameters equal after the steps).
6. ``<out_dir>/<timestamp>/report.md`` (device, versions, every figure), ``results.json``, ``config.yaml``.

Compilation dominates a short lease (each variant, length and dtype compiles its own kernels), so with
``workers > 1`` every stage's compilation runs first in that many processes at once (``warm_up``), each unit in a
process of its own (a compiler that crashes costs that unit only): the correctness rows come from them directly, and
the timed stages then run alone in this process on inductor's on-disk caches.

``time_limit_s`` bounds the whole check (``TimeLimit``): past it nothing starts, a compiling warm-up unit is stopped,
and what was left out reads ``time_limit``. ``preset=quick`` is the list for one H100 / H200 lease, cut at 270 s: the
calibration, the Combiner layouts' correctness, the layer as called and graph-replayed at the targets' lengths (no
Fig. 3: the profile times the same layers), training at 3,072 eager, compiled and graph-replayed. By the per-unit
times of docs/gpu_check_h100.md (an estimate, not yet run whole): start-up and calibration about 25 s, the warm-up
about 130 s (7 correctness, 9 profile and 9 training units in 8 processes), the timed profile about 55 s and the
training about 70 s; what does not fit is cut from the end (the last training rows first). ``dry=true`` runs every
stage on CPU at tiny sizes (``presets.dry``; DDP as gloo processes), so the pipeline is exercised by the fast suite.
Exit status 1 when a correctness check or DDP fails or was left out.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf

from longseq.bench import cell as cells
from longseq.bench import report
from longseq.bench.specs import build_spec, select_attentions
from longseq.utils.compiling import COMPILE_MODES, compile_module, compile_options, new_step

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
TIME_LIMIT = "time_limit"  # the status of a unit of work the check's time_limit_s left out
SECTIONS = ("## Device", "## Calibration", "## Correctness", "## Fig. 3 benchmark", "## Where the time goes",
            "### The layer as called and replayed in a CUDA graph", "### Kernels per step", "## Training",
            "### The whole-step graph against full", "## DDP")


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


@dataclasses.dataclass
class TimeLimit:
    """``time_limit_s`` of the check, counted from its start (None: no limit), so a short lease ends with a report:
    past it no unit of work starts (a warm-up unit, a correctness attention, a Fig. 3 cell, a profiled layer, a
    training row, DDP), a warm-up unit still compiling is stopped, and each unit left out is reported with the
    status ``time_limit``."""

    limit_s: float | None = None
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def left_s(self) -> float:
        return math.inf if self.limit_s is None else self.limit_s - (time.perf_counter() - self.start)

    def passed(self) -> bool:
        return self.left_s() <= 0

    def note(self) -> str:
        return f"not run: past time_limit_s={self.limit_s:g}"


NO_LIMIT = TimeLimit()


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


def compiled_graphs() -> int:
    """How many graphs dynamo has compiled in this process (its private ``unique_graphs`` counter, kept here with the
    bench's other uses of private APIs: a graph break or a recompile adds one), so a training row can count the graphs
    its steps made and see whether a timed step compiled again."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# -- timing helpers shared by the stages ------------------------------------------------------------------------
class NoCudaGraph(RuntimeError):
    """Why a step cannot be replayed in a CUDA graph here (no CUDA device; a module that replays its own)."""


def cuda_graph_replay(step: Callable[[], Any], dev: torch.device, warmup: int) -> Callable[[], None]:
    """``step`` (the same work on the same tensors each call: a layer's fwd + bwd, N launches) captured once in a
    CUDA graph -> its replay: the same kernels on the same addresses in one launch, with no Python, dispatcher, guards
    or autograd engine between them, so a replay takes the GPU's time alone. ``step`` runs ``warmup`` times on a side
    stream first, as ``torch.cuda.graphs`` asks (compilation and lazy initialisation stay outside the capture);
    gradients it leaves as None are allocated inside the capture, from the graph's own memory pool. Raises
    ``NoCudaGraph`` off CUDA; a step that syncs with the host cannot be captured (CUDA's error says so)."""
    if dev.type != "cuda":
        raise NoCudaGraph(f"CUDA graphs need a CUDA device (here: {dev.type})")
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            step()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay  # the bound method keeps the graph and its memory pool alive


def median_s(fn: Callable[[], Any], dev: torch.device, repeats: int) -> float:
    """Median wall seconds of ``fn`` over ``repeats`` calls, each between two device syncs."""
    times = []
    for _ in range(max(1, repeats)):
        cells._sync(dev)
        start = time.perf_counter()
        fn()
        cells._sync(dev)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- 0. calibration --------------------------------------------------------------------------------------------
def per_call_us(fn: Callable[[], Any], dev: torch.device, calls: int, warmup: int) -> tuple[float, float, float]:
    """``fn`` called ``calls`` times back to back (after ``warmup`` calls) -> µs per call: issued (the host's time
    to return from the calls, before waiting for the GPU), wall (until the GPU finished them), GPU (between two CUDA
    events around the calls, the GPU's timeline, idle gaps included: NaN off CUDA)."""
    for _ in range(warmup):
        fn()
    cells._sync(dev)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if dev.type == "cuda" else None
    start = time.perf_counter()
    if marks:
        marks[0].record()
    for _ in range(calls):
        fn()
    if marks:
        marks[1].record()
    issued = time.perf_counter() - start
    cells._sync(dev)
    wall = time.perf_counter() - start
    gpu_us = marks[0].elapsed_time(marks[1]) * 1e3 if marks else math.nan
    return issued * 1e6 / calls, wall * 1e6 / calls, gpu_us / calls


def calibrate(cfg: DictConfig, device: str, limit: TimeLimit = NO_LIMIT) -> list[dict[str, Any]]:
    """One row per calibration measurement (``calibration``): what it is, calls, launches per call, and µs per
    launch or call (``per_call_us``; ``status`` ok, skipped with the reason, error, or time_limit):

    - a 1-element add launched ``launches`` times (the host's cost per eager launch), and the same launches captured
      in one CUDA graph and replayed (the GPU's cost per kernel, no host in the way; CUDA only);
    - ``(x * w).sum()`` over ``size`` elements, forward + backward eager; forward alone (grad enabled) and forward +
      backward through ``torch.compile`` (``calibration.backend``): the floor every compiled call pays whatever its
      kernels; and with ``reduce-overhead`` (inductor's CUDA graphs; CUDA with inductor only)."""
    spec = cfg.calibration
    dev = torch.device(device)
    launches, calls, warmup, backend = int(spec.launches), int(spec.calls), int(spec.warmup), str(spec.backend)
    generator = torch.Generator().manual_seed(int(cfg.seed))
    counter = torch.zeros(1, device=dev)
    x = torch.randn(int(spec.size), generator=generator).to(dev)
    w = torch.randn(int(spec.size), generator=generator).to(dev).requires_grad_(True)
    rows: list[dict[str, Any]] = []

    def trivial() -> torch.Tensor:
        return (x * w).sum()

    def forward_backward(fn: Callable[[], torch.Tensor], mode: str = "none") -> Callable[[], None]:
        def call() -> None:
            new_step(mode)
            fn().backward()
            w.grad = None  # as optimizer.zero_grad(set_to_none=True): AccumulateGrad allocates the gradient again
        return call

    def launch_all() -> None:
        for _ in range(launches):
            counter.add_(1)

    def graph_of_launches() -> Callable[[], None]:
        return cuda_graph_replay(launch_all, dev, 1)

    def compiled(mode: str) -> Callable[[], torch.Tensor]:
        if mode == "reduce-overhead" and (dev.type != "cuda" or backend != "inductor"):
            raise NoCudaGraph(f"reduce-overhead replays CUDA graphs: inductor on a CUDA device only (here: "
                              f"{dev.type}, backend {backend})")
        options = compile_options(mode) if backend == "inductor" else {"dynamic": False, "backend": backend}
        return torch.compile(trivial, **options)

    plan: list[tuple[str, Callable[[], Callable[[], Any]], int, int]] = [  # what, make the call, calls, launches / call
        ("1-element add, eager launches", lambda: launch_all, 1, launches),
        ("1-element add, the same launches replayed in one CUDA graph", graph_of_launches, max(1, calls // 20),
         launches),
        ("(x * w).sum() forward + backward, eager", lambda: forward_backward(trivial), calls, 1),
        ("(x * w).sum() forward (grad enabled), compiled", lambda: compiled("default"), calls, 1),
        ("(x * w).sum() forward + backward, compiled", lambda: forward_backward(compiled("default")), calls, 1),
        ("(x * w).sum() forward + backward, compiled reduce-overhead",
         lambda: forward_backward(compiled("reduce-overhead"), "reduce-overhead"), calls, 1),
    ]
    for what, make, n_calls, per_call in plan:
        row: dict[str, Any] = {"what": what, "calls": n_calls, "launches_per_call": per_call, "status": "ok",
                               "note": "", "host_us": math.nan, "wall_us": math.nan, "gpu_us": math.nan}
        if limit.passed():
            rows.append({**row, "status": TIME_LIMIT, "note": limit.note()})
            continue
        try:
            issued, wall, gpu = per_call_us(make(), dev, n_calls, warmup)
            row.update(host_us=issued / per_call, wall_us=wall / per_call, gpu_us=gpu / per_call)
        except NoCudaGraph as reason:
            row.update(status="skipped", note=str(reason))
        except Exception as error:
            row.update(status="error", note=cells.error_text(error))
        print(f"  calibration {what}: {row['status']} {_fmt(row['host_us'], '.1f')} µs issued, "
              f"{_fmt(row['gpu_us'], '.2f')} µs GPU {row['note'][:100]}", flush=True)
        rows.append(row)
    fresh_compiles(device)
    return rows


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


def check_correctness(cfg: DictConfig, device: str, limit: TimeLimit = NO_LIMIT) -> list[dict[str, Any]]:
    """One row per (attention, dtype, backend): status pass / FAIL / n/a / error and the relative errors (one
    ``time_limit`` row for an attention the time limit left out). With ``correctness.summary_copy_rows`` the flex
    layouts lay out their summaries once per that many queries, as long sequences have them."""
    from longseq.attention.ops.flex.block_masks import summary_copies_every

    spec_cfg = cfg.correctness
    chosen = list(spec_cfg.backends) if spec_cfg.backends is not None else list(backends())
    rows: list[dict[str, Any]] = []
    with summary_copies_every(spec_cfg.get("summary_copy_rows")):
        for name in _names(spec_cfg.attentions):
            _check_attention(cfg, name, chosen, device, limit, rows)
    return rows


def _check_attention(cfg: DictConfig, name: str, chosen: list[str], device: str, limit: TimeLimit,
                     rows: list[dict[str, Any]]) -> None:
    """``check_correctness``'s rows of one attention, appended to ``rows``."""
    from longseq.attention import AttentionConfigError

    spec_cfg = cfg.correctness
    L, B, H, D = int(spec_cfg.seq_len), int(spec_cfg.batch), int(spec_cfg.heads), int(spec_cfg.head_dim)
    fresh_compiles(device)
    spec = build_spec(name, L, causal=bool(spec_cfg.causal), n_heads=H, head_dim=D,
                      block_size=spec_cfg.block_size)
    base = {"attention": name, "causal": spec.causal}
    if limit.passed():
        rows.append({**base, "dtype": "-", "backend": "-", "status": TIME_LIMIT, "note": limit.note()})
        return
    if spec.skip_reason:
        rows.append({**base, "dtype": "-", "backend": "-", "status": "n/a", "note": spec.skip_reason})
        return
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
                         "status": "error", "note": cells.error_text(error)})
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
                rows.append({**row, "status": "error", "note": cells.error_text(error)})
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


def _own_pattern_check(attn, q, k, v, out: torch.Tensor, tolerance: float, seed: int) -> tuple[str, str]:
    """A variant whose support is chosen from the data (``pattern_from_data``) may choose other blocks in bf16 than
    its fp64 reference: judge its forward by its own ``attention_matrix`` in the same dtype (the same choices)
    -> (``pass*`` or ``FAIL``, the note). Its gradients then have no reference of the same choices."""
    try:
        torch.manual_seed(seed)
        with torch.no_grad():
            own = attn.attention_matrix(q, k, v).double() @ v.double()
    except Exception as error:
        return "FAIL", f"pattern from data; its own attention_matrix failed: {cells.error_text(error)}"
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


# -- 2. the Fig. 3 benchmark ----------------------------------------------------------------------------------
def _modes(value: Any) -> list[str]:
    """A config entry of one or several items as a list (``mode: fwd_bwd`` or ``mode: [fwd, fwd_bwd]``)."""
    return [str(value)] if isinstance(value, (str, bool)) else [str(v) for v in value]


def compile_modes(value: Any) -> list[str]:
    """``fig3.compile`` / ``train.compile`` / ``profile.compile`` as modes (``false`` = none, ``true`` = default),
    each checked against ``COMPILE_MODES``."""
    modes = ["none" if v in (False, "false", "False") else "default" if v in (True, "true", "True") else str(v)
             for v in ([value] if isinstance(value, (str, bool)) else list(value))]
    for mode in modes:
        if mode not in ("none", *COMPILE_MODES):
            raise SystemExit(f"compile: '{mode}' unknown; valid: none, {', '.join(COMPILE_MODES)} (or true / false)")
    return modes


def fig3_cells(cfg: DictConfig, device: str, names: list[str], shape) -> list[tuple[dict[str, Any], Any]]:
    """Every (row, cell spec or skip result) of one shape for ``names``, in the order the stage runs them."""
    spec_cfg = cfg.fig3
    out = []
    for name in names:
        for length in sorted(int(n) for n in spec_cfg.lengths):
            spec = build_spec(name, length, causal=bool(spec_cfg.causal), n_heads=int(shape.heads),
                              head_dim=int(shape.head_dim), block_size=spec_cfg.block_size)
            for mode in _modes(spec_cfg.mode):
                for compile_mode in compile_modes(spec_cfg.get("compile", "none")):
                    row = {"attention": name, "length": length, "mode": mode, "compile": compile_mode,
                           "causal": spec.causal, "block_size": spec.block_size, "batch": int(shape.batch),
                           "heads": int(shape.heads), "head_dim": int(shape.head_dim), "dtype": str(spec_cfg.dtype),
                           "device": device}
                    if spec.skip_reason:
                        out.append((row, cells.CellResult("skipped", note=spec.skip_reason)))
                        continue
                    out.append((row, cells.CellSpec(
                        attention=spec.registry_name, length=length, mode=mode, kwargs=spec.kwargs,
                        batch=int(shape.batch), heads=int(shape.heads), head_dim=int(shape.head_dim),
                        dtype=str(spec_cfg.dtype), device=device, warmup=int(spec_cfg.warmup),
                        repeats=int(spec_cfg.repeats), budget_s=float(spec_cfg.budget_s), seed=int(cfg.seed),
                        compile=compile_mode)))
    return out


def run_fig3(cfg: DictConfig, device: str, compiled: set = frozenset(),
             limit: TimeLimit = NO_LIMIT) -> list[list[dict[str, Any]]]:
    """One list of bench rows per shape (``fig3.shapes``), with ``ratio_to_full`` (the bench's cells and ratios).
    ``compiled``: the warm-up units that compiled (``warm_up``); a cell not among them compiles here first."""
    names = _names(cfg.fig3.attentions)
    tables = []
    for shape in cfg.fig3.shapes:
        rows: list[dict[str, Any]] = []
        stopped: dict[tuple, cells.CellResult] = {}
        for row, cell in fig3_cells(cfg, device, names, shape):
            key = (row["attention"], row["mode"], row["compile"])
            if row["attention"] != (rows[-1]["attention"] if rows else None):
                fresh_compiles(device)
            if isinstance(cell, cells.CellResult):
                result = cell
            elif key in stopped:
                result = stopped[key]
            elif limit.passed():
                result = cells.CellResult(TIME_LIMIT)
            else:
                if device.startswith("cuda") and ("fig3", (row["attention"], row["length"])) not in compiled:
                    # one untimed cell first: compilation for this shape happens there, not in the timed cell's first
                    # iteration (which the budget judges: on the H100 a cold combiner_logsparse took 33 s there)
                    cells.measure_cell(dataclasses.replace(cell, warmup=1, repeats=0, budget_s=math.inf))
                result = cells.measure_cell(cell)
                if result.status in ("oom", "over_budget"):
                    stopped[key] = cells.CellResult(result.status, note=f"not run: {result.status} at L={row['length']}")
            row.update(result.as_dict())
            rows.append(row)
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        report.add_ratios(rows)
        tables.append(rows)
    return tables


def crossover(rows: list[dict[str, Any]], name: str, mode: str, compile_mode: str = "none") -> int | None:
    """The shortest measured length from which ``name`` is faster than full at every longer measured length (None:
    never, or nothing measured). A length where full did not run (oom) counts as faster when the variant ran."""
    def same(r):
        return r["mode"] == mode and r.get("compile", "none") == compile_mode

    cells_ = sorted((r for r in rows if r["attention"] == name and same(r)), key=lambda r: r["length"])
    full = {r["length"]: r for r in rows if r["attention"] == "full" and same(r)}
    answer = None
    for row in reversed(cells_):
        reference = full.get(row["length"])
        faster = row["status"] == "ok" and (
            (reference is not None and reference["status"] != "ok") or row.get("ratio_to_full", math.nan) < 1)
        if not faster:
            break
        answer = row["length"]
    return answer


# -- 3. where the time goes ----------------------------------------------------------------------------------
def profile_lengths(cfg: DictConfig) -> list[int]:
    """``profile.length``: one length or a list of them."""
    value = cfg.profile.length
    return [int(value)] if isinstance(value, (int, str)) else [int(v) for v in value]


def profile_layer(cfg: DictConfig, name: str, compile_mode: str, device: str, L: int) -> dict[str, Any]:
    """One attention layer's fwd + bwd step at length ``L`` (``profile`` shape, bf16, causal): median wall
    time as called, and replayed in a CUDA graph (``graph_ms``, or ``graph_note`` saying why not); GPU-busy time,
    kernels, copies and fills per step and the kernels by name from ``torch.profiler`` (``step_kernels``), host syncs
    per step (CUDA's sync debug mode; on CPU not counted), block masks built per step, peak memory above the inputs,
    host time per step and its largest events (``largest_events``)."""
    import warnings

    from longseq.attention import build_attention
    from longseq.attention.ops.flex import BUILDS

    spec_cfg = cfg.profile
    spec = build_spec(name, L, causal=True, n_heads=int(spec_cfg.heads), head_dim=int(spec_cfg.head_dim),
                      block_size=spec_cfg.block_size)
    row: dict[str, Any] = {"attention": name, "compile": compile_mode, "length": L, "status": "ok", "note": ""}
    if spec.skip_reason:
        return {**row, "status": "skipped", "note": spec.skip_reason}
    dtype = cells.DTYPES[str(spec_cfg.dtype)]
    torch.manual_seed(int(cfg.seed))
    attention = build_attention(spec.registry_name, **spec.kwargs).to(device=device, dtype=dtype).train()
    module = compile_module(attention, compile_mode)
    shape = (int(spec_cfg.batch), int(spec_cfg.heads), L, int(spec_cfg.head_dim))
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, device=device, dtype=dtype)
    dev = torch.device(device)

    def step() -> None:
        new_step(compile_mode)
        module(q, k, v).backward(grad_out)
        for tensor in (q, k, v, *attention.parameters()):
            tensor.grad = None

    for _ in range(int(spec_cfg.warmup)):
        step()
    cells._sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        baseline = torch.cuda.memory_allocated(dev)
    before = BUILDS["block_masks"]
    repeats = int(spec_cfg.repeats)
    row["wall_ms"] = median_s(step, dev, repeats) * 1e3
    row["block_masks_per_step"] = (BUILDS["block_masks"] - before) / max(1, repeats)
    if dev.type == "cuda":
        row["peak_mem_mb"] = (torch.cuda.max_memory_allocated(dev) - baseline) / 2**20
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        row["host_syncs_per_step"] = sum("synchroniz" in str(w.message) for w in caught)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    steps = max(1, int(spec_cfg.profiled))
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(steps):
            step()
        cells._sync(dev)
    row.update(step_kernels(profiler.events(), steps))
    if dev.type == "cuda" and row["wall_ms"] > 0:
        row["busy_share"] = row["gpu_busy_ms"] / row["wall_ms"]
    row["host_ms"], row["host_top"] = largest_events(profiler.key_averages(), steps)
    row.update(graph_timing(step, dev, compile_mode, int(spec_cfg.warmup), repeats))
    return row


def graph_timing(step: Callable[[], None], dev: torch.device, compile_mode: str, warmup: int,
                 repeats: int) -> dict[str, Any]:
    """The profiled step captured in one CUDA graph and replayed (``cuda_graph_replay``) -> ``graph_ms`` (median
    wall time of a replay: the GPU's time for the step) or ``graph_note`` (why there is none: no CUDA device, a
    module compiled with ``reduce-overhead`` replays graphs of its own, a capture that failed). Last in a profiled
    layer, so the graph's memory pool changes no figure before it; freed afterwards."""
    if compile_mode == "reduce-overhead":
        return {"graph_ms": math.nan, "graph_note": "n/a: reduce-overhead already replays CUDA graphs"}
    try:
        replay = cuda_graph_replay(step, dev, warmup)
    except NoCudaGraph as reason:
        return {"graph_ms": math.nan, "graph_note": f"skipped: {reason}"}
    except Exception as error:
        return {"graph_ms": math.nan, "graph_note": f"capture failed: {cells.error_text(error)}"}
    try:
        return {"graph_ms": median_s(replay, dev, repeats) * 1e3, "graph_note": ""}
    finally:
        del replay
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def add_profile_ratios(rows: list[dict[str, Any]]) -> None:
    """Each profiled row's wall and CUDA-graph times as ratios to full's at the same length and compile mode
    (``ratio_to_full``, ``graph_ratio_to_full``; NaN where either side has none), and the host's overhead: wall time
    as called minus the replay's (``host_overhead_ms``), also as a share of the wall time."""
    def key(r):
        return r["length"], r["compile"]

    full = {key(r): r for r in rows if r["attention"] == "full" and r["status"] == "ok"}
    for row in rows:
        if row["status"] != "ok":
            continue
        reference = full.get(key(row), {})
        for value, ratio in (("wall_ms", "ratio_to_full"), ("graph_ms", "graph_ratio_to_full")):
            mine, theirs = row.get(value, math.nan), reference.get(value, math.nan)
            row[ratio] = mine / theirs if theirs and not math.isnan(theirs) else math.nan
        row["host_overhead_ms"] = row["wall_ms"] - row.get("graph_ms", math.nan)
        row["host_share"] = row["host_overhead_ms"] / row["wall_ms"] if row["wall_ms"] > 0 else math.nan


TOP_EVENTS = 6  # host events listed per profiled layer
KERNELS_LISTED = 12  # kernels listed per profiled layer, largest GPU time first

# torch.profiler's activity types (kineto's names) of the work a GPU does; every other event on the GPU's timeline
# is an annotation (a record_function range drawn over the kernels it encloses) or bookkeeping, not work
GPU_WORK = {"kernel": "kernel", "gpu_memcpy": "copy", "gpu_memset": "fill"}


def gpu_activity(event: Any) -> str | None:
    """What one ``torch.profiler`` event (``FunctionEvent``) is on the GPU: ``kernel``, ``copy`` (memcpy), ``fill``
    (memset), ``annotation`` (``is_user_annotation``: a range torch's own device totals leave out, since it spans
    kernels counted already), ``other`` (another event on the GPU's timeline), or None (a host event). Where the
    event has no ``activity_type`` (older torch), copies and fills are told by their names."""
    if event.device_type != torch.autograd.DeviceType.CUDA:
        return None
    activity = getattr(event, "activity_type", None) or ""
    if getattr(event, "is_user_annotation", False) or "annotation" in activity:
        return "annotation"
    if activity:
        return GPU_WORK.get(activity, "other")
    return "copy" if event.name.startswith("Memcpy") else "fill" if event.name.startswith("Memset") else "kernel"


def step_kernels(events: Any, steps: int) -> dict[str, Any]:
    """``torch.profiler``'s events over ``steps`` steps -> per step: ``kernels_per_step``, ``copies_per_step``
    (copies and fills), ``annotations_per_step`` and ``other_gpu_per_step`` (on the GPU's timeline, left out),
    ``gpu_busy_ms`` (the kernels', copies' and fills' time) and ``kernels``: every kernel name as ``(name, µs per
    step, calls per step)``, largest GPU time first (``gpu_activity``)."""
    counts = {"kernel": 0, "copy": 0, "fill": 0, "annotation": 0, "other": 0}
    busy_us = 0.0
    by_name: dict[str, list[float]] = {}
    for event in events:
        kind = gpu_activity(event)
        if kind is None:
            continue
        counts[kind] += 1
        if kind in ("kernel", "copy", "fill"):
            busy_us += event.time_range.elapsed_us()
        if kind == "kernel":
            total = by_name.setdefault(event.name, [0.0, 0])
            total[0] += event.time_range.elapsed_us()
            total[1] += 1
    kernels = sorted(((name, us / steps, calls / steps) for name, (us, calls) in by_name.items()),
                     key=lambda kernel: kernel[1], reverse=True)
    return {"kernels_per_step": counts["kernel"] / steps, "copies_per_step": (counts["copy"] + counts["fill"]) / steps,
            "annotations_per_step": counts["annotation"] / steps, "other_gpu_per_step": counts["other"] / steps,
            "gpu_busy_ms": busy_us / steps / 1e3, "kernels": kernels}


def largest_events(averages, steps: int) -> tuple[float, list[tuple[str, float, float]]]:
    """Where a profiled step's host time goes: the self CPU time of every ``key_averages`` event -> the total per
    step in ms and the ``TOP_EVENTS`` largest events as ``(name, µs per step, calls per step)``. A layer whose GPU
    idles most of its wall time (docs/gpu_check_h100.md: 13 % busy) is bound by the host's: dynamo's guards
    ("TorchDynamo Cache Lookup"), the compiled graph's wrappers ("CompiledFunction", "## Call CompiledFxGraph"),
    kernel launches, autograd; one that keeps it busy, by its kernels (``step_kernels`` lists them)."""
    events = [(e.key, e.self_cpu_time_total, e.count) for e in averages
              if e.device_type == torch.autograd.DeviceType.CPU and e.self_cpu_time_total > 0]
    events.sort(key=lambda event: event[1], reverse=True)
    total = sum(us for _, us, _ in events) / steps / 1e3
    return total, [(name, us / steps, count / steps) for name, us, count in events[:TOP_EVENTS]]


def run_profile(cfg: DictConfig, device: str, limit: TimeLimit = NO_LIMIT) -> list[dict[str, Any]]:
    """``profile_layer`` for every length of ``profile.length``, attention of ``profile.attentions`` and compile mode
    of ``profile.compile``."""
    rows = []
    for L, name, compile_mode in profile_units(cfg):
        if limit.passed():
            rows.append({"attention": name, "compile": compile_mode, "length": L, "status": TIME_LIMIT, "note": ""})
            continue
        fresh_compiles(device)
        try:
            rows.append(profile_layer(cfg, name, compile_mode, device, L))
        except Exception as error:
            rows.append({"attention": name, "compile": compile_mode, "length": L,
                         "status": "oom" if cells.is_oom(error) else "error", "note": cells.error_text(error)})
        print(f"  profile {name} {compile_mode} L={L}: " + ", ".join(
            f"{k} {_fmt(v, '.3g')}" for k, v in rows[-1].items() if isinstance(v, float)), flush=True)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    add_profile_ratios(rows)
    return rows


def profile_units(cfg: DictConfig) -> list[tuple[int, str, str]]:
    """(length, attention, compile mode) of every profiled layer, in the order the stage runs them."""
    return [(L, name, mode) for L in profile_lengths(cfg) for name in _names(cfg.profile.attentions)
            for mode in compile_modes(cfg.profile.compile)]


# -- 4. training ---------------------------------------------------------------------------------------------
def _model(cfg: DictConfig, name: str, device: str, seq_len: int, block_size: int) -> torch.nn.Module:
    from longseq.models.transformer import Transformer

    spec = build_spec(name, seq_len, causal=True, n_heads=int(cfg.n_heads), head_dim=int(cfg.d_model) // int(cfg.n_heads),
                      block_size=block_size)
    if spec.skip_reason:
        raise ValueError(spec.skip_reason)
    attention = {k: v for k, v in spec.kwargs.items() if k not in {"seq_len", "n_heads", "head_dim", "dropout"}}
    torch.manual_seed(0)
    return Transformer(vocab_size=int(cfg.vocab_size), seq_len=seq_len, n_layers=int(cfg.n_layers),
                       d_model=int(cfg.d_model), n_heads=int(cfg.n_heads), mlp_ratio=cfg.mlp_ratio, dropout=0.0,
                       attn_dropout=0.0, attention={"name": spec.registry_name, **attention}, pos_emb="learned",
                       image_shape=None).to(device)


def model_flops_per_token(model: torch.nn.Module, cfg: DictConfig, seq_len: int) -> float:
    """Training FLOPs per token as nanoGPT / PaLM count them: ``6 N`` (N = parameters outside the embeddings) plus
    ``12 n_layers d_model L`` for dense attention's two products. The same count for every variant (the work of
    the model, not of its kernels), so MFU compares like throughput."""
    embedding = sum(p.numel() for n, p in model.named_parameters() if "emb" in n or "pos" in n)
    n = sum(p.numel() for p in model.parameters()) - embedding
    return 6.0 * n + 12.0 * int(cfg.n_layers) * int(cfg.d_model) * seq_len


def _train_steps(model: torch.nn.Module, cfg: DictConfig, device: str, steps: int, warmup: int,
                 tokens: torch.Tensor, compile_mode: str = "none", graphs: list[int] | None = None) -> float:
    """Median seconds per AdamW step (next-token loss) under the configured precision. ``graphs``: filled with
    dynamo's graph count (``compiled_graphs``) before the first step, after the warm-up steps and after the last."""
    from longseq.bench.throughput import next_token_loss

    if cfg.precision not in ("bf16-mixed", "32-true"):
        raise SystemExit(f"train.precision: '{cfg.precision}' unknown; valid: bf16-mixed, 32-true")
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(cfg.lr))
    model.train()
    device_type = torch.device(device).type
    times = []
    for step in range(warmup + steps):
        if graphs is not None:  # before the first step, and before the first timed one (the same with no warm-up)
            graphs += [compiled_graphs()] * ((step == 0) + (step == warmup))
        batch = tokens[step % tokens.shape[0]].to(device)
        cells._sync(torch.device(device))
        start = time.perf_counter()
        new_step(compile_mode)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16-mixed"):
            loss = next_token_loss(model, batch)
        loss.backward()
        optimizer.step()
        cells._sync(torch.device(device))
        times.append(time.perf_counter() - start)
    if graphs is not None:
        graphs.append(compiled_graphs())
    if not math.isfinite(loss.item()):
        raise FloatingPointError(f"non-finite loss {loss.item()}")
    return statistics.median(times[warmup:] or times)


def train_cases(cfg: DictConfig) -> list[tuple[str, int, int, str]]:
    """(attention, sequence length, block size, compile mode) of every training row, in the order they run."""
    spec = cfg.train
    return [(name, int(geo.seq_len), int(geo.block_size), mode) for geo in spec.geometries
            for name in _names(spec.attentions) for mode in compile_modes(spec.compile)]


def run_training(cfg: DictConfig, device: str, flops: float | None, log: bool = True,
                 limit: TimeLimit = NO_LIMIT) -> list[dict[str, Any]]:
    """One row per attention, geometry and compile mode: tokens/s, the graphs dynamo compiled over the row's steps
    (``graphs``) and over its timed steps (``graphs_in_timed_steps``: a recompile, which the timing then includes),
    peak memory (CUDA), MFU (where the device's peak is known). ``log``: a line per row (off in the warm-up, whose
    steps share the GPU and time nothing)."""
    spec = cfg.train
    steps, warmup = int(spec.steps), int(spec.warmup)
    rows = []
    for name, seq_len, block_size, compile_mode in train_cases(cfg):
        generator = torch.Generator().manual_seed(int(cfg.seed))
        tokens = torch.randint(0, int(spec.vocab_size), (steps + warmup, int(spec.batch), seq_len), generator=generator)
        row: dict[str, Any] = {"attention": name, "seq_len": seq_len, "compile": compile_mode, "batch": int(spec.batch),
                               "status": "ok", "note": "", "tokens_per_s": math.nan, "peak_mem_mb": math.nan,
                               "mfu": math.nan}
        if limit.passed():
            rows.append({**row, "status": TIME_LIMIT})
            continue
        try:
            fresh_compiles(device)
            model = _model(spec, name, device, seq_len, block_size)
            if compile_mode != "none":  # as model.compile=true does, so the first trace is one graph
                model.prepare_flex_layouts(device)
            model = compile_module(model, compile_mode)  # as model.compile=true: the warm-up steps compile
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            graphs: list[int] = []
            step_s = _train_steps(model, spec, device, steps, warmup, tokens, compile_mode, graphs)
            row["tokens_per_s"] = int(spec.batch) * seq_len / step_s
            row["step_ms"] = step_s * 1e3
            # one graph for a backbone compiled whole (its flex layers inlined); eager, the layers' own graph(s)
            row["graphs"], row["graphs_in_timed_steps"] = graphs[-1] - graphs[0], graphs[-1] - graphs[1]
            if device.startswith("cuda"):
                row["peak_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
            if flops:
                row["mfu"] = model_flops_per_token(model, spec, seq_len) * row["tokens_per_s"] / flops
            del model
        except Exception as error:
            row.update(status="oom" if cells.is_oom(error) else "error", note=cells.error_text(error))
        if log:
            print(f"  train {name} L={seq_len} compile={compile_mode}: {row['status']} "
                  f"{_fmt(row.get('tokens_per_s'), ',.0f')} tokens/s {row['note'][:120]}", flush=True)
        rows.append(row)
    return rows


# -- compiling ahead, in parallel ------------------------------------------------------------------------------
def warm_up_tasks(cfg: DictConfig) -> list[tuple[str, tuple]]:
    """The units of compile work of every stage: a correctness attention, a Fig. 3 attention at one length, a profiled
    attention and mode, a training row. Heavy ones first, so the pool ends together; under a time limit in the stages'
    order instead, so what the limit cuts is what would have run last."""
    tasks = [("correctness", (name,)) for name in _names(cfg.correctness.attentions)]
    # a Fig. 3 unit per length: one graph each (static shapes), so the pool shares them out evenly
    lengths = sorted(int(n) for n in cfg.fig3.lengths)
    tasks += [("fig3", (name, L)) for name in _names(cfg.fig3.attentions) for L in lengths]
    tasks += [("profile", unit) for unit in profile_units(cfg) if not _compiled_by_fig3(cfg, *unit)]
    tasks += [("train", case) for case in train_cases(cfg)]
    heavy_first = ("train", "fig3", "profile", "correctness")
    order = heavy_first if cfg.get("time_limit_s") is None else heavy_first[::-1]
    return sorted(tasks, key=lambda task: order.index(task[0]))


def _compiled_by_fig3(cfg: DictConfig, L: int, name: str, compile_mode: str) -> bool:
    """Whether a Fig. 3 warm-up unit compiles the graph this profiled layer runs (the same attention, length, shape,
    dtype, block size and mode): its warm-up unit would compile it again, beside it, for nothing."""
    f, p = cfg.fig3, cfg.profile
    shape = {"batch": int(p.batch), "heads": int(p.heads), "head_dim": int(p.head_dim)}
    return (name in _names(f.attentions) and L in {int(n) for n in f.lengths} and bool(f.causal)
            and shape in [{key: int(s[key]) for key in shape} for s in f.shapes] and str(f.dtype) == str(p.dtype)
            and f.block_size == p.block_size and "fwd_bwd" in _modes(f.mode)
            and compile_mode in compile_modes(f.get("compile", "none")))


def _warm_task(cfg_yaml: str, device: str, kind: str, args: tuple, threads: int) -> list[dict[str, Any]]:
    """One warm-up unit, in its own process: the stage's code for one unit with the timed repeats cut to one
    (compilation fills inductor's on-disk caches) -> the correctness rows (real results), nothing for the others."""
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = threads
    cfg = OmegaConf.create(cfg_yaml)
    if kind == "correctness":
        cfg.correctness.attentions = [args[0]]
        return check_correctness(cfg, device)
    if kind == "fig3":
        cfg.fig3.attentions, cfg.fig3.lengths = [args[0]], [args[1]]
        cfg.fig3.repeats, cfg.fig3.warmup = 0, 1
        errors = []
        for shape in cfg.fig3.shapes:
            for _, cell in fig3_cells(cfg, device, [args[0]], shape):
                if isinstance(cell, cells.CellSpec):
                    result = cells.measure_cell(dataclasses.replace(cell, budget_s=math.inf))
                    errors += [f"L={cell.length}: {result.note}"] if result.status == "error" else []
                    torch.cuda.empty_cache() if device.startswith("cuda") else None
        if errors:  # logged as not compiled; the timed stage compiles it again and reports the row
            raise RuntimeError("; ".join(errors))
        return []
    if kind == "profile":
        cfg.profile.repeats, cfg.profile.profiled = 1, 1
        L, name, mode = args
        profile_layer(cfg, name, mode, device, L)
        return []
    name, seq_len, block_size, mode = args
    cfg.train.attentions, cfg.train.compile = [name], [mode]
    cfg.train.geometries = [{"seq_len": seq_len, "block_size": block_size}]
    cfg.train.steps, cfg.train.warmup = 1, 2
    (row,) = run_training(cfg, device, None, log=False)
    if row["status"] == "error":
        raise RuntimeError(row["note"])
    return []


def _unit_within(limit: TimeLimit, task: Callable[..., list], *args: Any) -> list[dict[str, Any]]:
    """One warm-up unit in a process of its own, stopped at the time limit (not started past it)."""
    if limit.passed():
        raise RuntimeError(limit.note())
    return cells.call_isolated(task, *args, timeout_s=None if limit.limit_s is None else limit.left_s())


def warm_up(cfg: DictConfig, device: str, task: Callable[..., list] = _warm_task,
            limit: TimeLimit = NO_LIMIT) -> tuple[list[dict[str, Any]], set]:
    """Every stage's compilation in ``workers`` processes at once (``warm_up_tasks``), each unit in a fresh process
    of its own -> (the correctness rows in the configured order, the units that compiled). A unit that fails or
    whose process dies (a compiler's segfault) is logged with the reason and costs only itself: its correctness
    rows are checked again here, in this process, and the timed stages compile what did not (``run_fig3``). Past
    the time limit no unit starts and a running one is stopped; its correctness rows say ``time_limit``."""
    import concurrent.futures

    workers = int(cfg.workers)
    cfg_yaml = OmegaConf.to_yaml(cfg)
    threads = max(1, (os.cpu_count() or 1) // workers)
    rows: dict[str, list] = {}
    compiled: set[tuple[str, tuple]] = set()
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {pool.submit(_unit_within, limit, task, cfg_yaml, device, kind, args, threads): (kind, args)
                   for kind, args in warm_up_tasks(cfg)}
        for future in concurrent.futures.as_completed(futures):
            kind, args = futures[future]
            try:
                result = future.result()
            except RuntimeError as error:
                then = "the time limit is past" if limit.passed() else (
                    f"the stage {'checks it here' if kind == 'correctness' else 'compiles it'}")
                print(f"  warm-up {kind} {args}: {error} ({time.perf_counter() - start:.0f} s; {then})", flush=True)
                continue
            compiled.add((kind, args))
            done = f"compiled ({time.perf_counter() - start:.0f} s)"
            if kind == "correctness":  # select_attentions adds full to every list: keep the task's own rows
                rows[args[0]] = [row for row in result if row["attention"] == args[0]]
                statuses = [row["status"] for row in rows[args[0]]]
                done += "; " + ", ".join(f"{statuses.count(s)} {s}" for s in dict.fromkeys(statuses))
            print(f"  warm-up {kind} {args}: {done}", flush=True)  # the unit's process logged its own rows
    names = _names(cfg.correctness.attentions)
    for name in (n for n in names if n not in rows):
        rerun = OmegaConf.merge(cfg, {"correctness": {"attentions": [name]}})
        rows[name] = [row for row in check_correctness(rerun, device, limit) if row["attention"] == name]
    return [row for name in names for row in rows[name]], compiled


# -- 5. DDP --------------------------------------------------------------------------------------------------
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
        geometry = cfg.train.geometries[0]
        seq_len = int(geometry.seq_len)
        model = _model(cfg.train, str(cfg.ddp.attention), device, seq_len, int(geometry.block_size))
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if device_type == "cuda" else None)
        generator = torch.Generator().manual_seed(int(cfg.seed) + rank)  # each rank its own batches
        steps = int(cfg.ddp.steps)
        tokens = torch.randint(0, int(cfg.train.vocab_size), (steps + 1, int(cfg.train.batch), seq_len),
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
                "tokens_per_s": world * int(cfg.train.batch) * seq_len / step_s,
                "param_spread": spread, "status": "pass" if spread == 0.0 else "FAIL"}))
    finally:
        dist.destroy_process_group()


def run_ddp(cfg: DictConfig, device: str, out: Path, limit: TimeLimit = NO_LIMIT) -> dict[str, Any]:
    """DDP over every visible GPU (>= 2), or ``ddp.cpu_processes`` gloo processes on CPU; a status row otherwise."""
    import torch.multiprocessing as mp

    if device.startswith("cuda"):
        world, device_type = torch.cuda.device_count(), "cuda"
        if world < 2:
            return {"status": "skipped", "note": f"{world} GPU visible (DDP needs >= 2)"}
    else:
        world, device_type = int(cfg.ddp.cpu_processes), "cpu"
    if limit.passed():
        return {"status": TIME_LIMIT, "note": limit.note()}
    out_file = out / "ddp.json"
    args = (world, _free_port(), OmegaConf.to_yaml(cfg), device_type, str(out_file))
    try:
        if world == 1:  # the same code in this process: no interpreter start-up (dry runs)
            _ddp_worker(0, *args)
        else:
            mp.spawn(_ddp_worker, args=args, nprocs=world, join=True)
        return json.loads(out_file.read_text())
    except Exception as error:
        return {"status": "error", "world_size": world, "note": cells.error_text(error)}


# -- 6. the report -------------------------------------------------------------------------------------------
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


def crossover_table(tables: list[list[dict[str, Any]]], shapes: list[dict[str, Any]], mode: str,
                    compile_mode: str = "none") -> str:
    names = list(dict.fromkeys(r["attention"] for rows in tables for r in rows if r["attention"] != "full"))
    heads = [f"B{s['batch']} H{s['heads']} D{s['head_dim']}" for s in shapes]
    lines = ["| attention | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for name in names:
        values = [crossover(rows, name, mode, compile_mode) for rows in tables]
        lines.append(f"| {name} | " + " | ".join("never" if v is None else f"L={v}" for v in values) + " |")
    return "\n".join(lines)


def calibration_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| what | calls | launches / call | host µs (issued) | wall µs | GPU µs | status |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r.get('calls', '')} | {r.get('launches_per_call', '')} | "
                     f"{_fmt(r.get('host_us'), ',.2f')} | {_fmt(r.get('wall_us'), ',.2f')} | "
                     f"{_fmt(r.get('gpu_us'), ',.2f')} | {r['status']}{(': ' + r['note']) if r.get('note') else ''} |")
    return "\n".join(lines)


def profile_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| attention | L | compile | wall ms | GPU-busy ms | busy share | kernels / step | copies + fills / step | "
             "host syncs / step | block masks built / step | peak MB | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['attention']} | {r['length']} | {r['compile']} | {_fmt(r.get('wall_ms'), '.3f')} | "
                     f"{_fmt(r.get('gpu_busy_ms'), '.3f')} | {_fmt(r.get('busy_share'), '.0%')} | "
                     f"{_fmt(r.get('kernels_per_step'), '.0f')} | {_fmt(r.get('copies_per_step'), '.0f')} | "
                     f"{_fmt(r.get('host_syncs_per_step'), 'd')} | "
                     f"{_fmt(r.get('block_masks_per_step'), '.2g')} | {_fmt(r.get('peak_mem_mb'), ',.1f')} | "
                     f"{r['status']}{(': ' + r['note']) if r.get('note') else ''} |")
    return "\n".join(lines)


def graph_table(rows: list[dict[str, Any]]) -> str:
    """Each profiled layer as called and replayed in a CUDA graph (``graph_timing``), with ratios to full
    (``add_profile_ratios``) and the host's overhead."""
    lines = ["| attention | L | compile | as called ms | ratio to full | CUDA graph ms | ratio to full | "
             "host overhead ms | host share | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            continue
        lines.append(f"| {r['attention']} | {r['length']} | {r['compile']} | {_fmt(r.get('wall_ms'), '.3f')} | "
                     f"{_fmt(r.get('ratio_to_full'), '.2f')} | {_fmt(r.get('graph_ms'), '.3f')} | "
                     f"{_fmt(r.get('graph_ratio_to_full'), '.2f')} | {_fmt(r.get('host_overhead_ms'), '.3f')} | "
                     f"{_fmt(r.get('host_share'), '.0%')} | {r.get('graph_note', '')} |")
    return "\n".join(lines)


def _listed(events: list, limit: int) -> str:
    """``(name, µs per step, calls per step)`` as markdown, the first ``limit``, then how many more."""
    text = "; ".join(f"`{name[:60].replace('|', '/')}` {us:,.1f} ({calls:.0f})" for name, us, calls in events[:limit])
    return text + (f"; ... {len(events) - limit} more" if len(events) > limit else "")


def kernels_table(rows: list[dict[str, Any]]) -> str:
    """The profiled layers' kernels per step (``step_kernels``), by name, largest GPU time first (the first
    ``KERNELS_LISTED``)."""
    lines = ["| attention | L | compile | kernels / step | copies + fills / step | annotations left out / step | "
             "kernels: GPU µs / step (calls / step), largest first |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "kernels" in r:
            listed = _listed(r["kernels"], KERNELS_LISTED) or "none (no CUDA device)"
            lines.append(f"| {r['attention']} | {r['length']} | {r['compile']} | "
                         f"{_fmt(r['kernels_per_step'], '.0f')} | {_fmt(r['copies_per_step'], '.0f')} | "
                         f"{_fmt(r['annotations_per_step'], '.0f')} | {listed} |")
    return "\n".join(lines)


def events_table(rows: list[dict[str, Any]]) -> str:
    """The profiled layers' host time per step with its largest events (``largest_events``)."""
    lines = ["| attention | L | compile | host ms / step | largest host events: self µs / step (calls / step) |",
             "|---|---|---|---|---|"]
    for r in rows:
        if "host_top" in r:
            lines.append(f"| {r['attention']} | {r['length']} | {r['compile']} | {_fmt(r.get('host_ms'), '.3f')} | "
                         f"{_listed(r['host_top'], TOP_EVENTS)} |")
    return "\n".join(lines)


def _full_tokens(rows: list[dict[str, Any]]) -> dict[tuple[int, str], float]:
    return {(r["seq_len"], r["compile"]): r.get("tokens_per_s") for r in rows if r["attention"] == "full"}


def training_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| attention | L | compile | tokens/s | ratio to full | step ms | graphs (in timed steps) | peak MB | MFU | "
             "status |", "|---|---|---|---|---|---|---|---|---|---|"]
    full = _full_tokens(rows)
    for r in rows:
        reference = full.get((r["seq_len"], r["compile"]))
        ratio = r.get("tokens_per_s", math.nan) / reference if reference else math.nan
        graphs = f"{r['graphs']} ({r['graphs_in_timed_steps']})" if "graphs" in r else ""
        lines.append(f"| {r['attention']} | {r['seq_len']} | {r['compile']} | {_fmt(r.get('tokens_per_s'), ',.0f')} | "
                     f"{_fmt(ratio, '.2f')} | {_fmt(r.get('step_ms'), '.1f')} | {graphs} | "
                     f"{_fmt(r.get('peak_mem_mb'), ',.0f')} | {_fmt(r.get('mfu'), '.1%')} | "
                     f"{r['status']}{(': ' + r['note']) if r.get('note') else ''} |")
    return "\n".join(lines)


def whole_step_table(rows: list[dict[str, Any]]) -> str:
    """Training tokens/s per attention and length, one column per compile mode (``ratio`` to full in the same mode),
    and each side at its fastest mode: the variant's best tokens/s over full's best."""
    modes = list(dict.fromkeys(r["compile"] for r in rows))
    full = _full_tokens(rows)
    by_key = {(r["attention"], r["seq_len"], r["compile"]): r for r in rows}
    lines = ["| attention | L | " + " | ".join(f"{mode}: tokens/s (ratio)" for mode in modes) +
             " | best mode (ratio to full's best) |", "|---|---|" + "---|" * (len(modes) + 1)]
    for name, seq_len in dict.fromkeys((r["attention"], r["seq_len"]) for r in rows):
        cells_, best = [], (math.nan, "")
        for mode in modes:
            r = by_key.get((name, seq_len, mode))
            tokens = r.get("tokens_per_s", math.nan) if r and r["status"] == "ok" else math.nan
            reference = full.get((seq_len, mode))
            ratio = tokens / reference if reference and not math.isnan(reference) else math.nan
            cells_.append(f"{_fmt(tokens, ',.0f')} ({_fmt(ratio, '.2f')})" if not math.isnan(tokens)
                          else (r["status"] if r else ""))
            if not math.isnan(tokens) and (math.isnan(best[0]) or tokens > best[0]):
                best = (tokens, mode)
        full_best = max((v for (length, _), v in full.items() if length == seq_len and v and not math.isnan(v)),
                        default=math.nan)
        ratio = best[0] / full_best if full_best and not math.isnan(full_best) else math.nan
        lines.append(f"| {name} | {seq_len} | " + " | ".join(cells_) +
                     f" | {best[1]} ({_fmt(ratio, '.2f')}) |")
    return "\n".join(lines)


def write_report(out: Path, cfg: DictConfig, env: dict[str, Any], calibration: list, correctness: list, fig3: list,
                 profile: list, training: list, ddp: dict[str, Any], flops: float | None) -> str:
    shapes = OmegaConf.to_object(cfg.fig3.shapes)
    modes = _modes(cfg.fig3.mode)
    fig3_compile = compile_modes(cfg.fig3.get("compile", "none"))
    counts = {s: sum(r["status"] == s for r in correctness) for s in ("pass", "pass*", "FAIL", "error", "n/a")}
    c = cfg.calibration
    lines = [f"# longseq gpu-check{' (dry: CPU, tiny sizes)' if cfg.dry else ''}", "",
             "## Device", ""]
    lines += [f"- {key}: {value}" for key, value in env.items()]
    cut = units_cut(calibration, correctness, fig3, profile, training, ddp)
    if cut:
        lines.append(f"- **{cut} unit(s) of work not run: past time_limit_s={cfg.time_limit_s:g}** (status time_limit)")
    lines += [f"- peak bf16 FLOP/s used for MFU: {_fmt(flops, '.3g') or 'unknown device: MFU omitted'}", "",
              "## Calibration", "",
              f"What one launch and one compiled call cost on this host. µs per launch (the add rows: "
              f"{c.launches} back-to-back launches of a 1-element add) or per call ((x * w).sum() over {c.size} "
              f"elements, w requiring grad; {c.calls} calls after {c.warmup}; compiled with torch.compile backend "
              f"{c.backend}, static shapes). host: the calls returned (issued, not waited for); wall: the device "
              "finished them; GPU: between two CUDA events around them (the GPU's timeline, gaps included). The "
              "graph row is the GPU's own cost per kernel. To read a layer below: its host time is about the compiled "
              "fwd + bwd row (once per compiled call) plus its kernels per step times the host µs per launch; "
              "what the graph-replayed layer saves is that host time.", "",
              calibration_table(calibration), "",
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
              "## Fig. 3 benchmark", ""]
    if not cfg.fig3.lengths or not shapes:
        lines += ["Not run: no fig3.lengths or fig3.shapes in this configuration (the quick preset's profile below "
                  "times the same layers, as called and replayed in a CUDA graph).", ""]
    else:
        lines += [f"{cfg.fig3.dtype}, causal={cfg.fig3.causal}, median of {cfg.fig3.repeats} after "
                  f"{cfg.fig3.warmup} warm-up; ms (ratio to full = SDPA) / peak MB above the inputs.", ""]
        for shape, rows in zip(shapes, fig3):
            for mode in modes:
                for compile_mode in fig3_compile:
                    chosen = [r for r in rows if r.get("compile", "none") == compile_mode]
                    lines += [f"### {mode}, B={shape['batch']} H={shape['heads']} D={shape['head_dim']}, module "
                              f"compile: {compile_mode}", "", report.markdown_table(chosen, mode), ""]
        for mode in modes:
            for compile_mode in fig3_compile:
                lines += [f"### crossover ({mode}, compile {compile_mode}): shortest L from which the variant is "
                          "faster than full", "", crossover_table(fig3, shapes, mode, compile_mode), ""]
    p, t = cfg.profile, cfg.train
    lines += ["## Where the time goes", "",
              f"One layer's fwd + bwd step at L={', '.join(map(str, profile_lengths(cfg)))}, B={p.batch} H={p.heads} "
              f"D={p.head_dim}, {p.dtype}, causal; median wall time of {p.repeats} steps (the module as training calls "
              f"it, or compiled whole); GPU-busy time, kernels and copies + fills (annotation ranges left out) from "
              f"torch.profiler over {p.profiled} steps; host syncs from CUDA's sync debug mode over one step; block "
              "masks built per step outside a compiled graph (a static layout rebuilt; the k-means layouts build theirs "
              "on the device inside the compiled step, not counted); peak memory above the inputs.", "",
              profile_table(profile), "",
              "### The layer as called and replayed in a CUDA graph", "",
              "The same step captured once in a CUDA graph (static inputs, gradients from the graph's pool) and "
              f"replayed: median of {p.repeats} replays, the GPU's time with no host in the way. Ratios to full at the "
              "same length and compile mode, both sides timed the same way; host overhead = as called - replayed.", "",
              graph_table(profile), "",
              "### Kernels per step", "",
              f"Kernels per step by name (torch.profiler events on the GPU that are kernels: copies and fills counted "
              f"apart, annotation ranges left out), largest GPU time first, the first {KERNELS_LISTED}:", "",
              kernels_table(profile), "",
              "Host time per step (torch.profiler's self CPU time of every event, summed) and the events that take "
              "most of it:", "",
              events_table(profile), "",
              "## Training", "",
              f"{t.precision}, synthetic tokens, batch {t.batch}, {t.n_layers} layers d={t.d_model} H={t.n_heads}, "
              f"AdamW; median of {t.steps} steps after {t.warmup}; compile = the backbone through torch.compile with "
              "that mode: default is model.compile=true (the flex layers inlined, one graph), reduce-overhead also "
              "replays its forward and backward as CUDA graphs (the whole step but the loss and the optimizer), none "
              "is eager (the attention layers' own compiled graphs inside). graphs: dynamo's graphs made by the row's "
              "steps, in brackets those made in the timed steps (a recompile). MFU = model FLOPs "
              "(6 N + 12 n_layers d L per token) x tokens/s / peak FLOP/s.", "",
              training_table(training), "",
              "### The whole-step graph against full", "",
              "tokens/s per compile mode, in brackets the ratio to full's in the same mode (same process); last, the "
              "fastest mode of each and its tokens/s over full's fastest.", "",
              whole_step_table(training), "",
              "## DDP", ""]
    lines += [f"- {key}: {value}" for key, value in ddp.items()]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    report.write_json({"env": env, "calibration": calibration, "correctness": correctness, "fig3": fig3,
                       "profile": profile, "training": training, "ddp": ddp}, out / "results.json")
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
    limit = TimeLimit(cfg.get("time_limit_s"))
    env["time_limit_s"] = limit.limit_s
    flops = peak_flops(env.get("gpu")) if device.startswith("cuda") else None
    print(f"gpu-check on {env['gpu'] or env['cpu']} ({device}) -> {out}", flush=True)
    stages: dict[str, float] = {}
    done: dict[str, Any] = {"calibration": [], "correctness": [], "fig3": [], "profile": [], "training": [],
                            "ddp": {"status": "not run yet"}}

    def stage(key: str, title: str, fn, *args) -> None:
        # the report is rewritten after every stage: a run stopped later (a time limit, a lost machine) keeps
        # what it measured
        print(f"{len(stages) + 1}/{len(done)} {title} ...", flush=True)
        start = time.perf_counter()
        done[key] = fn(*args)
        stages[title] = time.perf_counter() - start
        env["stage_seconds"] = ", ".join(f"{k} {v:.1f}" for k, v in stages.items())
        write_report(out, cfg, env, **done, flops=flops)

    # first, alone on the machine: the host's costs before any other stage's processes share it
    stage("calibration", "calibration", calibrate, cfg, device, limit)
    compiled: set[tuple[str, tuple]] = set()
    if int(cfg.workers) > 1:  # every stage's compilation at once; the correctness rows come from it

        def correctness_and_compilation() -> list[dict[str, Any]]:
            rows, units = warm_up(cfg, device, limit=limit)
            compiled.update(units)
            return rows

        stage("correctness", "correctness and compilation in parallel", correctness_and_compilation)
    else:
        stage("correctness", "correctness", check_correctness, cfg, device, limit)
    stage("fig3", "Fig. 3 benchmark", run_fig3, cfg, device, compiled, limit)
    stage("profile", "where the time goes", run_profile, cfg, device, limit)
    stage("training", "training", run_training, cfg, device, flops, True, limit)
    stage("ddp", "DDP", run_ddp, cfg, device, out, limit)
    correctness, ddp = done["correctness"], done["ddp"]
    text = (out / "report.md").read_text()
    checked = {r["attention"] for r in correctness if r["status"] != TIME_LIMIT}
    ok = (checked >= set(_names(cfg.correctness.attentions)) and all(r["status"] in PASSED for r in correctness)
          and ddp["status"] in ("pass", "skipped"))
    cut = units_cut(**done)
    print(text, flush=True)
    print(f"wrote {out}/report.md, results.json; {'all checks passed' if ok else 'SOME CHECKS FAILED OR NOT RUN'}"
          + (f"; {cut} unit(s) not run: past time_limit_s={limit.limit_s:g}" if cut else ""), flush=True)
    return out, ok


def units_cut(calibration: list, correctness: list, fig3: list, profile: list, training: list,
              ddp: dict[str, Any]) -> int:
    """Units of work (rows, cells, DDP) the time limit left out of a check's results."""
    rows = [*calibration, *correctness, *(r for table in fig3 for r in table), *profile, *training, ddp]
    return sum(r.get("status") == TIME_LIMIT for r in rows)


def main() -> None:
    from longseq.bench.__main__ import run_check

    run_check("gpu_check", run_gpu_check)


if __name__ == "__main__":
    main()
