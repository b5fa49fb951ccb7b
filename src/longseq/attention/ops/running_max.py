"""Max pools along one axis, with their gradients: the inclusive running max (prefix max, or suffix max with
``reverse``; ``running_maxes``) and the max of all the other positions (``maxes_excluding_own``).

The values are those of ``torch.cummax`` and the gradient is the one ``cummax``'s indices route: each output
goes to the LATEST position at or before it (in scan order) that attains it, ties included.

Blocked scan (``_BlockedRunningMax``): the axis of length ``T`` is cut into ``T / b`` blocks of ``b ~ sqrt(T)``
positions; a scan inside every block at once (``b - 1`` ops on ``1 / b`` of the data each), a scan over the
blocks' maxima (``T / b - 1`` small ops), one broadcast max. The backward is the same blocked form of the
linear recurrence ``acc[t] = g[t] + carried[t+1] * acc[t+1]`` (``carried`` = the max was carried over, not
attained). Measured on CPU (L = 16384 grids, B*H = 8, 128 x 128, D = 64, one thread): q and k stacked in one
scan, forward about 0.6x the time of one ``torch.maximum`` per position and about 1/7 of ``cummax``'s; forward
plus backward about half of ``cummax`` + its ``scatter_add`` backward. With two threads on a shared machine
the one-op-per-position scan was several times slower still (each of its 2 * T small ops waits for both
threads), which the ~2 sqrt(T) ops here avoid.
"""

from __future__ import annotations

import math
from itertools import pairwise

import torch

from longseq.attention.ops.amp import autocast_function


def block_length(T: int) -> int:
    """The largest divisor of ``T`` not above ``sqrt(T)`` (1 for a prime ``T``: then the block scan is the plain scan)."""
    b = max(1, math.isqrt(T))
    while T % b:
        b -= 1
    return b


def _blocks(x: torch.Tensor, dim: int, b: int) -> torch.Tensor:
    """View ``x`` as ``(T / b, b, ...)``: blocks of axis ``dim`` first (a view, no copy)."""
    return x.unflatten(dim, (x.shape[dim] // b, b)).movedim((dim, dim + 1), (0, 1))


@autocast_function
class _BlockedRunningMax(torch.autograd.Function):
    """Running max of one or more same-shape tensors along ``dim`` (stacked: one scan for all).

    Forward args: ``dim`` (of each input, non-negative), ``reverse``, then the tensors; returns one output each.
    """

    @staticmethod
    def forward(ctx, dim, reverse, *xs):
        out = torch.stack(xs)
        d = dim + 1
        T = out.shape[d]
        b = block_length(T)
        nb = T // b
        blocks = _blocks(out, d, b)
        inner = range(b - 1, -1, -1) if reverse else range(b)  # scan order inside a block
        for before, at in pairwise(inner):
            torch.maximum(blocks[:, at], blocks[:, before], out=blocks[:, at])
        if nb > 1:
            block_max = blocks[:, inner[-1]].clone()  # (nb, ...): running max over whole blocks
            for before, at in pairwise(range(nb - 1, -1, -1) if reverse else range(nb)):
                torch.maximum(block_max[at], block_max[before], out=block_max[at])
            if reverse:
                torch.maximum(blocks[:-1], block_max[1:].unsqueeze(1), out=blocks[:-1])
            else:
                torch.maximum(blocks[1:], block_max[:-1].unsqueeze(1), out=blocks[1:])
        ctx.save_for_backward(out, *xs)
        ctx.dim, ctx.reverse = d, reverse
        return out.unbind(0)

    @staticmethod
    def backward(ctx, *grads):
        out, *xs = ctx.saved_tensors
        d, reverse = ctx.dim, ctx.reverse
        T = out.shape[d]
        b = block_length(T)
        nb = T // b
        acc = torch.stack([torch.zeros_like(x) if g is None else g for g, x in zip(grads, xs)])
        carried = torch.empty_like(acc)  # 1 where the output is the max carried from the step before
        for i, x in enumerate(xs):
            torch.ne(out[i], x, out=carried[i])
        a, c = _blocks(acc, d, b), _blocks(carried, d, b)
        inner = range(b - 1, -1, -1) if reverse else range(b)
        first, last = inner[0], inner[-1]
        # inside each block, from its end: gradients flow back while the max is carried
        through = torch.ones_like(a[:, 0])  # (nb, ...): carried across the whole block after its first position
        for after, at in pairwise(reversed(inner)):
            a[:, at].addcmul_(a[:, after], c[:, after])
            through.mul_(c[:, after])
        if nb > 1:  # the gradient entering each block from the next one (scan order), then passed down the block
            entering = torch.zeros_like(through)
            outer = range(nb - 1, -1, -1) if reverse else range(nb)
            for after, at in pairwise(reversed(outer)):
                total = torch.addcmul(a[after, first], through[after], entering[after])
                torch.mul(total, c[after, first], out=entering[at])
            a[:, last].add_(entering)
            for after, at in pairwise(reversed(inner)):
                entering.mul_(c[:, after])
                a[:, at].add_(entering)
        acc.addcmul_(acc, carried, value=-1)  # only positions that attain their max receive gradient
        return (None, None, *acc.unbind(0))


def running_maxes(xs: tuple[torch.Tensor, ...] | list[torch.Tensor], dim: int,
                  reverse: bool = False) -> tuple[torch.Tensor, ...]:
    """Inclusive running max of each same-shape tensor in ``xs`` along ``dim`` (suffix max if ``reverse``), as
    ``torch.cummax(x, dim).values`` (of the flipped axis when ``reverse``); one stacked scan for all of them."""
    dim = dim % xs[0].dim()
    return _BlockedRunningMax.apply(dim, reverse, *xs)


@autocast_function
class _MaxExcludingOwn(torch.autograd.Function):
    """For each position along ``dim``, the max over every other position (length >= 2) of one or more tensors.

    The row max and the max with its argmax removed: ``out[t] = second`` at the argmax, ``top`` elsewhere (ties:
    the second max equals the top). Backward: ``top`` collects the gradients of every other position, ``second``
    the argmax's own. Two reductions and a few index ops, no scan (a prefix and a suffix scan did the same).
    """

    @staticmethod
    def forward(ctx, dim, *xs):
        outs, indices = [], []
        for x in xs:
            top, top_at = x.max(dim, keepdim=True)
            second, second_at = x.scatter(dim, top_at, float("-inf")).max(dim, keepdim=True)
            outs.append(top.expand_as(x).clone(memory_format=torch.contiguous_format).scatter_(dim, top_at, second))
            indices += [top_at, second_at]
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
    return _MaxExcludingOwn.apply(dim, *xs)
