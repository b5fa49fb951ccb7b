"""Hybrid layer plans (``model.layer_attention``): which attention each layer of the backbone uses.

A plan is one of

- ``null`` (the default): every layer uses the run's ``attention=`` choice;
- a list with one entry per layer (``model.layer_attention=[combiner_fixed,full]``); an entry is a registered
  attention name, ``null`` (the run's ``attention=``), or a mapping ``{name: local, window: 300}`` (a name with
  its own knobs);
- a repeating pattern ``{every: k, attention: <entry>}`` (``model.layer_attention={every:2,attention:full}``):
  the last layer of every group of ``k`` uses ``<entry>`` and the others the run's ``attention=`` (layers
  ``k - 1, 2k - 1, ...``, counted from 0: with 2 layers and ``k = 2`` the top layer), the MoBA and NSA papers'
  hybrids.

A layer that names the run's own attention gets the ``attention`` spec itself, with every ``attention.*``
override of the command line. Any other name gets its preset (``conf/attention/<name>.yaml`` resolved against the
run's task: ``model.attention_presets``, filled by the ``attention_presets`` resolver) plus the keys every attention
shares (``SHARED_KEYS``: the task's direction and the backend, set once at the root of ``conf/train.yaml``), then the
entry's own knobs. Every mistake raises a ``ConfigError`` naming ``model.layer_attention`` at construction.
"""

from __future__ import annotations

import contextlib
import difflib
from typing import Any, Iterator, Mapping

from longseq.utils.errors import ConfigError
from longseq.utils.presets import has_preset, load_attention_yaml

PLAN_KEY = "model.layer_attention"
SHARED_KEYS = ("causal", "backend")  # conf/train.yaml sets these for whichever attention a layer uses
PATTERN_KEYS = {"every", "attention"}
SHAPES = (f"a list with one entry per layer ({PLAN_KEY}=[combiner_fixed,full]) or a pattern "
          f"({PLAN_KEY}={{every:2,attention:full}})")


def valid_names() -> list[str]:
    """Every name a plan entry may use: the registry plus the generic ``sparse`` / ``combiner``."""
    from longseq.attention.registry import ATTENTION_REGISTRY, PARTITION_FAMILIES

    return sorted({*ATTENTION_REGISTRY, *PARTITION_FAMILIES})


def entry_name(entry: Any, layer: int | None = None) -> str | None:
    """The attention name of one plan entry (None for ``null``: the run's ``attention=``)."""
    where = "" if layer is None else f"layer {layer}: "
    if entry is None:
        return None
    if isinstance(entry, str):
        return entry
    if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
        return entry["name"]
    raise ConfigError(PLAN_KEY, f"{where}an entry is an attention name, null (the run's attention=) or "
                                f"{{name: <attention>, <knob>: <value>}}, got {entry!r}")


def plan_entries(plan: Any, n_layers: int) -> list[Any] | None:
    """The plan as one entry per layer (None for no plan), its shape checked against ``n_layers``."""
    if plan is None:
        return None
    if isinstance(plan, Mapping):
        if set(plan) != PATTERN_KEYS:
            raise ConfigError(PLAN_KEY, f"a pattern has exactly the keys every and attention, got "
                                        f"{sorted(map(str, plan))}; a plan is {SHAPES}")
        every = plan["every"]
        if isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= n_layers:
            raise ConfigError(PLAN_KEY, f"every must be an integer in [1, model.n_layers={n_layers}], got {every!r}")
        return [plan["attention"] if (layer + 1) % every == 0 else None for layer in range(n_layers)]
    if isinstance(plan, (list, tuple)):
        if len(plan) != n_layers:
            raise ConfigError(PLAN_KEY, f"has {len(plan)} entries for model.n_layers={n_layers}: give one per layer, "
                                        f"or a pattern ({PLAN_KEY}={{every:k,attention:full}})")
        return list(plan)
    raise ConfigError(PLAN_KEY, f"must be null (attention= in every layer), {SHAPES}; got {plan!r}")


