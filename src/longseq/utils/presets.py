"""The attention presets of ``conf/attention/<name>.yaml``, resolved outside a composed training config.

Training builds the ``attention=`` choice through Hydra; the benchmark (no task) and the layers of a hybrid plan
(``model.layer_attention``: names other than ``attention=``) resolve the same files here, against a task geometry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"


def has_preset(name: str, conf_dir: Path = CONF_DIR) -> bool:
    """Whether ``conf/attention/<name>.yaml`` exists."""
    return (conf_dir / "attention" / f"{name}.yaml").is_file()


def load_attention_yaml(name: str, context: Mapping[str, Any], conf_dir: Path = CONF_DIR) -> dict[str, Any]:
    """Resolve ``conf/attention/<name>.yaml`` against ``context`` (``{"task": <the task keys it interpolates>}``,
    and ``partition`` where one is chosen) -> plain dict (``name`` and its knobs).

    Defaults-list entries such as ``- /partition: axial`` are honoured by loading that group's file at its package,
    the way Hydra composes the training config."""
    from omegaconf import OmegaConf

    attention = OmegaConf.load(conf_dir / "attention" / f"{name}.yaml")
    root = OmegaConf.create({k: v for k, v in context.items() if v is not None})
    for entry in attention.pop("defaults", []) or []:
        if not OmegaConf.is_dict(entry):
            continue  # ``_self_``
        for key, option in entry.items():
            group, _, package = str(key).lstrip("/").partition("@")
            if option is None or group.startswith("override"):
                continue
            root[package or group.replace("/", ".")] = OmegaConf.load(conf_dir / group / f"{option}.yaml")
    root.attention = attention
    return OmegaConf.to_container(root.attention, resolve=True)  # type: ignore[return-value]
