"""Train a model: ``python train.py task=<task> attention=<attention> [key=value ...]``.

Composes ``conf/train.yaml``, trains, tests the best checkpoint, and returns ``optimized_metric`` so
Hydra sweepers (``-m``, Optuna) can optimize it. All logic lives in ``longseq.runner``.
"""

import os
from pathlib import Path

os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parent))

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from longseq.runner import metric_value, set_float32_precision, train  # noqa: E402
from longseq.utils.config import extras, register_resolvers  # noqa: E402

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    output_dir = Path(hydra_cfg.runtime.output_dir)
    extras(cfg, output_dir, multirun=hydra_cfg.mode == RunMode.MULTIRUN)
    set_float32_precision()
    metrics = train(cfg)
    summary = {k: v for k, v in metrics.items() if k.startswith(("test/", "val/"))}
    print(f"results: {summary}")
    if "ckpt_path" in metrics:
        print(f"best checkpoint: {metrics['ckpt_path']}")
    print(f"last checkpoint: {output_dir / 'checkpoints' / 'last.ckpt'}")
    return metric_value(metrics, cfg.get("optimized_metric"))


if __name__ == "__main__":
    main()
