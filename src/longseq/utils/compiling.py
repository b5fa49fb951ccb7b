"""``torch.compile`` as this project uses it, in one place: the modes a user may choose (``model.compile_mode``, the
GPU check's ``compile`` lists), compiling a module whole, and the step marker CUDA graphs need."""

from __future__ import annotations

import torch

# torch.compile's modes; reduce-overhead records the compiled graphs as CUDA graphs (one launch per graph)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_module(module: torch.nn.Module, mode: str | None) -> torch.nn.Module:
    """``module`` as is (``mode`` None or ``none``) or through ``torch.compile`` with ``mode`` (one of
    ``COMPILE_MODES``): a new wrapper module, the parameters shared."""
    if mode in (None, "none"):
        return module
    return torch.compile(module, mode=None if mode == "default" else mode)


def new_step(mode: str | None) -> None:
    """Before each iteration of a module compiled with CUDA graphs (``reduce-overhead``): tells the graph trees that
    the previous iteration's outputs are no longer used, so replays may overwrite them."""
    if mode == "reduce-overhead":
        torch.compiler.cudagraph_mark_step_begin()
