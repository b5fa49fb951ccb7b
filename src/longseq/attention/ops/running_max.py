"""Max pools along one axis, with their gradients: the inclusive running max (prefix max, or suffix max with
``reverse``; ``running_maxes``) and the max of all the other positions (``maxes_excluding_own``).

The values are those of ``torch.cummax`` and the gradient is the one ``cummax``'s indices route: each output
goes to the LATEST position at or before it (in scan order) that attains it, ties included.

Blocked scan (``_BlockedRunningMax``): the axis of length ``T`` is cut into ``T / b`` blocks of ``b <= MAX_BLOCK``
positions. Forward: every block's max (one reduction), their running max over the blocks (``T / b - 1`` ops on
one position's slice each), then a scan inside all blocks at once that writes final values straight from the
input (``b`` ops on ``1 / b`` of the data each): no clone, no fix-up pass. Backward: the same blocked form of
the linear recurrence ``acc[t] = g[t] + carried[t+1] * acc[t+1]`` (``carried``: the max was carried over, not
attained), the final masking fused into the last in-block pass.

Why blocked and small blocks: on CPU this beat one ``torch.maximum`` per position and ``cummax`` with its
``scatter_add`` backward, and few whole-tensor ops stall less on a loaded machine (measured:
docs/cpu_engine_measurements.md, *running_max*).
"""

from __future__ import annotations

from itertools import pairwise

import torch

from longseq.attention.ops.amp import autocast_dtype, autocast_function, cast_floating

MAX_BLOCK = 4  # few whole-tensor ops (see above); the per-block ops stay small


def block_length(T: int) -> int:
    """The largest divisor of ``T`` not above ``MAX_BLOCK`` (1 for a prime ``T``: then only the scan over blocks runs)."""
    b = min(T, MAX_BLOCK)
    while T % b:
        b -= 1
    return b


