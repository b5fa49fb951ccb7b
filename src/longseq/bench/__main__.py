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


def prepare_check(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """A device check's config (``make gpu-check``, ``make xla-check``): ``dry=true`` selects ``presets.dry``, then the
    preset applies (keys set on the command line win)."""
    if cfg.dry and cfg.preset is None:
        cfg.preset = "dry"
    apply_preset(cfg, overrides)
    return cfg


def run_check(config_name: str, run) -> None:
    """The entry point of a device check: ``conf/<config_name>.yaml`` through Hydra, prepared (``prepare_check``), then
    ``run(cfg) -> (out_dir, ok)``; exit status 1 when a check failed."""

    @hydra.main(config_path=CONFIG_DIR, config_name=config_name, version_base="1.3")
    def _main(cfg: DictConfig) -> None:
        _, ok = run(prepare_check(cfg, list(HydraConfig.get().overrides.task)))
        if not ok:
            raise SystemExit(1)

    _main()


@hydra.main(config_path=CONFIG_DIR, config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from longseq.bench.run import run_benchmark

    apply_preset(cfg, list(HydraConfig.get().overrides.task))
    run_benchmark(cfg)


if __name__ == "__main__":
    main()
