"""Which attentions to benchmark and how to build each one exactly as training would.

Training builds an attention from ``conf/attention/<name>.yaml`` whose geometry knobs interpolate the
task (``${task.causal}``, ``${task.block_size}``, ``${task.n_clusters}``). The benchmark has no task, so
it resolves the same YAML against a synthetic task geometry derived from the length L.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from longseq.attention.registry import ATTENTION_REGISTRY, PARTITION_FAMILIES, accepted_kwargs
from longseq.utils.presets import CONF_DIR, load_attention_yaml

# ``sparse`` / ``combiner`` resolve through ``partition=`` to a registered preset: benchmarking them
# would time the same module twice.
GENERIC_NAMES = frozenset(PARTITION_FAMILIES)
BUILD_KEYS = {"seq_len", "n_heads", "head_dim", "dropout"}  # supplied by the backbone, not the attention config

# Families for the quick preset (a variant's ``family`` is its attention subpackage), with the members preferred
# as representatives (the Combiner paper's Fig. 3 set first); names not listed fall back to the registry order.
FAMILY_PREFERENCE = {
    "dense": ["full"],
    "sparse": ["fixed", "axial", "bigbird", "logsparse", "local"],
    "combiner": ["combiner_fixed", "combiner_axial", "combiner_mixture", "combiner_logsparse"],
    "efficient": ["performer", "linear", "nystrom", "linformer"],
}
PER_FAMILY_QUICK = 2


def family_of(name: str) -> str:
    """The family of a registered attention (dense, sparse, combiner or efficient): its class's ``family``."""
    return ATTENTION_REGISTRY[name].cls.family  # type: ignore[attr-defined]


def registered_names() -> list[str]:
    """Every benchmarkable registered attention (the generic partition entries excluded), full first."""
    import longseq.attention  # noqa: F401  (imports every variant module so that all names register)

    names = [n for n in ATTENTION_REGISTRY if n not in GENERIC_NAMES]
    return sorted(names, key=lambda n: (n != "full", n))


def quick_names() -> list[str]:
    """Up to two representatives per family among what is registered right now."""
    by_family: dict[str, list[str]] = {}
    for name in registered_names():
        by_family.setdefault(family_of(name), []).append(name)
    picked: list[str] = []
    for family in ["dense", "sparse", "combiner", "efficient"]:
        members = by_family.get(family, [])
        preferred = [n for n in FAMILY_PREFERENCE[family] if n in members]
        ordered = preferred + [n for n in members if n not in preferred]
        picked += ordered[:PER_FAMILY_QUICK]
    return picked


def select_attentions(requested: Any) -> list[str]:
    """Resolve the ``attentions`` knob: null / ``all`` -> every registered name; ``quick`` -> the quick
    picks; else the listed names. ``full`` is always included because every ratio is relative to it."""
    if requested is None or requested == "all" or requested == ["all"]:
        names = registered_names()
    elif requested == "quick" or requested == ["quick"]:
        names = quick_names()
    else:
        names = [requested] if isinstance(requested, str) else list(requested)
    names = [n for n in dict.fromkeys(names)]
    if "full" not in names:
        names.insert(0, "full")
    return names


def parse_label(label: str) -> tuple[str, dict[str, Any]]:
    """``"combiner_axial:row_summary=none"`` -> ``("combiner_axial", {"row_summary": "none"})``.

    An ``attentions`` entry may carry knob overrides after the registry name (``name:key=value[:key=value]``;
    quote it on the command line: ``'attentions=[full,"combiner_axial:row_summary=none"]'``), so one run can
    compare settings of one variant. Values are parsed as YAML scalars (``8`` -> int, ``true`` -> bool).
    """
    name, *pairs = label.split(":")
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"bench attentions entry {label!r}: expected name:key=value[:key=value], got {pair!r}")
        overrides[key] = yaml.safe_load(value)
    return name, overrides


def synthetic_block_size(length: int) -> int:
    """A power of two near sqrt(L): 2 ** round(log2(L) / 2), rounding halves up (L=2048 -> 64)."""
    return 2 ** int(math.floor(math.log2(length) / 2 + 0.5))