def _blocks(x: torch.Tensor, dim: int, b: int) -> torch.Tensor:
    """View ``x`` as ``(T / b, b, ...)``: blocks of axis ``dim`` first (a view, no copy)."""
    return x.unflatten(dim, (x.shape[dim] // b, b)).movedim((dim, dim + 1), (0, 1))


def _scan(dim: int, reverse: bool, xs) -> list[torch.Tensor]:
    """The blocked running max of each tensor of ``xs`` along ``dim`` (the forward of ``_BlockedRunningMax``)."""
    T = xs[0].shape[dim]
    b = block_length(T)
    nb = T // b
    inner = range(b - 1, -1, -1) if reverse else range(b)  # scan order inside a block
    outer = range(nb - 1, -1, -1) if reverse else range(nb)  # and over the blocks
    first = inner[0]
    outs = []
    # Writes into the strided block views are in-place ops (copy_ then clamp_ / addcmul_), never ``out=`` a
    # strided view: the same passes over memory, and torch.compile traces them (``out=`` breaks the graph).
    for x in xs:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        xb, ob = _blocks(x, dim, b), _blocks(out, dim, b)  # (nb, b, ...)
        if nb > 1:
            seen = xb.amax(1)  # (nb, ...): each block's max, then the running max over blocks
            for before, at in pairwise(outer):
                seen[at].clamp_(min=seen[before])
            opening, later = (-1, slice(None, -1)) if reverse else (0, slice(1, None))
            earlier = slice(1, None) if reverse else slice(None, -1)
            ob[opening, first].copy_(xb[opening, first])
            ob[later, first].copy_(xb[later, first]).clamp_(min=seen[earlier])
        else:
            ob[:, first].copy_(xb[:, first])
        for before, at in pairwise(inner):
            ob[:, at].copy_(xb[:, at]).clamp_(min=ob[:, before])
        outs.append(out)
    return outs


@autocast_function
class _BlockedRunningMax(torch.autograd.Function):
    """Running max of one or more same-shape tensors along ``dim``, each scanned in blocks (see the module).

    Forward args: ``dim`` (non-negative), ``reverse``, then the tensors; returns one output each. The block maxima
    come first, so the scan inside the blocks writes final values straight from the inputs: no stacked or cloned
    copy, no fix-up pass (fresh full-size buffers are the expensive part on CPU, see ``pooled_axial``).
    """

    @staticmethod
    def forward(ctx, dim, reverse, *xs):
        outs = _scan(dim, reverse, xs)
        ctx.save_for_backward(*outs, *xs)
        ctx.dim, ctx.reverse = dim, reverse
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        outs, xs = saved[: len(grads)], saved[len(grads) :]
        dim, reverse = ctx.dim, ctx.reverse
        T = outs[0].shape[dim]
        b = block_length(T)
        nb = T // b
        inner = range(b - 1, -1, -1) if reverse else range(b)
        outer = range(nb - 1, -1, -1) if reverse else range(nb)
        first, last = inner[0], inner[-1]
        result = []
        for grad, out, x in zip(grads, outs, xs):
            if grad is None:
                result.append(None)
                continue
            carried = torch.ne(out, x, out=torch.empty_like(out))  # 1 where the max is carried from the step before
            acc = torch.empty_like(out)
            a, c, g = _blocks(acc, dim, b), _blocks(carried, dim, b), _blocks(grad, dim, b)
            # inside each block, from its end: gradients flow back while the max is carried
            a[:, last].copy_(g[:, last])
            through = torch.ones_like(a[:, 0])  # (nb, ...): carried across the whole block after its first position
            for after, at in pairwise(reversed(inner)):
                a[:, at].copy_(g[:, at]).addcmul_(a[:, after], c[:, after])
                through.mul_(c[:, after])
            # the gradient entering each block from the next one (scan order), passed down the block; only positions
            # that attain their max keep a gradient
            entering = torch.zeros_like(through)
            for after, at in pairwise(reversed(outer)):
                total = torch.addcmul(a[after, first], through[after], entering[after])
                entering[at].copy_(total).mul_(c[after, first])
            a[:, last].add_(entering).addcmul_(a[:, last], c[:, last], value=-1)
            for after, at in pairwise(reversed(inner)):
                entering.mul_(c[:, after])
                a[:, at].add_(entering).addcmul_(a[:, at], c[:, at], value=-1)
            result.append(acc)
        return (None, None, *result)


@autocast_function
class _ScannedRunningMax(torch.autograd.Function):
    """The running max as one ``torch.cummax`` scan per tensor (GPUs: one kernel, where the blocked scan is dozens of
    small ones), keeping only the bool mask of the positions that attain their max for the backward (``cummax``
    itself keeps int64 indices: four to eight times the bytes, the largest tensor a pooled axial layer saved).

    Backward, in scan order: an attaining position j takes the gradients of every output from j up to the next
    attaining position (the outputs its max is carried to), i.e. a difference of suffix sums of the gradient at j
    and at that next position (found by a reverse ``cummin`` over the attaining positions' indices).
    """

    @staticmethod
    def forward(ctx, dim, reverse, *xs):
        outs, attained = [], []
        for x in xs:
            scan_order = x.flip(dim) if reverse else x
            values = torch.cummax(scan_order, dim).values
            attained.append(scan_order == values)
            outs.append(values.flip(dim) if reverse else values)
        ctx.save_for_backward(*attained)
        ctx.dim, ctx.reverse = dim, reverse
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        dim, reverse = ctx.dim, ctx.reverse
        result = []
        for grad, attained in zip(grads, ctx.saved_tensors):
            if grad is None:
                result.append(None)
                continue
            g = grad.flip(dim) if reverse else grad
            g = g.to(torch.promote_types(g.dtype, torch.float32))  # sums of up to T gradients: fp32 at least
            T = g.shape[dim]
            shape = [1] * g.dim()
            shape[dim] = T
            position = torch.arange(T, device=g.device).view(shape)
            # suffix sums of the gradient with a zero past the end: from_t[t] = sum of g[t:]
            from_t = torch.cat([g.flip(dim).cumsum(dim).flip(dim), torch.zeros_like(g.narrow(dim, 0, 1))], dim)
            at = torch.where(attained, position, T)
            # next attaining after t: a reverse running min, as a running max of -at (XLA lowers cummax; its cummin
            # fell back to the CPU, a host round trip per step)
            next_at = at.flip(dim).neg().cummax(dim).values.neg().flip(dim).narrow(dim, 1, T - 1)
            next_at = torch.cat([next_at, torch.full_like(at.narrow(dim, 0, 1), T)], dim)
            out = torch.where(attained, from_t.narrow(dim, 0, T) - from_t.gather(dim, next_at), 0.0).to(grad.dtype)
            result.append(out.flip(dim) if reverse else out)
        return (None, None, *result)


def blocked_scan_applies(x: torch.Tensor) -> bool:
    """The kernel choice of ``running_maxes``: the blocked scan on CPU tensors, one ``cummax`` elsewhere."""
    return x.device.type == "cpu"


def running_maxes(xs: tuple[torch.Tensor, ...] | list[torch.Tensor], dim: int,
                  reverse: bool = False) -> tuple[torch.Tensor, ...]:
    """Inclusive running max of each same-shape tensor in ``xs`` along ``dim`` (suffix max if ``reverse``), as
    ``torch.cummax(x, dim).values`` (of the flipped axis when ``reverse``), with ``cummax``'s gradient. On CPU the
    blocked scan (``_BlockedRunningMax``: fewest fresh buffers), elsewhere one ``cummax`` per tensor
    (``_ScannedRunningMax``: fewest kernels and bytes saved)."""
    dim = dim % xs[0].dim()
    blocked = blocked_scan_applies(xs[0])
    if _without_autograd(xs):
        if blocked:
            return tuple(_plain(_scan, xs, dim, reverse))
        return tuple((torch.cummax(x.flip(dim), dim).values.flip(dim) if reverse else torch.cummax(x, dim).values)
                     for x in xs)
    return (_BlockedRunningMax if blocked else _ScannedRunningMax).apply(dim, reverse, *xs)


def _excluding_own(dim: int, xs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The forward of ``_MaxExcludingOwn``: the outputs, and per tensor the indices of its max and second max."""
    outs, indices = [], []
    for x in xs:
        top, top_at = x.max(dim, keepdim=True)
        second, second_at = x.scatter(dim, top_at, float("-inf")).max(dim, keepdim=True)
        outs.append(top.expand_as(x).clone(memory_format=torch.contiguous_format).scatter_(dim, top_at, second))
        indices += [top_at, second_at]
    return outs, indices


def _without_autograd(xs) -> bool:
    """True when no gradient is wanted (inference): the pools then run their forward without the autograd Function,
    which torch.compile traces as plain ops (a Function's context breaks the graph when nothing requires grad)."""
    return not (torch.is_grad_enabled() and any(x.requires_grad for x in xs))


def _plain(scan, xs, *args):
    """``scan(*args, xs)`` as the ``autocast_function`` wrapper would run it: inputs cast to autocast's dtype, autocast
    off inside."""
    dtype = autocast_dtype(*xs)
    if dtype is None:
        return scan(*args, tuple(xs))
    with torch.autocast(xs[0].device.type, enabled=False):
        return scan(*args, cast_floating(tuple(xs), dtype))


@autocast_function
class _MaxExcludingOwn(torch.autograd.Function):
    """For each position along ``dim``, the max over every other position (length >= 2) of one or more tensors.

    The row max and the max with its argmax removed: ``out[t] = second`` at the argmax, ``top`` elsewhere (ties:
    the second max equals the top). Backward: ``top`` collects the gradients of every other position, ``second``
    the argmax's own. Two reductions and a few index ops, no scan (a prefix and a suffix scan did the same).
    """

    @staticmethod
    def forward(ctx, dim, *xs):
        outs, indices = _excluding_own(dim, xs)
        ctx.save_for_backward(*indices)
        ctx.dim = dim
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        dim, indices = ctx.dim, ctx.saved_tensors
        out = []
        for grad, top_at, second_at in zip(grads, indices[0::2], indices[1::2]):
            if grad is None:
                out.append(None)
                continue
            own = grad.gather(dim, top_at)  # the argmax's own output is the second max
            others = grad.sum(dim, keepdim=True) - own
            out.append(torch.zeros_like(grad).scatter_(dim, top_at, others).scatter_add_(dim, second_at, own))
        return (None, *out)


def maxes_excluding_own(xs: tuple[torch.Tensor, ...] | list[torch.Tensor], dim: int) -> tuple[torch.Tensor, ...]:
    """For each same-shape tensor in ``xs`` and each position ``t`` along ``dim`` (length >= 2): the max over all
    positions but ``t``."""
    dim = dim % xs[0].dim()
    if _without_autograd(xs):
        return tuple(_plain(_excluding_own, xs, dim)[0])
    return _MaxExcludingOwn.apply(dim, *xs)
