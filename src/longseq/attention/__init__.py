"""Attention variants behind one registry: ``build_attention(name, **kw)``.

Importing this package imports every variant module so that all names are registered.
"""

import importlib
import pkgutil

from longseq.attention.base import Attention, AttentionConfigError
from longseq.attention.registry import ATTENTION_REGISTRY, build_attention, register_attention

for _info in pkgutil.iter_modules(__path__):
    if _info.name not in {"base", "registry"}:
        importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["ATTENTION_REGISTRY", "Attention", "AttentionConfigError", "build_attention", "register_attention"]
