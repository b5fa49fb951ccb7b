"""What differs between the torch releases this project supports, in one place.

pyproject.toml states the range (``SUPPORTED_TORCH``): the oldest is the torch that the newest torch_xla on PyPI
requires (2.9.0, ``make xla-check``'s environment), the newest the pinned release that ``make install`` and CI
install (2.14.1); the GPU image's 2.11 lies between. Code that needs an API whose name or behaviour changed inside
the range imports it from here, so the next torch upgrade edits one module. Each entry says which releases behave
how, as measured (the fast suite runs on the pinned torch; ``make xla-check`` imports the package, builds every
attention and trains on 2.9.0).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch

SUPPORTED_TORCH = ("2.9", "2.15")  # lowest supported release, first release not supported (pyproject.toml)


def torch_release(version: str = torch.__version__) -> tuple[int, int]:
    """``"2.9.0+cu128"`` -> ``(2, 9)``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def supported(version: str = torch.__version__) -> bool:
    """Whether ``version`` lies in ``SUPPORTED_TORCH``."""
    low, high = (torch_release(bound + ".0") for bound in SUPPORTED_TORCH)
    return low <= torch_release(version) < high


# -- a function dynamo runs while it traces, with an object argument ---------------------------------------------
# ``torch.compiler.assume_constant_result`` makes dynamo call a function at trace time instead of tracing it. torch
# 2.14 passes it an object argument (guarded by identity); torch 2.9's dynamo converts every argument to a Python
# constant and raised ``AsPythonConstantNotImplementedError`` on a module. Both turn ``id(module)`` into a constant
# (2.9 with an identity guard), so the object travels as its id and is found again in a table of weak references.
_BY_ID: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def remember(obj: Any) -> None:
    """Make ``obj`` reachable by ``traced_with_object`` functions (call it when the object is made or unpickled)."""
    _BY_ID[id(obj)] = obj


def traced_with_object(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(obj, *constants)`` run as is in eager mode and once per compiled graph while dynamo traces (no guard on
    what it reads or writes on ``obj``), on every supported torch; ``obj`` must have been ``remember``ed."""

    @torch.compiler.assume_constant_result
    def by_id(key: int, *args: Any) -> Any:
        return fn(_BY_ID[key], *args)

    @functools.wraps(fn)
    def call(obj: Any, *args: Any) -> Any:
        return by_id(id(obj), *args)

    return call
