"""The one dispatch point of ``attention.backend``: which implementation computes an attention, and why.

The semantics of every variant are written once (its explicit path, ``Partition``, ``pattern``,
``attention_matrix``); a backend is how they are computed:

- ``explicit``: the reference paths (batched matmuls, SDPA with masks); any device, any condition.
- ``cpu_flash``: the CPU engine (``ops.cpu``): private CPU flash kernels merged by log-sum-exps, head groups.
  CPU tensors and one head size for q and v; each variant states what else its path handles (``CpuFlash``).
- ``flex``: FlexAttention over [keys ; region summaries] with a ``BlockMask`` from the ``Partition``
  (``ops.flex``): the fused path on CUDA; on CPU forward only (FlexAttention has no CPU backward).
- ``xla``: the explicit path with every op in its static-shape form (``static_shapes``): XLA traces a step into one
  graph, and a host read there (``nonzero``, a count read with ``int``: ``Variant.host_reads``) is a round trip and
  a recompile per new shape. A variant whose explicit path has static shapes runs it unchanged; one with host reads
  runs its static-shape form (``Variant.xla``) or, without one, is refused on XLA at the call, naming the variant
  and why. Any device runs it (the fast suite checks it on CPU against explicit); auto takes it on XLA devices.

``attention.backend=auto`` takes the first backend of its device's priority list (``PRIORITY``) that applies to the
call; a backend asked for by name runs or fails with ``AttentionConfigError`` naming ``attention.backend`` and the
reason: at construction when the variant has no such path (``static_refusal``), else at the call
(``choose``). ``full`` stays on SDPA (already FlashAttention on CUDA and the fused kernel on CPU): its only backend
is ``explicit``. The decision takes plain facts (``Facts``, ``Variant``), so every branch is testable without a GPU.
Each attention logs its choice once per run (per variant, backend and reasons), like xformers' fMHA dispatch,
and remembers the backends it used (``Attention.backends_used``, collected by ``attention_backends`` into
``metrics.json`` and the logger config).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

BACKENDS = ("auto", "flex", "cpu_flash", "xla", "explicit")
# auto's order per device type; a device not listed runs explicit
PRIORITY: dict[str, tuple[str, ...]] = {
    "cuda": ("flex", "explicit"),
    "cpu": ("cpu_flash", "explicit"),
    "xla": ("xla",),
}
OTHER_DEVICES: tuple[str, ...] = ("explicit",)
# why auto leaves a backend out of a device's list (it can still be asked for by name where it runs)
STATIC_ELSEWHERE = ("the static-shape forms pad their tiles to a count fixed by the shapes (more work); an eager "
                    "device tiles exactly")
LEFT_OUT = {
    ("cpu", "flex"): "FlexAttention is unfused on CPU (name attention.backend=flex for no-grad inference)",
    ("cuda", "cpu_flash"): "the CPU engine's kernels run on CPU tensors only",
    ("cpu", "xla"): STATIC_ELSEWHERE,
    ("cuda", "xla"): STATIC_ELSEWHERE,
    ("xla", "flex"): "FlexAttention has no XLA lowering (TPUs run the explicit paths or their static-shape forms)",
    ("xla", "cpu_flash"): "the CPU engine's kernels run on CPU tensors only",
    ("xla", "explicit"): "the xla backend is the explicit paths with their ops in static-shape forms",
}
HALF = (torch.float16, torch.bfloat16)
FLEX_MIN_WIDTH = 16  # compiled FlexAttention (CUDA) lowers only q, k, v widths >= 16 (NYI below; torch 2.11 on an H200)


@dataclass(frozen=True)
class CpuFlash:
    """What a variant's CPU-engine path handles (the class attribute ``cpu_flash``; None: the variant has none).

    Every CPU-engine path needs CPU tensors and one head size for q and v (the fused kernels take one D; tests
    probe the weights with v = identity). ``causal_only``: the bidirectional build has no such path.
    ``half_precision_training=False``: bf16/fp16 training runs explicit (the CPU flash backward measured about
    twice its fp32 time in bf16, slower than explicit batched matmuls that bf16 speeds up). ``half_precision=False``:
    every bf16/fp16 call runs explicit (the path computes in fp32/fp64 only). ``compiles=False``: while
    ``torch.compile`` traces, the call runs explicit (the path is eager-only: its autograd Function keeps a
    differentiable log-sum-exp that the traced graph does not). ``head_group_rows``: the path's largest temporaries
    hold about this many (D + 1)-wide rows per query and head, and the dispatch runs the heads in groups that keep
    them under glibc's fresh-mmap size (``ops.cpu.memory.heads_in_group``; None: all heads at once).
    """

    key_padding: bool = False
    dropout: bool = False
    half_precision_training: bool = True
    half_precision: bool = True
    causal_only: bool = False
    compiles: bool = True
    head_group_rows: float | None = None


@dataclass(frozen=True)
class Variant:
    """The static facts of one built attention: its registry ``name`` and ``family``, direction, CPU-engine path,
    why it has no flex layout (``flex``; None: it has one), why its explicit path reads tensor values on the host
    (``host_reads``; None: its shapes are static) and whether it has a static-shape form (``xla``)."""

    name: str
    family: str
    causal: bool
    cpu_flash: CpuFlash | None
    flex: str | None
    host_reads: str | None = None
    xla: bool = False


@dataclass(frozen=True)
class Facts:
    """The facts of one call: device type of the inputs (``"cpu"``, ``"cuda"``, ...), compute dtype (autocast's when
    active), whether autograd differentiates through it (``grad``), key padding, active weight dropout, the widths
    of v and q, whether ``torch.compile`` is tracing the call, and ``geometry``: why the variant's CPU-engine path
    does not fit this length (None: it does)."""

    device: str
    dtype: torch.dtype
    grad: bool = False
    key_padding: bool = False
    dropout: bool = False
    value_width: int = 1
    head_dim: int = 1
    compiling: bool = False
    geometry: str | None = None


@dataclass(frozen=True)
class Choice:
    """The backend that runs (None when a backend asked for by name cannot: ``refusal`` says why, naming
    ``attention.backend``) and, for every other backend, why it does not."""

    backend: str | None
    rejected: tuple[tuple[str, str], ...] = ()
    refusal: str | None = None


def check_backend_name(backend) -> str | None:
    """The validation of the knob: None when ``backend`` is one of ``BACKENDS``, else the error message."""
    if backend not in BACKENDS:
        return f"attention.backend must be one of {', '.join(BACKENDS)}; got {backend!r}"
    return None


def static_reason(backend: str, variant: Variant) -> str | None:
    """Why ``variant`` can never run on ``backend`` (known at construction), or None."""
    if backend == "cpu_flash":
        if variant.cpu_flash is None:
            return f"attention '{variant.name}' has no cpu_flash path (on CPU it runs explicit)"
        if variant.cpu_flash.causal_only and not variant.causal:
            return f"attention '{variant.name}' has a cpu_flash path for causal use only (attention.causal=false)"
    if backend == "flex":
        if variant.family == "dense":
            return f"attention '{variant.name}' stays on SDPA (fused already): its backend is explicit"
        return variant.flex
    if backend == "xla" and variant.host_reads is not None and not variant.xla:
        return f"attention '{variant.name}' has no static-shape form of its explicit path, which {variant.host_reads}"
    return None


def call_reason(backend: str, variant: Variant, facts: Facts) -> str | None:
    """Why ``backend`` cannot run this call of ``variant`` (None: it can)."""
    reason = static_reason(backend, variant)
    if reason is not None or backend == "xla":
        return reason
    if backend == "explicit":
        if facts.device == "xla" and variant.host_reads is not None:
            return (f"on XLA: attention '{variant.name}''s explicit path {variant.host_reads} (data-dependent shapes: "
                    "a host round trip and a recompile per new shape)")
        return None
    if backend == "cpu_flash":
        path = variant.cpu_flash
        if facts.device != "cpu":
            return f"the CPU engine runs on CPU tensors only, got {facts.device}"
        if facts.value_width != facts.head_dim:
            return f"v's width {facts.value_width} differs from q's {facts.head_dim} (the fused kernels take one)"
        if facts.key_padding and not path.key_padding:
            return "key padding (this variant's CPU-engine path has no padding masks)"
        if facts.dropout and not path.dropout:
            return "weight dropout in training (this variant's CPU-engine path has none)"
        if facts.dtype in HALF and not path.half_precision:
            return f"{facts.dtype} (this variant's CPU-engine path computes in fp32 / fp64 only)"
        if facts.grad and facts.dtype in HALF and not path.half_precision_training:
            return f"{facts.dtype} training (the CPU flash backward is slower than explicit in half precision)"
        if facts.compiling and not path.compiles:
            return "torch.compile tracing (this variant's CPU-engine path runs eagerly only)"
        return facts.geometry
    # flex
    if facts.device not in ("cpu", "cuda"):
        return f"FlexAttention runs on CPU and CUDA, got {facts.device}"
    if facts.device == "cpu" and facts.grad:
        return "FlexAttention has no CPU backward (an input requires grad)"
    if facts.dropout:
        return "weight dropout in training (FlexAttention has no attention-weight dropout)"
    if facts.device == "cuda" and min(facts.head_dim, facts.value_width) < FLEX_MIN_WIDTH:
        return (f"q / v widths {facts.head_dim} / {facts.value_width}: the compiled FlexAttention kernels need at "
                f"least {FLEX_MIN_WIDTH} (torch raises NotImplementedError below)")
    return None


def choose(requested: str, variant: Variant, facts: Facts) -> Choice:
    """The backend of one call: ``requested`` itself when named (or a refusal), else ``auto``'s first that applies."""
    if requested != "auto":
        reason = call_reason(requested, variant, facts)
        if reason is not None:
            return Choice(None, refusal=refusal(requested, reason))
        return Choice(requested)
    priority = PRIORITY.get(facts.device, OTHER_DEVICES)
    chosen, rejected = None, []
    for backend in priority:
        reason = call_reason(backend, variant, facts)
        if chosen is None and reason is None:
            chosen = backend
        elif chosen is None:
            rejected.append((backend, reason))
        else:
            rejected.append((backend, f"lower in auto's {facts.device} priority ({', '.join(priority)})"))
    for backend in BACKENDS[1:]:
        if backend not in priority:
            devices = ", ".join(d for d, order in PRIORITY.items() if backend in order)
            why = LEFT_OUT.get((facts.device, backend), f"auto uses it on {devices} only")
            rejected.append((backend, f"not in auto's {facts.device} priority: {why}"))
    if chosen is None:  # e.g. host reads on XLA without a static-shape form
        reasons = "; ".join(f"{backend}: {why}" for backend, why in rejected if backend in priority)
        return Choice(None, tuple(rejected), refusal=f"attention.backend=auto finds no backend for {facts.device} "
                                                     f"({reasons})")
    return Choice(chosen, tuple(rejected))


