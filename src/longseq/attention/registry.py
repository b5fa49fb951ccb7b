"""One registry of attention variants; names equal the ``conf/attention/*.yaml`` file names."""

from __future__ import annotations

import inspect
from typing import Any, Callable

from longseq.attention.base import Attention, AttentionConfigError

ATTENTION_REGISTRY: dict[str, Callable[..., Attention]] = {}

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


def register_attention(name: str, **preset: Any) -> Callable[[type[Attention]], type[Attention]]:
    """Class decorator: register ``cls`` under ``name`` with optional preset keyword defaults.

    The same class may be registered under several names with different presets (e.g. the
    Combiner axial family), which is how ``combiner_axial_vertical`` differs from ``combiner_axial``.
    """

    def decorate(cls: type[Attention]) -> type[Attention]:
        if name in ATTENTION_REGISTRY:
            raise ValueError(f"attention name '{name}' registered twice")

        def factory(**kwargs: Any) -> Attention:
            module = cls.__new__(cls)
            module.name = name
            module.__init__(**{**preset, **kwargs})
            return module

        factory.cls = cls  # type: ignore[attr-defined]
        factory.preset = preset  # type: ignore[attr-defined]
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
