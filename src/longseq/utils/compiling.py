"""``torch.compile`` as this project uses it, in one place: the modes a user may choose (``model.compile_mode``, the
GPU check's ``compile`` lists), compiling a module whole, and the step marker CUDA graphs need."""

from __future__ import annotations

import torch

# torch.compile's modes; reduce-overhead records the compiled graphs as CUDA graphs (one launch per graph)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_options(mode: str | None) -> dict:
    """``torch.compile``'s keyword arguments for one of ``COMPILE_MODES``. Static shapes: a run trains at one length,
    and on an H200 (torch 2.11) a backbone compiled at a second length in one process, shapes made dynamic by dynamo,
    ran with garbage sizes ("shape '[139939566755458, 9120285929716304060, 1536]' is invalid")."""
    return {"dynamic": False, **({} if mode in (None, "default") else {"mode": mode})}


def compile_module(module: torch.nn.Module, mode: str | None) -> torch.nn.Module:
    """``module`` as is (``mode`` None or ``none``) or through ``torch.compile`` with ``mode`` (one of
    ``COMPILE_MODES``): a new wrapper module, the parameters shared."""
    if mode in (None, "none"):
        return module
    return torch.compile(module, **compile_options(mode))


def new_step(mode: str | None) -> None:
    """Before each iteration of a module compiled with CUDA graphs (``reduce-overhead``): tells the graph trees that
    the previous iteration's outputs are no longer used, so replays may overwrite them."""
    if mode == "reduce-overhead":
        torch.compiler.cudagraph_mark_step_begin()
