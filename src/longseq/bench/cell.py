"""Time and measure one benchmark cell: one attention at one length in one mode.

Timing: ``warmup`` untimed iterations, then the median of ``repeats`` timed iterations (wall clock,
``torch.cuda.synchronize`` around each on GPU). ``fwd`` runs the module in eval mode under ``no_grad``
(inference); ``fwd_bwd`` runs it in train mode and back-propagates a fixed output gradient into q, k, v
(and the module's parameters, if any).

Peak memory, reported as the growth above what the inputs (q, k, v, output gradient, module) hold:
- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` minus the allocated bytes
  once the inputs exist.
- CPU: the resident-set high-water mark. The cell runs in a fresh process (``run_isolated``) so the
  allocator holds no memory freed by earlier cells; after the inputs are allocated the kernel's
  high-water mark is reset (``echo 5 > /proc/self/clear_refs``) and the peak is ``VmHWM`` minus the
  ``VmRSS`` at that moment. Where ``clear_refs`` is not writable the method falls back to
  ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` after the run minus its value once the inputs exist.
  Either way the figure covers the warm-up and the timed iterations, i.e. the op's peak working set.
"""

from __future__ import annotations

import ctypes
import math
import multiprocessing as mp
import resource
import signal
import statistics
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from longseq.utils.compiling import compile_module, new_step

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class CellSpec:
    """Everything a worker needs to run one cell (picklable)."""

    attention: str
    length: int
    mode: str  # "fwd" or "fwd_bwd"
    kwargs: dict[str, Any]
    batch: int
    heads: int
    head_dim: int
    dtype: str
    device: str
    warmup: int
    repeats: int
    budget_s: float
    threads: int | None = None
    seed: int = 0
    allocator: str = "glibc"
    compile: str = "none"  # none: the module as training calls it; else a torch.compile mode for the whole module