def refusal(backend: str, reason: str) -> str:
    """The error message of a backend asked for by name that cannot run (``AttentionConfigError``)."""
    return (f"attention.backend={backend} cannot run here: {reason}; use attention.backend=auto (picks a backend "
            f"that applies) or explicit (valid: {', '.join(BACKENDS)})")


# -- the xla backend: the explicit path with every op in its static-shape form ----------------------------------
_STATIC_SHAPES = [False]


@contextlib.contextmanager
def static_shapes():
    """While active, the ops that have a data-dependent form take their static-shape one (``static_shapes_on``): the
    dispatch point runs a variant's forward inside it when its backend is ``xla``."""
    previous = _STATIC_SHAPES[0]
    _STATIC_SHAPES[0] = True
    try:
        yield
    finally:
        _STATIC_SHAPES[0] = previous


def static_shapes_on() -> bool:
    """Whether the ops run in their static-shape forms (the ``xla`` backend; ``static_shapes``)."""
    return _STATIC_SHAPES[0]


# -- FlexAttention (``ops.flex``) ----------------------------------------------------------------------------
def flex_forward(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``attn``'s forward on the flex backend: ``(B, H, L, D)`` unscaled q, k, v -> ``(B, H, L, D)`` (``ops.flex``,
    imported on first use so that importing the package never touches FlexAttention)."""
    from longseq.attention.ops.flex import flex_forward as run

    return run(attn, q, k, v, key_padding_mask)


def prepare_flex(attn, length: int, device: torch.device, padded: bool = False) -> int:
    """Builds ``attn``'s static flex layout at ``length`` on ``device`` (``padded``: for key-padded batches, where the
    variant takes them) where its backend may be flex there (named, or ``auto``'s choice on that device), before
    ``torch.compile`` traces the model around it (``model.compile=true``): a layout first built inside the traced
    forward breaks the graph there, and the next step recompiles the whole backbone (the layout lookup's guard
    changes). Returns how many layouts it looked up (0: no static flex layout here)."""
    may_run = attn.backend == "flex" or (attn.backend == "auto" and "flex" in PRIORITY.get(device.type, OTHER_DEVICES))
    if not may_run or attn.flex_from_data or attn.flex_reason() is not None or attn.flex_config_reason() is not None:
        return 0
    from longseq.attention.ops.flex import static_layout, tile_size

    static_layout(attn, length, device, tile_size(length), padded=padded and attn.supports_padding_mask,
                  per_batch=attn.flex_selects)
    return 1


# -- logging and recording ---------------------------------------------------------------------------------
_LOGGED: set[tuple] = set()


def new_run() -> None:
    """Forget what was logged: called whenever attentions are built (a new model, so a new run in this process,
    e.g. the next job of a multirun); the layers of one model are all built before any of them runs."""
    _LOGGED.clear()


def log_choice(name: str, requested: str, facts: Facts, choice: Choice) -> None:
    """Log which backend an attention uses and why the others were not, once per run for each variant, request,
    backend and set of reasons."""
    key = (name, requested, choice.backend, choice.rejected)
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    how = "asked for by name" if requested != "auto" else "auto's first that applies"
    lines = [f"attention '{name}' runs on backend {choice.backend} (attention.backend={requested}: {how}; "
             f"{facts.device}, {str(facts.dtype).removeprefix('torch.')}, {'training' if facts.grad else 'no grad'})"]
    lines += [f"  {backend} not used because: {reason}" for backend, reason in choice.rejected]
    log.info("\n".join(lines))


def attention_backends(model: torch.nn.Module) -> dict[str, str]:
    """Every attention layer of ``model`` that has run -> the backends it used (``"cpu_flash"``, or several joined
    by ``+``, e.g. ``cpu_flash+explicit`` when training and evaluation differ)."""
    used = {}
    for name, module in model.named_modules():
        backends = getattr(module, "backends_used", None)
        if backends:
            used[name] = "+".join(sorted(backends))
    return used


def backend_summary(model: torch.nn.Module) -> str | None:
    """One line for a run's record: the backend every attention layer used, or ``layer=backend`` pairs when they
    differ; None when no attention has run."""
    used = attention_backends(model)
    if not used:
        return None
    values = set(used.values())
    if len(values) == 1:
        return values.pop()
    return ", ".join(f"{name}={backend}" for name, backend in used.items())