def plan_names(plan: Any) -> list[str]:
    """The attention names a plan mentions (what ``attention_presets`` resolves), in order, without repeats;
    entries it cannot read are left to ``layer_specs`` to reject."""
    entries = [plan.get("attention")] if isinstance(plan, Mapping) else list(plan) if isinstance(plan, (list, tuple)) \
        else []
    names = []
    for entry in entries:
        with contextlib.suppress(ConfigError):
            name = entry_name(entry)
            if name is not None and name not in names:
                names.append(name)
    return names


def check_direction(name: str, causal: bool, layer: int) -> None:
    """``name`` can run in the task's direction (``fnet`` cannot be causal), else a ``ConfigError``."""
    from longseq.attention.registry import ATTENTION_REGISTRY

    factory = ATTENTION_REGISTRY.get(name)
    if factory is None:  # a generic sparse / combiner entry: its partition decides, at build time
        return
    capable = "supports_causal" if causal else "supports_bidirectional"
    if not getattr(factory.cls, capable):
        direction = "causal" if causal else "bidirectional"
        options = [n for n, f in ATTENTION_REGISTRY.items() if getattr(f.cls, capable)]
        raise ConfigError(PLAN_KEY, f"layer {layer}: '{name}' cannot be {direction} (this task's attention.causal="
                                    f"{str(causal).lower()}); {direction} attentions: {', '.join(sorted(options))}")


def layer_specs(attention: Mapping[str, Any], plan: Any, n_layers: int,
                presets: Mapping[str, Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The attention spec (``{"name": ..., **knobs}``) of each of the ``n_layers`` layers.

    ``attention`` is the run's spec (``conf/attention`` merged with the root keys); ``plan`` the value of
    ``model.layer_attention`` (module docstring); ``presets`` maps a name to its resolved preset (a name without
    one gets ``{"name": name}``: the variant's own defaults)."""
    entries = plan_entries(plan, n_layers)
    if entries is None:
        return [dict(attention) for _ in range(n_layers)]
    names = valid_names()
    shared = {key: attention[key] for key in SHARED_KEYS if key in attention}
    specs = []
    for layer, entry in enumerate(entries):
        name = entry_name(entry, layer)
        if name is not None and name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(PLAN_KEY, f"layer {layer}: unknown attention '{name}'{hint}; valid: {', '.join(names)}")
        if name is None or name == attention.get("name"):
            spec = dict(attention)
        else:
            spec = {**dict((presets or {}).get(name) or {"name": name}), **shared}
        knobs = {k: v for k, v in entry.items() if k != "name"} if isinstance(entry, Mapping) else {}
        for key in SHARED_KEYS:
            if key in knobs and key in shared and knobs[key] != shared[key]:
                raise ConfigError(PLAN_KEY, f"layer {layer}: {key}={knobs[key]!r} differs from attention.{key}="
                                            f"{shared[key]!r}; every layer shares the run's {key}")
        spec.update(knobs)
        check_direction(spec["name"], bool(spec.get("causal", False)), layer)
        specs.append(spec)
    return specs


@contextlib.contextmanager
def layer_errors(layer: int, spec: Mapping[str, Any], planned: bool) -> Iterator[None]:
    """Building layer ``layer``: a configuration error of a planned layer names ``model.layer_attention`` (its
    message would otherwise name ``attention.<knob>``, a key of the run's ``attention=`` choice)."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as error:  # AttentionConfigError and the variants' own checks
        if not planned:
            raise
        raise ConfigError(PLAN_KEY, f"layer {layer} ({spec.get('name')}): {error}") from error


def attention_presets(plan: Any, *, _root_: Any) -> dict[str, dict[str, Any]]:
    """The ``attention_presets`` resolver (``model.attention_presets``): each name the plan mentions -> its
    ``conf/attention`` preset resolved against this run's ``task`` and ``partition``. Names without a preset file
    are left out (``layer_specs`` then names the mistake)."""
    from omegaconf import OmegaConf

    plan = OmegaConf.to_container(plan, resolve=True) if OmegaConf.is_config(plan) else plan
    context = {"task": _root_.get("task"), "partition": _root_.get("partition")}
    return {name: load_attention_yaml(name, context) for name in plan_names(plan)
            if has_preset(name)}