@dataclass
class AttentionSpec:
    """How one attention is built at one length: resolved constructor keywords plus bookkeeping."""

    name: str  # the label in results: a registry name, optionally with knob overrides (``parse_label``)
    length: int
    causal: bool
    registry_name: str = ""
    kwargs: dict[str, Any] = field(default_factory=dict)
    block_size: int | None = None
    n_clusters: int | None = None
    note: str = ""
    skip_reason: str = ""

    def backbone_attention(self) -> dict[str, Any]:
        """The spec a ``Transformer`` takes for this attention (``name`` and knobs; the backbone passes the sizes
        in ``BUILD_KEYS`` to every layer itself)."""
        return {"name": self.registry_name, **{k: v for k, v in self.kwargs.items() if k not in BUILD_KEYS}}


def task_geometry(length: int, causal: bool, block_size: int | None = None) -> dict[str, Any]:
    """The synthetic ``task.*`` keys the attention YAMLs interpolate."""
    block = block_size or synthetic_block_size(length)
    return {"causal": causal, "seq_len": length, "block_size": block, "n_clusters": max(1, length // block)}


def build_spec(
    name: str,
    length: int,
    *,
    causal: bool,
    n_heads: int,
    head_dim: int,
    block_size: int | None = None,
    unsupported_causal: str = "fallback",
    conf_dir: Path = CONF_DIR,
) -> AttentionSpec:
    """Resolve the constructor keywords for ``name`` at length ``length``.

    A variant that cannot run in the requested direction (e.g. a bidirectional-only kernel method on a
    causal sweep) is run the other way with a note (``unsupported_causal=fallback``) or skipped
    (``skip``). Problems in the YAML are reported in ``skip_reason`` rather than raised, so one broken
    variant does not stop the sweep.
    """
    import longseq.attention  # noqa: F401

    registry_name, overrides = parse_label(name)
    spec = AttentionSpec(name=name, length=length, causal=causal, registry_name=registry_name)
    factory = ATTENTION_REGISTRY.get(registry_name)
    if factory is None:
        spec.skip_reason = f"not registered (valid: {', '.join(registered_names())})"
        return spec
    cls = factory.cls  # type: ignore[attr-defined]
    if causal and not cls.supports_causal or not causal and not cls.supports_bidirectional:
        direction = "bidirectional" if causal else "causal"
        if unsupported_causal == "skip":
            spec.skip_reason = f"supports {direction} only"
            return spec
        spec.causal = not causal
        spec.note = f"{direction} only: run with causal={str(spec.causal).lower()}"
    task = task_geometry(length, spec.causal, block_size)
    unknown = sorted(set(overrides) - set(accepted_kwargs(cls)))
    if unknown:
        spec.skip_reason = f"{name}: unknown knob(s) {unknown}; valid: {sorted(accepted_kwargs(cls))}"
        return spec
    try:
        resolved = load_attention_yaml(registry_name, {"task": task}, conf_dir)
    except FileNotFoundError:
        # No YAML yet: give the geometry knobs the variant accepts the values its YAML would interpolate.
        accepted = accepted_kwargs(cls)
        resolved = {"name": name, **{k: task[k] for k in ("block_size", "n_clusters") if k in accepted}}
        spec.note = "; ".join(filter(None, [spec.note, f"no conf/attention/{registry_name}.yaml: task geometry"]))
    except Exception as error:  # an interpolation the synthetic task cannot satisfy
        spec.skip_reason = f"conf/attention/{name}.yaml: {type(error).__name__}: {error}".splitlines()[0]
        return spec
    resolved.pop("name", None)
    resolved.update(overrides)
    resolved["causal"] = spec.causal
    spec.kwargs = {**resolved, "seq_len": length, "n_heads": n_heads, "head_dim": head_dim, "dropout": 0.0}
    if "block_size" in resolved:
        spec.block_size = resolved["block_size"]
    if "n_clusters" in resolved:
        spec.n_clusters = resolved["n_clusters"]
    return spec
