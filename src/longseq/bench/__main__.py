"""Entry point: ``python -m longseq.bench [preset=quick] [key=value ...]`` (Hydra, conf/bench.yaml)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

# The package is installed editable from the repository, so the config tree sits next to src/.
CONFIG_DIR = str(Path(__file__).resolve().parents[3] / "conf")


def overridden_keys(overrides: list[str]) -> set[str]:
    """Dotted keys set on the command line (``lengths=[64]``, ``+x=1``, ``~y`` -> lengths, x, y)."""
    return {item.split("=", 1)[0].lstrip("+~") for item in overrides}


def apply_preset(cfg: DictConfig, overrides: list[str]) -> None:
    """Overlay ``presets.<preset>`` on ``cfg``, except for keys the command line set explicitly, so that
    ``preset=quick lengths=[64,128]`` keeps the quick settings but the given lengths."""
    if cfg.preset is None:
        return
    if cfg.preset not in cfg.presets:
        raise SystemExit(f"preset: '{cfg.preset}' unknown; valid: {list(cfg.presets)}")
    explicit = overridden_keys(overrides)
    flat: dict[str, Any] = {}

    def flatten(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                flatten(f"{prefix}.{key}" if prefix else key, value)
        else:
            flat[prefix] = node

    flatten("", OmegaConf.to_container(cfg.presets[cfg.preset]))
    for key, value in flat.items():
        clashes = any(key == e or key.startswith(e + ".") or e.startswith(key + ".") for e in explicit)
        if not clashes:
            OmegaConf.update(cfg, key, value, merge=False)


@hydra.main(config_path=CONFIG_DIR, config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from longseq.bench.run import run_benchmark

    apply_preset(cfg, list(HydraConfig.get().overrides.task))
    run_benchmark(cfg)


if __name__ == "__main__":
    main()