@dataclass
class CellResult:
    """One row's measurements; ``status`` is ok, over_budget, oom or error."""

    status: str
    ms: float = math.nan
    ms_min: float = math.nan
    ms_max: float = math.nan
    peak_mem_mb: float = math.nan
    input_mem_mb: float = math.nan
    warmup_ms: float = math.nan
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- CPU resident-set bookkeeping ---------------------------------------------------------------
def _status_kb(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise KeyError(field_name)


def _maxrss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux


class CpuPeakMemory:
    """Peak RSS growth from ``start()`` to ``peak_mb()`` (see the module docstring for the method)."""

    method = ""

    def start(self) -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.method = "VmHWM after clear_refs reset"
            self.baseline_kb = _status_kb("VmRSS")
        except OSError:
            self.method = "ru_maxrss growth"
            self.baseline_kb = _maxrss_kb()

    def peak_mb(self) -> float:
        now = _status_kb("VmHWM") if self.method.startswith("VmHWM") else _maxrss_kb()
        return max(0, now - self.baseline_kb) / 1024


def cpu_memory_method() -> str:
    """Which CPU peak-memory method this machine supports (recorded in env.json)."""
    probe = CpuPeakMemory()
    try:
        probe.start()
    except Exception:  # pragma: no cover - no /proc
        return "unavailable"
    return probe.method


def is_oom(error: BaseException) -> bool:
    """Out-of-memory on either device (CUDA raises OutOfMemoryError; CPU a RuntimeError)."""
    if isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(error).lower()
    return "out of memory" in text or "can't allocate memory" in text or "failed to allocate" in text


# -- the measurement ---------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prime_runtime(device: torch.device, dtype: torch.dtype) -> None:
    """Run a tiny SDPA forward/backward so one-off runtime costs happen before the memory baseline
    rather than inside the cell: on CPU the first backward from a non-scalar output gradient costs about
    30 MB regardless of size (autograd engine start-up), plus kernel and thread-pool initialisation."""
    q, k, v = (torch.randn(1, 2, 16, 8, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(torch.ones_like(out))
    weights = (q @ k.transpose(-1, -2)).softmax(-1)
    (weights @ v).backward(torch.ones_like(v))
    _sync(device)


# ``allocator``: glibc's malloc maps every block of 32 MiB or more afresh and unmaps it when freed, so each such
# tensor is paid for again in page faults (at L = 16384, B1 H8 D64, before the CPU engine ran their heads in groups:
# 0.4 to 0.54 M faults per fwd + bwd of moba, nsa or combiner_select, about 1 s of system time; 0.04 M for full);
# ``heap`` keeps freed blocks for reuse, as a caching allocator does (CUDA's, jemalloc, tcmalloc).
ALLOCATORS = ("glibc", "heap")
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters


def keep_freed_memory() -> bool:
    """``allocator=heap``: glibc malloc serves large blocks from the heap and keeps freed memory for reuse (mallopt:
    no mmap, no trimming) in this process from now on. False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def measure_cell(spec: CellSpec, report: Callable[[str, Any], None] = lambda kind, payload: None) -> CellResult:
    """Build the attention and inputs, time it and measure its peak memory -> ``CellResult``.

    ``report`` receives progress events (``built``, ``warmup``) so that a supervising process can kill
    a cell whose first warm-up iteration overruns the budget.
    """
    from longseq.attention import build_attention

    if spec.threads:
        torch.set_num_threads(spec.threads)
    if spec.allocator == "heap" and not keep_freed_memory():
        return CellResult("error", note="allocator=heap: this C library is not glibc (no mallopt)")
    torch.manual_seed(spec.seed)
    device = torch.device(spec.device)
    dtype = DTYPES[spec.dtype]
    try:
        attention = build_attention(spec.attention, **spec.kwargs).to(device=device, dtype=dtype)
    except Exception as error:
        return CellResult("error", note=f"build: {type(error).__name__}: {error}".splitlines()[0])
    train = spec.mode == "fwd_bwd"
    attention.train(train)
    module = compile_module(attention, spec.compile)
    shape = (spec.batch, spec.heads, spec.length, spec.head_dim)
    try:
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=train) for _ in range(3))
        grad_out = torch.randn(shape, device=device, dtype=dtype)
    except Exception as error:
        return CellResult("oom" if is_oom(error) else "error", note=f"inputs: {error}".splitlines()[0])

    def step() -> None:
        new_step(spec.compile)
        if train:
            out = module(q, k, v)
            out.backward(grad_out)
            for tensor in (q, k, v, *attention.parameters()):
                tensor.grad = None
        else:
            with torch.no_grad():
                module(q, k, v)

    input_bytes = 4 * q.numel() * q.element_size() + sum(p.numel() * p.element_size() for p in attention.parameters())
    prime_runtime(device, dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        cpu_memory = None
    else:
        cpu_memory = CpuPeakMemory()
        cpu_memory.start()
    report("built", None)

    result = CellResult("ok", input_mem_mb=input_bytes / 2**20)
    try:
        times = []
        for i in range(max(1, spec.warmup) + spec.repeats):
            _sync(device)
            start = time.perf_counter()
            step()
            _sync(device)
            times.append(time.perf_counter() - start)
            if i == 0:
                result.warmup_ms = times[0] * 1e3
                report("warmup", times[0])
                if times[0] > spec.budget_s:
                    result.status = "over_budget"
                    result.note = f"first warm-up iteration {times[0]:.1f} s > budget_s={spec.budget_s:g}"
                    break
        timed = times[max(1, spec.warmup):]
        if timed:
            result.ms = statistics.median(timed) * 1e3
            result.ms_min, result.ms_max = min(timed) * 1e3, max(timed) * 1e3
    except Exception as error:
        oom = is_oom(error)
        result = CellResult("oom" if oom else "error", note=error_text(error, where=not oom))
    if device.type == "cuda":
        result.peak_mem_mb = (torch.cuda.max_memory_allocated(device) - baseline) / 2**20
        del q, k, v, grad_out, attention
        torch.cuda.empty_cache()
    elif cpu_memory is not None:
        result.peak_mem_mb = cpu_memory.peak_mb()
    result.input_mem_mb = input_bytes / 2**20
    return result


# -- process isolation -------------------------------------------------------------------------
_CONTEXT: Any = None


def _context() -> Any:
    """A forkserver context whose server has already imported torch and the attentions, so each cell
    gets a fresh process in milliseconds instead of a 2-3 s interpreter start."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "longseq.attention", "longseq.bench.cell"])
    return _CONTEXT


def _worker(spec: CellSpec, connection: Any) -> None:
    def report(kind: str, payload: Any) -> None:
        connection.send((kind, payload))

    try:
        result = measure_cell(spec, report)
    except BaseException as error:  # never leave the parent waiting
        result = CellResult("error", note=error_text(error, where=False))
    connection.send(("done", result.as_dict()))
    connection.close()


def run_isolated(spec: CellSpec, startup_timeout_s: float = 300.0) -> CellResult:
    """Run ``measure_cell`` in a fresh process; a killed or hung process becomes a status, not a crash.

    The parent stops the worker when its first warm-up iteration has not finished within 1.5x the
    budget (+5 s), recording ``over_budget``; a worker killed by the kernel (SIGKILL) is recorded as
    ``oom``.
    """
    context = _context()
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_worker, args=(spec, sender), daemon=True)
    process.start()
    sender.close()
    deadline = time.monotonic() + startup_timeout_s
    warmup_s: float | None = None
    try:
        while True:
            if not receiver.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError
            kind, payload = receiver.recv()
            if kind == "built":
                deadline = time.monotonic() + 1.5 * spec.budget_s + 5
            elif kind == "warmup":
                warmup_s = float(payload)
                remaining_iterations = max(1, spec.warmup) + spec.repeats
                deadline = time.monotonic() + 3 * warmup_s * remaining_iterations + 60
            elif kind == "done":
                process.join(timeout=30)
                return CellResult(**payload)
    except TimeoutError:
        process.kill()
        process.join()
        if warmup_s is None:
            return CellResult("over_budget", note=f"killed: first warm-up iteration exceeded budget_s={spec.budget_s:g}")
        return CellResult("error", note=f"killed: timed iterations took > 3x the warm-up ({warmup_s:.1f} s each)")
    except EOFError:
        process.join()
        code = process.exitcode
        return CellResult("oom" if code == -signal.SIGKILL else "error", note=exit_text(code))
    finally:
        receiver.close()


def error_text(error: BaseException, where: bool = True) -> str:
    """One line for a report: the exception's type and first line (300 characters at most), and where it was raised
    (the file and line of the innermost frame)."""
    text = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    frame = traceback.extract_tb(error.__traceback__)[-1] if where and error.__traceback__ else None
    return text + (f" (at {Path(frame.filename).name}:{frame.lineno})" if frame else "")


def exit_text(code: int | None) -> str:
    """Why a worker process ended without a result, from its exit code (negative: the signal that killed it)."""
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        return f"worker killed by {name}" + (" (out of memory)" if -code == signal.SIGKILL else "")
    return f"worker exited with code {code}"


def _call(connection: Any, fn: Callable[..., Any], args: tuple) -> None:
    try:
        connection.send(("ok", fn(*args)))
    except BaseException as error:  # never leave the parent waiting
        connection.send(("error", error_text(error)))
    connection.close()


def call_isolated(fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> Any:
    """``fn(*args)`` in a fresh process (the forkserver's): its result, or a ``RuntimeError`` that says why there is
    none (the exception's text and line, the signal or exit code that ended the process, or ``timeout_s`` passed:
    the process is then killed), so a compiler that crashes or outlasts its time takes down one unit of work, not
    the caller or its other units. ``fn`` must be importable by name and its result picklable."""
    context = _context()
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_call, args=(sender, fn, args))  # not daemonic: inductor may start workers
    process.start()
    sender.close()
    try:
        if timeout_s is not None and not receiver.poll(max(timeout_s, 0.0)):
            process.kill()
            process.join()
            raise RuntimeError(f"stopped after {timeout_s:.0f} s: its time limit")
        status, value = receiver.recv()
    except EOFError:
        process.join()
        raise RuntimeError(exit_text(process.exitcode)) from None
    finally:
        receiver.close()
    process.join()
    if status == "error":
        raise RuntimeError(value)
    return value


# -- the hardware-independent columns: what the flex backend visits and keeps --------------------------------
FLEX_FIGURES = ("flex_tiles", "flex_longest_loop", "flex_kept", "flex_kept_by_calls")  # flex_figures' columns


def no_flex_figures(note: str) -> dict[str, Any]:
    """``flex_figures``' row where it does not apply: every figure NaN, ``note`` saying why."""
    return {**dict.fromkeys(FLEX_FIGURES, math.nan), "note": note}


def flex_figures(registry_name: str, length: int, kwargs: dict[str, Any], tile: int) -> dict[str, Any]:
    """For one attention at ``length``, from the flex backend without a GPU: the tiles (``tile`` x ``tile``) its
    block masks visit and their backward's longest loop, each divided by causal full attention's
    (``ops.flex.flex_tiles_visited``, ``ops.flex.flex_longest_loop``), what one training layer keeps for its
    backward in units of its output (``ops.flex.flex_kept_for_backward``: the whole layer and its flex calls' share),
    and a note: NaN with the reason where the variant has no flex layout, its tiles depend on the batch, or it cannot
    be built."""
    from longseq.attention import ATTENTION_REGISTRY, build_attention
    from longseq.attention.ops.flex import flex_kept_for_backward, flex_longest_loop, flex_tiles_visited

    row = no_flex_figures("")
    try:
        reason = ATTENTION_REGISTRY[registry_name].cls.flex_reason()
        if reason is not None:  # no module built: some hold (L, L) parameters (synthesizer)
            return {**row, "note": reason}
        attention = build_attention(registry_name, **kwargs)
        row["flex_tiles"] = flex_tiles_visited(attention, length, tile=tile)
        row["flex_longest_loop"] = flex_longest_loop(attention, length, tile=tile)
        if math.isnan(row["flex_tiles"]):
            row["note"] = "its block masks depend on the batch (clusters, chosen blocks)"
        kept = flex_kept_for_backward(attention, length, int(kwargs["n_heads"]), int(kwargs["head_dim"]))
        row["flex_kept"], row["flex_kept_by_calls"] = kept.whole, kept.calls
    except Exception as error:  # one variant's failure is a note, not a stopped sweep
        row["note"] = f"{type(error).__name__}: {error}".splitlines()[0]
    return row
