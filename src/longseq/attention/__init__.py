"""Attention variants behind one registry: ``build_attention(name, **kw)``.

Layers (the folder tree is the architecture; lower layers never import higher ones):

- ``base``, ``registry``: the contract every variant implements, and the one registry;
- ``ops/``: shared kernels and rules, no registered classes (mask convention, key padding, geometry and
  ``BlockGrid``, the one owner of ``block_size``, the one ``Partition``, joint softmax and the flash merge,
  log levels, prefix sums, clustering, mixed precision, incremental decoding);
- ``dense/``, ``sparse/``, ``combiner/``, ``efficient/``: one family each, one file per variant (or per
  variant family sharing one class); a variant's ``family`` is its folder.

Importing this package imports every module below it, so that all names are registered.
"""

import importlib
import pkgutil

from longseq.attention.base import Attention, AttentionConfigError, DecodingNotSupported
from longseq.attention.registry import ATTENTION_REGISTRY, build_attention, register_attention

for _info in pkgutil.walk_packages(__path__, prefix=f"{__name__}."):
    importlib.import_module(_info.name)

__all__ = [
    "ATTENTION_REGISTRY", "Attention", "AttentionConfigError", "DecodingNotSupported", "build_attention",
    "register_attention",
]
