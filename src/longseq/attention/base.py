"""The attention contract shared by every registered variant.

A variant is an ``nn.Module`` whose ``forward(q, k, v)`` maps unscaled per-head tensors
``(B, H, L, D)`` to ``(B, H, L, D)`` and whose ``attention_matrix(q, k, v)`` returns the effective,
normalized weights ``(B, H, L, L)`` it applied (for tests and figures, small L only). The 1/sqrt(D)
scaling happens once, inside the module.

Capabilities are class attributes, checked at construction so that an impossible choice fails before
any training starts, with a message naming the offending key. ``family`` (dense, sparse, combiner,
efficient) is the subpackage the variant lives in; the registry sets it and ``name``.

Padding: variants with ``supports_padding_mask = True`` take ``key_padding_mask`` ``(B, L)`` bool, True =
padded key, and follow the one key-padding rule of ``ops.padding`` (a padded key gets zero weight from every
query with a real key; a query with none falls back to its unpadded direct keys). A padded task rejects the
other variants when it is built (``check_padding_support``).

Incremental decoding (sampling): causal variants with ``supports_decoding`` keep a per-layer state,
``new_state`` / ``prefill`` / ``step`` (``ops.decoding``), whose outputs equal ``forward``'s at every position.
The others raise ``DecodingNotSupported`` from ``new_state`` and sampling falls back to recompute.

Backends (``attention.backend = auto | flex | cpu_flash | xla | explicit``, ``ops.dispatch``): every subclass's
``forward`` goes through the one dispatch point (wrapped in ``__init_subclass__``): it picks the backend of the call
(``backend_for``), runs ``flex`` through ``ops.flex``, ``xla`` as the variant's own ``forward`` with its ops in their
static-shape forms (``ops.dispatch.static_shapes``) and otherwise the variant's own ``forward``, which asks
``backend_for`` whether to take its CPU-engine path (``cpu_flash``, declared by the class attribute
``cpu_flash``). A backend the variant can never run fails at construction (``check_backend``, called by the
registry), one the call's conditions rule out fails at the call; both name ``attention.backend`` and the reason.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
from torch import nn

from longseq.attention.errors import (  # noqa: F401  (re-exported: the contract's errors and knob checks)
    AttentionConfigError,
    DecodingNotSupported,
    check_int_knob,
    divisors,
)
from longseq.attention.ops import dispatch
from longseq.attention.ops.amp import autocast_dtype
from longseq.attention.ops.cpu.memory import heads_in_group
from longseq.torch_compat import remember, traced_with_object


class Attention(nn.Module):
    """Base class: stores the common arguments and validates capabilities.

    Subclasses set the capability flags and implement ``forward`` and ``attention_matrix`` (and, with
    ``supports_decoding``, ``init_decoding_state`` and ``step``; ``prefill`` defaults to one step per position).

    Args:
        causal: forbid attending to later positions (autoregressive tasks).
        seq_len: the sequence length the layer will see, when known at construction; used to
            validate geometry early (``requires_len_multiple_of``, checked by the registry once the
            variant is built) and by length-dependent variants.
        n_heads: number of heads H (variants with per-head parameters need it).
        head_dim: per-head width D (variants with learned maps need it).
        dropout: dropout on attention weights during training.
        backend: ``attention.backend``: ``auto`` (default; ``ops.dispatch.PRIORITY``), ``flex``, ``cpu_flash``,
            ``xla`` (static shapes) or ``explicit`` (the reference paths).
    """

    name: str = "?"  # set by the registry
    family: str = "?"  # set by the registry: dense, sparse, combiner or efficient
    supports_causal: bool = True
    supports_bidirectional: bool = True
    supports_padding_mask: bool = False  # forward/attention_matrix accept key_padding_mask=(B, L), True = pad
    supports_decoding: bool = False  # causal builds have new_state / prefill / step
    has_parameters: bool = False
    # What ``attention_matrix`` promises (tests read these): rows sum to 1 (a softmax-style method),
    # and ``forward(q, k, v) == attention_matrix(q, k, v) @ v`` exactly (the output is linear in v
    # through one (L, L) matrix).
    normalized_rows: bool = True
    matrix_is_exact: bool = True
    # The support is chosen from the inputs by discrete decisions (clusters, hash buckets, top-k blocks). Near ties
    # can then choose otherwise in bf16 than in fp64 (seen on an H200: 2 to 16 % output differences at L = 256), so
    # make gpu-check judges such a variant's low-precision forward by its own ``attention_matrix`` in that dtype.
    pattern_from_data: bool = False
    # What the variant's CPU-engine path handles (``ops.dispatch.CpuFlash``); None: it has none (explicit on CPU).
    cpu_flash: dispatch.CpuFlash | None = None
    # Why the explicit path reads tensor values on the host (data-dependent shapes: on XLA a round trip and a recompile
    # per new shape), None: its shapes follow from the input shapes alone. ``xla_path``: its ops have static-shape forms
    # (``ops.dispatch.static_shapes``), the ``xla`` backend; without one such a variant is refused on XLA devices.
    host_reads: str | None = None
    xla_path: bool = False

    def __init__(
        self,
        *,
        causal: bool,
        seq_len: int | None = None,
        n_heads: int | None = None,
        head_dim: int | None = None,
        dropout: float = 0.0,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        invalid = dispatch.check_backend_name(backend)
        if invalid is not None:
            raise AttentionConfigError(invalid)
        if causal and not self.supports_causal:
            raise AttentionConfigError(
                f"attention '{self.name}' cannot be causal (attention.causal=true); it supports "
                "bidirectional tasks only (MLM, LRA). Pick a causal variant for LM/image tasks."
            )
        if not causal and not self.supports_bidirectional:
            raise AttentionConfigError(
                f"attention '{self.name}' supports causal use only (attention.causal=false given)."
            )
        if not 0.0 <= dropout < 1.0:
            raise AttentionConfigError(f"attention.dropout must be in [0, 1), got {dropout}")
        self.causal = bool(causal)
        self.seq_len = seq_len
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.dropout = float(dropout)
        self.backend = backend
        self.backends_used: dict[str, str] = {}  # backend -> how it was chosen, filled by calls (``ops.dispatch``)
        self._flex_reason: tuple[str | None] | None = None  # cached by ``check_backend``
        self.flex_layouts: dict = {}  # this module's static flex layouts (``ops.flex.static_layout``), not state
        remember(self)  # ``_record_choice`` finds it by id under torch.compile

    # -- capabilities -------------------------------------------------------------------------
    def requires_len_multiple_of(self) -> int:
        """The sequence length must be a multiple of this (1 = any length)."""
        return 1

    def geometry_key(self) -> str:
        """The config key that sets ``requires_len_multiple_of`` (for error messages)."""
        return "attention.block_size"

    def check_length(self, length: int) -> None:
        """Raise a clear error when a length does not fit the geometry."""
        multiple = self.requires_len_multiple_of()
        if multiple > 1 and length % multiple:
            raise AttentionConfigError(
                f"attention '{self.name}': sequence length {length} is not a multiple of {multiple} "
                f"({self.geometry_key()}); choose a value that divides {length}, e.g. one of {divisors(length)}"
            )

    def check_padding_support(self, task: str = "this task") -> None:
        """Raise when a padded task (variable-length inputs) uses a variant without key-padding support."""
        if not self.supports_padding_mask:
            raise AttentionConfigError(
                f"attention '{self.name}' does not support key_padding_mask (supports_padding_mask=False), "
                f"which {task} needs for its padded variable-length inputs; pick an attention that does "
                "(e.g. attention=full) or a task without padding"
            )

    # -- backends (``ops.dispatch``) ---------------------------------------------------------------
    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        forward = cls.__dict__.get("forward")
        if forward is not None and not getattr(forward, "dispatches", False):
            cls.forward = _dispatching(forward)

    def cpu_flash_geometry(self, length: int) -> str | None:
        """Why the CPU-engine path does not fit sequence length ``length`` (None: it does); e.g. a grid of one row."""
        return None

    def dispatch_variant(self) -> dispatch.Variant:
        """The static facts the dispatch decides on."""
        flex = self._flex_reason[0] if self._flex_reason is not None else self.flex_reason() or self.flex_config_reason()
        return dispatch.Variant(self.name, self.family, self.causal, self.cpu_flash, flex, self.host_reads,
                                self.xla_path)

    def check_backend(self) -> None:
        """Fail when ``attention.backend`` names a backend this variant can never run (the registry calls this once
        the variant is built); caches the flex layout check. Building attentions starts a new run for the
        once-per-run log of the choices (``ops.dispatch.log_choice``)."""
        dispatch.new_run()
        self._flex_reason = (self.flex_reason() or self.flex_config_reason(),)
        if self.backend != "auto":
            reason = dispatch.static_reason(self.backend, self.dispatch_variant())
            if reason is not None:
                raise AttentionConfigError(dispatch.refusal(self.backend, reason))

    # -- the flex layout (``ops.flex``): a variant with one overrides ``flex_calls`` and ``flex_summaries`` (or, when
    # its masks depend on the batch, sets ``flex_from_data`` and overrides ``flex_data_calls``); a variant that
    # selects blocks per query sets ``flex_selects`` and adds the per-batch hooks below ---------------------------
    flex_from_data: bool = False
    flex_selects: bool = False  # its calls' masks read a per-batch state (``flex_call_mask``)

    def flex_calls(self, length: int, device: torch.device) -> list:
        """The flex calls (``ops.flex.FlexCall``: masks and orders, no tensors of the batch) at ``length``."""
        raise NotImplementedError

    def flex_data_calls(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor | None) -> list:
        """The flex calls of this batch (``flex_from_data``: masks that read k-means clusters); ``real`` ``(B, L)``."""
        raise NotImplementedError

    def flex_summaries(self, index: int, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       real: torch.Tensor | None, state=None):
        """Summary keys ``(B, H, R, D)``, values ``(B, H, R, Dv)`` and ``occupied`` (``(B, R)`` or ``(B, H, R)`` bool:
        the region holds a real key; None unpadded) of call ``index``, from scaled queries and keys, values in
        sequence order; ``real`` ``(B, L)`` (True = real key) or None; ``state`` the batch's ``flex_batch_state``."""
        raise NotImplementedError

    def flex_batch_state(self, qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor | None,
                         tile: int):
        """What this batch decides once for every call (a selecting variant's chosen blocks); None by default."""
        return None

    def flex_fused_kv(self, index: int, keys: torch.Tensor, values: torch.Tensor):
        """Call ``index``'s KV ``(B, H, KV, .)`` as ``ops.flex.regions.summary_kv`` made it, changed as the variant's
        summaries need (``combiner_axial``: its learned summary keys); default: as made."""
        return keys, values

    def flex_call_mask(self, index: int, state) -> Callable | None:
        """A per-batch condition ``(b, h, q, kv) -> bool`` that call ``index``'s slots must also meet (e.g. a summary
        whose region came back at full resolution is not used twice); None: the call's static mask alone."""
        return None

    def flex_extra_parts(self, state, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor | None,
                         tile: int) -> list:
        """Parts of a group's softmax computed outside the static calls from unscaled q, k, v ``(B, H, L, .)``, as
        ``(group, out (B, H, L, Dv), lse (B, H, L))`` (chosen blocks at full resolution, ``ops.flex.selection``);
        none by default."""
        return []

    def flex_group_weights(self, state, q: torch.Tensor) -> torch.Tensor | None:
        """Weights ``(B, H, L, groups)`` of the groups' outputs (NSA's gates); None: their average."""
        return None

    def flex_config_reason(self) -> str | None:
        """Why this build (its knobs) has no flex layout although the class has one (None: it has one)."""
        return None

    @classmethod
    def flex_reason(cls) -> str | None:
        """Why this variant has no flex layout (None: it has one); a property of the class, so the benchmark asks
        before building a variant that may hold an (L, L) parameter."""
        if cls.family == "dense":
            return "full attention stays on SDPA (FlashAttention), which needs no mask"
        if cls.flex_calls is Attention.flex_calls and cls.flex_data_calls is Attention.flex_data_calls:
            if cls.family == "efficient":
                return f"'{cls.name}' is not a partition of keys (an efficient approximation): no block mask describes it"
            return f"no flex layout is written for attention '{cls.name}' yet"
        return None

    def flex_key(self) -> tuple:
        """What the variant's flex calls depend on: its class, every plain-valued knob and the keys of the attentions
        it wraps (``combiner_select``'s inner Combiner holds its block size) or that shape its layout (a
        ``RegionSummary``: its pooling is in the fused summaries' tables), so that modules of the same geometry share
        one static layout (``ops.flex.static_layout``) and any difference gets its own."""
        knobs = sorted((name, value) for name, value in vars(self).items()
                       if not name.startswith("_") and name != "training"
                       and isinstance(value, (bool, int, float, str, type(None))))
        inner = tuple((name, child.flex_key()) for name, child in self.named_children() if hasattr(child, "flex_key"))
        return (type(self).__module__, type(self).__qualname__, *knobs, *inner)

    def __getstate__(self) -> dict:
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        return {**state, "flex_layouts": {}}  # block masks hold mask_mod closures: rebuilt, never pickled or copied

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        remember(self)  # a copy or an unpickled module is a new object

    def backend_for(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    key_padding_mask: torch.Tensor | None = None, *, record: bool = False) -> str:
        """The backend that computes this call (``ops.dispatch.choose``) of unscaled ``(B, H, L, D)`` q, k, v.

        Raises ``AttentionConfigError`` when a backend asked for by name cannot run it. ``record``: remember the
        choice in ``backends_used`` (``_record_choice``, also under ``torch.compile``) and log it once per run (not
        while ``torch.compile`` traces).
        """
        facts = dispatch.Facts(
            device=q.device.type,
            # autocast's dtype where autocast exists for the device (not on meta)
            dtype=autocast_dtype(q) or q.dtype,
            grad=torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
            key_padding=key_padding_mask is not None,
            dropout=self.training and self.dropout > 0,
            value_width=v.shape[-1],
            head_dim=q.shape[-1],
            compiling=torch.compiler.is_compiling(),
            geometry=None if self.cpu_flash is None else self.cpu_flash_geometry(q.shape[-2]),
        )
        choice = dispatch.choose(self.backend, self.dispatch_variant(), facts)
        if choice.backend is None:
            raise AttentionConfigError(f"attention '{self.name}': {choice.refusal}")
        if record:
            _record_choice(self, choice.backend)
            if not torch.compiler.is_compiling():  # traced, logging would break the graph
                dispatch.log_choice(self.name, self.backend, facts, choice)
        return choice.backend

    # -- helpers ------------------------------------------------------------------------------
    @staticmethod
    def scale(q: torch.Tensor) -> torch.Tensor:
        """Apply the single 1/sqrt(D) scaling to queries ``(..., D)``."""
        return q * (1.0 / math.sqrt(q.shape[-1]))

    def weight_dropout(self, weights: torch.Tensor) -> torch.Tensor:
        """Dropout on attention weights, active only in training."""
        if self.training and self.dropout > 0:
            return nn.functional.dropout(weights, p=self.dropout)
        return weights

    # -- the contract ---------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # noqa: D401
        """(B, H, L, D) unscaled q, k, v -> (B, H, L, D).

        Variants with ``supports_padding_mask`` also take ``key_padding_mask=None`` ((B, L) bool, True = pad).
        """
        raise NotImplementedError

    def attention_matrix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(B, H, L, L) effective normalized weights such that ``forward == P @ v`` (no dropout).

        Variants with ``supports_padding_mask`` also take ``key_padding_mask=None`` (zero columns at pads).
        """
        raise NotImplementedError

    # -- incremental decoding (``ops.decoding``) ---------------------------------------------------
    def new_state(self, batch_size: int, max_len: int, *, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None):
        """A decoding state for ``batch_size`` sequences of up to ``max_len`` positions (``state.length`` = 0).

        Raises ``DecodingNotSupported`` naming the variant when it has no state or is built bidirectional.
        """
        if not (self.supports_decoding and self.causal):
            why = "it is built bidirectional (attention.causal=false)" if self.supports_decoding else (
                "it has no incremental decoding state (supports_decoding=False)")
            raise DecodingNotSupported(
                f"attention '{self.name}' cannot decode incrementally: {why}; sampling falls back to "
                "recompute (one full forward pass per generated position)"
            )
        self.check_length(max_len)
        device = torch.device(device) if device is not None else torch.device("cpu")
        return self.init_decoding_state(int(batch_size), int(max_len), device, dtype or torch.get_default_dtype())

    def init_decoding_state(self, batch_size: int, max_len: int, device: torch.device, dtype: torch.dtype):
        """The variant's empty state (called by ``new_state`` once the capability is checked)."""
        raise NotImplementedError

    def prefill(self, state, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The next T positions: q, k, v ``(B, H, T, D)`` unscaled -> ``(B, H, T, D)``, as ``forward`` gives them;
        advances ``state``. Default: one ``step`` per position (variants override with a batched prefill)."""
        return torch.cat([self.step(state, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
                          for t in range(q.shape[-2])], -2)

    def step(self, state, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The next position: q, k, v ``(B, H, 1, D)`` unscaled -> ``(B, H, 1, D)``; advances ``state``."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"name={self.name}, causal={self.causal}"


def _dispatching(forward):
    """``forward`` behind the dispatch point: the call's backend is decided (and recorded) first; ``flex`` runs
    ``ops.flex``, any other backend the variant's own ``forward`` (which asks ``backend_for`` again where it has a
    CPU-engine path; the decision is a few comparisons). A CPU-engine path with ``head_group_rows`` runs per group
    of heads (``ops.cpu.memory.heads_in_group``)."""

    @functools.wraps(forward)
    def dispatched(self, q, k, v, *args, **kwargs):
        key_padding_mask = kwargs.get("key_padding_mask", args[0] if args else None)
        backend = self.backend_for(q, k, v, key_padding_mask, record=True)
        if backend == "flex":
            return dispatch.flex_forward(self, q, k, v, key_padding_mask)
        if backend == "xla":
            with dispatch.static_shapes():
                return forward(self, q, k, v, *args, **kwargs)
        rows = self.cpu_flash.head_group_rows if backend == "cpu_flash" else None
        group = q.shape[1] if rows is None else heads_in_group(q.shape, v.shape[-1], q.element_size(), rows)
        if group < q.shape[1]:  # heads are independent: the same result, without fresh-mmap temporaries
            # split, not slices: a slice's backward zero-fills a gradient of the whole input per group
            return torch.cat([forward(self, *heads, *args, **kwargs)
                              for heads in zip(q.split(group, 1), k.split(group, 1), v.split(group, 1))], 1)
        return forward(self, q, k, v, *args, **kwargs)

    dispatched.dispatches = True
    return dispatched


@traced_with_object
def _record_choice(attn: Attention, backend: str) -> bool:
    """Remembers that ``attn`` ran on ``backend`` (``backends_used``). Under ``torch.compile`` dynamo runs this while
    it traces (``torch_compat.traced_with_object``): once per compiled graph, whose choice it is, with no guard on the
    dict. A traced dict update recompiled the whole backbone at its second step (the guard had seen the dict empty)."""
    attn.backends_used.setdefault(backend, attn.backend)
    return True
