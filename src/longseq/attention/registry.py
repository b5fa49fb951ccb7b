"""One registry of attention variants; names equal the ``conf/attention/*.yaml`` file names.

A variant's ``family`` is the subpackage it lives in (``dense``, ``sparse``, ``combiner``, ``efficient``);
a variant defined outside the package inherits it from the family class it subclasses. The benchmark and the
tests read ``family`` and the capability flags, never the name.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from longseq.attention.base import Attention, AttentionConfigError

ATTENTION_REGISTRY: dict[str, Callable[..., Attention]] = {}
FAMILIES = ("dense", "sparse", "combiner", "efficient")

# Generic entries whose geometry comes from ``partition=``: ``attention=sparse partition=axial`` is
# the ``axial`` baseline and ``attention=combiner partition=axial`` is ``combiner_axial``.
PARTITION_FAMILIES: dict[str, dict[str, str]] = {
    "sparse": {"fixed": "fixed", "logsparse": "logsparse", "axial": "axial", "routing": "routing"},
    "combiner": {
        "fixed": "combiner_fixed",
        "logsparse": "combiner_logsparse",
        "axial": "combiner_axial",
        "axial_vertical": "combiner_axial_vertical",
        "axial_horizontal": "combiner_axial_horizontal",
        "mixture": "combiner_mixture",
        "routing": "combiner_routing",
    },
}


def family_of_module(module: str) -> str | None:
    """``longseq.attention.<family>.<file>`` -> ``<family>``; None outside the package's family folders."""
    parts = module.split(".")
    if parts[:2] == ["longseq", "attention"] and len(parts) > 3 and parts[2] in FAMILIES:
        return parts[2]
    return None


def register_attention(name: str) -> Callable[[type[Attention]], type[Attention]]:
    """Class decorator: register ``cls`` under ``name`` (its ``name`` attribute) in its ``family``."""

    def decorate(cls: type[Attention]) -> type[Attention]:
        if name in ATTENTION_REGISTRY:
            raise ValueError(f"attention name '{name}' registered twice")
        family = family_of_module(cls.__module__) or getattr(cls, "family", None)
        if family not in FAMILIES:
            raise ValueError(
                f"attention '{name}' ({cls.__module__}) has no family: define it under "
                f"longseq/attention/<{'|'.join(FAMILIES)}>/ or subclass a variant of one"
            )
        cls.name, cls.family = name, family

        def factory(**kwargs: Any) -> Attention:
            module = cls(**kwargs)
            module.check_backend()  # attention.backend names a path this variant has
            if module.seq_len is not None:
                module.check_length(module.seq_len)
            return module

        factory.cls = cls  # type: ignore[attr-defined]
        ATTENTION_REGISTRY[name] = factory
        return cls

    return decorate


def build_attention(name: str, **kwargs: Any) -> Attention:
    """Build the registered attention ``name`` with constructor keywords ``kwargs``.

    Raises ``AttentionConfigError`` naming the key when the name is unknown or a keyword is not
    accepted by that variant.
    """
    if name in PARTITION_FAMILIES:
        return build_from_partition(name, **kwargs)
    if name not in ATTENTION_REGISTRY:
        raise AttentionConfigError(
            f"unknown attention '{name}' (attention.name / attention=); valid: "
            f"{', '.join(sorted(ATTENTION_REGISTRY))}"
        )
    factory = ATTENTION_REGISTRY[name]
    accepted = accepted_kwargs(factory.cls)  # type: ignore[attr-defined]
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise AttentionConfigError(
            f"attention '{name}' does not accept {', '.join('attention.' + k for k in unknown)}; "
            f"valid keys: {', '.join(sorted(accepted))}"
        )
    return factory(**kwargs)


def accepted_kwargs(cls: type) -> set[str]:
    """Keyword names accepted by ``cls.__init__`` and its bases (for config validation)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self":
                names.add(p.name)
        if klass is Attention:
            break
    return names


def build_from_partition(family: str, partition: dict | None = None, **kwargs: Any) -> Attention:
    """Resolve ``attention=<family> partition=<p>`` to the registered variant and build it.

    ``partition`` is a mapping with ``name`` (the geometry) and its knobs (``block_size``...).
    """
    if not partition or "name" not in partition:
        raise AttentionConfigError(f"attention={family} needs partition=<name>; valid: {sorted(PARTITION_FAMILIES[family])}")
    partition = dict(partition)
    geometry = partition.pop("name")
    targets = PARTITION_FAMILIES[family]
    available = sorted(p for p, t in targets.items() if t in ATTENTION_REGISTRY)
    if geometry not in targets or targets[geometry] not in ATTENTION_REGISTRY:
        raise AttentionConfigError(f"partition={geometry} has no {family} variant; valid partitions: {available}")
    return build_attention(targets[geometry], **partition, **kwargs)
