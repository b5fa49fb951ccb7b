"""Mixed precision for the hand-written autograd functions (``torch.autocast``, any device).

Autocast re-types ops one by one, which a ``torch.autograd.Function`` escapes: its inputs may arrive in
mixed dtypes (an fp32 query next to a bf16 summary key from an autocast ``Linear``), and its backward runs
under whatever autocast state the caller of ``backward()`` happens to have. ``autocast_function`` gives a
Function the semantics ``torch.amp.custom_fwd(cast_inputs=...)`` / ``custom_bwd`` give one device type,
for the device its inputs live on and the dtype the enclosing autocast region asks for (bf16 on CPU,
fp16 or bf16 on GPU): its floating inputs are cast to that dtype, and forward AND backward run with
autocast off, so backward sees exactly the dtypes forward saved. Outside autocast it changes nothing.
"""

from __future__ import annotations

import functools

import torch

# Device types autocast exists for, asked once: torch 2.11's dynamo cannot trace ``torch.amp.is_autocast_available``
# (a fullgraph compile of the pooled axial flex layers raised on an H200), a set lookup it can
AUTOCAST_DEVICES = frozenset(d for d in ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia")
                             if torch.amp.is_autocast_available(d))


def has_autocast(device_type: str) -> bool:
    """Whether autocast exists for ``device_type`` (not for meta, where shape-only runs measure saved bytes)."""
    return device_type in AUTOCAST_DEVICES


def autocast_dtype(*tensors: torch.Tensor | None) -> torch.dtype | None:
    """The dtype autocast computes in for the device of the first tensor given, or None when autocast is off there."""
    device_type = next(t.device.type for t in tensors if isinstance(t, torch.Tensor))
    if not has_autocast(device_type):
        return None
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def cast_floating(value, dtype: torch.dtype):
    """``value`` with every fp16/bf16/fp32 tensor in it (tuples and lists too) cast to ``dtype``;
    fp64, integer and bool tensors (masks, indices) and non-tensors unchanged."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != torch.float64 else value
    if isinstance(value, (tuple, list)):
        return type(value)(cast_floating(v, dtype) for v in value)
    return value


def autocast_function(cls: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """Class decorator for an autograd Function: correct under ``torch.autocast`` on any device.

    Inside an autocast region for the device of the Function's first tensor argument, floating inputs
    are cast to the region's dtype and ``forward`` runs with autocast disabled; ``backward`` always runs
    with autocast disabled for that device. Outside autocast, inputs pass through unchanged.
    """
    forward, backward = cls.forward, cls.backward

    @functools.wraps(forward)
    def cast_forward(ctx, *args):
        device_type = next(a.device.type for a in args if isinstance(a, torch.Tensor))
        ctx.amp_device_type = device_type
        dtype = autocast_dtype(*[a for a in args if isinstance(a, torch.Tensor)])
        if dtype is None:
            return forward(ctx, *args)
        with torch.autocast(device_type, enabled=False):
            return forward(ctx, *cast_floating(args, dtype))

    @functools.wraps(backward)
    def plain_backward(ctx, *grads):
        if not has_autocast(ctx.amp_device_type):  # no autocast there to turn off (meta)
            return backward(ctx, *grads)
        with torch.autocast(ctx.amp_device_type, enabled=False):
            return backward(ctx, *grads)

    cls.forward = staticmethod(cast_forward)
    cls.backward = staticmethod(plain_backward)
    cls.autocast_safe = True  # tests check that every Function in the attention package carries this
    return cls


def dtype_preserving(cls: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """Class decorator for an autograd Function that only moves elements (a gather, a permutation): it runs no
    autocast-eligible op, so each output keeps its input's dtype in or out of an autocast region, and casting its
    inputs (as ``autocast_function`` does) would only lose precision (a float32 log-sum-exp put in order)."""
    cls.autocast_safe = True
    return cls
